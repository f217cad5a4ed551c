"""Layout="auto" — the layout (pipeline_parallel, loops, micro_batches, groups, schedule, sharding, stage cut)
picked by the planner (`sim.planner.search`) from this model's layers measured on this device (forward+backward
seconds, parameters, saved-activation bytes per sample) for the world size and one global batch; knobs the user
set stay pinned. Every rank measures, the times are min-reduced and rank 0's pick is broadcast: one decision."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..dims import LayoutError, ParallelDims, divisors
from ..schedule import LOOPED_SCHEDULES, SCHEDULES, ScheduleSpec
from ..sim import Cluster, Layers, SimOptions, WireBytes, build_costs, simulate
from ..sim.planner import DEFAULT_LOOPS, Candidate, Plan, candidate_schedule, search
from .layer_cost import _tensors, measure_layer_times, time_balanced_stage_layers

# the knobs layout="auto" chooses (BFPPStrategy's argument names); any the user sets is pinned
KNOBS = ("pipeline_parallel", "loops", "micro_batches", "groups", "schedule", "sharding", "reshard_after_forward")
RERANK = 8  # best plans re-simulated with the time-balanced cut (the cut that runs)


@dataclass(frozen=True)
class AutoLayout:
    """Settings of layout="auto" (``BFPPStrategy(layout=AutoLayout(...))``; "auto" is ``AutoLayout()``).

    sample: one micro-batch of ``pipeline_inputs`` to time the layers on (default: the module's
        ``example_input_array``, else the first batch of a DataLoader given to ``fit``; a datamodule's loader is not
        built yet when the layout is decided, since its batch depends on the layout).
    cluster: the planner's communication and memory numbers (``sim.Cluster``); default ``default_cluster``.
    repeats: timed passes over the layers (the fastest counts).
    """

    sample: Any = None
    cluster: Cluster | None = None
    repeats: int = 3


class _Measured:
    """The planner's model interface (``sim.planner.candidates``/``search``) over measured `Layers` (tp = 1)."""

    n_head = vocab = 1  # tensor parallel is not searched: tp=1 divides them
    n_experts = 0  # nor expert parallel (layout="auto" refuses expert_parallel > 1)

    def __init__(self, layers: Layers) -> None:
        self.measured = layers
        self.seq = layers.seq  # nor context parallel: cp=1 divides it

    def layer_expert_params(self, tensor_parallel: int = 1) -> list[int]:
        return [0] * len(self.measured)

    @property
    def num_layers(self) -> int:
        return len(self.measured)

    def layer_params(self, tensor_parallel: int = 1) -> list[int]:
        return list(self.measured.params)

    def layers(self, cluster: Cluster | None = None, tensor_parallel: int = 1,
               sequence_parallel: bool = False, context_parallel: int = 1) -> Layers:
        return self.measured


