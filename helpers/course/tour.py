"""The main job: the notebooks run in order as a reader runs them, then the results table and the charts.
Each notebook runs in a kernel of its own with default threads, appends its rows and is saved with its outputs; a
failing cell stops the tour there.

    python -m helpers.course.tour [--backend cpu|cuda|tpu|xla] [--run-dir runs/tour] [--notebooks 01 03]
"""

import argparse
import os
import pathlib
import time

from tqdm.auto import tqdm

from .report import RUN_DIR_VAR, Results, closing_charts, run_dir

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOISY = 1.5  # the fastest of a step's 3 timed runs over the slowest, past which it is flagged
COLUMNS = (
    "step label backend ms speedup_vs_eager source_speedup load_s device_bytes same_tokens decode_tok_s prefill_s "
    "compiles first_call_s payback_tokens peak_bytes source_tok_s tok_s_spread bytes_per_token tokens_per_verify "
    "GB_per_s pct_of_bw"
).split()


class NotebookFailed(RuntimeError):
    """A cell of a notebook raised; the message names the notebook, where it was saved, and the error."""


def notebooks(numbers: list[str] | None = None) -> list[pathlib.Path]:
    """The series' notebooks in order, or those numbered in ``numbers`` ("01", "03", ...)."""
    found = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not numbers:
        return found
    known = {p.name[:2]: p for p in found}
    unknown = [n for n in numbers if n not in known]
    if unknown:
        raise SystemExit(f"no notebook {', '.join(unknown)}: pick from {', '.join(known)}")
    return [known[n] for n in sorted(numbers)]


def execute(path: pathlib.Path, folder: pathlib.Path, env: dict[str, str]) -> float:
    """Run the notebook in a fresh kernel with ``env`` and save it with its outputs in ``folder``.
    Returns the seconds it took; raises ``NotebookFailed`` at a failing cell."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = nbformat.read(path, as_version=4)
    code = sum(cell.cell_type == "code" for cell in notebook.cells)
    saved = folder / path.name
    resources = {"metadata": {"path": str(path.parent)}}  # the kernel starts in the notebook's folder
    quiet = ["--IPKernelApp.log_level=ERROR"]  # not its notice that local TCP is unencrypted
    client = NotebookClient(notebook, timeout=None, kernel_name="python3", resources=resources, extra_arguments=quiet)
    start = time.perf_counter()
    with tqdm(total=code, desc=path.stem, unit="cell", leave=False) as bar:
        client.on_cell_executed = lambda **_: bar.update()
        try:
            client.execute(env=env)
        except CellExecutionError as err:
            raise NotebookFailed(
                f"{path.name} stopped at a failing cell (saved as far as it ran: {saved}):\n{err}"
            ) from None
        finally:
            nbformat.write(notebook, saved)
    return time.perf_counter() - start


def summary(results: Results) -> None:
    """The run's table, the steps whose repeats disagree, and the closing charts, saved in the run folder."""
    print(results.table(COLUMNS))
    noisy = [f"{r['step']} ({r['tok_s_spread']:.2f}x)" for r in results.rows() if (r.get("tok_s_spread") or 1) > NOISY]
    if noisy:  # a busy machine: ratios between steps timed minutes apart are not to be trusted
        print(
            f"repeats disagree by more than {NOISY}x (fastest / slowest of 3) in: {', '.join(noisy)}; "
            "rerun with nothing else running before comparing steps"
        )
    closing_charts(results)


def main(argv: list[str] | None = None) -> Results:
    parser = argparse.ArgumentParser(prog="python -m helpers.course.tour", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", help="tpu, xla, cuda or cpu (default: detected, or $HELPERS_BACKEND)")
    parser.add_argument("--run-dir", default="runs/tour", help="where results, charts and executed notebooks go")
    parser.add_argument("--notebooks", nargs="*", metavar="NN", help="only these notebooks, by number (default: all)")
    args = parser.parse_args(argv)

    chosen = notebooks(args.notebooks)
    folder = run_dir(args.run_dir).resolve()
    results = Results(folder)
    env = {**os.environ, RUN_DIR_VAR: str(folder)}  # every notebook appends to this folder's table
    if args.backend:
        env["HELPERS_BACKEND"] = args.backend
    for path in tqdm(chosen, desc="tour", unit="notebook"):
        seconds = execute(path, folder, env)
        tqdm.write(f"== {path.stem}: {seconds:.0f} s, saved with its outputs in {folder / path.name}")
    summary(results)
    print(f"results, charts and executed notebooks in {folder}/")
    return results


if __name__ == "__main__":
    main()
