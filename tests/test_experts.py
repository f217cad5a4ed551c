"""Expert parallel and the router loss of the example's mixture of experts. Without processes: the layout's rules
(ParallelDims: ep inside dp, its groups and coordinates, the settings it refuses), which modules are experts, the models
and settings BFPPStrategy refuses before launch, and the example's MoE in one process in float64 (its router loss over
micro-batches from the step's totals, the whole batch's or each micro-batch's own; its grouped matmul). In one launch of
4 processes (tests/run_tp.py, float64, against tests/one_process.train): the example's MoE under 1F1B, depth-first,
zero bubble and breadth-first in 2 groups with router_loss="micro_batch" (ep=2 where dp is 2; pp=2 x cp=2 too),
breadth-first with the whole batch's ("batch"), expert x context parallel (pp=1 x dp=2 x cp=2, ep=2: breadth-first
and depth-first), expert x tensor parallel (pp=1 x dp=2 x tp=2, ep=2: breadth-first with and without sequence
parallel, depth-first with it) and pp=2 x tp=2 with sequence parallel (the experts whole). Also trained against one
process: tests/test_hf_exact.py (Mixtral, Qwen3-MoE, DeepSeek-V3 at pp=2 x dp=2 x ep=2; Mixtral at pp=1 x dp=2 x tp=2 x
ep=2) and tests/test_tensor_parallel.py (resumed across expert-parallel sizes, and from ep x tp x sp)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from exact_compare import assert_exact
from gpt import GPT, Experts, GPTConfig, grouped_matmul
from launch import ROOT, Launches, merged
from one_process import as_float64, train
from references import STEPS, gpt_reference

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.contract.router_loss import load_balancing_loss, step_aux_loss
from lightning_bfpp.contract.step_totals import StepTotals, step_totals
from lightning_bfpp.layout.experts import check_experts, experts_modules, is_experts
from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.schedule.dims import DP, EDP, EP, TP, LayoutError, ParallelDims, default_pipeline_parallel

MOE = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, n_experts=4, top_k=2, router_aux_loss_coef=0.5)


def _dims(world: int, pp: int, ep: int, schedule: str = "breadth_first", **kw) -> ParallelDims:
    return ParallelDims(world=world, spec=ScheduleSpec(schedule, pipeline_parallel=pp, loops=2), expert_parallel=ep,
                        **kw).validate()


def test_expert_parallel_groups_are_consecutive_replicas_of_the_data_parallel_group():
    dims = _dims(16, 2, 2)  # dp 8 = 4 copies x 2 parts
    assert (dims.data_parallel, dims.expert_data_parallel, dims.expert_mesh_shape) == (8, 4, (2, 4, 2))
    assert dims.expert_mesh_dim_names == ("pipeline_parallel", EDP, EP)
    assert dims.group(EP, 5) == [4, 5] and dims.group(EDP, 5) == [1, 3, 5, 7]
    assert dims.group(EP, 13) == [12, 13] and dims.group(EDP, 13) == [9, 11, 13, 15]
    for rank in range(16):  # every data-parallel group is its copies x parts, each rank once
        copies = {r for part in dims.group(EDP, rank) for r in dims.group(EP, part)}
        assert copies == set(dims.group(DP, rank))
        copy, part = dims.expert_coordinates(rank)
        assert dims.group(EP, rank)[part] == rank and dims.group(EDP, rank)[copy] == rank
    assert default_pipeline_parallel(8, expert_parallel=2) == 4  # every rank a pipeline rank but the ep replicas


def test_under_context_parallel_an_expert_group_is_one_context_coordinate_and_the_copies_span_the_others():
    """ep x cp: the tokens of a sequence shard are dispatched within the ranks holding that shard of their replicas'
    sequences (one cp coordinate), and every rank holding the same experts (copies x cp ranks) reduces their gradients:
    the experts' mesh lays out every rank once."""
    dims = _dims(16, 2, 2, context_parallel=2)  # dp 4 = 2 copies x 2 parts, x cp 2
    assert dims.expert_mesh_shape == (2, 4, 2) and dims.data_parallel == 4
    ranks = dims.expert_mesh_ranks()
    assert sorted(r for p in ranks for row in p for r in row) == list(range(16))
    for rank in range(16):
        ep, edp = dims.group(EP, rank), dims.group(EDP, rank)
        assert len({dims.coordinates(r).context for r in ep}) == 1  # one sequence shard
        assert {r for c in edp for r in dims.group(EP, c)} == set(dims.gradient_group(rank))  # dp x cp
        pipeline = ranks[dims.coordinates(rank).pipeline]
        assert ep in pipeline  # a row of the mesh: its EP dimension
        assert edp == [row[ep.index(rank)] for row in pipeline]  # a column: its EDP dimension, in the mesh's order


