# Scope: the Lightning glue only. Settings are checked, the mesh is built, the model is cut into
# looped stages and sharded, and the training/eval steps run the pipeline schedule; everything else
# (launchers, sampler, checkpoint I/O, loops) is Lightning's ModelParallelStrategy.
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from . import checkpoint as ckpt
from .handover import GradHandover
from .hooks import check_hooks
from .launcher import CheckingLauncher, requeue_slurm_job, slurm_requeue_signal
from .parallel import (DP, PP, TP, build_mesh, clip_grad_norm_global, share_from_ranks, shard_stage,
                       stage_mixed_precision)
from .partition import balanced_layout, check_layout, named_parts, plan_stages, split_stages
from .runtime.layer_cost import measure_layer_times, sample_micro_batch, stage_sums, time_balanced_layout
from .precision import pipeline_precision
from .resume import skip_consumed_batches
from .runtime.instrument import MEMORY_KEYS, gather_stats, local_bytes, optimizer_bytes
from .runtime.pipeline import PipelineRunner, _batch_size
from .schedule import Schedule, ScheduleSpec, build_schedule
from .tensor_parallel import apply_plans, check_tensor_parallel, grads_like_params, layer_plans
from .tied import TiedWeights, find_shared_weights
from .user_steps import pipeline_answers_forward, run_on_last_stage
from .watchdog import FAILED, STOP_SIGNALS, Watchdog

SHARDING = ("full", "none")
NONFINITE_LOSS = ("stop", "skip")


