from helpers import tour
from helpers.bench import Results


def test_tour_runs_every_step_prints_the_table_and_writes_the_chart(tmp_path, capsys):
    tour.main(["--backend", "cpu", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "01 modes" in out and "compile" in out
    labels = [r["label"] for r in Results(tmp_path).rows()]
    assert labels == ["eager", "compile"]
    assert (tmp_path / "speedup_vs_eager_01.png").exists()