def test_under_tensor_parallel_each_tp_coordinate_has_its_own_expert_groups():
    """ep x tp: the experts are whole on their rank (no tp split), and the tp ranks of a replica route the same tokens,
    so an expert-parallel group and the experts' copies are ranks at one tensor-parallel coordinate; the experts' mesh
    is (PP, EDP, EP, TP), every rank once, its TP rows the model's tensor-parallel groups."""
    dims = _dims(16, 2, 2, tensor_parallel=2)  # dp 4 = 2 copies x 2 parts, x tp 2
    assert dims.expert_mesh_dim_names == ("pipeline_parallel", EDP, EP, TP)
    assert dims.expert_mesh_shape == (2, 2, 2, 2) and dims.data_parallel == 4
    ranks = dims.expert_mesh_ranks()
    assert sorted(r for p in ranks for row in p for part in row for r in part) == list(range(16))
    for rank in range(16):
        ep, edp = dims.group(EP, rank), dims.group(EDP, rank)
        assert len({dims.coordinates(r).tensor for r in ep + edp}) == 1  # one tp coordinate
        assert {r for c in edp for r in dims.group(EP, c)} == set(dims.group(DP, rank))
        pipeline = ranks[dims.coordinates(rank).pipeline]
        t = dims.coordinates(rank).tensor
        assert ep in [[part[t] for part in row] for row in pipeline]  # the EP dimension of the mesh
        assert edp == [row[dims.expert_coordinates(rank).expert][t] for row in pipeline]  # its EDP dimension
        copy, part = dims.expert_coordinates(rank)
        assert pipeline[copy][part] == dims.group(TP, rank)  # its TP dimension: the model's tp group


