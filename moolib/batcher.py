"""``Batcher``: gathers tensors (or nests of tensors) into batches of a fixed size.

Items go in with :meth:`Batcher.stack` (one item per batch slot) or
:meth:`Batcher.cat` (items that already have a batch dimension); finished
batches come out, in order, through :meth:`Batcher.get` (blocking) or
``await batcher`` (asyncio). Producers and consumers may be on different
threads.

The output batch is allocated on the target device when a batch starts and
every item is copied straight into its place, so no list of items is kept.
Every batch is a fresh set of tensors: later items never overwrite a batch
that was handed out. Copies are made without autograd (batches are detached).

Nests are dicts, lists and tuples (namedtuples included) of leaves, handled
by :mod:`moolib.nest`. A leaf is a tensor, a numpy array (converted to a
tensor), ``None`` (``None`` in every item of a batch stays ``None``) or, for
``stack`` only, a Python or numpy number (a 0-d tensor).

Differences from the original moolib (C++) ``Batcher``, which had no
``size()`` and only non-negative ``dim``: ``size()`` returns the batch size
given at construction; negative ``dim`` counts from the end of each leaf as in
``torch.stack``/``torch.cat``; ``get`` takes an optional ``timeout``; items are
checked against the batch in progress (structure, dtype, shape) before
anything is copied, so a rejected item leaves the batcher as it was.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, NamedTuple

from . import nest as _nest
from ._checks import check_int

if TYPE_CHECKING:
    import torch

__all__ = ["Batcher"]


class _Spec(NamedTuple):
    """How one tensor leaf of the items goes into the batch."""

    dtype: Any  # torch.dtype
    shape: tuple[int, ...]  # the (first) item's shape
    dim: int  # the batch dimension in the output, non-negative
    out_shape: tuple[int, ...]


class _ThreadWaiter:
    """A thread blocked in ``get``; ``cond`` shares the batcher's queue lock."""

    __slots__ = ("cond", "batch", "has_batch")

    def __init__(self, lock: threading.Lock) -> None:
        self.cond = threading.Condition(lock)
        self.batch: Any = None
        self.has_batch = False

    def give(self, batch: Any) -> bool:
        self.batch = batch
        self.has_batch = True
        self.cond.notify()
        return True


class _AsyncWaiter:
    """A coroutine awaiting the batcher on ``loop``."""

    __slots__ = ("loop", "future", "batcher")

    def __init__(self, batcher: Batcher, loop: asyncio.AbstractEventLoop) -> None:
        self.batcher = batcher
        self.loop = loop
        self.future: asyncio.Future = loop.create_future()

    def give(self, batch: Any) -> bool:
        if self.future.done():  # cancelled
            return False
        try:
            self.loop.call_soon_threadsafe(self._resolve, batch)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def _resolve(self, batch: Any) -> None:
        # Runs on the loop. A waiter cancelled after the batch was handed over
        # gives it back, first in line.
        if self.future.done():
            self.batcher._deliver(batch, front=True)
        else:
            self.future.set_result(batch)


