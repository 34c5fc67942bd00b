"""Every step against the memory roofline (tok/s <= bandwidth / bytes a step reads), and K tokens per compiled call."""

from __future__ import annotations

import torch

from .backend import Backend
from .checkpoint import unique_tensors
from .decode import Decoder, cache_read_bytes


def _row_bytes(table) -> int:
    """Bytes of one row of a gathered table (bf16 ``Embedding`` or 4-bit ``QTable``)."""
    return sum(t[0].numel() * t.element_size() for t in unique_tensors(table).values() if t.dim() == 2)


def step_bytes(model, cache=None) -> int:
    """Bytes one decode step reads as stored: every tensor once (a 4-bit head's codes once a pass), one row of each
    gathered table (the per-layer one, and the main one where the head does not multiply by it: a 4-bit head with a
    copy of its own), the K and V each layer reads."""
    every = unique_tensors(model)
    head = unique_tensors(model.lm_head)
    tables = [model.model.embed_tokens_per_layer, model.model.embed_tokens]
    gathered = [t for t in tables if not unique_tensors(t).keys() & head.keys()]
    for table in gathered:
        for key in unique_tensors(table):
            every.pop(key, None)
    weights = sum(t.numel() * t.element_size() for t in every.values())
    if getattr(model.lm_head, "passes", 1) > 1:  # steps finer than bf16: torch's kernel reads the codes again
        weights += (model.lm_head.passes - 1) * model.lm_head.codes.numel() * model.lm_head.codes.element_size()
    rows = sum(_row_bytes(table) for table in gathered)
    return weights + rows + (cache_read_bytes(model, cache) if cache is not None else 0)


def columns(bytes_per_token: int, tok_s: float, bandwidth: float) -> dict:
    """The roofline columns of a results row."""
    return {
        "bytes_per_token": bytes_per_token,
        "GB_per_s": bytes_per_token * tok_s / 1e9,
        "pct_of_bw": 100 * bytes_per_token * tok_s / bandwidth,
        "ceiling_tok_s": bandwidth / bytes_per_token,
    }


class KDecoder(Decoder):
    """Notebook 04's decoder making K tokens per compiled call: K steps unrolled in one program, each token fed to the
    next."""

    def __init__(self, model, backend: Backend, max_len: int, tokens_per_call: int, **compile_options):
        if tokens_per_call < 1:
            raise ValueError(f"tokens_per_call={tokens_per_call}: one compiled call makes at least one token")
        super().__init__(model, backend, max_len, **compile_options)
        self.tokens_per_call = tokens_per_call
        self.decode_steps = backend.compile(self.steps, fullgraph=True, **compile_options)

    def steps(self, token, position):
        tokens = []
        for _ in range(self.tokens_per_call):
            token, position = self.step(token, position)
            tokens.append(token)
        return torch.cat(tokens, dim=1), token, position

    @torch.no_grad()
    def call(self, token, position):
        return self.decode_steps(token, position)

    def check_room(self, length: int, new_tokens: int, start: int = 0, extra: int = 0) -> None:
        super().check_room(length, new_tokens, start, self.tokens_per_call - 1)  # the last call makes K
