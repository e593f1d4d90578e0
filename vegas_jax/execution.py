"""How a model runs, as opposed to what it computes: one static execution config.

Held with the model and passed as a static argument to every jitted function. Four
choices are the user's; every other one (GEMM emitter, prefill kernel, draft kernels,
selection kernel, grouped matmul) follows from the backend and the card.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

BACKENDS = ("auto", "pallas", "xla")
LAYERS = ("auto", "scan", "unrolled")


@dataclasses.dataclass(frozen=True)
class ExecConfig:
    """backend: "pallas" kernels (on a CPU in interpret mode) or the "xla" reference path;
      auto: pallas on a GPU, xla elsewhere.
    layers: "scan" loops over stacked layer weights (compile time flat in depth);
      "unrolled" runs one buffer per layer (no per-layer slicing, less host work a call);
      auto: unrolled on a GPU, scan elsewhere.
    tp: tensor-parallel degree (attention heads and MLP width split over tp devices).
    exact: prefill, decode and verify run row-invariant kernels (fixed-tile matmuls, one
      attention plan whatever the rows and batch; on a CPU interpreted): a row's logits never
      depend on the rows computed with it, so greedy speculative output equals plain
      decoding bit for bit in bf16 too, at any batch size. Drafts keep the fast kernels."""

    backend: str = "auto"
    layers: str = "auto"
    tp: int = 1
    exact: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.layers not in LAYERS:
            raise ValueError(f"layers must be one of {LAYERS}, got {self.layers!r}")
        if int(self.tp) != self.tp or self.tp < 1:
            raise ValueError(f"tp must be a whole number >= 1, got {self.tp}")
        if self.exact and self.tp > 1:
            raise ValueError("exact=True runs on one device: use tp=1")

    def resolve(self) -> "ExecConfig":
        """The "auto" fields decided for JAX's default backend."""
        gpu = on_gpu()
        return dataclasses.replace(
            self, backend=self.backend if self.backend != "auto" else ("pallas" if gpu else "xla"),
            layers=self.layers if self.layers != "auto" else ("unrolled" if gpu else "scan"))

    # Derived choices (read at trace time). A Pallas path on a CPU interprets the GPU's own
    # kernel choices, except those only a GPU runs (cuDNN, Mosaic).
    @property
    def pallas(self) -> bool:
        return self.backend == "pallas"

    @property
    def interpret(self) -> bool:
        return not on_gpu()

    @property
    def cudnn_prefill(self) -> bool:
        """A prompt's attention from its first token through cuDNN flash attention."""
        return self.pallas and on_gpu()

    @property
    def draft_mlp(self) -> bool:
        """A fused draft layer's MLP input as one kernel where its weights are small."""
        return self.pallas and self.tp == 1

    @property
    def moe(self) -> str:
        """The grouped expert matmuls: our Pallas kernels on a Hopper GPU, else XLA's."""
        if not (self.pallas and on_gpu() and self.tp == 1):
            return "xla"
        from pallas_kernels.grouped_matmul import hopper

        return "pallas" if hopper() else "xla"

    def compiler_options(self) -> dict:
        """XLA options of every jitted model function: on a GPU, cuBLAS for every GEMM,
        reading a layer loop's weight slices in place; exact, no excess precision."""
        # exact: round to bf16 wherever the program says, not where fusion happens to keep
        # fp32 (fusion follows the shapes, so excess precision made rows depend on them)
        opts = {"xla_allow_excess_precision": False} if self.exact else {}
        if on_gpu():
            opts.update(xla_gpu_enable_triton_gemm=False, xla_gpu_enable_dynamic_slice_fusion=True)
        return opts


jax.tree_util.register_static(ExecConfig)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


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
