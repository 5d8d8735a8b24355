"""moolib: a communications library for distributed RL and ML training.

The core (transports, framing, RPC, group membership, all-reduce) is C++17 in
moolib/core; this package is its Python API, compatible with the original moolib.
"""

from __future__ import annotations

import atexit
import logging as _logging
from typing import TYPE_CHECKING, Any

from . import _core
from . import errors as errors  # moolib.errors, with `import moolib` alone
from ._checks import check_int as _check_int
from .accumulator import Accumulator
from .batcher import Batcher
from .envpool import EnvPool, EnvStepperFuture
from .errors import ModelMismatchError, ReplayError, RpcError, ShardUnavailableError
from .group import AllReduce, Broker, Group
from .publish import Publisher, Subscriber
from .replay import ReplayClient
from .rpc import Future, Queue, Rpc, set_auth_key

if TYPE_CHECKING:
    from .replay import Replay, ReplaySample

__all__ = [
    "Accumulator",
    "AllReduce",
    "Batcher",
    "Broker",
    "EnvPool",
    "EnvStepperFuture",
    "Future",
    "Group",
    "ModelMismatchError",
    "Publisher",
    "Queue",
    "Replay",
    "ReplayClient",
    "ReplayError",
    "ReplaySample",
    "Rpc",
    "RpcError",
    "Subscriber",
    "create_uid",
    "ShardUnavailableError",
    "set_auth_key",
    "set_log_level",
    "set_logging",
    "set_max_threads",
]


def __getattr__(name: str) -> Any:
    # moolib.replay imports its torch modules on first use, so that `import moolib`
    # (env workers, the broker, moolib.envs) does not pay torch's import.
    if name in ("Replay", "ReplaySample"):
        from . import replay

        value = getattr(replay, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_LEVELS = {"none": 0, "error": 1, "info": 2, "verbose": 3, "debug": 4}
_PY_LEVELS = {1: _logging.ERROR, 2: _logging.INFO, 3: _logging.DEBUG, 4: _logging.DEBUG}


def set_log_level(level: str | int) -> None:
    """Sets how much the core logs: "none", "error" (default), "info", "verbose", "debug"."""
    if isinstance(level, str):
        if level.lower() not in _LEVELS:
            raise ValueError(f"unknown log level {level!r}; known: {', '.join(_LEVELS)}")
        level = _LEVELS[level.lower()]
    _core.set_log_level(int(level))


def set_logging(logger: Any = None) -> None:
    """Sends core log lines to a ``logging.Logger`` (or the ``logging`` module,
    meaning the "moolib" logger) instead of stderr; None restores stderr."""
    if logger is None:
        _core.set_log_sink(None)
        return
    if logger is _logging:
        logger = _logging.getLogger("moolib")
    _core.set_log_sink(
        lambda level, message: logger.log(_PY_LEVELS.get(level, _logging.INFO), message)
    )


def set_max_threads(n: int) -> None:
    """Sets how many core threads run functions and callbacks at once.

    A thread blocked waiting for a call (a function in a nested ``sync()``)
    does not count: another is started in its place (up to a bound), so nested
    calls cannot exhaust the pool.
    """
    _core.set_max_threads(_check_int("max threads", n, low=1))


def create_uid() -> str:
    """A random 32-character hex string, e.g. for unique peer names."""
    return _core.create_uid()


# Threads of the core never outlive the interpreter: stop them (bounded) at exit.
atexit.register(_core.shutdown, 2.0)
