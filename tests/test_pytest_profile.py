"""benchmarks/pytest_profile.py: the per-file table from the plugin's JSON lines."""

import json

from benchmarks import pytest_profile as pp


def test_table_sums_each_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pp, "DIR", tmp_path)
    rows = [{"test": "tests/test_a.py::t1", "wall_s": 2.0, "cpu_s": 1.5,
             "backend_compile_duration": 1.0},
            {"test": "tests/test_a.py::t2", "wall_s": 3.0, "cpu_s": 2.5,
             "backend_compile_duration": 2.0},
            {"test": "tests/test_b.py::t", "wall_s": 9.0, "cpu_s": 0.5}]
    (tmp_path / "gw0.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]))
    (tmp_path / "gw1.jsonl").write_text(json.dumps(rows[2]))
    assert pp.main() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["tests/test_b.py", "1", "9.0", "0.5", "0.0"]  # longest first
    assert lines[2].split() == ["tests/test_a.py", "2", "5.0", "4.0", "3.0"]


def test_no_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(pp, "DIR", tmp_path)
    assert pp.main() == 1
