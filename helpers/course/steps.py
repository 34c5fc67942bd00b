"""The series' bookkeeping above the lessons: step names, every results-table row (one function per
row, whichever notebook records it) with the source's figure beside it, and notebook 07's variants."""

import contextlib
import statistics

import torch

from .. import modes, roofline
from ..backend import Backend, CompileCount
from ..decode import Decoder, cache_bytes, kv_buffers
from ..draft import draft_bytes
from ..fused import fuse_projections
from ..qlinear import keep_linears_compressed
from ..qtable import keep_embed_in_4bit
from ..roofline import KDecoder
from ..timing import time_fn
from . import audits, measure, sources
from .e2b import kv_cache_bytes
from .report import Results
from .series import Series

MODES = "01 execution modes"
LOADING = "02 loading"
BASELINE = "03 baseline generate"
COMPILED = "04 compiled decode"
TABLE = "05 4-bit table"
RING = "06 ring cache"
PAST = "07 past the source"
DRAFT = "09 draft and verify"
MAX_LEN = 256  # notebook 07's cache positions: prompt and tokens with room to spare
KS = ((1, 4), (1, 2))  # notebook 07's K, elsewhere and on xla: each K is a compile, a minute or more on a CPU
VARIANTS = ("matvec loops", "int4 bytes", "int4 linears", "4-bit head", "fused")  # notebook 07's, in order


def measured_on(checkpoint) -> dict:
    """The model's name, and whether it is Google's E2B (only such rows, on a TPU, are charted beside the source's)."""
    name = "synthetic E2B" if checkpoint.synthetic else checkpoint.name
    return {"model": name, "real_model": not (checkpoint.tiny or checkpoint.synthetic)}


def timed_columns(backend: Backend, rates: list[float], bytes_per_token: int) -> dict:
    """Every timed row's columns: median tok/s, spread (fastest over slowest: a busy machine shows), the roofline."""
    tok_s = statistics.median(rates)
    bandwidth, _ = measure.read_bandwidth(backend)
    return {
        "decode_tok_s": tok_s,
        "tok_s_spread": max(rates) / min(rates),
        **roofline.columns(bytes_per_token, tok_s, bandwidth),
    }


def record_modes(backend: Backend, results: Results, **options) -> list[dict]:
    """Notebook 01: compare the modes and record a row per mode, the source's figure on the compile row."""
    rows = modes.compare_modes(backend, **options)
    for row in rows:
        source = sources.COMPILE_SPEEDUP if row["mode"] == "compile" else None
        values = {"ms": row["median_ms"], "speedup_vs_eager": row["speedup_vs_eager"], "source_speedup": source}
        # real_model: the source's experiment is any op stack on a TPU
        results.add(MODES, row["mode"], backend=backend.name, model="op stack", real_model=backend.on_tpu, **values)
    return rows


def record_loading(results: Results, backend: Backend, checkpoint, label: str, model, load_s: float, **extra) -> dict:
    """Notebook 02's row: the model's bytes by kind."""
    kinds = {}
    for row in audits.memory_report(model):
        kinds[row["kind"]] = kinds.get(row["kind"], 0) + row["bytes"]
    values = {"load_s": load_s, "device_bytes": sum(kinds.values()), "bytes_by_kind": kinds, **extra}
    return results.add(LOADING, label, backend=backend.name, **measured_on(checkpoint), **values)


def record_baseline(results: Results, backend: Backend, checkpoint, measured: dict, model, context: int) -> dict:
    """Notebook 03's row from ``measure``'s dict; the roofline counts the weights as on the device
    and HF's dynamic cache at ``context`` positions (sliding layers keep a window)."""
    dtype_bytes = next(model.parameters()).element_size()
    step = roofline.step_bytes(model) + kv_cache_bytes(model.config, context, ring=True, dtype_bytes=dtype_bytes)
    timed = timed_columns(backend, measured["rates"], step)
    values = {"prefill_s": measured["prefill_s"], "source_tok_s": sources.HF_GENERATE_TOK_S, **timed}
    return results.add(BASELINE, "HF generate", backend=backend.name, **measured_on(checkpoint), **values)


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
    """Notebooks 04-06: a compiled step's row, from its notebook or the tour (3 timed runs, or ``runs``), with the
    tokens after which the compile pays for itself against notebook 03's rate in this run folder."""
    if runs is None:
        runs = measure.timed_generate(decoder, series.ids, series.timed_tokens, readback_every=16)["rates"]
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
        device_bytes=sum(r["bytes"] for r in audits.memory_report(decoder.model)) + cache_bytes(decoder.cache),
        table_bytes=series.table["bytes after"] if series.table else None,
        source_tok_s=source_tok_s,
        payback_tokens=payback_tokens(compiled.seconds, baseline, timed["decode_tok_s"]),
        **timed,
    )


def payback_tokens(compile_s: float, before_tok_s: float | None, after_tok_s: float) -> float | None:
    """Tokens after which a compile has paid for itself, each saving 1/before - 1/after s (None: no rate, no saving)."""
    if not before_tok_s or after_tok_s <= before_tok_s:
        return None
    return compile_s / (1 / before_tok_s - 1 / after_tok_s)


