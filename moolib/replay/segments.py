"""The shared memory a ``ReplayClient`` and a serving table pass items through
on one host.

The client owns the segments (sealed memfds, ``Segment``) and keeps a pool of
them (``SegmentPool``); the serving peer maps each one once (through
``/proc/<pid>/fd``, checked by a random token at its start) and keeps its
mappings (``MappedSegments``) until they go unused. A call then only names a
segment and where each leaf's rows are in it (``segment_layout``).
"""

from __future__ import annotations

import collections
import mmap
import os
import secrets
import threading
import time
from collections.abc import Sequence

import numpy as np

from .._core import ShmRegion

__all__ = ["MappedSegments", "Segment", "SegmentPool", "segment_layout"]

# The serving peer unmaps a client's segment unused for this long (its client
# may be gone); a client that comes back maps it again.
_SEGMENT_IDLE = 30.0
# Every leaf's rows start at a multiple of this in a segment: aligned for
# every dtype, and on separate cache lines. The first _ALIGN bytes are the
# segment's token, never rows.
_ALIGN = 64
# Free segments a client keeps for its next samples.
_FREE_SEGMENTS = 4
_MEMFD_NAME = "moolib-replay"
# Segments (each an open fd) a client has at most, held samples included.
_MAX_SEGMENTS = 64


class MappedSegments:
    """The serving side's mappings of its clients' shared memory segments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Ids start where a table of an earlier life of this peer (or another
        # serving peer) is unlikely to have been: a client naming a mapping it
        # made there must meet no mapping here, least of all another client's.
        self._next_id = secrets.randbits(48) << 8
        # id -> [uint8 array over the mapping, last use (monotonic)]
        self._segments: dict[int, list] = {}

    def attach(self, pid: int, fd: int, size: int, token: bytes) -> int | None:
        """Maps the client's segment; None where it is not this host's (or not
        the segment the client means: the token differs)."""
        pid, fd, size = int(pid), int(fd), int(size)
        if not (0 < pid < 1 << 32 and 0 <= fd < 1 << 31 and size > 0):
            return None
        try:
            # Only the client's replay segments, never another file it holds.
            region = ShmRegion.open_peer(pid, fd, _MEMFD_NAME, size, writable=True)
        except OSError:
            return None
        view = np.frombuffer(region, dtype=np.uint8)  # keeps the mapping
        if view[: len(token)].tobytes() != token:
            return None
        now = time.monotonic()
        with self._lock:
            # Unused mappings of clients that may be gone go first; dropping
            # one never unmaps memory a sample is writing (its views hold it).
            for sid in [k for k, v in self._segments.items() if now - v[1] > _SEGMENT_IDLE]:
                del self._segments[sid]
            self._next_id += 1
            self._segments[self._next_id] = [view, now]
            return self._next_id

    def get(self, sid: int) -> np.ndarray | None:
        """The mapping ``attach`` returned ``sid`` for; None once it was let go."""
        with self._lock:
            entry = self._segments.get(sid)
            if entry is None:
                return None
            entry[1] = time.monotonic()
            return entry[0]

    def detach(self, ids: list[int]) -> None:
        """Lets go of the mappings ``ids`` (a client dropped those segments)."""
        with self._lock:
            for sid in ids:
                self._segments.pop(sid, None)


class Segment:
    """A client's shared memory for samples: a memfd it maps, and the ids under
    which serving peers mapped it."""

    def __init__(self, size: int) -> None:
        self.size = size
        # Sealed: the serving peer maps it only so (ShmRegion.open_peer), as a region
        # that could shrink under it would fault there.
        self.region = ShmRegion.create(_MEMFD_NAME, size, sealed=True)
        self.view = np.frombuffer(self.region, dtype=np.uint8)
        self.token = os.urandom(16)
        self.ids: dict[int, int] = {}  # shard index -> the serving peer's id

    def close(self) -> None:
        """Closes the fd (the memory lives while a mapping or view does)."""
        self.region.close()


class SegmentPool:
    """A client's segments: those free for its next call, and the serving
    peers' ids of the ones it dropped, for it to tell them to let go."""

    def __init__(self, max_inflight: int) -> None:
        # Segments no sample uses; a sample's tensors give theirs back when
        # freed (any thread), so these are deques, not lists under a lock.
        self._free: collections.deque[Segment] = collections.deque()
        self._unmap: collections.deque[tuple[int, int]] = collections.deque()
        self._open = 0
        # Each in-flight insert holds a segment: the pool keeps that many.
        self._keep_free = _FREE_SEGMENTS + max_inflight

    def lease(self, nbytes: int) -> Segment | None:
        """A segment of at least ``nbytes`` for one call; None when this client
        already has _MAX_SEGMENTS open (samples held by the caller keep theirs):
        that call goes through RPC payloads, and no fd limit is reached."""
        while True:
            try:
                segment = self._free.pop()
            except IndexError:
                if self._open >= _MAX_SEGMENTS:
                    return None
                # Whole pages, and room for a slightly larger batch later.
                size = -(-(nbytes + nbytes // 8) // mmap.PAGESIZE) * mmap.PAGESIZE
                self._open += 1
                return Segment(size)
            if segment.size >= nbytes:
                return segment
            self.drop(segment)

    def give_back(self, segment: Segment) -> None:
        """Returns a segment no call writes into or reads from any more."""
        self._free.append(segment)
        while len(self._free) > self._keep_free:
            try:
                self.drop(self._free.popleft())
            except IndexError:
                break

    def drop(self, segment: Segment) -> None:
        """Closes a segment that is never used again (a failed call may still
        write into it); its mappings are let go by ``unmapped``'s taker."""
        self._unmap.extend(segment.ids.items())
        segment.close()
        # Not under a lock (this runs in finalizers, on any thread): the
        # count may be off by a race, and it is only a bound.
        self._open -= 1

    def unmapped(self) -> dict[int, list[int]]:
        """The serving peers' ids of the segments dropped since the last call,
        by shard index: theirs to let go."""
        by_shard: dict[int, list[int]] = {}
        while self._unmap:
            try:
                index, sid = self._unmap.popleft()
            except IndexError:
                break
            by_shard.setdefault(index, []).append(sid)
        return by_shard


def segment_layout(item_bytes: Sequence[int], batch_size: int) -> tuple[list[int], int, list[int]]:
    """Where each leaf's rows (of ``item_bytes`` bytes an item), the keys and
    the probabilities (or priorities) start in a segment for ``batch_size``
    items, the bytes it needs, and each one's bytes per item."""
    offsets = []
    # The first bytes hold the token a serving peer checks when it maps the
    # segment, which may happen mid-call (a restarted peer maps it again
    # while another shard's rows, or an insert's, are already there).
    end = _ALIGN
    sizes = [*item_bytes, 8, 8]
    for size in sizes:
        offsets.append(end)
        end = -(-(end + batch_size * size) // _ALIGN) * _ALIGN
    return offsets, max(end, 16), sizes
