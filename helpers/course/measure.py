"""What the notebooks measure: modes, read bandwidth, HF ``generate``, a compiled decoder's runs and
profile, ``StaticCache`` recompiling, and the ring against HF's default cache over context lengths."""

from __future__ import annotations

import contextlib
import functools
import statistics

import torch
from tqdm.auto import tqdm

from ..backend import V5E_BYTES_PER_S, Backend, get_backend
from ..decode import Decoder, cache_bytes, cache_read_bytes, greedy_step
from ..generate import generate, greedy_config, stop_ids, until_stop
from ..ring import RingCache, RingDecoder, inside_generate
from ..timing import time_fed, time_fn
from .audits import memory_report


@contextlib.contextmanager
def no_recompiles():
    """A recompile inside the block raises instead of silently compiling again."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


@contextlib.contextmanager
def compiled_forward(model, **compile_options):
    """HF's recipe for a faster ``generate``: the forward ``torch.compile``d inside the block; pass
    ``cache_implementation="static"``."""
    model.forward = torch.compile(model.forward, **compile_options)
    try:
        yield
    finally:
        del model.forward


def measure(
    model, tokenizer, ids, backend: Backend, new_tokens: int, repeats: int = 3, warmup: int = 1, **kwargs
) -> dict:
    """Median prefill seconds and decode tokens/s over ``repeats`` runs of exactly ``new_tokens`` (no
    stop: each run times the same count; each step ends with the token on the host, so synced)."""
    runs = []
    for i in range(warmup + repeats):
        tokens, streamer, _ = generate(model, tokenizer, ids, backend, new_tokens, stop=False, **kwargs)
        if i >= warmup:
            runs.append(streamer.step_seconds)
    prefill = statistics.median(r[0] for r in runs)
    rates = [(len(r) - 1) / sum(r[1:]) for r in runs]
    return {
        "prefill_s": prefill,
        "decode_tok_s": statistics.median(rates),
        "tok_s_spread": max(rates) / min(rates),
        "rates": rates,
        "tokens": until_stop(tokens, stop_ids(model)),
        "repeats": repeats,
    }


def ops_per_step(model, context: int = 26) -> dict[str, int]:
    """The aten ops of one eager decode step: ``compute`` (new data, each a host launch) and ``views``.
    A ``TorchDispatchMode`` counts them even on the meta device (E2B's real config); no profiler does."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"compute": 0, "views": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["views" if func.is_view else "compute"] += 1
            return func(*args, **(kwargs or {}))

    device = next(model.parameters()).device
    with torch.no_grad():
        cache = model(torch.zeros(1, context, dtype=torch.long, device=device), use_cache=True).cache
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        with Count():
            model(token, cache=cache, use_cache=True)
    return counts


# Defer-and-fuse compiles the whole model for each new shape, i.e. each step of a first call:
# 8 steps show it (32 would be 32 E2B compiles on a TPU); the xla backend uses 8 throughout.
DEFER_AND_FUSE_TOKENS = 8


def first_and_second_call(model, tokenizer, ids, backend: Backend, new_tokens: int) -> dict[str, dict]:
    """Per mode (not compile): seconds and device programs per step of a first and an identical
    second call. Defer-and-fuse generates at most ``DEFER_AND_FUSE_TOKENS``."""
    calls = {}
    for mode in backend.modes:
        if mode == "compile":
            continue  # HF generate as such is not compiled here: notebook 04 compiles a decode step
        length = min(new_tokens, DEFER_AND_FUSE_TOKENS) if mode == "defer_and_fuse" else new_tokens
        with backend.mode(mode):
            tokens, first, _ = generate(model, tokenizer, ids, backend, length)
            _, second, _ = generate(model, tokenizer, ids, backend, length)
        calls[mode] = {
            "tokens": tokens,
            "first": first.step_seconds,
            "second": second.step_seconds,
            "programs_first": first.step_programs,
            "programs_second": second.step_programs,
        }
    return calls


def device_bytes(model, cache) -> int:
    """Weights and buffers (tied ones once) plus the KV cache, from their tensors."""
    return sum(r["bytes"] for r in memory_report(model)) + cache_bytes(cache)


def profiler_activities(backend: Backend) -> list:
    """What torch.profiler records: the host, and on cuda the kernels; on tpu and xla only the host's side."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.device.type == "cuda" else [])


def profiler_sort(backend: Backend) -> str:
    return "self_cuda_time_total" if backend.device.type == "cuda" else "self_cpu_time_total"


@torch.no_grad()
def profile_steps(decoder: Decoder, ids, steps: int = 8, rows: int = 8) -> str:
    """torch.profiler's table of the ops with the most self time over ``steps`` compiled decode calls; on tpu and xla
    the host's side only (the device's own profilers are not wired in)."""
    from torch.profiler import profile

    token, position = decoder.prefill(ids)
    decoder.backend.sync()
    with profile(activities=profiler_activities(decoder.backend)) as prof:
        for _ in range(steps):
            _, token, position = decoder.call(token, position)
        decoder.backend.flush()
        decoder.backend.sync()
    return prof.key_averages().table(sort_by=profiler_sort(decoder.backend), row_limit=rows)


def timed_generate(decoder: Decoder, ids, new_tokens: int, readback_every: int, repeats: int = 3) -> dict:
    """``repeats`` runs of exactly ``new_tokens``, each after a prefill timed alone: median prefill
    seconds and decode tokens/s (run time less prefill); every run must give the same tokens."""
    sync = decoder.backend.sync
    prefills, runs, outputs = [], [], []
    for _ in range(repeats):  # alternated, so both see the same state of a shared machine
        prefills += time_fn(lambda: decoder.prefill(ids)[0], sync=sync, warmup=0, repeats=1).times
        run = time_fn(decoder.generate, ids, new_tokens, readback_every, stop_ids=(), sync=sync, warmup=0, repeats=1)
        runs += run.times
        outputs.append(run.last)
    if any(out != outputs[0] for out in outputs):
        raise AssertionError(f"the {repeats} timed runs of one greedy decoder gave different tokens")
    rates = [(new_tokens - 1) / max(run - prefill, 1e-9) for run, prefill in zip(runs, prefills)]
    return {
        "tokens": until_stop(outputs[0], stop_ids(decoder.model)),
        "prefill_s": statistics.median(prefills),
        "decode_tok_s": statistics.median(rates),
        "rates": rates,
    }


@torch.no_grad()
def context_sweep(
    decoder: RingDecoder,
    lengths,
    steps: int,
    hf_default: bool = True,
    eager: bool = False,
    bucketed: RingDecoder | None = None,
) -> list[dict]:
    """Per prompt length: prefill s, decode ms/token, cache bytes and bytes read, on the compiled ring
    (and eager), ``bucketed``, and HF's default ``DynamicCache`` (eager); compiled before timing."""
    backend, model, rows = decoder.backend, decoder.model, []

    def ms_per_step(step, token, position):
        return 1e3 * time_fed(step, (token, position), sync=backend.sync, repeats=steps).median

    def calls(ring):  # one decode call fed its own token, on the bucket that holds it
        return lambda token, position: ring.call(token, position)[1:]

    def once(fn, *args, **kwargs):  # a prefill: timed once, its output kept
        return time_fn(fn, *args, sync=backend.sync, warmup=0, repeats=1, **kwargs)

    vocab = model.config.get_text_config().vocab_size
    prompts = [
        torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(backend.device) for n in lengths
    ]
    rings = {"ring": decoder} | ({"buckets": bucketed} if bucketed is not None else {})
    for ids in tqdm(prompts, desc="contexts"):
        length, row = ids.shape[1], {"context": ids.shape[1]}
        for name, ring in rings.items():
            ring.generate(ids, steps + 1, stop_ids=())  # compiled for this length (its bucket's programs)
            prefill = once(ring.prefill, ids)
            row[f"{name} prefill s"] = prefill.median
            row[f"{name} ms/token"] = ms_per_step(calls(ring), *prefill.last)
            row[f"{name} cache bytes"] = cache_bytes(ring.cache)
            row[f"{name} bytes read"] = cache_read_bytes(model, ring.cache)
        if eager:
            token, position = decoder.prefill(ids)
            row["ring eager ms/token"] = ms_per_step(decoder.step, token, position)
        if hf_default:
            prefill = once(model, ids, use_cache=True)
            out = prefill.last
            row["HF prefill s"] = prefill.median
            step = functools.partial(greedy_step, model, out.past_key_values)
            row["HF ms/token"] = ms_per_step(
                step, out.logits[:, -1].argmax(-1, keepdim=True), torch.tensor([[length]], device=backend.device)
            )
            row["HF cache bytes"] = cache_bytes(out.past_key_values)
        rows.append(row)
    return rows


