"""The replay table over RPC: serving a ``Replay`` and the sharded ``ReplayClient``.

A served table answers four functions under its name. Rate-limited waits run
on the serving peer, but never longer than half the caller's RPC timeout per
call: a call that has to wait longer returns what it did so far (the keys it
inserted, the items it sampled) and the client asks again for the rest. So a
long wait never looks like a dead peer, and nothing done before a wait ends is
done twice or lost.

Keys returned by a ``ReplayClient`` carry the shard in their top bits, so
``update_priorities`` routes each key back to the table that holds it.

Sampling on one host skips the RPC payload: the client owns shared memory
segments (memfd) that the serving peer maps once (through ``/proc/<pid>/fd``,
checked by a random token), and a sample call only names a segment and where
each leaf's rows go. The table gathers the items straight into the client's
memory (one copy, as in process), the reply is a few numbers, and the
returned tensors are views of the segment, which goes back to the client's
pool when the last of them is freed. Where the segment cannot be mapped (the
peers are on different hosts or in different pid namespaces) the client falls
back to samples sent as RPC replies.
"""

from __future__ import annotations

import collections
import mmap
import os
import random
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import nest
from .rpc import Rpc, RpcError

if TYPE_CHECKING:
    from .replay import Replay, ReplaySample

__all__ = ["ReplayClient", "ReplayError", "serve"]

# A client key: shard index in the top bits, the table's own key below.
_SHARD_SHIFT = 48
_LOCAL_MASK = (1 << _SHARD_SHIFT) - 1
# A shard that failed is left out of sampling for this long, then asked again.
_RETRY_AFTER = 5.0
# The serving peer unmaps a client's segment unused for this long (its client
# may be gone); a client that comes back maps it again.
_SEGMENT_IDLE = 30.0
# Every leaf's rows start at a multiple of this in a segment: aligned for
# every dtype, and on separate cache lines.
_ALIGN = 64
# Free segments a client keeps for its next samples.
_FREE_SEGMENTS = 4
_MEMFD_NAME = "moolib-replay"
# Segments (each an open fd) a client has at most, held samples included.
_MAX_SEGMENTS = 64


class ReplayError(RuntimeError):
    """A replay shard could not be reached or refused a call; names the peer."""


class _Mapped:
    """The serving side's mappings of its clients' shared memory segments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next_id = 0
        # id -> [uint8 array over the mapping, last use (monotonic)]
        self._segments: dict[int, list] = {}

    def attach(self, pid: int, fd: int, size: int, token: bytes) -> int | None:
        """Maps the client's segment; None where it is not this host's (or not
        the segment the client means: the token differs)."""
        path = f"/proc/{int(pid)}/fd/{int(fd)}"
        try:
            # Only the client's replay segments, never another file it holds.
            if not os.readlink(path).startswith(f"/memfd:{_MEMFD_NAME}"):
                return None
            handle = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if os.fstat(handle).st_size < size:
                return None
            view = np.frombuffer(mmap.mmap(handle, size), dtype=np.uint8)
        except (OSError, ValueError):
            return None
        finally:
            os.close(handle)  # the mapping keeps the memory
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
        with self._lock:
            entry = self._segments.get(sid)
            if entry is None:
                return None
            entry[1] = time.monotonic()
            return entry[0]

    def detach(self, ids: list[int]) -> None:
        with self._lock:
            for sid in ids:
                self._segments.pop(sid, None)


def serve(replay: Replay, rpc: Rpc, name: str) -> None:
    """Defines ``name/insert``, ``name/sample``, ``name/update_priorities`` and
    ``name/info`` on ``rpc``, answered by ``replay`` (and ``name/layout``,
    ``name/attach``, ``name/sample_into``, ``name/detach``, with which a
    ``ReplayClient`` on this host samples into its shared memory)."""
    mapped = _Mapped()

    def insert(items: Any, priorities: Any, wait: float) -> Any:
        return replay._insert_some(items, priorities, wait)

    def sample(batch_size: int, wait: float) -> tuple:
        return tuple(replay._sample_some(batch_size, wait)), replay._mass()

    def update_priorities(keys: Any, priorities: Any) -> int:
        return replay.update_priorities(keys, priorities)

    def update_priorities_raw(keys: bytes, priorities: bytes) -> int:
        return replay._update_priorities_raw(keys, priorities)

    def outputs(sid: int, rows: list, sizes: list, count: int) -> list | None:
        view = mapped.get(sid)
        if view is None:
            return None
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

    def insert_from(sid: int, rows: list, prioritized: bool, count: int, wait: float) -> int | None:
        """Inserts ``count`` items from segment ``sid``: ``rows`` holds the byte
        offset of each leaf's rows, then the priorities' and the keys' (written
        here). Returns how many went in; None: the segment is not mapped."""
        schema = _layout_of(replay)
        views = outputs(sid, rows, [*schema.item_bytes, 8, 8], count)
        if views is None:
            return None
        prio = views[-2] if prioritized else None
        return replay._insert_into(views[:-2], prio, views[-1], wait)

    def layout() -> dict | None:
        schema = replay._schema
        return None if schema is None else schema.to_json()

    def sample_into(sid: int, rows: list, count: int, wait: float) -> tuple | None:
        """Samples ``count`` items into segment ``sid``: ``rows`` holds the byte
        offset where each leaf's rows start, then the keys' and the
        probabilities'. None: the segment is not mapped (attach it again)."""
        schema = _layout_of(replay)
        outs = outputs(sid, rows, [*schema.item_bytes, 8, 8], count)
        if outs is None:
            return None
        done, size = replay._sample_into(count, outs[:-2], outs[-2], outs[-1], wait)
        return done, size, replay._mass()

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


