#!/usr/bin/env bash
# Times every prepared step (benchmarks/gpu/exports/*/, made by prepare.py) on this
# machine's GPU with jax alone: one JSON line per step in $OUT/steps.jsonl, the optimized
# HLO and a profiler trace per step under $OUT/NAME/, the machine in $OUT/machine.txt.
#   OUT=/some/folder bash benchmarks/gpu/run_all.sh [--steps N]
# (EXPORTS=folder: time the steps there instead; PYTHON=interpreter: another than python3;
# tests/plan/test_export_step.py runs it so, on CPU)
# Each step is bounded (STEP_TIMEOUT_S, default 240 s) so that one slow compile cannot
# take the whole lease, and the whole run by TOTAL_S (default 540 s: a device command may
# run 600 s): a step gets what is left, and the steps after the deadline are recorded as
# skipped. A failed or stopped step is recorded (with the phases it reached, and its
# timing if it got that far) and the next one runs. The steps run in the order
# of exports/ORDER (prepare.py's); CASES="name name ...": only those, in that order.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to a folder for the results}
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  "${PYTHON:-python3}" -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices())' 2>&1
} > "$OUT/machine.txt"
start=$(date +%s)
exports=${EXPORTS:-benchmarks/gpu/exports}
# CASES, else the order prepare.py wrote (exports/ORDER), else every export by name
names=${CASES:-$(cat "$exports/ORDER" 2>/dev/null || (cd "$exports" && ls -d */ | tr -d /))}
for name in $names; do
  dir=$exports/$name
  left=$(( ${TOTAL_S:-540} - ($(date +%s) - start) ))
  if [ "$left" -lt 30 ]; then
    echo "{\"name\": \"$name\", \"skipped\": \"TOTAL_S=${TOTAL_S:-540} reached\"}" >> "$OUT/steps.jsonl"
    continue
  fi
  limit=${STEP_TIMEOUT_S:-240}
  [ "$left" -lt "$limit" ] && limit=$left
  mkdir -p "$OUT/$name"
  if timeout "$limit" "${PYTHON:-python3}" benchmarks/gpu/run_step.py "$dir" \
      --out "$OUT/$name" --profile "$OUT/$name/profile" "$@" \
      > "$OUT/$name/result.json" 2> "$OUT/$name/stderr.txt"; then
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r["name"]=sys.argv[2]; print(json.dumps(r))' \
      "$OUT/$name/result.json" "$name" >> "$OUT/steps.jsonl"
  else
    # failed or stopped (124: the timeout): its exit status, the phases it reached
    # (run_step.py's progress lines), the stderr's end, and the timing if it got that far
    python3 - "$OUT/$name" "$name" $? >> "$OUT/steps.jsonl" <<'PY'
import json, os, sys
folder, name, status = sys.argv[1], sys.argv[2], int(sys.argv[3])
with open(os.path.join(folder, "stderr.txt"), errors="replace") as f:
    err = f.read()
record = {"name": name, "failed": status, "stderr": err[-1500:],
          "reached": [json.loads(line.split(" ", 1)[1]) for line in err.splitlines()
                      if line.startswith("run_step: {")]}
partial = os.path.join(folder, "result.partial.json")
if os.path.exists(partial):
    with open(partial) as f:
        record = {**json.load(f), **record}
print(json.dumps(record))
PY
  fi
  tail -n 1 "$OUT/steps.jsonl" | cut -c1-300
done
