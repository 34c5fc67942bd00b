"""One decode matmul, two kernels: the BLAS matrix-vector product (MKL on a CPU) against the
loop inductor writes for it with its decompose_mm_pass (``Backend.use_matvec_loops``), for
every weight shape of the benchmarks' CPU model, float32 and as int4 codes a byte each with bf16 group
scales dequantized inside the compiled call. Each shape is timed over enough copies of its
weight to overflow the caches, both kernels interleaved round by round.

    python benchmarks/matvec.py [--rounds 5] [--megabytes 256]

Prints GB/s of weight bytes read (as stored) for each kernel, and the machine's read probe.
"""

import argparse
import statistics

import torch
from cpu_model import cpu_model

import helpers
from helpers.course import measure
from helpers.course.report import table
from helpers.int4 import GROUP_SIZE, dequantize
from helpers.timing import time_fn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--megabytes", type=int, default=256, help="float32 bytes of copies per shape")
args = parser.parse_args()

backend = helpers.get_backend("cpu")
model = cpu_model()
shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})  # the head too
loops = backend.use_matvec_loops() or {}


def dense(x, weight):
    return torch.nn.functional.linear(x, weight)


def codes_a_byte_each(x, codes, scales):
    return torch.nn.functional.linear(x, dequantize(codes, scales, x.dtype))


kernels = {  # name: (function, the weight's tensors from a float32 weight)
    "float32": (dense, lambda w: (w,)),
    "int4 bytes": (
        codes_a_byte_each,
        lambda w: (w.to(torch.int8), torch.rand(w.shape[0], w.shape[1] // GROUP_SIZE).bfloat16()),
    ),
}
rows = []
for out_features, in_features in shapes:
    copies = max(1, args.megabytes * 2**20 // (4 * out_features * in_features))
    weights = [torch.randint(-8, 8, (out_features, in_features)).float() for _ in range(copies)]
    x = torch.randn(1, 1, in_features)
    for kind, (fn, held) in kernels.items():
        torch.compiler.reset()  # each shape its own compilations, not recompiles of the last one's
        stored = [held(w) for w in weights]
        # both keep eager's casts: without, inductor drops the dequantization's rounding to bf16
        compiled = {
            "BLAS": backend.compile(fn, options={"emulate_precision_casts": True}),
            "loop": backend.compile(fn, **loops),
        }

        # compile, and eager's values up to summation order: float32's bound for a sum of n products,
        # n * eps * sum |x w| (the dequantized weights are whole codes times scales of at most 1)
        bound = in_features * torch.finfo(torch.float32).eps * float((x.abs() @ weights[0].abs().T).max())
        for name, f in compiled.items():
            largest = float((f(x, *stored[0]) - fn(x, *stored[0])).abs().max())
            print(
                f"{kind}, {name}, {out_features}x{in_features}: largest difference from eager {largest:.3g} (bound {bound:.3g})"
            )
            assert largest <= bound, (kind, name, largest, bound)
        runs = {name: [] for name in compiled}
        for _ in range(args.rounds):
            for name, f in compiled.items():
                calls = [(f, (x, *tensors)) for tensors in stored]  # one per copy of the weight
                timing = time_fn(lambda calls=calls: [f(*a) for f, a in calls], sync=backend.sync, warmup=0, repeats=1)
                runs[name].append(timing.median)
        read = sum(t.numel() * t.element_size() for t in stored[0]) * copies
        gbs = {name: read / statistics.median(times) / 1e9 for name, times in runs.items()}
        rows.append(
            {
                "weight": f"{out_features}x{in_features}",
                "kind": kind,
                "BLAS_GB_s": gbs["BLAS"],
                "loop_GB_s": gbs["loop"],
                "loop_vs_BLAS": gbs["loop"] / gbs["BLAS"],
            }
        )
print(table(rows))
bandwidth, how = measure.read_bandwidth(backend)
print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({how}); median of {args.rounds} interleaved rounds")
