"""benchmarks/kernel_profile.py on the CPU: it runs the phases asked for end to end and writes
HLO (the kernel table itself needs a GPU trace; on the CPU it is empty).

The model is a registered name made for the test: SmolLM2-135M's architecture at tiny sizes
(tests/tiny.py), so the script's path (load_model by name with random weights, every phase
compiled, traced and timed, the HLO written) is the same while the CPU spends seconds, not
most of a minute, running 135M-parameter bf16 steps whose timings mean nothing here."""

import json

from benchmarks import kernel_profile
from tests.tiny import tiny_config
from vegas_jax import config


def test_runs_and_writes_hlo(tmp_path, capsys, monkeypatch):
    cfg = tiny_config("llama", vocab=256, layers=2)
    monkeypatch.setitem(config.REGISTRY, cfg.name, cfg)
    rc = kernel_profile.main(["--model", cfg.name, "--batch", "1", "--context", "200",
                              "--gamma", "2", "--attn-impl", "xla", "--hlo", str(tmp_path),
                              "--phases", "decode,draft,round",
                              "--json", str(tmp_path / "out.json")])
    assert rc == 0
    out = capsys.readouterr().out
    for label in ("decode step:", "draft step:", "round:"):
        assert label in out
    assert "verify+capture:" not in out  # only the phases asked for
    for name in ("decode", "draft", "round"):
        assert "HloModule" in (tmp_path / f"{name}.hlo.txt").read_text()[:200]
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["round"]["wall_ms"] > 0


def test_kinds():
    assert kernel_profile.kind_of("nvjet_sm90_tst_64x8") == "matmul"
    assert kernel_profile.kind_of("vegas_sparse_attention") == "attention"
    assert kernel_profile.kind_of("memcpy32_post") == "copy"
    assert kernel_profile.kind_of("input_scatter_fusion_2") == "scatter"
    assert kernel_profile.kind_of("loop_add_fusion") == "other"


def test_gmm_tile_sweep_times_each_tile(tmp_path, capsys, monkeypatch):
    """--gmm-tiles: the decode and draft steps once per expert-kernel tile, the tile read
    when the kernels are traced (the module's GMM_TILE swapped)."""
    from pallas_kernels import grouped_matmul as gm

    cfg = tiny_config("llama", vocab=256, layers=2)
    monkeypatch.setitem(config.REGISTRY, cfg.name, cfg)
    monkeypatch.setattr(gm, "GMM_TILE", gm.GMM_TILE)
    rc = kernel_profile.main(["--model", cfg.name, "--batch", "1", "--context", "200",
                              "--gamma", "2", "--attn-impl", "xla", "--phases", "decode",
                              "--gmm-tiles", "64,128,8,2,0",
                              "--json", str(tmp_path / "out.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode step, gmm tile 64,128,8,2,0" in out and "draft step, gmm tile" in out
    assert gm.GMM_TILE == gm.GmmTile(block_k=64, block_n=128, num_warps=8, num_stages=2,
                                     loop=False)


def test_whole_tile_sweep_swaps_the_step_blocks(tmp_path, capsys, monkeypatch):
    """--whole-tiles: the draft step and the round once per whole-pair draft-kernel tile,
    the module's STEP_BLOCKS swapped (its knobs read when the kernels are traced)."""
    from pallas_kernels import sparse_attention as sa

    cfg = tiny_config("llama", vocab=256, layers=2)
    monkeypatch.setitem(config.REGISTRY, cfg.name, cfg)
    monkeypatch.setattr(sa, "STEP_BLOCKS", sa.STEP_BLOCKS)
    rc = kernel_profile.main(["--model", cfg.name, "--batch", "1", "--context", "200",
                              "--gamma", "2", "--attn-impl", "xla", "--phases", "decode",
                              "--whole-tiles", "32,2,3,1,1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "draft step, whole tile 32,2,3,1,1" in out and "round, whole tile" in out
    assert sa.STEP_BLOCKS.whole == sa.SparseBlocks(block_k=32, num_warps=2, num_stages=3,
                                                   merge_tail=True, write_last=True)
