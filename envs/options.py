"""Checks of env options that every suite shares: a bad value is a ValueError naming it."""

from __future__ import annotations


def check_flag(name: str, value: object) -> None:
    """Raises ValueError unless ``value`` is a bool. A flag is never coerced: ``bool("no")``
    is True, so a mistyped ``env.options.full_action_space=no`` would turn it on."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
