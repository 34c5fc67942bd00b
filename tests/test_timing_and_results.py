import pathlib
import subprocess
import sys
import time

import pytest

import helpers
from helpers.course.report import Results, table
from helpers.timing import Timing, time_fed, time_fn


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
    results.add("01 execution modes", "eager", ms=2.0)
    results.add("03 baseline generate", "generate", tok_s=5.0)
    results.add("01 execution modes", "eager", ms=1.0)
    rows = Results(tmp_path).rows()  # read back from the file
    assert [(r["step"], r["label"]) for r in rows] == [
        ("01 execution modes", "eager"),
        ("03 baseline generate", "generate"),
    ]
    assert rows[0]["ms"] == 1.0
    text = results.table()
    assert "tok_s" in text and "1" in text.splitlines()[2]


def test_rows_added_by_processes_side_by_side_are_all_kept(tmp_path):
    # two notebooks (parallel test workers, two Colab tabs) writing one run folder at once
    add = "import sys; from helpers.course.report import Results; r = Results(sys.argv[1]); [r.add('s', f'{sys.argv[2]}{i}') for i in range(200)]"
    writers = [subprocess.Popen([sys.executable, "-c", add, str(tmp_path), name]) for name in "ab"]
    assert [w.wait() for w in writers] == [0, 0]
    assert len(Results(tmp_path).rows()) == 400


def test_the_sources_figures_are_charted_only_beside_e2b_on_a_tpu_and_titles_name_model_device_run(tmp_path):
    results = Results(tmp_path / "run-a")
    twin = {"backend": "cpu", "model": "tiny-twin", "real_model": False}
    results.add("03 baseline generate", "HF generate", decode_tok_s=1184.0, source_tok_s=5, **twin)
    fig = results.chart("decode_tok_s", "decode tokens/s", source="source_tok_s")
    assert (tmp_path / "run-a" / "decode_tok_s.png").stat().st_size > 0
    bars = [p.get_height() for p in fig.axes[0].patches]
    assert bars == [1184.0] and fig.axes[0].get_legend() is None  # the twin's CPU figure alone
    title = fig.axes[0].get_title()
    assert "tiny-twin on cpu, run run-a" in title and "not beside these" in title
    e2b = {"backend": "tpu", "model": "google/gemma-4-E2B-it-qat-w4a16-ct@main", "real_model": True}
    results.add("03 baseline generate", "HF generate", decode_tok_s=4.8, source_tok_s=5, **e2b)
    fig = results.chart("decode_tok_s", "decode tokens/s", source="source_tok_s")
    assert [p.get_height() for p in fig.axes[0].patches] == [4.8, 5]  # E2B on a TPU: the source beside it
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
    monkeypatch.setattr(helpers.course.report, "DRIVE_RUNS", str(mounted / "gemma4-on-tpu" / "runs"))
    assert helpers.run_dir() == mounted / "gemma4-on-tpu" / "runs" and helpers.run_dir().is_dir()


def test_a_compile_pays_for_itself_after_the_tokens_it_saves():
    from helpers.course.steps import payback_tokens

    assert payback_tokens(10.0, 5.0, 50.0) == pytest.approx(10 / (0.2 - 0.02))  # 55.6 tokens
    assert payback_tokens(10.0, None, 50.0) is None and payback_tokens(10.0, 50.0, 40.0) is None


class _Pending:
    """A result a device is still computing after its synchronize returned: reading it to the
    host waits for it (as TorchTPU's compiled work did before torch_tpu#2494)."""

    def __init__(self, seconds: float):
        self.ready_at = time.perf_counter() + seconds

    def reshape(self, *shape):
        return self

    def __getitem__(self, index):
        return self

    def tolist(self):
        time.sleep(max(0.0, self.ready_at - time.perf_counter()))
        return [0]


def test_a_timed_call_ends_on_a_host_read_of_its_result_not_on_a_sync_that_returns_at_once():
    returns_at_once = lambda: None  # noqa: E731  (a stand-in backend's synchronize)
    timing = time_fn(lambda: _Pending(0.2), sync=returns_at_once, warmup=0, repeats=2)
    assert min(timing.times) >= 0.2
    fed = time_fed(lambda token, position: (_Pending(0.1), position + 1), (None, 0), sync=returns_at_once, repeats=2)
    assert min(fed.times) >= 0.1 and fed.last[1] == 2  # a step fed its own state: its token read back
    listed = time_fn(lambda: [1, 2, 3], sync=returns_at_once, warmup=0, repeats=1)  # tokens already on the host
    assert listed.last == [1, 2, 3]
