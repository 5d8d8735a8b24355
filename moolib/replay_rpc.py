"""The replay table over RPC: serving a ``Replay`` and the sharded ``ReplayClient``.

A served table answers four functions under its name. Rate-limited waits run
on the serving peer, but never longer than half the caller's RPC timeout per
call: a call that has to wait longer returns what it did so far (the keys it
inserted, the items it sampled) and the client asks again for the rest. So a
long wait never looks like a dead peer, and nothing done before a wait ends is
done twice or lost.

Keys returned by a ``ReplayClient`` carry the shard in their top bits, so
``update_priorities`` routes each key back to the table that holds it.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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


class ReplayError(RuntimeError):
    """A replay shard could not be reached or refused a call; names the peer."""


def serve(replay: Replay, rpc: Rpc, name: str) -> None:
    """Defines ``name/insert``, ``name/sample``, ``name/update_priorities`` and
    ``name/info`` on ``rpc``, answered by ``replay``."""

    def insert(items: Any, priorities: Any, wait: float) -> Any:
        return replay._insert_some(items, priorities, wait)

    def sample(batch_size: int, wait: float) -> tuple:
        return tuple(replay._sample_some(batch_size, wait)), replay._mass()

    def update_priorities(keys: Any, priorities: Any) -> int:
        return replay.update_priorities(keys, priorities)

    rpc.define(f"{name}/insert", insert)
    rpc.define(f"{name}/sample", sample)
    rpc.define(f"{name}/update_priorities", update_priorities)
    rpc.define(f"{name}/info", replay.info)


class _Shard:
    def __init__(self, index: int, peer: str, name: str) -> None:
        self.index = index
        self.peer = peer
        self.name = name
        self.mass = 0.0
        self.failed_at: float | None = None

    def describe(self) -> str:
        return f"replay '{self.name}' on peer '{self.peer}'"


class ReplayClient:
    """Inserts into and samples from replay tables served by other peers.

    ``shards`` is a list of ``(peer, name)`` pairs (or one pair). Inserts go to
    the shards in turn; a sample draws from every live shard in proportion to
    its priority mass (its size for uniform tables), so the probabilities it
    returns are those of the union of the shards. ``timeout`` bounds each call,
    rate-limited waits included.
    """

    def __init__(
        self,
        rpc: Rpc,
        shards: Sequence[tuple[str, str]] | tuple[str, str],
        timeout: float = 60.0,
        seed: int | None = None,
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
                raise TimeoutError(
                    f"{shard.describe()}: insert of {n} items timed out after "
                    f"{self._timeout:.1f} s with {start} inserted (the rate limiter "
                    "waits for samplers)"
                )
        return torch.cat(done) | (shard.index << _SHARD_SHIFT)

    def sample(self, batch_size: int) -> ReplaySample:
        """Samples ``batch_size`` items across the live shards."""
        import torch

        from .replay import ReplaySample

        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        live = self._live()
        if not live:
            raise ReplayError(
                "no replay shard is reachable: " + ", ".join(s.describe() for s in self._shards)
            )
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

        keys = torch.as_tensor(keys, dtype=torch.int64)
        priorities = torch.as_tensor(priorities, dtype=torch.float64)
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


def _rows_from(items: Any, start: int) -> Any:
    return nest.map_structure(lambda x: x[start:], items)


def _batch_size(items: Any) -> int:
    leaves = nest.flatten(items)
    if not leaves:
        raise ValueError("an insert needs at least one leaf")
    return len(leaves[0])
