#!/usr/bin/env bash
# End-to-end SmolLM2-135M (real weights) on the GPU machine, every method side by side:
# `python -m vegas_jax.bench` per batch size, greedy and sampled, one table each.
#   bash benchmarks/e2e_smollm2.sh [batch ...]      (default: 64 128 1)
# The GGUF travels in two halves (.gpu_a/smolpart00, .gpu_b/smolpart01: `split -n 2 -d`),
# the prompts as token ids (.gpu_a/prompts.json, `python -m benchmarks.make_prompts`), the
# gguf wheel in .gpu_a/whl.
# METHODS=a,b,c and GAMMAS=6,8 override the methods and gammas of the batched runs; EXTRA
# (any bench flags, e.g. "--exact", "--backend xla", "--profile-reps 0" for no phase split)
# is added to every run: METHODS=vanilla,vegas,auto GAMMAS=6 EXTRA="--profile-reps 0"
set -u
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
OUT=${OUT:-/tmp/e2e}
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps \
  --target /tmp/site .gpu_a/whl/*.whl || exit 1
SUM=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
# re-joined unless already whole (a call that had one half left a broken file behind)
echo "$SUM  /tmp/smol.gguf" | sha256sum -c --quiet 2>/dev/null || \
  cat .gpu_a/smolpart00 .gpu_b/smolpart01 > /tmp/smol.gguf
echo "$SUM  /tmp/smol.gguf" | sha256sum -c || exit 1
B="python3 -m vegas_jax.bench --checkpoint /tmp/smol.gguf --prompts-json .gpu_a/prompts.json
   --context 7680 --new-tokens 256 --save $OUT --profile-methods vegas --profile-reps 3
   ${EXTRA:-}"
S="--temperature 0.6 --top-p 0.95 --top-k 20"
for b in ${*:-64 128 1}; do
  if [ "$b" = 1 ]; then
    $B --batch 1 --methods vanilla,vegas,auto --gammas 6 --profile-reps 0
    continue
  fi
  M=${METHODS:-vanilla,stream,last,vegas,auto} G=${GAMMAS:-6,8}
  $B --batch "$b" --methods "$M" --gammas "$G"
  $B --batch "$b" $S --methods "$M" --gammas "$G"
done 2>&1 | grep -v -i "warn\|donat"
