"""The baseline: Hugging Face ``generate`` (greedy), streamed, timed per step, and the
reference tokens every later notebook must reproduce."""

from __future__ import annotations

import contextlib
import html
import statistics
import time

import torch
from transformers import TextStreamer

from .backend import Backend
from .sampling import greedy_config, stop_ids, until_stop


class StepStreamer(TextStreamer):
    """A transformers streamer that notes when each token (or chunk of tokens, from a compiled
    decoder) reaches the host (and, where the backend counts them, the device programs compiled
    so far), and shows the text as it comes: into an ipywidgets box in a notebook, with live
    tok/s over the tokens after the first; nowhere otherwise."""

    def __init__(self, tokenizer, backend: Backend, widget=None):
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.backend, self.widget = backend, widget
        self.times: list[float] = []
        self.counts: list[int] = []  # tokens in each put: the prompt's, then 1 (generate) or a chunk
        self.programs: list[int | None] = []
        self.text = ""

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
        """Tokens per second after the first (which the prefill made), so far; None before two."""
        steps = sum(self.counts[2:])
        return steps / (self.times[-1] - self.times[1]) if steps > 0 else None

    @property
    def step_seconds(self) -> list[float]:
        """Seconds per generated token: the first is the prefill (prompt in, first token out)."""
        return [b - a for a, b in zip(self.times, self.times[1:])]

    @property
    def step_programs(self) -> list[int | None]:
        """Device programs compiled during each step (None where the backend does not count)."""
        if self.programs[0] is None:
            return [None] * (len(self.programs) - 1)
        return [b - a for a, b in zip(self.programs, self.programs[1:])]


def text_widget():
    """An ipywidgets HTML box, shown in the notebook, for ``StepStreamer`` to write into."""
    import ipywidgets
    from IPython.display import display

    widget = ipywidgets.HTML()
    display(widget)
    return widget


def generate(
    model, tokenizer, ids: torch.Tensor, backend: Backend, new_tokens: int, widget=None, stop: bool = True, **kwargs
):
    """Greedy HF ``generate``, streamed, stopping at the model's stop ids (``stop=False``:
    exactly ``new_tokens``); returns (generated token ids, the streamer, generate's output)."""
    streamer = StepStreamer(tokenizer, backend, widget)
    config = greedy_config(model, new_tokens, stop)
    config.update(**kwargs)  # e.g. cache_implementation="static"
    out = model.generate(ids, generation_config=config, streamer=streamer, tokenizer=tokenizer)  # for stop_strings
    backend.sync()
    return out.sequences[0, ids.shape[1] :].tolist(), streamer, out


@contextlib.contextmanager
def compiled_forward(model, **compile_options):
    """HF's own recipe for a faster ``generate``, set up on any device: inside the block the
    model's forward is ``torch.compile``d (what ``generate`` does by itself with
    ``cache_implementation="static"`` on cuda, xpu and tpu, not on a CPU); pass
    ``cache_implementation="static"`` to ``generate`` or ``measure``. After it, the class's own
    forward again."""
    model.forward = torch.compile(model.forward, **compile_options)
    try:
        yield
    finally:
        del model.forward


def measure(
    model, tokenizer, ids, backend: Backend, new_tokens: int, repeats: int = 3, warmup: int = 1, **kwargs
) -> dict:
    """Prefill seconds and decode tokens/s, each the median over ``repeats`` runs after
    ``warmup`` runs of exactly ``new_tokens`` (no stop: every run times the same count);
    every step ends with the token on the host, so the device is synced. ``tokens``: those
    up to the first stop id, for comparison."""
    runs = []
    for i in range(warmup + repeats):
        tokens, streamer, _ = generate(model, tokenizer, ids, backend, new_tokens, stop=False, **kwargs)
        if i >= warmup:
            runs.append(streamer.step_seconds)
    prefill = statistics.median(r[0] for r in runs)
    rates = [(len(r) - 1) / sum(r[1:]) for r in runs]
    return {
        "prefill_s": prefill,
        "decode_tok_s": statistics.median(rates),
        "tok_s_spread": max(rates) / min(rates),
        "rates": rates,
        "tokens": until_stop(tokens, stop_ids(model)),
        "repeats": repeats,
    }


def ops_per_step(model, context: int = 26) -> dict[str, int]:
    """The aten ops one eager decode step runs after a ``context``-token prompt, counted by
    torch's dispatcher (a ``TorchDispatchMode``: no profiler counts ops on the meta device):
    ``compute``, those that make new data, each a launch from the host in eager mode, and
    ``views``, metadata only. Works on the meta device, so on E2B's real configuration."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"compute": 0, "views": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["views" if func.is_view else "compute"] += 1
            return func(*args, **(kwargs or {}))

    device = next(model.parameters()).device
    with torch.no_grad():
        cache = model(torch.zeros(1, context, dtype=torch.long, device=device), use_cache=True).cache
        token = torch.zeros(1, 1, dtype=torch.long, device=device)
        with Count():
            model(token, cache=cache, use_cache=True)
    return counts


# Under defer-and-fuse every step of a first call is a new shape, so a whole-model compile:
# 8 steps show it (32 would mean 32 E2B compiles on a TPU); the xla backend uses 8 throughout.
DEFER_AND_FUSE_TOKENS = 8


def first_and_second_call(model, tokenizer, ids, backend: Backend, new_tokens: int) -> dict[str, dict]:
    """Per mode (eager, and defer-and-fuse where the backend has it): seconds per step of the
    first call and of a second, identical call, and the device programs each step compiled.
    Defer-and-fuse generates at most ``DEFER_AND_FUSE_TOKENS``."""
    calls = {}
    for mode in backend.modes:
        if mode == "compile":
            continue  # HF generate as such is not compiled here: notebook 04 compiles a decode step
        length = min(new_tokens, DEFER_AND_FUSE_TOKENS) if mode == "defer_and_fuse" else new_tokens
        with backend.mode(mode):
            tokens, first, _ = generate(model, tokenizer, ids, backend, length)
            _, second, _ = generate(model, tokenizer, ids, backend, length)
        calls[mode] = {
            "tokens": tokens,
            "first": first.step_seconds,
            "second": second.step_seconds,
            "programs_first": first.step_programs,
            "programs_second": second.step_programs,
        }
    return calls
