"""Decode tokens/s on a CPU-sized Gemma 4 (same class, ~tens of millions of parameters, its
weights put on a 4-bit grid as QAT leaves them), every loop side by side in one run:
(a) HF generate as it comes, (b) HF's own recipe (static cache, forward compiled), and the
course's compiled decoders: (c) one step per call (notebook 04), (d) K steps per call, (e)
the same with its one-row matmuls as loops inductor writes (``Backend.use_matvec_loops``),
then with those loops (f) int4 codes a byte each and (g) packed int4 linears kept compressed and (h) q/k/v and gate/up
fused into one matmul each (notebook 07); and (b2), HF's recipe given the same loops, to show
what they buy alone. The timed runs are interleaved (every loop once per round), so a busy
moment of a shared machine hits them all alike.

    python benchmarks/decode.py [--tokens 64] [--rounds 3] [--k 4] [--profile]

Prints tok/s, ratios to (a), (b) and (b2), and the roofline: bytes one step reads (from the
tensors), GB/s, and % of this machine's read bandwidth (a plain read, same run).
--profile adds where (c)'s time goes (torch.profiler, top ops).
"""

import argparse
import copy
import statistics

import torch
from cpu_model import cpu_model

import helpers
from helpers import decode as d
from helpers import generate, roofline
from helpers.course import e2b, measure, offline, verdict
from helpers.course.measure import compiled_forward
from helpers.course.report import table
from helpers.fused import fuse_projections
from helpers.qlinear import QLinear
from helpers.timing import time_fn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tokens", type=int, default=64)
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--k", type=int, default=4, help="decode steps per compiled call for (d) to (h)")
parser.add_argument("--profile", action="store_true")
args = parser.parse_args()

backend = helpers.get_backend("cpu")
model = cpu_model()
with torch.no_grad():  # QAT's grid: the compressed linears then hold the same weights exactly
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.copy_(offline.on_grid(module.weight)[0])
print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32, on the CPU")
ids = torch.randint(3, 8192, (1, 48))
n, max_len = args.tokens, d.PREFILL_BUCKETS[2] + args.tokens + args.k


def hf(**kwargs):
    config = generate.greedy_config(model, n, stop=False)  # exactly n tokens: each run times the same count
    config.update(**kwargs)
    with torch.no_grad():
        return model.generate(ids, generation_config=config).sequences[0, ids.shape[1] :].tolist()


def compressed(fmt: str):
    copied = copy.deepcopy(model)
    for name, module in list(copied.model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            parent, _, child = name.rpartition(".")
            setattr(copied.model.get_submodule(parent), child, QLinear.from_linear(module, fmt))
    return copied


def fused_copy():
    copied = copy.deepcopy(model)
    fuse_projections(copied)
    return copied


loops_options = backend.use_matvec_loops() or {}


def hf_static(**compile_options):
    def run():
        with compiled_forward(model, **compile_options):
            return hf(cache_implementation="static")

    return run


k = args.k
decoders = {
    "(c) compiled step, K=1": d.Decoder(model, backend, max_len),
    f"(d) compiled, K={k}": roofline.KDecoder(model, backend, max_len, k),
    f"(e) matvec loops, K={k}": roofline.KDecoder(model, backend, max_len, k, **loops_options),
    f"(f) int4 codes a byte each, loops, K={k}": roofline.KDecoder(
        compressed("int4-bytes"), backend, max_len, k, **loops_options
    ),
    f"(g) int4 linears, loops, K={k}": roofline.KDecoder(compressed("int4"), backend, max_len, k, **loops_options),
    f"(h) fused q/k/v, gate/up, loops, K={k}": roofline.KDecoder(fused_copy(), backend, max_len, k, **loops_options),
}
loops = {  # HF's recipe: static cache, forward compiled
    "(a) HF generate, default": hf,
    "(b) HF static cache + compiled forward": hf_static(),
    "(b2) (b) + matvec loops": hf_static(**loops_options),
}
loops |= {name: (lambda dec=dec: dec.generate(ids, n, stop_ids=())) for name, dec in decoders.items()}

rows, expected = {}, hf()
for name, loop in loops.items():  # first calls: compile, count graphs, check tokens
    with backend.compile_counter() as count:
        first = time_fn(loop, sync=backend.sync, warmup=0, repeats=1)
    rows[name] = {
        "loop": name,
        "graphs": count.graphs,
        "first_call_s": first.median,
        "same_tokens": bool(verdict.compare_tokens(first.last, expected, model, ids)),  # two programs: the verdict
        "runs": [],
    }
for _ in range(args.rounds):  # interleaved: every loop once per round
    for name, loop in loops.items():
        rows[name]["runs"].append((n - 1) / time_fn(loop, sync=backend.sync, warmup=0, repeats=1).median)

bandwidth, how = measure.read_bandwidth(backend)
# HF's dynamic cache at the run's mean context (its sliding layers keep a window)
hf_bytes = roofline.step_bytes(model) + e2b.kv_cache_bytes(
    model.config, ids.shape[1] + n // 2, ring=True, dtype_bytes=4
)
for name, row in rows.items():
    row["tok_s"] = statistics.median(row.pop("runs"))
    step = roofline.step_bytes(decoders[name].model, decoders[name].cache) if name in decoders else hf_bytes
    row |= roofline.columns(step, row["tok_s"], bandwidth)
rows = list(rows.values())
for row in rows:
    row["vs_a"], row["vs_b"], row["vs_b2"] = (row["tok_s"] / rows[i]["tok_s"] for i in range(3))
print(
    table(
        rows,
        [
            "loop",
            "tok_s",
            "vs_a",
            "vs_b",
            "vs_b2",
            "GB_per_s",
            "pct_of_bw",
            "bytes_per_token",
            "graphs",
            "first_call_s",
            "same_tokens",
        ],
    )
)
print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({how}); median of {args.rounds} interleaved rounds of {n} tokens")

if args.profile:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decoders["(c) compiled step, K=1"].generate(ids, n, stop_ids=())
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
