"""The item layout of a replay table: how a nest of tensors flattens into the
leaves the core stores (learned from a table's first insert, checked at every
later one), and ``ReplaySample``, the batch a sample returns.

Shared by the table (``moolib.replay.table``), the serving peer
(``moolib.replay.server``) and its clients (``moolib.replay.client``), which lay a
sample's leaves out in shared memory by the same layout.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .. import nest

__all__ = ["ReplaySample", "Schema", "bytes_view", "describe"]


class ReplaySample(NamedTuple):
    """A sampled batch.

    ``items`` is the nest with each leaf stacked to ``(B, *leaf_shape)``,
    ``keys`` the items' int64 keys, ``probabilities`` (float64) the chance each
    item had of being drawn (for importance weights; 1.0 under ``fifo``), and
    ``size`` the table's size when the batch was drawn. From a
    ``ReplayClient`` of several shards, both are the union's: ``size`` sums
    the live shards' sizes, whichever shards the batch was drawn from, so
    ``(size * probabilities) ** -beta`` weighs items as one table would.
    """

    items: Any
    keys: torch.Tensor
    probabilities: torch.Tensor
    size: int


def _name(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "<item>"


def _walk(x: Any, path: tuple, leaves: list, paths: list) -> Any:
    """Flattens like nest.flatten, collecting paths; returns a JSON-able skeleton."""
    if isinstance(x, dict):
        keys = nest._keys(x)
        for k in keys:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(
                    f"replay items may have str or int dict keys; {_name(path)} has {k!r}"
                )
        return {"d": [[k, _walk(x[k], (*path, k), leaves, paths)] for k in keys]}
    if isinstance(x, (list, tuple)):
        tag = "l" if isinstance(x, list) else "t"
        return {tag: [_walk(v, (*path, i), leaves, paths) for i, v in enumerate(x)]}
    leaves.append(x)
    paths.append(path)
    return None


def describe(s: Any) -> str:
    """A skeleton as Python-like text: {'a': [*, *], 'b': (*,)}."""
    if s is None:
        return "*"
    if "d" in s:
        return "{" + ", ".join(f"{k!r}: {describe(v)}" for k, v in s["d"]) + "}"
    inner = ", ".join(describe(v) for v in s.get("l", s.get("t", [])))
    if "l" in s:
        return f"[{inner}]"
    return f"({inner},)" if len(s["t"]) == 1 else f"({inner})"


def _ordered(x: Any) -> Any:
    """The skeleton of a nest (of Nones) in its own dict key order, which
    _walk's skeleton (the table's leaf order) sorts."""
    if isinstance(x, dict):
        return {"d": [[k, _ordered(v)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        return {"l" if isinstance(x, list) else "t": [_ordered(v) for v in x]}
    return None


def _unskeleton(s: Any) -> Any:
    if s is None:
        return None
    if "d" in s:
        return {k: _unskeleton(v) for k, v in s["d"]}
    items = [_unskeleton(v) for v in s.get("l", s.get("t", []))]
    return items if "l" in s else tuple(items)


def _as_tensor(leaf: Any, name: str) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        t = leaf
    elif type(leaf).__module__ == "numpy" and hasattr(leaf, "__array_interface__"):
        t = torch.from_numpy(leaf)
    else:
        raise TypeError(
            f"replay leaf {name} is a {type(leaf).__name__}: leaves must be tensors or numpy "
            "arrays with a leading batch dimension"
        )
    if t.dim() == 0:
        raise ValueError(f"replay leaf {name} is a scalar: it needs a leading batch dimension")
    return t


_NUMPY_DTYPES = frozenset(
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
    + [torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128]
)


def bytes_view(t: torch.Tensor) -> Any:
    """A buffer over the leaf's bytes, without a copy when it is already a
    contiguous CPU tensor."""
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _NUMPY_DTYPES:
        return t.numpy()
    return t.reshape(-1).view(torch.uint8).numpy()  # numpy lacks it (bfloat16): its bytes


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a replay checkpoint")
    return dtype


class Schema:
    """The item layout learned from the first insert."""

    def __init__(
        self,
        skeleton: Any,
        names: list[str],
        dtypes: list[torch.dtype],
        shapes: list[tuple[int, ...]],
        frames: list[int],
    ) -> None:
        self.skeleton = skeleton
        self.structure = _unskeleton(skeleton)
        self.names = names
        self.dtypes = dtypes
        self.shapes = shapes
        self.frames = frames
        self.item_bytes = [
            math.prod(s) * torch.empty((), dtype=d).element_size()
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        # Items that are one flat dict of tensors (the usual transition) are
        # checked without walking the nest: the keys in table order, each
        # leaf's (dtype, shape); anything else takes the full walk.
        self._flat_keys: tuple | None = None
        if isinstance(skeleton, dict) and "d" in skeleton:
            entries = skeleton["d"]
            if all(v is None for _, v in entries):
                self._flat_keys = tuple(k for k, _ in entries)
        self._checks = list(zip(dtypes, shapes, strict=True))

    @classmethod
    def learn(cls, items: Any, dedup: Sequence[str]) -> Schema:
        """The layout of a batch of ``items`` (every leaf a tensor or numpy
        array with a leading batch dimension), with ``dedup`` the dotted names
        of the leaves whose frames are stored once each."""
        leaves: list = []
        paths: list = []
        skeleton = _walk(items, (), leaves, paths)
        if not leaves:
            raise ValueError("replay items need at least one leaf")
        names = [_name(p) for p in paths]
        tensors = [_as_tensor(x, n) for x, n in zip(leaves, names, strict=True)]
        unknown = [d for d in dedup if d not in names]
        if unknown:
            raise ValueError(
                f"dedup names {', '.join(map(repr, unknown))}, not leaves of the items "
                f"(leaves: {', '.join(names)})"
            )
        frames = []
        for t, n in zip(tensors, names, strict=True):
            if n in dedup:
                if t.dim() < 2 or t.shape[1] == 0:
                    raise ValueError(
                        f"dedup leaf {n} has item shape {tuple(t.shape[1:])}: it needs a "
                        "leading frame dimension (S, *frame_shape)"
                    )
                frames.append(int(t.shape[1]))
            else:
                frames.append(0)
        schema = cls(
            skeleton,
            names,
            [t.dtype for t in tensors],
            [tuple(t.shape[1:]) for t in tensors],
            frames,
        )
        # Sampled nests keep the first insert's dict key order.
        schema.structure = nest.pack_as(items, [None] * len(leaves))
        if any(b == 0 for b in schema.item_bytes):
            empty = [n for n, b in zip(names, schema.item_bytes, strict=True) if b == 0]
            raise ValueError(f"replay leaf {empty[0]} holds no bytes per item")
        return schema

    @functools.cached_property
    def digest(self) -> str:
        """Names the items this layout stores (their structure, dtypes and
        shapes): equal on a table and on a client that learned its layout, so a
        call through shared memory can say which layout its rows are in, and
        shards can be told to hold the same items."""
        text = json.dumps(
            [self.skeleton, [str(d) for d in self.dtypes], [list(s) for s in self.shapes]]
        )
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        """The layout as JSON-able data: a checkpoint's metadata, a shard's answer."""
        return {
            "skeleton": self.skeleton,
            "names": self.names,
            "dtypes": [str(d) for d in self.dtypes],
            "shapes": [list(s) for s in self.shapes],
            "frames": self.frames,
            # The first insert's dict key order, for the sampled nests (the
            # skeleton holds the table's, sorted).
            "order": _ordered(self.structure),
        }

    @classmethod
    def from_json(cls, d: dict) -> Schema:
        """The layout ``to_json`` wrote (refused, ``ValueError``, where its key order
        does not match it)."""
        schema = cls(
            d["skeleton"],
            list(d["names"]),
            [_dtype_from_name(x) for x in d["dtypes"]],
            [tuple(int(v) for v in s) for s in d["shapes"]],
            [int(f) for f in d["frames"]],
        )
        # Absent from checkpoints written before it was kept: sorted keys then.
        order = d.get("order")
        if order is not None:
            structure = _unskeleton(order)
            if _walk(structure, (), [], []) != schema.skeleton:
                raise ValueError("its key order does not match its layout")
            schema.structure = structure
        return schema

    def flatten(self, items: Any) -> tuple[list[torch.Tensor], int]:
        """The leaves of items in table order, and the batch size; raises
        naming the leaf whose structure, dtype or shape differs."""
        keys = self._flat_keys
        if keys is not None and type(items) is dict and len(items) == len(keys):
            fast = self._flatten_flat(items, keys)
            if fast is not None:
                return fast
        return self._flatten_walk(items)

    def _flatten_flat(self, items: dict, keys: tuple) -> tuple[list[torch.Tensor], int] | None:
        """A flat dict of CPU tensors that matches the table; None: anything
        else (the walk then says what differs)."""
        try:
            tensors = [items[k] for k in keys]
        except KeyError:
            return None
        n = -1
        for t, (dtype, shape) in zip(tensors, self._checks, strict=True):
            if type(t) is not torch.Tensor or t.dtype != dtype or t.dim() == 0:
                return None
            size = t.shape
            if size[1:] != shape or (n >= 0 and size[0] != n):
                return None
            n = size[0]
        return tensors, n

    def _flatten_walk(self, items: Any) -> tuple[list[torch.Tensor], int]:
        leaves: list = []
        paths: list = []
        skeleton = _walk(items, (), leaves, paths)
        if skeleton != self.skeleton:
            given = [_name(p) for p in paths]
            missing = [n for n in self.names if n not in given]
            extra = [n for n in given if n not in self.names]
            if not missing and not extra:
                raise ValueError(
                    "replay item structure differs from the table's: the same leaves "
                    "in other containers (a list where the table has a tuple, or the "
                    f"reverse); the table stores {describe(self.skeleton)}, given "
                    f"{describe(skeleton)}"
                )
            wrong = [
                f"{what} leaves {names}"
                for what, names in (("missing", missing), ("unexpected", extra))
                if names
            ]
            raise ValueError(
                f"replay item structure differs from the table's: {', '.join(wrong)} "
                f"(the table stores {', '.join(self.names)})"
            )
        tensors = []
        n = None
        for leaf, name, dtype, shape in zip(
            leaves, self.names, self.dtypes, self.shapes, strict=True
        ):
            t = _as_tensor(leaf, name)
            if t.dtype != dtype:
                raise ValueError(
                    f"replay leaf {name} has dtype {t.dtype}; the table stores {dtype}"
                )
            if tuple(t.shape[1:]) != shape:
                raise ValueError(
                    f"replay leaf {name} has item shape {tuple(t.shape[1:])}; the table "
                    f"stores {shape}"
                )
            if n is None:
                n = int(t.shape[0])
            elif t.shape[0] != n:
                raise ValueError(
                    f"replay leaf {name} has batch size {t.shape[0]}; leaf {self.names[0]} has {n}"
                )
            tensors.append(t)
        assert n is not None
        return tensors, n
