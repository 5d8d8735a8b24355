"""``scaling=slurm``: a broker job and N peer jobs on SLURM, through submitit.

    moolib-run agent=vtrace env=breakout scaling=slurm scaling.peers=8

The launcher

1. submits the broker job (unless ``broker=host:port`` names a running one),
   which serves a ``moolib.Broker`` and writes its address atomically into
   ``<savedir>/broker.json``;
2. waits, bounded by ``scaling.broker_timeout``, until that broker answers (an
   Rpc connects and a probe group joins through it);
3. submits the peers as one job array, each job running ``nodes x
   tasks_per_node`` peers, one per task (rank = array index x peers per job +
   the task's rank), which read the broker address from the file and train
   through ``launch.peer``;
4. records every job in ``<savedir>/jobs.json``, prints the job ids, the
   savedir and the log folder, and returns (``scaling.wait=true`` follows the
   jobs instead).

The savedir must be on a filesystem that every node mounts at the same path.
The launcher says so, and stops with that diagnosis when the broker job runs
but the log its node writes into the savedir does not show up here.

The broker and peers listen on every interface, and peers unpickle what they
receive: every launch has an authentication key (``MOOLIB_AUTH_KEY`` if set,
else a fresh random one), kept in ``<savedir>/slurm/auth/<launch>`` readable
by its owner only; the jobs read it from there. With ``broker=host:port`` the
key is ``MOOLIB_AUTH_KEY`` (or none): it has to be the running broker's.

Peer jobs are ``submitit.helpers.Checkpointable``: a preempted or timed-out
peer is requeued and rejoins its group (the Accumulator hands it the leader's
state); the other peers keep training meanwhile. Running the same command
again with the same savedir resumes from the leader's checkpoint. The broker
job ends by itself once every peer has finished training or no peer job is
left in the queue.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import submitit
from omegaconf import DictConfig, OmegaConf

from . import slurm_requeue

BROKER_FILE = "broker.json"
JOBS_FILE = "jobs.json"
SLURM_DIR = "slurm"  # submitit's folder: sbatch scripts, pickles, <job id>_<task>_log.out/err
FINISHED_DIR = "finished"  # inside SLURM_DIR: one empty file per peer that reached total_steps
AUTH_DIR = "auth"  # inside SLURM_DIR: one key file per launch, mode 0600
# Seconds a broker job may run before its log (written by its node into the
# savedir) must be visible to the launcher; if not, the savedir is not shared.
SHARED_FS_GRACE = 60.0

# -- files in the savedir ---------------------------------------------------------------


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
    """Appends one launch to ``<savedir>/jobs.json`` (a list, newest last)."""
    path = Path(savedir) / JOBS_FILE
    launches = read_json(path) or []
    launches.append(entry)
    write_json_atomic(path, launches)


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


# -- what runs inside the jobs ----------------------------------------------------------


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


def _requeue_on_failure(executor: submitit.SlurmExecutor, folder: Path, max_failures: int) -> None:
    """Makes the jobs' batch scripts requeue them when srun ends non-zero."""
    executor.update_parameters(
        # A failing task ends the job's step at once (its tasks requeue together).
        srun_args=["--kill-on-bad-exit=1"],
        teardown=[
            "moolib_status=$?  # srun's: the tasks'",
            f"{shlex.quote(sys.executable)} -m moolib.launch.slurm_requeue "
            f"{shlex.quote(str(folder))} $moolib_status {max_failures}",
        ],
    )


class BrokerJob(_RequeueableJob):
    """The broker job: serves a broker and publishes its address in the savedir.

    Ends when every peer of its launch has finished training, or when none of
    the launch's peer jobs is left in the queue (all done, failed or cancelled).
    Preempted, it is requeued: back on the same node it listens on the same
    port, so the peers' links come back by themselves; elsewhere the peers
    read the new address from the file.
    """

    def __call__(self, savedir: str, launch: str, peers: int, host: str | None) -> str:
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
                done = len(list(finished.glob("*"))) if finished.exists() else 0
                if done >= peers:
                    print("every peer finished training; broker stops", flush=True)
                    break
                if _peers_gone(savedir_path, launch):
                    print("no peer job left in the queue; broker stops", flush=True)
                    break
        finally:
            broker.close()
        return address


