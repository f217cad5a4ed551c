"""Tensor parallel inside the stages (pp x dp x tp), with and without sequence parallel: the example GPT split by its
pipeline_tp_plan trains like one process (SGD, 3 steps), resumes across tensor-parallel sizes and across sequence
parallel on/off (AdamW), holds 1/(pp*dp*tp) of the bytes per rank, and sends the activation message the simulator
counts. Two launches of tests/run_tp.py: 4 processes (several layouts one after another), 8 processes (pp2 x loops2 x
dp2 x tp2). The launches also train the example's mixture of experts ("moe": exact at pp=2 x dp=2 x ep=2, resumed
across expert-parallel sizes, and from expert x tensor x sequence parallel; pp=2 x dp=4 x ep=2 in the 8-process
one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import run_tp
import torch
from exact_compare import ELEMENT_BYTES, assert_exact
from gpt import GPT
from launch import ROOT, Launches, merged
from lightning.pytorch import Trainer
from one_process import BatchLoss, as_float64, train
from references import BATCH, STEPS, gpt_optimizer, gpt_reference

from lightning_bfpp import BFPPStrategy
from lightning_bfpp.layout.tensor_parallel import layer_plans
from lightning_bfpp.schedule import ScheduleSpec
from lightning_bfpp.schedule.dims import ParallelDims

# bf16-mixed vs fp32 train_loss over 3 SGD steps, relative (test_precision_memory measured <= 0.25% over 3 steps)
BF16_RTOL = 0.02

WORLD4 = {
    "pp2-tp2-bf": {"pp": 2, "tp": 2, "m": 2},
    "pp2-tp2-1f1b": {"pp": 2, "tp": 2, "m": 4, "schedule": "1f1b"},
    "pp1-dp2-tp2-loops2": {"pp": 1, "tp": 2, "loops": 2, "m": 2},
    "pp2-tp2-loops2-clip-ac-tied": {"pp": 2, "tp": 2, "loops": 2, "m": 2, "clip": 0.05, "ac": True, "tied": True},
    "pp1-dp2-tp2-clip-tied": {"pp": 1, "tp": 2, "m": 2, "clip": 0.05, "tied": True},
    "pp1-dp2-tp2-none": {"pp": 1, "tp": 2, "m": 2, "sharding": "none"},
    "pp2-tp2-bf16": {"pp": 2, "tp": 2, "loops": 2, "m": 2, "precision": "bf16-mixed"},
    "pp1-dp2-tp2-bf16": {"pp": 1, "tp": 2, "m": 2, "precision": "bf16-mixed"},
    # AdamW, 4 steps saving at step 2 at one tp size; resumed from step 2 at another (pp and dp change too)
    "save-tp2": {"pp": 2, "tp": 2, "m": 2, "opt": "adamw", "steps": 4, "save_every": 2, "save_dir": "{out}/tp2"},
    "resume-tp1": {"pp": 2, "loops": 2, "m": 2, "opt": "adamw", "steps": 4, "resume": "{out}/tp2/step=2.ckpt"},
    "save-tp1": {"pp": 4, "m": 4, "opt": "adamw", "steps": 4, "save_every": 2, "save_dir": "{out}/tp1"},
    "resume-tp2": {"pp": 1, "tp": 2, "m": 2, "opt": "adamw", "steps": 4, "resume": "{out}/tp1/step=2.ckpt"},
    # sequence parallel: between the split modules and across stages each tp rank holds half of each sequence
    "pp2-tp2-sp": {"pp": 2, "tp": 2, "m": 2, "sp": True},
    "pp2-tp2-loops2-clip-ac-tied-sp": {"pp": 2, "tp": 2, "loops": 2, "m": 2, "clip": 0.05, "ac": True, "tied": True,
                                       "sp": True},
    "pp2-tp2-sp-bf16": {"pp": 2, "tp": 2, "loops": 2, "m": 2, "precision": "bf16-mixed", "sp": True},
    "save-sp": {"pp": 2, "tp": 2, "m": 2, "sp": True, "opt": "adamw", "steps": 4, "save_every": 2,
                "save_dir": "{out}/sp"},
    "resume-no-sp": {"pp": 1, "tp": 2, "m": 2, "opt": "adamw", "steps": 4, "resume": "{out}/sp/step=2.ckpt"},
    # fine-tuning data (prompt and padding targets of -100): the mean over the global batch's counted targets, at
    # pp=2 x tp=2 with sequence parallel, pp=2 x loops=2 x m=4 x dp=2, and accumulating 2 batches
    "pp2-tp2-sp-counted": {"pp": 2, "tp": 2, "m": 2, "sp": True, "ignored": True},
    "pp2-loops2-m4-dp2-counted": {"pp": 2, "loops": 2, "m": 4, "ignored": True},
    "pp2-loops2-dp2-counted-accumulate2": {"pp": 2, "loops": 2, "m": 2, "ignored": True, "accumulate": 2},
    # windows packing several documents (document ids): each trains and predicts as if alone
    "pp2-loops2-dp2-packed": {"pp": 2, "loops": 2, "m": 2, "packed": True},
    "pp2-tp2-sp-packed": {"pp": 2, "tp": 2, "m": 2, "sp": True, "packed": True},
    # the example's mixture of experts (router loss on): experts split over the 2 data-parallel ranks (ep=2); AdamW
    # saved at step 2 with ep=2, resumed with the experts whole (ep=1, FSDP over dp=2) and on one replica (pp=4)
    "moe-pp2-loops2-dp2-ep2": {"pp": 2, "loops": 2, "m": 2, "moe": True, "ep": 2},
    "moe-save-ep2": {"pp": 2, "m": 2, "moe": True, "ep": 2, "opt": "adamw", "steps": 4, "save_every": 2,
                     "save_dir": "{out}/ep2"},
    "moe-resume-ep1": {"pp": 2, "loops": 2, "m": 2, "moe": True, "opt": "adamw", "steps": 4,
                       "resume": "{out}/ep2/step=2.ckpt"},
    "moe-resume-pp4": {"pp": 4, "m": 4, "moe": True, "opt": "adamw", "steps": 4, "resume": "{out}/ep2/step=2.ckpt"},
    # saved under expert x tensor x sequence parallel (pp=1 x dp=2 x tp=2, ep=2), resumed at pp=2 x dp=2, ep=1
    "moe-save-ep2-tp2-sp": {"pp": 1, "loops": 2, "tp": 2, "sp": True, "m": 2, "moe": True, "ep": 2, "opt": "adamw",
                            "steps": 4, "save_every": 2, "save_dir": "{out}/ep2-tp2"},
    "moe-resume-ep1-tp1": {"pp": 2, "loops": 2, "m": 2, "moe": True, "opt": "adamw", "steps": 4,
                           "resume": "{out}/ep2-tp2/step=2.ckpt"},
}
WORLD8 = {
    "pp2-loops2-dp2-tp2-bf": {"pp": 2, "tp": 2, "loops": 2, "m": 2},
    "pp2-loops2-dp2-tp2-sp": {"pp": 2, "tp": 2, "loops": 2, "m": 2, "sp": True},
    "pp2-loops2-dp2-tp2-sp-zb": {"pp": 2, "tp": 2, "loops": 2, "m": 2, "sp": True, "schedule": "breadth_first_zb",
                                 "tied": True, "clip": 0.05},
    "pp2-dp2-tp2-1f1b": {"pp": 2, "tp": 2, "m": 2, "schedule": "1f1b"},
    "moe-pp2-dp4-ep2": {"pp": 2, "m": 2, "moe": True, "ep": 2},  # two copies of each half of the experts (FSDP)
}


def _plan(devices: int, out: Path) -> tuple[int, dict[str, dict]]:
    """WORLD4 or WORLD8, their checkpoint folders ("{out}") in the launch's own folder."""
    configs = {4: WORLD4, 8: WORLD8}[devices]
    return devices, {name: {k: v.format(out=out) if isinstance(v, str) else v for k, v in c.items()}
                     for name, c in configs.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """tests/run_tp.py on 4 or 8 processes: `runs(devices)[config name]`."""
    return Launches(tmp_path_factory, _plan, script=ROOT / "tests" / "run_tp.py", timeout=600)


def _dp(devices: int, cfg: dict) -> int:
    return devices // (cfg.get("pp", 1) * cfg.get("tp", 1))


def _compare(ranks: list[dict], ref: tuple) -> float:
    """The ranks' parameters (merged) and train_loss equal the reference's (``exact_compare``, float64); a tied
    weight is held under one name. `ref`: (parameters, train_loss, ...) as ``gpt_reference`` returns them."""
    ref_params, ref_losses = ref[:2]
    params = merged(ranks)
    assert set(params) <= set(ref_params) and set(ref_params) - set(params) <= {"head.lm_head.weight"}
    diff = assert_exact(params, {n: ref_params[n] for n in params}, "params")
    assert all(r["losses"] == ranks[0]["losses"] for r in ranks)
    assert_exact(ranks[0]["losses"], ref_losses, "train_loss")
    return diff


def split_weights(tied: bool) -> set[str]:
    """The matrices GPT.pipeline_tp_plan splits over tensor parallel: every block's q, k, v, proj and MLP weights, and
    the token embedding and the output head unless they are tied (a tied weight stays whole)."""
    blocks = {f"blocks.{i}.{m}.weight" for i in range(run_tp.model_config().n_layer)
              for m in ("q", "k", "v", "proj", "mlp.0", "mlp.2")}
    return blocks if tied else blocks | {"embedding.tok.weight", "head.lm_head.weight"}


TRAINED = [(4, n) for n, c in WORLD4.items() if c.get("opt") != "adamw" and "precision" not in c and "packed" not in c]
TRAINED += [(8, n) for n in WORLD8]


@pytest.mark.parametrize("devices,name", [(d, n) if d == 4 else pytest.param(d, n, marks=pytest.mark.slow)
                                          for d, n in TRAINED], ids=[f"w{d}-{n}" for d, n in TRAINED])
def test_matches_one_process(runs, devices, name):
    cfg = {4: WORLD4, 8: WORLD8}[devices][name]
    ranks = runs(devices)[name]
    ref = gpt_reference(STEPS, [_dp(devices, cfg)] * STEPS, clip=cfg.get("clip"), tied=cfg.get("tied", False),
                        ignored=cfg.get("ignored", False), accumulate=cfg.get("accumulate", 1),
                        moe=cfg.get("moe", False))
    _compare(ranks, ref)
    split = {n for r in ranks for n in r["tp_split"] if n.endswith("weight")}  # over the ranks: each its own stages
    assert split == (split_weights(cfg.get("tied", False)) if cfg.get("tp", 1) > 1 else set()), sorted(split)


@pytest.mark.parametrize("name", [n for n, c in WORLD4.items() if c.get("precision")])
def test_bf16_mixed_follows_fp32(runs, name):
    cfg = WORLD4[name]
    fp32 = gpt_reference(STEPS, [_dp(4, cfg)] * STEPS)[1]
    got = runs(4)[name][0]["losses"]
    assert len(got) == len(fp32) and all(abs(a - b) <= BF16_RTOL * b for a, b in zip(got, fp32)), (got, fp32)


@pytest.mark.parametrize("devices,name", [(4, "pp2-tp2-sp"), (4, "pp2-tp2-bf"),
                                          pytest.param(8, "pp2-loops2-dp2-tp2-sp", marks=pytest.mark.slow)])
def test_stage_messages_are_what_the_simulator_counts(runs, devices, name):
    """A pipeline message is one micro-batch's activation (float64 here): whole on every tp rank, or with sequence
    parallel each rank's 1/tp of the sequence; the simulator's message_bytes (its p2p times' sizes) says the same."""
    from lightning_bfpp.sim import Model, message_bytes

    cfg = {4: WORLD4, 8: WORLD8}[devices][name]
    c = run_tp.model_config()
    model = Model(c.n_layer, c.n_head, c.n_embd, c.block_size, c.vocab_size)
    layers = model.layers(None, cfg["tp"], cfg.get("sp", False))
    micro_batch = BATCH // _dp(devices, cfg) // cfg["m"]
    expected = message_bytes(layers, micro_batch, cfg["tp"], cfg.get("sp", False), activation_bytes=ELEMENT_BYTES)
    sent = [r["message_bytes"] for r in runs(devices)[name]]
    senders = [b for b in sent if b]  # ranks holding the last stage only (pp2, loops 1) send nothing forward
    assert senders and all(b == expected for b in senders), (sent, expected)
    assert expected == micro_batch * c.block_size * c.n_embd * ELEMENT_BYTES / (cfg["tp"] if cfg.get("sp") else 1)


@pytest.mark.parametrize("saved,resumed", [("save-tp2", "resume-tp1"), ("save-tp1", "resume-tp2"),
                                           ("save-sp", "resume-no-sp"), ("moe-save-ep2", "moe-resume-ep1"),
                                           ("moe-save-ep2", "moe-resume-pp4"),
                                           ("moe-save-ep2-tp2-sp", "moe-resume-ep1-tp1")])
def test_adamw_resume_across_tensor_parallel_sizes(runs, saved, resumed):
    """Weights and AdamW state saved at step 2 at one tp size (and pp/dp) continue at another as if never
    interrupted: the resumed run, and the uninterrupted run it was saved from, equal one process's 4 steps. Likewise
    a mixture of experts' split experts (ep=2) resumed whole (ep=1) and on one replica."""
    a, b = WORLD4[saved], WORLD4[resumed]
    moe = a.get("moe", False)
    ref = gpt_reference(4, [_dp(4, a)] * 2 + [_dp(4, b)] * 2, opt="adamw", moe=moe)
    _compare(runs(4)[saved], gpt_reference(4, [_dp(4, a)] * 4, opt="adamw", moe=moe))
    _compare(runs(4)[resumed], (ref[0], ref[1][2:]))  # the resumed run logs steps 3 and 4


def test_export_of_a_tensor_parallel_checkpoint_is_one_plain_file(runs, tmp_path):
    from lightning_bfpp.checkpoint import export

    ranks = runs(4)["save-tp2"]
    out = tmp_path / "model.ckpt"
    state = export(runs(4).out / "tp2" / "step=4.ckpt", out)
    params = merged(ranks)
    assert set(state) == set(params)
    assert all(torch.equal(state[n], params[n]) for n in params)
    model = GPT(run_tp.model_config(), run_tp.optim_config("adamw"))
    model.load_state_dict(torch.load(out, weights_only=True)["state_dict"], strict=True)


@pytest.mark.slow
def test_bytes_per_rank_are_one_over_pp_dp_tp(runs):
    """P5: parameter + gradient + optimizer bytes per rank within 5% of the whole model's / (pp * dp * tp)
    (pp2 x loops2 x dp2 x tp2, SGD with momentum; stages balanced: embedding+block, block, block, block+head)."""
    ranks = runs(8)["pp2-loops2-dp2-tp2-bf"]
    full = sum(t.numel() * t.element_size() for t in merged(ranks).values())
    ideal = 3 * full / 8  # parameter, gradient, momentum buffer
    ratios = [sum(r["memory"][k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes")) / ideal for r in ranks]
    print({"ratios": [round(x, 4) for x in ratios]})
    assert all(abs(x - 1) <= 0.05 for x in ratios), ratios


# ---- settings refused before launch (no processes) ----
def test_tensor_parallel_must_fit_a_node_and_the_world():
    with pytest.raises(ValueError,
                       match=r"tensor_parallel=3 must divide the processes per node devices=4.*\[1, 2, 4\]"):
        ParallelDims(world=4, devices_per_node=4, tensor_parallel=3).validate()
    with pytest.raises(ValueError, match=r"pipeline_parallel x tensor_parallel = 4 x 2 must divide the world size 4"):
        ParallelDims(world=4, devices_per_node=4, tensor_parallel=2,
                     spec=ScheduleSpec(pipeline_parallel=4, micro_batches=4)).validate()
    with pytest.raises(ValueError, match=r"tensor_parallel=3 must divide the processes per node devices=4"):
        Trainer(strategy=BFPPStrategy(pipeline_parallel=1, tensor_parallel=3), accelerator="cpu", devices=4,
                logger=False, enable_progress_bar=False)  # the world is known: checked before any process starts
    with pytest.raises(ValueError, match="tensor_parallel=0 must be a positive integer"):
        BFPPStrategy(tensor_parallel=0)


def test_plan_errors_name_the_rule():
    from gpt import GPTConfig

    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32))
    layers = model.pipeline_layers()
    with pytest.raises(ValueError, match=r"model.n_head=4 must be divisible by tensor_parallel=8"):
        layer_plans(model, layers, 8)
    assert len(layer_plans(model, layers, 2)) == 4  # embedding, 2 blocks, head
    tied = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, tie_weights=True))
    assert len(layer_plans(tied, tied.pipeline_layers(), 2)) == 2  # only the blocks: a tied weight stays whole
    from torch.distributed.tensor.parallel import RowwiseParallel

    tied.pipeline_tp_plan = lambda name, layer, tp: {"tok": RowwiseParallel()} if name == "embedding" else None
    with pytest.raises(ValueError, match=r"embedding.tok.weight is tied to head.lm_head.weight.*cannot be split"):
        layer_plans(tied, tied.pipeline_layers(), 2)
    from exact_model import StackNet

    with pytest.raises(TypeError, match=r"tensor_parallel=2 needs `StackNet.pipeline_tp_plan"):
        layer_plans(StackNet(), StackNet().pipeline_layers(), 2)


