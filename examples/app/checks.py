"""Examples/train.py's preflight — the rules of the app's own Hydra keys (cluster, data, model, optim,
trainer), checked in the launching process before the Trainer starts any process. Each error names the key,
its value, the rule and a fix. The layout (world, schedule knobs, layers, batch) is checked by the library's
own rules (lightning_bfpp.dims.ParallelDims) in the app's key names; stage_layers and the model's
layers by BFPPStrategy's launcher, and `ckpt_path` by its launcher."""
from __future__ import annotations

import inspect
import math
from difflib import get_close_matches
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lightning_bfpp.data.settings import PACKINGS
from lightning_bfpp.dims import Names, ParallelDims, ScheduleSpec
from lightning_bfpp.layout.fsdp import check_shard_unit
from lightning_bfpp.schedule import SCHEDULES
from lightning_bfpp.schedule.checks import is_count

POSITIVE = ("cluster.devices", "cluster.num_nodes", "data.batch_size", "data.block_size", "data.max_bytes",
            "model.n_layer", "model.n_embd", "model.block_size", "model.vocab_size")
OPTIMIZERS = ("adamw", "sgd")  # examples/gpt.py GPT.configure_optimizers
FAMILIES = ("gpt", "hf_gpt2", "hf_llama", "hf_pretrained")  # model.family: examples/train.py build_model
BYTES = 256  # the local corpus's vocabulary
# Trainer arguments examples/train.py sets from other keys: `trainer.<key>` would be overridden or conflict.
SET_ELSEWHERE = {
    "accelerator": "cluster.accelerator", "devices": "cluster.devices", "num_nodes": "cluster.num_nodes",
    "logger": "logger=wandb|csv|none", "default_root_dir": "hydra.run.dir",
    "enable_checkpointing": "checkpoint.last=false (and checkpoint.every_n_steps=0)",
    "callbacks": "a callback in examples/train.py (objects cannot be given on the command line)",
}
# trainer.precision: short forms as Lightning reads them, and what trains the example under each strategy
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
BFPP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
AUTO_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "64-true", "16-mixed")


def text_data(cfg: DictConfig) -> bool:
    """data=text (conf/data/text.yaml): tokenized records, not the byte corpus."""
    return OmegaConf.select(cfg, "data.name") == "text"


class ConfigError(ValueError):
    """An illegal value of a key of examples/train.py's config."""


