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
# # 03 · The baseline: Hugging Face `generate`, measured honestly
#
# Plain `model.generate`, greedy, on the model notebook 02 loaded. We stream the text as it
# comes, time the prefill (prompt in, first token out) apart from the decode steps, and look
# at each step to see why this is slow on a TPU. The tokens it generates are saved as the
# reference that notebooks 04-06 must reproduce exactly, up to and including the token that
# ends the turn: `generate` stops at the generation config's stop ids (`<eos>` and Gemma 4's
# end of turn `<turn|>`, ids 1 and 106 in the real vocabulary), and so does every later decoder.
#
# **What the source measured:** about 5 tokens/s on a TPU v5e-1. On the same chip a pure-JAX
# engine runs the same model at 135.0 tokens/s with bf16 weights (its author's figure:
# xbill9/colab-jax, article `02-e2b-repack-vs-stock`; all peer figures are in `helpers.course.sources`).

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

# %% [markdown]
# The model is loaded as in notebook 02: compressed-tensors' default path, except where
# unpacking on the device is not exact (PyTorch/XLA), then `dequantize=True`. The tiny twin
# runs in float32: later notebooks compare tokens of differently ordered sums on prompts it
# never learned, where bf16 would round each program differently
# (`helpers.course.hub.series_dtype` says more). A TPU runs float32
# matmuls in bf16 unless told otherwise, so there `load_for_series` calls
# `backend.set_float32_matmuls_exact()` for the twin (torch's global float32 matmul precision
# set to "highest", a process-wide setting, named as such): a TPU-only line that no
# machine building this course has run.

# %%
backend = helpers.get_backend()
checkpoint, model, tokenizer, ids = helpers.course.series.load_for_series(backend)
print(checkpoint)
print(helpers.course.hub.describe(backend))
new_tokens = backend.generation_length  # 32; 8 on xla
timed_tokens = backend.timed_length  # per timed run: 128, enough for a steady rate; 8 on xla
print(f"prompt: {ids.shape[1]} tokens, BOS first: {bool(ids[0, 0] == tokenizer.bos_token_id)}")
print(tokenizer.decode(ids[0]))

# %% [markdown]
# The prompt is one user turn in Gemma 4's format, as its `chat_template.jinja` writes it: a turn
# opens with `<|turn>` and the role and closes with `<turn|>`; the generation prompt is
# `<|turn>model`. (Gemma 3's `<start_of_turn>` and `<end_of_turn>` are gone.) With
# `enable_thinking=True` the template adds a system turn holding `<|think|>`, and the reply then
# opens a thinking channel, `<|channel>thought ... <channel|>`, before its answer. The series runs
# with thinking off; the twin learned one thinking turn so the format is exercised (its tests).

# %%
thinking = tokenizer.apply_chat_template(
    [{"role": "user", "content": "What is two plus two?"}],
    add_generation_prompt=True,
    tokenize=False,
    enable_thinking=True,
)
print(thinking)
assert "<|turn>user\n" in tokenizer.decode(ids[0]) and "<|think|>" in thinking

# %% [markdown]
# ## First call, second call, per step
# **What we test:** the same `generate` call twice in each mode, with the time of every
# step (step 0 is the prefill) and the device programs each step compiled.
#
# In eager mode every op is its own dispatch, every step. Under defer-and-fuse the ops of a
# step run as one program, but the sequence grows by one token per step: every step is a new
# shape, so the first call compiles at every step, and only a second call of the same
# length finds them all cached. Each of those compiles is a whole forward of the model (minutes
# of E2B on a TPU in all), so defer-and-fuse runs only the first 8 tokens here. Its tokens are
# compared with eager's by the series' one verdict: two programs round differently, so the run
# is [teacher-forced](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#teacher-forced) through the eager model, each token its top choice or within 4 [ulps](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#ulp) of it.

# %%
calls = helpers.course.measure.first_and_second_call(model, tokenizer, ids, backend, new_tokens)
for mode, call in calls.items():
    counted = (
        f"; programs compiled per step, first call: {call['programs_first']}"
        if call["programs_first"][0] is not None
        else ""
    )
    print(f"{mode}: first call {sum(call['first']):.2f} s, second call {sum(call['second']):.2f} s{counted}")
