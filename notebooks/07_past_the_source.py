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
# # 07 · Past the source: every step against the memory roofline
#
# **What the source measured:** it stopped at 50 tokens/s (38-45 at long context) on a TPU
# v5e-1, where a pure-JAX engine runs the same model at 135.0 tokens/s with bf16 weights
# unpacked once at load, 93.7 with the 4-bit weights unpacked every step (xbill9/colab-jax,
# article 02-e2b-repack-vs-stock), and vLLM at 123.7 tokens/s at context 128 (xbill9/gemma4-dev,
# serving report): each its author's figure, all in `helpers.course.sources`. Decoding one token
# reads every weight it uses and the KV cache once, so its speed is bounded by the chip's
# bandwidth over the bytes one step reads: the memory roofline. Google publishes 819 GB/s for
# a v5e chip.
#
# Here: the bytes one step reads at each step of the series, at E2B scale, and the ceiling
# that follows; then the ways past the source, each measured on this machine against its
# own read bandwidth: K decode steps per compiled call (one dispatch per K tokens), on a
# CPU the matmuls as loops the compiler writes, the linears kept as their int4 codes (a byte
# each, then packed eight to a word) on the device and dequantized inside the step, the main
# table with its tied head in 4-bit
# too, and q/k/v and gate/up fused into one matmul each.
# Every variant must give notebook 03's tokens and compile once per shape.

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

from helpers.course.report import fmt_bytes, table

backend = helpers.get_backend()
series = helpers.course.series.prepare(backend, after=6)  # notebook 06's model: the 4-bit table, attention grouped

# %% [markdown]
# ## The roofline at E2B scale, computed on the meta device
# **What we test:** the bytes one decode step reads at each step and variant (every weight
# as stored, the main table whole since the tied head multiplies by it, one row of the
# per-layer table, the K and V every attention layer reads), the weights on the device, and the
# ceiling tok/s at 819 GB/s. Targets: the weights under 2.8 GB (6.0 GB at step 05), under 1.4 GB
# read per token (4.6 GB at step 05). The two tables count a float32 step per group of 32, what
# storing Google's tables exactly takes, and their rows' padding to 128 words for a TPU's gather
# (notebook 05): 25 MB, which puts the best variant's weights a hair past 2.8 GB; without the
# padding they are under it, and with bf16 steps they would be 2.7 GB.

# %%
figures = helpers.course.e2b.step_figures()
print(
    table(
        [
            {
                **r,
                "weights_on_device": fmt_bytes(r["weights_on_device"]),
                "cache_read": fmt_bytes(r["cache_read"]),
                "bytes_per_token": fmt_bytes(r["bytes_per_token"]),
            }
            for r in figures
        ]
    )
)
best = figures[-1]
e2b_model = helpers.course.e2b.meta_model(helpers.course.e2b.real_config())
padding = sum(  # the two tables' rows padded to 128 words, beyond their codes and float32 steps
    helpers.course.e2b.table_bytes(*t.shape)
    - helpers.course.e2b.int4_bytes(t.numel(), scale_bytes=helpers.packed.TABLE_SCALE_BYTES)
    for t in (e2b_model.model.embed_tokens.weight, e2b_model.model.embed_tokens_per_layer.weight)
)
print(f"best variant: weights {fmt_bytes(best['weights_on_device'])}, of which padding {fmt_bytes(padding)}")
assert best["weights_on_device"] - padding < 2.8e9 and best["bytes_per_token"] < 1.4e9
fig = helpers.course.report.ceiling_chart(
    figures,
    measured={  # the source's figures, each from its step's module
        "03 baseline generate": helpers.course.sources.HF_GENERATE_TOK_S,
        "04 compiled decode": helpers.course.sources.COMPILED_STEP_TOK_S,
        "05 4-bit table": helpers.course.sources.TABLE_4BIT_TOK_S,
    },
    peer=("a pure-JAX engine, bf16 weights (xbill9/colab-jax)", helpers.course.sources.JAX_BF16_TOK_S),
)
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# **What you should see:** all-bf16 linears cap E2B near 180 tok/s on a v5e, whatever the
# code; the JAX engine's 135 sits at 75% of that. Past it only fewer bytes go: int4 linears
# read packed lift the ceiling to ~440, and a 4-bit head to ~620. On a v5e, 4-bit pays only if
# the matmul reads the packed weights: dequantizing a whole bf16 weight in the step writes and
# reads it again (the grey bars are the source's measured figures; the ceilings are computed).

