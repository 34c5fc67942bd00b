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
# # 06 · A ring KV cache: long context in little memory, long prompts in fixed chunks
#
# **What the source measured:** HF's default cache fixed the sliding window at 512 and could
# not serve long contexts efficiently. A ring buffer for the sliding-window layers, with a
# full cache for the full-attention layers, held 131,328 tokens of context in 0.82 GB, loaded
# long prompts faster and decoded at 38-45 tokens/s on a TPU v5e-1.
#
# Here: each sliding-window layer keeps exactly `sliding_window` positions, position p in slot
# p mod window; each full-attention layer keeps a buffer up to the maximum context; layers
# that share K/V hold nothing. Masks come from absolute positions, so every slot's position
# is known. Prompts go through in chunks of one fixed size, the last one padded.
#
# What transformers already does: its `StaticCache` also caps sliding layers at the window
# (the same bytes), but its sliding layer shifts the whole buffer every step once full and
# counts tokens in a Python int, so a compiled step recompiles at every position (counted in
# notebook 04). The ring's win: one compiled program for every position, no shift, fixed chunks.

# %% [markdown]
# ## Set up
# Notebook 05's model: wrappers stripped, per-layer table in 4-bit.

# %%
# Set up, the same cell in every notebook (written by helpers.course): fetch the course
# where `helpers` is not importable (Colab), then install what this runtime lacks. Safe to rerun.
import importlib.util
import os
import subprocess
import sys

COURSE_REPO = os.environ.get("COURSE_REPO", "https://github.com/OWNER/gemma4-on-tpu")  # a URL or a folder
COURSE_REF = os.environ.get("COURSE_REF", "main")  # the branch or tag these notebooks go with
COURSE_DIR = os.environ.get("COURSE_DIR", "/content/course")


def is_course(folder):  # the course's helpers is a package with course.py beside its __init__
    return folder is not None and os.path.isfile(os.path.join(folder, "course.py"))


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

from helpers.bench import fmt_bytes, table

backend = helpers.get_backend()
series = helpers.series.prepare(backend, after=5)  # notebook 05's model: stripped, the per-layer table in 4-bit
checkpoint, model, tokenizer, ids = series.checkpoint, series.model, series.tokenizer, series.ids
new_tokens, reference = series.new_tokens, series.reference  # notebook 03's length and tokens
timed_tokens = series.timed_tokens  # tokens per timed run: 128, enough for a steady rate (8 on xla)
config = model.config.get_text_config()
print("sliding window:", config.sliding_window, "| layer kinds:", [t.split("_")[0] for t in config.layer_types])

# %% [markdown]
# ## The E2B figures, computed on the meta device
# **What we test:** K and V bytes for 131,328 positions over E2B's 15 cache-owning layers
# (the last 20 share K/V and hold none), full-length against a ring for the sliding layers.

# %%
e2b = helpers.e2b.real_config().get_text_config()
E2B_CONTEXT = helpers.sources.CONTEXT  # the source's headline context
full_e2b = helpers.e2b.kv_cache_bytes(e2b, E2B_CONTEXT)
ring_e2b = helpers.e2b.kv_cache_bytes(e2b, E2B_CONTEXT, ring=True)
print(
    f"E2B, {E2B_CONTEXT:,} positions: full-length caches {full_e2b:,} B ({fmt_bytes(full_e2b)}),"
    f" ring {ring_e2b:,} B ({fmt_bytes(ring_e2b)})"
)
assert ring_e2b == 813_170_688 and full_e2b == 2_420_637_696
weights_e2b = {k: v for k, v in helpers.e2b.bytes_by_step()["05 4-bit table"].items() if k != "KV cache"}
fig = helpers.bench.stacked_bars(
    {"full-length caches": weights_e2b | {"KV cache": full_e2b}, "ring cache": weights_e2b | {"KV cache": ring_e2b}},
    f"E2B device bytes at {E2B_CONTEXT:,} positions (computed, meta device)",
)

# %% [markdown]
# ## Why the source's decode slowed down: the roofline
# **What we test:** a static-shape step reads the full-attention layers' whole buffer every
# token, whatever the context: at 131,328 positions that is the ring's 0.81 GB on top of the
# 4.56 GB notebook 05's step reads at a short context (both from the real configuration).
# Decode at batch 1 is bound by bytes read, so the rate should fall by their ratio: from the
# source's 50 tok/s to about 42, which is the source's 38-45.

