"""Processes seen through /proc, for the benchmarks that start and watch many:
the living processes below one, and what one holds."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(root: int | None = None) -> list[int]:
    """Pids of the living processes below ``root`` (this one by default), by their
    parent links; zombies are left out."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [os.getpid() if root is None else root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def proc_stats(pid: int) -> dict[str, int | str] | None:
    """RSS (bytes), open descriptors, shared-memory segments held (see
    ``shared_segments``), threads and state letter of ``pid``; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss": int(fields.get("VmRSS", "0 kB").split()[0]) * 1024,
        "fds": fds,
        "shm": len(shared_segments(pid)),
        "threads": int(fields["Threads"]),
        "state": fields["State"].split()[0],
    }


def shared_segments(pid: int) -> set[tuple[str, int]]:
    """The shared-memory segments ``pid`` maps or holds open, as (name, inode): memfds
    (moolib's transport pools and group regions) and files under /dev/shm (torch,
    multiprocessing). Empty if it is gone."""
    found = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(("/memfd:", "/dev/shm/")):
                    found.add((parts[5].strip().removesuffix(" (deleted)"), int(parts[4])))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(("/memfd:", "/dev/shm/")):
                    inode = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
                    found.add((target.removesuffix(" (deleted)"), inode))
            except OSError:
                continue  # closed meanwhile
    except OSError:
        return set()
    return found
