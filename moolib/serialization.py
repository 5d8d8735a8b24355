"""Pickle protocol 5 with out-of-band buffers for RPC payloads.

The core ships the pickle stream and each out-of-band buffer as separate wire
segments (scatter/gather I/O), so the bytes of large tensors and numpy arrays
are never copied into the pickle stream on the sending side, and on the
receiving side tensors are rebuilt directly over the memory the core received
into.

torch is optional: it is never imported here. A tensor can only exist if torch
has already been imported by the user, so ``sys.modules`` is consulted instead,
which keeps the cost for non-torch users at zero.
"""

from __future__ import annotations

import functools
import io
import pickle
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["INBAND_THRESHOLD", "dumps", "loads"]

#: Buffers smaller than this many bytes are written into the pickle stream
#: instead of becoming separate out-of-band segments. Every extra segment
#: costs a frame header, an iovec entry and a separate allocation on the
#: receiving side, which outweighs copying a few KiB.
INBAND_THRESHOLD = 4096


def _rebuild_tensor_v1(
    data: Any,
    dtype_name: str,
    shape: tuple[int, ...],
    requires_grad: bool,
    device: str | None,
    is_parameter: bool,
) -> Any:
    """Rebuild a tensor reduced by ``_Pickler``; referenced by name from pickle streams.

    The ``_v1`` suffix lets a future layout change keep old streams loadable.
    """
    import torch

    dtype = getattr(torch, dtype_name)
    view = memoryview(data)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    if view.nbytes == 0:
        # torch.frombuffer rejects empty buffers outright.
        tensor = torch.empty(shape, dtype=dtype)
    else:
        if view.readonly:
            # torch.frombuffer accepts read-only memory but returns a writable tensor
            # aliasing it (plus a one-time UserWarning); copying is the only safe option.
            flat = torch.frombuffer(bytearray(view), dtype=torch.uint8)
        else:
            # The tensor holds a reference to ``view`` (which pins ``data``), so the
            # received block lives as long as the tensor does.
            flat = torch.frombuffer(view, dtype=torch.uint8)
        if flat.data_ptr() % dtype.itemsize:
            # Kernels assume element-aligned data (misaligned access is undefined
            # behaviour in C++); a fresh allocation is always suitably aligned.
            flat = flat.clone()
        tensor = flat.view(dtype).view(shape)
    if device is not None:
        tensor = _to_received_device(torch, tensor, device)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


def _to_received_device(torch: Any, tensor: Any, device: str) -> Any:
    """Move a tensor that was sent from ``device`` back to a matching local device."""
    sent = torch.device(device)
    if sent.type != "cuda" or not torch.cuda.is_available():
        # The receiver may legitimately have no GPU (e.g. a CPU actor talking to a
        # GPU learner); falling back to CPU keeps the message usable.
        return tensor
    index = sent.index
    if index is None or index >= torch.cuda.device_count():
        index = 0
    return tensor.to(torch.device("cuda", index))


def _tensor_bytes(torch: Any, tensor: Any) -> Any:
    """Return a writable, flat uint8 buffer object over a contiguous CPU tensor's bytes."""
    flat = tensor.reshape(-1).view(torch.uint8)
    try:
        # The ndarray keeps ``flat`` (hence the storage) alive as its base, so the
        # buffer stays valid for as long as the caller holds it.
        return flat.numpy()
    except RuntimeError:
        # torch built or installed without numpy: fall back to a copy.
        return _tensor_bytes_copy(flat)


def _tensor_bytes_copy(flat: Any) -> bytearray:
    """Copy a flat uint8 tensor's bytes without numpy (fallback path)."""
    # clone() yields a storage of exactly this size, whereas ``flat`` may be a
    # window into a larger storage.
    return bytearray(bytes(flat.clone().untyped_storage()))


def _on_buffer(buffers: list[memoryview], buffer: pickle.PickleBuffer) -> bool:
    """Pickle buffer callback: True keeps ``buffer`` in band, False sends it out of band."""
    raw = buffer.raw()
    if raw.nbytes < INBAND_THRESHOLD:
        return True
    buffers.append(raw)
    return False


