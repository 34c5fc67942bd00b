"""Draft and verify: Gemma 4's assistant drafts K tokens from the target's own K/V and last hidden state, the target
checks them in one forward of K+1 tokens and keeps the drafts it agrees with, then its own next token: the target's
greedy tokens, several per pass over its weights."""

from __future__ import annotations

import torch

from .checkpoint import unique_tensors
from .decode import READBACK_EVERY, Decoder, kv_buffers, set_length
from .ring import EMPTY, RingDecoder, as_mask, group_query_heads
from .sampling import Sampled, gumbel


def load_assistant(folder, backend, dtype: torch.dtype = torch.bfloat16):
    """The assistant in ``folder`` (transformers' ``Gemma4AssistantForCausalLM``) on the device, its attention grouped
    as the target's (notebook 06): each draft reads the target's K/V once per K/V head, not copied per query head."""
    from transformers import Gemma4AssistantForCausalLM

    assistant = Gemma4AssistantForCausalLM.from_pretrained(folder, dtype=dtype)
    group_query_heads(assistant)
    backend.place(assistant)
    return assistant.eval()


def shared_layers(model) -> dict[str, int]:
    """Per attention type, the target layer whose K/V its sharing layers read: the assistant reads the same."""
    types = model.config.get_text_config().layer_types
    return {types[i]: i for i, layer in enumerate(model.model.layers) if layer.self_attn.store_full_length_kv}


def draft_masks(key_positions: dict, position: torch.Tensor, window: int) -> dict:
    """Which keys the assistant's query at ``position`` sees, from each type's key positions [S] (-1: empty): all
    before it, and in a sliding layer the last ``window`` of them, as the target's own query at ``position - 1``."""
    masks = {}
    for kind, keys in key_positions.items():
        seen = (keys < position) & (keys != EMPTY)
        masks[kind] = seen & (keys >= position - window) if kind == "sliding_attention" else seen
    return masks


def draft_scores(assistant, hidden: torch.Tensor):
    """The assistant's scores [1, 1, N] and the ids they score [1, 1, N]: every token, or with ordered embeddings only its
    top centroids' tokens, as HF's masked embedder scores them, without its host read of their minimum (a graph
    break)."""
    ordered = assistant.masked_embedding
    if ordered is None:
        scores = assistant.lm_head(hidden)
        return scores, torch.arange(scores.shape[-1], device=scores.device).expand(scores.shape)
    top = ordered.centroids(hidden).topk(ordered.centroid_intermediate_top_k, dim=-1).indices
    ids = ordered.token_ordering.view(ordered.num_centroids, -1)[top].flatten(-2)  # [1, 1, tokens scored]
    return (hidden.unsqueeze(-2) @ assistant.lm_head.weight[ids].transpose(-1, -2)).squeeze(-2), ids


def draft_token(assistant, hidden: torch.Tensor) -> torch.Tensor:
    """The assistant's argmax [1, 1]."""
    scores, ids = draft_scores(assistant, hidden)
    return ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


def assist(assistant, embedding, hidden, position, shared_kv: dict, masks: dict):
    """One assistant forward as HF's, with the masks given (HF's builds them from a padding mask, which a static or ring
    buffer's unwritten slots are not): its last hidden state, which scores the draft, and the hidden state the next
    draft starts from."""
    x = assistant.pre_projection(torch.cat([embedding, hidden], dim=-1))
    out = assistant.model(
        inputs_embeds=x, attention_mask=masks, position_ids=position, shared_kv_states=shared_kv, use_cache=False
    )
    return out.last_hidden_state, assistant.post_projection(out.last_hidden_state)


