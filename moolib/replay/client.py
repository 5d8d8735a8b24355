"""The sharded ``ReplayClient``: inserts into and samples from replay tables
served by other peers (moolib/replay/server.py).

Keys returned by a ``ReplayClient`` carry the shard in their top bits, so
``update_priorities`` routes each key back to the table that holds it.

Sampling on one host skips the RPC payload: the client owns shared memory
segments (moolib/replay/segments.py) that the serving peer maps once, and a
sample call only names a segment and where each leaf's rows go. The table
gathers the items straight into the client's memory (one copy, as in
process), the reply is a few numbers, and the returned tensors are views of
the segment, which goes back to the client's pool when the last of them is
freed. Inserts go the other way through the same segments. Where the segment
cannot be mapped (the peers are on different hosts or in different pid
namespaces) the client falls back to items sent as RPC payloads and replies.
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import nest
from .._checks import check_seconds
from ..errors import (
    RemoteError,
    ReplayError,
    ReplayTimeoutError,
    RpcError,
    ShardTimeoutError,
    ShardUnavailableError,
)
from ..rpc import Rpc
from .segments import Segment, SegmentPool, segment_layout

if TYPE_CHECKING:
    from .schema import ReplaySample

__all__ = ["ReplayClient"]

# A client key: shard index in the top bits, the table's own key (56 bits:
# its incarnation, then its insertion counter) below.
_SHARD_SHIFT = 56
_LOCAL_MASK = (1 << _SHARD_SHIFT) - 1
_MAX_SHARDS = 1 << (63 - _SHARD_SHIFT)
# A shard that is down is asked whether it is back (its ``info``) this often.
_PROBE_EVERY = 0.2


def _refused(error: RpcError) -> bool:
    """Whether the table answered the call with an error (it refused the
    input): the shard is there, as opposed to gone. Every other failure (a
    timeout, a lost connection, a peer not found, a function not defined
    there, this Rpc closed) means the call never got an answer from the table."""
    return isinstance(error, RemoteError)


class _LayoutChanged(ReplayError):
    """A shard's table no longer has the layout this client learned from it."""


class _Shard:
    def __init__(self, index: int, peer: str, name: str) -> None:
        self.index = index
        self.peer = peer
        self.name = name
        # Its priority mass and size as of its latest answer.
        self.mass = 0.0
        self.size = 0
        # Down: it did not answer a call, or its link closed after it had
        # answered (a killed peer): left out until a probe of it answers.
        self.down = False
        self.answered = False
        self.probe: Any = None  # the probe in flight (a Future), if any
        self.probed_at = 0.0
        # Whether it maps this client's segments: None until tried.
        self.shared: bool | None = None
        # Its table's item layout (a Schema), once learned from it: a
        # table without items has none yet, whatever the other shards hold.
        self.layout: Any = None

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
        self.segment: Segment
        self.futures: list[Any] = []
        # The deferred priority update each shard's call carries (or Nones).
        self.updates: list[tuple[Any, Any]] = []

    def rows(self, row: int) -> list[int]:
        """Where item ``row`` of each leaf, its key and its probability go."""
        return [o + row * b for o, b in zip(self.offsets, self.sizes, strict=True)]


class _InsertCall:
    """A batch on its way into a shard, and how much of it went in so far."""

    __slots__ = (
        "shard",
        "deadline",
        "n",
        "start",
        "future",
        "segment",
        "offsets",
        "sizes",
        "prioritized",
        "items",
        "priorities",
        "keys",
        "schema",
    )

    def __init__(self, shard: _Shard, deadline: float) -> None:
        self.shard = shard
        self.deadline = deadline
        self.n = 0
        self.start = 0  # rows inserted so far
        self.future: Any = None  # the call in flight, if any
        # Through shared memory: the segment, where each leaf's rows (then
        # the priorities' and keys') start in it, and their bytes per item.
        self.segment: Segment | None = None
        self.offsets: list[int] = []
        self.sizes: list[int] = []
        self.prioritized = False
        # Through the call's payload: the batch, and the keys of its parts.
        self.items: Any = None
        self.priorities: Any = None
        self.keys: list[Any] = []
        # The layout the batch was staged in (shared memory).
        self.schema: Any = None


