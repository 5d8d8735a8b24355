"""Utilities for nests: tensors, arrays, numbers or None, nested in dicts, lists and tuples.

Used for batching (``Rpc.define(batch_size=...)``, queue batching and the
``Batcher``). Anything that is not a dict, list or tuple is a leaf. Dict leaves
are visited in sorted key order (insertion order if the keys do not sort), so
two dicts with the same keys flatten the same way regardless of how they were
built.

``flatten``, ``pack_as`` and ``map_structure`` work on any leaves; ``stack``,
``cat``, ``split`` and ``unstack`` need torch, which is imported only when they
are called.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["cat", "flatten", "map_structure", "pack_as", "split", "stack", "unstack"]


def _keys(d: dict) -> list:
    try:
        return sorted(d)
    except TypeError:
        return list(d)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def _rebuild_sequence(like: list | tuple, items: list) -> list | tuple:
    cls = type(like)
    if cls is list:
        return items
    if cls is tuple:
        return tuple(items)
    if _is_namedtuple(like):
        return cls(*items)
    return cls(items)


def _rebuild_dict(like: dict, pairs: list[tuple[Any, Any]]) -> dict:
    # Keep the structure's own key order in the output, not the sorted visit order.
    order = {k: i for i, k in enumerate(like)}
    pairs.sort(key=lambda kv: order[kv[0]])
    if type(like) is dict:
        return dict(pairs)
    # Subclasses such as defaultdict take constructor arguments that are not
    # items; copying and refilling preserves them.
    out = copy.copy(like)
    out.clear()
    out.update(pairs)
    return out


def _flatten_into(nest: Any, out: list) -> None:
    if isinstance(nest, dict):
        for k in _keys(nest):
            _flatten_into(nest[k], out)
    elif isinstance(nest, (list, tuple)):
        for x in nest:
            _flatten_into(x, out)
    else:
        out.append(nest)


def flatten(nest: Any) -> list:
    """Return the leaves of ``nest`` in depth-first order (dicts by sorted key)."""
    out: list = []
    _flatten_into(nest, out)
    return out


def _pack(structure: Any, leaves: Iterator) -> Any:
    if isinstance(structure, dict):
        return _rebuild_dict(
            structure, [(k, _pack(structure[k], leaves)) for k in _keys(structure)]
        )
    if isinstance(structure, (list, tuple)):
        return _rebuild_sequence(structure, [_pack(x, leaves) for x in structure])
    return next(leaves)


def pack_as(structure: Any, flat_list: Sequence) -> Any:
    """Build a nest shaped like ``structure`` whose leaves are ``flat_list``, in order.

    Inverse of :func:`flatten`. Raises ``ValueError`` if the number of leaves
    does not match.
    """
    expected = len(flatten(structure))
    if len(flat_list) != expected:
        raise ValueError(
            f"pack_as: structure has {expected} leaves but {len(flat_list)} values were given"
        )
    return _pack(structure, iter(flat_list))


def _kind(x: Any) -> str:
    if isinstance(x, dict):
        return "dict"
    if isinstance(x, list):
        return "list"
    if isinstance(x, tuple):
        return "tuple"
    return "leaf"


def _map(fn: Callable[..., Any], nests: Sequence[Any], path: str) -> Any:
    first = nests[0]
    kind = _kind(first)
    for i, other in enumerate(nests[1:], 1):
        other_kind = _kind(other)
        if other_kind != kind:
            raise ValueError(
                f"structure mismatch at {path}: nest 0 has a {kind}, nest {i} has a {other_kind}"
            )
    if kind == "dict":
        keys = _keys(first)
        key_set = set(keys)
        for i, other in enumerate(nests[1:], 1):
            if set(other) != key_set:
                missing = ", ".join(sorted(map(repr, key_set - set(other)))) or "none"
                extra = ", ".join(sorted(map(repr, set(other) - key_set))) or "none"
                raise ValueError(
                    f"structure mismatch at {path}: nest {i} dict keys differ from nest 0 "
                    f"(missing: {missing}; extra: {extra})"
                )
        return _rebuild_dict(
            first, [(k, _map(fn, [n[k] for n in nests], f"{path}[{k!r}]")) for k in keys]
        )
    if kind in ("list", "tuple"):
        for i, other in enumerate(nests[1:], 1):
            if len(other) != len(first):
                raise ValueError(
                    f"structure mismatch at {path}: nest 0 has {len(first)} elements, "
                    f"nest {i} has {len(other)}"
                )
        return _rebuild_sequence(
            first,
            [_map(fn, [n[j] for n in nests], f"{path}[{j}]") for j in range(len(first))],
        )
    return fn(path, *nests)


def map_structure(fn: Callable[..., Any], *nests: Any) -> Any:
    """Apply ``fn`` to corresponding leaves of ``nests``, returning a nest like the first.

    All nests must have the same structure (same container kinds, dict keys
    and sequence lengths); otherwise ``ValueError`` names the first differing
    path, e.g. ``nest['obs'][1]``.
    """
    if not nests:
        raise TypeError("map_structure needs at least one nest")
    return _map(lambda _path, *leaves: fn(*leaves), nests, "nest")


def _numpy_ndarray() -> type | None:
    # An array can only exist if numpy was already imported.
    numpy = sys.modules.get("numpy")
    return numpy.ndarray if numpy is not None else None


def _as_tensor(torch: Any, x: Any, ndarray: type | None) -> Any:
    if isinstance(x, torch.Tensor):
        return x
    if ndarray is not None and isinstance(x, ndarray):
        if not x.flags.writeable or any(s < 0 for s in x.strides):
            # torch.from_numpy rejects negative strides and warns on read-only
            # arrays; the batch copies the data anyway, so copy first.
            x = x.copy()
        return torch.from_numpy(x)
    return None


def _is_number(x: Any) -> bool:
    if isinstance(x, (bool, int, float, complex)):
        return True
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(x, numpy.generic) and x.dtype.kind in "biufc"


def _batch_leaves(torch: Any, op: str, leaves: Sequence[Any], dim: int, path: str) -> Any:
    if all(x is None for x in leaves):
        return None
    ndarray = _numpy_ndarray()
    tensors = [_as_tensor(torch, x, ndarray) for x in leaves]
    if any(t is None for t in tensors):
        if op == "stack" and all(_is_number(x) for x in leaves):
            if dim in (0, -1):
                # One tensor constructor instead of one tiny tensor per number.
                return torch.tensor(list(leaves))
            tensors = [torch.as_tensor(x) for x in leaves]
        else:
            bad = next(x for x, t in zip(leaves, tensors, strict=True) if t is None)
            what = "tensors, arrays or numbers" if op == "stack" else "tensors or arrays"
            raise TypeError(
                f"{op}: leaf at {path} must be {what} (or None in every nest), "
                f"got {type(bad).__name__}"
            )
    try:
        return torch.stack(tensors, dim) if op == "stack" else torch.cat(tensors, dim)
    except (RuntimeError, IndexError) as e:
        raise type(e)(f"{op}: at {path}: {e}") from e


def stack(nests: Sequence[Any], dim: int = 0) -> Any:
    """Stack identically structured nests leaf by leaf with ``torch.stack``.

    numpy arrays are converted to tensors and Python/numpy numbers become
    tensors (so a batch of scalars becomes a 1-d tensor). A leaf that is
    None in every nest stays None.
    """
    import torch

    if not nests:
        raise ValueError("stack needs at least one nest")
    return _map(
        lambda path, *leaves: _batch_leaves(torch, "stack", leaves, dim, path), nests, "nest"
    )


def cat(nests: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate identically structured nests leaf by leaf with ``torch.cat``.

    numpy arrays are converted to tensors. A leaf that is None in every nest
    stays None; numbers cannot be concatenated (use :func:`stack`).
    """
    import torch

    if not nests:
        raise ValueError("cat needs at least one nest")
    return _map(lambda path, *leaves: _batch_leaves(torch, "cat", leaves, dim, path), nests, "nest")


