"""``BFPPStrategy``: the Lightning hooks, dispatching to the parts. Settings are checked (``layout.plan``), the mesh
is built, the model is cut into looped stages and sharded (``layout``), and the training and evaluation steps run the
pipeline schedule (``runtime``, ``adapter``); everything else (launchers, sampler, loops) is Lightning's
ModelParallelStrategy."""
from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

from . import checkpoint as ckpt
from ._private.lightning_api import (
    SubprocessScriptLauncher,
    check_precision_first,
    optimizers_to_device,
    process_group_timeout,
    set_module_device_mesh,
    skip_logged_value_moves_in_place,
    skip_per_hook_bookkeeping_in_place,
)
from .adapter.collectives import ReplicaCollectives
from .adapter.lightning_output import ParameterCount, adapt_lightning_output
from .adapter.loader import check_split, check_training_loader
from .adapter.precision import pipeline_precision
from .adapter.training import TrainingStep
from .adapter.user_steps import PipelineSteps
from .checkpoint.strategy_hooks import CheckpointHooks
from .contract.hooks import built_in_configure_model, check_callbacks, check_module, check_precision
from .contract.source_notes import announce_contract
from .job.guard import JobGuard, as_timeout, rendezvous
from .job.launcher import CheckingLauncher
from .job.preempt import SaveOnSignal, check_on_signal
from .job.resume import resume_training_loader
from .layout.auto import AutoLayout
from .layout.fsdp import check_shard_unit
from .layout.materialize import has_meta_tensors
from .layout.mesh import build_expert_mesh, build_mesh, forget_groups, parameter_mesh
from .layout.plan import LayoutPlan
from .layout.stages import cut, parallelize
from .layout.tensor_parallel import layer_plans
from .runtime.cuda_graphs import check_runtime_options
from .runtime.pipeline import PipelineRunner
from .runtime.reduce import clip_grad_norm_on_mesh
from .schedule import Schedule


