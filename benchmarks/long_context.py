"""Long context on a CPU-sized Gemma 4 (same class, E2B's 512-token window): decode step time
and prefill time at contexts of 256, 2K and 8K tokens, HF's default cache against the ring
cache (notebook 06), eager and compiled, side by side in one run; cache bytes measured.

    python benchmarks/long_context.py [--contexts 256 2048 8192] [--steps 16]

Prints ms per decode step, prefill seconds, cache bytes and ratios to HF's default cache.
"""

import argparse
import time

import torch
from cpu_model import cpu_model

import helpers
from helpers import decode as d
from helpers import ring
from helpers.bench import fmt_bytes, table

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
parser.add_argument("--steps", type=int, default=16)
args = parser.parse_args()

backend = helpers.get_backend("cpu")
model = cpu_model(sliding_window=512, max_position_embeddings=16384)  # E2B's window
config = model.config
print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, float32, window "
      f"{config.sliding_window}, on the CPU")


def hf_cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for l in cache.layers for t in (l.keys, l.values) if t is not None)


max_len = -(-(max(args.contexts) + args.steps + 1) // config.sliding_window) * config.sliding_window
decoder = ring.RingDecoder(model, backend, max_len=max_len)
print(f"ring cache: {max_len} positions for the full layers, one {config.sliding_window}-slot ring per sliding layer")
rows = []
with torch.no_grad():
    for context in args.contexts:
        ids = torch.randint(3, 8192, (1, context))
        start = time.perf_counter()
        out = model(ids, use_cache=True)  # HF's default: a DynamicCache, whole-prompt attention
        hf_prefill = time.perf_counter() - start
        cache = out.past_key_values

        first = out.logits[:, -1].argmax(-1, keepdim=True)
        hf_ms = ring.decode_ms(ring.hf_default_step(model, cache), first, torch.tensor([[context]]), args.steps, backend)
        hf_bytes = hf_cache_bytes(cache)

        decoder.prefill(ids)  # compiles the chunk once, at the first context
        start = time.perf_counter()
        token, position = decoder.prefill(ids)
        backend.sync()
        ring_prefill = time.perf_counter() - start
        eager_ms = ring.decode_ms(decoder._step, token, position, args.steps, backend)  # the same step, not compiled
        decoder.prefill(ids)
        compiled_ms = ring.decode_ms(decoder.decode_step, token, position, args.steps, backend)
        rows.append({"context": context, "HF default ms/step": round(hf_ms, 2), "ring eager ms/step": round(eager_ms, 2),
                     "ring compiled ms/step": round(compiled_ms, 2), "compiled vs HF": f"{hf_ms / compiled_ms:.2f}x",
                     "HF prefill s": round(hf_prefill, 3), "ring prefill s": round(ring_prefill, 3),
                     "HF cache": fmt_bytes(hf_bytes), "ring cache": fmt_bytes(d.cache_bytes(decoder.cache))})
        print(rows[-1])

print(table(rows))
flat = rows[-1]["ring compiled ms/step"] / rows[0]["ring compiled ms/step"]
print(f"ring compiled step at {args.contexts[-1]} vs {args.contexts[0]} tokens of context: {flat:.2f}x"
      f" (HF default: {rows[-1]['HF default ms/step'] / rows[0]['HF default ms/step']:.2f}x)")
