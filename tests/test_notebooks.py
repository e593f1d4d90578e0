"""Execute every notebook in notebooks/ top to bottom (nbclient) so they cannot rot.

Each notebook runs in a fresh python3 kernel of the interpreter running the tests, with
notebooks/ as its working directory and the repository on PYTHONPATH (so the notebooks'
install cell finds vegas_jax importable and installs nothing). Any cell error fails the
test. The committed .ipynb files must match `notebooks/build.py` and carry no outputs.
"""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = ["01_quickstart.ipynb", "02_why_vegas_works.ipynb", "03_kernels.ipynb"]

# Each notebook takes ~1-2 min on a 2-core CPU; this cap only catches gross regressions
# (a shared, loaded CI machine can be 2-3x slower).
MAX_SECONDS = 600


def _kernel_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return env


def test_notebooks_match_build_script(tmp_path):
    """The committed notebooks are exactly what build.py writes (no outputs, no drift)."""
    spec = importlib.util.spec_from_file_location("notebooks_build", NB_DIR / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    assert sorted(build.NOTEBOOKS) == NOTEBOOKS
    for path in build.build(tmp_path):
        fresh = nbformat.read(str(path), as_version=4)
        committed = nbformat.read(str(NB_DIR / path.name), as_version=4)
        assert committed == fresh, f"{path.name} is stale: run python notebooks/build.py"
        assert all(not c.get("outputs") for c in committed.cells if c.cell_type == "code")


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name):
    nb = nbformat.read(str(NB_DIR / name), as_version=4)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=MAX_SECONDS, allow_errors=False,
        resources={"metadata": {"path": str(NB_DIR)}},
    )
    t0 = time.perf_counter()
    client.execute(env=_kernel_env())  # raises CellExecutionError on the first failing cell
    seconds = time.perf_counter() - t0
    print(f"{name}: {seconds:.0f} s")
    assert seconds < MAX_SECONDS, f"{name} took {seconds:.0f} s"
    # the install cell must not have installed anything: vegas_jax came from this checkout
    install = next(c for c in nb.cells if "def pip_install" in c.source)
    outputs = "".join(o.get("text", "") for o in install.get("outputs", []))
    assert str(ROOT / "vegas_jax") in outputs, outputs
