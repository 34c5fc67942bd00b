"""Notebook 01's experiment: one op stack run in each execution mode, and what shapes do."""

from __future__ import annotations

import torch

from .backend import Backend
from .timing import time_fn


def op_stack(x: torch.Tensor, depth: int = 10) -> torch.Tensor:
    """A stack of small elementwise ops: each is one dispatch (one device program) in eager
    mode, and all of them together are one fused program when deferred or compiled."""
    for _ in range(depth):
        x = torch.tanh(x * 1.1 + 0.1)
    return x


def _input(backend: Backend, size: int) -> torch.Tensor:
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(backend.device)
    backend.flush()  # a lazy backend would otherwise fold the upload into the first timed call
    backend.sync()
    return x


def compare_modes(backend: Backend, size: int = 256, warmup: int = 3, repeats: int = 20) -> list[dict]:
    """Time ``op_stack`` in every mode the backend has, side by side in one run.

    Returns one row per mode: median/min/max ms per call, speed-up over eager, and the
    device programs launched per call (None where the backend cannot count that mode's).
    """
    x = _input(backend, size)
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
    """Call ``op_stack`` on inputs of the given sizes in order, counting what each call compiles.

    A size seen before reuses its program (0 new compilations); a new size compiles anew.
    """
    torch._dynamo.reset()  # start from an empty compile cache, so the counts start at zero
    fn = backend.in_mode(op_stack, mode)
    rows, total = [], 0
    for size in sizes:
        x = _input(backend, size)
        with backend.compile_counter() as count:
            out = fn(x)
        del out
        new = count.graphs if mode == "compile" else count.programs
        total += new
        rows.append({"input": f"{size}x{size}", "new_compilations": new, "total": total})
    return rows