# %%
figures = helpers.e2b.step_figures()
short, ring_step = figures[2], next(r for r in figures if r["step"].startswith("06"))
predicted = helpers.sources.TABLE_4BIT_TOK_S * short["bytes_per_token"] / ring_step["bytes_per_token"]
print(
    f"a step reads {fmt_bytes(short['bytes_per_token'])} at context 256, {fmt_bytes(ring_step['bytes_per_token'])}"
    f" with the ring for {E2B_CONTEXT:,} positions: the source's {helpers.sources.TABLE_4BIT_TOK_S} tok/s"
    f" x {short['bytes_per_token'] / ring_step['bytes_per_token']:.3f} = {predicted:.1f} tok/s predicted"
)
assert ring_step["cache_read"] == ring_e2b and 38 <= predicted <= 45

# %% [markdown]
# So "decode time stays flat with context" below is flat at the worst case: the step reads
# 131,328 positions of K and V at context 10 as at context 131,000. What reads only the filled
# part: a bucketed `max_len` (one compiled step per bucket, say 4k, 16k, 64k and 131k
# positions, the cache copied up when a bucket fills: a few compiles, each step reading its
# bucket), or paged / ragged attention, which reads only the pages that hold tokens (vLLM's
# TPU backend does this; on a TPU it takes a Pallas kernel, not a plain PyTorch op).

# %% [markdown]
# ## The ring, in a few lines
# A sliding layer's update: attention gets the ring as it was followed by the chunk's own keys
# (all that a query of the chunk may see), then the chunk's real positions are written into
# slot `position % window`; padding never is. The masks come from the absolute position each
# slot holds. The decoder's prefill goes through the prompt in fixed chunks, from any `start`
# position the cache already holds (the chat of notebook 08 goes on from there).

# %%
helpers.show(helpers.ring.RingLayer.update, helpers.ring.RingCache.masks, helpers.ring.RingDecoder.prefill)

# %% [markdown]
# ## Attention that reads the one K/V head as the cache holds it
# **What we test:** E2B has 8 query heads and one K/V head. transformers' SDPA attention gives
# each query head its own copy of K and V (`repeat_kv`) whenever it gets a mask, and in every
# compiled graph: at 131,328 positions a full layer's K repeated is 1.08 GB in bf16, more than
# the whole ring (the last section computes it from the real configuration). `grouped_attention`
# stacks the query heads that share a K/V head along the queries instead, and reads K and V once.
# It is registered through transformers' `AttentionInterface`, so the model calls it as it calls
# its own. Here it gives transformers' values, on a full layer's shapes with a mask (a prefill
# chunk's queries and a decode step's one), and from here on the model uses it. Two programs
# sum in their own order (and by the thread count), so the check is float32's default
# tolerance in `torch.testing` (rtol 1.3e-6, atol 1e-5), not equal bits; the largest
# difference is printed.

# %% tags=["grouped-attention-check"]
helpers.show(helpers.ring.grouped_attention)
from transformers.integrations.sdpa_attention import sdpa_attention_forward

full_attn = model.model.layers[config.layer_types.index("full_attention")].self_attn
heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
for queries in (1, 5):
    shape = (1, heads, queries, full_attn.head_dim)
    q = torch.randn(shape, dtype=torch.float32)
    k, v = (torch.randn(1, kv_heads, 40, full_attn.head_dim) for _ in "kv")
    mask = torch.arange(40)[None, None, None, :] <= torch.arange(30, 30 + queries)[None, None, :, None]
    theirs, _ = sdpa_attention_forward(full_attn, q, k, v, mask, scaling=full_attn.scaling)
    ours, _ = helpers.ring.grouped_attention(full_attn, q, k, v, mask, scaling=full_attn.scaling)
    largest = (ours - theirs).abs().max().item()
    print(f"{queries} quer{'y' if queries == 1 else 'ies'}: largest difference from transformers' SDPA: {largest:.3g}")
    torch.testing.assert_close(ours, theirs)

# %%
before = helpers.ring.group_query_heads(model)
print(f"the model's attention: {before} -> {model.config._attn_implementation}")

# %% [markdown]
# ## The cache on this model
# **What we test:** a ring of `sliding_window` slots per sliding layer, a full buffer per
# full-attention layer, nothing for K/V-sharing layers; bytes as the formula above gives them.

