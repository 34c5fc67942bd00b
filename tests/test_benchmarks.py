"""No benchmark rots: every script in ``benchmarks/`` runs on the twin with its smallest settings (a few tokens, one
round) and exits 0, so a change to a lesson that breaks a benchmark is red. What they print is not judged here: their
figures are for a quiet machine and full size (``docs/full-size.md``)."""

import os
import pathlib
import subprocess
import sys

import pytest

from conftest import needs_xla

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
HELPER_MODULES = {"cpu_model.py"}  # imported by the scripts, not run
SMALLEST = {
    "buckets.py": ["--contexts", "40", "--buckets", "96", "--steps", "1", "--run-dir", "{tmp}"],
    "decode.py": ["--tokens", "4", "--rounds", "1", "--k", "1"],
    "draft.py": ["--tokens", "6", "--rounds", "1", "--ks", "2"],
    "draft_full_size.py": ["--rounds", "1", "--context", "16"],
    "full_size.py": ["--tokens", "4", "--variants", "int4 linears", "--skip-ring", "--run-dir", "{tmp}"],
    "grid.py": ["--repeats", "1"],
    "int4_cpu.py": ["--rounds", "1", "--copies", "1"],
    "long_context.py": ["--contexts", "64", "--steps", "2"],
    "matvec.py": ["--rounds", "1", "--megabytes", "8"],
    "modes.py": ["--size", "32", "--repeats", "2"],
    "prefill.py": ["--windows", "1", "--tokens", "2", "--repeats", "1"],
    "step_profile.py": ["--steps", "2", "--rows", "3", "--rounds", "1"],
    "xla_programs.py": ["--ks", "1", "--variants", "int4 linears"],
}
ON_XLA = {"xla_programs.py"}  # what XLA compiles: PyTorch/XLA's CPU client, CI's xla job
# half the run, in a file of its own (test_benchmarks_full_size.py), so that CI's two test workers take one each
SECOND_FILE = {"full_size.py", "draft.py", "step_profile.py", "prefill.py", "buckets.py", "draft_full_size.py"}


def test_every_script_has_its_smallest_settings():
    scripts = {p.name for p in BENCHMARKS.glob("*.py")} - HELPER_MODULES
    assert scripts == set(SMALLEST), scripts ^ set(SMALLEST)
    assert ON_XLA | SECOND_FILE <= scripts and not ON_XLA & SECOND_FILE


def run_benchmark(script: str, tmp_path, extra_env=None):
    args = [a.replace("{tmp}", str(tmp_path)) for a in SMALLEST[script]]
    env = {**os.environ, "HELPERS_MODEL": "tiny", "MPLBACKEND": "Agg", **(extra_env or {})}
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, (
        f"python benchmarks/{script} {' '.join(args)}:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    )


@pytest.mark.parametrize("script", sorted(set(SMALLEST) - ON_XLA - SECOND_FILE))
def test_the_benchmark_runs_on_the_twin_with_its_smallest_settings(script, tmp_path):
    run_benchmark(script, tmp_path)


@needs_xla
@pytest.mark.parametrize("script", sorted(ON_XLA))
def test_the_xla_benchmark_runs_on_the_twin_with_its_smallest_settings(script, tmp_path):
    run_benchmark(script, tmp_path, {"PJRT_DEVICE": "CPU", "HELPERS_BACKEND": "xla"})
