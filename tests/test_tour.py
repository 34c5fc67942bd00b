"""The main job: the tour executes the notebooks themselves, in order, as a reader runs them, and
collects the rows each appends. Its run here is CI's one run of every notebook with the
machine's default threads (a reader's configuration; test workers run one thread each)."""

import nbformat
import pytest
import torch

from helpers.course import tour


@pytest.mark.reader
def test_the_tour_runs_every_notebook_in_order_and_collects_their_rows(tmp_path, capsys):
    results = tour.main(["--backend", "cpu", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "01 execution modes" in out and "02 loading" in out and "07 past the source" in out
    rows = results.rows()
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
    for name in [p.name for p in tour.notebooks()]:  # each saved with its outputs, none of them an error
        executed = nbformat.read(tmp_path / name, as_version=4)
        outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
        assert outputs and not [o for o in outputs if o.output_type == "error"], name
    described = nbformat.read(tmp_path / "01_execution_modes.ipynb", as_version=4).cells
    text = "".join(o.get("text", "") for c in described if c.cell_type == "code" for o in c.outputs)
    assert f"{torch.get_num_threads()} CPU threads" in text  # the kernels ran with the machine's default
    assert (tmp_path / "reference_tokens.json").exists() and (tmp_path / "decode_tok_s.png").exists()
    assert (tmp_path / "device_bytes.png").exists() and (tmp_path / "pct_of_bw.png").exists()


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
