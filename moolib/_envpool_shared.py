"""What the EnvPool and its worker processes agree on: the framing of their
control socket and the layout of the shared-memory region.

Kept free of torch so a worker process starts with numpy only.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import numpy as np

# Message kinds on a worker's control socket. Every message is a fixed header
# (kind, batch index, payload length) and an optional payload, so the step
# path costs one send and one receive per worker.
INIT = 1  # parent -> worker: pickled setup (sys.path, create_env, slice)
SPEC = 2  # worker -> parent: pickled spec of the first observation and actions
LAYOUT = 3  # parent -> worker: pickled layout, with the region's fd attached
READY = 4  # worker -> parent: views are mapped, envs are ready
STEP = 5  # parent -> worker: step batch `batch`
STEPPED = 6  # worker -> parent: batch `batch` is written (payload: see NONFINITE)
FAILED = 7  # worker -> parent: utf-8 error text (batch = -1 outside a step)

_HEADER = struct.Struct("<Bii")
# A STEPPED message's optional payload: how many non-finite rewards were
# counted since the worker's last STEPPED message, then (utf-8) the first.
NONFINITE = struct.Struct("<Q")
# A traceback longer than this is cut; the head and the tail carry the story.
MAX_TEXT = 1 << 16
# Each array starts on its own cache line.
_ALIGN = 64

# Result keys the pool adds beside the observation's own keys.
STAT_KEYS = ("reward", "done", "episode_return", "episode_length")
_STAT_DTYPES = {
    "reward": np.float32,
    "done": np.bool_,
    "episode_return": np.float32,
    "episode_length": np.int64,
}


# Dtypes a region may hold: those torch.from_numpy takes, in native byte order.
STORABLE = frozenset(
    np.dtype(t).str
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    )
)


def dtype_name(dtype: np.dtype) -> str:
    """How messages name a dtype: "float32", ">f4" for a foreign byte order, "object"."""
    if dtype.kind == "O":
        return "object"
    if dtype.kind in "biufc" and dtype.isnative:
        return dtype.name
    return dtype.str


class WorkerGone(Exception):
    """The other end of a control socket closed (its process exited)."""


def send(sock: socket.socket, kind: int, batch: int = -1, payload: bytes = b"") -> None:
    """Sends one framed message."""
    sock.sendall(_HEADER.pack(kind, batch, len(payload)) + payload)


def receive(sock: socket.socket) -> tuple[int, int, bytes]:
    """Receives one framed message: (kind, batch, payload). Raises WorkerGone on EOF."""
    header = _receive_exactly(sock, _HEADER.size)
    kind, batch, length = _HEADER.unpack(header)
    if length < 0 or length > (1 << 30):
        raise ValueError(f"EnvPool control message claims {length} bytes")
    payload = _receive_exactly(sock, length) if length else b""
    return kind, batch, payload


def _receive_exactly(sock: socket.socket, n: int) -> bytes:
    data = sock.recv(n, socket.MSG_WAITALL)
    if len(data) == n:
        return data
    # MSG_WAITALL returns short only at EOF or on a signal; finish by hand.
    chunks = [data]
    got = len(data)
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise WorkerGone()
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def clip_text(text: str) -> bytes:
    """UTF-8 bytes of ``text``, cut in the middle if longer than MAX_TEXT."""
    data = text.encode("utf-8", "replace")
    if len(data) <= MAX_TEXT:
        return data
    half = MAX_TEXT // 2
    return data[:half] + b"\n[... traceback cut ...]\n" + data[-half:]


def observation_arrays(obs: Any) -> dict[str, np.ndarray]:
    """An observation as named arrays: a dict's items, anything else as "state"."""
    if isinstance(obs, dict):
        return {str(k): np.asarray(v) for k, v in obs.items()}
    return {"state": np.asarray(obs)}


def array_spec(arrays: dict[str, np.ndarray]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype string, shape) of each array."""
    return {k: (v.dtype.str, tuple(v.shape)) for k, v in arrays.items()}


def layout(
    obs_spec: dict[str, tuple[str, tuple[int, ...]]],
    action_spec: tuple[str, tuple[int, ...]],
    batch_size: int,
    num_batches: int,
) -> tuple[dict[str, tuple[int, str, tuple[int, ...]]], int]:
    """Places every per-batch array in one region.

    Returns ({"<batch>/<key>": (offset, dtype, shape)}, total bytes), where key is
    an observation key, a STAT_KEYS entry or "action"; each shape starts with
    batch_size.
    """
    fields = dict(obs_spec)
    for key, dtype in _STAT_DTYPES.items():
        fields[key] = (np.dtype(dtype).str, ())
    fields["action"] = action_spec
    placed: dict[str, tuple[int, str, tuple[int, ...]]] = {}
    offset = 0
    for b in range(num_batches):
        for key, (dtype, shape) in fields.items():
            full = (batch_size, *shape)
            nbytes = int(np.prod(full, dtype=np.int64)) * np.dtype(dtype).itemsize
            placed[f"{b}/{key}"] = (offset, dtype, full)
            offset += -(-max(nbytes, 1) // _ALIGN) * _ALIGN
    return placed, offset


def views(buffer: Any, placed: dict[str, tuple[int, str, tuple[int, ...]]], batch: int) -> dict:
    """Numpy arrays over ``buffer`` for every field of one batch, by key."""
    prefix = f"{batch}/"
    out = {}
    for name, (offset, dtype, shape) in placed.items():
        if name.startswith(prefix):
            out[name[len(prefix) :]] = np.ndarray(shape, dtype=dtype, buffer=buffer, offset=offset)
    return out
