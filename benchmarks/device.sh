#!/usr/bin/env bash
# One prepared run on a lent GPU machine (8 minutes by construction), or --dry-run on CPU (under 2 minutes):
#   benchmarks/device.sh --out device.json
#   benchmarks/device.sh --dry-run --out /tmp/dry.json
# Parts, budgets and outputs: benchmarks/device.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
test -x "$PY" || PY=python3
exec "$PY" benchmarks/device.py "$@"
