"""The app's Hugging Face model configs from the command line (model=hf_llama_tiny, model=hf_gpt2_tiny):
random-init tiny models built locally (nothing downloaded) train under bfpp and write summary.json; a saved model
(model=hf_pretrained model.path=DIR) fine-tunes."""
from __future__ import annotations

import json
import math

import pytest
from app_config import compose_app
from test_app import run_cli

pytest.importorskip("transformers", reason="transformers is not installed (pip install lightning-bfpp[hf])")

CHEAP = ["cluster=cpu_2", "schedule.pipeline_parallel=2", "schedule.loops=2", "schedule.micro_batches=2",
         "data.batch_size=8", "data.max_bytes=100000", "trainer.max_steps=2", "trainer.val_check_interval=2",
         "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false", "logger=none", "checkpoint.last=false"]


@pytest.mark.parametrize("model, extra", [
    ("hf_llama_tiny", ["trainer.precision=bf16-mixed", "model.activation_checkpointing=true"]),  # strategy's AC
    pytest.param("hf_gpt2_tiny", [], marks=pytest.mark.slow),  # fp32, tied embeddings
])
def test_hf_model_trains_from_the_command_line(tmp_path, model, extra):
    run_cli([f"model={model}", *CHEAP, *extra, f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["model"] == model and s["steps"] == 2 and s["pipeline_parallel"] == 2 and s["loops"] == 2
    assert math.isfinite(s["train_loss"]) and math.isfinite(s["val_loss"]) and 0 < s["train_loss"] < 7
    assert s["params"] > 0 and s["model_flops_per_s"] > 0  # flops_per_token from model.n_layer/n_embd/block_size


def test_hf_configs_follow_the_layer_rule():
    """n_layer + 2 pipeline layers (embedding, decoder layers, norm + head), as for the example GPT."""
    from app.checks import ConfigError, check_config

    for model in ("hf_llama_tiny", "hf_gpt2_tiny"):
        ok = compose_app([f"model={model}", "schedule.pipeline_parallel=2", "schedule.loops=3"])
        bad = compose_app([f"model={model}", "schedule.pipeline_parallel=2", "schedule.loops=4"])
        check_config(ok)  # 6 stages, 6 layers
        with pytest.raises(ConfigError, match=r"8 stages .* model.n_layer=4 \(embedding, 4 blocks, head\) gives 6"):
            check_config(bad)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny Llama with a byte vocabulary, written by save_pretrained (what a user fine-tunes)."""
    import torch
    import transformers

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("pretrained") / "llama"
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=256, max_position_embeddings=32)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_saved_model_fine_tunes_from_the_command_line(tmp_path, saved_llama):
    """model=hf_pretrained model.path=DIR: its shape comes from DIR/config.json; each rank reads its stages."""
    run_cli(["model=hf_pretrained", f"model.path={saved_llama}", "model.block_size=32", *CHEAP,
             f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["model"] == "hf_pretrained" and s["steps"] == 2 and s["pipeline_parallel"] == 2
    # the saved shape
    assert s["params"] == 2 * (256 * 32) + 2 * (4 * 32 * 32 - 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32) + 32
    assert math.isfinite(s["train_loss"]) and s["train_loss"] < 6


def test_hf_pretrained_settings_are_checked_before_launch(saved_llama, tmp_path):
    from app import run_dir
    from app.checks import ConfigError, check_config

    run_dir.register_resolvers()  # as examples/train.py does at import: ${bfpp_hf_config:...}

    def compose_with(*overrides):
        return compose_app(["model=hf_pretrained", *overrides])

    with pytest.raises(ConfigError, match=r"needs the saved model's directory: model.path="):
        check_config(compose_with())
    with pytest.raises(ConfigError, match=r"model.path='/nowhere' is not a directory with a config.json"):
        check_config(compose_with("model.path=/nowhere"))
    with pytest.raises(ConfigError, match=r"model.block_size=64 exceeds the saved model's max_position_embeddings=32"):
        check_config(compose_with(f"model.path={saved_llama}"))
    check_config(compose_with(f"model.path={saved_llama}", "model.block_size=32"))


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_hf_model_splits_by_its_own_tensor_parallel_plan_from_the_command_line(tmp_path, sequence_parallel):
    """model=hf_llama_tiny at pp=2 x tp=2 on 4 processes, split by the model's own plan, with and without sequence
    parallel. (The row-wise split embedding's output is a tensor whose all-reduce is in flight: the app's activation
    meter failed on it.)"""
    cheap = [a for a in CHEAP if not a.startswith(("cluster=", "schedule.loops="))]
    run_cli(["model=hf_llama_tiny", "cluster=cpu_4", "schedule.loops=1", "schedule.tensor_parallel=2", *cheap,
             f"schedule.sequence_parallel={str(sequence_parallel).lower()}", f"hydra.run.dir={tmp_path}"], cwd=tmp_path)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["tensor_parallel"] == 2 and s["pipeline_parallel"] == 2 and s["world_size"] == 4 and s["steps"] == 2
    assert s["sequence_parallel"] is sequence_parallel
    assert math.isfinite(s["train_loss"]) and math.isfinite(s["val_loss"]) and 0 < s["train_loss"] < 7


@pytest.mark.slow
def test_a_saved_model_fine_tunes_with_lora_and_exports_a_hugging_face_directory(tmp_path, saved_llama):
    """model=hf_pretrained model.lora.r=4 checkpoint.export_hf=DIR: only the adapters train (the saved weights are
    read per stage, the adapters initialized as PEFT does), and DIR is a plain Llama, the adapters merged into the
    saved weights they adapted (q and v: PEFT's choice for Llama)."""
    import torch
    from safetensors.torch import load_file

    out = tmp_path / "exported"
    run_cli(["model=hf_pretrained", f"model.path={saved_llama}", "model.block_size=32", "model.lora.r=4", *CHEAP,
             "checkpoint.last=true", f"checkpoint.export_hf={out}", "optim.lr=0.05", "optim.warmup_steps=0",
             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["model"] == "hf_pretrained" and s["steps"] == 2 and math.isfinite(s["train_loss"])
    saved, exported = load_file(saved_llama / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(exported) == set(saved)
    changed = {k for k in saved if not torch.equal(saved[k], exported[k])}
    assert changed == {f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"}


def test_lora_and_export_settings_are_checked_before_launch(saved_llama, tmp_path):
    from app import run_dir
    from app.checks import ConfigError, check_config

    run_dir.register_resolvers()

    def compose_with(*overrides):
        return compose_app(["model=hf_pretrained", f"model.path={saved_llama}", "model.block_size=32", *overrides])

    with pytest.raises(ConfigError, match=r"model.lora.r=0: the adapters' rank, a positive integer"):
        check_config(compose_with("model.lora.r=0"))
    with pytest.raises(ConfigError, match=r"model.lora.rank is not a LoRA setting"):
        check_config(compose_with("+model.lora.rank=4"))
    with pytest.raises(ConfigError, match=r"model.lora adapts Hugging Face models"):
        check_config(compose_app(["+model.lora.r=4"]))  # the GPT (model=gpt_tiny) has no model.lora
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "f").write_text("")
    with pytest.raises(ConfigError, match=r"checkpoint.export_hf=.* exists and is not an empty folder"):
        check_config(compose_with(f"checkpoint.export_hf={tmp_path / 'used'}"))
    with pytest.raises(ConfigError, match=r"set trainer.strategy=bfpp and checkpoint.last=true"):
        check_config(compose_with("checkpoint.last=false", f"checkpoint.export_hf={tmp_path}/x"))
    check_config(compose_with("model.lora.r=4", f"checkpoint.export_hf={tmp_path / 'new'}"))
