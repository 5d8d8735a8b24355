"""Rpc: named peers calling each other's functions (the public face of the core)."""

from __future__ import annotations

import asyncio
import functools
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from . import _core, nest
from ._checks import MAX_TIMEOUT, check_int, check_seconds
from .errors import RpcError
from .serialization import dumps, loads

__all__ = ["Future", "Queue", "Rpc", "RpcError"]


Future = _core.Future


def _future_await(self: Future) -> Any:
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    self.add_done_callback(functools.partial(_wake, loop, waiter))
    yield from waiter.__await__()
    return self.result()


def _wake(loop: asyncio.AbstractEventLoop, waiter: asyncio.Future, _: Any) -> None:
    # An await that was given up on (asyncio.wait_for's timeout) may complete
    # after its event loop closed: nobody waits for it any more.
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(_resolve, waiter)
        except RuntimeError:  # closed in between
            pass


# The core's Future is the public one (no wrapper on the hot path); asyncio
# support is Python's business.
Future.__await__ = _future_await


def _describe(exc: BaseException) -> str:
    """What the caller sees of a remote exception: type, message and the remote traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{type(exc).__name__}: {exc}\nRemote traceback:\n{tb}"


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Reply:
    """The return callback of a queued call: call it with the result, or .error()."""

    __slots__ = ("_responders",)

    def __init__(self, responders: list) -> None:
        self._responders = responders

    def __call__(self, result: Any) -> None:
        if len(self._responders) == 1 and not isinstance(self, _BatchReply):
            self._responders[0].reply(result)
            return
        _reply_batch(self._responders, result)

    def error(self, message: str | BaseException) -> None:
        """Fails the call(s) at the caller with ``message``."""
        if isinstance(message, BaseException):
            message = _describe(message)
        for r in self._responders:
            r.error(str(message))


class _BatchReply(_Reply):
    __slots__ = ()


def _reply_batch(responders: list, result: Any) -> None:
    try:
        parts = nest.unstack(result, len(responders))
    except BaseException as e:  # noqa: BLE001
        message = _describe(e)
        for r in responders:
            r.error(message)
        return
    for r, part in zip(responders, parts, strict=True):
        r.reply(part)


def _stack_calls(calls: list[tuple[tuple, dict]], device: Any) -> tuple[tuple, dict]:
    args, kwargs = nest.stack(calls)
    if device is not None:
        args, kwargs = nest.map_structure(
            lambda t: t.to(device) if hasattr(t, "to") else t, (args, kwargs)
        )
    return tuple(args), dict(kwargs)


class _BatchedFunction:
    """Runs fn on the stacked arguments of the calls that are waiting, up to batch_size.

    A call that arrives while a batch runs waits for the next one, so batches
    grow with load and a lone call is never held back.
    """

    def __init__(self, fn: Callable, batch_size: int, device: Any) -> None:
        self._fn = fn
        self._batch_size = batch_size
        self._device = device
        self._lock = threading.Lock()
        self._pending: list = []
        self._running = False

    def __call__(self, responder: Any, args: tuple, kwargs: dict) -> None:
        with self._lock:
            self._pending.append((responder, (args, kwargs)))
            if self._running:
                return
            self._running = True
        while True:
            with self._lock:
                batch = self._pending[: self._batch_size]
                del self._pending[: self._batch_size]
                if not batch:
                    self._running = False
                    return
            responders = [r for r, _ in batch]
            try:
                args, kwargs = _stack_calls([c for _, c in batch], self._device)
                result = self._fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001
                message = _describe(e)
                for r in responders:
                    r.error(message)
                continue
            _reply_batch(responders, result)


class Queue:
    """Incoming calls of a function defined with Rpc.define_queue, as items.

    Each item is ``(return_callback, args, kwargs)``; call ``return_callback(result)``
    (or ``return_callback.error(msg)``) to answer. With ``batch_size``, the
    arguments of up to that many calls are stacked along a new first dimension
    and ``return_callback`` takes the batched result. Without
    ``dynamic_batching`` a batch waits until it is full. Iterate with ``for``,
    ``async for``, or take one item with ``get()`` or ``await queue``.
    """

    def __init__(self, batch_size: int | None = None, dynamic_batching: bool = False) -> None:
        self._batch_size = _check_batch_size(batch_size)
        self._dynamic = dynamic_batching
        self._cv = threading.Condition()
        self._items: list = []
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def _put(self, responder: Any, args: tuple, kwargs: dict) -> None:
        with self._cv:
            self._items.append((responder, (args, kwargs)))
            self._cv.notify()
            waiters, self._async_waiters = self._async_waiters, []
        for loop, waiter in waiters:
            loop.call_soon_threadsafe(_resolve, waiter)

    def _ready(self) -> bool:
        if not self._items:
            return False
        return self._batch_size is None or self._dynamic or len(self._items) >= self._batch_size

    def _take(self) -> tuple:
        if self._batch_size is None:
            responder, (args, kwargs) = self._items.pop(0)
            return _Reply([responder]), args, kwargs
        batch = self._items[: self._batch_size]
        del self._items[: self._batch_size]
        args, kwargs = _stack_calls([c for _, c in batch], None)
        return _BatchReply([r for r, _ in batch]), args, kwargs

    def get(self, timeout: float | None = None) -> tuple:
        """Blocks until an item (or a batch) is ready; raises TimeoutError after ``timeout``."""
        with self._cv:
            if not self._cv.wait_for(self._ready, timeout):
                raise TimeoutError("no call arrived within the timeout")
            return self._take()

    def empty(self) -> bool:
        """Whether no call is waiting."""
        with self._cv:
            return not self._items

    def qsize(self) -> int:
        """How many calls are waiting."""
        with self._cv:
            return len(self._items)

    def __iter__(self) -> Iterator[tuple]:
        return self

    def __next__(self) -> tuple:
        return self.get()

    def __await__(self) -> Any:
        loop = asyncio.get_running_loop()
        while True:
            with self._cv:
                if self._ready():
                    return self._take()
                waiter = loop.create_future()
                self._async_waiters.append((loop, waiter))
            yield from waiter.__await__()

    def __aiter__(self) -> Queue:
        return self

    async def __anext__(self) -> tuple:
        return await self


def _serve_deferred(fn: Callable, responder: Any, args: tuple, kwargs: dict) -> None:
    # An exception is answered by the core, with _describe of it.
    fn(_Reply([responder]), *args, **kwargs)


_default_auth_key: str | None = None


def set_auth_key(key: str | None) -> None:
    """Sets the shared authentication key of every Rpc created afterwards.

    Overrides MOOLIB_AUTH_KEY. Peers with different keys (or one without) cannot connect.
    """
    global _default_auth_key
    _default_auth_key = key


_core.set_codec(dumps, loads, _describe)


def _check_callable(method: str, what: str, fn: object) -> None:
    # Found here rather than as a TypeError on the core thread of the first call.
    if not callable(fn):
        raise TypeError(f"{method}: {what} must be callable, got {type(fn).__name__} {fn!r:.80}")


def _check_name(method: str, name: object) -> None:
    # Else the core's binding names its internal function (_define_owned).
    if not isinstance(name, str):
        raise TypeError(f"{method}: the function's name must be a str, got {type(name).__name__}")


def _check_batch_size(batch_size: object) -> int | None:
    return None if batch_size is None else check_int("batch_size", batch_size, low=1)


class Rpc(_core.Rpc):
    """One peer: a name, listeners, connections, and functions other peers can call.

    Inherited from the core: set_name, get_name, listen (returns the bound
    address), connect (reconnects whenever the link drops), set_timeout (per
    call, default 10 s), get_timeout, set_transports (["shm", "tcp"]),
    set_auth_key, debug_info, close, and the calls themselves:
    async_(peer, fn, *args, **kwargs) -> Future and sync(peer, fn, *args,
    **kwargs) -> result (raises RpcError: the moolib.errors class of the failure).

    An Rpc that is deleted or garbage collected closes as close() does before
    that returns. The functions defined on it belong to it (the core reaches
    them only through it), so an object that owns an Rpc and defines its own
    methods on it is collected like any other cycle.
    """

    def __init__(self) -> None:
        super().__init__()
        # name -> its _core.Handler: the function and how the core serves it.
        self._handlers: dict[str, _core.Handler] = {}
        if _default_auth_key is not None:
            self.set_auth_key(_default_auth_key)

    def set_timeout(self, seconds: float) -> None:
        """Seconds a call may take before it fails with ``RpcTimeoutError`` (default
        10): positive and below 1e7; anything else is a ValueError."""
        super().set_timeout(
            check_seconds("the call timeout (Rpc.set_timeout)", seconds, below=MAX_TIMEOUT)
        )

    def _define(self, name: str, fn: Callable, kind: str, method: str = "define") -> None:
        """Defines ``name`` as ``fn``, served as ``kind`` says (moolib._core.Handler):
        "call": ``fn(*args, **kwargs)`` returns the result; "responder":
        ``fn(responder, args, kwargs)`` answers through ``responder.reply(result)``
        or ``responder.error(text)``, then or later; "encoded": ``fn(args,
        kwargs)`` returns the result already encoded, ``(data, buffers)``."""
        _check_name(method, name)
        # This object owns the handler and the core holds a weak reference to
        # it: a function that refers back to its Rpc's owner
        # (``self.rpc.define("f", self.f)``) makes a cycle that the garbage
        # collector sees whole, since no strong reference to it hides in the core.
        handler = _core.Handler(fn, kind)
        if name in self._handlers:
            # The core raises its usual error: the name is taken.
            self._define_owned(name, handler)
        self._handlers[name] = handler
        try:
            self._define_owned(name, handler)
        except BaseException:
            del self._handlers[name]
            raise

    def undefine(self, name: str) -> None:
        """Removes ``name``; waits for its calls in flight (unless called from one)."""
        super().undefine(name)
        self._handlers.pop(name, None)

    def define(
        self, name: str, fn: Callable, batch_size: int | None = None, device: Any = None
    ) -> None:
        """Makes ``fn`` callable by other peers as ``name``; it runs on a core thread.

        With ``batch_size``, the arguments of concurrent calls are stacked along a
        new first dimension (moved to ``device`` if given), fn runs once on the
        batch, and its result is split back along that dimension to each caller.
        """
        _check_callable("define", "fn", fn)
        batch_size = _check_batch_size(batch_size)
        if batch_size is None:
            self._define(name, fn, "call")
            return
        self._define(name, _BatchedFunction(fn, batch_size, device), "responder")

    def define_deferred(self, name: str, fn: Callable) -> None:
        """Defines ``name`` as ``fn(callback, *args, **kwargs)``: the call returns
        when ``callback(result)`` is called (from any thread, any time later)."""
        _check_callable("define_deferred", "fn", fn)
        self._define(name, functools.partial(_serve_deferred, fn), "responder", "define_deferred")

    def define_queue(
        self, name: str, batch_size: int | None = None, dynamic_batching: bool = False
    ) -> Queue:
        """Defines ``name`` so that its calls arrive as items of the returned Queue."""
        queue = Queue(batch_size, dynamic_batching)
        self._define(name, queue._put, "responder", "define_queue")
        return queue

    def async_callback(
        self, peer: str, fn: str, callback: Callable[[Any, Any], Any], *args: Any, **kwargs: Any
    ) -> None:
        """Calls ``fn`` on ``peer``; ``callback(result, error)`` runs on a core thread
        when it completes (error is None on success, result None on error)."""
        _check_callable("async_callback", "callback", callback)

        def done(future: Future) -> None:
            try:
                result = future.result()
            except RpcError as e:
                callback(None, e)
                return
            callback(result, None)

        self.async_(peer, fn, *args, **kwargs).add_done_callback(done)

    def __enter__(self) -> Rpc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
