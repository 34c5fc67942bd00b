"""What the notebooks measure: HF ``generate``, compiled decoders (runs, profile, recompiles), bandwidth, contexts."""

import contextlib
import functools
import statistics

import torch
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from ..backend import V5E_BYTES_PER_S, Backend, get_backend
from ..decode import Decoder, cache_bytes, cache_read_bytes, greedy_step
from ..generate import generate, greedy_config, stop_ids, until_stop
from ..ring import RingCache, RingDecoder, inside_generate
from ..timing import time_fed, time_fn

DEFER_AND_FUSE_TOKENS = 8  # a first call compiles the model at each step: 8 show it (32: 32 E2B compiles on a TPU)
READS = 9  # timed reads of the bandwidth probe: the best is the bandwidth, the slowest over it the spread


def no_recompiles():
    """A recompile inside the ``with`` block raises instead of silently compiling again."""
    return torch._dynamo.config.patch(error_on_recompile=True)


@contextlib.contextmanager
def compiled_forward(model, **compile_options):
    """HF's recipe for a faster ``generate`` (``cache_implementation="static"``): the forward compiled in the block."""
    model.forward = torch.compile(model.forward, **compile_options)
    try:
        yield
    finally:
        del model.forward


def measure(model, tokenizer, ids, backend: Backend, new_tokens: int, repeats=3, warmup=1, **kwargs) -> dict:
    """Median prefill s and decode tok/s of ``repeats`` runs of exactly ``new_tokens`` (each step ends on the host)."""
    runs = [  # (tokens, streamer): each output let go, its cache with it
        generate(model, tokenizer, ids, backend, new_tokens, stop=False, **kwargs)[:2] for _ in range(warmup + repeats)
    ]
    steps = [streamer.step_seconds for _, streamer in runs[warmup:]]
    rates = [(len(s) - 1) / sum(s[1:]) for s in steps]
    return {
        "prefill_s": statistics.median(s[0] for s in steps),
        "decode_tok_s": statistics.median(rates),
        "tok_s_spread": max(rates) / min(rates),
        "rates": rates,
        "tokens": until_stop(runs[-1][0], stop_ids(model)),
        "repeats": repeats,
    }


@torch.no_grad()
def ops_per_step(model, context: int = 26) -> dict[str, int]:
    """The aten ops of one eager decode step: ``compute`` (new data, each a host launch) and ``views``.
    A ``TorchDispatchMode`` counts them even on the meta device (E2B's real config); no profiler does."""
    counts = {"compute": 0, "views": 0}

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["views" if func.is_view else "compute"] += 1
            return func(*args, **(kwargs or {}))

    device = next(model.parameters()).device
    cache = model(torch.zeros(1, context, dtype=torch.long, device=device), use_cache=True).cache
    token = torch.zeros(1, 1, dtype=torch.long, device=device)  # made outside the count
    with Count():
        model(token, cache=cache, use_cache=True)
    return counts


def first_and_second_call(model, tokenizer, ids, backend: Backend, new_tokens: int) -> dict[str, dict]:
    """Per mode but compile: seconds and programs compiled per step of a first and an identical second call."""
    calls = {}
    for mode in [m for m in backend.modes if m != "compile"]:  # notebook 04 compiles a decode step, not generate
        length = min(new_tokens, DEFER_AND_FUSE_TOKENS) if mode == "defer_and_fuse" else new_tokens
        with backend.mode(mode):
            (tokens, first, _), (_, second, _) = [generate(model, tokenizer, ids, backend, length) for _ in range(2)]
        calls[mode] = {"tokens": tokens, "first": first.step_seconds, "second": second.step_seconds}
        calls[mode] |= {"programs_first": first.step_programs, "programs_second": second.step_programs}
    return calls


def profiler_activities(backend: Backend) -> list:
    """What torch.profiler records: the host, and on cuda the kernels; on tpu and xla only the host's side."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if backend.device.type == "cuda" else [])


def profiler_sort(backend: Backend) -> str:
    """The profiler table's sort key: the kernels' self time on cuda, else the host's."""
    return "self_cuda_time_total" if backend.device.type == "cuda" else "self_cpu_time_total"


@torch.no_grad()
def profile_steps(decoder: Decoder, ids, steps: int = 8, rows: int = 8) -> str:
    """torch.profiler's top ops by self time over ``steps`` compiled decode calls (tpu, xla: the host's side only)."""
    token, position = decoder.prefill(ids)
    decoder.backend.sync()
    with profile(activities=profiler_activities(decoder.backend)) as prof:
        for _ in range(steps):
            _, token, position = decoder.call(token, position)
        decoder.backend.flush()
        decoder.backend.sync()
    return prof.key_averages().table(sort_by=profiler_sort(decoder.backend), row_limit=rows)


def timed_generate(decoder: Decoder, ids, new_tokens: int, readback_every: int, repeats: int = 3) -> dict:
    """Median prefill s and decode tok/s (a run less its prefill, timed alone) of ``repeats`` same-token runs."""
    once = {"sync": decoder.backend.sync, "warmup": 0, "repeats": 1}
    prefills, runs = [], []
    for _ in range(repeats):  # alternated, so both see the same state of a shared machine
        prefills.append(time_fn(lambda: decoder.prefill(ids)[0], **once).median)
        runs.append(time_fn(decoder.generate, ids, new_tokens, readback_every, stop_ids=(), **once))
    if any(run.last != runs[0].last for run in runs):
        raise AssertionError(f"the {repeats} timed runs of one greedy decoder gave different tokens")
    rates = [(new_tokens - 1) / max(run.median - prefill, 1e-9) for run, prefill in zip(runs, prefills)]
    return {
        "tokens": until_stop(runs[0].last, stop_ids(decoder.model)),
        "prefill_s": statistics.median(prefills),
        "decode_tok_s": statistics.median(rates),
        "rates": rates,
    }


