"""Length buckets at full size: decode tok/s against context on notebook 06's ring for the
source's 131,328 positions, one buffer (a static shape: every step reads the whole buffer)
against a few compiled buffer lengths (``RingDecoder(buckets=...)``: a step reads the smallest
bucket that holds its context), side by side in one run, on the synthetic E2B
(``helpers.course.offline``: the real shapes, random weights) as notebook 06 leaves it (4-bit
per-layer table, grouped attention, bf16).

    python benchmarks/buckets.py [--contexts 2048 16384 131000] [--buckets 8192 32768] [--steps 8]

At each context, one chunk is prefilled just below it (the positions before it hold zeros: a
step's time depends on the buffer it reads, not on what the buffer holds) and ``--steps``
decode calls are timed, each fed its own token. Prints tok/s, the bytes of cache a step reads
(``decode.cache_read_bytes``), the bucket, the programs each decoder compiled (one chunk and one
step per bucket it used), and the prediction t = t0 + extra bytes / bandwidth from the one
buffer's smallest context; saves ``buckets.png`` in the run folder.
"""

import argparse
import os
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

import helpers
from helpers import decode, roofline
from helpers.course import e2b, measure
from helpers.course.offline import SYNTHETIC
from helpers.course.report import fmt_bytes, run_dir, table
from helpers.course.series import load_for_series
from helpers.qtable import keep_table_in_4bit
from helpers.ring import RingDecoder, group_query_heads
from helpers.timing import time_fed

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--contexts", type=int, nargs="+", default=[2_048, 16_384, 131_000])
parser.add_argument("--buckets", type=int, nargs="+", default=[8_192, 32_768])
parser.add_argument("--steps", type=int, default=8, help="decode calls timed at each context")
parser.add_argument("--backend", help="cpu or cuda (default: detected)")
parser.add_argument("--run-dir", default="runs/buckets")
args = parser.parse_args()

os.environ.setdefault("HELPERS_MODEL", SYNTHETIC)
backend = helpers.get_backend(args.backend)
print(helpers.course.hub.describe(backend))
checkpoint, model, tokenizer, ids = load_for_series(backend)
print(checkpoint)
max_len = e2b.CONTEXT if not checkpoint.tiny else e2b.CONTEXT // 64
if max(args.contexts) > max_len:
    parser.error(f"contexts {args.contexts} must fit the ring's {max_len:,} positions")
with torch.no_grad():
    model(ids)  # the first forward decompresses the weights
decode.strip_compressed_wrappers(model)
keep_table_in_4bit(model, checkpoint.path)
group_query_heads(model)
bandwidth, how = measure.read_bandwidth(backend)
print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s ({how})")
weights = roofline.step_bytes(model)
vocab = model.config.get_text_config().vocab_size


@torch.no_grad()  # as generate runs it: with grad on, another compile and a cache that requires grad
def sweep(buckets: tuple) -> tuple[dict, int]:
    """tok/s, spread, bytes read, bucket and first-call seconds at each context; programs compiled."""
    ring = RingDecoder(model, backend, max_len=max_len, buckets=buckets)
    chunk = torch.randint(3, vocab, (1, ring.chunk_size), generator=torch.Generator().manual_seed(0))
    chunk, found = chunk.to(backend.device), {}
    torch.compiler.reset()
    with backend.compile_counter() as count:
        for context in args.contexts:
            start = time.perf_counter()
            ring.call(*ring.prefill(chunk, start=context - ring.chunk_size))  # the bucket's chunk and step compiled
            first_s = time.perf_counter() - start
            prefilled = ring.prefill(chunk, start=context - ring.chunk_size)
            timed = time_fed(lambda t, p: ring.call(t, p)[1:], prefilled, sync=backend.sync, repeats=args.steps)
            found[context] = {
                "tok_s": 1 / timed.median,
                "spread": timed.max / timed.min,
                "read": decode.cache_read_bytes(model, ring.cache),
                "bucket": ring.cache.max_len,
                "first_s": first_s,
            }
    print(f"buckets {ring.buckets}: {count.graphs} programs compiled")
    return found, count.graphs


rows, compiled = {}, {}
for name, buckets in (("one buffer", ()), ("buckets", tuple(args.buckets))):
    found, compiled[name] = sweep(buckets)
    for context, row in found.items():
        rows.setdefault(context, {})[name] = row
    torch.compiler.reset()

base = rows[args.contexts[0]]["one buffer"]
t0 = 1 / base["tok_s"] - (weights + base["read"]) / bandwidth  # what a step costs besides its reads
shown = []
for context, row in rows.items():
    one, bucketed = row["one buffer"], row["buckets"]
    shown.append(
        {
            "context": f"{context:,}",
            "one buffer tok/s": round(one["tok_s"], 2),
            "spread": round(one["spread"], 2),
            "reads": fmt_bytes(one["read"]),
            "buckets tok/s": round(bucketed["tok_s"], 2),
            "spread ": round(bucketed["spread"], 2),
            "bucket": f"{bucketed['bucket']:,}",
            "reads ": fmt_bytes(bucketed["read"]),
            "predicted": round(1 / (t0 + (weights + bucketed["read"]) / bandwidth), 2),
            "buckets / one": f"{bucketed['tok_s'] / one['tok_s']:.2f}x",
            "first call s": f"{one['first_s']:.0f} / {bucketed['first_s']:.0f}",
        }
    )
print(table(shown))
print(
    f"programs compiled: one buffer {compiled['one buffer']}, buckets {compiled['buckets']} "
    f"(a chunk and a step per bucket used); weights read per step {fmt_bytes(weights)}; "
    f"predicted: the one buffer's step at {args.contexts[0]:,} plus the bucket's cache bytes over {bandwidth / 1e9:.1f} GB/s"
)
folder = run_dir(args.run_dir)
fig, ax = plt.subplots(figsize=(6, 3.5))
for name in ("one buffer", "buckets"):
    ax.plot(list(rows), [rows[c][name]["tok_s"] for c in rows], "o-", label=name)
ax.set(xscale="log", xlabel="context (positions)", ylabel="decode tok/s (median)", ylim=(0, None))
ax.set_title(f"{checkpoint.name}, {backend.name}: ring of {max_len:,} positions, one buffer vs buckets", fontsize=9)
ax.legend()
fig.tight_layout()
fig.savefig(folder / "buckets.png", dpi=120)
print(f"chart: {folder / 'buckets.png'}")