def _peers_gone(savedir: Path, launch: str) -> bool:
    """Whether the launch's peer job array has left the queue (pending/running/requeued)."""
    for entry in read_json(savedir / JOBS_FILE) or []:
        if entry.get("launch") == launch and entry.get("peers"):
            array = entry["peers"]["array_job_id"]
            try:
                out = subprocess.run(
                    ["squeue", "-h", "-j", str(array), "-o", "%T"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
            except (OSError, subprocess.TimeoutExpired):
                return False
            if out.returncode != 0:
                # squeue fails for an id that is no longer known: the jobs are gone.
                return "Invalid job id" in out.stderr
            return not out.stdout.strip()
    return False  # peers not submitted yet


class PeerJob(_RequeueableJob):
    """A peer job's task: trains as one peer of the experiment in ``config_path``,
    rank ``index x peers per job + the task's global rank``.

    Requeued (preempted, timed out or failed), its peers rejoin the group as
    the same ranks, with the leader's state (or its checkpoint).
    """

    def __call__(self, config_path: str, index: int, launch: str, broker: str | None) -> dict:
        import logging

        import torch

        from . import config as config_lib
        from .peer import make_trainer

        cfg = config_lib.load(Path(config_path))
        rank = index * peers_per_job(cfg) + submitit.JobEnvironment().global_rank
        logging.basicConfig(level=logging.INFO, format=f"[peer {rank}] %(message)s")
        cpus = os.environ.get("SLURM_CPUS_PER_TASK")
        if cpus:
            torch.set_num_threads(int(cpus))
        savedir = Path(cfg.savedir)
        use_auth_key(savedir, launch)
        address = broker or _wait_for_broker_file(savedir, launch, cfg.scaling.broker_timeout)
        print(f"peer {rank}: broker at {address}", flush=True)
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
                args=(trainer.accumulator, savedir, launch, address, stop),
                daemon=True,
            ).start()
        row = trainer.run(stop)
        if not stop.is_set():
            marker = savedir / SLURM_DIR / FINISHED_DIR / launch / str(rank)
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        return {k: v for k, v in row.items() if isinstance(v, (int, float, str))}


def peers_per_job(cfg: DictConfig) -> int:
    """Peers in one peer job: one per task."""
    return int(cfg.scaling.nodes) * int(cfg.scaling.tasks_per_node)


def _follow_broker_file(
    accumulator: Any, savedir: Path, launch: str, address: str, stop: threading.Event
) -> None:
    """Connects to the broker's new address when its (requeued) job writes one."""
    while not stop.wait(5):
        new = read_broker_file(savedir, launch)
        if new and new != address:
            print(f"the broker moved to {new}: connecting", flush=True)
            accumulator.connect(new)
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


# -- the launcher ------------------------------------------------------------------------


def _executor(cfg: DictConfig, folder: Path) -> submitit.SlurmExecutor:
    s = cfg.scaling
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=1000)
    params: dict[str, Any] = {
        "time": int(s.time),
        "nodes": int(s.nodes),
        "ntasks_per_node": int(s.tasks_per_node),
        "cpus_per_task": int(s.cpus_per_task),
        # Also signals the requeue 90 s before the time limit (submitit's default).
        "signal_delay_s": 90,
    }
    # Requeueable whatever the cluster's default (JobRequeue): by submitit, by
    # slurm_requeue after a failure, by SLURM after a node failure.
    extra: dict[str, Any] = {"requeue": True}
    for key in ("partition", "gpus_per_task", "mem", "constraint", "account", "qos"):
        value = s.get(key)
        if value is not None:
            params[key] = value
    extra.update(OmegaConf.to_container(s.additional_parameters, resolve=True) or {})
    params["additional_parameters"] = extra
    executor.update_parameters(**params)
    _requeue_on_failure(executor, folder, int(s.max_failures))
    return executor


