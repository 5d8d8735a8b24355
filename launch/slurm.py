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
   through ``launch.peer``; an off-policy run (agent=apex, r2d2) gets a learner
   job instead (rank 0, one task: it serves the replay and publishes the
   weights) and an array of ``scaling.actors`` actor processes (ranks 1..,
   without GPUs), which find the learner by name through the broker;
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
state); the other peers keep training meanwhile. A requeued actor job reconnects to the
learner and feeds it again; a requeued learner job writes a checkpoint as it is
preempted, resumes from it (model, target, optimizer, and the replay with
``agent.save_replay``), and its actors, waiting up to ``lost_group_timeout``,
feed it again. Running the same command again with the same savedir resumes
from the leader's (learner's) checkpoint. The broker job ends by itself once
every peer (the learner) has finished training or no training job is left in
the queue.
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit
from moolib.agents.registry import ProcessGroup
from moolib.conf.schema.run_config import RunConfig

from .jobs import ACTIVE_STATES, cancel_jobs, job_states, raise_if_stuck
from .local import check_broker
from .slurm_files import (
    BROKER_FILE,
    SLURM_DIR,
    read_broker_file,
    record_jobs,
    write_auth_key,
)
from .slurm_jobs import BrokerJob, PeerJob

# Seconds a broker job may run before its log (written by its node into the
# savedir) must be visible to the launcher; if not, the savedir is not shared.
SHARED_FS_GRACE = 60.0


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


def _scaling(cfg: RunConfig) -> Any:
    """The run's SLURM settings (``moolib.launch.scaling.slurm.SlurmScalingConfig``: a
    run comes here with scaling=slurm)."""
    return cfg.scaling


def _executor(cfg: RunConfig, folder: Path) -> submitit.SlurmExecutor:
    s = _scaling(cfg)
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
        value = getattr(s, key)
        if value is not None:
            params[key] = value
    extra.update(s.additional_parameters or {})
    params["additional_parameters"] = extra
    executor.update_parameters(**params)
    _requeue_on_failure(executor, folder, int(s.max_failures))
    return executor


# Seconds between asking squeue why the broker job is pending; how long a launch asks
# why its training jobs are, before it goes on.
REASON_POLL = 2.0
STUCK_CHECK = 5.0


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
    reason, reason_checked = None, 0.0
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
        if state == "PENDING" and time.monotonic() - reason_checked > REASON_POLL:
            # squeue, not sacct, has the reason: asked now and then, not every poll.
            reason_checked = time.monotonic()
            now = job_states([job.job_id]).get(job.job_id, {}).get("reason")
            if now and now != reason:
                print(f"moolib-run: broker job {job.job_id}: PENDING ({now})", flush=True)
                reason = now
            raise_if_stuck("broker job", job.job_id, reason)
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


def _check_not_stuck(jobs: list[submitit.Job], what: str) -> None:
    """Raises RuntimeError if SLURM holds one of ``jobs`` for a reason that waiting does
    not change. SLURM gives a reason at its first scheduling pass, within seconds of the
    submission: asked for up to STUCK_CHECK seconds, then the launch goes on."""
    deadline = time.monotonic() + STUCK_CHECK
    ids = [j.job_id for j in jobs]
    while True:
        states = job_states(ids)
        for job_id in ids:
            raise_if_stuck(what, job_id, states.get(job_id, {}).get("reason"))
        untold = [s for s in states.values() if s["state"] == "PENDING" and "reason" not in s]
        if not untold or time.monotonic() > deadline:
            return
        time.sleep(1)


@dataclass
class Launched:
    """The jobs one launch submitted (what ``follow`` watches)."""

    peer_jobs: list[submitit.Job]  # an off-policy run's: its learner job, then its actor jobs
    broker_job: submitit.Job | None  # None with broker=host:port