def test_sequence_parallel_settings_and_plans_are_checked_before_launch():
    from gpt import GPTConfig

    from lightning_bfpp.layout.tensor_parallel import check_sequence_length

    with pytest.raises(ValueError, match=r"sequence_parallel=True splits the sequence .* tensor_parallel=1: "
                                         r"set tensor_parallel > 1"):
        BFPPStrategy(sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel='yes' must be True, False or None"):
        BFPPStrategy(tensor_parallel=2, sequence_parallel="yes")
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32))
    layers = model.pipeline_layers()
    plans = layer_plans(model, layers, 2, sequence_parallel=True)
    block = {k: type(v).__name__ for k, v in plans[id(model.blocks[0])][2].items()}
    assert block["ln_1"] == block["ln_2"] == "GatheredSequenceParallel" and block["proj"] == "RowwiseParallel"
    assert plans[id(model.blocks[0])][2]["proj"].output_layouts[0].is_shard(1)  # reduce-scattered to sequence shards
    # a plan that takes no sequence_parallel argument is not silently used with shards
    model.pipeline_tp_plan = lambda name, layer, tp: GPT.pipeline_tp_plan(model, name, layer, tp)
    with pytest.raises(TypeError, match=r"takes no `sequence_parallel` argument.*or set sequence_parallel=False"):
        layer_plans(model, layers, 2, sequence_parallel=True)
    # under sequence parallel a layer left whole would compute on its shard as if it were the whole sequence
    model.pipeline_tp_plan = lambda name, layer, tp, sequence_parallel=False: (
        None if name == "blocks.1" else GPT.pipeline_tp_plan(model, name, layer, tp, sequence_parallel))
    with pytest.raises(ValueError, match=r"returned no plan, so blocks.1 would run on a sequence shard"):
        layer_plans(model, layers, 2, sequence_parallel=True)
    dims = ParallelDims(world=2, tensor_parallel=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=r"over tensor_parallel=2 ranks, and the sequence length \(dim 1 of the first "
                                         r"input, shape \(2, 7\)\)=7 does not divide by 2"):
        check_sequence_length((torch.zeros(2, 7, dtype=torch.long),), dims)
    check_sequence_length(torch.zeros(2, 8, dtype=torch.long), dims)


