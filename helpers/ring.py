"""A ring KV cache: a sliding layer keeps ``sliding_window`` positions (p in slot p mod window), a full layer up to the
maximum context; masks from absolute positions; prompts in fixed chunks."""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, StaticLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from .decode import READBACK_EVERY, Decoder, allocated_layers, kv_buffers

EMPTY = -1  # the position of a slot never written
GROUPED = "grouped_sdpa"  # the attention implementation ``group_query_heads`` sets


def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention with the query heads that share a K/V head stacked along the queries, so K and V are
    read as the cache holds them, not repeated per head (``repeat_kv``: 1.08 GB of K alone at E2B's 131,328
    positions). Same arguments and return."""
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


# As transformers documents for a custom attention, with SDPA's boolean masks (a new name gets no mask otherwise).
AttentionInterface.register(GROUPED, grouped_attention)
AttentionMaskInterface.register(GROUPED, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def group_query_heads(model) -> str:
    """Switch ``model`` to ``grouped_attention`` in place; returns the implementation it had, to set back."""
    before = model.config._attn_implementation
    model.set_attn_implementation(GROUPED)
    return before


def _chunk(kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's absolute positions [C] and which are real [C], from the forward's kwargs: inputs, not cache state."""
    kwargs = kwargs.get("kwargs", kwargs)
    if "ring_positions" not in kwargs:
        raise ValueError(
            "a RingCache needs each forward's absolute positions and the ring's masks, which transformers' "
            "generate does not give: call model.generate(..., cache=cache) inside "
            "`with helpers.ring.inside_generate(model):`, or use helpers.ring.RingDecoder"
        )
    return kwargs["ring_positions"], kwargs["ring_valid"]


class RingLayer(StaticLayer):
    """A sliding layer's K/V in a ring of ``window`` slots: ``update`` returns the ring followed by the chunk, then
    writes the chunk's real positions into their slots."""

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


def ring_masks(slots: torch.Tensor, positions: torch.Tensor, window: int, max_len: int):
    """Which keys each query at ``positions`` [C] sees, by absolute position: a sliding layer's keys are the ring
    (``slots``: each slot's position, -1 empty) then the chunk (q - window < k <= q), a full layer's 0..max_len-1."""
    q = positions[:, None]
    ring = torch.cat([slots, positions])[None, :]
    sliding = (ring <= q) & (ring > q - window) & (ring != EMPTY)
    # in int32: a [chunk, max_len] comparison, 64-bit work a TPU emulates in pairs otherwise
    full = torch.arange(max_len, dtype=torch.int32, device=q.device)[None, :] <= q.to(torch.int32)
    return sliding, full


def as_mask(allowed: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """A boolean mask [Q, K] as ``attn_implementation`` takes it, [1, 1, Q, K]."""
    allowed = allowed[None, None]
    if ALL_MASK_ATTENTION_FUNCTIONS.get(attn_implementation) is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]:
        return allowed  # an implementation that takes SDPA's boolean masks (SDPA's own, grouped)
    # eager attention adds its mask to the scores
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


class FullLayer(StaticLayer):
    """A full layer's K/V at the chunk's absolute positions; the padded last chunk's positions past ``max_len`` wrap
    onto the first slots and write their own values back."""

    def update(self, key_states, value_states, *args, **kwargs):
        positions, valid = _chunk(kwargs)
        slots = positions % self.max_cache_len  # distinct while the chunk is no longer than max_len
        keep = valid.view(1, 1, -1, 1)
        self.keys.index_copy_(2, slots, torch.where(keep, key_states, self.keys.index_select(2, slots)))
        self.values.index_copy_(2, slots, torch.where(keep, value_states, self.values.index_select(2, slots)))
        return self.keys, self.values


