"""Tensor parallel on CPU devices (XLA's --xla_force_host_platform_device_count, in a
subprocess: the device count is fixed when JAX starts). Greedy fp32 tokens and tau with
tp = 2 and 4 equal tp = 1 for vanilla and the methods, on the XLA path (XLA partitions
every op) and through the Pallas kernels in interpret mode (run per device in
shard_map, the captured scores averaged across devices; the Pallas backend on the CPU
interprets its kernels by itself)."""

import json
import os
import subprocess
import sys

import pytest

from tests.tiny import tiny_config
from vegas_jax.sharding import check_tp

SCRIPT = r"""
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from tests.tiny import TinyModel, tiny_config
from vegas_jax import SpecConfig
from vegas_jax.execution import ExecConfig
from vegas_jax.generate import generate
from vegas_jax.params import init_params
from vegas_jax.sharding import check_tp, place_params
from vegas_jax.speculative import speculative_generate

cfg = dataclasses.replace(tiny_config(), num_heads=8, num_kv_heads=4)
params = init_params(cfg, jax.random.PRNGKey(0), jnp.float32, scale=0.3)
rng = np.random.default_rng(1)
prompts = [rng.integers(0, 100, size=n).tolist() for n in (20, 45)]
spec = lambda m: SpecConfig(method=m, gamma=3, min_tokens=8)

def model(tp, backend="xla"):
    check_tp(cfg, tp)
    placed = place_params(params, cfg, tp)
    shards = len(placed.layers.w_qkv.sharding.device_set)
    return TinyModel(cfg, placed, None, ExecConfig(backend=backend, tp=tp)), shards

out = {}
for tp, backend, methods in RUNS:
    m, shards = model(tp, backend)
    key = f"{tp}-{backend}"
    out[key] = {"shards": shards}
    if "vanilla" in methods:
        out[key]["vanilla"] = generate(m, prompts, 10).tokens
    if "refill" in methods:
        out[key]["refill"] = generate(m, prompts + prompts[:1], 10, max_batch=2).tokens
    for meth in set(methods) - {"vanilla", "refill"}:
        r = speculative_generate(m, prompts, 10, spec(meth))
        out[key][meth] = [r.tokens, r.stats["tau"], r.stats["backend"]]
print("RESULT" + json.dumps(out))
"""
# (tp, backend, runs): tp 1 runs every method a sharded run compares its acceptance with.
# vegas: the capture and the selection (on the Pallas backend: the verify kernel's capture
# averaged across devices, the top-k kernel, the fused draft kernel a device); quest: the
# pages picked from sharded queries; refill: a slot refilled under tp.
RUNS = [(1, "xla", ("vanilla", "vegas", "quest")),
        (2, "xla", ("vanilla", "refill", "vegas")),
        (4, "xla", ("quest",)),
        (2, "pallas", ("vegas",))]


@pytest.fixture(scope="module")
def runs():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-c", f"RUNS = {RUNS!r}\n" + SCRIPT], capture_output=True,
                       text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


@pytest.mark.slow
@pytest.mark.parametrize("key", ["2-xla", "4-xla", "2-pallas"])
def test_tp_equals_one_device(runs, key):
    ref, got = runs["1-xla"], runs[key]
    assert got["shards"] == int(key[0])  # the weights really are split
    methods = next(m for tp, backend, m in RUNS if f"{tp}-{backend}" == key)
    assert methods
    if "vanilla" in methods:
        assert got["vanilla"] == ref["vanilla"]
    if "refill" in methods:  # a slot refilled under tp
        assert got["refill"] == ref["vanilla"] + ref["vanilla"][:1]
    for meth in set(methods) - {"vanilla", "refill"}:
        tokens, tau, backend = got[meth]
        assert backend == key.split("-")[1]
        assert tokens == ref["vanilla"], meth  # lossless
        assert tau == ref[meth][1], meth  # same drafts, same acceptance


def test_tp_must_divide_the_kv_heads_and_fit_the_devices():
    cfg = tiny_config()  # 2 KV heads
    with pytest.raises(ValueError, match="divide"):
        check_tp(cfg, 3)
    with pytest.raises(ValueError, match="devices"):
        check_tp(cfg, 2)  # one CPU device in this process
    with pytest.raises(ValueError, match="whole number"):
        check_tp(cfg, 0)


def test_sharding_rules_name_specs_by_logical_axis():
    from jax.sharding import PartitionSpec as P

    from vegas_jax.sharding import AXIS, TP_RULES, ShardingRules

    cache = ("layers", "batch", "kv_heads", "keys", "head_dim")
    assert TP_RULES.spec(cache) == P(None, None, AXIS, None, None)
    assert TP_RULES.spec(("batch", "seq", "qkv")) == P(None, None, AXIS)
    assert TP_RULES.spec(()) == P()
    assert ShardingRules(kv_heads=None).spec(cache) == P(None, None, None, None, None)
    with pytest.raises(ValueError, match="unknown logical axes"):
        TP_RULES.spec(("batch", "heads"))