class _Collectives:
    """Counts the functional collectives (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, ...) dispatched
    while active. (torch's CommDebugMode counts the same, but its module tracker's global hooks outlive a failed
    forward and break every later module call in the process.)"""

    def __init__(self) -> None:
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        counts = self.counts = Counter()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counted = func._opname not in ("wait_tensor", "_wrap_tensor_autograd")
                if func.namespace == "_c10d_functional" and counted:
                    counts[func._opname] += 1
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


def collectives(module, plan: dict, x: torch.Tensor, **kwargs) -> tuple[dict[str, int], dict[str, int]]:
    """The collectives one forward and one backward of `module`, split by `plan` over 2 tensor-parallel ranks, issue
    (counted in this process, on the fake backend: nothing is sent). `x`: this rank's input."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    forward, backward = _Collectives(), _Collectives()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        parallelize_module(module, init_device_mesh("cpu", (2,)), {k: v for k, v in plan.items() if k})
        with forward.mode:
            out = module(x.requires_grad_(), **kwargs)
        with backward.mode:
            (out[0] if isinstance(out, tuple) else out).sum().backward()
    finally:
        dist.destroy_process_group()
    return dict(forward.counts), dict(backward.counts)


# per block, what the simulator's cost model counts (sim.Model.layer_tp_comm): two all-reduces of the activation in
# forward and two in backward, or with sequence parallel an all-gather and a reduce-scatter for each
BLOCK_COLLECTIVES = {False: {"all_reduce": 2}, True: {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_a_block_issues_the_collectives_the_simulator_counts(sequence_parallel):
    """Without sequence parallel q, k and v read one replicated input: its gradient is all-reduced once (torch's
    styles alone all-reduce it per projection: four all-reduces per block in backward, not two)."""
    from gpt import GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=8, vocab_size=32))
    plan = model.pipeline_tp_plan("blocks.0", model.blocks[0], 2, sequence_parallel=sequence_parallel)
    x = torch.randn(2, 4 if sequence_parallel else 8, 32)  # this rank's input: half the sequence with sequence parallel
    forward, backward = collectives(model.blocks[0], plan, x)
    assert forward == backward == BLOCK_COLLECTIVES[sequence_parallel]


# an all-gather or a reduce-scatter is half an all-reduce's volume and latency steps: the simulator's unit
ALL_REDUCES = {"all_reduce": 1.0, "all_gather_into_tensor": 0.5, "reduce_scatter_tensor": 0.5}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("n_experts", [0, 4], ids=["dense", "moe"])
def test_the_simulator_counts_the_collectives_each_block_issues(n_experts, sequence_parallel):
    """The example GPT's dense and mixture-of-experts blocks under its tensor-parallel plan issue, in all-reduces of
    the activation, what sim.Model.layer_tp_comm counts for a block (a mixture under sequence parallel gathers its
    whole sequence, and its output's gradient: half an all-reduce more each way than attention's alone)."""
    from gpt import GPTConfig

    from lightning_bfpp.sim import Model

    model = GPT(GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=8, vocab_size=32, n_experts=n_experts))
    plan = model.pipeline_tp_plan("blocks.0", model.blocks[0], 2, sequence_parallel=sequence_parallel)
    x = torch.randn(2, 4 if sequence_parallel else 8, 32)
    forward, backward = collectives(model.blocks[0], plan, x)
    issued = [sum(ALL_REDUCES[name] * n for name, n in counts.items()) for counts in (forward, backward)]
    sim = Model(n_layer=1, n_head=4, n_embd=32, seq=8, vocab=32, n_experts=n_experts)
    counted = sim.layer_tp_comm(2, sequence_parallel=sequence_parallel)[1]  # the block (after the embedding)
    act = counted[1] / counted[0]  # bytes per all-reduce: the block's activation
    assert issued == [counted[0], counted[2]] and counted[3] / counted[2] == act, (forward, backward, counted)


def packed_reference(data_parallel: int) -> tuple[GPT, list[float]]:
    """The example GPT in one process, SGD on Lightning's order of packed rows, every document run alone (its own
    forward from position 0): each step trains the mean over the global batch's counted targets."""
    from packed_rows import PackedRows, alone_loss_sum, global_batches

    torch.manual_seed(0)
    model = as_float64(GPT(run_tp.model_config(), run_tp.optim_config()))

    def loss(model: GPT, batch) -> BatchLoss:
        x, y, documents = batch
        total = alone_loss_sum(model, x, y, documents)
        items = int((y != -100).sum())
        return total, items, total.item() / items

    data = global_batches(PackedRows(run_tp.SAMPLES, run_tp.BLOCK, run_tp.VOCAB), BATCH, data_parallel)
    losses = train(model, gpt_optimizer(model), ([next(data)] for _ in range(STEPS)), loss)
    return model, losses


