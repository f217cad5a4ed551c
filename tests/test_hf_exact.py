"""Hugging Face GPT-2, Llama, Qwen2 and Gemma 3 (tiny, random init; Llama and Qwen2 also saved and loaded per stage with
CausalLM.from_pretrained) under bfpp equal the plain HF model trained in one process, and the exported checkpoint loads
into the plain HF class with strict=True (no key map)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="lightning_bfpp.hf needs the [hf] extra: pip install -e '.[dev,hf]'")

from launch import ROOT, Launches
from packed_rows import PackedRows, alone_loss_sum, document_losses, global_batches, segments
from run_hf_exact import LR, SAMPLES, SEQ, VOCAB, WIDTH, hf_model, lightning_batches

from lightning_bfpp.checkpoint import main as checkpoint_cli

WORKER = ROOT / "tests" / "run_hf_exact.py"
TOL = 1e-6
STEPS, BATCH = 3, 8
# pp=2 x loops=2 (4 stages: embedding, 2 decoder layers, norm + head), breadth_first; GPT-2 ties its embeddings
CONFIGS = [{"family": "gpt2"}, {"family": "llama"}, {"family": "llama", "tie": True},
           {"family": "gpt2", "attn": "eager"}]
# saved with save_pretrained (Llama in several shards, Qwen2 tied), loaded with CausalLM.from_pretrained per stage
PRETRAINED = [{"family": "llama", "pretrained": True}, {"family": "qwen2", "pretrained": True}]
# fine-tuning data: prompt and padding targets of -100, the loss counting the others (the mean over the global batch's
# counted targets): pp=2 x loops=2 x m=4 at dp 2 (one row per micro-batch), with accumulate_grad_batches=2, and at dp 1
COUNTED = [{"family": "llama", "ignored": True, "m": 4}, {"family": "llama", "ignored": True, "accumulate": 2}]
# mixtures of experts with their router loss (output_router_logits=True): the whole step's routing statistics
ROUTED = [{"family": "mixtral", "m": 4}, {"family": "qwen3_moe"}]
# windows packing 2-4 documents (token batches with document ids): each document trains and predicts as if alone
PACKED = [{"family": "llama", "packed": True}, {"family": "gpt2", "packed": True}]
RUNS = {2: [*CONFIGS[:2], {"family": "gemma3"}, *PRETRAINED, COUNTED[0], PACKED[1], {"family": "mixtral"}],  # dp 1
        4: [*CONFIGS, *PRETRAINED, *COUNTED, PACKED[0], *ROUTED]}  # dp 2
# tensor parallel by the model's own plan (base_model_tp_plan): pp=2 x loops=2 x tp=2 on 4 processes (dp 1), 2 key/value
# heads (one per tp rank); Qwen2 ties its embeddings (they stay whole), Mistral attends within a sliding window; with
# sequence parallel ("sp") too. Two launches: the first in `make test`, the second (slow) in CI.
TP_LAUNCHES = {  # name: (processes, configs); "dp2": pp=2 x loops=2 x tp=2 x dp=2 on 8 processes
    "sp": (4, [{"family": "llama", "tp": 2, "kv_heads": 2, "sp": True},
               {"family": "qwen2", "tp": 2, "kv_heads": 2, "sp": True},
               {"family": "llama", "tp": 2, "kv_heads": 2, "sp": True, "ignored": True},
               {"family": "llama", "tp": 2, "kv_heads": 2, "sp": True, "packed": True}]),
    "slow": (4, [{"family": "llama", "tp": 2, "kv_heads": 2}, {"family": "qwen2", "tp": 2, "kv_heads": 2},
                 {"family": "mistral", "tp": 2, "kv_heads": 2},
                 {"family": "mistral", "tp": 2, "kv_heads": 2, "sp": True},
                 {"family": "llama", "tp": 2, "kv_heads": 2, "sp": True, "precision": "bf16-mixed"}]),
    "dp2": (8, [{"family": "llama", "tp": 2, "kv_heads": 2, "sp": True}, {"family": "qwen2", "tp": 2, "kv_heads": 2}]),
}
TP_RUNS = [(launch, i, c) for launch, (_, configs) in TP_LAUNCHES.items() for i, c in enumerate(configs)
           if "precision" not in c and not c.get("packed")]
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


def reference(family: str, data_parallel: int, tie: bool | None = None, attn: str = "sdpa", pretrained=None,
              kv_heads: int = 1, ignored: bool = False, accumulate: int = 1):
    """The unmodified HF model (`pretrained`: loaded by its class's from_pretrained), its own forward, SGD on
    Lightning's data order; each step trains the mean cross-entropy over the counted targets (not -100) of all its
    `accumulate` batches, as one process on the whole batch (each batch's own mean recorded as its loss). Returns
    (model, losses, the router loss of each batch for a mixture of experts with output_router_logits=True)."""
    model = hf_model(family, tie, attn, kv_heads=kv_heads)
    if pretrained is not None:
        model = type(model).from_pretrained(pretrained, dtype=torch.float32, attn_implementation=attn)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = lightning_batches(BATCH, data_parallel, ignored)
    losses, aux_losses = [], []
    routed = getattr(model.config, "output_router_logits", False)  # + router_aux_loss_coef x aux_loss (the batch's)
    for _ in range(STEPS):
        batches = [next(data) for _ in range(accumulate)]
        items = sum(int((y != -100).sum()) for _, y in batches)
        opt.zero_grad()
        for x, y in batches:
            out = model(x, output_router_logits=True) if routed else model(x)
            total = F.cross_entropy(out.logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
            losses.append(total.item() / int((y != -100).sum()))
            if routed:
                total = total + model.router_aux_loss_coef * out.aux_loss * items
                aux_losses.append(out.aux_loss.item())
            (total / items).backward()
        opt.step()
    return model, losses, aux_losses


def _data_parallel_plan(devices: int, out: Path) -> tuple[int, list[dict]]:
    """RUNS[devices] (pretrained models saved into `out` first); on 4 processes also BF16, the first config saving
    its checkpoint to out/ckpt."""
    configs = [dict(c) for c in RUNS[devices]] + ([dict(BF16)] if devices == 4 else [])
    for c in configs:
        if c.get("pretrained"):
            c["pretrained"] = str(saved_model(out, c["family"]))
    if devices == 4:
        configs[0]["save"] = str(out / "ckpt")
    return devices, configs


def _tensor_parallel_plan(name: str, out: Path) -> tuple[int, list[dict]]:
    """TP_LAUNCHES[name]; in "slow" the first config saves its checkpoint to out/ckpt."""
    devices, configs = TP_LAUNCHES[name][0], [dict(c) for c in TP_LAUNCHES[name][1]]
    if name == "slow":
        configs[0]["save"] = str(out / "ckpt")
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
                                          accumulate=cfg.get("accumulate", 1))
    expected = dict(model.named_parameters(remove_duplicate=False))
    got = {}
    for rank in launch[index]:
        got.update(rank["params"])
    assert set(got) == set(model.state_dict())  # the HF model's own names, tied copies included
    worst = max((got[n] - expected[n].detach()).abs().max().item() for n in got)
    assert worst <= TOL, f"max |bfpp - one process| = {worst:.3g}"
    last_stage = launch[index][-1]["losses"]  # every rank logs the shared loss
    assert last_stage == pytest.approx(losses, abs=1e-5)
    assert all(r["aux_losses"] == launch[index][0]["aux_losses"] for r in launch[index])  # every rank logs it
    assert launch[index][0]["aux_losses"] == pytest.approx(aux_losses, abs=1e-5)
    assert bool(aux_losses) == (cfg["family"] in ("mixtral", "qwen3_moe"))


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
    model = hf_model("gpt2", seed=1)  # different weights before loading
    model.load_state_dict(state, strict=True)  # no key map
    trained, _, _ = reference("gpt2", 2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(trained.named_parameters())[name], atol=TOL, rtol=0)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after loading
    model.save_pretrained(tmp_path / "hf")
    again = type(model).from_pretrained(tmp_path / "hf")
    for (n, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("name, index", [(n, i) if n == "sp" else pytest.param(n, i, marks=pytest.mark.slow)
                                         for n, i, _ in TP_RUNS],
                         ids=[f"{n}-" + c["family"] + ("-sp" if c.get("sp") else "") for n, _, c in TP_RUNS])
def test_hf_tensor_parallel_trains_exactly_as_in_one_process(tp_runs, name, index):
    devices, configs = TP_LAUNCHES[name]
    cfg, dp = configs[index], devices // 4  # pp=2 x tp=2
    records = tp_runs(name)[index]
    model, losses, _ = reference(cfg["family"], dp, kv_heads=cfg["kv_heads"], ignored=cfg.get("ignored", False))
    expected = dict(model.named_parameters(remove_duplicate=False))
    got = {}
    for rank in records:
        got.update(rank["params"])
    assert set(got) == set(model.state_dict())  # the HF model's own names
    worst = max((got[n] - expected[n].detach()).abs().max().item() for n in got)
    assert worst <= TOL, f"max |bfpp tp=2 - one process| = {worst:.3g}"
    assert records[-1]["losses"] == pytest.approx(losses, abs=1e-5)
    # what was split: attention and MLP projections, and the embedding and head unless tied
    # a pipeline message: one micro-batch's activations (fp32), with sequence parallel half of each sequence
    micro_batch = BATCH // dp // 2
    assert max(r["message_bytes"] for r in records) == micro_batch * SEQ * WIDTH * 4 // (2 if cfg.get("sp") else 1)
    split = {n for rank in records for n in rank["tp_split"]}
    want = {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    want |= set() if model.config.tie_word_embeddings else {"model.embed_tokens.weight", "lm_head.weight"}
    assert {n for n in split if n.endswith("weight")} == want, sorted(split)


@pytest.mark.slow
def test_hf_tensor_and_sequence_parallel_under_bf16_mixed_follow_fp32(tp_runs):
    """Llama at pp=2 x loops=2 x tp=2 with sequence parallel, precision="bf16-mixed": each step's loss within 2% of
    the fp32 model's."""
    (index,) = [i for i, c in enumerate(TP_LAUNCHES["slow"][1]) if c.get("precision")]
    got = tp_runs("slow")[index][-1]["losses"]
    _, losses, _ = reference("llama", 1, kv_heads=2)
    assert len(got) == len(losses) and all(abs(a - b) <= BF16_REL * abs(b) for a, b in zip(got, losses)), (got, losses)


@pytest.mark.slow
def test_tensor_parallel_checkpoint_exports_into_the_plain_hf_class(tp_runs, tmp_path):
    checkpoint_cli([str(tp_runs("slow").out / "ckpt"), str(tmp_path / "llama.pt")])
    model = hf_model("llama", seed=1, kv_heads=2)
    model.load_state_dict(torch.load(tmp_path / "llama.pt", weights_only=True)["state_dict"], strict=True)
    trained, _, _ = reference("llama", 1, kv_heads=2)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, dict(trained.named_parameters())[name], atol=TOL, rtol=0)


def packed_reference(family: str, data_parallel: int, kv_heads: int = 1):
    """The unmodified HF model, SGD on Lightning's order of the packed rows, each document run alone (its own forward
    from position 0): each step trains the mean over the global batch's counted targets."""
    model = hf_model(family, kv_heads=kv_heads)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data, losses = global_batches(PackedRows(SAMPLES, SEQ, VOCAB), BATCH, data_parallel), []
    for _ in range(STEPS):
        x, y, documents = next(data)
        items = int((y != -100).sum())
        opt.zero_grad()
        total = alone_loss_sum(lambda t: model(t).logits, x, y, documents)
        (total / items).backward()
        losses.append(total.item() / items)
        opt.step()
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
    alone (<= 1e-5)."""
    cfg = (RUNS[devices] if kind == "dp" else TP_LAUNCHES["sp"][1])[index]
    records = (runs(devices) if kind == "dp" else tp_runs("sp"))[index]
    dp = devices // (2 * cfg.get("tp", 1))
    model, losses = packed_reference(cfg["family"], dp, kv_heads=cfg.get("kv_heads", 1))
    expected = dict(model.named_parameters(remove_duplicate=False))
    got = {n: t for rank in records for n, t in rank["params"].items()}
    assert set(got) == set(model.state_dict())
    worst = max((got[n] - expected[n].detach()).abs().max().item() for n in got)
    assert worst <= TOL, f"max |bfpp packed - each document alone| = {worst:.3g}"
    assert records[-1]["losses"] == pytest.approx(losses, abs=1e-5)
    x, y, documents = PackedRows(SAMPLES, SEQ, VOCAB).tensors
    predicted = {r["replica"]: r["predicted"] for r in records if r["predicted"] is not None}  # a rank per replica
    assert len(predicted) == dp
    worst, count = 0.0, 0
    for (replica, replicas), logits in predicted.items():
        rows = list(range(replica, BATCH, replicas))
        packed = document_losses(logits, y[rows], documents[rows])
        with torch.no_grad():
            alone = [F.cross_entropy(model(x[row:row + 1, a:b]).logits[0], y[row, a:b], ignore_index=-100).item()
                     for row in rows for a, b in segments(documents[row]) if (y[row, a:b] != -100).any()]
        assert len(packed) == len(alone) > len(rows)  # several documents per window
        worst, count = max(worst, *(abs(p - a) for p, a in zip(packed, alone))), count + len(packed)
    assert worst <= 1e-5, f"max |a document's loss packed - alone| = {worst:.3g} over {count} documents"
