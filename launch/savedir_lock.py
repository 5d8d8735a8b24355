"""One run per savedir at a time.

Two runs training in one savedir would interleave their logs and race for its
checkpoints (the checkpoint lock only keeps the one further along). So a
``moolib-run`` that trains (in its own process, its peer processes, or SLURM
jobs it launches and follows) holds an exclusive ``flock`` on
``<savedir>/.moolib-run.lock`` while it runs, with who it is written in the
file for the message another run gets. The kernel drops the lock when the
process ends, however it ends, so no lock outlives its run. SLURM jobs outlive
the ``moolib-run`` that launched them: they are found by the job ids recorded
in ``jobs.json`` and asked about with ``jobs.job_states``.

Where a filesystem has no locks (``flock`` fails with ENOLCK, say), the check
is skipped rather than stopping the run.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from . import jobs
from .config import ConfigError

LOCK_FILE = ".moolib-run.lock"


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it, for the message."""
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return (
            f"moolib-run (pid {data['pid']} on host {data['host']}, started {data['since']}) "
            f"runs in it; stop that run first (Ctrl-C in its terminal, or kill -INT "
            f"{data['pid']} on {data['host']})"
        )
    except (OSError, ValueError, KeyError):
        return "another moolib-run runs in it; stop that run first"


def _in_use(savedir: Path, fd: int) -> ConfigError:
    return ConfigError(
        f"savedir={savedir} is in use: {_holder(fd)}, or give this run another savedir"
    )


def _try_lock(fd: int) -> bool | None:
    """True when locked, False when another process holds it, None when the
    filesystem does not lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def _check_slurm_jobs(savedir: Path) -> None:
    found = jobs.recorded_jobs(savedir)
    if not found or not (shutil.which("sacct") or shutil.which("squeue")):
        return
    try:
        states = jobs.job_states([job_id for job_id, _ in found])
    except (OSError, ValueError):
        return  # SLURM cannot answer here: nothing to go by
    active = [
        f"{job_id} ({role}, {states[job_id]['state']})"
        for job_id, role in found
        if states.get(job_id, {}).get("state") in jobs.ACTIVE_STATES
    ]
    if active:
        raise ConfigError(
            f"savedir={savedir} is in use: the SLURM jobs of its last launch are still active: "
            f"{', '.join(active)}; wait for them to end, or stop them first with "
            f"moolib-jobs {savedir} --cancel"
        )


def check_free(savedir: Path) -> None:
    """Raises ConfigError if a moolib-run, or SLURM jobs launched into it, are
    running in ``savedir``. Creates nothing."""
    path = Path(savedir)
    try:
        fd = os.open(path / LOCK_FILE, os.O_RDWR)
    except OSError:
        fd = None  # no lock file: no moolib-run has held it
    if fd is not None:
        try:
            locked = _try_lock(fd)
            if locked is False:
                raise _in_use(savedir, fd)
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    if path.is_dir():
        _check_slurm_jobs(path)


class SavedirLock:
    """``savedir``'s lock, held from ``acquire`` until ``release`` (or the process's end)."""

    def __init__(self, fd: int, locked: bool) -> None:
        self._fd: int | None = fd
        self._locked = locked

    @classmethod
    def acquire(cls, savedir: Path) -> SavedirLock:
        """Takes the lock, making the folder if needed; raises ConfigError if another
        moolib-run holds it."""
        path = Path(savedir)
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        locked = _try_lock(fd)
        if locked is False:
            error = _in_use(savedir, fd)
            os.close(fd)
            raise error
        if locked:
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
        return cls(fd, bool(locked))

    def release(self) -> None:
        if self._fd is None:
            return
        if self._locked:
            # LOCK_UN, not only close: an env worker forked meanwhile shares the
            # open file and would keep the lock until it exits.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None
