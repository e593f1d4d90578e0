"""Ctrl-C (SIGINT) sent to `python -m vegas_jax.decode` at several moments: importing,
loading, compiling with a cold compilation cache, auto's build of its other candidates,
decoding. Each time the process ends at once with exit code 130, one line on stderr after
its own log lines and no traceback; what it streamed stays on stdout."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG = "[vegas_jax] "


def interrupt(tmp_path, moment: str, *args):
    """Starts the command with a cold compilation cache of its own, sends SIGINT at
    `moment` and returns (exit code, stdout, stderr, seconds from the signal to the exit)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
           "VEGAS_JAX_COMPILE_CACHE": str(tmp_path / "xla")}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # cold: every program compiles
    p = subprocess.Popen([sys.executable, "-m", "vegas_jax.decode", *args], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen_out, seen_err = b"", b""
    if moment.startswith("after "):
        time.sleep(float(moment.split()[1]))
    elif moment == "loaded":  # the log line that says loading is over: compiling comes next
        while b"loaded" not in seen_err:
            line = p.stderr.readline()
            assert line, "the command ended before loading"
            seen_err += line
    elif moment.startswith("streamed"):  # the first bytes of the answer are out
        seen_out = p.stdout.read1(1)
        assert seen_out, "the command ended before streaming"
        time.sleep(float(moment.split()[1]))
    t = time.perf_counter()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return (p.returncode, (seen_out + out).decode(), (seen_err + err).decode(),
            time.perf_counter() - t)


def assert_quiet_exit(rc, err, took):
    lines = [line for line in err.splitlines() if line and not line.startswith(LOG)]
    assert rc == 130, err
    assert lines == ["interrupted"] and err.endswith("interrupted\n"), err
    assert took < 10, took  # at once: no wait for a compile or a build to finish


@pytest.mark.parametrize("moment", ["after 0.3", "after 1.5", "loaded"])
def test_ctrl_c_while_importing_loading_or_compiling(tmp_path, moment):
    rc, out, err, took = interrupt(tmp_path, moment, "--max-new-tokens", "32")
    assert_quiet_exit(rc, err, took)
    assert out == ""


@pytest.mark.parametrize("method, wait", [
    ("vegas", 0.0), pytest.param("vegas", 1.0, marks=pytest.mark.slow),
    pytest.param("auto", 1.0, marks=pytest.mark.slow)])
def test_ctrl_c_while_decoding(tmp_path, method, wait):
    """After the first streamed bytes: decoding, compiling its next calls or (auto, a
    generation long enough to try its other candidates) building them in a thread."""
    rc, out, err, took = interrupt(tmp_path, f"streamed {wait}", "--max-new-tokens", "400",
                                   "--method", method)
    assert_quiet_exit(rc, err, took)
    assert out and "\ufffd" not in out  # the streamed text stays
