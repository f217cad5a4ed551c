"""LoRA adapters (peft's get_peft_model) on a tiny Llama through CausalLM: only the adapters train, exactly as the
PEFT model trains in one process, at pp=2 x loops=2, pp=2 x dp=2 and pp=2 x tp=2 with sequence parallel; the frozen
weights take no gradient and no optimizer state."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft", reason="LoRA needs the [hf] extra: pip install -e '.[dev,hf]'")

from exact_compare import ELEMENT_BYTES, assert_exact
from launch import ROOT, Launches, merged
from references import hf_micro_batches, hf_reference
from run_hf_exact import lora_model

from lightning_bfpp.hf import CausalLM

WORKER = ROOT / "tests" / "run_hf_exact.py"
LAYOUTS = {  # name: (processes, config); 2 key/value heads under tensor parallel (one per rank)
    "pp2-loops2": (2, {"family": "llama", "lora": True}),
    "pp2-dp2": (4, {"family": "llama", "lora": True, "loops": 1}),
    "pp2-tp2-sp": (4, {"family": "llama", "lora": True, "tp": 2, "kv_heads": 2, "sp": True}),
}
# the bytes per rank of a full fine-tune and of LoRA on the same model and layout (pp=2 x dp=2), AdamW
BYTES = {"full": {"family": "llama", "loops": 1, "adamw": True}, "lora": {**LAYOUTS["pp2-dp2"][1], "adamw": True}}


def _plan(key: int, out) -> tuple[int, dict]:
    """2 processes: pp=2 x loops=2; 4: the other layouts and the bytes of a full fine-tune and of LoRA."""
    configs = {n: c for n, (d, c) in LAYOUTS.items() if d == key}
    return key, {**configs, **({f"bytes-{n}": c for n, c in BYTES.items()} if key == 4 else {})}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    return Launches(tmp_path_factory, _plan, script=WORKER, timeout=400)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lora_trains_exactly_as_the_peft_model_in_one_process(runs, layout):
    devices, cfg = LAYOUTS[layout]
    records = runs(devices)[layout]
    dp = devices // (2 * cfg.get("tp", 1))
    # the PEFT model in float64, its own forward, SGD over its trainable parameters on Lightning's data order
    model, losses, _ = hf_reference(cfg["family"], dp, kv_heads=cfg.get("kv_heads", 1), lora=True,
                                    micro_batches=hf_micro_batches(cfg, dp))
    initial = dict(lora_model(cfg["family"], kv_heads=cfg.get("kv_heads", 1)).named_parameters())
    params = merged(records)
    assert set(params) == set(model.state_dict())  # PEFT's own names (base_model.model...lora_A.default.weight)
    assert_exact(params, dict(model.named_parameters()), "params")
    assert_exact(records[-1]["losses"], losses, "train_loss")
    for name, p in model.named_parameters():  # the adapters moved, the frozen weights did not
        moved = not torch.equal(p, initial[name].double())
        assert moved == p.requires_grad == (".lora_" in name), name
    assert all(r["frozen_in_optimizer"] == 0 for r in records)


def test_lora_keeps_no_gradient_or_optimizer_state_of_frozen_weights(runs):
    """Per rank at pp=2 x dp=2 with AdamW: LoRA's trained parameters, gradients and optimizer state are the adapters'
    only (the full fine-tune's: every weight), each stage's shared by its dp=2 ranks: over the 4 ranks, each adapter
    weight once. AdamW keeps two moments per trained element and a scalar step per parameter."""
    launch = runs(4)
    peft = lora_model("llama")
    adapters = sum(p.numel() for p in peft.parameters() if p.requires_grad) * ELEMENT_BYTES
    every = sum(p.numel() for p in lora_model("llama").get_base_model().parameters()) * ELEMENT_BYTES - adapters
    for name, total in (("bytes-full", every), ("bytes-lora", adapters)):
        records = launch[name]
        assert sum(r["trained_bytes"] for r in records) == total, name
        for r in records:
            assert r["grad_bytes"] == r["trained_bytes"], name
            assert 2 * r["trained_bytes"] < r["state_bytes"] <= 2 * r["trained_bytes"] + 64 * ELEMENT_BYTES, name


def test_peft_model_keeps_peft_names_and_reproduces_its_forward():
    """CausalLM adopts the PeftModel's modules: its state dict is the PeftModel's (adapters included), and its layers
    reproduce the PEFT model's own logits."""
    peft = lora_model("llama")
    lm = CausalLM(peft)
    assert list(lm.state_dict()) == list(peft.state_dict())
    ids = torch.arange(16).view(2, 8)
    with torch.no_grad():
        assert torch.allclose(lm(ids), peft(ids).logits, atol=1e-6)
    assert lm.configure_optimizers().param_groups[0]["params"] == [p for p in peft.parameters() if p.requires_grad]