class ReplayClient:
    """Inserts into and samples from replay tables served by other peers.

    ``shards`` is a list of ``(peer, name)`` pairs (or one pair). Inserts go to
    the shards in turn; a sample draws from every live shard in proportion to
    its priority mass (its size for uniform tables), so the probabilities it
    returns are those of the union of the shards, and so is its ``size``: the
    sum of the live shards' sizes (a shard not drawn from this time counts
    with its size as of its latest answer), whichever shards the batch came
    from. ``timeout`` bounds how long
    an insert or a sample waits on the tables' rate limiting (``min_size``,
    ``samples_per_insert``) before it raises ``TimeoutError``. A shard that
    does not answer (its link closed after it had answered: a killed peer,
    at once; or no reply within the Rpc's timeout) is down: it is left out
    of samples and inserts, which go on from the live shards, until a probe
    sent in the background (its ``info``) answers; then it is used again.
    ``ShardUnavailableError`` is raised only for a call in flight to a shard
    when it went (an insert then may or may not be in its table) and for a
    call that no live shard can serve (every shard down, or a client of one);
    the keys of a down shard count as not present in ``update_priorities``.
    A call that a table refuses (a NaN priority, an item of another layout)
    raises ``ReplayError`` with the table's message, and changes nothing
    else: that shard stays in use.

    With ``shared_memory`` (the default), shards on this host write samples
    straight into this client's shared memory; the sampled tensors are then
    views of it, valid as long as they live (their memory is reused only
    after they are freed). With ``prefetch`` as well, each ``sample()`` asks
    for the next batch of the same size before it returns, so the shards draw
    it while the caller works on this one (as Reverb's samplers do): that
    batch is drawn before the caller's next ``update_priorities``.

    For callers that do not need the replies: ``insert(..., block=False)``
    keeps up to ``max_inflight`` batches travelling at once, and
    ``update_priorities(..., block=False)`` sends the update with the next
    sample call to its shard (one round trip for both). ``flush()`` waits
    for the first and sends the second.
    """

    def __init__(
        self,
        rpc: Rpc,
        shards: Sequence[tuple[str, str]] | tuple[str, str],
        timeout: float = 60.0,
        seed: int | None = None,
        shared_memory: bool = True,
        prefetch: bool = False,
        max_inflight: int = 8,
    ) -> None:
        if isinstance(shards, tuple) and len(shards) == 2 and isinstance(shards[0], str):
            shards = [shards]
        if not shards:
            raise ValueError("ReplayClient needs at least one (peer, name) shard")
        if len(shards) > _MAX_SHARDS:
            raise ValueError(
                f"ReplayClient takes at most {_MAX_SHARDS} shards (the bits of a key above "
                f"the table's own), got {len(shards)}"
            )
        for shard in shards:
            if not (isinstance(shard, (tuple, list)) and len(shard) == 2):
                raise ValueError(f"ReplayClient: a shard is a (peer, name) pair, got {shard!r:.80}")
            if not all(isinstance(part, str) for part in shard):
                raise TypeError(f"ReplayClient: a shard's peer and name are str, got {shard!r:.80}")
        self._rpc = rpc
        self._shards = [_Shard(i, peer, name) for i, (peer, name) in enumerate(shards)]
        self._timeout = check_seconds("timeout", timeout)
        self._rng = random.Random(seed)
        self._next_insert = 0
        self._lock = threading.Lock()
        self._shared_memory = bool(shared_memory)
        # The layout of the first shard whose layout was learned: a batch
        # sampled into shared memory takes its structure (every shard drawn
        # from has the same, checked).
        self._schema: Any = None
        self._prefetch = bool(prefetch)
        self._pending: _Pending | None = None
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be at least 1, got {max_inflight}")
        self._max_inflight = int(max_inflight)
        self._segments = SegmentPool(self._max_inflight)
        self._inflight: collections.deque[_InsertCall] = collections.deque()
        # Deferred priority updates: shard index -> (int64 keys, float64
        # priorities) as bytes, sent with that shard's next sample call.
        self._updates: dict[int, tuple[bytes, bytes]] = {}

    # Each call to a shard waits at most this long on the serving peer, so the
    # reply comes well within the RPC timeout.
    def _wait_per_call(self, deadline: float) -> float:
        return max(0.0, min(deadline - time.monotonic(), self._rpc.get_timeout() / 2))

    def _call(self, shard: _Shard, fn: str, *args: Any) -> Any:
        if self._is_down(shard):
            # Not sent: a call to a peer with no link would wait for the Rpc's timeout.
            raise ShardUnavailableError(f"{shard.describe()}: {fn} not sent: the shard is down")
        try:
            result = self._rpc.sync(shard.peer, f"{shard.name}/{fn}", *args)
        except RpcError as e:
            raise self._failed(shard, fn, e) from e
        shard.answered = True
        return result

    def _failed(self, shard: _Shard, fn: str, error: RpcError) -> ReplayError:
        """The error to raise (from ``error``) for ``shard``'s failed call to
        ``fn``. Only a shard that did not answer is left out; one that refused
        the call (bad input) is healthy and stays in use."""
        message = f"{shard.describe()}: {fn} failed: {error}"
        if _refused(error):
            return ReplayError(message)
        self._set_down(shard)
        if isinstance(error, TimeoutError):
            return ShardTimeoutError(message)
        return ShardUnavailableError(message)

    def _set_down(self, shard: _Shard) -> None:
        shard.down = True
        # Its peer may come back with a fresh table: learned again then.
        shard.layout = None

    def _is_down(self, shard: _Shard) -> bool:
        """Whether ``shard`` is left out now. One whose link closed after it
        answered is down at once (its process ended), not after a call to it
        timed out; one that is down is back once a probe (``info``, sent in
        the background) answers."""
        if not shard.down:
            if shard.answered and not self._rpc._linked_to(shard.peer):
                self._set_down(shard)
            return shard.down
        probe = shard.probe
        if probe is not None and probe.done():
            shard.probe = None
            try:
                info = probe.result()
            except RpcError:
                pass  # asked again below
            else:
                shard.size = int(info["size"])
                shard.mass = float(info["priority_mass"])
                shard.down = False
                return False
        now = time.monotonic()
        if shard.probe is None and now - shard.probed_at >= _PROBE_EVERY:
            shard.probed_at = now
            try:
                shard.probe = self._rpc.async_(shard.peer, f"{shard.name}/info")
            except RuntimeError:
                pass  # this Rpc is closed: the shard stays down
        return True

    def _live(self) -> list[_Shard]:
        return [s for s in self._shards if not self._is_down(s)]

    def insert(self, items: Any, priorities: Any = None, *, block: bool = True) -> Any:
        """Inserts a batch (leading dim N in every leaf) into the next shard; returns the keys.

        With ``block=False`` the batch is sent and the call returns None at
        once, without waiting for the shard's reply: up to ``max_inflight``
        batches travel at the same time (then the oldest is waited for), and
        they may enter the table in any order among themselves. An in-flight
        batch that fails raises its error from this client's next ``insert``
        (after that call has sent its own batch, or with ``block`` inserted
        it: its keys are then not returned) or ``flush``, once the other
        batches in flight have been answered; every other batch goes in
        once. Through shared memory (a shard on this host) the batch is
        copied before this returns, and its tensors may be reused at once;
        sent as the call's payload (another host), it is read until the
        reply comes, so change it in place only after ``flush()``. Call
        ``flush()`` before dropping the client, or errors of the last
        batches go unseen.
        """
        # Room for this batch, and the errors of batches in flight. An earlier
        # batch's error never costs this one: it is raised once this batch
        # is sent (or in, with ``block``), so a caller who catches it and
        # goes on loses no good batch. Should this batch fail too, its own
        # error is raised, the earlier one chained to it.
        try:
            self._reap(wait=not block, keep=self._max_inflight - 1)
        except Exception:
            self._insert_one(items, priorities, block)
            raise
        return self._insert_one(items, priorities, block)

    def _insert_one(self, items: Any, priorities: Any, block: bool) -> Any:
        """Sends the batch to the next shard; with ``block`` waits for its keys."""
        for attempt in range(len(self._shards)):
            with self._lock:
                live = self._live()
                if not live:
                    raise self._none_live()
                shard = live[self._next_insert % len(live)]
                self._next_insert += 1
            try:
                call = self._start_insert(shard, items, priorities)
                break
            except ShardUnavailableError:
                # Nothing was sent (the shard went before it mapped the
                # batch's memory): the next live shard takes it.
                if attempt == len(self._shards) - 1:
                    raise
        # Into a table whose layout this client has yet to learn, the batch
        # goes as the call's payload; once it is in, the table has a layout
        # to learn, for this shard's next batches to go through shared memory.
        learn = self._shared_memory and shard.layout is None and shard.shared is not False
        if block or learn:
            keys = self._finish_insert(call)
            if learn:
                try:
                    self._learn_layout(shard)
                except ReplayError:
                    pass  # asked again after its next insert
            return None if not block else keys
        try:
            self._send_insert(call)
        except BaseException:
            if call.segment is not None:
                self._segments.give_back(call.segment)  # nothing was sent from it
            raise
        with self._lock:
            self._inflight.append(call)
        return None

    def flush(self) -> None:
        """Waits for every batch sent with ``insert(block=False)`` and sends
        the priority updates deferred by ``update_priorities(block=False)``;
        raises the first error of an in-flight batch (``ReplayError``,
        ``TimeoutError``), after the others have been answered."""
        self._reap(wait=True, keep=0)
        self._send_updates()

    def _reap(self, wait: bool, keep: int = 0) -> None:
        """Finishes the in-flight inserts whose replies came (with ``wait``:
        the oldest, until at most ``keep`` remain); on an error, waits for
        every other one in flight, then raises the first."""
        error: BaseException | None = None
        while True:
            with self._lock:
                if not self._inflight:
                    break
                call = self._inflight[0]
                if error is None and not (wait and len(self._inflight) > keep):
                    if call.future is None or not call.future.done():
                        break
                self._inflight.popleft()
            try:
                self._finish_insert(call)
            except BaseException as e:  # noqa: BLE001 - raised once the rest are answered
                if error is None:
                    error = e
        if error is not None:
            raise error

    def _start_insert(self, shard: _Shard, items: Any, priorities: Any) -> _InsertCall:
        """Prepares an insert of ``items`` into ``shard``: through this
        client's shared memory where the shard maps it, else in the call."""
        call = _InsertCall(shard, time.monotonic() + self._timeout)
        if self._shared_memory and shard.layout is not None and shard.shared is not False:
            if self._stage_shared(call, items, priorities):
                return call
        call.n = _batch_size(items)
        call.items = items
        call.priorities = priorities
        return call

    def _stage_shared(self, call: _InsertCall, items: Any, priorities: Any) -> bool:
        """Copies the batch into a segment that the shard maps. False: the
        shard cannot map it (another host), or this client holds all the
        segments it may; nothing was sent."""
        import torch

        from .schema import bytes_view

        shard = call.shard
        schema = shard.layout
        try:
            leaves, n = schema.flatten(items)
        except (ValueError, TypeError) as e:
            # As the shard would have refused it (the same text, naming the leaf).
            raise ReplayError(f"{shard.describe()}: insert failed: {type(e).__name__}: {e}") from e
        if n <= 0:
            raise ValueError(f"replay insert of {n} items: a batch needs at least one")
        prioritized = priorities is not None
        if prioritized:
            p = torch.as_tensor(priorities, dtype=torch.float64)
            if p.device.type != "cpu" or p.requires_grad:
                p = p.detach().cpu()
            if p.numel() != n:
                raise ValueError(f"replay insert: {p.numel()} priorities for a batch of {n} items")
        offsets, nbytes, sizes = segment_layout(schema.item_bytes, n)
        segment = self._segments.lease(nbytes)
        if segment is None:
            return False
        try:
            if self._attach(shard, segment) is None:
                self._segments.give_back(segment)
                return False
            view = segment.view
            # numpy's copy is one memcpy; torch's copy_ splits a large one
            # over its threads, which wait for each other on a busy machine
            # (6x slower for an Atari batch in bench/replay.py).
            for t, o, b in zip(leaves, offsets, sizes, strict=False):
                np.copyto(view[o : o + n * b], bytes_view(t).reshape(-1).view(np.uint8))
            if prioritized:
                prio_rows = view[offsets[-2] : offsets[-2] + n * 8].view(np.float64)
                np.copyto(prio_rows, p.reshape(-1).numpy())
        except BaseException:
            self._segments.drop(segment)
            raise
        call.n = n
        call.segment = segment
        call.offsets = offsets
        call.sizes = sizes
        call.prioritized = prioritized
        call.schema = schema
        return True

    def _insert_args(self, call: _InsertCall) -> tuple[str, tuple]:
        """The function and arguments that insert the rest of ``call``'s batch."""
        wait = self._wait_per_call(call.deadline)
        if call.segment is None:
            start = call.start
            rest = call.items if start == 0 else _rows_from(call.items, start)
            rest_p = None if call.priorities is None else call.priorities[start:]
            return "insert", (rest, rest_p, wait)
        rows = call.offsets
        if call.start:
            rows = [o + call.start * b for o, b in zip(call.offsets, call.sizes, strict=True)]
        sid = call.segment.ids[call.shard.index]
        args = (sid, rows, call.prioritized, call.n - call.start, wait, call.schema.digest)
        return "insert_from", args

    def _send_insert(self, call: _InsertCall) -> None:
        fn, args = self._insert_args(call)
        call.future = self._rpc.async_(call.shard.peer, f"{call.shard.name}/{fn}", *args)

    def _finish_insert(self, call: _InsertCall) -> Any:
        """Waits for ``call``'s reply, asks again for what the rate limiter
        held back, and returns the batch's keys."""
        import torch

        shard = call.shard
        segment = call.segment
        try:
            while True:
                if call.future is not None:
                    future, call.future = call.future, None
                    fn = "insert" if segment is None else "insert_from"
                    try:
                        result = future.result()
                    except RpcError as e:
                        raise self._failed(shard, fn, e) from e
                    shard.answered = True
                else:
                    fn, args = self._insert_args(call)
                    result = self._call(shard, fn, *args)
                if segment is None:
                    call.keys.append(torch.as_tensor(result, dtype=torch.int64))
                    done = len(result)
                elif result is None:  # the peer unmapped it meanwhile: map it again
                    del segment.ids[shard.index]
                    if self._attach(shard, segment) is None:
                        raise ReplayError(f"{shard.describe()}: cannot map this client's memory")
                    continue
                elif isinstance(result, str):
                    # The table's layout is not the batch's (a fresh table, its peer
                    # restarted): the rest goes as the call's payload, for the table
                    # to learn its layout from, or to refuse naming what differs.
                    shard.layout = None
                    self._to_payload(call)
                    segment = None
                    continue
                else:
                    done = result
                call.start += done
                if call.start >= call.n:
                    break
                if time.monotonic() >= call.deadline:
                    raise _insert_timeout(shard, call.n, call.start, self._timeout)
            if segment is None:
                keys = torch.cat(call.keys)
            else:
                o = call.offsets[-1]
                keys = torch.from_numpy(segment.view[o : o + call.n * 8].view(np.int64).copy())
        except BaseException:
            if segment is not None:
                # A call that failed (a timeout) may still be reading it: never reused.
                self._segments.drop(segment)
            raise
        if segment is not None:
            self._segments.give_back(segment)
        return keys | (shard.index << _SHARD_SHIFT) if shard.index else keys

    def _to_payload(self, call: _InsertCall) -> None:
        """Turns a batch staged in shared memory into one sent as the call's
        payload: its rows copied out of the segment (which goes back to the
        pool), the keys of the rows already in kept."""
        import torch

        schema, segment, n = call.schema, call.segment, call.n
        assert segment is not None
        whole = torch.from_numpy(segment.view)
        leaves = [
            whole[o : o + n * b].view(d).view(n, *shape).clone()
            for o, b, d, shape in zip(
                call.offsets, schema.item_bytes, schema.dtypes, schema.shapes, strict=False
            )
        ]
        call.items = nest.pack_as(schema.structure, leaves)
        if call.prioritized:
            o = call.offsets[-2]
            call.priorities = whole[o : o + n * 8].view(torch.float64).clone()
        if call.start:
            o = call.offsets[-1]
            call.keys.append(whole[o : o + call.start * 8].view(torch.int64).clone())
        call.segment = None
        self._segments.give_back(segment)

    def _learn_layout(self, shard: _Shard) -> None:
        """Asks ``shard`` for its table's layout (none while it has no items)."""
        from .schema import Schema

        layout = self._call(shard, "layout")
        if layout is not None:
            shard.layout = Schema.from_json(layout)
            if self._schema is None:
                self._schema = shard.layout

    def sample(self, batch_size: int) -> ReplaySample:
        """Samples ``batch_size`` items across the live shards.

        A shard that does not answer (killed, its link closed) is left out and
        the batch is drawn again from the others, so this raises
        ``ShardUnavailableError`` only when no shard is live."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        # Each failed try leaves out at least one more shard.
        for _ in range(len(self._shards)):
            try:
                return self._sample_live(batch_size)
            except ShardUnavailableError:
                if not self._live():
                    raise
        return self._sample_live(batch_size)

    def _sample_live(self, batch_size: int) -> ReplaySample:
        """One try at a sample from the shards live now."""
        import torch

        from .schema import ReplaySample

        if self._shared_memory:
            self._flush_unmap()
            with self._lock:
                pending, self._pending = self._pending, None
            if pending is not None and pending.batch_size != batch_size:
                # Drawn for another batch size: it is dropped (its draws count
                # for the rate limiter as any other).
                self._finish_shared(pending)
                pending = None
            # The next batch is asked for once this one is in, so the table
            # draws it while this one's tensors are made.
            then = (lambda: self._prefetch_next(batch_size)) if self._prefetch else None
            for retry in (False, True):
                if pending is None:
                    pending = self._start_shared(batch_size)
                if pending is None:
                    break  # through replies, below
                try:
                    return self._finish_shared(pending, then)
                except _LayoutChanged:
                    if retry:
                        raise
                    pending = None
        self._send_updates()
        live = self._live()
        if not live:
            raise self._none_live()
        counts = self._split(batch_size, live)
        deadline = time.monotonic() + self._timeout
        parts = []
        for shard, count in zip(live, counts, strict=True):
            got = 0
            while got < count:
                (items, keys, probs, shard.size), shard.mass = self._call(
                    shard, "sample", count - got, self._wait_per_call(deadline)
                )
                if len(keys):
                    parts.append((shard, items, keys, probs))
                    got += len(keys)
                elif time.monotonic() >= deadline:
                    raise _sample_timeout(shard, count, got, self._timeout)
        total_mass = sum(s.mass for s in live)
        # One part (one shard, one call) is already the batch: no copy.
        try:
            items = parts[0][1] if len(parts) == 1 else nest.cat([p[1] for p in parts])
        except (RuntimeError, ValueError, TypeError) as e:
            drawn = ", ".join({p[0].describe(): None for p in parts})
            raise ReplayError(
                f"replay shards hold items of different layouts: the items of {drawn} "
                f"do not stack ({e})"
            ) from e
        keys = torch.cat([torch.as_tensor(p[2]) | (p[0].index << _SHARD_SHIFT) for p in parts])
        # An item's probability in the union: its shard's share of the mass
        # times its probability within the shard.
        probs = torch.cat(
            [torch.as_tensor(p[3], dtype=torch.float64) * (p[0].mass / total_mass) for p in parts]
        )
        return ReplaySample(items, keys, probs, _union_size(live))

    # Sampling into shared memory.

    def _shared_layout(self, live: list[_Shard]) -> bool:
        """Whether every live shard can sample into this client's memory: each
        may map it, and has items of one layout (learned from each shard)."""
        if any(s.shared is False for s in live):
            return False
        layouts = []
        for shard in live:
            # Read once: a failed call (another thread's) may forget it meanwhile.
            layout = shard.layout
            if layout is None:
                self._learn_layout(shard)
                layout = shard.layout
                if layout is None:
                    return False  # no items yet: this sample comes as replies
            layouts.append(layout)
        schema = self._schema
        for shard, layout in zip(live, layouts, strict=True):
            if layout.digest != schema.digest:
                from .schema import describe

                raise ReplayError(
                    f"replay shards hold items of different layouts: {shard.describe()} "
                    f"stores {describe(layout.skeleton)} of dtypes {layout.dtypes} and "
                    f"shapes {layout.shapes}, this client's first shard with items "
                    f"{describe(schema.skeleton)} of dtypes {schema.dtypes} and shapes "
                    f"{schema.shapes}"
                )
        return True

    def _flush_unmap(self) -> None:
        for index, ids in self._segments.unmapped().items():
            try:
                self._call(self._shards[index], "detach", ids)
            except ReplayError:
                pass  # a shard that is gone holds nothing; one that is back expires them

    def _attach(self, shard: _Shard, segment: Segment) -> int | None:
        sid = segment.ids.get(shard.index)
        if sid is None:
            segment.view[: len(segment.token)] = np.frombuffer(segment.token, dtype=np.uint8)
            sid = self._call(
                shard, "attach", os.getpid(), segment.region.fd, segment.size, segment.token
            )
            shard.shared = sid is not None
            if sid is not None:
                segment.ids[shard.index] = sid
        return sid

    def _none_live(self) -> ShardUnavailableError:
        return ShardUnavailableError(
            "no replay shard is reachable (each is down until it answers again): "
            + ", ".join(s.describe() for s in self._shards)
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
        layout = segment_layout(self._schema.item_bytes, batch_size)
        pending = _Pending(batch_size, live, counts, deadline, *layout)
        segment = self._segments.lease(pending.nbytes)
        if segment is None:
            return None
        pending.segment = segment
        try:
            for shard in live:
                if self._attach(shard, pending.segment) is None:
                    self._segments.give_back(pending.segment)
                    return None
            row = 0
            for shard, count in zip(live, counts, strict=True):
                future = None
                keys, priorities = self._take_update(shard.index)
                try:
                    if count:
                        # The priority update deferred for this shard rides along.
                        future = self._rpc.async_(
                            shard.peer,
                            f"{shard.name}/sample_into",
                            pending.segment.ids[shard.index],
                            pending.rows(row),
                            count,
                            self._wait_per_call(deadline),
                            keys,
                            priorities,
                            self._schema.digest,
                        )
                    elif keys is not None:
                        self._call(shard, "update_priorities_raw", keys, priorities)
                except BaseException:
                    self._restore_update(shard.index, (keys, priorities))  # not sent
                    raise
                pending.updates.append((keys, priorities) if count else (None, None))
                pending.futures.append(future)
                row += count
        except BaseException:
            self._segments.drop(pending.segment)  # an asked part may still be written
            raise
        return pending

    def _finish_shared(
        self, pending: _Pending, then: Callable[[], None] | None = None
    ) -> ReplaySample:
        """Waits for the parts of a sample started by _start_shared, asks again
        for what the rate limiter held back, calls ``then`` once every part
        is in, and returns the batch."""
        import torch

        from .schema import ReplaySample

        segment = pending.segment
        try:
            row = 0
            for i, (shard, count, future) in enumerate(
                zip(pending.live, pending.counts, pending.futures, strict=True)
            ):
                got = 0
                while got < count:
                    if future is not None:
                        try:
                            result = future.result()
                        except RpcError as e:
                            error = self._failed(shard, "sample_into", e)
                            if shard.down:
                                # Unanswered, the update it carried may not
                                # have been made: it goes with the next call
                                # again (it is idempotent, and older than any
                                # made since). One the table refused would
                                # only be refused again.
                                self._restore_update(shard.index, pending.updates[i])
                            raise error from e
                        shard.answered = True
                        future = None
                    else:
                        result = self._call(
                            shard,
                            "sample_into",
                            segment.ids[shard.index],
                            pending.rows(row + got),
                            count - got,
                            self._wait_per_call(pending.deadline),
                            None,
                            None,
                            self._schema.digest,
                        )
                    if result is None:  # the peer unmapped it meanwhile: map it again
                        del segment.ids[shard.index]
                        if self._attach(shard, segment) is None:
                            raise ReplayError(
                                f"{shard.describe()}: cannot map this client's memory"
                            )
                        continue
                    if isinstance(result, str):
                        # A fresh table (its peer restarted), or one of another layout:
                        # learned anew by the next try.
                        shard.layout = None
                        raise _LayoutChanged(
                            f"{shard.describe()}: its table's layout is not the one this "
                            "client learned (its peer restarted?)"
                        )
                    done, shard.size, shard.mass = result
                    got += done
                    if got < count and not done and time.monotonic() >= pending.deadline:
                        raise _sample_timeout(shard, count, got, self._timeout)
                row += count
        except BaseException:
            # A call that failed (a timeout) may still write into it: never reused.
            self._segments.drop(segment)
            raise
        if then is not None:
            then()
        batch_size = pending.batch_size
        offsets = pending.offsets
        # The segment comes back to this client when the last view of it is freed.
        base = segment.view[: pending.nbytes]
        weakref.finalize(base, self._segments.give_back, segment)
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
        # Tagged whenever the shard is not the first, even where it is the only
        # live one (the others down).
        total_mass = sum(s.mass for s in pending.live)
        row = 0
        for shard, count in zip(pending.live, pending.counts, strict=True):
            if shard.index:
                keys[row : row + count] |= shard.index << _SHARD_SHIFT
            if len(pending.live) > 1:
                probs[row : row + count] *= shard.mass / total_mass
            row += count
        items = nest.pack_as(schema.structure, outs)
        return ReplaySample(items, keys, probs, _union_size(pending.live))

    def _split(self, batch_size: int, live: list[_Shard]) -> list[int]:
        if len(live) == 1:
            return [batch_size]
        if any(s.mass <= 0 for s in live):
            for s in live:
                info = self._call(s, "info")
                s.mass = float(info["priority_mass"])
                s.size = int(info["size"])
        weights = [s.mass for s in live]
        if sum(weights) <= 0:
            weights = [1.0] * len(live)
        counts = [0] * len(live)
        for i in self._rng.choices(range(len(live)), weights=weights, k=batch_size):
            counts[i] += 1
        return counts

    def update_priorities(self, keys: Any, priorities: Any, *, block: bool = True) -> int | None:
        """Routes each key to its shard; keys evicted meanwhile are ignored.
        Returns how many keys were still present.

        With ``block=False`` nothing is sent now: each shard's part goes with
        this client's next sample call to that shard (or ``flush()``), which
        applies it before drawing, as the call would have been; a shard's
        deferred updates apply in the order they were made. Returns None.
        The priorities are checked here (a NaN, infinite or negative one is
        refused naming its key)."""
        import torch

        keys = torch.as_tensor(keys, dtype=torch.int64).reshape(-1)
        priorities = torch.as_tensor(priorities, dtype=torch.float64).reshape(-1)
        if keys.device.type != "cpu" or keys.requires_grad:
            keys = keys.detach().cpu()
        if priorities.device.type != "cpu" or priorities.requires_grad:
            priorities = priorities.detach().cpu()
        if keys.numel() != priorities.numel():
            raise ValueError(
                f"replay update_priorities: {keys.numel()} keys but {priorities.numel()} priorities"
            )
        if not keys.numel():
            return None if not block else 0
        one = len(self._shards) == 1 and int(keys.max()) <= _LOCAL_MASK and int(keys.min()) >= 0
        if not block:
            _check_priorities(keys.numpy(), priorities.numpy())
            parts = [(0, keys, priorities)] if one else self._by_shard(keys, priorities)
            with self._lock:
                for index, k, p in parts:
                    self._defer_update(index, (k.numpy().tobytes(), p.numpy().tobytes()))
            return None
        if one:
            # One shard: the keys go as they are, as bytes (no tensors to pickle).
            return self._call(
                self._shards[0],
                "update_priorities_raw",
                keys.contiguous().numpy().tobytes(),
                priorities.contiguous().numpy().tobytes(),
            )
        updated = 0
        for index, k, p in self._by_shard(keys, priorities):
            try:
                updated += self._call(self._shards[index], "update_priorities", k, p)
            except ShardUnavailableError:
                # The keys of a shard that is down count as not present.
                if not self._live():
                    raise
        return updated

    def _by_shard(self, keys: Any, priorities: Any) -> list[tuple[int, Any, Any]]:
        """Each shard's index, its keys (the table's own) and their priorities."""
        shard_of = keys >> _SHARD_SHIFT
        parts = []
        for index in shard_of.unique().tolist():
            if not 0 <= index < len(self._shards):
                raise ValueError(f"key with shard index {index}: not a key of this client")
            mask = shard_of == index
            parts.append((index, keys[mask] & _LOCAL_MASK, priorities[mask]))
        return parts

    def _take_update(self, index: int) -> tuple[bytes, bytes] | tuple[None, None]:
        with self._lock:
            return self._updates.pop(index, (None, None))

    def _defer_update(self, index: int, update: tuple[bytes, bytes]) -> None:
        """Appends ``update`` (keys, priorities as bytes) to shard ``index``'s
        deferred one; with ``self._lock`` held. While the shard is down its
        update waits for it, with only each key's latest priority kept
        (applying them in order gives the same): no new keys of a down shard
        are sampled, so it stays as large as the keys sampled before."""
        old = self._updates.get(index)
        keys, priorities = update if old is None else (old[0] + update[0], old[1] + update[1])
        if self._shards[index].down:
            keys, priorities = _latest_per_key(keys, priorities)
        self._updates[index] = (keys, priorities)

    def _restore_update(self, index: int, update: tuple[Any, Any]) -> None:
        """Puts back the update that could not be sent, ahead of any made since."""
        if update[0] is None:
            return
        with self._lock:
            newer = self._updates.pop(index, None)
            self._updates[index] = update
            if newer is not None:
                self._defer_update(index, newer)
            elif self._shards[index].down:
                self._updates[index] = _latest_per_key(*update)

    def _send_updates(self) -> None:
        """Sends every deferred priority update on its own (for the sample
        calls that cannot carry them)."""
        with self._lock:
            updates, self._updates = self._updates, {}
        for index, update in updates.items():
            try:
                self._call(self._shards[index], "update_priorities_raw", *update)
            except ShardUnavailableError:
                # Sent once the shard is back (updates are idempotent).
                self._restore_update(index, update)

    def info(self) -> list[dict]:
        """Each shard's ``info()``, with its peer and name."""
        return [{"peer": s.peer, "name": s.name, **self._call(s, "info")} for s in self._shards]


