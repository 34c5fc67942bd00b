"""Every step against the memory roofline. A decode step reads every weight it uses and the KV
cache once per token, so tok/s is bounded by bandwidth / bytes read per token. Here: the bytes
one step reads, from the tensors as they are stored on the device; the bandwidth this device
reads at, from a read probe (on a TPU, Google's published figure, labelled as such); and the
columns that follow, GB/s achieved and % of that bandwidth."""

from __future__ import annotations

import functools

import torch

from .backend import Backend, get_backend
from .decode import cache_read_bytes
from .timing import time_fn

READS = 9  # timed reads of the probe: the best is the bandwidth, the slowest over it the spread


@functools.cache
def _probe(name: str, device: str, megabytes: int) -> tuple[float, float]:
    backend = get_backend(name)
    data = torch.randn(megabytes * 2**20 // 4, device=backend.device)
    timing = time_fn(torch.amax, data, sync=lambda: (backend.flush(), backend.sync()), warmup=2, repeats=READS)
    return data.numel() * data.element_size() / timing.min, timing.max / timing.min


def read_bandwidth(backend: Backend, megabytes: int = 256) -> tuple[float, str]:
    """Bytes per second this device reads at, and where the figure comes from: the max of
    ``megabytes`` of float32 (it reads every byte once and does next to nothing else), the
    best of ``READS`` reads, measured once per process, with their spread in the description
    (a busy machine shows there); on a TPU, the published v5e figure. Not a matrix-vector
    product: on a CPU the compiled step's own loops read faster than MKL's
    (``benchmarks/matvec.py``)."""
    if backend.published_bandwidth:
        return backend.published_bandwidth
    best, spread = _probe(backend.name, str(backend.device), megabytes)
    return best, f"measured here: the max of {megabytes} MB, best of {READS} reads, slowest {spread:.2f}x slower"


def _tensors(module) -> dict[int, torch.Tensor]:
    named = [*module.parameters(recurse=True), *module.buffers(recurse=True)]
    return {id(t): t for t in named}  # identity, as parameters() dedups tied weights


def _row_bytes(table) -> int:
    """Bytes of one row of a gathered table, bf16 (an Embedding) or 4-bit (a QTable)."""
    return sum(t[0].numel() * t.element_size() for t in _tensors(table).values() if t.dim() == 2)


def step_bytes(model, cache=None) -> int:
    """Bytes one decode step reads, from the tensors as stored on the device: every parameter
    and buffer once (tied ones once; the main table whole, as the tied head multiplies by it),
    except the per-layer table, which is only gathered from: one row of it; plus the K and V
    each attention layer reads (``decode.cache_read_bytes``: a buffer shared by several layers
    is read by each)."""
    table = model.model.embed_tokens_per_layer
    every = _tensors(model)
    for key in _tensors(table):
        every.pop(key, None)
    weights = sum(t.numel() * t.element_size() for t in every.values())
    return weights + _row_bytes(table) + (cache_read_bytes(model, cache) if cache is not None else 0)


def columns(bytes_per_token: int, tok_s: float, bandwidth: float) -> dict:
    """The roofline columns of a results row."""
    return {
        "bytes_per_token": bytes_per_token,
        "GB_per_s": bytes_per_token * tok_s / 1e9,
        "pct_of_bw": 100 * bytes_per_token * tok_s / bandwidth,
        "ceiling_tok_s": bandwidth / bytes_per_token,
    }
