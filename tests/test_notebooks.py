"""The notebooks in notebooks/: committed with the outputs of a real run, and still runnable.

Each .ipynb is its own source, paired (jupytext, notebooks/jupytext.toml) with a py:percent
file of the same name for review. The fast tests check that the committed notebooks carry
outputs and no errors, and that each pair holds the same cells. The slow test executes each
notebook top to bottom (nbclient) so they cannot rot: in a fresh python3 kernel of the
interpreter running the tests, with notebooks/ as its working directory and the repository
on PYTHONPATH (so the install cell finds vegas_jax importable and installs nothing). Any
cell error fails the test.

The slow test runs the three notebooks at once, each at smaller sizes than its committed
run (shorter prompts, fewer new tokens, fewer sweep points: QUICK below), papermill-style:
each notebook keeps its sizes in one parameters cell (its source starts with
"# Parameters"), and the test inserts a cell of overrides right after it. Every cell of
the notebook still runs, with all its checks (e.g. speculative output == plain decoding);
only the sizes shrink. A fast test also keeps the notebooks on the current API (no deleted
module, option or method) and their text free of dated measurements.

To refresh the committed outputs after editing a notebook (on a CPU, a few minutes):

    python tests/test_notebooks.py                      # all notebooks, in place
    python tests/test_notebooks.py 02_why_vegas_works   # one
"""

from __future__ import annotations

import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parent.parent
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = ["01_quickstart.ipynb", "02_why_vegas_works.ipynb", "03_kernels.ipynb"]

# Each notebook takes minutes on a 2-core CPU at its own sizes, and the slow test runs all
# three at once; this cap only catches gross regressions (a shared, loaded CI machine can
# be several times slower).
MAX_SECONDS = 600
# The slow test's sizes (CI time), in place of the parameters cell's values. The prompts
# stay longer than the default draft budget floor (256 tokens), so drafts are sparse.
PARAMS_MARKER = "# Parameters"
QUICK = {
    # vegas and auto (the other methods: tests/test_speculative.py)
    "01_quickstart.ipynb": dict(PROMPT_TOKENS=500, N_NEW=16, METHODS=["vegas", "auto"]),
    # N_GEN 14: two verify windows of gamma + 1 = 7 tokens for section 2's analysis;
    # section 5's sweep reuses section 4's sparsity and adds one
    "02_why_vegas_works.ipynb": dict(PROMPT_TOKENS=400, N_GEN=14, SPARSITIES=[0.05, 0.15]),
    "03_kernels.ipynb": {},
}
# Committed outputs stay readable on a repository page: no long text dumps.
MAX_TEXT_CHARS = 5000


def _kernel_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return env


def inject_parameters(nb, params: dict):
    """Insert a cell assigning `params` right after the notebook's parameters cell (which
    must assign each of them), so they replace its values for every later cell."""
    i = next(i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and c.source.startswith(PARAMS_MARKER))
    for key in params:
        assert re.search(rf"^{key} = ", nb.cells[i].source, re.M), (
            f"{key} is not a parameter of this notebook")
    source = "# injected by tests/test_notebooks.py\n" + "\n".join(
        f"{k} = {v!r}" for k, v in params.items())
    nb.cells.insert(i + 1, nbformat.v4.new_code_cell(source))


