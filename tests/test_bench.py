import pathlib
import subprocess
import sys

import pytest

import helpers
from helpers.bench import Results, Timing, table, time_fn


def test_time_fn_warms_up_syncs_every_call_and_keeps_the_median():
    calls, syncs = [], []
    timing = time_fn(lambda v: calls.append(v) or v, 7, sync=lambda: syncs.append(1), warmup=3, repeats=5)
    assert calls == [7] * 8 and len(syncs) == 8
    assert len(timing.times) == 5 and timing.min <= timing.median <= timing.max


def test_time_fn_rejects_no_repeats():
    with pytest.raises(ValueError, match="repeats"):
        time_fn(lambda: None, sync=lambda: None, repeats=0)


def test_timing_median():
    assert Timing([3.0, 1.0, 2.0]).median == 2.0


def test_results_replace_a_rerun_row_and_keep_the_others(tmp_path):
    results = Results(tmp_path)
    results.add("01 modes", "eager", ms=2.0)
    results.add("03 baseline", "generate", tok_s=5.0)
    results.add("01 modes", "eager", ms=1.0)
    rows = Results(tmp_path).rows()  # read back from the file
    assert [(r["step"], r["label"]) for r in rows] == [("01 modes", "eager"), ("03 baseline", "generate")]
    assert rows[0]["ms"] == 1.0
    text = results.table()
    assert "tok_s" in text and "1" in text.splitlines()[2]


def test_rows_added_by_processes_side_by_side_are_all_kept(tmp_path):
    # two notebooks (parallel test workers, two Colab tabs) writing one run folder at once
    add = "import sys; from helpers.bench import Results; r = Results(sys.argv[1]); [r.add('s', f'{sys.argv[2]}{i}') for i in range(200)]"
    writers = [subprocess.Popen([sys.executable, "-c", add, str(tmp_path), name]) for name in "ab"]
    assert [w.wait() for w in writers] == [0, 0]
    assert len(Results(tmp_path).rows()) == 400


def test_chart_is_written_to_the_run_folder(tmp_path):
    results = Results(tmp_path)
    results.add("01 modes", "eager", speedup_vs_eager=1.0)
    results.add("01 modes", "compile", speedup_vs_eager=3.0, source_speedup=98)
    fig = results.chart("speedup_vs_eager", "t", source="source_speedup", step="01 modes")
    assert (tmp_path / "speedup_vs_eager_01.png").stat().st_size > 0
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["this run", "source (TPU v5e-1)"]


def test_table_of_dicts():
    text = table([{"a": 1, "b": 2.5}, {"a": 10}])
    assert text.splitlines()[0].split() == ["a", "b"] and text.splitlines()[3].split() == ["10", "-"]


def test_run_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("HELPERS_RUN_DIR", str(tmp_path / "x"))
    assert helpers.run_dir() == tmp_path / "x" and (tmp_path / "x").is_dir()


def test_run_dir_goes_to_drive_where_it_is_mounted(tmp_path, monkeypatch):
    monkeypatch.delenv("HELPERS_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert helpers.run_dir() == pathlib.Path("runs/latest")  # no Drive here
    mounted = tmp_path / "drive" / "MyDrive"
    mounted.mkdir(parents=True)
    monkeypatch.setattr(helpers.bench, "DRIVE_RUNS", str(mounted / "gemma4-on-tpu" / "runs"))
    assert helpers.run_dir() == mounted / "gemma4-on-tpu" / "runs" and helpers.run_dir().is_dir()


def test_a_compile_pays_for_itself_after_the_tokens_it_saves():
    from helpers.steps import payback_tokens

    assert payback_tokens(10.0, 5.0, 50.0) == pytest.approx(10 / (0.2 - 0.02))  # 55.6 tokens
    assert payback_tokens(10.0, None, 50.0) is None and payback_tokens(10.0, 50.0, 40.0) is None
