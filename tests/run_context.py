"""Train under context parallel, several models in one launch of N CPU processes: the example GPT
(tests/run_tp.py's configs) and tiny Hugging Face causal LMs (tests/run_hf_exact.py's), one after another in the same
processes (see tests/test_context_parallel.py).

Usage: python tests/run_context.py OUT_DIR DEVICES '[{"model": "gpt", "pp": 2, "cp": 2, "m": 2}, ...]'
Config keys: model (gpt|hf), then the worker's own keys; rank R of config i writes OUT_DIR/cfg{i}/rank{R}.pt
as that worker does.
"""

from __future__ import annotations

from pathlib import Path

import run_hf_exact
import run_tp

WORKERS = {"gpt": run_tp.run, "hf": run_hf_exact.run}


def run(cfg: dict, devices: int, out: Path) -> None:
    WORKERS[cfg["model"]]({k: v for k, v in cfg.items() if k != "model"}, devices, out)


if __name__ == "__main__":
    from launch import run_configs

    run_configs(run)
