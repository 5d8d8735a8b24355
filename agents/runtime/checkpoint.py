"""Verified, atomic checkpoints with a bounded history.

``<savedir>/checkpoint.pt`` is always a complete checkpoint: it is written to a
temporary file in the same folder, flushed to disk and renamed over the old one,
so a crash mid-write leaves the previous checkpoint intact. Older checkpoints
are kept as ``<savedir>/checkpoints/checkpoint_<step>.pt`` (the newest
``history`` of them); each is a file of its own (not a link to the latest), so
damage to one spoils no other.

A checkpoint file is the ``torch.save`` bytes of the state followed by a
trailer: a JSON record (steps, model version, lineage, the payload's size and a
SHA-256 digest of payload and record), its length and a magic tag. Loading
checks the digest, so a truncated file or a flipped bit is found before anything
is trained on; ``load_latest`` then falls back to the newest intact history
entry.

Writers take an ``flock`` on ``<savedir>/.checkpoint.lock`` around the final
renames and never replace a checkpoint on disk that is further along (more
steps, or as many at a higher model version): a leader that was paused while
the others went on cannot, on waking, put its stale state back.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import logging
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("moolib.agents")

LATEST = "checkpoint.pt"
HISTORY_DIR = "checkpoints"
LOCK = ".checkpoint.lock"
_HISTORY_NAME = re.compile(r"checkpoint_(\d+)\.pt$")
_MAGIC = b"MOOLIBC1"
_TAIL = struct.Struct("<Q8s")  # length of the JSON record, magic
_FORMAT = 1


class CheckpointError(Exception):
    """A checkpoint file that cannot be used (missing trailer, bad digest, unreadable)."""


class StaleWriteError(Exception):
    """A write skipped because the checkpoint on disk is further along than the state."""

    def __init__(self, path: Path, on_disk: dict, mine: dict) -> None:
        super().__init__(
            f"{path} holds step {on_disk['steps']} (model version {on_disk['model_version']}), "
            f"further than this state's step {mine['steps']} "
            f"(model version {mine['model_version']})"
        )
        self.on_disk = on_disk


class NotAllowedError(Exception):
    """A write skipped because the caller's ``may_write`` said no at the last moment."""


class FinalWriteError(RuntimeError):
    """The end-of-run checkpoint could not be written: the steps since the last one
    that was are lost, and the run must not look finished."""


def write_failure(savedir: Path, step: int, error: OSError, final: bool) -> str:
    """What a failed write of the checkpoint at ``step`` means, in one line: training
    goes on and retries, or (``final``) what a resume of ``savedir`` would start from."""
    where = error.filename or Path(savedir) / LATEST
    reason = error.strerror or str(error)
    if not final:
        return (
            f"checkpoint at step {step} could not be written to {where}: {reason}; the "
            "previous checkpoint stays, training goes on (next try at the next interval)"
        )
    on_disk = _on_disk(Path(savedir) / LATEST)
    kept = (
        f"the savedir's latest checkpoint is at step {on_disk['steps']:,}, where a resume "
        "would go on"
        if on_disk
        else "the savedir holds no checkpoint: a resume is refused (start over in a new savedir)"
    )
    return f"the final checkpoint (step {step:,}) could not be written to {where}: {reason}; {kept}"


@dataclass
class Loaded:
    """A checkpoint read and verified by ``load_latest``."""

    state: dict
    path: Path
    # One line per newer checkpoint that was passed over as unusable.
    skipped: list[str]


def _record(state: dict, payload: bytes) -> dict:
    return {
        "format": _FORMAT,
        "steps": int(state["steps"]),
        "model_version": int(state.get("model_version", 0)),
        "lineage": int(state.get("lineage", 0)),
        "size": len(payload),
    }