@pytest.mark.parametrize("name", [n for n, c in WORLD4.items() if c.get("packed")])
def test_packed_documents_train_and_predict_as_each_document_alone(runs, name):
    """The example GPT on windows packing several documents (positions restart, attention stays within each document)
    at pp=2 x loops=2 x dp=2 and at pp=2 x tp=2 with sequence parallel: 3 SGD steps equal one process running every
    document alone, and each document's loss in a predicted packed window equals its loss alone."""
    check_packed_documents(runs(4)[name], _dp(4, WORLD4[name]))


def check_packed_documents(ranks: list[dict], dp: int) -> None:
    """Every rank's parameters and losses after 3 SGD steps on packed rows equal `packed_reference`, and each
    document's loss in the packed windows the ranks predicted equals its loss alone (``exact_compare``)."""
    import torch.nn.functional as F
    from packed_rows import PackedRows, document_losses, segments

    model, losses = packed_reference(dp)
    ref = {n: p.detach() for n, p in model.named_parameters()}
    _compare(ranks, (ref, losses))
    rows = PackedRows(run_tp.SAMPLES, run_tp.BLOCK, run_tp.VOCAB)
    x, y, documents = rows.tensors
    predicted = {r["replica"]: r["predicted"] for r in ranks if r["predicted"] is not None}
    assert len(predicted) == dp
    for (replica, replicas), logits in predicted.items():
        mine = list(range(replica, BATCH, replicas))
        packed = document_losses(logits, y[mine], documents[mine])
        with torch.no_grad():
            alone = [F.cross_entropy(model(x[r:r + 1, a:b])[0], y[r, a:b], ignore_index=-100).item()
                     for r in mine for a, b in segments(documents[r]) if (y[r, a:b] != -100).any()]
        assert len(packed) == len(alone) > len(mine)  # several documents per window
        assert_exact(packed, alone, f"replica {replica}'s document losses, packed vs alone")
