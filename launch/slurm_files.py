"""The files a SLURM experiment keeps in its savedir (on a filesystem shared by
every node): the broker's address, the jobs of each launch, the launch's
authentication key, and the peers that finished."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

BROKER_FILE = "broker.json"
JOBS_FILE = "jobs.json"
SLURM_DIR = "slurm"  # submitit's folder: sbatch scripts, pickles, <job id>_<task>_log.out/err
FINISHED_DIR = "finished"  # inside SLURM_DIR: one empty file per peer that reached total_steps
AUTH_DIR = "auth"  # inside SLURM_DIR: one key file per launch, mode 0600


def write_json_atomic(path: Path, data: Any) -> None:
    """Writes ``data`` to ``path`` so a reader sees the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def read_broker_file(savedir: Path, launch: str | None) -> str | None:
    """The address in ``<savedir>/broker.json``, if written by this launch's broker."""
    data = read_json(Path(savedir) / BROKER_FILE)
    if not data or (launch is not None and data.get("launch") != launch):
        return None
    return data["address"]


def record_jobs(savedir: Path, entry: dict) -> None:
    """Records one launch in ``<savedir>/jobs.json`` (a list, newest last),
    replacing what an earlier call recorded for the same launch."""
    path = Path(savedir) / JOBS_FILE
    launches = [e for e in read_json(path) or [] if e.get("launch") != entry["launch"]]
    write_json_atomic(path, [*launches, entry])


def write_auth_key(savedir: Path, launch: str, key: str) -> Path:
    """Stores the launch's key where its jobs read it, readable by the owner only."""
    folder = Path(savedir) / SLURM_DIR / AUTH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)
    path = folder / launch
    # Created 0600 (not chmod-ed after): the key is never readable by others.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    return path


def use_auth_key(savedir: Path, launch: str) -> bool:
    """Makes every Rpc of this process use the launch's key, if it has one."""
    import moolib

    path = Path(savedir) / SLURM_DIR / AUTH_DIR / launch
    if not path.exists():
        return False
    moolib.set_auth_key(path.read_text())
    return True