counts = {f"{m}, first call": c["programs_first"] for m, c in calls.items() if c["programs_first"][0] is not None}
fig = helpers.course.report.step_plot(
    {f"{m}, {k} call": c[k] for m, c in calls.items() for k in ("first", "second")},
    f"HF generate, {checkpoint.name} on {backend.name}: seconds per step (this run)",
    counts or None,
)
tokens = calls["eager"]["tokens"]
if "defer_and_fuse" in calls:
    assert all(p > 0 for p in calls["defer_and_fuse"]["programs_first"]), "every new length compiles"
    assert sum(calls["defer_and_fuse"]["programs_second"]) == 0, "a second call reuses every program"
    deferred = calls["defer_and_fuse"]["tokens"]  # its first DEFER_AND_FUSE_TOKENS (8): each is a compile
    # two programs round differently: the series' verdict, teacher-forced through the eager model
    same = helpers.course.verdict.compare_tokens(deferred, tokens[: len(deferred)], model, ids)
    print("defer-and-fuse against eager:", same)
    assert same

# %% [markdown]
# **What you should see:** under defer-and-fuse, every step of the first call compiles
# (the bar below each step) and takes seconds; the second call compiles nothing. Eager
# compiles its op programs once and then dispatches op by op.

# %% [markdown]
# ## Streaming, and what `generate` chose by itself
# `generate` may pick a static cache and compile the forward on some hardware
# (transformers lists `"tpu"` among those devices). We read which cache it used and whether
# anything was compiled from this run, not from its documentation.

# %%
widget = helpers.course.report.text_widget()
with backend.compile_counter() as compiled:
    streamed, streamer, out = helpers.generate.generate(model, tokenizer, ids, backend, new_tokens, widget=widget)
print(
    "cache used by generate:",
    type(out.past_key_values).__name__,
    "| torch.compile graphs during generate:",
    compiled.graphs,
)
print("text:", streamer.text)
stops = helpers.generate.stop_ids(model)
ended = bool(streamed) and streamed[-1] in stops
print(f"{len(streamed)} tokens; stop ids {stops} (the generation config's); ended its turn: {ended}")
assert streamed == tokens  # equal lists: generate's eager program again, on the same inputs
within = helpers.backend.GENERATION_TOKENS  # the twin learned to end its turn within 32 tokens
assert ended or not checkpoint.tiny or new_tokens < within

# %% [markdown]
# **What you should see:** the twin (trained for seconds on a few chat turns, then put on the
# 4-bit grid) answers in words and ends its turn before 32 tokens, as the instruction-tuned
# E2B often does: every later notebook must stop at the same token.

# %% [markdown]
# ## Prefill and decode, measured
# **What we test:** prefill seconds and decode tokens/s, each the median over 3 runs
# after a warm-up run; each step ends with its token on the host, so the device is synced.
# Timing runs generate exactly `timed_tokens` (`eos_token_id=[]`: no stop), so every run times
# the same count: 128, as gpt-fast times, since a rate over a few milliseconds is mostly noise
# (the spread below says how steady it is). Their first tokens, cut after the first stop id,
# are the ones above.

