"""`benchmarks.tune_sparse_step`'s inputs (its timings need a GPU: benchmarks only)."""

import jax
import numpy as np
import pytest

from benchmarks.tune_sparse_step import GRIDS, selected_positions
from pallas_kernels.sparse_attention import StepBlocks


@pytest.mark.parametrize("kind,run", [("random", None), ("runs4", 4), ("runs16", 16),
                                      ("contiguous", 37)])
def test_selected_positions(kind, run):
    x = np.asarray(selected_positions(jax.random.PRNGKey(1), kind, (2, 3), 37, 500))
    assert x.shape == (2, 3, 37)
    assert (np.diff(x, axis=-1) >= 0).all() and x.min() >= 0 and x.max() < 500
    if run:  # runs of `run` consecutive positions from aligned starts
        for row in x.reshape(-1, 37):
            starts = row[::run]
            assert (starts % run == 0).all()
            for i, s0 in enumerate(starts):
                seg = row[i * run:(i + 1) * run]
                np.testing.assert_array_equal(seg, s0 + np.arange(len(seg)))


def test_selected_positions_rejects_unknown_kind():
    with pytest.raises(ValueError, match="random, runsN or contiguous"):
        selected_positions(jax.random.PRNGKey(0), "runs", (1,), 8, 100)


def test_grids_hold_step_blocks():
    for name, grid in GRIDS.items():
        assert grid[0] == ("default", StepBlocks()), name
        assert len({n for n, _ in grid}) == len(grid), name
        assert all(isinstance(bl, StepBlocks) for _, bl in grid), name
