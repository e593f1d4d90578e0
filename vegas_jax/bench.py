"""`python -m vegas_jax.bench`: one workload under every method, one table.

For each method: decode tokens/s, speedup over vanilla, tau (tokens per round),
per-position acceptance, and the time of one round split into draft / verify / select
(measured by timing the round's jitted phases alone on a live state). Every method's
compile is left out of its tokens/s: a fixed method's first call is not timed, and auto
is timed after an untimed generation of the same shapes has compiled all its candidates.
With `--profile-only` (e.g. Qwen3-8B shapes with `--random-init`) no text is generated:
the cache is filled with random entries and only step times are measured, so throughput
can be projected for a given tau.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vegas_jax.auto_choice import AutoPolicy
from vegas_jax.cache import KVCache
from vegas_jax.cli import (
    HelpFormatter, add_model_args, add_sampling_args, dtype_from_arg, flag_error, load_from_args,
    sampling_from_args,
)
from vegas_jax.methods import METHODS
from vegas_jax.quant import check_draft_weights
from vegas_jax.speculative import SpecConfig

ALL_METHODS = ("vanilla", "stream", "quest", "last", "vegas-paper", "vegas", "auto")
# What the table's less obvious columns and the lines under it mean (printed with them and
# in --help)
LEGEND = (
    "= vanilla: sequences whose greedy tokens equal vanilla's, token for token (greedy only); "
    "acc@1..gamma: the share of rounds that accepted drafts 1..i",
    "round, draft, verify ms: a round and its phases, each jitted and timed alone; "
    "capture+select ms: the verify's extra time to capture scores plus the selection (n/a: "
    "the capture cost less than the timing noise)",
    "tail METHOD gGAMMA sSPARSITY: mean device ms a call (tokens/s) over the calls that ran "
    "every sequence, then over those with at most a quarter still running (the batch waiting "
    "for its slowest sequences)",
)


def _time(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls after one warm-up (which compiles)."""
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def synthetic_cache(cfg, batch: int, max_len: int, length: int, dtype) -> KVCache:
    """A full cache of pseudo-random entries for timing at sizes near the card's memory.

    Each buffer is written by one fused elementwise kernel (a hash of the position), so
    nothing larger than the cache itself is ever allocated: a zeros cache plus
    `jax.random.normal` would need three cache-sized buffers at once.
    """
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)

    @jax.jit
    def make(salt):
        h = salt
        for axis, mult in enumerate((0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)):
            h = h + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(mult)
        h = (h ^ (h >> 15)) * jnp.uint32(0x2C1B3C6D)
        h = h ^ (h >> 12)
        # Uniform in [-1.7, 1.7): unit variance, like normalised keys.
        return ((h >> 8).astype(jnp.float32) * (3.4 / 2**24) - 1.7).astype(dtype)

    # one half made before the other is dispatched: an allocation failure shows here, not
    # in the first call that reads the cache
    k = jax.block_until_ready(make(jnp.uint32(1)))
    return KVCache(k=k, v=jax.block_until_ready(make(jnp.uint32(2))),
                   lengths=jnp.full((batch,), length, jnp.int32))


