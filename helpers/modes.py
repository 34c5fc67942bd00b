"""Notebook 01's experiment: one op stack run in each execution mode, and what shapes do."""

from __future__ import annotations

import torch

from .backend import Backend


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


def shape_demo(backend: Backend, mode: str = "compile", sizes=(64, 64, 128, 128, 96)) -> list[dict]:
    """``op_stack`` on each size in turn, counting what each call compiles: a size seen before compiles nothing."""
    torch._dynamo.reset()  # an empty compile cache: counts start at zero
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
