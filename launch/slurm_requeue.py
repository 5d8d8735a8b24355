"""Requeues a SLURM job (peers or broker) whose tasks failed; run by the job's
batch script after ``srun`` returns:

    python -m moolib.launch.slurm_requeue <submitit folder> <exit status> <max failures>

submitit requeues a job that is preempted or timed out (USR2); a task that
fails (an exception, a crash, the OOM killer) ends its ``srun`` with a non-zero
status instead, and this requeues the job, at most ``max failures`` times per
job. Requeued peers rejoin their group like preempted ones. The failures are
counted in the job's folder (``<submitit folder>/<job id>/failures``, one line
each). A preempted job whose own requeue did not take (its batch script still
runs) is requeued here too, as no failure.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# Written into the job folder by the job's checkpoint(): submitit requeued this
# run of the job itself, so its non-zero exit status is no failure.
REQUEUED_MARKER = ".requeued-by-submitit-{restart}"


def restart_count() -> int:
    """How many times SLURM has requeued this job so far."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def job_id() -> str:
    """The job's id as submitit and jobs.json write it (``<array>_<index>`` in an array)."""
    array, index = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{index}" if array and index else os.environ["SLURM_JOB_ID"]


def after_srun(submitit_folder: Path, status: int, max_failures: int) -> int:
    """Requeues this job if its peers failed and failures are left; returns the
    batch script's exit status (0 when requeued or successful)."""
    if status == 0:
        return 0
    name = job_id()
    folder = submitit_folder / name
    if (folder / REQUEUED_MARKER.format(restart=restart_count())).exists():
        # submitit asked SLURM to requeue this job, and a requeue kills the batch
        # script with the job: a script still running here means the request did not
        # take (its `scontrol` can die of the same preemption's SIGTERM). Requeued
        # from here instead; a preemption is no failure.
        print(f"moolib: job {name} was preempted and is still running: requeued", flush=True)
        requeue(name)
        return 0
    failures = folder / "failures"
    failed = len(failures.read_text().splitlines()) if failures.exists() else 0
    if failed >= max_failures:
        print(
            f"moolib: job {name} failed (exit status {status}) after {failed} requeues "
            f"for failures (scaling.max_failures={max_failures}): not requeued",
            flush=True,
        )
        return status
    with failures.open("a") as f:
        f.write(f"{status}\n")
    print(
        f"moolib: job {name} failed (exit status {status}): requeued "
        f"({failed + 1} of scaling.max_failures={max_failures})",
        flush=True,
    )
    return 0 if requeue(name) else status


def requeue(name: str) -> bool:
    """``scontrol requeue`` of job ``name``; says why when SLURM refuses it."""
    out = subprocess.run(["scontrol", "requeue", name], capture_output=True, text=True)
    if out.returncode != 0:
        print(f"moolib: scontrol requeue {name} failed: {out.stderr.strip()}", flush=True)
    return out.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for the batch script."""
    folder, status, max_failures = argv if argv is not None else sys.argv[1:]
    return after_srun(Path(folder), int(status), int(max_failures))


if __name__ == "__main__":
    sys.exit(main())