@pytest.mark.parametrize("kwargs, message", [
    (dict(world=4, pp=2, ep=4), r"expert_parallel=4 must divide the data-parallel size 2 .*use expert_parallel in "
                                r"\[1, 2\]"),
    (dict(world=6, pp=2, ep=2), r"expert_parallel=2 must divide the data-parallel size 3"),
    (dict(world=8, pp=1, ep=2, tensor_parallel=2, context_parallel=2),
     r"expert_parallel=2 with tensor_parallel=2 and context_parallel=2: expert parallel combines with tensor parallel "
     r"or with context parallel, not with both at once yet; set context_parallel=1"),
    (dict(world=4, pp=1, ep=4, tensor_parallel=2),
     r"expert_parallel=4 must divide the data-parallel size 2 \(devices x num_nodes=4 / pipeline_parallel=1 / "
     r"tensor_parallel=2\)"),
    (dict(world=4, pp=1, ep=2, sharding="none"), r"expert_parallel=2 with sharding='none'.*use sharding=full"),
    (dict(world=4, pp=1, ep=0), r"expert_parallel=0 must be a positive integer"),
])
def test_bad_expert_parallel_settings_name_the_setting(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        _dims(**kwargs)


def test_strategy_refuses_bad_expert_parallel_before_launch():
    with pytest.raises(ValueError, match="expert_parallel=0 must be a positive integer"):
        BFPPStrategy(pipeline_parallel=2, expert_parallel=0)
    with pytest.raises(ValueError, match="expert_parallel=2 with tensor_parallel=2 and context_parallel=2"):
        BFPPStrategy(pipeline_parallel=1, tensor_parallel=2, context_parallel=2, expert_parallel=2)
    assert BFPPStrategy(pipeline_parallel=1, tensor_parallel=2, sequence_parallel=True, expert_parallel=2).dims \
        .expert_parallel == 2  # ep x tp (x sp): accepted
    with pytest.raises(ValueError, match="layout='auto' searches expert_parallel=1 only"):
        BFPPStrategy(layout="auto", global_batch_size=8, expert_parallel=2)
    strategy = BFPPStrategy(pipeline_parallel=2, loops=2, expert_parallel=2)  # dp unknown yet: fine
    assert strategy.expert_parallel == 2 and strategy.plan.checkpoint_meta([])["expert_parallel"] == 2


def test_a_model_without_experts_or_with_too_few_is_refused_naming_the_setting():
    dense = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16))
    with pytest.raises(ValueError, match=r"expert_parallel=2 splits the experts .* GPT has no experts module"):
        BFPPStrategy(pipeline_parallel=2, loops=2, expert_parallel=2).check_model(dense)
    moe = GPT(MOE)
    with pytest.raises(ValueError, match=r"expert_parallel=3 must divide the 4 experts of GPT.blocks.0.mlp.experts"):
        check_experts(moe, 3)
    assert check_experts(moe, 2) == ["blocks.0.mlp.experts", "blocks.1.mlp.experts"]
    BFPPStrategy(pipeline_parallel=2, loops=2, expert_parallel=2).check_model(moe)


def test_experts_are_transformers_fused_experts_and_not_their_routers():
    pytest.importorskip("transformers")
    from run_hf_exact import hf_model

    for family in ("mixtral", "qwen3_moe", "deepseek_v3"):
        model = hf_model(family)
        assert [n for n, _ in experts_modules(model)] == [f"model.layers.{i}.mlp.experts" for i in range(2)]
        gate = model.model.layers[0].mlp.gate
        assert gate.weight.shape[0] == 4 and not is_experts(gate)  # a router: (experts, width), 2-D
    assert not list(experts_modules(hf_model("llama")))
    assert [type(m) for _, m in experts_modules(GPT(MOE))] == [Experts, Experts]


def _example_step(router_loss: str | None) -> tuple[dict[str, torch.Tensor], StepTotals | None, int]:
    """The example MoE (float64) on an 8-row batch: in one process on the whole batch (None), or as a pipeline step
    computes it, 4 micro-batches whose losses add routing statistics to the step's totals (`router_loss`: the step's
    definition). The gradients are the summed losses' over the counted targets, divided after the backward."""
    torch.manual_seed(0)
    model = as_float64(GPT(MOE))
    x, y = torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))
    totals = StepTotals(router_loss=router_loss) if router_loss else None
    with step_totals(totals) if totals else contextlib.nullcontext():
        parts = [model.pipeline_loss(model(a), b) for a, b in zip(x.chunk(4 if totals else 1), y.chunk(4 if totals
                                                                                                         else 1))]
        torch.stack([part for part, _ in parts]).sum().backward()
    items = sum(int(n) for _, n in parts)
    return {n: p.grad / items for n, p in model.named_parameters()}, totals, items


def test_the_examples_router_loss_over_micro_batches_is_the_whole_batchs():
    """router_loss="batch": the summed gradient over the counted targets equals the whole batch's (router loss
    included)."""
    whole, _, _ = _example_step(None)
    assert whole["blocks.0.mlp.router.weight"].abs().max() > 0
    grads, totals, _ = _example_step("batch")
    assert_exact(grads, whole, "grads")
    assert_exact(step_aux_loss(totals), load_balancing_loss(totals.total("router_stats")), "train_aux_loss")


