"""A compiled decode step: one token in, the next token out, the KV cache updated in place,
every input on the device, compiled once and reused for every token."""

from __future__ import annotations

import contextlib
import functools
import time

import torch
from transformers.cache_utils import Cache, StaticLayer

from . import generate as g
from .backend import Backend

STEP = "04 compiled decode"
SOURCE_TOK_S = 32  # the source's figure, TPU v5e-1: 31-33 tok/s
PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def strip_compressed_wrappers(model) -> dict:
    """Make the model plain again with compressed-tensors' own API: decompress the weights once,
    in place (if the first forward has not yet), unwrap every quantized forward and drop the
    quantization parameters, and remove the offloading wrappers. Returns what was removed."""
    from compressed_tensors.offload import remove_dispatch
    from compressed_tensors.quantization.quant_metadata import QuantizationMetadata

    from .checkpoint import compression_report

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
    return {"decompressed now": decompressed,
            "wrapped forwards removed": before["modules with a wrapped forward"] - after["modules with a wrapped forward"],
            "hooks removed": before["modules with forward hooks"] - after["modules with forward hooks"],
            "wrapped forwards left": after["modules with a wrapped forward"]}


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
            kv = torch.zeros(1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim,
                             dtype=attn.k_proj.weight.dtype, device=attn.k_proj.weight.device)
            layer.lazy_initialization(kv, kv)
        layers.append(layer)
    return layers