def profile_cache(cfg, batch: int, context: int, gamma: int, dtype) -> KVCache:
    """A synthetic cache of `context` tokens with room for the rounds a profile runs."""
    max_len = -(-(context + 4 * gamma + 1) // 128) * 128
    return synthetic_cache(cfg, batch, max_len, context, dtype)


class Phases:
    """A round's phases as separate jitted calls on one live state, for timing and
    profiling: `draft()`, `verify(capture)`, `select()`, `round()` and `vanilla()` (8
    decode steps). Every call donates the cache and gets it back with its lengths restored
    (drafts and verify rewrite the same positions), so they can repeat at any context,
    even where a copy of the cache would not fit beside it."""

    def __init__(self, model, cache, spec, sampling, xc, scores=None, x0=None):
        from vegas_jax import speculative as S
        from vegas_jax.driver import Progress
        from vegas_jax.quant import draft_params
        from vegas_jax.sharding import place_cache

        cfg, self.params = model.config, model.params
        draft = draft_params(model, spec.draft_weights, xc)  # `SpecConfig.draft_weights`
        self.draft_params = model.params if draft is None else draft  # what drafts read
        cache = place_cache(cache, xc.tp)
        b = cache.batch
        self.n = cache.lengths + 0  # own buffer: the cache (with its lengths) is donated
        if scores is None:
            scores = jax.random.uniform(jax.random.PRNGKey(1),
                                        (len(cfg.full_layers), b, cache.max_len))
        x0 = jnp.zeros((b,), jnp.int32) if x0 is None else x0
        big = 1 << 30  # never stops: phases are timed, not generated
        self.state = S.init_state(spec, xc, cache, x0, jax.random.PRNGKey(0), scores,
                                  Progress.start(x0, big, ()))
        self.drafts = jnp.zeros((b, spec.gamma), jnp.int32)
        key = jax.random.PRNGKey(2)
        n = self.n
        opts = xc.compiler_options()

        def draft(p, c, st):  # only the cache is donated
            c, d, _ = S.draft_phase(p, cfg, xc, st.replace(cache=c), key, spec, sampling)
            return c.replace(lengths=n), d

        def verify(p, c, x, d, capture):
            cap = S.round_capture(spec, cfg, xc, c.max_len) if capture else None
            lg, c2, sc = S.verify_phase(p, cfg, xc, c, x, d, cap)
            return c2.replace(lengths=n), sc, lg[:, 0, :1]

        def select(st, sc):
            return spec.method.update(spec, st.sel, sc, st.cache, n, jnp.zeros_like(n), xc)

        self._draft = jax.jit(draft, donate_argnums=1, compiler_options=opts)
        self._verify = jax.jit(verify, static_argnames=("capture",), donate_argnums=1,
                               compiler_options=opts)
        self._select = jax.jit(select, compiler_options=opts)
        from vegas_jax.generate import DecodeState, decode_steps

        self._round_args = (cfg, xc, spec, sampling)
        self._round = lambda st: S.spec_round(self.params, cfg, xc, st, spec, sampling,
                                              self._draft_arg)
        self._vanilla = lambda st: decode_steps(self.params, cfg, xc, st, sampling, 8)
        self._decode_state = DecodeState
        self.scores = None
        self.x0 = x0

    @property
    def _draft_arg(self):
        """spec_round's draft argument: None for the model's own weights (the round as it
        always compiled)."""
        return None if self.draft_params is self.params else self.draft_params

    def hlo_texts(self, phases) -> dict[str, str]:
        """The optimised HLO of each named phase (decode, draft, verify, round)."""
        return {name: c.as_text() for name, c in self.compiled(phases).items()}

    def memory(self, phases) -> dict[str, dict[str, int]]:
        """XLA's memory plan of each named phase's executable, in bytes: arguments,
        outputs, outputs aliased to (donated) arguments, and temporaries (where a phase
        ran out of memory: a temporary the size of a cache half is a copy of it)."""
        out = {}
        for name, c in self.compiled(phases).items():
            m = c.memory_analysis()
            out[name] = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in
                         ("argument", "output", "alias", "temp")}
        return out

    def compiled(self, phases) -> dict:
        """Each named phase (decode, draft, verify, round) lowered and compiled anew."""
        from vegas_jax import speculative as S
        from vegas_jax.generate import decode_steps

        cfg, xc, spec, sp = self._round_args
        st, p, dp = self.state, self.params, self.draft_params
        lowered = {
            "decode": lambda: decode_steps.lower(p, cfg, xc, self._decode_state(
                st.cache, self.x0, jax.random.PRNGKey(3), st.progress), sp, 8),
            "draft": lambda: self._draft.lower(dp, st.cache, st.replace(cache=None)),
            "verify": lambda: self._verify.lower(p, st.cache, self.x0, self.drafts, capture=True),
            "round": lambda: S.spec_round.lower(p, cfg, xc, st, spec, sp, self._draft_arg),
        }
        return {name: lowered[name]().compile() for name in phases}

    def draft(self):
        cache, self.drafts = self._draft(self.draft_params, self.state.cache,
                                         self.state.replace(cache=None))
        self.state = self.state.replace(cache=cache)
        return self.drafts

    def verify(self, capture=True):
        cache, self.scores, lg = self._verify(self.params, self.state.cache, self.x0,
                                              self.drafts, capture=capture)
        self.state = self.state.replace(cache=cache)
        return lg

    def select(self):
        if self.scores is None:
            self.verify(True)
        return self._select(self.state, self.scores)

    def round(self):
        st, emitted, *_ = self._round(self.state)
        self.state = st.replace(cache=st.cache.replace(lengths=self.n + 0))
        return emitted

    def vanilla(self):
        # decode_steps donates its whole state: hand it copies of what the round keeps
        st = self._decode_state(self.state.cache, self.x0 + 0, jax.random.PRNGKey(3),
                                jax.tree.map(jnp.copy, self.state.progress))
        st, toks, _ = self._vanilla(st)
        self.state = self.state.replace(cache=st.cache.replace(lengths=self.n + 0))
        return toks


