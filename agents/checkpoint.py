"""Atomic checkpoints with a bounded history.

``<savedir>/checkpoint.pt`` is always a complete checkpoint: it is written to a
temporary file in the same folder, flushed to disk and renamed over the old one,
so a crash mid-write leaves the previous checkpoint intact. Older checkpoints
are kept as ``<savedir>/checkpoints/checkpoint_<step>.pt`` (the newest
``history`` of them).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

LATEST = "checkpoint.pt"
HISTORY_DIR = "checkpoints"
_HISTORY_NAME = re.compile(r"checkpoint_(\d+)\.pt$")


def _write_atomically(obj: Any, path: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    # The rename itself is durable only once the directory entry is.
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(savedir: Path, state: dict, step: int, history: int) -> Path:
    """Writes ``state`` as the latest checkpoint and as history entry ``step``,
    then drops history entries beyond the newest ``history``. Returns the path
    of the latest checkpoint."""
    savedir = Path(savedir)
    latest = savedir / LATEST
    _write_atomically(state, latest)
    if history > 0:
        folder = savedir / HISTORY_DIR
        folder.mkdir(parents=True, exist_ok=True)
        entry = folder / f"checkpoint_{step}.pt"
        # A hard link shares the bytes just written; copy where links fail.
        try:
            if entry.exists():
                entry.unlink()
            os.link(latest, entry)
        except OSError:
            _write_atomically(state, entry)
        for old in list_history(savedir)[:-history]:
            old.unlink(missing_ok=True)
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


def load_latest(savedir: Path) -> dict | None:
    """The latest checkpoint in ``savedir``, or None if there is none."""
    latest = Path(savedir) / LATEST
    if not latest.exists():
        return None
    return torch.load(latest, map_location="cpu", weights_only=False)
