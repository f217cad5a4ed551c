# Scope: examples/train.py's preflight — the rules of the app's own Hydra keys (cluster, data, model,
# trainer), checked before the Trainer starts any process. Each error names the key, its value, the rule
# and a fix. Schedule knobs (schedule.name, micro_batches, loops, groups, sharding, stage_layers) are
# checked by BFPPStrategy when train.py builds it, and the model's layers against the stages by its launcher.
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

POSITIVE = ("cluster.devices", "cluster.num_nodes", "data.batch_size", "data.block_size", "data.max_bytes",
            "model.n_layer", "model.n_embd", "model.block_size", "model.vocab_size", "trainer.max_steps")
OPTIMIZERS = ("adamw", "sgd")  # examples/gpt.py GPT.configure_optimizers


class ConfigError(ValueError):
    """An illegal value of a key of examples/train.py's config."""


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first illegal app setting (see the module comment for what is left out)."""
    def get(key: str):
        return OmegaConf.select(cfg, key)

    for key in POSITIVE + (("data.stride",) if get("data.stride") is not None else ()):
        if not _is_positive_int(get(key)):
            raise ConfigError(f"{key}={get(key)!r} must be a positive integer; set {key}=1 or more.")
    fraction = get("data.val_fraction")
    if not (isinstance(fraction, (int, float)) and 0 < fraction < 1):
        raise ConfigError(f"data.val_fraction={fraction!r} must be in (0, 1); e.g. data.val_fraction=0.05.")
    if get("data.block_size") > get("model.block_size"):
        raise ConfigError(
            f"data.block_size={get('data.block_size')} must be <= model.block_size={get('model.block_size')} (the "
            "model has that many position embeddings); leave data.block_size at ${model.block_size}."
        )
    if get("optim.name") not in OPTIMIZERS:
        raise ConfigError(f"optim.name={get('optim.name')!r} is unknown; use optim={' or optim='.join(OPTIMIZERS)}.")

    devices, nodes, batch = get("cluster.devices"), get("cluster.num_nodes"), get("data.batch_size")
    world, dp, m = devices * nodes, devices * nodes, 1
    if get("trainer.strategy") == "bfpp":
        pp, loops, m = get("schedule.pipeline_parallel"), get("schedule.loops"), get("schedule.micro_batches")
        m = pp if m is None else m
        if not all(_is_positive_int(v) for v in (pp, loops, m)):
            return  # BFPPStrategy names the illegal schedule knob
        if world % pp:
            fits = [d for d in range(1, world + 1) if world % d == 0]
            raise ConfigError(
                f"schedule.pipeline_parallel={pp} must divide the world size cluster.devices x cluster.num_nodes = "
                f"{devices} x {nodes} = {world}; use schedule.pipeline_parallel in {fits}, or cluster.devices a "
                f"multiple of {pp}."
            )
        n_layer = get("model.n_layer")
        stages, layers = pp * loops, n_layer + 2  # embedding + blocks + head
        if stages > layers:
            fix = f"schedule.loops={layers // pp}" if layers >= pp else f"schedule.pipeline_parallel<={layers}"
            raise ConfigError(
                f"schedule.pipeline_parallel x schedule.loops = {pp} x {loops} = {stages} stages need at least as many "
                f"layers, but model.n_layer={n_layer} makes {layers} (embedding, {n_layer} blocks, head); use "
                f"{fix}, or model.n_layer={stages - 2}."
            )
        dp = world // pp
    unit = dp * m
    if batch % unit:
        sizes = " or ".join(str(b) for b in sorted({max(unit, batch // unit * unit), (batch // unit + 1) * unit}))
        split = f", in {m} micro-batches); use data.batch_size={sizes}, or change schedule.micro_batches." if m > 1 \
            else f"); use data.batch_size={sizes}."
        raise ConfigError(
            f"data.batch_size={batch} (global, per optimizer step) must be divisible by data_parallel x micro_batches "
            f"= {dp} x {m} = {unit} (each data-parallel replica loads data.batch_size / {dp}{split}"
        )
