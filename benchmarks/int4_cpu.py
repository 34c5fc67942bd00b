"""Why notebook 07's int4 linears are fast on a CPU only through torch's kernel: one decode matmul at E2B's widest
linear shapes, its weight read as bf16 (MKL, and the loops inductor writes: ``Backend.use_matvec_loops``); as
``QLinear``'s packed int4 codes dequantized inside the compiled step (the form a backend with no kernel takes); and
as ``QLinear`` through torch's own CPU int4 kernel (``aten._weight_int4pack_mm_for_cpu``, the one torchao and gpt-fast
call), repacked once, which multiplies code x scale before rounding, so its output is within bf16's tolerance of the
matmul on the checkpoint's values.

    python benchmarks/int4_cpu.py [--rounds 5] [--copies 24]

Prints, per shape and way: milliseconds per matmul and GB/s of the weight's bytes as stored
(median of interleaved rounds, over enough copies of the weight to overflow the caches), the
spread, the output's largest difference from the exact bf16 matmul, and the read probe.
"""

import argparse
import statistics

import torch

import helpers
from helpers.course import e2b, measure
from helpers.course.report import table
from helpers.packed import GROUP_SIZE
from helpers.qlinear import QLinear
from helpers.timing import time_fn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--copies", type=int, default=24, help="weights per shape, read in turn (caches overflow)")
args = parser.parse_args()

backend = helpers.get_backend("cpu")
loops = backend.use_matvec_loops()
config = e2b.real_config().get_text_config()
widest = 2 * config.intermediate_size  # the double-wide MLP's (E2B's KV-sharing layers)
shapes = [(widest, config.hidden_size), (config.hidden_size, widest)]  # gate or up, and down


def bf16(x, weight):
    return torch.nn.functional.linear(x, weight)


def int4(x, qlinear):
    return qlinear(x)


rows = []
for out_features, in_features in shapes:
    torch.manual_seed(0)
    codes = [torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8) for _ in range(args.copies)]
    scales = [(torch.rand(out_features, in_features // GROUP_SIZE) / 64).bfloat16() for _ in codes]
    qlinears = [QLinear.of(c, s, torch.bfloat16, "int4") for c, s in zip(codes, scales)]
    kernels = [QLinear.of(c, s, torch.bfloat16, "int4", "cpu") for c, s in zip(codes, scales)]
    x = torch.randn(1, 1, in_features).bfloat16()
    ways = {  # name: (function, its arguments per copy)
        "bf16, MKL": (backend.compile(bf16), [(x, q.weight) for q in qlinears]),
        "bf16, loops": (backend.compile(bf16, **loops), [(x, q.weight) for q in qlinears]),
        "int4 dequantized in the step, loops": (backend.compile(int4, **loops), [(x, q) for q in qlinears]),
        "int4, torch's CPU kernel (QLinear)": (backend.compile(int4, **loops), [(x, q) for q in kernels]),
    }
    exact = bf16(x, qlinears[0].weight).float().flatten()
    diffs = {name: (fn(*calls[0]).float().flatten() - exact).abs().max().item() for name, (fn, calls) in ways.items()}
    runs = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, (fn, calls) in ways.items():
            timing = time_fn(lambda fn=fn, calls=calls: [fn(*a) for a in calls], sync=backend.sync, warmup=0, repeats=1)
            runs[name].append(timing.median / len(calls))
    for name, (_, calls) in ways.items():
        module = calls[0][1]
        held = (module.codes, module.scales) if isinstance(module, QLinear) else calls[0][1:2]
        stored = sum(t.numel() * t.element_size() for t in held)
        seconds = statistics.median(runs[name])
        rows.append(
            {
                "weight": f"{out_features}x{in_features}",
                "way": name,
                "ms": seconds * 1e3,
                "spread": max(runs[name]) / min(runs[name]),
                "GB_s_of_bytes_stored": stored / seconds / 1e9,
                "max_diff_vs_exact": diffs[name],
                "exact_output_max": exact.abs().max().item(),
            }
        )
print(table(rows))
bandwidth, how = measure.read_bandwidth(backend)
print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({how}); median of {args.rounds} interleaved rounds")
