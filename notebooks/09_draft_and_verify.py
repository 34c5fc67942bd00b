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
# # 09 · Draft and verify with Gemma 4's own assistant
#
# **What others measured** (not this course; xbill9/gemma4-dev, `jev-tpu-v5e1/README.md`, vLLM
# TPU on a v5e-1, one request, 4 drafted tokens): E2B at 144 tok/s in bf16, 346 with
# Google's assistant drafting, 395 with W8A8 weights and the assistant, at a mean acceptance
# length of 3.21 (W8A8, prompts that ignore EOS). vLLM's mean acceptance length counts the
# target's own token: it is this course's **tokens per verify**, the one definition used here
# (3.21 tokens per verify at K = 4 is 2.21 of the 4 drafts kept).
#
# Every notebook so far made one token per pass over the weights, and notebook 07 showed that
# pass is bound by the bytes it reads. Google ships a drafter for each Gemma 4 size
# (`google/gemma-4-E2B-it-assistant`; transformers' `Gemma4AssistantForCausalLM`): a 4-layer
# model that keeps no cache of its own. Each of its layers reads the target's own K/V (of the
# target's last sliding and last full layer), and its input is the target's last hidden state
# joined to the embedding of the last token. It drafts K tokens; the target checks all of them in
# **one** forward of K+1 tokens, the prefill's path, which reads the weights once. The drafts up
# to the first one the target disagrees with are kept, then the target's own token there: with
# greedy verification the tokens are the target's own, this course's rule.
#
# **What we test:** the tokens are notebook 03's (the one verdict), with HF's assisted `generate`
# as the reference; per K one compiled call (the verify, then the next call's drafts) besides the
# prefill (which drafts the first call's), none per
# token; on the static cache and on the ring. The tests add: K = 1..6, every draft kept, every
# draft rejected, a stop token inside the drafts, a prompt several windows long on the ring.
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
assistant_folder = helpers.course.hub.choose_assistant(checkpoint)
assistant = helpers.draft.load_assistant(assistant_folder, backend, helpers.course.hub.series_dtype(checkpoint))
MAX_LEN = 256  # prompt, timed tokens and the last call's drafts
text = assistant.config.get_text_config()
owners = helpers.draft.shared_layers(model)
print(
    table(
        [
            {"": "layers", "target": len(model.model.layers), "assistant": text.num_hidden_layers},
            {"": "hidden size", "target": model.config.get_text_config().hidden_size, "assistant": text.hidden_size},
            {
                "": "K/V of its own",
                "target": "yes",
                "assistant": f"none: reads target layers {sorted(owners.values())}",
            },
            {
                "": "weights",
                "target": fmt_bytes(
                    sum(t.numel() * t.element_size() for t in helpers.checkpoint.unique_tensors(model).values())
                ),
                "assistant": fmt_bytes(
                    sum(t.numel() * t.element_size() for t in helpers.checkpoint.unique_tensors(assistant).values())
                ),
            },
        ]
    )
)
print(f"the assistant: {assistant_folder}")

# %% [markdown]
# On the twin, the assistant is transformers' class at the twin's widths, trained offline for about
# two minutes on 2 CPU cores (seeded, cached: `helpers.course.offline`) to draft the twin's
# own greedy tokens. The twin knows a few answers by heart, and so does its assistant: its
# acceptance here is near perfect, far above the real pair's 3.21 tokens per verify, which is
# why the figures below at full size use the real pair's acceptance, labelled. A random
# assistant would accept nothing and prove only the rejection path (exercise 1).
#
# ## The reference: transformers' assisted `generate`
# **What we test:** `model.generate(..., assistant_model=assistant)` gives notebook 03's tokens,
# and how many tokens each pass of the target makes (its forwards counted by a hook, removed
# after).

# %%
calls = []
hook = model.register_forward_pre_hook(lambda module, args: calls.append(1))
try:
    config = helpers.generate.greedy_config(model, series.new_tokens)
    assisted = helpers.timing.time_fn(
        model.generate, ids, generation_config=config, assistant_model=assistant, sync=backend.sync, warmup=0, repeats=1
    )
    passes = len(calls)
    calls.clear()
    plain = helpers.timing.time_fn(
        model.generate, ids, generation_config=config, sync=backend.sync, warmup=0, repeats=1
    )
finally:
    hook.remove()
hf_tokens = assisted.last.sequences[0, ids.shape[1] :].tolist()
verdict = series.same_tokens(hf_tokens)
print(f"HF assisted generate: {len(hf_tokens)} tokens in {passes} passes of the target (the prefill's included)")
print(
    f"  {len(hf_tokens) / assisted.median:.1f} tok/s against {len(hf_tokens) / plain.median:.1f} without the assistant (eager, this run)"
)
print("same tokens as notebook 03:", verdict)
assert verdict