def _latest_per_key(keys: bytes, priorities: bytes) -> tuple[bytes, bytes]:
    """A deferred update (int64 keys, float64 priorities) with each key once, at
    its latest priority, in the order of those latest updates."""
    import numpy as np

    k = np.frombuffer(keys, dtype=np.int64)[::-1]
    p = np.frombuffer(priorities, dtype=np.float64)[::-1]
    _, first = np.unique(k, return_index=True)  # in the reversed order: the latest
    keep = np.sort(first)[::-1]
    return k[keep].tobytes(), p[keep].tobytes()


def _union_size(live: list[_Shard]) -> int:
    """The size of the union of the live shards, as the probabilities of a
    sample are the union's: importance weights ``(size * p) ** -beta`` come
    out as for one table, whichever shards a (small) batch was drawn from."""
    return sum(s.size for s in live)


def _insert_timeout(shard: _Shard, n: int, done: int, timeout: float) -> ReplayTimeoutError:
    return ReplayTimeoutError(
        f"{shard.describe()}: insert of {n} items timed out after {timeout:.1f} s with "
        f"{done} inserted (the rate limiter waits for samplers)"
    )


def _sample_timeout(shard: _Shard, n: int, done: int, timeout: float) -> ReplayTimeoutError:
    return ReplayTimeoutError(
        f"{shard.describe()}: sample of {n} timed out after {timeout:.1f} s ({done} sampled; "
        "the rate limiter waits for inserts)"
    )


def _check_priorities(keys: np.ndarray, priorities: np.ndarray) -> None:
    """Refuses a NaN, infinite or negative priority as the table would, naming its key."""
    # min() is NaN where any is: one test covers NaN and negatives.
    if priorities.min() >= 0 and priorities.max() < np.inf:
        return
    bad = ~(np.isfinite(priorities) & (priorities >= 0))
    i = int(np.flatnonzero(bad)[0])
    raise ValueError(
        f"replay update_priorities: the priority for key {int(keys[i])} is "
        f"{float(priorities[i])}; priorities must be finite and >= 0"
    )


def _rows_from(items: Any, start: int) -> Any:
    return nest.map_structure(lambda x: x[start:], items)


def _batch_size(items: Any) -> int:
    leaves = nest.flatten(items)
    if not leaves:
        raise ValueError("an insert needs at least one leaf")
    return len(leaves[0])
