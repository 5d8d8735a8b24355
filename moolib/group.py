"""Group: peers that a broker keeps track of, and all-reduce among them.

Membership and the all-reduce protocol are in the core (moolib/core/collectives/group.cc,
collective.cc); this module turns nests of tensors, arrays and numbers into the
typed buffers the core sums, and runs custom reduce ops.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from . import _core, nest
from ._checks import MAX_TIMEOUT, check_seconds
from .rpc import Rpc, _check_callable, _resolve
from .serialization import dumps, loads

__all__ = ["AllReduce", "Broker", "Group"]

_UNSET = object()


class AllReduce:
    """The result of ``Group.all_reduce``, with the methods of ``Future``.

    ``result()`` returns the reduced data in the shape it was given: tensors on
    their original device, numpy arrays, Python numbers.
    """

    def __init__(self, future: Any, finish: Callable[[Any], Any]) -> None:
        self._future = future
        self._finish = finish
        self._result: Any = _UNSET
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether the all-reduce has completed (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until it completes; returns whether it did within ``timeout``."""
        return self._future.wait(timeout)

    def result(self, timeout: float | None = None) -> Any:
        """Waits and returns the result; raises RpcError if the all-reduce failed
        (the moolib.errors class of the failure: MembershipChangedError,
        RpcTimeoutError, SharedMemoryUnavailableError, ...), TimeoutError if
        ``timeout`` seconds pass first (it goes on)."""
        if not self._future.wait(timeout):
            raise TimeoutError("the all-reduce did not complete within the wait timeout")
        error = self._future.exception()
        if error is not None:
            raise error
        with self._lock:
            if self._result is _UNSET:
                self._result = self._finish(self._future)
            return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits; returns the error as an RpcError, or None on success."""
        return self._future.exception(timeout)

    def cancel(self) -> bool:
        """Stops waiting here (this peer still does its part for the others)."""
        return self._future.cancel()

    def cancelled(self) -> bool:
        return self._future.cancelled()

    def add_done_callback(self, fn: Callable[[AllReduce], Any]) -> None:
        """Calls ``fn(self)`` on a core thread once the all-reduce completes."""
        self._future.add_done_callback(lambda _: fn(self))

    def __await__(self) -> Any:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self.add_done_callback(lambda _: loop.call_soon_threadsafe(_resolve, waiter))
        yield from waiter.__await__()
        return self.result()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


class _SumPlan:
    """A nest's leaves as byte views grouped by element type, and the way back.

    The core concatenates each type's views into a buffer of its own (no copy
    here) and returns one summed buffer per type; ``finish`` cuts the leaves
    back out of them.
    """

    def __init__(self, data: Any) -> None:
        import numpy as np

        self.structure_of = data
        self.torch = sys.modules.get("torch")
        torch = self.torch
        # Per leaf: (kind, type, offset, count, shape, device, leaf)
        self.layout: list[tuple] = []
        self.parts: dict[str, list] = {}
        counts: dict[str, int] = {}
        # Leaf by leaf: "kind dtype shape"; with the nest's skeleton, the
        # structure every member's data must share (see structure()).
        self._specs: list[str] = []
        for leaf in nest.flatten(data):
            if torch is not None and isinstance(leaf, torch.Tensor):
                t = leaf.detach()
                kind, shape, device = "torch", tuple(t.shape), t.device
                t = t.cpu().contiguous().reshape(-1)
                key, count = _dtype_name(t.dtype), t.numel()
                view = t.view(torch.uint8).numpy() if count else b""
            elif isinstance(leaf, (np.ndarray, np.generic, bool, int, float)):
                kind = "numpy" if isinstance(leaf, np.ndarray) else "number"
                if isinstance(leaf, bool):
                    a = np.asarray(leaf, dtype=np.bool_)
                elif isinstance(leaf, int):
                    a = np.asarray(leaf, dtype=np.int64)
                elif isinstance(leaf, float):
                    a = np.asarray(leaf, dtype=np.float64)
                else:
                    a = np.asarray(leaf)
                shape, device = a.shape, None
                a = np.ascontiguousarray(a).reshape(-1)
                key, count = a.dtype.name, a.size
                view = a.view(np.uint8) if count else b""
            else:
                raise TypeError(
                    f"all_reduce cannot sum a {type(leaf).__name__}: leaves must be tensors, "
                    "numpy arrays or numbers (use op= for anything else)"
                )
            self.layout.append((kind, key, counts.get(key, 0), count, shape, device, leaf))
            self._specs.append(f"{kind} {key} {tuple(shape)}")
            counts[key] = counts.get(key, 0) + count
            self.parts.setdefault(key, []).append(view)

    def structure(self) -> int:
        """A 64-bit digest of the nest's keys, nesting, leaf kinds, dtypes and shapes."""
        specs = iter(self._specs)

        def skeleton(x: Any) -> str:
            # Dict keys in the order nest.flatten visits them, as leaves are.
            if isinstance(x, dict):
                return "{" + ",".join(f"{k!r}:{skeleton(x[k])}" for k in nest._keys(x)) + "}"
            if isinstance(x, (list, tuple)):
                inner = ",".join(skeleton(v) for v in x)
                return f"[{inner}]" if isinstance(x, list) else f"({inner})"
            return next(specs)

        digest = hashlib.blake2b(skeleton(self.structure_of).encode(), digest_size=8).digest()
        # Never 0: the core reads 0 as "not checked".
        return int.from_bytes(digest, "little") or 1

    def items(self) -> list[tuple[str, list]]:
        # A nest with no leaves still exchanges an empty buffer, so a member
        # whose data has leaves where this one has none fails on both sides.
        return list(self.parts.items()) or [("uint8", [b""])]

    def _flat(self, key: str, segment: Any) -> Any:
        torch = self.torch
        if torch is not None:
            dtype = getattr(torch, key)
            if not len(segment):
                return torch.empty(0, dtype=dtype)
            return torch.frombuffer(segment, dtype=torch.uint8).view(dtype)
        import numpy as np

        return np.frombuffer(segment, dtype=key) if len(segment) else np.empty(0, dtype=key)

    def finish(self, future: Any) -> Any:
        segments = future._segments()[: len(self.parts)]
        flats = {key: self._flat(key, seg) for key, seg in zip(self.parts, segments, strict=True)}
        leaves = []
        for kind, key, offset, count, shape, device, leaf in self.layout:
            part = flats[key][offset : offset + count]
            if kind == "torch":
                t = part.view(shape)
                leaves.append(t if device.type == "cpu" else t.to(device))
            elif kind == "numpy":
                arr = part.numpy() if hasattr(part, "numpy") else part
                leaves.append(arr.reshape(shape))
            else:
                value = part[0].item()
                leaves.append(type(leaf)(value) if isinstance(leaf, (bool, int, float)) else value)
        return nest.pack_as(self.structure_of, leaves)


