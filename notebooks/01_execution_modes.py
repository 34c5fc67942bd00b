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
# # 01 · Execution modes: eager, defer-and-fuse, `torch.compile`
#
# A TPU is fast only when it is handed big programs. This notebook runs one small stack of
# ops three ways and counts what the device is asked to run:
#
# - **eager**: op by op, one device program per op (on a TPU the course's backend sets TorchTPU's
#   strict eager, `DEFER_NEVER`, once for the process when it is made; a block below may defer);
# - **defer-and-fuse**: ops are recorded, then run as one fused program when a result is
#   needed (TorchTPU's `DEFER_AND_FUSE`, or PyTorch/XLA's lazy tensors);
# - **`torch.compile`**: the whole function is traced ahead and compiled once per input shape:
#   each compiled graph keeps [guards](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#guard), the conditions (shapes, dtypes) under which it is reused.
#
# It runs on a TPU (TorchTPU), on PyTorch/XLA, on a GPU or on a laptop CPU; the first
# output says which.

# %% [markdown]
# ## Set up
# In Colab this fetches the course's `helpers` and installs only what is missing (TorchTPU
# on a TPU runtime), with pip's output shown as it runs. It then says in one line what else
# pip moved (TorchTPU needs a newer `pyzmq`, `absl-py`, `portpicker`, `tensorboard`) and what
# in the runtime no longer matches (JAX on the TPU, whose `libtpu` is replaced). It names the
# folder the course was imported from. On your own machine, run it from a clone after
# `pip install -r requirements.txt`: it then installs nothing.

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
backend = helpers.get_backend()  # override: helpers.get_backend("cpu") or HELPERS_BACKEND=xla
print(helpers.course.hub.describe(backend))
print("modes here:", ", ".join(backend.modes))

# %% [markdown]
# ## The op stack
# **What the source measured:** on a TPU v5e-1, a stack like this ran **more than 98x
# faster** compiled than in eager mode.
#
# Ten rounds of `tanh(x * 1.1 + 0.1)`: thirty tiny elementwise ops, each far too small to
# keep a TPU busy on its own.

# %%
# @save helpers.modes
import torch

from helpers.backend import Backend
from helpers.timing import time_fn


def op_stack(x: torch.Tensor, depth: int = 10) -> torch.Tensor:
    """Small elementwise ops: one device program each in eager mode, one fused program deferred or compiled."""
    for _ in range(depth):
        x = torch.tanh(x * 1.1 + 0.1)
    return x


def op_input(backend: Backend, size: int) -> torch.Tensor:
    x = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(backend.device)
    backend.flush()  # a lazy backend would otherwise fold the upload into the first timed call
    backend.sync()
    return x


# %%
traced = torch.fx.symbolic_trace(lambda x: op_stack(x))  # the ops one call runs, as torch records them
ops = [node.target.__name__ for node in traced.graph.nodes if node.op == "call_function"]
print(f"{len(ops)} ops a call: " + ", ".join(f"{ops.count(op)} x {op}" for op in dict.fromkeys(ops)))
assert len(ops) == 30
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Three modes, side by side
# **What we test:** every mode gives the same numbers; the timings are this run's own
# (median of 20 calls after a warm-up, the device synced after each call), and where the
# backend counts device programs, eager launches one per op while defer-and-fuse and
# compile launch one per call. PyTorch/XLA counts every launch. TorchTPU counts its eager
# program cache, and a compiled call bypasses it (it runs its executable directly), so on
# `tpu` only eager and defer-and-fuse are counted. That count has not been run on a real TPU
# while this course was built: on a v5e-1, look for eager > 1 and defer-and-fuse = 1.
#
# Each mode timed the same way: the median of `repeats` calls after a warm-up, each ending on a read of its
# result on the host (`helpers.timing.time_fn`: a device's synchronize alone may return early), and the device
# programs one call launches, where the backend counts them.


# %%
# @save helpers.modes
def compare_modes(backend: Backend, size: int = 256, warmup: int = 3, repeats: int = 20) -> list[dict]:
    """Time ``op_stack`` in every mode the backend has: a row per mode with median/min/max ms, speed-up
    over eager, and device programs per call (None where the backend cannot count that mode's)."""
    x = op_input(backend, size)
    rows = []
    for mode in backend.modes:
        fn = backend.in_mode(op_stack, mode)
        timing = time_fn(fn, x, sync=backend.sync, warmup=warmup, repeats=repeats, desc=mode)
        with backend.compile_counter() as count:
            out = fn(x)
        del out
        executions = count.executions if backend.counts_executions(mode) else None
        rows.append(
            {
                "mode": mode,
                "median_ms": timing.median * 1e3,
                "min_ms": timing.min * 1e3,
                "max_ms": timing.max * 1e3,
                "executions_per_call": executions,
            }
        )
    eager_ms = rows[0]["median_ms"]
    for row in rows:
        row["speedup_vs_eager"] = eager_ms / row["median_ms"]
    return rows


