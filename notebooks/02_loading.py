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
# # 02 · Loading the 4-bit checkpoint, and where the memory goes
#
# Google ships Gemma 4 E2B as a 4-bit QAT checkpoint in compressed-tensors format
# (`google/gemma-4-E2B-it-qat-w4a16-ct`): its linears are packed int4, eight values per
# int32, one bf16 scale per group of 32. This notebook loads its text decoder onto the
# device with transformers + compressed-tensors and looks at what actually lands there.
#
# On a TPU, and on a CUDA GPU where E2B fits (a Colab T4 or L4 when there is no TPU quota),
# it loads Google's checkpoint. Elsewhere, or without the Hub, it runs the same code on a tiny
# offline twin: the same model class, the same file layout and tensor names, the same
# packing, built here in a second. The first output says which one you got, and why.

# %% [markdown]
# ## Set up
# In Colab this fetches the course's `helpers` and installs only what is missing (TorchTPU
# on a TPU runtime). The checkpoint is public and ungated: it downloads without a Hugging Face
# token. A token is asked for only if the Hub says a repository is gated, and the message then
# says how (the Colab secret `HF_TOKEN`, or `huggingface_hub.login()`).

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
# ## Which checkpoint, and what its export re-rounded
# The series loads `google/gemma-4-E2B-it-qat-w4a16-ct`: the 4-bit format the course is about,
# one `model.safetensors` of 7.75 GiB (2,504 tensors: 276 linears packed as `weight_packed`,
# `weight_scale`, `weight_shape`, no zero point, and an `lm_head` copy; as others published it).
# Every later notebook keeps exactly what this file holds.
#
# That file is not exactly the QAT training's result. Google's export re-rounded every linear
# group with step = max / 7.5; the trained weights are in
# `google/gemma-4-E2B-it-qat-q4_0-unquantized` (bf16 values on the QAT grid, same shapes). Others
# have measured the difference (the JAX sibling course, xbill9/colab-jax, article
# `02-e2b-repack-vs-stock`; their figures, not measured here): 12% of the linears' values
# identical to the trained ones, a mean KL of 0.071 against the QAT model, and greedy text that
# parts from it after 5 of 128 tokens. The two embedding tables were not re-rounded: they stay
# bf16 on the QAT grid, each value bf16(level x step) with a step finer than bf16 (notebook 05
# recovers it exactly).
#
# To run the series on the QAT weights instead, one switch before this cell:
# `os.environ["HELPERS_MODEL"] = helpers.course.hub.QAT_REPO_ID`. They load through the same code (no
# quantization config, so nothing to decompress), dense bf16 from the start: what the path below
# reaches anyway after its first forward.

# %%
backend = helpers.get_backend()
checkpoint = helpers.choose_checkpoint(backend)  # override: HELPERS_MODEL=<repo id | folder | tiny>
print(checkpoint)
print(helpers.course.hub.describe(backend))

# %% [markdown]
# ## Tensor names: a multimodal checkpoint, a text model
# **What the source found:** the checkpoint is multimodal. Its text decoder sits under
# `model.language_model.*` beside audio and vision towers, and the names must be mapped for
# the text model (`Gemma4ForCausalLM`, which calls them `model.*`) to find its weights.
#
# **What we test:** every text tensor is read, nothing else is: the towers are never built,
# so they never reach the device. The checkpoint also stores a full `lm_head` copy although
# the model ties `lm_head` to `embed_tokens`.

# %%
from helpers.course.report import fmt_bytes, table

print(table(helpers.course.audits.name_map(checkpoint.path)))
print("mapping given to from_pretrained(key_mapping=...):", helpers.packed.KEY_MAPPING)

# %% [markdown]
# ## The E2B figures, computed without weights
# **What the source measured:** the per-layer embedding table alone is 4.7 GB in bf16;
# kept in 4-bit it would be 1.32 GB, the "about 3.4 GB" saved in notebook 05.
#
# We build the real E2B text configuration on PyTorch's meta device (shapes, no memory) and
# count bytes per component in bf16 and in int4 with bf16 scales.

