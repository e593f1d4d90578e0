"""`python -m vegas_jax.bench`: one workload under every method, one table.

For each method: decode tokens/s, speedup over vanilla, tau (tokens per round),
per-position acceptance, and the time of one round split into draft / verify / select
(measured by timing the round's jitted phases alone on a live state). With
`--profile-only` (e.g. Qwen3-8B shapes with `--random-init`) no text is generated: the
cache is filled with random entries and only step times are measured, so throughput can be
projected for a given tau.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from vegas_jax.cache import KVCache
from vegas_jax.model import compiler_options
from vegas_jax.selection import METHODS, SpecConfig

ALL_METHODS = ("vanilla", "stream", "quest", "last", "vegas-all", "vegas")


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

    return KVCache(k=make(jnp.uint32(1)), v=make(jnp.uint32(2)),
                   lengths=jnp.full((batch,), length, jnp.int32))


def profile_cache(cfg, batch: int, context: int, gamma: int, dtype) -> KVCache:
    """A synthetic cache of `context` tokens with room for the rounds a profile runs."""
    max_len = -(-(context + 4 * gamma + 1) // 128) * 128
    return synthetic_cache(cfg, batch, max_len, context, dtype)


def profile_round(model, ids_or_cache, spec: SpecConfig, sampling, impl: str, reps: int = 5):
    """Milliseconds of one round's phases on a live state: draft (all gamma steps), verify
    without capture, verify with capture, selection, the whole jitted round, and one
    vanilla decode step. `ids_or_cache` is a list of prompts (token ids) to prefill, or a
    ready KVCache (synthetic, for --profile-only), which is donated: the cache is returned
    with its lengths restored, for the next call."""
    from vegas_jax import selection as sel
    from vegas_jax import speculative as S
    from vegas_jax.generate import decode_steps, prefill_prompts, start

    cfg, params = model.config, model.params
    if isinstance(ids_or_cache, list):
        ids, cache, impl = start(model, ids_or_cache, 64, sampling, 2 * spec.gamma + 2, impl)
        logits, cache, scores = prefill_prompts(params, cfg, ids, cache, impl,
                                                spec.method in sel.VERIFY_GUIDED)
    else:
        from vegas_jax.attention import default_impl

        impl = impl or default_impl()
        cache = ids_or_cache
        b, s = cache.batch, cache.max_len
        logits = jnp.zeros((b, cfg.vocab_size), jnp.float32)
        scores = jax.random.uniform(jax.random.PRNGKey(1), (cfg.num_layers, b, s))
    x0 = jnp.argmax(logits, -1).astype(jnp.int32)
    state = S.init_state(spec, cache, x0, jax.random.PRNGKey(0), scores, cache.lengths + 0)
    key = jax.random.PRNGKey(2)
    n = state.cache.lengths + 0  # own buffer: the cache (with its lengths) is donated
    active = jnp.ones_like(n, bool)
    # Weights go in as arguments (a jitted closure would bake them in as constants), and
    # every timed call donates the cache and gets it back: at long context a copy of the
    # cache would not fit next to it. Drafts and verify rewrite the same positions, so
    # repeating them leaves the state as it was.
    opts = compiler_options(cfg)
    draft = jax.jit(lambda p, c, st: (lambda c2, d, q: (c2, d))(
        *S.draft_phase(p, cfg, st.replace(cache=c), key, spec, sampling, impl)), donate_argnums=1,
        compiler_options=opts)
    verify = jax.jit(lambda p, c, x, d, capture: (lambda lg, c2, sc: (c2, sc, lg[:, 0, :1]))(
        *S.verify_phase(p, cfg, c, x, d, spec, impl, capture)),
        static_argnames=("capture",), donate_argnums=1, compiler_options=opts)
    select = jax.jit(lambda st, sc: jax.tree.map(
        lambda a: a, S.select_phase(st, sc, n, jnp.zeros_like(n), spec).replace(cache=None)))
    box = {"state": state}

    def run_draft():
        cache, drafts = draft(params, box["state"].cache, box["state"].replace(cache=None))
        box["state"] = box["state"].replace(cache=cache)
        box["drafts"] = drafts
        return drafts

    def run_verify(capture):
        def f():
            cache, sc, lg = verify(params, box["state"].cache, x0, box["drafts"], capture=capture)
            box["state"] = box["state"].replace(cache=cache)
            box["scores"] = sc
            return lg
        return f

    def run_step():
        cache, tok, toks = decode_steps(params, cfg, box["state"].cache, x0, active, key,
                                        sampling, impl, 8)
        box["state"] = box["state"].replace(cache=cache.replace(lengths=n + 0))
        return toks

    out = {}
    out["draft_ms"] = _time(run_draft, reps) * 1e3
    out["verify_ms"] = _time(run_verify(False), reps) * 1e3
    out["verify_capture_ms"] = _time(run_verify(True), reps) * 1e3
    out["select_ms"] = _time(lambda: select(box["state"], box["scores"]), reps) * 1e3
    out["selection_overhead_ms"] = out["verify_capture_ms"] - out["verify_ms"] + out["select_ms"]
    out["vanilla_step_ms"] = _time(run_step, reps) * 1e3 / 8
    state = box.pop("state")
    st = state
    times = []
    for i in range(reps + 1):  # the round donates its state: chain them
        t = time.perf_counter()
        st, em, _ = S.spec_round(params, cfg, st, active, spec, sampling, impl)
        jax.block_until_ready(em)
        if i:
            times.append(time.perf_counter() - t)
    out["round_ms"] = float(np.median(times)) * 1e3
    return out, st.cache.replace(lengths=n)


def hf_reference(model, prompts, new_tokens: int, sampling, prompt_lookup: bool = False) -> dict:
    """The same weights and prompts through Hugging Face transformers on PyTorch (static KV
    cache; optionally prompt-lookup decoding): an outside reference for tokens/s.
    Decode throughput = extra tokens / extra time between a 1-token and an N-token call."""
    import torch
    import transformers

    from convert.hf import to_hf_config, to_hf_state_dict
    from vegas_jax.model import param_dtype

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf_cfg = to_hf_config(model.config)
    config = transformers.AutoConfig.for_model(**hf_cfg)
    dtype = torch.bfloat16 if param_dtype(model.params) == jnp.bfloat16 else torch.float32
    tm = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
    sd = {k: torch.from_numpy(np.asarray(v, np.float32)).to(dtype)
          for k, v in to_hf_state_dict(model.config, model.params).items()}
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
    from vegas_jax.speculative import speculative_generate

    rows = []
    for method in ("vanilla", spec.method):
        s = dataclasses.replace(spec, method=method)
        got = {impl: speculative_generate(model, prompts, new_tokens, s, attn_impl=impl).tokens
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
    p.add_argument("--model", default=None, help="registered model name (default: the embedded SmolLM2)")
    p.add_argument("--checkpoint", default=None, help="HF / orbax directory or .gguf file")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp32"),
                   help="auto = bf16 on GPU, fp32 on CPU")
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
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (also random prompts)")
    p.add_argument("--attn-impl", default=None, choices=("pallas", "xla"),
                   help="attention backend; unset: pallas on GPU, xla on CPU")


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m vegas_jax.bench",
        description="Run one decoding workload under several methods and print one table.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_workload_args(p)
    p.add_argument("--random-init", action="store_true",
                   help="random full-size weights (timing only; implies --profile-only)")
    p.add_argument("--methods", default=",".join(ALL_METHODS),
                   help="comma-separated subset of " + ",".join(ALL_METHODS))
    p.add_argument("--profile-methods", default=None,
                   help="comma-separated methods whose round is split into phases "
                   "(default: all speculative methods)")
    p.add_argument("--gamma", type=int, default=6, help="draft tokens per round")
    p.add_argument("--sparsity", type=float, default=0.07, help="draft budget fraction")
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


def run(args, model=None) -> list[dict]:
    """The rows of the table. `model` (tests) replaces loading --model / --checkpoint."""
    from tqdm import tqdm

    from vegas_jax.loading import load_model
    from vegas_jax.sampling import SamplingParams
    from vegas_jax.speculative import speculative_generate

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(ALL_METHODS)}")
    if args.batch < 1 or args.context < 1 or args.new_tokens < 1:
        raise ValueError("--batch, --context and --new-tokens must be >= 1")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bf16" if jax.default_backend() == "gpu" else "fp32"
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    if model is None:
        model = load_model(args.model, checkpoint=args.checkpoint,
                           random_init=args.random_init, dtype=dt)
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
    for m in tqdm(methods, desc="methods", file=sys.stderr, disable=args.json):
        spec = SpecConfig(method=m if m != "vanilla" else "vegas", gamma=args.gamma,
                          sparsity=args.sparsity, min_tokens=args.min_tokens, score=args.score)
        row = {"method": m}
        if not profile_only:
            res = speculative_generate(model, prompts, args.new_tokens,
                                       dataclasses.replace(spec, method=m), sampling,
                                       seed=args.seed, attn_impl=args.attn_impl)
            st = res.stats
            row.update(tok_s=st["decode_tokens_per_s"], tau=st["tau"],
                       acceptance=st["acceptance_by_position"], rounds=st["rounds"],
                       prefill_s=st["prefill_s"], attn_impl=st["attn_impl"])
            if m == "vanilla":
                base = st["decode_tokens_per_s"]
        profiled = args.profile_methods is None or m in args.profile_methods.split(",")
        if m != "vanilla" and args.profile_reps > 0 and profiled:
            times, cache_after = profile_round(model, cache if profile_only else prompts, spec,
                                               sampling, args.attn_impl, args.profile_reps)
            row.update(times)
            if profile_only:
                cache = cache_after
            if profile_only and args.project_tau:
                row["projected_tok_s"] = args.batch * args.project_tau / row["round_ms"] * 1e3
                row["projected_vanilla_tok_s"] = args.batch / row["vanilla_step_ms"] * 1e3
        rows.append(row)
    if args.hf_reference and not profile_only:
        rows.append(hf_reference(model, prompts, args.new_tokens, sampling))
        if args.batch == 1 and sampling.greedy:
            rows.append(hf_reference(model, prompts, args.new_tokens, sampling, True))
    for r in rows:
        if base and "tok_s" in r:
            r["speedup"] = r["tok_s"] / base
    return rows


def format_table(rows, gamma) -> str:
    head = ["method", "tok/s", "speedup", "tau", "acc@1..gamma", "round ms", "draft ms",
            "verify ms", "capture+select ms", "vanilla step ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        def f(key, fmt="{:.1f}"):
            return fmt.format(r[key]) if key in r and r[key] is not None else ""
        acc = " ".join(f"{a:.2f}" for a in r.get("acceptance", [])) if r.get("acceptance") else ""
        lines.append("| " + " | ".join([
            r["method"], f("tok_s"), f("speedup", "{:.2f}x"), f("tau", "{:.2f}"), acc,
            f("round_ms", "{:.2f}"), f("draft_ms", "{:.2f}"), f("verify_ms", "{:.2f}"),
            f("selection_overhead_ms", "{:.2f}"), f("vanilla_step_ms", "{:.2f}")]) + " |")
    return "\n".join(lines)


def main(argv=None, model=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        rows = run(args, model)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json or args.check_impls:
        print(json.dumps({"args": vars(args), "rows": rows}))
    else:
        print(f"# {jax.devices()[0].device_kind}, batch {args.batch}, context {args.context}, "
              f"new {args.new_tokens}, gamma {args.gamma}, sparsity {args.sparsity}, "
              f"T={args.temperature}")
        print(format_table(rows, args.gamma))
        for r in rows:
            if "projected_tok_s" in r:
                print(f"{r['method']}: projected {r['projected_tok_s']:.1f} tok/s at tau "
                      f"{args.project_tau} vs vanilla {r['projected_vanilla_tok_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
