export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu_a/whl/*.whl
SUM=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
echo "$SUM  /tmp/smol.gguf" | sha256sum -c --quiet 2>/dev/null || \
  cat .gpu_a/smolpart00 .gpu_b/smolpart01 > /tmp/smol.gguf
echo "$SUM  /tmp/smol.gguf" | sha256sum -c || exit 1
nvidia-smi --query-gpu=name --format=csv,noheader
B="python3 -m vegas_jax.bench --checkpoint /tmp/smol.gguf --prompts-json .gpu_a/prompts.json --context 7680 --new-tokens 256 --profile-reps 0 --gammas 6 --compile-cache /tmp/jcc"
S="--temperature 0.6 --top-p 0.95 --top-k 20"
for n in $RUNS; do
  case $n in
    b1g) a="--batch 1";; b64g) a="--batch 64";; b64s) a="--batch 64 $S";;
    b128g) a="--batch 128";; b128s) a="--batch 128 $S";;
  esac
  mkdir -p $OUT/$n
  $B $a --methods ${METHODS:-vanilla,vegas,auto} --save $OUT/$n > $OUT/$n/log.txt 2>&1
  grep -v -i "warn\|donat" $OUT/$n/log.txt | tail -14
done
