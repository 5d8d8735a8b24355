"""Rpc: named peers calling each other's functions (the public face of the core)."""

from __future__ import annotations

import asyncio
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from . import _core, nest
from .serialization import dumps, loads

__all__ = ["Future", "Queue", "Rpc", "RpcError"]


class RpcError(RuntimeError):
    """A call failed: timeout, unknown peer or function, or an exception in the remote function."""


def _describe(exc: BaseException) -> str:
    """What the caller sees of a remote exception: type, message and the remote traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return f"{type(exc).__name__}: {exc}\nRemote traceback:\n{tb}"


def _decode(segments: list) -> Any:
    return loads(segments[0], segments[1:])


class Future:
    """The result of an asynchronous call, completed by the core."""

    __slots__ = ("_core_future",)

    def __init__(self, core_future: _core.Future) -> None:
        self._core_future = core_future

    def result(self, timeout: float | None = None) -> Any:
        """Waits for the call and returns its result, or raises RpcError.

        Raises TimeoutError if ``timeout`` seconds pass first (the call goes on).
        """
        f = self._core_future
        if not f.done() and not f.wait(timeout):
            raise TimeoutError("the call did not complete within the wait timeout")
        error = f.error()
        if error is not None:
            raise RpcError(error)
        return _decode(f.segments())

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until the call completes; returns whether it did within ``timeout``."""
        return self._core_future.wait(timeout)

    def done(self) -> bool:
        """Whether the call has completed (with a result or an error)."""
        return self._core_future.done()

    def cancel(self) -> bool:
        """Gives up on the call; returns False if it had already completed."""
        return self._core_future.cancel()

    def cancelled(self) -> bool:
        """Whether cancel() took effect."""
        return self._core_future.cancelled()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Waits for the call and returns its error as an RpcError, or None."""
        if not self.wait(timeout):
            raise TimeoutError("the call did not complete within the wait timeout")
        error = self._core_future.error()
        return None if error is None else RpcError(error)

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        """Calls ``fn(self)`` on a core thread once the call completes."""
        self._core_future.add_done_callback(lambda: fn(self))

    def __await__(self) -> Any:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake() -> None:
            loop.call_soon_threadsafe(_resolve, waiter)

        self._core_future.add_done_callback(wake)
        yield from waiter.__await__()
        return self.result()


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
            _reply(self._responders[0], result)
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


def _reply(responder: Any, result: Any) -> None:
    try:
        data, buffers = dumps(result)
    except BaseException as e:  # noqa: BLE001 - any pickling failure goes to the caller
        responder.error(_describe(e))
        return
    responder.reply(data, buffers)


def _reply_batch(responders: list, result: Any) -> None:
    try:
        parts = nest.unstack(result, len(responders))
    except BaseException as e:  # noqa: BLE001
        message = _describe(e)
        for r in responders:
            r.error(message)
        return
    for r, part in zip(responders, parts):
        _reply(r, part)


def _stack_calls(calls: list[tuple[tuple, dict]], device: Any) -> tuple[tuple, dict]:
    args, kwargs = nest.stack(calls)
    if device is not None:
        args, kwargs = nest.map_structure(lambda t: t.to(device) if hasattr(t, "to") else t, (args, kwargs))
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

    def __call__(self, responder: Any, segments: list) -> None:
        try:
            args, kwargs = _decode(segments)
        except BaseException as e:  # noqa: BLE001
            responder.error(_describe(e))
            return
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
    ``dynamic_batching`` a batch waits until it is full.
    """

    def __init__(self, batch_size: int | None = None, dynamic_batching: bool = False) -> None:
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self._batch_size = batch_size
        self._dynamic = dynamic_batching
        self._cv = threading.Condition()
        self._items: list = []
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def _put(self, responder: Any, segments: list) -> None:
        try:
            call = _decode(segments)
        except BaseException as e:  # noqa: BLE001
            responder.error(_describe(e))
            return
        with self._cv:
            self._items.append((responder, call))
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


def _serve(fn: Callable, responder: Any, segments: list) -> None:
    try:
        args, kwargs = _decode(segments)
        result = fn(*args, **kwargs)
        data, buffers = dumps(result)
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the caller
        responder.error(_describe(e))
        return
    responder.reply(data, buffers)


def _serve_deferred(fn: Callable, responder: Any, segments: list) -> None:
    try:
        args, kwargs = _decode(segments)
        fn(_Reply([responder]), *args, **kwargs)
    except BaseException as e:  # noqa: BLE001
        responder.error(_describe(e))


