"""Where the test suite's time goes: a pytest plugin that writes, per test, its wall time
(setup to teardown), its worker's CPU time and the JAX compile events' durations.

    PYTHONPATH=. python -m pytest -q -p benchmarks.pytest_profile   # then:
    python -m benchmarks.pytest_profile          # per-file table of $PROFILE_DIR/*.jsonl

One JSON line a test in $PROFILE_DIR (default /tmp/pytest_profile)/<xdist worker>.jsonl.
The CPU time is the worker process's: subprocesses and notebook kernels are not in it.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

DIR = Path(os.environ.get("PROFILE_DIR", "/tmp/pytest_profile"))
_events: collections.Counter = collections.Counter()
_start: dict = {}


def pytest_configure(config):
    import jax

    DIR.mkdir(parents=True, exist_ok=True)
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **kw: _events.update({event.rsplit("/", 1)[-1]: secs})
        if event.startswith("/jax/core/compile/") else None)


def pytest_runtest_setup(item):
    _events.clear()
    _start.update(wall=time.time(), cpu=time.process_time())


def pytest_runtest_teardown(item, nextitem):
    row = {"test": item.nodeid, "wall_s": time.time() - _start["wall"],
           "cpu_s": time.process_time() - _start["cpu"], **_events}
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(DIR / f"{worker}.jsonl", "a") as fh:
        fh.write(json.dumps(row) + "\n")


def main() -> int:
    files: dict = collections.defaultdict(collections.Counter)
    for path in DIR.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            c = files[row.pop("test").split("::")[0]]
            c.update({k: v for k, v in row.items() if isinstance(v, float)}, tests=1)
    if not files:
        print(f"no profile in {DIR}", file=sys.stderr)
        return 1
    print(f"{'file':44} tests  wall_s  cpu_s  compile_s")
    for f, c in sorted(files.items(), key=lambda x: -x[1]["wall_s"]):
        print(f"{f:44} {c['tests']:5} {c['wall_s']:7.1f} {c['cpu_s']:6.1f} "
              f"{c['backend_compile_duration']:9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