class _Pickler(pickle.Pickler):
    """Protocol 5 pickler that sends tensor and array memory out of band."""

    def __init__(self, file: io.BytesIO, buffers: list[memoryview]) -> None:
        # A bound method as callback would make a pickler<->callback cycle, keeping
        # the memo (and so every pickled tensor) alive until the cyclic GC runs.
        super().__init__(file, protocol=5, buffer_callback=functools.partial(_on_buffer, buffers))
        # Looked up once per dumps() call: reducer_override runs for nearly every
        # object in the stream, so it must do no module lookups of its own.
        self._torch = sys.modules.get("torch")
        if self._torch is not None:
            self._tensor_cls: type | None = self._torch.Tensor
            self._parameter_cls: type | None = self._torch.nn.Parameter
        else:
            self._tensor_cls = self._parameter_cls = None
        self._numpy = sys.modules.get("numpy")
        self._ndarray_cls: type | None = self._numpy.ndarray if self._numpy is not None else None

    def reducer_override(self, obj: Any) -> Any:
        """Reduce tensors and non-contiguous arrays; defer everything else to pickle."""
        cls = type(obj)
        if cls is self._tensor_cls or cls is self._parameter_cls:
            return self._reduce_tensor(obj, cls is self._parameter_cls)
        if cls is self._ndarray_cls:
            flags = obj.flags
            if not (flags.c_contiguous or flags.f_contiguous) and not obj.dtype.hasobject:
                # numpy only goes out of band for contiguous arrays and would
                # otherwise copy the data into the stream; one copy here instead
                # keeps the stream small.
                return self._numpy.ascontiguousarray(obj).__reduce_ex__(5)
        return NotImplemented

    def _reduce_tensor(self, obj: Any, is_parameter: bool) -> Any:
        torch = self._torch
        if (
            obj.layout is not torch.strided
            or obj.is_quantized
            or obj.is_nested
            or obj.device.type == "meta"
        ):
            # Not a plain dense buffer: torch's own (in-band) pickling handles these.
            return NotImplemented
        requires_grad = obj.requires_grad
        # detach() so that non-leaf tensors can be sent; the receiver gets a leaf.
        tensor = obj.detach()
        device = None
        if tensor.device.type != "cpu":
            device = str(tensor.device)
            tensor = tensor.cpu()
        # Lazy conjugate/negative views have no materialised bytes; both are no-ops
        # when the bit is unset.
        tensor = tensor.resolve_conj().resolve_neg()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        data = pickle.PickleBuffer(_tensor_bytes(torch, tensor))
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        return (
            _rebuild_tensor_v1,
            (data, dtype_name, tuple(tensor.shape), requires_grad, device, is_parameter),
        )


def dumps(obj: Any) -> tuple[bytes, list[memoryview]]:
    """Pickle ``obj`` with protocol 5, keeping large tensor/array memory out of band.

    Returns the pickle bytes and the out-of-band buffers, each a flat,
    C-contiguous ``memoryview`` of format ``'B'``. For contiguous CPU tensors
    and arrays the buffers alias the original memory (no copy), so the objects
    must not be modified until the buffers have been sent. Buffers smaller
    than :data:`INBAND_THRESHOLD` bytes are written into the pickle stream.

    The core's codec pickles the arguments and results of calls that are small
    nests of scalars with ``pickle.dumps`` alone (moolib/core/python/codec.cc,
    ``isPlain``, the one copy of that rule): the same bytes, without a Pickler
    made per call. It calls this function for the rest.
    """
    buffers: list[memoryview] = []
    file = io.BytesIO()
    _Pickler(file, buffers).dump(obj)
    return file.getvalue(), buffers


def loads(data: Any, buffers: Sequence[Any] = ()) -> Any:
    """Unpickle ``data`` (any bytes-like object) with the out-of-band ``buffers``.

    ``buffers`` holds objects supporting the buffer protocol, in the order
    :func:`dumps` returned them. Tensors are rebuilt over writable buffers
    without copying (and keep them alive); read-only buffers are copied.
    """
    return pickle.loads(data, buffers=buffers)
