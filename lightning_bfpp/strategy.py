# Scope: the Lightning glue only. Settings are checked, the mesh is built, the model is cut into
# looped stages and sharded, and the training/eval steps run the pipeline schedule; everything else
# (launchers, sampler, checkpoint I/O, loops) is Lightning's ModelParallelStrategy.
from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from . import checkpoint as ckpt
from .hooks import check_hooks
from .parallel import DP, PP, build_mesh, clip_grad_norm_global, share_from_ranks, shard_stage
from .partition import split_stages
from .resume import skip_consumed_batches
from .runtime.instrument import local_bytes, optimizer_bytes
from .runtime.pipeline import PipelineRunner, _batch_size
from .schedule import Schedule, ScheduleSpec, build_schedule

SHARDING = ("full", "none")


def _unwrap(optimizer):
    """The torch optimizer behind a LightningOptimizer (or the optimizer itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class BFPPStrategy(ModelParallelStrategy):
    """Breadth-first pipeline parallelism (looped stages) x FSDP data parallelism for Lightning.

    Args:
        pipeline_parallel: pipeline ranks (pp); data parallel = world_size / pp.
        loops: stages per pipeline rank; stage s lives on pipeline rank s % pp.
        micro_batches: micro-batches per step, split from each replica's batch (default: pp).
        schedule: "breadth_first" (default), "depth_first", "gpipe" or "1f1b".
        groups: breadth_first only: sequential accumulation groups of micro-batches.
        sharding: "full" (FSDP2 over data parallel) or "none" (replicated, gradients all-reduced).
        reshard_after_forward: free each stage's gathered weights between its forward and backward.
        stage_layers: explicit layer count per stage (default: balanced by parameter count).
        process_group_backend, timeout: as in ModelParallelStrategy (timeout bounds every distributed wait).

    Checkpoints are always sharded folders (torch.distributed.checkpoint) keyed by the model's own
    parameter names; they load into any other layout. See ``lightning_bfpp.checkpoint``.
    """

    strategy_name = "bfpp"

    def __init__(
        self,
        pipeline_parallel: int = 1,
        loops: int = 1,
        micro_batches: int | None = None,
        schedule: str = "breadth_first",
        groups: int = 1,
        sharding: Literal["full", "none"] = "full",
        reshard_after_forward: bool = False,
        stage_layers: Sequence[int] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if sharding not in SHARDING:
            raise ValueError(f"sharding={sharding!r} must be one of {SHARDING}.")
        self.spec = ScheduleSpec(
            name=schedule,
            pipeline_parallel=pipeline_parallel,
            loops=loops,
            micro_batches=micro_batches if micro_batches is not None else pipeline_parallel,
            groups=groups,
            reshard_after_forward=bool(reshard_after_forward),
        )
        # Bad settings fail here, before any process starts: the schedule is generated and validated
        # (dependencies, send/receive pairing, no deadlock) now, and this very schedule is what runs.
        self._train_schedule = build_schedule(self.spec)
        self.sharding = sharding
        self.stage_layers = list(stage_layers) if stage_layers else None
        self.runner: PipelineRunner | None = None
        self.stage_layer_names: list[list[str]] = []
        self.step_stats: dict[str, Any] = {}
        self._fresh_grads: list[tuple[torch.nn.Parameter, torch.Tensor | None]] = []

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def pipeline_parallel(self) -> int:
        return self.spec.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        return self.device_mesh.size() // self.spec.pipeline_parallel

    @property
    def loops(self) -> int:
        return self.spec.loops

    @property
    def micro_batches(self) -> int:
        return self.spec.micro_batches

    @property
    def schedule_name(self) -> str:
        return self.spec.name

    @property
    def schedule(self) -> Schedule:
        assert self.runner is not None, "the schedule is built in setup()"
        return self.runner.schedules["train"]

    # ---- processes and mesh --------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        world = self.num_processes * self.num_nodes
        if world and world % self.spec.pipeline_parallel:
            raise ValueError(
                f"pipeline_parallel={self.spec.pipeline_parallel} must divide the world size {world} "
                f"(devices={self.num_processes} x num_nodes={self.num_nodes}); change devices or pipeline_parallel."
            )
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        self._device_mesh = build_mesh(self.root_device.type, self.spec.pipeline_parallel, self.world_size)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ---- model ---------------------------------------------------------------------------------
    @override
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_hooks(module)
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError("strategy='bfpp' does not support loss scaling (fp16-mixed); use precision='bf16-mixed'.")
        if self.runner is None:
            self.runner = self._build_pipeline(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self._install_global_clipping()

    def _build_pipeline(self, module) -> PipelineRunner:
        pp_mesh, dp_mesh = self.device_mesh[PP], self.device_mesh[DP]
        modules, self.stage_layer_names = split_stages(
            module,
            list(module.pipeline_layers()),
            self.spec.num_stages,
            self.spec.local_stages(pp_mesh.get_local_rank()),
            self.spec.stage_rank,
            self.stage_layers,
        )
        _materialize_distributed_module(module, self.root_device)  # only local layers remain
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        sharded = self.sharding == "full" and dp_mesh.size() > 1
        if sharded:
            for stage in modules.values():
                shard_stage(stage, dp_mesh)
        replicate_group = dp_mesh.get_group() if not sharded and dp_mesh.size() > 1 else None
        return PipelineRunner(
            self._train_schedule, modules, self.root_device, pp_mesh.get_group(), module.pipeline_loss, replicate_group
        )

    def _install_global_clipping(self) -> None:
        """Norm clipping must see the whole model: the precision plugin's per-rank norm is replaced by one
        all-reduced over pipeline ranks (and data-parallel ranks when gradients are sharded)."""
        plugin = self.precision_plugin
        pp_group = self.device_mesh[PP].get_group()
        sharded = self.sharding == "full" and self.device_mesh[DP].size() > 1
        dp_group = self.device_mesh[DP].get_group() if sharded else None

        def clip_grad_by_norm(optimizer, clip_val) -> None:
            clip_grad_norm_global(plugin.main_params(optimizer), float(clip_val), pp_group, dp_group)

        plugin.clip_grad_by_norm = clip_grad_by_norm

    # ---- checkpoints ---------------------------------------------------------------------------
    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(self.model, _unwrap(optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("strategy='bfpp' writes torch.distributed.checkpoint folders; storage_options is not supported.")
        path = Path(self.broadcast(filepath))
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        checkpoint["bfpp"] = {"schedule": self.spec.name, "pipeline_parallel": self.spec.pipeline_parallel,
                              "loops": self.spec.loops, "data_parallel": self.data_parallel,
                              "stage_layers": self.stage_layer_names}
        ckpt.save(path, state, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [_unwrap(o) for o in self.optimizers]
        return ckpt.load(path, self.model, optimizers, strict=self.lightning_module.strict_loading)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Check the batch splits into micro-batches (before the first step), and on a mid-epoch resume start
        the training loader after the batches the checkpoint had trained on (`processed`: a ModelCheckpoint
        saving in on_train_batch_end has not yet counted its batch `completed`)."""
        batch_size = getattr(dataloader, "batch_size", None)
        if isinstance(batch_size, int) and batch_size % self.spec.micro_batches:
            raise ValueError(
                f"the dataloader's batch_size={batch_size} (per data-parallel replica) is not a multiple of "
                f"micro_batches={self.spec.micro_batches}; change one of them."
            )
        trainer = self.lightning_module.trainer
        if trainer.training and trainer.fit_loop.restarting:
            return skip_consumed_batches(dataloader, trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        return dataloader

    # ---- steps ---------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.runner is not None
        module = self.lightning_module
        inputs, target = module.pipeline_inputs(args[0])
        params = [p for p in module.parameters() if p.requires_grad]
        previous = [p.grad for p in params]  # grads of earlier accumulation batches: kept out of 1/m scaling
        for p in params:
            p.grad = None
        with self.precision_plugin.train_step_context():
            loss = self.runner.train_step(inputs, target)
        # Lightning zeroes grads between training_step and backward: park the fresh ones until backward.
        self._fresh_grads = [(p, p.grad) for p in params]
        for p, g in zip(params, previous):
            p.grad = g
        loss = share_from_ranks(loss, self.data_parallel, self.root_device)
        self._update_stats(params)
        module.log("train_loss", loss, prog_bar=True, batch_size=_batch_size(inputs))
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran backward; hand its gradients over where Lightning expects them."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        scale = 1.0 / module.trainer.accumulate_grad_batches  # Lightning divides the loss the same way
        for p, g in self._fresh_grads:
            if g is None:
                continue
            g = g * scale if scale != 1.0 else g
            p.grad = g if p.grad is None else p.grad + g
        self._fresh_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _eval_step(self, key: str, batch: Any, context) -> torch.Tensor:
        assert self.runner is not None
        inputs, target = self.lightning_module.pipeline_inputs(batch)
        with context():
            loss = self.runner.eval_step(inputs, target)
        loss = share_from_ranks(loss, self.data_parallel, self.root_device)
        # identical on every rank already; sync_dist only makes the epoch mean explicit (and quiet)
        self.lightning_module.log(key, loss, prog_bar=True, batch_size=_batch_size(inputs), sync_dist=True)
        return loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval_step("val_loss", args[0], self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._eval_step("test_loss", args[0], self.precision_plugin.test_step_context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Last stage's outputs, broadcast over the pipeline group: every rank returns them."""
        assert self.runner is not None
        inputs = self.lightning_module.pipeline_inputs(args[0])[0]
        with self.precision_plugin.predict_step_context():
            out = self.runner.predict_step(inputs)
        if self.spec.pipeline_parallel > 1:
            box = [out.cpu() if isinstance(out, torch.Tensor) else out]
            pp_mesh = self.device_mesh[PP]
            dist.broadcast_object_list(box, group=pp_mesh.get_group(), group_src=self.spec.pipeline_parallel - 1)
            out = box[0].to(self.root_device) if isinstance(box[0], torch.Tensor) else box[0]
        return out

    def _update_stats(self, params: list[torch.nn.Parameter]) -> None:
        """Per-step measurements, identical on every rank: the max over ranks of each number (bubble, times,
        bytes) and, under "memory", every rank's own byte counts ({global rank: {...}})."""
        assert self.runner is not None
        local = {
            **self.runner.last_stats,
            "param_bytes": local_bytes(params),
            "grad_bytes": local_bytes(g for _, g in self._fresh_grads),
            "optimizer_bytes": optimizer_bytes(self.optimizers),
            "activation_peak_bytes": self.runner.meter.peak,
        }
        mine = torch.tensor(list(local.values()), dtype=torch.float64, device=self.root_device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        table = torch.stack(every).cpu()
        self.step_stats = dict(zip(local, table.max(dim=0).values.tolist()))
        memory_keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_peak_bytes")
        columns = [list(local).index(k) for k in memory_keys]
        self.step_stats["memory"] = {
            rank: {k: int(row[c]) for k, c in zip(memory_keys, columns)} for rank, row in enumerate(table.tolist())
        }
