"""A run's resolved config in its savedir: what ``moolib-run`` writes there, and what
its peers, resumes and ``evaluate`` read back."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

CONFIG_FILE = "config.yaml"


def save(cfg: DictConfig, savedir: Path) -> Path:
    """Writes the resolved config into the savedir (what peers and resumes read)."""
    savedir.mkdir(parents=True, exist_ok=True)
    path = savedir / CONFIG_FILE
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(cfg))
    tmp.replace(path)
    return path


def load(path: Path) -> DictConfig:
    """A config written by ``save``."""
    cfg = OmegaConf.load(path)
    assert isinstance(cfg, DictConfig)
    OmegaConf.set_struct(cfg, True)
    return cfg