def check_broker(address: str, timeout: float, auth_key: str | None = None) -> None:
    """Returns once the broker at ``address`` answers (an Rpc connects and a probe
    group joins through it); raises TimeoutError after ``timeout`` seconds.
    ``auth_key`` overrides the process's key (``MOOLIB_AUTH_KEY``)."""
    import moolib

    rpc = moolib.Rpc()
    if auth_key is not None:
        rpc.set_auth_key(auth_key)
    try:
        rpc.connect(address)
        group = moolib.Group(rpc, f"moolib-run-probe/{secrets.token_hex(4)}")
        group.set_timeout(5)
        deadline = time.monotonic() + timeout
        while not group.active():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the broker at {address} did not answer in {timeout:.0f} s")
            group.update()
            time.sleep(0.05)
    finally:
        rpc.close()


def _wait_for_broker(
    job: submitit.Job,
    savedir: Path,
    launch: str,
    timeout: float,
    auth_key: str,
    stop: threading.Event,
) -> str:
    """The address of the launch's broker job, once it runs and answers."""
    deadline = time.monotonic() + timeout
    last_state = None
    running_since = None
    while True:
        if stop.is_set():
            raise RuntimeError(f"interrupted while waiting for the broker job {job.job_id}")
        address = read_broker_file(savedir, launch)
        if address:
            check_broker(address, max(1.0, deadline - time.monotonic()), auth_key)
            return address
        state = job.state
        if state != last_state and state != "UNKNOWN":  # UNKNOWN: not in sacct yet
            print(f"moolib-run: broker job {job.job_id}: {state}", flush=True)
            last_state = state
        if job.done():
            raise RuntimeError(
                f"the broker job {job.job_id} ended ({state}) before writing "
                f"{savedir / BROKER_FILE}; its log: {job.paths.stderr}"
            )
        if state == "RUNNING":
            running_since = running_since or time.monotonic()
            # Its node writes the job's log into the savedir as the job starts.
            if not job.paths.stdout.exists() and (
                time.monotonic() - running_since > SHARED_FS_GRACE
            ):
                raise RuntimeError(
                    f"the broker job {job.job_id} has run for {SHARED_FS_GRACE:.0f} s but its "
                    f"log {job.paths.stdout} does not appear on this machine: the savedir "
                    f"{savedir} is not on a filesystem shared with the compute nodes; give "
                    "savedir=<a path on a shared filesystem, mounted at the same path everywhere>"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the broker job {job.job_id} did not write {savedir / BROKER_FILE} in "
                f"{timeout:.0f} s (state {state}); is the savedir on a shared filesystem?"
            )
        time.sleep(0.5)


