"""Draft and verify at E2B's size, on the synthetic pair (the synthetic checkpoint and a random assistant at E2B's
widths, bf16, CPU), run as written (eager: a compile per shape at this size is minutes on 2 cores): one decode step,
a verify of K+1 = 2..7 tokens and a draft of K = 4, interleaved over rounds, and the tok/s they imply at others'
acceptance (3.21 tokens per verify at K = 4, vLLM TPU with Google's assistant, xbill9/gemma4-dev).

    python benchmarks/draft_full_size.py [--rounds 3] [--context 64]
"""

import argparse
import os
import statistics
import time

import torch

os.environ.setdefault("HELPERS_MODEL", "e2b-synthetic")

import helpers  # noqa: E402
from helpers import checkpoint, decode, draft  # noqa: E402
from helpers.course import hub  # noqa: E402
from helpers.course.tables import table  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--context", type=int, default=64, help="prompt positions in the cache before each call")
args = parser.parse_args()
ACCEPTED, K = 3.21, 4  # others' figure: tokens per verify at 4 drafts

backend = helpers.get_backend("cpu")
source = hub.choose_checkpoint(backend)
print(source)
model, load_s = checkpoint.load(source.path, backend, dtype=torch.bfloat16, dequantize=True)
decode.strip_compressed_wrappers(model)
assistant = draft.load_assistant(hub.choose_assistant(source), backend, torch.bfloat16)
print(f"loaded in {load_s:.0f} s; assistant {sum(p.numel() for p in assistant.parameters()) / 1e6:.0f} M parameters")
decoder = draft.DraftDecoder(model, assistant, backend, 256, K)
decoder.prefill_step = decoder._prefill  # as written: no compile
ids = torch.randint(3, 1000, (1, args.context), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    token, position = decoder.prefill(ids)
    hidden = decoder.hidden


def timed(fn) -> float:
    start = time.perf_counter()
    with torch.no_grad():
        fn()
    return time.perf_counter() - start


def step():
    decode.set_length(decoder.cache, args.context)
    decoder.step(token, position)


def verify(k):
    decode.set_length(decoder.cache, args.context)
    decoder.verify(token, torch.full((1, k), 5), position)


def drafts():
    decoder.draft(token, hidden, position)


calls = {"one step": step, **{f"verify K+1={k + 1}": (lambda k=k: verify(k)) for k in range(1, 7)}, "draft K=4": drafts}
times = {name: [] for name in calls}
for fn in calls.values():  # once each before timing: first-call costs out of the rounds
    fn()
for _ in range(args.rounds):
    for name, fn in calls.items():
        times[name].append(timed(fn))
step_s = statistics.median(times["one step"])
rows = [
    {
        "call": n,
        "median s": statistics.median(t),
        "spread": max(t) / min(t),
        "x one step": statistics.median(t) / step_s,
    }
    for n, t in times.items()
]
print(table(rows))
verify_s = statistics.median(times["verify K+1=5"]) + statistics.median(times["draft K=4"])
print(
    f"at {ACCEPTED} tokens per verify (K = 4, others' figure): {ACCEPTED / verify_s:.2f} tok/s against one step's "
    f"{1 / step_s:.2f}: {ACCEPTED * step_s / verify_s:.2f}x (eager bf16 on this CPU; not HF's compiled recipe)"
)
