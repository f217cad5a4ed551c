"""A bfpp checkpoint of a Hugging Face model as a Hugging Face directory (``python -m lightning_bfpp.checkpoint CKPT
--hf DIR``): for a dense Llama, a Mixtral-like mixture of experts (stored one expert per key, as transformers 5 stores
it) and a LoRA fine-tune (merged, or its adapters), trained at pp=2 x loops=2, the exported directory's logits equal
the trained model's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="needs the [hf] extra: pip install -e '.[dev,hf]'")

from launch import ROOT, Launches, merged
from one_process import as_float64
from run_hf_exact import SEQ, VOCAB, experts_kwargs, hf_model, lora_model

from lightning_bfpp.checkpoint import main as checkpoint_cli

WORKER = ROOT / "tests" / "run_hf_exact.py"
CONFIGS = {"llama": {"family": "llama"}, "mixtral": {"family": "mixtral"}, "lora": {"family": "llama", "lora": True}}
LOGITS_TOL = 1e-5  # the exported model's logits against the trained model's (float64 both)


def _plan(key, out):
    return 2, {name: {**c, "save": str(out / f"ckpt-{name}")} for name, c in CONFIGS.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory, _plan, script=WORKER, timeout=400)


def trained(name: str, records: list[dict]) -> torch.nn.Module:
    """The model as the run trained it: its class (a PeftModel for LoRA) in float64 holding the run's parameters."""
    family = CONFIGS[name]["family"]
    model = as_float64(lora_model(family) if name == "lora" else hf_model(family))
    model.load_state_dict(merged(records), strict=True)
    return model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = (torch.arange(2 * SEQ).view(2, SEQ) * 7 + 3) % VOCAB
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exported_directory_has_the_trained_models_logits(runs, name, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    launch = runs(0)
    out = tmp_path / "hf"
    checkpoint_cli([str(launch.out / f"ckpt-{name}"), "--hf", str(out)])
    exported = AutoModelForCausalLM.from_pretrained(out, **experts_kwargs(CONFIGS[name]["family"])).eval()
    assert next(exported.parameters()).dtype == torch.float64  # as trained (precision="64-true")
    gap = (logits(exported) - logits(trained(name, launch[name]))).abs().max().item()
    assert gap <= LOGITS_TOL, f"{name}: max |logits(exported) - logits(trained)| = {gap:.3g}"
    with safe_open(out / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    if name == "mixtral":  # transformers 5 stores the fused experts one per key, under Mixtral's older names
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert not any("lora_" in k or "base_layer" in k for k in keys)  # LoRA merged: a plain Llama
    if name == "lora":
        base = dict(hf_model("llama").named_parameters())  # the merge changed exactly the adapted weights
        adapted = [k for k in keys if k.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight",
                                                  "gate_proj.weight", "down_proj.weight"))]
        with safe_open(out / "model.safetensors", framework="pt") as f:
            assert all(torch.equal(f.get_tensor(k), base[k].double()) != (k in adapted) for k in keys)


def test_lora_adapters_export_as_peft_writes_them(runs, tmp_path):
    from peft import PeftModel

    launch = runs(0)
    out = tmp_path / "adapters"
    checkpoint_cli([str(launch.out / "ckpt-lora"), "--hf", str(out), "--adapters"])
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    model = PeftModel.from_pretrained(as_float64(hf_model("llama")), out).eval()  # on the base it fine-tuned
    gap = (logits(model) - logits(trained("lora", launch["lora"]))).abs().max().item()
    assert gap <= LOGITS_TOL


def test_export_refuses_a_used_folder_and_a_model_without_adapters(runs, tmp_path):
    launch = runs(0)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    with pytest.raises(SystemExit, match="exists and is not an empty folder"):
        checkpoint_cli([str(launch.out / "ckpt-llama"), "--hf", str(tmp_path / "used")])
    with pytest.raises(SystemExit, match="holds no LoRA adapters"):
        checkpoint_cli([str(launch.out / "ckpt-llama"), "--hf", str(tmp_path / "new"), "--adapters"])
    assert not (tmp_path / "new").exists()
    with pytest.raises(SystemExit):
        checkpoint_cli([str(launch.out / "ckpt-llama")])  # neither OUT nor --hf
