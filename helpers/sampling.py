"""Sampling inside a compiled decode step: temperature, top-k and top-p with the names and
semantics of transformers' ``GenerationConfig`` (its own logits warpers, in ``generate``'s
order), then one draw per token by the Gumbel-max trick from noise keyed on (seed, position):
no generator state in the compiled program, no host round trip, and the same tokens whatever
the tokens per call. ``Sampled`` gives a decoder the sampler and stop strings."""

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

# the sampling settings the compiled step runs; generate's other warpers are refused, not ignored
UNSUPPORTED = ("min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff")


def sampling_config(**settings) -> GenerationConfig:
    """A ``GenerationConfig`` with ``do_sample=True`` and the given settings (temperature,
    top_k, top_p, ...), validated by transformers."""
    config = GenerationConfig(do_sample=True, **settings)
    config.validate(strict=True)
    return config


class Sampler:
    """Chooses the next token from logits on the device.

    Args: ``config``, a ``GenerationConfig`` (None or ``do_sample=False``: greedy). With
    ``do_sample=True`` its ``temperature``, ``top_k`` and ``top_p`` are applied as ``generate``
    applies them (transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
    ``TopPLogitsWarper``, in that order; a 1.0 or a 0/None is skipped, as there).

    ``sampler(logits [N, vocab], positions [N] int64, seed [1] int64)`` returns tokens [N, 1]:
    the argmax, or one draw from the warped distribution for each row, where row i's noise is a
    fixed function of ``seed`` and ``positions[i]`` (the position the new token will take)."""

    def __init__(self, config: GenerationConfig | None = None):
        self.do_sample = bool(config is not None and config.do_sample)
        self.warpers = LogitsProcessorList()
        if not self.do_sample:
            return
        refused = [name for name in UNSUPPORTED if getattr(config, name, None) not in (None, 1.0)]
        if refused:
            raise ValueError(f"{', '.join(refused)}: not in the compiled step (temperature, top_k and top_p are)")
        if config.temperature is not None and config.temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            self.warpers.append(TopKLogitsWarper(top_k=config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p=config.top_p))

    def __repr__(self) -> str:
        warpers = ", ".join(type(w).__name__ for w in self.warpers) or "none"
        return f"Sampler(do_sample={self.do_sample}, warpers: {warpers})"

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The warped scores [N, vocab] in float32 (-inf where top-k or top-p removed a token);
        their softmax is the distribution one draw follows."""
        return self.warpers(None, logits.float())

    def __call__(self, logits: torch.Tensor, positions: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(-1, keepdim=True)
        noise = gumbel(seed, positions, logits.shape[-1])
        return (self.scores(logits) + noise).argmax(-1, keepdim=True)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x >> k`` on int32 words read as unsigned (1 <= k <= 31). The sign bit is cleared before
    the shift and put back after it: PyTorch/XLA's ``>>`` of a negative int32 rounds like a
    division (notebook 02), and a TPU has no 64-bit integers to widen into."""
    return ((x & 0x7FFFFFFF) >> k) | ((x < 0).to(torch.int32) << (31 - k))


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) on int32 tensors: products wrap mod 2**32,
    so the bits are those of the unsigned hash."""
    x = x ^ _shr(x, 16)
    x = x * 0x7FEB352D
    x = x ^ _shr(x, 15)
    x = x * (0x846CA68B - 2**32)  # the constant as a signed 32-bit word
    return x ^ _shr(x, 16)


def gumbel(seed: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Gumbel noise [N, vocab] as a pure function of (seed, position, token id), in 32-bit
    integers (``seed`` and ``positions`` are read mod 2**32). Written by hand: torch's
    generators keep state a compiled program cannot carry between calls, and integer arithmetic
    gives the same noise on every backend."""
    key = _mix32(_mix32(seed.view(1, 1).to(torch.int32)) ^ positions.view(-1, 1).to(torch.int32))
    bits = _mix32(key ^ torch.arange(vocab, dtype=torch.int32, device=positions.device).view(1, -1))
    uniform = (_shr(bits, 8).float() + 0.5) / 2**24  # in (0, 1): 24 bits are exact in float32
    return -torch.log(-torch.log(uniform))


class Sampled:
    """What notebook 08 adds to a decoder (first among a decoder class's bases): its compiled step
    samples with ``Sampler(sampling)``, its noise keyed on ``generate``'s ``seed`` (a device
    tensor, so a new seed is a new input, not a recompile), and a run stops at ``stop_strings``
    too (with the ``tokenizer``, as transformers' ``generate``)."""

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