# %%
W = config.sliding_window
MAX_LEN = 68 * W  # positions the full layers hold: the longest context measured below (64 windows), plus room
decoder = helpers.ring.RingDecoder(model, backend, max_len=MAX_LEN)
layers = [
    {
        "layer": i,
        "kind": config.layer_types[i].split("_")[0],
        "holds": "nothing (shares K/V)" if not c.is_initialized else f"{c.keys.shape[2]} positions",
    }
    for i, c in enumerate(decoder.cache.layers)
]
print(table(layers))
dtype_bytes = decoder.cache.layers[0].keys.element_size()
ring_bytes = helpers.decode.cache_bytes(decoder.cache)
full_bytes = helpers.e2b.kv_cache_bytes(config, MAX_LEN, dtype_bytes=dtype_bytes)
print(f"ring cache: {fmt_bytes(ring_bytes)}; full-length caches would hold {fmt_bytes(full_bytes)}")
assert ring_bytes == helpers.e2b.kv_cache_bytes(config, MAX_LEN, ring=True, dtype_bytes=dtype_bytes)

# %% [markdown]
# ## Same tokens, one decode program, one prefill program
# **What we test:** the tokens of notebook 03; two compilations in all (the prefill chunk and
# the decode step), then none for more tokens or a longer prompt.

# %%
torch._dynamo.reset()
with backend.compile_counter() as compiled:
    tokens = decoder.generate(ids, new_tokens)
verdict = series.same_tokens(tokens)
print(verdict, "| graphs compiled:", compiled.graphs)
assert verdict and compiled.graphs == 2

# %% [markdown]
# ## A long prompt, across the window many times
# **What we test:** a prompt many windows long, in fixed chunks (the last one padded), with
# no new compilation, gives the tokens a model with no cache at all gives (the whole sequence
# through the independently dequantized reference model of notebook 02, on the host, keeping
# only the last position's logits). Both count exactly, no stop: the comparison is of the
# cache, not of where the turn ends. On the real model that reference is a host forward of
# E2B per token, so there the prompt is 3 windows and 2 tokens are checked (minutes on a
# Colab host); the twin checks 20 windows and every token.