def selection_overhead(times: dict, spec: SpecConfig) -> float | None:
    """Milliseconds a round spends choosing the next drafts' entries: the verify's extra time
    with capture (a difference of two medians; none for a method that captures nothing) plus
    the select phase. None where the verify with capture timed faster than without: its cost
    is then below the timing noise, and a difference would go negative."""
    capture = times["verify_capture_ms"] - times["verify_ms"]
    if spec.method.capture(spec) is None:
        capture = 0.0  # both verifies are one program: their difference is noise alone
    return None if capture < 0 else capture + times["select_ms"]


def profile_round(model, ids_or_cache, spec: SpecConfig, sampling, reps: int = 5):
    """Milliseconds of one round's phases on a live state: draft (all gamma steps), verify
    without capture, verify with capture, selection, the whole jitted round, and one
    vanilla decode step. `ids_or_cache` is a list of prompts (token ids) to prefill, or a
    ready KVCache (synthetic, for --profile-only), which is donated: the cache is returned
    with its lengths restored, for the next call."""
    from vegas_jax.driver import exec_config, start
    from vegas_jax.prefill import prefill_prompts
    from vegas_jax.speculative import prefill_capture

    cfg, params = model.config, model.params
    if isinstance(ids_or_cache, list):
        ids, cache, xc = start(model, ids_or_cache, 64, sampling, 2 * spec.gamma + 2)
        logits, cache, scores = prefill_prompts(params, cfg, xc, ids, cache,
                                                prefill_capture(spec))
        x0 = jnp.argmax(logits, -1).astype(jnp.int32)
    else:
        xc = exec_config(model)
        cache, scores, x0 = ids_or_cache, None, None
    ph = Phases(model, cache, spec, sampling, xc, scores, x0)
    out = {}
    out["draft_ms"] = _time(ph.draft, reps) * 1e3
    out["verify_ms"] = _time(lambda: ph.verify(False), reps) * 1e3
    out["verify_capture_ms"] = _time(lambda: ph.verify(True), reps) * 1e3
    out["select_ms"] = _time(ph.select, reps) * 1e3
    out["selection_overhead_ms"] = selection_overhead(out, spec)
    out["vanilla_step_ms"] = _time(ph.vanilla, reps) * 1e3 / 8
    out["round_ms"] = _time(ph.round, reps) * 1e3
    return out, ph.state.cache.replace(lengths=ph.n)


def hf_reference(model, prompts, new_tokens: int, sampling, prompt_lookup: bool = False) -> dict:
    """The same weights and prompts through Hugging Face transformers on PyTorch (static KV
    cache; optionally prompt-lookup decoding): an outside reference for tokens/s.
    Decode throughput = extra tokens / extra time between a 1-token and an N-token call."""
    import torch
    import transformers

    from vegas_jax.checkpoint.hf import to_hf_config, to_hf_state_dict
    from vegas_jax.params import param_dtype, stack_layers

    if model.config.is_moe:
        # transformers holds the experts as fused tensors: load_state_dict below would skip
        # our per-expert names and leave them uninitialised
        raise ValueError("--hf-reference does not support mixture-of-experts models yet")

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = to_hf_config(model.config)
    config = transformers.AutoConfig.for_model(**hf_cfg)
    dtype = torch.bfloat16 if param_dtype(model.params) == jnp.bfloat16 else torch.float32
    tm = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    sd = {k: torch.from_numpy(np.asarray(v, np.float32)).to(dtype)
          for k, v in to_hf_state_dict(model.config, stack_layers(model.params)).items()}
    tm.load_state_dict(sd, strict=False)
    tm = tm.to(dev).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as transformers' generate expects
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    kw = dict(attention_mask=mask, do_sample=not sampling.greedy, pad_token_id=0,
              eos_token_id=None)
    if not sampling.greedy:
        kw.update(temperature=sampling.temperature, top_k=sampling.top_k or None,
                  top_p=sampling.top_p, min_p=sampling.min_p or None)
    if prompt_lookup:
        kw["prompt_lookup_num_tokens"] = 10
    else:
        kw["cache_implementation"] = "static"

    def timed(n):
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            tm.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    # Warm up both lengths: a static cache is sized by the call's max length, and each new
    # size compiles again (timing a first call measured the compiler, not the decoding).
    timed(1), timed(new_tokens)
    t1, tn = timed(1), timed(new_tokens)
    name = "hf-transformers" + (" prompt-lookup" if prompt_lookup else " static cache")
    return {"method": name, "tok_s": len(prompts) * (new_tokens - 1) / (tn - t1)}


