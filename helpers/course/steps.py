"""The series' bookkeeping, above the lessons: each step's name with the source's figure beside
it, every row of the results table (the same from every notebook, built by one function), and
notebook 07's variant measuring. The lesson modules below hold the mechanisms; this module
calls them and writes down what they measured."""

from __future__ import annotations

import contextlib
import statistics

import torch

from .. import checkpoint as ck
from .. import roofline
from ..backend import Backend, CompileCount
from ..decode import Decoder, kv_buffers
from ..fused import fuse_projections
from ..qlinear import keep_linears_compressed
from ..qtable import keep_embed_in_4bit
from ..roofline import KDecoder
from . import measure, programs, sources
from .e2b import kv_cache_bytes
from .measure import device_bytes, timed_generate
from .results import Results
from .series import Series
from .timing import time_fn

MODES = "01 execution modes"
LOADING = "02 loading"
BASELINE = "03 baseline generate"
COMPILED = "04 compiled decode"
TABLE = "05 4-bit table"
RING = "06 ring cache"
PAST = "07 past the source"
MAX_LEN = 256  # notebook 07's cache positions: prompt and tokens with room to spare
KS = ((1, 4), (1, 2))  # notebook 07's K, elsewhere and on xla: each K is a compile, a minute or more on a CPU


def measured_on(checkpoint) -> dict:
    """What a row was measured on: the model's name, and whether it is Google's E2B (not the twin
    or a synthetic checkpoint): only such rows, on a TPU, are charted beside the source's figures."""
    name = "synthetic E2B" if checkpoint.synthetic else checkpoint.name
    return {"model": name, "real_model": not (checkpoint.tiny or checkpoint.synthetic)}


def timed_columns(backend: Backend, rates: list[float], bytes_per_token: int) -> dict:
    """The timing columns of every timed row: decode tok/s (the median of ``rates``, one per
    timed run), their spread (fastest over slowest: a busy machine shows here), and the
    roofline at this device's read bandwidth (``measure.read_bandwidth``)."""
    tok_s = statistics.median(rates)
    bandwidth, _ = measure.read_bandwidth(backend)
    return {
        "decode_tok_s": tok_s,
        "tok_s_spread": max(rates) / min(rates),
        **roofline.columns(bytes_per_token, tok_s, bandwidth),
    }


# --- 01 ----------------------------------------------------------------------------------------
def record_modes(backend: Backend, results: Results, **options) -> list[dict]:
    """Compare the modes and record one results row per mode, the source's figure beside
    ours on the compile row."""
    rows = measure.compare_modes(backend, **options)
    for row in rows:
        results.add(
            MODES,
            row["mode"],
            backend=backend.name,
            model="op stack",
            real_model=backend.on_tpu,  # the source's experiment: any op stack on a TPU
            ms=row["median_ms"],
            speedup_vs_eager=row["speedup_vs_eager"],
            source_speedup=sources.COMPILE_SPEEDUP if row["mode"] == "compile" else None,
        )
    return rows


# --- 02 ----------------------------------------------------------------------------------------
def record_loading(results: Results, backend: Backend, checkpoint, label: str, model, load_s: float, **extra) -> dict:
    """The model's bytes by kind, as one row of the results table."""
    kinds = {}
    for row in ck.memory_report(model):
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + row["bytes"]
    return results.add(
        LOADING,
        label,
        backend=backend.name,
        **measured_on(checkpoint),
        load_s=load_s,
        device_bytes=sum(kinds.values()),
        bytes_by_kind=kinds,
        **extra,
    )


# --- 03 ----------------------------------------------------------------------------------------
def record_baseline(results: Results, backend: Backend, checkpoint, measured: dict, model, context: int) -> dict:
    """Notebook 03's row (``measured``: what ``generate.measure`` returns), with the roofline:
    the weights as they are on the device, and HF's dynamic cache at ``context`` positions (its
    sliding layers keep a window)."""
    dtype_bytes = next(model.parameters()).element_size()
    step = roofline.step_bytes(model) + kv_cache_bytes(model.config, context, ring=True, dtype_bytes=dtype_bytes)
    return results.add(
        BASELINE,
        "HF generate",
        backend=backend.name,
        **measured_on(checkpoint),
        prefill_s=measured["prefill_s"],
        source_tok_s=sources.HF_GENERATE_TOK_S,
        **timed_columns(backend, measured["rates"], step),
    )


