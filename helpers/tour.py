"""The main job: every step of the series that exists so far, on the detected backend.

    python -m helpers.tour [--backend cpu|cuda|tpu|xla] [--run-dir runs/tour]

Runs on the tiny offline model where no TPU or real weights are at hand, prints the
results table and writes the charts into the run folder.
"""

from __future__ import annotations

import argparse

from tqdm.auto import tqdm

from . import steps
from .backend import get_backend
from .bench import Results, closing_charts, run_dir

NOISY = 1.5  # the fastest of a step's 3 timed runs over the slowest, past which it is flagged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m helpers.tour", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="tpu, xla, cuda or cpu (default: detected, or $HELPERS_BACKEND)")
    parser.add_argument("--run-dir", default="runs/tour", help="where results and charts go")
    args = parser.parse_args(argv)

    backend = get_backend(args.backend)
    print(backend.describe())
    results = Results(run_dir(args.run_dir))
    for name, step in tqdm(steps.TOUR, desc="tour", unit="step"):
        tqdm.write(f"== {name}")
        step(backend, results)
    print(
        results.table(
            [
                "step",
                "label",
                "backend",
                "ms",
                "speedup_vs_eager",
                "source_speedup",
                "load_s",
                "device_bytes",
                "same_tokens",
                "decode_tok_s",
                "prefill_s",
                "compiles",
                "first_call_s",
                "payback_tokens",
                "peak_bytes",
                "source_tok_s",
                "tok_s_spread",
                "bytes_per_token",
                "GB_per_s",
                "pct_of_bw",
            ]
        )
    )
    noisy = [f"{r['step']} ({r['tok_s_spread']:.2f}x)" for r in results.rows() if (r.get("tok_s_spread") or 1) > NOISY]
    if noisy:  # a busy machine: ratios between steps timed minutes apart are not to be trusted
        print(
            f"repeats disagree by more than {NOISY}x (fastest / slowest of 3) in: {', '.join(noisy)}; "
            "rerun with nothing else running before comparing steps"
        )
    results.chart(
        "speedup_vs_eager", "op stack: speed-up over eager", source="source_speedup", step=steps.MODES, log=True
    )
    results.chart("device_bytes", "model bytes on the device after a forward", step=steps.LOADING)
    closing_charts(results)
    print(f"results and charts in {results.path.parent}/")


if __name__ == "__main__":
    main()