def _unwrap(optimizer):
    """The torch optimizer behind a LightningOptimizer (or the optimizer itself)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class BFPPStrategy(ModelParallelStrategy):
    """Breadth-first pipeline parallelism (looped stages) x FSDP data parallelism for Lightning.

    Args:
        pipeline_parallel: pipeline ranks (pp); data parallel = world_size / (pp x tensor_parallel). Default (None):
            world_size / tensor_parallel (fewer when the model has fewer layers), printed at start.
        tensor_parallel: processes splitting every layer (tp, innermost, within one node) by the model's
            ``pipeline_tp_plan`` (see ``lightning_bfpp.tensor_parallel``); must divide the devices per node.
        loops: stages per pipeline rank; stage s lives on pipeline rank s % pp.
        micro_batches: micro-batches per step, split from each replica's batch (default: pp).
        schedule: "breadth_first" (default), "depth_first", "gpipe" or "1f1b".
        groups: breadth_first only: sequential accumulation groups of micro-batches.
        sharding: "full" (FSDP2 over data parallel) or "none" (replicated, gradients all-reduced).
        reshard_after_forward: free each stage's gathered weights between its forward and backward.
        stage_layers: explicit layer count per stage; "auto": balanced by time (every rank times every layer's
            forward+backward on one micro-batch of the training data at setup; all cut by the minimum over ranks;
            logged, and kept as ``stage_times_s``); default (None): balanced by parameter count.
        activation_checkpointing: recompute every layer of every local stage in backward (one extra forward
            per layer) instead of keeping its activations; only each layer's inputs stay saved.
        nonfinite_loss: a NaN/inf training loss (seen by every rank at once) "stop"s the run with an error
            before the optimizer step, or "skip"s that batch's gradients and goes on (counted as
            ``skipped_batches``); more than ``max_consecutive_skips`` skipped in a row stop the run.
        max_consecutive_skips: with nonfinite_loss="skip", the bound on consecutive skipped batches (default 5).
        process_group_backend: as in ModelParallelStrategy.
        timeout: bound on every distributed wait — collectives, p2p, the store (a timedelta or seconds; default
            30 min, torch's). A rank that dies or fails ends the job long before: see ``lightning_bfpp.watchdog``.
        measure_every_n_steps: when ``step_stats`` (bubble, compute time, per-rank bytes, saved-activation peak: an
            all-gather over the world and a saved-tensor hook) are measured: None (default) on Lightning's logging
            steps (``Trainer(log_every_n_steps=...)``) and the last step (``max_steps``); N every N-th step; 0 never.
            Other steps run without timing wrappers, saved-tensor hook or all-gather.
        trust_checkpoints: load checkpoint files with unrestricted unpickling (can run code from the file). Off by
            default: only plain data and tensors load (also switched on by BFPP_TRUST_CHECKPOINTS=1). README
            "Checkpoints" says what is safe to load from an untrusted source.

    Checkpoints are always sharded folders (torch.distributed.checkpoint) keyed by the model's own
    parameter names; they load into any other layout. See ``lightning_bfpp.checkpoint``.
    """

    strategy_name = "bfpp"

    def __init__(
        self,
        pipeline_parallel: int | None = None,
        tensor_parallel: int = 1,
        loops: int = 1,
        micro_batches: int | None = None,
        schedule: str = "breadth_first",
        groups: int = 1,
        sharding: Literal["full", "none"] = "full",
        reshard_after_forward: bool = False,
        stage_layers: Sequence[int] | Literal["auto"] | None = None,
        activation_checkpointing: bool = False,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
        max_consecutive_skips: int = 5,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        trust_checkpoints: bool = False,
        measure_every_n_steps: int | None = None,
    ) -> None:
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            if timeout <= 0:
                raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (default 1800).")
            timeout = timedelta(seconds=timeout)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        if sharding not in SHARDING:
            raise ValueError(
                f"sharding={sharding!r} is unknown; choose one of {', '.join(SHARDING)} (full: FSDP over data "
                "parallel; none: replicated weights, gradients all-reduced)."
            )
        if nonfinite_loss not in NONFINITE_LOSS:
            raise ValueError(f"nonfinite_loss={nonfinite_loss!r} must be one of {NONFINITE_LOSS}: stop the run, or skip the step.")
        if not (isinstance(max_consecutive_skips, int) and max_consecutive_skips >= 1):
            raise ValueError(f"max_consecutive_skips={max_consecutive_skips!r} must be a positive integer (default 5).")
        if measure_every_n_steps is not None and not (
                isinstance(measure_every_n_steps, int) and not isinstance(measure_every_n_steps, bool) and measure_every_n_steps >= 0):
            raise ValueError(f"measure_every_n_steps={measure_every_n_steps!r} must be None (Lightning's logging steps), "
                             "a positive integer N (every N-th step) or 0 (never).")
        if not (isinstance(tensor_parallel, int) and not isinstance(tensor_parallel, bool) and tensor_parallel >= 1):
            raise ValueError(f"tensor_parallel={tensor_parallel!r} must be a positive integer (1: no tensor parallel; "
                             "2, 4, 8: processes of one node splitting every layer).")
        self.tensor_parallel = tensor_parallel
        self.measure_every_n_steps = measure_every_n_steps
        self.nonfinite_loss = nonfinite_loss
        self.max_consecutive_skips = max_consecutive_skips
        self._default_layout = pipeline_parallel is None  # pp = world size, decided once the world is known
        self._layout_announced = False
        self._contract_announced = False
        self._requested_micro_batches = micro_batches
        self.spec = ScheduleSpec(
            name=schedule,
            pipeline_parallel=1 if pipeline_parallel is None else pipeline_parallel,
            loops=loops,
            micro_batches=micro_batches if micro_batches is not None else 1 if pipeline_parallel is None else pipeline_parallel,
            groups=groups,
            reshard_after_forward=bool(reshard_after_forward),
        )
        # Bad settings fail here, before any process starts: the schedule is generated and validated
        # (dependencies, send/receive pairing, no deadlock) now, and this very schedule is what runs.
        self._train_schedule = build_schedule(self.spec)
        self.sharding = sharding
        self.activation_checkpointing = bool(activation_checkpointing)
        self._fsdp_mixed_precision = False  # bf16-mixed through FSDP2's MixedPrecisionPolicy (set in setup)
        # one positive count per stage now; that they add up to the model's layers is checked by check_model
        self.stage_layers = "auto" if stage_layers == "auto" else \
            check_layout(stage_layers, None, self.spec.num_stages) if stage_layers else None
        self.stage_times_s: list[float] = []  # stage_layers="auto": measured seconds per stage (one micro-batch)
        self.runner: PipelineRunner | None = None
        self.stage_layer_names: list[list[str]] = []
        self.step_stats: dict[str, Any] = {}  # of the last measured step (see measure_every_n_steps)
        self.measured_step = False  # whether the last training step was measured
        self._handover = GradHandover()  # gradients from the schedule in training_step, handed over in backward
        self.skipped_batches = 0
        self._consecutive_skips = 0
        self.tied: TiedWeights | None = None
        self._watchdog: Watchdog | None = None
        self._failed = False
        self.trust_checkpoints = bool(trust_checkpoints)

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def pipeline_parallel(self) -> int:
        return self.spec.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        return self.device_mesh.size() // (self.spec.pipeline_parallel * self.tensor_parallel)

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

    # ---- the default layout (strategy="bfpp" with no pipeline_parallel) -------------------------------------
    def _resolve_default_layout(self, world: int, num_layers: int | None = None) -> None:
        """Without an explicit pipeline_parallel, every process is a pipeline rank: pp = the world size, or its
        largest divisor that leaves every stage a layer (`num_layers`, once the model is known)."""
        if not self._default_layout or not world or world % self.tensor_parallel:
            return
        world //= self.tensor_parallel  # pipeline x data parallel
        fits = [pp for pp in range(1, world + 1) if world % pp == 0
                and (num_layers is None or pp * self.spec.loops <= num_layers)]
        pp = max(fits or [1])
        if pp == self.spec.pipeline_parallel and num_layers is None:
            return
        m = self._requested_micro_batches if self._requested_micro_batches is not None else pp
        self.spec = dataclasses.replace(self.spec, pipeline_parallel=pp, micro_batches=m)
        self._train_schedule = build_schedule(self.spec)
        if self.stage_layers not in (None, "auto"):
            self.stage_layers = check_layout(self.stage_layers, None, self.spec.num_stages)
        if num_layers is not None and not self._layout_announced:
            self._layout_announced = True
            rank_zero_info(
                f"bfpp: default layout on {world * self.tensor_parallel} processes: pipeline_parallel={pp}, "
                f"data_parallel={world // pp}, tensor_parallel={self.tensor_parallel}, "
                f"loops={self.spec.loops}, micro_batches={m}, schedule={self.spec.name} (choose with "
                "BFPPStrategy(pipeline_parallel=..., loops=..., micro_batches=...))."
            )

    # ---- processes and mesh --------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        world = self.num_processes * self.num_nodes
        self._resolve_default_layout(world)
        if world and world % self.spec.pipeline_parallel:
            fits = [pp for pp in range(1, world + 1) if world % pp == 0]
            raise ValueError(
                f"pipeline_parallel={self.spec.pipeline_parallel} must divide the world size {world} "
                f"(devices={self.num_processes} x num_nodes={self.num_nodes}); use pipeline_parallel in {fits}, "
                f"or devices x num_nodes a multiple of {self.spec.pipeline_parallel}."
            )
        check_tensor_parallel(self.tensor_parallel, self.spec.pipeline_parallel, world, self.num_processes)
        super()._configure_launcher()
        if type(self._launcher) is _SubprocessScriptLauncher:  # check the model before starting the children
            self._launcher = CheckingLauncher(self._check_before_launch, self.cluster_environment,
                                              self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        if self.world_size > 1 and self._watchdog is None:
            requeue = slurm_requeue_signal(self.cluster_environment)
            self._watchdog = Watchdog(self.global_rank, self.world_size, on_exit=self._kill_children,
                                      signals=STOP_SIGNALS + ((requeue,) if requeue else ()),
                                      on_signal_stop=self._requeue if requeue and self.global_rank == 0 else None)
            self._watchdog.start()
            self._failed = False
        self._device_mesh = build_mesh(self.root_device.type, self.spec.pipeline_parallel, self.world_size, self._timeout,
                                       self.tensor_parallel)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _check_before_launch(self, ckpt_path: str | None = None) -> None:
        if self.lightning_module is not None and self.runner is None:  # once built, the model is already cut
            self.check_model(self.lightning_module)
        ckpt.check_path(ckpt_path, trust=self.trust_checkpoints)  # exists, complete, plain data only

    def _kill_children(self, wait: float = 0.0) -> None:
        """When this rank is Lightning's launching process, its child ranks go down with it (after `wait`
        seconds in which they may stop by themselves and say why)."""
        if isinstance(self.launcher, CheckingLauncher):
            self.launcher.stop_children(wait)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that failed first, on every rank (see ``lightning_bfpp.watchdog``). The launching
        process hosts the job's store: it outlives its children so they can read why the job stops."""
        self._failed = True
        if self._watchdog is not None:
            self._watchdog.report(exception)
            signalled = self._watchdog.code != FAILED
            self._kill_children(wait=self._watchdog.interval + (1.0 if signalled else self._watchdog.grace + 1.0))
        else:  # before the process group (e.g. its rendezvous timed out): the children have nothing to say
            self._kill_children()

    @override
    def teardown(self) -> None:
        """After a stop signal the process ends here with the job's code (128 + N) rather than the code of a
        secondary error (a peer's closed connection), which would say 1 on some ranks."""
        code = None
        if self._watchdog is not None:
            code = self._watchdog.code if self._failed else None
            self._watchdog.stop(finished=not self._failed)
            self._watchdog = None
        super().teardown()
        if code is not None and code != FAILED:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def _claim_signals(self) -> None:
        """Lightning installs its SIGTERM handler after ``setup_environment``; the watchdog's handlers go back on
        top at the start of every loop (see ``lightning_bfpp.watchdog``)."""
        if self._watchdog is not None:
            self._watchdog.claim_signals()

    @override
    def on_train_start(self) -> None:
        self._claim_signals()

    @override
    def on_validation_start(self) -> None:
        self._claim_signals()

    @override
    def on_test_start(self) -> None:
        self._claim_signals()

    @override
    def on_predict_start(self) -> None:
        self._claim_signals()

    def _requeue(self, signum: int) -> None:
        """Global rank 0, after SLURM's requeue signal stopped every rank: put the job back in the queue."""
        requeue_slurm_job()

    # ---- model ---------------------------------------------------------------------------------
    @override
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if self.runner is None:
            self.check_model(module)  # again on every rank: under torchrun/SLURM no launcher has checked it
            self.runner = self._build_pipeline(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Lightning's plugin, as a subclass that clips by the global norm; under "bf16-mixed" with sharded stages
        # FSDP2 computes in bf16 (``parallel.stage_mixed_precision``), so no autocast (README "Precision and memory")
        self.precision_plugin = pipeline_precision(self.precision_plugin, self._clip_grad_norm, self._fsdp_mixed_precision)

    def check_model(self, module) -> list[list[str]]:
        """Check `module` against these settings without changing it; return the layer names of every stage.

        Raises when a pipeline hook is missing, the module optimizes manually, the precision is fp16, or the
        layers cannot be cut into pipeline_parallel x loops stages (see ``partition.plan_stages``). Lightning's
        launcher runs this in the launching process before it starts the others; ``setup`` runs it on every rank.
        """
        check_hooks(module)
        name = type(module).__name__
        if not module.automatic_optimization:
            raise ValueError(
                f"{name}.automatic_optimization=False: strategy='bfpp' runs forward and backward of every micro-batch "
                "itself inside the training step, so a manual optimization loop cannot run; use automatic "
                "optimization (return the loss, or let bfpp compute it with pipeline_loss) or another strategy."
            )
        if is_overridden("training_step", module) and "dataloader_iter" in inspect.signature(module.training_step).parameters:
            raise ValueError(f"{name}.training_step(dataloader_iter): strategy='bfpp' needs one batch per step; take `batch`.")
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if getattr(self.precision_plugin, "scaler", None) is not None or precision.startswith("16"):
            raise ValueError(
                f"precision={precision!r}: strategy='bfpp' does not support fp16 (no loss scaling across pipeline "
                "stages; fp16 overflows within steps); use precision='bf16-mixed' or 'bf16-true' (or '32-true')."
            )
        layers = list(module.pipeline_layers())
        self._resolve_default_layout(self.num_processes * self.num_nodes, len(layers))
        self._announce_contract(module)
        stages = plan_stages(module, layers, self.spec.num_stages, None if self.stage_layers == "auto" else self.stage_layers)
        if self.tensor_parallel > 1:
            layer_plans(module, layers, self.tensor_parallel)  # the model's tensor-parallel plan, checked
        return stages

    def _announce_contract(self, module) -> None:
        """Say once, at start-up, which of the user's methods bfpp runs as written and which it replaces."""
        if self._contract_announced:
            return
        self._contract_announced = True
        name = type(module).__name__
        metrics = "pipeline_train_metrics(output, target)" if callable(getattr(module, "pipeline_train_metrics", None)) \
            else "none (define pipeline_train_metrics(output, target) to log training metrics)"
        replaced = (f"{name}.training_step is not run: " if is_overridden("training_step", module) else "") + \
            "each training step runs the pipeline schedule with pipeline_loss per micro-batch and logs train_loss"
        as_written = [m for m in ("validation_step", "test_step", "predict_step") if is_overridden(m, module)]
        rank_zero_info(
            f"bfpp: {replaced}; training metrics: {metrics}; run as written on the last stage with self(x) = the "
            f"pipeline's output: {', '.join(as_written) or 'none'} (README: Adapting a model)."
        )

    def _build_pipeline(self, module) -> PipelineRunner:
        pp_mesh, dp_mesh = self.device_mesh[PP], self.device_mesh[DP]
        layers = list(module.pipeline_layers())
        parts = named_parts(module, layers)  # every layer's modules by their names in `module`, before the split
        tp = self.tensor_parallel
        plans = layer_plans(module, layers, tp) if tp > 1 else {}
        modules, self.stage_layer_names = split_stages(
            module,
            layers,
            self.spec.num_stages,
            self.spec.local_stages(pp_mesh.get_local_rank()),
            self.spec.stage_rank,
            self._auto_stage_layers(module, layers) if self.stage_layers == "auto" else self.stage_layers,
        )
        # weights shared across stages (tied embeddings): one copy per stage, before stages are cast or sharded
        shared = find_shared_weights(parts, self.stage_layer_names)
        # global rank = (pipeline rank x dp + dp index) x tp + tp index: copies are summed per (dp, tp) index
        self.tied = TiedWeights(module, shared, modules, self.spec.stage_rank, dp_mesh.size() * tp, self.global_rank,
                                self._timeout)
        _materialize_distributed_module(module, self.root_device)  # only local layers remain
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if plans:  # split the local layers over tensor parallel (before FSDP shards the stages over data parallel)
            apply_plans(plans, modules.values(), self.device_mesh[TP])
        for stage in modules.values():
            stage.activation_checkpointing = self.activation_checkpointing
        sharded = self.sharding == "full" and dp_mesh.size() > 1
        if sharded:
            precision, last = getattr(self.precision_plugin, "precision", "32-true"), self.spec.num_stages - 1
            for s, stage in modules.items():
                shard_stage(stage, dp_mesh, stage_mixed_precision(precision, last_stage=s == last))
            self._fsdp_mixed_precision = precision == "bf16-mixed"
        replicate_group = dp_mesh.get_group() if not sharded and dp_mesh.size() > 1 else None
        return PipelineRunner(
            self._train_schedule, modules, self.root_device, pp_mesh.get_group(), module.pipeline_loss, replicate_group
        )

    def _auto_stage_layers(self, module, layers: list) -> list[int]:
        """stage_layers="auto": every rank times each layer (``runtime.layer_cost``); the minimum over ranks (the
        least disturbed sample, identical everywhere) decides the cut; the cut and the per-stage times are logged."""
        inputs, target = sample_micro_batch(module, module.trainer, self.spec.micro_batches)
        measured = measure_layer_times(module, layers, inputs, target, module.pipeline_loss, self.root_device, repeats=5)
        times_t = torch.tensor(measured, dtype=torch.float64, device=self.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(times_t, op=dist.ReduceOp.MIN)
        times = times_t.tolist()
        counts = time_balanced_layout(times, self.spec.num_stages)
        self.stage_times_s = stage_sums(times, counts)
        by_params = balanced_layout([sum(p.numel() for p in layer.parameters()) for layer in layers], self.spec.num_stages)
        rank_zero_info(
            f"bfpp: stage_layers='auto' cut {counts} (by parameter count: {by_params}); forward+backward per stage "
            f"on one micro-batch: {', '.join(f'{t * 1e3:.1f}' for t in self.stage_times_s)} ms, by parameter count "
            f"the slowest would be {max(stage_sums(times, by_params)) * 1e3:.1f} ms."
        )
        return counts

    def _clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> None:
        """Norm clipping over the whole model (the precision plugin's ``clip_grad_by_norm``, see
        ``lightning_bfpp.precision``): the norm is all-reduced over pipeline ranks (and data-parallel ranks when
        gradients are sharded); copies of a shared weight count once."""
        pp_group = self.device_mesh[PP].get_group()
        sharded = self.sharding == "full" and self.device_mesh[DP].size() > 1
        dp_group = self.device_mesh[DP].get_group() if sharded else None
        not_counted = self.tied.not_counted() if self.tied is not None else set()
        tp_group = self.device_mesh[TP].get_group() if self.tensor_parallel > 1 else None
        clip_grad_norm_global(params, max_norm, pp_group, dp_group, not_counted, tp_group)

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
                              "tensor_parallel": self.tensor_parallel,
                              "stage_layers": self.stage_layer_names, "stage_times_s": self.stage_times_s}
        ckpt.save(path, state, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        optimizers = [_unwrap(o) for o in self.optimizers]
        aliases = self.tied.aliases() if self.tied is not None else None
        # every rank checks the checkpoint (under torchrun/SLURM no launcher has) and loads without running code
        return ckpt.load(path, self.model, optimizers, strict=self.lightning_module.strict_loading, aliases=aliases,
                         trust=self.trust_checkpoints)

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
        if self._watchdog is not None:
            self._watchdog.progress(module.trainer.global_step)
        inputs, target = module.pipeline_inputs(args[0])
        params = [p for p in module.parameters() if p.requires_grad]
        train_metrics = getattr(module, "pipeline_train_metrics", None)
        # Lightning zeroes grads between training_step and backward: park the fresh ones until backward.
        self.measured_step = measure = self._measure_now(module.trainer)
        with self._handover.capture(params):
            with self.precision_plugin.train_step_context():
                loss, outputs = self.runner.train_step(inputs, target, keep_outputs=callable(train_metrics), measure=measure)
            if self.tied:
                self.tied.sum_gradients()
            if self.tensor_parallel > 1:
                grads_like_params(params)
        loss = share_from_ranks(loss, self.data_parallel * self.tensor_parallel, self.root_device)  # last-stage ranks
        if measure:
            self._update_stats(params)
        module.log("train_loss", loss, prog_bar=True, batch_size=_batch_size(inputs))
        if callable(train_metrics):
            with torch.no_grad():
                self._run_user_step(lambda: train_metrics(outputs, target))
        if not torch.isfinite(loss):  # the shared loss: every rank takes this branch together
            return self._on_nonfinite_loss(loss, args[1] if len(args) > 1 else None)
        self._consecutive_skips = 0
        return loss

    def _on_nonfinite_loss(self, loss: torch.Tensor, batch_idx: int | None) -> torch.Tensor:
        """Stop every rank before the optimizer step (weights and checkpoints stay the last good ones), or drop
        this batch's gradients. (Lightning refuses a None step output in distributed runs.)"""
        trainer = self.lightning_module.trainer
        where = f"train_loss={loss.item()} at global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {batch_idx})"
        if self.nonfinite_loss == "stop":
            raise FloatingPointError(
                f"{where}: stopping every rank before the optimizer step, so the weights and the last checkpoint are the "
                "last good ones. Check the data and the learning rate, or set nonfinite_loss='skip' (Hydra: "
                "schedule.nonfinite_loss=skip) to drop such batches."
            )
        self._handover.drop()  # backward hands nothing over; parameters without gradients are not stepped
        self.skipped_batches += 1
        self._consecutive_skips += 1
        if self._consecutive_skips > self.max_consecutive_skips:
            raise FloatingPointError(
                f"{where}: {self._consecutive_skips} batches in a row had a non-finite loss (nonfinite_loss='skip' "
                f"allows max_consecutive_skips={self.max_consecutive_skips}): the weights are likely poisoned (e.g. "
                "by a huge update). Stopping every rank; lower the learning rate or resume from an earlier checkpoint "
                "(Hydra: schedule.max_consecutive_skips=N raises the bound)."
            )
        self.lightning_module.log("skipped_batches", float(self.skipped_batches), batch_size=1)
        rank_zero_warn(f"{where}: dropped that batch's gradients (nonfinite_loss='skip', {self.skipped_batches} so far, "
                       f"{self._consecutive_skips} in a row).")
        return loss

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran backward; hand its gradients over where Lightning expects them."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._handover.hand_over(1.0 / module.trainer.accumulate_grad_batches)  # as Lightning divides the loss
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _run_user_step(self, method) -> tuple[Any, list[str]]:
        """`method()` on the ranks holding the last stage; its logs replayed and its result returned on every
        rank (see ``lightning_bfpp.user_steps``)."""
        assert self.runner is not None
        pp_mesh, dp_mesh = self.device_mesh[PP], self.device_mesh[DP]
        return run_on_last_stage(self.lightning_module, method, self.runner.has_last_stage, pp_mesh.get_group(),
                                 self.spec.pipeline_parallel - 1, dp_mesh.get_group(), self.root_device)

    def _user_step(self, step: str, context, args: tuple, kwargs: dict) -> Any:
        """The user's own `step` (validation_step, test_step, predict_step) with `self(x)` answered by the
        pipeline's forward of this batch; a predict_step the user did not write returns that output."""
        assert self.runner is not None
        module = self.lightning_module
        batch = kwargs.get("batch", args[0] if args else None)
        inputs = module.pipeline_inputs(batch)[0]
        with context():
            output = self.runner.predict_step(inputs)  # every rank takes part; the output is on the last stage's
            if not is_overridden(step, module):
                method = lambda: output  # noqa: E731  (Lightning's default predict_step is self(batch))
            else:
                def method():
                    with pipeline_answers_forward(module, inputs, output, step):
                        return getattr(module, step)(*args, **kwargs)
            result, nonfinite = self._run_user_step(method)
        if nonfinite:
            rank_zero_warn(f"{type(module).__name__}.{step} logged non-finite {', '.join(nonfinite)} "
                           f"(batch {kwargs.get('batch_idx', args[1] if len(args) > 1 else '?')}).")
        return result

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._user_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._user_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """What the user's predict_step returns, on every rank (shared over the pipeline group)."""
        return self._user_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _measure_now(self, trainer) -> bool:
        """Whether this training step is measured (the same answer on every rank: the gather is collective)."""
        n = trainer.log_every_n_steps if self.measure_every_n_steps is None else self.measure_every_n_steps
        step = trainer.global_step + 1  # Lightning's count: its logging steps are those where this is a multiple of n
        last = self.measure_every_n_steps is None and 0 < trainer.max_steps <= step
        return bool(n) and (step % n == 0 or last)

    def _update_stats(self, params: list[torch.nn.Parameter]) -> None:
        """Per-step measurements, identical on every rank: the max over ranks of each number (bubble, times,
        bytes) and, under "memory", every rank's own byte counts ({global rank: {...}})."""
        assert self.runner is not None
        local = {
            **self.runner.last_stats,
            "param_bytes": local_bytes(params),
            "grad_bytes": local_bytes(self._handover.grads()),
            "optimizer_bytes": optimizer_bytes(self.optimizers),
            "activation_peak_bytes": self.runner.meter.peak,
        }
        self.step_stats = gather_stats(local, MEMORY_KEYS, self.root_device)