# %% [markdown]
# **What you should see:** the same tokens, in far fewer passes of the target than tokens.
# `generate` still runs eagerly, reads each round's tokens back to the host and builds the
# drafter's masks every round; the rest of this notebook compiles both halves.
#
# ## Draft: K tokens at one position, over the target's K/V
# The assistant's query sits at the position of the last token (the one the target has not yet
# seen), and stays there for all K drafts: each draft feeds the last one and the hidden state it
# left. It sees every key before that position, and in a sliding layer the last `window` of them:
# what the target's own query one position earlier saw. transformers builds those masks from a
# padding mask, which a static or ring buffer's unwritten slots are not, so the masks are written
# here from the slots' positions; with `use_ordered_embeddings` (2,048 centroids) the head scores
# only the tokens of the top 32, as transformers' own `Gemma4AssistantMaskedEmbedder`, without its
# read of a minimum to the host (a [graph break](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#graph-break)).

# %%
# @save helpers.draft
from helpers.ring import EMPTY, as_mask


def shared_layers(model) -> dict[str, int]:
    """Per attention type, the target layer whose K/V its sharing layers read: the assistant reads the same."""
    types = model.config.get_text_config().layer_types
    return {types[i]: i for i, layer in enumerate(model.model.layers) if layer.self_attn.store_full_length_kv}


def draft_masks(key_positions: dict, position: torch.Tensor, window: int) -> dict:
    """Which keys the assistant's query at ``position`` sees, from each type's key positions [S] (-1: empty): all
    before it, and in a sliding layer the last ``window`` of them, as the target's own query at ``position - 1``."""
    masks = {}
    for kind, keys in key_positions.items():
        seen = (keys < position) & (keys != EMPTY)
        masks[kind] = seen & (keys >= position - window) if kind == "sliding_attention" else seen
    return masks


def draft_scores(assistant, hidden: torch.Tensor):
    """The assistant's scores [1, 1, N] and the ids they score [1, 1, N]: every token, or with ordered embeddings only its
    top centroids' tokens, as HF's masked embedder scores them, without its host read of their minimum (a graph
    break)."""
    ordered = assistant.masked_embedding
    if ordered is None:
        scores = assistant.lm_head(hidden)
        return scores, torch.arange(scores.shape[-1], device=scores.device).expand(scores.shape)
    top = ordered.centroids(hidden).topk(ordered.centroid_intermediate_top_k, dim=-1).indices
    ids = ordered.token_ordering.view(ordered.num_centroids, -1)[top].flatten(-2)  # [1, 1, tokens scored]
    return (hidden.unsqueeze(-2) @ assistant.lm_head.weight[ids].transpose(-1, -2)).squeeze(-2), ids


def draft_token(assistant, hidden: torch.Tensor) -> torch.Tensor:
    """The assistant's argmax [1, 1]."""
    scores, ids = draft_scores(assistant, hidden)
    return ids.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)


def assist(assistant, embedding, hidden, position, shared_kv: dict, masks: dict):
    """One assistant forward as HF's, with the masks given (HF's builds them from a padding mask, which a static or ring
    buffer's unwritten slots are not): its last hidden state, which scores the draft, and the hidden state the next
    draft starts from."""
    x = assistant.pre_projection(torch.cat([embedding, hidden], dim=-1))
    out = assistant.model(
        inputs_embeds=x, attention_mask=masks, position_ids=position, shared_kv_states=shared_kv, use_cache=False
    )
    return out.last_hidden_state, assistant.post_projection(out.last_hidden_state)


# %% [markdown]
# ## Verify: K+1 tokens in one forward, the longest agreeing prefix kept
# The whole loop, written as a class that goes first among a decoder's bases (as notebook 08's
# sampler). A call is one compiled program, `verify_and_draft`: the verify, then the next call's
# drafts from the token and hidden state it leaves, so nothing waits between the two (the prefill
# drafts the first call's). `generate` reads the tokens back as notebook 04's loop does, now 1 to
# K+1 of them per call (-1 marks the rest). After a verify the cache is rewound to the tokens kept: a static
# cache's positions past them are written again by the next call, as notebook 04's prefill does
# with its padding.

# %%
# @save helpers.draft
from helpers.decode import READBACK_EVERY, Decoder, kv_buffers, set_length
from helpers.ring import RingDecoder


