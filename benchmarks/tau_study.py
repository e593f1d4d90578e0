"""Drafting accuracy on real text: tau (mean acceptance length) of every method over kinds
of text, contexts, sparsities and gammas, with confidence intervals.

    PYTHONPATH=. python -m benchmarks.tau_study [--kinds chat-prose,prose,code]
        [--contexts 1024,2048,4096,8000] [--sparsities 0.03,0.07,0.15] [--gammas 4,6,8]
        [--methods vegas,stream,...] [--draft-weights same,int8,int4] [--seqs 8]
        [--new-tokens 96] [--json out.json] [--plot DIR]

Methods: the library's (`vegas_jax.methods.METHODS`) and the study's plug-ins
(`benchmarks.methods.PLUGINS`, e.g. vegas-all, vegas-accepted), by name. Draft weights:
the library's (`SpecConfig.draft_weights`) and the study's variants
(`benchmarks.draft_formats.VARIANTS`, e.g. int4-g32, int4-h8), by name; every method runs
with each, and a row of quantized drafts ("vegas @int4") gets its ratio to the same
method on the model's own weights ("vs same weights"), pooled over the kinds too.

The grid is a star, not a product: a centre point (the first context, the middle
sparsity and gamma unless --centre-* say otherwise) and one axis varied at a time
from it, per kind of text. Greedy decoding: every method emits vanilla's tokens, so the
methods are compared on the same sequences, pair by pair. Each sequence's tau comes from
its own rounds (`stats["tau_by_sequence"]`); a method's tau over a cell is the mean of its
sequences', and its ratio to stream gets a 95 % bootstrap interval over sequences (paired:
both methods resampled with the same sequences; greedy output is vanilla's whatever
weights the drafts read, so formats pair as methods do); the pooled tables put every kind's
sequences together, against stream and against vegas (`--from-json` re-prints them from
saved runs). tau does not need the GPU: this runs on the CPU in fp32 (set --dtype bf16
to see the GPU's arithmetic).

Kinds: "prose" (CPython's language reference) and "code" (CPython's standard library) as
raw continuation; "chat-prose" / "chat-code": the same documents with a task, through the
model's chat template (the bench's long prompts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

KINDS = ("prose", "code", "chat-prose", "chat-code")
DEFAULT_METHODS = ("vegas", "vegas-paper", "vegas-all", "vegas-accepted", "last", "stream",
                   "quest")


def prompts_for(tokenizer, kind: str, context: int, n: int) -> list[list[int]]:
    """n prompts of `context` tokens from disjoint stretches of the source."""
    from vegas_jax.workloads import TASKS, document

    chat = kind.startswith("chat-")
    source = kind.removeprefix("chat-")
    out = []
    for i in range(n):
        doc = document(tokenizer, context, source, offset=i * context)
        if chat:
            msg = [{"role": "user", "content": f"{doc}\n\n{TASKS[source]}"}]
            text = tokenizer.apply_chat_template(msg, tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer.encode(text)
            # keep the template's head and the task at the end; cut the document's start
            out.append(ids[-context:] if len(ids) > context else ids)
        else:
            out.append(tokenizer.encode(doc)[:context])
    return out


def ratio_ci(a, b, reps: int = 2000, seed: int = 0):
    """mean(a) / mean(b) and its 95 % paired bootstrap interval over the sequences."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), size=(reps, len(a)))
    r = a[idx].mean(1) / b[idx].mean(1)
    return float(a.mean() / b.mean()), float(np.percentile(r, 2.5)), float(np.percentile(r, 97.5))