def _default(value, default):
    """`default` for an unset (null) key; any other value, even 0 or "", is checked as given."""
    return default if value is None else value


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first illegal app setting (see the module comment for what is left out)."""
    check_trainer_keys(cfg)
    check_run_keys(cfg)
    check_precision(cfg)
    check_model_and_data(cfg)
    check_optim(cfg)
    dp = check_layout(cfg)
    if not text_data(cfg):  # data=text is checked against its token cache (examples/data.py prepare_text)
        check_corpus(cfg, dp)


def check_trainer_keys(cfg: DictConfig) -> None:
    """Every `trainer.<key>` (also `+trainer.<key>=...`) is passed to lightning.Trainer: it must be one of its
    arguments, and not one that examples/train.py sets from another key."""
    import lightning as L

    allowed = set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}
    for key in cfg.trainer:
        value = OmegaConf.select(cfg, f"trainer.{key}")
        if key in SET_ELSEWHERE:
            raise ConfigError(f"trainer.{key}={value!r} is set by examples/train.py from {SET_ELSEWHERE[key]}; "
                              f"use that instead of trainer.{key}.")
        if key not in allowed:
            close = get_close_matches(key, sorted(allowed), n=1)
            hint = f"did you mean trainer.{close[0]}? " if close else ""
            raise ConfigError(f"trainer.{key}={value!r} is not an argument of lightning.Trainer; {hint}Any Trainer "
                              "argument can be given as trainer.<name>=<value> (+trainer.<name>=<value> if "
                              "conf/train.yaml does not list it).")
    if cfg.trainer.get("strategy") not in ("bfpp", "auto"):
        raise ConfigError(f"trainer.strategy={cfg.trainer.get('strategy')!r}: use trainer.strategy=bfpp (pipelined) "
                          "or trainer.strategy=auto (plain Lightning, for comparison).")


# (key, holds, rule, fix): values Lightning, the loggers or the app would take without a word or fail on only
# after the processes start (a ZeroDivisionError for val_check_interval=0 or accumulate_grad_batches=0)
RUN_RULES = [
    ("trainer.val_check_interval", lambda v: v is None or is_count(v, 1) or (isinstance(v, float) and 0 < v <= 1),
     "must be a number of batches >= 1 or a fraction of an epoch in (0, 1]", "e.g. trainer.val_check_interval=100"),
    ("trainer.accumulate_grad_batches", lambda v: is_count(v, 1), "must be an integer >= 1",
     "e.g. trainer.accumulate_grad_batches=1"),
    ("trainer.gradient_clip_val", lambda v: v is None or (_is_number(v) and v >= 0), "must be >= 0 or null",
     "trainer.gradient_clip_val=null for no clipping"),
    ("checkpoint.every_n_steps", lambda v: is_count(v, 0), "must be an integer >= 0", "0: no step checkpoints"),
    ("checkpoint.keep", lambda v: is_count(v, -1), "must be an integer >= -1", "-1: keep every step checkpoint"),
    ("checkpoint.async_save", lambda v: isinstance(v, bool), "must be true or false",
     "true: saves are written in the background"),
    ("checkpoint.on_signal", lambda v: v in ("save", "exit"), "must be save or exit",
     "save: a checkpoint at the next step boundary, then exit; exit: at once"),
    ("checkpoint.on_signal_grace_s", lambda v: v is None or (_is_number(v) and v > 0), "must be > 0 seconds or null",
     "null: 25 s under torchrun and after SLURM's SIGTERM, else 60 s"),
    ("data.num_workers", lambda v: is_count(v, 0), "must be an integer >= 0", "0: load in the training process"),
    ("schedule.cross_step_overlap", lambda v: isinstance(v, bool), "must be true or false",
     "true: the next step's first all-gathers start right after the optimizer step"),
    ("schedule.shard_unit", lambda v: v in ("stage", "layer"), "must be stage or layer",
     "layer: each layer its own FSDP unit, computing as soon as its weights arrive"),
    ("schedule.router_loss", lambda v: v in (None, "batch", "micro_batch"), "must be batch, micro_batch or null",
     "null: batch where the schedule runs every forward first (gpipe, breadth_first with groups 1), else micro_batch"),
    ("schedule.cuda_graphs", lambda v: isinstance(v, bool), "must be true or false",
     "true (GPU): each stage's training passes replayed as CUDA graphs"),
    ("trace.enabled", lambda v: isinstance(v, bool), "must be true or false", "true: traces of measured steps"),
    ("trace.count", lambda v: is_count(v, 1), "must be an integer >= 1", "e.g. trace.count=3"),
]
WANDB_MODES = ("offline", "online")


def check_run_keys(cfg: DictConfig) -> None:
    """Keys of the run around the model: the schedule group, validation and accumulation, clipping,
    checkpoints, data workers, the W&B mode, and an accelerator this machine has."""
    steps, epochs = OmegaConf.select(cfg, "trainer.max_steps"), OmegaConf.select(cfg, "trainer.max_epochs")
    if not (is_count(steps, 1) or (steps == -1 and is_count(epochs, 1))):
        raise ConfigError(f"trainer.max_steps={steps!r} must be a positive integer, or -1 (no step limit) with "
                          "+trainer.max_epochs=N; e.g. trainer.max_steps=400.")
    if OmegaConf.is_missing(cfg.schedule, "name"):
        raise ConfigError("schedule=base holds the knobs every schedule shares, it is not a schedule; use "
                          f"schedule={', '.join(SCHEDULES[:-1])} or {SCHEDULES[-1]}.")
    for key, holds, rule, fix in RUN_RULES:
        value = OmegaConf.select(cfg, key)
        if not holds(value):
            raise ConfigError(f"{key}={value!r} {rule}; {fix}.")
    if cfg.logger.get("name") == "wandb" and cfg.logger.get("mode") not in WANDB_MODES:
        raise ConfigError(f"logger.mode={cfg.logger.get('mode')!r}: use logger.mode={' or '.join(WANDB_MODES)}, or "
                          "logger=csv / logger=none for no W&B run.")
    accelerator = cfg.cluster.get("accelerator")
    if cfg.schedule.get("cuda_graphs") and cfg.trainer.get("strategy") == "bfpp" and accelerator not in ("gpu", "cuda"):
        raise ConfigError(f"schedule.cuda_graphs=true needs a CUDA device (cluster={cfg.cluster.get('name')} is "
                          f"{accelerator}): a CUDA graph replays GPU kernels; use schedule.cuda_graphs=false here.")
    if accelerator in ("gpu", "cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"cluster.accelerator={accelerator} (cluster={cfg.cluster.get('name')}): this machine "
                              "has no usable GPU (torch.cuda.is_available() is False); use cluster=cpu_1, cpu_2 or "
                              "cpu_4 here.")


def check_precision(cfg: DictConfig) -> None:
    """Precisions that train the example under the chosen strategy and accelerator; fp16 needs loss scaling."""
    raw, strategy, accelerator = cfg.trainer.get("precision"), cfg.trainer.strategy, cfg.cluster.accelerator
    value = PRECISION_ALIASES.get(str(raw), str(raw))
    allowed = BFPP_PRECISIONS if strategy == "bfpp" else AUTO_PRECISIONS
    if value == "16-true":
        raise ConfigError(f"trainer.precision={raw!r}: fp16 weights without loss scaling overflow (the example GPT's "
                          "loss is NaN at step 1); use trainer.precision=bf16-true (bf16 weights) or bf16-mixed.")
    if value == "16-mixed" and strategy == "bfpp":
        raise ConfigError(f"trainer.precision={raw!r} needs fp16 loss scaling, which strategy=bfpp does not do; use "
                          "trainer.precision=bf16-mixed.")
    if value == "16-mixed" and accelerator == "cpu":
        raise ConfigError(f"trainer.precision={raw!r}: fp16 autocast with loss scaling needs a GPU "
                          "(cluster.accelerator=cpu); use trainer.precision=bf16-mixed.")
    if value not in allowed:
        raise ConfigError(f"trainer.precision={raw!r} is not supported with trainer.strategy={strategy}; use one of "
                          f"{', '.join(allowed)}.")


def check_lora(cfg: DictConfig, family: str) -> None:
    """model.lora: a Hugging Face model's LoRA adapters (peft installed, settings a LoraConfig takes); without a
    rank (model.lora.r=null) no other LoRA setting."""
    from lightning_bfpp.hf.lora import SETTINGS, lora_config

    settings = OmegaConf.to_container(cfg.model.lora, resolve=True)
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ConfigError(f"model.lora.{unknown[0]} is not a LoRA setting; they are {', '.join(SETTINGS)}.")
    if settings.get("r") is None:
        given = [k for k in ("alpha", "target_modules") if settings.get(k) is not None]
        if given:
            raise ConfigError(f"model.lora.{given[0]} is set but model.lora.r=null (no adapters): set the rank, "
                              "e.g. model.lora.r=8.")
        return
    if family == "gpt":
        raise ConfigError("model.lora adapts Hugging Face models: use model=hf_pretrained (or hf_llama_tiny), or set "
                          "model.lora.r=null.")
    try:
        lora_config(settings)
    except (ValueError, ImportError) as err:
        raise ConfigError(str(err)) from None


def check_export_hf(cfg: DictConfig, family: str) -> None:
    """checkpoint.export_hf: last.ckpt of a Hugging Face model under bfpp, written to a folder that is new."""
    out = Path(str(cfg.checkpoint.export_hf)).expanduser()
    if family == "gpt":
        raise ConfigError("checkpoint.export_hf writes Hugging Face models (model=hf_pretrained, hf_llama_tiny, ...); "
                          "export the GPT with python -m lightning_bfpp.checkpoint CKPT OUT.pt.")
    if cfg.trainer.strategy != "bfpp" or not cfg.checkpoint.get("last", True):
        raise ConfigError("checkpoint.export_hf exports last.ckpt of a bfpp run: set trainer.strategy=bfpp and "
                          "checkpoint.last=true.")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"checkpoint.export_hf={str(out)!r} exists and is not an empty folder: name a new one.")
    if not out.parent.is_dir():
        raise ConfigError(f"checkpoint.export_hf={str(out)!r}: the folder {out.parent} does not exist; create it.")


def check_model_and_data(cfg: DictConfig) -> None:
    def get(key: str):
        return OmegaConf.select(cfg, key)

    family = get("model.family") or "gpt"
    if family == "hf_pretrained":  # before reading the keys that come from the saved model's config.json
        if OmegaConf.is_missing(cfg.model, "path"):
            raise ConfigError("model=hf_pretrained needs the saved model's directory: model.path=/abs/path/to/model "
                              "(written by save_pretrained).")
        pretrained_config(cfg.model.path, "vocab_size")
    if family not in FAMILIES:
        raise ConfigError(f"model.family={family!r} is unknown; use one of {', '.join(FAMILIES)} (e.g. "
                          "model=hf_llama_tiny).")
    if family != "gpt":
        try:
            import transformers  # noqa: F401
        except ImportError as err:
            raise ConfigError(f"model.family={family} needs Hugging Face transformers ({err}); install the extra: "
                              "pip install lightning-bfpp[hf], or use model=gpt_tiny.") from None
    if get("model.lora") is not None:
        check_lora(cfg, family)
    if get("checkpoint.export_hf"):
        check_export_hf(cfg, family)
    text = text_data(cfg)
    if text and get("data.packing") not in PACKINGS:
        raise ConfigError(f"data.packing={get('data.packing')!r} is not one of {', '.join(PACKINGS)}.")
    if not text and family != "gpt" and is_count(get("model.vocab_size")) and get("model.vocab_size") < BYTES:
        raise ConfigError(f"model.vocab_size={get('model.vocab_size')} is below the {BYTES} byte values of the local "
                          "corpus: use a model with at least 256 tokens (token id = byte value).")
    positive = [k for k in POSITIVE if not (text and k == "data.max_bytes")]
    for key in positive + (["data.stride"] if get("data.stride") is not None else []):
        if not is_count(get(key)):
            raise ConfigError(f"{key}={get(key)!r} must be a positive integer; set {key}=1 or more.")
    fraction = get("data.val_fraction")
    if not (_is_number(fraction) and 0 < fraction < 1):
        raise ConfigError(f"data.val_fraction={fraction!r} must be in (0, 1); e.g. data.val_fraction=0.05.")
    if is_count(get("model.max_positions")) and get("model.block_size") > get("model.max_positions"):
        raise ConfigError(f"model.block_size={get('model.block_size')} exceeds the saved model's "
                          f"max_position_embeddings={get('model.max_positions')}; set "
                          f"model.block_size={get('model.max_positions')} or less.")
    if get("data.block_size") > get("model.block_size"):
        raise ConfigError(
            f"data.block_size={get('data.block_size')} must be <= model.block_size={get('model.block_size')} (the "
            "model has that many position embeddings); leave data.block_size at ${model.block_size}."
        )


def check_optim(cfg: DictConfig) -> None:
    """optim.*: what torch.optim and GPT.configure_optimizers accept, and a learning rate that trains."""
    o = cfg.optim
    if o.get("name") not in OPTIMIZERS:
        raise ConfigError(f"optim.name={o.get('name')!r} is unknown; use optim={' or optim='.join(OPTIMIZERS)}.")
    rules = [  # (key, holds, rule, fix)
        ("lr", lambda v: _is_number(v) and v > 0, "must be a number > 0", "e.g. optim.lr=3e-3 (adamw) or 0.3 (sgd)"),
        ("weight_decay", lambda v: _is_number(v) and v >= 0, "must be >= 0", "e.g. optim.weight_decay=0.1"),
        ("warmup_steps", lambda v: is_count(v, 0),
         "must be an integer >= 0", "e.g. optim.warmup_steps=30 (0: no warmup)"),
        ("min_lr_ratio", lambda v: _is_number(v) and 0 <= v <= 1, "must be in [0, 1]", "e.g. optim.min_lr_ratio=0.1"),
    ]
    if o.name == "adamw":
        rules.append(("betas", lambda v: len(v) == 2 and all(_is_number(b) and 0 <= b < 1 for b in v),
                      "must be two numbers in [0, 1)", "e.g. optim.betas=[0.9,0.95]"))
        rules.append(("eps", lambda v: _is_number(v) and v > 0, "must be a number > 0", "e.g. optim.eps=1e-8"))
    else:
        rules.append(("momentum", lambda v: _is_number(v) and 0 <= v < 1, "must be in [0, 1)",
                      "e.g. optim.momentum=0.9"))
    for key, holds, rule, fix in rules:
        value = OmegaConf.select(o, key)
        shown = list(value) if OmegaConf.is_list(value) else value
        try:
            ok = holds(shown)
        except TypeError:
            ok = False
        if not ok:
            raise ConfigError(f"optim.{key}={shown!r} {rule}; {fix}.")


def check_layout(cfg: DictConfig) -> int:
    """World size, schedule knobs, pipeline stages, the global batch and the sequence, by the layout's own rules
    (``ParallelDims.validate``) in the app's key names; returns data_parallel."""
    def get(key: str):
        return OmegaConf.select(cfg, key)

    devices, nodes = get("cluster.devices"), get("cluster.num_nodes")
    dims, n_layer = ParallelDims(world=devices * nodes, devices_per_node=devices), None
    auto = get("trainer.strategy") == "bfpp" and get("schedule.layout") == "auto"
    if auto:  # the planner picks the knobs (the typed ones pinned) for data.batch_size; BFPPStrategy checks the pins
        dims = ParallelDims(world=devices * nodes, devices_per_node=devices,
                            tensor_parallel=_default(get("schedule.tensor_parallel"), 1),
                            context_parallel=_default(get("schedule.context_parallel"), 1))
    elif get("trainer.strategy") == "bfpp":
        pp, loops, m = get("schedule.pipeline_parallel"), get("schedule.loops"), get("schedule.micro_batches")
        m, tp = _default(m, pp), _default(get("schedule.tensor_parallel"), 1)
        spec = ScheduleSpec(get("schedule.name"), pipeline_parallel=pp, loops=loops, micro_batches=m,
                            groups=_default(get("schedule.groups"), 1))
        dims = ParallelDims(world=devices * nodes, devices_per_node=devices, spec=spec, tensor_parallel=tp,
                            sharding=_default(get("schedule.sharding"), "full"),
                            sequence_parallel=_default(get("schedule.sequence_parallel"), False),
                            expert_parallel=_default(get("schedule.expert_parallel"), 1),
                            context_parallel=_default(get("schedule.context_parallel"), 1))
        n_layer = get("model.n_layer")
        check_experts_model(cfg)
        try:
            check_shard_unit(_default(get("schedule.shard_unit"), "stage"), _default(get("schedule.sharding"), "full"))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    names = Names(
        pipeline_parallel="schedule.pipeline_parallel", tensor_parallel="schedule.tensor_parallel",
        sequence_parallel="schedule.sequence_parallel", context_parallel="schedule.context_parallel",
        expert_parallel="schedule.expert_parallel", loops="schedule.loops", groups="schedule.groups",
        micro_batches="schedule.micro_batches" if n_layer is not None else "micro_batches (1 under strategy=auto)",
        sharding="schedule.sharding",
        world="cluster.devices x cluster.num_nodes", devices="cluster.devices", batch="data.batch_size",
        # embedding + blocks + head (also lightning_bfpp.hf's GPT-2 and Llama)
        layers=f"model.n_layer={n_layer} (embedding, {n_layer} blocks, head)",
        sequence="data.block_size")
    block = get("data.block_size")
    try:
        dims.validate(num_layers=None if n_layer is None else n_layer + 2,
                      global_batch=None if auto else get("data.batch_size"),
                      sequence=block if is_count(block) else None, names=names)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return dims.data_parallel


