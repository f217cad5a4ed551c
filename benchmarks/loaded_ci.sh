#!/usr/bin/env bash
# Issue 36's check that CI is trustworthy under load: N consecutive CI runs, each a fresh clone of this repository's
# HEAD running `CI=true bash .ci/run` (install from scratch, then every test, slow ones included, in 2 test
# processes) with a busy-looping CPU hog beside it. Prints one line per run (exit code, minutes, the pytest summary)
# and a total.
#
#   bash benchmarks/loaded_ci.sh [RUNS=5] [WORK=/tmp/loaded_ci]
set -uo pipefail
RUNS=${1:-5}
WORK=${2:-/tmp/loaded_ci}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-python3}
mkdir -p "$WORK"
passed=0
for i in $(seq 1 "$RUNS"); do
  clone="$WORK/run$i"
  rm -rf "$clone"
  git clone -q "$REPO" "$clone"
  "$PY" -c "while True: pass" &
  hog=$!
  start=$(date +%s)
  (cd "$clone" && CI=true bash .ci/run) > "$WORK/run$i.log" 2>&1
  code=$?
  kill "$hog" 2>/dev/null
  wait "$hog" 2>/dev/null
  minutes=$(awk "BEGIN {printf \"%.1f\", ($(date +%s) - $start) / 60}")
  summary=$(grep -E "^[0-9]+ (passed|failed).* in " "$WORK/run$i.log" | tail -1)
  [ "$code" -eq 0 ] && passed=$((passed + 1))
  echo "run $i of $RUNS: exit $code after $minutes min (commit $(git -C "$clone" rev-parse --short HEAD)): $summary"
done
echo "== $passed of $RUNS loaded CI runs passed"
[ "$passed" -eq "$RUNS" ]
