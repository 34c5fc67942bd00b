"""Draft and verify on the twin (CPU), every loop side by side in one run: the course's one-token loops (notebook 04's
Decoder, 06's RingDecoder, 07's KDecoder at 4 tokens per call), HF's assisted generate, and notebook 09's DraftDecoder
for K = 1..6. The timed runs are interleaved (every loop once per round), so a busy moment hits them all alike.

    python benchmarks/draft.py [--tokens 96] [--rounds 3] [--ks 1 2 3 4 5 6]

Prints tok/s (median, and the spread: fastest over slowest run), tokens per verify, the share of verifies that kept
each draft position, and the ratio of each K to the best one-token loop and to HF's assisted generate. The twin's
assistant learned the twin's few answers by heart: its acceptance is far above the real pair's (3.21 tokens per verify at K = 4, vLLM TPU).
"""

import argparse
import statistics

import torch

import helpers
from helpers import decode, draft, generate, ring, roofline
from helpers.course import hub, series
from helpers.course.report import table
from helpers.timing import time_fn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tokens", type=int, default=96)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
args = parser.parse_args()

backend = helpers.get_backend("cpu")
setup = series.prepare(backend, after=6)
model, ids, n = setup.model, setup.ids, args.tokens
assistant = draft.load_assistant(hub.choose_assistant(setup.checkpoint), backend, torch.float32)
max_len = 256

loops = {
    "04 Decoder": decode.Decoder(model, backend, max_len),
    "06 RingDecoder": ring.RingDecoder(model, backend, max_len),
    "07 KDecoder, 4 per call": roofline.KDecoder(model, backend, max_len, 4),
    **{f"09 DraftDecoder, K={k}": draft.DraftDecoder(model, assistant, backend, max_len, k) for k in args.ks},
}
config = generate.greedy_config(model, n, stop=False)
assistant.generation_config.num_assistant_tokens = 4


def hf_assisted():
    return model.generate(ids, generation_config=config, assistant_model=assistant).sequences[0, ids.shape[1] :]


runs = {name: [] for name in [*loops, "HF assisted generate, K=4"]}
for loop in loops.values():  # compiled before timing
    loop.generate(ids, n, stop_ids=())
for _ in range(args.rounds):
    for name, loop in loops.items():
        timed = time_fn(loop.generate, ids, n, stop_ids=(), sync=backend.sync, warmup=0, repeats=1)
        runs[name].append(n / timed.median)
    runs["HF assisted generate, K=4"].append(n / time_fn(hf_assisted, sync=backend.sync, warmup=0, repeats=1).median)

best_one = max((statistics.median(runs[name]), name) for name in loops if not name.startswith("09"))
hf_rate = statistics.median(runs["HF assisted generate, K=4"])
rows = []
for name, rates in runs.items():
    loop = loops.get(name)
    row = {"loop": name, "tok/s": statistics.median(rates), "spread": max(rates) / min(rates)}
    if isinstance(loop, draft.Drafted):
        row["tokens/verify"] = loop.tokens_per_verify()
        row["kept at 1..K"] = " ".join(f"{share:.2f}" for share in loop.kept_at())
    row["x best one-token"] = row["tok/s"] / best_one[0]
    row["x HF assisted"] = row["tok/s"] / hf_rate
    rows.append(row)
print(f"{n} tokens per run, {args.rounds} interleaved rounds; the best one-token loop: {best_one[1]}")
print(table(rows))
best = max((r for r in rows if r["loop"].startswith("09")), key=lambda r: r["tok/s"])
print(f"best K: {best['loop']}, {best['x best one-token']:.2f}x the best one-token loop (target: >= 1.5x)")
