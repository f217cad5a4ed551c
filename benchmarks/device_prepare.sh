#!/usr/bin/env bash
# Prepares this checkout for benchmarks/device.sh on the lent GPU machine, whose image has torch 2.11, lightning 2.6
# and torchmetrics 1.9 but not omegaconf / hydra-core (benchmarks/common.py reads conf/model/*.yaml with omegaconf).
# Puts those pure-Python packages, at this venv's versions, in .devsite/ (git-ignored; carried to the machine).
# Then, in one device call with carry [".devsite"] (BENCHMARKS.md, "The device run"):
#   export LIGHTNING_BFPP_ALLOW_UNTESTED_VERSIONS=1 PYTHONPATH=$PWD/.devsite PY=python3
#   bash benchmarks/device.sh --out $OUT/device.json --work /tmp/devwork
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
ver() { "$PY" -c "from importlib.metadata import version; print(version('$1'))"; }
rm -rf .devsite
"$PY" -m pip install -q --no-deps --target .devsite "omegaconf==$(ver omegaconf)" "hydra-core==$(ver hydra-core)" \
  "antlr4-python3-runtime==$(ver antlr4-python3-runtime)"
du -sh .devsite
