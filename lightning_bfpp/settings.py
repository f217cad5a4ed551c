"""BFPPStrategy's settings, each described once: its group, a summary and the manual's details.

Three texts are made from this table and held equal to it by ``tests/test_settings_docs.py``: the ``Args:`` section
of ``BFPPStrategy``'s docstring (the summaries: ``help()`` and docs/api.md), the settings tables of docs/settings.md
(one per group; summary, then details) and the comments of conf/schedule/base.yaml (the summaries of the keys the
app sets). ``python -m lightning_bfpp.settings`` lists the settings (``--markdown``: the docs' tables); ``--write``
rewrites the three from it. The names and defaults themselves are the signature's (``BFPPStrategy.__init__``); the
test holds this table to it. A module of the package's top: nothing in the package imports it; it imports the
strategy for the defaults.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

GROUPS = ("layout", "performance", "job", "measurement")
GROUP_TITLES = {"layout": "The layout: how the model and the batch are split over the processes",
                "performance": "Performance: what each step keeps, recomputes, compiles and overlaps",
                "job": "The job: failures, waits, signals and checkpoints", "measurement": "Measurement"}


@dataclass(frozen=True)
class Setting:
    """One ``BFPPStrategy`` argument. `summary`: what it does, in a sentence or two (markdown; the docstring and the
    app's comments). `details`: what the manual adds after the summary. `default`: the manual's default cell where
    it is not the signature's literal ("world size", "see meaning"); empty: the literal."""

    name: str
    group: str
    summary: str
    details: str = ""
    default: str = ""


def _s(group: str, name: str, summary: str, details: str = "", default: str = "") -> Setting:
    return Setting(name, group, " ".join(summary.split()), " ".join(details.split()), default)


L, P, J, M = GROUPS
SETTINGS: tuple[Setting, ...] = (
    # the layout: how the model and the batch are split over the processes
    _s(L, "layout", """`"auto"` (or `AutoLayout(...)`): the planner picks `pipeline_parallel`, `loops`, `micro_batches`,
       `groups`, `schedule`, `sharding`, `reshard_after_forward` and the stage cut from this model's layers measured on
       this device, for this world and `global_batch_size`; any of those given is pinned. `None`: as given.""",
       "See [Automatic layout](#automatic-layout)."),
    _s(L, "global_batch_size", """samples per optimizer step over all replicas (required by `layout="auto"`); the
       training loader must then yield `replica_batch_size` (global / data parallel) samples.""",
       "Checked before the first step."),
    _s(L, "pipeline_parallel", """pipeline ranks `pp`; data parallel `dp = world_size / (pp·cp·tp)` (must divide).
       Default: every process but the tensor-, context- and expert-parallel ones is a pipeline rank
       (world / (tp·cp·ep); fewer when the model has fewer layers), printed at start.""",
       default="world size"),
    _s(L, "tensor_parallel", """processes `tp` splitting every layer by the model's `pipeline_tp_plan`, innermost in
       the mesh, within one node.""",
       """See [Tensor parallel](tensor_parallel.md): mesh (pp, dp, tp), `dp = world_size / (pp·tp)`; tp must divide the
       devices per node."""),
    _s(L, "sequence_parallel", """with tp > 1: activations between the split modules and across stages are each tp
       rank's 1/tp of the sequence; the sequence length must divide by tp. Default: off.""",
       "See [Sequence parallel](tensor_parallel.md#sequence-parallel); off by default: slower on CPU."),
    _s(L, "expert_parallel", """data-parallel ranks splitting each mixture-of-experts layer's experts (tokens
       dispatched by all-to-all); must divide data parallel and the experts.""",
       """See [Mixtures of experts](mixture_of_experts.md). With `context_parallel > 1` (or `tensor_parallel > 1`) an
       expert-parallel group is the ranks at one context-parallel (tensor-parallel) coordinate; not with
       `tensor_parallel > 1` and `context_parallel > 1` together, `sharding="none"` or `layout="auto"`."""),
    _s(L, "context_parallel", """processes `cp` sharing every sequence: each holds 1/cp of it (chunks i and 2cp−1−i)
       through every layer and stage, and attention gathers the rest; the sequence length must divide by 2·cp.""",
       """See [Context parallel](context_parallel.md): mesh (pp, dp, cp, tp), `dp = world_size / (pp·cp·tp)`; the model
       says which layers run on a shard (`pipeline_context_parallel`; `CausalLM` and the example GPT do)."""),
    _s(L, "loops", "stages per pipeline rank: `pp·loops` stages, stage `s` on rank `s % pp` (looped placement)."),
    _s(L, "micro_batches", """micro-batches per optimizer step `m`, split from each data-parallel replica's batch (its
       size must be a multiple). Default: `pp`.""", default="`pp`"),
    _s(L, "schedule", """`"breadth_first"`, `"depth_first"`, `"gpipe"`, `"1f1b"` or `"breadth_first_zb"`.""",
       "See [Schedules](schedules.md)."),
    _s(L, "groups", """breadth_first (and breadth_first_zb) only: run the `m` micro-batches as `groups` sequential
       accumulation groups, which divides activation memory."""),
    _s(L, "sharding", """`"full"`: FSDP2 (ZeRO-3) of every stage over its data-parallel group; `"none"`: replicated
       weights, gradients all-reduced.""",
       """Under `"none"` each stage's gradients are all-reduced in 25 MiB buckets, asynchronously, from its last
       backward on (overlapping the remaining backward)."""),
    _s(L, "stage_layers", """layers per stage, e.g. `[3, 2, 2, 3]`; `"auto"`: balanced by each layer's time measured
       at setup; `None`: balanced by parameter count.""",
       """`"auto"`: at setup every rank times every layer's forward+backward (last layer with `pipeline_loss`;
       fastest of 5 passes) on one micro-batch of the training data (or `example_input_array`), the minimum over ranks
       is taken, and every rank cuts to minimise the slowest stage; the cut, the parameter cut and per-stage
       milliseconds are logged, `strategy.stage_times_s` and the checkpoint meta keep them. Not the default: on the
       example GPT it picks the parameter cut ([BENCHMARKS.md](benchmarks.md#stage-cut-by-time-stage_layersauto)) and
       timing noise could change the cut between runs."""),
    _s(L, "router_loss", """a mixture of experts' load-balancing loss in a step: `"batch"` (the whole step's; gpipe,
       breadth_first with groups=1) or `"micro_batch"` (each micro-batch's own; any schedule). Default: `"batch"`
       where the schedule allows it, else `"micro_batch"`, printed at start.""",
       """See [the router loss](mixture_of_experts.md#the-router-loss-batch-or-micro_batch): `"batch"` is the model's
       own `aux_loss` on the whole batch (its gradient reads every micro-batch's routing); `"micro_batch"` weighs each
       micro-batch's loss by its counted targets. `"batch"` under a schedule that starts a backward before the
       step's last forward is refused, naming `router_loss="micro_batch"`. Printed as `bfpp: router_loss=...`.""",
       default="see meaning"),
    # performance: what each step keeps, recomputes, compiles and overlaps
    _s(P, "reshard_after_forward", """free each stage's gathered weights between its forward and backward (gathered
       again before backward)."""),
    _s(P, "shard_unit", """the FSDP unit: `"stage"` (each stage one unit: one all-gather and one reduce-scatter per
       stage pass) or `"layer"` (each layer its own unit, gathered in order: a stage's first layer computes while the
       next ones' weights arrive).""",
       """As torchtitan does per block. Same memory as `"stage"` (the whole stage is gathered for its pass either
       way), one collective per layer (each with its latency). Exact under every schedule. Refused with
       `sharding="none"`. Where it helps: stages of several big layers on slow links; the simulator and the planner
       (`search(shard_units=("stage", "layer"))`) say when ([Paper
       reproduction](paper_reproduction.md#fsdp-units-per-layer))."""),
    _s(P, "activation_checkpointing", """recompute every layer of every local stage in backward instead of saving its
       activations.""", "See [Precision and memory](precision.md)."),
    _s(P, "compile", """`torch.compile` each pipeline layer of the local stages, in place, after tensor parallel and
       before FSDP (names kept); recompiles after step 2 are warned about.""",
       "See [Compiled layers](precision.md#compiled-layers)."),
    _s(P, "cross_step_overlap", """right after each optimizer step the next step's first all-gathers start
       (FSDP-sharded stages; their weights stay gathered across the step boundary).""",
       """They are the UNSHARDs before each rank's first compute, overlapping what runs between the steps: the
       optimizer's hooks, callbacks, logging, the next batch's loading and the next step's host work before its first
       forward. Memory: one or two stages' gathered weights during the optimizer step, less than the step's peak with
       activations. An evaluation, a checkpoint save or the end of the run first waits for the gathers and frees them.
       Nothing may change the parameters between the optimizer step and the next training step (a callback writing
       weights in `on_train_batch_end`): the gathered copy would be stale. Off by default: on CPU it gained nothing
       measurable ([Benchmarks](benchmarks.md#cross-step-overlap))."""),
    _s(P, "cuda_graphs", """on a GPU: each local stage's training forward and backward captured as CUDA graphs, one
       pair per micro-batch, and replayed after.""",
       """Captured by torch's `make_graphed_callables` at the first step, one pair per (stage, micro-batch, input
       shapes): the host launches one graph instead of every kernel, for micro-batches too small to keep a GPU busy.
       Refused before training on CPU, with FSDP-sharded stages (gathers and frees move the weights) and with stages
       that synchronize with the host, naming the setting; evaluation and prediction run eagerly. Not yet run on a
       device (`benchmarks/device.sh` holds the first measurement)."""),
    # the job: failures, waits, signals and checkpoints
    _s(J, "nonfinite_loss", """a NaN/inf training loss: `"stop"` (every rank raises before the optimizer step) or
       `"skip"` (that batch's gradients are dropped)."""),
    _s(J, "max_consecutive_skips", "with `\"skip\"`: more non-finite batches than this in a row stop the run."),
    _s(J, "process_group_backend", "as in `ModelParallelStrategy`: `gloo` on CPU, `nccl` on GPU by default.",
       default="as `ModelParallelStrategy`"),
    _s(J, "timeout", """bound on every distributed wait (collectives, p2p, the store, in every process group bfpp
       creates): a `timedelta` or seconds. A rank that dies or fails ends the job long before.""",
       """The start-up rendezvous, which waits for every process to start (imports, a shared file system, a loaded
       machine), waits at least 5 minutes (`lightning_bfpp.job.guard.STARTUP_TIMEOUT`), then the default group and
       its store are set back to `timeout`.""", default="30 min"),
    _s(J, "on_signal", """SIGTERM, SIGINT and SLURM's requeue signal while training: `"save"`: every rank saves one
       checkpoint at the next step boundary they agree on, then the process exits 128 + N; `"exit"`: every process
       exits at once.""",
       """Under `"save"` the run stops through Lightning's `SIGTERMException` (here
       `lightning_bfpp.job.preempt.Preempted`). Outside training, and at a second signal, the job exits at once
       ([Checkpoints and preemption](checkpoints.md))."""),
    _s(J, "signal_grace_s", """the bound on that save: 25 s under torchrun and after SLURM's SIGTERM (their launchers
       kill 30 s after the signal), else 60 s.""",
       "Past it the job exits without the save, and the newest complete checkpoint stays intact.",
       default="25 s / 60 s"),
    _s(J, "signal_checkpoint", """where that checkpoint goes: Lightning's HPC checkpoint under SLURM or without a
       ModelCheckpoint, else `last.ckpt` in the ModelCheckpoint's folder.""",
       """The HPC checkpoint is `<default_root_dir>/hpc_ckpt_<N>.ckpt` (the requeued job resumes it by itself; or
       `ckpt_path="hpc"`); `last.ckpt` resumes with `ckpt_path="last"`.""", default="see meaning"),
    _s(J, "async_save", """while fitting, a save copies the state to CPU memory and returns; the files are written in
       the background.""",
       """torch.distributed.checkpoint's `async_save`, then the manifest and the rename on a gloo group of their own.
       The next save, the end of fit and a stop signal's exit wait for it; saves outside fit are written at once.
       Costs a CPU copy of this rank's state while it is written. A write that fails in the background stops the run
       at the first step boundary after it, with the message of a failed save ([Storage
       faults](checkpoints.md#storage-faults))."""),
    _s(J, "trust_checkpoints", """load checkpoint files with unrestricted unpickling (can run code from the file; also
       `BFPP_TRUST_CHECKPOINTS=1`). Off: only plain data and tensors load.""", "See [Checkpoints](checkpoints.md)."),
    # measurement
    _s(M, "measure_every_n_steps", """when `step_stats` (bubble, times, bytes) are measured: `None` on Lightning's
       logging steps (`Trainer(log_every_n_steps=...)`) and the last step; `N` every N-th step; `0` never.""",
       "See [Measurements](measurements.md)."),
)
BY_NAME = {s.name: s for s in SETTINGS}
assert len(BY_NAME) == len(SETTINGS) and {s.group for s in SETTINGS} == set(GROUPS) == set(GROUP_TITLES)

DOCSTRING_ARGS = re.compile(r"(?ms)^    Args:\n.*?(?=\n\n)")  # the Args section of BFPPStrategy's docstring
TABLES_START = ("<!-- the settings' tables: made by `python -m lightning_bfpp.settings --write` from "
                "lightning_bfpp/settings.py -->")
TABLES_END = "<!-- end of the settings' tables -->"
TABLES = re.compile(rf"(?s){re.escape(TABLES_START)}\n.*?{re.escape(TABLES_END)}")  # in docs/settings.md
YAML_KEY = re.compile(r"^(\w+):(.*?)(?:#.*)?$")  # a top-level key, its value, its comment
YAML_COMMENT_COLUMN, WIDTH = 29, 120


def docstring_args() -> str:
    """The ``Args:`` section of BFPPStrategy's docstring: each setting's summary, in the signature's order."""
    lines = ["    Args:"]
    for s in SETTINGS:
        lines += textwrap.wrap(f"{s.name}: {s.summary}", WIDTH, initial_indent=" " * 8, subsequent_indent=" " * 12,
                               break_on_hyphens=False)
    return "\n".join(lines)


def default_cell(name: str, default: object) -> str:
    """docs/settings.md's default cell: the described one, else `default` (what the setting is when not given)."""
    if BY_NAME[name].default:
        return BY_NAME[name].default
    return str(default) if isinstance(default, int) and not isinstance(default, bool) else f"`{default!r}`".replace(
        "'", '"')


def docs_tables(defaults: dict[str, object]) -> str:
    """docs/settings.md's tables, one per group under its title: argument, default (`defaults`: each setting's when
    not given), summary + details; between the markers that --write finds them by."""
    parts = [TABLES_START]
    for group in GROUPS:
        parts += [f"**{GROUP_TITLES[group]}**", "", "| argument | default | meaning |", "|---|---|---|"]
        parts += [f"| `{s.name}` | {default_cell(s.name, defaults[s.name])} | {_meaning(s)} |"
                  for s in SETTINGS if s.group == group]
        parts.append("")
    return "\n".join([*parts, TABLES_END])


def _meaning(setting: Setting) -> str:
    return f"{setting.summary} {setting.details}".strip()


def yaml_comments(text: str, defaults: dict[str, object]) -> str:
    """conf/schedule/base.yaml with each setting key's comment made its summary (wrapped, the continuation lines
    aligned); a value that is neither null nor the strategy's default (`defaults`) is the app's own, and says so.
    Other lines are kept."""
    out: list[str] = []
    rewriting = False  # the last key was a setting: its comment's continuation lines are rewritten with it
    for line in text.splitlines():
        key = YAML_KEY.match(line)
        if key is None and rewriting and line.startswith(" ") and line.lstrip().startswith("#"):
            continue
        rewriting = key is not None and key.group(1) in BY_NAME
        if not rewriting:
            out.append(line)
            continue
        name, value = key.group(1), key.group(2).strip()
        comment = BY_NAME[name].summary
        if value not in ("null", _yaml_value(defaults[name])):
            comment = f"(app default; BFPPStrategy's: {default_cell(name, defaults[name]).strip('`')}) {comment}"
        head = f"{name}: {value}".ljust(YAML_COMMENT_COLUMN - 1) + " "
        wrapped = textwrap.wrap(comment, WIDTH - len(head) - 2, break_on_hyphens=False)
        out += [head + "# " + wrapped[0]] + [" " * len(head) + "# " + w for w in wrapped[1:]]
    return "\n".join(out) + "\n"


def _yaml_value(default: object) -> str:
    """How base.yaml spells a default: YAML's booleans and null, a timedelta in seconds."""
    if isinstance(default, bool) or default is None:
        return {True: "true", False: "false", None: "null"}[default]
    seconds = getattr(default, "total_seconds", None)
    return str(int(seconds())) if seconds else str(default)


def effective_defaults() -> dict[str, object]:
    """Each setting when not given: the signature's default, or for a layout setting whose signature default is None
    (not pinned), the one the layout gives it (``UNGIVEN_DEFAULTS``). Imports the strategy (torch, Lightning)."""
    import inspect

    from .layout.plan import UNGIVEN_DEFAULTS
    from .strategy import BFPPStrategy

    return {name: UNGIVEN_DEFAULTS.get(name) if p.default is None else p.default
            for name, p in inspect.signature(BFPPStrategy).parameters.items()}


def rendered(root: Path) -> dict[Path, str]:
    """The three texts as this table makes them, keyed by their files under `root` (the repository)."""
    strategy, docs = root / "lightning_bfpp" / "strategy.py", root / "docs" / "settings.md"
    yaml, defaults = root / "conf" / "schedule" / "base.yaml", effective_defaults()
    return {strategy: DOCSTRING_ARGS.sub(lambda _: docstring_args(), strategy.read_text(), count=1),
            docs: TABLES.sub(lambda _: docs_tables(defaults), docs.read_text(), count=1),
            yaml: yaml_comments(yaml.read_text(), defaults)}


def listing(defaults: dict[str, object], width: int = 100) -> str:
    """The settings for a terminal: per group, each `name = default` and its summary, wrapped."""
    lines: list[str] = []
    for group in GROUPS:
        lines += ["", GROUP_TITLES[group]]
        for s in (s for s in SETTINGS if s.group == group):
            lines.append(f"  {s.name} = {default_cell(s.name, defaults[s.name]).replace('`', '')}")
            lines += textwrap.wrap(s.summary.replace("`", ""), width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_bfpp.settings", description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/settings.md's tables instead")
    parser.add_argument("--write", action="store_true",
                        help="rewrite the strategy's docstring, docs/settings.md's tables and "
                             "conf/schedule/base.yaml's comments from the table (in a checkout)")
    args = parser.parse_args(argv)
    if not args.write:
        print(docs_tables(effective_defaults()) if args.markdown else listing(effective_defaults()))
        return
    root = Path(__file__).resolve().parents[1]
    if not (root / "docs" / "settings.md").is_file():
        parser.error(f"--write rewrites a checkout's files, and {root} has no docs/settings.md: run it in a clone of "
                     "the repository (pip install -e .)")
    for path, text in rendered(root).items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"rewrote {path.relative_to(root)}")


if __name__ == "__main__":
    main()
