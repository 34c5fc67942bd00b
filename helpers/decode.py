"""A compiled decode step: one token in, the next out, the KV cache updated in place, all on the device, compiled once."""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, StaticLayer

from .backend import Backend
from .checkpoint import compression_report
from .generate import Stops

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
READBACK_EVERY = 16  # tokens made between reads to the host: one round trip per block, not per token


def cache_length(positions: int) -> int:
    """A static cache's length for ``positions``: the smallest bucket that holds them (a step reads its whole buffer),
    shared by runs of similar length."""
    return next((size for size in PREFILL_BUCKETS if size >= positions), positions)


def strip_compressed_wrappers(model) -> dict:
    """Make the model plain with compressed-tensors' own API: weights decompressed in place, forwards unwrapped,
    quantization parameters and offloading wrappers dropped."""
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
    """``StaticLayer``s for ``max_len`` positions, allocated now. Not ``StaticCache``: its sliding layers count tokens
    in a Python int, so a compiled step recompiles at every position."""
    return Cache(layers=allocated_layers(model, lambda attn: StaticLayer(max_len)))


def allocated_layers(model, make_layer) -> list:
    """One ``make_layer(self_attn)`` per layer, allocated now where it owns K/V (a sharing layer stores none)."""
    layers = []
    for decoder in model.model.layers:
        attn = decoder.self_attn
        layer = make_layer(attn)
        if not attn.is_kv_shared_layer:
            weight = attn.k_proj.weight
            kv = torch.zeros(
                1, attn.k_proj.out_features // attn.head_dim, 1, attn.head_dim, dtype=weight.dtype, device=weight.device
            )
            layer.lazy_initialization(kv, kv)
        layers.append(layer)
    return layers


def set_length(cache: Cache, length) -> None:
    """Rewind or advance every allocated layer to ``length`` positions (a device tensor: the same program for any)."""
    for layer in cache.layers:
        if layer.is_initialized:  # not fill_: with a tensor, PyTorch/XLA runs it on the host, splitting the program
            layer.cumulative_length.zero_().add_(length)


def kv_buffers(cache) -> list[torch.Tensor]:
    """The K and V tensors a cache holds (none for a K/V-sharing layer)."""
    return [
        t
        for layer in getattr(cache, "layers", [])
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
        if t is not None
    ]


def cache_bytes(cache) -> int:
    """K and V bytes the cache holds (a static or ring cache: all of them read each step)."""
    return sum(t.numel() * t.element_size() for t in kv_buffers(cache))


def cache_read_bytes(model, cache) -> int:
    """K and V bytes a step's attention reads: a K/V-sharing layer reads its owner's (at E2B a full layer's buffer is
    read 7 times)."""
    config = model.config.get_text_config()
    owner, total = {}, 0
    for i, (kind, decoder) in enumerate(zip(config.layer_types, model.model.layers)):
        if not decoder.self_attn.is_kv_shared_layer:
            owner[kind] = i
        layer = cache.layers[owner[kind]]
        total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total


def skip_shared_layers(model) -> None:
    """Run the layers that keep no K/V of their own, and the head, on the prompt rows ``logits_to_keep`` names when it is
    a tensor, as transformers does for the last rows when it is an int (``_maybe_slice_kv_shared_inputs``, its cut,
    taken at our rows): a padded prompt's last real row is not its last. Their K/V come from earlier layers, so no
    other row needs them. Idempotent."""
    text = model.model
    own = type(text)._maybe_slice_kv_shared_inputs
    first_shared = len(text.layers) - text.config.num_kv_shared_layers

    def cut(hidden, per_layer, rotary, masks, logits_to_keep, cache=None, **kwargs):
        if not torch.is_tensor(logits_to_keep) or cache is None:
            return own(text, hidden, per_layer, rotary, masks, logits_to_keep, cache=cache, **kwargs)
        rows = logits_to_keep.view(-1)
        # a mask of None is SDPA's causal flag, which counts rows from the first: for our rows, keys up to the row
        keys = {kind: cache.layers[i].keys.shape[2] for i, kind in enumerate(text.config.layer_types[:first_shared])}
        causal = {kind: torch.arange(n, device=rows.device) <= rows[:, None] for kind, n in keys.items()}
        return (
            hidden.index_select(1, rows),
            None if per_layer is None else per_layer.index_select(1, rows),
            {kind: (cos.index_select(1, rows), sin.index_select(1, rows)) for kind, (cos, sin) in rotary.items()},
            {kind: causal[kind][None, None] if m is None else m.index_select(2, rows) for kind, m in masks.items()},
        )

    text._maybe_slice_kv_shared_inputs = cut


def greedy_step(model, cache: Cache, token, position):
    """One decode step: the last token in, the next greedy token and its position out."""
    logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True), position + 1


