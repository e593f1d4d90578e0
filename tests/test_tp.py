"""Tensor parallel on CPU devices (XLA's --xla_force_host_platform_device_count, in a
subprocess: the device count is fixed when JAX starts). Greedy fp32 tokens and tau with
tp = 2 and 4 equal tp = 1 for vanilla and the methods, on the XLA path (XLA partitions
every op) and through the Pallas kernels in interpret mode (run per device in
shard_map, the captured scores averaged across devices)."""

import json
import os
import subprocess
import sys

import pytest

from tests.tiny import tiny_config
from vegas_jax.sharding import check_tp

SCRIPT = r"""
import dataclasses, functools, json
import jax, jax.numpy as jnp, numpy as np
from tests.tiny import TinyModel, tiny_config
from vegas_jax import SpecConfig
from vegas_jax.execution import ExecConfig
from vegas_jax.generate import generate
from vegas_jax.model import init_params
from vegas_jax.sharding import check_tp, place_params
from vegas_jax.speculative import speculative_generate

from pallas_kernels.sparse_attention import sparse_attention, sparse_step
from pallas_kernels.verify_attention import verify_attention
from vegas_jax import attention as attn_mod
attn_mod.verify_attention = functools.partial(verify_attention, interpret=True)
attn_mod.sparse_attention = functools.partial(sparse_attention, interpret=True)
attn_mod.sparse_step = functools.partial(sparse_step, interpret=True)
from pallas_kernels.topk import select_topk_fast
from vegas_jax import selection as sel_mod
sel_mod.select_topk_fast = functools.partial(select_topk_fast, interpret=True)

cfg = dataclasses.replace(tiny_config(), num_heads=8, num_kv_heads=4)
params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32, scale=0.3)
rng = np.random.default_rng(1)
prompts = [rng.integers(0, 100, size=n).tolist() for n in (20, 45)]
spec = lambda m: SpecConfig(method=m, gamma=3, min_tokens=8)

def model(tp, attn="xla"):
    check_tp(cfg, tp)
    placed = place_params(params, cfg, tp)
    shards = len(placed.layers.w_qkv.sharding.device_set)
    return TinyModel(cfg, placed, None, ExecConfig(attn=attn, tp=tp).resolve()), shards

out = {}
for tp, attn, methods in [(1, "xla", ("vegas", "stream", "quest", "vegas-heads")),
                          (2, "xla", ("vegas", "quest", "auto")),
                          (4, "xla", ("stream",)),
                          (2, "pallas", ("vegas", "vegas-heads"))]:
    m, shards = model(tp, attn)
    key = f"{tp}-{attn}"
    out[key] = {"shards": shards, "vanilla": generate(m, prompts, 10).tokens}
    if key == "2-xla":
        out[key]["refill"] = generate(m, prompts + prompts[:1], 10, max_batch=2).tokens
    for meth in methods:
        r = speculative_generate(m, prompts, 10, spec(meth))
        out[key][meth] = [r.tokens, r.stats["tau"]]
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def runs():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.parametrize("key", ["2-xla", "4-xla", "2-pallas"])
def test_tp_equals_one_device(runs, key):
    ref, got = runs["1-xla"], runs[key]
    assert got["shards"] == int(key[0])  # the weights really are split
    assert got["vanilla"] == ref["vanilla"]
    if "refill" in got:  # a slot refilled under tp
        assert got["refill"] == ref["vanilla"] + ref["vanilla"][:1]
    for meth in ("vegas", "stream", "quest", "auto", "vegas-heads"):
        if meth in got:
            assert got[meth][0] == ref["vanilla"], meth  # lossless
            if meth != "auto":  # auto's choices depend on timings
                assert got[meth][1] == ref[meth][1], meth  # same drafts, same acceptance


def test_tp_must_divide_the_kv_heads_and_fit_the_devices():
    cfg = tiny_config()  # 2 KV heads
    with pytest.raises(ValueError, match="divide"):
        check_tp(cfg, 3)
    with pytest.raises(ValueError, match="devices"):
        check_tp(cfg, 2)  # one CPU device in this process
    with pytest.raises(ValueError, match="whole number"):
        check_tp(cfg, 0)
