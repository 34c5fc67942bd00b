"""A ring KV cache: each sliding-window layer keeps exactly ``sliding_window`` positions
(position p in slot p mod window), each full-attention layer a buffer up to the maximum
context, KV-sharing layers nothing. Masks come from absolute positions, so a slot's position
is always known; long prompts go through in fixed-size chunks, the last one padded. Attention
reads each K/V head once for the query heads that share it (``grouped_attention``)."""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, StaticLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .decode import Decoder, allocated_layers, kv_buffers

EMPTY = -1  # the position of a slot never written
GROUPED = "grouped_sdpa"  # the attention implementation ``group_query_heads`` sets


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention with the query heads that share a K/V head stacked along the
    queries ([B, H, S, D] -> [B, H_kv, H / H_kv * S, D]), so K and V are read as the cache holds
    them. transformers' own SDPA attention repeats them for every query head (``repeat_kv``)
    wherever a mask is given and in every compiled graph: a copy 8x a full layer's K and V at
    E2B's one K/V head, 1.08 GB of K alone at 131,328 positions (``e2b.full_attention_bytes``).
    Same arguments and return as transformers' attention functions."""
    if kwargs.get("softcap") is not None:
        raise ValueError("grouped attention has no softcap, as SDPA's has none: use eager attention")
    batch, heads, queries, dim = query.shape
    groups = heads // key.shape[1]
    query = query.reshape(batch, key.shape[1], groups * queries, dim)  # row g * S + i: head g's query i
    if attention_mask is not None and queries > 1:
        if attention_mask.shape[1] != 1:
            raise ValueError(f"a mask per head ({attention_mask.shape[1]}) cannot be grouped: one for all heads")
        attention_mask = attention_mask.repeat(1, 1, groups, 1)  # each head's queries see what query i sees
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


