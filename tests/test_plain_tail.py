"""A fixed method's batch finishes with plain steps once few sequences are left
(`SpecConfig.plain_tail`): same tokens as vanilla, the switch where the rule says."""

import numpy as np
import pytest

from vegas_jax.generate import generate
from vegas_jax.sampling import SamplingParams
from vegas_jax.speculative import SpecConfig, speculative_generate
from tests.tiny import tiny_model


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(scale=0.3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 100, size=n).tolist() for n in (40, 220, 90)]


# two sequences stop early: the third decodes alone for ~30 tokens
LIMITS = [40, 8, 8]


def test_tail_size_follows_batch_times_sparsity():
    assert SpecConfig(sparsity=0.07).tail_size(128) == 8
    assert SpecConfig(sparsity=0.07).tail_size(64) == 4
    assert SpecConfig(sparsity=0.07).tail_size(14) == 0  # below 1 / sparsity: never
    assert SpecConfig(sparsity=0.07).tail_size(1) == 0
    assert SpecConfig(sparsity=0.07, plain_tail=False).tail_size(128) == 0
    assert SpecConfig(method="auto", sparsity=0.07).tail_size(128) == 0  # its own choice
    with pytest.raises(TypeError, match="plain_tail"):
        SpecConfig(plain_tail="yes")


@pytest.mark.parametrize("method", ["vegas", "stream"])
def test_greedy_tail_in_plain_steps_equals_vanilla(tiny, prompts, method):
    ref = generate(tiny, prompts, LIMITS)
    on = speculative_generate(tiny, prompts, LIMITS,
                              SpecConfig(method=method, gamma=3, sparsity=0.4, min_tokens=8))
    off = speculative_generate(tiny, prompts, LIMITS,
                               SpecConfig(method=method, gamma=3, sparsity=0.4, min_tokens=8,
                                          plain_tail=False))
    assert on.tokens == ref.tokens and off.tokens == ref.tokens
    assert on.stats["tail_size"] == 1 and off.stats["tail_size"] == 0
    assert on.stats["tail_plain_calls"] >= 1 and off.stats["tail_plain_calls"] == 0
    # the lone sequence's last tokens came from plain steps, not rounds
    assert on.stats["rounds"] < off.stats["rounds"]
    assert None in on.stats["accepted_by_call"]


def test_plain_tail_with_refilled_slots(tiny, prompts):
    """More prompts than slots: the batch refills, and the long sequence still ends alone
    in plain steps once no prompt waits."""
    many = prompts + prompts[:2]
    limits = LIMITS + [8, 8]
    ref = generate(tiny, many, limits)
    res = speculative_generate(tiny, many, limits,
                               SpecConfig(gamma=3, sparsity=0.4, min_tokens=8), max_batch=3)
    assert res.tokens == ref.tokens
    assert res.stats["refills"] == 2 and res.stats["tail_plain_calls"] >= 1
    acc = res.stats["accepted_by_call"]  # a plain call is None; none before the last refill
    first_plain = next(i for i, a in enumerate(acc) if a is None)
    assert all(a is None for a in acc[first_plain:])


def test_sampled_tail_keeps_lengths(tiny, prompts):
    sp = SamplingParams(0.8, top_k=20)
    res = speculative_generate(tiny, prompts, LIMITS,
                               SpecConfig(gamma=3, sparsity=0.4, min_tokens=8), sp, seed=2)
    assert [len(t) for t in res.tokens] == LIMITS
    assert res.stats["tail_plain_calls"] >= 1
