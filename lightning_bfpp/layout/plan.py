"""The strategy's layout as it gets decided — the settings as given (checked before any process starts), then
the world size, then the model's layer count and, for layout="auto", the planner's pick — each step checked by the
one set of rules in ``dims``; the training schedule built for it."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..contract.hooks import built_in_configure_model
from ..contract.router_loss import ROUTER_LOSSES
from ..dims import Names, ParallelDims, default_pipeline_parallel
from ..schedule import Schedule, ScheduleSpec, build_schedule
from ..schedule.checks import is_count
from .auto import KNOBS, AutoLayout, decide, sample_inputs
from .context_parallel import check_context_parallel
from .cut import check_stage_layers, plan_stages
from .experts import check_experts
from .layer_cost import auto_stage_layers
from .materialize import has_meta_tensors
from .tensor_parallel import layer_plans

BATCH_NAMES = Names(batch="global_batch_size")


# What a layout setting left at None means when the layout is not planned (layout="auto" plans these instead):
# the one source of these defaults (docs/settings.md's table and conf/schedule/base.yaml are checked against it by
# tests/test_settings_docs.py). pipeline_parallel and micro_batches depend on the world and pp (`__init__`).
UNGIVEN_DEFAULTS: dict[str, Any] = {"schedule": "breadth_first", "loops": 1, "groups": 1, "sharding": "full",
                                    "reshard_after_forward": False, "sequence_parallel": False}


def _given(name: str, value: Any) -> Any:
    """``value`` as given, or the setting's default where it is None (not given; 0, "" and the like are checked as
    given)."""
    return UNGIVEN_DEFAULTS[name] if value is None else value


class LayoutPlan:
    """pipeline_parallel, loops, micro_batches, schedule, sharding and the stage cut of a BFPPStrategy (its
    arguments of the same names; see ``BFPPStrategy``)."""

    def __init__(self, *, pipeline_parallel: int | None, tensor_parallel: int, sequence_parallel: bool | None,
                 loops: int | None,
                 micro_batches: int | None, schedule: str | None, groups: int | None, sharding: str | None,
                 reshard_after_forward: bool | None, stage_layers: Sequence[int] | Literal["auto"] | None,
                 layout: Literal["auto"] | AutoLayout | None, global_batch_size: int | None,
                 expert_parallel: int = 1, context_parallel: int = 1, router_loss: str | None = None) -> None:
        given = dict(pipeline_parallel=pipeline_parallel, loops=loops, micro_batches=micro_batches, groups=groups,
                     schedule=schedule, sharding=sharding, reshard_after_forward=reshard_after_forward)
        self.auto_layout = AutoLayout() if layout == "auto" else layout  # decided once the world is up (`decide`)
        if self.auto_layout is not None and not isinstance(self.auto_layout, AutoLayout):
            raise ValueError(f"layout={layout!r} must be 'auto', an AutoLayout(...) or None (the knobs as given).")
        self.pinned = {k: given[k] for k in KNOBS if given[k] is not None} if self.auto_layout else {}
        if (self.auto_layout or global_batch_size is not None) and not is_count(global_batch_size):
            raise ValueError(f"global_batch_size={global_batch_size!r} must be a positive integer, the samples per "
                             "optimizer step over all replicas (layout='auto' needs global_batch_size: every candidate "
                             "layout trains that same batch, each replica loading global_batch_size / data_parallel, "
                             "strategy.replica_batch_size).")
        for name, value in (("tensor_parallel", tensor_parallel), ("expert_parallel", expert_parallel),
                            ("context_parallel", context_parallel)):
            if self.auto_layout and value != 1:
                raise ValueError(f"layout='auto' searches {name}=1 only; set the layout by hand for "
                                 f"{name}={value!r}.")
        if router_loss is not None and router_loss not in ROUTER_LOSSES:
            raise ValueError(f"router_loss={router_loss!r} must be 'batch' (the whole step's load-balancing loss, as "
                             "the model's aux_loss on the whole batch; gpipe, or breadth_first with groups=1), "
                             "'micro_batch' (each micro-batch's own; any schedule) or None (the one that fits the "
                             "schedule).")
        self.router_loss = router_loss  # None: the schedule's (`router_loss_for`)
        self.router_announced = False
        self.global_batch_size = global_batch_size
        self.decided = False  # layout="auto": decided in `decide`
        # pp = world size, decided once the world is known (layout="auto": the planner's)
        self.default_layout = pipeline_parallel is None and self.auto_layout is None
        self.requested_micro_batches = micro_batches
        self.announced = False
        self.stage_times_s: list[float] = []  # stage_layers="auto": measured seconds per stage (one micro-batch)
        pp = 1 if pipeline_parallel is None else pipeline_parallel
        m = micro_batches if micro_batches is not None else 1 if self.auto_layout else pp
        spec = ScheduleSpec(_given("schedule", schedule), pipeline_parallel=pp, loops=_given("loops", loops),
                            groups=_given("groups", groups), micro_batches=m,
                            reshard_after_forward=bool(_given("reshard_after_forward", reshard_after_forward)))
        sharding = _given("sharding", sharding)
        # Bad settings fail here, before any process starts: the layout's rules (``dims``) with the world
        # not yet known, and the schedule is generated and validated (dependencies, send/receive pairing, no
        # deadlock) now; this very schedule is what runs. The world and the model are checked once known.
        # the least world
        sizes = [s for s in (pp, tensor_parallel, expert_parallel, context_parallel) if isinstance(s, int)]
        self.dims = ParallelDims(world=math.prod(sizes), spec=spec, tensor_parallel=tensor_parallel,
                                 context_parallel=context_parallel, sharding=sharding,
                                 sequence_parallel=_given("sequence_parallel", sequence_parallel),
                                 expert_parallel=expert_parallel).validate()
        self.train_schedule: Schedule = build_schedule(spec)
        # one positive count per stage now; that they add up to the model's layers is checked with the model
        self.stage_layers = "auto" if stage_layers == "auto" else check_stage_layers(
            stage_layers, None, len(stage_layers) if self.auto_layout else spec.num_stages) if stage_layers else None

    @property
    def spec(self) -> ScheduleSpec:
        return self.dims.spec

    @property
    def undecided(self) -> bool:
        """Whether the stage cut is still to be decided (stage_layers="auto", or layout="auto" before `decide`)."""
        return self.stage_layers == "auto" or (self.auto_layout is not None and not self.decided)

    @property
    def replica_batch_size(self) -> int | None:
        """Samples each data-parallel replica's training loader yields per step (global_batch_size / data_parallel)."""
        return None if self.global_batch_size is None else self.dims.replica_batch(self.global_batch_size, BATCH_NAMES)

    def set_world(self, world: int, devices_per_node: int, num_layers: int | None = None) -> str | None:
        """The layout on `world` processes (`num_layers`: once the model is known), checked by its one set of rules.
        Without an explicit pipeline_parallel every process is a pipeline rank (``default_pipeline_parallel``).
        Returns the line announcing a default layout, once."""
        if not world:
            return None
        spec, tp, cp = self.spec, self.dims.tensor_parallel, self.dims.context_parallel
        if self.default_layout and world % (tp * cp) == 0:
            pp = default_pipeline_parallel(world, tp, spec.loops, num_layers, self.dims.expert_parallel, cp)
            m = self.requested_micro_batches if self.requested_micro_batches is not None else pp
            spec = dataclasses.replace(spec, pipeline_parallel=pp, micro_batches=m)
        changed = spec != self.spec
        self.dims = dataclasses.replace(self.dims, world=world, devices_per_node=devices_per_node, spec=spec)
        undecided = self.auto_layout is not None and not self.decided  # the planner picks a layout the batch fits
        self.dims.validate(num_layers=num_layers, global_batch=None if undecided else self.global_batch_size,
                           names=BATCH_NAMES)
        if changed:
            self.train_schedule = build_schedule(spec)
            if self.stage_layers not in (None, "auto"):
                self.stage_layers = check_stage_layers(self.stage_layers, None, spec.num_stages)
        if not self.default_layout or num_layers is None or self.announced:
            return None
        self.announced = True
        return (f"bfpp: default layout on {world} processes: pipeline_parallel={spec.pipeline_parallel}, "
                f"data_parallel={self.dims.data_parallel}, tensor_parallel={tp}, "
                f"{f'expert_parallel={self.dims.expert_parallel}, ' if self.dims.expert_parallel > 1 else ''}"
                f"loops={spec.loops}, "
                f"{f'context_parallel={cp}, ' if cp > 1 else ''}loops={spec.loops}, "
                f"micro_batches={spec.micro_batches}, schedule={spec.name} (choose with "
                "BFPPStrategy(pipeline_parallel=..., loops=..., micro_batches=...)).")

    def check_model(self, module: Any, layers: list) -> list[list[str]]:
        """The layer names of every stage this layout cuts `module`'s `layers` into; raises when they cannot be cut
        (or timed, for stage_layers="auto"), or the model's tensor-parallel plan does not fit."""
        if self.stage_layers == "auto" and has_meta_tensors(module):
            raise ValueError("stage_layers='auto' times every layer by running it, and this model is on the meta "
                             "device: give the layers per stage, or let bfpp balance them by parameter count (None).")
        if getattr(module, "pipeline_uses_step_totals", False) and self.router_loss_for() == "batch" and \
                not self.train_schedule.forwards_first():
            spec = self.spec
            raise ValueError(
                f"router_loss='batch' trains {type(module).__name__}'s router loss over the whole step "
                f"(contract.router_loss: its gradient reads every micro-batch's routing), and schedule={spec.name!r} "
                f"(groups={spec.groups}) starts a backward before the step's last forward: use "
                "router_loss='micro_batch' (each micro-batch's own load-balancing loss), or schedule='breadth_first' "
                "with groups=1, or 'gpipe'.")
        stages = plan_stages(module, layers, self.spec.num_stages, None if self.undecided else self.stage_layers)
        if self.dims.tensor_parallel > 1:
            layer_plans(module, layers, self.dims.tensor_parallel, self.dims.sequence_parallel)  # the model's plan
        if self.dims.expert_parallel > 1:
            check_experts(module, self.dims.expert_parallel)
        if self.dims.context_parallel > 1:
            check_context_parallel(module, layers, self.dims.context_parallel)  # every layer runs on a shard
        return stages

    def router_loss_for(self) -> str:
        """The router loss's definition a training step uses (``contract.router_loss``): as given, else "batch" where
        the schedule runs every forward of a step before its first backward (gpipe, breadth-first in one group) and
        "micro_batch" where it does not."""
        if self.router_loss is not None:
            return self.router_loss
        return "batch" if self.train_schedule.forwards_first() else "micro_batch"

    def router_loss_line(self, module: Any) -> str | None:
        """The line announcing the default router loss of a model that has one, once (not before layout="auto" has
        decided the schedule)."""
        undecided = self.auto_layout is not None and not self.decided
        if self.router_loss is not None or self.router_announced or undecided or \
                not getattr(module, "pipeline_uses_step_totals", False):
            return None
        self.router_announced = True
        spec, chosen = self.spec, self.router_loss_for()
        why = ("runs every forward of a step before its first backward: the whole step's load-balancing loss, as the "
               "model's aux_loss on the whole batch" if chosen == "batch" else
               "starts a backward before the step's last forward: each micro-batch's own load-balancing loss, "
               "weighted by its counted items")
        return (f"bfpp: router_loss={chosen!r}: schedule={spec.name} (groups={spec.groups}) {why} (choose with "
                "BFPPStrategy(router_loss='batch' | 'micro_batch')).")

    def decide(self, module: Any, device: Any, world: int, devices_per_node: int, precision: str) -> str:
        """layout="auto" on every rank at once, the process group up: each rank measures the layers, the numbers are
        min-reduced and rank 0's pick is broadcast (``auto.decide``), so every rank builds the same mesh. Returns the
        line describing the pick."""
        where = "configure_model builds the layers" if built_in_configure_model(module) else \
            "the model is on the meta device" if has_meta_tensors(module) else None
        if where:
            raise ValueError(f"layout='auto' times the layers by running them, and {where}: give the layout "
                             "(pipeline_parallel, loops, ...), or build the model in memory.")
        layers = list(module.pipeline_layers())
        inputs, target = sample_inputs(module, self.auto_layout.sample)
        explicit = isinstance(self.stage_layers, list)
        spec, sharding, cut, line = decide(
            module, layers, inputs, target, device, world=world, devices_per_node=devices_per_node,
            global_batch=self.global_batch_size, pinned=self.pinned, settings=self.auto_layout,
            stage_count=len(self.stage_layers) if explicit else None, precision=precision)
        self.dims = dataclasses.replace(self.dims, spec=spec, sharding=sharding)
        self.train_schedule = build_schedule(spec)
        self.stage_layers = self.stage_layers if explicit else cut  # "auto"/None: cut by the measured times
        self.decided = True
        self.set_world(world, devices_per_node, len(layers))
        return line

    def stage_cut(self, module: Any, layers: list, device: Any, say: Callable[[str], Any]) -> Sequence[int] | None:
        """The layers per stage to cut: as given, None (balanced by parameter count), or for stage_layers="auto" cut
        by every layer's time measured now on `device` (kept in `stage_times_s`; the line describing it to `say`)."""
        if self.stage_layers != "auto":
            return self.stage_layers
        stage_layers, self.stage_times_s, line = auto_stage_layers(module, layers, self.spec.num_stages,
                                                                   self.spec.micro_batches, device)
        say(line)
        return stage_layers

    def checkpoint_meta(self, stage_layer_names: list[list[str]]) -> dict[str, Any]:
        """The layout a checkpoint was written with (its ``bfpp`` entry: informative; checkpoints load into any)."""
        spec = self.spec
        return {"schedule": spec.name, "pipeline_parallel": spec.pipeline_parallel, "loops": spec.loops,
                "data_parallel": self.dims.data_parallel, "tensor_parallel": self.dims.tensor_parallel,
                "expert_parallel": self.dims.expert_parallel,
                "context_parallel": self.dims.context_parallel,
                "stage_layers": stage_layer_names, "stage_times_s": self.stage_times_s}