class Drafted:
    """Notebook 09's additions to a decoder (first among its bases): each call verifies ``draft_tokens`` (K) drafts, a
    forward of K+1 tokens, then drafts the next call's K with ``assistant``, in one compiled program (a prefill drafts
    the first call's)."""

    at = 0  # positions held, at most (a ring's buckets read it)

    def __init__(self, model, assistant, backend, max_len: int, draft_tokens: int = 4, **kwargs):
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens={draft_tokens}: draft at least one token (0 is notebook 04's decoder)")
        self.assistant, self.draft_tokens = assistant, draft_tokens
        super().__init__(model, backend, max_len, **kwargs)
        self.window = model.config.get_text_config().sliding_window
        self.owners = shared_layers(model)
        self.drafts = None  # the next call's drafts, and what they were drawn from
        options = {k: v for k, v in kwargs.items() if k not in ("chunk_size", "buckets", "readback_every")}
        self.call_step = backend.compile(self.verify_and_draft, fullgraph=True, **options)
        self.kept: list[int] = []  # per call of the last run: the drafts the target kept

    def key_positions(self) -> dict:
        """Per attention type, the position each slot of its shared K/V holds (a static cache: the slot's index)."""
        keys = self.cache.layers[self.owners["full_attention"]].keys
        return dict.fromkeys(self.owners, torch.arange(keys.shape[2], device=keys.device))

    def shared(self, position):
        """What every draft at ``position`` reads: the target's shared K/V, and the masks over it."""
        layers = {kind: self.cache.layers[i] for kind, i in self.owners.items()}
        implementation = self.assistant.config.get_text_config()._attn_implementation
        allowed = draft_masks(self.key_positions(), position.view(()), self.window)
        masks = {kind: as_mask(m[None], implementation) for kind, m in allowed.items()}
        return {kind: (layer.keys, layer.values) for kind, layer in layers.items()}, masks

    def draft(self, token, hidden, position):
        """K tokens [1, K] after ``token`` at ``position``, ``hidden`` the target's before it: K assistant forwards at
        that one position, over the target's K/V (the assistant keeps no cache), each fed the last draft and the hidden
        state it left. Returns them and what they were drawn from (None here: each the assistant's argmax)."""
        shared_kv, masks = self.shared(position)
        embed, drafts = self.model.get_input_embeddings(), []
        for _ in range(self.draft_tokens):
            last, hidden = assist(self.assistant, embed(token), hidden, position, shared_kv, masks)
            token = draft_token(self.assistant, last)
            drafts.append(token)
        return torch.cat(drafts, dim=1), None

    @torch.no_grad()
    def prefill(self, ids, start: int = 0):
        (token, self.drafts), position = super().prefill(ids, start)  # this decoder's prefill drafts too
        return token, position

    def check_room(self, length: int, new_tokens: int, start: int = 0, extra: int = 0) -> None:
        super().check_room(length, new_tokens, start, self.draft_tokens)  # the last call writes K more positions


# %% [markdown]
# The target's side of a call: its last hidden state on K+1 tokens (what the assistant reads next), its head,
# and its cache rewound to what it keeps.


# %%
# @save helpers.draft
@helpers.add_to_class(Drafted)
def target(self, tokens, positions, rows=0):
    """The target's last hidden state [1, C, H] for ``tokens`` [1, C] at ``positions`` [1, C] (at ``rows`` alone,
    a tensor): its text model's output, what the assistant reads (``output_hidden_states`` hooks every layer, through
    a lock dynamo refuses)."""
    return self.model.model(
        input_ids=tokens, position_ids=positions, cache=self.cache, use_cache=True, logits_to_keep=rows
    )


@helpers.add_to_class(Drafted)
def head(self, hidden):
    """The target's logits from its last hidden state, as its forward makes them: ``lm_head``, then the softcap."""
    logits = self.model.lm_head(hidden)
    cap = self.model.config.get_text_config().final_logit_softcapping
    return logits if cap is None else torch.tanh(logits / cap) * cap


@helpers.add_to_class(Drafted)
def rewind(self, length) -> None:
    """Forget positions from ``length`` (a device tensor) on: the rejected drafts'."""
    set_length(self.cache, length)


# %% [markdown]
# A verify: the target on the token and the K drafts in one forward, the longest agreeing prefix kept (`judge`),
# then its own token after it; and a call, the verify then the next call's drafts, one program.


# %%
# @save helpers.draft
@helpers.add_to_class(Drafted)
def verify(self, token, drafts, position, q=None):
    """The target on ``token`` then the drafts, in one forward (its weights read once): the drafts it keeps
    (``judge``), then its own token after them. Returns those tokens [1, K+1] (-1 past them), the last one, the
    position it goes at and the hidden state before it."""
    self.backend.donate(*kv_buffers(self.cache))  # written in place below: reused, not copied (xla)
    tokens = torch.cat([token, drafts], dim=1)
    steps = torch.arange(tokens.shape[1], device=tokens.device)
    positions = position + steps
    hidden = self.target(tokens, positions).last_hidden_state
    kept, made = self.judge(drafts[0], q, self.head(hidden[0]), positions[0] + 1)
    self.rewind(position.view(()) + kept + 1)
    chosen = torch.where(steps < kept, torch.cat([drafts[0], made[-1:]]), made)  # the kept drafts, then its token
    block = torch.where(steps <= kept, chosen, -1)
    return (
        block[None],
        made.index_select(0, kept.view(1))[None],
        position + kept + 1,
        hidden.index_select(1, kept.view(1)),
    )


def leading(agree: torch.Tensor) -> torch.Tensor:
    """How many of ``agree`` [K] (bool) hold before the first that does not: its index, else K. A minimum, not a
    ``cumprod``: PyTorch/XLA runs cumprod on the host, which split a call in programs around it."""
    steps = torch.arange(agree.shape[0], device=agree.device)
    return torch.where(agree, agree.shape[0], steps).min()


@helpers.add_to_class(Drafted)
def judge(self, drafts, q, logits, at):
    """How many of ``drafts`` [K] the target keeps, and the token it makes after each of the K+1 positions [K+1],
    from its ``logits`` [K+1, vocab] at positions ``at``: greedy, the drafts before its first disagreement."""
    made = self.pick(logits, at)[:, 0]
    return leading(drafts == made[:-1]), made


@helpers.add_to_class(Drafted)
def verify_and_draft(self, token, position, drafts, q=None):
    """One call: ``verify``, then the next call's drafts from the token and hidden state it leaves (``draft``)."""
    block, token, position, hidden = self.verify(token, drafts, position, q)
    return block, token, position, self.draft(token, hidden, position)


# %% [markdown]
# The loop around the calls: the prefill drafts the first call's tokens, each call hands the next its drafts,
# and the host reads the blocks back as notebook 04's loop does.


# %%
# @save helpers.draft
@helpers.add_to_class(Drafted)
@torch.no_grad()
def call(self, token, position):
    block, token, position, self.drafts = self.call_step(token, position, *self.drafts)
    return block, token, position


@helpers.add_to_class(Drafted)
def tokens_per_verify(self) -> float:
    """The last run's tokens per call: the target's own and the drafts it kept, on average (vLLM's "mean
    acceptance length", which counts the target's own token too)."""
    return 1 + sum(self.kept) / self.calls()


@helpers.add_to_class(Drafted)
def kept_at(self) -> list[float]:
    """Per draft position 1..K, the share of the last run's calls that kept it."""
    return [sum(n >= j for n in self.kept) / self.calls() for j in range(1, self.draft_tokens + 1)]


@helpers.add_to_class(Drafted)
def calls(self) -> int:
    """The last run's calls: none when its one token came from the prefill, and then nothing to count per call."""
    if not self.kept:
        raise ValueError("the last run made no call (its one token came from the prefill): no verify to count")
    return len(self.kept)


@helpers.add_to_class(Drafted)
@torch.no_grad()
def generate(
    self, ids, new_tokens: int, readback_every: int = READBACK_EVERY, stop_ids=None, streamer=None, start: int = 0
):
    """As notebook 04's, each call making 1 to K+1 tokens: read back once ``readback_every`` tokens may have been
    made, or the length may have been reached."""
    self.check_room(ids.shape[1], new_tokens, start)
    stops = self.stops(ids.cpu()[0].tolist(), stop_ids)  # a copy, not a device op per prompt length
    if streamer is not None:
        streamer.put(ids.cpu())
    token, position = self.prefill(ids, start)
    tokens, pending, most, self.kept = [], [token], 1, []  # most: tokens made at most, until read back
    while True:
        if most >= new_tokens or most - len(tokens) >= readback_every:
            self.backend.flush()
            blocks = [b[0].tolist() for b in pending]
            self.kept += [sum(t >= 0 for t in b) - 1 for b in blocks[1 if not tokens else 0 :]]
            made = [t for b in blocks for t in b if t >= 0]
            chunk, stopped = stops.cut(made[: new_tokens - len(tokens)])
            tokens, pending, most = tokens + chunk, [], len(tokens) + len(chunk)
            self.at = start + ids.shape[1] + len(tokens)  # positions held, known again (a ring's buckets)
            if streamer is not None:
                streamer.put(torch.tensor(chunk))
            if most >= new_tokens or stopped:
                if streamer is not None:
                    streamer.end()
                return tokens
        block, token, position = self.call(token, position)
        pending.append(block)
        most += block.shape[1]


# %% [markdown]
# The two decoders: `Drafted` first among the bases, on notebook 04's static cache and on notebook 06's ring,
# which keeps K more spare slots for the drafts and moves up a bucket as notebook 06's does.


# %%
# @save helpers.draft
class DraftDecoder(Drafted, Decoder):
    """Notebook 04's decoder, drafting and verifying on its static cache."""

    def prefill_forward(self, tokens, last):
        self.backend.donate(*kv_buffers(self.cache))
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        hidden = self.target(tokens, positions, rows=last).last_hidden_state  # the last real row's alone
        token = self.pick(self.head(hidden[0]), last + 1)
        return token, self.draft(token, hidden, (last + 1).view(1, 1))  # the first call's drafts


class DraftRingDecoder(Drafted, RingDecoder):
    """Notebook 06's decoder, drafting and verifying on a ring with K more spare slots: a rejected draft's position
    takes a slot, which in a ring of ``window`` held a position the next query still sees."""

    def key_positions(self) -> dict:
        positions = super().key_positions()
        return {**positions, "sliding_attention": self.cache.slot_positions}

    def target(self, tokens, positions, rows=0, valid=None):
        valid = torch.ones(tokens.shape[1], dtype=torch.bool, device=tokens.device) if valid is None else valid
        return self.forward_chunk(tokens, positions, valid, self.model.model, rows)

    rewind = RingDecoder.rewind  # not Drafted's, the static cache's

    def prefill_forward(self, tokens, positions, valid, last):
        self.backend.donate(*kv_buffers(self.cache))
        hidden = self.target(tokens, positions, last, valid).last_hidden_state
        at = positions[0].index_select(0, last) + 1
        token = self.pick(self.head(hidden[0]), at)
        return token, self.draft(token, hidden, at.view(1, 1))  # the first call's drafts (each chunk's: one program)

    @torch.no_grad()
    def call(self, token, position):
        """``Drafted.call`` on the smallest bucket that holds what the call may write: K+1 positions. ``at`` counts
        them all, so it may run ahead of the positions held until ``generate`` reads back and sets it."""
        self.fit(min(self.at + self.draft_tokens + 1, self.max_len))
        self.at += self.draft_tokens + 1
        return Drafted.call(self, token, position)


# %% [markdown]
# ## On the static cache and on the ring, compiled
# **What we test:** for each K, the tokens are notebook 03's; two graphs compile on the first
# run (the prefill, which drafts the first call's tokens, and the call: a verify, then the next
# drafts) and none on the second; tokens per verify and the
# drafts kept at each draft position; tok/s against notebook 06's one-token ring decoder, timed
# in this run.

# %%
ks = (3,)  # each K is two compiles, a minute on a CPU: K = 1..6 in `benchmarks/draft.py` and the tests
one_token = helpers.ring.RingDecoder(model, backend, MAX_LEN)
one_token.generate(ids, series.new_tokens)  # compiled before it is timed
base = helpers.course.measure.timed_generate(one_token, ids, series.timed_tokens, readback_every=16)
results = helpers.Results()
rows, kept_shares = [], {}
for k in ks:
    for kind in (DraftDecoder, DraftRingDecoder):
        backend.reset_peak_memory()  # each row's own device peak (none counted on a CPU)
        decoder = kind(model, assistant, backend, MAX_LEN, k)
        with backend.compile_counter() as compiled:
            tokens = decoder.generate(ids, series.new_tokens)
        with backend.compile_counter() as again:
            assert decoder.generate(ids, series.new_tokens) == tokens  # equal lists: the same programs, same inputs
        timed = helpers.course.measure.timed_generate(decoder, ids, series.timed_tokens, readback_every=16)
        row = helpers.course.steps.record_draft(results, series, decoder, tokens, compiled, timed["rates"])
        kept_shares[f"{kind.__name__}, K={k}"] = decoder.kept_at()
        rows.append({**row, "again": again.graphs, "x one-token": row["decode_tok_s"] / base["decode_tok_s"]})
        assert row["same_tokens"] and compiled.graphs == 2 and again.graphs == 0, row
print(f"notebook 06's one-token ring decoder: {base['decode_tok_s']:.1f} tok/s")
print(
    table(
        rows,
        [
            "label",
            "same_tokens",
            "compiles",
            "again",
            "tokens_per_verify",
            "decode_tok_s",
            "x one-token",
            "bytes_per_token",
        ],
    )
)

# %%
fig, ax = plt.subplots(figsize=(7, 3))
for label, rates in kept_shares.items():
    ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label)
