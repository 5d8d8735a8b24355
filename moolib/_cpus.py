"""How many cores a process of moolib's may keep busy: what sizes torch's thread
pool and the envpool backend's threads."""

from __future__ import annotations

import os


def task_cores() -> int:
    """The cores this process may use: its SLURM task's CPUs (a cluster that does
    not bind tasks to cores shows each task every core of the node), else the
    cores it may run on (taskset, cgroups), not the machine's."""
    slurm_cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if slurm_cpus:
        return int(slurm_cpus)
    return len(os.sched_getaffinity(0))