class Decoder:
    """The model on a static cache: a compiled prefill per bucket and one compiled decode step, ``token, position ->
    next token, position + 1``, all int64 device tensors [1, 1], the token chosen by ``pick``."""

    def __init__(self, model, backend: Backend, max_len: int, **compile_options):
        self.model, self.backend, self.max_len = model, backend, max_len
        skip_shared_layers(model)  # a prefill's rows past the last real one stop at the last layer that keeps K/V
        self.cache = self.new_cache(model, max_len)
        self.decode_step = backend.compile(self.step, fullgraph=True, **compile_options)
        self.prefill_step = backend.compile(self.prefill_forward, fullgraph=True, **compile_options)

    def new_cache(self, model, max_len: int) -> Cache:
        return static_cache(model, max_len)

    def pick(self, logits, positions):
        """The next token [N, 1] from logits [N, vocab], to go at ``positions`` [N]: the argmax."""
        return logits.argmax(-1, keepdim=True)

    def step(self, token, position):
        self.backend.donate(*kv_buffers(self.cache))  # written in place below: reused, not copied (xla)
        logits = self.model(input_ids=token, position_ids=position, cache=self.cache, use_cache=True).logits
        return self.pick(logits[:, -1], position.view(-1) + 1), position + 1

    def prefill_forward(self, tokens, last):
        self.backend.donate(*kv_buffers(self.cache))
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        # layers 15-34 and the head on the last real position only: a 4096-token bucket's logits would be 2.1 GB at E2B
        logits = self.model(
            input_ids=tokens, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=last
        ).logits
        return self.pick(logits[0], last + 1)  # the token after the last real one

    def bucket(self, length: int) -> int:
        """The padded prefill length: the smallest bucket that holds the prompt."""
        size = cache_length(length)
        if size in PREFILL_BUCKETS and size <= self.max_len:
            return size
        raise ValueError(f"a {length}-token prompt needs more than the cache's {self.max_len} positions")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, start: int = 0):
        """The prompt right-padded to its bucket (causal attention keeps padding out; the cache is rewound over it): the
        first new token and its position."""
        if start:
            raise ValueError("a static cache's prefill starts at 0: RingDecoder goes on from a position")
        length = ids.shape[1]
        # built on the host, then copied: a TPU compiles an eager op per shape (deferred, per scalar value too)
        padded = torch.zeros(1, self.bucket(length), dtype=ids.dtype)
        padded[:, :length] = ids.cpu()
        lengths = torch.tensor([0, length - 1, length]).to(ids.device)  # data copied, not a constant per length
        zero, last, end = lengths[0], lengths[1:2], lengths[2]
        set_length(self.cache, zero)
        token = self.prefill_step(padded.to(ids.device), last)
        set_length(self.cache, end)
        return token, end.view(1, 1)

    @torch.no_grad()  # as generate runs it: with grad on, dynamo would compile the step again
    def call(self, token, position):
        """One compiled call: the tokens it made [1, K] (K = 1 here; notebook 07 makes more), the last token and
        position."""
        token, position = self.decode_step(token, position)
        return token, token, position

    def check_room(self, length: int, new_tokens: int, start: int = 0, extra: int = 0) -> None:
        """Refuse, with the numbers, a run the cache cannot hold."""
        if start + length + new_tokens + extra > self.max_len:
            held = f"{start} positions held + " if start else ""
            more = f" (+ {extra}: the last call's)" if extra else ""
            raise ValueError(
                f"{held}prompt {length} + {new_tokens} new tokens{more} exceed the cache's {self.max_len} positions"
            )

    def stops(self, history: list[int], stop_ids) -> Stops:
        """Where a run stops: after the first of ``stop_ids`` (None: the model's)."""
        return Stops(self.model, history, stop_ids)

    @torch.no_grad()
    def generate(
        self, ids, new_tokens: int, readback_every: int = READBACK_EVERY, stop_ids=None, streamer=None, start: int = 0
    ):
        """At most ``new_tokens`` tokens after ``ids`` (at ``start``), fed straight back on the device, read to the host
        every ``readback_every`` and cut by ``stops`` (``stop_ids=()``: exactly ``new_tokens``)."""
        self.check_room(ids.shape[1], new_tokens, start)
        stops = self.stops(ids.cpu()[0].tolist(), stop_ids)  # a copy, not a device op per prompt length
        if streamer is not None:
            streamer.put(ids.cpu())
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
            made += block.shape[1]


def hf_static_cache_compiles(model, ids, backend: Backend, steps: int) -> tuple[list[int], str | None]:
    """Graphs compiled per step over transformers' ``StaticCache`` (its sliding layers count tokens in
    a Python int: each position is a new guard), and dynamo's error at its recompile limit."""
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
        torch.compiler.reset()
        for _ in range(steps):
            try:
                with backend.compile_counter() as count:
                    token, position = compiled(token, position)
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                return counts, str(err).splitlines()[0]
            counts.append(count.graphs)
    return counts, None
