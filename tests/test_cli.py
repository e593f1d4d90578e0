"""`python -m vegas_jax.decode` as a user runs it: its flags and their help, clear errors
for bad input, prompts as text or @file, JSON and streamed output, and the compilation
cache `$VEGAS_JAX_COMPILE_CACHE` names.

Most runs call `decode.main` in this process (a subprocess spends seconds importing JAX);
a few start the command itself."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vegas_jax import decode
from tests.tiny import with_tokenizer

ROOT = Path(__file__).resolve().parents[1]
MAX_OPTIONS = 21  # 20, and issue 55's --draft-weights


def run(*args, env=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "vegas_jax.decode", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def _keep_jax_cache_config(jax_cache_config_restored):
    """`decode.main` turns on the compilation cache: this process's setting comes back."""


@pytest.fixture(scope="module")
def ckpt(tiny_hf, tmp_path_factory):
    """A tiny Qwen3 checkpoint with a word-level tokenizer (no chat template)."""
    src, _ = tiny_hf("qwen3-untied")
    return str(with_tokenizer(src, tmp_path_factory.mktemp("cli") / "tiny-qwen3"))


def main(capsys, *args):
    """decode.main(args) -> (exit code, stdout, stderr)."""
    rc = decode.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------

def _options():
    p = decode.build_parser()
    return [a for a in p._actions if not isinstance(a, argparse._HelpAction)]


def test_at_most_max_options_each_with_one_line_help():
    opts = _options()
    assert len(opts) <= MAX_OPTIONS, [a.option_strings for a in opts]
    for a in opts:
        assert a.help and "\n" not in a.help, a.option_strings


def test_help_lists_every_option():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for a in _options():
        assert a.option_strings[0] in r.stdout
    assert "VEGAS_JAX_COMPILE_CACHE" in r.stdout


def test_help_names_one_default_per_flag():
    """A default the help writes itself is not followed by argparse's own, and a flag with
    none shows no "(default: None)" or "(default: False)"."""
    text = " ".join(decode.build_parser().format_help().split("options:")[1].split())
    starts = [text.index(f" {a.option_strings[0]} ") for a in _options()]
    for a, i, j in zip(_options(), starts, starts[1:] + [len(text)]):
        entry = text[i:j]
        assert entry.count("default") <= 1, entry
        assert "(default: None)" not in entry and "(default: False)" not in entry, entry
    assert "(default smollm2-135m)" in text and "(default: 128)" in text


@pytest.mark.parametrize("flag", ["--attn-impl", "--gemm", "--layers", "--draft-attn",
                                  "--draft-row-pad", "--select-impl", "--prefill-impl",
                                  "--moe-impl", "--min-tokens", "--score", "--compile-cache",
                                  "--prompt-file"])
def test_removed_flags_are_refused(flag, capsys):
    with pytest.raises(SystemExit) as e:
        decode.main([flag, "x"])
    assert e.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--method", "vegas-all"], ["--backend", "cuda"],
                                  ["--dtype", "int8"], ["--gamma", "two"]])
def test_bad_choices_are_refused_by_the_parser(args, capsys):
    with pytest.raises(SystemExit) as e:
        decode.main(args)
    assert e.value.code == 2 and "invalid" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------
# Bad input: exit code 2 and one line saying what is wrong
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--model", "qwen3-8"], "unknown model 'qwen3-8'"),
    (["--gamma", "0"], "--gamma must be a whole number >= 1"),
    (["--sparsity", "0"], "--sparsity must be in (0, 1]"),
    (["--sparsity", "1.5"], "--sparsity must be in (0, 1]"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k must be a whole number >= 0"),
    (["--min-p", "1"], "--min-p must be in [0, 1)"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--checkpoint", "/no/such/dir"], "/no/such/dir"),
    (["--model", "qwen3-8b"], "--checkpoint"),
    (["--prompt", "@/no/such/file.txt"], "prompt file not found: /no/such/file.txt"),
    (["--max-context", "9000"], "smollm2-135m supports at most 8192 positions"),
    (["--tp", "0"], "--tp must be"),
    (["--exact", "--tp", "2"], "--exact runs on one device: use --tp 1"),
])
def test_bad_input_is_a_clear_error(args, message, capsys):
    rc, _, err = main(capsys, *args)
    assert rc == 2, err
    assert message in err and err.startswith("error: ")
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--max-context", "8", "--prompt", "the cat sat on a mat the cat sat"],
     "exceeds tiny-qwen3's context of 8 tokens"),
    (["--max-batch", "0"], "--max-batch must be a whole number >= 1"),
])
def test_bad_input_of_a_loaded_model(ckpt, args, message, capsys):
    rc, _, err = main(capsys, "--checkpoint", ckpt, *args)
    assert rc == 2, err
    assert message in err and "Traceback" not in err


def test_bad_input_as_the_user_sees_it():
    """The command itself: exit status 2, the message, no traceback."""
    r = run("--top-p", "0")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr == "error: --top-p must be in (0, 1], got 0.0\n"


# ---------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------

# The two runs below decode one prompt with the same settings: the second reuses the
# programs the first compiled.
RUN = ("--max-new-tokens", "6", "--method", "vegas", "--gamma", "2")


def test_json_run_of_a_text_prompt(ckpt, capsys):
    rc, out, err = main(capsys, "--checkpoint", ckpt, "--prompt", "the cat sat on a mat",
                        *RUN, "--json")
    assert rc == 0, err
    assert not err  # --json prints nothing else
    out = json.loads(out)
    assert out["model"] == "tiny-qwen3" and out["method"] == "vegas"
    (res,) = out["results"]
    assert res["prompt"] == "the cat sat on a mat"  # no chat template: as it is
    assert 1 <= len(res["tokens"]) <= 6 and isinstance(res["text"], str)
    st = out["stats"]
    assert st["method"] == "vegas" and st["gamma"] == 2 and st["prompts"] == 1
    if st["rounds"]:
        assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))