def launch(cfg: RunConfig, config_path: Path, stop: threading.Event) -> Launched:
    """Submits the experiment's jobs and records them in jobs.json.

    All or nothing: when a submission fails (sbatch refuses a job array, say) or
    ``stop`` (Ctrl-C) comes while the broker job starts, the jobs already
    submitted are cancelled, so no broker is left waiting for peers that never come.
    """
    submitted: list[submitit.Job] = []
    try:
        return _submit_all(cfg, config_path, stop, submitted)
    except BaseException:
        # The broker last, as cancel_jobs does: it outlives whatever needs it.
        for job in reversed(submitted):
            job.cancel(check=False)
        if submitted:
            ids = ", ".join(job.job_id for job in reversed(submitted))
            print(f"moolib-run: cancelled this launch's jobs: {ids}", flush=True)
        raise


def _submit(what: str, submit: Any, *args: Any) -> Any:
    """``submit(*args)``; when sbatch fails, the error says which submission it was."""
    try:
        return submit(*args)
    except submitit.core.utils.FailedJobError as e:
        raise RuntimeError(f"sbatch could not submit the {what}: {str(e).strip()}") from e


def _submit_all(
    cfg: RunConfig, config_path: Path, stop: threading.Event, submitted: list[submitit.Job]
) -> Launched:
    from moolib.agents.registry import runtime_of

    # The jobs are laid out as the runtime lays out the run's processes.
    runtime = runtime_of(cfg)
    groups = runtime.process_groups(cfg)
    savedir = Path(cfg.savedir).resolve()
    folder = savedir / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    s = _scaling(cfg)
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
        # The broker serves until every process that ends the run finished (a learner),
        # else until all did.
        finishers = sum(g.count for g in groups if g.ends_run) or sum(g.count for g in groups)
        broker_job = _submit(
            "broker job",
            executor.submit,
            BrokerJob(),
            str(savedir),
            token,
            finishers,
            s.broker_host,
        )
        submitted.append(broker_job)
        entry["broker"] = {"job_id": broker_job.job_id}
        record_jobs(savedir, entry)
        print(f"moolib-run: broker job {broker_job.job_id} submitted", flush=True)
        address = _wait_for_broker(broker_job, savedir, token, float(s.broker_timeout), key, stop)
        entry["broker"]["address"] = address

    broker_arg = cfg.broker or None
    per_job = s.peers_per_job
    said = f"moolib-run: broker at {address}" + (
        f" (job {broker_job.job_id})" if broker_job else ""
    )
    jobs: list[submitit.Job] = []
    for group in groups:
        submitted_now = _submit_group(cfg, folder, config_path, token, broker_arg, group, groups)
        submitted.extend(submitted_now)
        jobs.extend(submitted_now)
        if group.key is None:  # a process of its own: one job
            entry[group.role] = {"job_id": submitted_now[0].job_id}
            said += f"; {group.role} job {submitted_now[0].job_id}"
            record_jobs(savedir, entry)
        else:
            entry[group.key] = _array_entry(submitted_now, per_job, group.key)
            said += "; " + _describe_array(submitted_now, per_job, group.role)
    logs = runtime.training_logs.format(savedir=savedir)
    record_jobs(savedir, entry)
    _check_not_stuck(jobs, " or ".join(f"{g.role} job" for g in groups))
    print(
        f"{said}\n"
        f"moolib-run: savedir {savedir} (must be on a shared filesystem, mounted at this path "
        "on every node)\n"
        f"moolib-run: SLURM logs in {folder}/<job id>/*_log.out|err; training logs in {logs}\n"
        f"moolib-run: moolib-jobs {savedir}   # states;  moolib-jobs {savedir} --cancel   "
        "# stop them",
        flush=True,
    )
    return Launched(jobs, broker_job)