def test_the_examples_router_loss_per_micro_batch_is_each_micro_batchs_own():
    """router_loss="micro_batch": the gradient of each micro-batch's own router loss x its counted targets, as one
    process computes it micro-batch by micro-batch (tests/one_process.train); not the whole batch's."""
    grads, totals, items = _example_step("micro_batch")
    torch.manual_seed(0)
    model = as_float64(GPT(MOE))
    x, y = torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8, 16))
    auxes = []

    def loss(model, batch):
        total, counted = model.pipeline_loss(model(batch[0]), batch[1])
        auxes.append(load_balancing_loss(model.head.last_stats).item() * int(counted))
        return total, counted, 0.0

    train(model, torch.optim.SGD(model.parameters(), lr=0.0), [[(x, y)]], loss, micro_batches=4)
    assert_exact(grads, {n: p.grad for n, p in model.named_parameters()}, "grads")
    assert_exact(step_aux_loss(totals), sum(auxes) / items, "train_aux_loss")
    whole, _, _ = _example_step(None)
    assert (grads["blocks.0.mlp.router.weight"] - whole["blocks.0.mlp.router.weight"]).abs().max() > 1e-6


def test_grouped_matmul_is_one_matmul_per_expert():
    rows, weights = torch.randn(10, 32), torch.randn(4, 32, 128)
    ends = torch.tensor([2, 2, 7, 10])  # expert 1 gets no rows
    want = torch.cat([rows[0:2] @ weights[0], rows[2:7] @ weights[2], rows[7:10] @ weights[3]])
    torch.testing.assert_close(grouped_matmul(rows, weights, ends), want)
    odd, odd_weights = torch.randn(10, 6), torch.randn(4, 6, 4)  # 24-byte rows: torch's CPU kernel refuses them
    want = torch.cat([odd[0:2] @ odd_weights[0], odd[2:7] @ odd_weights[2], odd[7:10] @ odd_weights[3]])
    torch.testing.assert_close(grouped_matmul(odd, odd_weights, ends), want)


# ---- the simulator's mixture of experts (no processes) ----
def _moe_model():
    import yaml
    from launch import ROOT

    from lightning_bfpp.sim import Model

    return Model.from_dict(yaml.safe_load((ROOT / "conf" / "model" / "gpt_moe_tiny.yaml").read_text()))


def test_the_simulators_moe_is_the_example_models_shape():
    """Parameters per pipeline layer, the experts' share and FLOPs per token: the simulator's Model of
    conf/model/gpt_moe_tiny.yaml against the example GPT built from the same file (one FLOPs formula)."""
    from gpt import flops_per_token

    model = _moe_model()
    cfg = GPTConfig(**{k: v for k, v in dataclasses_asdict(model).items()})
    gpt = GPT(cfg)
    assert model.layer_params() == [sum(p.numel() for p in layer.parameters()) for layer in gpt.pipeline_layers()]
    experts = [sum(p.numel() for _, m in experts_modules(layer) for p in m.parameters()) for layer in
               gpt.pipeline_layers()]
    assert model.layer_expert_params() == experts and experts[1] > 0
    assert model.flops_per_token() == flops_per_token(cfg, gpt)
    # a sample's top_k copies of each token's activation (bf16) per all-to-all
    assert model.layer_a2a_bytes()[1] == 2 * cfg.block_size * cfg.top_k * cfg.n_embd


def dataclasses_asdict(model) -> dict:
    return dict(n_layer=model.n_layer, n_head=model.n_head, n_embd=model.n_embd, block_size=model.seq,
                vocab_size=model.vocab, n_experts=model.n_experts, top_k=model.top_k)


