"""Draft and verify at E2B's size, on the synthetic pair (the synthetic checkpoint and a random assistant at E2B's
widths, bf16; this CPU unless told): one decode step, a verify of K+1 = 2..7 tokens and a draft of K = 4, interleaved over rounds, and
the tok/s they imply at others' acceptance (3.21 tokens per verify at K = 4, vLLM TPU with Google's assistant,
xbill9/gemma4-dev). Eager by default; ``--compiled`` compiles each call as notebooks 04 and 09 do (one graph per
shape: minutes each on 2 cores) and times HF's ``generate`` with its static cache and compiled forward in the same
run, the target's yardstick, with the same-token verdict of the draft decoder's own tokens against HF's. Both print
why a verify costs what it does here: one of E2B's linears at 1..7 rows. ``--int4``: the target's linears kept as the
checkpoint's int4 codes through torch's int4 kernel where the backend has one (notebook 07's ``QLinear``) for the draft
decoder's calls, HF's recipe keeping its bf16 linears (swapped back for its second timing); the assistant stays bf16,
its weights being on no 4-bit grid.

    python benchmarks/draft_full_size.py [--backend cpu|cuda|tpu] [--rounds 3] [--context 64] [--compiled] [--int4]
        [--tokens 16] [--verify 2 3 4 5 6 7]
"""

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HELPERS_MODEL", "e2b-synthetic")

import helpers
from helpers import checkpoint, decode, draft, qlinear
from helpers.course import hub, measure, verdict
from helpers.course.report import table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--backend", help="cpu, cuda or tpu (default: detected, or $HELPERS_BACKEND)")
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--context", type=int, default=64, help="prompt positions in the cache before each call")
parser.add_argument("--compiled", action="store_true", help="compile each call; time HF's compiled recipe beside")
parser.add_argument("--tokens", type=int, default=16, help="--compiled: tokens per run of HF's generate")
parser.add_argument("--int4", action="store_true", help="the target's linears through the backend's int4 kernel")
parser.add_argument(
    "--verify", type=int, nargs="*", default=[2, 3, 4, 5, 6, 7], help="verify sizes K+1 to time (each is a compile)"
)
args = parser.parse_args()
ACCEPTED, K = 3.21, 4  # others' figure: tokens per verify at 4 drafts

backend = helpers.get_backend(args.backend)
print(hub.describe(backend))
source = hub.choose_checkpoint(backend)
print(source)
model, load_s = checkpoint.load(source.path, backend, dtype=torch.bfloat16, dequantize=True)
decode.strip_compressed_wrappers(model)
assistant = draft.load_assistant(hub.choose_assistant(source), backend, torch.bfloat16)
print(f"loaded in {load_s:.0f} s; assistant {sum(p.numel() for p in assistant.parameters()) / 1e6:.0f} M parameters")


def timed(fn) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    backend.sync()
    return time.perf_counter() - start


