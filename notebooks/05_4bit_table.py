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
# # 05 · The per-layer embedding table, kept in 4-bit on the device
#
# **What the source measured:** keeping Gemma 4 E2B's largest table,
# `embed_tokens_per_layer` ([262144, 8960]: 4.70 GB in bf16), packed in 4-bit on the TPU
# saved about 3.4 GB and took decode from 31-33 to 50 tokens/s on a v5e-1. QAT makes 4-bit
# lookups accurate: the table's values already lie on a 4-bit grid.
#
# Here: recover that grid exactly (codes and scales that reproduce the table bit for bit),
# pack it with compressed-tensors' own packer, and replace the table with a module that
# gathers only the current tokens' packed rows and dequantizes them inside the compiled step.

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
import torch

backend = helpers.get_backend()
series = helpers.course.series.prepare(backend, after=4)  # notebook 04's model: decompressed, wrappers stripped
checkpoint, model, tokenizer, ids = series.checkpoint, series.model, series.tokenizer, series.ids
new_tokens, reference = series.new_tokens, series.reference  # notebook 03's length and tokens
timed_tokens = series.timed_tokens  # tokens per timed run: 128, enough for a steady rate (8 on xla)

decoder = helpers.decode.Decoder(model, backend, max_len=256)
assert series.same_tokens(decoder.generate(ids, new_tokens))
rate_bf16_table = helpers.course.measure.timed_generate(decoder, ids, timed_tokens, 16)[
    "decode_tok_s"
]  # notebook 04's step, timed in this run for a side-by-side ratio

# %% [markdown]
# ## The E2B figures, computed on the meta device
# **What we test:** the bytes of the per-layer table at E2B scale, in bf16 and packed int4
# with bf16 scales, and the saving: the source's "about 3.4 GB". Then what storing Google's
# table exactly takes: its values are bf16(level x step) with steps finer than bf16 (others'
# published measurements: one bf16 scale per group gives back only ~74% of the values), so
# the exact 4-bit table keeps a float32 step per group: 4 bytes per 32 values instead of 2.
#
# And laid out for a TPU. Others measured on a v5e-1 that a gather of more than one row from an
# int32 table whose rows are not a multiple of 128 words wide reads the whole table: 4.2 ms a
# step for E2B's per-layer table, flat in the number of ids, against 0.06 ms padded; E2B's int4
# build decoded at 85 tok/s unpadded and 150 padded (xbill9/gemma4-dev, `jev-tpu-v5e1/README.md`,
# "The int4 tables must be 128 columns wide"; not measured here). A decode step gathers one row,
# but notebook 07's K tokens per call gather K, and every prefill chunk gathers a row per token.
# So each row here is one int32 row: its 1,120 words of codes, then its 280 float32 steps, then
# zeros to 1,408 words (11 x 128), and one gather fetches both. Every byte figure counts the
# padding.

# %%
from helpers.course.report import fmt_bytes, table

e2b = {
    r["component"]: r
    for r in helpers.course.e2b.component_bytes(helpers.course.e2b.meta_model(helpers.course.e2b.real_config()))
}
ple = e2b["embed_tokens_per_layer"]
saved = ple["bf16_bytes"] - ple["int4_bytes"]
saved_exact = ple["bf16_bytes"] - ple["int4_exact_bytes"]
row_words = helpers.packed.table_row_words(ple["shape"][1])
padding = ple["int4_exact_bytes"] - helpers.course.e2b.int4_bytes(
    ple["bf16_bytes"] // 2, scale_bytes=helpers.packed.TABLE_SCALE_BYTES
)
print(
    f"E2B per-layer table {ple['shape']}: {ple['bf16_bytes']:,} B in bf16 -> {ple['int4_bytes']:,} B in int4"
    f" with bf16 scales (saves {fmt_bytes(saved)}), {ple['int4_exact_bytes']:,} B with float32 steps in rows of"
    f" {row_words:,} words, exact (saves {fmt_bytes(saved_exact)}; {fmt_bytes(padding)} of it padding)"
)
assert ple["int4_bytes"] == 1_321_205_760 and saved == 3_376_414_720 and row_words % 128 == 0
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## What a step reads: the same before and after
# **What we test:** the bytes one decode step reads at E2B, from the real configuration
# (`e2b.step_figures`: every weight once, the tied head reading the main table whole, the
# cache, and of the per-layer table only the current token's row, since a gather reads one
# row). The row is 17,920 B in bf16 and 5,632 B in 4-bit (codes, float32 steps, padding): the
# two steps read the same 4.57 GB to within a few kB, so they share one ceiling. What this
# notebook saves is device memory, not bytes per step.

