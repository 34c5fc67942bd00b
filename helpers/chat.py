"""A chat on the ring cache: each turn goes in at the cache's position, so the history is never run again."""

from __future__ import annotations

import torch

from . import checkpoint as ck
from .decode import cache_bytes
from .ring import RingDecoder

_SENTINEL = "\x00reply\x00"  # stands for the last reply while the template renders the next turn


class Chat:
    """A conversation kept in a ``RingDecoder``'s cache between turns; turn i samples with ``seed + i``; each reply read
    back every ``readback_every`` tokens (default: the decoder's, its most). ``tokens``: the whole conversation;
    ``replies``: each reply's ids."""

    def __init__(
        self,
        decoder: RingDecoder,
        tokenizer,
        max_new_tokens: int = 64,
        seed: int = 0,
        readback_every: int | None = None,
        **generate_kwargs,
    ):
        if not isinstance(decoder, RingDecoder):
            raise TypeError(
                f"a chat keeps its cache between turns: it needs a RingDecoder, not {type(decoder).__name__}"
            )
        self.readback_every = readback_every or decoder.readback_every
        if self.readback_every > decoder.readback_every:
            raise ValueError(
                f"readback_every={self.readback_every}: the decoder's ring keeps spare slots for "
                f"{decoder.readback_every} tokens past a reply's stop (make it with readback_every={self.readback_every})"
            )
        self.decoder, self.tokenizer, self.max_new_tokens = decoder, tokenizer, max_new_tokens
        self.seed, self.generate_kwargs = seed, generate_kwargs
        self.messages: list[dict] = []
        self.tokens: list[int] = []
        self.replies: list[list[int]] = []

    def turn_ids(self, text: str) -> list[int]:
        """The new turn's tokens as the chat template writes them after the history (BOS first on the first turn)."""
        device = self.decoder.backend.device
        if not self.messages:
            return ck.chat_ids(self.tokenizer, device, prompt=text)[0].tolist()
        history = self.messages[:-1] + [{"role": "assistant", "content": _SENTINEL}]
        before = self.tokenizer.apply_chat_template(history, tokenize=False)
        after = self.tokenizer.apply_chat_template(
            history + [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        if not after.startswith(before):
            raise ValueError("this chat template rewrites earlier turns: each turn cannot go after the cache's")
        closing = before.split(_SENTINEL, 1)[1]
        ended = self.tokenizer.decode(self.tokens[-1:])
        if closing.startswith(ended):  # the reply's stop token is the template's own end of turn
            closing = closing[len(ended) :]
        return self.tokenizer(closing + after[len(before) :], add_special_tokens=False).input_ids

    def say(self, text: str, streamer=None) -> str:
        """The reply to ``text``, read back in the decoder's blocks: the ring's spare slots keep what a block makes past
        the reply's stop from taking positions the next turn sees, and the next turn writes over them."""
        turn = self.turn_ids(text)
        held = max(len(self.tokens) - 1, 0)  # the last reply's last token is not in the cache yet
        new = self.tokens[held:] + turn
        need = held + len(new) + self.max_new_tokens
        if need > self.decoder.max_len:
            raise ValueError(
                f"this turn would take the context to {need} positions (held {held} + turn {len(new)} + reply "
                f"up to {self.max_new_tokens}), past the full layers' buffer of {self.decoder.max_len}: "
                "start a new Chat, or a RingDecoder with a larger max_len"
            )
        ids = torch.tensor([new], device=self.decoder.backend.device)
        reply = self.decoder.generate(
            ids,
            self.max_new_tokens,
            readback_every=self.readback_every,
            start=held,
            streamer=streamer,
            **({"seed": self.seed + len(self.replies)} if hasattr(self.decoder, "sampler") else {}),  # Sampled
            **self.generate_kwargs,
        )
        self.tokens = self.tokens[:held] + new + reply
        self.replies.append(reply)
        answer = self.tokenizer.decode(reply, skip_special_tokens=True)
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
        return answer

    def status(self) -> dict:
        """The context so far (positions) and the cache's bytes (all allocated up front)."""
        return {
            "context": len(self.tokens),
            "max_len": self.decoder.max_len,
            "cache_bytes": cache_bytes(self.decoder.cache),
        }
