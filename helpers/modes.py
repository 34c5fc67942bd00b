"""Notebook 01's experiment: one op stack run and timed in each execution mode, and what shapes do."""

from __future__ import annotations

import torch

from .backend import Backend
from .timing import time_fn


def op_stack(x: torch.Tensor, depth: int = 10) -> torch.Tensor:
    """Small elementwise ops: one device program each in eager mode, one fused program deferred or compiled."""
    for _ in range(depth):
        x = torch.tanh(x * 1.1 + 0.1)
    return x


def op_input(backend: Backend, size: int) -> torch.Tensor:
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(backend.device)
    backend.flush()  # a lazy backend would otherwise fold the upload into the first timed call
    backend.sync()
    return x


def compare_modes(backend: Backend, size: int = 256, warmup: int = 3, repeats: int = 20) -> list[dict]:
    """Time ``op_stack`` in every mode the backend has: a row per mode with median/min/max ms, speed-up
    over eager, and device programs per call (None where the backend cannot count that mode's)."""
    x = op_input(backend, size)
    rows = []
    for mode in backend.modes:
        fn = backend.in_mode(op_stack, mode)
        timing = time_fn(fn, x, sync=backend.sync, warmup=warmup, repeats=repeats, desc=mode)
        with backend.compile_counter() as count:
            out = fn(x)
        del out
        executions = count.executions if backend.counts_executions(mode) else None
        rows.append(
            {
                "mode": mode,
                "median_ms": timing.median * 1e3,
                "min_ms": timing.min * 1e3,
                "max_ms": timing.max * 1e3,
                "executions_per_call": executions,
            }
        )
    eager_ms = rows[0]["median_ms"]
    for row in rows:
        row["speedup_vs_eager"] = eager_ms / row["median_ms"]
    return rows


def shape_demo(backend: Backend, mode: str = "compile", sizes=(64, 64, 128, 128, 96)) -> list[dict]:
    """``op_stack`` on each size in turn, counting what each call compiles: a size seen before compiles nothing."""
    torch.compiler.reset()  # an empty compile cache: counts start at zero
    fn = backend.in_mode(op_stack, mode)
    rows, total = [], 0
    for size in sizes:
        x = op_input(backend, size)
        with backend.compile_counter() as count:
            out = fn(x)
        del out
        new = count.graphs if mode == "compile" else count.programs
        total += new
        rows.append({"input": f"{size}x{size}", "new_compilations": new, "total": total})
    return rows
