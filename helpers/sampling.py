"""Sampling inside a compiled decode step: transformers' warpers in ``generate``'s order, then a Gumbel-max draw from
noise keyed on (seed, position): no generator state, no host round trip."""

from __future__ import annotations

import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .decode import Decoder
from .generate import Stops, stop_strings_criteria
from .ring import RingDecoder

UNSUPPORTED = ("min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")  # warpers refused, not ignored


def sampling_config(**settings) -> GenerationConfig:
    """A ``GenerationConfig`` with ``do_sample=True`` and ``settings``, validated by transformers."""
    config = GenerationConfig(do_sample=True, **settings)
    config.validate(strict=True)
    return config


class Sampler:
    """The next token from logits on the device: the argmax, or with ``config.do_sample`` its temperature, top-k and
    top-p applied as ``generate`` applies them and one Gumbel-max draw per row, its noise a function of ``seed`` and
    the row's position. With top-k, its k candidates are taken first and temperature and top-p run on them alone: a
    sort of k scores, not of the whole vocabulary (262,144 at E2B), the same distribution but at an exact tie with
    the k-th score (``generate`` keeps every tied token)."""

    def __init__(self, config: GenerationConfig | None = None):
        self.do_sample = bool(config is not None and config.do_sample)
        self.warpers, self.top_k = LogitsProcessorList(), None
        if not self.do_sample:
            return
        refused = [name for name in UNSUPPORTED if getattr(config, name, None) not in (None, 1.0)]
        if refused:
            raise ValueError(f"{', '.join(refused)}: not in the compiled step (temperature, top_k and top_p are)")
        if config.temperature is not None and config.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            TopKLogitsWarper(top_k=config.top_k)  # transformers' own check of the value
            self.top_k = config.top_k
        if config.top_p is not None and config.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=config.top_p))

    def __repr__(self) -> str:
        warpers = ", ".join(type(w).__name__ for w in self.warpers) or "none"
        return f"Sampler(do_sample={self.do_sample}, top_k={self.top_k}, then warpers: {warpers})"

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The warped scores [N, vocab] in float32 (-inf where top-k or top-p removed a token)."""
        if self.top_k is None:
            return self.warpers(None, logits.float())
        candidates, ids = logits.float().topk(min(self.top_k, logits.shape[-1]))
        warped = self.warpers(None, candidates)
        return torch.full_like(logits, -torch.inf, dtype=torch.float32).scatter(-1, ids, warped)

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(-1, keepdim=True)
        noise = gumbel(seed, positions, logits.shape[-1])
        return (self.scores(logits) + noise).argmax(-1, keepdim=True)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x >> k`` on int32 words read as unsigned: PyTorch/XLA's ``>>`` of a negative int32 rounds like a division, and
    a TPU has no 64-bit integers to widen into."""
    return ((x & 0x7FFFFFFF) >> k) | ((x < 0).to(torch.int32) << (31 - k))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' lowbias32 hash on int32 tensors (products wrap mod 2**32: the unsigned hash's bits)."""
    x = x ^ _shr(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shr(x, 15)
    x = x * (0x846CA68B - 2**32)  # the constant as a signed 32-bit word
    return x ^ _shr(x, 16)


def gumbel(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] as a pure function of (seed, position, token id) in 32-bit integers: torch's generators
    keep state a compiled program cannot carry."""
    key = _mix32(_mix32(seed.view(1, 1).to(torch.int32)) ^ positions.view(-1, 1).to(torch.int32))
    bits = _mix32(key ^ torch.arange(vocab, dtype=torch.int32, device=positions.device).view(1, -1))
    # in (0, 1): 23 bits and a half are exact in float32 (with 24, the largest rounds to 1, its noise to infinity)
    uniform = (_shr(bits, 9).float() + 0.5) / 2**23
    return -torch.log(-torch.log(uniform))


class Sampled:
    """Notebook 08's additions to a decoder (first among its bases): the step samples with ``Sampler(sampling)`` keyed
    on ``generate``'s ``seed`` (a device tensor: no recompile), and ``stop_strings`` stop a run."""

    def __init__(self, *args, sampling: GenerationConfig | None = None, **kwargs):
        self.sampler, self.stop_strings, self.tokenizer = Sampler(sampling), None, None
        super().__init__(*args, **kwargs)
        self.seed = torch.zeros(1, dtype=torch.long, device=self.backend.device)

    def pick(self, logits, positions):
        return self.sampler(logits, positions, self.seed)

    def stops(self, history: list[int], stop_ids) -> Stops:
        return Stops(self.model, history, stop_ids, stop_strings_criteria(self.tokenizer, self.stop_strings))

    def generate(self, ids, new_tokens: int, *args, seed: int = 0, stop_strings=None, tokenizer=None, **kwargs):
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer (tokenizer=...), as in transformers' generate")
        self.seed.fill_(seed)
        self.stop_strings, self.tokenizer = stop_strings, tokenizer
        return super().generate(ids, new_tokens, *args, **kwargs)


class SampledDecoder(Sampled, Decoder):
    """Notebook 04's decoder, sampling."""


class SampledRingDecoder(Sampled, RingDecoder):
    """Notebook 06's decoder on the ring, sampling: what the chat runs."""