def check_impls(model, prompts, new_tokens: int, spec: SpecConfig) -> list[dict]:
    """Greedy tokens through the Pallas kernels vs the XLA reference path, for vanilla and
    `spec`'s method: equal, or where they first part (bf16 near-ties can flip)."""
    from vegas_jax.driver import exec_config
    from vegas_jax.speculative import speculative_generate

    rows = []
    for method in ("vanilla", spec.name):
        s = dataclasses.replace(spec, method=method)
        got = {impl: speculative_generate(
            model, prompts, new_tokens, s,
            exec_config=dataclasses.replace(exec_config(model), backend=impl)).tokens
            for impl in ("pallas", "xla")}
        first = []
        for a, b in zip(got["pallas"], got["xla"]):
            diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            first.append(diff[0] if diff else None)
        rows.append({"method": method, "identical_sequences": sum(f is None for f in first),
                     "sequences": len(first), "first_mismatch": first})
    return rows


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by the bench and the tuner: model, workload, budget and sampling."""
    add_model_args(p)
    p.add_argument("--batch", type=int, default=4, help="sequences decoded together")
    p.add_argument("--context", type=int, default=4096, help="prompt length in tokens")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens generated per sequence")
    p.add_argument("--kind", default="prose", choices=("prose", "code"),
                   help="real text the prompts are cut from (vegas_jax.workloads)")
    p.add_argument("--prompts-json", default=None,
                   help='token-id prompts {"prompts": [[ids], ...]} instead of --kind text '
                   "(each cut to its last --context tokens, repeated to fill the batch)")
    p.add_argument("--no-chat", action="store_true", help="raw text continuation, no chat template")
    p.add_argument("--min-tokens", type=int, default=256,
                   help="draft budget floor (at short context it can hide the sparsity)")
    p.add_argument("--score", default="weight", choices=("weight", "logit"),
                   help="criticality score: softmax weights or raw logits")
    add_sampling_args(p)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m vegas_jax.bench",
        description="Run one decoding workload under several methods and print one table.",
        epilog="The table: " + "; ".join(LEGEND) + ".", formatter_class=HelpFormatter)
    add_workload_args(p)
    p.add_argument("--random-init", action="store_true",
                   help="random full-size weights (timing only; implies --profile-only)")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help="comma-separated subset of " + ",".join(ALL_METHODS))
    p.add_argument("--profile-methods", default=None,
                   help="comma-separated methods whose round is split into phases "
                   "(default: all speculative methods)")
    p.add_argument("--gamma", type=int, default=6, help="draft tokens per round")
    p.add_argument("--gammas", default=None,
                   help="comma-separated gammas: every speculative method runs at each "
                   "(default: --gamma); auto starts from --gamma")
    p.add_argument("--sparsity", type=float, default=0.07, help="draft budget fraction")
    p.add_argument("--sparsities", default=None,
                   help="comma-separated budget fractions: every speculative method runs at "
                   "each gamma and each of them (default: --sparsity); auto runs at --sparsity")
    p.add_argument("--draft-weights", default="same",
                   help="comma-separated draft weights (same, int8, int4): every speculative "
                   "method runs with each")
    p.add_argument("--profile-reps", type=int, default=5,
                   help="timed repetitions of each round phase (0: skip the phase split)")
    p.add_argument("--profile-only", action="store_true",
                   help="only time the phases on a synthetic cache of --context tokens")
    p.add_argument("--project-tau", type=float, default=None,
                   help="with --profile-only: project tokens/s at this tau")
    p.add_argument("--hf-reference", action="store_true",
                   help="also run the same weights and prompts through transformers (PyTorch)")
    p.add_argument("--check-impls", action="store_true",
                   help="only compare greedy tokens of the pallas and xla attention paths")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--save", default=None, metavar="DIR",
                   help="also write the JSON to DIR/<model>_b<batch>_ctx<context>_<greedy|"
                   "sampled>_<date>.json")
    return p


def _workload(model, args):
    from vegas_jax.workloads import long_prompts

    if args.prompts_json:
        with open(args.prompts_json) as f:
            ids = json.load(f)["prompts"]
        ids = [p[-args.context:] for p in ids]
        return [ids[i % len(ids)] for i in range(args.batch)]
    if model.tokenizer is None:
        rng = np.random.default_rng(args.seed)
        return [rng.integers(0, model.config.vocab_size, args.context).tolist()
                for _ in range(args.batch)]
    # Different documents per row; at most a few distinct ones (the source is finite).
    texts = long_prompts(model.tokenizer, [args.context] * min(args.batch, 8), args.kind,
                         chat=not args.no_chat)
    ids = [model.tokenizer.encode(t) for t in texts]
    return [ids[i % len(ids)] for i in range(args.batch)]


def _compile_auto(model, prompts, args, spec, sampling, policy: AutoPolicy):
    """auto's every candidate compiled before its timed run, as a fixed method's round is
    by its first call (which tokens/s leaves out): one generation of the same shapes whose
    first read waits for the build (`policy` with background=False). The timed run then
    builds from the caches at once and explores from its first calls."""
    from vegas_jax.speculative import speculative_generate

    speculative_generate(model, prompts, args.new_tokens, spec, sampling, seed=args.seed,
                         auto_policy=dataclasses.replace(policy, background=False))


def _methods_and_weights(args) -> tuple[list[str], list[str]]:
    """The --methods and --draft-weights asked for, each checked (before the model loads)."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    if args.batch < 1 or args.context < 1 or args.new_tokens < 1:
        raise ValueError("--batch, --context and --new-tokens must be >= 1")
    weights = [w.strip() for w in args.draft_weights.split(",") if w.strip()]
    for w in weights:
        check_draft_weights(w)
    return methods, weights