def test_expert_parallel_costs_gather_a_part_of_the_experts_and_add_all_to_alls():
    from lightning_bfpp.sim import Cluster
    from lightning_bfpp.sim.cost import build_costs, state_bytes

    model = _moe_model()
    cluster = Cluster(devices=4, num_nodes=1, flops=1e10, device_memory=8e9, intra_bw=2e9, inter_bw=2e9, latency=5e-5)
    costs = {ep: build_costs(model, cluster, pipeline_parallel=1, loops=2, data_parallel=4, micro_batch_size=2,
                             micro_batches=2, expert_parallel=ep) for ep in (1, 2, 4)}
    for s in range(2):
        base = costs[1].stages[s]
        assert base.a2a_forward == base.a2a_backward == 0.0 and base.gathered_params == base.params
        for ep in (2, 4):
            st = costs[ep].stages[s]
            assert st.params == base.params and st.expert_params > 0
            assert st.gathered_params == base.params - st.expert_params * (1 - 1 / ep)
            assert st.a2a_forward == st.a2a_backward > 0 and st.unshard < base.unshard
    assert costs[4].stages[0].a2a_forward > costs[2].stages[0].a2a_forward  # 3/4 of the rows cross, not 1/2
    # fully sharded, the state per rank is the same; replicated, the experts' part is 1/ep
    p, whole = 1000.0, 400.0
    assert state_bytes(p, "full", 4, whole) == state_bytes(p, "full", 4)
    assert state_bytes(p, "none", 4, whole) == 20 * whole


def test_the_simulator_keeps_a_mixture_whole_under_tensor_parallel_and_the_planner_offers_ep_x_tp():
    """The runtime's expert x tensor parallel: tp splits a MoE block's attention only; the router and experts are whole
    on every tp rank (expert parallel splits the experts), so the simulator divides attention alone by tp, and the
    planner's candidates include ep x tp (ep x tp x cp is refused: none)."""
    from lightning_bfpp.sim import Cluster
    from lightning_bfpp.sim.planner import candidates, simulate_candidate

    model = _moe_model()
    h = model.n_embd
    assert model.layer_expert_params(2) == model.layer_expert_params(1)
    assert model.layer_params(2)[1] == model.layer_params(1)[1] - (4 * h * h + 2 * h) // 2
    mixture = model.layer_forward_flops(1)[1] - (2 * 4 * h * h + 4 * model.seq * h)
    assert model.layer_forward_flops(2)[1] == (2 * 4 * h * h + 4 * model.seq * h) / 2 + mixture
    cluster = Cluster(devices=4, num_nodes=1, flops=1e10, device_memory=8e9, intra_bw=2e9, inter_bw=2e9, latency=5e-5)
    found = [c for c in candidates(model, cluster, 8, schedules=("breadth_first",), loops=(2,), shardings=("full",),
                                   tensor_parallels=(2,), expert_parallels=(2,), context_parallels=(1, 2))]
    assert found and {(c.pipeline_parallel, c.tensor_parallel, c.expert_parallel, c.context_parallel)
                      for c in found} == {(1, 2, 2, 1)}
    assert simulate_candidate(model, cluster, found[0]).step_time > 0


def test_overlap_hides_all_to_alls_behind_another_micro_batch_and_breadth_first_has_more_of_them():
    """One rank, 4 micro-batches, forward 1 s + 0.5 s of all-to-alls, backward 2 s + 0.5 s. Breadth-first (all
    forwards F0..F3, then the backwards B0..B3) hides every all-to-all behind the next micro-batch's compute but the
    step's last; 1F1B (F0 B0 F1 B1 ...) only the backwards' (each forward is followed by its own backward)."""
    from dataclasses import replace

    from lightning_bfpp.schedule import build_schedule
    from lightning_bfpp.sim import SimOptions, simulate, unit_costs

    costs = unit_costs(1, 1)
    costs.stages[0] = replace(costs.stages[0], a2a_forward=0.5, a2a_backward=0.5)
    times = {}
    for name in ("gpipe", "1f1b"):
        schedule = build_schedule(ScheduleSpec(name, pipeline_parallel=1, micro_batches=4))
        times[name] = [simulate(schedule, costs, SimOptions(expert_overlap=o)).step_time for o in (False, True)]
    assert times["gpipe"] == [16.0, 12.5] and times["1f1b"] == [16.0, 14.5]


