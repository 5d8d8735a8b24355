"""Checks of the arguments of moolib's Python API. The original binds numbers as
C++ ints, where a float, a bool or a string is refused with a TypeError; so are
they here, and numpy's integers pass as they do there."""

from __future__ import annotations

import numbers
import operator
from typing import Any


def check_int(what: str, value: Any, low: int | None = None) -> int:
    """``value`` as an int, or TypeError (``what must be an int``); with ``low``,
    ValueError below it (``what must be at least LOW``)."""
    if not isinstance(value, bool):
        try:
            value = operator.index(value)
        except TypeError:
            pass
        else:
            if low is not None and value < low:
                raise ValueError(f"{what} must be at least {low}, got {value}")
            return value
    raise TypeError(f"{what} must be an int, got {type(value).__name__}")


# The core's timeouts are below this (about 115 days): it turns a timeout
# into a deadline in nanoseconds, which a far longer (or infinite) one
# would overflow.
MAX_TIMEOUT = 1e7


def check_seconds(
    what: str, value: Any, *, zero: bool = False, below: float = float("inf")
) -> float:
    """``value`` as a float of seconds, positive (or 0 with ``zero``) and below
    ``below`` (finite where given), or TypeError / ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not (seconds >= 0 if zero else seconds > 0):  # NaN too
        raise ValueError(f"{what} must be {'>= 0' if zero else 'positive'}, got {seconds:g}")
    if seconds >= below:
        raise ValueError(f"{what} must be below {below:g} s, got {seconds:g}")
    return seconds


def check_served(what: str, rpc: Any, name: Any) -> None:
    """TypeError unless ``rpc`` is a moolib Rpc and ``name`` a str: the Rpc and the
    name that ``what`` (Publisher, Replay.serve) defines its functions under."""
    if not hasattr(rpc, "_define"):
        raise TypeError(f"{what} needs a moolib.Rpc, got {type(rpc).__name__}")
    if not isinstance(name, str):
        raise TypeError(f"{what}: name must be a str, got {type(name).__name__}")
