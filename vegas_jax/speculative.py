"""Self-speculative decoding (paper §3): gamma sparse drafts, one full-attention verify,
lossless acceptance, and the next selection from the verify's own attention, all in one
jitted round. Which KV entries a draft reads is the method's business (`methods`)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from vegas_jax.attention import AttnPlan, Capture, raw_capture
from vegas_jax.auto import AutoController
from vegas_jax.auto_choice import AutoPolicy
from vegas_jax.auto_formats import Sizes, candidate_formats, prepare_drafts
from vegas_jax.cache import KVCache
from vegas_jax.config import ModelConfig
from vegas_jax.driver import GenerationResult, Launch, Progress, launch, run_loop
from vegas_jax.driver import exec_config as exec_config_of
from vegas_jax.execution import ExecConfig, model_jit
from vegas_jax.generate import DecodeState, PlainRunner, decode_steps_body, generate
from vegas_jax.methods import DEFAULT_METHOD, SCORES, Auto, Method, method_named
from vegas_jax.model import forward
from vegas_jax.params import Params
from vegas_jax.prompts import encode_prompts
from vegas_jax.quant import check_draft_weights, draft_params
from vegas_jax.sampling import SamplingParams, accept, sample
from vegas_jax.tally import Tally


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Self-speculative decoding settings.

    method: a name from `methods.METHODS` or a `Method` object (e.g. `Stream(sink=4)`);
    names become objects here, once. gamma: draft tokens per round (auto: where it
    starts). sparsity: fraction of the context each draft step reads, in (0, 1].
    min_tokens: floor of that budget. score: "weight" (softmax weights, the authors'
    default) or "logit" (raw logits, the paper's formula). draft_weights: the weights
    drafts read (`quant.DRAFT_WEIGHTS`): "same" (the model's), or an "int8" / "int4"
    copy (lossless still: the verify keeps the model's own); auto: where it starts."""

    method: Method | str = DEFAULT_METHOD
    gamma: int = 6
    sparsity: float = 0.07
    min_tokens: int = 256
    score: str = "weight"
    draft_weights: str = "same"

    def __post_init__(self):
        object.__setattr__(self, "method", method_named(self.method))
        if int(self.gamma) != self.gamma or self.gamma < 1:
            raise ValueError(f"gamma must be a whole number >= 1, got {self.gamma}")
        if not 0 < self.sparsity <= 1:
            raise ValueError(f"sparsity must be in (0, 1], got {self.sparsity}")
        if int(self.min_tokens) != self.min_tokens or self.min_tokens < 1:
            raise ValueError(f"min_tokens must be a whole number >= 1, got {self.min_tokens}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        check_draft_weights(self.draft_weights)

    @property
    def name(self) -> str:
        return self.method.name


jax.tree_util.register_static(SpecConfig)


@struct.dataclass
class SpecState:
    cache: KVCache  # lengths = committed tokens n
    x0: jax.Array  # [b] last emitted token; sits at position n, not yet in the cache
    key: jax.Array
    sel: Any  # the method's selection state (`Method.init` / `update`)
    progress: Progress


def draft_phase(params, cfg: ModelConfig, xc: ExecConfig, state: SpecState, key,
                spec: SpecConfig, sp: SamplingParams):
    """gamma sparse single-token steps (a scan). Each writes its K/V at its true position
    (the verify rewrites them). Returns (cache, drafts [b, gamma], q): q is None (greedy),
    [b, gamma, v], or with top-k its sparse form ([b, gamma, k] indices, probabilities)."""
    n = state.cache.lengths
    active = ~state.progress.done

    def step(carry, xs):
        cache, tok = carry
        j, rng = xs
        pos = n + j
        plan = spec.method.draft_plan(spec, state.sel, state.cache, pos).replace(active=active)
        logits, cache, _ = forward(params, cfg, xc, tok[:, None], pos[:, None], cache, plan)
        nxt, q = sample(rng, logits[:, 0], sp)
        return (cache, nxt), (nxt, q)

    (cache, _), (drafts, q) = lax.scan(
        step, (state.cache, state.x0),
        (jnp.arange(spec.gamma, dtype=jnp.int32), jax.random.split(key, spec.gamma)),
    )
    return cache, drafts.T, jax.tree.map(lambda a: a.swapaxes(0, 1), q)


def verify_phase(params, cfg: ModelConfig, xc: ExecConfig, cache: KVCache, x0, drafts,
                 capture: Capture | None, active=None):
    """Full causal attention over x0, d_1..d_gamma at positions n..n+gamma: rewrites their
    K/V and, in the same attention call, captures the next selection's scores. active [b]
    (or None): finished sequences, False, read no cache.
    Returns (logits [b, gamma + 1, v], cache, scores | None)."""
    n = cache.lengths
    vtok = jnp.concatenate([x0[:, None], drafts], axis=1)
    vpos = n[:, None] + jnp.arange(drafts.shape[1] + 1, dtype=jnp.int32)
    return forward(params, cfg, xc, vtok, vpos, cache, AttnPlan(capture=capture, active=active))


def round_capture(spec: SpecConfig, cfg: ModelConfig, xc: ExecConfig,
                  max_len: int) -> Capture | None:
    """What a round's verify captures: the method's capture, handed over raw (the logits
    for the selection's own kernel) where the method and the kernels allow it."""
    cap = spec.method.capture(spec)
    if not spec.method.takes_raw(spec):
        return cap
    return raw_capture(cap, cfg, xc, max_len)


def prefill_capture(spec: SpecConfig) -> Capture | None:
    """The prefill's capture, when the method ranks anything: the last prompt token's row."""
    cap = spec.method.capture(spec)
    return None if cap is None else Capture((0,), "mean", cap.score)


@model_jit(static_argnames=("cfg", "xc", "spec", "sp"), donate_argnames=("state",))
def spec_round(params, cfg: ModelConfig, xc: ExecConfig, state: SpecState, spec: SpecConfig,
               sp: SamplingParams, draft: Params | None = None):
    """One round: gamma sparse drafts, one verify, acceptance, the next selection. draft:
    the params the drafts read (`quant.draft_params`); None: `params`.

    Returns (state, emitted [b, gamma + 1] with -1 after the last kept token, done [b],
    n_accepted [b], active [b] at the round's start). Finished sequences keep their length
    and token. (No `lax.cond` skips finished rounds: a conditional over the donated state
    makes XLA copy the whole cache.)"""
    gamma = spec.gamma
    n = state.cache.lengths  # [b]
    active = ~state.progress.done
    key, k_draft, k_acc = jax.random.split(state.key, 3)
    cache, drafts, q = draft_phase(params if draft is None else draft, cfg, xc, state, k_draft,
                                   spec, sp)
    logits, cache, scores = verify_phase(params, cfg, xc, cache, state.x0, drafts,
                                         round_capture(spec, cfg, xc, cache.max_len), active)
    n_acc, nxt = accept(k_acc, drafts, q, logits, sp)
    slot = jnp.arange(gamma + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    emitted = jnp.where(slot < n_acc[:, None], padded,
                        jnp.where(slot == n_acc[:, None], nxt[:, None], -1))
    emitted, progress = state.progress.emit(jnp.where(active[:, None], emitted, -1))
    sel = spec.method.update(spec, state.sel, scores, cache, n, n_acc, xc)
    new = SpecState(cache=cache.replace(lengths=jnp.where(active, n + n_acc + 1, n)),
                    x0=jnp.where(active, nxt, state.x0), key=key, sel=sel, progress=progress)
    return new, emitted, jnp.copy(progress.done), n_acc, active


@model_jit(static_argnames=("cfg", "xc", "spec", "sp", "n_steps"), donate_argnames=("state",))
def plain_steps(params, cfg: ModelConfig, xc: ExecConfig, state: SpecState, spec: SpecConfig,
                sp: SamplingParams, n_steps: int):
    """`n_steps` plain decoding steps from a speculative state (auto's plain calls), and the
    selection state the next round drafts from (`Method.after_plain`). Returns a round's
    outputs with no acceptance: (state, emitted [b, n_steps], done [b], None, None)."""
    ds, toks, done = decode_steps_body(params, cfg, xc, DecodeState(
        state.cache, state.x0, state.key, state.progress), sp, n_steps)
    sel = spec.method.after_plain(spec, state.sel, ds.cache.lengths)
    return SpecState(ds.cache, ds.tok, ds.key, sel, ds.progress), toks, done, None, None


@functools.partial(jax.jit, static_argnames=("spec", "xc"), donate_argnames=("cache",))
def init_state(spec: SpecConfig, xc: ExecConfig, cache: KVCache, x0, key, scores,
               progress: Progress) -> SpecState:
    """The first state after a prefill (jitted: the selection run op by op is slow, and
    every refilled slot pays it again)."""
    sel = spec.method.init(spec, cache, scores, cache.lengths, xc)
    return SpecState(cache=cache, x0=x0, key=key, sel=sel, progress=progress)


def _runner(model, xc: ExecConfig, spec: SpecConfig, sampling: SamplingParams,
            plain_steps_n: int = 0, draft: Params | None = None) -> Callable:
    """run(state) -> (state, outputs) for one device call: a round, or plain steps.
    draft: the params the drafts read (None: the model's)."""
    cfg = model.config

    def run(st):
        if plain_steps_n:
            st, *out = plain_steps(model.params, cfg, xc, st, spec, sampling, plain_steps_n)
        else:
            st, *out = spec_round(model.params, cfg, xc, st, spec, sampling, draft)
        return st, tuple(out)
    return run


class SpecRunner:
    """`run_loop`'s runner for speculative rounds: one method's, or auto's choice of
    rounds and plain steps (`AutoController`)."""

    def __init__(self, model, lc: Launch, spec: SpecConfig, sampling: SamplingParams,
                 auto: AutoController | None, drafts: Callable[[str], Params | None]):
        """drafts(format): the params the drafts of that format read (`quant.draft_params`;
        None: the model's): `spec.draft_weights`, or each auto candidate's (made by the
        first call that needs it: `auto_formats.DraftCopies`)."""
        self.spec, self.xc, self.key, self.auto = spec, lc.xc, lc.key, auto
        self.name, self.capture = spec.name, prefill_capture(spec)
        self.tally = Tally(len(lc.ids))
        if auto is None:
            self.step = _runner(model, lc.xc, spec, sampling, draft=drafts(spec.draft_weights))
            return

        def make(config):  # plain decoding on the same cache, or a round of (gamma, format)
            if config.plain:
                low = dataclasses.replace(auto.spec, gamma=min(auto.gammas),
                                          draft_weights=config.draft_weights)
                return _runner(model, lc.xc, low, sampling, auto.policy.plain_steps)
            spec_c = dataclasses.replace(auto.spec, gamma=config.gamma,
                                         draft_weights=config.draft_weights)
            return lambda st: _runner(model, lc.xc, spec_c, sampling,
                                      draft=drafts(config.draft_weights))(st)

        auto.prepare(make)  # the start builds on its first call, the rest later
        self.step = lambda st: auto.run(auto.choose(), st)

    def _init_args(self, cache, first, scores, progress):
        return (self.spec, self.xc, cache, first, self.key, scores, progress)

    def compile_init(self, *parts):
        init_state.lower(*self._init_args(*parts)).compile()

    def init(self, *parts) -> SpecState:
        return init_state(*self._init_args(*parts))

    def count(self, out, ready_at, wait_s, collector, waiting):
        emitted, _, n_acc, was_active = out
        if self.auto is not None:  # tokens left matter while no prompt waits for a slot
            self.auto.read(n_acc, was_active, ready_at, wait_s,
                           None if waiting else collector.remaining())
        self.tally.add(emitted.shape[1] - 1, n_acc, was_active,
                       collector.owner[was_active] if n_acc is not None else None)

    def stats(self) -> dict:
        st = self.tally.stats()
        if self.auto is None:
            return {"gamma": self.spec.gamma, "sparsity": self.spec.sparsity, **st}
        # auto: the gamma of most rounds (0: none ran); `by_gamma` and `auto` say the rest
        ran = max(st["by_gamma"].items(), key=lambda kv: kv[1]["rounds"], default=(0, None))
        return {"gamma": ran[0], "sparsity": self.spec.sparsity, **st,
                "auto": self.auto.stats()}


class AutoPlainRunner(PlainRunner):
    """auto where no round can pay (`auto_bound`): vanilla's plain steps and programs
    (no capture, no selection, no round compiled), each call through the controller,
    which times and reports it."""

    name = "auto"

    def __init__(self, model, lc: Launch, spec: SpecConfig, sampling: SamplingParams,
                 auto: AutoController):
        super().__init__(model, lc.xc, sampling, lc.key, auto.policy.plain_steps)
        self.auto, self.sparsity, self.tally = auto, spec.sparsity, Tally(len(lc.ids))
        auto.decode_plainly(functools.partial(PlainRunner.step, self))

    def step(self, state):
        return self.auto.run(self.auto.choose(), state)

    def count(self, out, ready_at, wait_s, collector, waiting):
        self.auto.read(None, None, ready_at, wait_s, None if waiting else collector.remaining())
        self.tally.add(0, None, None, None)

    def stats(self) -> dict:
        return {"gamma": 0, "sparsity": self.sparsity, **self.tally.stats(),
                "auto": self.auto.stats()}


def speculative_generate(
    model,
    prompts,
    max_new_tokens: int | Sequence[int] = 128,
    spec: SpecConfig = SpecConfig(),
    sampling: SamplingParams = SamplingParams(),
    seed: int = 0,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    max_batch: int | None = None,
    exec_config: ExecConfig | None = None,
    auto_policy: AutoPolicy = AutoPolicy(),
) -> GenerationResult:
    """Self-speculative decoding of prompts (conversations of {"role", "content"} messages,
    raw strings or token ids: `vegas_jax.prompts.encode_prompts`); output has the vanilla
    distribution (greedy: the same tokens). `spec.method="vanilla"` runs plain decoding;
    "auto" decodes plainly where no round can pay, else chooses gamma and the drafts'
    weights (`Auto.formats`), or plain steps, as it goes (`auto_policy`: its settings).
    `max_batch`: at most this many sequences at once; each finished one's slot is
    refilled with the next prompt's prefill (results stay in prompt order).
    `max_new_tokens`: one limit, or one per prompt. `exec_config`: how to run (default:
    the model's)."""
    if not isinstance(spec, SpecConfig):
        raise TypeError("spec must be a SpecConfig")
    if not spec.method.speculative:
        res = generate(model, prompts, max_new_tokens, sampling, seed, on_tokens,
                       max_batch=max_batch, exec_config=exec_config)
        steps = max(len(t) for t in res.tokens) - 1  # one token per step after the prefill's
        res.stats.update(tau=1.0, gamma=0, acceptance_cumulative=[], rounds=steps)
        return res
    xc = exec_config_of(model, exec_config)
    auto = None
    if isinstance(spec.method, Auto):
        spec, refused = candidate_formats(spec, model, xc)
        auto = AutoController(spec, auto_policy)
        for f, why in refused.items():
            auto.drop_format(f, why)
    gamma = max(auto.gammas) if auto else spec.gamma
    # Room past the last kept token: a round writes gamma + 1 entries after n, and the last
    # round may overshoot max_new_tokens by gamma.
    extra = 2 * gamma + 2 + spec.method.extra_len()
    if auto is None:  # made before the cache, whose memory check then counts it
        drafts = {spec.draft_weights: draft_params(model, spec.draft_weights, xc)}.get
    else:  # the bound first (no copy where no round can pay), then the copies that fit
        prompts = encode_prompts(model, prompts)
        copies = prepare_drafts(model, xc, auto, Sizes.plan(model, prompts, max_new_tokens,
                                                            max_batch, extra))
        drafts = None if copies is None else copies.get
    lc = launch(model, prompts, max_new_tokens, sampling, extra, exec_config, max_batch, seed,
                on_tokens)
    if auto is not None and drafts is None:
        return run_loop(model, lc, sampling, AutoPlainRunner(model, lc, spec, sampling, auto))
    return run_loop(model, lc, sampling, SpecRunner(model, lc, spec, sampling, auto, drafts))