def _runs(args, methods, weights) -> list[tuple[str, int, float, str]]:
    """(method, gamma, sparsity, draft weights) of every run: each speculative method at
    each gamma, sparsity and draft weights; vanilla and auto once."""
    gammas = [int(g) for g in args.gammas.split(",")] if args.gammas else [args.gamma]
    sparsities = ([float(s) for s in args.sparsities.split(",")] if args.sparsities
                  else [args.sparsity])
    if not all(0 < s <= 1 for s in sparsities):  # before any run, not after vanilla's
        raise ValueError(f"--sparsities: each sparsity must be in (0, 1], got {sparsities}")
    return [(m, g, s, w) for m in methods
            for g in (gammas if m not in ("vanilla", "auto") else [args.gamma])
            for s in (sparsities if m not in ("vanilla", "auto") else [args.sparsity])
            for w in (weights if m != "vanilla" else ["same"])]


def _first_differences(tokens, ref_tokens) -> list[int | None]:
    """Where each sequence first parts from the reference's (None: equal throughout)."""
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b),
                 None if len(x) == len(y) else min(len(x), len(y)))
            for x, y in zip(tokens, ref_tokens)]


def _decode_into(row, model, prompts, args, spec, sampling, auto_policy, ref_tokens):
    """Generate under `row`'s method and add its stats to `row` (with the sequences equal
    to `ref_tokens`, vanilla's, under greedy sampling). Returns the generation's result."""
    from vegas_jax.speculative import speculative_generate

    m = row["method"]
    if m == "auto":
        _compile_auto(model, prompts, args, spec, sampling, auto_policy)
    res = speculative_generate(model, prompts, args.new_tokens,
                               dataclasses.replace(spec, method=m), sampling,
                               seed=args.seed, auto_policy=auto_policy)
    st = res.stats
    row.update(tok_s=st["decode_tokens_per_s"], tau=st["tau"],
               acceptance=st["acceptance_cumulative"], rounds=st["rounds"],
               prefill_s=st["prefill_s"], backend=st["backend"],
               ms_per_call=st["ms_per_call"], host_ms_per_call=st["host_ms_per_call"],
               wait_ms_per_call=st["wait_ms_per_call"],
               dispatch_ms_per_call=st["dispatch_ms_per_call"],
               call_ms=st["call_ms"], active_by_call=st["active_by_call"],
               rounds_by_sequence=st.get("rounds_by_sequence"),
               tokens_by_call=st["tokens_by_call"],
               accepted_by_call=st.get("accepted_by_call"))
    row["full_batch_tok_s"] = full_batch_tok_s(row, args.batch)
    if "auto" in st:
        row["auto"] = st["auto"]
    if m != "vanilla" and sampling.greedy and ref_tokens is not None:  # lossless: same tokens
        first = _first_differences(res.tokens, ref_tokens)
        row["equal_sequences"] = sum(f is None for f in first)
        row["first_difference"] = first
    return res


