"""Decode tokens/s on a CPU-sized Gemma 4 (same class, ~tens of millions of parameters):
(a) HF generate as it comes, (b) HF's own recipe (static cache, forward compiled), (c) the
course's compiled decode step (notebook 04), measured side by side in one run.

    python benchmarks/decode.py [--tokens 64] [--repeats 3] [--profile]

Prints tok/s and ratios; --profile adds where (c)'s time goes (torch.profiler, top ops).
"""

import argparse
import statistics
import time

import torch
from cpu_model import cpu_model

import helpers
from helpers import decode as d
from helpers import generate as g
from helpers.bench import table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--profile", action="store_true")
args = parser.parse_args()

backend = helpers.get_backend("cpu")
model = cpu_model()
print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32, on the CPU")
ids = torch.randint(3, 8192, (1, 48))
n = args.tokens


def tok_s(fn):
    fn()  # warm-up (and compile)
    runs = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        tokens = fn()
        runs.append((n - 1) / (time.perf_counter() - start))
    return statistics.median(runs), tokens


def hf(**kwargs):
    config = g.greedy_config(model, n, stop=False)  # exactly n tokens: each run times the same count
    config.update(**kwargs)
    with torch.no_grad():
        return model.generate(ids, generation_config=config).sequences[0, ids.shape[1]:].tolist()


rows = []
rate, expected = tok_s(hf)
rows.append({"loop": "(a) HF generate, default", "tok_s": rate})
eager_forward = model.forward
model.forward = torch.compile(model.forward)  # HF's recipe: static cache, forward compiled
with backend.compile_counter() as count:
    rate, tokens = tok_s(lambda: hf(cache_implementation="static"))
rows.append({"loop": "(b) HF generate, static cache + compiled forward", "tok_s": rate, "graphs": count.graphs,
             "same_tokens": tokens == expected})
model.forward = eager_forward
decoder = d.Decoder(model, backend, max_len=d.PREFILL_BUCKETS[2] + n)
with backend.compile_counter() as count:
    rate, tokens = tok_s(lambda: decoder.generate(ids, n, stop_ids=()))
rows.append({"loop": "(c) compiled decode step (ours)", "tok_s": rate, "graphs": count.graphs,
             "same_tokens": tokens == expected})
for row in rows:
    row["vs_a"] = row["tok_s"] / rows[0]["tok_s"]
    row["vs_b"] = row["tok_s"] / rows[1]["tok_s"]
print(table(rows, ["loop", "tok_s", "vs_a", "vs_b", "graphs", "same_tokens"]))

if args.profile:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decoder.generate(ids, n, stop_ids=())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
