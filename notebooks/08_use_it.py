# ---
# jupyter:
#   accelerator: TPU
#   colab:
#     gpuType: V5E1
#     provenance: []
#   jupytext:
#     formats: ipynb,py:percent
#     notebook_metadata_filter: accelerator,colab
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 08 · Use it: sampling, stopping at the end of a turn, a chat, the ring inside `generate`
#
# **What the source measured:** nothing here: it decoded a fixed count of greedy tokens, as
# notebooks 03-07 do to compare steps. People who copy these cells want more: sampled text,
# a reply that stops where a turn ends, and a conversation whose history is not run again.
#
# Here, on notebook 06's ring cache: temperature, top-k and top-p chosen on the device inside
# the compiled step, with transformers' own names and warpers; stop ids and stop strings checked
# once per readback; a chat that appends each turn to the cache; and the ring cache handed to
# transformers' own `generate`. The twin of the checkpoint only knows a few answers, so its
# sampled text is odd: the checks are about the mechanics, the real checkpoint makes the prose.
#
# ## Set up

# %%
# Set up, the same cell in every notebook (written by tools/publish.py): fetch the course
# where `helpers` is not importable (Colab), then install what this runtime lacks. Safe to rerun.
import importlib.util
import os
import subprocess
import sys

COURSE_REPO = os.environ.get("COURSE_REPO", "https://github.com/OWNER/gemma4-on-tpu")  # a URL or a folder
COURSE_REF = os.environ.get("COURSE_REF", "main")  # the branch or tag these notebooks go with
COURSE_DIR = os.environ.get("COURSE_DIR", "/content/course")


def is_course(folder):  # the course's helpers is a package with its course/ beside its __init__
    return folder is not None and os.path.isfile(os.path.join(folder, "course", "setup.py"))


