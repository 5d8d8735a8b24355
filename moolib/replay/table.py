"""A prioritized experience replay table (Ape-X, R2D2) with Reverb's rate limiter.

The table itself (priorities, sum tree, item bytes, content-addressed frames,
rate limiter, checkpoints) lives in the C++ core (moolib/core/replay/table.h); this
module maps nests of tensors onto it: it learns the item layout from the first
insert (moolib/replay/schema.py), checks every later insert against it (naming
the leaf that differs), and hands the core one flat byte view per leaf, so the
insert and sample paths make no per-item Python objects. docs/architecture.md
("Replay") has the design.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .. import _core, nest
from .schema import ReplaySample, Schema, bytes_view
from .server import serve

__all__ = ["Replay"]

_SELECTORS = ("uniform", "prioritized", "fifo")
_LOAD_OVERRIDES = ("alpha", "min_size", "samples_per_insert", "error_buffer", "seed", "timeout")


class Replay:
    """A replay table of nests of tensors, stored natively.

    ``selector``: ``"prioritized"`` draws item i with probability
    ``p_i**alpha / sum(p**alpha)`` (a sum tree), ``"uniform"`` uniformly over
    the live items, both with replacement and seeded by ``seed``; ``"fifo"``
    returns the oldest items in insertion order (round again past the end).
    At capacity the oldest item is evicted.

    Rate limiting follows Reverb: sampling waits until ``min_size`` items are
    in the table; with ``samples_per_insert`` (SPI) and ``error_buffer`` (E),
    ``diff = inserts * SPI - samples`` (counted per item) must stay within
    ``SPI * min_size -/+ E``: an item may be inserted while the table has fewer
    than ``min_size`` items or ``diff + SPI <= max_diff``, and sampled when
    ``diff - 1 >= min_diff``. Batches move item by item. A wait longer than
    ``timeout`` (per call, or the call's own ``timeout``) raises
    ``TimeoutError`` saying what it waited for; ``close()`` fails every waiter.

    ``dedup`` names leaves (dotted paths, e.g. ``"obs"``) of item shape
    ``(S, *frame)`` whose frames are stored once each, shared by every item
    and leaf holding the same bytes: stacked Atari frames cost about one frame
    per transition.

    ``serve`` answers other peers' ``ReplayClient``s through the methods of
    ``moolib.replay.server.ServedTable``: ``insert_some``, ``sample_some``,
    ``insert_from_buffers``, ``sample_into_buffers``,
    ``update_priorities_from_bytes`` and ``priority_mass``, besides those above.
    """

    def __init__(
        self,
        capacity: int,
        *,
        selector: str = "prioritized",
        alpha: float = 0.6,
        min_size: int = 1,
        samples_per_insert: float | None = None,
        error_buffer: float | None = None,
        dedup: Sequence[str] = (),
        seed: int | None = None,
        timeout: float = 60.0,
    ) -> None:
        if selector not in _SELECTORS:
            raise ValueError(
                f"unknown replay selector {selector!r}: expected one of {', '.join(_SELECTORS)}"
            )
        spi, eb = _limiter(samples_per_insert, error_buffer)
        if isinstance(dedup, str):
            dedup = (dedup,)
        if seed is None:
            seed = random.SystemRandom().getrandbits(64)
        core = _core.Replay(
            int(capacity), selector, float(alpha), int(min_size), spi, eb, int(seed) % 2**64
        )
        self._setup(core, tuple(dedup), timeout)
        self._save_meta()

    def _setup(self, core: Any, dedup: tuple[str, ...], timeout: float) -> None:
        if not timeout > 0:
            raise ValueError(f"replay timeout must be positive, got {timeout}")
        self._core = core
        self._dedup = dedup
        self._timeout = float(timeout)
        self._schema: Schema | None = None
        self._schema_lock = threading.Lock()

    def _meta(self, schema: Schema | None) -> bytes:
        meta = {
            "dedup": list(self._dedup),
            "timeout": self._timeout,
            "schema": schema.to_json() if schema else None,
        }
        return json.dumps(meta).encode()

    def _save_meta(self) -> None:
        self._core.set_meta(self._meta(self._schema))

    def _wait(self, timeout: float | None) -> float:
        t = self._timeout if timeout is None else float(timeout)
        if math.isnan(t) or t < 0:
            raise ValueError(f"replay timeout must be >= 0, got {timeout}")
        return t

    # Inserting.

    def _flatten(self, items: Any) -> tuple[list[torch.Tensor], int]:
        schema = self._schema
        if schema is None:
            with self._schema_lock:
                if self._schema is None:
                    learned = Schema.learn(items, self._dedup)
                    self._core.set_schema(learned.item_bytes, learned.frames, self._meta(learned))
                    self._schema = learned
                schema = self._schema
        return schema.flatten(items)

    def _insert(self, items: Any, priorities: Any, wait: float) -> tuple[torch.Tensor, str]:
        tensors, n = self._flatten(items)
        if n <= 0:
            raise ValueError(f"replay insert of {n} items: a batch needs at least one")
        prio = None
        if priorities is not None:
            p = torch.as_tensor(priorities, dtype=torch.float64).detach().cpu().reshape(-1)
            if p.numel() != n:
                raise ValueError(f"replay insert: {p.numel()} priorities for a batch of {n} items")
            prio = p.contiguous().numpy()
        keys = torch.empty(n, dtype=torch.int64)
        done, waited, _ = self._core.insert(
            [bytes_view(t) for t in tensors], prio, keys.numpy(), wait
        )
        return keys[:done], waited

    def insert(
        self, items: Any, priorities: Any = None, timeout: float | None = None
    ) -> torch.Tensor:
        """Inserts a batch (every leaf with leading dim N); returns the N int64 keys.

        ``priorities`` (N values, finite and >= 0) may be None: 1 each. Waits on
        the rate limiter at most ``timeout`` seconds (default: the table's);
        on timeout the items inserted so far stay and ``TimeoutError`` says
        how many and why.
        """
        keys, waited = self._insert(items, priorities, self._wait(timeout))
        if waited:
            raise TimeoutError(waited)
        return keys

    def insert_some(self, items: Any, priorities: Any, wait: float) -> torch.Tensor:
        """Inserts what the rate limiter lets through within ``wait`` seconds;
        returns those items' keys (a prefix of the batch)."""
        return self._insert(items, priorities, max(0.0, float(wait)))[0]

    def insert_from_buffers(self, leaves: list, priorities: Any, keys: Any, wait: float) -> int:
        """Inserts from caller buffers in the table's layout (one per leaf, the
        items' bytes back to back; priorities as float64 or None), writing the
        keys to ``keys`` (int64); waits on the rate limiter at most ``wait``
        seconds and returns how many went in (a prefix). The table must have
        its layout (an insert happened)."""
        if self._schema is None:
            raise RuntimeError("replay insert from buffers before the table has its layout")
        done, _, _ = self._core.insert(leaves, priorities, keys, max(0.0, float(wait)))
        return int(done)

    # Sampling.

    def _sample(self, batch_size: int, wait: float) -> tuple[ReplaySample, str]:
        if batch_size <= 0:
            raise ValueError(f"replay sample of {batch_size} items: batch_size must be positive")
        keys = torch.empty(batch_size, dtype=torch.int64)
        probs = torch.empty(batch_size, dtype=torch.float64)
        deadline = None if wait >= 1e9 else _now() + wait
        while True:
            schema = self._schema
            raw = []
            if schema is not None:
                # numpy's allocator advises huge pages for large arrays: a
                # fresh Atari batch then costs far fewer page faults.
                raw = [np.empty(batch_size * b, dtype=np.uint8) for b in schema.item_bytes]
            left = wait if deadline is None else max(0.0, deadline - _now())
            done, waited, size, need_outputs = self._core.sample(
                batch_size,
                raw,
                keys.numpy(),
                probs.numpy(),
                left,
            )
            if not need_outputs:
                break
        items = None
        if schema is not None:
            outs = [
                torch.from_numpy(r).view(d).reshape(batch_size, *shape)[:done]
                for r, d, shape in zip(raw, schema.dtypes, schema.shapes, strict=True)
            ]
            items = nest.pack_as(schema.structure, outs)
        return ReplaySample(items, keys[:done], probs[:done], int(size)), waited

    def sample_into_buffers(
        self, batch_size: int, outs: list, keys: Any, probs: Any, wait: float
    ) -> tuple[int, int]:
        """Samples up to ``batch_size`` items straight into caller buffers (one
        per leaf, ``batch_size * item_bytes`` bytes each, and the keys' and
        probabilities' 8 bytes an item), waiting on the rate limiter at most
        ``wait`` seconds; returns (sampled, table size). The table must have
        its layout (an insert happened)."""
        done, _, size, need_outputs = self._core.sample(
            batch_size, outs, keys, probs, max(0.0, float(wait))
        )
        if need_outputs:
            raise RuntimeError("replay sample into buffers: the table has no items yet")
        return int(done), int(size)

    def sample(self, batch_size: int, timeout: float | None = None) -> ReplaySample:
        """Draws ``batch_size`` items (with replacement, except under fifo).

        Waits for ``min_size`` and the rate limiter at most ``timeout`` seconds
        (default: the table's), then raises ``TimeoutError`` saying what it
        waited for.
        """
        s, waited = self._sample(int(batch_size), self._wait(timeout))
        if waited:
            raise TimeoutError(waited)
        return s

    def sample_some(self, batch_size: int, wait: float) -> ReplaySample:
        """Samples what the rate limiter lets through within ``wait`` seconds
        (possibly nothing)."""
        return self._sample(int(batch_size), max(0.0, float(wait)))[0]

    def update_priorities(self, keys: Any, priorities: Any) -> int:
        """Sets the priorities of ``keys``; keys evicted meanwhile are skipped.
        Returns how many keys were still present. A NaN, infinite or negative
        priority is refused (nothing changes), naming its key."""
        k = torch.as_tensor(keys, dtype=torch.int64).detach().cpu().reshape(-1).contiguous()
        p = torch.as_tensor(priorities, dtype=torch.float64).detach().cpu().reshape(-1)
        if k.numel() != p.numel():
            raise ValueError(
                f"replay update_priorities: {k.numel()} keys but {p.numel()} priorities"
            )
        if k.numel() == 0:
            return 0
        return int(self._core.update_priorities(k.numpy(), p.contiguous().numpy()))

    def update_priorities_from_bytes(self, keys: Any, priorities: Any) -> int:
        """update_priorities from buffers of int64 keys and float64 priorities."""
        k = np.frombuffer(keys, dtype=np.int64)
        p = np.frombuffer(priorities, dtype=np.float64)
        if len(k) != len(p):
            raise ValueError(f"replay update_priorities: {len(k)} keys but {len(p)} priorities")
        return int(self._core.update_priorities(k, p)) if len(k) else 0

    # State.

    def size(self) -> int:
        """How many items the table holds."""
        return int(self._core.size())

    def __len__(self) -> int:
        return self.size()

    @property
    def capacity(self) -> int:
        """The most items the table holds; the oldest is evicted past it."""
        return int(self._core.config()["capacity"])

    @property
    def schema(self) -> Schema | None:
        """The item layout learned from the first insert (None before it): the
        leaves' names, dtypes and shapes, in the order the table stores them."""
        return self._schema

    def priority_mass(self) -> float:
        """The sum of p**alpha over the items (prioritized), else the size."""
        return float(self._core.priority_mass())

    def info(self) -> dict:
        """Counters and settings: size, capacity, inserts, samples (items),
        evictions, priority_mass, bytes_per_item (measured storage per live
        item, frames shared by dedup counted once), item_bytes (an item's
        size as inserted), frames (distinct dedup frames), waiting
        inserters/samplers, and the table's settings."""
        info = dict(self._core.info())
        config = self._core.config()
        schema = self._schema
        info["bytes_per_item"] = info["stored_bytes"] / info["size"] if info["size"] else 0.0
        info["item_bytes"] = sum(schema.item_bytes) if schema else 0
        info.update(
            selector=config["selector"],
            alpha=config["alpha"],
            min_size=config["min_size"],
            samples_per_insert=config["samples_per_insert"] or None,
            error_buffer=config["error_buffer"] if config["samples_per_insert"] else None,
            dedup=list(self._dedup),
        )
        return info

    def serve(self, rpc: Any, name: str) -> None:
        """Serves this table on ``rpc`` under ``name``, for ``ReplayClient``s of
        other peers (``insert``, ``sample``, ``update_priorities``, ``info``)."""
        serve(self, rpc, name)

    def close(self) -> None:
        """Wakes every waiting insert and sample with an error; later calls fail too."""
        self._core.close()

    def __enter__(self) -> Replay:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # Checkpoints.

    def save(self, path: str | os.PathLike) -> None:
        """Writes the table atomically (temp file, fsync, rename) with a SHA-256
        checksum: items (dedup frames once each), keys, priorities, counters and
        the sampler's random state. The table's state is copied under its lock
        and written after it is released (so samples and inserts wait for the
        copy only); temporaries of this path left by a writer that was killed
        are removed first."""
        self._core.save(os.fspath(path))

    @classmethod
    def load(cls, path: str | os.PathLike, **overrides: Any) -> Replay:
        """Restores a table written by ``save``: same keys, priorities, items,
        counters and (unless ``seed`` is overridden) the same samples after.

        ``overrides`` may change ``alpha``, ``min_size``, ``samples_per_insert``,
        ``error_buffer``, ``seed`` and ``timeout``; the others keep what was
        saved (a table saved without rate limiting stays so). A new
        ``samples_per_insert`` gets the default ``error_buffer`` unless one is
        given, ``samples_per_insert=None`` lifts the rate limit, and an
        ``error_buffer`` alone needs a table saved with a rate. A truncated or
        damaged file is refused with a ``ValueError`` naming it.

        The loaded table is a new incarnation of the saved one: the keys it
        hands out carry an incarnation number (above the insertion counter)
        that no earlier load of this path used, written to
        ``<path>.incarnation`` before this returns (keep it with the
        checkpoint). So a key of an item lost with an earlier incarnation
        (inserted after its last save) never names an item of this one.
        """
        unknown = set(overrides) - set(_LOAD_OVERRIDES)
        if unknown:
            raise TypeError(
                f"Replay.load cannot override {', '.join(sorted(unknown))}; "
                f"it can override {', '.join(_LOAD_OVERRIDES)}"
            )
        if not os.path.exists(path):
            raise FileNotFoundError(f"replay checkpoint {os.fspath(path)} does not exist")
        core = _core.Replay.load(os.fspath(path))
        try:
            meta = json.loads(core.meta().decode())
            dedup = tuple(meta["dedup"])
            schema = Schema.from_json(meta["schema"]) if meta["schema"] else None
            timeout = float(meta["timeout"])
            stored = (
                [(b, f) for b, f in zip(schema.item_bytes, schema.frames, strict=True)]
                if schema
                else []
            )
            if stored != [tuple(x) for x in core.layout()]:
                raise ValueError("its layout does not match its items")
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
            raise ValueError(f"replay checkpoint {os.fspath(path)} has bad metadata: {e}") from e
        self = cls.__new__(cls)
        self._setup(core, dedup, float(overrides.get("timeout", timeout)))
        self._schema = schema
        config = core.config()
        if any(k in overrides for k in ("alpha", "min_size", "samples_per_insert", "error_buffer")):
            # The core stores "no rate limiting" as a rate of 0 (and a buffer
            # of 0, which is no buffer): only a saved rate keeps its buffer,
            # and only when the rate is not overridden (a new rate gets the
            # default buffer, unless one is given too).
            saved_spi = config["samples_per_insert"] or None
            spi = overrides.get("samples_per_insert", saved_spi)
            eb = overrides.get("error_buffer")
            if "error_buffer" not in overrides and "samples_per_insert" not in overrides:
                eb = config["error_buffer"] if saved_spi is not None else None
            if spi is None and eb is not None:
                raise ValueError(
                    f"Replay.load: error_buffer needs samples_per_insert: the table in "
                    f"{os.fspath(path)} was saved without rate limiting; pass "
                    "samples_per_insert as well"
                )
            spi_value, eb_value = _limiter(spi, eb)
            core.reconfigure(
                float(overrides.get("alpha", config["alpha"])),
                int(overrides.get("min_size", config["min_size"])),
                spi_value,
                eb_value,
            )
        if overrides.get("seed") is not None:
            core.reseed(int(overrides["seed"]) % 2**64)
        self._save_meta()
        return self


def _limiter(samples_per_insert: float | None, error_buffer: float | None) -> tuple[float, float]:
    if samples_per_insert is None:
        if error_buffer is not None:
            raise ValueError("replay error_buffer needs samples_per_insert")
        return 0.0, 0.0
    spi = float(samples_per_insert)
    if not spi > 0 or math.isinf(spi):
        raise ValueError(f"replay samples_per_insert must be positive and finite, got {spi}")
    # Reverb's smallest buffer that lets both sides move: max(1, SPI).
    eb = max(1.0, spi) if error_buffer is None else float(error_buffer)
    return spi, eb


def _now() -> float:
    import time

    return time.monotonic()
