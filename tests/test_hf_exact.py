"""Hugging Face GPT-2, Llama, Qwen2, Gemma 3, Qwen3, OLMo 2 and OLMoE (tiny, random init; Llama, Qwen2 and Mixtral also
saved and loaded per stage with CausalLM.from_pretrained, Mixtral's experts stored one per key under older names) under
bfpp, with tensor and sequence parallel by each model's own plan, equal the plain HF model trained in one process, and
the exported checkpoints load into the plain HF class with strict=True (no key map)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="lightning_bfpp.hf needs the [hf] extra: pip install -e '.[dev,hf]'")

from exact_compare import ELEMENT_BYTES, assert_exact
from launch import ROOT, Launches, merged
from one_process import as_float64, train
from packed_rows import PackedRows, alone_loss_sum, document_losses, global_batches, segments
from references import BATCH, STEPS
from references import hf_micro_batches as micro_batches
from references import hf_reference as reference
from run_hf_exact import (
    LR,
    SAMPLES,
    SEQ,
    VOCAB,
    WIDTH,
    hf_model,
)

from lightning_bfpp.checkpoint import main as checkpoint_cli

WORKER = ROOT / "tests" / "run_hf_exact.py"
# pp=2 x loops=2 (4 stages: embedding, 2 decoder layers, norm + head), breadth_first; GPT-2 ties its embeddings
CONFIGS = [{"family": "gpt2"}, {"family": "llama"}, {"family": "llama", "tie": True},
           {"family": "gpt2", "attn": "eager"}]
# saved with save_pretrained (Llama in several shards, Qwen2 tied, Mixtral's experts one per key under older names:
# transformers' conversions fuse them), loaded with CausalLM.from_pretrained per stage
PRETRAINED = [{"family": "llama", "pretrained": True}, {"family": "qwen2", "pretrained": True},
              {"family": "mixtral", "pretrained": True}]
# fine-tuning data: prompt and padding targets of -100, the loss counting the others (the mean over the global batch's
# counted targets): pp=2 x loops=2 x m=4 at dp 2 (one row per micro-batch), with accumulate_grad_batches=2, and at dp 1
COUNTED = [{"family": "llama", "ignored": True, "m": 4}, {"family": "llama", "ignored": True, "accumulate": 2}]
# mixtures of experts with their router loss (output_router_logits=True): the whole step's routing statistics; with
# their experts split over the 2 data-parallel ranks (expert_parallel=2: pp=2 x dp=2 x ep=2), DeepSeek-V3 (a shared
# expert beside the routed ones, no router loss) too
ROUTED = [{"family": "mixtral", "m": 4}, {"family": "qwen3_moe"}]
# the router loss of each micro-batch (router_loss="micro_batch"): 1F1B (its default) and zero bubble, its experts
# split over the 2 data-parallel ranks (ep=2: torch's split backward through the all-to-alls)
MICRO_BATCH = [{"family": "qwen3_moe", "schedule": "1f1b", "loops": 1, "m": 4},
               {"family": "mixtral", "schedule": "breadth_first_zb", "router_loss": "micro_batch", "ep": 2}]
# windows packing 2-4 documents (token batches with document ids): each document trains and predicts as if alone
PACKED = [{"family": "llama", "packed": True}, {"family": "gpt2", "packed": True}]
EXPERT_PARALLEL = [{"family": "mixtral", "m": 4, "ep": 2}, {"family": "qwen3_moe", "ep": 2},
                   {"family": "deepseek_v3", "ep": 2}]
RUNS = {2: [*CONFIGS[:2], {"family": "gemma3"}, *PRETRAINED, COUNTED[0], PACKED[1], {"family": "mixtral"}],  # dp 1
        4: [*CONFIGS, *PRETRAINED, *COUNTED, PACKED[0], *ROUTED, *EXPERT_PARALLEL, *MICRO_BATCH]}  # dp 2
# tensor parallel by the model's own plan (base_model_tp_plan): pp=2 x loops=2 x tp=2 on 4 processes (dp 1), 2 key/value
# heads (one per tp rank); Qwen2 ties its embeddings (they stay whole), Mistral attends within a sliding window; with
# sequence parallel ("sp") too. Qwen3 (tied) normalizes q and k per head (replicated_with_grad_allreduce), OLMo 2 over
# the whole projection (colwise_gather_output, rowwise_split_input), Gemma 3 mixes sliding and full layers, OLMoE has no
# base_model_pp_plan and keeps its experts whole; each exports to out/ckpt-FAMILY. Three launches: the first in
# `make test`, the others (slow) in CI.
FAMILIES_49 = [("qwen3", {"tie": True}), ("olmo2", {}), ("gemma3", {}), ("olmoe", {})]
TP_LAUNCHES = {  # name: (processes, configs); "dp2": pp=2 x loops=2 x tp=2 x dp=2 on 8 processes
    "sp": (4, [{"family": "llama", "tp": 2, "kv_heads": 2, "sp": True},
               {"family": "qwen2", "tp": 2, "kv_heads": 2, "sp": True},
               {"family": "llama", "tp": 2, "kv_heads": 2, "sp": True, "ignored": True},
               {"family": "llama", "tp": 2, "kv_heads": 2, "sp": True, "packed": True},
               *({"family": f, "tp": 2, "kv_heads": 2, "sp": True, "export": True, **c} for f, c in FAMILIES_49)]),
    "slow": (4, [{"family": "llama", "tp": 2, "kv_heads": 2}, {"family": "qwen2", "tp": 2, "kv_heads": 2},
                 {"family": "mistral", "tp": 2, "kv_heads": 2},
                 {"family": "mistral", "tp": 2, "kv_heads": 2, "sp": True},
                 {"family": "llama", "tp": 2, "kv_heads": 2, "sp": True, "precision": "bf16-mixed"},
                 *({"family": f, "tp": 2, "kv_heads": 2, **c} for f, c in FAMILIES_49)]),
    "dp2": (8, [{"family": "llama", "tp": 2, "kv_heads": 2, "sp": True}, {"family": "qwen2", "tp": 2, "kv_heads": 2},
                *({"family": f, "tp": 2, "kv_heads": 2, "sp": i % 2 == 0, **c}  # Qwen3 and Gemma 3 with sp
                  for i, (f, c) in enumerate(FAMILIES_49))]),
}
# expert x tensor parallel: Mixtral at pp=1 x loops=2 x dp=2 x tp=2, its experts split over the 2 replicas at each tp
# coordinate (ep=2; whole on their rank), attention by its own plan; without and with sequence parallel; DeepSeek-V3
# (latent attention, its shared expert split by tp) with it
EXPERT_TP = [{"family": "mixtral", "pp": 1, "tp": 2, "kv_heads": 2, "ep": 2},
             {"family": "mixtral", "pp": 1, "tp": 2, "kv_heads": 2, "ep": 2, "sp": True},
             {"family": "deepseek_v3", "pp": 1, "tp": 2, "kv_heads": 2, "ep": 2, "sp": True}]
TP_LAUNCHES["ep-tp"] = (4, EXPERT_TP)
TP_RUNS = [(launch, i, c) for launch, (_, configs) in TP_LAUNCHES.items() for i, c in enumerate(configs)
           if "precision" not in c and not c.get("packed") and launch != "ep-tp"]
# sharded bf16-mixed (FSDP computes each stage in bf16): rotary cos/sin are side inputs and must follow
# (docs/precision.md: tolerance)
BF16 = {"family": "llama", "precision": "bf16-mixed"}
BF16_REL = 0.02


def saved_model(out, family: str):
    """The tiny model of `family` written by save_pretrained (the same weights as hf_model(family))."""
    path = out / f"pretrained-{family}"
    if not path.exists():
        hf_model(family).save_pretrained(path, max_shard_size="20KB" if family == "llama" else "5GB")
    return path


def _data_parallel_plan(devices: int, out: Path) -> tuple[int, list[dict]]:
    """RUNS[devices] (pretrained models saved into `out` first); on 4 processes also BF16, the first config saving
    its checkpoint to out/ckpt."""
    configs = [dict(c) for c in RUNS[devices]] + ([dict(BF16)] if devices == 4 else [])
    for c in configs:
        if c.get("pretrained"):
            c["pretrained"] = str(saved_model(out, c["family"]))
    if devices == 4:
        configs[0]["save"] = str(out / "ckpt")
        next(c for c in configs if c["family"] == "mixtral")["save"] = str(out / "ckpt-mixtral")
    return devices, configs


def _tensor_parallel_plan(name: str, out: Path) -> tuple[int, list[dict]]:
    """TP_LAUNCHES[name]; in "slow" the first config saves its checkpoint to out/ckpt, "export" configs to
    out/ckpt-FAMILY."""
    devices, configs = TP_LAUNCHES[name][0], [dict(c) for c in TP_LAUNCHES[name][1]]
    if name == "slow":
        configs[0]["save"] = str(out / "ckpt")
    for c in configs:
        if c.pop("export", False):
            c["save"] = str(out / f"ckpt-{c['family']}")
    return devices, configs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Launches:
    """tests/run_hf_exact.py on 2 or 4 processes: `runs(devices)[index]`."""
    return Launches(tmp_path_factory, _data_parallel_plan, script=WORKER, timeout=400)


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory) -> Launches:
    """One launch per TP_LAUNCHES entry: `tp_runs(name)[index]`."""
    return Launches(tmp_path_factory, _tensor_parallel_plan, script=WORKER, timeout=400)


UNPACKED = [(d, i, c) for d in (2, 4) for i, c in enumerate(RUNS[d]) if not c.get("packed")]


@pytest.mark.parametrize("devices, index", [(d, i) if d == 4 else pytest.param(d, i, marks=pytest.mark.slow)
                                            for d, i, _ in UNPACKED],
                         ids=[f"dp{d // 2}-" + "-".join(f"{v}" for v in c.values()) for d, _, c in UNPACKED])
def test_hf_model_trains_exactly_as_in_one_process(runs, devices, index):
    cfg = RUNS[devices][index]
    launch = runs(devices)
    pretrained = saved_model(launch.out, cfg["family"]) if cfg.get("pretrained") else None
    model, losses, aux_losses = reference(cfg["family"], devices // 2, cfg.get("tie"), cfg.get("attn", "sdpa"),
                                          pretrained, ignored=cfg.get("ignored", False),
                                          accumulate=cfg.get("accumulate", 1),
                                          micro_batches=micro_batches(cfg, devices // 2))
    # the HF model's own names, tied copies included
    assert_exact(merged(launch[index]), dict(model.named_parameters(remove_duplicate=False)), "params")
    assert all(r["losses"] == launch[index][0]["losses"] for r in launch[index])  # every rank logs the shared loss
    assert_exact(launch[index][-1]["losses"], losses, "train_loss")
    assert all(r["aux_losses"] == launch[index][0]["aux_losses"] for r in launch[index])  # every rank logs it
    assert_exact(launch[index][0]["aux_losses"], aux_losses, "train_aux_loss")
    assert bool(aux_losses) == (cfg["family"] in ("mixtral", "qwen3_moe"))
    if cfg.get("ep"):  # each rank holds half of its decoder layer's experts (pp=2 x loops=2: one such layer per rank)
        experts = sum(p.numel() * ELEMENT_BYTES for n, p in model.named_parameters() if ".experts." in n) // 2
        assert [r["expert_bytes"] for r in launch[index]] == [experts // cfg["ep"]] * 4


def test_rotary_model_trains_under_sharded_bf16_mixed(runs):
    """Llama at pp=2 x loops=2 x dp=2, precision="bf16-mixed": each step's loss within 2% of the fp32 model's
    (the rotary cos/sin, side inputs, follow the stage's bf16: fp32 ones would make q and k fp32 beside a bf16 v, and
    sdpa takes one dtype)."""
    _, losses, _ = reference("llama", 2)
    got = runs(4)[len(RUNS[4])][-1]["losses"]
    assert len(got) == len(losses)
    assert all(abs(a - b) <= BF16_REL * abs(b) for a, b in zip(got, losses)), (got, losses)


def test_exported_checkpoint_loads_into_the_plain_hf_class(runs, tmp_path):
    # python -m lightning_bfpp.checkpoint FOLDER FILE
    checkpoint_cli([str(runs(4).out / "ckpt"), str(tmp_path / "gpt2.pt")])
    state = torch.load(tmp_path / "gpt2.pt", weights_only=True)["state_dict"]
    model = as_float64(hf_model("gpt2", seed=1))  # different weights before loading (the run's type: float64)
    model.load_state_dict(state, strict=True)  # no key map
    trained, _, _ = reference("gpt2", 2, micro_batches=micro_batches(RUNS[4][0], 2))
    assert_exact(dict(model.named_parameters()), dict(trained.named_parameters()), "exported params")
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after loading
    model.save_pretrained(tmp_path / "hf")
    again = type(model).from_pretrained(tmp_path / "hf")
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name, index", [(n, i) if n == "sp" else pytest.param(n, i, marks=pytest.mark.slow)
                                         for n, i, _ in TP_RUNS],
                         ids=[f"{n}-" + c["family"] + ("-sp" if c.get("sp") else "") + ("-ignored" if c.get("ignored")
                              else "") for n, _, c in TP_RUNS])
def test_hf_tensor_parallel_trains_exactly_as_in_one_process(tp_runs, name, index):
    devices, configs = TP_LAUNCHES[name]
    cfg, dp = configs[index], devices // 4  # pp=2 x tp=2
    records = tp_runs(name)[index]
    model, losses, _ = reference(cfg["family"], dp, cfg.get("tie"), kv_heads=cfg["kv_heads"],
                                 ignored=cfg.get("ignored", False), micro_batches=micro_batches(cfg, dp))
    assert set(merged(records)) == set(model.state_dict())  # the HF model's own names
    assert_exact(merged(records), dict(model.named_parameters(remove_duplicate=False)), "params")
    assert_exact(records[-1]["losses"], losses, "train_loss")
    # what was split: attention and MLP projections, and the embedding and head unless tied
    # a pipeline message: one micro-batch's activations (the run's float64), with sequence parallel half of each
    # sequence
    micro_batch = BATCH // dp // 2
    expected_bytes = micro_batch * SEQ * WIDTH * ELEMENT_BYTES // (2 if cfg.get("sp") else 1)
    assert max(r["message_bytes"] for r in records) == expected_bytes
    split = {n for rank in records for n in rank["tp_split"]}
    mlp = () if cfg["family"] == "olmoe" else ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # experts: whole
    want = {f"model.layers.{i}.{m}.weight" for i in range(2)
            for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", *mlp)}
    want |= set() if model.config.tie_word_embeddings else {"model.embed_tokens.weight", "lm_head.weight"}
    assert {n for n in split if n.endswith("weight")} == want, sorted(split)


@pytest.mark.parametrize("index", range(len(EXPERT_TP)), ids=["mixtral", "mixtral-sp", "deepseek_v3-sp"])
def test_hf_expert_x_tensor_parallel_trains_exactly_as_in_one_process(tp_runs, index):
    """Mixtral at pp=1 x dp=2 x tp=2 x ep=2 (sequence parallel on or off), with its router loss, and DeepSeek-V3:
    parameters, train_loss and train_aux_loss as one process; attention split by tp, each rank holding half of every
    layer's experts."""
    cfg, dp = EXPERT_TP[index], 2
    records = tp_runs("ep-tp")[index]
    model, losses, aux_losses = reference(cfg["family"], dp, kv_heads=cfg["kv_heads"],
                                          micro_batches=micro_batches(cfg, dp))
    assert_exact(merged(records), dict(model.named_parameters(remove_duplicate=False)), "params")
    assert_exact(records[-1]["losses"], losses, "train_loss")
    assert all(r["aux_losses"] == records[0]["aux_losses"] for r in records)
    assert bool(aux_losses) == (cfg["family"] == "mixtral")  # DeepSeek-V3: no router loss
    assert_exact(records[0]["aux_losses"], aux_losses, "train_aux_loss")
    experts = sum(p.numel() * ELEMENT_BYTES for n, p in model.named_parameters() if ".experts." in n)
    assert [r["expert_bytes"] for r in records] == [experts // cfg["ep"]] * 4  # both layers on every rank (pp=1)
    assert "model.layers.0.self_attn.q_proj.weight" in records[0]["tp_split"]


@pytest.mark.slow
def test_hf_tensor_and_sequence_parallel_under_bf16_mixed_follow_fp32(tp_runs):
    """Llama at pp=2 x loops=2 x tp=2 with sequence parallel, precision="bf16-mixed": each step's loss within 2% of
    the fp32 model's."""
    (index,) = [i for i, c in enumerate(TP_LAUNCHES["slow"][1]) if c.get("precision")]
    got = tp_runs("slow")[index][-1]["losses"]
    _, losses, _ = reference("llama", 1, kv_heads=2)
    assert len(got) == len(losses) and all(abs(a - b) <= BF16_REL * abs(b) for a, b in zip(got, losses)), (got, losses)


@pytest.mark.parametrize("family", [f for f, _ in FAMILIES_49])
def test_tensor_and_sequence_parallel_exports_load_into_the_plain_hf_class(tp_runs, tmp_path, family):
    """The checkpoints of Qwen3, OLMo 2, Gemma 3 and OLMoE trained at pp=2 x loops=2 x tp=2 with sequence parallel,
    exported with python -m lightning_bfpp.checkpoint, load into the Hugging Face class with strict=True and hold the
    weights of the model trained in one process."""
    cfg = next(c for c in TP_LAUNCHES["sp"][1] if c["family"] == family)
    checkpoint_cli([str(tp_runs("sp").out / f"ckpt-{family}"), str(tmp_path / f"{family}.pt")])
    model = as_float64(hf_model(family, cfg.get("tie"), seed=1, kv_heads=2))  # other weights before loading
    model.load_state_dict(torch.load(tmp_path / f"{family}.pt", weights_only=True)["state_dict"], strict=True)
    trained, _, _ = reference(family, 1, cfg.get("tie"), kv_heads=2, micro_batches=micro_batches(cfg, 1))
    assert_exact(dict(model.named_parameters()), dict(trained.named_parameters()), "exported params")


def test_a_converted_pretrained_checkpoint_exports_under_the_models_own_names(runs, tmp_path):
    """Mixtral saved by transformers 5 (experts one per key, older names), trained from CausalLM.from_pretrained at
    pp=2 x loops=2 x dp=2: its export holds the model's own (fused) names and loads into MixtralForCausalLM with
    strict=True, with the weights of the HF model loaded by its own from_pretrained and trained in one process."""
    launch = runs(4)
    checkpoint_cli([str(launch.out / "ckpt-mixtral"), str(tmp_path / "mixtral.pt")])
    model = as_float64(hf_model("mixtral", seed=1))
    model.load_state_dict(torch.load(tmp_path / "mixtral.pt", weights_only=True)["state_dict"], strict=True)
    trained, _, _ = reference("mixtral", 2, pretrained=saved_model(launch.out, "mixtral"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())  # fused in the model
    assert_exact(dict(model.named_parameters()), dict(trained.named_parameters()), "exported params")


@pytest.mark.slow
def test_tensor_parallel_checkpoint_exports_into_the_plain_hf_class(tp_runs, tmp_path):
    checkpoint_cli([str(tp_runs("slow").out / "ckpt"), str(tmp_path / "llama.pt")])
    model = as_float64(hf_model("llama", seed=1, kv_heads=2))
    model.load_state_dict(torch.load(tmp_path / "llama.pt", weights_only=True)["state_dict"], strict=True)
    trained, _, _ = reference("llama", 1, kv_heads=2, micro_batches=micro_batches(TP_LAUNCHES["slow"][1][0], 1))
    assert_exact(dict(model.named_parameters()), dict(trained.named_parameters()), "exported params")


def packed_reference(family: str, data_parallel: int, kv_heads: int = 1):
    """The unmodified HF model in float64, SGD on Lightning's order of the packed rows, each document run alone (its
    own forward from position 0): each step trains the mean over the global batch's counted targets."""
    model = as_float64(hf_model(family, kv_heads=kv_heads))

    def loss(model, batch):
        x, y, documents = batch
        total, items = alone_loss_sum(lambda t: model(t).logits, x, y, documents), int((y != -100).sum())
        return total, items, total.item() / items

    data = global_batches(PackedRows(SAMPLES, SEQ, VOCAB), BATCH, data_parallel)
    losses = train(model, torch.optim.SGD(model.parameters(), lr=LR), ([next(data)] for _ in range(STEPS)), loss)
    return model, losses


PACKED_RUNS = [("dp", d, i, c) for d in (2, 4) for i, c in enumerate(RUNS[d]) if c.get("packed")] + \
    [("tp", TP_LAUNCHES["sp"][0], i, c) for i, c in enumerate(TP_LAUNCHES["sp"][1]) if c.get("packed")]


@pytest.mark.parametrize("kind, devices, index", [
    pytest.param(k, d, i, marks=pytest.mark.slow) if (k, d) == ("dp", 2) else (k, d, i) for k, d, i, _ in PACKED_RUNS],
    ids=[f"{c['family']}-" + ("tp2-sp" if k == "tp" else f"dp{d // 2}") for k, d, _, c in PACKED_RUNS])
def test_packed_documents_train_and_predict_as_each_document_alone(runs, tp_runs, kind, devices, index):
    """Windows packing several documents (document ids: positions restart, attention stays within each document) at
    pp=2 x loops=2 (dp 2; GPT-2 at dp 1, slow) and at pp=2 x tp=2 with sequence parallel: 3 SGD steps equal one process
    that runs every document alone, and afterwards each document's loss in a predicted packed window equals its loss
    alone."""
    cfg = (RUNS[devices] if kind == "dp" else TP_LAUNCHES["sp"][1])[index]
    records = (runs(devices) if kind == "dp" else tp_runs("sp"))[index]
    dp = devices // (2 * cfg.get("tp", 1))
    model, losses = packed_reference(cfg["family"], dp, kv_heads=cfg.get("kv_heads", 1))
    assert set(merged(records)) == set(model.state_dict())
    assert_exact(merged(records), dict(model.named_parameters(remove_duplicate=False)), "params")
    assert_exact(records[-1]["losses"], losses, "train_loss")
    x, y, documents = PackedRows(SAMPLES, SEQ, VOCAB).tensors
    predicted = {r["replica"]: r["predicted"] for r in records if r["predicted"] is not None}  # a rank per replica
    assert len(predicted) == dp
    for (replica, replicas), logits in predicted.items():
        rows = list(range(replica, BATCH, replicas))
        packed = document_losses(logits, y[rows], documents[rows])
        with torch.no_grad():
            alone = [F.cross_entropy(model(x[row:row + 1, a:b]).logits[0], y[row, a:b], ignore_index=-100).item()
                     for row in rows for a, b in segments(documents[row]) if (y[row, a:b] != -100).any()]
        assert len(packed) == len(alone) > len(rows)  # several documents per window
        assert_exact(packed, alone, f"replica {replica}'s documents' losses, packed vs alone")
