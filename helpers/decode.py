"""A compiled decode step: one token in, the next token out, the KV cache updated in place,
every input on the device, compiled once and reused for every token."""

from __future__ import annotations

import contextlib
import functools
import statistics

import torch
from transformers.cache_utils import Cache, StaticLayer

from .backend import Backend
from .checkpoint import compression_report, memory_report
from .sampling import Sampler, Stops, stop_ids, until_stop
from .timing import time_fn

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def cache_length(positions: int) -> int:
    """A static cache sized to a run of ``positions`` (prompt + new tokens): the smallest of
    ``PREFILL_BUCKETS`` that holds them (beyond the largest, ``positions`` itself). A step reads
    its whole buffer, so every position past the run's is read for nothing; a bucket, not the
    exact length, so runs of similar length share one compiled step."""
    return next((size for size in PREFILL_BUCKETS if size >= positions), positions)


def strip_compressed_wrappers(model) -> dict:
    """Make the model plain again with compressed-tensors' own API: decompress the weights once,
    in place (if the first forward has not yet), unwrap every quantized forward and drop the
    quantization parameters, and remove the offloading wrappers. Returns what was removed."""
    from compressed_tensors.offload import remove_dispatch
    from compressed_tensors.quantization.quant_metadata import QuantizationMetadata

    before = {r["what"]: r["count"] for r in compression_report(model)}
    quantizer = getattr(model, "hf_quantizer", None)
    decompressed = hasattr(model, "ct_decompress_hook")
    if decompressed:
        quantizer.compressor.decompress_model(model)
    for module in model.modules():
        if hasattr(module, "quantization_scheme"):
            QuantizationMetadata.clear_quantization(module)
    remove_dispatch(model, onload_tensors=True)
    after = {r["what"]: r["count"] for r in compression_report(model)}
    return {
        "decompressed now": decompressed,
        "wrapped forwards removed": before["modules with a wrapped forward"] - after["modules with a wrapped forward"],
        "hooks removed": before["modules with forward hooks"] - after["modules with forward hooks"],
        "wrapped forwards left": after["modules with a wrapped forward"],
    }


def static_cache(model, max_len: int) -> Cache:
    """A KV cache preallocated for ``max_len`` positions, one transformers ``StaticLayer`` per
    cache-owning layer, allocated now (not lazily inside a compiled region).

    Not ``StaticCache`` itself: its sliding-window layer counts tokens in a Python int and
    shifts its buffer once full, so a compiled step recompiles at every position. A full-length
    ``StaticLayer`` keeps its count in a device tensor; the model's sliding mask does the rest
    (notebook 06 replaces these full-length sliding layers with a ring)."""
    return Cache(layers=allocated_layers(model, lambda attn: StaticLayer(max_len)))


def allocated_layers(model, make_layer) -> list:
    """One cache layer per decoder layer, ``make_layer(self_attn)``, its buffers allocated now
    for the layers that own K/V; a K/V-sharing layer reads an earlier layer's and stores none."""
    layers = []
    for decoder in model.model.layers:
        attn = decoder.self_attn
        layer = make_layer(attn)
        if not attn.is_kv_shared_layer:
            kv = torch.zeros(
                1,
                attn.k_proj.out_features // attn.head_dim,
                1,
                attn.head_dim,
                dtype=attn.k_proj.weight.dtype,
                device=attn.k_proj.weight.device,
            )
            layer.lazy_initialization(kv, kv)
        layers.append(layer)
    return layers


