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

from helpers.course.report import fmt_bytes, table

backend = helpers.get_backend()
series = helpers.course.series.prepare(backend, after=5)  # notebook 05's model: stripped, the per-layer table in 4-bit
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
e2b = helpers.course.e2b.real_config().get_text_config()
E2B_CONTEXT = helpers.course.e2b.CONTEXT  # the source's headline context
full_e2b = helpers.course.e2b.kv_cache_bytes(e2b, E2B_CONTEXT)
ring_e2b = helpers.course.e2b.kv_cache_bytes(e2b, E2B_CONTEXT, ring=True)
print(
    f"E2B, {E2B_CONTEXT:,} positions: full-length caches {full_e2b:,} B ({fmt_bytes(full_e2b)}),"
    f" ring {ring_e2b:,} B ({fmt_bytes(ring_e2b)})"
)
assert ring_e2b == 813_170_688 and full_e2b == 2_420_637_696
weights_e2b = {k: v for k, v in helpers.course.e2b.bytes_by_step()["05 4-bit table"].items() if k != "KV cache"}
fig = helpers.course.report.stacked_bars(
    {"full-length caches": weights_e2b | {"KV cache": full_e2b}, "ring cache": weights_e2b | {"KV cache": ring_e2b}},
    f"E2B device bytes at {E2B_CONTEXT:,} positions (computed, meta device)",
)
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Why the source's decode slowed down: bytes read, and time that adds
# **What we test:** what a step reads from the cache, counted per attention layer that reads
# it (`e2b.kv_read_bytes`, from the real configuration). A static-shape step reads the full
# layers' whole buffer whatever the context, and E2B's layers 19-34 read layer 14's K and V
# (they share it): so all 7 full layers read a 131,328-position buffer, 269 MB each. The ring
# holds 0.81 GB; a step reads about 1.9 GB of it.
#
# The source's steps ran well below the memory ceiling (notebook 05: 32 and 50 tok/s against
# 179 possible, 18% and 28%), so the extra bytes add their time to the step rather than scale
# its rate: t = 1/50 s + extra bytes / 819 GB/s (Google's published v5e bandwidth). A
# prediction, printed beside the source's measured 38-45 tok/s and not fitted to it; if the
# cache were also copied every step (a program that writes a fresh cache, notebook 04's
# question about TorchTPU), a write and a read of the 0.81 GB more.

# %%
figures = helpers.course.e2b.step_figures()
short, ring_step = figures[2], next(r for r in figures if r["step"].startswith("06"))
extra = ring_step["bytes_per_token"] - short["bytes_per_token"]
base_s, bandwidth_v5e = 1 / helpers.course.sources.TABLE_4BIT_TOK_S, helpers.backend.V5E_BYTES_PER_S
predicted = 1 / (base_s + extra / bandwidth_v5e)
copied = 1 / (base_s + (extra + 2 * ring_step["cache_held"]) / bandwidth_v5e)
print(
    f"cache at {E2B_CONTEXT:,} positions: held {fmt_bytes(ring_step['cache_held'])}, read"
    f" {fmt_bytes(ring_step['cache_read'])} a step; a step reads {fmt_bytes(short['bytes_per_token'])} at context 256,"
    f" {fmt_bytes(ring_step['bytes_per_token'])} here"
)
print(
    f"predicted from the source's {helpers.course.sources.TABLE_4BIT_TOK_S} tok/s: {predicted:.1f} tok/s, {copied:.1f} if the"
    f" cache is also copied each step; the source measured {helpers.course.sources.RING_TOK_S_RANGE[0]}-"
    f"{helpers.course.sources.RING_TOK_S_RANGE[1]} tok/s"
)
# the decoder's ring: the window and its 16 spare slots (notebook 04's blocks), held once, read by more layers
spared = helpers.course.e2b.kv_cache_bytes(e2b, E2B_CONTEXT, ring=True, spare=helpers.decode.READBACK_EVERY)
assert ring_step["cache_held"] == spared and ring_step["cache_read"] > 2 * spared
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# So a static shape's decode time is flat with context at the worst case: the step reads
# 131,328 positions of K and V at context 10 as at context 131,000. Length buckets, below, read
# only the smallest bucket that holds the context; paged or ragged attention reads only the pages
# that hold tokens (vLLM's TPU backend does this; on a TPU it takes a Pallas kernel, not a plain
# PyTorch op).

