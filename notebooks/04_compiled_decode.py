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
# # 04 · A compiled decode step: compile one token once, reuse it for every token
#
# **What the source measured:** compiling one whole decode step took Gemma 4 E2B from ~5
# to 31-33 tokens/s on a TPU v5e-1, once the compressed-tensors wrappers that blocked
# tracing were removed.
#
# Here: why `torch.compile` stops on the model as loaded, how compressed-tensors' own API
# removes its wrappers, a preallocated KV cache, one single-token step compiled with
# `fullgraph=True`, and a loop that keeps every token on the device and reads them back in
# chunks. Same tokens as notebook 03, one compilation for the step however long we decode.

# %% [markdown]
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
backend = helpers.get_backend()
series = helpers.course.series.prepare(backend, after=3)  # the model as notebook 03 loaded it
checkpoint, model, tokenizer, ids = series.checkpoint, series.model, series.tokenizer, series.ids
new_tokens, reference = series.new_tokens, series.reference  # notebook 03's length and tokens
timed_tokens = series.timed_tokens  # tokens per timed run: 128, enough for a steady rate (8 on xla)
# the positions the static cache holds: the prompt and 128 tokens (a timed run, the long run
# below), rounded up to a bucket. A step reads its whole buffer, so sizing the cache to the run,
# as HF's static cache does, is a speed-up: positions past the run are read for nothing.
MAX_LEN = helpers.decode.cache_length(ids.shape[1] + 128)

# %% [markdown]
# ## Why `torch.compile` stops on the model as loaded
# compressed-tensors wrapped the forward of every module (quantized forwards, then its
# offloading layer after the first forward decompressed the weights). Dynamo cannot trace
# through them: each is a [graph break](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#graph-break), which `fullgraph=True` makes an error. Here is the error
# from this run.

# %%
import torch

with torch.no_grad():
    model(ids)  # the first forward: compressed-tensors decompresses here, as in notebook 02
print(helpers.course.report.table(helpers.checkpoint.compression_report(model)))
try:
    helpers.decode.Decoder(model, backend, MAX_LEN).generate(ids, 2)
    print("compiled as is: nothing in the way on this backend (loaded with dequantize=True)")