# %%
figures = {r["step"]: r for r in helpers.course.e2b.step_figures()}
before, after = figures["04 compiled decode"], figures["05 4-bit table"]
cols = ple["shape"][1]
row_bf16, row_int4 = cols * 2, row_words * 4
print(
    f"one step reads {before['bytes_per_token']:,} B with the bf16 table, {after['bytes_per_token']:,} B with the"
    f" 4-bit one (a row: {row_bf16:,} B -> {row_int4:,} B); ceiling at 819 GB/s: {before['ceiling_tok_s']:.1f} and"
    f" {after['ceiling_tok_s']:.1f} tok/s; on the device: {fmt_bytes(before['weights_on_device'])} ->"
    f" {fmt_bytes(after['weights_on_device'])}"
)
assert before["bytes_per_token"] - after["bytes_per_token"] == row_bf16 - row_int4
assert before["weights_on_device"] - after["weights_on_device"] == saved_exact
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# So the source's 31-33 -> 50 tok/s is not the bytes a step reads: both steps read the same
# 4.57 GB, the source's at 18% and 28% of one ceiling (32 and 50 of 179 tok/s at 819 GB/s). The
# gap has a size, though: 1/32 - 1/50 s a token is about what one more read and one write of the
# bf16 per-layer table take at 819 GB/s (the cell below computes both). A hypothesis, not a
# measurement: while the table lived in bf16, the program copied or laid it out again every
# step (a gather operand that XLA relayouts, say), and the 4-bit table, 3.2 GB smaller, ended
# that. How a v5e-1 would test it (a path no machine building this course has run): notebook
# 04's profile cell, read for an op that moves about 4.7 GB a step with the bf16 table and none
# with the 4-bit one; or tok/s against the table's size (a copy's time grows with the table, a
# gather's does not).

# %%
gap_s = 1 / helpers.course.sources.COMPILED_STEP_TOK_S - 1 / helpers.course.sources.TABLE_4BIT_TOK_S
copy_s = 2 * ple["bf16_bytes"] / helpers.backend.V5E_BYTES_PER_S
print(
    f"the source's steps: {1e3 / helpers.course.sources.COMPILED_STEP_TOK_S:.1f} and"
    f" {1e3 / helpers.course.sources.TABLE_4BIT_TOK_S:.1f} ms, {1e3 * gap_s:.1f} ms apart; a read and a write of the"
    f" {fmt_bytes(ple['bf16_bytes'])} bf16 table at 819 GB/s: {1e3 * copy_s:.1f} ms"
)

# %% [markdown]
# ## The lookup, in 4-bit
# What runs inside the compiled step for every token: gather the token's packed row (eight
# 4-bit codes per int32 word) and its group scales, unpack, multiply, round as bf16 rounds the
# grid's products. Only the rows of the current tokens are ever dequantized. The unpacking and
# the products are written here (and kept, the same, in `helpers.int4`, which notebook 07's
# int4 linears use too; a test checks the two are the same); the row lookup, one gather of whole
# rows and then those rows dequantized, is in the cell after them (kept in `helpers.qtable`, which
# `QTable.rows` calls).

