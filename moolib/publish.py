"""Versioned parameter publishing: one learner publishes weights, many actors fetch them.

A :class:`Publisher` serves the latest publication of a nest of tensors or
arrays (e.g. ``model.state_dict()``) under a name on its peer's :class:`Rpc`;
a :class:`Subscriber` on any other peer fetches it by name, and only gets the
weights when the publisher holds a newer version than it already has.

Why it is built this way (see docs/architecture.md, "Parameter publishing"):

- ``publish()`` copies the nest once into one contiguous buffer (the
  *snapshot*) and pickles a small stream that describes it once. Every fetch
  answers with that same prebuilt stream and buffer: the core frames a header
  and ships the buffer as out-of-band segments (slices of up to 256 MiB), so
  serving N actors costs N sends and no serialization, and the learner may
  keep training (changing its tensors) while actors fetch the snapshot.
- A snapshot never changes after it is built; ``publish()`` swaps in a new one.
  A fetch in flight keeps the snapshot it started with alive (the core holds
  its buffer until sent), so a fetch always returns one version, never a mix,
  and an old snapshot is freed as soon as no fetch uses it.
- The request carries the subscriber's version, so the reply to an actor that
  is up to date is a few bytes.

The reply is an ordinary moolib reply: ``rpc.sync(peer, name, version)``
returns ``None`` or ``(version, metadata, [buffer, ...])``.
"""

from __future__ import annotations

import asyncio
import pickle
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import errors
from ._checks import check_int, check_seconds, check_served

__all__ = ["Publisher", "Subscriber"]

# Each leaf starts at a multiple of this within a snapshot, so that the views a
# subscriber makes over the received buffer are aligned for every dtype (and
# for vector loads).
_ALIGN = 64

# A snapshot goes out as segments of at most this size unless one leaf is
# larger (leaves never straddle two): the core's receive side reuses freed
# blocks only up to 256 MiB, so a larger model sent as one segment would be
# received into fresh, page-faulting memory on every TCP fetch (1.6x slower at
# 400 MB in bench/publish.py), while many small segments cost shared-memory
# fetches a pool segment each.
_CHUNK = 256 << 20

# The layout of the metadata blob; a subscriber refuses others.
_FORMAT = 1

# The reply to a subscriber that already holds the latest version.
_NOTHING_NEWER = (pickle.dumps(None, protocol=5), [])