def launch(cfg: DictConfig, config_path: Path, stop: threading.Event) -> dict:
    """Submits the experiment's jobs; returns what is recorded in jobs.json.
    ``stop`` (Ctrl-C) while the broker job starts cancels it."""
    savedir = Path(cfg.savedir).resolve()
    folder = savedir / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    s = cfg.scaling
    token = secrets.token_hex(6)
    entry: dict[str, Any] = {
        "launch": token,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "group": cfg.group,
        "folder": str(folder),
    }
    broker_job = None
    key = os.environ.get("MOOLIB_AUTH_KEY") or None
    if cfg.broker:
        address = cfg.broker
        check_broker(address, float(s.broker_timeout), key)
        entry["broker"] = {"address": address}
        if key:
            write_auth_key(savedir, token, key)
    else:
        key = key or secrets.token_urlsafe(32)
        write_auth_key(savedir, token, key)
        executor = _executor(cfg, folder)
        executor.update_parameters(
            job_name=f"{cfg.name}-broker",
            nodes=1,
            ntasks_per_node=1,
            cpus_per_task=int(s.broker_cpus),
            gpus_per_task=None,
            **({"mem": s.broker_mem} if s.broker_mem else {}),
        )
        broker_job = executor.submit(BrokerJob(), str(savedir), token, int(s.peers), s.broker_host)
        entry["broker"] = {"job_id": broker_job.job_id}
        record_jobs(savedir, entry)
        print(f"moolib-run: broker job {broker_job.job_id} submitted", flush=True)
        try:
            address = _wait_for_broker(
                broker_job, savedir, token, float(s.broker_timeout), key, stop
            )
        except BaseException:
            broker_job.cancel(check=False)
            print(f"moolib-run: broker job {broker_job.job_id} cancelled", flush=True)
            raise
        entry["broker"]["address"] = address

    executor = _executor(cfg, folder)
    executor.update_parameters(
        job_name=cfg.name, array_parallelism=int(s.array_parallelism or s.peers)
    )
    per_job = peers_per_job(cfg)
    indices = list(range(int(s.peers) // per_job))
    broker_arg = cfg.broker or None
    jobs = executor.map_array(
        PeerJob(),
        [str(config_path)] * len(indices),
        indices,
        [token] * len(indices),
        [broker_arg] * len(indices),
    )
    array_id = jobs[0].job_id.split("_")[0]
    entry["peers"] = {
        "array_job_id": array_id,
        "job_ids": [j.job_id for j in jobs],
        "peers_per_job": per_job,
    }
    if broker_job is None:
        record_jobs(savedir, entry)
    else:
        launches = read_json(savedir / JOBS_FILE) or []
        launches = [e for e in launches if e.get("launch") != token] + [entry]
        write_json_atomic(savedir / JOBS_FILE, launches)
    print(
        f"moolib-run: broker at {address}"
        + (f" (job {broker_job.job_id})" if broker_job else "")
        + f"; {len(jobs)} peer jobs"
        + (f" of {per_job} peers (one per task)" if per_job > 1 else "")
        + f": array {array_id} ({', '.join(j.job_id for j in jobs)})\n"
        f"moolib-run: savedir {savedir} (must be on a shared filesystem, mounted at this path "
        "on every node)\n"
        f"moolib-run: SLURM logs in {folder}/<job id>/*_log.out|err; training logs in "
        f"{savedir}/peer<rank>/logs.tsv\n"
        f"moolib-run: moolib-jobs {savedir}   # states;  moolib-jobs {savedir} --cancel   "
        "# stop them",
        flush=True,
    )
    entry["_jobs"] = jobs
    entry["_broker_job"] = broker_job
    return entry


def follow(entry: dict, stop: threading.Event) -> int:
    """``scaling.wait=true``: waits for the peer jobs (printing state changes), then
    for the broker job; ``stop`` (Ctrl-C) cancels them. Returns 0 when every peer
    job completed."""
    jobs: list[submitit.Job] = entry["_jobs"]
    broker_job = entry.get("_broker_job")
    states: dict[str, str] = {}
    while True:
        if stop.is_set():
            print("moolib-run: stopping: cancelling the jobs", flush=True)
            cancel_jobs([j.job_id for j in jobs] + ([broker_job.job_id] if broker_job else []))
            return 1
        for j in jobs:
            state = j.state
            if states.get(j.job_id) != state and state != "UNKNOWN":
                states[j.job_id] = state
                print(f"moolib-run: job {j.job_id}: {state}", flush=True)
        if all(j.done() for j in jobs):
            break
        time.sleep(2)
    failed = []
    for j in jobs:
        try:
            j.results()  # one per task
        except Exception as e:  # noqa: BLE001 - reported, not raised
            failed.append(j.job_id)
            print(f"moolib-run: peer job {j.job_id} failed: {e}", file=sys.stderr, flush=True)
    if broker_job is not None:
        deadline = time.monotonic() + 60
        while not broker_job.done() and time.monotonic() < deadline:
            time.sleep(2)
        if not broker_job.done():
            broker_job.cancel(check=False)
    return 1 if failed else 0


# -- monitoring -------------------------------------------------------------------------


def recorded_jobs(savedir: Path, everything: bool = False) -> list[tuple[str, str]]:
    """(job id, role) of the latest launch (every launch with ``everything``).

    A folder without jobs.json but with experiments in its subfolders (a ``-m``
    sweep's folder) gives theirs, each role prefixed with its subfolder.
    """
    savedir = Path(savedir)
    if not (savedir / JOBS_FILE).exists() and savedir.is_dir():
        return [
            (job_id, f"{point.name}: {role}")
            for point in sorted(savedir.iterdir(), key=_natural)
            if (point / JOBS_FILE).exists()
            for job_id, role in recorded_jobs(point, everything)
        ]
    launches = read_json(savedir / JOBS_FILE) or []
    if not everything:
        launches = launches[-1:]
    found = []
    for entry in launches:
        if entry.get("broker", {}).get("job_id"):
            found.append((entry["broker"]["job_id"], "broker"))
        peers = entry.get("peers", {})
        per_job = peers.get("peers_per_job", 1)
        for index, job_id in enumerate(peers.get("job_ids", [])):
            first = index * per_job
            role = f"peer {first}" if per_job == 1 else f"peers {first}-{first + per_job - 1}"
            found.append((job_id, role))
    return found


def _natural(path: Path) -> tuple[int, str]:
    """Sweep points in order: 2 before 10."""
    return (int(path.name), "") if path.name.isdigit() else (1 << 62, path.name)


def job_states(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """State, elapsed time and node of each job, from sacct (squeue if accounting
    is off)."""
    if not job_ids:
        return {}
    fields = "JobID,State,Elapsed,NodeList"
    out = subprocess.run(
        ["sacct", "-X", "-P", "-n", f"--format={fields}", "-j", ",".join(job_ids)],
        capture_output=True,
        text=True,
    )
    info: dict[str, dict[str, str]] = {}
    if out.returncode == 0:
        for line in out.stdout.splitlines():
            job_id, state, elapsed, nodes = line.split("|")
            # "CANCELLED by 0" -> "CANCELLED"
            info[job_id] = {"state": state.split()[0], "elapsed": elapsed, "node": nodes}
    missing = [j for j in job_ids if j not in info]
    if missing:
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i|%T|%M|%N|%r", "-j", ",".join(missing)],
            capture_output=True,
            text=True,
        )
        for line in out.stdout.splitlines():
            job_id, state, elapsed, nodes, _reason = line.split("|")
            info[job_id] = {"state": state, "elapsed": elapsed, "node": nodes}
    return info


ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED"}


def cancel_jobs(job_ids: list[str], grace: float = 60.0) -> None:
    """Stops the jobs: SIGINT first (peers stop after their step, the leader
    writing a checkpoint), then ``scancel`` whatever is still there after ``grace``."""
    if not job_ids:
        return
    subprocess.run(["scancel", "--signal=INT", *job_ids], capture_output=True)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        states = job_states(job_ids)
        if not any(v["state"] in ACTIVE_STATES - {"PENDING"} for v in states.values()):
            break
        time.sleep(1)
    subprocess.run(["scancel", *job_ids], capture_output=True)


def jobs_main(argv: list[str] | None = None) -> int:
    """``moolib-jobs <savedir> [--all] [--cancel]``: an experiment's SLURM jobs
    (or a sweep's: given its folder, every point's)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="moolib-jobs",
        description="Show (or cancel) the SLURM jobs of a moolib-run savedir or sweep folder.",
    )
    parser.add_argument("savedir", type=Path, help="a savedir, or a -m sweep's folder")
    parser.add_argument("--all", action="store_true", help="every launch, not only the latest")
    parser.add_argument(
        "--cancel", action="store_true", help="stop every job (peers checkpoint first)"
    )
    parser.add_argument(
        "--grace", type=float, default=60.0, help="seconds between SIGINT and scancel"
    )
    args = parser.parse_args(argv)
    found = recorded_jobs(args.savedir, args.all or args.cancel)
    if not found:
        print(
            f"moolib-jobs: no jobs recorded in {args.savedir} (no {JOBS_FILE} there or in its "
            "subfolders)",
            file=sys.stderr,
        )
        return 1
    states = job_states([j for j, _ in found])
    if args.cancel:
        active = [j for j, _ in found if states.get(j, {}).get("state") in ACTIVE_STATES]
        cancel_jobs(active, args.grace)
        print(f"moolib-jobs: cancelled {len(active)} jobs: {' '.join(active) or '-'}")
        states = job_states([j for j, _ in found])
    width = max(10, *(len(role) for _, role in found))
    print(f"{'job':<16} {'role':<{width}} {'state':<12} {'elapsed':>10}  node")
    for job_id, role in found:
        st = states.get(job_id, {"state": "UNKNOWN", "elapsed": "", "node": ""})
        print(f"{job_id:<16} {role:<{width}} {st['state']:<12} {st['elapsed']:>10}  {st['node']}")
    return 0


if __name__ == "__main__":
    sys.exit(jobs_main())