def _leaf_paths(nest: Any, path: str, out: list[str]) -> None:
    # Mirrors _flatten_into so that paths line up with flatten()'s order.
    if isinstance(nest, dict):
        for k in _keys(nest):
            _leaf_paths(nest[k], f"{path}[{k!r}]", out)
    elif isinstance(nest, (list, tuple)):
        for j, x in enumerate(nest):
            _leaf_paths(x, f"{path}[{j}]", out)
    else:
        out.append(path)


def _pieces_per_leaf(
    nest: Any, count: int, cut: Callable[[Any, str], Sequence[Any] | None]
) -> list[Any]:
    leaves = flatten(nest)
    paths: list[str] = []
    _leaf_paths(nest, "nest", paths)
    columns = []
    for leaf, path in zip(leaves, paths, strict=True):
        pieces = cut(leaf, path)
        # Non-tensor leaves are shared by every piece.
        columns.append([leaf] * count if pieces is None else pieces)
    return [pack_as(nest, [col[i] for col in columns]) for i in range(count)]


def _normalize_dim(ndim: int, dim: int, path: str) -> int:
    if ndim == 0:
        raise ValueError(f"at {path}: cannot split a 0-d value")
    if not -ndim <= dim < ndim:
        raise IndexError(f"at {path}: dim {dim} out of range for {ndim}-d value")
    return dim % ndim


