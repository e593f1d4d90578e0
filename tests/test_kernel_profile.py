"""benchmarks/kernel_profile.py on the CPU: it runs the phases asked for end to end and writes
HLO (the kernel table itself needs a GPU trace; on the CPU it is empty).

The model is a registered name made for the test: SmolLM2-135M's architecture at tiny sizes
(tests/tiny.py), so the script's path (random weights of a registered name, every phase
compiled, traced and timed, the HLO written) is the same while the CPU spends seconds, not
minutes, running steps whose timings mean nothing here."""

import json

import pytest

from benchmarks import kernel_profile
from tests.tiny import tiny_config
from vegas_jax import config


@pytest.fixture
def tiny_name(monkeypatch):
    cfg = tiny_config("llama", vocab=256, layers=2)
    monkeypatch.setitem(config.REGISTRY, cfg.name, cfg)
    return cfg.name


def _run(name, *extra):
    return kernel_profile.main(["--model", name, "--batch", "1", "--context", "200",
                                "--gamma", "2", "--backend", "xla", *extra])


@pytest.mark.slow
def test_runs_and_writes_hlo(tmp_path, capsys, tiny_name):
    rc = _run(tiny_name, "--hlo", str(tmp_path), "--phases", "decode,draft,round",
              "--json", str(tmp_path / "out.json"))
    assert rc == 0
    out = capsys.readouterr().out
    for label in ("decode step:", "draft step:", "round:"):
        assert label in out
    assert "verify+capture:" not in out  # only the phases asked for
    for name in ("decode", "draft", "round"):
        assert "HloModule" in (tmp_path / f"{name}.hlo.txt").read_text()[:200]
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["round"]["wall_ms"] > 0
    assert "backend='xla'" in summary["exec"]


@pytest.mark.slow
def test_profiles_a_study_plugin(capsys, tiny_name):
    """--method takes the study's plug-ins (benchmarks.methods) beside the library's names;
    the verify without capture has no HLO of its own but runs."""
    rc = _run(tiny_name, "--method", "vegas-accepted", "--phases", "verify0,verify",
              "--memory", "--top", "3")
    assert rc == 0
    out = capsys.readouterr().out
    assert "verify, no capture:" in out and "verify+capture:" in out
    assert "verify memory plan:" in out


def test_rejects_unknown_phases_and_methods(tiny_name):
    with pytest.raises(SystemExit, match="unknown phase"):
        _run(tiny_name, "--phases", "decode,select")
    with pytest.raises(SystemExit, match="unknown method"):
        _run(tiny_name, "--method", "vegas-heads", "--phases", "decode")


def test_kinds():
    assert kernel_profile.kind_of("nvjet_sm90_tst_64x8") == "matmul"
    assert kernel_profile.kind_of("vegas_sparse_attention") == "attention"
    assert kernel_profile.kind_of("memcpy32_post") == "copy"
    assert kernel_profile.kind_of("input_scatter_fusion_2") == "scatter"
    assert kernel_profile.kind_of("loop_add_fusion") == "other"