def cells(args):
    """(kind, context, sparsity, gamma) of the star grid, the centre first."""
    ctx, sps, gms = args.contexts, args.sparsities, args.gammas
    c0 = args.centre_context or ctx[0]
    s0 = sps[len(sps) // 2] if args.centre_sparsity is None else args.centre_sparsity
    g0 = gms[len(gms) // 2] if args.centre_gamma is None else args.centre_gamma
    pts = [(c0, s0, g0)] + [(c0, s, g0) for s in sps] + [(c, s0, g0) for c in ctx] + \
          [(c0, s0, g) for g in gms]
    # point by point, every kind at each (`main` then runs them kind by kind, context by
    # context, so that cells share their prefills)
    return list(dict.fromkeys((kind, *p) for p in pts for kind in args.kinds))


class SharedPrefill:
    """Every method of a cell prefills the same prompts, and so does every cell of the
    same kind and context (sparsity and gamma do not enter the prefill; a gamma whose
    cache is longer is a new key): methods with the same first-selection capture get the
    same result, computed once (the prefill is most of a CPU run's time) and handed to
    each method as its own copy (the decoding loop donates the cache)."""

    def __init__(self):
        import vegas_jax.prefill as prefill_mod  # the driver reads it from there per run

        self.mod, self.real, self.memo = prefill_mod, prefill_mod.prefill_prompts, {}

    def __enter__(self):
        def shared(params, cfg, xc, ids, cache, capture):
            import jax
            import jax.numpy as jnp

            key = (capture, cache.k.shape, cache.k.dtype, tuple(map(tuple, ids)))
            if key not in self.memo:
                self.memo[key] = self.real(params, cfg, xc, ids, cache, capture)
            return jax.tree.map(jnp.copy, self.memo[key])

        self.mod.prefill_prompts = shared
        return self

    def __exit__(self, *exc):
        self.mod.prefill_prompts = self.real
        self.memo.clear()


def draft_models(model, names) -> dict:
    """{draft weights name: (the model its runs decode with, its SpecConfig.draft_weights)},
    a variant's params made once (`benchmarks.draft_formats.model_for`)."""
    from benchmarks.draft_formats import model_for

    return {w: model_for(model, w) for w in names}


def run_cell(model, kind, context, sparsity, gamma, args, shared: SharedPrefill | None = None,
             models: dict | None = None):
    """One cell's rows; `shared`: an entered SharedPrefill that outlives the cell; models:
    `draft_models` of args.draft_weights (None: made here)."""
    prompts = prompts_for(model.tokenizer, kind, context, args.seqs)
    models = models or draft_models(model, args.draft_weights)
    if shared is not None:
        return _run_methods(models, prompts, kind, context, sparsity, gamma, args)
    with SharedPrefill():
        return _run_methods(models, prompts, kind, context, sparsity, gamma, args)


def _run_methods(models, prompts, kind, context, sparsity, gamma, args):
    from benchmarks.methods import method_of
    from vegas_jax import SpecConfig, speculative_generate

    per = {}
    ref = None
    for m in args.methods:
        for w in args.draft_weights:
            t0 = time.perf_counter()
            model, lib_weights = models[w]
            spec = SpecConfig(method=method_of(m), gamma=gamma, sparsity=sparsity,
                              min_tokens=args.min_tokens, draft_weights=lib_weights)
            res = speculative_generate(model, prompts, args.new_tokens, spec,
                                       max_batch=args.batch)
            st = res.stats
            if ref is None:
                ref = res.tokens
            equal = sum(x == y for x, y in zip(res.tokens, ref))
            per[m, w] = {"tau_by_sequence": st["tau_by_sequence"],
                         "equal_to_first_method": equal, "s": time.perf_counter() - t0}
            print(f"  {kind} ctx {context} sp {sparsity} g {gamma} {label(m, w)}: tau "
                  f"{st['tau']:.3f} ({per[m, w]['s']:.0f} s)", file=sys.stderr, flush=True)
    rows = []
    for (m, w), r in per.items():
        seq = [t for t in r["tau_by_sequence"] if t is not None]
        row = {"kind": kind, "context": context, "sparsity": sparsity, "gamma": gamma,
               "method": m, "draft_weights": w, "seqs": len(seq), "tau": float(np.mean(seq)),
               "tau_by_sequence": r["tau_by_sequence"],
               "equal_to_first_method": r["equal_to_first_method"]}
        # against stream on the model's own weights; a quantized row also against its
        # method on the model's own weights
        for key, base in (("vs_stream", per.get(("stream", "same"))),
                          ("vs_same", per.get((m, "same")) if w != "same" else None)):
            if base is not None:
                row[key], row[key + "_lo"], row[key + "_hi"] = ratio_ci(
                    *_paired(r["tau_by_sequence"], base["tau_by_sequence"]))
        rows.append(row)
    return rows


def label(method: str, weights: str = "same") -> str:
    """A row's name in the tables: the method, and its draft weights where not the model's."""
    return method if weights == "same" else f"{method} @{weights}"


def _label(row) -> str:
    return label(row["method"], row.get("draft_weights", "same"))  # older runs: "same"


def _same_label(row) -> str | None:
    """The label of the row's method on the model's own weights (None: the row is one)."""
    return row["method"] if row.get("draft_weights", "same") != "same" else None


def _paired(a, b):
    """Sequences where both methods made a round: (a's taus, b's taus)."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    return tuple(zip(*pairs))


def table(rows, refs=("stream", "vegas")) -> str:
    """Each row's tau and its paired ratio to each reference method of the same cell (on
    the model's own weights), and where some drafts read other weights, to its own method
    on the model's weights ("vs same weights")."""
    by = {(r["kind"], r["context"], r["sparsity"], r["gamma"], _label(r)): r for r in rows}
    quant = any(_same_label(r) for r in rows)
    cols = [f"vs {m}" for m in refs] + (["vs same weights"] if quant else [])
    out = ["| kind | context | sparsity | gamma | method | tau |"
           + "".join(f" {c} (95 % CI) |" for c in cols),
           "|---|---|---|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        cell = (r["kind"], r["context"], r["sparsity"], r["gamma"])
        vs = ""
        for m in [*refs, *([_same_label(r)] if quant else [])]:
            ref = by.get((*cell, m)) if m else None
            vs += (" %.3f [%.3f, %.3f] |" % ratio_ci(*_paired(r["tau_by_sequence"],
                                                               ref["tau_by_sequence"]))
                   if ref else " — |")
        out.append(f"| {r['kind']} | {r['context']} | {r['sparsity']:g} | {r['gamma']} | "
                   f"{_label(r)} | {r['tau']:.3f} |" + vs)
    return "\n".join(out)


def pooled(rows, refs=("stream", "vegas")) -> str:
    """Per (context, sparsity, gamma): each method's tau per kind and its ratio to each
    reference method over the sequences of every kind together (paired, 95 % bootstrap),
    and where some drafts read other weights, to its own method on the model's weights.
    The study's summary tables."""
    out = []
    for cell in dict.fromkeys((r["context"], r["sparsity"], r["gamma"]) for r in rows):
        mine = [r for r in rows if (r["context"], r["sparsity"], r["gamma"]) == cell]
        kinds = list(dict.fromkeys(r["kind"] for r in mine))
        by = {(r["kind"], _label(r)): r["tau_by_sequence"] for r in mine}
        same = {_label(r): _same_label(r) for r in mine}
        have = [m for m in refs if all((k, m) in by for k in kinds)]
        quant = any(same.values())

        def seqs(m, others):  # sequences with a round under m and every one of others,
            # in the kinds that ran them all (a method run on some kinds only is pooled
            # over those)
            pairs = [[by[(k, x)][i] for x in (m, *others)] for k in kinds
                     if all((k, x) in by for x in (m, *others))
                     for i in range(len(by[(k, m)]))]
            return np.array([p for p in pairs if None not in p], float).reshape(
                -1, 1 + len(others))

        out += [f"\ncontext {cell[0]}, sparsity {cell[1]:g}, gamma {cell[2]}",
                "| method | " + " | ".join(f"{k} tau" for k in kinds)
                + "".join(f" | vs {m}, pooled" for m in have)
                + (" | vs same weights, pooled" if quant else "") + " |",
                "|---|" + "---|" * (len(kinds) + len(have) + quant)]
        for m in same:
            taus = [np.mean([t for t in by[(k, m)] if t is not None]) if (k, m) in by
                    else None for k in kinds]
            x = seqs(m, have)
            vs = "".join(" | %.3f [%.3f, %.3f]" % ratio_ci(x[:, 0], x[:, 1 + j])
                         for j in range(len(have)))
            if quant:
                y = seqs(m, [same[m]]) if same[m] else None
                vs += " | —" if y is None or not len(y) else " | %.3f [%.3f, %.3f]" % (
                    ratio_ci(y[:, 0], y[:, 1]))
            out.append(f"| {m} | " + " | ".join("—" if t is None else f"{t:.2f}"
                                                for t in taus) + vs + " |")
    return "\n".join(out)


def plot(rows, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = []
    for axis in ("context", "sparsity", "gamma"):
        kinds = sorted({r["kind"] for r in rows})
        fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
        for ax, kind in zip(axes[0], kinds):
            mine = [r for r in rows if r["kind"] == kind]
            fixed = {k: max({r[k] for r in mine}, key=[r[k] for r in mine].count)
                     for k in ("context", "sparsity", "gamma") if k != axis}
            for m in dict.fromkeys(map(_label, mine)):
                pts = sorted((r[axis], r["tau"]) for r in mine if _label(r) == m
                             and all(r[k] == v for k, v in fixed.items()))
                if len(pts) > 1:
                    ax.plot(*zip(*pts), marker="o", label=m)
            ax.set_xlabel(axis)
            ax.set_ylabel("tau")
            ax.set_title(f"{kind} ({', '.join(f'{k} {v:g}' for k, v in fixed.items())})")
            if axis == "context":
                ax.set_xscale("log", base=2)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = Path(out_dir) / f"tau_vs_{axis}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def _ints(s):
    return [int(x) for x in s.split(",") if x]


def _names(s):
    return [x for x in s.split(",") if x]


def _floats(s):
    return [float(x) for x in s.split(",") if x]


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", help="model checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--kinds", default="chat-prose,prose,code",
                   help=f"comma-separated, from {', '.join(KINDS)}")
    p.add_argument("--contexts", default="1024,2048,4096,8000", type=_ints,
                   help="prompt lengths in tokens (prompt + new tokens + a round's room must fit "
                        "the model's context: SmolLM2's is 8192)")
    p.add_argument("--sparsities", default="0.03,0.07,0.15", type=_floats)
    p.add_argument("--gammas", default="4,6,8", type=_ints)
    p.add_argument("--centre-context", type=int, help="context of the centre point "
                   "(default: the first of --contexts)")
    p.add_argument("--centre-sparsity", type=float, help="default: the middle of --sparsities")
    p.add_argument("--centre-gamma", type=int, help="default: the middle of --gammas")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma-separated names from vegas_jax.methods.METHODS and "
                   "benchmarks.methods.PLUGINS (stream is the ratio's reference)")
    p.add_argument("--draft-weights", default="same", type=_names,
                   help="comma-separated weights the drafts read: the library's (same, "
                   "int8, int4; `SpecConfig.draft_weights`) and benchmarks.draft_formats."
                   "VARIANTS (e.g. int4-g32, int4-h8); every method runs with each (same is "
                   "the ratios' reference)")
    p.add_argument("--seqs", type=int, default=8, help="sequences per cell")
    p.add_argument("--batch", type=int, default=None,
                   help="sequences decoded at once (default: all of a cell's)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--min-tokens", type=int, default=64,
                   help="floor of the draft's budget (the library's default, 256, would "
                        "be a third of a 1K context at 7 %%)")
    p.add_argument("--json", help="write every row here")
    p.add_argument("--plot", help="write tau_vs_{context,sparsity,gamma}.png here")
    p.add_argument("--from-json", nargs="+", metavar="FILE",
                   help="print the tables (and --plot) of saved --json runs; run nothing")
    return p


def main(argv=None) -> int:
    import jax.numpy as jnp

    from benchmarks.draft_formats import check_name
    from benchmarks.methods import method_of
    from vegas_jax.loading import load_model
    from vegas_jax.methods import Auto

    args = build_parser().parse_args(argv)
    if args.from_json:
        rows = []
        for path in args.from_json:
            with open(path) as f:
                rows += json.load(f)["rows"]
        report(rows, args.plot)
        return 0
    args.kinds = [k for k in args.kinds.split(",") if k]
    args.methods = [m for m in args.methods.split(",") if m]
    for k in args.kinds:
        if k not in KINDS:
            raise SystemExit(f"unknown kind {k!r}; choose from {', '.join(KINDS)}")
    for m in args.methods:
        try:
            method = method_of(m)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        if not method.speculative or isinstance(method, Auto):
            raise SystemExit(f"{m!r} is not a drafting method of one gamma")
    for w in args.draft_weights:
        try:
            check_name(w)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    if args.seqs < 2:
        raise SystemExit("--seqs must be >= 2 (the interval needs several sequences)")
    model = load_model(checkpoint=args.checkpoint,
                       dtype=jnp.float32 if args.dtype == "fp32" else jnp.bfloat16)
    models = draft_models(model, args.draft_weights)  # a variant's params made once
    rows = []
    # cells of one kind and context in a row, so that their prefills are shared
    grid = sorted(cells(args), key=lambda c: (args.kinds.index(c[0]), c[1]))
    with SharedPrefill() as shared:
        for i, (kind, ctx, sp, g) in enumerate(grid):
            if i and grid[i - 1][:2] != (kind, ctx):
                shared.memo.clear()  # another kind or context: the old prefills go
            print(f"cell {i + 1}/{len(grid)}: {kind}, context {ctx}, sparsity {sp}, gamma {g}",
                  file=sys.stderr, flush=True)
            rows += run_cell(model, kind, ctx, sp, g, args, shared, models)
            if args.json:  # after every cell: a long study keeps what it measured
                with open(args.json, "w") as f:
                    json.dump({"args": {k: v for k, v in vars(args).items()}, "rows": rows},
                              f, indent=1)
    report(rows, args.plot)
    return 0


def report(rows, plot_dir=None):
    print(table(rows))
    print(pooled(rows))
    if plot_dir:
        for p in plot(rows, plot_dir):
            print(f"wrote {p}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
