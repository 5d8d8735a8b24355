"""Parameter publishing: a learner publishes versioned weights, actors fetch the latest.

``publish()`` copies the weights once into one contiguous snapshot buffer and
describes its layout (structure, dtypes, shapes, offsets) once, in a small
pickled blob. Every fetch then returns the same ``(version, layout, buffer)``:
the RPC layer frames the small parts and sends the buffer out of band from
the snapshot's memory, so however many actors fetch a publication it is
serialized once, and the learner can go on changing its weights meanwhile.

A fetch carries the version the subscriber holds and the publisher instance it
came from; the reply is ``None`` (a few bytes) unless the publisher has a
newer one, or is another instance (a restarted learner, whose versions may
start lower).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
from typing import Any, NamedTuple

from . import nest
from .rpc import Rpc, RpcError

__all__ = ["Publisher", "Subscriber"]

# Leaves start on this boundary in the snapshot, so every view is aligned.
_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class _Leaf:
    # Not a tuple: nest functions would walk into it.
    dtype: str
    shape: tuple[int, ...]
    offset: int


class _Snapshot(NamedTuple):
    version: int
    layout: bytes  # pickled nest of _Leaf tuples
    buffer: Any  # torch.uint8 tensor holding every leaf


def _as_cpu_tensor(leaf: Any, path: str) -> Any:
    import torch

    if isinstance(leaf, torch.Tensor):
        return leaf.detach().to("cpu")
    try:
        return torch.as_tensor(leaf)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"cannot publish {path}: {type(leaf).__name__} is not a tensor") from e


def _snapshot(weights: Any, version: int) -> _Snapshot:
    import torch

    paths = nest.leaf_paths(weights, "weights")
    tensors = [_as_cpu_tensor(x, p) for x, p in zip(nest.flatten(weights), paths, strict=True)]
    specs = []
    offset = 0
    for t in tensors:
        specs.append(_Leaf(str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    buffer = torch.empty(offset, dtype=torch.uint8)
    for t, spec in zip(tensors, specs, strict=True):
        n = t.numel() * t.element_size()
        buffer[spec.offset : spec.offset + n].view(t.dtype).view(t.shape).copy_(t)
    layout = pickle.dumps(nest.pack_as(weights, specs), protocol=pickle.HIGHEST_PROTOCOL)
    return _Snapshot(version, layout, buffer)


def _unpack(layout: bytes, buffer: Any) -> Any:
    import torch

    specs = pickle.loads(layout)
    flat = buffer.reshape(-1).view(torch.uint8)

    def view(spec: _Leaf) -> Any:
        dtype = getattr(torch, spec.dtype)
        n = dtype.itemsize
        for d in spec.shape:
            n *= d
        return flat[spec.offset : spec.offset + n].view(dtype).view(spec.shape)

    return nest.map_structure(view, specs)


class Publisher:
    """Serves the latest published weights of this peer under ``name``.

    Versions must increase; ``publish`` without one uses the last plus one
    (starting at ``first_version``, e.g. the step a resumed learner restarts
    from).
    """

    def __init__(self, rpc: Rpc, name: str = "weights", first_version: int = 0) -> None:
        self._rpc = rpc
        self._name = name
        self._next = int(first_version)
        self._snap: _Snapshot | None = None
        self._lock = threading.Lock()
        # Tells subscribers a restarted publisher from the one they fetched from.
        self._instance = os.urandom(8).hex()
        rpc.define(f"{name}/fetch", self._fetch)

    @property
    def version(self) -> int:
        """The latest published version, -1 before the first publication."""
        snap = self._snap
        return -1 if snap is None else snap.version

    def publish(self, weights: Any, version: int | None = None) -> int:
        """Publishes a copy of ``weights`` (a nest of tensors or arrays, e.g. a
        ``state_dict()``); returns its version."""
        with self._lock:
            if version is None:
                version = self._next
            elif int(version) < self._next:
                raise ValueError(
                    f"publisher '{self._name}': version {version} does not increase "
                    f"(the last published was {self.version})"
                )
            snap = _snapshot(weights, int(version))
            self._snap = snap
            self._next = snap.version + 1
            return snap.version

    def _fetch(self, have_version: int, have_instance: str | None) -> Any:
        snap = self._snap
        if snap is None:
            return None
        if have_instance == self._instance and have_version >= snap.version:
            return None
        return snap.version, self._instance, snap.layout, snap.buffer

    def close(self) -> None:
        """Stops serving; subscribers' fetches fail from then on."""
        self._rpc.undefine(f"{self._name}/fetch")


