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
    """RSS (bytes), open descriptors, threads and state letter of ``pid``; None if
    it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss": int(fields.get("VmRSS", "0 kB").split()[0]) * 1024,
        "fds": fds,
        "threads": int(fields["Threads"]),
        "state": fields["State"].split()[0],
    }
