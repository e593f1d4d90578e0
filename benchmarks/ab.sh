#!/usr/bin/env bash
# Two commits side by side on one GPU: the old tree in .old/ (`mkdir .old && git archive OLD vegas_jax
# pallas_kernels | tar -x -C .old`) against the working tree, each config old then new.
#   bash benchmarks/ab.sh B GAMMA   (/tmp/gpu_a: the first GGUF half, prompts.json, whl/; .gpu_b: the second half)
set -u
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
B=$1; G=$2; OUTD=${OUT:-/tmp/ab}
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/gpu_a/whl/*.whl
SUM=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
echo "$SUM  /tmp/smol.gguf" | sha256sum -c --quiet 2>/dev/null || cat /tmp/gpu_a/smolpart00 .gpu_b/smolpart01 > /tmp/smol.gguf
echo "$SUM  /tmp/smol.gguf" | sha256sum -c || exit 1
A="--checkpoint /tmp/smol.gguf --prompts-json /tmp/gpu_a/prompts.json --context 7680 --new-tokens 256 --profile-reps 0 --methods vanilla,stream,vegas,auto --batch $B --gammas $G"
S="--temperature 0.6 --top-p 0.95 --top-k 20"
root=$PWD
for mode in greedy sampled; do
  X=""; [ $mode = sampled ] && X=$S
  for code in old new; do
    dir=$root; [ $code = old ] && dir=$root/.old
    echo "=== $code B$B $mode"; t0=$(date +%s)
    (cd $dir && PYTHONPATH=.:/tmp/site python3 -m vegas_jax.bench $A $X --save $OUTD/$code) 2>&1 | grep -v -i "warn\|donat"
    echo "=== $code B$B $mode took $(( $(date +%s) - t0 )) s"
  done
done