def _layout_of(replay: Replay) -> Any:
    schema = replay._schema
    if schema is None:
        raise RuntimeError("replay: shared memory calls before the table has items")
    return schema


class _Segment:
    """A client's shared memory for samples: a memfd it maps, and the ids under
    which serving peers mapped it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self.view = np.frombuffer(mmap.mmap(self.fd, size), dtype=np.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.token = os.urandom(16)
        self.ids: dict[int, int] = {}  # shard index -> the serving peer's id
        self._closer = weakref.finalize(self, os.close, self.fd)

    def close(self) -> None:
        """Closes the fd (the memory lives while a mapping or view does)."""
        self._closer()


class _Shard:
    def __init__(self, index: int, peer: str, name: str) -> None:
        self.index = index
        self.peer = peer
        self.name = name
        self.mass = 0.0
        self.failed_at: float | None = None
        # Whether it maps this client's segments: None until tried.
        self.shared: bool | None = None

    def describe(self) -> str:
        return f"replay '{self.name}' on peer '{self.peer}'"


class _Pending:
    """A sample asked for: where its parts go, and the shards' answers to come."""

    def __init__(
        self,
        batch_size: int,
        live: list[_Shard],
        counts: list[int],
        deadline: float,
        offsets: list[int],
        nbytes: int,
        sizes: list[int],
    ) -> None:
        self.batch_size = batch_size
        self.live = live
        self.counts = counts
        self.deadline = deadline
        self.offsets = offsets
        self.nbytes = nbytes
        self.sizes = sizes
        self.segment: _Segment
        self.futures: list[Any] = []

    def rows(self, row: int) -> list[int]:
        """Where item ``row`` of each leaf, its key and its probability go."""
        return [o + row * b for o, b in zip(self.offsets, self.sizes, strict=True)]


