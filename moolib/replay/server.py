"""Serving a replay table over RPC: the functions a ``ReplayClient`` calls.

A served table answers four functions under its name (``insert``, ``sample``,
``update_priorities``, ``info``), and those with which a client on this host
passes items through its shared memory (moolib/replay/segments.py). Rate-limited
waits run on the serving peer, but never longer than the wait each call names
(the client asks for at most half its RPC timeout): a call that has to wait
longer returns what it did so far (the keys it inserted, the items it sampled)
and the client asks again for the rest. So a long wait never looks like a dead
peer, and nothing done before a wait ends is done twice or lost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from .._checks import check_served
from ..rpc import Rpc
from .segments import MappedSegments

if TYPE_CHECKING:
    from .schema import ReplaySample, Schema

__all__ = ["ServedTable", "serve"]

# A shared-memory call's answer where the table's layout is not the one the
# client laid its rows out for.
_OTHER_LAYOUT = "other layout"


class ServedTable(Protocol):
    """What ``serve`` asks of the table it serves: ``moolib.Replay`` is one.

    Named here, not taken from ``moolib.replay.table``, because the table
    imports this module (for ``Replay.serve``). Each wait is in seconds, at
    most that long on the table's rate limiter; a call that waited it out
    returns what it did so far, and never raises for the wait."""

    @property
    def schema(self) -> Schema | None:
        """The item layout, learned from the first insert; None before it."""

    def insert_some(self, items: Any, priorities: Any, wait: float) -> Any:
        """Inserts a prefix of the batch; returns its keys (int64)."""

    def insert_from_buffers(self, leaves: list, priorities: Any, keys: Any, wait: float) -> int:
        """Inserts from buffers in the table's layout (one per leaf, then the
        priorities as float64 or None), writes the keys (int64) to ``keys``;
        returns how many went in (a prefix)."""

    def sample_some(self, batch_size: int, wait: float) -> ReplaySample:
        """Samples up to ``batch_size`` items (possibly none)."""

    def sample_into_buffers(
        self, batch_size: int, outs: list, keys: Any, probs: Any, wait: float
    ) -> tuple[int, int]:
        """Samples up to ``batch_size`` items into buffers (one per leaf, and
        the keys' and probabilities'); returns (sampled, table size)."""

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Sets the priorities of ``keys``; returns how many were present."""

    def update_priorities_from_bytes(self, keys: Any, priorities: Any) -> int:
        """``update_priorities`` from buffers of int64 keys and float64 priorities."""

    def priority_mass(self) -> float:
        """The sum of the items' p**alpha (prioritized), else the size."""

    def info(self) -> dict:
        """The table's counters and settings, ``priority_mass`` and ``size`` among them."""


def serve(replay: ServedTable, rpc: Rpc, name: str) -> None:
    """Defines ``name/insert``, ``name/sample``, ``name/update_priorities`` and
    ``name/info`` on ``rpc``, answered by ``replay`` (and ``name/layout``,
    ``name/attach``, ``name/sample_into``, ``name/detach``, with which a
    ``ReplayClient`` on this host samples into its shared memory)."""
    check_served("Replay.serve", rpc, name)
    mapped = MappedSegments()

    def insert(items: Any, priorities: Any, wait: float) -> Any:
        return replay.insert_some(items, priorities, wait)

    def sample(batch_size: int, wait: float) -> tuple:
        return tuple(replay.sample_some(batch_size, wait)), replay.priority_mass()

    def update_priorities(keys: Any, priorities: Any) -> int:
        return replay.update_priorities(keys, priorities)

    def update_priorities_raw(keys: bytes, priorities: bytes) -> int:
        return replay.update_priorities_from_bytes(keys, priorities)

    def segment_rows(sid: int, rows: list, count: int, layout: str | None) -> list | str | None:
        """Views of ``count`` items' rows in segment ``sid``: each leaf's, then
        two of 8 bytes an item, starting where ``rows`` says. None: the segment
        is not mapped; ``_OTHER_LAYOUT``: the rows are laid out for items
        (``layout``, a digest) that are not this table's."""
        schema = _layout_of(replay, layout)
        if schema is None:
            return _OTHER_LAYOUT
        view = mapped.get(sid)
        if view is None:
            return None
        sizes = [*schema.item_bytes, 8, 8]
        if len(rows) != len(sizes):
            raise ValueError(f"replay: {len(rows)} offsets for {len(sizes)} leaves")
        outs = []
        for start, item_bytes in zip(rows, sizes, strict=True):
            end = start + count * item_bytes
            if start < 0 or end > len(view):
                raise ValueError(
                    f"replay: bytes [{start}, {end}) outside the segment of {len(view)}"
                )
            outs.append(view[start:end])
        return outs

    def insert_from(
        sid: int,
        rows: list,
        prioritized: bool,
        count: int,
        wait: float,
        layout: str | None = None,
    ) -> int | str | None:
        """Inserts ``count`` items from segment ``sid``: ``rows`` holds the byte
        offset of each leaf's rows, then the priorities' and the keys' (written
        here). Returns how many went in; None: the segment is not mapped;
        ``_OTHER_LAYOUT``: the items are in a layout (``layout``, a digest)
        that is not this table's."""
        views = segment_rows(sid, rows, count, layout)
        if not isinstance(views, list):
            return views
        prio = views[-2] if prioritized else None
        return replay.insert_from_buffers(views[:-2], prio, views[-1], wait)

    def layout() -> dict | None:
        schema = replay.schema
        return None if schema is None else schema.to_json()

    def sample_into(
        sid: int,
        rows: list,
        count: int,
        wait: float,
        keys: bytes | None = None,
        priorities: bytes | None = None,
        layout: str | None = None,
    ) -> tuple | str | None:
        """Samples ``count`` items into segment ``sid``: ``rows`` holds the byte
        offset where each leaf's rows start, then the keys' and the
        probabilities'. None: the segment is not mapped (attach it again);
        ``_OTHER_LAYOUT``: the client's rows are laid out for items
        (``layout``, a digest) that are not this table's.
        ``keys`` and ``priorities`` (int64 and float64 bytes): a priority
        update the client deferred, applied before the draw, as if it had
        been its own call just before."""
        if keys is not None:
            replay.update_priorities_from_bytes(keys, priorities)
        outs = segment_rows(sid, rows, count, layout)
        if not isinstance(outs, list):
            return outs
        done, size = replay.sample_into_buffers(count, outs[:-2], outs[-2], outs[-1], wait)
        return done, size, replay.priority_mass()

    rpc.define(f"{name}/insert", insert)
    rpc.define(f"{name}/sample", sample)
    rpc.define(f"{name}/update_priorities", update_priorities)
    rpc.define(f"{name}/info", replay.info)
    rpc.define(f"{name}/layout", layout)
    rpc.define(f"{name}/attach", mapped.attach)
    rpc.define(f"{name}/sample_into", sample_into)
    rpc.define(f"{name}/detach", mapped.detach)
    rpc.define(f"{name}/insert_from", insert_from)
    rpc.define(f"{name}/update_priorities_raw", update_priorities_raw)


def _layout_of(replay: ServedTable, layout: str | None) -> Any:
    """The table's layout for a shared-memory call made for ``layout`` (a
    digest); None where the table has another one, or none yet (its peer
    restarted with a fresh table, say): the client then learns it anew."""
    schema = replay.schema
    if layout is not None:
        return schema if schema is not None and schema.digest == layout else None
    if schema is None:
        raise RuntimeError("replay: shared memory calls before the table has items")
    return schema
