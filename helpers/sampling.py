"""Sampling inside a compiled decode step: temperature, top-k and top-p with the names and
semantics of transformers' ``GenerationConfig`` (its own logits warpers, in ``generate``'s
order), then one draw per token by the Gumbel-max trick from noise keyed on (seed, position):
no generator state in the compiled program, no host round trip, and the same tokens whatever
the tokens per call. And where a run stops: the model's stop ids, stop strings, and the greedy
configuration every step of the series compares against."""

from __future__ import annotations

import copy

import torch
from transformers import GenerationConfig, StopStringCriteria
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

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


def stop_strings_criteria(tokenizer, stop_strings) -> StopStringCriteria | None:
    """transformers' own check for stop strings, or None for none."""
    if not stop_strings:
        return None
    return StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)


def first_stop(history: list[int], chunk: list[int], stop_ids, criteria: StopStringCriteria | None = None):
    """How many of ``chunk``'s tokens to keep when it stops: up to and including the first stop
    id, or the first token that completes a stop string (``criteria``, checked against
    ``history`` then the chunk, as ``generate`` checks it after every token); None if it goes on."""
    for i, token in enumerate(chunk):
        if token in stop_ids:
            return i + 1
        if criteria is not None and bool(criteria(torch.tensor([history + chunk[: i + 1]]), None)[0]):
            return i + 1
    return None


def stop_ids(model) -> list[int]:
    """The ids ``generate`` stops at: the generation config's EOS list (the instruction-tuned
    Gemma 4's and the twin's: ``<eos>`` and ``<turn|>``)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def until_stop(tokens: list[int], stops) -> list[int]:
    """``tokens`` up to and including the first stop id: what "the same tokens" compares."""
    return tokens[: first_stop([], tokens, stops)]


def greedy_config(model, new_tokens: int, stop: bool = True):
    """Greedy, at most ``new_tokens`` tokens, stopping at the model's stop ids as ``generate``
    does. ``stop=False``: exactly ``new_tokens`` tokens, the mode timing uses. It sets
    ``eos_token_id=[]``: a ``None`` would be refilled from the model's own generation config."""
    config = copy.deepcopy(model.generation_config)
    config.update(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=None,
        top_k=None,
        top_p=None,
        temperature=None,
        return_dict_in_generate=True,
        eos_token_id=stop_ids(model) if stop else [],
    )
    return config


class Stops:
    """Where a run stops, checked on each chunk of tokens read back to the host: after the first
    of ``ids`` (default: ``model``'s stop ids, as ``generate``; ``()``: never), or at the first of
    ``stop_strings`` (transformers' ``StopStringCriteria``, which needs the ``tokenizer``), with
    the tokens already read (``history``, the prompt's first) as context."""

    def __init__(self, model, history: list[int], ids=None, stop_strings=None, tokenizer=None):
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer (tokenizer=...), as in transformers' generate")
        self.ids = set(stop_ids(model) if ids is None else ids)
        self.criteria = stop_strings_criteria(tokenizer, stop_strings)
        self.history = list(history)

    def cut(self, chunk: list[int]) -> tuple[list[int], bool]:
        """The chunk up to and including its first stop, and whether it stopped there."""
        keep = first_stop(self.history, chunk, self.ids, self.criteria)
        chunk = chunk[:keep]
        self.history += chunk
        return chunk, keep is not None