# why a verify costs what it does on this machine: one linear of the target at 1..7 rows, as torch runs it eagerly
weight = next(m.weight for n, m in model.named_modules() if n.endswith("mlp.gate_proj"))
rows = []
forms = {"bf16": lambda x: torch.nn.functional.linear(x, weight)}
if args.int4:
    grid = torch.randint(-8, 8, weight.shape, dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scales = torch.full((weight.shape[0], weight.shape[1] // 32), 0.01, dtype=weight.dtype)
    forms["int4 " + str(backend.int4_kernel)] = qlinear.QLinear.of(
        grid, scales, weight.dtype, "int4", backend.int4_kernel
    )
for form, linear in forms.items():
    for m in range(1, 8):
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
        times = [timed(lambda x=x, linear=linear: linear(x)) for _ in range(20)]
        rows.append(
            {"form": form, "rows": m, "median ms": 1e3 * statistics.median(times), "spread": max(times) / min(times)}
        )
for row in rows:
    row["x one bf16 row"] = row["median ms"] / rows[0]["median ms"]
print(f"one linear of the target, {tuple(weight.shape)} {weight.dtype}, eager, at 1..7 rows (20 calls each):")
print(table(rows))

hf_rates, hf_tokens = [], None


def hf_recipe(when: str) -> None:
    """HF's generate on the same weights, its forward compiled, its static cache: timed before the draft decoder's
    calls and again after them (its graphs kept), so both sides see the same machine."""
    global hf_tokens
    start = time.perf_counter()
    with measure.compiled_forward(model), backend.compile_counter() as count:
        hf = measure.measure(model, tokenizer, prompt, backend, args.tokens, cache_implementation="static")
    hf_rates.extend(hf["rates"])
    hf_tokens = hf["tokens"]
    print(
        f"HF generate, static cache + compiled forward, {when}: {hf['decode_tok_s']:.2f} tok/s (spread "
        f"{hf['tok_s_spread']:.2f}, {count.graphs} graphs compiled, {time.perf_counter() - start:.0f} s)"
    )


if args.compiled:
    tokenizer = checkpoint.load_tokenizer(source.path)
    prompt = checkpoint.chat_ids(tokenizer, backend.device)
    hf_recipe("before")

dense_linears = {n: m for n, m in model.model.named_modules() if isinstance(m, torch.nn.Linear)}
if args.int4:
    print("the target's linears:", qlinear.keep_linears_compressed(model, source.path, "int4", backend.int4_kernel))
decoder = draft.DraftDecoder(model, assistant, backend, 256, K)
decoder.prefill_step = decoder.prefill_forward  # the prefill is not timed: not compiled
parts = (decoder.step, decoder.verify, decoder.draft, decoder.verify_and_draft)  # a call's parts, and the call
compile_ = (lambda fn: backend.compile(fn, fullgraph=True)) if args.compiled else (lambda fn: fn)
step_fn, verify_fn, draft_fn, call_fn = (decoder.decode_step, *map(compile_, parts[1:])) if args.compiled else parts
vocab = model.config.get_text_config().vocab_size
ids = torch.randint(3, min(1000, vocab), (1, args.context), generator=torch.Generator().manual_seed(0))
ids = ids.to(backend.device)
with torch.no_grad():
    token, position = decoder.prefill(ids)
    hidden = model.model.embed_tokens(token)  # a hidden state's shape and dtype: a draft's time is not its values'


def step():
    decode.set_length(decoder.cache, args.context)
    step_fn(token, position)


def verify(k):
    decode.set_length(decoder.cache, args.context)
    verify_fn(token, torch.full((1, k), 5, device=backend.device), position)


def drafts():
    draft_fn(token, hidden, position)


def call():
    decode.set_length(decoder.cache, args.context)
    call_fn(token, position, torch.full((1, K), 5, device=backend.device))


sizes = sorted({*args.verify, K + 1})  # K+1 = 5 always: the parts of a call
calls = {
    "one step": step,
    **{f"verify K+1={n}": (lambda k=n - 1: verify(k)) for n in sizes},
    "draft K=4": drafts,
    "call K=4 (verify, then draft)": call,
}
times = {name: [] for name in calls}
first = {name: timed(fn) for name, fn in calls.items()}  # once each before timing: compiles out of the rounds
for _ in range(args.rounds):
    for name, fn in calls.items():
        times[name].append(timed(fn))
step_s = statistics.median(times["one step"])
rows = [
    {
        "call": n,
        "first call s": first[n],
        "median s": statistics.median(t),
        "spread": max(t) / min(t),
        "x one step": statistics.median(t) / step_s,
    }
    for n, t in times.items()
]
print(table(rows))
call_s = statistics.median(times["call K=4 (verify, then draft)"])
parts_s = statistics.median(times["verify K+1=5"]) + statistics.median(times["draft K=4"])
print(f"a call, one program: {call_s / step_s:.2f} steps; its verify and draft as two: {parts_s / step_s:.2f}")
implied = ACCEPTED / call_s
how = "compiled" if args.compiled else "eager"
print(
    f"at {ACCEPTED} tokens per verify (K = 4, others' figure): {implied:.2f} tok/s against one step's "
    f"{1 / step_s:.2f}: {implied * step_s:.2f}x ({how}, {'int4 linears' if args.int4 else 'bf16'}, {backend.name})"
)
if args.compiled:
    int4_linears = {n: model.model.get_submodule(n) for n in dense_linears}
    for name, linear in dense_linears.items():  # HF's recipe on its own bf16 linears again
        parent, _, child = name.rpartition(".")
        setattr(model.model.get_submodule(parent) if parent else model.model, child, linear)
    hf_recipe("after")
    for name, linear in int4_linears.items():  # the draft decoder's linears back for its tokens
        parent, _, child = name.rpartition(".")
        setattr(model.model.get_submodule(parent) if parent else model.model, child, linear)
    hf_tok_s = statistics.median(hf_rates)
    print(f"against HF's static cache + compiled forward ({hf_tok_s:.2f} tok/s, the median of both): ", end="")
    print(f"{implied / hf_tok_s:.2f}x (target >= 2x); one compiled step: {1 / step_s / hf_tok_s:.2f}x")
    with torch.no_grad():  # the draft decoder's own tokens (random drafts: nearly all rejected) against HF's
        tokens = measure.until_stop(decoder.generate(prompt, args.tokens, stop_ids=()), measure.stop_ids(model))
    print("same tokens as HF's:", verdict.compare_tokens(tokens, hf_tokens, model, prompt))