def draft_bytes(decoder) -> int:
    """Bytes one draft reads: the assistant's weights (with ordered embeddings, of its head only its top centroids'
    rows) and, per layer, the target's K/V it shares."""
    assistant, cache = decoder.assistant, decoder.cache
    weights = sum(t.numel() * t.element_size() for t in unique_tensors(assistant).values())
    ordered, head = assistant.masked_embedding, assistant.lm_head.weight
    if ordered is not None:
        rows = ordered.centroid_intermediate_top_k * (head.shape[0] // ordered.num_centroids)
        weights -= (head.shape[0] - rows) * head[0].numel() * head.element_size()
    owners = [cache.layers[decoder.owners[kind]] for kind in assistant.config.get_text_config().layer_types]
    return weights + sum(t.numel() * t.element_size() for layer in owners for t in (layer.keys, layer.values))


def leading(agree: torch.Tensor) -> torch.Tensor:
    """How many of ``agree`` [K] (bool) hold before the first that does not: its index, else K. A minimum, not a
    ``cumprod``: PyTorch/XLA runs cumprod on the host, which split a call in programs around it."""
    steps = torch.arange(agree.shape[0], device=agree.device)
    return torch.where(agree, agree.shape[0], steps).min()


class Drafted:
    """Notebook 09's additions to a decoder (first among its bases): each call verifies ``draft_tokens`` (K) drafts, a
    forward of K+1 tokens, then drafts the next call's K with ``assistant``, in one compiled program (a prefill drafts
    the first call's)."""

    at = 0  # positions held, at most (a ring's buckets read it)

    def __init__(self, model, assistant, backend, max_len: int, draft_tokens: int = 4, **kwargs):
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens={draft_tokens}: draft at least one token (0 is notebook 04's decoder)")
        self.assistant, self.draft_tokens = assistant, draft_tokens
        super().__init__(model, backend, max_len, **kwargs)
        self.window = model.config.get_text_config().sliding_window
        self.owners = shared_layers(model)
        self.drafts = None  # the next call's drafts, and what they were drawn from
        options = {k: v for k, v in kwargs.items() if k not in ("chunk_size", "buckets", "readback_every")}
        self.call_step = backend.compile(self.verify_and_draft, fullgraph=True, **options)
        self.kept: list[int] = []  # per call of the last run: the drafts the target kept

    def key_positions(self) -> dict:
        """Per attention type, the position each slot of its shared K/V holds (a static cache: the slot's index)."""
        keys = self.cache.layers[self.owners["full_attention"]].keys
        return dict.fromkeys(self.owners, torch.arange(keys.shape[2], device=keys.device))

    def shared(self, position):
        """What every draft at ``position`` reads: the target's shared K/V, and the masks over it."""
        layers = {kind: self.cache.layers[i] for kind, i in self.owners.items()}
        implementation = self.assistant.config.get_text_config()._attn_implementation
        allowed = draft_masks(self.key_positions(), position.view(()), self.window)
        masks = {kind: as_mask(m[None], implementation) for kind, m in allowed.items()}
        return {kind: (layer.keys, layer.values) for kind, layer in layers.items()}, masks

    def draft(self, token, hidden, position):
        """K tokens [1, K] after ``token`` at ``position``, ``hidden`` the target's before it: K assistant forwards at
        that one position, over the target's K/V (the assistant keeps no cache), each fed the last draft and the hidden
        state it left. Returns them and what they were drawn from (None here: each the assistant's argmax)."""
        shared_kv, masks = self.shared(position)
        embed, drafts = self.model.get_input_embeddings(), []
        for _ in range(self.draft_tokens):
            last, hidden = assist(self.assistant, embed(token), hidden, position, shared_kv, masks)
            token = draft_token(self.assistant, last)
            drafts.append(token)
        return torch.cat(drafts, dim=1), None

    def target(self, tokens, positions, rows=0):
        """The target's last hidden state [1, C, H] for ``tokens`` [1, C] at ``positions`` [1, C] (at ``rows`` alone,
        a tensor): its text model's output, what the assistant reads (``output_hidden_states`` hooks every layer, through
        a lock dynamo refuses)."""
        return self.model.model(
            input_ids=tokens, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=rows
        )

    def head(self, hidden):
        """The target's logits from its last hidden state, as its forward makes them: ``lm_head``, then the softcap."""
        logits = self.model.lm_head(hidden)
        cap = self.model.config.get_text_config().final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def rewind(self, length) -> None:
        """Forget positions from ``length`` (a device tensor) on: the rejected drafts'."""
        set_length(self.cache, length)

    def verify(self, token, drafts, position, q=None):
        """The target on ``token`` then the drafts, in one forward (its weights read once): the drafts it keeps
        (``judge``), then its own token after them. Returns those tokens [1, K+1] (-1 past them), the last one, the
        position it goes at and the hidden state before it."""
        self.backend.donate(*kv_buffers(self.cache))  # written in place below: reused, not copied (xla)
        tokens = torch.cat([token, drafts], dim=1)
        steps = torch.arange(tokens.shape[1], device=tokens.device)
        positions = position + steps
        hidden = self.target(tokens, positions).last_hidden_state
        kept, made = self.judge(drafts[0], q, self.head(hidden[0]), positions[0] + 1)
        self.rewind(position.view(()) + kept + 1)
        chosen = torch.where(steps < kept, torch.cat([drafts[0], made[-1:]]), made)  # the kept drafts, then its token
        block = torch.where(steps <= kept, chosen, -1)
        return (
            block[None],
            made.index_select(0, kept.view(1))[None],
            position + kept + 1,
            hidden.index_select(1, kept.view(1)),
        )

    def judge(self, drafts, q, logits, at):
        """How many of ``drafts`` [K] the target keeps, and the token it makes after each of the K+1 positions [K+1],
        from its ``logits`` [K+1, vocab] at positions ``at``: greedy, the drafts before its first disagreement."""
        made = self.pick(logits, at)[:, 0]
        return leading(drafts == made[:-1]), made

    def verify_and_draft(self, token, position, drafts, q=None):
        """One call: ``verify``, then the next call's drafts from the token and hidden state it leaves (``draft``)."""
        block, token, position, hidden = self.verify(token, drafts, position, q)
        return block, token, position, self.draft(token, hidden, position)

    @torch.no_grad()
    def prefill(self, ids, start: int = 0):
        (token, self.drafts), position = super().prefill(ids, start)  # this decoder's prefill drafts too
        return token, position

    @torch.no_grad()
    def call(self, token, position):
        block, token, position, self.drafts = self.call_step(token, position, *self.drafts)
        return block, token, position

    def check_room(self, length: int, new_tokens: int, start: int = 0, extra: int = 0) -> None:
        super().check_room(length, new_tokens, start, self.draft_tokens)  # the last call writes K more positions

    def tokens_per_verify(self) -> float:
        """The last run's tokens per call: the target's own and the drafts it kept, on average (vLLM's "mean
        acceptance length", which counts the target's own token too)."""
        return 1 + sum(self.kept) / self.calls()

    def kept_at(self) -> list[float]:
        """Per draft position 1..K, the share of the last run's calls that kept it."""
        return [sum(n >= j for n in self.kept) / self.calls() for j in range(1, self.draft_tokens + 1)]

    def calls(self) -> int:
        """The last run's calls: none when its one token came from the prefill, and then nothing to count per call."""
        if not self.kept:
            raise ValueError("the last run made no call (its one token came from the prefill): no verify to count")
        return len(self.kept)

    @torch.no_grad()
    def generate(
        self, ids, new_tokens: int, readback_every: int = READBACK_EVERY, stop_ids=None, streamer=None, start: int = 0
    ):
        """As notebook 04's, each call making 1 to K+1 tokens: read back once ``readback_every`` tokens may have been
        made, or the length may have been reached."""
        self.check_room(ids.shape[1], new_tokens, start)
        stops = self.stops(ids.cpu()[0].tolist(), stop_ids)  # a copy, not a device op per prompt length
        if streamer is not None:
            streamer.put(ids.cpu())
        token, position = self.prefill(ids, start)
        tokens, pending, most, self.kept = [], [token], 1, []  # most: tokens made at most, until read back
        while True:
            if most >= new_tokens or most - len(tokens) >= readback_every:
                self.backend.flush()
                blocks = [b[0].tolist() for b in pending]
                self.kept += [sum(t >= 0 for t in b) - 1 for b in blocks[1 if not tokens else 0 :]]
                made = [t for b in blocks for t in b if t >= 0]
                chunk, stopped = stops.cut(made[: new_tokens - len(tokens)])
                tokens, pending, most = tokens + chunk, [], len(tokens) + len(chunk)
                self.at = start + ids.shape[1] + len(tokens)  # positions held, known again (a ring's buckets)
                if streamer is not None:
                    streamer.put(torch.tensor(chunk))
                if most >= new_tokens or stopped:
                    if streamer is not None:
                        streamer.end()
                    return tokens
            block, token, position = self.call(token, position)
            pending.append(block)
            most += block.shape[1]


class DraftDecoder(Drafted, Decoder):
    """Notebook 04's decoder, drafting and verifying on its static cache."""

    def prefill_forward(self, tokens, last):
        self.backend.donate(*kv_buffers(self.cache))
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        hidden = self.target(tokens, positions, rows=last).last_hidden_state  # the last real row's alone
        token = self.pick(self.head(hidden[0]), last + 1)
        return token, self.draft(token, hidden, (last + 1).view(1, 1))  # the first call's drafts


class DraftRingDecoder(Drafted, RingDecoder):
    """Notebook 06's decoder, drafting and verifying on a ring with K more spare slots: a rejected draft's position
    takes a slot, which in a ring of ``window`` held a position the next query still sees."""

    def key_positions(self) -> dict:
        positions = super().key_positions()
        return {**positions, "sliding_attention": self.cache.slot_positions}

    def target(self, tokens, positions, rows=0, valid=None):
        valid = torch.ones(tokens.shape[1], dtype=torch.bool, device=tokens.device) if valid is None else valid
        return self.forward_chunk(tokens, positions, valid, self.model.model, rows)

    rewind = RingDecoder.rewind  # not Drafted's, the static cache's

    def prefill_forward(self, tokens, positions, valid, last):
        self.backend.donate(*kv_buffers(self.cache))
        hidden = self.target(tokens, positions, last, valid).last_hidden_state
        at = positions[0].index_select(0, last) + 1
        token = self.pick(self.head(hidden[0]), at)
        return token, self.draft(token, hidden, at.view(1, 1))  # the first call's drafts (each chunk's: one program)

    @torch.no_grad()
    def call(self, token, position):
        """``Drafted.call`` on the smallest bucket that holds what the call may write: K+1 positions. ``at`` counts
        them all, so it may run ahead of the positions held until ``generate`` reads back and sets it."""
        self.fit(min(self.at + self.draft_tokens + 1, self.max_len))
        self.at += self.draft_tokens + 1
        return Drafted.call(self, token, position)


class Speculative(Sampled):
    """Notebook 09's drafts sampled (first among a draft decoder's bases): the assistant draws each draft from its warped
    distribution q, the target keeps it with probability min(1, p/q), p its own, and at the first it does not keep
    draws from max(p - q, 0) renormalised (every draft kept: its next token from p). The tokens then follow p exactly
    (Leviathan et al., 2023). Each draw is notebook 08's Gumbel-max, keyed on (seed + stream, position)."""

    def draw(self, probs, positions, stream: int):
        """One token per row of ``probs`` [N, vocab] (unnormalised), at ``positions`` [N]."""
        return (probs.log() + gumbel(self.seed + stream, positions, probs.shape[-1])).argmax(-1)

    def draft(self, token, hidden, position):
        if not self.sampler.do_sample:
            return super().draft(token, hidden, position)
        shared_kv, masks = self.shared(position)
        embed, drafts, probs = self.model.get_input_embeddings(), [], []
        for i in range(self.draft_tokens):
            last, hidden = assist(self.assistant, embed(token), hidden, position, shared_kv, masks)
            scores, ids = draft_scores(self.assistant, last)
            q = torch.zeros(1, self.model.lm_head.out_features, device=last.device)
            q = q.scatter(-1, ids[0], self.sampler.scores(scores[0]).softmax(-1))
            token = self.draw(q, position.view(-1) + 1 + i, 1).view(1, 1)
            drafts.append(token)
            probs.append(q)
        return torch.cat(drafts, dim=1), torch.cat(probs)

    def judge(self, drafts, q, logits, at):
        if not self.sampler.do_sample:
            return super().judge(drafts, q, logits, at)
        p = self.sampler.scores(logits).softmax(-1)  # [K+1, vocab]: the target's, after each token
        chosen = drafts[:, None]
        uniform = torch.exp(-torch.exp(-gumbel(self.seed + 3, at[:-1], 1)[:, 0]))  # a Gumbel variable back to (0, 1)
        kept = leading(uniform * q.gather(1, chosen)[:, 0] < p[:-1].gather(1, chosen)[:, 0])
        beyond = (p[:-1] - q).clamp_min(0)  # all 0 only where p = q up to rounding: then p itself
        beyond = torch.where(beyond.sum(-1, keepdim=True) > 0, beyond, p[:-1])
        return kept, self.draw(torch.cat([beyond, p[-1:]]), at, 2)  # row i: drawn if drafts before i are kept


class SpeculativeDecoder(Speculative, DraftDecoder):
    """Drafts on the static cache, sampled."""


class SpeculativeRingDecoder(Speculative, DraftRingDecoder):
    """Drafts on the ring, sampled: what notebook 08's chat runs with its assistant."""