# %%
# @save helpers.int4
from helpers.packed import GROUP_SIZE  # 32 values per scale, the checkpoint's group


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int4 codes from int32 words, eight a word, low nibble first (compressed-tensors' `pack-quantized`). Written out:
    on PyTorch/XLA compressed-tensors' unpack is wrong (``>>`` of a negative int32 rounds like a division), so the
    sign bit is cleared before shifting and put back as the top nibble's. All int32: a TPU has no 64-bit integers."""
    return code_planes(packed).transpose(-1, -2).flatten(-2)


def code_planes(packed: torch.Tensor) -> torch.Tensor:
    """``unpack_rows``' codes by plane, [..., 8, words]: plane k holds every word's k-th code."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device).view(8, 1)
    top = ((shifts + 4) & 32) >> 2  # the sign bit's place: 8 in the last nibble (shift 28), 0 elsewhere
    negative = packed < packed.new_zeros(())  # an int32 zero: PyTorch/XLA compares with a Python 0 in 64 bits
    nibbles = ((packed & 0x7FFFFFFF).unsqueeze(-2) >> shifts) & 15
    return (nibbles | negative.to(torch.int32).unsqueeze(-2) * top) - 8


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales (one per group of 32 along the last dimension) as the grid's values."""
    return grid_values(codes, scales.float().repeat_interleave(GROUP_SIZE, dim=-1), dtype)


def grid_values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes x scales rounded to bf16, as the QAT grid's values are, then in ``dtype``."""
    return (codes.float() * scales.float()).to(torch.bfloat16).to(dtype)


# %%
# @save helpers.qtable
def gather_rows(table: torch.Tensor, input_ids: torch.Tensor, words: int, groups: int, dtype) -> torch.Tensor:
    """The rows of ``input_ids`` dequantized: one gather of whole int32 rows (``words`` of codes, then ``groups``
    float32 steps' bits), then only those rows unpacked and scaled."""
    gathered = table[input_ids]
    steps = gathered[..., words : words + groups].view(torch.float32)
    return dequantize(unpack_rows(gathered[..., :words]), steps, dtype)


# %% [markdown]
# Two rows of a 4-bit table of 3 tokens by 32 values, packed by hand: token 1's codes run -8..7
# twice, its step 0.5; token 2's are all -8, its step 0.25. One gather, then only those two rows
# unpacked and scaled.

# %%
codes = torch.stack([torch.zeros(32), torch.arange(32) % 16 - 8, torch.full((32,), -8.0)]).to(torch.int32)
# each code stored as code + 8 (0..15), low nibble first, as compressed-tensors packs them
words = ((codes + 8) << torch.arange(0, 32, 4, dtype=torch.int32).repeat(4)).view(3, 4, 8).sum(-1, dtype=torch.int32)
steps = torch.tensor([[1.0], [0.5], [0.25]]).view(torch.int32)  # the steps' float32 bits, one group a row
hand_table = torch.cat([words, steps], dim=1)  # [tokens, 4 words of codes + 1 step]
rows = gather_rows(hand_table, torch.tensor([1, 2]), words=4, groups=1, dtype=torch.float32)
print(rows)
# equal bits by construction: small integers times 0.5 or 0.25, exact in bf16, elementwise (no sum)
assert torch.equal(rows, torch.stack([(torch.arange(32) % 16 - 8) * 0.5, torch.full((32,), -2.0)]))

# %% [markdown]
# ## Recover the grid, build the 4-bit table, swap it in
# **What we test:** per group of 32 values, integer codes in [-8, 7] times one step (either
# sign: a grid centred the other way, codes -7..8, is the same grid with the step negated)
# give the table's values exactly once the product is rounded to bf16, as a bf16 QAT table was
# rounded. The steps that do so form an interval per group (bf16 rounds a range of reals to
# each value); `recover_grid` intersects them and keeps a bf16 step where the interval holds
# one, else a float32 one. The twin's tables are made as Google's are, with float32 steps, so
# its `QTable` keeps float32 scales (the report's "scale dtype"). Where a group is on no such
# grid (a model trained without QAT), that group is quantized by compressed-tensors and the
# report says how many and the largest error. The table is built once, from the checkpoint's own packed data if it saved the table packed, and
# the bf16 table is then freed: bytes on the device before and after, from the model's tensors
# (and the backend's own counter where it has one).

# %%
old_table = model.model.embed_tokens_per_layer
before = backend.memory()
report = helpers.qtable.keep_table_in_4bit(model, checkpoint.path)
qtable = model.model.embed_tokens_per_layer
print(report)
if report["exact grid"]:
    print("every group on its 4-bit grid: the table is kept exactly")
else:
    print(
        f"{report['groups off the grid']:,} of {report['groups']:,} groups on no 4-bit grid, quantized by "
        f"compressed-tensors; largest error {report['max abs error']:.3g}"
    )
assert report["exact grid"] or not checkpoint.tiny  # the twin's table is on its grid, as QAT leaves it

ids_to_check = torch.tensor([[0, old_table.num_embeddings - 1, 5, 5, 7], [1, 2, 3, 4, 5]], device=backend.device)
random_ids = torch.randint(0, old_table.num_embeddings, (4, 64), generator=torch.Generator().manual_seed(0)).to(
    backend.device
)
# bit for bit by construction: a gather, then codes x steps rounded to bf16 as the table's values were;
# elementwise only (no sum), so no thread count or kernel order can change a bit
same_rows = all(torch.equal(qtable(c).cpu(), old_table(c).cpu()) for c in (ids_to_check, random_ids))
print("rows equal bit for bit (first and last id, repeated ids, a batch of random ids):", same_rows)
assert same_rows == report["exact grid"] or not checkpoint.tiny
# the rows again with the lookup written above, from the table's own words: the same code on the
# same words, so bit for bit
written = gather_rows(qtable.table, ids_to_check, qtable.words, qtable.groups, qtable.dtype)
assert torch.equal(written, qtable.rows(ids_to_check))
del old_table
after = backend.memory()
print(f"table: {fmt_bytes(report['bytes before'])} -> {fmt_bytes(report['bytes after'])} on {backend.device}")
if before is not None:
    print("device memory in use:", fmt_bytes(before["in_use"]), "->", fmt_bytes(after["in_use"]))
print(table(helpers.course.audits.memory_report(model)))

# %%
fig = helpers.course.report.stacked_bars(
    helpers.course.e2b.bytes_by_step(), "E2B device bytes by component (computed, meta device)"
)
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Same tokens, still one compile
# **What we test:** the compiled step of notebook 04, now with the 4-bit table: the same
# tokens as notebook 03, two compilations (prefill bucket and step) and no recompiles.

# %%
torch.compiler.reset()
decoder = helpers.decode.Decoder(model, backend, max_len=256)  # a new module inside: compile anew
with backend.compile_counter() as compiled:
    tokens = decoder.generate(ids, new_tokens)
verdict = series.same_tokens(tokens)
print(verdict, "| graphs compiled:", compiled.graphs)
assert verdict and compiled.graphs == 2
with backend.compile_counter() as again, helpers.course.measure.no_recompiles():
    decoder.generate(ids, new_tokens)
assert again.graphs == 0

# %%
series.table = report  # the model is notebook 05's now
results = helpers.Results()
row = helpers.course.steps.record_compiled(
    results,
    helpers.course.steps.TABLE,
    "4-bit table",
    decoder,
    series,
    tokens,
    compiled,
    helpers.course.sources.TABLE_4BIT_TOK_S,
)
rate = row["decode_tok_s"]
print(
    f"decode {rate:.1f} tok/s with the 4-bit table, {rate_bf16_table:.1f} with the full table"
    f" (both measured in this run): {rate / rate_bf16_table:.2f}x"
)
print(results.table(["step", "label", "backend", "decode_tok_s", "source_tok_s", "compiles", "same_tokens"]))

# %% [markdown]
# ## A measured extra: the main table in 4-bit as well
# **What the source did:** only the per-layer table went to 4-bit. The main `embed_tokens` is
# tied with the output head, so in 4-bit the head must multiply by the same dequantized
# values: each step then dequantizes the whole table for the head's matmul. Off by default;
# kept only where the tokens stay identical (measured here, side by side).

# %%
main = e2b["embed_tokens"]
print(
    f"E2B embed_tokens {main['shape']}: {fmt_bytes(main['bf16_bytes'])} in bf16 -> {fmt_bytes(main['int4_bytes'])} in int4"
)
print(helpers.qtable.keep_embed_in_4bit(model))
torch.compiler.reset()
decoder = helpers.decode.Decoder(model, backend, max_len=256)
with backend.compile_counter() as compiled_main:
    tokens_main = decoder.generate(ids, new_tokens)
rate_main = helpers.course.measure.timed_generate(decoder, ids, timed_tokens, 16)["decode_tok_s"]
print(
    f"main table in 4-bit too: same tokens {bool(series.same_tokens(tokens_main))}, {compiled_main.graphs} graphs,"
    f" {rate_main:.1f} tok/s vs {rate:.1f} (this run): {rate_main / rate:.2f}x ->",
    "worth keeping" if series.same_tokens(tokens_main) and rate_main > rate else "left off",
)

# %% [markdown]
# **What you should see:** the table exact on its grid; the same tokens and one compiled
# step; at E2B scale 3.22 GB less on the device (3.38 GB with bf16 scales, the source's figure,
# which would not give Google's table back exactly), and the same bytes per step: a gather
# reads one row either way. On the tiny twin the table is a few hundred kB and speed barely
# moves. The main table in 4-bit keeps the tokens on the twin (its table is on the grid too);
# whether it pays depends on the device: the head then dequantizes the whole table every step,
# extra work on a CPU. On a TPU it reads 226 MB instead of 805 MB at E2B only if XLA fuses the
# dequantization into the head's matmul; a program that writes the dequantized table out and
# reads it back moves 805 MB twice more, not less.

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** On a device at its read ceiling, how much faster is E2B's step with the 4-bit table?
# And on this machine?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# Not at all at the ceiling: a gather reads one row in either format (the same bytes per step).
# Measured here, side by side above: the 4-bit row costs an unpack, the bytes barely change.
ratio = figures["04 compiled decode"]["bytes_per_token"] / figures["05 4-bit table"]["bytes_per_token"]
print(f"E2B's bytes per step, bf16 table over 4-bit table: {ratio:.6f}")
print(f"measured here: {rate / rate_bf16_table:.2f}x")

# %% [markdown]
# **2.** What would E2B's 4-bit table take with bf16 scales instead of float32 ones, and why does
# the course keep float32?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# Half the scale bytes, but Google's table values are bf16(level x step) with steps finer than
# bf16: a bf16 step would not give them back exactly, and the tokens are the lesson's test.
values = ple["shape"][0] * ple["shape"][1]
for scale_bytes in (2, 4):
    print(f"{scale_bytes}-byte scales: {fmt_bytes(helpers.course.e2b.int4_bytes(values, scale_bytes=scale_bytes))}")
# NBVAL_CHECK_OUTPUT