ax.set_xlabel("draft position")
ax.set_ylabel("share of verifies that kept it")
ax.set_ylim(0, 1.05)
ax.set_title(f"drafts kept, {checkpoint.name} on {backend.name}, this run")
ax.legend()

# %% [markdown]
# **What you should see:** the same tokens on both caches, 2 graphs then 0 (a call writes its K/V
# in place, [donated](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#aliased-donated) as the step's are; on PyTorch/XLA no op of a call runs on the host,
# which is why `judge` takes a minimum and not a `cumprod`: CI's xla job audits both),
# and close to K+1 tokens per verify on the twin (its assistant learned the twin's few answers).
# Whether that is faster depends on what a call costs against one step: the verify of K+1 tokens
# and the K drafts (the next section computes it for a v5e-1). On a CPU, the twin's step is bound by Python and dispatch, so the ratio shows the calls
# saved. At E2B's size on a CPU (the course's `benchmarks/draft_full_size-cpu-*.txt`, a 2-core
# CPU, compiled): with bf16 linears on a CPU without bf16 instructions a verify of 5 tokens cost
# 3.7 steps, its matmuls bound by compute, and drafting would run at 0.74x HF's compiled
# `generate`; with notebook 07's int4 linears through torch's kernel, on a CPU with bf16
# instructions, one step is 2.37x HF's recipe, a verify of 5 costs 1.88 steps and a draft of 4
# 0.59, so at the real pair's 3.21 tokens per verify drafting would run at 3.07x HF's recipe
# (1.30x the one-token step). `bytes_per_token` is this notebook's
# roofline figure: what a call reads (the target's step once, the assistant K times) over the tokens
# it made.
#
# ## What a call costs on a v5e-1: a hypothesis, from the configuration
# A call is the verify of K+1 tokens and K assistant passes, so it costs more than one step. On a
# v5e-1 a step is bound by the bytes it reads. The verify reads those bytes once, for K+1 rows
# whose arithmetic stays far below the
# [ridge point](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#ridge-point).
# Each draft reads the assistant's weights (of its ordered head, only the top centroids' rows)
# and the target's K/V its layers share. Below,
# each part's bytes at 819 GB/s plus its FLOPs at the bf16 peak, from E2B's configuration and the
# synthetic assistant's (Google's own is not in this course's sources; its widths are E2B's).
# No TPU ran this. The measurement that would test it: `benchmarks/draft_full_size.py --backend
# tpu --compiled` on a v5e-1, its verify and draft rows against its one step.