# %%
e2b = helpers.course.e2b.real_config()
components = helpers.course.e2b.component_bytes(helpers.course.e2b.meta_model(e2b))
print(table([{**r, "bf16": fmt_bytes(r["bf16_bytes"]), "int4": fmt_bytes(r["int4_bytes"])} for r in components]))
by_name = {r["component"]: r for r in components}
assert by_name["embed_tokens_per_layer"]["bf16_bytes"] == 4_697_620_480
assert by_name["embed_tokens_per_layer"]["int4_bytes"] == 1_321_205_760
assert by_name["embed_tokens"]["bf16_bytes"] == 805_306_368 and by_name["embed_tokens"]["int4_bytes"] == 226_492_416
assert "linears (276)" in by_name  # the checkpoint's 276 packed linears
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Preflight: refuse what will not fit
# A Colab kernel that dies of out-of-memory loses everything. Before loading, we estimate
# the device bytes (everything ends up bf16 on the device, see below) and refuse with the
# numbers if they exceed what is free. Here for E2B on an empty v5e-1, then on a device
# with only 8 GB free (both hypothetical: computed, not measured), and what each way of
# holding less saves at E2B, computed from its configuration: the linears kept packed
# (notebook 07), the per-layer table left in host memory with one row fetched per token
# (Gemma 3n's documented approach to per-layer embeddings), a smaller ring cache (notebook
# 06), K and V in int8.

# %%
v5e_hbm = helpers.backend.V5E_HBM_BYTES  # 15.75 GiB: what a v5e-1 reports it gives programs
print(helpers.course.hub.preflight(e2b, backend, dequantize=False, available=v5e_hbm, where="an empty v5e-1"))
try:
    helpers.course.hub.preflight(e2b, backend, dequantize=False, available=8 * 10**9, where="a device with 8 GB free")
except helpers.checkpoint.CheckpointError as err:
    print(err)
print(table([{**o, "saves": fmt_bytes(o["saves"])} for o in helpers.course.e2b.fit_options(e2b)]))
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Path 1: compressed-tensors' default
# **What we test:** right after loading, the linears hold packed int4 (`weight_packed`,
# int32) with their scales, and compressed-tensors has wrapped every quantized module's
# forward and hooked the model. `device_map` is set explicitly (`"tpu"` on TorchTPU).

# %%
device_before = backend.memory()
config = helpers.checkpoint.text_config(helpers.checkpoint.read_config(checkpoint.path))
print(helpers.course.hub.preflight(config, backend, dequantize=False))  # this checkpoint on this device
model, load_s = helpers.checkpoint.load(checkpoint.path, backend)
print(
    f"loaded in {load_s:.2f} s onto {backend.device}; lm_head tied to embed_tokens:",
    model.lm_head.weight is model.model.embed_tokens.weight,
)
after_load = helpers.course.audits.memory_report(model)
print(table(after_load))
print(table(helpers.checkpoint.compression_report(model)))
assert any(r["kind"] == "packed int4" for r in after_load)

# %% [markdown]
# **The first forward expands everything to bf16.** The decompression hook fires once,
# unpacks every linear on the device and keeps the bf16 weight: the 4-bit memory win is gone.
# The hook is gone after it, but compressed-tensors' offloading layer now wraps the forward
# of every module, quantized or not (the count below).

# %%
import torch

tokenizer = helpers.checkpoint.load_tokenizer(checkpoint.path)
ids = helpers.checkpoint.chat_ids(tokenizer, backend.device)  # the series' chat prompt, BOS in front
new_tokens = backend.generation_length  # 32; 8 on xla, where generate compiles every step
with torch.no_grad():
    model(ids)
backend.sync()
after_forward = helpers.course.audits.memory_report(model)
print(table(after_forward))
print(table(helpers.checkpoint.compression_report(model)))
if device_before is not None:
    print(
        "device memory in use, from the backend's counters:",
        fmt_bytes(device_before["in_use"]),
        "->",
        fmt_bytes(backend.memory()["in_use"]),
    )


def bf16(report):
    return sum(r["bytes"] for r in report if r["kind"] == "bf16")


assert not any(r["kind"] == "packed int4" for r in after_forward) and bf16(after_forward) > bf16(after_load)
results = helpers.Results()
helpers.course.steps.record_loading(results, backend, checkpoint, "compressed (default)", model, load_s)
default_tokens = helpers.course.verdict.greedy_tokens(model, ids, new_tokens)
# One model on the device at a time. `del model` alone can leave it all held: compressed-tensors
# binds forwards onto modules (reference cycles), so on a 15.75 GiB v5e-1 the next load's preflight
# would refuse. `unload` empties the model's tensors, collects, and prints the device bytes.
helpers.checkpoint.unload(model, backend)
del model

