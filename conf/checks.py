"""Checks of the toolkit's config values, and the error they raise.

A leaf module: the agents' settings (``moolib.agents.registry``) and
``moolib-run``'s checks of the rest (``moolib.launch.config``) both word their
failures through it, so neither package imports the other for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


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


def build_config(
    cls: type[T], values: Mapping[str, Any], prefix: str, **nested: Callable[[Any], Any]
) -> T:
    """The dataclass ``cls`` made from the settings ``values`` (the keys under ``prefix``,
    e.g. ``agent``; ``""`` at the top), its checks run by its ``__post_init__``. Raises
    ConfigError for a key it has no field for (its ``retired_keys``, if any, are dropped
    unchecked), for a missing one without a default, and for a field named in
    ``nested`` whose value is not a mapping; ``nested[name]`` builds that field from
    its mapping (a config of its own)."""

    def key(name: str) -> str:
        return f"{prefix}.{name}" if prefix else name

    retired = getattr(cls, "retired_keys", frozenset())
    values = {k: v for k, v in values.items() if k not in retired}
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown key {key(unknown[0])} ({cls.__name__} has no such setting; "
            f"it has {', '.join(fields)})"
        )
    missing = [
        k
        for k, f in fields.items()
        if k not in values
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{key(missing[0])} is missing ({cls.__name__} needs it)")
    kwargs = dict(values)
    for name, build in nested.items():
        if name in values:
            if not isinstance(values[name], Mapping):
                raise ConfigError(f"{key(name)} must be a mapping, got {values[name]!r}")
            kwargs[name] = build(values[name])
    return cls(**kwargs)
