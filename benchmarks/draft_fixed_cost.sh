#!/usr/bin/env bash
# The draft step's fixed costs on the GPU machine, in one call (random weights: no GGUF):
# the whole-pair draft kernel's merge_tail / write_last knobs and the fused-MLP draft
# kernel, in isolation and in the model (BENCHMARKS.md 2026-12-06 c says why).
#   bash benchmarks/draft_fixed_cost.sh [part ...]     (default: tune mlp profile)
# All three take ~10 min: within one call's limit only just, so run `tune mlp` and then
# `profile` as two calls on the warm machine.
#   tune:    tune_sparse_step --candidates merge at B 64 and 128
#   mlp:     tune_draft_gemm --what mlp at 64 and 128 rows (SmolLM2), 8 (Qwen3-8B)
#   profile: the model's draft step and round at B 64 for each whole tile, then
#            --draft-attn fused vs fused-mlp
# Output under $OUT (one file a part).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/fixed_cost}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
P="python3 -m benchmarks.kernel_profile --model smollm2-135m --batch 64 --context 7680
   --method vegas --top 8"
for part in ${*:-tune mlp profile}; do
  case $part in
    tune) for b in 64 128; do
            timeout 150 python3 -m benchmarks.tune_sparse_step --candidates merge --batch $b
          done 2>&1 | grep -v -i warn | grep -v "check:.*True$" | tee "$OUT/tune_merge.txt" ;;
    mlp) { timeout 150 python3 -m benchmarks.tune_draft_gemm --what mlp --rows 64,128
           # Qwen3-8B's draft rows at B 4 (padded to 8): large weights, cuBLAS at its floor
           timeout 120 python3 -m benchmarks.tune_draft_gemm --model qwen3-8b --what mlp \
             --rows 8 --layers 4; } 2>&1 | grep -v -i warn | tee "$OUT/draft_mlp.txt" ;;
    profile)
      { timeout 150 $P --phases draft,round \
          --whole-tiles "64,2,3,0,0;64,2,3,1,0;64,2,3,0,1;64,2,3,1,1" --json "$OUT/kp_tiles.json"
        for d in fused fused-mlp; do
          timeout 100 $P --phases draft,round --draft-attn $d --label "$d" \
            --json "$OUT/kp_$d.json"
        done; } 2>&1 | grep -v -i warn | tee "$OUT/profile.txt" ;;
    *) echo "unknown part $part (tune, mlp, profile)"; exit 2 ;;
  esac
done
