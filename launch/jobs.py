"""``moolib-jobs <savedir>``: the SLURM jobs of an experiment (or of a sweep's
points), their states, and cancelling them."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .slurm_files import JOBS_FILE, SLURM_DIR, read_json


def recorded_jobs(savedir: Path, everything: bool = False) -> list[tuple[str, str]]:
    """(job id, role) of the latest launch (every launch with ``everything``): the
    broker, the peers (``peer 0``, or ``peers 0-1`` for a job of two), or an
    off-policy run's ``learner`` and actors (``actor 0``, numbered as their logdirs).

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
        if entry.get("learner", {}).get("job_id"):  # an off-policy run's
            found.append((entry["learner"]["job_id"], "learner"))
        for key, noun in (("peers", "peer"), ("actors", "actor")):
            array = entry.get(key, {})
            per_job = array.get(f"{key}_per_job", 1)
            for index, job_id in enumerate(array.get("job_ids", [])):
                first = index * per_job
                role = f"{noun} {first}" if per_job == 1 else f"{key} {first}-{first + per_job - 1}"
                found.append((job_id, role))
    return found


def _natural(path: Path) -> tuple[int, str]:
    """Sweep points in order: 2 before 10."""
    return (int(path.name), "") if path.name.isdigit() else (1 << 62, path.name)


def job_states(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """State, elapsed time and node of each job, from sacct (squeue if accounting
    is off); a pending job's also the reason SLURM gives (``reason``, from squeue)."""
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
    # A pending array's tasks are one line in sacct and squeue ("12_[0-1]") unless
    # squeue is told to expand them (-r): without it they would read as unknown, and
    # moolib-jobs --cancel would leave them queued.
    queued = [j for j in job_ids if info.get(j, {}).get("state", "PENDING") == "PENDING"]
    if queued:
        out = subprocess.run(
            ["squeue", "-h", "-r", "-o", "%i|%T|%M|%N|%r", "-j", ",".join(queued)],
            capture_output=True,
            text=True,
        )
        for line in out.stdout.splitlines():
            job_id, state, elapsed, nodes, reason = line.split("|")
            info[job_id] = {"state": state, "elapsed": elapsed, "node": nodes}
            if state == "PENDING" and reason not in ("", "None"):
                info[job_id]["reason"] = reason
    return info


def failure_counts(folder: Path) -> dict[str, int]:
    """Job id -> how many times its batch script requeued it because its tasks
    failed (slurm_requeue's count; preemptions are not counted), for a savedir
    or a sweep's folder."""
    folder = Path(folder)
    counts: dict[str, int] = {}
    for path in [
        *folder.glob(f"{SLURM_DIR}/*/failures"),
        *folder.glob(f"*/{SLURM_DIR}/*/failures"),
    ]:
        counts[path.parent.name] = len(path.read_text().splitlines())
    return counts


ACTIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "SUSPENDED"}

# Reasons SLURM gives for a pending job that waiting does not change: the request is
# more than its partition allows, or names what the cluster does not have.
_STUCK_REASONS = frozenset(
    {
        "PartitionConfig",
        "PartitionNodeLimit",
        "PartitionTimeLimit",
        "BadConstraints",
        "InvalidAccount",
        "InvalidQOS",
    }
)


def is_stuck(reason: str | None) -> bool:
    """Whether a pending job with this reason can never start as it was submitted
    (a per-job QOS limit, ``QOSMaxCpuPerJobLimit`` say, counts too)."""
    if not reason:
        return False
    return reason in _STUCK_REASONS or (
        reason.startswith("QOSMax") and reason.endswith("PerJobLimit")
    )


def raise_if_stuck(what: str, job_id: str, reason: str | None) -> None:
    """Raises RuntimeError, naming the job and the reason, if SLURM holds the job
    pending for a reason that never passes (``is_stuck``)."""
    if is_stuck(reason):
        raise RuntimeError(
            f"the {what} {job_id} cannot start: SLURM holds it pending for {reason}, which "
            "waiting does not change (it asks for more than the partition or QOS allows, or "
            "for what the cluster lacks: check scaling.partition, scaling.time, "
            "scaling.nodes, the CPUs, GPUs and memory asked for, and scaling.constraint)"
        )


def cancel_jobs(job_ids: Sequence[str], grace: float = 60.0, brokers: Sequence[str] = ()) -> None:
    """Stops the jobs: SIGINT first (peers stop after their step, the leader
    writing a checkpoint), then ``scancel`` whatever is still there after ``grace``.

    ``brokers`` (among ``job_ids`` or not) get their SIGINT only once the other jobs
    have ended (or ``grace`` has passed): a leader whose group changes as the others
    stop can only find itself connected again, and write its last checkpoint,
    through a broker that is still there."""
    brokers = list(brokers)
    everything = [j for j in job_ids if j not in brokers] + brokers
    if not everything:
        return
    # A job still pending has nothing to stop: it goes at once. (scancel --signal on
    # one retries for a minute and a half, "Job can not be altered now".)
    states = job_states(everything)
    pending = [j for j in everything if states.get(j, {}).get("state") == "PENDING"]
    if pending:
        subprocess.run(["scancel", *pending], capture_output=True)
    brokers = [j for j in brokers if j not in pending]
    peers = [j for j in job_ids if j not in brokers and j not in pending]
    deadline = time.monotonic() + grace
    for batch in (peers, brokers):
        if not batch:
            continue
        subprocess.run(["scancel", "--signal=INT", *batch], capture_output=True)
        while time.monotonic() < deadline:
            states = job_states(batch)
            if not any(v["state"] in ACTIVE_STATES - {"PENDING"} for v in states.values()):
                break
            time.sleep(1)
    subprocess.run(["scancel", *everything], capture_output=True)


def main(argv: list[str] | None = None) -> int:
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
    if not args.savedir.is_dir():
        print(f"moolib-jobs: error: {args.savedir}: no such directory", file=sys.stderr)
        return 2
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
        brokers = [j for j, role in found if role.split(": ")[-1] == "broker"]
        cancel_jobs(active, args.grace, brokers=[j for j in brokers if j in active])
        print(f"moolib-jobs: cancelled {len(active)} jobs: {' '.join(active) or '-'}")
        states = job_states([j for j, _ in found])
    failures = failure_counts(args.savedir)
    width = max(10, *(len(role) for _, role in found))
    print(
        f"{'job':<16} {'role':<{width}} {'state':<12} {'elapsed':>10} {'fail-requeues':>13}  node"
    )
    for job_id, role in found:
        st = states.get(job_id, {"state": "UNKNOWN", "elapsed": "", "node": ""})
        # A pending job has no node yet: why it waits is shown there (PartitionConfig, say,
        # is a request the partition can never run).
        where = st["node"]
        if not where and "reason" in st:
            never = "; it cannot start as submitted" if is_stuck(st["reason"]) else ""
            where = f"(waits: {st['reason']}{never})"
        print(
            f"{job_id:<16} {role:<{width}} {st['state']:<12} {st['elapsed']:>10} "
            f"{failures.get(job_id, 0):>13}  {where}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