def _submit_group(
    cfg: RunConfig,
    folder: Path,
    config_path: Path,
    token: str,
    broker: str | None,
    group: ProcessGroup,
    groups: tuple[ProcessGroup, ...],
) -> list[submitit.Job]:
    """Submits the processes of ``group``: one of its own (``key`` None: a learner) as a
    job of one task, a counted group as one job array of ``scaling.peers_per_job``
    processes per job. A group that does not use the run's device gets no GPU. Jobs
    are named for the run, and for their role when the run has several groups."""
    s = _scaling(cfg)
    executor = _executor(cfg, folder)
    name = cfg.name if len(groups) == 1 else f"{cfg.name}-{group.role}"
    gpus = {} if group.uses_device else {"gpus_per_task": None}
    if group.key is None:
        executor.update_parameters(job_name=name, nodes=1, ntasks_per_node=1, **gpus)
        job = _submit(
            f"{group.role} job",
            executor.submit,
            PeerJob(),
            str(config_path),
            0,
            token,
            broker,
            group.first_rank,
        )
        return [job]
    executor.update_parameters(
        job_name=name, array_parallelism=int(s.array_parallelism or group.count), **gpus
    )
    n = group.count // s.peers_per_job
    return _submit(
        f"{group.key} job array ({n} jobs)",
        executor.map_array,
        PeerJob(),
        [str(config_path)] * n,
        list(range(n)),
        [token] * n,
        [broker] * n,
        [group.first_rank] * n,
    )


def _array_entry(jobs: list[submitit.Job], per_job: int, what: str) -> dict[str, Any]:
    """What jobs.json keeps of a job array (``moolib-jobs`` names its jobs' roles from it)."""
    return {
        "array_job_id": jobs[0].job_id.split("_")[0],
        "job_ids": [j.job_id for j in jobs],
        f"{what}_per_job": per_job,
    }


def _describe_array(jobs: list[submitit.Job], per_job: int, noun: str) -> str:
    """``2 actor jobs: array 12 (12_0, 12_1)``, as the launcher prints it."""
    array_id = jobs[0].job_id.split("_")[0]
    return (
        f"{len(jobs)} {noun} jobs"
        + (f" of {per_job} {noun}s (one per task)" if per_job > 1 else "")
        + f": array {array_id} ({', '.join(j.job_id for j in jobs)})"
    )


# How long follow() waits, once every job's results are in, for the accounting to show
# their end.
FINAL_STATE_WAIT = 30.0
# How often follow() asks the accounting for the jobs' states: submitit alone asks
# less and less often as a run goes on, down to every 10 minutes.
STATE_POLL = 30.0


def follow(launched: Launched, stop: threading.Event) -> int:
    """``scaling.wait=true``: waits for the training jobs (printing state changes),
    then for the broker job; ``stop`` (Ctrl-C) cancels them. Returns 0 when every
    training job completed."""
    jobs, broker_job = launched.peer_jobs, launched.broker_job
    states: dict[str, str] = {}
    last_asked = time.monotonic()

    def report_changes(ask: bool = False) -> None:
        nonlocal last_asked
        if ask or time.monotonic() - last_asked >= STATE_POLL:
            jobs[0].get_info(mode="force")  # one sacct call for every job it follows
            last_asked = time.monotonic()
        for j in jobs:
            state = j.state
            if states.get(j.job_id) != state and state != "UNKNOWN":
                states[j.job_id] = state
                print(f"moolib-run: job {j.job_id}: {state}", flush=True)

    while True:
        if stop.is_set():
            print("moolib-run: stopping: cancelling the jobs", flush=True)
            cancel_jobs([j.job_id for j in jobs], brokers=[broker_job.job_id] if broker_job else [])
            return 1
        report_changes()
        if all(j.done() for j in jobs):
            # done() sees a job's results before SLURM's accounting has its end (or any
            # state at all, for a job that ran between two polls): the final states are
            # asked for and waited for a little, so that each job's end is said. Without
            # accounting no job ever shows a state: no wait.
            deadline = time.monotonic() + FINAL_STATE_WAIT
            report_changes(ask=True)
            while states and any(states.get(j.job_id, "PENDING") in ACTIVE_STATES for j in jobs):
                if time.monotonic() > deadline:
                    break
                time.sleep(1)
                report_changes(ask=True)
            break
        time.sleep(2)
    failed = []
    for j in jobs:
        try:
            j.results()  # one per task
        except Exception as e:  # noqa: BLE001 - reported, not raised
            failed.append(j.job_id)
            print(f"moolib-run: job {j.job_id} failed: {e}", file=sys.stderr, flush=True)
    if broker_job is not None:
        deadline = time.monotonic() + 60
        while not broker_job.done() and time.monotonic() < deadline:
            time.sleep(2)
        if not broker_job.done():
            broker_job.cancel(check=False)
    return 1 if failed else 0
