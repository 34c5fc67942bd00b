"""The notebooks' rows, as a reader's run leaves them: nbval runs every notebook in order in a kernel of its own with the
machine's default threads (``pytest -m reader --nbval-lax notebooks tests``, the README's test command; test workers
run one thread each), each appending its rows to the run folder; the table and the charts are made of those rows.
The tour, the main job, runs the same notebooks through its own executor, tested below on small notebooks."""

import os

import nbformat
import pytest

from conftest import NBVAL_RUN_DIR
from helpers.course import tour
from helpers.course.report import Results


@pytest.mark.reader
def test_the_rows_every_notebook_appended_make_the_table_and_the_charts(capsys, request):
    # where nbval's kernels appended their rows (this test's own run folder is a fresh one); conftest empties it when
    # nbval runs, so rows of an earlier command are never read
    folder = NBVAL_RUN_DIR
    ran = request.config.getoption("nbval_lax", False)
    rows = Results(folder).rows() if ran and folder.exists() else []
    assert "OMP_NUM_THREADS" not in os.environ  # the kernels inherit it: they ran with the machine's default threads
    assert rows, "no rows: run the notebooks first, in the same command: pytest -m reader --nbval-lax notebooks tests"
    assert [(r["step"], r["label"]) for r in rows[:8]] == [
        ("01 execution modes", "eager"),
        ("01 execution modes", "compile"),
        ("02 loading", "compressed (default)"),
        ("02 loading", "dequantize=True"),
        ("03 baseline generate", "HF generate"),
        ("04 compiled decode", "compiled step"),
        ("05 4-bit table", "4-bit table"),
        ("06 ring cache", "ring cache, 1,088 positions"),
    ]
    variants = [r for r in rows[8:] if r["step"] == "07 past the source"]
    drafted = rows[8 + len(variants) :]
    assert [(r["step"], r["label"]) for r in drafted] == [
        ("09 draft and verify", "DraftDecoder, K=3"),
        ("09 draft and verify", "DraftRingDecoder, K=3"),
    ]
    assert rows[4]["decode_tok_s"] > 0 and rows[4]["source_tok_s"] == 5
    assert all(r["tok_s_spread"] >= 1 for r in rows[4:])  # fastest / slowest timed run, flagged when large
    assert all(r["bytes_per_token"] > 0 and r["pct_of_bw"] > 0 for r in rows[4:])  # the roofline on every row
    assert all(r["same_tokens"] and r["compiles"] == 2 and r["first_call_s"] > 0 for r in rows[5:8] + variants)
    assert all(r["same_tokens"] and r["compiles"] == 2 and r["tokens_per_verify"] > 1 for r in drafted)  # prefill, call
    assert len(variants) == 7 and sum(r["label"].endswith("matvec loops") for r in variants) == 5
    assert rows[7]["source_tok_s"] == 38
    tour.summary(Results(folder))
    assert "07 past the source" in capsys.readouterr().out
    for chart in ("decode_tok_s.png", "device_bytes.png", "pct_of_bw.png"):
        assert (Results(folder).path.parent / chart).exists(), chart
    assert (Results(folder).path.parent / "reference_tokens.json").exists()


def _notebook(folder, name: str, *sources: str):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nbformat.write(nb, folder / name)


def test_a_failing_cell_stops_the_tour_and_the_notebook_is_saved_as_far_as_it_ran(tmp_path, monkeypatch):
    (tmp_path / "notebooks").mkdir()
    _notebook(tmp_path / "notebooks", "01_fine.ipynb", "import os\nprint(os.environ['HELPERS_RUN_DIR'])")
    _notebook(tmp_path / "notebooks", "02_broken.ipynb", "print('ran')", "raise ValueError('the lesson broke')", "1")
    monkeypatch.setattr(tour, "NOTEBOOKS", tmp_path / "notebooks")
    monkeypatch.setattr(tour, "closing_charts", lambda results: None)
    with pytest.raises(tour.NotebookFailed, match="(?s)02_broken.ipynb stopped at a failing cell.*the lesson broke"):
        tour.main(["--run-dir", str(tmp_path / "run")])
    fine = nbformat.read(tmp_path / "run" / "01_fine.ipynb", as_version=4)
    assert fine.cells[0].outputs[0]["text"].strip() == str((tmp_path / "run").resolve())  # the run folder, passed on
    broken = nbformat.read(tmp_path / "run" / "02_broken.ipynb", as_version=4)
    assert broken.cells[0].outputs[0]["text"] == "ran\n" and broken.cells[2].get("outputs") == []


def test_notebooks_by_number_and_an_unknown_one_refused():
    assert [p.name[:2] for p in tour.notebooks(["03", "01"])] == ["01", "03"]
    with pytest.raises(SystemExit, match="no notebook 42: pick from 01, 02"):
        tour.notebooks(["42"])