# %%
cost = helpers.course.e2b.call_figures(k=4, tokens_per_verify=3.21)
vllm = helpers.course.sources.VLLM_E2B_TOK_S
print(
    f"E2B on a v5e-1, K = 4: a step {cost['step_ms']:.2f} ms; a verify of 5 {cost['verify_steps']:.3f} steps, 4 drafts"
    f" {cost['drafts_steps']:.3f}: a call costs {cost['call_steps']:.2f} steps. At 3.21 tokens per verify that is"
    f" {cost['x_one_token']:.2f}x the one-token step; vLLM measured {vllm['bf16 + assistant'] / vllm['bf16']:.2f}x"
    f" ({vllm['bf16 + assistant']} against {vllm['bf16']} tok/s, bf16)"
)
assert 1.2 < cost["call_steps"] < 1.4
# NBVAL_CHECK_OUTPUT

# %% [markdown]
# **What you should see:** a call at about 1.3 steps: the verify about 1.02, the drafts about
# 0.28. The verify alone would promise 3.2x; the drafts bring it to about 2.5x, near what vLLM
# measured on the real pair.
#
# ## Sampling: the target's distribution, kept
# **What we test:** speculative sampling with notebook 08's sampler (its warpers, its
# [Gumbel-max](https://github.com/OWNER/gemma4-on-tpu/blob/main/docs/glossary.md#gumbel-max) draws keyed on seed and position): the assistant draws each draft from its own warped
# distribution q; the target keeps it with probability min(1, p/q), p its own, and at the first
# draft it does not keep, draws from what p has beyond q, max(p - q, 0) renormalised; with every
# draft kept, its next token from p. The tokens then follow p exactly (Leviathan et al., 2023),
# whatever the assistant: a better one only keeps more drafts. The tests check it with a
# chi-square test on 1,200 seeds, for an untrained assistant and the trained one.