def _profile_into(row, model, ids_or_cache, args, spec, sampling, profile_only: bool):
    """Add the round's phase times to `row` (and with --project-tau, projected tokens/s).
    Returns the cache `profile_round` hands back (the donated one, for --profile-only)."""
    times, cache_after = profile_round(model, ids_or_cache, spec, sampling, args.profile_reps)
    row.update(times)
    if "ms_per_call" in row:
        row["e2e_over_jitted"] = row["ms_per_call"] / row["round_ms"]
    if profile_only and args.project_tau:
        row["projected_tok_s"] = args.batch * args.project_tau / row["round_ms"] * 1e3
        row["projected_vanilla_tok_s"] = args.batch / row["vanilla_step_ms"] * 1e3
    return cache_after


def _hf_rows(args, model, prompts, sampling) -> list[dict]:
    """--hf-reference's rows: transformers with a static cache, and at batch 1 under greedy
    sampling, with prompt-lookup decoding too."""
    rows = [hf_reference(model, prompts, args.new_tokens, sampling)]
    if args.batch == 1 and sampling.greedy:
        rows.append(hf_reference(model, prompts, args.new_tokens, sampling, True))
    return rows


def run(args, model=None, auto_policy: AutoPolicy = AutoPolicy()) -> list[dict]:
    """The rows of the table. `model`, `auto_policy` (tests): the model, auto's settings."""
    from tqdm import tqdm

    methods, weights = _methods_and_weights(args)
    sampling = sampling_from_args(args)
    dt = dtype_from_arg(args.dtype)
    if model is None:
        model = load_from_args(args, random_init=args.random_init)
    profile_only = args.profile_only or args.random_init
    rows = []
    base = None
    if profile_only:
        cache = profile_cache(model.config, args.batch, args.context, args.gamma, dt)
    else:
        prompts = _workload(model, args)
    if args.check_impls:
        spec = SpecConfig(method="vegas" if methods == list(ALL_METHODS) else methods[-1],
                          gamma=args.gamma, sparsity=args.sparsity, min_tokens=args.min_tokens)
        return check_impls(model, prompts, args.new_tokens, spec)
    ref_tokens = None
    for m, g, s, w in tqdm(_runs(args, methods, weights), desc="methods", file=sys.stderr,
                           disable=args.json):
        gc.collect()  # the previous run's cache and state (some in reference cycles) go now
        spec = SpecConfig(method=m if m != "vanilla" else "vegas", gamma=g,
                          sparsity=s, min_tokens=args.min_tokens, score=args.score,
                          draft_weights=w)
        row = {"method": m, "gamma": g if m != "vanilla" else 0}
        if m != "vanilla":
            row.update(sparsity=s, draft_weights=w)
        if not profile_only:
            res = _decode_into(row, model, prompts, args, spec, sampling, auto_policy,
                               ref_tokens)
            if m == "vanilla":
                base, ref_tokens = res.stats["decode_tokens_per_s"], res.tokens
        profiled = args.profile_methods is None or m in args.profile_methods.split(",")
        if m not in ("vanilla", "auto") and args.profile_reps > 0 and profiled:
            cache_after = _profile_into(row, model, cache if profile_only else prompts, args,
                                        spec, sampling, profile_only)
            if profile_only:
                cache = cache_after
        rows.append(row)
    if args.hf_reference and not profile_only:
        rows += _hf_rows(args, model, prompts, sampling)
    for r in rows:
        if base and "tok_s" in r:
            r["speedup"] = r["tok_s"] / base
    return rows