# %% [markdown]
# ## The ring, in a few lines
# A sliding layer's update: attention gets the ring as it was followed by the chunk's own keys
# (all that a query of the chunk may see), then the chunk's real positions are written into
# slot `position % window`; padding never is. Written here, and kept, the same, in
# `helpers.ring`, whose `RingCache` builds one per sliding layer (a test checks the two are the
# same).

# %%
# @save helpers.ring
from transformers.cache_utils import StaticLayer


def _chunk(kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's absolute positions [C] and which are real [C], from the forward's kwargs: inputs, not cache state."""
    kwargs = kwargs.get("kwargs", kwargs)
    if "ring_positions" not in kwargs:
        raise ValueError(
            "a RingCache needs each forward's absolute positions and the ring's masks, which transformers' "
            "generate does not give: call model.generate(..., cache=cache) inside "
            "`with helpers.ring.inside_generate(model):`, or use helpers.ring.RingDecoder"
        )
    return kwargs["ring_positions"], kwargs["ring_valid"]


class RingLayer(StaticLayer):
    """A sliding layer's K/V in a ring of ``window`` slots: ``update`` returns the ring followed by the chunk, then
    writes the chunk's real positions into their slots."""

    is_sliding = True

    def __init__(self, window: int):
        super().__init__(window)
        self.window = window

    def update(self, key_states, value_states, *args, **kwargs):
        keys = torch.cat([self.keys, key_states], dim=2)
        values = torch.cat([self.values, value_states], dim=2)
        positions, valid = _chunk(kwargs)
        if key_states.shape[2] > self.window:  # generate's prefill, the whole prompt: its last window stays
            key_states, value_states = key_states[:, :, -self.window :], value_states[:, :, -self.window :]
            positions, valid = positions[-self.window :], valid[-self.window :]
        slots = positions % self.window  # distinct: at most a window of positions
        keep = valid.view(1, 1, -1, 1)
        self.keys.index_copy_(2, slots, torch.where(keep, key_states, self.keys.index_select(2, slots)))
        self.values.index_copy_(2, slots, torch.where(keep, value_states, self.values.index_select(2, slots)))
        return keys, values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window + query_length, 0


# %% [markdown]
# A ring of 4 slots, fed positions 0-2, then 3-5 with the last one padding: each key is its
# position, so the slots show where each position went (position 5 is padding: never written).

# %%
ring_layer = RingLayer(4)
positions = torch.arange(6.0).view(1, 1, 6, 1)  # one head, one dimension: key = its position
ring_layer.lazy_initialization(positions, positions)
for chunk, valid in ((slice(0, 3), [True] * 3), (slice(3, 6), [True, True, False])):
    seen, _ = ring_layer.update(
        positions[:, :, chunk],
        positions[:, :, chunk],
        ring_positions=torch.arange(6)[chunk],
        ring_valid=torch.tensor(valid),
    )
    print(f"attention sees {seen.view(-1).tolist()}; the ring's slots now {ring_layer.keys.view(-1).tolist()}")
assert ring_layer.keys.view(-1).tolist() == [4.0, 1.0, 2.0, 3.0]  # 3 -> slot 3, 4 -> slot 0; 5 is padding

# %% [markdown]
# The masks come from the absolute position each slot holds, never from where a key sits in the
# buffer: a query sees a ring slot if its position is written and within the window behind it,
# and the chunk's own keys causally. Written here (kept the same in `helpers.ring`, where
# `RingCache.masks` calls it). Then the ring above, its slots holding positions 4, 1, 2, 3, and
# a chunk at positions 6 and 7: each row is a query, each column a key (the four slots, then the
# chunk), with a window of 4.

# %%
# @save helpers.ring
from helpers.ring import EMPTY


def ring_masks(slots: torch.Tensor, positions: torch.Tensor, window: int, max_len: int):
    """Which keys each query at ``positions`` [C] sees, by absolute position: a sliding layer's keys are the ring
    (``slots``: each slot's position, -1 empty) then the chunk (q - window < k <= q), a full layer's 0..max_len-1."""
    q = positions[:, None]
    ring = torch.cat([slots, positions])[None, :]
    sliding = (ring <= q) & (ring > q - window) & (ring != EMPTY)
    # in int32: a [chunk, max_len] comparison, 64-bit work a TPU emulates in pairs otherwise
    full = torch.arange(max_len, dtype=torch.int32, device=q.device)[None, :] <= q.to(torch.int32)
    return sliding, full


# %%
sliding, full = ring_masks(torch.tensor([4, 1, 2, 3]), torch.tensor([6, 7]), window=4, max_len=8)
print("keys by position:", [4, 1, 2, 3, 6, 7])
for q, row in zip((6, 7), sliding.int().tolist()):
    print(f"query {q} sees {row}")
assert sliding.int().tolist() == [[1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]]  # 3..6 for 6, 4..7 for 7
assert full.int().sum(-1).tolist() == [7, 8]  # a full layer: positions 0..6, 0..7

# %% [markdown]
# The decoder's prefill goes through the prompt in fixed chunks, from any `start` position the
# cache already holds (the chat of notebook 08 goes on from there).
#
# Going on needs the window before `start` intact. `generate` reads tokens back in blocks of 16
# (notebook 04), so a run that stops at token 3 has already written 12 more positions. In a
# ring of `window` slots, each of them took the slot of a position the next query still sees.
# So the decoder's ring keeps `readback_every` spare slots. Position p takes the slot of
# p - window - 16, which is out of every later window. `go_on_from` then forgets the positions
# past `start`; where a run wrote more than the spare slots cover, it refuses and says why.

# %%
# @save helpers.ring


@helpers.add_to_class(helpers.ring.RingDecoder)
def go_on_from(self, start: int) -> None:
    """Forget what the last run wrote from ``start`` on, or refuse where its slots have taken positions a query at
    ``start`` still sees: a write at position p takes the slot of p - window - spare."""
    past = self.cache.get_seq_length() - start  # the last run's positions from start on (a verify's: K more)
    if past > self.spare - self.draft_tokens + 1:
        raise ValueError(
            f"the cache holds {past} positions past {start}: going on from {start} needs the window before it, "
            f"and this ring keeps {self.spare} spare slots (read back at most every {self.readback_every} "
            "tokens, or make the decoder with a larger readback_every)"
        )
    self.rewind(torch.tensor(start).to(self.cache.slot_positions.device))


@helpers.add_to_class(helpers.ring.RingDecoder)
@torch.no_grad()
def prefill(self, ids: torch.Tensor, start: int = 0):
    """The prompt in chunks, the last padded: one program for any length. ``start`` > 0 goes on after what the cache
    holds."""
    length = ids.shape[1]
    if start + length > self.max_len:
        held, verb = (f"{start} positions held + ", "exceed") if start else ("", "exceeds")
        raise ValueError(f"{held}a {length}-token prompt {verb} the cache's {self.max_len} positions")
    if start:
        self.go_on_from(start)
    self.at = start
    self.fit(start + length)
    if start == 0:
        self.cache.reset()
    self.at = start + length
    host = ids.cpu()  # each chunk built on the host, then copied: one program for any prompt, as in Decoder.prefill
    for first, positions, valid in self.chunks(length, ids.device, start):
        tokens = torch.zeros(1, self.chunk_size, dtype=ids.dtype)
        tokens[:, : min(self.chunk_size, length - first)] = host[:, first : first + self.chunk_size]
        last = torch.tensor([min(length - 1 - first, self.chunk_size - 1)]).to(ids.device)
        token = self.prefill_step(tokens.to(ids.device), positions, valid, last)
    return token, torch.tensor([[start + length]]).to(ids.device)


# %% [markdown]
# Each chunk's `prefill_forward` passes its last real row as `logits_to_keep`, so layers 15-34 and the
# head run on that row alone (notebook 04's `skip_shared_layers`). Before issue 44, the ring ran
# all 35 layers and the 262,144-wide head on every row: a 512-row chunk's logits alone were
# 268 MB in bf16. The weight FLOPs per prefilled token, computed from E2B's configuration
# (`benchmarks/prefill.py` times both at full size):

# %%
flops = helpers.course.e2b.prefill_flops(e2b, e2b.sliding_window)
print(
    f"E2B, chunks of {e2b.sliding_window}: every layer and the head on every row {flops['every row'] / 1e9:.2f} GFLOP"
    f" a token; layers 15-34 and the head on one row a chunk {flops['cut'] / 1e9:.2f} GFLOP"
    f" ({flops['every row'] / flops['cut']:.1f}x fewer)"
)
assert flops["every row"] > 3.5 * flops["cut"]
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# ## Attention that reads the one K/V head as the cache holds it
# **What we test:** E2B has 8 query heads and one K/V head. transformers' SDPA attention gives
# each query head its own copy of K and V (`repeat_kv`) whenever it gets a mask, and in every
# compiled graph: at 131,328 positions a full layer's K repeated is 1.08 GB in bf16, more than
# the whole ring (the last section computes it from the real configuration). `grouped_attention`,
# written here (kept, the same, in `helpers.ring`; a test checks it), stacks the query heads that
# share a K/V head along the queries instead, and reads K and V once.
# It is registered through transformers' `AttentionInterface`, so the model calls it as it calls
# its own. Here it gives transformers' values, on a full layer's shapes with a mask (a prefill
# chunk's queries and a decode step's one), and from here on the model uses it. Two programs
# sum in their own order (and by the thread count), so the check is float32's default
# tolerance in `torch.testing` (rtol 1.3e-6, atol 1e-5), not equal bits; the largest
# difference is printed.


# %% tags=["grouped-attention"]
# @save helpers.ring
def grouped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' SDPA attention with the query heads that share a K/V head stacked along the queries, so K and V are
    read as the cache holds them, not repeated per head (``repeat_kv``: 1.08 GB of K alone at E2B's 131,328
    positions). Same arguments and return."""
    if kwargs.get("softcap") is not None:
        raise ValueError("grouped attention has no softcap, as SDPA's has none: use eager attention")
    batch, heads, queries, dim = query.shape
    groups = heads // key.shape[1]
    query = query.reshape(batch, key.shape[1], groups * queries, dim)  # row g * S + i: head g's query i
    if attention_mask is not None and queries > 1:
        if attention_mask.shape[1] != 1:
            raise ValueError(f"a mask per head ({attention_mask.shape[1]}) cannot be grouped: one for all heads")
        attention_mask = attention_mask.repeat(1, 1, groups, 1)  # each head's queries see what query i sees
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(batch, heads, queries, dim).transpose(1, 2).contiguous(), None


# %% tags=["grouped-attention-check"]
from transformers.integrations.sdpa_attention import sdpa_attention_forward

full_attn = model.model.layers[config.layer_types.index("full_attention")].self_attn
heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
for queries in (1, 5):
    shape = (1, heads, queries, full_attn.head_dim)
    q = torch.randn(shape, dtype=torch.float32)
    k, v = (torch.randn(1, kv_heads, 40, full_attn.head_dim) for _ in "kv")
    mask = torch.arange(40)[None, None, None, :] <= torch.arange(30, 30 + queries)[None, None, :, None]
    theirs, _ = sdpa_attention_forward(full_attn, q, k, v, mask, scaling=full_attn.scaling)
    ours, _ = grouped_attention(full_attn, q, k, v, mask, scaling=full_attn.scaling)
    largest = (ours - theirs).abs().max().item()
    print(f"{queries} quer{'y' if queries == 1 else 'ies'}: largest difference from transformers' SDPA: {largest:.3g}")
    torch.testing.assert_close(ours, theirs)

# %%
before = helpers.ring.group_query_heads(model)
print(f"the model's attention: {before} -> {model.config._attn_implementation}")

# %% [markdown]
# ## The cache on this model
# **What we test:** a ring of `sliding_window` slots and 16 spare ones per sliding layer, a full
# buffer per full-attention layer, nothing for K/V-sharing layers; bytes as the formula above
# gives them.

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
full_bytes = helpers.course.e2b.kv_cache_bytes(config, MAX_LEN, dtype_bytes=dtype_bytes)
print(f"ring cache: {fmt_bytes(ring_bytes)}; full-length caches would hold {fmt_bytes(full_bytes)}")
ring_sizes = {"ring": True, "dtype_bytes": dtype_bytes, "spare": decoder.spare}
assert ring_bytes == helpers.course.e2b.kv_cache_bytes(config, MAX_LEN, **ring_sizes)

# %% [markdown]
# ## Same tokens, one decode program, one prefill program
# **What we test:** the tokens of notebook 03; two compilations in all (the prefill chunk and
# the decode step), then none for more tokens or a longer prompt.

# %%
torch.compiler.reset()
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
with backend.compile_counter() as again, helpers.course.measure.no_recompiles():
    long_tokens = decoder.generate(long_ids, checked, stop_ids=())
reference_model = helpers.course.verdict.reference_model(checkpoint, helpers.course.hub.series_dtype(checkpoint))
seq = long_ids.cpu()
with torch.no_grad():
    for _ in range(checked):
        seq = torch.cat([seq, reference_model(seq, use_cache=False, logits_to_keep=1).logits[:, -1:].argmax(-1)], dim=1)
same_long = helpers.course.verdict.compare_tokens(
    long_tokens, seq[0, long_ids.shape[1] :].tolist(), reference_model, long_ids
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
# on a TPU, a path no machine building this course has run: look for 813,367,296 bytes (the
# 813,170,688 above and the 16 spare slots) and tokens at position 100,005. The twin runs the same code at 1/64 of the size (2,052 positions,
# no multiple of its window either).

# %%
CONTEXT = E2B_CONTEXT if not checkpoint.tiny else E2B_CONTEXT // 64
big = helpers.ring.RingDecoder(model, backend, max_len=CONTEXT)
big_bytes = helpers.decode.cache_bytes(big.cache)
print(f"ring cache for {CONTEXT:,} positions: {big_bytes:,} B ({fmt_bytes(big_bytes)})")
assert big_bytes == helpers.course.e2b.kv_cache_bytes(config, CONTEXT, **ring_sizes)
assert checkpoint.tiny or big_bytes == 813_367_296
far = CONTEXT * 100_005 // E2B_CONTEXT  # 100,005 on E2B
far_ids = ids.repeat(1, 1 + far // ids.shape[1])[:, :far]
with backend.compile_counter() as big_compiled:
    big.generate(ids, 2)  # a new max_len is a new program: compiled here, not inside the timing
repeats = 3 if checkpoint.tiny else 1  # each run prefills the whole prompt again: on E2B, 196 chunks
with backend.compile_counter() as big_timed, helpers.course.measure.no_recompiles():
    run = helpers.course.measure.timed_generate(big, far_ids, timed_tokens, readback_every=16, repeats=repeats)
print(
    f"compiled first ({big_compiled.graphs} graphs); prompt of {far:,} tokens in {-(-far // big.chunk_size)} chunks:"
    f" prefill {run['prefill_s']:.1f} s, decode at context {far:,}: {run['decode_tok_s']:.1f} tok/s"
    f" over {timed_tokens} tokens, spread {max(run['rates']) / min(run['rates']):.2f}x over {repeats} run(s)"
)
assert big_compiled.graphs == 2 and big_timed.graphs == 0  # the timed runs compiled nothing

# %% [markdown]
# ## Length buckets: a step reads only what its context needs
# **What others measured:** nothing for this course's steps; the arithmetic is above. A static
# shape reads its whole buffer, so the decoder above reads 131,328 positions of its full layers
# (at E2B) at any context. With length buckets, a few compiled buffer lengths (here 2,048, 8,192
# and 131,328 positions at E2B; 64, 256 and 2,052 on the twin), each step runs on the smallest
# that holds its context, and moving up copies the cache once into the next bucket
# (`RingDecoder.fit`). The price is one compiled decode step, and prefill chunk, per bucket.
#
# **What we test:** a prompt that fills most of the first bucket, decoded on into the second:
# the tokens of the one-length decoder above (the series' verdict, [teacher-forced](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#teacher-forced) through the
# model itself: both decoders run it), three programs compiled (the first bucket's chunk and
# step, the second's step), and what a step reads in each bucket (`decode.cache_read_bytes`).

# %%
# @save helpers.ring
from helpers.ring import RingCache


@helpers.add_to_class(helpers.ring.RingDecoder)
def fit(self, end: int) -> None:
    """Make the cache the smallest bucket holding positions 0..``end``-1 (copying up once; a new prompt may move
    back down)."""
    bucket = next(b for b in self.buckets if b >= end)
    if bucket == self.cache.max_len or (bucket < self.cache.max_len and self.at):
        return
    old, self.cache = self.cache, RingCache(self.model, bucket, self.chunk_size, self.spare)
    if self.at:  # moving up mid-context: the same slots, a longer buffer for the full layers
        for new, held in zip(self.cache.layers, old.layers):
            if held.is_initialized:
                new.keys[:, :, : held.keys.shape[2]].copy_(held.keys)
                new.values[:, :, : held.values.shape[2]].copy_(held.values)
        self.cache.slot_positions.copy_(old.slot_positions)


# %%
BUCKETS = (64, 256) if checkpoint.tiny else (2_048, 8_192)  # and CONTEXT itself
bucketed = helpers.ring.RingDecoder(model, backend, max_len=CONTEXT, buckets=BUCKETS)
prompt = far_ids[:, : BUCKETS[0] - 4]
read_before = helpers.decode.cache_read_bytes(model, bucketed.cache)
with backend.compile_counter() as grew:
    grown = bucketed.generate(prompt, 12, stop_ids=())
one_length = big.generate(prompt, 12, stop_ids=())
verdict = helpers.course.verdict.compare_tokens(grown, one_length, model, prompt)
print(
    f"{prompt.shape[1]}-token prompt, 12 tokens: buckets {bucketed.buckets}, now in {bucketed.cache.max_len};"
    f" {grew.graphs} graphs; against the one-length decoder: {verdict}"
)
print(
    f"a step reads {fmt_bytes(read_before)} of cache in the first bucket,"
    f" {fmt_bytes(helpers.decode.cache_read_bytes(model, bucketed.cache))} in the second,"
    f" {fmt_bytes(helpers.decode.cache_read_bytes(model, big.cache))} in one buffer of {CONTEXT:,}"
)
assert verdict and grew.graphs == 3 and bucketed.cache.max_len == BUCKETS[1]

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
    sizes = helpers.course.e2b.full_attention_bytes(e2b, E2B_CONTEXT, chunk)
    print(
        f"E2B full layer at {E2B_CONTEXT:,} positions, {chunk} quer{'y' if chunk == 1 else 'ies'}: scores"
        f" {fmt_bytes(sizes['scores'])} (float32); K repeated for {e2b.num_attention_heads} heads, which"
        f" grouped attention does not make, {fmt_bytes(sizes['k_repeated'])} (bf16)"
    )
assert helpers.course.e2b.full_attention_bytes(e2b, E2B_CONTEXT)["k_repeated"] > ring_e2b  # outweighs the whole ring
# NBVAL_CHECK_OUTPUT

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
# this run, at contexts one in each bucket (1,536, 6,144 and 102,400 at E2B; 48, 192 and
# 1,600 on the twin). The one-length ring's decode step reads its whole buffer whatever the
# context; the bucketed one reads its bucket's; HF's default cache (eager) grows with the
# context. HF's default is timed on a CPU or GPU only: under defer-and-fuse it makes a new graph
# at every step (notebook 03), and its whole-prompt prefill is the attention matrix the chunks
# avoid.

# %%
contexts = (48, 192, 1_600) if checkpoint.tiny else (1_536, 6_144, 102_400)
sweep = helpers.course.measure.context_sweep(
    big, contexts, steps=8, hf_default=not backend.defers_ops, bucketed=bucketed
)
print(table(sweep))
fig = helpers.course.report.plot_sweep(sweep, f"{checkpoint.name} on {backend.name}: measured in this run")
assert [r["buckets bytes read"] for r in sweep] == sorted(r["buckets bytes read"] for r in sweep)  # bucket by bucket
assert all(r["ring bytes read"] == sweep[0]["ring bytes read"] for r in sweep)  # one length: the same every step

# %% [markdown]
# ## Results, and the series' closing charts
# Decode tok/s of this step (median of 3 runs of the short prompt), and every step's row in
# this run folder beside the source's figures (TPU v5e-1, labelled as the source's).

# %%
results = helpers.Results()
helpers.course.steps.record_compiled(
    results,
    helpers.course.steps.RING,
    f"ring cache, {MAX_LEN:,} positions",  # the step's cost grows with them: one label per set-up
    decoder,
    series,
    tokens,
    compiled,
    helpers.course.sources.RING_TOK_S,
)
print(
    results.table(
        ["step", "label", "backend", "decode_tok_s", "source_tok_s", "device_bytes", "compiles", "same_tokens"]
    )
)
figs = helpers.course.report.closing_charts(results)

# %% [markdown]
# **What you should see:** the E2B cache at 813,170,688 bytes for 131,328 positions (a third
# of full-length caches; 196,608 more for the decoder's 16 spare slots), of which a step reads about 1.9 GB; the same tokens as notebook 03 and
# as a model with no cache on a prompt twenty windows long; two compilations in all, where HF's
# `StaticCache` compiles at every step (notebook 04); and with buckets, the same tokens across a
# bucket change, one program per bucket, and a step's bytes that grow with its bucket. On a CPU
# the tiny model's times are small and noisy; the one-length ring's decode time stays flat with
# context (at the worst case's cost), the bucketed ring's follows its buckets, HF's default
# grows. On a v5e-1 (a path no machine building this course has run), look for the bucketed
# step ahead of the one-length one at short contexts by the bytes it does not read.

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
base_s = 1 / helpers.course.sources.TABLE_4BIT_TOK_S
for positions in (16_384, 65_536, helpers.course.e2b.CONTEXT):
    at = next(r for r in helpers.course.e2b.step_figures(ring_context=positions) if r["step"].startswith("06"))
    extra = at["bytes_per_token"] - short["bytes_per_token"]
    print(
        f"{positions:>7,} positions: +{fmt_bytes(extra)} a step -> {1 / (base_s + extra / 819e9):.1f} tok/s (predicted)"
    )
# NBVAL_CHECK_OUTPUT

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
timed = helpers.timing.time_fn(quarter.prefill, long_ids, sync=backend.sync, warmup=1, repeats=1)
again = helpers.timing.time_fn(decoder.prefill, long_ids, sync=backend.sync, warmup=1, repeats=1)
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
for bucket in (4_096, 16_384, 65_536, helpers.course.e2b.CONTEXT):
    at = next(r for r in helpers.course.e2b.step_figures(ring_context=bucket) if r["step"].startswith("06"))
    extra = at["bytes_per_token"] - short["bytes_per_token"]
    print(f"contexts {low + 1:,}-{bucket:,}: {1 / (base_s + extra / 819e9):.1f} tok/s (predicted)")
    low = bucket
# NBVAL_CHECK_OUTPUT