def set_length(cache: Cache, length: int) -> None:
    """Rewind or advance every allocated layer to ``length`` positions, in place."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.cumulative_length.fill_(length)


def kv_buffers(cache) -> list[torch.Tensor]:
    """The K and V tensors a cache holds, layer by layer (none for a K/V-sharing layer)."""
    return [
        t
        for layer in getattr(cache, "layers", [])
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if t is not None
    ]


def cache_bytes(cache) -> int:
    """K and V bytes the cache holds, from its tensors: every allocated slot of a static or ring
    cache (what the attention reads each step: the mask drops unused slots after the read), what
    a dynamic cache holds now."""
    return sum(t.numel() * t.element_size() for t in kv_buffers(cache))


def cache_read_bytes(model, cache) -> int:
    """K and V bytes one step's attention reads, from the cache's tensors: every layer reads its own
    buffers, and a K/V-sharing layer those of the last earlier layer of its type that stores them
    (Gemma 4's ``shared_kv_states``): at E2B a full layer's buffer is read by 7 layers, not held 7
    times. A static shape reads a whole buffer, filled or not."""
    config = model.config.get_text_config()
    owner, total = {}, 0
    for i, (kind, decoder) in enumerate(zip(config.layer_types, model.model.layers)):
        if not decoder.self_attn.is_kv_shared_layer:
            owner[kind] = i
        layer = cache.layers[owner[kind]]
        total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total


def device_bytes(model, cache: Cache) -> int:
    """Weights and buffers (tied ones once) plus the KV cache, from their tensors."""
    return sum(r["bytes"] for r in memory_report(model)) + cache_bytes(cache)


def greedy_step(model, cache: Cache, token, position):
    """One decode step: the last token in, the next greedy token and its position out."""
    logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True), position + 1


class Decoder:
    """The model with a static cache, a compiled prefill per bucket and one compiled decode step.

    Args: ``model``, a Gemma 4 text model (``Gemma4ForCausalLM``) stripped of compressed-tensors'
    wrappers, on ``backend``'s device; ``backend``, a ``Backend``; ``max_len``, the positions
    the cache holds (prompt + new tokens); ``sampling``, a ``GenerationConfig`` whose
    ``do_sample``, ``temperature``, ``top_k`` and ``top_p`` the compiled step applies (None:
    greedy; see ``helpers.sampling``); ``compile_options`` go to ``torch.compile``.

    ``decode_step(token, position)``: ``token`` and ``position`` are int64 device tensors of
    shape [1, 1]; returns the next token and ``position + 1``, same shapes, still on the device
    (chosen there by ``sampler``: no host round trip). ``step`` is the same, not compiled. With
    ``tokens_per_call`` K > 1, ``generate`` calls ``decode_steps`` instead: K steps in one
    compiled program, returning their tokens [1, K] and the last token and position.
    ``prefill(ids)``: ``ids`` [1, L] int64 on the device; returns the first new token and its
    position. ``generate(ids, new_tokens, ...)``: a list of at most ``new_tokens`` ints.
    """

    def __init__(
        self, model, backend: Backend, max_len: int, tokens_per_call: int = 1, sampling=None, **compile_options
    ):
        if tokens_per_call < 1:
            raise ValueError(f"tokens_per_call={tokens_per_call}: one compiled call makes at least one token")
        self.model, self.backend, self.max_len = model, backend, max_len
        self.tokens_per_call = tokens_per_call
        self.sampler = Sampler(sampling)
        # a device tensor, set in place by generate: a new seed is a new input, not a recompile
        self.seed = torch.zeros(1, dtype=torch.long, device=backend.device)
        self.cache = self.new_cache(model, max_len)
        self.decode_step = backend.compile(self.step, fullgraph=True, **compile_options)
        self.decode_steps = backend.compile(self.steps, fullgraph=True, **compile_options)
        self.prefill_step = backend.compile(self._prefill, fullgraph=True, **compile_options)

    def new_cache(self, model, max_len: int) -> Cache:
        return static_cache(model, max_len)

    def step(self, token, position):
        self.backend.donate(*kv_buffers(self.cache))  # written in place below: reused, not copied (xla)
        logits = self.model(input_ids=token, position_ids=position, cache=self.cache, use_cache=True).logits
        return self.sampler(logits[:, -1], position.view(-1) + 1, self.seed), position + 1

    def steps(self, token, position):
        """``tokens_per_call`` decode steps in one program (unrolled by the trace), each token
        fed to the next on the device: returns their tokens [1, K] and the last token and position."""
        tokens = []
        for _ in range(self.tokens_per_call):
            token, position = self.step(token, position)
            tokens.append(token)
        return torch.cat(tokens, dim=1), token, position

    def _prefill(self, tokens, last):
        self.backend.donate(*kv_buffers(self.cache))
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        # the head on the last real position only, not on the whole bucket: at E2B's vocabulary of
        # 262,144 a 4096-token bucket's logits would be 2.1 GB of bf16 at the prefill's peak
        logits = self.model(
            input_ids=tokens, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=last
        ).logits
        return self.sampler(logits[0], last + 1, self.seed)  # the token after the last real one

    def bucket(self, length: int) -> int:
        """The padded prefill length: the smallest bucket that holds the prompt."""
        size = cache_length(length)
        if size in PREFILL_BUCKETS and size <= self.max_len:
            return size
        raise ValueError(f"a {length}-token prompt needs more than the cache's {self.max_len} positions")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, start: int = 0):
        """The prompt, right-padded to its bucket, through the model; returns the first new
        token and its position (device tensors). Padding comes after the prompt, so causal
        attention keeps it out of every real position; the cache is then rewound over it."""
        if start:
            raise ValueError("a static cache's prefill starts at 0: RingDecoder goes on from a position")
        length = ids.shape[1]
        padded = torch.zeros(1, self.bucket(length), dtype=ids.dtype, device=ids.device)
        padded[:, :length] = ids
        set_length(self.cache, 0)
        token = self.prefill_step(padded, torch.tensor([length - 1], device=ids.device))
        set_length(self.cache, length)
        return token, torch.tensor([[length]], device=ids.device)

    @torch.no_grad()  # as generate runs it: with grad on, dynamo would compile the step again
    def call(self, token, position):
        """One compiled call: ``decode_step`` (one token), or with ``tokens_per_call`` K > 1
        ``decode_steps`` (notebook 07: K tokens in one program). Returns the tokens it made [1, K]
        and the last token and position, all still on the device."""
        if self.tokens_per_call == 1:
            token, position = self.decode_step(token, position)
            return token, token, position
        return self.decode_steps(token, position)

    def check_room(self, length: int, new_tokens: int, start: int = 0) -> None:
        """Refuse, with the numbers, a run the cache cannot hold (the last call makes K tokens)."""
        k = self.tokens_per_call
        if start + length + new_tokens + k - 1 > self.max_len:
            extra = f" (+ {k - 1}: the last call makes {k})" if k > 1 else ""
            held = f"{start} positions held + " if start else ""
            raise ValueError(
                f"{held}prompt {length} + {new_tokens} new tokens{extra} exceed the cache's {self.max_len} positions"
            )

    @torch.no_grad()
    def generate(self, ids, new_tokens: int, readback_every: int = 16, stop_ids=None, streamer=None, **later):
        """At most ``new_tokens`` tokens after ``ids`` [1, L], each chosen on the device and fed
        straight back; read to the host every ``readback_every`` tokens (1: every token) and at
        the end, where ``Stops`` checks them: after the first of ``stop_ids`` (default: the
        model's, as ``generate``; ``()``: exactly ``new_tokens``, for timing). A transformers
        ``streamer`` gets the prompt, then each chunk. What later notebooks add, in ``later``:
        ``start`` (06, 08: the prompt goes on after that many positions in the cache), ``seed``
        (08: the sampler's), ``stop_strings`` with ``tokenizer`` (08)."""
        start, seed = later.pop("start", 0), later.pop("seed", 0)
        self.check_room(ids.shape[1], new_tokens, start)
        stops = Stops(self.model, ids[0].tolist(), stop_ids, **later)
        if streamer is not None:
            streamer.put(ids.cpu())
        self.seed.fill_(seed)
        token, position = self.prefill(ids, start)
        tokens, pending, made = [], [token], 1
        while True:
            last = made >= new_tokens
            if last or made - len(tokens) >= readback_every:  # one host round trip per chunk
                self.backend.flush()
                chunk, stopped = stops.cut(torch.cat(pending, dim=1)[0].tolist()[: new_tokens - len(tokens)])
                tokens, pending = tokens + chunk, []
                if streamer is not None:
                    streamer.put(torch.tensor(chunk))
                if last or stopped:
                    if streamer is not None:
                        streamer.end()
                    return tokens
            block, token, position = self.call(token, position)
            pending.append(block)
            made += self.tokens_per_call


@torch.no_grad()
def profile_steps(decoder: Decoder, ids, steps: int = 8, rows: int = 8) -> str:
    """Where the time of ``steps`` compiled decode calls goes, after a prefill of ``ids``:
    torch.profiler's table of the ``rows`` ops with the most self time, host (CPU) activity
    everywhere and the GPU's kernels on cuda. On tpu and xla it sees the host's side only
    (dispatch, guards, waiting for the device); the device's own ops are in the backend's
    profiler (TorchTPU's, PyTorch/XLA's ``torch_xla.debug.profiler``), not wired in here."""
    from torch.profiler import profile

    token, position = decoder.prefill(ids)
    decoder.backend.sync()
    with profile(activities=decoder.backend.profiler_activities) as prof:
        for _ in range(steps):
            _, token, position = decoder.call(token, position)
        decoder.backend.flush()
        decoder.backend.sync()
    return prof.key_averages().table(sort_by=decoder.backend.profiler_sort, row_limit=rows)


@contextlib.contextmanager
def no_recompiles():
    """A recompile inside the block raises instead of silently compiling again."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def timed_generate(decoder: Decoder, ids, new_tokens: int, readback_every: int, repeats: int = 3) -> dict:
    """``repeats`` timed runs of exactly ``new_tokens`` (no stop), each after a prefill timed
    alone: prefill seconds (median), and decode tokens/s over the tokens after the first (a
    run's time less its prefill's), median and per run; ``tokens``: the runs' tokens up to the
    first stop id (every run must give the same)."""
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


def hf_static_cache_compiles(model, ids, backend: Backend, steps: int) -> tuple[list[int], str | None]:
    """The trap this notebook avoids, counted: transformers' own ``StaticCache`` in a decode
    step compiled with static shapes. Its sliding layers count tokens in a Python int, so every
    position is a new guard: graphs compiled at each of ``steps`` steps. Dynamo's ``eager``
    backend keeps the count cheap: when dynamo recompiles does not depend on the backend.
    Returns the graphs compiled per step, and dynamo's error if it gave up (its recompile limit)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 1)

    compiled = torch.compile(
        functools.partial(greedy_step, model, cache), backend="eager", dynamic=False, fullgraph=True
    )
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position = torch.tensor([[ids.shape[1]]], device=ids.device)
        counts = []
        torch._dynamo.reset()
        for _ in range(steps):
            try:
                with backend.compile_counter() as count:
                    token, position = compiled(token, position)
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                return counts, str(err).splitlines()[0]
            counts.append(count.graphs)
    return counts, None