@torch.no_grad()
def generate_on_ring(model, ids, backend, new_tokens: int, max_len: int, compiled: bool = False):
    """transformers' greedy ``generate`` on a ``RingCache`` (exactly ``new_tokens``); ``compiled``: the forward compiled
    as HF's recipe, graphs counted per token. Returns (tokens, cache, graphs per token or None)."""
    from torch._dynamo.utils import counters

    if compiled and not backend.runs_compiled_generate:
        raise NotImplementedError(
            "generate with a compiled forward over lazy XLA tensors crashes torch_xla 2.9's process: "
            "on xla use RingDecoder.generate (compiled with openxla) or compiled=False"
        )

    class Graphs:  # a streamer that only counts
        def __init__(self):
            self.seen: list[int] = []

        def put(self, value):
            backend.flush()
            self.seen.append(counters["stats"]["unique_graphs"])

        def end(self):
            pass

    cache, graphs = RingCache(model, max_len, model.config.get_text_config().sliding_window), Graphs()
    if compiled:
        model.forward = torch.compile(model.forward, backend="eager", dynamic=False)
    try:
        with inside_generate(model):
            out = model.generate(
                ids, generation_config=greedy_config(model, new_tokens, stop=False), cache=cache, streamer=graphs
            )
    finally:
        if compiled:
            del model.forward  # back to the class's own, eager
    per_token = [b - a for a, b in zip(graphs.seen, graphs.seen[1:])] if compiled else None
    return out.sequences[0, ids.shape[1] :].tolist(), cache, per_token


