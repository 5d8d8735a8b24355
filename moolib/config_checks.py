"""Checks of the toolkit's config values, and the error they raise.

A leaf module: the agents' settings (``moolib.agents.registry``) and
``moolib-run``'s checks of the rest (``moolib.launch.config``) both word their
failures through it, so neither package imports the other for them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


def one_line(text: str) -> str:
    """``text`` with its line breaks and runs of blanks folded into single spaces: a
    ConfigError is one line."""
    return " ".join(str(text).split())


def check_int_at_least(key: str, value: object, low: int = 1) -> None:
    """Raises ConfigError unless ``value`` (the setting ``key``) is an integer >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        hint = ""
        if isinstance(value, float) and value.is_integer() and value >= low:
            # Most likely 1e6 on the command line, meant as the integer.
            hint = f" (write {int(value)}: Hydra reads 1e6 or 2.0 as a float)"
        raise ConfigError(f"{key} must be {kind}, got {value!r}{hint}")


def check_number(key: str, value: object, low: float, high: float | None = None) -> None:
    """Raises ConfigError unless ``value`` (the setting ``key``) is a number in
    [``low``, ``high``] (no upper bound where ``high`` is None)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or value < low or (high is not None and value > high):  # type: ignore[operator]
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{key} must be a number {bounds}, got {value!r}")


def check_choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    """Raises ConfigError unless ``value`` (the setting ``key``) is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")


def check_flag(key: str, value: object) -> None:
    """Raises ConfigError unless ``value`` (the setting ``key``) is true or false."""
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")


def resolve_device(value: object, *, cuda_here: bool = True) -> torch.device:
    """The torch device the setting ``device`` names: ``auto`` is CUDA when this machine
    has it, else CPU. Raises ConfigError for a value torch cannot read, and for CUDA on
    a machine without it, unless ``cuda_here`` is False (a launcher whose runs go to
    other machines: a SLURM login node may have no GPU, its jobs' nodes do)."""
    import torch

    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {value!r}") from e
    if cuda_here and device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={value}: CUDA is not available on this machine")
    return device


def env_options(cfg: Any) -> dict[str, Any]:
    """A run config's ``env.options`` as keyword arguments of its env (none when unset).
    Raises ConfigError when they are not a mapping."""
    from omegaconf import OmegaConf

    options = cfg.env.get("options")
    if options is None:
        return {}
    values = (
        OmegaConf.to_container(options, resolve=True) if OmegaConf.is_config(options) else options
    )
    if not isinstance(values, dict):
        raise ConfigError(f"env.options must be a mapping of settings, got {values!r}")
    return values