@torch.no_grad()
def context_sweep(
    decoder: RingDecoder, lengths, steps: int, hf_default=True, eager=False, bucketed: RingDecoder | None = None
) -> list[dict]:
    """Per prompt length: prefill s, decode ms/token, cache bytes and bytes read, on the compiled ring
    (and eager), ``bucketed``, and HF's default ``DynamicCache`` (eager); compiled before timing."""
    backend, model, rows = decoder.backend, decoder.model, []

    def ms_per_step(step, state):  # ``step`` fed its own (token, position), from ``state``
        return 1e3 * time_fed(step, state, sync=backend.sync, repeats=steps).median

    def calls(ring):  # one decode call fed its own token, on the bucket that holds it
        return lambda token, position: ring.call(token, position)[1:]

    vocab = model.config.get_text_config().vocab_size
    rings = {"ring": decoder} | ({"buckets": bucketed} if bucketed is not None else {})
    for n in tqdm(lengths, desc="contexts"):
        ids = torch.randint(3, vocab, (1, n), generator=torch.Generator().manual_seed(n)).to(backend.device)
        row = {"context": n}
        for name, ring in rings.items():
            ring.generate(ids, steps + 1, stop_ids=())  # compiled for this length (its bucket's programs)
            prefill = time_fn(ring.prefill, ids, sync=backend.sync, warmup=0, repeats=1)  # timed once, its output kept
            row[f"{name} prefill s"] = prefill.median
            row[f"{name} ms/token"] = ms_per_step(calls(ring), prefill.last)
            row[f"{name} cache bytes"] = cache_bytes(ring.cache)
            row[f"{name} bytes read"] = cache_read_bytes(model, ring.cache)
        if eager:
            row["ring eager ms/token"] = ms_per_step(decoder.step, decoder.prefill(ids))
        if hf_default:
            prefill = time_fn(model, ids, use_cache=True, sync=backend.sync, warmup=0, repeats=1)
            cache, logits = prefill.last.past_key_values, prefill.last.logits
            row["HF prefill s"] = prefill.median
            first = logits[:, -1].argmax(-1, keepdim=True), torch.tensor([[n]], device=backend.device)
            row["HF ms/token"] = ms_per_step(functools.partial(greedy_step, model, cache), first)
            row["HF cache bytes"] = cache_bytes(cache)
        rows.append(row)
    return rows


@torch.no_grad()
def generate_on_ring(model, ids, backend, new_tokens: int, max_len: int, compiled: bool = False):
    """transformers' greedy ``generate`` on a ``RingCache`` (exactly ``new_tokens``); ``compiled``: the forward compiled
    as HF's recipe, graphs counted per token. Returns (tokens, cache, graphs per token or None)."""
    if compiled and not backend.runs_compiled_generate:
        raise NotImplementedError(
            "generate with a compiled forward over lazy XLA tensors crashes torch_xla 2.9's process: "
            "on xla use RingDecoder.generate (compiled with openxla) or compiled=False"
        )

    class Graphs(list):  # a streamer that only counts: the graphs compiled so far, at each token
        def put(self, value):
            backend.flush()
            self.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])

        def end(self):
            pass

    cache, graphs = RingCache(model, max_len, model.config.get_text_config().sliding_window), Graphs()
    forward = compiled_forward(model, backend="eager", dynamic=False) if compiled else contextlib.nullcontext()
    with forward, inside_generate(model):
        config = greedy_config(model, new_tokens, stop=False)
        out = model.generate(ids, generation_config=config, cache=cache, streamer=graphs)
    per_token = [b - a for a, b in zip(graphs, graphs[1:])] if compiled else None
    return out.sequences[0, ids.shape[1] :].tolist(), cache, per_token


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
        return V5E_BYTES_PER_S, f"published: TPU v5e, {V5E_BYTES_PER_S / 1e9:.0f} GB/s"
    best, spread = _probe(backend.name, str(backend.device), megabytes)
    return best, f"measured here: the max of {megabytes} MB, best of {READS} reads, slowest {spread:.2f}x slower"


@torch.no_grad()
def cache_passes(model, ids, backend: Backend, lengths: tuple[int, int], repeats: int = 16) -> dict:
    """Passes over its cache a decode step makes: its extra seconds at static caches of two ``lengths`` times the read
    bandwidth over the extra bytes (about 1 where it writes in place, 3 or more where a new cache is copied in)."""
    seconds, held = [], []
    for max_len in lengths:
        decoder = Decoder(model, backend, max_len)
        decoder.generate(ids, 2, stop_ids=())  # compiled here, not in the timing
        seconds.append(time_fed(decoder.decode_step, decoder.prefill(ids), sync=backend.sync, repeats=repeats).median)
        held.append(cache_bytes(decoder.cache))
        del decoder
    bandwidth, how = read_bandwidth(backend)
    passes = (seconds[1] - seconds[0]) * bandwidth / (held[1] - held[0])
    return {"lengths": lengths, "step_s": seconds, "cache_bytes": held, "passes": passes, "bandwidth": how}