def _cut_leaves(
    what: str, nest: Any, count: int, dim: int, expected: int, error: str, cut_leaf: Callable
) -> list[Any]:
    """Cut every tensor or array leaf of ``nest`` into ``count`` pieces with
    ``cut_leaf(leaf, dim, is_array)``, after checking that it has ``expected``
    entries along ``dim`` (``error`` ends the message when it has not)."""
    import torch

    ndarray = _numpy_ndarray()

    def cut(leaf: Any, path: str) -> Sequence[Any] | None:
        is_array = ndarray is not None and isinstance(leaf, ndarray)
        if not (is_array or isinstance(leaf, torch.Tensor)):
            return None
        d = _normalize_dim(leaf.ndim, dim, path)
        if leaf.shape[d] != expected:
            raise ValueError(
                f"{what}: leaf at {path} has size {leaf.shape[d]} along dim {dim}, {error}"
            )
        return cut_leaf(leaf, d, is_array)

    return _pieces_per_leaf(nest, count, cut)


def split(nest: Any, sizes: Sequence[int], dim: int = 0) -> list[Any]:
    """Split every tensor (or array) leaf along ``dim`` into pieces of ``sizes``.

    Inverse of :func:`cat`: returns ``len(sizes)`` nests; tensor pieces are
    views, numpy leaves stay numpy, and other leaves are replicated. Every
    tensor leaf must have exactly ``sum(sizes)`` entries along ``dim``.
    """
    import torch

    sizes = [int(s) for s in sizes]

    def cut_leaf(leaf: Any, d: int, is_array: bool) -> Sequence[Any]:
        if not is_array:
            return torch.split(leaf, sizes, d)
        pieces, start = [], 0
        for size in sizes:
            index = [slice(None)] * leaf.ndim
            index[d] = slice(start, start + size)
            pieces.append(leaf[tuple(index)])
            start += size
        return pieces

    total = sum(sizes)
    return _cut_leaves("split", nest, len(sizes), dim, total, f"but sizes sum to {total}", cut_leaf)


def unstack(nest: Any, n: int, dim: int = 0) -> list[Any]:
    """Split every tensor (or array) leaf into its ``n`` slices along ``dim``.

    Inverse of :func:`stack`: returns ``n`` nests with ``dim`` removed from
    each tensor leaf (stacked numbers come back as 0-d tensors); other leaves
    are replicated. Every tensor leaf must have size ``n`` along ``dim``.
    """

    def cut_leaf(leaf: Any, d: int, is_array: bool) -> Sequence[Any]:
        return list(sys.modules["numpy"].moveaxis(leaf, d, 0)) if is_array else leaf.unbind(d)

    return _cut_leaves("unstack", nest, n, dim, n, f"expected {n}", cut_leaf)