READS = 9  # timed reads of the probe: the best is the bandwidth, the slowest over it the spread


@functools.cache
def _probe(name: str, device: str, megabytes: int) -> tuple[float, float]:
    backend = get_backend(name)
    data = torch.randn(megabytes * 2**20 // 4, device=backend.device)
    timing = time_fn(torch.amax, data, sync=lambda: (backend.flush(), backend.sync()), warmup=2, repeats=READS)
    return data.numel() * data.element_size() / timing.min, timing.max / timing.min


def read_bandwidth(backend: Backend, megabytes: int = 256) -> tuple[float, str]:
    """Bytes per second this device reads at and where the figure comes from: the best of ``READS`` reads of
    ``megabytes`` (once per process; the spread in the text), or on a TPU the published figure."""
    if backend.on_tpu:  # a TPU's figure: Google's, in place of a measurement
        return V5E_BYTES_PER_S, "published: TPU v5e, 819 GB/s"
    best, spread = _probe(backend.name, str(backend.device), megabytes)
    return best, f"measured here: the max of {megabytes} MB, best of {READS} reads, slowest {spread:.2f}x slower"


def cache_passes(model, ids, backend: Backend, lengths: tuple[int, int], repeats: int = 16) -> dict:
    """How many passes over its cache a decode step makes, from its time at one context with static caches of two
    ``lengths``: the extra seconds times the read bandwidth over the extra cache bytes. About 1 where the step reads its
    cache and writes one position in place; 3 or more where each call's cache comes back as a new buffer copied into
    the old one (a read, a write and a copy's read and write)."""
    seconds, held = [], []
    for max_len in lengths:
        decoder = Decoder(model, backend, max_len)
        decoder.generate(ids, 2, stop_ids=())  # compiled here, not in the timing
        with torch.no_grad():
            start = decoder.prefill(ids)
            seconds.append(time_fed(decoder.decode_step, start, sync=backend.sync, repeats=repeats).median)
        held.append(cache_bytes(decoder.cache))
        del decoder
    bandwidth, how = read_bandwidth(backend)
    passes = (seconds[1] - seconds[0]) * bandwidth / (held[1] - held[0])
    return {"lengths": lengths, "step_s": seconds, "cache_bytes": held, "passes": passes, "bandwidth": how}
