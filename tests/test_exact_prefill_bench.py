"""benchmarks/exact_prefill.py on the CPU: --smoke runs the kernel checks at tiny shapes
in interpret mode (timings mean nothing here); the model table from recorded rows."""

import json

import pytest

from benchmarks import exact_prefill as ep


def test_model_table_compares_exact_with_default(monkeypatch):
    rows = [dict(kind="model", batch=1, t=64, mode="default", chunk=0, cold_s=2.0, warm_s=1.0,
                 peak_gib=10.0, decode_step_ms=5.0, logits_sha1=["aa"]),
            dict(kind="model", batch=1, t=64, mode="exact", chunk=0, cold_s=3.0, warm_s=1.2,
                 peak_gib=10.5, decode_step_ms=5.1, logits_sha1=["bb"]),
            dict(kind="model", batch=1, t=64, mode="exact", chunk=32, cold_s=3.0, warm_s=1.3,
                 peak_gib=10.0, logits_sha1=["bb"]),
            dict(kind="model", batch=2, t=64, mode="exact", error="timeout after 30 s")]
    monkeypatch.setattr(ep, "RESULTS", rows)
    table = ep.model_table()
    assert "| 1 | 64 | exact | 3.00 | 1.20 | 10.5 | 5.10 |  | 1.20x | 1.50x | 1.05x | bb |" in table
    assert "exact (chunks of 32)" in table and "error: timeout" in table


@pytest.mark.slow
def test_smoke_checks_rows_and_prints_one_table(tmp_path, capsys):
    assert ep.main(["--smoke", "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    kinds = {r["kind"] for r in out["results"]}
    assert {"attn_rows", "attn_time", "attn_sweep", "mm"} <= kinds
    rows = next(r for r in out["results"] if r["kind"] == "attn_rows")
    assert rows["alone_eq_batch"] and rows["alone_eq_chunked"]
    assert all(r.get("alone_eq_batch", True) for r in out["results"] if r["kind"] == "mm")
    assert "| what | variant |" in capsys.readouterr().out