# --- 04-06 -------------------------------------------------------------------------------------
def record_compiled(
    results: Results,
    step: str,
    label: str,
    decoder: Decoder,
    series: Series,
    tokens: list[int],
    compiled: CompileCount,
    source_tok_s: float,
    runs: list[float] | None = None,
) -> dict:
    """A compiled step's row, the same from its notebook and the tour: decode tok/s (3 timed
    runs, or the given ``runs``) and their spread, same tokens as notebook 03, what the first
    call compiled (``compiled``: its graphs, and its seconds, the compile's cost), the peak
    device memory where the backend counts it, the bytes of weights and cache on the device from
    their tensors, the 4-bit table's bytes if it has one, the roofline columns, and the tokens
    after which the compile has paid for itself against notebook 03's rate in this run folder."""
    if runs is None:
        runs = timed_generate(decoder, series.ids, series.timed_tokens, readback_every=16)["rates"]
    timed = timed_columns(decoder.backend, runs, roofline.step_bytes(decoder.model, decoder.cache))
    baseline = next((r["decode_tok_s"] for r in results.rows() if r["step"] == BASELINE), None)
    return results.add(
        step,
        label,
        backend=decoder.backend.name,
        **measured_on(series.checkpoint),
        same_tokens=bool(series.same_tokens(tokens)),
        compiles=compiled.graphs,
        first_call_s=compiled.seconds,
        peak_bytes=(decoder.backend.memory() or {}).get("peak"),
        device_bytes=device_bytes(decoder.model, decoder.cache),
        table_bytes=series.table["bytes after"] if series.table else None,
        source_tok_s=source_tok_s,
        payback_tokens=payback_tokens(compiled.seconds, baseline, timed["decode_tok_s"]),
        **timed,
    )


def payback_tokens(compile_s: float, before_tok_s: float | None, after_tok_s: float) -> float | None:
    """Tokens after which a compile of ``compile_s`` seconds has paid for itself: each token
    saves 1/before - 1/after seconds (None with no earlier rate, or no saving)."""
    if not before_tok_s or after_tok_s <= before_tok_s:
        return None
    return compile_s / (1 / before_tok_s - 1 / after_tok_s)


# --- 07 ----------------------------------------------------------------------------------------
VARIANTS = ("matvec loops", "int4 bytes", "int4 linears", "4-bit head", "fused")  # notebook 07's, in order


def measure_variant(
    backend: Backend, series: Series, variant: str, k: int = 1, options=None, max_len: int = MAX_LEN
) -> dict:
    """One row of notebook 07: ``series.model`` as it is now, compiled anew (``Decoder`` with K =
    ``k`` tokens per call and ``options`` for ``torch.compile``) and timed: same tokens as notebook
    03, graphs compiled, seconds of the first call (its compilation), peak device memory where the
    backend counts it, decode tok/s (median of 3) and spread, weights on the device, the roofline
    columns, and what XLA compiled where it dumps it."""
    model = series.model
    torch._dynamo.reset()  # count this variant's compilations only
    backend.reset_peak_memory()
    options = options or {}
    decoder = KDecoder(model, backend, max_len, k, **options) if k > 1 else Decoder(model, backend, max_len, **options)
    folder = backend.xla_dump_folder
    with programs.captured(folder) if folder else contextlib.nullcontext([]) as compiled:
        with backend.compile_counter() as count:
            first = time_fn(decoder.generate, series.ids, series.new_tokens, sync=backend.sync, warmup=0, repeats=1)
    timed = timed_generate(decoder, series.ids, series.timed_tokens, readback_every=max(16, k))
    memory, verdict = backend.memory(), series.same_tokens(first.last)
    return {
        "variant": variant,
        **measured_on(series.checkpoint),
        "K": k,
        "same_tokens": bool(verdict),
        "verdict": str(verdict),
        "compiles": count.graphs,
        "first_call_s": first.median,
        "peak_bytes": memory and memory["peak"],
        "weights_bytes": sum(r["bytes"] for r in ck.memory_report(model)),
        **timed_columns(backend, timed["rates"], roofline.step_bytes(model, decoder.cache)),
        # what XLA compiled, where it dumps it (xla with HELPERS_XLA_AUDIT=1): helpers.course.programs
        **programs.summary(compiled, {programs.hlo_shape(t) for t in kv_buffers(decoder.cache)}),
    }