# %%
# @save helpers.draft
from helpers.sampling import Sampled, gumbel


class Speculative(Sampled):
    """Notebook 09's drafts sampled (first among a draft decoder's bases): the assistant draws each draft from its warped
    distribution q, the target keeps it with probability min(1, p/q), p its own, and at the first it does not keep
    draws from max(p - q, 0) renormalised (every draft kept: its next token from p). The tokens then follow p exactly
    (Leviathan et al., 2023). Each draw is notebook 08's Gumbel-max, keyed on (seed + stream, position)."""

    def draw(self, probs, positions, stream: int):
        """One token per row of ``probs`` [N, vocab] (unnormalised), at ``positions`` [N]."""
        return (probs.log() + gumbel(self.seed + stream, positions, probs.shape[-1])).argmax(-1)

    def draft(self, token, hidden, position):
        if not self.sampler.do_sample:
            return super().draft(token, hidden, position)
        shared_kv, masks = self.shared(position)
        embed, drafts, probs = self.model.get_input_embeddings(), [], []
        for i in range(self.draft_tokens):
            last, hidden = assist(self.assistant, embed(token), hidden, position, shared_kv, masks)
            scores, ids = draft_scores(self.assistant, last)
            q = torch.zeros(1, self.model.lm_head.out_features, device=last.device)
            q = q.scatter(-1, ids[0], self.sampler.scores(scores[0]).softmax(-1))
            token = self.draw(q, position.view(-1) + 1 + i, 1).view(1, 1)
            drafts.append(token)
            probs.append(q)
        return torch.cat(drafts, dim=1), torch.cat(probs)

    def judge(self, drafts, q, logits, at):
        if not self.sampler.do_sample:
            return super().judge(drafts, q, logits, at)
        p = self.sampler.scores(logits).softmax(-1)  # [K+1, vocab]: the target's, after each token
        chosen = drafts[:, None]
        uniform = torch.exp(-torch.exp(-gumbel(self.seed + 3, at[:-1], 1)[:, 0]))  # a Gumbel variable back to (0, 1)
        kept = leading(uniform * q.gather(1, chosen)[:, 0] < p[:-1].gather(1, chosen)[:, 0])
        beyond = (p[:-1] - q).clamp_min(0)  # all 0 only where p = q up to rounding: then p itself
        beyond = torch.where(beyond.sum(-1, keepdim=True) > 0, beyond, p[:-1])
        return kept, self.draw(torch.cat([beyond, p[-1:]]), at, 2)  # row i: drawn if drafts before i are kept