def measure_variant(
    backend: Backend, series: Series, variant: str, k: int = 1, options=None, max_len: int = MAX_LEN
) -> dict:
    """One row of notebook 07: ``series.model`` as it is now, compiled anew (``k`` tokens per call,
    ``options`` for ``torch.compile``) and timed, with what XLA compiled where it dumps it."""
    model = series.model
    torch.compiler.reset()  # count this variant's compilations only
    backend.reset_peak_memory()
    options = options or {}
    decoder = KDecoder(model, backend, max_len, k, **options) if k > 1 else Decoder(model, backend, max_len, **options)
    folder = backend.xla_dump_folder
    captured = audits.captured(folder) if folder else contextlib.nullcontext([])
    with captured as compiled, backend.compile_counter() as count:
        first = time_fn(decoder.generate, series.ids, series.new_tokens, sync=backend.sync, warmup=0, repeats=1)
    timed = measure.timed_generate(decoder, series.ids, series.timed_tokens, readback_every=max(16, k))
    memory, verdict = backend.memory(), series.same_tokens(first.last)
    kernels = sorted({m.kernel for m in model.modules() if isinstance(getattr(m, "kernel", None), str)})
    return {
        "variant": variant,
        **measured_on(series.checkpoint),
        "K": k,
        "kernel": ", ".join(kernels) or None,  # torch's weight kernels in the step: code x scale unrounded
        "same_tokens": bool(verdict),
        "verdict": str(verdict),
        "compiles": count.graphs,
        "first_call_s": first.median,
        "peak_bytes": memory and memory["peak"],
        "weights_bytes": sum(r["bytes"] for r in audits.memory_report(model)),
        **timed_columns(backend, timed["rates"], roofline.step_bytes(model, decoder.cache)),
        # what XLA compiled, where it dumps it (xla with HELPERS_XLA_AUDIT=1): helpers.course.audits
        **audits.summary(compiled, {audits.hlo_shape(t) for t in kv_buffers(decoder.cache)}),
    }


def measure_variants_in_place(
    backend: Backend, series: Series, ks=(1, 2, 4, 8), max_len: int = MAX_LEN, variants=VARIANTS
) -> list[dict]:
    """Notebook 07's cells for ``benchmarks/full_size.py`` and the tests: the variants on notebook 06's model, changed
    in place in order, each by ``measure_variant``; ``variants``: which to measure (earlier changes are made anyway)."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}: pick from {VARIANTS}")
    model, path, kernel = series.model, series.checkpoint.path, backend.int4_kernel
    series.table = None
    loops = backend.use_matvec_loops()
    rows = [measure_variant(backend, series, f"4-bit table, K={k}", k, max_len=max_len) for k in ks]
    tail = "K=1" if loops is None else "K=1, matvec loops"
    if loops is not None and "matvec loops" in variants:
        rows.append(measure_variant(backend, series, f"4-bit table, {tail}", 1, loops, max_len))
    changes = {  # each later variant's label, and the change that makes it
        "int4 bytes": ("int4 codes a byte each", lambda: keep_linears_compressed(model, path, "int4-bytes", kernel)),
        "int4 linears": ("int4 linears", lambda: keep_linears_compressed(model, path, "int4", kernel)),
        "4-bit head": ("int4 linears + 4-bit head", lambda: keep_embed_in_4bit(model, kernel)),
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
    """Each variant's results row, from notebook 07 or the tour."""
    keys = ("decode_tok_s", "tok_s_spread", "same_tokens", "compiles", "first_call_s", "bytes_per_token", "GB_per_s")
    keys += ("pct_of_bw", "peak_bytes", "model", "real_model")
    return [results.add(PAST, r["variant"], backend=backend.name, **{k: r[k] for k in keys}) for r in rows]


def record_draft(results: Results, series: Series, decoder, tokens: list[int], compiled: CompileCount, runs) -> dict:
    """Notebook 09's row for one K: tok/s, tokens per verify, and the roofline per token made: a call reads the
    target's step once and the assistant's K times, for 1 + (drafts kept) tokens."""
    per_call = decoder.tokens_per_verify()
    read = (roofline.step_bytes(decoder.model, decoder.cache) + decoder.draft_tokens * draft_bytes(decoder)) / per_call
    return results.add(
        DRAFT,
        f"{type(decoder).__name__}, K={decoder.draft_tokens}",
        backend=decoder.backend.name,
        **measured_on(series.checkpoint),
        K=decoder.draft_tokens,
        tokens_per_verify=per_call,
        same_tokens=bool(series.same_tokens(tokens)),
        compiles=compiled.graphs,
        first_call_s=compiled.seconds,
        peak_bytes=(decoder.backend.memory() or {}).get("peak"),  # None where the backend counts none (cpu)
        **timed_columns(decoder.backend, runs, round(read)),
    )