class BFPPStrategy(PipelineSteps, ReplicaCollectives, CheckpointHooks, ModelParallelStrategy):
    """Breadth-first pipeline parallelism (looped stages) x FSDP data parallelism for Lightning. Every setting is
    checked before any process starts; docs/settings.md describes each in full.

    Args:
        layout: `"auto"` (or `AutoLayout(...)`): the planner picks `pipeline_parallel`, `loops`, `micro_batches`,
            `groups`, `schedule`, `sharding`, `reshard_after_forward` and the stage cut from this model's layers
            measured on this device, for this world and `global_batch_size`; any of those given is pinned. `None`: as
            given.
        global_batch_size: samples per optimizer step over all replicas (required by `layout="auto"`); the training
            loader must then yield `replica_batch_size` (global / data parallel) samples.
        pipeline_parallel: pipeline ranks `pp`; data parallel `dp = world_size / (pp·cp·tp)` (must divide). Default:
            every process but the tensor-, context- and expert-parallel ones is a pipeline rank (world / (tp·cp·ep);
            fewer when the model has fewer layers), printed at start.
        tensor_parallel: processes `tp` splitting every layer by the model's `pipeline_tp_plan`, innermost in the mesh,
            within one node.
        sequence_parallel: with tp > 1: activations between the split modules and across stages are each tp rank's 1/tp
            of the sequence; the sequence length must divide by tp. Default: off.
        expert_parallel: data-parallel ranks splitting each mixture-of-experts layer's experts (tokens dispatched by
            all-to-all); must divide data parallel and the experts.
        context_parallel: processes `cp` sharing every sequence: each holds 1/cp of it (chunks i and 2cp−1−i) through
            every layer and stage, and attention gathers the rest; the sequence length must divide by 2·cp.
        loops: stages per pipeline rank: `pp·loops` stages, stage `s` on rank `s % pp` (looped placement).
        micro_batches: micro-batches per optimizer step `m`, split from each data-parallel replica's batch (its size
            must be a multiple). Default: `pp`.
        schedule: `"breadth_first"`, `"depth_first"`, `"gpipe"`, `"1f1b"` or `"breadth_first_zb"`.
        groups: breadth_first (and breadth_first_zb) only: run the `m` micro-batches as `groups` sequential accumulation
            groups, which divides activation memory.
        sharding: `"full"`: FSDP2 (ZeRO-3) of every stage over its data-parallel group; `"none"`: replicated weights,
            gradients all-reduced.
        stage_layers: layers per stage, e.g. `[3, 2, 2, 3]`; `"auto"`: balanced by each layer's time measured at setup;
            `None`: balanced by parameter count.
        router_loss: a mixture of experts' load-balancing loss in a step: `"batch"` (the whole step's; gpipe,
            breadth_first with groups=1) or `"micro_batch"` (each micro-batch's own; any schedule). Default: `"batch"`
            where the schedule allows it, else `"micro_batch"`, printed at start.
        reshard_after_forward: free each stage's gathered weights between its forward and backward (gathered again
            before backward).
        shard_unit: the FSDP unit: `"stage"` (each stage one unit: one all-gather and one reduce-scatter per stage pass)
            or `"layer"` (each layer its own unit, gathered in order: a stage's first layer computes while the next
            ones' weights arrive).
        activation_checkpointing: recompute every layer of every local stage in backward instead of saving its
            activations.
        compile: `torch.compile` each pipeline layer of the local stages, in place, after tensor parallel and before
            FSDP (names kept); recompiles after step 2 are warned about.
        cross_step_overlap: right after each optimizer step the next step's first all-gathers start (FSDP-sharded
            stages; their weights stay gathered across the step boundary).
        cuda_graphs: on a GPU: each local stage's training forward and backward captured as CUDA graphs, one pair per
            micro-batch, and replayed after.
        nonfinite_loss: a NaN/inf training loss: `"stop"` (every rank raises before the optimizer step) or `"skip"`
            (that batch's gradients are dropped).
        max_consecutive_skips: with `"skip"`: more non-finite batches than this in a row stop the run.
        process_group_backend: as in `ModelParallelStrategy`: `gloo` on CPU, `nccl` on GPU by default.
        timeout: bound on every distributed wait (collectives, p2p, the store, in every process group bfpp creates): a
            `timedelta` or seconds. A rank that dies or fails ends the job long before.
        on_signal: SIGTERM, SIGINT and SLURM's requeue signal while training: `"save"`: every rank saves one checkpoint
            at the next step boundary they agree on, then the process exits 128 + N; `"exit"`: every process exits at
            once.
        signal_grace_s: the bound on that save: 25 s under torchrun and after SLURM's SIGTERM (their launchers kill 30 s
            after the signal), else 60 s.
        signal_checkpoint: where that checkpoint goes: Lightning's HPC checkpoint under SLURM or without a
            ModelCheckpoint, else `last.ckpt` in the ModelCheckpoint's folder.
        async_save: while fitting, a save copies the state to CPU memory and returns; the files are written in the
            background.
        trust_checkpoints: load checkpoint files with unrestricted unpickling (can run code from the file; also
            `BFPP_TRUST_CHECKPOINTS=1`). Off: only plain data and tensors load.
        measure_every_n_steps: when `step_stats` (bubble, times, bytes) are measured: `None` on Lightning's logging
            steps (`Trainer(log_every_n_steps=...)`) and the last step; `N` every N-th step; `0` never.

    Checkpoints are sharded folders (torch.distributed.checkpoint) keyed by the model's own parameter names; they load
    into any other layout; ``storage.names`` spells the settings storage errors name. See ``lightning_bfpp.checkpoint``.
    """

    # a model built on the meta device gets memory per stage in setup (CausalLM reads it)
    materializes_meta_stages = True

    strategy_name = "bfpp"

    def __init__(
        self,
        *,
        # the layout: how the model and the batch are split over the processes
        layout: Literal["auto"] | AutoLayout | None = None, global_batch_size: int | None = None,
        pipeline_parallel: int | None = None, tensor_parallel: int = 1, sequence_parallel: bool | None = None,
        expert_parallel: int = 1, context_parallel: int = 1, loops: int | None = None,
        micro_batches: int | None = None, schedule: str | None = None, groups: int | None = None,
        sharding: Literal["full", "none"] | None = None, stage_layers: Sequence[int] | Literal["auto"] | None = None,
        router_loss: Literal["batch", "micro_batch"] | None = None,
        # performance: what each step keeps, recomputes, compiles and overlaps
        reshard_after_forward: bool | None = None, shard_unit: Literal["stage", "layer"] = "stage",
        activation_checkpointing: bool = False, compile: bool = False,  # noqa: A002  (public argument name: BFPPStrategy(compile=True))
        cross_step_overlap: bool = False, cuda_graphs: bool = False,
        # the job: failures, waits, signals and checkpoints
        nonfinite_loss: Literal["stop", "skip"] = "stop", max_consecutive_skips: int = 5,
        process_group_backend: str | None = None, timeout: timedelta | float | None = default_pg_timeout,
        on_signal: Literal["save", "exit"] = "save", signal_grace_s: float | None = None,
        signal_checkpoint: str | Path | None = None, async_save: bool = False, trust_checkpoints: bool = False,
        # measurement
        measure_every_n_steps: int | None = None,
    ) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=True,
                         process_group_backend=process_group_backend, timeout=as_timeout(timeout))
        self._training = TrainingStep(measure_every_n_steps, nonfinite_loss, max_consecutive_skips)
        # the layout, checked now (before any process starts), then again with the world and the model
        self.plan = LayoutPlan(
            pipeline_parallel=pipeline_parallel, tensor_parallel=tensor_parallel, sequence_parallel=sequence_parallel,
            loops=loops, micro_batches=micro_batches, schedule=schedule, groups=groups, sharding=sharding,
            reshard_after_forward=reshard_after_forward, stage_layers=stage_layers, layout=layout,
            global_batch_size=global_batch_size, expert_parallel=expert_parallel, context_parallel=context_parallel,
            router_loss=router_loss)
        self._contract_announced = False
        self._check_batch = True  # the next batch is compared across the ranks of each replica (adapter.same_batch)
        self.activation_checkpointing, self.compile = bool(activation_checkpointing), bool(compile)
        self.cuda_graphs = bool(cuda_graphs)
        self._fsdp_mixed_precision = False  # bf16-mixed through FSDP2's MixedPrecisionPolicy (set in setup)
        self.runner: PipelineRunner | None = None
        self.stage_layer_names: list[list[str]] = []
        self.tied = None  # TiedWeights, once the model is cut
        self.param_order: list[str] = []  # the whole model's parameter names, in its order (before the cut)
        self._job = JobGuard()
        self.trust_checkpoints = bool(trust_checkpoints)
        check_on_signal(on_signal, signal_grace_s)
        self.on_signal, self.signal_grace_s, self.signal_checkpoint = on_signal, signal_grace_s, signal_checkpoint
        self.async_save, self.cross_step_overlap = bool(async_save), bool(cross_step_overlap)
        check_shard_unit(shard_unit, sharding)
        self.shard_unit = shard_unit
        self._saves = ckpt.BackgroundSaves()  # async_save: the save under way
        self.storage = ckpt.Storage()  # its saves' sizes; .names: how storage errors spell the settings (an app's keys)

    # ---- the layout (``self.plan``) ------------------------------------------------------------
    dims = property(lambda self: self.plan.dims)
    spec = property(lambda self: self.plan.dims.spec)
    pipeline_parallel = property(lambda self: self.plan.dims.pipeline_parallel)
    tensor_parallel = property(lambda self: self.plan.dims.tensor_parallel)
    expert_parallel = property(lambda self: self.plan.dims.expert_parallel)
    sequence_parallel = property(lambda self: self.plan.dims.sequence_parallel)
    context_parallel = property(lambda self: self.plan.dims.context_parallel)
    router_loss = property(lambda self: self.plan.router_loss_for(), doc="The router loss's definition in a step.")
    data_parallel = property(lambda self: self.plan.dims.data_parallel)
    sharding = property(lambda self: self.plan.dims.sharding)
    loops = property(lambda self: self.plan.dims.spec.loops)
    micro_batches = property(lambda self: self.plan.dims.spec.micro_batches)
    stage_layers = property(lambda self: self.plan.stage_layers)
    global_batch_size = property(lambda self: self.plan.global_batch_size)
    auto_layout = property(lambda self: self.plan.auto_layout)
    pinned = property(lambda self: self.plan.pinned)
    stage_times_s = property(lambda self: self.plan.stage_times_s, doc='stage_layers="auto": seconds per stage.')

    # ---- the training step (``adapter.training``) -------------------------------------------------
    measure_every_n_steps = property(lambda self: self._training.measure_every_n_steps)
    nonfinite = property(lambda self: self._training.nonfinite)
    step_stats = property(lambda self: self._training.step_stats, doc="The last measured step's numbers.")
    measured_step = property(lambda self: self._training.measured_step, doc="Whether the last step was measured.")

    replica_batch_size = property(lambda self: self.plan.replica_batch_size,
                                  doc="Samples each data-parallel replica's training loader yields per step "
                                      "(global_batch_size / data_parallel).")

    @property
    def schedule(self) -> Schedule:
        assert self.runner is not None, "the schedule is built in setup()"
        return self.runner.schedules["train"]

    def _set_world(self, world: int, num_layers: int | None = None) -> None:
        if line := self.plan.set_world(world, self.num_processes, num_layers):
            rank_zero_info(line)

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
        self._job.launcher = self.launcher  # a failed rendezvous (e.g. its port taken) still stops the child ranks
        rendezvous(self, self._setup_distributed)  # waits at least STARTUP_TIMEOUT for every process to start
        if self.auto_layout is not None and not self.plan.decided:  # the mesh, datamodule and samplers depend on it
            rank_zero_info(self.plan.decide(self.lightning_module, self.root_device, self.world_size,
                                            self.num_processes, self._precision))
        self._job.start(self.global_rank, self.world_size, self.cluster_environment, self.on_signal,
                        self.signal_grace_s)
        self._device_mesh = build_mesh(self.dims, self.root_device.type, process_group_timeout(self))
        assert self.lightning_module is not None
        set_module_device_mesh(self.lightning_module, self._device_mesh)

    def _check_before_launch(self, ckpt_path: str | None = None, trainer=None) -> None:
        module = self.lightning_module
        # once built, the model is cut
        if module is not None and self.runner is None and not built_in_configure_model(module):
            self.check_model(module)
        if trainer is not None:
            check_callbacks(trainer.callbacks)
            ckpt.check_save_dirs(trainer, self.signal_checkpoint, self.storage.names)  # writable
        ckpt.check_path(ckpt_path, trust=self.trust_checkpoints)  # exists, complete, plain data only

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Name the rank that failed first, on every rank (see ``job.guard``); a later run in this process builds
        new process groups (these may hold a broken collective)."""
        forget_groups()
        self._job.on_exception(exception)

    @override
    def teardown(self) -> None:
        self._saves.close()  # the save under way is written before anything ends
        self.runner is not None and self.runner.settle()  # (cross_step_overlap: gathers held across a step boundary)
        code = self._job.stop()  # after a stop signal: the job's code (128 + N)
        super().teardown()
        if code is not None:
            self._job.exit(code)

    @override
    def on_train_start(self) -> None:
        """The start of every loop (the validation, test and predict loops' hooks are this one)."""
        self._training.forget_parameters()
        self._job.claim_signals()  # Lightning installs its SIGTERM handler after setup_environment: the watchdog's
        self._check_batch = True  # go back on top; the loop's first batch is compared across a replica's ranks

    on_validation_start = on_test_start = on_predict_start = on_train_start

    # ---- model ---------------------------------------------------------------------------------
    @override
    def setup(self, trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        check_callbacks(trainer.callbacks)  # again on every rank: under torchrun/SLURM no launcher has checked it
        ckpt.check_save_dirs(trainer, self.signal_checkpoint, self.storage.names)
        if self.runner is None:
            self.check_model(module)
            self.runner = self._build_pipeline(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            skip_logged_value_moves_in_place()  # self.log's per-value walk when nothing moves (host cost per step)
            skip_per_hook_bookkeeping_in_place()  # Lightning's per-hook profiler range and signature reads (same)
            self.setup_optimizers(trainer)
            if self.on_signal == "save" and not any(isinstance(c, SaveOnSignal) for c in trainer.callbacks):
                trainer.callbacks.append(SaveOnSignal(self._job, self.signal_checkpoint))  # after the user's callbacks
            adapt_lightning_output(trainer.callbacks, self.model_count, self.dims, self.global_rank)  # summary, saves
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)
        # Lightning's plugin as a subclass (``adapter.precision``): the global norm, no autocast where FSDP2 casts
        clip = partial(clip_grad_norm_on_mesh, mesh=parameter_mesh(self.dims, self.device_mesh),
                       sharded=self.dims.sharded, tied=self.tied)
        self.precision_plugin = pipeline_precision(self.precision_plugin, clip, self._fsdp_mixed_precision,
                                                   self._training.before_optimizer_step,
                                                   self.runner.prefetch_next_step if self.cross_step_overlap else None)

    @property
    def _precision(self) -> str:
        return str(getattr(self.precision_plugin, "precision", "32-true"))

    def check_model(self, module) -> list[list[str]]:
        """Check `module` against these settings without changing it; return the layer names of every stage.

        Raises when a pipeline hook is missing, the module optimizes manually, the precision is fp16, or the
        layers cannot be cut into pipeline_parallel x loops stages (see ``layout.cut.plan_stages``). Lightning's
        launcher runs this in the launching process before it starts the others; ``setup`` runs it on every rank."""
        check_module(module, self._precision, getattr(self.precision_plugin, "scaler", None) is not None)
        layers = list(module.pipeline_layers())
        self._set_world(self.num_processes * self.num_nodes, len(layers))
        if not self._contract_announced:
            self._contract_announced = True
            announce_contract(module, self.spec.pipeline_parallel, self.spec.micro_batches)
        stages = self.plan.check_model(module, layers)
        if line := self.plan.router_loss_line(module):
            rank_zero_info(line)
        if self.compile or self.cuda_graphs:  # (the device is known once the Trainer has set the strategy up)
            check_runtime_options(self.root_device.type, self.dims, compile_layers=self.compile,
                                  cuda_graphs=self.cuda_graphs, activation_checkpointing=self.activation_checkpointing)
        return stages

    def _build_pipeline(self, module) -> PipelineRunner:
        layers = list(module.pipeline_layers())
        plans = (layer_plans(module, layers, self.tensor_parallel, self.sequence_parallel)
                 if self.tensor_parallel > 1 else {})
        on_meta = has_meta_tensors(module)  # the same on every rank: every process built the same model
        stage_layers = self.plan.stage_cut(module, layers, self.root_device, rank_zero_info)
        seed = self.broadcast(torch.initial_seed()) if on_meta else None  # rank 0's: one initialization for all
        self.param_order = [name for name, _ in module.named_parameters()]  # the whole model's (checkpoint.plain)
        self.model_count = ParameterCount.of(module)  # the whole model's (the model summary's totals)
        modules, self.stage_layer_names, self.tied = cut(module, layers, self.device_mesh, self.dims,
                                                         stage_layers=stage_layers, global_rank=self.global_rank,
                                                         timeout=process_group_timeout(self), device=self.root_device,
                                                         seed=seed)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        experts = build_expert_mesh(self.dims, self.device_mesh, self.root_device.type,
                                    process_group_timeout(self)) if self.expert_parallel > 1 else None
        self._fsdp_mixed_precision = parallelize(modules, self.device_mesh, self.dims, plans, self._precision,
                                                 activation_checkpointing=self.activation_checkpointing,
                                                 compile_layers=self.compile, expert_mesh=experts,
                                                 shard_unit=self.shard_unit)
        return PipelineRunner.on_mesh(self.plan.train_schedule, modules, device=self.root_device,
                                      mesh=self.device_mesh, loss_fn=module.pipeline_loss, dims=self.dims,
                                      compiled=self.compile, cuda_graphs=self.cuda_graphs, say=rank_zero_info,
                                      router_loss=self.plan.router_loss_for())

    # ---- data loaders (the checkpoint hooks: checkpoint.strategy_hooks) -------------------------
    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Check the loader against the layout (before the first step); on a mid-epoch resume start the training loader
        after the batches the checkpoint had trained on (`processed`: a ModelCheckpoint saving in on_train_batch_end
        has not yet counted its batch `completed`)."""
        check_split(dataloader, self.plan)
        trainer = self.lightning_module.trainer
        if not trainer.training:
            return dataloader
        check_training_loader(dataloader, self.plan, trainer)
        return resume_training_loader(dataloader, trainer.fit_loop)

    # ---- steps ---------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        assert self.runner is not None
        module = self.lightning_module
        self._job.progress(module.trainer.global_step)
        self._saves.raise_failure()  # a save that failed in the background stops the run at this step boundary

        def check_batch(batch: Any, measured: bool) -> None:
            if measured or self._check_batch:
                self._same_batch(batch, "training")

        return self._training.run(module, self.runner, args[0], args[1] if len(args) > 1 else None, dims=self.dims,
                                  device=self.root_device, tied=self.tied, optimizers=self.optimizers,
                                  step_context=self.precision_plugin.train_step_context, check_batch=check_batch,
                                  on_last_stage=self._run_user_step)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran backward; hand its gradients over where Lightning expects them."""
        module = self.lightning_module
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._training.hand_over(module.trainer.accumulate_grad_batches)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss


check_precision_first(BFPPStrategy, check_precision)  # Trainer(precision="16-mixed") names bf16-mixed, not 16-true