class RingCache(Cache):
    """The model's cache, allocated now: ring layers, full layers, nothing for KV-sharing layers; ``slot_positions``,
    each ring slot's position (-1: empty). Per chunk: ``masks``, the forward with ``ring_positions`` and
    ``ring_valid``, then ``commit``."""

    def __init__(self, model, max_len: int, chunk_size: int, spare: int = 0):
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
        slots = self.window + spare  # notebook 09: a rejected draft's slot must not hold a position still needed
        self.slot_positions = torch.full((slots,), EMPTY, dtype=torch.long, device=next(model.parameters()).device)
        super().__init__(
            layers=allocated_layers(model, lambda attn: RingLayer(slots) if attn.is_sliding else FullLayer(max_len))
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions seen so far (the latest is always in the ring): where ``generate`` goes on."""
        return int(self.slot_positions.max()) + 1

    def reset(self) -> None:
        """Forget every position (the buffers are not cleared: masks keep stale slots out)."""
        self.slot_positions.fill_(EMPTY)

    def masks(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        sliding, full = ring_masks(self.slot_positions, positions, self.window, self.max_len)
        return {"sliding_attention": self._as_mask(sliding), "full_attention": self._as_mask(full)}

    def _as_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        return as_mask(allowed, self.attn_implementation)

    def commit(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        size = self.slot_positions.shape[0]
        if positions.shape[0] > size:  # as in RingLayer.update (XLA refuses a slice past the start)
            positions, valid = positions[-size:], valid[-size:]
        slots = positions % size
        kept = torch.where(valid, positions, self.slot_positions.index_select(0, slots))
        self.slot_positions.index_copy_(0, slots, kept)


class RingDecoder(Decoder):
    """Notebook 04's decoder on a ring: one compiled step for every position, one compiled prefill chunk for prompts of
    any length. ``buckets``: shorter full-layer lengths, each with its own compiled step, a step reading the smallest
    that holds the context. ``at``: positions held. ``readback_every``: the most tokens a run makes between reads to
    the host; the ring keeps that many spare slots for what a block makes past a stop, so a run can go on from it."""

    draft_tokens = 0  # positions a call writes past the one it keeps (notebook 09's drafts)

    def __init__(
        self,
        model,
        backend,
        max_len: int,
        chunk_size: int | None = None,
        buckets=(),
        readback_every: int = READBACK_EVERY,
        **compile_options,
    ):
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
        self.readback_every = readback_every
        self.spare = readback_every + self.draft_tokens  # ring slots past the window
        super().__init__(model, backend, max_len, **compile_options)

    def new_cache(self, model, max_len: int) -> RingCache:
        return RingCache(model, self.buckets[0], self.chunk_size, self.spare)  # the smallest bucket first

    def fit(self, end: int) -> None:
        """Make the cache the smallest bucket holding positions 0..``end``-1 (copying up once; a new prompt may move
        back down)."""
        bucket = next(b for b in self.buckets if b >= end)
        if bucket == self.cache.max_len or (bucket < self.cache.max_len and self.at):
            return
        old, self.cache = self.cache, RingCache(self.model, bucket, self.chunk_size, self.spare)
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

    def forward_chunk(self, tokens, positions, valid, model=None, rows=0):
        """The output of ``model`` (the decoder's, or its text model) for ``tokens`` [1, C] at ``positions`` [1, C]
        (``valid`` [C]: not padding), at ``rows`` (a tensor: layers past the last that keeps K/V run on those alone)."""
        out = (model or self.model)(
            input_ids=tokens,
            position_ids=positions,
            attention_mask=self.cache.masks(positions[0]),
            cache=self.cache,
            use_cache=True,
            logits_to_keep=rows,
            ring_positions=positions[0],
            ring_valid=valid,
        )
        self.cache.commit(positions[0], valid)
        return out

    def step(self, token, position):
        self.backend.donate(*kv_buffers(self.cache))  # written in place below: reused, not copied (xla)
        logits = self.forward_chunk(token, position, torch.ones(1, dtype=torch.bool, device=token.device)).logits
        return self.pick(logits[:, -1], position.view(-1) + 1), position + 1

    def prefill_forward(self, tokens, positions, valid, last):
        self.backend.donate(*kv_buffers(self.cache))
        logits = self.forward_chunk(tokens, positions, valid, rows=last).logits[0]  # the last real row's alone
        return self.pick(logits, positions[0].index_select(0, last) + 1)

    def chunks(self, length: int, device, offset: int = 0):
        """(start, positions [1, C], valid [C]) per chunk of a ``length``-token prompt put at ``offset``."""
        for start in range(0, length, self.chunk_size):
            # made on the host: PyTorch/XLA fed a compiled chunk stale device-made positions (measured)
            positions = torch.arange(start, start + self.chunk_size)
            yield start, (positions + offset)[None].to(device), (positions < length).to(device)

    def rewind(self, length) -> None:
        """Forget positions from ``length`` on (a block's tokens past a stop, a verify's rejected drafts)."""
        self.cache.slot_positions.masked_fill_(self.cache.slot_positions >= length, EMPTY)

    def go_on_from(self, start: int) -> None:
        """Forget what the last run wrote from ``start`` on, or refuse where its slots have taken positions a query at
        ``start`` still sees: a write at position p takes the slot of p - window - spare."""
        past = self.cache.get_seq_length() - start  # the last run's positions from start on (a verify's: K more)
        if past > self.spare - self.draft_tokens + 1:
            raise ValueError(
                f"the cache holds {past} positions past {start}: going on from {start} needs the window before it, "
                f"and this ring keeps {self.spare} spare slots (read back at most every {self.readback_every} "
                "tokens, or make the decoder with a larger readback_every)"
            )
        self.rewind(torch.tensor(start).to(self.cache.slot_positions.device))

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, start: int = 0):
        """The prompt in chunks, the last padded: one program for any length. ``start`` > 0 goes on after what the cache
        holds."""
        length = ids.shape[1]
        if start + length > self.max_len:
            held, verb = (f"{start} positions held + ", "exceed") if start else ("", "exceeds")
            raise ValueError(f"{held}a {length}-token prompt {verb} the cache's {self.max_len} positions")
        if start:
            self.go_on_from(start)
        self.at = start
        self.fit(start + length)
        if start == 0:
            self.cache.reset()
        self.at = start + length
        host = ids.cpu()  # each chunk built on the host, then copied: one program for any prompt, as in Decoder.prefill
        for first, positions, valid in self.chunks(length, ids.device, start):
            tokens = torch.zeros(1, self.chunk_size, dtype=ids.dtype)
            tokens[:, : min(self.chunk_size, length - first)] = host[:, first : first + self.chunk_size]
            last = torch.tensor([min(length - 1 - first, self.chunk_size - 1)]).to(ids.device)
            token = self.prefill_step(tokens.to(ids.device), positions, valid, last)
        return token, torch.tensor([[start + length]]).to(ids.device)


@contextlib.contextmanager
def inside_generate(model):
    """Inside the block, transformers' own ``generate(..., cache=RingCache(...))`` runs on the ring: hooks give each
    forward the ring's masks and positions, then commit the slots."""

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