# %% [markdown]
# ## Why decode is bound by bytes, not by compute: the [ridge point](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#ridge-point)
# **What we test:** at batch 1 a step does one multiply-add per weight it reads (each linear,
# and the head over the main table), 2 FLOPs per weight: in bf16, one FLOP per byte read. A
# v5e does 197 TFLOP/s in bf16 and reads 819 GB/s (Google's published figures): below 240
# FLOPs per byte it waits on memory, its ridge point. E2B's step sits two orders of magnitude
# below it, so only bytes set its speed. More tokens per weight read raise the intensity
# (a batch of B sequences, or speculative decoding's drafts checked in one pass: B FLOPs per
# byte per weight); K sequential steps per call do not, since each step reads every weight
# again.

# %%
step05 = figures[2]  # notebook 05's step: bf16 linears, 4-bit per-layer table
flops = step05["flops_per_token"]
intensity = flops / step05["bytes_per_token"]
ridge = helpers.course.sources.V5E_BF16_FLOPS / helpers.backend.V5E_BYTES_PER_S
print(
    f"one E2B step: {flops / 1e9:.2f} GFLOP over {fmt_bytes(step05['bytes_per_token'])} read ="
    f" {intensity:.2f} FLOP/byte; v5e ridge point {ridge:.0f} FLOP/byte. At the v5e's peaks the step's"
    f" arithmetic takes {flops / helpers.course.sources.V5E_BF16_FLOPS * 1e3:.3f} ms, its reads"
    f" {step05['bytes_per_token'] / helpers.backend.V5E_BYTES_PER_S * 1e3:.2f} ms"
)
assert intensity < 2 and ridge > 200
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## What this device reads at
# *Aside for CPU and GPU readers: on a TPU the published figure is used, and the matvec loops
# below are a CPU-only switch. A TPU reader may skip to the results of the variants.*
# The max of a large tensor reads every byte once and does next to nothing else: its bytes
# over its time are this device's practical read bandwidth (on a TPU, the published figure
# instead, labelled so). Not a matrix-vector product: on a CPU, MKL's reads a decode step's
# short weight rows at well under half of this, and the loops below read faster than MKL.

# %%
bandwidth, how = helpers.course.measure.read_bandwidth(backend)
print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s ({how})")

# %% [markdown]
# ## K tokens per compiled call, matmuls as loops, the linears kept compressed, fewer matmuls
# The code: K decode steps unrolled into one program (written here, kept the same in
# `helpers.roofline`); then, on screen, on a CPU, the compile options
# that make each one-row matmul a multiply-and-sum loop inductor writes itself (its own
# `decompose_mm_pass`), vectorized, with a compressed weight's dequantization inside the same
# kernel, where MKL's matrix-vector product reads a short row at well under half the
# bandwidth (on a TPU, XLA writes every matmul itself: there is no such switch to make); the
# linear that stays compressed on the device, in the backend's form (`Backend.int4_kernel`):
# on a CPU and on a CUDA GPU of sm80 or later, torch's own int4 weight kernel, which reads 4
# bits a weight and multiplies in one pass (the one gpt-fast and torchao call); on a TPU, XLA
# and an older GPU, no such kernel: the weight dequantized and multiplied
# (`F.linear(x, dequantize(...))`). Last, the fused linear whose one matmul serves q, k and v
# (or gate and up): transformers' attention calls them in turn on the same hidden states.