def full_batch_tok_s(row, batch: int) -> float | None:
    """Tokens a second over the timed calls that ran with every sequence active: the rate
    a server that refills finished slots would see, free of the wait for this batch's
    slowest sequence (which moves tok/s from run to run). None if no such call was timed."""
    tokens = ms = 0.0
    for m, a, n in zip(row["call_ms"], row["active_by_call"], row["tokens_by_call"]):
        if m is not None and a == batch:
            tokens, ms = tokens + n, ms + m
    return tokens / ms * 1e3 if ms else None


def tail_line(row, batch: int) -> str:
    """What the batch's tail cost: mean device ms of the calls that ran with every
    sequence active (and their tokens a second, `full_batch_tok_s`), and of those with at
    most a quarter active (the batch waiting for its slowest sequences; finished ones
    skip their attention)."""
    def mean(sel, extra=""):
        ms = [m for m, a in zip(row["call_ms"], row["active_by_call"]) if m is not None and sel(a)]
        return f"{sum(ms) / len(ms):.2f} ms ({len(ms)} calls{extra})" if ms else "-"
    s = f" s{row['sparsity']:g}" if row.get("sparsity") is not None else ""
    rate = row.get("full_batch_tok_s")
    full = mean(lambda a: a == batch, f", {rate:.0f} tok/s" if rate else "")
    return (f"tail {row['method']} g{row.get('gamma')}{s}: all {batch} active {full}, "
            f"<= {batch // 4} active {mean(lambda a: a <= batch // 4)}")


def format_table(rows, gamma) -> str:
    head = ["method", "gamma", "sparsity", "draft weights", "tok/s", "speedup", "tau",
            "= vanilla", "acc@1..gamma", "ms/call", "round ms", "draft ms", "verify ms",
            "capture+select ms", "vanilla step ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        def f(key, fmt="{:.1f}"):
            return fmt.format(r[key]) if key in r and r[key] is not None else ""
        acc = " ".join(f"{a:.2f}" for a in r.get("acceptance", [])) if r.get("acceptance") else ""
        lines.append("| " + " | ".join([
            r["method"], str(r.get("gamma", "")), f("sparsity", "{:g}"),
            r.get("draft_weights", ""), f("tok_s"),
            f("speedup", "{:.2f}x"),
            f("tau", "{:.2f}"), f("equal_sequences", "{:d}"), acc, f("ms_per_call", "{:.2f}"),
            f("round_ms", "{:.2f}"), f("draft_ms", "{:.2f}"), f("verify_ms", "{:.2f}"),
            "n/a" if "select_ms" in r and r.get("selection_overhead_ms") is None
            else f("selection_overhead_ms", "{:.2f}"), f("vanilla_step_ms", "{:.2f}")]) + " |")
    return "\n".join(lines)


def main(argv=None, model=None, auto_policy: AutoPolicy = AutoPolicy()) -> int:
    args = build_parser().parse_args(argv)
    try:
        rows = run(args, model, auto_policy)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as e:
        print(f"error: {flag_error(str(e), args)}", file=sys.stderr)
        return 2
    out = {"args": vars(args), "device": jax.devices()[0].device_kind,
           "date": time.strftime("%Y-%m-%d"), "rows": rows}
    if args.save:
        import os

        os.makedirs(args.save, exist_ok=True)
        name = args.model or (os.path.basename(args.checkpoint).split(".")[0] if args.checkpoint
                              else "default")
        mode = "greedy" if args.temperature == 0 else "sampled"
        path = os.path.join(args.save, f"{name}_b{args.batch}_ctx{args.context}_{mode}_"
                                       f"{out['date']}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    if args.json or args.check_impls:
        print(json.dumps(out))
    else:
        print(f"# {jax.devices()[0].device_kind}, batch {args.batch}, context {args.context}, "
              f"new {args.new_tokens}, gamma {args.gamma}, sparsity {args.sparsity}, "
              f"T={args.temperature}")
        print(format_table(rows, args.gamma))
        for r in rows:
            if "auto" in r:
                shown = {k: v for k, v in r["auto"].items() if k != "trace"}  # trace: JSON
                print(f"auto: {shown}")
        for r in rows:
            if r.get("call_ms"):
                print(tail_line(r, args.batch))
        for r in rows:
            if "projected_tok_s" in r:
                print(f"{r['method']}: projected {r['projected_tok_s']:.1f} tok/s at tau "
                      f"{args.project_tau} vs vanilla {r['projected_vanilla_tok_s']:.1f}")
        print("\n".join(f"# {line}" for line in LEGEND))
    return 0


if __name__ == "__main__":
    sys.exit(main())