class SpeculativeDecoder(Speculative, DraftDecoder):
    """Drafts on the static cache, sampled."""


class SpeculativeRingDecoder(Speculative, DraftRingDecoder):
    """Drafts on the ring, sampled: what notebook 08's chat runs with its assistant."""


# %% [markdown]
# Token 2 of 400 seeds, drawn by the speculative loop (run as written, uncompiled: three more
# compiles would be a minute on a CPU), against its exact probability under the target: the
# target's probability of each first token times its probability of the second after it.

# %%
settings = helpers.sampling.sampling_config(top_k=3)  # a few tokens per position: 400 draws resolve them
sampled = SpeculativeDecoder(model, assistant, backend, MAX_LEN, 2, sampling=settings)
sampled.prefill_step, sampled.call_step = sampled.prefill_forward, sampled.verify_and_draft
warp = sampled.sampler.scores
with torch.no_grad():
    p1 = warp(model(ids).logits[:, -1]).softmax(-1)[0]
    first = p1.nonzero()[:, 0]
    after = warp(model(torch.cat([ids.repeat(len(first), 1), first[:, None]], dim=1)).logits[:, -1]).softmax(-1)
p2 = (p1[first, None] * after).sum(0).cpu()
counts = torch.zeros_like(p2)
for seed in range(400):
    counts[sampled.generate(ids, 2, seed=seed, stop_ids=())[1]] += 1
shown = p2.nonzero()[:, 0]
fig, ax = plt.subplots(figsize=(7, 3))
x = torch.arange(len(shown))
ax.bar(x - 0.2, p2[shown], 0.4, label="the target's probability")
ax.bar(x + 0.2, counts[shown] / 400, 0.4, label="share of 400 speculative draws")
ax.set_xticks(x, [repr(tokenizer.decode([int(t)])) for t in shown], rotation=30)
ax.set_title("token 2, sampled with drafts")
ax.legend()
assert counts[p2 == 0].sum() == 0  # nothing the target's warpers removed is ever drawn

# %% [markdown]
# **What you should see:** the two bars of each token close together (400 draws: a few percent
# apart); only tokens the target's top-k keeps.
#
# ## Why the ring needs K more spare slots
# A verify writes the K/V of all K+1 tokens before it knows which it keeps. On a ring of `window`
# slots, a rejected draft's position takes the slot of a position `window` earlier, one the next
# query still sees. With K spare slots, the slot it takes held a position out of every future
# window. (The decoder keeps `readback_every` spare slots besides, for what a block makes past a
# stop: notebook 06.) Below, one call whose drafts are rejected (each the twin's last token id), on both rings: each slot's position after
# it, and in red the positions the next query needs that the ring no longer holds.

