"""Grid recovery at E2B's scale: ``int4.recover_grid`` on one block of the per-layer table's
shape (``int4.ROWS_PER_BLOCK`` rows of 8,960 values, as ``QTable.from_embedding`` walks the
table), built as Google's tables are, bf16(level x float32 step), timed over several repeats;
then the time for E2B's two tables, projected from their real shapes (meta device).

    python benchmarks/grid.py [--repeats 5]

Prints seconds per block (median, and the spread: fastest over slowest) and the projection.
Run it with nothing else on the machine: on 2 cores a busy neighbour makes it 2-10x slower.
"""

import argparse

import torch

from helpers import qtable
from helpers.course import e2b
from helpers.timing import time_fn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--repeats", type=int, default=5)
args = parser.parse_args()

inner = e2b.meta_model(e2b.real_config()).model
rows, cols = inner.embed_tokens_per_layer.weight.shape
block_rows = qtable.ROWS_PER_BLOCK
generator = torch.Generator().manual_seed(0)
levels = torch.randint(-8, 8, (block_rows, cols), generator=generator).float()
steps = torch.rand(block_rows, cols // 32, generator=generator) * 0.01 + 1e-4
block = (levels * steps.repeat_interleave(32, dim=1)).to(torch.bfloat16)

codes, found_steps, found = qtable.recover_grid(block)
assert found.all() and torch.equal(qtable.dequantize(codes, found_steps, torch.bfloat16), block)
timing = time_fn(qtable.recover_grid, block, sync=lambda: None, warmup=1, repeats=args.repeats)  # host work: no device
per_value = timing.median / block.numel()
tables = {"embed_tokens_per_layer": rows * cols, "embed_tokens": inner.embed_tokens.weight.numel()}
print(
    f"one block of {block_rows:,} x {cols:,} values: {timing.median:.2f} s median of {args.repeats}, "
    f"spread {max(timing.times) / min(timing.times):.2f}x; every group recovered bit for bit"
)
for name, numel in tables.items():
    print(f"{name}: {numel:,} values, projected {numel * per_value / 60:.1f} min")
print(f"both tables: {sum(tables.values()) * per_value / 60:.1f} min on this machine")
