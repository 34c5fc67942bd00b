"""Eager vs defer-and-fuse vs torch.compile on notebook 01's op stack, side by side.

    python benchmarks/modes.py [--backend xla] [--size 256] [--repeats 50]

Prints one row per mode with the ratio to eager, all measured in this one run (the
machines are shared and noisy: compare ratios, not wall times across runs).
"""

import argparse

import helpers
from helpers.course.report import table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--backend", help="tpu, xla, cuda or cpu (default: detected)")
parser.add_argument("--size", type=int, default=256, help="the op stack's input is size x size")
parser.add_argument("--repeats", type=int, default=50)
args = parser.parse_args()

backend = helpers.get_backend(args.backend)
print(helpers.course.hub.describe(backend))
rows = helpers.compare_modes(backend, size=args.size, warmup=5, repeats=args.repeats)
print(table(rows, ["mode", "median_ms", "min_ms", "max_ms", "speedup_vs_eager", "executions_per_call"]))
print(f"source (TPU v5e-1): compile >{helpers.course.sources.COMPILE_SPEEDUP}x faster than eager")
