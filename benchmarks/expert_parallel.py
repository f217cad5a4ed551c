"""Expert parallel measured side by side: the example's mixture of experts (conf/model/gpt_moe_tiny.yaml) at pp=2 x
loops=2 x dp=2 with the experts whole (ep=1: FSDP over the 2 replicas) and split (ep=2), in one launch of 4 CPU
processes, AdamW. Per rank: the experts' bytes held between steps (weights and AdamW state: sharded either way), the
experts' weights gathered while a stage computes, the all-to-all bytes of one micro-batch (measured, and the
simulator's ``Layers.a2a_bytes``) and the time the forward all-to-alls take. With --balance, the routing's balance
over 50 app steps with the router's load-balancing loss and without it (train_expert_load: the busiest expert's share
of the picks x n_experts; 1 is even).

    python benchmarks/expert_parallel.py             # ~3 min on 2 cores
    python benchmarks/expert_parallel.py --balance   # + two 50-step app runs at ep=2 (~15 min on 2 loaded cores)
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from common import ROOT, clean_env

SCRIPT = Path(__file__).resolve()
STEPS, SKIP = 5, 1  # the first step also runs torch's shape inference: measured from step 2 on
MODEL = ROOT / "conf" / "model" / "gpt_moe_tiny.yaml"


def run(cfg: dict, devices: int, out: Path) -> None:
    """Worker: train the MoE at expert_parallel=cfg["ep"], write this rank's measurements."""
    import torch
    import yaml
    from gpt import GPT, GPTConfig, OptimConfig
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_bfpp import BFPPStrategy
    from lightning_bfpp.layout import expert_dispatch
    from lightning_bfpp.layout.experts import experts_modules
    from lightning_bfpp.runtime.instrument import local_bytes

    shape = {k: v for k, v in yaml.safe_load(MODEL.read_text()).items() if k in GPTConfig.__dataclass_fields__}
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape), OptimConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=1.0))
    seen = {"gathered": 0, "dispatched": [], "sent": [], "a2a_s": 0.0, "step": 0}
    inner = expert_dispatch.all_to_all_autograd

    def timed(*args, **kwargs):  # the forward all-to-alls (their backward ones run inside autograd)
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            if seen["step"] > SKIP:
                seen["a2a_s"] += time.perf_counter() - t0

    expert_dispatch.all_to_all_autograd = timed

    def after_call(module, _args, _out):
        if seen["step"] <= SKIP:
            return
        seen["gathered"] = max(seen["gathered"], local_bytes(module.parameters(recurse=False)))
        forward = module.__dict__.get("forward")
        if isinstance(forward, expert_dispatch.ExpertParallelForward):
            seen["dispatched"].append(forward.dispatched_bytes)
            seen["sent"].append(forward.sent_bytes)

    experts = [m for _, m in experts_modules(model)]
    for m in experts:
        m.register_forward_hook(after_call)

    class Steps(Callback):
        def on_train_batch_start(self, trainer, *args):
            seen["step"] += 1
            if seen["step"] == SKIP + 1:
                seen["t0"] = time.perf_counter()

        def on_train_end(self, trainer, *args):
            seen["step_s"] = (time.perf_counter() - seen["t0"]) / (STEPS - SKIP)

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab_size"], (256, shape["block_size"] + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    strategy = BFPPStrategy(pipeline_parallel=2, loops=2, micro_batches=4, expert_parallel=cfg["ep"],
                            timeout=timedelta(seconds=300))
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[Steps()])
    trainer.fit(model, DataLoader(data, batch_size=16, drop_last=True))
    state = trainer.optimizers[0].state
    params = [p for m in experts for p in m.parameters(recurse=False)]
    held = local_bytes(params) + local_bytes(v for p in params for v in state.get(p, {}).values()
                                             if isinstance(v, torch.Tensor) and v.dim())  # weights and AdamW state
    out.mkdir(parents=True, exist_ok=True)
    calls = max(len(seen["dispatched"]), 1)
    torch.save({"held": held, "gathered": seen["gathered"], "dispatched": sum(seen["dispatched"]) / calls,
                "sent": sum(seen["sent"]) / calls, "a2a_s": seen["a2a_s"] / (STEPS - SKIP),
                "step_s": seen["step_s"]}, out / f"rank{trainer.global_rank}.pt")