# %%
windows, checked = (20, new_tokens) if checkpoint.tiny else (3, 2)
long_ids = ids.repeat(1, 1 + windows * W // ids.shape[1])[:, : windows * W + 5]
with backend.compile_counter() as again, helpers.decode.no_recompiles():
    long_tokens = decoder.generate(long_ids, checked, stop_ids=())
reference_model = helpers.checkpoint.reference_model(checkpoint, helpers.checkpoint.series_dtype(checkpoint))
seq = long_ids.cpu()
with torch.no_grad():
    for _ in range(checked):
        seq = torch.cat([seq, reference_model(seq, use_cache=False, logits_to_keep=1).logits[:, -1:].argmax(-1)], dim=1)
exact = helpers.checkpoint.series_dtype(checkpoint) == torch.float32  # else teacher-forced: bf16 near ties
same_long = helpers.checkpoint.compare_tokens(
    long_tokens, seq[0, long_ids.shape[1] :].tolist(), None if exact else reference_model, long_ids
)
helpers.checkpoint.unload(reference_model, helpers.get_backend("cpu"))
print(
    f"{long_ids.shape[1]}-token prompt ({long_ids.shape[1] / W:.1f} windows,"
    f" {-(-long_ids.shape[1] // decoder.chunk_size)} chunks of {decoder.chunk_size}), {checked} tokens"
    f" against no cache: {same_long}; new graphs: {again.graphs}"
)
assert same_long and again.graphs == 0

# %% [markdown]
# ## The source's headline context: 131,328 positions
# **What we test:** a ring cache for the source's 131,328 positions is allocated with the
# defaults (chunks of one window; 131,328 is no multiple of E2B's 512: the padded last chunk's
# positions past the end wrap onto the first slots and write nothing), holds exactly the
# bytes computed above, and decodes at a context past 100,000 tokens. That is the real model
# on a TPU, a path no machine building this course has run: look for 813,170,688 bytes and
# tokens at position 100,005. The twin runs the same code at 1/64 of the size (2,052 positions,
# no multiple of its window either).

# %%
CONTEXT = E2B_CONTEXT if not checkpoint.tiny else E2B_CONTEXT // 64
big = helpers.ring.RingDecoder(model, backend, max_len=CONTEXT)
big_bytes = helpers.decode.cache_bytes(big.cache)
print(f"ring cache for {CONTEXT:,} positions: {big_bytes:,} B ({fmt_bytes(big_bytes)})")
assert big_bytes == helpers.e2b.kv_cache_bytes(config, CONTEXT, ring=True, dtype_bytes=dtype_bytes)
assert checkpoint.tiny or big_bytes == 813_170_688
far = CONTEXT * 100_005 // E2B_CONTEXT  # 100,005 on E2B
far_ids = ids.repeat(1, 1 + far // ids.shape[1])[:, :far]
torch._dynamo.reset()
with backend.compile_counter() as big_compiled:
    big.generate(ids, 2)  # a new max_len is a new program: compiled here, not inside the timing
repeats = 3 if checkpoint.tiny else 1  # each run prefills the whole prompt again: on E2B, 196 chunks
with backend.compile_counter() as big_timed, helpers.decode.no_recompiles():
    run = helpers.decode.timed_generate(big, far_ids, timed_tokens, readback_every=16, repeats=repeats)
print(
    f"compiled first ({big_compiled.graphs} graphs); prompt of {far:,} tokens in {-(-far // big.chunk_size)} chunks:"
    f" prefill {run['prefill_s']:.1f} s, decode at context {far:,}: {run['decode_tok_s']:.1f} tok/s"
    f" over {timed_tokens} tokens, spread {max(run['rates']) / min(run['rates']):.2f}x over {repeats} run(s)"
)
assert big_compiled.graphs == 2 and big_timed.graphs == 0  # the timed runs compiled nothing
del big
torch._dynamo.reset()
decoder.generate(ids, 2)  # compile the notebook's decoder again after the reset

# %% [markdown]
# ## What a program at 131,328 positions holds besides the cache
# **What we test:** nothing new runs here: the sizes below are computed from E2B's real
# configuration. transformers' attention would give each of the 8 query heads its own copy of
# the one K/V head (`repeat_kv`): at 131,328 positions a full layer's K, repeated, is larger than
# the whole ring cache. The grouped attention set above makes no such copy. What still grows
# with the context is the scores: every position a full layer holds, for each query of a chunk.
#
# Read from XLA (`benchmarks/xla_programs.py`: the programs of notebooks 04-07 at E2B's shapes,
# compiled by XLA's CPU compiler, 2026-12-05, outputs in `benchmarks/`). With transformers'
# attention, the ring's decode step at 131,328 positions held a 2.15 GB intermediate (a full
# layer's K repeated for 8 heads, float32: the CPU compiler computes in float32) and needed
# 15.06 GB in all. Grouped, it needs 10.75 GB (7.81 GB without the CPU compiler's float32 copies
# of its bf16 inputs), and its largest intermediate is 269 MB, one full layer's K in float32. A
# prefill chunk of 128 went from 21.24 GB to 17.88 GB (8.76 GB without the copies). A chunk of a
# window (512, this notebook's default) ran this 24 GB build machine out of memory before
# grouping; its scores alone are 2.15 GB a full layer (the cell below). On a TPU (a path no
# machine building this course has run), look at your program's peak before trusting a long
# context: a smaller `chunk_size` lowers it.

# %%
for chunk in (1, e2b.sliding_window // 4, e2b.sliding_window):
    sizes = helpers.e2b.full_attention_bytes(e2b, E2B_CONTEXT, chunk)
    print(
        f"E2B full layer at {E2B_CONTEXT:,} positions, {chunk} quer{'y' if chunk == 1 else 'ies'}: scores"
        f" {fmt_bytes(sizes['scores'])} (float32); K repeated for {e2b.num_attention_heads} heads, which"
        f" grouped attention does not make, {fmt_bytes(sizes['k_repeated'])} (bf16)"
    )
assert helpers.e2b.full_attention_bytes(e2b, E2B_CONTEXT)["k_repeated"] > ring_e2b  # outweighs the whole ring

# %% [markdown]
# Nothing wraps silently: a prompt plus new tokens beyond the full layers' buffer is refused
# before any work.

# %%
try:
    decoder.generate(long_ids, MAX_LEN)
except ValueError as err:
    print("refused:", err)

# %% [markdown]
# ## Prefill and decode time against context length
# **What we test:** nothing about speed (a shared machine is noisy); measured side by side in
# this run. The ring's decode step reads its windows and the full layers' buffer whatever the
# context; HF's default cache (eager) grows with it. HF's default is timed on a CPU or GPU
# only: under defer-and-fuse it makes a new graph at every step (notebook 03), and its
# whole-prompt prefill at 64 windows is the attention matrix the chunks avoid.

# %%
sweep = helpers.ring.context_sweep(
    decoder, [W, 4 * W, 16 * W, 64 * W], steps=8, hf_default=backend.name in ("cpu", "cuda")
)
print(table(sweep))
fig = helpers.ring.plot_sweep(sweep)

# %% [markdown]
# ## Results, and the series' closing charts
# Decode tok/s of this step (median of 3 runs of the short prompt), and every step's row in
# this run folder beside the source's figures (TPU v5e-1, labelled as the source's).

# %%
results = helpers.Results()
helpers.steps.record_compiled(
    results,
    helpers.steps.RING,
    f"ring cache, {MAX_LEN:,} positions",  # the step's cost grows with them: one label per set-up
    decoder,
    series,
    tokens,
    compiled,
    helpers.sources.RING_TOK_S,
)
print(
    results.table(
        ["step", "label", "backend", "decode_tok_s", "source_tok_s", "device_bytes", "compiles", "same_tokens"]
    )
)
figs = helpers.bench.closing_charts(results)

# %% [markdown]
# **What you should see:** the E2B cache at 813,170,688 bytes for 131,328 positions (a third
# of full-length caches); the same tokens as notebook 03 and as a model with no cache on a
# prompt twenty windows long; two compilations in all, where HF's `StaticCache` compiles at
# every step. On a CPU the tiny model's times are small and noisy; the ring's decode time
# stays flat with context (at the worst case's cost: the full layers' whole buffer every step),
# HF's default grows. At E2B the ring's step reads 0.81 GB more than notebook 05's at a short
# context, which predicts the source's slowdown from 50 to 38-45 tok/s.

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.
# Each solution is a collapsed cell that runs with the notebook, at the size this runtime has.

# %% [markdown]
# **1.** On a v5e-1, what decode tok/s would E2B give with a ring for 16,384, 65,536 and 131,328
# positions, starting from the source's 50 tok/s at a short context?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# Time adds: each step reads the full layers' buffers on top of notebook 05's step, at 819 GB/s;
# the rate does not scale by the bytes' ratio, since the source's step ran well below the ceiling.
base_s = 1 / helpers.sources.TABLE_4BIT_TOK_S
for positions in (16_384, 65_536, helpers.sources.CONTEXT):
    at = next(r for r in helpers.e2b.step_figures(ring_context=positions) if r["step"].startswith("06"))
    extra = at["bytes_per_token"] - short["bytes_per_token"]
    print(
        f"{positions:>7,} positions: +{fmt_bytes(extra)} a step -> {1 / (base_s + extra / 819e9):.1f} tok/s (predicted)"
    )

# %% [markdown]
# **2.** With chunks of a quarter window, how long does the 20-window prompt's prefill take, and
# how many programs compile?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# Two programs again (a chunk, a step), whatever the chunk; four times the chunks, each smaller:
# more calls, each reading every weight once, so the prefill takes longer.
quarter = helpers.ring.RingDecoder(model, backend, max_len=MAX_LEN, chunk_size=W // 4)
with backend.compile_counter() as made:
    quarter.generate(ids, 2)
timed = helpers.bench.time_fn(quarter.prefill, long_ids, sync=backend.sync, warmup=1, repeats=1)
again = helpers.bench.time_fn(decoder.prefill, long_ids, sync=backend.sync, warmup=1, repeats=1)
print(
    f"{made.graphs} programs; prefill {timed.median:.3f} s in chunks of {W // 4}, {again.median:.3f} s in chunks of {W}"
)

# %% [markdown]
# **3.** A few compiled buffer lengths (4,096, 16,384, 65,536 and 131,328 positions), each step
# run on the smallest that holds its context: which contexts does each serve, and what would E2B
# decode at in each, from the bytes a step reads?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 3 (open it after you predicted)
# Each bucket serves the contexts above the one below it; a step reads its own bucket's buffer.
low = 0
for bucket in (4_096, 16_384, 65_536, helpers.sources.CONTEXT):
    at = next(r for r in helpers.e2b.step_figures(ring_context=bucket) if r["step"].startswith("06"))
    extra = at["bytes_per_token"] - short["bytes_per_token"]
    print(f"contexts {low + 1:,}-{bucket:,}: {1 / (base_s + extra / 819e9):.1f} tok/s (predicted)")
    low = bucket
