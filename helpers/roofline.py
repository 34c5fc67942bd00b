"""Every step against the memory roofline. A decode step reads every weight it uses and the KV
cache once per token, so tok/s is bounded by bandwidth / bytes read per token. Here: the bytes
one step reads, from the tensors as they are stored on the device; the bandwidth this device
reads at, from a read probe (on a TPU, Google's published figure, labelled as such); and the
columns that follow, GB/s achieved and % of that bandwidth."""

from __future__ import annotations

import functools

import torch

from .backend import Backend
from .bench import time_fn

V5E_BYTES_PER_S = 819e9  # Google's published HBM bandwidth of one TPU v5e chip


@functools.cache
def _probe(name: str, device: str, megabytes: int) -> float:
    from .backend import get_backend

    backend = get_backend(name)
    data = torch.randn(megabytes * 2**20 // 4, device=backend.device)
    timing = time_fn(torch.amax, data, sync=lambda: (backend.flush(), backend.sync()), warmup=2, repeats=7)
    return data.numel() * data.element_size() / timing.median


def read_bandwidth(backend: Backend, megabytes: int = 256) -> tuple[float, str]:
    """Bytes per second this device reads at, and where the figure comes from: the max of
    ``megabytes`` of float32 (it reads every byte once and does next to nothing else), measured
    once per process; on a TPU, the published v5e figure. Not a matrix-vector product: on a CPU
    the compiled step's own loops read faster than MKL's (``benchmarks/matvec.py``)."""
    if backend.name == "tpu":
        return V5E_BYTES_PER_S, "published: TPU v5e, 819 GB/s"
    return _probe(backend.name, str(backend.device), megabytes), "measured here: the max of a large tensor"


def _tensors(module) -> dict[int, torch.Tensor]:
    named = [*module.parameters(recurse=True), *module.buffers(recurse=True)]
    return {id(t): t for t in named}  # identity, as parameters() dedups tied weights


def _row_bytes(table) -> int:
    """Bytes of one row of a gathered table, bf16 (an Embedding) or 4-bit (a QTable)."""
    return sum(t[0].numel() * t.element_size() for t in _tensors(table).values() if t.dim() == 2)


def cache_read_bytes(cache) -> int:
    """K and V bytes the attention reads per step: every allocated slot of a static or ring
    cache (the mask drops unused ones after the read); what a dynamic cache holds now."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def step_bytes(model, cache=None) -> int:
    """Bytes one decode step reads, from the tensors as stored on the device: every parameter
    and buffer once (tied ones once; the main table whole, as the tied head multiplies by it),
    except the per-layer table, which is only gathered from: one row of it; plus the cache."""
    table = model.model.embed_tokens_per_layer
    every = _tensors(model)
    for key in _tensors(table):
        every.pop(key, None)
    weights = sum(t.numel() * t.element_size() for t in every.values())
    return weights + _row_bytes(table) + (cache_read_bytes(cache) if cache is not None else 0)


def columns(bytes_per_token: int, tok_s: float, bandwidth: float) -> dict:
    """The roofline columns of a results row."""
    return {
        "bytes_per_token": bytes_per_token,
        "GB_per_s": bytes_per_token * tok_s / 1e9,
        "pct_of_bw": 100 * bytes_per_token * tok_s / bandwidth,
        "ceiling_tok_s": bandwidth / bytes_per_token,
    }


STEP = "07 past the source"
KS = ((1, 2, 4), (1, 2))  # the K measured: each K is a compile, a minute or more for large K on a CPU
JAX_TOK_S = 135  # a pure-JAX engine on the same chip and model, bf16 QAT weights (its own figure)


def measure_variants(backend: Backend, series, ks=(1, 2, 4, 8), max_len: int = 256) -> list[dict]:
    """Notebook 07's variants on notebook 05's model (``series``, changed in place), each
    compiled anew and timed: K tokens per compiled call for each of ``ks``; on a CPU, K = 1 with
    the one-row matmuls as loops inductor writes (``Backend.matvec_loop_options``), kept for
    the variants after it; then, at K = 1 (each is beside a K = 1 row: unrolled K times, a step
    that dequantizes every weight compiles for minutes on a CPU), the linears as int8 codes, as
    packed int4, the main table and tied head in 4-bit too, and then q/k/v and gate/up fused into
    one matmul each. A row each: same tokens as notebook 03, graphs compiled, seconds of the first
    call (its compilation), peak device memory where the backend counts it, decode tok/s
    (median of 3) and spread, weights on the device, and the roofline columns."""
    from .checkpoint import memory_report
    from .decode import Decoder, timed_generate
    from .fused import fuse_projections
    from .qlinear import keep_linears_compressed
    from .qtable import keep_embed_in_4bit

    bandwidth, _ = read_bandwidth(backend)
    model, rows = series.model, []
    loops = backend.matvec_loop_options()

    def run(variant: str, k: int, options=None) -> dict:
        torch._dynamo.reset()  # count this variant's compilations only
        backend.reset_peak_memory()
        decoder = Decoder(model, backend, max_len, tokens_per_call=k, **(options or {}))
        with backend.compile_counter() as count:
            first = time_fn(decoder.generate, series.ids, series.new_tokens, sync=backend.sync, warmup=0, repeats=1)
        timed = timed_generate(decoder, series.ids, series.new_tokens, readback_every=max(16, k))
        memory = backend.memory()
        row = {
            "variant": variant,
            "K": k,
            "same_tokens": first.last == series.reference,
            "compiles": count.graphs,
            "first_call_s": first.median,
            "peak_bytes": memory and memory["peak"],
            "decode_tok_s": timed["decode_tok_s"],
            "tok_s_spread": max(timed["rates"]) / min(timed["rates"]),
            "weights_bytes": sum(r["bytes"] for r in memory_report(model)),
            **columns(step_bytes(model, decoder.cache), timed["decode_tok_s"], bandwidth),
        }
        rows.append(row)
        return row

    for k in ks:
        run(f"4-bit table, K={k}", k)
    tail = "K=1" if loops is None else "K=1, matvec loops"
    if loops is not None:
        run(f"4-bit table, {tail}", 1, loops)
    keep_linears_compressed(model, series.checkpoint, "int8")
    run(f"int8 linears, {tail}", 1, loops)
    keep_linears_compressed(model, series.checkpoint, "int4")
    run(f"int4 linears, {tail}", 1, loops)
    keep_embed_in_4bit(model)
    run(f"int4 linears + 4-bit head, {tail}", 1, loops)
    fuse_projections(model)
    run(f"int4 linears + 4-bit head + fused q/k/v, gate/up, {tail}", 1, loops)
    return rows


def record(results, backend: Backend, rows: list[dict]) -> list[dict]:
    """Each variant's row of the results table, the same from notebook 07 and the tour."""
    keys = ("decode_tok_s", "tok_s_spread", "same_tokens", "compiles", "bytes_per_token", "GB_per_s", "pct_of_bw")
    return [results.add(STEP, r["variant"], backend=backend.name, **{k: r[k] for k in keys}) for r in rows]


def run_step(backend: Backend, results) -> list[dict]:
    """The tour's step 07: notebook 07's variants, a results row each."""
    from .series import prepare

    series = prepare(backend, after=5, folder=results.path.parent)
    return record(results, backend, measure_variants(backend, series, ks=KS[backend.name == "xla"]))
