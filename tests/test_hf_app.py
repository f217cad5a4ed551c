# Scope: the app's Hugging Face model configs from the command line (model=hf_llama_tiny, model=hf_gpt2_tiny):
# random-init tiny models built locally (nothing downloaded) train under bfpp and write summary.json.
from __future__ import annotations

import json
import math

import pytest
from hydra import compose, initialize_config_dir

from test_app import CONF, run_cli

pytest.importorskip("transformers", reason="transformers is not installed (pip install lightning-bfpp[hf])")

CHEAP = ["cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=2", "schedule.micro_batches=2",
         "data.batch_size=8", "data.max_bytes=100000", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "logger=none", "checkpoint.last=false"]


@pytest.mark.parametrize("model, extra", [
    ("hf_llama_tiny", ["trainer.precision=bf16-mixed", "model.activation_checkpointing=true"]),  # strategy's AC
    ("hf_gpt2_tiny", []),  # fp32, tied embeddings
])
def test_hf_model_trains_from_the_command_line(tmp_path, model, extra):
    run_cli([f"model={model}", *CHEAP, *extra, f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["model"] == model and s["steps"] == 2 and s["pipeline_parallel"] == 2 and s["loops"] == 2
    assert math.isfinite(s["train_loss"]) and math.isfinite(s["val_loss"]) and 0 < s["train_loss"] < 7
    assert s["params"] > 0 and s["model_flops_per_s"] > 0  # flops_per_token from model.n_layer/n_embd/block_size


def test_hf_configs_follow_the_layer_rule():
    """n_layer + 2 pipeline layers (embedding, decoder layers, norm + head), as for the example GPT."""
    from config_checks import ConfigError, check_config

    for model in ("hf_llama_tiny", "hf_gpt2_tiny"):
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            ok = compose("train", overrides=[f"model={model}", "schedule.pipeline_parallel=2", "schedule.loops=3"])
            bad = compose("train", overrides=[f"model={model}", "schedule.pipeline_parallel=2", "schedule.loops=4"])
        check_config(ok)  # 6 stages, 6 layers
        with pytest.raises(ConfigError, match=r"8 stages .* model.n_layer=4 \(embedding, 4 blocks, head\) gives 6"):
            check_config(bad)
