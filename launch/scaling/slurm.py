"""``scaling=slurm``: a broker job and the run's processes as SLURM jobs, through
submitit (``moolib.launch.slurm``, imported when a run starts: submitit is an extra)."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from moolib.conf.checks import ConfigError, check_flag, check_int_at_least, check_number
from moolib.conf.schema.run_config import RunConfig
from moolib.conf.schema.scaling import ProcessScalingConfig, register_scaling

from ..peer import StopSignal

# The SLURM commands a launch needs first: submitit's executor refuses to start without
# srun, and sbatch submits the jobs.
SLURM_COMMANDS = ("sbatch", "srun")
# How long SLURM's controller may take to answer ``sinfo`` (a busy one is slow).
SLURM_ANSWER_SECONDS = 30.0


@dataclass(frozen=True)
class SlurmScalingConfig(ProcessScalingConfig):
    """``scaling=slurm``: a broker job and the peer jobs (one array) on SLURM, through
    submitit. The sbatch settings' null is the cluster's default."""

    wait: bool  # follow the jobs until the peers end
    partition: str | None
    time: int  # minutes per job; a peer that reaches it is requeued
    nodes: int
    tasks_per_node: int  # one peer per task
    cpus_per_task: int
    gpus_per_task: int | None
    mem: str | None  # e.g. 64G
    constraint: str | None
    account: str | None
    qos: str | None
    # Any other sbatch option (free-form), e.g. {exclude: "node[1-3]"}.
    additional_parameters: Mapping[str, Any]
    max_failures: int  # requeues of a job after its tasks failed
    array_parallelism: int | None  # peer jobs running at once (None: all)
    broker_cpus: int
    broker_mem: str | None
    broker_host: str | None  # the hostname peers reach the broker by (None: its node's)
    broker_timeout: float  # seconds the launcher waits for the broker job to answer

    # The jobs run on the cluster's nodes, not on this machine (a login node).
    on_this_machine: ClassVar[bool] = False

    @property
    def peers_per_job(self) -> int:
        """Peers (actor processes, for an off-policy run) in one job of the array."""
        return self.nodes * self.tasks_per_node

    @property
    def follows_run(self) -> bool:
        """Only with ``wait``: else moolib-run returns once the jobs are submitted."""
        return bool(self.wait)

    def broker_wait(self, run: RunConfig) -> tuple[float, str]:
        """A broker on the cluster may take a job's start to answer."""
        return float(self.broker_timeout), "scaling.broker_timeout"

    def check(self, run: RunConfig) -> None:
        """The process counts, and the sbatch settings."""
        super().check(run)
        for key in ("time", "nodes", "tasks_per_node", "cpus_per_task", "broker_cpus"):
            check_int_at_least(f"scaling.{key}", getattr(self, key))
        # Off-policy runs spread their actor processes over the array's jobs (the
        # learner has a job of its own); the others their peers.
        what = run.processes
        count = getattr(self, what)
        if count % self.peers_per_job:
            raise ConfigError(
                f"scaling.{what} ({count}) must be a multiple of the {what} per job, "
                f"scaling.nodes x scaling.tasks_per_node ({self.peers_per_job})"
            )
        check_flag("scaling.wait", self.wait)
        if self.gpus_per_task is not None:
            check_int_at_least("scaling.gpus_per_task", self.gpus_per_task, 0)
        check_number("scaling.broker_timeout", self.broker_timeout, 1.0)
        check_int_at_least("scaling.max_failures", self.max_failures, 0)
        if self.array_parallelism is not None:
            check_int_at_least("scaling.array_parallelism", self.array_parallelism)


@functools.cache
def _sinfo_failure(slurm_conf: str | None) -> str | None:
    """Why ``sinfo`` failed here with ``SLURM_CONF`` as given (its last line), or None
    when it answered or is not installed; asked once for all the points of a sweep."""
    if shutil.which("sinfo") is None:
        return None
    try:
        answer = subprocess.run(
            ["sinfo", "--noheader", "--format=%P"],
            capture_output=True,
            text=True,
            timeout=SLURM_ANSWER_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return f"no answer in {SLURM_ANSWER_SECONDS:.0f} s"
    if answer.returncode == 0:
        return None
    lines = (answer.stderr or answer.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {answer.returncode}"


def check_machine(cfg: RunConfig) -> None:
    """SLURM's commands are on this machine's PATH, and its controller answers
    (``sinfo``, where installed): SLURM's client packages without a cluster configured
    would otherwise fail in sbatch, after the savedir is made."""
    missing = [name for name in SLURM_COMMANDS if shutil.which(name) is None]
    if missing:
        raise ConfigError(
            f"scaling=slurm: no SLURM on this machine ({' and '.join(missing)} not found on "
            "PATH); launch from a machine of the cluster (a login node), or train here with "
            "scaling=single or scaling=local"
        )
    said = _sinfo_failure(os.environ.get("SLURM_CONF"))
    if said is not None:
        raise ConfigError(
            f"scaling=slurm: SLURM does not answer on this machine (sinfo: {said}); check "
            "that its controller runs and SLURM_CONF or /etc/slurm names it, or train here "
            "with scaling=single or scaling=local"
        )


@register_scaling("slurm", SlurmScalingConfig, check_machine=check_machine)
def start(cfg: RunConfig, config_path: Path, stop: StopSignal) -> int:
    """Submits the broker and the run's jobs; with ``scaling.wait``, follows them until
    they end (a stop cancels them). A submission that fails exits 1 with one line."""
    from .. import slurm

    try:
        launched = slurm.launch(cfg, config_path, stop)
    except (RuntimeError, TimeoutError) as e:
        if stop.is_set():
            print(f"moolib-run: {e}", file=sys.stderr)
            sys.exit(stop.exit_code)
        print(f"moolib-run: error: {e}", file=sys.stderr)
        sys.exit(1)
    return slurm.follow(launched, stop) if cfg.scaling.follows_run else 0
