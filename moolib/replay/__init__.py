"""The replay table (Ape-X, R2D2) and its use over RPC, one module per part:

- ``table``: ``Replay``, the table's Python API over the core (moolib/core/replay/table.h);
- ``schema``: the item layout a table learns from its first insert, and
  ``ReplaySample``, the batch a sample returns;
- ``server``: ``serve``, which answers other peers' clients for a table (any
  with the methods of its ``ServedTable`` protocol);
- ``client``: ``ReplayClient``, which inserts into and samples from tables
  served by other peers, sharded;
- ``segments``: the shared memory a client and a serving table on one host
  pass items through.

Its errors are in ``moolib.errors``. ``Replay`` and ``ReplaySample`` work on
torch tensors: they are imported on first use, so that ``import moolib`` (env
workers, the broker) does not pay torch's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ReplayError, ShardUnavailableError
from .client import ReplayClient
from .server import ServedTable, serve

if TYPE_CHECKING:
    from .schema import ReplaySample
    from .table import Replay

__all__ = [
    "Replay",
    "ReplayClient",
    "ReplayError",
    "ReplaySample",
    "ServedTable",
    "ShardUnavailableError",
    "serve",
]

_LAZY = {"Replay": "table", "ReplaySample": "schema"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
