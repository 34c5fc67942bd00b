"""Notebook 01's experiment: one op stack run in each execution mode, and what shapes do."""

from __future__ import annotations

import torch

from .backend import Backend


def op_stack(x: torch.Tensor, depth: int = 10) -> torch.Tensor:
    """A stack of small elementwise ops: each is one dispatch (one device program) in eager
    mode, and all of them together are one fused program when deferred or compiled."""
    for _ in range(depth):
        x = torch.tanh(x * 1.1 + 0.1)
    return x


def op_input(backend: Backend, size: int) -> torch.Tensor:
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(backend.device)
    backend.flush()  # a lazy backend would otherwise fold the upload into the first timed call
    backend.sync()
    return x


def shape_demo(backend: Backend, mode: str = "compile", sizes=(64, 64, 128, 128, 96)) -> list[dict]:
    """Call ``op_stack`` on inputs of the given sizes in order, counting what each call compiles.

    A size seen before reuses its program (0 new compilations); a new size compiles anew.
    """
    torch._dynamo.reset()  # start from an empty compile cache, so the counts start at zero
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
