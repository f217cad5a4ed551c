# Scope: the Lightning glue only. Settings are checked, the mesh is built, the model is cut into
# looped stages and sharded, and the training/eval steps run the pipeline schedule; everything else
# (launchers, sampler, checkpoint I/O, loops) is Lightning's ModelParallelStrategy.
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from . import checkpoint as ckpt
from .auto_layout import KNOBS, AutoLayout, decide, sample_inputs
from .handover import GradHandover
from .hooks import (
    PipelineHooks, check_callbacks, check_module, describe_contract, forward_not_the_pipeline, not_run_as_written,
    rank_zero_work_on_last_stage,
)
from .job import JobGuard
from .launcher import CheckingLauncher
from .lightning_private import (SubprocessScriptLauncher, materialize_distributed_module, optimizers_to_device,
                                process_group_timeout, process_group_timeout_at_least, set_module_device_mesh,
                                unwrap_optimizer)
from .measure import check_every_n_steps, measure_now, step_stats
from .nonfinite import NonfiniteLoss
from .parallel import DP, PP, TP, build_mesh, clip_grad_norm_global, forget_groups, share_from_ranks
from .partition import check_layout, plan_stages
from .precision import pipeline_precision
from .replica_collectives import ReplicaCollectives
from .resume import skip_consumed_batches
from .same_batch import check_same_batch
from .runtime.layer_cost import auto_stage_layers
from .runtime.pipeline import PipelineRunner, _batch_size
from .schedule import Schedule, ScheduleSpec, build_schedule
from .schedule.dims import LayoutError, Names, ParallelDims, default_pipeline_parallel
from .stages import cut, parallelize
from .tensor_parallel import grads_like_params, layer_plans
from .torch_private import set_default_group_timeout
from .user_steps import run_on_last_stage, user_step


BATCH_NAMES = Names(batch="global_batch_size")


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _ragged_tail(dataloader: object) -> int:
    """Samples in a map-style loader's short last batch (0: none, or unknown)."""
    batch_size, sampler = getattr(dataloader, "batch_size", None), getattr(dataloader, "sampler", None)
    if not isinstance(batch_size, int) or getattr(dataloader, "drop_last", True) or not hasattr(sampler, "__len__"):
        return 0
    return len(sampler) % batch_size


STARTUP_TIMEOUT = timedelta(minutes=5)  # the least the rendezvous waits for every process to start

