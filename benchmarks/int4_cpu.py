"""Why notebook 07's int4 linears are slower than bf16 on a CPU, and what would make them faster:
one decode matmul at E2B's widest linear shapes, its weight read as bf16 (MKL, and the loops
inductor writes: ``Backend.use_matvec_loops``); as ``QLinear``'s packed int4 codes multiplied
inside the compiled step (exact: the checkpoint's bf16 values), plane by plane as ``QLinear``
does for one row (``int4.packed_linear``), or unpacked into the weight's columns first, as it
does for a prefill's rows; and through torch's own CPU int4 kernel
(``aten._weight_int4pack_mm_for_cpu``, the one torchao and gpt-fast call on a CPU), which
multiplies codes by scales without rounding the products to bf16, so its weights are within half a
bf16 step of the checkpoint's, not equal to them.

    python benchmarks/int4_cpu.py [--rounds 5] [--copies 24]

Prints, per shape and way: milliseconds per matmul and GB/s of the weight's bytes as stored
(median of interleaved rounds, over enough copies of the weight to overflow the caches), the
spread, the output's largest difference from the exact bf16 matmul, and the read probe.
"""

import argparse
import statistics

import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

import helpers
from helpers.course import (
    e2b,
    measure,
)
from helpers.course.tables import table
from helpers.course.timing import time_fn
from helpers.packed import GROUP_SIZE
from helpers.qlinear import QLinear

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--copies", type=int, default=24, help="weights per shape, read in turn (caches overflow)")
args = parser.parse_args()

backend = helpers.get_backend("cpu")
loops = backend.use_matvec_loops()
config = e2b.real_config().get_text_config()
widest = 2 * config.intermediate_size  # the double-wide MLP's (E2B's KV-sharing layers)
shapes = [(widest, config.hidden_size), (config.hidden_size, widest)]  # gate or up, and down


def int4_kernel_tensors(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes -8..7 [out, in] and bf16 scales [out, in / 32] in the kernel's layout: unsigned
    codes (code + 8, its zero point) packed by torch, and [in / 32, out, 2] scales and zeros."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32) + 8, 1)
    scales_and_zeros = torch.stack([scales.t(), torch.zeros_like(scales.t())], dim=-1).contiguous()
    return packed, scales_and_zeros


def bf16(x, weight):
    return torch.nn.functional.linear(x, weight)


def int4(x, qlinear):
    return qlinear(x)


def int4_columns(x, qlinear):
    return torch.nn.functional.linear(x, qlinear.weight)


def kernel(x, packed, scales_and_zeros):
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x.view(1, -1), packed, GROUP_SIZE, scales_and_zeros)


rows = []
for out_features, in_features in shapes:
    torch.manual_seed(0)
    codes = [torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8) for _ in range(args.copies)]
    scales = [(torch.rand(out_features, in_features // GROUP_SIZE) / 64).bfloat16() for _ in codes]
    qlinears = [QLinear(pack_to_int32(c, 4), s, torch.bfloat16, "int4") for c, s in zip(codes, scales)]
    x = torch.randn(1, 1, in_features).bfloat16()
    ways = {  # name: (function, its arguments per copy)
        "bf16, MKL": (backend.compile(bf16), [(x, q.weight) for q in qlinears]),
        "bf16, loops": (backend.compile(bf16, **loops), [(x, q.weight) for q in qlinears]),
        "int4 QLinear, loops": (backend.compile(int4, **loops), [(x, q) for q in qlinears]),
        "int4 unpacked to columns, loops": (backend.compile(int4_columns, **loops), [(x, q) for q in qlinears]),
        "int4, torch's CPU kernel": (kernel, [(x, *int4_kernel_tensors(c, s)) for c, s in zip(codes, scales)]),
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
        held = (module.codes, module.scales) if isinstance(module, QLinear) else calls[0][1:]
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