def check_experts_model(cfg: DictConfig) -> None:
    """schedule.expert_parallel > 1 splits a mixture of experts' experts: the example GPT needs model.n_experts > 0
    (model=gpt_moe_tiny) divisible by it (other model families are checked by BFPPStrategy against the model)."""
    ep, family = OmegaConf.select(cfg, "schedule.expert_parallel"), OmegaConf.select(cfg, "model.family") or "gpt"
    experts = OmegaConf.select(cfg, "model.n_experts") or 0
    if not is_count(ep) or ep == 1 or family != "gpt":
        return
    if not experts:
        raise ConfigError(f"schedule.expert_parallel={ep} splits the experts of a mixture of experts, and model="
                          f"{cfg.model.get('name')} has none (model.n_experts={experts}); use model=gpt_moe_tiny (or "
                          "set model.n_experts), or schedule.expert_parallel=1.")
    if experts % ep:
        raise ConfigError(f"schedule.expert_parallel={ep} must divide model.n_experts={experts} (each rank holds "
                          f"n_experts / expert_parallel of them); use schedule.expert_parallel in "
                          f"{[d for d in range(1, experts + 1) if experts % d == 0]}.")


def corpus_windows(max_bytes: int, val_fraction: float, block_size: int,
                   stride: int | None) -> tuple[int, int, int, int]:
    """(training bytes, training windows, validation bytes, validation windows) of examples/data.py's split
    of a `max_bytes` corpus (the stdlib holds ~30 MB, so the corpus is max_bytes long below that)."""
    cut = int(max_bytes * (1.0 - val_fraction))
    train, val = cut, max_bytes - cut

    def windows(n: int, step: int) -> int:
        return (n - block_size - 1) // step + 1 if n >= block_size + 1 else 0

    return train, windows(train, stride or block_size), val, windows(val, block_size)


