#!/usr/bin/env bash
# A user's first hour, as the README tells it (the install line aside): the CLI with a text
# prompt on the embedded model, a batch of text prompts, --json, and the README's Python API
# example, run as it stands there; each with its wall time, from a cold compile cache.
#
#   bash benchmarks/first_hour.sh [PYTHON [JSON]]   (PYTHON: default python3; JSON: also write the
#   table there; run from the repo root)
set -uo pipefail
PY=${1:-python3}
JSON=${2:-}
export VEGAS_JAX_COMPILE_CACHE=$(mktemp -d)  # cold: nothing compiled before
export PYTHONUNBUFFERED=1
LOG=$(mktemp -d)
rows=()
json=()

step() {  # step NAME COMMAND...: run it, keep its output, time it
  local name=$1; shift
  local t0=$EPOCHREALTIME
  "$@" >"$LOG/$name.out" 2>"$LOG/$name.err"
  local rc=$? t=$(awk "BEGIN{print $EPOCHREALTIME - $t0}")
  rows+=("| $name | $rc | $(printf %.1f "$t") |")
  json+=("$name $rc $t")
  echo "== $name (rc $rc, $(printf %.1f "$t") s)"
  tail -n 12 "$LOG/$name.out"
  [ $rc -ne 0 ] && tail -n 20 "$LOG/$name.err"
}

printf 'Three rules of writing clear code.\n' >"$LOG/q.txt"
step cli_text $PY -m vegas_jax.decode --prompt "Write a haiku about autumn." --max-new-tokens 64
step cli_batch $PY -m vegas_jax.decode --prompt "Explain a B-tree." \
  --prompt "Name three rivers of Europe." --prompt @"$LOG/q.txt" --max-new-tokens 64
step cli_json $PY -m vegas_jax.decode --prompt "What is the capital of France?" \
  --max-new-tokens 32 --json
# the README's API example, exactly as written there
$PY - <<'EOF' >"$LOG/api.py"
import re
text = open("README.md").read()
print(re.search(r"## Python API\s+```python\n(.*?)```", text, re.S).group(1))
EOF
step api_example $PY "$LOG/api.py"

echo
echo "| step | exit | wall s |"
echo "|---|---|---|"
printf '%s\n' "${rows[@]}"
echo "(logs: $LOG; compile cache: $VEGAS_JAX_COMPILE_CACHE)"
if [ -n "$JSON" ]; then printf '%s\n' "${json[@]}" | $PY -c '
import datetime, json, shutil, subprocess, sys
steps = [dict(step=n, exit=int(rc), wall_s=round(float(t), 2)) for n, rc, t in map(str.split, sys.stdin)]
smi = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
gpu = subprocess.run(smi, capture_output=True, text=True).stdout.strip() if shutil.which(smi[0]) else ""
json.dump(dict(command="bash benchmarks/first_hour.sh " + sys.argv[1], date=str(datetime.date.today()),
               device=gpu or "cpu", steps=steps), open(sys.argv[2], "w"), indent=1)' "$PY" "$JSON"
fi
