"""Lossless on real weights: SmolLM2-135M (fp32, CPU), prompts of real text of 66 to
1146 tokens in one batch, 96 new tokens: every method's greedy output equals vanilla
greedy token for token, over many rounds with partial acceptance.

The 66-token prompt starts below the min_tokens floor (every draft selects its whole
context) and grows past it; the 645-token one sits on the floor (clamped budget); the
1146-token one is above it (budget = sparsity * length)."""

import jax.numpy as jnp
import pytest

from vegas_jax import SpecConfig, generate, speculative_generate
from vegas_jax.loading import load_model
from vegas_jax.workloads import long_prompts

pytestmark = pytest.mark.slow

NEW = 96
MIN_TOKENS = 70


@pytest.fixture(scope="module")
def setup():
    model = load_model(dtype=jnp.float32)
    prompts = long_prompts(model.tokenizer, [20, 600, 1100], "prose")
    lens = [len(model.tokenizer.encode(p)) for p in prompts]
    assert lens[0] < MIN_TOKENS < 0.07 * lens[2] and 0.07 * lens[1] < MIN_TOKENS
    assert max(lens) < 2048
    return model, prompts, generate(model, prompts, NEW)


# vegas-all and last differ from vegas only in the verify rows they capture: the tiny-model
# tests run them in CI, and the GPU equality table (BENCHMARKS.md) on these weights.
@pytest.mark.parametrize("method,new", [("vegas", NEW), ("stream", NEW), ("quest", NEW)])
def test_greedy_matches_vanilla_on_real_weights(setup, method, new):
    model, prompts, ref = setup
    assert all(len(t) == NEW for t in ref.tokens)  # no early EOS: the runs are long
    res = speculative_generate(model, prompts, new,
                               SpecConfig(method=method, gamma=5, min_tokens=MIN_TOKENS))
    assert res.tokens == [t[:new] for t in ref.tokens]  # greedy: a prefix of the long run
    st = res.stats
    # partial acceptance happened: neither every draft kept nor none
    assert 1.0 < st["tau"] < 6.0, st["tau"]
    assert st["rounds"] >= new // 6