class Batcher:
    """Batches tensors, or nests of tensors, into batches of ``size`` along ``dim`` on ``device``.

    Args:
        size: the batch size (at least 1).
        device: where the batches are allocated: ``"cpu"``, ``"cuda"``,
            ``"cuda:1"``, a ``torch.device``... A CUDA device that this
            process cannot use raises ``ValueError`` here.
        dim: the batch dimension. For :meth:`stack` it is a dimension of the
            output (item rank + 1), for :meth:`cat` a dimension of the items;
            negative values count from the end, as in ``torch.stack`` and
            ``torch.cat``.

    Example::

        batcher = Batcher(32, device="cuda")
        batcher.stack({"obs": torch.zeros(4, 84, 84), "reward": torch.tensor(0.0)})
        ...  # 31 more
        batch = batcher.get()  # {"obs": [32, 4, 84, 84], "reward": [32]}

    Thread-safe: any thread may add items while others ``get`` or ``await``.
    Batches are handed out in the order they were completed; waiters are
    served first come, first served.
    """

    def __init__(self, size: int, device: str | torch.device = "cpu", dim: int = 0) -> None:
        import torch

        size = check_int("Batcher: size", size, low=1)
        dim = check_int("Batcher: dim", dim)
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError, ValueError) as e:
            raise ValueError(f"Batcher: invalid device {device!r}: {e}") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"Batcher: device {str(dev)!r} requested but CUDA is not available "
                    "in this process (torch built without CUDA, or no GPU visible)"
                )
            count = torch.cuda.device_count()
            if dev.index is not None and dev.index >= count:
                raise ValueError(
                    f"Batcher: device {str(dev)!r} requested but only {count} CUDA "
                    f"device(s) are visible"
                )
        self._torch = torch
        self._size = size
        self._dim = dim
        self._device = dev

        # The batch being filled; guarded by _fill_lock (taken before _lock).
        self._fill_lock = threading.Lock()
        self._mode: str | None = None  # None (no batch in progress), "stack" or "cat"
        self._skeleton: Any = None  # the items' structure, leaves replaced by None
        self._specs: list[_Spec | None] = []  # None for None leaves
        self._buffers: list[Any] = []
        self._filled = 0

        # Finished batches and whoever waits for them; guarded by _lock.
        self._lock = threading.Lock()
        self._ready: collections.deque[Any] = collections.deque()
        self._waiters: collections.deque[_ThreadWaiter | _AsyncWaiter] = collections.deque()

    def __repr__(self) -> str:
        return (
            f"Batcher(size={self._size}, device={str(self._device)!r}, dim={self._dim}, "
            f"ready={len(self._ready)}, filled={self._filled})"
        )

    # -- consumers -------------------------------------------------------------

    def size(self) -> int:
        """The batch size given at construction (not the number of ready batches)."""
        return self._size

    def empty(self) -> bool:
        """True when no finished batch is waiting to be taken."""
        with self._lock:
            return not self._ready

    def get(self, timeout: float | None = None) -> Any:
        """Return the next finished batch, blocking until there is one.

        With ``timeout`` (seconds), raises ``TimeoutError`` if no batch is
        finished in time (``timeout=0`` only takes a batch that is ready).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._ready:
                return self._ready.popleft()
            if deadline is not None and timeout <= 0:
                raise TimeoutError("Batcher.get: no batch ready")
            waiter = _ThreadWaiter(self._lock)
            self._waiters.append(waiter)
            try:
                while not waiter.has_batch:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"Batcher.get: no batch ready within {timeout} s")
                    waiter.cond.wait(remaining)
            except BaseException:
                # Timeout or interrupt (e.g. KeyboardInterrupt): leave the line,
                # and hand back a batch given in the meantime.
                if waiter.has_batch:
                    self._deliver_locked(waiter.batch, front=True)
                else:
                    self._waiters.remove(waiter)
                raise
            return waiter.batch

    def __await__(self) -> Generator[Any, None, Any]:
        """``await batcher`` returns the next finished batch without blocking the event loop."""
        return self._get_async().__await__()

    async def _get_async(self) -> Any:
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._ready:
                return self._ready.popleft()
            waiter = _AsyncWaiter(self, loop)
            self._waiters.append(waiter)
        try:
            return await waiter.future
        except BaseException:
            future = waiter.future
            if future.done() and not future.cancelled():
                # The batch arrived just as this task was cancelled: give it back.
                self._deliver(future.result(), front=True)
            else:
                with self._lock:
                    try:
                        self._waiters.remove(waiter)
                    except ValueError:
                        pass  # already handed a batch; _resolve gives it back
            raise

    def _deliver(self, batch: Any, front: bool = False) -> None:
        with self._lock:
            self._deliver_locked(batch, front)

    def _deliver_locked(self, batch: Any, front: bool) -> None:
        while self._waiters:
            if self._waiters.popleft().give(batch):
                return
        if front:
            self._ready.appendleft(batch)
        else:
            self._ready.append(batch)

    # -- producers -------------------------------------------------------------

    def stack(self, nest: Any) -> None:
        """Add one item: a tensor or a nest of tensors, without a batch dimension.

        The item becomes slot ``k`` of the batch along ``dim``; after ``size``
        items the batch is finished, like ``torch.stack(items, dim)`` leaf by
        leaf. Every item of a batch must have the same structure, dtypes and
        shapes (``ValueError`` otherwise, naming the leaf); a batch started
        with :meth:`cat` cannot take :meth:`stack` items (``RuntimeError``).
        """
        with self._fill_lock:
            if self._mode == "cat":
                raise RuntimeError(
                    "Batcher.stack: the batch in progress was started with cat; "
                    "cannot mix cat and stack within the same batch"
                )
            leaves = self._leaves("stack", nest)
            if self._mode is None:
                specs = [None if t is None else self._stack_spec(p, t) for p, t in leaves]
                self._start("stack", nest, specs)
            else:
                for (path, t), spec in zip(leaves, self._specs, strict=True):
                    self._check_leaf("stack", path, t, spec)
            torch = self._torch
            with torch.no_grad():
                for (_, t), spec, buf in zip(leaves, self._specs, self._buffers, strict=True):
                    if spec is not None:
                        buf.select(spec.dim, self._filled).copy_(t)
            self._filled += 1
            if self._filled == self._size:
                self._finish()

    def cat(self, nest: Any) -> None:
        """Add a tensor or a nest of tensors that already have a batch dimension ``dim``.

        Every tensor leaf of the item must have the same length ``n`` along
        ``dim``. The item fills the batch in progress; once it holds ``size``
        entries the batch is finished and the rest of the item starts the next
        one (an item longer than several batches finishes several). Leaves
        must match the batch in progress in structure, dtype and every
        dimension but ``dim`` (``ValueError`` otherwise, naming the leaf); a
        batch started with :meth:`stack` cannot take :meth:`cat` items
        (``RuntimeError``).
        """
        with self._fill_lock:
            if self._mode == "stack":
                raise RuntimeError(
                    "Batcher.cat: the batch in progress was started with stack; "
                    "cannot mix cat and stack within the same batch"
                )
            leaves = self._leaves("cat", nest)
            if self._mode is None:
                specs = [None if t is None else self._cat_spec(p, t) for p, t in leaves]
            else:
                specs = self._specs
                for (path, t), spec in zip(leaves, specs, strict=True):
                    self._check_leaf("cat", path, t, spec)
            n = None
            first_path = ""
            for (path, t), spec in zip(leaves, specs, strict=True):
                if spec is None:
                    continue
                length = t.shape[spec.dim]
                if n is None:
                    n, first_path = length, path
                elif length != n:
                    raise ValueError(
                        f"Batcher.cat: every leaf of an item needs the same length along the "
                        f"batch dimension; {first_path} has {n}, {path} has {length}"
                    )
            if n is None:
                raise ValueError("Batcher.cat: the item has no tensor to concatenate")
            torch = self._torch
            offset = 0
            while offset < n:
                if self._mode is None:
                    self._start("cat", nest, specs)
                take = min(n - offset, self._size - self._filled)
                with torch.no_grad():
                    for (_, t), spec, buf in zip(leaves, specs, self._buffers, strict=True):
                        if spec is not None:
                            src = t if take == n else t.narrow(spec.dim, offset, take)
                            buf.narrow(spec.dim, self._filled, take).copy_(src)
                self._filled += take
                offset += take
                if self._filled == self._size:
                    self._finish()

    # -- helpers (called with _fill_lock held) -----------------------------------

    def _leaves(self, op: str, nest: Any) -> list[tuple[str, Any]]:
        """The item's leaves as (path, tensor or None), in flatten order, after
        checking its structure against the batch in progress."""
        torch = self._torch
        ndarray = _nest._numpy_ndarray()
        out: list[tuple[str, Any]] = []

        def leaf(path: str, *values: Any) -> None:
            x = values[-1]
            if x is None:
                out.append((path, None))
                return
            t = _nest._as_tensor(torch, x, ndarray)
            if t is None:
                if op == "stack" and _nest._is_number(x):
                    t = torch.as_tensor(x)
                else:
                    what = "a tensor, array, number or None"
                    if op == "cat":
                        what = "a tensor, array or None"
                    raise TypeError(
                        f"Batcher.{op}: leaf at {path} must be {what}, got {type(x).__name__}"
                    )
            out.append((path, t))

        if self._mode is None:
            _nest._map(leaf, [nest], "item")
        else:
            try:
                _nest._map(leaf, [self._skeleton, nest], "item")
            except ValueError as e:
                raise ValueError(
                    f"Batcher.{op}: the item's structure differs from the batch in progress "
                    f"(nest 0 is the batch, nest 1 the item): {e}"
                ) from None
        return out

    def _stack_spec(self, path: str, t: Any) -> _Spec:
        shape = tuple(t.shape)
        rank = len(shape)
        d = self._dim + rank + 1 if self._dim < 0 else self._dim
        if not 0 <= d <= rank:
            raise ValueError(
                f"Batcher.stack: dim {self._dim} is out of range for the {rank}-d leaf at "
                f"{path} (stacking {rank}-d items allows dims {-rank - 1} to {rank})"
            )
        return _Spec(t.dtype, shape, d, shape[:d] + (self._size,) + shape[d:])

    def _cat_spec(self, path: str, t: Any) -> _Spec:
        shape = tuple(t.shape)
        rank = len(shape)
        if rank == 0:
            raise ValueError(
                f"Batcher.cat: the leaf at {path} is 0-d and has no dimension to "
                "concatenate along (use stack)"
            )
        d = self._dim + rank if self._dim < 0 else self._dim
        if not 0 <= d < rank:
            raise ValueError(
                f"Batcher.cat: dim {self._dim} is out of range for the {rank}-d leaf at "
                f"{path} (dims {-rank} to {rank - 1})"
            )
        return _Spec(t.dtype, shape, d, shape[:d] + (self._size,) + shape[d + 1 :])

    def _check_leaf(self, op: str, path: str, t: Any, spec: _Spec | None) -> None:
        if spec is None or t is None:
            if spec is not None or t is not None:
                had = "None" if spec is None else "a tensor"
                got = "None" if t is None else "a tensor"
                raise ValueError(
                    f"Batcher.{op}: the leaf at {path} is {got} but {had} in the batch in progress"
                )
            return
        if t.dtype != spec.dtype:
            raise ValueError(
                f"Batcher.{op}: the leaf at {path} has dtype {t.dtype} but the batch in "
                f"progress has {spec.dtype}"
            )
        shape = tuple(t.shape)
        if op == "stack":
            if shape != spec.shape:
                raise ValueError(
                    f"Batcher.stack: the leaf at {path} has shape {list(shape)} but the batch "
                    f"in progress has items of shape {list(spec.shape)}"
                )
            return
        d = spec.dim
        if len(shape) != len(spec.shape) or shape[:d] + shape[d + 1 :] != (
            spec.shape[:d] + spec.shape[d + 1 :]
        ):
            expected = list(spec.shape)
            expected[d] = "*"
            raise ValueError(
                f"Batcher.cat: the leaf at {path} has shape {list(shape)} but the batch in "
                f"progress needs shape {expected} ('*' along the batch dimension {d})"
            )

    def _start(self, mode: str, nest: Any, specs: list[_Spec | None]) -> None:
        torch = self._torch
        skeleton = _nest.pack_as(nest, [None] * len(specs))
        buffers = [
            None
            if spec is None
            else torch.empty(spec.out_shape, dtype=spec.dtype, device=self._device)
            for spec in specs
        ]
        self._mode = mode
        self._skeleton = skeleton
        self._specs = specs
        self._buffers = buffers
        self._filled = 0

    def _finish(self) -> None:
        batch = _nest.pack_as(self._skeleton, self._buffers)
        self._mode = None
        self._skeleton = None
        self._specs = []
        self._buffers = []
        self._filled = 0
        self._deliver(batch)