def measure_variants_in_place(
    backend: Backend, series: Series, ks=(1, 2, 4, 8), max_len: int = MAX_LEN, variants=VARIANTS
) -> list[dict]:
    """Notebook 07's variants on notebook 06's model, in the order its cells make them, each
    compiled anew and timed (``measure_variant``): for ``benchmarks/full_size.py`` and the tests,
    which run the sequence in one call; the notebook writes each change in a cell. It changes
    ``series.model`` in place, variant after variant (the model ends as the last one), and drops
    ``series.table``'s report, which no longer describes it. K tokens per compiled call for each
    of ``ks``; on a CPU, K = 1 with the one-row matmuls as loops inductor writes
    (``Backend.use_matvec_loops``), kept for the variants after it; then, at K = 1 (each is
    beside a K = 1 row: unrolled K times, a step that dequantizes every weight compiles for
    minutes on a CPU), the linears as int4 codes a byte each, as packed int4 (in the backend's
    form, ``Backend.int4_by_planes``), the main table and tied head in 4-bit too, and then
    q/k/v and gate/up fused into one matmul each. ``variants``: which of ``VARIANTS`` are
    measured (each is a compile: minutes at full size on a CPU); the changes before the last one
    asked for are made all the same, except the bytes, which int4 replaces. A row
    each: same tokens as notebook 03, graphs compiled, seconds of the first call (its
    compilation), peak device memory where the backend counts it, decode tok/s (median of 3)
    and spread, weights on the device, and the roofline columns."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}: pick from {VARIANTS}")
    model = series.model
    series.table = None
    loops = backend.use_matvec_loops()
    rows = [measure_variant(backend, series, f"4-bit table, K={k}", k, max_len=max_len) for k in ks]
    tail = "K=1" if loops is None else "K=1, matvec loops"
    if loops is not None and "matvec loops" in variants:
        rows.append(measure_variant(backend, series, f"4-bit table, {tail}", 1, loops, max_len))
    changes = {
        "int4 bytes": (
            "int4 codes a byte each",
            lambda: keep_linears_compressed(model, series.checkpoint, "int4-bytes"),
        ),
        "int4 linears": (
            "int4 linears",
            lambda: keep_linears_compressed(model, series.checkpoint, "int4", backend.int4_by_planes),
        ),
        "4-bit head": ("int4 linears + 4-bit head", lambda: keep_embed_in_4bit(model)),
        "fused": ("int4 linears + 4-bit head + fused q/k/v, gate/up", lambda: fuse_projections(model)),
    }
    last = max((VARIANTS.index(v) for v in variants), default=0)
    for name in VARIANTS[1 : last + 1]:
        label, change = changes[name]
        if name == "int4 bytes" and name not in variants:
            continue  # int4 rebuilds the linears from the checkpoint: unmeasured, this format is no step
        series.drop_reference_model()  # 9 GB at E2B beside the swap's reads and the compile (a verdict rebuilds it)
        change()
        if name in variants:
            rows.append(measure_variant(backend, series, f"{label}, {tail}", 1, loops, max_len))
    return rows


def record_variants(results: Results, backend: Backend, rows: list[dict]) -> list[dict]:
    """Each variant's row of the results table, the same from notebook 07 and the tour."""
    keys = (
        "decode_tok_s",
        "tok_s_spread",
        "same_tokens",
        "compiles",
        "first_call_s",
        "bytes_per_token",
        "GB_per_s",
        "pct_of_bw",
        "model",
        "real_model",
    )
    return [results.add(PAST, r["variant"], backend=backend.name, **{k: r[k] for k in keys}) for r in rows]