# %%
window, vocab = model.config.get_text_config().sliding_window, model.config.get_text_config().vocab_size
prompt = torch.randint(3, vocab, (1, 2 * window + 3), generator=torch.Generator().manual_seed(1))
prompt = prompt.to(backend.device)
k = 3
fig, axes = plt.subplots(2, 1, figsize=(9, 2.8))
for ax, spare in zip(axes, (0, k)):
    ring = DraftRingDecoder(model, assistant, backend, MAX_LEN, k)
    ring.spare, ring.cache = spare, helpers.ring.RingCache(model, MAX_LEN, ring.chunk_size, spare)
    ring.draft = lambda token, hidden, position: (torch.full((1, k), vocab - 1, device=token.device), None)
    ring.prefill_step, ring.call_step = (
        ring.prefill_forward,
        ring.verify_and_draft,
    )  # as written: another ring, another compile
    token, start = ring.prefill(prompt)
    _, _, position = ring.call(token, start)
    q, held = int(position), ring.cache.slot_positions.tolist()
    assert q - int(start) <= k - 1  # at least two drafts rejected (the twin hardly ever makes its last token)
    lost = sorted(set(range(q - window + 1, q)) - set(held))
    ax.bar(range(len(held)), [1] * len(held), color=["lightgray" if p < 0 else "tab:blue" for p in held])
    for slot, p in enumerate(held):
        ax.text(slot, 0.5, str(p) if p >= 0 else "-", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([])
    ax.set_title(
        f"{len(held)} slots: the next query (position {q}) has lost {lost or 'nothing'}",
        fontsize=9,
        color="red" if lost else "black",
    )
    assert bool(lost) == (spare == 0)
fig.tight_layout()
extra = helpers.decode.cache_bytes(ring.cache) - helpers.decode.cache_bytes(
    helpers.ring.RingCache(model, MAX_LEN, ring.chunk_size)
)
print(f"the K = {k} spare slots cost {fmt_bytes(extra)} here, the sliding layers' K/V of {k} positions")

# %% [markdown]
# **What you should see:** on the ring of `window` slots, the next query has lost positions it
# needs (the tokens would silently change); with K spare slots it has lost nothing. The spare slots
# cost K positions of the sliding layers' K/V, next to nothing beside the full layers' buffer.
#
# Everything in this notebook past the twin (Google's assistant's acceptance on E2B, tok/s on a
# TPU) is a path the course's builders could not run: no TPU and no real weights where it is built.
#
# ## Results

# %%
print(
    results.table(
        ["step", "label", "backend", "decode_tok_s", "tokens_per_verify", "bytes_per_token", "same_tokens", "compiles"]
    )
)

# %% [markdown]
# ## Exercises
# Predict before you measure: write your number down, then open the solution under the question.

# %% [markdown]
# **1.** With an assistant that learned nothing (random weights, the same class), are the tokens
# still the target's? How many tokens does a verify make?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 1 (open it after you predicted)
# The same tokens: the target decides every one. About one per verify: a random draft is kept by chance.
from transformers import Gemma4AssistantForCausalLM

torch.manual_seed(0)
untrained = Gemma4AssistantForCausalLM(assistant.config).to(backend.device, assistant.dtype).eval()
if untrained.masked_embedding is not None:
    untrained.masked_embedding.token_ordering.copy_(torch.randperm(untrained.vocab_size))
decoder = DraftDecoder(model, untrained, backend, MAX_LEN, 3)
tokens = decoder.generate(ids, series.new_tokens)
print("same tokens:", series.same_tokens(tokens), "| tokens per verify:", decoder.tokens_per_verify())

# %% [markdown]
# **2.** On the twin, how many tokens does a verify make at K = 1, 2, 4 and 6? Where does it stop
# growing, and what would stop it growing with the real pair (3.21 tokens per verify, 2.21 of 4
# drafts kept: others' figure)?

# %% cellView="form" jupyter={"source_hidden": true} tags=["solution"]
# @title Solution 2 (open it after you predicted)
# Close to K+1 while the assistant knows the answer by heart; a real assistant's misses compound:
# draft i is kept only if drafts 1..i-1 were, so each extra draft adds less than the one before.
for k in (1, 2, 4, 6):
    decoder = DraftDecoder(model, assistant, backend, MAX_LEN, k)
    decoder.prefill_step, decoder.call_step = decoder.prefill_forward, decoder.verify_and_draft
    decoder.generate(ids, series.new_tokens, stop_ids=())  # run as written, uncompiled: a compile per K otherwise
    print(f"K = {k}: {decoder.tokens_per_verify():.2f} tokens per verify")