# %%
measured = helpers.course.measure.measure(model, tokenizer, ids, backend, timed_tokens)
print(
    f"prefill {measured['prefill_s'] * 1e3:.1f} ms, decode {measured['decode_tok_s']:.1f} tok/s over"
    f" {timed_tokens} tokens, spread {measured['tok_s_spread']:.2f}x over {measured['repeats']} runs"
    f" (the source, TPU v5e-1: ~{helpers.course.sources.HF_GENERATE_TOK_S} tok/s)"
)
assert measured["tokens"][:new_tokens] == tokens  # the same eager program again: equal lists
results = helpers.Results()
# this step's row, as the tour writes it: the roofline at the run's mean context
helpers.course.steps.record_baseline(results, backend, checkpoint, measured, model, ids.shape[1] + timed_tokens // 2)
fig = results.chart("decode_tok_s", "decode tokens/s", source="source_tok_s", step=helpers.course.steps.BASELINE)

# %% [markdown]
# ## Why ~5 tokens/s: one launch per op
# **What we test:** the ops one decode step runs, counted by torch's dispatcher on E2B's real
# configuration on the meta device (every op, no weights) and on this run's model. In eager
# mode each op that computes is its own launch from the host; views are bookkeeping. The
# bytes a step reads, at the v5e's 819 GB/s, would take a few ms: at the source's 5 tok/s they
# are about 3% of the step, so the rest is the host launching thousands of small programs
# one after another. Notebook 04 makes the step one program.

# %%
ops_e2b = helpers.course.measure.ops_per_step(helpers.course.e2b.meta_model(helpers.course.e2b.real_config()))
ops_here = helpers.course.measure.ops_per_step(model)
step_s = 1 / helpers.course.sources.HF_GENERATE_TOK_S
read_s = helpers.course.e2b.step_figures()[0]["bytes_per_token"] / helpers.backend.V5E_BYTES_PER_S
print(
    f"E2B: {ops_e2b['compute']:,} ops that compute per decode step (+ {ops_e2b['views']:,} views); this model:"
    f" {ops_here['compute']:,}. At the source's {helpers.course.sources.HF_GENERATE_TOK_S} tok/s a step takes"
    f" {step_s * 1e3:.0f} ms, {step_s / ops_e2b['compute'] * 1e6:.0f} us per op; its bytes at 819 GB/s take"
    f" {read_s * 1e3:.1f} ms: {100 * read_s / step_s:.1f}% of the step"
)
assert ops_e2b["compute"] > 1000 and read_s / step_s < 0.05

# %% [markdown]
# ## Aside, PyTorch/XLA only: prompts shorter than the sliding window
# *A TPU reader on TorchTPU may skip this section.*
# transformers' sliding-window cache keeps the last `window - 1` positions with
# `keys[:, :, -window + 1:]`. On a CPU, a start before the beginning is clamped; PyTorch/XLA
# raises "Value out of range" instead. So there, any prompt shorter than the window fails
# (with E2B's window of 512: any prompt under 511 tokens). Two ways through: pad the prompt
# to the window, or ask `generate` for a static cache, which preallocates its buffers.

# %%
short = helpers.checkpoint.encode(tokenizer, "Paris", backend.device)
window = model.config.sliding_window
print(f"a {short.shape[1]}-token prompt, window {window}:")
try:
    helpers.generate.generate(model, tokenizer, short, backend, 2)
    print("  default cache: works here")
    trapped = False
except RuntimeError as err:
    print("  default cache fails:", str(err).splitlines()[0])
    trapped = True
assert trapped == backend.lazy or backend.on_tpu  # on a TPU: not run by the course's tests (no TPU here)
with_static, _, out = helpers.generate.generate(model, tokenizer, short, backend, 2, cache_implementation="static")
print(f"  cache_implementation='static' ({type(out.past_key_values).__name__}): works, tokens {with_static}")

# %% [markdown]
# ## The reference tokens
# Saved in the run folder under a key of model, backend, prompt and length: notebooks 04-06
# load them, and a mismatch in any of the four is caught rather than compared.
#
# On Colab each notebook gets a fresh runtime and a fresh `/content`, so a run folder there
# lasts one notebook. Mount Google Drive first (`from google.colab import drive;
# drive.mount("/content/drive")`, before the set-up cell) and the run folder is
# `MyDrive/gemma4-on-tpu/runs` (`helpers.course.report.DRIVE_RUNS`): these tokens and the results
# table then carry to notebooks 04-07 and their closing charts show every step. Without it,
# each later notebook makes the reference tokens again (it says so) and charts its own rows.

# %%
key = helpers.course.series.save_reference(checkpoint, backend, ids, new_tokens, tokens)
assert helpers.course.series.load_reference(checkpoint, backend, ids, new_tokens) == tokens
print("saved:", key, "| run folder:", helpers.run_dir().resolve())
print(results.table(["step", "label", "backend", "decode_tok_s", "prefill_s", "source_tok_s"]))

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** What decode tok/s does `generate` give over twice as many tokens?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# About the same: the eager step runs the same ops at every length here (the cache grows, the
# launches do not), so the rate does not depend on how long you time it.
twice = helpers.course.measure.measure(model, tokenizer, ids, backend, 2 * timed_tokens, repeats=1, warmup=0)
print(f"{2 * timed_tokens} tokens: {twice['decode_tok_s']:.1f} tok/s; {timed_tokens}: {measured['decode_tok_s']:.1f}")

# %% [markdown]
# **2.** Does one decode step run more ops after a context of 260 tokens than after 26?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# No: the context changes the sizes of the attention's tensors, not the number of ops.
print({context: helpers.course.measure.ops_per_step(model, context)["compute"] for context in (26, 260)})

# %% [markdown]
# **3.** If an eager step had half of E2B's ops, what tok/s would the source's v5e-1 give?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 3 (open it after you predicted)
# Each op costs a launch (the source's step: 200 ms over its ops), and the bytes take a few ms
# whatever the count: half the launches plus the same reads.
per_op = step_s / ops_e2b["compute"]
half = ops_e2b["compute"] / 2 * per_op + read_s
print(
    f"{1 / half:.1f} tok/s, against the source's {helpers.course.sources.HF_GENERATE_TOK_S} (a prediction, not measured)"
)
# NBVAL_CHECK_OUTPUT