spec = importlib.util.find_spec("helpers")
if not is_course(spec and spec.submodule_search_locations and spec.submodule_search_locations[0]):
    if not os.path.isdir(os.path.join(COURSE_DIR, "helpers")):
        fetch = subprocess.run(
            ["git", "clone", "-q", "--depth", "1", "--branch", COURSE_REF, COURSE_REPO, COURSE_DIR],
            capture_output=True,
            text=True,
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
        if fetch.returncode:
            raise SystemExit(
                f"could not fetch the course from {COURSE_REPO} ({COURSE_REF}): {fetch.stderr.strip()}\n"
                "Set COURSE_REPO to your copy, a URL or a folder: os.environ['COURSE_REPO'] = '...', then rerun."
            )
        print(f"fetched {COURSE_REPO} ({COURSE_REF}) into {COURSE_DIR}")
    sys.path.insert(0, COURSE_DIR)
    sys.modules.pop("helpers", None)  # a stray module of that name imported earlier
import helpers

if not is_course(os.path.dirname(helpers.__file__ or "")):
    raise SystemExit(f"`helpers` came from {helpers.__file__}, not the course: rename that file, then rerun.")
print("the course:", os.path.dirname(os.path.dirname(helpers.__file__)))
helpers.install_missing()

# %%
import matplotlib.pyplot as plt
import torch

from helpers.course.report import fmt_bytes, table

backend = helpers.get_backend()
series = helpers.course.series.prepare(backend, after=6)  # notebook 06's model: the 4-bit table, attention grouped
checkpoint, model, tokenizer, ids = series.checkpoint, series.model, series.tokenizer, series.ids
MAX_LEN = 256 if checkpoint.tiny else 8192  # the chat's context: the full layers' buffer

# %% [markdown]
# ## Sampling inside the compiled step
# **What we test:** transformers' `GenerationConfig` names (`do_sample`, `temperature`,
# `top_k`, `top_p`) run by its own warpers, in `generate`'s order, on the device; one draw per
# token by the [Gumbel-max](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#gumbel-max) trick: the argmax of the warped scores plus noise that is a fixed
# function of (seed, position), computed from a 32-bit integer hash in int32 words (a TPU has no
# 64-bit integers). No generator state lives in the compiled program, so a new
# seed is a new input, not a recompile, and one seed gives the same tokens twice.


# %%
# @save helpers.sampling
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


# %% [markdown]
# The noise, written here and kept, the same, in `helpers.sampling` (a test checks the two are
# the same). A row depends on the seed and the position only: the same pair gives the same
# noise, another position other noise. `Sampler` adds it to the warped scores and takes the
# argmax, inside the compiled step:

# %%
noise = gumbel(torch.tensor([7]), torch.tensor([40, 40, 41]), 6)
print(noise)
# equal bits by construction: the same integers through the same elementwise ops (no sum)
assert torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# The sampler, written here too (kept, the same, in `helpers.sampling`, which the decoders'
# compiled steps call): transformers' own warpers, in `generate`'s order, then the argmax of the
# scores plus the noise; greedy is the argmax alone. Top-k first takes its k candidates
# (`topk`), and temperature and top-p run on those alone: top-p sorts its scores, and sorting
# k of them costs nothing beside sorting E2B's 262,144 for every row, every draft and every
# verify.

# %%
# @save helpers.sampling
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from helpers.sampling import UNSUPPORTED  # what the compiled step refuses: min_p, typical_p, ...


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


# %% [markdown]
# The sampler goes into notebook 04's decoder in place of its argmax (`pick`), with the seed as a
# device tensor (a new seed is a new input, not a recompile) and stop strings beside the stop ids,
# written here (kept, the same, in `helpers.sampling`): a class that goes first among a decoder's
# bases, so notebook 04's `Decoder` and notebook 06's `RingDecoder` both sample.

# %%
# @save helpers.sampling
from helpers.decode import Decoder
from helpers.generate import Stops, stop_strings_criteria
from helpers.ring import RingDecoder


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


# %%
settings = helpers.sampling.sampling_config(temperature=1.0, top_k=64, top_p=0.95)  # pick your own
sampled = SampledRingDecoder(model, backend, max_len=MAX_LEN, sampling=settings)
print(sampled.sampler)
# NBVAL_CHECK_OUTPUT

# %%
with backend.compile_counter() as first:
    one = sampled.generate(ids, series.new_tokens, seed=0)
with backend.compile_counter() as again:
    runs = {seed: sampled.generate(ids, series.new_tokens, seed=seed) for seed in (0, 1, 2)}
print(table([{"seed": s, "text": tokenizer.decode(t, skip_special_tokens=True)[:70]} for s, t in runs.items()]))
print(f"graphs compiled: {first.graphs} on the first call (prefill chunk, step), {again.graphs} for three more seeds")
assert runs[0] == one and again.graphs == 0  # equal lists: the same programs on the same inputs

# %% [markdown]
# **What you should see:** seed 0 twice gives the same text, and nothing compiles after the
# first call. A draw follows the warped distribution: 2,000 draws of the first token (each
# with its own position, so its own noise), beside the probabilities transformers' warpers
# give, at temperature 1.5 so that more than one token has a chance.

# %%
hot = Sampler(helpers.sampling.sampling_config(temperature=1.5, top_k=64, top_p=0.95))
with torch.no_grad():
    logits = model(ids).logits[:, -1].float()
probs = hot.scores(logits).softmax(-1)[0].cpu()
counts = torch.zeros_like(probs)
for start in range(0, 2000, 250):  # in blocks: 250 rows of E2B's 262,144 logits are 262 MB
    rows = torch.arange(start, start + 250, device=logits.device)
    drawn = hot(logits.expand(250, -1), rows, torch.tensor([0], device=logits.device))
    counts += torch.bincount(drawn.view(-1).cpu(), minlength=probs.numel())
top = probs.argsort(descending=True)[:8]
fig, ax = plt.subplots(figsize=(8, 3))
x = torch.arange(len(top))
ax.bar(x - 0.2, probs[top], 0.4, label="transformers' warped probability")
ax.bar(x + 0.2, counts[top] / 2000, 0.4, label="share of 2,000 draws")
ax.set_xticks(x, [repr(tokenizer.decode([int(t)])) for t in top], rotation=30)
ax.set_ylabel("probability")
ax.set_title(f"the first token, sampled on the device: {checkpoint.name} on {backend.name}, this run")
ax.legend()
assert counts[probs == 0].sum() == 0  # what top-k and top-p remove is never drawn

# %% [markdown]
# ## Stopping at the end of a turn, streamed
# **What we test:** `generate`'s stop ids (the generation config's EOS list: `<eos>`,
# `<turn|>`) and stop strings (transformers' `StopStringCriteria`), checked once per
# readback of 4 tokens, so without a host round trip per token; the text streams into the
# same widget as notebook 03, with live tok/s.

# %%
# @save helpers.generate
# notebook 03's rule, with transformers' StopStringCriteria
from transformers import StopStringCriteria

from helpers.generate import first_stop, stop_ids


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


# %%
widget = helpers.course.report.text_widget()
streamer = helpers.generate.StepStreamer(tokenizer, backend, widget)
stop = "."
tokens = sampled.generate(
    ids, series.new_tokens, readback_every=4, seed=0, stop_strings=[stop], tokenizer=tokenizer, streamer=streamer
)
text = tokenizer.decode(tokens, skip_special_tokens=True)
print(f"{len(tokens)} tokens, {streamer.tok_s or 0:.1f} tok/s after the first: {text!r}")
assert stop in text or tokens[-1] in helpers.generate.stop_ids(model) or len(tokens) == series.new_tokens

# %% [markdown]
# **What you should see:** the text ends at the first full stop (or at `<turn|>`, or at
# the length, if it comes first). Tokens made after the stop within the same readback are
# dropped: that is the price of not reading each token back.
#
# ## The ring cache inside transformers' `generate`
# **What we test:** `generate` given a `RingCache` (`cache=`), inside
# `helpers.ring.inside_generate(model)`, gives its default cache's tokens for a prompt three
# windows long. `generate` builds masks that assume keys at positions 0..n; inside the block,
# hooks on the model give its forward the ring's masks and positions instead, so any generation
# config runs on the ring: greedy, sampled, streamed, stopped by a string. Outside the block a
# `RingCache` is refused with a message that names it. With the forward compiled (HF's recipe),
# the graphs dynamo makes before each token: the prefill, the first step, then none, where HF's
# own static cache recompiled every position (notebook 04).

# %%
# @save helpers.ring
import contextlib

from helpers.ring import RingCache


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


# %%
window = model.config.get_text_config().sliding_window
long = torch.randint(3, model.config.vocab_size, (1, 3 * window + 5), generator=torch.Generator().manual_seed(0))
long = long.to(backend.device)
n = min(series.new_tokens, 12)
default, _, _ = helpers.generate.generate(model, tokenizer, long, backend, n, stop=False)  # its default cache
on_ring, cache, _ = helpers.course.measure.generate_on_ring(model, long, backend, n, max_len=MAX_LEN)
print(f"prompt {long.shape[1]} tokens (window {window}); ring cache {fmt_bytes(helpers.decode.cache_bytes(cache))}")
verdict = helpers.course.verdict.compare_tokens(on_ring, default, series.reference_model(), long)  # two programs
print("greedy, against the default cache:", verdict)
assert verdict

# sampled and streamed, with a stop string: generate's own sampling, on the ring
streamer = helpers.generate.StepStreamer(tokenizer, backend, helpers.course.report.text_widget())
torch.manual_seed(0)  # generate draws from torch's generator
with inside_generate(model):
    out = model.generate(
        long,
        cache=helpers.ring.RingCache(model, MAX_LEN, window),
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        max_new_tokens=n,
        stop_strings=["."],
        tokenizer=tokenizer,
        streamer=streamer,
        return_dict_in_generate=True,
    )
print(f"sampled on the ring: {out.sequences.shape[1] - long.shape[1]} tokens, {streamer.text!r}")
if not backend.runs_compiled_generate:  # it crashed torch_xla 2.9's process: refused, with the reason
    print("forward compiled: not on xla (RingDecoder.generate is its compiled path)")
else:
    _, _, graphs = helpers.course.measure.generate_on_ring(model, long, backend, n, max_len=MAX_LEN, compiled=True)
    print("graphs compiled before each token, forward compiled:", graphs)
    assert sum(graphs[2:]) == 0

# %% [markdown]
# **What you should see:** the same tokens, a sampled reply that ends at its first full stop (or
# at the length), and graphs `[1, 1, 0, 0, ...]`. `generate` still makes one host round trip per
# token and runs its warpers on the host side of that trip, so `RingDecoder.generate` stays the
# fast path; this is for code that must call `generate`.
#
# ## A chat that keeps its cache
# **What we test:** each turn's tokens, as the chat template writes them, prefilled in chunks
# at the cache's current position: the history is never run again. Each reply is read back in
# the decoder's blocks of 16, not token by token: a block may run past the reply's stop, and the
# ring's 16 spare slots (notebook 06) keep those tokens off every slot the next turn still sees;
# the next turn writes over them. After each turn, the
# context and the cache's bytes (allocated once: the ring's sliding layers hold a window and
# the spare slots, the full layers `MAX_LEN` positions); before a turn would pass the full
# layers' buffer, a clear message instead. The tests check that turn 2's tokens equal those of the whole conversation
# given as one prompt to the model with no cache. `USE_ASSISTANT = True` below makes it draft
# with Gemma 4's assistant (notebook 09's speculative sampling): the same settings, the replies
# drawn from the target's own distribution, several tokens per pass over its weights.


# %%
# @save helpers.chat
@helpers.add_to_class(helpers.chat.Chat)
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


# %%
USE_ASSISTANT = False  # True: the chat drafts with Gemma 4's assistant, notebook 09's draft and verify
if USE_ASSISTANT:
    dtype = helpers.course.hub.series_dtype(checkpoint)
    assistant = helpers.draft.load_assistant(helpers.course.hub.choose_assistant(checkpoint), backend, dtype)
    talker = helpers.draft.SpeculativeRingDecoder(model, assistant, backend, MAX_LEN, draft_tokens=4, sampling=settings)
    print("the chat drafts with Gemma 4's assistant (notebook 09): sampled as before, from the target's distribution")
else:
    talker = sampled
    print("the chat samples, one token per pass over the weights (USE_ASSISTANT = True drafts, notebook 09)")
chat = helpers.chat.Chat(talker, tokenizer, max_new_tokens=series.new_tokens)
for message in ["Explain why compilation matters on a TPU, in two sentences.", "And on a GPU?"]:
    reply = chat.say(message)
    status = chat.status()
    print(f"you: {message}\nmodel: {reply}")
    print(f"   context {status['context']} of {status['max_len']} positions, cache {fmt_bytes(status['cache_bytes'])}")
assert len(chat.replies) == 2 and chat.status()["context"] == len(chat.tokens)

# %% [markdown]
# ## Talk to it
# The same chat in a widget: type a message, then Enter. The reply streams in with its tok/s;
# the context and the cache follow. (Here a scripted turn runs first, so the cell is checked
# when the notebook runs unattended.)

# %%
ui = helpers.course.report.chat_widget(helpers.chat.Chat(talker, tokenizer, max_new_tokens=series.new_tokens))
ui.submit("Hello!")

# %% [markdown]
# **What you should see:** your turns and the model's, each with its tok/s and the context so
# far. On the tiny twin the replies are the few answers it was trained on; on the real
# checkpoint, Gemma. Everything in this notebook past the twin (E2B's sampled prose, its
# tok/s on a TPU) is a path the course's builders could not run: no TPU and no real weights
# where it is built.

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** Does sampling with `top_k=1` give the greedy token?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# Yes: top-k keeps one token, and the noise cannot lift a removed token (its score is -inf).
one = helpers.sampling.Sampler(helpers.sampling.sampling_config(top_k=1))
positions = torch.arange(8, device=logits.device)
drawn = one(logits.expand(8, -1), positions, torch.tensor([3], device=logits.device))
print("top_k=1 draws:", drawn.view(-1).tolist(), "| argmax:", logits.argmax(-1).item())

# %% [markdown]
# **2.** With a stop string that ends mid-reply, how many tokens past it does the decoder make
# before it stops?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# It checks once per readback chunk: up to one chunk less one token are made and dropped.
full = sampled.generate(ids, series.new_tokens, seed=0, stop_ids=())
cut_at = len(full) // 2
stop = tokenizer.decode(full[cut_at : cut_at + 1]).strip() or tokenizer.decode(full[cut_at : cut_at + 2])
for every in (1, 4, 8):
    kept = sampled.generate(
        ids, series.new_tokens, readback_every=every, seed=0, stop_strings=[stop], tokenizer=tokenizer
    )
    made = -(-len(kept) // every) * every  # whole chunks: what the device computed
    print(f"readback every {every}: kept {len(kept)} tokens, made {min(made, series.new_tokens)}")
