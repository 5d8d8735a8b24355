"""Checks a composed moolib-run config and fills in what is decided at launch.

Hydra already refuses unknown keys; the typed config (``moolib.conf.schema.run_config``)
catches values of the wrong type or out of range, naming the key, before any
process starts. What comes out of here is a ``RunConfig``: the rest of the run
never sees the DictConfig.
"""

from __future__ import annotations

import dataclasses
import datetime
import secrets
from pathlib import Path

from moolib.conf.checks import ConfigError, check_flag, check_int_at_least, one_line
from moolib.conf.schema.run_config import CONFIG_FILE, RunConfig, env_name_error, load, save
from omegaconf import DictConfig, OmegaConf

# Importable from here too (moolib.launch.config.ConfigError, ...), where they lived first.
__all__ = [
    "CONFIG_FILE",
    "ConfigError",
    "RunConfig",
    "check_flag",
    "check_int_at_least",
    "env_name_error",
    "load",
    "one_line",
    "prepare",
    "save",
    "validate",
]


def validate(cfg: DictConfig) -> RunConfig:
    """The typed config of a composed one. Raises ConfigError naming the first bad key
    (the agent's settings are checked by its registered dataclass, the rest by
    ``RunConfig``)."""
    return RunConfig.from_dict(cfg)


def prepare(cfg: DictConfig, savedir: Path) -> RunConfig:
    """The run's final config: checked, typed, with ``savedir`` and ``group`` filled in.
    A savedir that holds a config from an earlier run keeps that run's group (a
    resumed experiment stays one experiment)."""
    final = validate(cfg)
    group = final.group
    previous = savedir / CONFIG_FILE
    if group is None:
        if previous.exists():
            group = OmegaConf.load(previous).get("group")
        if group is None:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            group = f"{final.name}-{stamp}-{secrets.token_hex(2)}"
    return dataclasses.replace(final, savedir=str(savedir), group=group)