except torch._dynamo.exc.TorchDynamoException as err:
    print(f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")

# %% [markdown]
# ## Strip the wrappers, with compressed-tensors' own API
# **What we test:** weights decompressed once, in place; quantized forwards unwrapped and
# their parameters dropped (`QuantizationMetadata.clear_quantization`); the offloading
# wrappers removed (`remove_dispatch`). Nothing compressed-tensors attached is left.

# %%
removed = helpers.decode.strip_compressed_wrappers(model)
print(removed)
report = {r["what"]: r["count"] for r in helpers.checkpoint.compression_report(model)}
assert report["modules with a wrapped forward"] == 0 and report["modules with forward hooks"] == 0, report

# %% [markdown]
# ## The step, and the loop around it
# The whole lesson in four lines, written here (and kept, the same, in `helpers.decode` for the
# notebooks after this one; a test checks the two are the same): the last token and its
# position in, the model's forward on the cache, the next token and its position out, all on
# the device. Edit it and rerun the cells below it.

# %%
# @save helpers.decode
from transformers import Cache


def greedy_step(model, cache: Cache, token, position):
    """One decode step: the last token in, the next greedy token and its position out."""
    logits = model(input_ids=token, position_ids=position, cache=cache, use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True), position + 1


# %% [markdown]
# Run as it is, eagerly: the prompt through it once (its last position's token is the first new
# one), then each token fed straight back, on a static cache of `MAX_LEN` positions. Its tokens
# are notebook 03's by the series' verdict (two programs: eager here, HF's `generate` there).

# %%
cache = helpers.decode.static_cache(model, MAX_LEN)
with torch.no_grad():
    token, position = greedy_step(model, cache, ids, torch.arange(ids.shape[1], device=ids.device)[None])
    position, eager = position[:, -1:], [token.item()]
    for _ in range(7):
        token, position = greedy_step(model, cache, token, position)
        eager.append(token.item())
# the series' verdict over notebook 03's first 8 tokens, teacher-forced through the reference model
verdict = helpers.course.verdict.compare_tokens(eager, reference[:8], series.reference_model(), ids)
print(f"{len(eager)} tokens, eager: {tokenizer.decode(eager)!r}; {verdict}")
assert verdict
del cache

# %% [markdown]
# A prompt's rows need layers 15-34 only where a token comes out: those layers keep no K/V of
# their own (they read layers 13's and 14's), so nothing later reads what they make for the
# other rows. transformers skips them for every row but the last when `logits_to_keep` is an
# int; the decoder's prefill pads the prompt to a bucket, so its last real row is a tensor, and
# `skip_shared_layers` (written here, kept the same in `helpers.decode`) takes transformers' own
# cut at that row. At E2B that is most of a prefill's multiplications (notebook 06 counts them).


# %%
# @save helpers.decode
def skip_shared_layers(model) -> None:
    """Run the layers that keep no K/V of their own, and the head, on the prompt rows ``logits_to_keep`` names when it is
    a tensor, as transformers does for the last rows when it is an int (``_maybe_slice_kv_shared_inputs``, its cut,
    taken at our rows): a padded prompt's last real row is not its last. Their K/V come from earlier layers, so no
    other row needs them. Idempotent."""
    text = model.model
    own = type(text)._maybe_slice_kv_shared_inputs
    first_shared = len(text.layers) - text.config.num_kv_shared_layers

    def cut(hidden, per_layer, rotary, masks, logits_to_keep, cache=None, **kwargs):
        if not torch.is_tensor(logits_to_keep) or cache is None:
            return own(text, hidden, per_layer, rotary, masks, logits_to_keep, cache=cache, **kwargs)
        rows = logits_to_keep.view(-1)
        # a mask of None is SDPA's causal flag, which counts rows from the first: for our rows, keys up to the row
        keys = {kind: cache.layers[i].keys.shape[2] for i, kind in enumerate(text.config.layer_types[:first_shared])}
        causal = {kind: torch.arange(n, device=rows.device) <= rows[:, None] for kind, n in keys.items()}
        return (
            hidden.index_select(1, rows),
            None if per_layer is None else per_layer.index_select(1, rows),
            {kind: (cos.index_select(1, rows), sin.index_select(1, rows)) for kind, (cos, sin) in rotary.items()},
            {kind: causal[kind][None, None] if m is None else m.index_select(2, rows) for kind, m in masks.items()},
        )

    text._maybe_slice_kv_shared_inputs = cut


# %% [markdown]
# The decoder around that step, written here (kept, the same, in `helpers.decode`; a test checks
# the two are the same). `step` is `greedy_step` with the token chosen by `pick` (the argmax here;
# notebook 08 samples) and the cache's buffers marked as written in place (`Backend.donate`,
# below). It is compiled once, as `decode_step`; the prompt goes through `prefill`, padded to a
# bucket so that prompts of similar length share one compiled prefill. `generate` is the loop:
# each token fed straight back through `call` (one compiled call; notebook 07 makes it K tokens),
# read to the host once per chunk, and cut there after a stop id (`Stops`, notebook 03's rule;
# notebook 08 adds stop strings).

# %%
# @save helpers.decode
from helpers.backend import Backend
from helpers.decode import (
    PREFILL_BUCKETS,
    READBACK_EVERY,
    cache_length,
    kv_buffers,
    set_length,
    static_cache,
)
from helpers.generate import Stops


class Decoder:
    """The model on a static cache: a compiled prefill per bucket and one compiled decode step, ``token, position ->
    next token, position + 1``, all int64 device tensors [1, 1], the token chosen by ``pick``."""

    def __init__(self, model, backend: Backend, max_len: int, **compile_options):
        self.model, self.backend, self.max_len = model, backend, max_len
        skip_shared_layers(model)  # a prefill's rows past the last real one stop at the last layer that keeps K/V
        self.cache = self.new_cache(model, max_len)
        self.decode_step = backend.compile(self.step, fullgraph=True, **compile_options)
        self.prefill_step = backend.compile(self.prefill_forward, fullgraph=True, **compile_options)

    def new_cache(self, model, max_len: int) -> Cache:
        return static_cache(model, max_len)

    def pick(self, logits, positions):
        """The next token [N, 1] from logits [N, vocab], to go at ``positions`` [N]: the argmax."""
        return logits.argmax(-1, keepdim=True)

    def step(self, token, position):
        self.backend.donate(*kv_buffers(self.cache))  # written in place below: reused, not copied (xla)
        logits = self.model(input_ids=token, position_ids=position, cache=self.cache, use_cache=True).logits
        return self.pick(logits[:, -1], position.view(-1) + 1), position + 1

    def prefill_forward(self, tokens, last):
        self.backend.donate(*kv_buffers(self.cache))
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        # layers 15-34 and the head on the last real position only: a 4096-token bucket's logits would be 2.1 GB at E2B
        logits = self.model(
            input_ids=tokens, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=last
        ).logits
        return self.pick(logits[0], last + 1)  # the token after the last real one


# %% [markdown]
# The prompt: padded on the host to the smallest bucket that holds it, copied over with its lengths as data, so
# prompts of any length in one bucket run one compiled prefill. The padding is written into the cache, then
# forgotten: the cache's length is set back to the prompt's.


# %%
# @save helpers.decode
@helpers.add_to_class(Decoder)
def bucket(self, length: int) -> int:
    """The padded prefill length: the smallest bucket that holds the prompt."""
    size = cache_length(length)
    if size in PREFILL_BUCKETS and size <= self.max_len:
        return size
    raise ValueError(f"a {length}-token prompt needs more than the cache's {self.max_len} positions")


@helpers.add_to_class(Decoder)
@torch.no_grad()
def prefill(self, ids: torch.Tensor, start: int = 0):
    """The prompt right-padded to its bucket (causal attention keeps padding out; the cache is rewound over it): the
    first new token and its position."""
    if start:
        raise ValueError("a static cache's prefill starts at 0: RingDecoder goes on from a position")
    length = ids.shape[1]
    # built on the host, then copied: a TPU compiles an eager op per shape (deferred, per scalar value too)
    padded = torch.zeros(1, self.bucket(length), dtype=ids.dtype)
    padded[:, :length] = ids.cpu()
    lengths = torch.tensor([0, length - 1, length]).to(ids.device)  # data copied, not a constant per length
    zero, last, end = lengths[0], lengths[1:2], lengths[2]
    set_length(self.cache, zero)
    token = self.prefill_step(padded.to(ids.device), last)
    set_length(self.cache, end)
    return token, end.view(1, 1)


# %% [markdown]
# The loop: each call's tokens stay on the device and feed the next call; the host reads them once per block of
# `readback_every` and cuts the run after a stop id there.


# %%
# @save helpers.decode
@helpers.add_to_class(Decoder)
@torch.no_grad()  # as generate runs it: with grad on, dynamo would compile the step again
def call(self, token, position):
    """One compiled call: the tokens it made [1, K] (K = 1 here; notebook 07 makes more), the last token and
    position."""
    token, position = self.decode_step(token, position)
    return token, token, position


@helpers.add_to_class(Decoder)
def check_room(self, length: int, new_tokens: int, start: int = 0, extra: int = 0) -> None:
    """Refuse, with the numbers, a run the cache cannot hold."""
    if start + length + new_tokens + extra > self.max_len:
        held = f"{start} positions held + " if start else ""
        more = f" (+ {extra}: the last call's)" if extra else ""
        raise ValueError(
            f"{held}prompt {length} + {new_tokens} new tokens{more} exceed the cache's {self.max_len} positions"
        )


@helpers.add_to_class(Decoder)
def stops(self, history: list[int], stop_ids) -> Stops:
    """Where a run stops: after the first of ``stop_ids`` (None: the model's)."""
    return Stops(self.model, history, stop_ids)


@helpers.add_to_class(Decoder)
@torch.no_grad()
def generate(
    self, ids, new_tokens: int, readback_every: int = READBACK_EVERY, stop_ids=None, streamer=None, start: int = 0
):
    """At most ``new_tokens`` tokens after ``ids`` (at ``start``), fed straight back on the device, read to the host
    every ``readback_every`` and cut by ``stops`` (``stop_ids=()``: exactly ``new_tokens``)."""
    self.check_room(ids.shape[1], new_tokens, start)
    stops = self.stops(ids.cpu()[0].tolist(), stop_ids)  # a copy, not a device op per prompt length
    if streamer is not None:
        streamer.put(ids.cpu())
    token, position = self.prefill(ids, start)
    tokens, pending, made = [], [token], 1
    while True:
        last = made >= new_tokens
        if last or made - len(tokens) >= readback_every:  # one host round trip per chunk
            self.backend.flush()
            chunk, stopped = stops.cut(torch.cat(pending, dim=1)[0].tolist()[: new_tokens - len(tokens)])
            tokens, pending = tokens + chunk, []
            if streamer is not None:
                streamer.put(torch.tensor(chunk))
            if last or stopped:
                if streamer is not None:
                    streamer.end()
                return tokens
        block, token, position = self.call(token, position)
        pending.append(block)
        made += block.shape[1]


# %% [markdown]
# ## One step, compiled once
# **What we test:** the decode step (`token, position -> next token, position + 1`, greedy
# argmax on the device, the cache updated in place) compiles once, the prompt's prefill
# once for its bucket; then a longer run, far past the sliding window, and a prompt of
# another length in the same bucket compile nothing. Dynamo is told to fail on any
# recompile inside that block. The compiler is the backend's own (`"tpu"` on TorchTPU,
# `"openxla"` on PyTorch/XLA, inductor on CUDA and CPU); options pass through, e.g.
# `Decoder(model, backend, MAX_LEN, mode="reduce-overhead")` for CUDA graph replay.
# It stops where `generate` stops, after the first stop id, checked once per readback
# (every 16 tokens): no host round trip per token; `stop_ids=()` asks for an exact count.
# "The same tokens" is the series' one verdict (`series.same_tokens`): a compiled step and HF's
# eager `generate` are two programs that round differently, so the run is [teacher-forced](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#teacher-forced)
# through the checkpoint's reference model, each token its top choice or within 4 [ulps](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#ulp) of it.

# %%
torch.compiler.reset()
decoder = Decoder(model, backend, MAX_LEN)
with backend.compile_counter() as first:
    tokens = decoder.generate(ids, new_tokens)
print("graphs compiled by the first run (prefill + decode step):", first.graphs)
verdict = series.same_tokens(tokens)  # notebook 03's HF generate
print(verdict)
assert verdict and first.graphs == 2

long_run = MAX_LEN - decoder.bucket(ids.shape[1])
other = helpers.checkpoint.chat_ids(tokenizer, backend.device, prompt="Why do shapes matter?")
with backend.compile_counter() as later, helpers.course.measure.no_recompiles():
    decoder.generate(ids, long_run, stop_ids=())  # exactly long_run tokens, past the end of turn
    decoder.generate(other, 4)
print(
    f"then {long_run} tokens (to position {ids.shape[1] + long_run}, window {model.config.sliding_window})"
    f" and a {other.shape[1]}-token prompt: {later.graphs} new graphs"
)
assert later.graphs == 0 and decoder.bucket(other.shape[1]) == decoder.bucket(ids.shape[1])

# %% [markdown]
# ## The trap this avoids: transformers' `StaticCache` in a compiled step
# Its sliding-window layers count tokens in a Python int and shift their buffer once full,
# so under static shapes (what transformers picks on a TPU) every position is a new [guard](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#guard).
# Counted in this run (dynamo's `eager` backend: the same recompiles, without the compile
# cost):

# %%
# @save helpers.decode
import functools

from helpers.decode import greedy_step


def hf_static_cache_compiles(model, ids, backend: Backend, steps: int) -> tuple[list[int], str | None]:
    """Graphs compiled per step over transformers' ``StaticCache`` (its sliding layers count tokens in
    a Python int: each position is a new guard), and dynamo's error at its recompile limit."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps + 1)

    compiled = torch.compile(
        functools.partial(greedy_step, model, cache), backend="eager", dynamic=False, fullgraph=True
    )
    with torch.no_grad():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position = torch.tensor([[ids.shape[1]]], device=ids.device)
        counts = []
        torch.compiler.reset()
        for _ in range(steps):
            try:
                with backend.compile_counter() as count:
                    token, position = compiled(token, position)
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                return counts, str(err).splitlines()[0]
            counts.append(count.graphs)
    return counts, None


# %%
counts, stopped = hf_static_cache_compiles(model, ids, backend, steps=4)
print("graphs compiled per step with StaticCache:", counts, "| stopped:", stopped or "no")
print("graphs compiled per step with ours, after the first:", 0)
assert sum(counts) > 1

# %% [markdown]
# ## Does the step write its cache in place?
# **What we test:** a decode step writes one position of each KV cache buffer. A program that
# writes in place reuses the cache's buffers for its outputs (in XLA's words: those inputs are
# *[aliased](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#aliased-donated)* to outputs, *donated*); one that does not writes a whole new copy of every buffer
# per token: at E2B's 131,328 positions, 0.81 GB written per token on top of what the step
# reads. Inductor (CPU, GPU) writes in place by itself. PyTorch/XLA aliases a compiled graph's
# input only when the graph marks it a buffer donor, which `Decoder.step` and the prefill do
# through `Backend.donate`. On the `xla` backend started with `HELPERS_XLA_AUDIT=1`, XLA dumps
# what it compiles (its [HLO](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#hlo)) and the cell reads it (`helpers.course.audits`): per program, the cache buffers,
# how many are aliased, the bytes copied per call.
#
# On a TPU, TorchTPU's `torch.compile` backend does not write the cache in place. Its sources
# (`torch_tpu/_internal/compile/_backend.py`, in the 0.2.0 wheel on PyPI and in the public mirror
# `jonathan1920/torch_tpu`) call `aot_autograd(..., keep_inference_input_mutations=False)`, and it
# takes no option for donation. (Its eager in-place ops, in strict eager, do donate their buffers.)
# A mutated input is [functionalized](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#functionalized): the program returns the updated cache as a new
# buffer, and torch's own runtime wrapper copies it back into the cache's tensor after each
# call (`copy_`). At 131,328 positions that is about 1.6 GB more traffic a token, and a second
# copy of the cache at the peak. Newer TorchTPU code has a `donated_inputs` list in its compiler,
# which this compile path does not reach; no machine building the course could try another.
# So this stays a hypothesis, and the section's last code cell prints the test a reader's v5e-1 runs: the
# step timed at one context with caches of two lengths. The extra time, times the bandwidth,
# over the extra cache bytes counts the passes a step makes over its cache: about 1 if it
# writes in place, 3 or more if each call's cache is copied back.

# %%
e2b = helpers.course.e2b.real_config().get_text_config()
keeping = e2b.num_hidden_layers - e2b.num_kv_shared_layers  # the layers that keep K/V of their own
ring = helpers.course.e2b.kv_cache_bytes(e2b, helpers.course.e2b.CONTEXT, ring=True)
print(
    f"E2B: a step writes {2 * keeping} K/V buffers ({keeping} layers keep their own); at {helpers.course.e2b.CONTEXT:,}"
    f" positions they hold {helpers.course.report.fmt_bytes(ring)} (notebook 06's ring); if each call"
    f" copies them back (the hypothesis above), {helpers.course.report.fmt_bytes(2 * ring)} more read and written a token"
)
# NBVAL_CHECK_OUTPUT


# %%
# @save helpers.backend
@helpers.add_to_class(helpers.backend.Backend)
def donate(self, *tensors: torch.Tensor) -> None:
    """Inside a compiled function: ``tensors`` written in place (a KV cache) lend their buffers to its outputs.
    PyTorch/XLA aliases only inputs marked so, else it copies them every call (``helpers.course.audits``);
    TorchTPU 0.2.0 has no such mark (its sources: mutated inputs come back as new buffers); inductor writes in
    place by itself."""
    if self.name == "xla":
        for tensor in tensors:
            torch.ops.xla.dynamo_set_buffer_donor_(tensor, True)


# %%
audit_folder = backend.xla_dump_folder
if audit_folder:
    torch.compiler.reset()
    with helpers.course.audits.captured(audit_folder) as programs:  # another length: XLA compiles anew, and dumps
        audited = Decoder(model, backend, 2 * MAX_LEN)
        audited.generate(ids, 4)
    shapes = {helpers.course.audits.hlo_shape(t) for t in helpers.decode.kv_buffers(audited.cache)}
    audit = [row for row in (helpers.course.audits.audit(p, shapes) for p in programs) if row["cache_buffers"]]
    print(
        helpers.course.report.table(
            audit, ["program", "cache_buffers", "cache_aliased", "cache_bytes_copied", "s64_ops", "total_bytes"]
        )
    )
    assert len(audit) == 2 and all(r["cache_aliased"] == r["cache_buffers"] for r in audit)
    torch.compiler.reset()
    decoder.generate(ids, 2)  # the notebook's decoder, compiled again after the reset
else:
    print(f"{backend.name}: no XLA dump to read here (the xla backend with HELPERS_XLA_AUDIT=1 shows it)")

# %%
if backend.on_tpu:  # the hypothesis's test on a reader's v5e-1: no machine building the course has run it
    passes = helpers.course.measure.cache_passes(model, ids, backend, (MAX_LEN, 16 * MAX_LEN))
    print(f"a step makes {passes['passes']:.1f} passes over its cache: {passes}")
    torch.compiler.reset()
    decoder.generate(ids, 2)  # the notebook's decoder, compiled again
else:
    print(f"{backend.name}: on a TPU, this cell times the step at caches of {MAX_LEN} and {16 * MAX_LEN} positions")

# %% [markdown]
# **What you should see:** on `xla` with the audit on, every cache buffer aliased in both
# programs and 0 bytes copied. At E2B's shapes the same holds: `benchmarks/xla_programs.py`
# (XLA's CPU compiler, 2026-12-05, output in `benchmarks/`) reads 30 of 30 cache buffers
# aliased in this notebook's prefill and step, and in every program of notebooks 05-07,
# the 131,328-position ring's included. On a TPU, the passes: about 1 would refute the
# hypothesis (the cache written in place); 3 or more would confirm it.
#
# > **Aside: 64-bit integer ops in XLA's programs** (PyTorch/XLA readers; a TPU reader may skip
# > it). The `s64_ops` column is not 0, and cannot be from PyTorch: its index ops (`index_copy_`,
# > which writes the cache, `gather`, `embedding`) take int64 indices, so the positions, the
# > masks built from them and the ids stay 64-bit. A TPU emulates each such op in 32-bit pairs;
# > what matters is their size. At E2B the largest is a mask: 8,192 values (`[1, 1, 32, 256]`) in
# > the greedy programs of notebooks 04, 05 and 07, 81,920 (`[128, 640]`) in the ring's prefill
# > chunk of 128: no 64-bit work over a table row or the vocabulary there (the 4-bit unpack and
# > the ring's 131,328-position mask are 32-bit, as is the sampling noise; the xla job tests
# > them). PyTorch/XLA's `XLA_USE_32BIT_LONG=1` would make them all 32-bit; torch_xla 2.9 crashed
# > with it on this course's steps.

# %% [markdown]
# ## Where a step's time goes: a profile
# **What we test:** nothing about speed; 8 compiled decode calls under torch.profiler, the ops
# with the most time of their own. On a CPU that is the compiled step's kernels and matmuls
# beside the per-call cost of the call itself (dynamo's guards, the launch); on a GPU the
# kernels too. On a TPU and on PyTorch/XLA this sees the host's side only (dispatch and
# waiting for the device); the device's own ops come from the backend's profiler, not run by
# this course (a path no machine building it has run).

# %%
print(helpers.course.measure.profile_steps(decoder, ids))

# %% [markdown]
# ## Speed, side by side in this run
# **What we test:** HF `generate` (notebook 03's measure), our loop reading every token
# back to the host as it is made, and our loop reading back every 16 tokens. The source
# found per-token readback ate much of the later gains. Beside tok/s: the bytes a step reads
# (`roofline.step_bytes`: every weight once, one row of the per-layer table, the KV cache)
# times tok/s, against the bandwidth this device reads at (`measure.read_bandwidth`: a read
# probe measured here; on a TPU, Google's published 819 GB/s). The row recorded below uses the
# same two functions, so it shows these numbers.

# %%
hf = helpers.course.measure.measure(model, tokenizer, ids, backend, timed_tokens)
runs = {rb: helpers.course.measure.timed_generate(decoder, ids, timed_tokens, rb) for rb in (1, 16)}  # 3 runs each
ours = {rb: run["decode_tok_s"] for rb, run in runs.items()}
step_bytes = helpers.roofline.step_bytes(model, decoder.cache)
bandwidth, how = helpers.course.measure.read_bandwidth(backend)
rows = [
    {"loop": "HF generate", "decode_tok_s": hf["decode_tok_s"]},
    {"loop": "compiled step, read back every token", "decode_tok_s": ours[1]},
    {"loop": "compiled step, read back every 16", "decode_tok_s": ours[16]},
]
for row in rows:
    row["speedup_vs_hf"] = row["decode_tok_s"] / hf["decode_tok_s"]
    row |= helpers.roofline.columns(step_bytes, row["decode_tok_s"], bandwidth)
print(helpers.course.report.table(rows))
print(
    f"bytes read per step: {helpers.course.report.fmt_bytes(step_bytes)}; read bandwidth: {bandwidth / 1e9:.1f} GB/s ({how})"
)
assert all(series.same_tokens(run["tokens"]) for run in runs.values())

# %%
results = helpers.Results()
rates = runs[16]["rates"]  # the runs above, read back every 16 tokens
step = helpers.course.steps.COMPILED
helpers.course.steps.record_compiled(
    results, step, "compiled step", decoder, series, tokens, first, helpers.course.sources.COMPILED_STEP_TOK_S, rates
)
fig = results.chart("decode_tok_s", "decode tokens/s", source="source_tok_s")
cols = ["step", "label", "backend", "decode_tok_s", "tok_s_spread", "source_tok_s", "compiles", "first_call_s"]
print(results.table([*cols, "payback_tokens", "peak_bytes"]))  # tokens until the compile paid for itself vs 03

# %% [markdown]
# **What you should see:** the same tokens as notebook 03; two compilations (the prefill
# bucket and the step) and none after them; HF's own static cache recompiling at every step
# until dynamo's limit stops it; and the compiled loop ahead of `generate`, further ahead
# with chunked readback where each host round trip is expensive (a TPU).

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** Reading the tokens back every 1, 4, 16 and 64 tokens: where does the rate stop rising?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# Once one host round trip per chunk is small beside the chunk's steps. On a CPU a round trip is
# microseconds, so the rate barely moves; on a TPU it is the device draining its queue.
for every in (1, 4, 16, 64):
    rate = helpers.course.measure.timed_generate(decoder, ids, timed_tokens, every, repeats=1)["decode_tok_s"]
    print(f"read back every {every:>2} tokens: {rate:.1f} tok/s")

# %% [markdown]
# **2.** What tok/s would this device reach if a step did nothing but read its bytes? How far is
# the compiled step from it?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# The ceiling is the read bandwidth over the bytes a step reads; the gap is per-call overhead and
# compute (the profile above names the ops).
ceiling = bandwidth / step_bytes
print(f"ceiling {ceiling:.0f} tok/s; measured {ours[16]:.1f}: {100 * ours[16] / ceiling:.0f}% of it")

# %% [markdown]
# **3.** A static cache four times longer: how many more bytes does a step read, and what does
# that do to this device's ceiling?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 3 (open it after you predicted)
# A static shape reads its whole buffer at every step, filled or not: the cache's bytes grow four
# times, the weights' not at all. On the twin the cache is a large share of a step; at E2B a little
# one at 256 positions. (To measure it, build `Decoder(model, backend, 4 * MAX_LEN)`
# and time it as above: a new shape, so a new compile.)
longer = helpers.decode.static_cache(model, 4 * MAX_LEN)  # allocated, not compiled
more = helpers.roofline.step_bytes(model, longer) - step_bytes
print(
    f"{helpers.course.report.fmt_bytes(more)} more per step: ceiling {bandwidth / step_bytes:.0f} ->"
    f" {bandwidth / (step_bytes + more):.0f} tok/s on this device"
)