class _Slot:
    """Where a tensor or array sat in a published nest (index into the leaf specs)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple:
        return (_Slot, (self.index,))


# A leaf of a snapshot: (path, library, dtype name, shape, offset, nbytes, device).
# library is "torch" or "numpy"; dtype is torch's name ("float32") or numpy's
# dtype.str ("<f4"); device is None for CPU data.
_Spec = tuple[str, str, str, tuple[int, ...], int, int, "str | None"]

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _torch_tensor_type() -> type | None:
    torch = sys.modules.get("torch")
    return torch.Tensor if torch is not None else None


def _skeleton(obj: Any, path: str, leaves: list[tuple[str, Any]], tensor: type | None) -> Any:
    """``obj`` with every tensor or array replaced by a _Slot; leaves collects them."""
    if (tensor is not None and isinstance(obj, tensor)) or isinstance(obj, np.ndarray):
        leaves.append((path or "<root>", obj))
        return _Slot(len(leaves) - 1)
    if isinstance(obj, _SCALARS):
        return obj
    if isinstance(obj, dict):
        out = type(obj)() if type(obj) in (dict, OrderedDict) else {}
        for k, v in obj.items():
            out[k] = _skeleton(v, _join(path, k), leaves, tensor)
        # A state_dict's _metadata (module versions) matters to load_state_dict.
        extra = getattr(obj, "_metadata", None)
        if extra is not None and type(out) is OrderedDict:
            out._metadata = extra  # type: ignore[attr-defined]
        return out
    if isinstance(obj, (list, tuple)):
        items = [_skeleton(v, _join(path, i), leaves, tensor) for i, v in enumerate(obj)]
        if isinstance(obj, list):
            return items
        if hasattr(obj, "_fields"):  # a namedtuple
            return type(obj)(*items)
        return tuple(items)
    raise TypeError(
        f"cannot publish {type(obj).__name__} at {path or '<root>'}: a published nest holds "
        "tensors, arrays and plain Python values in dicts, lists and tuples"
    )


def _fill(skeleton: Any, leaves: Sequence[Any]) -> Any:
    """The nest described by ``skeleton`` with its slots filled from ``leaves``."""
    if type(skeleton) is _Slot:
        return leaves[skeleton.index]
    if isinstance(skeleton, dict):
        out = type(skeleton)((k, _fill(v, leaves)) for k, v in skeleton.items())
        extra = getattr(skeleton, "_metadata", None)
        if extra is not None:
            out._metadata = extra
        return out
    if isinstance(skeleton, list):
        return [_fill(v, leaves) for v in skeleton]
    if isinstance(skeleton, tuple):
        items = [_fill(v, leaves) for v in skeleton]
        return type(skeleton)(*items) if hasattr(skeleton, "_fields") else tuple(items)
    return skeleton


def _describe_leaf(x: Any, path: str) -> tuple[str, str, tuple[int, ...], int, str | None]:
    """(library, dtype, shape, nbytes, device) of a tensor or array leaf."""
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject:
            raise TypeError(f"cannot publish {path}: numpy arrays of Python objects have no bytes")
        return "numpy", x.dtype.str, tuple(x.shape), x.nbytes, None
    torch = sys.modules["torch"]
    if x.layout is not torch.strided or x.is_quantized or x.is_nested or x.device.type == "meta":
        raise TypeError(f"cannot publish {path}: only dense (strided) tensors can be published")
    dtype = str(x.dtype).removeprefix("torch.")
    device = None if x.device.type == "cpu" else str(x.device)
    return "torch", dtype, tuple(x.shape), x.numel() * x.element_size(), device


def _copy_leaf(buffer: np.ndarray, spec: _Spec, x: Any) -> None:
    """Copies leaf ``x`` into its place in ``buffer``."""
    _, library, _, shape, offset, nbytes, _ = spec
    window = buffer[offset : offset + nbytes]
    if library == "numpy":
        np.copyto(window.view(x.dtype).reshape(shape), x, casting="no")
        return
    torch = sys.modules["torch"]
    # copy_ handles any strides, lazy conj/neg views, and a device-to-host copy
    # (CUDA tensors are snapshot to host memory, as every moolib message is).
    torch.from_numpy(window).view(x.dtype).view(shape).copy_(x.detach())


class _Snapshot:
    """One publication: its version and the reply every fetch of it gets."""

    __slots__ = ("version", "buffer", "reply", "__weakref__")

    def __init__(self, version: int, nest: Any) -> None:
        leaves: list[tuple[str, Any]] = []
        skeleton = _skeleton(nest, "", leaves, _torch_tensor_type())
        specs: list[_Spec] = []
        chunks: list[tuple[int, int]] = []
        start = offset = 0
        for path, x in leaves:
            library, dtype, shape, nbytes, device = _describe_leaf(x, path)
            offset = -(-offset // _ALIGN) * _ALIGN
            if offset > start and offset + nbytes - start > _CHUNK:
                chunks.append((start, offset))
                start = offset
            specs.append((path, library, dtype, shape, offset, nbytes, device))
            offset += nbytes
        # Never empty: a zero-length segment would gain nothing and is an edge
        # case for every transport.
        chunks.append((start, max(offset, start + _ALIGN)))
        self.buffer = np.empty(chunks[-1][1], dtype=np.uint8)
        for spec, (_, x) in zip(specs, leaves, strict=True):
            _copy_leaf(self.buffer, spec, x)
        # The structure alone (no version): equal for every publication of one
        # model, so subscribers parse it once.
        metadata = pickle.dumps((_FORMAT, skeleton, specs, chunks), protocol=5)
        self.version = version
        segments = [self.buffer[a:b] for a, b in chunks]
        # Out of band: the stream only refers to segments 1.., which are sent
        # from the snapshot's memory, never pickled or copied here.
        stream = pickle.dumps(
            (version, metadata, [pickle.PickleBuffer(c) for c in segments]),
            protocol=5,
            buffer_callback=lambda _: False,
        )
        self.reply = (stream, segments)


class Publisher:
    """Serves versioned snapshots of a nest of tensors or arrays under ``name``.

    ``Publisher(rpc, name)`` defines ``name`` on ``rpc`` (a moolib.Rpc); peers
    fetch with :class:`Subscriber`. ``version`` is the version to continue
    from: a learner that restarts passes the last version it published (or a
    checkpoint's), so subscribers that hold it keep going. Until the first
    ``publish()``, fetches get nothing (``Subscriber.fetch()`` returns None).
    """

    def __init__(self, rpc: Any, name: str, version: int = -1) -> None:
        check_served("Publisher", rpc, name)
        self._rpc = rpc
        self._name = name
        self._version = check_int("version", version, low=-1)
        self._current: _Snapshot | None = None
        self._lock = threading.Lock()
        self._published = 0
        self._served = 0
        self._unchanged = 0
        rpc._define(name, self._serve, "encoded")
        self._defined = True

    @property
    def name(self) -> str:
        """The name subscribers fetch."""
        return self._name

    @property
    def version(self) -> int:
        """The version of the latest publication (-1, or the given one, before any)."""
        return self._version

    def publish(self, nest: Any, version: int | None = None) -> int:
        """Snapshots ``nest`` (e.g. ``model.state_dict()``) as ``version``; returns it.

        ``nest`` holds torch tensors (any device: they are copied to host
        memory) and numpy arrays in dicts, lists and tuples, plus plain Python
        values. It is copied once, here, into one buffer that every fetch sends
        as is: change the model as soon as this returns. ``version`` defaults
        to the previous one plus 1 and must be greater than it (a subscriber
        fetches only what is newer than what it holds).
        """
        with self._lock:
            if version is None:
                version = self._version + 1
            version = check_int("version", version, low=-1)
            if version <= self._version:
                raise ValueError(
                    f"cannot publish '{self._name}' as version {version}: it is already at "
                    f"version {self._version}, and versions must increase (subscribers only "
                    "fetch a version newer than theirs)"
                )
            # Built before it is swapped in, so a fetch sees the old or the new
            # snapshot whole, never one in the making.
            snapshot = _Snapshot(version, nest)
            self._current = snapshot
            self._version = version
            self._published += 1
        return version

    def stats(self) -> dict[str, int]:
        """Counters: ``published`` (snapshots built), ``served`` (fetches answered
        with weights), ``unchanged`` (fetches answered "nothing newer"), ``bytes``
        (size of the current snapshot's buffer)."""
        current = self._current
        return {
            "published": self._published,
            "served": self._served,
            "unchanged": self._unchanged,
            "bytes": 0 if current is None else current.buffer.nbytes,
        }

    def close(self) -> None:
        """Stops serving ``name`` (waits for fetches in flight) and frees the snapshot."""
        if self._defined:
            self._defined = False
            self._rpc.undefine(self._name)
        self._current = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _serve(self, args: tuple, kwargs: dict) -> tuple:
        # Runs on a core thread for every fetch; returns the prebuilt reply for
        # the core to send (an exception is answered by the core).
        have = kwargs.get("version", args[0] if args else -1)
        if type(have) is not int:
            raise TypeError(f"a fetch carries the subscriber's version (int), got {have!r}")
        snapshot = self._current
        if snapshot is None or snapshot.version <= have:
            with self._lock:
                self._unchanged += 1
            return _NOTHING_NEWER
        with self._lock:
            self._served += 1
        return snapshot.reply


class _Layout:
    """A parsed metadata blob: the nest's skeleton and its leaves' specs."""

    __slots__ = ("raw", "skeleton", "specs", "by_path", "chunks", "where")

    def __init__(self, raw: bytes) -> None:
        fmt, skeleton, specs, chunks = pickle.loads(raw)
        if fmt != _FORMAT:
            raise RuntimeError(
                f"the publisher sends snapshot format {fmt}, this moolib reads {_FORMAT}: "
                "upgrade the older side"
            )
        self.raw = raw
        self.skeleton = skeleton
        self.specs: list[_Spec] = [tuple(s) for s in specs]  # type: ignore[misc]
        self.by_path = {s[0]: s for s in self.specs}
        self.chunks = list(chunks)
        # (segment, offset in it) of each leaf.
        self.where = []
        for spec in self.specs:
            i = max(i for i, (a, _) in enumerate(self.chunks) if a <= spec[4])
            self.where.append((i, spec[4] - self.chunks[i][0]))


def _dtype_name(library: str, dtype: str) -> str:
    return np.dtype(dtype).name if library == "numpy" else dtype


def _describe_spec(spec: _Spec) -> str:
    _, library, dtype, shape, _, _, _ = spec
    return f"{_dtype_name(library, dtype)} {list(shape)}"


def _leaf_views(layout: _Layout, buffers: Sequence[Any], to_device: bool) -> list[Any]:
    """Tensors and arrays over the received ``buffers`` (no copy), one per spec;
    with ``to_device``, tensors published from a GPU move to a matching local one."""
    if len(buffers) != len(layout.chunks):
        raise RuntimeError(
            f"a snapshot of {len(layout.chunks)} segments arrived with {len(buffers)}"
        )
    raws = [np.frombuffer(b, dtype=np.uint8) for b in buffers]
    flats: dict[int, Any] = {}
    out = []
    for spec, (chunk, offset) in zip(layout.specs, layout.where, strict=True):
        _, library, dtype, shape, _, nbytes, device = spec
        window = raws[chunk][offset : offset + nbytes]
        if library == "numpy":
            out.append(window.view(np.dtype(dtype)).reshape(shape))
            continue
        import torch

        if chunk not in flats:
            flats[chunk] = torch.from_numpy(raws[chunk])
        tensor = flats[chunk][offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)
        if device is not None and to_device:
            from .serialization import _to_received_device

            tensor = _to_received_device(torch, tensor, device)
        out.append(tensor)
    return out


class Subscriber:
    """Fetches what a :class:`Publisher` on ``peer`` serves under ``name``, when newer.

    ``timeout`` (seconds) bounds each fetch; None uses the Rpc's timeout. A
    fetch asks for anything newer than :attr:`version` (-1 before the first);
    the publisher answers with its latest snapshot, or a few bytes saying
    there is nothing newer. Fetches from several threads are safe: versions
    seen never go back.
    """

    def __init__(self, rpc: Any, peer: str, name: str, timeout: float | None = None) -> None:
        self._rpc = rpc
        self._peer = peer
        self._name = name
        if timeout is not None:
            timeout = check_seconds("timeout", timeout)
        self._timeout = timeout
        self._version = -1
        self._lock = threading.Lock()
        self._layout: _Layout | None = None

    @property
    def version(self) -> int:
        """The version this subscriber holds: the last fetched, -1 before any."""
        return self._version

    @property
    def peer(self) -> str:
        return self._peer

    @property
    def name(self) -> str:
        return self._name

    # -- the fetch itself ----------------------------------------------------

    def _request(self) -> Any:
        return self._rpc.async_(self._peer, self._name, self._version)

    def _failed(self, error: errors.RpcError) -> errors.RpcError:
        # The peer is there but publishes nothing by this name: say so in the
        # Publisher's terms, the RPC function being an implementation detail.
        unknown = isinstance(error, errors.FunctionNotDefinedError)
        hint = f" (no Publisher named '{self._name}' there)" if unknown else ""
        # Of the same class, so that callers can tell failures apart as for any call.
        return type(error)(
            f"fetching '{self._name}' from peer '{self._peer}' failed: {error}{hint}"
        )

    def _timed_out(self) -> errors.RpcError:
        return errors.RpcTimeoutError(
            f"fetching '{self._name}' from peer '{self._peer}' failed: no answer within "
            f"{self._timeout} s"
        )

    def _wait(self, future: Any) -> Any:
        if self._timeout is not None and not future.wait(self._timeout):
            future.cancel()
            raise self._timed_out()
        try:
            return future.result()
        except errors.RpcError as e:
            raise self._failed(e) from None

    async def _wait_async(self, future: Any) -> Any:
        async def result() -> Any:
            return await future

        try:
            if self._timeout is None:
                return await result()
            return await asyncio.wait_for(result(), self._timeout)
        except errors.RpcError as e:  # first: an RpcTimeoutError is a TimeoutError too
            raise self._failed(e) from None
        except asyncio.TimeoutError:
            future.cancel()
            raise self._timed_out() from None

    def _parse(self, reply: Any) -> tuple[int, _Layout, Any] | None:
        """(version, layout, buffers) of a reply, or None when it holds nothing newer."""
        if reply is None:
            return None
        version, raw, buffers = reply
        layout = self._layout
        if layout is None or layout.raw != raw:
            # Parsed once per model layout, not per fetch.
            layout = self._layout = _Layout(bytes(raw))
        return version, layout, buffers

    # -- fetch -----------------------------------------------------------------

    def _accept(self, reply: Any) -> tuple[int, Any] | None:
        parsed = self._parse(reply)
        if parsed is None:
            return None
        version, layout, buffers = parsed
        with self._lock:
            if version <= self._version:  # a concurrent fetch got it (or newer) first
                return None
            self._version = version
        return version, _fill(layout.skeleton, _leaf_views(layout, buffers, True))

    def fetch(self) -> tuple[int, Any] | None:
        """``(version, nest)`` if the publisher holds a newer version than this
        subscriber, else None (also when nothing is published yet).

        The nest is shaped like the published one; its tensors and arrays
        share the received memory (no copy); tensors published from a GPU come
        back on the GPU of the same index when there is one. Raises RpcError,
        naming the peer, if the peer is unknown, gone, or does not answer in time:
        the ``moolib.errors`` class of the failure (``RpcTimeoutError``,
        ``FunctionNotDefinedError`` where no Publisher of that name is, ...).
        """
        return self._accept(self._wait(self._request()))

    async def fetch_async(self) -> tuple[int, Any] | None:
        """:meth:`fetch` for asyncio: awaits the reply without blocking the loop."""
        return self._accept(await self._wait_async(self._request()))

    # -- fetch_into ------------------------------------------------------------

    def _copy_into(self, reply: Any, target: Any) -> bool:
        parsed = self._parse(reply)
        if parsed is None:
            return False
        version, layout, buffers = parsed
        with self._lock:
            if version <= self._version:
                return False
            destinations = _destinations(target)
            pairs = _match(layout, destinations, self._name)
            views = _leaf_views(layout, buffers, False)
            index = {spec[0]: i for i, spec in enumerate(layout.specs)}
            torch = sys.modules.get("torch")
            if torch is not None:
                with torch.no_grad():
                    _copy_pairs(pairs, views, index)
            else:
                _copy_pairs(pairs, views, index)
            self._version = version
        return True

    def fetch_into(self, target: Any) -> bool:
        """Copies a newer publication into ``target`` in place; returns whether it did.

        ``target`` is a torch module (its state_dict's tensors are written, as
        ``load_state_dict`` would, without new allocations) or a nest of
        tensors and arrays shaped like the published one. Every published
        tensor must have a counterpart of the same dtype and shape, and the
        reverse; otherwise ValueError names the key, what was published and
        what the target has, and nothing is written. Returns False when
        nothing newer is published.
        """
        return self._copy_into(self._wait(self._request()), target)

    async def fetch_into_async(self, target: Any) -> bool:
        """:meth:`fetch_into` for asyncio."""
        return self._copy_into(await self._wait_async(self._request()), target)


def _destinations(target: Any) -> dict[str, Any]:
    """Path -> tensor or array of a fetch_into target."""
    state_dict = getattr(target, "state_dict", None)
    if callable(state_dict) and callable(getattr(target, "load_state_dict", None)):
        # A module: its state_dict's tensors share storage with its parameters
        # and buffers, so writing them writes the model.
        target = state_dict()
    leaves: list[tuple[str, Any]] = []
    _skeleton(target, "", leaves, _torch_tensor_type())
    return dict(leaves)


def _match(layout: _Layout, destinations: dict[str, Any], name: str) -> list[tuple[Any, str]]:
    missing = [p for p in layout.by_path if p not in destinations]
    if missing:
        raise ValueError(
            f"'{name}' publishes {missing[0]!r} ({_describe_spec(layout.by_path[missing[0]])}) "
            f"but the target has no such key ({len(missing)} missing)"
        )
    extra = [p for p in destinations if p not in layout.by_path]
    if extra:
        raise ValueError(
            f"the target has {extra[0]!r} but '{name}' does not publish it "
            f"({len(extra)} unexpected key(s))"
        )
    pairs = []
    for path, spec in layout.by_path.items():
        dst = destinations[path]
        _, library, dtype, shape, _, _, _ = spec
        if isinstance(dst, np.ndarray):
            got_dtype = dst.dtype.name
            writable = dst.flags.writeable
        else:
            got_dtype = str(dst.dtype).removeprefix("torch.")
            writable = True
        got_shape = tuple(dst.shape)
        if got_dtype != _dtype_name(library, dtype) or got_shape != tuple(shape):
            raise ValueError(
                f"'{name}' key {path!r}: published {_describe_spec(spec)}, the target has "
                f"{got_dtype} {list(got_shape)}"
            )
        if not writable:
            raise ValueError(f"the target's {path!r} is a read-only array")
        pairs.append((dst, path))
    return pairs


def _copy_pairs(pairs: list[tuple[Any, str]], views: list[Any], index: dict[str, int]) -> None:
    for dst, path in pairs:
        src = views[index[path]]
        if isinstance(dst, np.ndarray):
            np.copyto(dst, src if isinstance(src, np.ndarray) else src.cpu().numpy())
        else:
            if isinstance(src, np.ndarray):
                import torch

                src = torch.from_numpy(src)
            dst.copy_(src)
