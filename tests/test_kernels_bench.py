"""benchmarks/kernels.py on the CPU: the smoke mode (tiny shapes, Pallas interpret mode)
runs the full benchmark end to end and prints its tables; the numbers mean nothing here.
The focus mode's smoke run takes about as long again, so only its argument parsing is
checked (run it by hand: `python -m benchmarks.kernels focus --smoke`)."""

import json

import pytest

from benchmarks import kernels


@pytest.mark.slow
def test_full_smoke_prints_tables(tmp_path, capsys):
    assert kernels.main(["full", "--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "correctness: PASS" in out
    for header in ("== read ceiling", "verify (us per layer call",
                   "cuDNN (gamma 6", "sparse 7 % (+16 tail)", "top-k over [B, S]",
                   "prefill T=256:", "total "):
        assert header in out, header
    assert "top_k " in out and "fast " in out
    assert "  1     512  6 |" in out  # the one smoke verify row
    summary = json.loads((tmp_path / "bench.json").read_text())
    kinds = {r["kind"] for r in summary["results"]}
    assert {"ceiling", "check", "tune", "topk", "verify", "sparse", "prefill"} <= kinds
    assert (tmp_path / "bench_log.txt").read_text() == out
    assert kernels.LOG is None  # the log file is closed again
    assert kernels.make_cache(1, 512)[2] == 2  # smoke caches stay tiny (2 layers, not 64)


def test_modes_and_flags():
    p = kernels.build_parser()
    a = p.parse_args([])
    assert (a.mode, a.budget_s, a.quick, a.smoke, a.out) == ("full", 540.0, False, False, "/tmp")
    a = p.parse_args(["focus", "--budget-s", "240", "--smoke", "--quick", "--out", "d"])
    assert (a.mode, a.budget_s, a.quick, a.smoke, a.out) == ("focus", 240.0, True, True, "d")
    help_text = p.format_help()
    for word in ("full", "fast", "focus", "--budget-s", "--quick", "--smoke", "--out"):
        assert word in help_text


def test_bad_mode(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(["nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