# Registered the way transformers documents for a custom attention: the function, and SDPA's
# boolean masks for it (a name without a mask function of its own gets none).
AttentionInterface.register(GROUPED, grouped_attention)
AttentionMaskInterface.register(GROUPED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def group_query_heads(model) -> str:
    """Make ``model``'s attention ``grouped_attention`` (the same values as transformers' SDPA
    attention, without the copies of K and V per query head), in place. Returns the attention
    implementation it had, to set back with ``model.set_attn_implementation``."""
    before = model.config._attn_implementation
    model.set_attn_implementation(GROUPED)
    return before


def _chunk(kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's absolute positions [C] and which are not padding [C], passed from the model's
    forward through the attention kwargs to every layer: inputs of the step, not cache state."""
    kwargs = kwargs.get("kwargs", kwargs)
    if "ring_positions" not in kwargs:
        raise ValueError(
            "a RingCache needs each forward's absolute positions and the ring's masks, which transformers' "
            "generate does not give: call model.generate(..., cache=cache) inside "
            "`with helpers.ring.inside_generate(model):`, or use helpers.ring.RingDecoder"
        )
    return kwargs["ring_positions"], kwargs["ring_valid"]


class RingLayer(StaticLayer):
    """A sliding-window layer's K/V in a ring of ``window`` slots (a ``StaticLayer`` of that
    length). ``update`` returns the ring as it was followed by the chunk (window + C keys: all
    a query of the chunk may need), then writes the chunk's real positions into their slots;
    padding is never written."""

    is_sliding = True

    def __init__(self, window: int):
        super().__init__(window)
        self.window = window

    def update(self, key_states, value_states, *args, **kwargs):
        keys = torch.cat([self.keys, key_states], dim=2)
        values = torch.cat([self.values, value_states], dim=2)
        positions, valid = _chunk(kwargs)
        if key_states.shape[2] > self.window:  # generate's prefill, the whole prompt: its last window stays
            key_states, value_states = key_states[:, :, -self.window :], value_states[:, :, -self.window :]
            positions, valid = positions[-self.window :], valid[-self.window :]
        slots = positions % self.window  # distinct: at most a window of positions
        keep = valid.view(1, 1, -1, 1)
        self.keys.index_copy_(2, slots, torch.where(keep, key_states, self.keys.index_select(2, slots)))
        self.values.index_copy_(2, slots, torch.where(keep, value_states, self.values.index_select(2, slots)))
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window + query_length, 0


class FullLayer(StaticLayer):
    """A full-attention layer's K/V for every position up to the maximum context, written at
    the chunk's absolute positions; padding is never written. The padded last chunk may run
    past ``max_len``: those positions wrap onto the first slots (mod ``max_len``), where the
    slot's own value is written back, so ``max_len`` need not be a multiple of the chunk."""

    def update(self, key_states, value_states, *args, **kwargs):
        positions, valid = _chunk(kwargs)
        slots = positions % self.max_cache_len  # distinct while the chunk is no longer than max_len
        keep = valid.view(1, 1, -1, 1)
        self.keys.index_copy_(2, slots, torch.where(keep, key_states, self.keys.index_select(2, slots)))
        self.values.index_copy_(2, slots, torch.where(keep, value_states, self.values.index_select(2, slots)))
        return self.keys, self.values


class RingCache(Cache):
    """The model's cache through ``past_key_values``/``cache``: ring layers for sliding
    attention, full layers for full attention, nothing for KV-sharing layers; all allocated now.

    Args: ``model``, a Gemma 4 text model on its device (its dtype is the cache's);
    ``max_len``, the positions a full layer holds (any size at least ``chunk_size``);
    ``chunk_size``, the tokens per forward, 1..``sliding_window``. Sliding layers hold K and V
    of shape [1, kv_heads, window, head_dim], full layers [1, kv_heads, max_len, head_dim];
    ``slot_positions`` [window] int64 is the absolute position in each ring slot (-1: empty).

    Per chunk: ``masks(positions)`` for the model's ``attention_mask``, the forward with
    ``ring_positions`` and ``ring_valid``, then ``commit(positions, valid)`` records which
    position each ring slot now holds. Inside ``generate_on_ring``, hooks on the model do these
    from ``generate``'s own inputs; its prefill may be any length up to ``max_len``."""

    def __init__(self, model, max_len: int, chunk_size: int):
        config = model.config.get_text_config()
        self.window, self.max_len, self.chunk_size = config.sliding_window, max_len, chunk_size
        if not 0 < chunk_size <= self.window:
            raise ValueError(
                f"chunk size {chunk_size} must be 1..{self.window} (the sliding window): a longer "
                "chunk would write two positions into one ring slot"
            )
        if max_len < chunk_size:
            raise ValueError(
                f"max_len {max_len} must be at least the chunk size {chunk_size}: the padded last "
                "chunk's positions past max_len wrap onto the first slots, which must be distinct"
            )
        self.attn_implementation = config._attn_implementation
        self.slot_positions = torch.full(
            (self.window,), EMPTY, dtype=torch.long, device=next(model.parameters()).device
        )
        super().__init__(
            layers=allocated_layers(
                model, lambda attn: RingLayer(self.window) if attn.is_sliding else FullLayer(max_len)
            )
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions seen so far (the latest is always in the ring): where ``generate`` goes on."""
        return int(self.slot_positions.max()) + 1

    def reset(self) -> None:
        """Forget every position (the buffers are not cleared: masks keep stale slots out)."""
        self.slot_positions.fill_(EMPTY)

    def masks(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Which keys each query of the chunk sees, by absolute position: a sliding layer's
        keys are its ring then the chunk (q - window < k <= q; never-written slots are out), a
        full layer's keys are positions 0..max_len-1 (k <= q)."""
        q = positions[:, None]
        ring = torch.cat([self.slot_positions, positions])[None, :]
        sliding = (ring <= q) & (ring > q - self.window) & (ring != EMPTY)
        # in int32: a [chunk, max_len] comparison, 64-bit work a TPU emulates in pairs otherwise
        full = torch.arange(self.max_len, dtype=torch.int32, device=q.device)[None, :] <= q.to(torch.int32)
        return {"sliding_attention": self._as_mask(sliding), "full_attention": self._as_mask(full)}

    def _as_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        allowed = allowed[None, None]
        if ALL_MASK_ATTENTION_FUNCTIONS.get(self.attn_implementation) is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]:
            return allowed  # an implementation that takes SDPA's boolean masks (SDPA's own, grouped)
        # eager attention adds its mask to the scores
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)

    def commit(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        if positions.shape[0] > self.window:  # as in RingLayer.update (XLA refuses a slice past the start)
            positions, valid = positions[-self.window :], valid[-self.window :]
        slots = positions % self.window
        kept = torch.where(valid, positions, self.slot_positions.index_select(0, slots))
        self.slot_positions.index_copy_(0, slots, kept)


@contextlib.contextmanager
def inside_generate(model):
    """Inside the block, transformers' own ``model.generate(ids, cache=RingCache(...), ...)``
    runs on the ring with any generation config (greedy or sampled, a streamer, stop strings):
    hooks on the text model give each forward called with a ``RingCache`` the ring's masks and
    absolute positions, and record after it which position each ring slot holds. By hand:
    ``generate`` builds masks that assume keys at positions 0..n, not a ring. The hooks are
    removed when the block ends."""

    def before(module, args, kwargs):
        cache = kwargs.get("cache")
        if not isinstance(cache, RingCache) or "ring_positions" in kwargs:
            return None
        inputs = kwargs.get("input_ids")
        length = (inputs if inputs is not None else kwargs["inputs_embeds"]).shape[1]
        position_ids = kwargs.get("position_ids")
        if position_ids is None:
            position_ids = (torch.arange(length) + cache.get_seq_length()).to(cache.slot_positions.device)[None]
        positions = position_ids[0]
        if positions.shape[0] > cache.max_len:
            raise ValueError(f"a {positions.shape[0]}-token forward exceeds the ring cache's {cache.max_len} positions")
        valid = torch.ones_like(positions, dtype=torch.bool)
        cache.pending = positions, valid  # committed by the forward hook, after every layer has read the ring
        kwargs |= {"position_ids": position_ids, "attention_mask": cache.masks(positions)}
        return args, kwargs | {"ring_positions": positions, "ring_valid": valid}

    def after(module, args, kwargs, output):
        cache = kwargs.get("cache")
        if isinstance(cache, RingCache) and getattr(cache, "pending", None) is not None:
            cache.commit(*cache.pending)
            cache.pending = None

    text_model = model.get_decoder()
    handles = [
        text_model.register_forward_pre_hook(before, with_kwargs=True),
        text_model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class RingDecoder(Decoder):
    """Notebook 04's decoder on a ring cache: one compiled decode step for every position, and
    one compiled prefill chunk of ``chunk_size`` tokens for prompts of any length.

    Args as ``Decoder``'s, plus ``chunk_size`` (default: the sliding window) and ``buckets``,
    shorter lengths the full layers' buffers may take on the way to ``max_len``. ``max_len``
    may be any size (131,328 for the source's headline context). A static shape reads its whole
    buffer every step; with buckets a step runs on the smallest one that holds the context, and
    moving up copies the cache once into the next: one compiled step (and prefill chunk) per
    bucket, each reading only its own buffer. Same calls and shapes as ``Decoder``;
    ``forward_chunk(tokens [1, C], positions [1, C], valid [C] bool)`` returns the logits
    [1, C, vocab] and records the chunk's real positions in the ring. ``at``: the positions the
    cache holds, counted on the host."""

    def __init__(self, model, backend, max_len: int, chunk_size: int | None = None, buckets=(), **compile_options):
        self.chunk_size = chunk_size or model.config.get_text_config().sliding_window
        self.buckets = sorted({*buckets, max_len})
        if self.buckets[0] < self.chunk_size:
            name = "max_len" if self.buckets[0] == max_len else "bucket"
            raise ValueError(
                f"{name} {self.buckets[0]} must be at least the chunk size {self.chunk_size}: the padded "
                "last chunk's positions wrap onto the first slots, which must be distinct"
            )
        if self.buckets[-1] != max_len:
            raise ValueError(f"buckets {sorted(buckets)} must be at most max_len {max_len}")
        self.at = 0
        super().__init__(model, backend, max_len, **compile_options)

    def new_cache(self, model, max_len: int) -> RingCache:
        return RingCache(model, self.buckets[0], self.chunk_size)  # the smallest bucket first

    def fit(self, end: int) -> None:
        """Make the cache the smallest bucket that holds positions 0..``end``-1: a larger one is
        allocated and what the cache holds copied into it once (the ring's slots whole, the full
        layers' positions so far); a new prompt from position 0 may move back down, copying nothing."""
        bucket = next(b for b in self.buckets if b >= end)
        if bucket == self.cache.max_len or (bucket < self.cache.max_len and self.at):
            return
        old, self.cache = self.cache, RingCache(self.model, bucket, self.chunk_size)
        if self.at:  # moving up mid-context: the same slots, a longer buffer for the full layers
            for new, held in zip(self.cache.layers, old.layers):
                if held.is_initialized:
                    new.keys[:, :, : held.keys.shape[2]].copy_(held.keys)
                    new.values[:, :, : held.values.shape[2]].copy_(held.values)
            self.cache.slot_positions.copy_(old.slot_positions)

    @torch.no_grad()
    def call(self, token, position):
        """``Decoder.call`` on the smallest bucket that holds the call's position."""
        self.fit(self.at + 1)
        self.at += 1
        return super().call(token, position)

    def forward_chunk(self, tokens, positions, valid):
        """Logits for ``tokens`` [1, C] at ``positions`` [1, C] (``valid`` [C]: not padding)."""
        logits = self.model(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=self.cache.masks(positions[0]),
            cache=self.cache,
            use_cache=True,
            ring_positions=positions[0],
            ring_valid=valid,
        ).logits
        self.cache.commit(positions[0], valid)
        return logits

    def step(self, token, position):
        self.backend.donate(*kv_buffers(self.cache))  # written in place below: reused, not copied (xla)
        logits = self.forward_chunk(token, position, torch.ones(1, dtype=torch.bool, device=token.device))
        return self.pick(logits[:, -1], position.view(-1) + 1), position + 1

    def _prefill(self, tokens, positions, valid, last):
        self.backend.donate(*kv_buffers(self.cache))
        logits = self.forward_chunk(tokens, positions, valid)[0].index_select(0, last)
        return self.pick(logits, positions[0].index_select(0, last) + 1)

    def chunks(self, length: int, device, offset: int = 0):
        """(start, positions [1, C], valid [C]) for each fixed-size chunk of a ``length``-token
        prompt whose first token goes at position ``offset``; ``start`` counts from the prompt's."""
        for start in range(0, length, self.chunk_size):
            # made on the host, then copied: PyTorch/XLA fed a compiled chunk the first call's
            # values for positions computed lazily on the device (measured: slots never advanced)
            positions = torch.arange(start, start + self.chunk_size)
            yield start, (positions + offset)[None].to(device), (positions < length).to(device)

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, start: int = 0):
        """The prompt in chunks of ``chunk_size`` tokens, the last one padded: a prompt of any
        length compiles one program, and no attention matrix is larger than C x (window + C)
        or C x max_len. ``start`` > 0: the tokens go on from that position, after what the
        cache holds (a chat's next turn; nothing before it is run again). Returns the first
        new token and its position (device tensors)."""
        length = ids.shape[1]
        if start + length > self.max_len:
            held, verb = (f"{start} positions held + ", "exceed") if start else ("", "exceeds")
            raise ValueError(f"{held}a {length}-token prompt {verb} the cache's {self.max_len} positions")
        self.at = start
        self.fit(start + length)
        if start == 0:
            self.cache.reset()
        self.at = start + length
        for first, positions, valid in self.chunks(length, ids.device, start):
            tokens = torch.zeros(1, self.chunk_size, dtype=ids.dtype, device=ids.device)
            tokens[:, : min(self.chunk_size, length - first)] = ids[:, first : first + self.chunk_size]
            last = torch.tensor([min(length - 1 - first, self.chunk_size - 1)], device=ids.device)
            token = self.prefill_step(tokens, positions, valid, last)
        return token, torch.tensor([[start + length]], device=ids.device)
