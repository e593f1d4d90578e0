"""The draft-kernel tuning tools' inputs (their timings need a GPU: benchmarks only)."""

import jax
import numpy as np
import pytest

from benchmarks import tune_draft_gemm
from benchmarks.tune_sparse_step import GRIDS, selected_positions
from pallas_kernels.sparse_attention import StepBlocks
from vegas_jax.config import get_config


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
    merged = [bl.whole.merge_tail for _, bl in GRIDS["merge"][1:]]
    assert merged.count(True) == merged.count(False) > 0


def test_draft_gemm_shapes_are_smollm2s():
    assert tune_draft_gemm.shapes(get_config("smollm2-135m")) == [
        ("qkv", 576, 960), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576),
        ("lm_head", 576, 49152)]