def simulated(ep: int, micro_batch: int) -> tuple[float, float]:
    """The simulator's all-to-all bytes of one experts call (one MoE layer, one micro-batch; fp32 as run here) and
    the fraction of them that crosses ranks."""
    import yaml

    from lightning_bfpp.sim import Model

    model = Model.from_dict(yaml.safe_load(MODEL.read_text()))
    per_sample = max(model.layers().a2a_bytes) if ep > 1 else 0.0  # bf16 in the simulator
    return per_sample * micro_batch * 4 / 2, (ep - 1) / ep


def measure(out: Path) -> dict:
    from launch import run_lightning

    records = run_lightning(out, 4, [{"ep": 1}, {"ep": 2}], timeout=1200, script=SCRIPT)
    result = {}
    for cfg, ranks in zip(({"ep": 1}, {"ep": 2}), records):
        ep = cfg["ep"]
        dispatched, fraction = simulated(ep, 4)
        result[f"ep{ep}"] = {
            "held_bytes_per_rank": [r["held"] for r in ranks],
            "gathered_bytes_per_rank": [r["gathered"] for r in ranks],
            "a2a_bytes_per_call": [r["dispatched"] for r in ranks], "simulated_a2a_bytes_per_call": dispatched,
            "crossing_fraction": [r["sent"] / (2 * r["dispatched"]) if r["dispatched"] else 0.0 for r in ranks],
            "simulated_crossing_fraction": fraction, "a2a_forward_s_per_step": [r["a2a_s"] for r in ranks],
            "step_s": [r["step_s"] for r in ranks]}
    return result


def balance(out: Path, steps: int = 50) -> dict:
    """train_expert_load over `steps` app steps at ep=2, with the router's loss (its default coefficient) and off."""
    result = {}
    for label, coef in (("with_aux_loss", None), ("without_aux_loss", 0.0)):
        run_dir = out / label
        cmd = [sys.executable, str(ROOT / "examples" / "train.py"), "model=gpt_moe_tiny", "cluster=cpu_4",
               "schedule.expert_parallel=2", f"trainer.max_steps={steps}", "logger=csv", "trainer.limit_val_batches=0",
               "trainer.enable_progress_bar=false", "checkpoint.last=false", f"hydra.run.dir={run_dir}"]
        cmd += [f"model.router_aux_loss_coef={coef}"] if coef is not None else []
        subprocess.run(cmd, env=clean_env(), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        rows = list(csv.DictReader(open(next(run_dir.glob("csv/*/metrics.csv")))))
        load = [float(r["train_expert_load"]) for r in rows if r.get("train_expert_load")]
        aux = [float(r["train_aux_loss"]) for r in rows if r.get("train_aux_loss")]
        result[label] = {"expert_load_first": load[0], "expert_load_last10_mean": sum(load[-10:]) / 10,
                         "expert_load_max": max(load), "aux_loss_last10_mean": sum(aux[-10:]) / 10, "steps": len(load)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "expert_parallel"))
    parser.add_argument("--balance", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    result = {"memory_and_bytes": measure(out / "launch")}
    if args.balance:
        result["balance"] = balance(out / "balance")
    e1, e2 = result["memory_and_bytes"]["ep1"], result["memory_and_bytes"]["ep2"]
    result["ratios"] = {"held_ep2_over_ep1": max(e2["held_bytes_per_rank"]) / max(e1["held_bytes_per_rank"]),
                        "gathered_ep2_over_ep1": max(e2["gathered_bytes_per_rank"]) /
                        max(e1["gathered_bytes_per_rank"]),
                        "a2a_measured_over_simulated": max(e2["a2a_bytes_per_call"]) /
                        e2["simulated_a2a_bytes_per_call"],
                        "step_s_ep2_over_ep1": max(e2["step_s"]) / max(e1["step_s"])}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):  # a worker: OUT DEVICES CONFIGS
        from launch import run_configs

        run_configs(run)
    else:
        main()