def check_corpus(cfg: DictConfig, dp: int) -> None:
    """One full batch per data-parallel replica in the training split, and in the validation split when
    validation runs (the loaders drop incomplete batches: a shorter split trains or validates nothing)."""
    d = cfg.data
    batch, block, stride, fraction = d.batch_size, d.block_size, d.get("stride"), d.val_fraction
    validates = cfg.trainer.get("limit_val_batches") not in (0, 0.0)

    def fits(n: int) -> bool:
        _, w, _, wv = corpus_windows(n, fraction, block, stride)
        return w >= batch and (wv >= batch or not validates)

    if fits(d.max_bytes):
        return
    need = max(math.ceil(((batch - 1) * (stride or block) + block + 1) / (1 - fraction)),
               math.ceil((batch * block + 1) / fraction) if validates else 0)
    while not fits(need):
        need += 1
    while fits(need - 1):  # the bounds above round up: the least size that fits
        need -= 1
    train, w, val, wv = corpus_windows(d.max_bytes, fraction, block, stride)
    per_replica = f"{batch // dp} per data-parallel replica x {dp}" if dp > 1 else "one replica"
    if w < batch:
        every, smaller = ((f" starting every data.stride={stride} bytes", ", a smaller data.stride") if stride
                          else ("", ""))
        raise ConfigError(
            f"data.max_bytes={d.max_bytes} is too small: its training split ({train} bytes) holds {w} windows of "
            f"data.block_size + 1 = {block + 1} bytes{every}, fewer than one batch of data.batch_size={batch} "
            f"({per_replica}); use data.max_bytes={need} or more{smaller}, or a smaller data.batch_size."
        )
    raise ConfigError(
        f"data.max_bytes={d.max_bytes} is too small for validation: its validation split (the last {val} bytes, "
        f"data.val_fraction={fraction}) holds {wv} windows of {block + 1} bytes, fewer than one batch of "
        f"data.batch_size={batch} ({per_replica}), so validation would be empty; use data.max_bytes={need} or more, "
        "a larger data.val_fraction, or trainer.limit_val_batches=0 (no validation)."
    )


def pretrained_config(path: str, field: str):
    """`field` of the Hugging Face config saved in the directory `path` (``${bfpp_hf_config:${model.path},field}`` in
    conf/model/hf_pretrained.yaml): the model's shape is the saved model's, read before any process starts."""
    if not (Path(str(path)) / "config.json").is_file():
        raise ConfigError(f"model.path={path!r} is not a directory with a config.json: pass a directory written by "
                          "save_pretrained (model.path=/abs/path/to/model).")
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), field)
