"""The contract pieces Hugging Face models need, checked without processes and without transformers: names kept
for wrapper layers, side inputs routed by keyword, what may cross a stage boundary, errors naming the layer."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule
from torch import nn

from lightning_bfpp import PipelineHooks
from lightning_bfpp.layout.cut import plan_stages, split_stages
from lightning_bfpp.layout.stage_module import StageModule


class Model(nn.Module):  # stands for a third-party model: its own names, its own forward
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.wte.weight  # tied


class Embed(nn.Module):
    def __init__(self, wte):
        super().__init__()
        self.wte = wte

    def forward(self, ids, position_ids):
        return self.wte(ids) + position_ids[..., None].float()


class Block(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, h, *, scale=None, **kwargs):
        return self.lin(h) * scale


class Wrapped(PipelineHooks, LightningModule):
    """The model as `self.hf`, wrapper layers registered too (what a user writes first)."""

    def __init__(self, register_wrappers: bool = True):
        super().__init__()
        self.hf = Model()
        layers = [Embed(self.hf.wte), *(Block(b) for b in self.hf.blocks), self.hf.head]
        if register_wrappers:
            self.layers = nn.ModuleList(layers)
        else:
            self.__dict__["_layers"] = layers

    def pipeline_layers(self):
        return list(self.layers) if "layers" in self._modules else self._layers

    def pipeline_side_inputs(self, ids):
        return {"position_ids": torch.arange(ids.shape[1])[None], "scale": torch.tensor(0.5)}

    def pipeline_loss(self, out, target):
        return out.sum()


@pytest.mark.parametrize("register_wrappers", [True, False])
def test_wrapper_layers_keep_the_models_own_names(register_wrappers):
    model = Wrapped(register_wrappers)
    names = plan_stages(model, model.pipeline_layers(), 4)
    assert names == [["hf.wte"], ["hf.blocks.0"], ["hf.blocks.1"], ["hf.head"]]
    local, _ = split_stages(model, model.pipeline_layers(), 4, [0, 3], lambda s: s % 2)
    assert set(local[0].state_dict()) == {"hf.wte.weight"} and set(local[3].state_dict()) == {"hf.head.weight"}
    # each parameter has one name in the LightningModule's state dict (the wrappers' slots do not register)
    assert set(model.state_dict()) == {"hf.wte.weight", "hf.head.weight"}


def test_side_inputs_reach_the_layers_that_take_them_and_the_pipeline_equals_the_plain_forward():
    torch.manual_seed(0)
    model = Wrapped(register_wrappers=False)
    ids = torch.randint(0, 10, (2, 3))
    plain = model.pipeline_forward(ids)
    embedded = model.hf.wte(ids) + torch.arange(3)[None, :, None]
    expected = model.hf.head(model.hf.blocks[1](model.hf.blocks[0](embedded) * 0.5) * 0.5)
    torch.testing.assert_close(plain, expected)
    local, _ = split_stages(model, model.pipeline_layers(), 2, [0, 1], lambda s: s)
    h = local[0](ids, bfpp_input=ids)
    torch.testing.assert_close(local[1](h, bfpp_input=ids), plain)


def test_a_nested_output_at_a_stage_boundary_names_the_layer_and_the_rule():
    class Pair(nn.Module):
        def forward(self, x):
            return x, (x, x)

    stage = StageModule([("pair", Pair())], index=1, rank=1, last=False)
    with pytest.raises(TypeError, match=r"layer pair, the last of stage 1 .* returned "
                                        r"tuple\(float32\[2\], tuple\(.*pipeline_side_inputs"):
        stage(torch.zeros(2))


def test_a_module_with_two_names_is_reported_naming_both():
    model = Wrapped(register_wrappers=False)
    model.alias = model.hf.blocks[0]  # a second name outside the layers
    with pytest.raises(ValueError, match=r"registers the module hf.blocks.0 also as alias"):
        plan_stages(model, model.pipeline_layers(), 2)


def test_unregistered_state_in_a_wrapper_is_named():
    model = Wrapped(register_wrappers=False)
    model._layers[1].extra = nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=r"pipeline_layers\(\)\[1\] \(Block\) holds the parameter `extra`"):
        plan_stages(model, model.pipeline_layers(), 2)
