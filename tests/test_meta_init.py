"""Models built on the meta device: materialized per module under seeds that do not depend on the layout, and what
cannot be initialized is refused by name; Hugging Face models read from save_pretrained directories (in one process
here; under bfpp per stage in test_hf_exact and test_exactness)."""

from __future__ import annotations

import pytest
import torch
from exact_compare import PRECISION, assert_exact
from exact_model import StackNet
from gpt import GPT, GPTConfig
from one_process import as_float64
from torch import nn
from torchmetrics import MeanMetric

from lightning_bfpp import seeded_init
from lightning_bfpp.layout.materialize import has_meta_tensors, init_hook, materialize

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, tie_weights=True)


def test_a_meta_built_model_gets_the_weights_seeded_init_gives_in_one_process():
    eager = seeded_init(GPT(CFG), seed=5)
    with torch.device("meta"):
        model = GPT(CFG)
    assert has_meta_tensors(model)
    materialize(model, torch.device("cpu"), 5, init_hook(model))
    assert not has_meta_tensors(model)
    assert model.head.lm_head.weight is model.embedding.tok.weight  # a tensor held twice stays one tensor
    for (name, a), (_, b) in zip(eager.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name
    # the model's own rule (GPT-2's scaled residual projections), not torch's defaults
    assert model.blocks[0].proj.weight.std().item() == pytest.approx(0.01, rel=0.15)
    assert model.blocks[0].q.weight.std().item() == pytest.approx(0.02, rel=0.15)
    assert torch.all(model.blocks[0].q.bias == 0)


def test_the_weights_do_not_depend_on_which_modules_a_rank_holds():
    """A rank holding only some layers (the cut replaced the others) gets the same values for them."""
    whole = seeded_init(StackNet(), seed=3)
    with torch.device("meta"):
        part = StackNet()
    part.blocks[0] = part.blocks[3] = nn.Identity()  # held by other ranks
    part.embed = nn.Identity()
    torch.manual_seed(123)  # the global RNG plays no part, and is left as it was
    state = torch.get_rng_state()
    materialize(part, torch.device("cpu"), 3, init_hook(part))
    assert torch.equal(torch.get_rng_state(), state)
    full = whole.state_dict()
    got = part.state_dict()
    assert got and set(got) < set(full)
    for name, value in got.items():
        assert torch.equal(value, full[name]), name
    other = seeded_init(StackNet(), seed=4)  # another seed, other weights
    assert not torch.equal(other.head.weight, whole.head.weight)


def test_a_module_holding_tensors_without_reset_parameters_is_refused_by_name():
    with torch.device("meta"):
        model = StackNet(counter=True)  # Counter: buffers, no reset_parameters
    with pytest.raises(TypeError,
                       match=r"counters\.\d \(Counter\) holds calls, input_sum, one and has no reset_parameters"):
        materialize(model, torch.device("cpu"), 0, init_hook(model))


def test_a_metric_built_on_the_meta_device_is_refused():
    with torch.device("meta"):
        model = StackNet()
        model.metric = MeanMetric()
    with pytest.raises(ValueError, match=r"metric metric \(MeanMetric\) was created on the meta device"):
        materialize(model, torch.device("cpu"), 0, init_hook(model))
    with torch.device("meta"):
        gpt = GPT(CFG)  # the example builds its metrics on the CPU: they work
    materialize(gpt, torch.device("cpu"), 0, init_hook(gpt))
    gpt.val_metrics["val_bpb"].update(torch.tensor([1.0, 3.0]))
    assert gpt.val_metrics["val_bpb"].compute().item() == 2.0


# ---- Hugging Face: CausalLM.from_pretrained -------------------------------------------------------------------------
transformers = pytest.importorskip("transformers", reason="lightning_bfpp.hf needs the [hf] extra")


def tiny_qwen2():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, max_position_embeddings=16,
                                   tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(cfg)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    tiny_qwen2().save_pretrained(path, max_shard_size="20KB")  # several files and an index
    return path


def test_from_pretrained_builds_no_weights_and_fills_them_from_the_files(saved):
    from lightning_bfpp.hf import CausalLM

    model = CausalLM.from_pretrained(saved)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary frequencies are computed, not stored
    seeded_init(model, only_meta=True)  # what configure_model does outside bfpp
    reference = transformers.Qwen2ForCausalLM.from_pretrained(saved, dtype=torch.float32).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, and read once from the stored key
    assert set(model.state_dict()) == set(reference.state_dict())
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(model.eval()(ids), reference(ids).logits)


def test_from_pretrained_runs_under_a_plain_lightning_strategy(saved):
    """strategy="auto": configure_model reads every tensor (bfpp reads each rank's own)."""
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bfpp.hf import CausalLM

    model = CausalLM.from_pretrained(saved, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, precision=PRECISION)
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4))
    reference = as_float64(transformers.Qwen2ForCausalLM.from_pretrained(saved, dtype=torch.float32))
    loss = torch.nn.functional.cross_entropy(reference(tokens[:, :-1]).logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert_exact(trainer.callback_metrics["train_loss"], loss, "train_loss")


def test_from_pretrained_refuses_what_it_cannot_read(saved, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from lightning_bfpp.hf import CausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(OSError,
                       match=r"no such local directory, and the Hugging Face Hub did not provide it.*save_pretrained"):
        CausalLM.from_pretrained("some-org/some-model")
    (tmp_path / "config.json").write_text((saved / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="reads safetensors only"):
        CausalLM.from_pretrained(tmp_path)
    with pytest.raises(TypeError, match=r"\['device_map'\] are neither"):
        CausalLM.from_pretrained(saved, device_map="auto")
    with pytest.raises(ValueError, match="holds weights already"):
        CausalLM(tiny_qwen2(), pretrained=saved)
    # a parameter the files lack (or store under another name) is an error naming it, not a random weight
    state = {k: v for k, v in tiny_qwen2().state_dict().items() if k != "model.norm.weight" and k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    model = CausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"stores no model.norm.weight \(nor a name tied to it, nor keys the "
                                         r"installed transformers converts into it\)"):
        seeded_init(model, only_meta=True)


def test_from_pretrained_reads_base_model_names_and_the_stored_dtype(saved, tmp_path):
    """A checkpoint saved from the base model (no ``model.`` prefix) loads; ``dtype="auto"`` keeps the file's dtype,
    the default is torch's (the Trainer's precision decides)."""
    from safetensors.torch import save_file

    from lightning_bfpp.hf import CausalLM

    reference = tiny_qwen2()
    state = {k.removeprefix("model."): v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    del state["lm_head.weight"]  # tied: stored once, under the embedding's (base model) name
    save_file(state, tmp_path / "model.safetensors")
    reference.config.dtype = torch.bfloat16
    reference.config.save_pretrained(tmp_path)
    model = seeded_init(CausalLM.from_pretrained(tmp_path), only_meta=True)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value.to(torch.bfloat16).float()), name
    auto = seeded_init(CausalLM.from_pretrained(tmp_path, dtype="auto"), only_meta=True)
    assert auto.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_tensor_that_no_initializer_writes_is_refused():
    class HalfReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.register_buffer("mask", torch.ones(4))

        def reset_parameters(self):  # forgets the buffer
            nn.init.ones_(self.weight)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), HalfReset())
    with pytest.raises(TypeError,
                       match=r"1.mask \(HalfReset\) was not initialized by HalfReset's reset_parameters\(\)"):
        materialize(model, torch.device("cpu"), 0, init_hook(model))
