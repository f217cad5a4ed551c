"""Gantt picture of one training step — one compute lane per pipeline rank (colour per stage, forward light, backward
(or its input part I) dark and hatched, weight part W dotted, micro-batch numbers in the boxes) and a thin comm lane
under it (FSDP all-gather, gradient reduction, p2p sends). Times come from the simulator's timeline."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..schedule import ScheduleSpec, build_schedule
from .cost import unit_costs
from .simulate import SimOptions, SimResult, evaluate


def draw_schedule(spec_or_timeline, path: str | Path, *, costs=None, options=None, title: str | None = None,
                  num_stages: int | None = None) -> Path:
    """Render a step to a PNG.

    Args:
        spec_or_timeline: a ScheduleSpec (simulated with `costs`, default unit costs F=1, B=2 and
            visible FSDP comm), a `sim.SimResult`, or a list of `sim.Event`.
        path: output PNG file.
        costs: a `sim.Costs` for the spec (e.g. from `sim.build_costs`); `options`: `sim.SimOptions`.
    """
    stats = ""
    if isinstance(spec_or_timeline, ScheduleSpec):
        spec_or_timeline = planned_step(spec_or_timeline, costs, options)
    if isinstance(spec_or_timeline, SimResult):
        result = spec_or_timeline
        num_stages = num_stages or result.schedule.spec.num_stages
        title = title or _spec_title(result.schedule.spec)
        # the simulator's plan, not a measurement (a training run measures its own: PipelineMetrics' bubble_fraction)
        stats = f"planned (simulated): step {result.step_time:.4g}   bubble {result.bubble:.3f}"
        if result.pipeline_bubble is not None:
            stats += f" (pipeline {result.pipeline_bubble:.3f}, exposed comm {result.exposed_comm:.4g})"
        events = result.timeline
    else:
        events = list(spec_or_timeline)
    return _render(events, Path(path), title or "schedule", stats, num_stages)


def planned_step(spec: ScheduleSpec, costs=None, options=None) -> SimResult:
    """One step of `spec` as the simulator plans it: with `costs` (default: unit costs, forward 1, backward 2, FSDP
    gathers and reductions 0.5, p2p 0.1) and `options` (default ``SimOptions()``)."""
    if costs is None:
        costs = unit_costs(spec.num_stages, spec.pipeline_parallel, unshard=0.5, reduce=0.5, p2p=0.1)
    return evaluate(build_schedule(spec), costs, options or SimOptions())


def _spec_title(spec: ScheduleSpec) -> str:
    extra = f", groups={spec.groups}" if spec.groups > 1 else ""
    extra += ", reshard_after_forward" if spec.reshard_after_forward else ""
    return f"{spec.name}: pp={spec.pipeline_parallel}, loops={spec.loops}, micro_batches={spec.micro_batches}{extra}"


def _render(events: Sequence, path: Path, title: str, stats: str, num_stages: int | None) -> Path:
    if not events:
        raise ValueError("nothing to draw: the timeline is empty (record it with simulate(..., timeline=True)).")
    return _figure([(events, title + (f"\n{stats}" if stats else ""))], path, num_stages)


def draw_measured(measured: Sequence, planned: SimResult, path: str | Path, *, title: str = "",
                  num_stages: int | None = None) -> Path:
    """The planned step (`planned`, e.g. the schedule simulated with the stage times measured) above the measured one
    (`measured`: `Event`s of every rank, seconds from the step's start), on one time axis, to a PNG."""
    if not measured:
        raise ValueError("nothing to draw: the measured timeline is empty.")
    spec = planned.schedule.spec
    end = max(e.end for e in measured)
    busy = sum(e.end - e.start for e in measured if e.kind in "FBIW")
    ranks = len({e.rank for e in measured})
    panels = [(planned.timeline, f"planned: {_spec_title(spec)}\nstep {planned.step_time:.4g} s   bubble "
                                 f"{planned.bubble:.3f}"),
              (measured, f"measured{': ' + title if title else ''}\nstep {end:.4g} s   bubble "
                         f"{(ranks * end - busy) / busy if busy else 0.0:.3f}")]
    return _figure(panels, Path(path), num_stages or spec.num_stages)


def _figure(panels: Sequence[tuple[Sequence, str]], path: Path, num_stages: int | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = max(len({e.rank for e in events}) for events, _ in panels)
    end = max(e.end for events, _ in panels for e in events)
    computes = max(sum(1 for e in events if e.kind in "FBIW") for events, _ in panels)
    width = min(max(8.0, 0.25 * computes / max(ranks, 1)), 40.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, len(panels) * (1.0 + 0.9 * ranks)), squeeze=False)
    n_stages = num_stages or (max(e.stage for events, _ in panels for e in events) + 1)
    for ax, (events, title) in zip(axes[:, 0], panels):
        _lanes(ax, events, n_stages, end)
        ax.set_title(title, fontsize=10)
    _legend(axes[0, 0], n_stages)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _colours(n_stages: int):
    import matplotlib.pyplot as plt

    return plt.get_cmap("tab10" if n_stages <= 10 else "tab20")


def _lanes(ax, events: Sequence, n_stages: int, end: float) -> None:
    """One compute lane per rank and a thin comm lane under it, on `ax`."""
    ranks = sorted({e.rank for e in events})
    cmap = _colours(n_stages)
    lane, comm_h = 0.55, 0.3  # heights of the compute box and of a comm bar
    comm_style = {"UNSHARD": ("#3b7dd8", 0), "REDUCE": ("#d8563b", 1), "SEND_F": ("#888888", 2),
                  "SEND_B": ("#888888", 2)}
    for e in events:
        y = (len(ranks) - 1 - ranks.index(e.rank)) * 1.0
        if e.kind in ("F", "B", "I", "W"):
            colour = cmap(e.stage % cmap.N)
            fwd = e.kind == "F"
            hatch = {"F": None, "B": "//", "I": "//", "W": ".."}[e.kind]
            ax.barh(y + 0.2, e.end - e.start, left=e.start, height=lane, color=colour, alpha=0.55 if fwd else 1.0,
                    edgecolor="black", linewidth=0.5, hatch=hatch)
            if e.end - e.start > end / 150:
                ax.text((e.start + e.end) / 2, y + 0.2, str(e.micro_batch), ha="center", va="center", fontsize=7,
                        color="black",
                        bbox=None if fwd else dict(boxstyle="square,pad=0.05", fc="white", lw=0, alpha=0.7))
        elif e.kind in comm_style:
            colour, row = comm_style[e.kind]
            ax.barh(y - 0.16 - row * 0.13, e.end - e.start, left=e.start, height=comm_h / 2.6, color=colour,
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks([(len(ranks) - 1 - i) * 1.0 for i in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.set_xlim(0, end * 1.01)
    ax.set_ylim(-0.6, len(ranks) - 0.4)
    ax.set_xlabel("time")


def _legend(ax, n_stages: int) -> None:
    from matplotlib.patches import Patch

    cmap = _colours(n_stages)
    handles = [Patch(facecolor=cmap(s % cmap.N), label=f"stage {s}") for s in range(min(n_stages, 20))]
    handles += [Patch(facecolor="white", edgecolor="black", label="forward (light)"),
                Patch(facecolor="white", edgecolor="black", hatch="//", label="backward (dark, hatched)"),
                Patch(facecolor="white", edgecolor="black", hatch="..", label="weight gradient W (dotted)"),
                Patch(facecolor="#3b7dd8", label="all-gather (FSDP)"), Patch(facecolor="#d8563b", label="grad reduce"),
                Patch(facecolor="#888888", label="p2p send")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
