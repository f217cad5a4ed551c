"""Examples/train.py's command line, read before Hydra composes the config: a key or a config file the app knows,
misspelt (`trainer.max_step=10`, `schedule=breadth_frist`), is answered with "did you mean ..." first. Hydra's own
answer ("To append to your config use +trainer.max_step=10") would send the user to a key the app then refuses.
Keys that are close to nothing the app knows are left to Hydra, and the composed config to config_checks."""
from __future__ import annotations

import inspect
from difflib import get_close_matches
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from omegaconf import DictConfig, OmegaConf

from lightning_bfpp.schedule import SCHEDULES

from .checks import SET_ELSEWHERE, ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"
# options taking a value as the next argument (the others are flags, or `--opt=value` in one argument)
VALUE_OPTIONS = ("--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c", "--package",
                 "-p", "--info", "-i")


def overrides_of(argv: list[str]) -> list[Override]:
    """The overrides on a command line (options and what Hydra's grammar cannot read are left out: Hydra names
    those itself)."""
    parser, found, args = OverridesParser.create(), [], iter(argv)
    for arg in args:
        if arg.startswith("-"):
            if arg in VALUE_OPTIONS:
                next(args, None)
            continue
        try:
            found.append(parser.parse_override(arg))
        except Exception:
            continue
    return found


def _choices(override: Override) -> list[str]:
    return list(override.sweep_string_iterator()) if override.is_sweep_override() else \
        [override.get_value_element_as_str()]


def _trainer_arguments() -> set[str]:
    import lightning as L

    return set(inspect.signature(L.Trainer.__init__).parameters) - {"self"}


def check_command_line(argv: list[str], conf: Path = CONF, config_name: str = "train") -> None:
    """Raise ConfigError for the first override of a config file or a key that does not exist when the app knows
    one close to it (or, for `trainer.<Trainer argument>`, how the app takes it)."""
    overrides = [o for o in overrides_of(argv) if not o.key_or_group.startswith("hydra.")]
    groups = [o for o in overrides if (conf / o.key_or_group).is_dir() and not (o.is_delete() or o.is_add())]
    for override in groups:
        _check_group(override, conf)
    keys = [o for o in overrides if o.type.name == "CHANGE" and o not in groups]
    if not keys:
        return
    from hydra import compose, initialize_config_dir

    choices = [f"{o.key_or_group}={_choices(o)[0]}" for o in groups]
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        cfg = compose(config_name, overrides=choices)
    for override in keys:
        _check_key(override, cfg)


def _check_group(override: Override, conf: Path) -> None:
    """`group=option`: each option names a file of conf/<group>/."""
    group = override.key_or_group
    options = sorted(p.stem for p in (conf / group).glob("*.yaml"))
    for choice in _choices(override):
        if choice in options:
            continue
        known = [s for s in SCHEDULES if s in options] if group == "schedule" else options
        close = get_close_matches(choice, known, n=1)
        if close:
            raise ConfigError(f"{group}={choice}: conf/{group}/ has no {choice}.yaml; did you mean {group}={close[0]}? "
                              f"({group}={', '.join(known)})")


def _check_key(override: Override, cfg: DictConfig) -> None:
    """`a.b.c=value`: the first part of the path the config lacks is named with the closest key of its node."""
    key, value = override.key_or_group, ",".join(_choices(override))
    parts, node = key.split("."), cfg
    for depth, part in enumerate(parts):
        if isinstance(node, DictConfig) and part in node.keys():  # (`in node` is False for a missing value, ???)
            if depth == len(parts) - 1 or OmegaConf.is_missing(node, part):
                return  # the key exists; its value is not read (it may be an interpolation still to resolve)
            node = node[part]
            continue
        if not isinstance(node, DictConfig):
            return  # a value, not a node: Hydra names it
        known = set(node.keys())
        trainer = parts[:depth] == ["trainer"]
        if trainer:
            arguments = _trainer_arguments()
            if depth == len(parts) - 1 and part in arguments:
                if part in SET_ELSEWHERE:
                    raise ConfigError(f"{key}={value}: examples/train.py sets trainer.{part} from "
                                      f"{SET_ELSEWHERE[part]}; use that instead.")
                raise ConfigError(f"{key}={value}: {part} is a lightning.Trainer argument that conf/train.yaml does "
                                  f"not list; add it with +{key}={value}.")
            known |= arguments - set(SET_ELSEWHERE)
        close = get_close_matches(part, sorted(known), n=1)
        if not close:
            return  # close to nothing the app knows: Hydra's message
        fixed = ".".join([*parts[:depth], close[0], *parts[depth + 1:]])
        how = (f"+{fixed}={value}: a lightning.Trainer argument conf/train.yaml does not list"
               if close[0] not in node.keys() else f"{fixed}={value}")
        raise ConfigError(f"{key}={value}: the config has no key {key}; did you mean {fixed}? ({how})")