# %%
results = helpers.Results()
rows = helpers.course.steps.record_modes(backend, results)
print(helpers.course.report.table(rows))

x = torch.randn(256, 256).to(backend.device)
outs = [backend.in_mode(op_stack, mode)(x).cpu() for mode in backend.modes]
# three programs round differently: compared within float32's default tolerance (rtol 1.3e-6, atol 1e-5)
print("largest difference from eager:", max((out - outs[0]).abs().max().item() for out in outs))
for out in outs[1:]:
    torch.testing.assert_close(out, outs[0])
# launches per call, for the modes this backend can count (none on cpu and cuda)
counted = {r["mode"]: r["executions_per_call"] for r in rows if r["executions_per_call"] is not None}
print("device programs launched per call:", counted or f"not counted on {backend.name}")
if "eager" in counted:
    assert counted["eager"] > 1 and all(n == 1 for m, n in counted.items() if m != "eager"), counted

# %%
fig = results.chart(
    "speedup_vs_eager",
    "op stack: speed-up over eager",
    source="source_speedup",
    step=helpers.course.steps.MODES,
    log=True,
)

# %% [markdown]
# **What you should see:** on a TPU, compile far ahead of eager (the source's grey bar is
# its own TPU v5e-1 figure, not this run's). On a CPU the gap is small: a CPU runs a tiny op
# in microseconds, so there is little launch cost to save. Where a mode is missing, this
# backend does not have it:

# %%
try:
    backend.in_mode(op_stack, "defer_and_fuse")
    print("defer_and_fuse is available here")
except helpers.BackendError as err:
    print(err)

# %% [markdown]
# ## Shapes: compiled once per shape
# **What we test:** a compiled program is reused while the input shape repeats, and a new
# shape compiles a new one. The counter counts compilations inside its block (dynamo's
# graphs for `torch.compile`; the device's programs for defer-and-fuse), not times.
#
# We compile with `dynamic=False`, as TorchTPU requires: every new shape is a new program.
# This is why the later notebooks pad inputs to a few fixed shapes.

# %%
for mode in backend.modes:
    if mode == "eager":
        continue
    demo = helpers.shape_demo(backend, mode, sizes=(64, 64, 128, 128, 96))
    print(f"-- {mode}\n" + helpers.course.report.table(demo))
    assert [r["new_compilations"] for r in demo] == [1, 0, 1, 0, 1], demo

# %% [markdown]
# **What you should see:** `new_compilations` is 1 for 64x64, 0 when 64x64 comes again,
# 1 for 128x128, 0 again, 1 for 96x96. Under defer-and-fuse the same holds for the fused
# program: its cache key includes every shape, so a sequence that grows by one token per
# step (notebook 03) compiles at every step.

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** Double the side of the op stack's input, from 256 to 512 (four times the bytes). Does
# eager's time per call grow four times? Does compile's?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# Eager pays a launch per op whatever the size, so it grows by less than the bytes while launches
# dominate; one fused program pays for its bytes, so it grows nearer four times.
bigger = compare_modes(backend, size=512, repeats=5)
print(
    helpers.course.report.table(
        [{"mode": a["mode"], "ms at 256": a["median_ms"], "ms at 512": b["median_ms"]} for a, b in zip(rows, bigger)]
    )
)

# %% [markdown]
# **2.** With dynamo's default (`dynamic=None`, not the course's static shapes), how many graphs
# does a compiled function make for inputs of 64, 96 and 128 rows, one after another?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# A second length marks the dimension dynamic: one graph for 64, one shape-generic graph for 96,
# which 128 reuses. Dynamo's "eager" backend: when it recompiles does not depend on the compiler.
torch.compiler.reset()
generic = torch.compile(op_stack, backend="eager", dynamic=None)
made = []
for n in (64, 96, 128):
    with backend.compile_counter() as count:
        generic(torch.randn(n, 32).to(backend.device))
    made.append(count.graphs)
print("graphs made at 64, 96, 128 rows:", made)
