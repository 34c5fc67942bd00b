import helpers
from helpers.course.report import Results


def test_compare_modes_has_a_row_per_mode_relative_to_eager(backend):
    rows = helpers.compare_modes(backend, size=32, warmup=1, repeats=3)
    assert [r["mode"] for r in rows] == list(backend.modes)
    assert rows[0]["speedup_vs_eager"] == 1.0
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in rows)


def test_shape_demo_compiles_once_per_new_shape(backend):
    rows = helpers.shape_demo(backend, "compile", sizes=(8, 8, 16, 8))
    assert [r["new_compilations"] for r in rows] == [1, 0, 1, 0]
    assert rows[-1]["total"] == 2


def test_the_modes_step_records_the_source_figure_on_the_compile_row_only(backend, tmp_path):
    results = Results(tmp_path)
    helpers.course.steps.record_modes(backend, results, size=16, warmup=1, repeats=2)
    rows = {r["label"]: r for r in results.rows()}
    assert set(rows) == set(backend.modes)
    assert rows["compile"]["source_speedup"] == helpers.course.sources.COMPILE_SPEEDUP
    assert all(rows[m]["source_speedup"] is None for m in rows if m != "compile")
    assert all(r["backend"] == backend.name for r in rows.values())