# %% [markdown]
# ## Path 2: `CompressedTensorsConfig(dequantize=True)`
# **What we test:** the weights are expanded once, at load, into plain dense modules: no
# wrapped forwards, no hooks. Same bytes on the device, nothing left to surprise you later.

# %%
print(helpers.course.hub.preflight(config, backend, dequantize=True))
model, load_s = helpers.checkpoint.load(checkpoint.path, backend, dequantize=True)
dense = helpers.course.audits.memory_report(model)
print(f"loaded in {load_s:.2f} s")
print(table(dense))
report = {r["what"]: r["count"] for r in helpers.checkpoint.compression_report(model)}
print(report)
assert report["modules with a wrapped forward"] == 0 and report["modules with forward hooks"] == 0
helpers.course.steps.record_loading(results, backend, checkpoint, "dequantize=True", model, load_s)
dense_tokens = helpers.course.verdict.greedy_tokens(model, ids, new_tokens)
helpers.checkpoint.unload(model, backend)
del model


# %%
def by_kind(report):
    return {k: sum(r["bytes"] for r in report if r["kind"] == k) for k in dict.fromkeys(r["kind"] for r in report)}


fig = helpers.course.report.stacked_bars(
    {
        "default,\nafter load": by_kind(after_load),
        "default,\nafter 1st forward": by_kind(after_forward),
        "dequantize=True": by_kind(dense),
    },
    f"{'tiny twin' if checkpoint.tiny else 'E2B'}: model bytes on {backend.device}",
    ylabel="MB" if checkpoint.tiny else "GB",
    scale=1e6 if checkpoint.tiny else 1e9,
)

# %% [markdown]
# ## Same tokens as the weights themselves
# **What we test:** greedy tokens from each load path (computed above, right after each
# load) equal those of a reference model whose weights we dequantize ourselves from the
# file (codes x scales, with compressed-tensors' own unpack on the host), run on the same
# device: bf16 rounding differs between devices.
#
# *Aside, PyTorch/XLA only (a TPU reader may skip it):* a trap we measured on PyTorch/XLA 2.9
# (compressed-tensors 0.15): the default path unpacks on the device at the first forward, and
# there the unpack returns wrong int4 codes (it shifts int32 words right, and XLA's `>>` of a
# negative word rounds like a division), so that path's tokens differ. `dequantize=True` unpacks on the host and is right everywhere.

# %%
expected = helpers.course.verdict.check_tokens(backend, checkpoint, ids, new_tokens)
# equal lists: one model class, the same weight values and dtype on one device run the same program
dense_same, default_same = dense_tokens == expected, default_tokens == expected
exact_unpack = helpers.course.verdict.unpack_is_exact(backend.device)
print("reference tokens:", expected)
print("same tokens, dequantize=True:", dense_same)
print("same tokens, default path:", default_same, "| unpack exact on this device:", exact_unpack)
assert dense_same and default_same == exact_unpack

# %% [markdown]
# **What you should see:** `dequantize=True` gives the reference tokens on every backend;
# the default path does too wherever unpacking on the device is exact. On the device both
# paths hold bf16 weights once the model has run: notebook 05 wins the memory back for the
# largest table, and notebook 04 shows why the default path's wrappers stop `torch.compile`.

# %%
print(results.table(["step", "label", "backend", "load_s", "device_bytes"]))

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** From the component figures above, predict the bytes E2B holds on the device once loaded
# with `dequantize=True`, and with the default path after its first forward.

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# Every weight ends as bf16 either way (embeddings tied: stored once); the default path also keeps
# each linear's bf16 group scales beside its expanded weight.
for dequantize in (True, False):
    needed = helpers.course.e2b.estimate_device_bytes(e2b, dequantize)
    print(f"E2B, dequantize={dequantize}: {fmt_bytes(needed)} ({needed / 2**30:.2f} GiB)")
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# **2.** Which single way of holding less, from the table of fit options above, brings E2B's
# default load under a device with 8 GB free?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# The load itself holds weights only: a smaller ring cache or int8 K/V save nothing here.
needed = helpers.course.e2b.estimate_device_bytes(e2b, dequantize=False)
for option in helpers.course.e2b.fit_options(e2b):
    left = needed - option["saves"]
    print(f"{option['option']}: {fmt_bytes(left)} ({'fits' if left <= 8e9 else 'does not fit'} in 8 GB)")
# NBVAL_CHECK_OUTPUT
