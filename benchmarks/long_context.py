"""Long context on a CPU-sized Gemma 4 (same class, E2B's 512-token window): decode step time
and prefill time at contexts of 256, 2K and 8K tokens, HF's default cache against the ring
cache (notebook 06), eager and compiled, side by side in one run; cache bytes measured.

    python benchmarks/long_context.py [--contexts 256 2048 8192] [--steps 16]

Prints ms per decode step, prefill seconds, cache bytes and ratios to HF's default cache.
"""

import argparse

from cpu_model import cpu_model

import helpers
from helpers import ring
from helpers.course import measure
from helpers.course.report import fmt_bytes, table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
parser.add_argument("--steps", type=int, default=16)
args = parser.parse_args()

backend = helpers.get_backend("cpu")
model = cpu_model(sliding_window=512, max_position_embeddings=16384)  # E2B's window
config = model.config
print(
    f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32, window "
    f"{config.sliding_window}, on the CPU"
)


max_len = -(-(max(args.contexts) + args.steps + 1) // config.sliding_window) * config.sliding_window
decoder = ring.RingDecoder(model, backend, max_len=max_len)
print(f"ring cache: {max_len} positions for the full layers, one {config.sliding_window}-slot ring per sliding layer")
rows = measure.context_sweep(decoder, args.contexts, args.steps, hf_default=True, eager=True)
for r in rows:
    r["compiled vs HF"] = f"{r['HF ms/token'] / r['ring ms/token']:.2f}x"
    r["eager vs HF"] = f"{r['HF ms/token'] / r['ring eager ms/token']:.2f}x"
    r["prefill vs HF"] = f"{r['HF prefill s'] / r['ring prefill s']:.2f}x"
    for k in ("ring cache bytes", "HF cache bytes"):
        r[k] = fmt_bytes(r[k])
print(table(rows))
for what in ("ring ms/token", "ring eager ms/token", "HF ms/token"):
    print(
        f"{what} at {args.contexts[-1]} vs {args.contexts[0]} tokens of context: {rows[-1][what] / rows[0][what]:.2f}x"
    )