def test_streams_a_file_prompt_and_prints_stats(ckpt, tmp_path, capsys):
    f = tmp_path / "prompt.txt"
    f.write_text("hello world the mat")
    rc, out, err = main(capsys, "--checkpoint", ckpt, "--prompt", f"@{f}", *RUN)
    assert rc == 0, err
    assert "loaded tiny-qwen3 (fp32)" in err and "tok/s" in err and "tau=" in err
    assert "method=vegas gamma=2" in err
    assert out.endswith("\n")


def test_auto_prints_what_it_ran(ckpt, capsys):
    """auto on the CPU (the XLA path: the model's own draft weights alone) where no round
    can pay: its line says it decoded plainly and why; --json has its stats."""
    args = ("--checkpoint", ckpt, "--prompt", "the cat sat on a mat", "--max-new-tokens", "6",
            "--method", "auto", "--gamma", "2")
    rc, out, err = main(capsys, *args)
    assert rc == 0, err
    assert "method=auto decoded plainly" in err and "no round compiled" in err
    rc, out, err = main(capsys, *args, "--json")
    auto = json.loads(out)["stats"]["auto"]
    from vegas_jax.quant import DRAFT_WEIGHTS

    assert auto["formats"] == [] and set(auto["formats_dropped"]) == set(DRAFT_WEIGHTS)
    assert not auto["rounds_allowed"] and auto["start"] == "vanilla"


@pytest.mark.slow
def test_json_run_on_the_default_model():
    r = run("--prompt", "Name three colours.", "--max-new-tokens", "12", "--json",
            "--method", "vegas", "--gamma", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    res, st = out["results"][0], out["stats"]
    assert out["model"] == "smollm2-135m" and len(res["tokens"]) == 12 and res["text"]
    assert res["prompt"] == "Name three colours."  # as typed (the model got the chat template)
    assert st["prompt_tokens"][0] > 20  # SmolLM2's template adds a system message
    st = out["stats"]
    assert st["method"] == "vegas" and st["gamma"] == 3
    assert st["tau"] == pytest.approx(1 + sum(st["acceptance_cumulative"]))


# ---------------------------------------------------------------------------------------
# The compilation cache: $VEGAS_JAX_COMPILE_CACHE only
# ---------------------------------------------------------------------------------------

def test_compile_cache_comes_from_the_environment(monkeypatch, tmp_path):
    """The directory $VEGAS_JAX_COMPILE_CACHE names (default ~/.cache/vegas_jax/xla);
    'off' turns JAX's persistent cache off even where JAX_COMPILATION_CACHE_DIR set one
    (the tests' own processes run with it)."""
    import jax

    from vegas_jax.cli import CACHE_ENV, default_compile_cache, enable_compile_cache

    assert CACHE_ENV == "VEGAS_JAX_COMPILE_CACHE"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert default_compile_cache() == str(tmp_path / "c")
    monkeypatch.delenv(CACHE_ENV)
    assert default_compile_cache() == os.path.join(os.path.expanduser("~"), ".cache",
                                                   "vegas_jax", "xla")
    monkeypatch.setenv(CACHE_ENV, "off")
    assert enable_compile_cache(default_compile_cache()) is None
    assert jax.config.jax_compilation_cache_dir is None
    assert enable_compile_cache(str(tmp_path / "c")) == str(tmp_path / "c")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")


@pytest.mark.slow
def test_compile_cache_is_written_and_reused(ckpt, tmp_path):
    """$VEGAS_JAX_COMPILE_CACHE=DIR fills DIR on the first run; a second run of the same
    shapes finds its programs there (and prints the same tokens). ('off':
    `test_compile_cache_comes_from_the_environment`.)"""
    cache = tmp_path / "xla"
    args = ("--checkpoint", ckpt, "--prompt", "the cat sat", "--max-new-tokens", "6", "--json",
            "--method", "vegas", "--gamma", "2")
    first = run(*args, env={"VEGAS_JAX_COMPILE_CACHE": str(cache)})
    assert first.returncode == 0, first.stderr
    entries = set(os.listdir(cache))
    assert any("spec_round" in e for e in entries), sorted(entries)[:10]
    second = run(*args, env={"VEGAS_JAX_COMPILE_CACHE": str(cache)})
    assert second.returncode == 0, second.stderr
    assert set(os.listdir(cache)) == entries  # nothing new had to be compiled
    assert json.loads(second.stdout)["results"] == json.loads(first.stdout)["results"]


# ---------------------------------------------------------------------------------------
# Streaming: a character split across tokens
# ---------------------------------------------------------------------------------------

def test_stream_never_prints_half_a_character(smollm2_gguf, capsys):
    """SmolLM2 spells '☃' in three byte tokens: the stream holds the first two back until the
    third comes, and where the token limit falls between them, prints the text the result
    carries (`decode_text` leaves the half character off too), never U+FFFD."""
    from types import SimpleNamespace

    from vegas_jax.checkpoint import gguf
    from vegas_jax.prompts import decode_text

    tok = gguf.read_tokenizer(gguf.open_gguf(smollm2_gguf))
    ids = tok.encode("Snow ☃ falls")
    assert len(ids) == 5 and "\ufffd" in tok.decode(ids[:3])  # the snowman takes ids 1..3
    for n in (len(ids), 3, 2):
        stream = decode.Streamer(tok)
        for t in ids[:n]:
            stream([[t]])
        out = capsys.readouterr().out
        assert "\ufffd" not in out
        assert [out] == decode_text(SimpleNamespace(tokenizer=tok), [ids[:n]])
    assert out == "Snow "
