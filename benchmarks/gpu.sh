#!/usr/bin/env bash
# Single-device GPU pieces (per-layer timings, MFU of a one-stage bfpp run); `make bench` does not need it.
# Usage: benchmarks/gpu.sh [--n-layer 12 --n-embd 1024 --batch 16 --peak-tflops 989 --out gpu.json]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
test -x "$PY" || PY=python3
exec "$PY" benchmarks/gpu.py "$@"