def default_cluster(device: torch.device, world: int, devices_per_node: int) -> Cluster:
    """This machine for the planner: memory per process from the device (CPU: RAM / local processes); links and
    per-action overheads from conf/cluster/cpu_2_calibrated.yaml (gloo on one host) or NVLink/InfiniBand-class
    GPU values. Compute comes from the measured layer times, not from these numbers."""
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        return Cluster(devices=devices_per_node, num_nodes=max(world // devices_per_node, 1), flops=1e14,
                       device_memory=memory, intra_bw=150e9, inter_bw=25e9, latency=1e-5, overhead=2e-5,
                       memory_reserve=3e9)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Cluster(devices=devices_per_node, num_nodes=max(world // devices_per_node, 1), flops=1e10,
                   device_memory=float(ram) / devices_per_node, intra_bw=1.587e9, inter_bw=1.587e9,
                   latency=9.8e-5, overhead=8.8e-4, collective_bw=3.7e8, grad_scale=2.6e-10, step_overhead=2e-3)


def _rows(value: Any) -> int:
    tensors = [value] if isinstance(value, torch.Tensor) else [v for v in value if isinstance(v, torch.Tensor)]
    return max(int(tensors[0].shape[0]), 1) if tensors and tensors[0].dim() else 1


def measure_layers(module: Any, layers: Sequence[nn.Module], inputs: Any, target: Any, device: torch.device,
                   repeats: int = 3, precision: str = "32-true") -> Layers:
    """`Layers` of this model per sample of `inputs` (one micro-batch): the fastest forward+backward seconds of
    each layer (split 1:2 into forward and backward), its parameters, the bytes it saves for backward
    (``saved_tensors_hooks``, parameters excluded) and the bytes of its parameter-owning modules' outputs (whose
    gradients zero bubble keeps from a micro-batch's input pass to its weight pass), so the planner scales them to
    any micro-batch size; what the step moves per weight, gradient and message element is `precision`'s
    (``sim.WireBytes.for_precision``)."""
    rows = _rows(inputs)
    owner = {p.data_ptr() for p in module.parameters()}
    saved, weight_outputs = [0.0] * len(layers), [0.0] * len(layers)
    current, sent = [-1], [0] * len(layers)  # the layer running; elements of its output (what a stage sends)

    def done(_m, _a, out, i: int) -> None:
        current[0] = -1
        sent[i] = max([t.numel() for t in ([out] if isinstance(out, torch.Tensor) else out)
                       if isinstance(t, torch.Tensor)] + [sent[i]])

    def weighted(_m, _a, out, i: int) -> None:
        if isinstance(out, (torch.Tensor, tuple, list)):
            weight_outputs[i] += sum(t.numel() * t.element_size() for t in _tensors(out) if t.requires_grad)

    hooks = [h for i, layer in enumerate(layers) for h in (
        layer.register_forward_pre_hook(lambda _m, _a, i=i: current.__setitem__(0, i)),
        layer.register_forward_hook(lambda m, a, out, i=i: done(m, a, out, i)))]
    hooks += [m.register_forward_hook(lambda m, a, out, i=i: weighted(m, a, out, i))
              for i, layer in enumerate(layers) for m in layer.modules()
              if next(m.parameters(recurse=False), None) is not None]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if current[0] >= 0 and t.data_ptr() not in owner:
            saved[current[0]] += t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            times = measure_layer_times(module, layers, inputs, target, module.pipeline_loss, device, repeats=repeats)
    finally:
        for h in hooks:
            h.remove()
    passes = 1 + repeats  # measure_layer_times: one warm-up pass, then `repeats`
    first = inputs if isinstance(inputs, torch.Tensor) else next(v for v in inputs if isinstance(v, torch.Tensor))
    seq = int(first.shape[1]) if first.dim() > 1 else 1
    width = max(max(sent[:-1] or [1]) // rows // seq, 1)  # elements per token crossing a stage boundary
    return Layers(params=tuple(sum(p.numel() for p in layer.parameters()) for layer in layers),
                  forward_flops=(0.0,) * len(layers),
                  activation_bytes=tuple(b / passes / rows for b in saved),
                  seq=seq, width=width,
                  times=tuple((t / rows / 3, 2 * t / rows / 3) for t in times), wire=WireBytes.for_precision(precision),
                  weight_grad_bytes=tuple(b / passes / rows for b in weight_outputs))


def _matches(c: Candidate, pinned: Mapping[str, Any]) -> bool:
    return all(getattr(c, k) == v for k, v in pinned.items())


def _with_cut(model: _Measured, cluster: Cluster, p: Plan, options: SimOptions) -> tuple[Plan, list[int]]:
    """`p` re-simulated with the stages cut by measured time (what runs), and that cut."""
    c = p.candidate
    times = [f + b for f, b in model.measured.times or ()]
    cut = time_balanced_stage_layers(times, c.pipeline_parallel * c.loops)
    costs = build_costs(model.measured, cluster, pipeline_parallel=c.pipeline_parallel, loops=c.loops,
                        data_parallel=c.data_parallel, micro_batch_size=c.micro_batch_size,
                        micro_batches=c.micro_batches, sharding=c.sharding, stage_layers=cut)
    r = simulate(candidate_schedule(c), costs, options)
    fits = r.peak_memory <= cluster.usable_memory
    return Plan(c, r.tokens_per_second_per_device, r.step_time, r.peak_memory, fits), cut


def _with_loops(schedules: Sequence[str], loops: int) -> list[str]:
    """The schedules of `schedules` that run `loops` stages per rank (only looped ones run more than one): the
    search's best plans must be of the cut's length, not only its unpruned tail."""
    return [s for s in schedules if loops == 1 or s in LOOPED_SCHEDULES]


def plan_layout(layers: Layers, cluster: Cluster, world: int, global_batch: int, pinned: Mapping[str, Any],
                *, blocking_reduce: bool = True, stage_count: int | None = None) -> list[tuple[Plan, list[int]]]:
    """Legal fitting layouts of `layers` on `cluster` for `global_batch`, fastest first, each with its time-balanced
    cut; every one keeps `pinned` (knob -> value) and passes ``ParallelDims.validate``. `stage_count`: an explicit
    stage_layers list's length (pp x loops must equal it). Raises LayoutError when none is left."""
    unknown = set(pinned) - set(KNOBS)
    if unknown:
        raise ValueError(f"layout='auto' cannot pin {sorted(unknown)}; pinnable: {', '.join(KNOBS)}.")
    model, options = _Measured(layers), SimOptions(blocking_reduce=blocking_reduce)
    pp = pinned.get("pipeline_parallel")
    space = dict(schedules=[pinned["schedule"]] if "schedule" in pinned else list(SCHEDULES),
                 loops=[pinned["loops"]] if "loops" in pinned else list(DEFAULT_LOOPS),
                 shardings=[pinned["sharding"]] if "sharding" in pinned else ["full", "none"],
                 min_pipeline_parallel=pp or 1, max_pipeline_parallel=pp, tensor_parallels=(1,), residencies=("step",))
    # pinned memory-for-speed knobs or micro-batch counts: no pruning (the pinned variants must be simulated)
    exhaustive = bool({"micro_batches", "groups", "reshard_after_forward"} & set(pinned))
    if stage_count:  # an explicit cut's length: one search per pp x loops = stage_count (pinned knobs kept)
        spaces = [{**space, "min_pipeline_parallel": d, "max_pipeline_parallel": d, "loops": [stage_count // d],
                   "schedules": _with_loops(space["schedules"], stage_count // d)}
                  for d in divisors(stage_count)
                  if (pp or d) == d and pinned.get("loops", stage_count // d) == stage_count // d
                  and _with_loops(space["schedules"], stage_count // d)]
    else:
        spaces = [space]
    plans = sorted((p for sp in spaces for p in search(model, cluster, global_batch, options=options, top=RERANK,
                                                       include_unfit=exhaustive, **sp)),
                   key=lambda p: -p.tokens_per_second_per_device)
    legal = []
    for p in plans:
        c = p.candidate
        if not p.fits or not _matches(c, pinned) or (stage_count and c.pipeline_parallel * c.loops != stage_count):
            continue
        ParallelDims(world=world, spec=c.spec(), sharding=c.sharding).validate(num_layers=len(layers),
                                                                               global_batch=global_batch)
        legal.append(p)
    if not legal:
        shown = ", ".join(f"{k}={v!r}" for k, v in pinned.items()) or "nothing pinned"
        raise LayoutError(
            f"layout='auto' found no layout of {len(layers)} layers on {world} processes for global_batch_size="
            f"{global_batch} that keeps {shown} and fits in {cluster.usable_memory / 1e9:.1f} GB per process; unpin a "
            "knob, change global_batch_size (it must split over data_parallel x micro_batches), or set the layout by "
            "hand.")
    ranked = [_with_cut(model, cluster, p, options) for p in legal[:RERANK]]
    ranked = [r for r in ranked if r[0].fits] or ranked
    ranked.sort(key=lambda r: (-round(r[0].tokens_per_second_per_device, 6), r[0].peak_memory))
    return ranked


def describe(c: Candidate) -> str:
    groups = f", groups={c.groups}" if c.groups > 1 else ""
    raf = ", reshard_after_forward=True" if c.reshard_after_forward else ""
    return (f"schedule={c.schedule}, pipeline_parallel={c.pipeline_parallel}, data_parallel={c.data_parallel}, "
            f"loops={c.loops}, micro_batches={c.micro_batches} x {c.micro_batch_size}{groups}, "
            f"sharding={c.sharding}{raf}")


def report(ranked: Sequence[tuple[Plan, list[int]]], pinned: Mapping[str, Any]) -> str:
    """The pick and the runner-up, with predicted step time and peak memory per process."""
    def line(p: Plan, cut: list[int]) -> str:
        return f"{describe(p.candidate)}, stage_layers={cut}: predicted step {p.step_time * 1e3:.1f} ms, " \
               f"peak memory {p.peak_memory / 1e6:.3g} MB"

    pins = ", ".join(f"{k}={v!r}" for k, v in pinned.items()) or "none"
    out = f"bfpp: layout='auto' (pinned: {pins}) picked {line(*ranked[0])}"
    runner_up = next((r for r in ranked[1:] if not _twin(r[0], ranked[0][0])), None)
    return out + (f"; runner-up {line(*runner_up)}." if runner_up else "; no runner-up with another prediction.")


def _twin(a: Plan, b: Plan) -> bool:
    """The same prediction (e.g. one micro-batch under two schedule names): not a runner-up worth naming."""
    return round(a.step_time, 9) == round(b.step_time, 9) and round(a.peak_memory) == round(b.peak_memory)


def sample_inputs(module: Any, sample: Any = None) -> tuple[Any, Any]:
    """(inputs, target) of one micro-batch to time the layers on: `sample` (inputs), else the module's
    ``example_input_array``, else the first batch of a DataLoader given to ``fit`` (through ``pipeline_inputs``)."""
    from torch.utils.data import DataLoader

    if sample is None:
        sample = getattr(module, "example_input_array", None)
    if sample is not None:
        return sample, None
    from .._private.lightning_api import train_data_source

    loader = getattr(train_data_source(module.trainer), "instance", None)
    if isinstance(loader, DataLoader):
        return module.pipeline_inputs(next(iter(loader)))
    raise ValueError(
        f"layout='auto' times every layer before the data is set up (a datamodule's batch depends on the layout), "
        f"on {type(module).__name__}.example_input_array or the first batch of a DataLoader passed to fit(); there "
        "is neither: set example_input_array (one micro-batch of pipeline inputs), or "
        "BFPPStrategy(layout=AutoLayout(sample=...)), or set the layout by hand.")


def _same_everywhere(values: list[float], device: torch.device, op: str) -> list[float]:
    """`values` min-reduced (op="min") or broadcast from rank 0 (op="broadcast") over the default group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN) if op == "min" else dist.broadcast(t, src=0)
    return t.tolist()


def decide(module: Any, layers: Sequence[nn.Module], inputs: Any, target: Any, device: torch.device, *, world: int,
           devices_per_node: int, global_batch: int, pinned: Mapping[str, Any], settings: AutoLayout,
           stage_count: int | None = None, precision: str = "32-true") -> tuple[ScheduleSpec, str, list[int], str]:
    """The layout, identical on every rank: each rank measures, the per-layer numbers are min-reduced (the least
    disturbed sample), every rank plans, and rank 0's pick is broadcast. Returns (spec, sharding, cut, report)."""
    measured = measure_layers(module, layers, inputs, target, device, settings.repeats, precision)
    n = len(measured)
    flat = [t for fb in measured.times or () for t in fb] + list(measured.activation_bytes)
    flat = _same_everywhere(flat, device, "min")
    measured = dataclasses.replace(measured, times=tuple((flat[2 * i], flat[2 * i + 1]) for i in range(n)),
                                   activation_bytes=tuple(flat[2 * n:]))
    cluster = settings.cluster or default_cluster(device, world, devices_per_node)
    ranked = plan_layout(measured, cluster, world, global_batch, pinned, blocking_reduce=device.type == "cpu",
                         stage_count=stage_count)
    (_, cut), c = ranked[0], ranked[0][0].candidate
    code = [float(SCHEDULES.index(c.schedule)), c.pipeline_parallel, c.loops, c.micro_batches, c.groups,
            float(c.sharding == "full"), float(c.reshard_after_forward), *cut, *[0] * (n - len(cut))]
    code = [int(round(v)) for v in _same_everywhere(code, device, "broadcast")]  # fixed length: n + 7
    spec = ScheduleSpec(SCHEDULES[code[0]], pipeline_parallel=code[1], loops=code[2], micro_batches=code[3],
                        groups=code[4], reshard_after_forward=bool(code[6]))
    return spec, "full" if code[5] else "none", [k for k in code[7:] if k], report(ranked, pinned)
