#!/usr/bin/env bash
# A SmolLM2 draft step and round under XLA flag variants, one process each (XLA reads
# XLA_FLAGS once), on the GPU machine with random weights (no GGUF). The question: does
# programmatic dependent launch (Hopper: a kernel's prologue overlaps its predecessor's
# tail) shorten a draft step whose ~160 kernels each cost 3-7 us whatever their bytes?
#   bash benchmarks/xla_flags.sh [batch]          (default 64)
# Variants: label|XLA_FLAGS|extra kernel_profile args. A flag this jaxlib does not know
# aborts XLA, so each variant's flags are tried on a tiny program first and skipped if
# they fail. Output: the profile's summary lines; JSON under $OUT.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/xla_flags}
mkdir -p "$OUT"
B=${1:-64}
nvidia-smi --query-gpu=name --format=csv,noheader
VARIANTS=${VARIANTS:-"base||
pdl|--xla_gpu_enable_pdl=true|
pdl-off|--xla_gpu_enable_pdl=false|
pdl+launch|--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true|
triton||--gemm triton
triton+pdl|--xla_gpu_enable_pdl=true|--gemm triton"}
while IFS='|' read -r label flags extra; do
  [ -z "$label" ] && continue
  if ! XLA_FLAGS="$flags" timeout 60 python3 -c "import jax; jax.jit(lambda x: x + 1)(1.0).block_until_ready()" >/dev/null 2>&1; then
    echo "== $label: XLA_FLAGS='$flags' rejected by this jaxlib, skipped"; continue
  fi
  echo "== $label: XLA_FLAGS='$flags' $extra"
  XLA_FLAGS="$flags" timeout 150 python3 -m benchmarks.kernel_profile --model smollm2-135m \
    --batch "$B" --context 7680 --method vegas --phases draft,round --top 6 $extra \
    --json "$OUT/kp_b${B}_${label//+/_}.json" 2>&1 \
    | grep -E "^(draft step|round)(:| by kind| {2,})" | head -18
done <<< "$VARIANTS"