# %%
# @save helpers.roofline
import torch

from helpers.backend import Backend
from helpers.decode import Decoder


class KDecoder(Decoder):
    """Notebook 04's decoder making K tokens per compiled call: K steps unrolled in one program, each token fed to the
    next."""

    def __init__(self, model, backend: Backend, max_len: int, tokens_per_call: int, **compile_options):
        if tokens_per_call < 1:
            raise ValueError(f"tokens_per_call={tokens_per_call}: one compiled call makes at least one token")
        super().__init__(model, backend, max_len, **compile_options)
        self.tokens_per_call = tokens_per_call
        self.decode_steps = backend.compile(self.steps, fullgraph=True, **compile_options)

    def steps(self, token, position):
        tokens = []
        for _ in range(self.tokens_per_call):
            token, position = self.step(token, position)
            tokens.append(token)
        return torch.cat(tokens, dim=1), token, position

    @torch.no_grad()
    def call(self, token, position):
        return self.decode_steps(token, position)

    def check_room(self, length: int, new_tokens: int, start: int = 0, extra: int = 0) -> None:
        super().check_room(length, new_tokens, start, self.tokens_per_call - 1)  # the last call makes K


# %%
# @save helpers.backend
@helpers.add_to_class(helpers.backend.Backend)
def use_matvec_loops(self) -> dict | None:
    """On a CPU, ``compile`` options that make one-row matmuls inductor's own loops (``decompose_mm_pass``),
    dequantizing in the same kernel: MKL reads short rows at under half a plain read's bandwidth, these loops at
    two to three times MKL's rate (``benchmarks/matvec.py``). Sets the pass's size limit process-wide. None
    elsewhere."""
    if self.name != "cpu":
        return None
    from torch._inductor.fx_passes import decompose_mem_bound_mm

    # read once, at the pass's import: its default (2048 rows) leaves the vocabulary-wide head to MKL
    decompose_mem_bound_mm.cpu_max_other_dimension_decomposition = 2**31
    # emulate_precision_casts: dequantized weights rounded to bf16 in the loop (measured: logits 0.36 off without)
    return {"options": {"post_grad_fusion_options": {"decompose_mm_pass": {}}, "emulate_precision_casts": True}}


# %% [markdown]
# The int4 product itself, written here (kept, the same, in `helpers.int4`, where `QLinear` calls
# it; a test checks the two are the same). Notebook 05 wrote the unpacking. Why the kernel is the
# library's: a loop written by hand in Python ops cannot read 4 bits at the bandwidth (at E2B's
# size on a CPU, the hand-written form of an earlier version of this notebook read 2% to 7% of
# it: `benchmarks/full_size-cpu-2026-12-05-int4-planes.txt`).
# The checkpoint's codes and scales are repacked once, at load, into the kernel's layout: no
# value is rounded again.

# %%
# @save helpers.int4
import torch

from helpers.int4 import dequantize, exact_scales, unpack_rows  # notebook 05's
from helpers.packed import GROUP_SIZE


def packed_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``F.linear(x, weight)`` for the weight that int32 words [out, in / 8] and scales [out, in / 32] hold, exactly the
    grid's: dequantized, then a matmul (the form for a backend with no int4 kernel)."""
    return torch.nn.functional.linear(x, dequantize(unpack_rows(packed), scales, dtype))


