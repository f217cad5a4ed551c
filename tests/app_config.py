"""The app's Hydra configuration as the command line composes it, for tests that check settings without a run: the
one Hydra ``compose`` of the tests."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

CONF = Path(__file__).resolve().parents[1] / "conf"


def compose_app(overrides: list[str] = (), hydra: bool = False) -> DictConfig:
    """conf/train.yaml with the command line's `overrides`; `hydra`: with the ``hydra`` node, as a run sees it."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("train", overrides=list(overrides), return_hydra_config=hydra)
