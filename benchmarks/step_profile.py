"""Where a decode step's time goes at E2B's size: notebook 04's compiled step against HF's own
recipe (``generate`` with its static cache and the forward compiled), side by side in one run on
the synthetic E2B (``helpers.course.offline``: the real shapes, random weights), each profiled over
the same count of steps with torch.profiler: the ops and kernels with the most time of their
own, their counts, and each loop's tok/s. Notebook 04's step runs twice: with the 256-position
cache it was measured with, and with its cache sized to the run as HF sizes its own
(``decode.cache_length``: prompt + tokens, rounded up to a bucket), since a step's attention
reads its whole buffer.

    python benchmarks/step_profile.py [--steps 16] [--rows 15] [--max-len 256 64] [--rounds 6] [--backend cpu|cuda]

Then, without the profiler (it adds time to every op), the two loops alternate ``--rounds`` times
with notebook 04's step at the run's bucket, so both see the same state of a shared machine: each
round's median step time, and the ratio of the medians over rounds with its spread.

Both run the model as notebook 04 leaves it (decompressed, compressed-tensors' wrappers
stripped, bf16). HF's recipe is timed from its streamer's per-token times over the same steps.
"""

import argparse
import os
import statistics
import time

import torch
from torch.profiler import profile

import helpers
from helpers import decode
from helpers.course import hub, measure
from helpers.course.measure import compiled_forward
from helpers.course.offline import SYNTHETIC
from helpers.course.series import load_for_series
from helpers.generate import StepStreamer, greedy_config

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=16, help="decode steps profiled per loop")
parser.add_argument("--rows", type=int, default=15, help="rows of each profile table")
parser.add_argument("--backend", help="cpu or cuda (default: detected)")
parser.add_argument(
    "--max-len", type=int, nargs="*", help="cache lengths of notebook 04's step (default: 256, then the run's bucket)"
)
parser.add_argument("--rounds", type=int, default=6, help="alternated rounds of the two loops, unprofiled")
args = parser.parse_args()

os.environ.setdefault("HELPERS_MODEL", SYNTHETIC)
backend = helpers.get_backend(args.backend)
print(helpers.course.hub.describe(backend))
print(hub.choose_checkpoint(backend))
checkpoint, model, tokenizer, ids = load_for_series(backend)
with torch.no_grad():
    model(ids)  # the first forward decompresses the weights
decode.strip_compressed_wrappers(model)
tokens = args.steps + 1


def hf_run():
    config = greedy_config(model, tokens, stop=False)
    config.update(cache_implementation="static")
    streamer = StepStreamer(tokenizer, backend)
    with torch.no_grad():
        model.generate(ids, generation_config=config, streamer=streamer)
    return streamer


def report(name: str, prof, seconds: list[float]):
    per_token = sorted(seconds)[len(seconds) // 2]
    print(f"\n== {name}: {1 / per_token:.2f} tok/s (median of {len(seconds)} steps)")
    print(prof.key_averages().table(sort_by=measure.profiler_sort(backend), row_limit=args.rows))


with compiled_forward(model):
    start = time.perf_counter()
    hf_run()  # compiles the forward
    print(f"HF's recipe compiled in {time.perf_counter() - start:.0f} s")
    with profile(activities=measure.profiler_activities(backend)) as hf_prof:
        streamer = hf_run()
    hf_seconds = streamer.step_seconds[1:]  # after the prefill's token
torch.compiler.reset()


def our_run(decoder) -> list[float]:
    """Seconds of ``args.steps`` compiled decode calls after a prefill, each ending on the host
    with its token, as generate's streamer has it."""
    token, position = decoder.prefill(ids)
    seconds = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        _, token, position = decoder.call(token, position)
        token.tolist()
        seconds.append(time.perf_counter() - begin)
    return seconds


report("HF generate, static cache, forward compiled", hf_prof, hf_seconds)
print(f"HF's static cache holds {ids.shape[1] + tokens} positions: the prompt and the tokens asked for")
# notebook 04's step with the cache it was measured with, then sized to the run as HF sizes its own
for max_len in args.max_len or (256, decode.cache_length(ids.shape[1] + tokens)):
    torch.compiler.reset()
    decoder = decode.Decoder(model, backend, max_len)
    start = time.perf_counter()
    decoder.generate(ids, 2)  # compiles the prefill bucket and the step
    print(f"\nnotebook 04's step, {max_len} positions, compiled in {time.perf_counter() - start:.0f} s")
    with profile(activities=measure.profiler_activities(backend)) as our_prof:
        ours = our_run(decoder)
    report(f"notebook 04's compiled step, a static cache of {max_len} positions", our_prof, ours)
    del decoder


if args.rounds:
    # both compiled at once: HF's forward inside compiled_forward, notebook 04's step outside it
    torch.compiler.reset()
    max_len = decode.cache_length(ids.shape[1] + tokens)
    decoder = decode.Decoder(model, backend, max_len)
    decoder.generate(ids, 2)
    with compiled_forward(model):
        hf_run()
    medians = {"HF": [], "04": []}
    for r in range(args.rounds):
        with compiled_forward(model):
            medians["HF"].append(statistics.median(hf_run().step_seconds[1:]))
        medians["04"].append(statistics.median(our_run(decoder)))
        print(f"round {r + 1}: HF {1 / medians['HF'][-1]:.2f} tok/s, 04 {1 / medians['04'][-1]:.2f} tok/s", flush=True)
    ratios = [hf / ours for hf, ours in zip(medians["HF"], medians["04"])]
    print(
        f"\nalternated, {args.rounds} rounds of {args.steps} steps, 04 with {max_len} positions:"
        f" HF {1 / statistics.median(medians['HF']):.2f} tok/s, 04 {1 / statistics.median(medians['04']):.2f} tok/s;"
        f" 04 / HF = {statistics.median(ratios):.3f} (median of rounds; {min(ratios):.3f} to {max(ratios):.3f})"
    )