def int4pack(codes: torch.Tensor, scales: torch.Tensor, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes -8..7 [out, in] and scales [out, in / 32] in the layout of torch's int4 kernel (``kernel``: "cpu" or
    "cuda"), on their device: unsigned codes (code + 8) packed by torch itself, and [in / 32, out, 2] scales with zero
    points of 0, so each weight is (code + 8 - 8) x scale; bf16 scales where each is a bf16 number, else float32 (the CPU
    kernel then multiplies in float32). No value is rounded again."""
    scales = exact_scales(scales)
    unsigned = codes.to(torch.int32) + 8
    if kernel == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 1)
    else:  # two codes a byte, the first in the high nibble; tiles of 16 x inner_k_tiles along the input
        tiles = next(t for t in (8, 4, 2) if codes.shape[1] % (16 * t) == 0)
        pairs = (unsigned[:, ::2] << 4 | unsigned[:, 1::2]).to(torch.uint8)
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)
    scales_and_zeros = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()
    return packed, scales_and_zeros


def int4pack_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel: str) -> torch.Tensor:
    """``F.linear`` through torch's int4 kernel: it reads 4 bits a weight and multiplies in one pass (a loop written by
    hand reads them far below the bandwidth). Each product is code x scale before any rounding, so the result is
    within the dtype's tolerance of the matmul on the checkpoint's (rounded) values, not equal to it. ``x`` goes in
    the scales' dtype (float32 for scales finer than bf16) and comes out in its own."""
    matmul = torch.ops.aten._weight_int4pack_mm_for_cpu if kernel == "cpu" else torch.ops.aten._weight_int4pack_mm
    out = matmul(x.reshape(-1, x.shape[-1]).to(scales_and_zeros.dtype), packed, GROUP_SIZE, scales_and_zeros)
    return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])


def int4pack_values(packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel: str) -> torch.Tensor:
    """The weight [out, in] as the kernel dequantizes it, read back through an identity in the scales' dtype: one term
    per output, code x scale exactly, so in bf16 the checkpoint's values; with scales of 1, the codes themselves."""
    eye = torch.eye(scales_and_zeros.shape[0] * GROUP_SIZE, dtype=scales_and_zeros.dtype, device=packed.device)
    return int4pack_linear(eye, packed, scales_and_zeros, kernel).t()


# %% [markdown]
# Both forms on one random 4-bit weight in bf16 (4 x this model's hidden width by its width),
# on the host where this backend has no kernel: repacked, the kernel's weight read back is the
# dequantized weight bit for bit (`torch.equal`: exact data, one term per output); its product
# is within bf16's rounding of the dense matmul, not equal (it multiplies code x scale before
# rounding, and sums in its own order): half an
# [ulp](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#ulp) of each term and one of the output, the
# largest difference printed against that bound.

