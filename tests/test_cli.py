"""`python -m vegas_jax.decode` as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "vegas_jax.decode", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_flag():
    r = run("--help")
    assert r.returncode == 0
    for flag in ("--model", "--checkpoint", "--prompt", "--prompt-file", "--max-new-tokens",
                 "--temperature", "--top-k", "--top-p", "--min-p", "--seed", "--method",
                 "--gamma", "--sparsity", "--min-tokens", "--score", "--dtype", "--attn-impl",
                 "--gemm", "--layers", "--compile-cache", "--max-context", "--json", "--raw"):
        assert flag in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "qwen3-8"], "unknown model 'qwen3-8'"),
    (["--gamma", "0"], "gamma must be"),
    (["--sparsity", "0"], "sparsity must be in (0, 1]"),
    (["--sparsity", "1.5"], "sparsity must be in (0, 1]"),
    (["--top-p", "0"], "top_p must be"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--checkpoint", "/no/such/dir"], "/no/such/dir"),
    (["--model", "qwen3-8b"], "--checkpoint"),
    (["--prompt-file", "/no/such/file.txt"], "prompt file not found"),
    (["--max-context", "9000"], "smollm2-135m supports at most 8192 positions"),
])
def test_bad_input_is_a_clear_error(args, message):
    r = run(*args)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_json_run_on_the_default_model():
    r = run("--prompt", "Name three colours.", "--max-new-tokens", "12", "--json",
            "--method", "vegas", "--gamma", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    res = out["results"][0]
    assert out["model"] == "smollm2-135m" and len(res["tokens"]) == 12 and res["text"]
    st = out["stats"]
    assert st["method"] == "vegas" and st["gamma"] == 3
    assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))


def test_streams_text_and_prints_stats(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("Write one sentence about the sea.")
    r = run("--prompt-file", str(f), "--max-new-tokens", "16", "--method", "stream")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "tau=" in r.stderr


def test_compile_cache_off_overrides_the_environment(tmp_path):
    """'off' turns JAX's persistent cache off even where JAX_COMPILATION_CACHE_DIR set
    one (the tests' own processes run with it); a directory turns it on there."""
    import jax

    from vegas_jax.cli import enable_compile_cache

    saved = jax.config.jax_compilation_cache_dir
    try:
        assert enable_compile_cache("off") is None
        assert jax.config.jax_compilation_cache_dir is None
        assert enable_compile_cache(str(tmp_path / "c")) == str(tmp_path / "c")
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
    finally:
        jax.config.update("jax_compilation_cache_dir", saved)


def test_compile_cache_is_written_and_reused(tmp_path):
    """--compile-cache DIR fills DIR on the first run; a second run of the same shapes
    finds its programs there (and prints the same tokens); 'off' writes nothing."""
    cache = tmp_path / "xla"
    args = ("--prompt", "Name a colour.", "--max-new-tokens", "6", "--json", "--method",
            "vegas", "--gamma", "2")
    first = run(*args, "--compile-cache", str(cache))
    assert first.returncode == 0, first.stderr
    entries = set(os.listdir(cache))
    assert any("spec_round" in e for e in entries), sorted(entries)[:10]
    second = run(*args, "--compile-cache", str(cache))
    assert second.returncode == 0, second.stderr
    assert set(os.listdir(cache)) == entries  # nothing new had to be compiled
    assert json.loads(second.stdout)["results"] == json.loads(first.stdout)["results"]
    session_cache = os.environ["VEGAS_JAX_COMPILE_CACHE"]  # the default in tests
    before = set(os.listdir(session_cache)) if os.path.isdir(session_cache) else set()
    r = run(*args, "--gamma", "3", "--compile-cache", "off")  # new shapes: would compile
    assert r.returncode == 0, r.stderr
    after = set(os.listdir(session_cache)) if os.path.isdir(session_cache) else set()
    assert after == before
