"""Prefill at E2B's size, before and after the cut of issue 44, side by side in one run: a 4,096-token static
prefill (notebook 04's ``Decoder``, one bucket) and a prompt of 4 windows on the ring (notebook 06's ``RingDecoder``,
chunks of one window, the full layers' buffer sized to the prompt). Before: every layer on every row (and on the
ring, the head on every row too, as its prefill ran it); after: the layers that keep no K/V of their own, and the
head, on the last real row alone (``decode.skip_shared_layers``, transformers' own cut taken at a tensor of rows).
On the synthetic checkpoint with E2B's real shapes (random weights: the tokens mean nothing, the time is E2B's),
compiled as the notebooks compile it; this CPU unless told. Prints each prefill's seconds (median of ``--repeats``,
and the spread), the ratio, the weight FLOPs per prefilled token computed from the configuration, and the same-token
verdict of the ``--tokens`` tokens after each prompt (teacher-forced through the model: two programs).

    python benchmarks/prefill.py [--backend cpu|cuda] [--prompt 4090] [--windows 4] [--tokens 8] [--repeats 2]

``HELPERS_MODEL=tiny`` runs the same on the twin in seconds.
"""

import argparse
import os
import time

import torch

from helpers.course.offline import SYNTHETIC

os.environ.setdefault("HELPERS_MODEL", SYNTHETIC)

import helpers
from helpers import decode
from helpers.course import e2b, hub, verdict
from helpers.course.report import table
from helpers.course.series import load_for_series
from helpers.ring import RingDecoder, group_query_heads
from helpers.timing import time_fn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--backend", help="cpu or cuda (default: detected, or $HELPERS_BACKEND)")
parser.add_argument("--prompt", type=int, default=4_090, help="the static prompt's tokens (padded to its bucket)")
parser.add_argument("--windows", type=int, default=4, help="the ring's prompt, in sliding windows")
parser.add_argument("--tokens", type=int, default=8, help="tokens after each prompt, for the verdict")
parser.add_argument("--repeats", type=int, default=2, help="timed prefills per case, after the one that compiles")
args = parser.parse_args()


class EveryRowRing(RingDecoder):
    """The ring's prefill as it was before the cut: every layer and the head on every row, the last real row's logits
    picked after the head."""

    def prefill_forward(self, tokens, positions, valid, last):
        self.backend.donate(*decode.kv_buffers(self.cache))
        logits = self.forward_chunk(tokens, positions, valid).logits[0].index_select(0, last)
        return self.pick(logits, positions[0].index_select(0, last) + 1)


def every_row(model) -> None:
    """transformers' own forward: no cut at a tensor of rows (``skip_shared_layers`` undone)."""
    model.model.__dict__.pop("_maybe_slice_kv_shared_inputs", None)


backend = helpers.get_backend(args.backend)
print(hub.describe(backend))
print(hub.choose_checkpoint(backend))
started = time.perf_counter()
checkpoint, model, tokenizer, _ = load_for_series(backend)
with torch.no_grad():
    model(torch.tensor([[2, 3]], device=backend.device))  # the first forward decompresses the weights
decode.strip_compressed_wrappers(model)
config = model.config.get_text_config()
window = config.sliding_window
scale = 1 if not checkpoint.tiny else 64  # the twin's window is 1/32 of E2B's: its prompt 1/64 of the length
ids = torch.randint(3, config.vocab_size, (1, args.prompt // scale), generator=torch.Generator().manual_seed(0))
ids = ids.to(backend.device)
ring_ids = ids.repeat(1, 1 + args.windows * window // ids.shape[1])[:, : args.windows * window]
print(f"loaded in {time.perf_counter() - started:.0f} s; threads {torch.get_num_threads()}")


def static(cut: bool):
    """Notebook 04's decoder (its prefill's head already on the last real row alone) and the prompt; rows a call."""
    bucket = decode.cache_length(ids.shape[1])
    return decode.Decoder(model, backend, max_len=bucket + args.tokens), ids, bucket, "head on one row"


def ring(cut: bool):
    """Notebook 06's decoder, before the cut as its prefill ran (``EveryRowRing``), and the prompt; rows a call."""
    kind = RingDecoder if cut else EveryRowRing
    return kind(model, backend, max_len=(args.windows + 1) * window), ring_ids, window, "every row"


rows, flops = [], {}
for name, make in (("static, 04", static), ("ring, 06", ring)):
    if name.startswith("ring"):
        print("attention:", group_query_heads(model), "->", model.config._attn_implementation, "(as notebook 06)")
    tokens = {}
    for cut in (False, True):
        torch.compiler.reset()
        decoder, prompt, chunk, before = make(cut)  # a Decoder installs the cut
        if not cut:
            every_row(model)
        first = time.perf_counter()
        time_fn(decoder.prefill, prompt, sync=backend.sync, warmup=0, repeats=1)
        compile_s = time.perf_counter() - first
        timed = time_fn(decoder.prefill, prompt, sync=backend.sync, warmup=0, repeats=args.repeats)
        tokens[cut] = decoder.generate(prompt, args.tokens, stop_ids=())
        counted = e2b.prefill_flops(config, chunk)
        rows.append(
            {
                "prefill": name,
                "prompt": prompt.shape[1],
                "layers 15-34": "last real row" if cut else "every row",
                "first_s (compiles)": f"{compile_s:.3g}",
                "prefill_s": timed.median,
                "spread": f"{timed.max / timed.min:.2f}x",
                "GFLOP/token": f"{counted['cut' if cut else before] / 1e9:.3g}",
            }
        )
        print(rows[-1], flush=True)
        del decoder
    before, after = rows[-2]["prefill_s"], rows[-1]["prefill_s"]
    rows[-2]["prefill_s"], rows[-1]["prefill_s"] = f"{before:.3g}", f"{after:.3g}"
    result = verdict.compare_tokens(tokens[True], tokens[False], model, prompt)
    print(f"{name}: {before / after:.2f}x shorter with the cut; tokens after the prompt: {result}", flush=True)
    rows[-1]["vs every row"] = f"{before / after:.2f}x"
    rows[-1]["verdict"] = str(result)
print(table(rows))
print(f"whole run {(time.perf_counter() - started) / 60:.1f} min")