def execute(name: str, params: dict | None = None):
    """Run notebook `name` top to bottom, with `params` (if any) in place of its parameters
    cell's values; returns (executed notebook, seconds). Raises CellExecutionError on the
    first failing cell. No per-cell timestamps are recorded, so a re-run changes only what
    the cells print and draw."""
    nb = nbformat.read(str(NB_DIR / name), as_version=4)
    if params:
        inject_parameters(nb, params)
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=MAX_SECONDS, allow_errors=False,
        record_timing=False, resources={"metadata": {"path": str(NB_DIR)}},
    )
    t0 = time.perf_counter()
    client.execute(env=_kernel_env())
    seconds = time.perf_counter() - t0
    # the kernel's interpreter version would churn with every machine: keep the name only
    nb.metadata["language_info"] = {"name": "python"}
    return nb, seconds


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(output) -> str:
    if output.output_type == "stream":
        return output.text
    return output.get("data", {}).get("text/plain", "")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_outputs(name):
    """Committed with the outputs of a top-to-bottom run: every code cell ran, in order,
    without errors, and the outputs are of a size a repository page shows well."""
    nb = nbformat.read(str(NB_DIR / name), as_version=4)
    nbformat.validate(nb)
    cells = _code_cells(nb)
    assert any(c.outputs for c in cells), f"{name} has no outputs: run it and commit them"
    counts = [c.execution_count for c in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{name}: execution counts {counts}: run it top to bottom in a fresh kernel")
    for i, c in enumerate(cells):
        for o in c.outputs:
            assert o.output_type != "error", f"{name}, code cell {i}: {o.ename}: {o.evalue}"
            assert len(_text(o)) <= MAX_TEXT_CHARS, f"{name}, code cell {i}: long output"
    # the install cell found vegas_jax in the checkout it ran from
    install = next(c for c in cells if "def pip_install" in c.source)
    assert "vegas_jax from" in "".join(_text(o) for o in install.outputs)
    # the slow test's sizes replace parameters the notebook has
    params = [c for c in cells if c.source.startswith(PARAMS_MARKER)]
    assert len(params) == (1 if QUICK[name] else 0), f"{name}: one parameters cell"
    for key in QUICK[name]:
        assert re.search(rf"^{key} = ", params[0].source, re.M), f"{name}: no {key} parameter"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_pair_in_sync(name):
    """notebooks/NN_name.py (py:percent) holds the same cells as the .ipynb."""
    jupytext = pytest.importorskip("jupytext")
    paired = NB_DIR / name.replace(".ipynb", ".py")
    assert paired.is_file(), f"{paired.name} missing: jupytext --sync notebooks/{name}"
    text = jupytext.read(str(paired))
    nb = nbformat.read(str(NB_DIR / name), as_version=4)
    cells = lambda n: [(c.cell_type, c.source.strip()) for c in n.cells]  # noqa: E731
    assert cells(text) == cells(nb), (
        f"{name} and {paired.name} differ: jupytext --sync notebooks/{name}")


# Names the notebooks must not use: modules and options the library no longer has.
GONE = [r"vegas_jax\.runtime", r"vegas_jax\.selection", r"ExecConfig\(attn=",
        r"\battn_impl\b", r"SpecConfig\([^)]*exact=", r"kernels_runnable_here"]
# Text cells carry no measurements of their own: no dates, no cards (RESULTS.md has them).
STALE = [r"\b20\d\d-\d\d-\d\d\b", r"\bH[12]00\b", r"BENCHMARKS\.md"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_uses_the_current_api(name):
    """No cell uses a deleted module or option, every method a code cell names by string is
    the library's or a study plug-in's, and no text cell quotes a dated measurement."""
    from benchmarks.methods import PLUGINS
    from vegas_jax.methods import METHODS

    nb = nbformat.read(str(NB_DIR / name), as_version=4)
    for i, c in enumerate(nb.cells):
        for pat in GONE:
            assert not re.search(pat, c.source), f"{name}, cell {i}: uses {pat}"
        if c.cell_type == "markdown":
            for pat in STALE:
                assert not re.search(pat, c.source), f"{name}, cell {i}: stale {pat}"
        else:
            for m in re.findall(r"method=\"([\w-]+)\"", c.source):
                assert m in METHODS or m in PLUGINS, f"{name}, cell {i}: method {m!r}"
    names = re.findall(r"`([a-z]+(?:-[a-z]+)*)`", "".join(
        c.source for c in nb.cells if c.cell_type == "markdown"))
    for m in names:  # a method-like name in backticks that looks like ours
        if m.startswith("vegas-"):
            assert m in METHODS or m in PLUGINS, f"{name}: text names method {m!r}"


@pytest.fixture(scope="module")
def quick_runs():
    """run(name) -> (executed notebook, seconds) of the slow test's run of `name`. The
    first call starts every notebook's run at once, each in its own kernel process (the
    file's tests share one xdist worker: one after another, the others' cores would sit
    idle); the pool is shut down with the module."""
    pool = ThreadPoolExecutor(max_workers=len(NOTEBOOKS))
    futures = {}

    def run(name):
        if not futures:
            futures.update({n: pool.submit(execute, n, QUICK[n]) for n in NOTEBOOKS})
        return futures[name].result()

    yield run
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, quick_runs):
    nb, seconds = quick_runs(name)
    print(f"{name}: {seconds:.0f} s")
    assert seconds < MAX_SECONDS, f"{name} took {seconds:.0f} s"
    # the install cell must not have installed anything: vegas_jax came from this checkout
    install = next(c for c in nb.cells if "def pip_install" in c.source)
    outputs = "".join(o.get("text", "") for o in install.get("outputs", []))
    assert str(ROOT / "vegas_jax") in outputs, outputs


if __name__ == "__main__":  # refresh the committed outputs
    names = [n if n.endswith(".ipynb") else n + ".ipynb" for n in sys.argv[1:]] or NOTEBOOKS
    for name in names:
        nb, seconds = execute(name)
        nbformat.write(nb, str(NB_DIR / name))
        print(f"{name}: {seconds:.0f} s")