def set_length(cache: Cache, length: int) -> None:
    """Rewind or advance every allocated layer to ``length`` positions, in place."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.cumulative_length.fill_(length)


def cache_bytes(cache: Cache) -> int:
    return sum(l.keys.numel() * l.keys.element_size() * 2 for l in cache.layers if l.is_initialized)


def device_bytes(model, cache: Cache) -> int:
    """Weights and buffers (tied ones once) plus the KV cache, from their tensors."""
    from .checkpoint import memory_report

    return sum(r["bytes"] for r in memory_report(model)) + cache_bytes(cache)


def greedy_step(model, cache: Cache, token, position):
    """One decode step: the last token in, the next greedy token and its position out."""
    logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True), position + 1


class Decoder:
    """The model with a static cache, a compiled prefill per bucket and one compiled decode step.

    ``decode_step(token, position)`` takes the last token and its position (both device
    tensors of shape [1, 1]) and returns the next token and position, still on the device:
    greedy argmax, no host round trip.
    """

    def __init__(self, model, backend: Backend, max_len: int, **compile_options):
        self.model, self.backend, self.max_len = model, backend, max_len
        self.cache = self.new_cache(model, max_len)
        self.decode_step = backend.compile(self._step, fullgraph=True, **compile_options)
        self.prefill_step = backend.compile(self._prefill, fullgraph=True, **compile_options)

    def new_cache(self, model, max_len: int) -> Cache:
        return static_cache(model, max_len)

    def _step(self, token, position):
        return greedy_step(self.model, self.cache, token, position)

    def _prefill(self, tokens, last):
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        logits = self.model(input_ids=tokens, position_ids=positions, cache=self.cache, use_cache=True).logits
        return logits[0].index_select(0, last).argmax(-1, keepdim=True)  # the token after the last real one

    def bucket(self, length: int) -> int:
        """The padded prefill length: the smallest bucket that holds the prompt."""
        for size in PREFILL_BUCKETS:
            if length <= size <= self.max_len:
                return size
        raise ValueError(f"a {length}-token prompt needs more than the cache's {self.max_len} positions")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor):
        """The prompt, right-padded to its bucket, through the model; returns the first new
        token and its position (device tensors). Padding comes after the prompt, so causal
        attention keeps it out of every real position; the cache is then rewound over it."""
        length = ids.shape[1]
        padded = torch.zeros(1, self.bucket(length), dtype=ids.dtype, device=ids.device)
        padded[:, :length] = ids
        set_length(self.cache, 0)
        token = self.prefill_step(padded, torch.tensor([length - 1], device=ids.device))
        set_length(self.cache, length)
        return token, torch.tensor([[length]], device=ids.device)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, new_tokens: int, readback_every: int = 16, on_tokens=None,
                 stop_ids=None) -> list[int]:
        """Greedy tokens, at most ``new_tokens``: each chosen on the device and fed straight
        back; read to the host every ``readback_every`` tokens (1: every token) and at the end.
        Stops after the first of ``stop_ids`` (default: the model's, as ``generate``), checked
        once per readback, so without a host round trip per token; ``stop_ids=()``: exactly
        ``new_tokens`` (timing). ``on_tokens(chunk)`` sees each chunk as it is read."""
        if ids.shape[1] + new_tokens > self.max_len:
            raise ValueError(f"prompt {ids.shape[1]} + {new_tokens} new tokens exceed the cache's {self.max_len} positions")
        stops = set(g.stop_ids(self.model) if stop_ids is None else stop_ids)
        token, position = self.prefill(ids)
        tokens, pending = [], [token]
        while True:
            last = len(tokens) + len(pending) == new_tokens
            if last or len(pending) == readback_every:
                self.backend.flush()
                chunk = g.until_stop(torch.cat(pending, dim=1)[0].tolist(), stops)
                stopped, pending = chunk[-1] in stops, []
                if on_tokens is not None:
                    on_tokens(chunk)
                tokens += chunk
                if last or stopped:
                    return tokens
            token, position = self.decode_step(token, position)
            pending.append(token)


@contextlib.contextmanager
def no_recompiles():
    """A recompile inside the block raises instead of silently compiling again."""
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


def timed_generate(decoder: Decoder, ids, new_tokens: int, readback_every: int) -> dict:
    """One timed run of exactly ``new_tokens`` (no stop): prefill seconds, and decode tokens/s
    over the tokens after the first (the whole run's time less that of a prefill timed alone
    just before it); ``tokens`` up to the first stop id, for comparison."""
    backend = decoder.backend
    start = time.perf_counter()
    token, position = decoder.prefill(ids)
    token.cpu()
    prefill_s = time.perf_counter() - start
    start = time.perf_counter()
    tokens = decoder.generate(ids, new_tokens, readback_every, stop_ids=())
    backend.sync()
    total = time.perf_counter() - start
    return {"tokens": g.until_stop(tokens, g.stop_ids(decoder.model)), "prefill_s": prefill_s,
            "decode_tok_s": (new_tokens - 1) / max(total - prefill_s, 1e-9)}


def bytes_per_token(model, cache: Cache) -> int:
    """Bytes one decode step must read: every weight (the tied embedding fully, as the output
    head's matmul reads it), one row of the per-layer table, and the whole static KV cache
    (attention reads every slot; the mask drops the unused ones afterwards)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    table = model.model.embed_tokens_per_layer.weight
    weights -= table.numel() * table.element_size() - table.shape[1] * table.element_size()
    return weights + cache_bytes(cache)


def hf_static_cache_compiles(model, ids, backend: Backend, steps: int) -> tuple[list[int], str | None]:
    """The trap this notebook avoids, counted: transformers' own ``StaticCache`` in a decode
    step compiled with static shapes. Its sliding layers count tokens in a Python int, so every
    position is a new guard: graphs compiled at each of ``steps`` steps. Dynamo's ``eager``
    backend keeps the count cheap: when dynamo recompiles does not depend on the backend.
    Returns the graphs compiled per step, and dynamo's error if it gave up (its recompile limit)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 1)

    compiled = torch.compile(functools.partial(greedy_step, model, cache), backend="eager", dynamic=False, fullgraph=True)
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


def compiled_run(backend: Backend, results, change_model=None, decoder_class=Decoder) -> dict:
    """Notebook 04's recipe end to end for the tour: load, decompress, strip, optionally
    ``change_model(model)`` (notebook 05 packs its table), compile, generate, time. Returns
    same-tokens-as-the-reference, compilations, decode tok/s (median of 3) and the bytes of
    weights and cache on the device, from their tensors."""
    from . import generate as g

    checkpoint, model, tokenizer, ids = g.load_for_series(backend)
    new_tokens = g.generation_length(backend)
    reference = g.load_reference(checkpoint, backend, ids, new_tokens, results.path.parent)
    with torch.no_grad():
        model(ids)  # decompress, as generate would
    strip_compressed_wrappers(model)
    extra = change_model(model) if change_model else {}
    torch._dynamo.reset()  # count what this step compiles, not a graph an earlier run left cached
    decoder = decoder_class(model, backend, max_len=256)
    with backend.compile_counter() as count:
        tokens = decoder.generate(ids, new_tokens)
    runs = [timed_generate(decoder, ids, new_tokens, readback_every=16)["decode_tok_s"] for _ in range(3)]
    return {"backend": backend.name, "decode_tok_s": sorted(runs)[1], "same_tokens": tokens == reference,
            "compiles": count.graphs, "device_bytes": device_bytes(model, decoder.cache), **extra}


def run_step(backend: Backend, results) -> dict:
    """The tour's compiled-decode step."""
    return results.add(STEP, "compiled step", **compiled_run(backend, results), source_tok_s=SOURCE_TOK_S)