_default_auth_key: str | None = None


def set_auth_key(key: str | None) -> None:
    """Sets the shared authentication key of every Rpc created afterwards.

    Overrides MOOLIB_AUTH_KEY. Peers with different keys (or one without) cannot connect.
    """
    global _default_auth_key
    _default_auth_key = key


class Rpc:
    """One peer: a name, listeners, connections, and functions other peers can call."""

    def __init__(self) -> None:
        self._core = _core.Rpc()
        if _default_auth_key is not None:
            self._core.set_auth_key(_default_auth_key)

    def set_name(self, name: str) -> None:
        """Sets the name other peers call this one by (a unique random name by default)."""
        self._core.set_name(name)

    def get_name(self) -> str:
        """This peer's name."""
        return self._core.get_name()

    def listen(self, address: str) -> str:
        """Listens on ``host:port`` (port 0 picks a free one); returns the bound address."""
        return self._core.listen(address)

    def connect(self, address: str) -> None:
        """Connects to the peer at ``host:port``, and reconnects whenever the link drops."""
        self._core.connect(address)

    def set_timeout(self, seconds: float) -> None:
        """Sets how long a call may wait for its reply (default 10 s)."""
        self._core.set_timeout(float(seconds))

    def get_timeout(self) -> float:
        """The call timeout in seconds."""
        return self._core.get_timeout()

    def set_transports(self, transports: list[str]) -> None:
        """Restricts which transports carry calls: any of "shm" and "tcp"."""
        self._core.set_transports(list(transports))

    def set_auth_key(self, key: str) -> None:
        """Sets the shared key connections must prove knowledge of (HMAC challenge)."""
        self._core.set_auth_key(key)

    def debug_info(self) -> dict:
        """Name, addresses, peers and the transport of each of their connections."""
        return self._core.debug_info()

    def define(
        self, name: str, fn: Callable, batch_size: int | None = None, device: Any = None
    ) -> None:
        """Makes ``fn`` callable by other peers as ``name``; it runs on a core thread.

        With ``batch_size``, the arguments of concurrent calls are stacked along a
        new first dimension (moved to ``device`` if given), fn runs once on the
        batch, and its result is split back along that dimension to each caller.
        """
        if batch_size is None:
            self._core.define(name, lambda responder, segments: _serve(fn, responder, segments))
            return
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self._core.define(name, _BatchedFunction(fn, batch_size, device))

    def define_deferred(self, name: str, fn: Callable) -> None:
        """Defines ``name`` as ``fn(callback, *args, **kwargs)``: the call returns
        when ``callback(result)`` is called (from any thread, any time later)."""
        self._core.define(name, lambda responder, segments: _serve_deferred(fn, responder, segments))

    def define_queue(
        self, name: str, batch_size: int | None = None, dynamic_batching: bool = False
    ) -> Queue:
        """Defines ``name`` so that its calls arrive as items of the returned Queue."""
        queue = Queue(batch_size, dynamic_batching)
        self._core.define(name, queue._put)
        return queue

    def undefine(self, name: str) -> None:
        """Removes a function; waits for its calls in flight to finish."""
        self._core.undefine(name)

    def async_(self, peer: str, fn: str, *args: Any, **kwargs: Any) -> Future:
        """Calls ``fn`` on ``peer``; returns a Future for the result."""
        data, buffers = dumps((args, kwargs))
        return Future(self._core.call(peer, fn, data, buffers))

    def async_callback(
        self, peer: str, fn: str, callback: Callable[[Any, Any], Any], *args: Any, **kwargs: Any
    ) -> None:
        """Calls ``fn`` on ``peer``; ``callback(result, error)`` runs on a core thread
        when it completes (error is None on success, result None on error)."""
        future = self.async_(peer, fn, *args, **kwargs)

        def done() -> None:
            try:
                result = future.result()
            except RpcError as e:
                callback(None, e)
                return
            callback(result, None)

        future._core_future.add_done_callback(done)

    def sync(self, peer: str, fn: str, *args: Any, **kwargs: Any) -> Any:
        """Calls ``fn`` on ``peer`` and waits for the result (raises RpcError on failure)."""
        return self.async_(peer, fn, *args, **kwargs).result()

    def close(self) -> None:
        """Closes every connection and listener; calls in flight fail."""
        self._core.close()

    def __enter__(self) -> Rpc:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