# ---- the example's MoE against one process, in float64 (one launch of 4 processes) ----
F64 = {"moe": True, "precision": "64-true"}
LAUNCH = {  # pp=2 x dp=2 (ep=2 where given), pp=2 x cp=2, or pp=1 x dp=2 x cp|tp=2; the router loss each schedule gets
    # by default unless given
    "1f1b-ep2": {"pp": 2, "m": 4, "schedule": "1f1b", "ep": 2, **F64},
    "depth_first-ep2": {"pp": 2, "loops": 2, "m": 2, "schedule": "depth_first", "ep": 2, **F64},
    "zero_bubble": {"pp": 2, "loops": 2, "m": 2, "schedule": "breadth_first_zb", "router_loss": "micro_batch", **F64},
    "zero_bubble-ep2": {"pp": 2, "loops": 2, "m": 2, "schedule": "breadth_first_zb", "router_loss": "micro_batch",
                        "ep": 2, **F64},
    "groups2": {"pp": 2, "loops": 2, "m": 4, "groups": 2, **F64},
    "1f1b-cp2": {"pp": 2, "cp": 2, "m": 2, "schedule": "1f1b", **F64},
    "breadth_first-batch-ep2": {"pp": 2, "loops": 2, "m": 2, "ep": 2, **F64},
    # expert x context parallel: pp=1 x dp=2 x cp=2, the experts split over the 2 replicas at each cp coordinate
    "ep2-cp2": {"pp": 1, "loops": 2, "m": 2, "ep": 2, "cp": 2, **F64},
    "depth_first-ep2-cp2": {"pp": 1, "loops": 2, "m": 2, "ep": 2, "cp": 2, "schedule": "depth_first", **F64},
    # expert x tensor parallel: pp=1 x dp=2 x tp=2, attention split by tp, the experts by ep over the 2 replicas at
    # each tp coordinate (whole on their rank); with sequence parallel the mixture runs on the gathered sequence
    "ep2-tp2": {"pp": 1, "loops": 2, "m": 2, "ep": 2, "tp": 2, **F64},
    "ep2-tp2-sp": {"pp": 1, "loops": 2, "m": 2, "ep": 2, "tp": 2, "sp": True, **F64},
    "depth_first-ep2-tp2-sp": {"pp": 1, "loops": 2, "m": 2, "ep": 2, "tp": 2, "sp": True, "schedule": "depth_first",
                               **F64},
    # the mixture under tp alone (experts whole on every rank), its routing statistics crossing stages under sp
    "pp2-tp2-sp": {"pp": 2, "loops": 2, "m": 2, "tp": 2, "sp": True, **F64},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """tests/run_tp.py on 4 processes: `runs(4)[config name]`."""
    return Launches(tmp_path_factory, lambda devices, out: (devices, LAUNCH), script=ROOT / "tests" / "run_tp.py",
                    timeout=600)


@pytest.mark.parametrize("name", list(LAUNCH))
def test_the_examples_moe_trains_as_one_process_under_every_schedule(runs, name):
    cfg = LAUNCH[name]
    dp = 4 // (cfg["pp"] * cfg.get("cp", 1) * cfg.get("tp", 1))
    micro_batch = cfg.get("router_loss") == "micro_batch" or cfg.get("schedule") in ("1f1b", "depth_first") or \
        cfg.get("groups", 1) > 1
    # each global batch in dp x m micro-batches, each with its own router loss (1 part: the whole batch's)
    params, losses, aux_losses = gpt_reference(STEPS, [dp] * STEPS, moe=True,
                                               micro_batches=dp * cfg["m"] if micro_batch else 1)
    ranks = runs(4)[name]
    assert_exact(merged(ranks), params, "params")
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert_exact(ranks[0]["losses"], losses, "train_loss")
    assert all(r["aux_losses"] == ranks[0]["aux_losses"] for r in ranks)
    assert_exact(ranks[0]["aux_losses"], aux_losses, "train_aux_loss")
