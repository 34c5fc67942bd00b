from helpers import tour
from helpers.bench import Results


def test_tour_runs_every_step_prints_the_table_and_writes_the_chart(tmp_path, capsys):
    tour.main(["--backend", "cpu", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert "01 modes" in out and "02 loading" in out and "tiny offline twin" in out
    rows = Results(tmp_path).rows()
    assert [(r["step"], r["label"]) for r in rows[:8]] == [
        ("01 modes", "eager"),
        ("01 modes", "compile"),
        ("02 loading", "compressed (default)"),
        ("02 loading", "dequantize=True"),
        ("03 baseline", "HF generate"),
        ("04 compiled decode", "compiled step"),
        ("05 4-bit table", "4-bit table"),
        ("06 ring cache", "ring cache, 256 positions"),
    ]
    assert {r["step"] for r in rows[8:]} == {"07 past the source"}
    assert all(r["same_tokens"] for r in rows[2:4])
    assert rows[4]["decode_tok_s"] > 0 and rows[4]["source_tok_s"] == 5
    assert all(r["tok_s_spread"] >= 1 for r in rows[4:])  # fastest / slowest timed run, flagged when large
    assert all(r["bytes_per_token"] > 0 and r["pct_of_bw"] > 0 for r in rows[4:])  # the roofline on every row
    variants = rows[8:]
    assert len(variants) == 8 and all(r["same_tokens"] and r["compiles"] == 2 for r in variants)
    assert sum(r["label"].endswith("matvec loops") for r in variants) == 5  # the CPU's loops, then kept
    assert {r["label"].split(",")[0] for r in variants} >= {
        "int8 linears",
        "int4 linears",
        "int4 linears + 4-bit head",
        "int4 linears + 4-bit head + fused q/k/v",
    }
    assert rows[5]["same_tokens"] and rows[5]["compiles"] == 2
    assert rows[6]["same_tokens"] and rows[6]["compiles"] == 2
    assert rows[7]["same_tokens"] and rows[7]["compiles"] == 2 and rows[7]["source_tok_s"] == 38
    assert rows[7]["device_bytes"] < rows[6]["device_bytes"]  # a ring of 16 slots, not 256 positions, per sliding layer
    assert (tmp_path / "reference_tokens.json").exists() and (tmp_path / "decode_tok_s.png").exists()
    assert (tmp_path / "device_bytes.png").exists() and (tmp_path / "pct_of_bw.png").exists()
    assert (tmp_path / "speedup_vs_eager_01.png").exists() and (tmp_path / "device_bytes_02.png").exists()
