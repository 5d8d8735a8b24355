"""What runs inside the SLURM jobs of ``scaling=slurm``: the broker job and the
peer jobs (one peer per task), both requeued by submitit on preemption or
time-out and by their batch script after a failure (see slurm_requeue)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit

from . import slurm_requeue
from .slurm_files import (
    BROKER_FILE,
    FINISHED_DIR,
    JOBS_FILE,
    SLURM_DIR,
    read_broker_file,
    read_json,
    use_auth_key,
    write_json_atomic,
)


def _this_host() -> str:
    return socket.gethostname()


class _RequeueableJob(submitit.helpers.Checkpointable):
    """A job that submitit requeues on preemption or time-out (the same call
    again), and its batch script after a failure (see slurm_requeue)."""

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """The same call again, once the job is requeued."""
        print(f"{type(self).__name__}: preempted or timed out: requeued", flush=True)
        # This run then exits non-zero: tell the batch script it is no failure.
        marker = slurm_requeue.REQUEUED_MARKER.format(restart=slurm_requeue.restart_count())
        (submitit.JobEnvironment().paths.folder / marker).touch()
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)


class BrokerJob(_RequeueableJob):
    """The broker job: serves a broker and publishes its address in the savedir.

    Ends when ranks ``0..finishers-1`` of its launch have finished training
    (every peer; an off-policy run's learner), or when none of the launch's
    training jobs is left in the queue (all done, failed or cancelled).
    Preempted, it is requeued: back on the same node it listens on the same
    port, so the peers' links come back by themselves; elsewhere the peers
    read the new address from the file.
    """

    def __call__(self, savedir: str, launch: str, finishers: int, host: str | None) -> str:
        import moolib

        savedir_path = Path(savedir)
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        use_auth_key(savedir_path, launch)
        broker = moolib.Broker()
        previous = read_json(savedir_path / BROKER_FILE) or {}
        bound = None
        if previous.get("launch") == launch and previous.get("node") == _this_host():
            try:
                bound = broker.listen(f"0.0.0.0:{previous['port']}")
            except (RuntimeError, KeyError):
                bound = None
        if bound is None:
            bound = broker.listen("0.0.0.0:0")
        port = int(bound.rsplit(":", 1)[1])
        address = f"{host or _this_host()}:{port}"
        write_json_atomic(
            savedir_path / BROKER_FILE,
            {
                "address": address,
                "port": port,
                "launch": launch,
                "job_id": os.environ.get("SLURM_JOB_ID"),
                "node": _this_host(),
                "written": time.time(),
            },
        )
        print(f"Broker listening at {bound}; peers reach it at {address}", flush=True)
        finished = savedir_path / SLURM_DIR / FINISHED_DIR / launch
        last_check = 0.0
        try:
            while not stop.wait(0.25):
                broker.update()
                if time.monotonic() - last_check < 10:
                    continue
                last_check = time.monotonic()
                if all((finished / str(rank)).exists() for rank in range(finishers)):
                    print("training finished; broker stops", flush=True)
                    break
                if _jobs_gone(savedir_path, launch):
                    print("no training job left in the queue; broker stops", flush=True)
                    break
        finally:
            broker.close()
        return address


def _in_queue(job_id: str) -> bool:
    """Whether a job (or any job of an array) is pending, running or requeued;
    True when squeue cannot tell."""
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return True
    if out.returncode != 0:
        # squeue fails for an id that is no longer known: the job is gone.
        return "Invalid job id" not in out.stderr
    return bool(out.stdout.strip())


def _jobs_gone(savedir: Path, launch: str) -> bool:
    """Whether every training job of the launch (the peer array; an off-policy
    run's learner job and actor array) has left the queue."""
    for entry in read_json(savedir / JOBS_FILE) or []:
        if entry.get("launch") == launch and (entry.get("peers") or entry.get("actors")):
            ids = [entry[k]["array_job_id"] for k in ("peers", "actors") if entry.get(k)]
            ids += [entry["learner"]["job_id"]] if entry.get("learner") else []
            return not any(_in_queue(str(job_id)) for job_id in ids)
    return False  # not submitted yet


class PeerJob(_RequeueableJob):
    """A training job's task: runs as one peer of the experiment in ``config_path``,
    rank ``first_rank + index x tasks per job + the task's global rank`` (an
    off-policy run's learner is rank 0, its actor processes ranks 1..).

    Requeued (preempted, timed out or failed), its peers rejoin the group as
    the same ranks, with the leader's state (or its checkpoint); a requeued
    learner resumes from its checkpoint and its actors reconnect to it.
    """

    def __call__(
        self, config_path: str, index: int, launch: str, broker: str | None, first_rank: int = 0
    ) -> dict:
        import logging

        from . import config as config_lib
        from .peer import make_trainer

        cfg = config_lib.load(Path(config_path))
        env = submitit.JobEnvironment()
        rank = first_rank + index * env.num_tasks + env.global_rank
        from moolib.agents.registry import runtime_of

        who = runtime_of(cfg).role(cfg, rank)  # named as moolib-jobs names their jobs
        logging.basicConfig(level=logging.INFO, format=f"[{who}] %(message)s")
        savedir = Path(cfg.savedir)
        use_auth_key(savedir, launch)
        address = broker or _wait_for_broker_file(savedir, launch, cfg.scaling.broker_timeout)
        print(f"{who}: broker at {address}", flush=True)
        # SIGINT (moolib-jobs --cancel sends it first) stops after the current
        # step, the leader writing a last checkpoint.
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        # SLURM signals every process of the job, the EnvPool workers included.
        # SIGTERM comes before USR2 on preemption and must change nothing
        # (submitit's handler only logs it): ignored here, and so in the
        # workers, which inherit SIG_IGN. USR2 makes submitit checkpoint and
        # requeue this job; the workers must not die of it first (their death
        # would fail the training step): blocked in this thread while the
        # Trainer starts, so the workers it spawns inherit it blocked. A USR2
        # meanwhile is not lost: Python runs submitit's handler in this thread
        # (whichever thread took the signal), at the latest once unblocked.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        try:
            trainer = make_trainer(cfg, rank, address)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})
        if not broker:  # a requeued broker job may come back elsewhere
            threading.Thread(
                target=_follow_broker_file,
                args=(trainer.connect, savedir, launch, address, stop),
                daemon=True,
            ).start()
        row = trainer.run(stop)
        if not stop.is_set():
            marker = savedir / SLURM_DIR / FINISHED_DIR / launch / str(rank)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        return {k: v for k, v in row.items() if isinstance(v, (int, float, str))}


def _follow_broker_file(
    connect: Callable[[str], None], savedir: Path, launch: str, address: str, stop: threading.Event
) -> None:
    """Connects to the broker's new address when its (requeued) job writes one."""
    while not stop.wait(5):
        new = read_broker_file(savedir, launch)
        if new and new != address:
            print(f"the broker moved to {new}: connecting", flush=True)
            connect(new)
            address = new


def _wait_for_broker_file(savedir: Path, launch: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        address = read_broker_file(savedir, launch)
        if address:
            return address
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"no broker address in {savedir / BROKER_FILE} after {timeout:.0f} s: is the "
                "savedir on a filesystem shared by every node?"
            )
        time.sleep(1)
