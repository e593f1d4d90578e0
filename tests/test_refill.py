"""More prompts than slots (`max_batch`): a finished sequence's slot is refilled with the
next prompt's prefill. Greedy fp32 output equals running each prompt alone, for vanilla
and the speculative methods, with sequences ending at EOS in the middle of a round.

conftest's tiny model and prompts: prompt 1 ends at its EOS after 6 tokens (prompt 4 at
its 12th); with three slots the batch compiles the programs test_speculative's batch of
three does (the persistent compilation cache serves them to this module)."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SPEC_EOS, SPEC_NEW

from vegas_jax import SpecConfig
from vegas_jax.driver import Refill, TokenCollector, put_slots, refill_group
from vegas_jax.generate import generate
from vegas_jax.speculative import speculative_generate

NEW = SPEC_NEW
SLOTS = 3


def spec(method):
    return SpecConfig(method=method, gamma=3, min_tokens=8)


@pytest.fixture(scope="module")
def setup(spec_model):
    model, prompts = spec_model
    alone = [generate(model, [p], NEW).tokens[0] for p in prompts]
    assert len(alone[1]) == 6 and alone[1][-1] == SPEC_EOS  # a sequence ends early
    assert len(alone[0]) == NEW
    return model, prompts, alone


def test_vanilla_refilled_slots_equal_each_prompt_alone(setup):
    model, prompts, alone = setup
    res = generate(model, prompts, NEW, max_batch=SLOTS)
    assert res.tokens == alone
    assert res.stats["batch"] == SLOTS and res.stats["refills"] == len(prompts) - SLOTS


# auto's controller with refilled slots (a slot's counts start over): test_speculative
@pytest.mark.parametrize("method", ["vegas", pytest.param("stream", marks=pytest.mark.slow),
                                    pytest.param("quest", marks=pytest.mark.slow)])
def test_speculative_refilled_slots_equal_each_prompt_alone(setup, method):
    model, prompts, alone = setup
    seen = []
    res = speculative_generate(model, prompts, NEW, spec(method), max_batch=SLOTS,
                               on_tokens=seen.append)
    assert res.tokens == alone
    assert res.stats["refills"] == len(prompts) - SLOTS
    # streamed per prompt, in order
    streamed = [[t for step in seen for t in step[i]] for i in range(len(prompts))]
    assert streamed == alone
    # every prompt decoded in rounds of its own, in whichever slot it got
    assert all(r > 0 for r in res.stats["rounds_by_sequence"])


@pytest.mark.slow
def test_slots_freed_together_are_refilled_by_one_prefill(setup):
    """8 slots, 12 prompts: the slots that finish in the same call are refilled in groups
    of refill_group(8) = 2 prompts per prefill; tokens still equal each prompt alone. (The
    loop's refill is the same for every method: a speculative state's group goes in by
    the same `put_slots`, tested above in groups of one.)"""
    model, prompts, alone = setup
    res = generate(model, prompts * 2, NEW, max_batch=8)
    assert res.tokens == alone * 2
    assert res.stats["refills"] == 4 and res.stats["refill_prefills"] < 4


@pytest.mark.slow
def test_one_slot_and_more_slots_than_prompts(setup):
    """One slot: each group is the whole batch (`put_slots` takes it whole)."""
    model, prompts, alone = setup
    one = speculative_generate(model, prompts[:3], NEW, spec("stream"), max_batch=1)
    assert one.tokens == alone[:3] and one.stats["batch"] == 1 and one.stats["refills"] == 2
    wide = generate(model, prompts[:3], NEW, max_batch=8)
    assert wide.tokens == alone[:3] and wide.stats["batch"] == 3
    assert wide.stats["refills"] == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_max_batch_must_be_a_positive_whole_number(setup, bad):
    model, prompts, _ = setup
    with pytest.raises(ValueError, match="max_batch"):
        generate(model, prompts, 4, max_batch=bad)
    with pytest.raises(ValueError, match="max_batch"):
        speculative_generate(model, prompts, 4, spec("vegas"), max_batch=bad)


def test_put_slots_replaces_the_given_rows_of_every_batch_leaf():
    from flax import struct

    @struct.dataclass
    class S:
        cache: jnp.ndarray  # [L, b, s]
        tok: jnp.ndarray  # [b]
        key: jnp.ndarray  # no batch axis

    def big():  # donated to put_slots: a fresh one each call
        return S(jnp.zeros((2, 4, 3)), jnp.zeros((4,), jnp.int32), jnp.arange(2))

    # a group of 2 rows (its last one padding) for slots 3 and 1
    grp = S(jnp.stack([jnp.ones((2, 3)), 2 * jnp.ones((2, 3))], 1),  # rows of 1s and 2s
            jnp.array([7, 9], jnp.int32), jnp.arange(2) + 5)
    out = put_slots(big(), grp, jnp.array([3], jnp.int32))
    assert out.cache[:, 3].tolist() == [[1.0] * 3] * 2 and float(out.cache.sum()) == 6.0
    assert out.tok.tolist() == [0, 0, 0, 7] and out.key.tolist() == [0, 1]
    out = put_slots(big(), grp, jnp.array([3, 1], jnp.int32))
    assert out.tok.tolist() == [0, 9, 0, 7] and float(out.cache[:, 1].sum()) == 12.0


def test_refill_groups_are_never_as_wide_as_the_batch():
    """put_slots finds the batch axis by the sizes: a group of as many rows as the batch
    would be ambiguous, so Refill pads it by one (and groups are powers of two else)."""
    assert [refill_group(b) for b in (1, 2, 4, 7, 8, 64, 100)] == [1, 1, 1, 1, 2, 16, 16]
    col = TokenCollector(4, 8, ())
    r = Refill([], None, col)
    assert [r.rows(k) for k in (1, 2, 3, 4)] == [1, 2, 5, 5]
    assert Refill([], None, TokenCollector(1, 8, ())).rows(1) == 1


def test_collector_hands_a_refilled_slot_its_prompts_first_token():
    """A slot given a new prompt (`assign`) reads that prompt's prefill token before the
    slot's next output; the finished prompt keeps what it had."""
    got = []
    col = TokenCollector(2, 3, (9,), on_tokens=got.append, n_prompts=3)
    assert col.add([[1], [2]]).tolist() == [True, True]
    assert col.add([[9], [3]]).tolist() == [False, True]  # prompt 0 ends at its EOS
    col.assign(0, 2, np.array([5]))
    col.add([[6], [4]])
    assert col.tokens == [[1, 9], [2, 3, 4], [5, 6]]
    assert got[-1] == [[], [4], [5, 6]]
    assert col.remaining().tolist() == [1, 0]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["vanilla", "vegas"])
def test_per_prompt_token_limits(setup, method):
    """One limit per prompt (a ragged workload): each prompt stops at its own limit (or
    EOS) and its tokens are the head of what it makes with a single limit, in static
    batches and through refilled slots."""
    model, prompts, alone = setup
    limits = [3, NEW, 9, 1, 17, 5]
    want = [a[:n] for a, n in zip(alone, limits)]
    run = (generate if method == "vanilla"
           else lambda *a, **k: speculative_generate(*a, spec=spec(method), **k))
    # a static batch (the first SLOTS prompts: the programs of the tests above), and all
    # six through refilled slots
    assert run(model, prompts[:SLOTS], limits[:SLOTS]).tokens == want[:SLOTS]
    assert run(model, prompts, limits, max_batch=SLOTS).tokens == want


@pytest.mark.parametrize("bad", [[4, 4], [4, 0, 4, 4, 4, 4], [4, 2.5, 4, 4, 4, 4]])
def test_per_prompt_limits_must_match_the_prompts(setup, bad):
    model, prompts, _ = setup
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(model, prompts, bad, spec("vegas"))