def _gathered(future: Any) -> list:
    segments = future._segments()
    counts = struct.unpack(f"<{len(segments[0]) // 4}I", bytes(segments[0]))
    values, i = [], 1
    for n in counts:
        values.append(loads(segments[i], segments[i + 1 : i + n]))
        i += n
    return values


class Group(_core.Group):
    """Peers that one broker tracks under one name.

    The first ``update()`` joins; from then on, pings to the broker run in the
    background (so membership changes reach a member even while it waits on an
    all-reduce), and ``update()`` returns True when membership changed since
    the last call. ``members()`` is ordered by
    ``set_sort_order`` then join order, and is the same list on every member for
    one ``sync_id()``. Also: ``active()``, ``name()``, ``set_timeout(s)``,
    ``set_broker_name(name)`` (default "broker"), ``close()``.

    Liveness follows the program: a member that does not call ``update()`` for
    longer than the timeout (``set_timeout``, default 10 s) leaves the group,
    like a member whose process died or lost the broker, and its next
    ``update()`` rejoins. So the timeout must exceed the longest gap between
    two ``update()`` calls; wrap a longer computation in ``keepalive()``.
    """

    def __init__(self, rpc: Rpc, name: str) -> None:
        super().__init__(rpc, name)
        self.rpc = rpc

    def set_timeout(self, seconds: float) -> None:
        """A member that has not called ``update()`` (or not reached the broker) this
        long leaves (default 10 s): positive and below 1e7; else a ValueError."""
        super().set_timeout(
            check_seconds("the group timeout (Group.set_timeout)", seconds, below=MAX_TIMEOUT)
        )

    def set_collective_timeout(self, seconds: float) -> None:
        """An all-reduce not complete after this long fails on every member, naming
        the members it waits for; 0 (the default): max(60 s, 2 x the group
        timeout). Below 1e7; a negative or NaN value is a ValueError."""
        super().set_collective_timeout(
            check_seconds(
                "the collective timeout (Group.set_collective_timeout)",
                seconds,
                zero=True,
                below=MAX_TIMEOUT,
            )
        )

    @contextlib.contextmanager
    def keepalive(self) -> Iterator[None]:
        """Keeps this member in the group while the block runs, however long it goes
        without ``update()`` (the others' all-reduces then wait for it)."""
        self._hold_membership(True)
        try:
            yield
        finally:
            self._hold_membership(False)

    def all_reduce(
        self, name: str, data: Any, op: Callable[[Any, Any], Any] | None = None
    ) -> AllReduce:
        """Reduces ``data`` (a tensor, array, number or a nest of them) across the members.

        Every member must call it with the same ``name`` and data of the same
        structure. With ``op=None`` the data is summed (by the core, with
        bitwise identical results everywhere); otherwise every member's data is
        gathered and folded with ``op(a, b)`` in member order. Fails (never hangs)
        if membership changes before it completes.
        """
        if op is not None:
            _check_callable("all_reduce", "op", op)
            payload, buffers = dumps(data)
            future = self._all_gather(name, payload, buffers)
            return AllReduce(future, lambda f: functools.reduce(op, _gathered(f)))
        return self._sum_at(name, data, 0)

    def _gather_at(self, name: str, data: Any, sync_id: int) -> AllReduce:
        """Every member's ``data`` (picklable), in member order; fails at once unless
        membership is still ``sync_id``."""
        payload, buffers = dumps(data)
        return AllReduce(self._all_gather(name, payload, buffers, sync_id), _gathered)

    def _sum_at(self, name: str, data: Any, sync_id: int) -> AllReduce:
        """A sum all-reduce that fails at once unless membership is still ``sync_id`` (0: any)."""
        plan = _SumPlan(data)
        future = self._all_reduce_sum(name, plan.items(), sync_id, plan.structure())
        return AllReduce(future, plan.finish)


class Broker:
    """A peer that keeps track of groups: members, liveness and sync ids.

    Groups find it by name ("broker" unless ``Group.set_broker_name`` says
    otherwise). Call ``update()`` regularly: it drops members that missed their
    timeout.
    """

    def __init__(self, rpc: Rpc | None = None) -> None:
        if rpc is None:
            rpc = Rpc()
            rpc.set_name("broker")
        self.rpc = rpc
        self._service = _core.Broker(rpc)

    def set_name(self, name: str) -> None:
        """Sets the name groups address the broker by."""
        self.rpc.set_name(name)

    def get_name(self) -> str:
        return self.rpc.get_name()

    def listen(self, address: str) -> str:
        """Listens on ``address`` ("host:port"; port 0 picks one); returns the bound address."""
        return self.rpc.listen(address)

    def connect(self, address: str) -> None:
        self.rpc.connect(address)

    def update(self) -> None:
        """Drops members that have not pinged within their timeout."""
        self._service.update()

    def groups(self) -> dict[str, dict[str, Any]]:
        """``{group: {"sync_id": int, "members": [names]}}`` as the broker sees them now."""
        return self._service.groups()

    def close(self) -> None:
        """Stops serving (closes the Rpc)."""
        self.rpc.close()