# %%
hidden = series.model.config.get_text_config().hidden_size
out_features, in_features = 4 * hidden, hidden
codes = torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
steps = (torch.rand(out_features, in_features // 32, generator=torch.Generator().manual_seed(1)) / 64).bfloat16()
row = torch.randn(1, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
values = dequantize(codes, steps, torch.bfloat16)  # the checkpoint's values: bf16(code x scale)
dense = torch.nn.functional.linear(row, values)
kernel = backend.int4_kernel or "cpu"  # a TPU has none: the host's shows it
device = backend.device if backend.int4_kernel else "cpu"
packed, scales_and_zeros = int4pack(codes.to(device), steps.to(device), kernel)
assert torch.equal(int4pack_values(packed, scales_and_zeros, kernel).cpu(), values)
words = helpers.qlinear.pack_words(codes)
for name, product in [
    ("dequantized", packed_linear(row, words, steps, torch.bfloat16)),
    (f"torch's {kernel} int4 kernel", int4pack_linear(row.to(device), packed, scales_and_zeros, kernel).cpu()),
]:
    # bf16's rounding: half an ulp of each term (the kernel's weights are unrounded), one of the output
    bound = 2**-9 * (row.abs().float() @ values.abs().float().T) + 2**-8 * product.abs().float().maximum(dense.abs())
    gap = (product.float() - dense.float()).abs()
    print(
        f"{name}: largest difference from the dense matmul {gap.max().item():.3g}, at most {gap.div(bound).max():.2f} of the bound"
    )
    assert (gap <= bound).all()

# %% [markdown]
# `QLinear` holds a linear's codes in the form its backend multiplies: through torch's kernel where the backend
# has one (`int4pack_linear`, above), else dequantized in the step (`packed_linear`); int8 codes, one scale a row,
# through torch's int8 kernel. `Fused.part` serves q/k/v (and gate/up) from one matmul of their concatenated
# weights: the first part's call computes all of them, the others read its result.


# %%
# @save helpers.qlinear
@helpers.add_to_class(helpers.qlinear.QLinear)
@property
def weight(self) -> torch.Tensor:
    """The weight, dequantized: through the kernel's own reading where it has one (exactly the checkpoint's)."""
    if self.kernel and self.fmt == "int4":
        return int4pack_values(self.codes, self.scales, self.kernel).to(self.dtype)
    return dequantize(*self.unpacked(), self.dtype)


@helpers.add_to_class(helpers.qlinear.QLinear)
def forward(self, x: torch.Tensor) -> torch.Tensor:
    if self.kernel and self.fmt == "int4":
        return int4pack_linear(x, self.codes, self.scales, self.kernel)
    if self.kernel:  # int8 codes, one scale a row
        return torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.codes, self.scales).view(
            *x.shape[:-1], self.out_features
        )
    if self.fmt == "int4":
        return packed_linear(x, self.codes, self.scales, self.dtype)
    return torch.nn.functional.linear(x, self.weight)


# %%
# @save helpers.fused
@helpers.add_to_class(helpers.fused.Fused)
def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
    if self._last is None or self._last[0] is not x:
        self._last = (x, self.linear(x).split(self.sizes, dim=-1))
    out = self._last[1][i]
    if i == len(self.sizes) - 1:
        self._last = None  # hold no activation between steps (nor a compiled graph's output)
    return out


# %% [markdown]
# **What we test:** each variant, compiled anew: the same tokens as notebook 03, two graphs
# (the prefill bucket and the step), the seconds of the first call (its compilation) and the
# peak device memory where the backend counts it; decode tok/s (median of 3) beside the bytes
# one step reads, from the tensors, GB/s and % of the read bandwidth above. The linears come
# from the checkpoint's own packed codes and scales, never re-quantized; the fused weights are
# the same rows concatenated. Dequantized in the step they are exactly the checkpoint's values,
# so notebook 03's tokens are asserted. Through torch's kernel (the `kernel` column) each weight
# is code x scale unrounded, where the checkpoint's bf16 values round it: within half a bf16
# [ulp](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#ulp), the rounding a bf16 model makes everywhere, but a different sum, so its verdict is
# printed, not asserted (at E2B's size on a CPU: `benchmarks/full_size-cpu-2026-12-07-*.txt`).
# On a CPU the matvec loops come in at
# K = 1 and stay for every variant after them. The compressed variants run at K = 1, each read
# beside a K = 1 row: unrolled K times, a step that dequantizes every weight takes minutes to
# compile on a CPU (a TPU reader can combine the best K with the best format). Timed one
# after another: the spread column (fastest over slowest run) says when the machine was busy.

# %% [markdown]
# Each variant is a cell of its own: the change to the model, then its row
# (`helpers.course.steps.measure_variant`: the model as it is now, compiled anew, timed and checked).
# Each change stays for the variants after it. First K tokens per compiled call, on notebook
# 06's model as it is.

# %%
ks = helpers.course.steps.KS[backend.lazy]  # each K is a compile: fewer on XLA's CPU client
model, checkpoint, token = series.model, series.checkpoint, series.ids[:, :1]
matmuls = helpers.fused.linear_calls(model, token)  # F.linear calls a token, before any variant
series.table = None  # notebook 05's report: it no longer describes the model once the variants change it
rows = [helpers.course.steps.measure_variant(backend, series, f"4-bit table, K={k}", k) for k in ks]

# %% [markdown]
# On a CPU, the one-row matmuls as loops inductor writes (`use_matvec_loops` above); elsewhere
# nothing changes here. Kept for every variant after this one.

# %%
loops = backend.use_matvec_loops()  # compile options on a CPU, None elsewhere
tail = "K=1" if loops is None else "K=1, matvec loops"
if loops is not None:
    rows.append(helpers.course.steps.measure_variant(backend, series, f"4-bit table, {tail}", 1, loops))

# %% [markdown]
# The linears as the checkpoint's int4 codes, one a byte (`QLinear`'s "int4-bytes"): the same
# weights, dequantized inside the step. torch's int8 weight kernel (`_weight_int8pack_mm`) would
# read them in one pass, but it takes one scale a row, and the checkpoint's scales change every
# group of 32: it is used only where a row's scales are all one (the report says how many). Each
# swap frees the reference model first (rebuilt for the verdict): at E2B it is 9 GB beside the
# swap's reads and the compile.

# %%
series.drop_reference_model()
print(helpers.qlinear.keep_linears_compressed(model, checkpoint.path, "int4-bytes", backend.int4_kernel))
rows.append(helpers.course.steps.measure_variant(backend, series, f"int4 codes a byte each, {tail}", 1, loops))

# %% [markdown]
# The linears as packed int4, in the backend's form (`int4_kernel`): repacked for torch's
# kernel where the kernel holds the checkpoint's values exactly (a bf16 model: in float32, as the
# twin runs, the kernel's unrounded code x scale would not be the checkpoint's bf16 values, so
# there they are dequantized; the report says why).

# %%
series.drop_reference_model()
print(helpers.qlinear.keep_linears_compressed(model, checkpoint.path, "int4", backend.int4_kernel))
rows.append(helpers.course.steps.measure_variant(backend, series, f"int4 linears, {tail}", 1, loops))

# %% [markdown]
# The main table and its tied head in 4-bit too.

# %%
series.drop_reference_model()
print(helpers.qtable.keep_embed_in_4bit(model, backend.int4_kernel))
rows.append(helpers.course.steps.measure_variant(backend, series, f"int4 linears + 4-bit head, {tail}", 1, loops))

# %% [markdown]
# q/k/v and gate/up fused into one matmul each: fewer matmuls a token.

# %%
series.drop_reference_model()
helpers.fused.fuse_projections(model)
label = f"int4 linears + 4-bit head + fused q/k/v, gate/up, {tail}"
rows.append(helpers.course.steps.measure_variant(backend, series, label, 1, loops))
after = helpers.fused.linear_calls(model, token)
print(
    f"F.linear calls a token: {matmuls} before the variants, {after} after them (torch's int4 kernel is no F.linear call)"
)

# %% [markdown]
# Every variant's row:

# %%
shown = [
    "variant",
    "kernel",
    "same_tokens",
    "compiles",
    "first_call_s",
    "decode_tok_s",
    "tok_s_spread",
    "bytes_per_token",
    "GB_per_s",
    "pct_of_bw",
    "weights_bytes",
    "peak_bytes",
]
audited = [c for c in ("s64_ops", "cache_in_place", "largest_intermediate", "program_bytes") if c in rows[0]]
print(table(rows, shown + audited))  # the audit columns: xla started with HELPERS_XLA_AUDIT=1 (notebook 04)
assert all(r["compiles"] == 2 for r in rows), "every variant: one compile per shape"
# the checkpoint's arithmetic, in another order: notebook 03's tokens by the verdict
assert all(r["same_tokens"] for r in rows if not r["kernel"]), "every exact variant: notebook 03's tokens"
for r in rows:  # torch's kernels round no product to bf16 as the checkpoint's values are: their verdict, shown
    if r["kernel"]:
        print(f"{r['variant']}, through torch's {r['kernel']} kernel: {r['verdict']}")
fig = helpers.course.report.variant_chart(rows, f"notebook 07, {series.checkpoint.name} on {backend.name}: this run")

# %% [markdown]
# > **Aside: what XLA's CPU compiler made of these programs** (PyTorch/XLA readers; a TPU
# > reader may skip it). On the `xla` backend started with `HELPERS_XLA_AUDIT=1`, each row also
# > carries what XLA compiled (notebook 04's audit, `helpers.course.audits`): 64-bit integer ops left
# > (transformers' int64 positions and masks; the 4-bit unpack and the sampling noise are
# > 32-bit), whether every cache buffer is written in place, the largest intermediate buffer
# > (for the 4-bit head: is the whole main table dequantized, or fused into the matmul?) and the
# > program's bytes as XLA assigned them. At the twin's size these are kilobytes; at E2B's, a
# > program must stay under the 15.75 GiB a v5e-1 gives programs.
# >
# > At E2B's shapes, read from XLA's CPU compiler by `benchmarks/xla_programs.py` (2026-12-05,
# > output in `benchmarks/`; zero weights of the real shapes, a program does not depend on the
# > values): every cache buffer of every program [aliased](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#aliased-donated) (30 of 30, nothing copied per call); the
# > decode step's inputs 9.26 GB (notebook 04), 6.03 GB (05, 4-bit table), 3.33 GB (int4
# > linears), 2.76 GB (+ 4-bit head). The CPU compiler computes bf16 matmuls in float32 and adds
# > float32 copies of the bf16 weights, 2.26 GB in a step and 7.51 GB in a prefill, which a TPU's
# > matrix unit, taking bf16, never makes: with them notebook 04's prefill needs 16.78 GB on this
# > compiler (15.6 GiB), without them 9.27 GB (8.6 GiB). The 4-bit head never makes the
# > dequantized main table whole (no buffer of its [262144, 1536] shape: the unpack is fused
# > into its matmul). In that run the int4 linears multiplied a decode row plane by plane, and
# > this compiler made one linear's products whole at a time (75.5 MB the largest): the int4
# > step needed 3.49 GB (3.25 GiB), the one with the 4-bit head and fused projections 2.91 GB
# > (2.71 GiB) (`benchmarks/xla_programs-cpu-2026-12-05-int4-planes.txt`). What a TPU's
# > compiler does with them is the question to ask of its own dump.
#
# **What you should see:** the same tokens and two compilations everywhere. On a CPU, K > 1
# saves the per-call overhead (dynamo's [guards](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#guard), the launch), and the matvec loops row is ahead
# of the K = 1 row above it: the same bytes, read faster (`benchmarks/decode.py` measures it on
# a model large enough for the bytes to dominate, which the tiny twin is not). The compressed
# linears read fewer bytes. Where torch's int4 kernel takes them (a bf16 model on a CPU or a
# recent GPU) it reads the 4 bits in one pass: at E2B's size on a CPU the int4 row is the
# fastest (`benchmarks/full_size.py`, its output in `benchmarks/`). Dequantized inside the step
# instead (the float32 twin here, or a backend with no kernel), turning codes into floats is work
# the cores pay for: their % of the bandwidth falls. Fusing reads the same bytes in fewer, larger
# matmuls: it saves launches and reads each input once, but whether that pays depends on the
# backend's matmuls; read its row against the one before it, measured above in this run. The
# twin's 4-bit head adds bytes where E2B's saves them: a 4-bit row is padded to 128 words for a
# TPU's gather (notebook 05), and the twin's 64-wide row is 10 words of codes and steps, so its
# padded table is larger than its bf16 one; E2B's 1,536-wide row is 240 words, padded to 256. On a
# v5e-1 (a path no machine building this course has run) look for K > 1 ahead of K = 1 by the
# per-call dispatch it saves: not by readback, since K = 1 already reads tokens back once per
# 16.
#
# **What int8 would be.** The "int4 codes a byte each" row is not int8 quantization: it holds
# the checkpoint's int4 codes one per byte, the same weights, and `QLinear` is weight-only (it
# turns codes into bf16 inside the step and runs a bf16 matmul). Real int8 is W8A8: weights and
# activations both int8, multiplied on the v5e's int8 path (393 TOPS, twice its bf16 peak, by
# the vendor's figure). Others measured it for E2B on a v5e-1 at one request with vLLM TPU: 220
# tok/s against 144 in bf16; made from the QAT weights, its quality was bf16's within noise on a
# 3,880-record suite (+0.003, -0.007 to +0.013), and 2.0 points below on GSM8K
# (xbill9/gemma4-dev, `jev-tpu-v5e1/README.md` and `devto-gemma4-qat-v5e1.md`; all in
# `helpers.course.sources`, printed below). Those values are new weights, not the checkpoint's, so the
# course's rule (the same tokens) rules it out here; it is the next step a server takes.

# %%
src = helpers.course.sources
print(f"others' figures, vLLM TPU on a v5e-1, E2B, one request (tok/s): {src.VLLM_E2B_TOK_S}")
print(f"W8A8 over bf16 there: {src.VLLM_E2B_TOK_S['W8A8'] / src.VLLM_E2B_TOK_S['bf16']:.2f}x;", end=" ")
v5e = helpers.course.sources
print(f"the v5e's int8 peak {v5e.V5E_INT8_OPS / 1e12:.0f} TOPS, {v5e.V5E_INT8_OPS / v5e.V5E_BF16_FLOPS:.1f}x its bf16")
print(f"W8A8's quality against bf16 (the suite's score, GSM8K's points): {src.W8A8_VS_BF16}")
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Results
# Each variant's row in this run's table, beside the steps before it.

# %%
results = helpers.Results()
helpers.course.steps.record_variants(results, backend, rows)
print(results.table(["step", "label", "backend", "decode_tok_s", "pct_of_bw", "same_tokens", "compiles"]))
figs = helpers.course.report.closing_charts(results)

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** From each variant's bytes per step and this device's read bandwidth, what is its ceiling?
# Which variants are held back by compute rather than bytes?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# The ceiling is bandwidth over bytes; a row far below its ceiling while reading fewer bytes is
# paying for work, not reads (on a CPU, turning int4 codes into floats).
for r in rows:
    ceiling = bandwidth / r["bytes_per_token"]
    print(f"{r['variant']}: ceiling {ceiling:.0f} tok/s, measured {r['decode_tok_s']:.1f} ({r['pct_of_bw']:.0f}%)")

# %% [markdown]
# **2.** From the rows above with one and with several decode steps per compiled call, what would
# eight steps per call give?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# A call costs its steps plus one fixed per-call cost (guards, launch): seconds per token are
# step + call / K, so two rows give both, and K = 8 pays the call once per eight. (To measure it, a
# KDecoder with tokens_per_call=8 on notebook 06's model: one more compile, a minute or more on a CPU.)
per_token = {r["K"]: 1 / r["decode_tok_s"] for r in rows if r["variant"] == f"4-bit table, K={r['K']}"}
(a, t_a), (b, t_b) = min(per_token.items()), max(per_token.items())
per_call = (t_a - t_b) / (1 / a - 1 / b)  # seconds a call costs beyond its steps
per_step = t_a - per_call / a
print(
    f"per call {per_call * 1e3:.2f} ms, per step {per_step * 1e3:.2f} ms: K = 8 -> {1 / (per_step + per_call / 8):.1f} tok/s"
)

# %% [markdown]
# **3.** At what batch would E2B's decode step reach the v5e's ridge point?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 3 (open it after you predicted)
# A batch of B sequences reads each weight once for B multiply-adds: B times the FLOPs per byte.
print(f"batch {ridge / intensity:.0f} (intensity {intensity:.2f} FLOP/byte per sequence, ridge {ridge:.0f})")
