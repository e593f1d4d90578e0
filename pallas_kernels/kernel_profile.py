"""Where a decode step and a Vegas round spend device time, kernel by kernel (GPU).

    PYTHONPATH=. python pallas_kernels/kernel_profile.py --model qwen3-8b --batch 1 --context 32768

Random weights of the model's full shapes and a synthetic cache (`vegas_jax.bench`), a
`jax.profiler` trace of a few calls, and device kernel times summed by kernel name from
the trace's GPU stream lines. `--hlo DIR` also writes the optimised HLO of both programs,
to map fusion names back to operations.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.profiler import ProfileData


def kernel_times(fn, n: int = 2) -> dict[str, list]:
    """{kernel name: [launches, microseconds per call of fn]} over n traced calls."""
    trace_dir = tempfile.mkdtemp()
    jax.block_until_ready(fn())
    with jax.profiler.trace(trace_dir):
        for _ in range(n):
            jax.block_until_ready(fn())
    path = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)[0]
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for plane in ProfileData.from_file(path).planes:
        if "GPU" not in plane.name:
            continue
        for line in plane.lines:
            if "Stream" not in line.name:
                continue
            for ev in line.events:
                agg[ev.name][0] += 1
                agg[ev.name][1] += ev.duration_ns / 1e3 / n
    return dict(agg)


def report(agg: dict[str, list], label: str, per: int = 1, top: int = 20) -> None:
    total = sum(v[1] for v in agg.values()) / per
    print(f"{label}: {total:.1f} us of kernels")
    for name, (count, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{label} {us / per:9.1f} us  x{count:5d}  {name[:100]}")


def main(argv=None) -> int:
    from vegas_jax import speculative as S
    from vegas_jax.attention import default_impl
    from vegas_jax.bench import profile_cache
    from vegas_jax.config import get_config
    from vegas_jax.generate import decode_steps
    from vegas_jax.model import init_params
    from vegas_jax.sampling import SamplingParams
    from vegas_jax.selection import SpecConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b", help="registered model name")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--context", type=int, default=32768, help="cached tokens per sequence")
    p.add_argument("--gamma", type=int, default=6, help="draft tokens per round")
    p.add_argument("--sparsity", type=float, default=0.07, help="draft budget fraction")
    p.add_argument("--attn-impl", default=None, choices=("pallas", "xla"),
                   help="attention backend (default: pallas on GPU)")
    p.add_argument("--hlo", default=None, metavar="DIR", help="write the optimised HLO here")
    args = p.parse_args(argv)
    impl = args.attn_impl or default_impl()
    cfg = get_config(args.model)
    params = init_params(cfg, jax.random.PRNGKey(0))
    b = args.batch
    cache = profile_cache(cfg, b, args.context, args.gamma, jnp.bfloat16)
    sp, key = SamplingParams(), jax.random.PRNGKey(0)
    tok, active, lens = jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool), cache.lengths + 0
    box = {"cache": cache}

    def step():  # 8 decode steps in one call; the cache is donated and handed back
        c, _, toks = decode_steps(params, cfg, box["cache"], tok, active, key, sp, impl, 8)
        box["cache"] = c.replace(lengths=lens + 0)
        return toks

    if args.hlo:
        os.makedirs(args.hlo, exist_ok=True)
        text = decode_steps.lower(params, cfg, box["cache"], tok, active, key, sp, impl,
                                  8).compile().as_text()
        open(f"{args.hlo}/decode.hlo.txt", "w").write(text)
    report(kernel_times(step), "decode step", per=8)

    spec = SpecConfig(method="vegas", gamma=args.gamma, sparsity=args.sparsity)
    scores = jax.random.uniform(jax.random.PRNGKey(1), (cfg.num_layers, b, cache.max_len))
    box["state"] = S.init_state(spec, box.pop("cache"), tok, key, scores, lens + 0)

    def round_():
        st, emitted, _ = S.spec_round(params, cfg, box["state"], active, spec, sp, impl)
        box["state"] = st.replace(cache=st.cache.replace(lengths=lens + 0))
        return emitted

    if args.hlo:
        text = S.spec_round.lower(params, cfg, box["state"], active, spec, sp,
                                  impl).compile().as_text()
        open(f"{args.hlo}/round.hlo.txt", "w").write(text)
    report(kernel_times(round_), "vegas round", top=30)
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        jax.block_until_ready(round_())
        walls.append(time.perf_counter() - t)
    print(f"vegas round wall: {np.median(walls) * 1e3:.2f} ms (median of 5)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
