"""The baseline: HF ``generate`` (greedy), streamed and timed per step; where a run stops, as ``generate`` decides it."""

from __future__ import annotations

import copy
import html
import time

import torch
from transformers import StopStringCriteria, TextStreamer

from .backend import Backend


class StepStreamer(TextStreamer):
    """A streamer noting when each token (or chunk) reaches the host and the programs compiled so far; text and live
    tok/s in ``widget``."""

    def __init__(self, tokenizer, backend: Backend, widget=None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.backend, self.widget, self.text = backend, widget, ""
        self.times: list[float] = []
        self.counts: list[int] = []  # tokens in each put: the prompt's, then 1 (generate) or a chunk
        self.programs: list[int | None] = []

    def put(self, value):
        self.backend.flush()  # end the step's deferred group, KV cache included (else lazy XLA grows one graph)
        value = value.cpu()  # the token is on the host: the step is done
        self.times.append(time.perf_counter())
        self.counts.append(value.numel())
        self.programs.append(self.backend.programs_compiled())
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False):
        self.text += text
        if self.widget is not None:
            rate = f"{self.tok_s:.1f} tok/s" if self.tok_s else ""
            self.widget.value = f"<pre style='white-space:pre-wrap'>{html.escape(self.text)}</pre><b>{rate}</b>"

    @property
    def tok_s(self) -> float | None:
        """Tokens per second after the first (the prefill's), so far; None before two."""
        steps = sum(self.counts[2:])
        return steps / (self.times[-1] - self.times[1]) if steps > 0 else None

    @property
    def step_seconds(self) -> list[float]:
        """Seconds per generated token, the first the prefill's."""
        return [b - a for a, b in zip(self.times, self.times[1:])]

    @property
    def step_programs(self) -> list[int | None]:
        if self.programs[0] is None:
            return [None] * (len(self.programs) - 1)
        return [b - a for a, b in zip(self.programs, self.programs[1:])]


def generate(
    model, tokenizer, ids: torch.Tensor, backend: Backend, new_tokens: int, widget=None, stop: bool = True, **kwargs
):
    """Greedy HF ``generate``, streamed (``stop=False``: exactly ``new_tokens``): (new token ids, the streamer, its
    output)."""
    streamer = StepStreamer(tokenizer, backend, widget)
    config = greedy_config(model, new_tokens, stop)
    config.update(**kwargs)  # e.g. cache_implementation="static"
    out = model.generate(ids, generation_config=config, streamer=streamer, tokenizer=tokenizer)  # for stop_strings
    backend.sync()
    return out.sequences[0, ids.shape[1] :].tolist(), streamer, out


def stop_strings_criteria(tokenizer, stop_strings) -> StopStringCriteria | None:
    return StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings) if stop_strings else None


def first_stop(history: list[int], chunk: list[int], stop_ids, criteria: StopStringCriteria | None = None):
    """How many of ``chunk``'s tokens to keep: through the first stop id or completed stop string (``criteria``); None:
    no stop."""
    for i, token in enumerate(chunk):
        if token in stop_ids:
            return i + 1
        if criteria is not None and bool(criteria(torch.tensor([history + chunk[: i + 1]]), None)[0]):
            return i + 1
    return None


def stop_ids(model) -> list[int]:
    """The generation config's EOS ids (instruction-tuned Gemma 4's and the twin's: ``<eos>``, ``<turn|>``)."""
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def until_stop(tokens: list[int], stops) -> list[int]:
    """``tokens`` through the first stop id: what "the same tokens" compares."""
    return tokens[: first_stop([], tokens, stops)]


def greedy_config(model, new_tokens: int, stop: bool = True):
    """Greedy, at most ``new_tokens``; ``stop=False``: exactly that many (``eos_token_id=[]``: None would be refilled)."""
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
    """Where a run stops, checked per chunk read back: the first of ``ids`` (default the model's; ``()``: never) or of
    the stop strings in ``criteria``."""

    def __init__(self, model, history: list[int], ids=None, criteria: StopStringCriteria | None = None):
        self.ids = set(stop_ids(model) if ids is None else ids)
        self.criteria, self.history = criteria, list(history)

    def cut(self, chunk: list[int]) -> tuple[list[int], bool]:
        """The chunk through its first stop, and whether it stopped."""
        keep = first_stop(self.history, chunk, self.ids, self.criteria)
        chunk = chunk[:keep]
        self.history += chunk
        return chunk, keep is not None