class BFPPStrategy(ReplicaCollectives, ModelParallelStrategy):
    """Breadth-first pipeline parallelism (looped stages) x FSDP data parallelism for Lightning.

    Args:
        layout: "auto" (or ``AutoLayout(...)``): pipeline_parallel, loops, micro_batches, groups, schedule, sharding,
            reshard_after_forward and the stage cut are picked by the planner (``lightning_bfpp.auto_layout``) from
            this model's layers measured on this device, for this world and ``global_batch_size``; the pick and the
            runner-up are printed with predicted step time and memory. Any of those knobs set here is pinned.
            Default (None): the knobs as given, with the defaults below.
        global_batch_size: samples per optimizer step over all data-parallel replicas; required by layout="auto" (a
            loader's batch is per replica, so it would change with data_parallel). The training loader's batch must
            be ``replica_batch_size`` (global_batch_size / data_parallel), which is checked.
        pipeline_parallel: pipeline ranks (pp); data parallel = world_size / (pp x tensor_parallel). Default (None):
            world_size / tensor_parallel (fewer when the model has fewer layers), printed at start.
        tensor_parallel: processes splitting every layer (tp, innermost, within one node) by the model's
            ``pipeline_tp_plan`` (see ``lightning_bfpp.tensor_parallel``); must divide the devices per node.
        loops: stages per pipeline rank (default 1); stage s lives on pipeline rank s % pp.
        micro_batches: micro-batches per step, split from each replica's batch (default: pp).
        schedule: "breadth_first" (default), "depth_first", "gpipe" or "1f1b".
        groups: breadth_first only: sequential accumulation groups of micro-batches (default 1).
        sharding: "full" (FSDP2 over data parallel; default) or "none" (replicated, gradients all-reduced).
        reshard_after_forward: free each stage's gathered weights between its forward and backward (default False).
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
            30 min, torch's), except the start-up rendezvous (at least ``STARTUP_TIMEOUT``: processes start at
            different times). A rank that dies or fails ends the job long before: see ``lightning_bfpp.watchdog``.
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
        loops: int | None = None,
        micro_batches: int | None = None,
        schedule: str | None = None,
        groups: int | None = None,
        sharding: Literal["full", "none"] | None = None,
        reshard_after_forward: bool | None = None,
        stage_layers: Sequence[int] | Literal["auto"] | None = None,
        activation_checkpointing: bool = False,
        nonfinite_loss: Literal["stop", "skip"] = "stop",
        max_consecutive_skips: int = 5,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        trust_checkpoints: bool = False,
        measure_every_n_steps: int | None = None,
        layout: Literal["auto"] | AutoLayout | None = None,
        global_batch_size: int | None = None,
    ) -> None:
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            if timeout <= 0:
                raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (default 1800).")
            timeout = timedelta(seconds=timeout)
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.measure_every_n_steps = check_every_n_steps(measure_every_n_steps)
        self.nonfinite = NonfiniteLoss(nonfinite_loss, max_consecutive_skips)
        given = dict(pipeline_parallel=pipeline_parallel, loops=loops, micro_batches=micro_batches, groups=groups,
                     schedule=schedule, sharding=sharding, reshard_after_forward=reshard_after_forward)
        self.auto_layout = AutoLayout() if layout == "auto" else layout  # decided in setup_environment
        if self.auto_layout is not None and not isinstance(self.auto_layout, AutoLayout):
            raise ValueError(f"layout={layout!r} must be 'auto', an AutoLayout(...) or None (the knobs as given).")
        self.pinned = {k: given[k] for k in KNOBS if given[k] is not None} if self.auto_layout else {}
        if (self.auto_layout or global_batch_size is not None) and not (
                isinstance(global_batch_size, int) and not isinstance(global_batch_size, bool) and global_batch_size >= 1):
            raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive integer, the samples per "
                             "optimizer step over all replicas (layout='auto' needs global_batch_size: every candidate "
                             "layout trains that same batch, each replica loading global_batch_size / data_parallel, "
                             "strategy.replica_batch_size).")
        if self.auto_layout and tensor_parallel != 1:
            raise ValueError(f"layout='auto' searches tensor_parallel=1 only; set the layout by hand for tensor_parallel"
                             f"={tensor_parallel!r}.")
        self.global_batch_size = global_batch_size
        self._decided = False  # layout="auto": decided in setup_environment
        # pp = world size, decided once the world is known (layout="auto": the planner's, in setup_environment)
        self._default_layout = pipeline_parallel is None and self.auto_layout is None
        self._requested_micro_batches = micro_batches
        self._contract_announced = False
        self._check_batch = True  # the next batch is compared across the ranks of each replica (lightning_bfpp.same_batch)
        self._layout_announced = False
        pp = 1 if pipeline_parallel is None else pipeline_parallel
        m = micro_batches if micro_batches is not None else 1 if self.auto_layout else pp
        spec = ScheduleSpec(_given(schedule, "breadth_first"), pipeline_parallel=pp, loops=_given(loops, 1),
                            groups=_given(groups, 1), micro_batches=m,
                            reshard_after_forward=bool(_given(reshard_after_forward, False)))
        sharding = _given(sharding, "full")  # (None: not given; 0, "" and other values are checked as given)
        # Bad settings fail here, before any process starts: the layout's rules (``schedule.dims``) with the world
        # not yet known, and the schedule is generated and validated (dependencies, send/receive pairing, no
        # deadlock) now; this very schedule is what runs. The world and the model are checked once known.
        self.dims = ParallelDims(world=pp * tensor_parallel if isinstance(tensor_parallel, int) else pp, spec=spec,
                                 tensor_parallel=tensor_parallel, sharding=sharding).validate()
        self._train_schedule = build_schedule(spec)
        self.activation_checkpointing = bool(activation_checkpointing)
        self._fsdp_mixed_precision = False  # bf16-mixed through FSDP2's MixedPrecisionPolicy (set in setup)
        # one positive count per stage now; that they add up to the model's layers is checked by check_model
        self.stage_layers = "auto" if stage_layers == "auto" else check_layout(
            stage_layers, None, len(stage_layers) if self.auto_layout else spec.num_stages) if stage_layers else None
        self.stage_times_s: list[float] = []  # stage_layers="auto": measured seconds per stage (one micro-batch)
        self.runner: PipelineRunner | None = None
        self.stage_layer_names: list[list[str]] = []
        self.step_stats: dict[str, Any] = {}  # of the last measured step (see measure_every_n_steps)
        self.measured_step = False  # whether the last training step was measured
        self._handover = GradHandover()  # gradients from the schedule in training_step, handed over in backward
        self.tied = None  # TiedWeights, once the model is cut
        self._job = JobGuard()
        self.trust_checkpoints = bool(trust_checkpoints)

    # ---- the layout ----------------------------------------------------------------------------
    @property
    def spec(self) -> ScheduleSpec:
        return self.dims.spec

    @property
    def pipeline_parallel(self) -> int:
        return self.dims.pipeline_parallel

    @property
    def tensor_parallel(self) -> int:
        return self.dims.tensor_parallel

    @property
    def data_parallel(self) -> int:
        return self.dims.data_parallel

    @property
    def sharding(self) -> str:
        return self.dims.sharding

    @property
    def loops(self) -> int:
        return self.spec.loops

    @property
    def micro_batches(self) -> int:
        return self.spec.micro_batches

    @property
    def replica_batch_size(self) -> int | None:
        """Samples each data-parallel replica's training loader yields per step (global_batch_size / data_parallel)."""
        return None if self.global_batch_size is None else self.dims.replica_batch(self.global_batch_size, BATCH_NAMES)

    @property
    def schedule(self) -> Schedule:
        assert self.runner is not None, "the schedule is built in setup()"
        return self.runner.schedules["train"]

    def _set_world(self, world: int, num_layers: int | None = None) -> None:
        """The layout on `world` processes (`num_layers`: once the model is known), checked by its one set of rules.
        Without an explicit pipeline_parallel every process is a pipeline rank (``default_pipeline_parallel``)."""
        if not world:
            return
        spec = self.spec
        if self._default_layout and world % self.tensor_parallel == 0:
            pp = default_pipeline_parallel(world, self.tensor_parallel, spec.loops, num_layers)
            m = self._requested_micro_batches if self._requested_micro_batches is not None else pp
            spec = dataclasses.replace(spec, pipeline_parallel=pp, micro_batches=m)
        changed = spec != self.spec
        self.dims = dataclasses.replace(self.dims, world=world, devices_per_node=self.num_processes, spec=spec)
        undecided = self.auto_layout is not None and not self._decided  # the planner picks a layout the batch fits
        self.dims.validate(num_layers=num_layers, global_batch=None if undecided else self.global_batch_size,
                           names=BATCH_NAMES)
        if changed:
            self._train_schedule = build_schedule(spec)
            if self.stage_layers not in (None, "auto"):
                self.stage_layers = check_layout(self.stage_layers, None, spec.num_stages)
        if self._default_layout and num_layers is not None and not self._layout_announced:
            self._layout_announced = True
            rank_zero_info(
                f"bfpp: default layout on {world} processes: pipeline_parallel={spec.pipeline_parallel}, "
                f"data_parallel={self.dims.data_parallel}, tensor_parallel={self.tensor_parallel}, "
                f"loops={spec.loops}, micro_batches={spec.micro_batches}, schedule={spec.name} (choose with "
                "BFPPStrategy(pipeline_parallel=..., loops=..., micro_batches=...)).")

    # ---- processes and mesh --------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        self._set_world(self.num_processes * self.num_nodes)
        super()._configure_launcher()
        if type(self._launcher) is SubprocessScriptLauncher:  # check the model before starting the children
            self._launcher = CheckingLauncher(self._check_before_launch, self.cluster_environment,
                                              self.num_processes, self.num_nodes)

    @override
    def setup_environment(self) -> None:
        # the rendezvous waits for every process to start (imports, a slow file system, a loaded machine): at least
        # STARTUP_TIMEOUT; afterwards every wait is bounded by `timeout` again
        with process_group_timeout_at_least(self, STARTUP_TIMEOUT) as requested:
            self._setup_distributed()
        if requested is not None and requested < STARTUP_TIMEOUT:
            set_default_group_timeout(requested)
        if self.auto_layout is not None and not self._decided:
            self._decide_layout()  # before the mesh, the datamodule's setup and the samplers depend on it
        self._job.start(self.global_rank, self.world_size, self.cluster_environment, self.launcher)
        self._device_mesh = build_mesh(self.root_device.type, self.pipeline_parallel, self.world_size,
                                       process_group_timeout(self), self.tensor_parallel)
        assert self.lightning_module is not None
        set_module_device_mesh(self.lightning_module, self._device_mesh)

    def _decide_layout(self) -> None:
        """layout="auto" on every rank at once, the process group up: each rank measures the layers, the numbers are
        min-reduced and rank 0's pick is broadcast (``auto_layout.decide``), so every rank builds the same mesh."""
        module = self.lightning_module
        layers = list(module.pipeline_layers())
        inputs, target = sample_inputs(module, self.auto_layout.sample)
        explicit = isinstance(self.stage_layers, list)
        spec, sharding, cut, line = decide(
            module, layers, inputs, target, self.root_device, world=self.world_size, devices_per_node=self.num_processes,
            global_batch=self.global_batch_size, pinned=self.pinned, settings=self.auto_layout,
            stage_count=len(self.stage_layers) if explicit else None, precision=self._precision)
        self.dims = dataclasses.replace(self.dims, spec=spec, sharding=sharding)
        self._train_schedule = build_schedule(spec)
        self.stage_layers = self.stage_layers if explicit else cut  # "auto"/None: cut by the measured times
        self._decided = True
        self._set_world(self.world_size, len(layers))
        rank_zero_info(line)

    def _check_before_launch(self, ckpt_path: str | None = None, trainer=None) -> None:
        if self.lightning_module is not None and self.runner is None:  # once built, the model is already cut
            self.check_model(self.lightning_module)
        if trainer is not None:
            check_callbacks(trainer.callbacks)
        ckpt.check_path(ckpt_path, trust=self.trust_checkpoints)  # exists, complete, plain data only

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that failed first, on every rank (see ``lightning_bfpp.job``); a later run in this process
        builds new process groups (these may hold a broken collective)."""
        forget_groups()
        self._job.on_exception(exception)

    @override
    def teardown(self) -> None:
        code = self._job.stop()  # after a stop signal: the job's code (128 + N)
        super().teardown()
        if code is not None:
            self._job.exit(code)

    # Lightning installs its SIGTERM handler after setup_environment: the watchdog's go back on top in every loop
    @override
    def on_train_start(self) -> None:
        self._job.claim_signals()
        self._check_batch = True

    @override
    def on_validation_start(self) -> None:
        self._job.claim_signals()
        self._check_batch = True

    @override
    def on_test_start(self) -> None:
        self._job.claim_signals()
        self._check_batch = True

    @override
    def on_predict_start(self) -> None:
        self._job.claim_signals()
        self._check_batch = True

    # ---- model ---------------------------------------------------------------------------------
    @override
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_callbacks(trainer.callbacks)  # again on every rank: under torchrun/SLURM no launcher has checked it
        if self.runner is None:
            self.check_model(module)
            self.runner = self._build_pipeline(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        # Lightning's plugin, as a subclass that clips by the global norm; under "bf16-mixed" with sharded stages
        # FSDP2 computes in bf16 (``parallel.stage_mixed_precision``), so no autocast (README "Precision and memory")
        self.precision_plugin = pipeline_precision(self.precision_plugin, self._clip_grad_norm, self._fsdp_mixed_precision)

    @property
    def _precision(self) -> str:
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def check_model(self, module) -> list[list[str]]:
        """Check `module` against these settings without changing it; return the layer names of every stage.

        Raises when a pipeline hook is missing, the module optimizes manually, the precision is fp16, or the
        layers cannot be cut into pipeline_parallel x loops stages (see ``partition.plan_stages``). Lightning's
        launcher runs this in the launching process before it starts the others; ``setup`` runs it on every rank.
        """
        check_module(module, self._precision, getattr(self.precision_plugin, "scaler", None) is not None)
        layers = list(module.pipeline_layers())
        self._set_world(self.num_processes * self.num_nodes, len(layers))
        if not self._contract_announced:
            self._contract_announced = True
            rank_zero_info(describe_contract(module))
            for warning in (rank_zero_work_on_last_stage(module, self.spec.pipeline_parallel),
                            forward_not_the_pipeline(module), *not_run_as_written(module, self.spec.micro_batches)):
                if warning is not None:
                    rank_zero_warn(warning)
        undecided = self.stage_layers == "auto" or (self.auto_layout is not None and not self._decided)
        stages = plan_stages(module, layers, self.spec.num_stages, None if undecided else self.stage_layers)
        if self.tensor_parallel > 1:
            layer_plans(module, layers, self.tensor_parallel)  # the model's tensor-parallel plan, checked
        return stages

    def _build_pipeline(self, module) -> PipelineRunner:
        layers = list(module.pipeline_layers())
        plans = layer_plans(module, layers, self.tensor_parallel) if self.tensor_parallel > 1 else {}
        layout = self.stage_layers
        if layout == "auto":
            layout, self.stage_times_s, line = auto_stage_layers(module, layers, self.spec.num_stages,
                                                                 self.spec.micro_batches, self.root_device)
            rank_zero_info(line)
        modules, self.stage_layer_names, self.tied = cut(module, layers, self.device_mesh, self.dims, layout,
                                                         self.global_rank, process_group_timeout(self))
        materialize_distributed_module(module, self.root_device)  # only local layers remain
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._fsdp_mixed_precision = parallelize(modules, self.device_mesh, self.dims, plans, self._precision,
                                                 self.activation_checkpointing)
        dp_mesh = self.device_mesh[DP]
        replicate_group = dp_mesh.get_group() if not self.dims.sharded and dp_mesh.size() > 1 else None
        return PipelineRunner(self._train_schedule, modules, self.root_device, self.device_mesh[PP].get_group(),
                              module.pipeline_loss, replicate_group)

    def _clip_grad_norm(self, params: Iterable[torch.nn.Parameter], max_norm: float) -> None:
        """Norm clipping over the whole model (the precision plugin's ``clip_grad_by_norm``, see
        ``lightning_bfpp.precision``): the norm is all-reduced over pipeline ranks (and data-parallel ranks when
        gradients are sharded); copies of a shared weight count once."""
        dp_group = self.device_mesh[DP].get_group() if self.dims.sharded else None
        not_counted = self.tied.not_counted() if self.tied is not None else set()
        tp_group = self.device_mesh[TP].get_group() if self.tensor_parallel > 1 else None
        clip_grad_norm_global(params, max_norm, self.device_mesh[PP].get_group(), dp_group, not_counted, tp_group)

    # ---- checkpoints ---------------------------------------------------------------------------
    @override
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return ckpt.optimizer_state(self.model, unwrap_optimizer(optimizer))

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
        optimizers = [unwrap_optimizer(o) for o in self.optimizers]
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
        if isinstance(batch_size, int):
            self.dims.micro_batch_size(batch_size, Names(replica_batch="the dataloader's batch_size"))
        trainer = self.lightning_module.trainer
        if isinstance(batch_size, int) and trainer.training and self.global_batch_size:
            if batch_size != self.replica_batch_size:
                raise LayoutError(
                    f"the training dataloader's batch_size={batch_size} (per data-parallel replica) x data_parallel="
                    f"{self.data_parallel} is not global_batch_size={self.global_batch_size}: build the loader with "
                    f"batch_size=trainer.strategy.replica_batch_size ({self.replica_batch_size}), e.g. in a datamodule's "
                    "setup/train_dataloader, so the optimizer sees the same batch whatever the layout.")
        tail = _ragged_tail(dataloader)
        if tail and trainer.training and tail % self.spec.micro_batches:
            rank_zero_warn(
                f"the training dataloader's last batch of each epoch has {tail} samples (per data-parallel replica), "
                f"not a multiple of micro_batches={self.spec.micro_batches}: the step that reaches it will stop with "
                "an error. Set drop_last=True on the training loader (evaluation loaders may keep a ragged last batch).")
        if trainer.training and trainer.fit_loop.restarting:
            return skip_consumed_batches(dataloader, trainer.fit_loop.epoch_loop.batch_progress.current.processed)
        return dataloader

    # ---- steps ---------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.runner is not None
        module = self.lightning_module
        self._job.progress(module.trainer.global_step)
        inputs, target = module.pipeline_inputs(args[0])
        if target is None and getattr(type(module), "pipeline_inputs", None) is PipelineHooks.pipeline_inputs:
            raise ValueError(f"a training batch of {type(module).__name__} holds inputs only: strategy='bfpp' trains on "
                             "(inputs, target) batches (pipeline_loss(output, target)); return both from the training "
                             "loader, or define pipeline_inputs(batch) -> (inputs, target).")
        params = [p for p in module.parameters() if p.requires_grad]
        train_metrics = getattr(module, "pipeline_train_metrics", None)
        # Lightning zeroes grads between training_step and backward: park the fresh ones until backward.
        self.measured_step = measure = measure_now(module.trainer, self.measure_every_n_steps)
        if measure or self._check_batch:
            self._same_batch((inputs, target), "training")
        with self._handover.capture(params):
            with self.precision_plugin.train_step_context():
                loss, outputs = self.runner.train_step(inputs, target, keep_outputs=callable(train_metrics), measure=measure)
            if self.tied:
                self.tied.sum_gradients()
            if self.tensor_parallel > 1:
                grads_like_params(params)
        loss = share_from_ranks(loss, self.data_parallel * self.tensor_parallel, self.root_device)  # last-stage ranks
        if measure:
            self.step_stats = step_stats(self.runner, params, self._handover.grads(), self.optimizers, self.root_device)
        module.log("train_loss", loss, prog_bar=True, batch_size=_batch_size(inputs))
        if callable(train_metrics):
            with torch.no_grad():
                self._run_user_step(lambda: train_metrics(outputs, target))
        if torch.isfinite(loss):
            self.nonfinite.finite()
            return loss
        # the shared loss: every rank takes this branch together, before the optimizer step
        trainer, batch_idx = module.trainer, args[1] if len(args) > 1 else None
        warning = self.nonfinite.nonfinite(f"train_loss={loss.item()} at global step {trainer.global_step} (epoch "
                                           f"{trainer.current_epoch}, batch {batch_idx})")
        self._handover.drop()  # backward hands nothing over; parameters without gradients are not stepped
        module.log("skipped_batches", float(self.nonfinite.skipped), batch_size=1)
        rank_zero_warn(warning)
        return loss  # (Lightning refuses a None step output in distributed runs)

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

        def on_last_stage() -> Any:
            with self.last_stage_step():  # its barrier / broadcast over the ranks that run it
                return method()

        return run_on_last_stage(self.lightning_module, on_last_stage, self.runner.has_last_stage, pp_mesh.get_group(),
                                 self.spec.pipeline_parallel - 1, dp_mesh.get_group(), self.root_device)

    def _same_batch(self, batch: Any, where: str) -> None:
        """The first batch of every loop and each measured training step: the same on the ranks of a replica."""
        self._check_batch = False
        if self.spec.pipeline_parallel * self.tensor_parallel > 1:
            check_same_batch(batch, where, self.data_parallel, self.tensor_parallel, self.root_device)

    def _user_step(self, step: str, context, args: tuple, kwargs: dict) -> Any:
        assert self.runner is not None
        if self._check_batch:
            self._same_batch(kwargs.get("batch", args[0] if args else None), step.removesuffix("_step"))
        with context():
            return user_step(self.lightning_module, self.runner, step, args, kwargs, self._run_user_step)

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
