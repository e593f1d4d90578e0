"""`python -m vegas_jax.tune`: pick (sparsity, gamma) with the paper's 3-step strategy.

1. At a large gamma, sweep sparsity upwards until tau (tokens per round) stops growing:
   stop at the first step whose relative gain is below `--threshold`; the sparsity before
   that step is where tau stabilised.
2. At that sparsity, sweep gamma for decode throughput (tokens/s).
3. Refine sparsity around the chosen point (grid neighbours, or halfway points) at the
   chosen gamma, for throughput.

`--grid` also measures the full sparsity x gamma grid and reports how close the tuner's
choice lands to the grid's best (ratio of tokens/s). Every (sparsity, gamma) point is one
`speculative_generate` run (each point compiles its own round: SpecConfig is a static jit
argument), measured once and reused by every step that needs it. The workload is the
bench's (`vegas_jax.bench`), built by the same code.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

DEFAULT_SPARSITIES = "0.01,0.02,0.03,0.05,0.07,0.1,0.15"
DEFAULT_GAMMAS = "2,4,6,8,10"


def parse_sparsities(text: str) -> list[float]:
    vals = sorted({float(v) for v in text.split(",") if v.strip()})
    if not vals:
        raise ValueError("empty sparsity list")
    bad = [v for v in vals if not 0 < v <= 1]
    if bad:
        raise ValueError(f"sparsity must be in (0, 1], got {bad}")
    return vals


def parse_gammas(text: str) -> list[int]:
    vals = [float(v) for v in text.split(",") if v.strip()]
    if not vals:
        raise ValueError("empty gamma list")
    bad = [v for v in vals if v < 1 or v != int(v)]
    if bad:
        raise ValueError(f"gamma must be a whole number >= 1, got {bad}")
    return sorted({int(v) for v in vals})


def plateau_index(taus: list[float], threshold: float) -> int | None:
    """Index of the sparsity where tau stabilised: the point before the first step whose
    relative gain is below `threshold`; None while it is still growing."""
    for i in range(1, len(taus)):
        if (taus[i] - taus[i - 1]) / taus[i - 1] < threshold:
            return i - 1
    return None


class Tuner:
    """The three steps over a memoised `evaluate(sparsity, gamma) -> {"tau", "tok_s", ...}`."""

    def __init__(self, evaluate: Callable[[float, int], dict], sparsities, gammas,
                 large_gamma: int = 8, threshold: float = 0.03, refine: str = "grid"):
        if large_gamma < 1:
            raise ValueError(f"--large-gamma must be >= 1, got {large_gamma}")
        if threshold < 0:
            raise ValueError(f"--threshold must be >= 0, got {threshold}")
        if refine not in ("grid", "halfway"):
            raise ValueError(f"refine must be 'grid' or 'halfway', got {refine!r}")
        self._evaluate = evaluate
        self.sparsities = list(sparsities)
        self.gammas = list(gammas)
        self.large_gamma = large_gamma
        self.threshold = threshold
        self.refine = refine
        self.points: dict[tuple[float, int], dict] = {}

    def point(self, sparsity: float, gamma: int, step: str) -> dict:
        key = (round(sparsity, 6), gamma)
        if key not in self.points:
            self.points[key] = {"sparsity": key[0], "gamma": gamma, "step": step,
                                **self._evaluate(key[0], gamma)}
        return self.points[key]

    def step1(self) -> tuple[float, list[dict]]:
        curve = []
        for s in self.sparsities:
            curve.append(self.point(s, self.large_gamma, "1"))
            i = plateau_index([p["tau"] for p in curve], self.threshold)
            if i is not None:
                return self.sparsities[i], curve
        return self.sparsities[-1], curve

    def step2(self, sparsity: float) -> tuple[int, list[dict]]:
        curve = [self.point(sparsity, g, "2") for g in self.gammas]
        return max(curve, key=lambda p: p["tok_s"])["gamma"], curve

    def step3(self, sparsity: float, gamma: int) -> tuple[dict, list[dict]]:
        i = self.sparsities.index(sparsity)
        nb = [self.sparsities[j] for j in (i - 1, i + 1) if 0 <= j < len(self.sparsities)]
        if self.refine == "halfway":
            nb = [(sparsity + s) / 2 for s in nb]
        cands = sorted([sparsity, *nb])
        curve = [self.point(s, gamma, "3") for s in cands]
        return max(curve, key=lambda p: p["tok_s"]), curve

    def tune(self) -> dict:
        s1, c1 = self.step1()
        g2, c2 = self.step2(s1)
        best, c3 = self.step3(s1, g2)
        return {"step1": {"gamma": self.large_gamma, "sparsity": s1, "curve": c1},
                "step2": {"sparsity": s1, "gamma": g2, "curve": c2},
                "step3": {"gamma": g2, "curve": c3},
                "chosen": best}

    def grid(self, chosen: dict) -> dict:
        pts = [self.point(s, g, "grid") for s in self.sparsities for g in self.gammas]
        best = max(pts, key=lambda p: p["tok_s"])
        return {"best": best, "ratio": chosen["tok_s"] / best["tok_s"],
                "evaluated": len(pts)}


def build_parser():
    from vegas_jax.bench import add_workload_args
    from vegas_jax.cli import HelpFormatter

    p = argparse.ArgumentParser(
        prog="python -m vegas_jax.tune",
        description="Choose sparsity and gamma for self-speculative decoding with the "
        "paper's 3-step strategy (tau plateau over sparsity at a large gamma; gamma sweep "
        "for tokens/s; sparsity refinement). Workload flags mirror vegas_jax.bench.",
        formatter_class=HelpFormatter)
    add_workload_args(p)  # the bench's model, workload and sampling flags
    p.add_argument("--method", default="vegas", choices=("vegas", "vegas-paper", "last", "stream", "quest"),
                   help="speculative method to tune")
    p.add_argument("--sparsities", default=DEFAULT_SPARSITIES,
                   help="comma-separated sparsity grid, each in (0, 1]; swept in ascending order")
    p.add_argument("--gammas", default=DEFAULT_GAMMAS, help="comma-separated gamma grid (>= 1)")
    p.add_argument("--large-gamma", type=int, default=8, help="gamma of the step-1 sparsity sweep")
    p.add_argument("--threshold", type=float, default=0.03,
                   help="step 1 stops when tau grows by less than this fraction")
    p.add_argument("--refine", default="grid", choices=("grid", "halfway"),
                   help="step 3 candidates: grid neighbours, or halfway to them")
    p.add_argument("--grid", action="store_true",
                   help="also measure the full sparsity x gamma grid and compare with its best")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per point; the fastest is kept (less sensitive to other load)")
    p.add_argument("--no-vanilla", action="store_true", help="skip the vanilla reference run")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write the curves as a figure")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def run(args, model=None) -> dict:
    """Tune on the workload `args` describes; `model` overrides --model/--checkpoint."""
    import dataclasses

    from tqdm import tqdm

    from vegas_jax.bench import _workload
    from vegas_jax.cli import load_from_args, sampling_from_args
    from vegas_jax.speculative import SpecConfig, speculative_generate

    sparsities = parse_sparsities(args.sparsities)
    gammas = parse_gammas(args.gammas)
    if args.batch < 1 or args.context < 1 or args.new_tokens < 1 or args.repeats < 1:
        raise ValueError("--batch, --context, --new-tokens and --repeats must be >= 1")
    base = SpecConfig(method=args.method, min_tokens=args.min_tokens, score=args.score)
    sampling = sampling_from_args(args)
    # Built (and so validated) before the model loads; `evaluate` is defined below.
    tuner = Tuner(lambda s, g: evaluate(s, g), sparsities, gammas, large_gamma=args.large_gamma,
                  threshold=args.threshold, refine=args.refine)
    if model is None:
        model = load_from_args(args)
    prompts = _workload(model, args)
    bar = tqdm(desc="tune", unit="pt", file=sys.stderr)

    def measure(spec):
        runs = [speculative_generate(model, prompts, args.new_tokens, spec, sampling,
                                     seed=args.seed).stats
                for _ in range(args.repeats)]
        st = max(runs, key=lambda r: r["decode_tokens_per_s"])
        return {"tau": st["tau"], "tok_s": st["decode_tokens_per_s"],
                "acceptance": st["acceptance_cumulative"]}

    def evaluate(sparsity, gamma):
        bar.set_postfix(sparsity=sparsity, gamma=gamma)
        out = measure(dataclasses.replace(base, sparsity=sparsity, gamma=gamma))
        bar.update()
        return out

    result = tuner.tune()
    result["grid"] = tuner.grid(result["chosen"]) if args.grid else None
    result["vanilla_tok_s"] = (None if args.no_vanilla else
                               measure(dataclasses.replace(base, method="vanilla"))["tok_s"])
    bar.close()
    result["points"] = list(tuner.points.values())
    return result


def _table(curve, vary: str, chosen=None) -> str:
    lines = [f"| {vary} | tau | tok/s |", "|---|---|---|"]
    for p in curve:
        mark = " *" if chosen is not None and p[vary] == chosen else ""
        lines.append(f"| {p[vary]:g}{mark} | {p['tau']:.2f} | {p['tok_s']:.1f} |")
    return "\n".join(lines)


def format_report(res: dict, sparsities, gammas) -> str:
    s1, s2, s3, ch = res["step1"], res["step2"], res["step3"], res["chosen"]
    out = [f"step 1: sparsity sweep at gamma {s1['gamma']} -> sparsity {s1['sparsity']:g}",
           _table(s1["curve"], "sparsity", s1["sparsity"]), "",
           f"step 2: gamma sweep at sparsity {s2['sparsity']:g} -> gamma {s2['gamma']}",
           _table(s2["curve"], "gamma", s2["gamma"]), "",
           f"step 3: sparsity refinement at gamma {s3['gamma']}",
           _table(s3["curve"], "sparsity", ch["sparsity"]), "",
           f"chosen: sparsity {ch['sparsity']:g}, gamma {ch['gamma']} "
           f"(tau {ch['tau']:.2f}, {ch['tok_s']:.1f} tok/s)"]
    if res.get("vanilla_tok_s"):
        out.append(f"vanilla: {res['vanilla_tok_s']:.1f} tok/s "
                   f"(chosen = {ch['tok_s'] / res['vanilla_tok_s']:.2f}x)")
    if res.get("grid"):
        pts = {(p["sparsity"], p["gamma"]): p for p in res["points"]}
        head = "| sparsity \\ gamma | " + " | ".join(str(g) for g in gammas) + " |"
        lines = ["", "grid tok/s (tau):", head, "|---" * (len(gammas) + 1) + "|"]
        for s in sparsities:
            cells = [f"{pts[(round(s, 6), g)]['tok_s']:.1f} ({pts[(round(s, 6), g)]['tau']:.2f})"
                     for g in gammas]
            lines.append(f"| {s:g} | " + " | ".join(cells) + " |")
        b, r = res["grid"]["best"], res["grid"]["ratio"]
        lines.append(f"grid best: sparsity {b['sparsity']:g}, gamma {b['gamma']} "
                     f"({b['tok_s']:.1f} tok/s); tuner / best = {r:.3f}")
        out += lines
    return "\n".join(out)


def plot(res: dict, path: str, gammas) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = 4 if res.get("grid") else 3
    fig, ax = plt.subplots(1, n, figsize=(4.2 * n, 3.6))
    c1, c2, c3, ch = (res["step1"]["curve"], res["step2"]["curve"], res["step3"]["curve"],
                      res["chosen"])
    ax[0].plot([p["sparsity"] for p in c1], [p["tau"] for p in c1], "o-")
    ax[0].axvline(res["step1"]["sparsity"], ls="--", c="gray")
    ax[0].set(xlabel="sparsity", ylabel="tau (tokens/round)",
              title=f"1: tau vs sparsity (gamma {res['step1']['gamma']})")
    ax[1].plot([p["gamma"] for p in c2], [p["tok_s"] for p in c2], "o-")
    ax[1].axvline(res["step2"]["gamma"], ls="--", c="gray")
    ax[1].set(xlabel="gamma", ylabel="decode tok/s",
              title=f"2: tok/s vs gamma (sparsity {res['step2']['sparsity']:g})")
    ax[2].plot([p["sparsity"] for p in c3], [p["tok_s"] for p in c3], "o-")
    ax[2].plot([ch["sparsity"]], [ch["tok_s"]], "r*", ms=12, label="chosen")
    ax[2].set(xlabel="sparsity", ylabel="decode tok/s",
              title=f"3: refinement (gamma {res['step3']['gamma']})")
    ax[2].legend()
    if res.get("grid"):
        for g in gammas:
            pts = sorted((p for p in res["points"] if p["gamma"] == g), key=lambda p: p["sparsity"])
            ax[3].plot([p["sparsity"] for p in pts], [p["tok_s"] for p in pts], ".-", label=f"γ={g}")
        ax[3].plot([ch["sparsity"]], [ch["tok_s"]], "r*", ms=12)
        ax[3].set(xlabel="sparsity", ylabel="decode tok/s",
                  title=f"grid (tuner/best = {res['grid']['ratio']:.2f})")
        ax[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None, model=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = run(args, model)
    except (ValueError, TypeError, FileNotFoundError, MemoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot:
        plot(res, args.plot, parse_gammas(args.gammas))
    if args.json:
        print(json.dumps({"args": vars(args), **res}))
    else:
        print(format_report(res, parse_sparsities(args.sparsities), parse_gammas(args.gammas)))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