class ReplayClient:
    """Inserts into and samples from replay tables served by other peers.

    ``shards`` is a list of ``(peer, name)`` pairs (or one pair). Inserts go to
    the shards in turn; a sample draws from every live shard in proportion to
    its priority mass (its size for uniform tables), so the probabilities it
    returns are those of the union of the shards. ``timeout`` bounds each call,
    rate-limited waits included.

    With ``shared_memory`` (the default), shards on this host write samples
    straight into this client's shared memory; the sampled tensors are then
    views of it, valid as long as they live (their memory is reused only
    after they are freed). With ``prefetch`` as well, each ``sample()`` asks
    for the next batch of the same size before it returns, so the shards draw
    it while the caller works on this one (as Reverb's samplers do): that
    batch is drawn before the caller's next ``update_priorities``.
    """

    def __init__(
        self,
        rpc: Rpc,
        shards: Sequence[tuple[str, str]] | tuple[str, str],
        timeout: float = 60.0,
        seed: int | None = None,
        shared_memory: bool = True,
        prefetch: bool = False,
    ) -> None:
        if isinstance(shards, tuple) and len(shards) == 2 and isinstance(shards[0], str):
            shards = [shards]
        if not shards:
            raise ValueError("ReplayClient needs at least one (peer, name) shard")
        self._rpc = rpc
        self._shards = [_Shard(i, peer, name) for i, (peer, name) in enumerate(shards)]
        self._timeout = float(timeout)
        self._rng = random.Random(seed)
        self._next_insert = 0
        self._lock = threading.Lock()
        self._shared_memory = bool(shared_memory)
        self._schema: Any = None  # the tables' item layout, once one has items
        # Segments no sample uses; a sample's tensors give theirs back when
        # freed (any thread), so these are deques, not lists under a lock.
        self._free: collections.deque[_Segment] = collections.deque()
        self._unmap: collections.deque[tuple[int, int]] = collections.deque()
        self._prefetch = bool(prefetch)
        self._open_segments = 0
        self._pending: _Pending | None = None

    # Each call to a shard waits at most this long on the serving peer, so the
    # reply comes well within the RPC timeout.
    def _wait_per_call(self, deadline: float) -> float:
        return max(0.0, min(deadline - time.monotonic(), self._rpc.get_timeout() / 2))

    def _call(self, shard: _Shard, fn: str, *args: Any) -> Any:
        try:
            result = self._rpc.sync(shard.peer, f"{shard.name}/{fn}", *args)
        except RpcError as e:
            shard.failed_at = time.monotonic()
            raise ReplayError(f"{shard.describe()}: {fn} failed: {e}") from None
        shard.failed_at = None
        return result

    def _live(self) -> list[_Shard]:
        now = time.monotonic()
        return [s for s in self._shards if s.failed_at is None or now - s.failed_at > _RETRY_AFTER]

    def insert(self, items: Any, priorities: Any = None) -> Any:
        """Inserts a batch (leading dim N in every leaf) into the next shard; returns the keys."""
        import torch

        with self._lock:
            live = self._live() or self._shards
            shard = live[self._next_insert % len(live)]
            self._next_insert += 1
        deadline = time.monotonic() + self._timeout
        if self._shared_memory and self._schema is not None and shard.shared is not False:
            keys = self._insert_shared(shard, items, priorities, deadline)
            if keys is not None:
                return keys
        done: list[torch.Tensor] = []
        n = _batch_size(items)
        start = 0
        while True:
            rest = items if start == 0 else _rows_from(items, start)
            rest_p = None if priorities is None else priorities[start:]
            keys = self._call(shard, "insert", rest, rest_p, self._wait_per_call(deadline))
            done.append(torch.as_tensor(keys, dtype=torch.int64))
            start += len(keys)
            if start >= n:
                break
            if time.monotonic() >= deadline:
                raise _insert_timeout(shard, n, start, self._timeout)
        if self._shared_memory and self._schema is None:
            self._learn_layout(shard)
        return torch.cat(done) | (shard.index << _SHARD_SHIFT)

    def _insert_shared(
        self, shard: _Shard, items: Any, priorities: Any, deadline: float
    ) -> Any | None:
        """Inserts through this client's shared memory: the batch is copied
        into a segment that the shard maps and reads from. None: the shard
        cannot map it (another host), or this client holds all the segments
        it may; nothing was inserted."""
        import torch

        from .replay import _bytes_view

        try:
            leaves, n = self._schema.flatten(items)
        except (ValueError, TypeError) as e:
            # As the shard would have refused it (the same text, naming the leaf).
            raise ReplayError(
                f"{shard.describe()}: insert failed: {type(e).__name__}: {e}"
            ) from None
        if n <= 0:
            raise ValueError(f"replay insert of {n} items: a batch needs at least one")
        prioritized = priorities is not None
        if prioritized:
            p = torch.as_tensor(priorities, dtype=torch.float64).detach().cpu().reshape(-1)
            p = p.contiguous()
            if p.numel() != n:
                raise ValueError(f"replay insert: {p.numel()} priorities for a batch of {n} items")
        offsets, nbytes, sizes = self._layout(n)
        segment = self._lease(nbytes)
        if segment is None:
            return None
        try:
            if self._attach(shard, segment) is None:
                self._give_back(segment)
                return None
            view = segment.view
            # numpy's copy is one memcpy; torch's copy_ splits a large one
            # over its threads, which wait for each other on a busy machine
            # (6x slower for an Atari batch in bench/replay.py).
            for t, o, b in zip(leaves, offsets, sizes, strict=False):
                np.copyto(view[o : o + n * b], _bytes_view(t).reshape(-1).view(np.uint8))
            if prioritized:
                np.copyto(view[offsets[-2] : offsets[-2] + n * 8].view(np.float64), p.numpy())
            start = 0
            while start < n:
                rows = [o + start * b for o, b in zip(offsets, sizes, strict=True)]
                wait = self._wait_per_call(deadline)
                sid = segment.ids[shard.index]
                done = self._call(shard, "insert_from", sid, rows, prioritized, n - start, wait)
                if done is None:  # the peer unmapped it meanwhile: map it again
                    del segment.ids[shard.index]
                    if self._attach(shard, segment) is None:
                        raise ReplayError(f"{shard.describe()}: cannot map this client's memory")
                    continue
                start += done
                if start < n and time.monotonic() >= deadline:
                    raise _insert_timeout(shard, n, start, self._timeout)
            keys = torch.from_numpy(view[offsets[-1] : offsets[-1] + n * 8].view(np.int64).copy())
        except BaseException:
            # A call that failed (a timeout) may still be reading it: never reused.
            self._drop(segment)
            raise
        self._give_back(segment)
        return keys | (shard.index << _SHARD_SHIFT) if shard.index else keys

    def _learn_layout(self, shard: _Shard) -> None:
        from .replay import _Schema

        try:
            layout = self._call(shard, "layout")
        except ReplayError:
            return  # asked again after the next insert
        if layout is not None:
            self._schema = _Schema.from_json(layout)

    def sample(self, batch_size: int) -> ReplaySample:
        """Samples ``batch_size`` items across the live shards."""
        import torch

        from .replay import ReplaySample

        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if self._shared_memory:
            self._flush_unmap()
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is not None and pending.batch_size != batch_size:
                # Drawn for another batch size: it is dropped (its draws count
                # for the rate limiter as any other).
                self._finish_shared(pending)
                pending = None
            if pending is None:
                pending = self._start_shared(batch_size)
            if pending is not None:
                sample = self._finish_shared(pending)
                if self._prefetch:
                    self._prefetch_next(batch_size)
                return sample
        live = self._live()
        if not live:
            raise self._none_live()
        counts = self._split(batch_size, live)
        deadline = time.monotonic() + self._timeout
        parts = []
        for shard, count in zip(live, counts, strict=True):
            got = 0
            while got < count:
                (items, keys, probs, size), mass = self._call(
                    shard, "sample", count - got, self._wait_per_call(deadline)
                )
                shard.mass = mass
                if len(keys):
                    parts.append((shard, items, keys, probs, size))
                    got += len(keys)
                elif time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{shard.describe()}: sample of {count} timed out after "
                        f"{self._timeout:.1f} s ({got} sampled; the rate limiter waits "
                        "for inserts)"
                    )
        total_mass = sum(s.mass for s in live)
        # One part (one shard, one call) is already the batch: no copy.
        items = parts[0][1] if len(parts) == 1 else nest.cat([p[1] for p in parts])
        keys = torch.cat([torch.as_tensor(p[2]) | (p[0].index << _SHARD_SHIFT) for p in parts])
        # An item's probability in the union: its shard's share of the mass
        # times its probability within the shard.
        probs = torch.cat(
            [torch.as_tensor(p[3], dtype=torch.float64) * (p[0].mass / total_mass) for p in parts]
        )
        size = sum(p[4] for p in {id(p[0]): p for p in parts}.values())
        return ReplaySample(items, keys, probs, size)

    # Sampling into shared memory.

    def _shared_layout(self, live: list[_Shard]) -> bool:
        """Whether every live shard can sample into this client's memory."""
        if any(s.shared is False for s in live):
            return False
        if self._schema is None:
            from .replay import _Schema

            layout = self._call(live[0], "layout")
            if layout is None:
                return False  # no items yet: the first sample waits the usual way
            self._schema = _Schema.from_json(layout)
        return True

    def _layout(self, batch_size: int) -> tuple[list[int], int, list[int]]:
        """Where each leaf's rows, the keys and the probabilities start in a
        segment for ``batch_size`` items, the bytes it needs, and each one's
        bytes per item."""
        offsets = []
        end = 0
        sizes = [*self._schema.item_bytes, 8, 8]
        for item_bytes in sizes:
            offsets.append(end)
            end = -(-(end + batch_size * item_bytes) // _ALIGN) * _ALIGN
        return offsets, max(end, 16), sizes

    def _lease(self, nbytes: int) -> _Segment | None:
        """A segment of at least ``nbytes`` for one call; None when this client
        already has _MAX_SEGMENTS open (samples held by the caller keep theirs):
        that call goes through RPC payloads, and no fd limit is reached."""
        while True:
            try:
                segment = self._free.pop()
            except IndexError:
                if self._open_segments >= _MAX_SEGMENTS:
                    return None
                # Whole pages, and room for a slightly larger batch later.
                size = -(-(nbytes + nbytes // 8) // mmap.PAGESIZE) * mmap.PAGESIZE
                self._open_segments += 1
                return _Segment(size)
            if segment.size >= nbytes:
                return segment
            self._drop(segment)

    def _give_back(self, segment: _Segment) -> None:
        self._free.append(segment)
        while len(self._free) > _FREE_SEGMENTS:
            try:
                self._drop(self._free.popleft())
            except IndexError:
                break

    def _drop(self, segment: _Segment) -> None:
        self._unmap.extend(segment.ids.items())
        segment.close()
        # Not under a lock (this runs in finalizers, on any thread): the
        # count may be off by a race, and it is only a bound.
        self._open_segments -= 1

    def _flush_unmap(self) -> None:
        by_shard: dict[int, list[int]] = {}
        while self._unmap:
            try:
                index, sid = self._unmap.popleft()
            except IndexError:
                break
            by_shard.setdefault(index, []).append(sid)
        for index, ids in by_shard.items():
            try:
                self._call(self._shards[index], "detach", ids)
            except ReplayError:
                pass  # a shard that is gone holds nothing; one that is back expires them

    def _attach(self, shard: _Shard, segment: _Segment) -> int | None:
        sid = segment.ids.get(shard.index)
        if sid is None:
            segment.view[: len(segment.token)] = np.frombuffer(segment.token, dtype=np.uint8)
            sid = self._call(shard, "attach", os.getpid(), segment.fd, segment.size, segment.token)
            shard.shared = sid is not None
            if sid is not None:
                segment.ids[shard.index] = sid
        return sid

    def _none_live(self) -> ReplayError:
        return ReplayError(
            "no replay shard is reachable: " + ", ".join(s.describe() for s in self._shards)
        )

    def _prefetch_next(self, batch_size: int) -> None:
        try:
            pending = self._start_shared(batch_size)
        except ReplayError:
            return  # the next sample asks again, and raises if it must
        with self._lock:
            if self._pending is None:
                self._pending = pending
                return
        self._finish_shared(pending)  # another thread prefetched meanwhile

    def _start_shared(self, batch_size: int) -> _Pending | None:
        """Leases a segment and asks every live shard for its part of a sample
        into it (without waiting for the answers). None: this client samples
        through replies (the tables have no items yet, or cannot map it)."""
        live = self._live()
        if not live:
            raise self._none_live()
        if not self._shared_layout(live):
            return None
        counts = self._split(batch_size, live)
        deadline = time.monotonic() + self._timeout
        pending = _Pending(batch_size, live, counts, deadline, *self._layout(batch_size))
        segment = self._lease(pending.nbytes)
        if segment is None:
            return None
        pending.segment = segment
        try:
            for shard in live:
                if self._attach(shard, pending.segment) is None:
                    self._give_back(pending.segment)
                    return None
            row = 0
            for shard, count in zip(live, counts, strict=True):
                future = None
                if count:
                    future = self._rpc.async_(
                        shard.peer,
                        f"{shard.name}/sample_into",
                        pending.segment.ids[shard.index],
                        pending.rows(row),
                        count,
                        self._wait_per_call(deadline),
                    )
                pending.futures.append(future)
                row += count
        except BaseException:
            self._drop(pending.segment)  # an asked part may still be written
            raise
        return pending

    def _finish_shared(self, pending: _Pending) -> ReplaySample:
        """Waits for the parts of a sample started by _start_shared, asks again
        for what the rate limiter held back, and returns the batch."""
        import torch

        from .replay import ReplaySample

        segment = pending.segment
        try:
            row = 0
            table_size = 0
            for shard, count, future in zip(
                pending.live, pending.counts, pending.futures, strict=True
            ):
                got = 0
                size = 0
                while got < count:
                    if future is not None:
                        try:
                            result = future.result()
                        except RpcError as e:
                            shard.failed_at = time.monotonic()
                            raise ReplayError(
                                f"{shard.describe()}: sample_into failed: {e}"
                            ) from None
                        shard.failed_at = None
                        future = None
                    else:
                        result = self._call(
                            shard,
                            "sample_into",
                            segment.ids[shard.index],
                            pending.rows(row + got),
                            count - got,
                            self._wait_per_call(pending.deadline),
                        )
                    if result is None:  # the peer unmapped it meanwhile: map it again
                        del segment.ids[shard.index]
                        if self._attach(shard, segment) is None:
                            raise ReplayError(
                                f"{shard.describe()}: cannot map this client's memory"
                            )
                        continue
                    done, size, shard.mass = result
                    got += done
                    if got < count and not done and time.monotonic() >= pending.deadline:
                        raise TimeoutError(
                            f"{shard.describe()}: sample of {count} timed out after "
                            f"{self._timeout:.1f} s ({got} sampled; the rate limiter waits "
                            "for inserts)"
                        )
                row += count
                table_size += size
        except BaseException:
            # A call that failed (a timeout) may still write into it: never reused.
            self._drop(segment)
            raise
        batch_size = pending.batch_size
        offsets = pending.offsets
        # The segment comes back to this client when the last view of it is freed.
        base = segment.view[: pending.nbytes]
        weakref.finalize(base, self._give_back, segment)
        whole = torch.from_numpy(base)
        schema = self._schema
        outs = [
            whole[o : o + batch_size * b].view(d).view(batch_size, *shape)
            for o, b, d, shape in zip(
                offsets[:-2], schema.item_bytes, schema.dtypes, schema.shapes, strict=True
            )
        ]
        keys = whole[offsets[-2] : offsets[-2] + batch_size * 8].view(torch.int64)
        probs = whole[offsets[-1] : offsets[-1] + batch_size * 8].view(torch.float64)
        if len(pending.live) > 1:
            total_mass = sum(s.mass for s in pending.live)
            row = 0
            for shard, count in zip(pending.live, pending.counts, strict=True):
                keys[row : row + count] |= shard.index << _SHARD_SHIFT
                probs[row : row + count] *= shard.mass / total_mass
                row += count
        items = nest.pack_as(schema.structure, outs)
        return ReplaySample(items, keys, probs, table_size)

    def _split(self, batch_size: int, live: list[_Shard]) -> list[int]:
        if len(live) == 1:
            return [batch_size]
        if any(s.mass <= 0 for s in live):
            for s in live:
                s.mass = float(self._call(s, "info")["priority_mass"])
        weights = [s.mass for s in live]
        if sum(weights) <= 0:
            weights = [1.0] * len(live)
        counts = [0] * len(live)
        for i in self._rng.choices(range(len(live)), weights=weights, k=batch_size):
            counts[i] += 1
        return counts

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Routes each key to its shard; keys evicted meanwhile are ignored."""
        import torch

        keys = torch.as_tensor(keys, dtype=torch.int64).reshape(-1)
        priorities = torch.as_tensor(priorities, dtype=torch.float64).reshape(-1)
        if keys.numel() != priorities.numel():
            raise ValueError(
                f"replay update_priorities: {keys.numel()} keys but {priorities.numel()} priorities"
            )
        if len(self._shards) == 1 and keys.numel() and int(keys.max()) <= _LOCAL_MASK:
            if int(keys.min()) >= 0:
                # One shard: the keys go as they are, as bytes (no tensors to pickle).
                return self._call(
                    self._shards[0],
                    "update_priorities_raw",
                    keys.detach().cpu().contiguous().numpy().tobytes(),
                    priorities.detach().cpu().contiguous().numpy().tobytes(),
                )
        shard_of = keys >> _SHARD_SHIFT
        updated = 0
        for index in shard_of.unique().tolist():
            if not 0 <= index < len(self._shards):
                raise ValueError(f"key with shard index {index}: not a key of this client")
            mask = shard_of == index
            updated += self._call(
                self._shards[index],
                "update_priorities",
                keys[mask] & _LOCAL_MASK,
                priorities[mask],
            )
        return updated

    def info(self) -> list[dict]:
        """Each shard's ``info()``, with its peer and name."""
        return [{"peer": s.peer, "name": s.name, **self._call(s, "info")} for s in self._shards]


def _insert_timeout(shard: _Shard, n: int, done: int, timeout: float) -> TimeoutError:
    return TimeoutError(
        f"{shard.describe()}: insert of {n} items timed out after {timeout:.1f} s with "
        f"{done} inserted (the rate limiter waits for samplers)"
    )


def _rows_from(items: Any, start: int) -> Any:
    return nest.map_structure(lambda x: x[start:], items)


def _batch_size(items: Any) -> int:
    leaves = nest.flatten(items)
    if not leaves:
        raise ValueError("an insert needs at least one leaf")
    return len(leaves[0])
