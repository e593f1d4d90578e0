"""How a model runs, as opposed to what it computes: one static execution config.

Built once from CLI / API arguments, held with the model, and passed as a static argument
to every jitted function (like jax-llm-examples' decode-kernel flag). Nothing in model code
reads the environment: every switch lives here.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

ATTN = ("auto", "pallas", "xla")
GEMM = ("auto", "triton", "cublas")
LAYERS = ("auto", "scan", "unrolled")
DRAFT = ("auto", "fused", "split", "merged", "fused-mlp")
SELECT = ("auto", "capture", "fused", "pallas", "xla")
PREFILL = ("auto", "pallas", "cudnn")
MOE = ("auto", "xla", "mosaic", "triton", "pallas")

# GPU defaults, from kernel profiles and host timings (BENCHMARKS.md, "What changed",
# "Weight reads" and "Host dispatch"): decode-shaped matmuls read large weights several
# times faster through cuBLAS than through XLA's Triton GEMM; and per-layer weight buffers
# walked by an unrolled loop, because in a layer loop XLA reads each layer's weight slices
# at offsets the host computes, so the host walks the loop body once per layer of every
# forward: ~48 us a layer, 10-14 ms of host work for a SmolLM2 round at B = 64 that the
# GPU runs in 13 ms (sampled rounds were host bound), against ~1.4 ms unrolled.


def select_impl(select: str, attn: str) -> str:
    """The selection's backend for `select` under attention backend `attn`: "auto" is the
    kernel from the captured logits where the attention runs on Pallas, XLA's count passes
    elsewhere."""
    if select != "auto":
        return select
    return "capture" if attn == "pallas" else "xla"


@dataclasses.dataclass(frozen=True)
class ExecConfig:
    """attn: attention backend ("pallas" kernels or the "xla" reference path).
    gemm: XLA's GEMM emitter on the GPU ("triton" or "cublas"); no effect on the CPU.
    layers: "scan" walks stacked layer weights with a `lax.while_loop` (compile time flat in
      depth); "unrolled" runs a Python loop over per-layer weight buffers (on the GPU no
      per-layer slicing, whose offsets the host computes layer by layer; longer compiles).
      The params' layout must match (`layout_params`).
    draft: with the Pallas kernels, a sparse draft step's attention block (Q/K norm, RoPE,
      K/V write, sparse attention, combine) runs as one "fused" kernel or "split" into
      XLA ops around the sparse-attention kernel; no effect on the XLA path. "merged":
      fused, and a draft layer's four matmuls as three through draft-only weights made at
      load (`model.merge_draft`: the MLP's gate/up rides on the input projection and on
      the output projection through wo @ w_gate_up; dense models, one device; more weight
      memory: for small models whose draft matmuls are launch bound). "fused-mlp": fused,
      and a draft layer's MLP input -- the norm's row scale, the gate/up matmul and
      silu(gate) * up, three kernels -- as one Pallas kernel (`pallas_kernels.draft_mlp`;
      dense models with folded norm weights, one device; only in layers whose gate/up
      weights are small enough that three kernels cost more than their bytes, and at
      enough rows: `draft_mlp.SMALL_BYTES`, `draft_mlp.MIN_ROWS`).
    select: the selection's top-k: "capture", one kernel from the verify's captured logits
      for all layers (scores, carry, threshold and compaction: `capture_select`; where the
      method and model allow it -- the mean of softmax weights, one device, no sliding
      windows, rows of at most 16K positions -- else "fused"); threshold and compaction in
      one "fused" kernel over the scores the verify's epilogue made, the threshold alone
      in one "pallas" kernel that reads the scores once (the compaction in XLA), or XLA
      count passes ("xla", one read of the scores a pass).
    prefill: with the Pallas kernels, a prompt's attention from its first token: the
      "pallas" kernel, or "cudnn" flash attention (~2x faster at long prompts; bf16/fp16
      only, fp32 runs the kernel). Slices of a prompt that start later, and the verify,
      always run the kernel.
    moe: mixture-of-experts grouped matmuls through XLA's `lax.ragged_dot` ("xla"; on the
      GPU a dense computation over every expert) or jax's Mosaic-GPU grouped matmul
      ("mosaic", Hopper only; `pallas_kernels.grouped_matmul`), or our Pallas Triton
      grouped matmul ("triton": reads only the experts in use, no spare tiles; faster up
      to ~32 tokens), or "pallas": triton for few rows, mosaic for many (Hopper only).
    tp: tensor-parallel degree: the model split across this many devices (`sharding`).
    row_pad: a fused draft of a dense model carries its residual stream padded to a
      multiple of this many rows (the padding rows compute zeros and are dropped before
      the LM head): cuBLAS pads half-precision matmul operands to multiples of 8, and at
      B 4 XLA did so with a pad kernel before each of a draft layer's four matmuls (8 % of
      a Qwen3-8B draft step). 1: no padding.
    "auto" resolves by backend: on the GPU cuBLAS and unrolled layers; elsewhere the XLA
    path and a scan; fused drafts wherever the Pallas kernels run (with the MLP kernel on
    the GPU without tensor parallelism: "fused-mlp"); the selection's kernel
    where the attention's are; cuDNN prefills on the GPU; the Pallas grouped matmuls
    (triton for few rows, mosaic for many) on a Hopper GPU without tensor parallelism."""

    attn: str = "auto"
    gemm: str = "auto"
    layers: str = "auto"
    draft: str = "auto"
    select: str = "auto"
    prefill: str = "auto"
    moe: str = "auto"
    tp: int = 1
    row_pad: int = 8

    def __post_init__(self):
        for name, allowed in (("attn", ATTN), ("gemm", GEMM), ("layers", LAYERS),
                              ("draft", DRAFT), ("select", SELECT),
                              ("prefill", PREFILL), ("moe", MOE)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if int(self.tp) != self.tp or self.tp < 1:
            raise ValueError(f"tp must be a whole number >= 1, got {self.tp}")
        if int(self.row_pad) != self.row_pad or self.row_pad < 1:
            raise ValueError(f"row_pad must be a whole number >= 1, got {self.row_pad}")
        if self.draft in ("merged", "fused-mlp") and self.tp > 1:
            raise ValueError(f"draft={self.draft!r} runs on one device: use draft='fused' "
                             "with tp > 1")
        if self.moe in ("mosaic", "pallas") and self.tp > 1:
            raise ValueError(f"moe={self.moe!r} runs on one device: use moe='xla' with tp > 1")

    def resolve(self, backend: str | None = None) -> "ExecConfig":
        """Concrete choices on `backend` (default: JAX's)."""
        gpu = (backend or jax.default_backend()) == "gpu"
        attn = self.attn if self.attn != "auto" else ("pallas" if gpu else "xla")
        if self.moe in ("mosaic", "pallas") and not gpu:
            raise ValueError(f"moe={self.moe!r} needs a Hopper GPU (H100 / H200): use moe='xla'")
        if self.moe != "auto":
            moe = self.moe
        else:
            from pallas_kernels.grouped_matmul import hopper

            moe = "pallas" if gpu and self.tp == 1 and hopper() else "xla"
        return ExecConfig(
            attn=attn,
            gemm=self.gemm if self.gemm != "auto" else ("cublas" if gpu else "triton"),
            layers=self.layers if self.layers != "auto" else ("unrolled" if gpu else "scan"),
            draft=self._draft(attn, gpu),
            select=select_impl(self.select, attn),
            prefill=self.prefill if self.prefill != "auto" else ("cudnn" if gpu else "pallas"),
            moe=moe,
            tp=self.tp,
            row_pad=self.row_pad,
        )

    def _draft(self, attn: str, gpu: bool) -> str:
        if attn != "pallas":  # the merged weights and the MLP kernel serve the fused draft
            return "fused" if self.draft in ("auto", "merged", "fused-mlp") else self.draft
        if self.draft == "auto":  # the MLP kernel pays on the GPU (BENCHMARKS.md 12-06 d)
            return "fused-mlp" if gpu and self.tp == 1 else "fused"
        return self.draft

    @property
    def resolved(self) -> bool:
        return "auto" not in (self.attn, self.gemm, self.layers, self.draft, self.select,
                              self.prefill, self.moe)

    def compiler_options(self) -> dict:
        """XLA options of every jitted model function: on the GPU, cuBLAS reading a layer
        loop's weight slices in place."""
        if self.gemm != "cublas":
            return {}
        return {"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_dynamic_slice_fusion": True}


jax.tree_util.register_static(ExecConfig)


def model_jit(fun=None, **kwargs):
    """`jax.jit` for functions that take an `ExecConfig` among their arguments: compiled
    with that config's compiler options (one jitted variant per option set)."""
    if fun is None:
        return functools.partial(model_jit, **kwargs)

    @functools.cache
    def variant(opts: tuple):
        return jax.jit(fun, compiler_options=dict(opts), **kwargs)

    def pick(args, kw):
        xc = next((a for a in (*args, *kw.values()) if isinstance(a, ExecConfig)), None)
        if xc is None:
            raise TypeError(f"{fun.__name__} needs an ExecConfig argument")
        return variant(tuple(sorted(xc.compiler_options().items())))

    @functools.wraps(fun)
    def call(*args, **kw):
        return pick(args, kw)(*args, **kw)

    call.lower = lambda *args, **kw: pick(args, kw).lower(*args, **kw)
    return call


def add_exec_args(p) -> None:
    """The execution flags every command shares (argparse)."""
    p.add_argument("--attn-impl", default=None, choices=ATTN[1:],
                   help="attention backend; unset: pallas on GPU, xla on CPU")
    p.add_argument("--gemm", default="auto", choices=GEMM,
                   help="XLA's GEMM emitter on the GPU (auto: cuBLAS, reading a scan's "
                   "weight slices in place); no effect on the CPU")
    p.add_argument("--layers", default="auto", choices=LAYERS,
                   help="layer loop: a loop over stacked weights (compiles fastest) or "
                   "unrolled over per-layer weight buffers (less host work per call on the "
                   "GPU); auto: unrolled on the GPU, loop elsewhere")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallel over N devices (attention heads and MLP width split; "
                   "N must divide the model's KV heads)")
    p.add_argument("--draft-attn", default="auto", choices=DRAFT,
                   help="Pallas path only: a draft step's attention block (norm, RoPE, K/V "
                   "write, sparse attention) as one fused kernel or split into XLA "
                   "ops around the sparse-attention kernel; merged: fused, and the draft "
                   "layer's four matmuls as three through extra draft-only weights (dense "
                   "models, one device); fused-mlp: fused, and the draft layer's MLP input "
                   "(norm, gate/up, activation) as one Pallas kernel where its weights are "
                   "small (dense models, one device); auto: fused-mlp on the GPU with --tp "
                   "1, else fused")
    p.add_argument("--draft-row-pad", type=int, default=8, metavar="N",
                   help="fused drafts of dense models carry their batch padded to a "
                   "multiple of N rows, so that cuBLAS pads no matmul input (1: off)")
    p.add_argument("--select-impl", default="auto", choices=SELECT,
                   help="the selection's top-k: scores, carry, threshold and compaction "
                   "in one Pallas kernel from the verify's captured logits (capture; "
                   "fused where a method or model cannot), threshold and compaction in one "
                   "kernel over scores an epilogue made (fused), the threshold alone in "
                   "one (pallas), or XLA count passes (xla); auto: capture where the "
                   "attention is pallas")
    p.add_argument("--prefill-impl", default="auto", choices=PREFILL,
                   help="Pallas path only: a prompt's attention from its first token through "
                   "the Pallas kernel or cuDNN flash attention (bf16/fp16; ~2x faster at "
                   "long prompts); auto: cudnn on the GPU")
    p.add_argument("--moe-impl", default="auto", choices=MOE,
                   help="mixture-of-experts models: grouped expert matmuls through XLA's "
                   "ragged_dot (dense over every expert on the GPU) or jax's Mosaic-GPU "
                   "grouped matmul (reads only the experts in use; Hopper only) or our "
                   "Pallas Triton one (triton; faster up to ~32 tokens) or pallas (triton "
                   "for few rows, mosaic for many; Hopper only); auto: pallas on an "
                   "H100/H200 without --tp, xla elsewhere")


def exec_from_args(args) -> ExecConfig:
    return ExecConfig(attn=args.attn_impl or "auto", gemm=args.gemm, layers=args.layers,
                      draft=args.draft_attn, select=getattr(args, "select_impl", "auto"),
                      prefill=getattr(args, "prefill_impl", "auto"),
                      moe=getattr(args, "moe_impl", "auto"), tp=args.tp,
                      row_pad=getattr(args, "draft_row_pad", 8))