class Subscriber:
    """Fetches the weights a ``Publisher`` on ``peer`` serves under ``name``,
    only when they are newer than those this subscriber already has."""

    def __init__(self, rpc: Rpc, peer: str, name: str = "weights") -> None:
        self._rpc = rpc
        self._peer = peer
        self._name = name
        self._version = -1
        self._instance: str | None = None

    @property
    def version(self) -> int:
        """The version last fetched, -1 before the first."""
        return self._version

    def fetch(self) -> tuple[int, Any] | None:
        """Returns ``(version, weights)`` when the publisher has newer weights
        than the last fetched (or has restarted), else None (also while
        nothing is published). The weights are tensors over the received
        memory. Raises ``RpcError`` naming the peer when it cannot be reached
        within the Rpc's timeout."""
        try:
            reply = self._rpc.sync(self._peer, f"{self._name}/fetch", self._version, self._instance)
        except RpcError as e:
            raise RpcError(f"fetching '{self._name}' from peer '{self._peer}': {e}") from None
        if reply is None:
            return None
        version, instance, layout, buffer = reply
        self._version, self._instance = version, instance
        return version, _unpack(layout, buffer)

    def fetch_into(self, target: Any) -> bool:
        """Copies newer weights into ``target`` (a module, its ``state_dict()``
        or a nest of tensors shaped like the published one), in place; returns
        False when there was nothing newer. A target whose structure, shape or
        dtype differs raises ``ValueError`` naming the leaf, before anything is
        copied (the version is not taken then)."""
        import torch

        before = (self._version, self._instance)
        got = self.fetch()
        if got is None:
            return False
        version, weights = got
        dest = target.state_dict() if isinstance(target, torch.nn.Module) else target
        try:
            pairs = _match(dest, weights)
        except ValueError:
            self._version, self._instance = before
            raise
        with torch.no_grad():
            for d, s in pairs:
                d.copy_(s)
        return True


def _match(dest: Any, src: Any) -> list[tuple[Any, Any]]:
    import torch

    if isinstance(dest, dict) and isinstance(src, dict) and set(dest) != set(src):
        missing = sorted(map(str, set(src) - set(dest)))
        extra = sorted(map(str, set(dest) - set(src)))
        raise ValueError(
            "published weights do not match the target: "
            + "; ".join(
                part
                for part in (
                    f"not in the target: {', '.join(missing)}" if missing else "",
                    f"not published: {', '.join(extra)}" if extra else "",
                )
                if part
            )
        )
    dest_paths = nest.leaf_paths(dest, "weights")
    src_paths = nest.leaf_paths(src, "weights")
    if dest_paths != src_paths:
        raise ValueError(
            f"published weights have leaves {src_paths[:8]}..., the target {dest_paths[:8]}..."
        )
    pairs = []
    for path, d, s in zip(dest_paths, nest.flatten(dest), nest.flatten(src), strict=True):
        if not isinstance(d, torch.Tensor):
            raise ValueError(f"{path}: the target holds {type(d).__name__}, not a tensor")
        if d.shape != s.shape or d.dtype != s.dtype:
            raise ValueError(
                f"{path}: published {s.dtype} {tuple(s.shape)}, "
                f"the target has {d.dtype} {tuple(d.shape)}"
            )
        pairs.append((d, s))
    return pairs
