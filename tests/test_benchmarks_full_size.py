"""The series' full-size benchmarks, on the twin with their smallest settings (``test_benchmarks.py`` says why)."""

import pytest
from test_benchmarks import SECOND_FILE, run_benchmark


@pytest.mark.parametrize("script", sorted(SECOND_FILE))
def test_the_full_size_benchmark_runs_on_the_twin_with_its_smallest_settings(script, tmp_path):
    run_benchmark(script, tmp_path)