def _digest(payload: bytes, record: dict) -> str:
    h = hashlib.sha256(payload)
    h.update(json.dumps(record, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def encode(state: dict) -> bytes:
    """The bytes of a checkpoint file holding ``state`` (needs ``state["steps"]``)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    payload = buf.getvalue()
    record = _record(state, payload)
    record["sha256"] = _digest(payload, record)
    meta = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    return payload + meta + _TAIL.pack(len(meta), _MAGIC)


def _legacy(data: bytes, path: Path) -> tuple[bytes, dict]:
    """A checkpoint written before checkpoints carried a digest: a whole torch.save
    archive (a truncated one does not load), accepted unverified, with a warning."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
        record = _record(state, data)
    except Exception as e:  # noqa: BLE001 - any failure means the file is unusable
        raise CheckpointError(
            f"{path} is truncated or not a moolib checkpoint (no trailer; {type(e).__name__})"
        ) from e
    log.warning("%s has no digest (written by an older moolib): loaded unverified", path)
    return data, record


def _split(data: bytes, path: Path) -> tuple[bytes, dict]:
    """(payload, record) of a checkpoint's bytes, digest checked."""
    if len(data) < _TAIL.size:
        what = "empty" if not data else "truncated"
        raise CheckpointError(f"{path} is {what} ({len(data)} bytes)")
    meta_len, magic = _TAIL.unpack_from(data, len(data) - _TAIL.size)
    if magic != _MAGIC or meta_len > len(data) - _TAIL.size:
        return _legacy(data, path)
    end = len(data) - _TAIL.size
    try:
        record = json.loads(data[end - meta_len : end])
        digest = record.pop("sha256")
    except (ValueError, KeyError, AttributeError) as e:
        raise CheckpointError(f"{path} has a damaged trailer ({e})") from e
    payload = data[: end - meta_len]
    if record.get("size") != len(payload) or _digest(payload, record) != digest:
        raise CheckpointError(f"{path} is corrupt (SHA-256 digest mismatch)")
    return payload, record


def verify(path: Path) -> dict:
    """The record (steps, model_version, lineage, size) of the checkpoint at ``path``,
    its digest checked. Raises CheckpointError (OSError: it cannot be read)."""
    path = Path(path)
    return _split(path.read_bytes(), path)[1]


def load(path: Path) -> dict:
    """The state held by the checkpoint at ``path``, verified. Raises CheckpointError."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path} cannot be read ({e.strerror or e})") from e
    payload, record = _split(data, path)
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - a verified payload that torch cannot read
        raise CheckpointError(f"{path} cannot be loaded ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or int(state.get("steps", -1)) != record["steps"]:
        raise CheckpointError(f"{path} does not hold the state its trailer describes")
    return state


@contextlib.contextmanager
def _locked(savedir: Path) -> Iterator[None]:
    fd = os.open(savedir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write_temp(data: bytes, folder: Path, name: str) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _fsync_dir(folder: Path) -> None:
    # A rename is durable only once the directory entry is.
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _on_disk(latest: Path) -> dict | None:
    """The record of the intact checkpoint at ``latest``; None if there is none (a
    damaged one may be replaced)."""
    try:
        return verify(latest)
    except (OSError, CheckpointError):
        return None


def save(
    savedir: Path,
    state: dict,
    step: int,
    history: int,
    may_write: Callable[[], bool] | None = None,
) -> Path:
    """Writes ``state`` as the latest checkpoint and as history entry ``step``, then
    drops history entries beyond the newest ``history``. Returns the latest's path.

    Raises StaleWriteError (nothing written) when the latest checkpoint on disk is
    further along than ``state``, NotAllowedError when ``may_write()`` (asked under
    the lock, right before the renames) is false, and OSError when a file cannot be
    written; in every case the checkpoints on disk are left as they were."""
    savedir = Path(savedir)
    latest = savedir / LATEST
    data = encode(state)
    temps: list[tuple[Path, Path]] = []
    try:
        temps.append((_write_temp(data, savedir, LATEST), latest))
        if history > 0:
            folder = savedir / HISTORY_DIR
            folder.mkdir(parents=True, exist_ok=True)
            entry = folder / f"checkpoint_{step}.pt"
            temps.append((_write_temp(data, folder, entry.name), entry))
        mine = _record(state, b"")
        with _locked(savedir):
            on_disk = _on_disk(latest)
            if on_disk is not None and (on_disk["steps"], on_disk["model_version"]) > (
                mine["steps"],
                mine["model_version"],
            ):
                raise StaleWriteError(latest, on_disk, mine)
            if may_write is not None and not may_write():
                raise NotAllowedError(str(latest))
            for tmp, dest in temps:
                os.replace(tmp, dest)
            temps.clear()
            _fsync_dir(savedir)
            if history > 0:
                _fsync_dir(savedir / HISTORY_DIR)
                for old in list_history(savedir)[:-history]:
                    old.unlink(missing_ok=True)
    finally:
        for tmp, _ in temps:
            tmp.unlink(missing_ok=True)
    return latest


def list_history(savedir: Path) -> list[Path]:
    """History checkpoints, oldest first."""
    folder = Path(savedir) / HISTORY_DIR
    if not folder.is_dir():
        return []
    found = []
    for p in folder.iterdir():
        m = _HISTORY_NAME.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def load_latest(savedir: Path) -> Loaded | None:
    """The newest intact checkpoint of ``savedir``: ``checkpoint.pt``, else the newest
    history entry that verifies. None when there is no checkpoint at all; raises
    CheckpointError (one line naming every file tried) when none is intact."""
    savedir = Path(savedir)
    candidates = [savedir / LATEST] if (savedir / LATEST).exists() else []
    candidates += list(reversed(list_history(savedir)))
    if not candidates:
        return None
    skipped: list[str] = []
    for path in candidates:
        try:
            return Loaded(load(path), path, skipped)
        except CheckpointError as e:
            skipped.append(str(e))
    raise CheckpointError(f"no intact checkpoint in {savedir}: " + "; ".join(skipped))


def describe_fallback(loaded: Loaded) -> str:
    """One line saying which checkpoints were unusable and which one is used."""
    return (
        "; ".join(loaded.skipped)
        + f"; using the newest intact one instead: {loaded.path} (step {loaded.state['steps']:,})"
    )
