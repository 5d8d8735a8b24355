"""What the SLURM tests (tests/test_slurm_*.py) share: the test cluster, the runs'
settings, the fixtures (``savedirs``, and ``slurm_conf``, which every test of a file
that imports it uses) and the waits on jobs and their logs.

Start the cluster with ``scripts/slurm-test-cluster.sh start`` (Debian packages: slurm,
slurmdbd + MariaDB, munge; ~1 min the first time, then ~2 s), then
``export SLURM_CONF=/tmp/moolib-slurm-ci/etc/slurm.conf`` (the tests also find it
there by themselves). Without a cluster these tests are skipped.

Every run is a real ``moolib-run`` with its savedir under tmp_path; every job a test
submits is cancelled at its end, whatever happened. The tests are in four files, by
subject, so that the suite's workers run them side by side."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers.run_util import read_logs, run, wait_for

submitit = pytest.importorskip("submitit")
from moolib.launch import jobs as jobs_lib  # noqa: E402 - needs submitit

REPO = Path(__file__).resolve().parents[1]


DEFAULT_CONF = Path(os.environ.get("MOOLIB_SLURM_BASE", "/tmp/moolib-slurm-ci")) / "etc/slurm.conf"


HOW_TO_START = (
    "no SLURM cluster: start the test cluster with `scripts/slurm-test-cluster.sh start` "
    f"(then export SLURM_CONF={DEFAULT_CONF})"
)


def _slurm_env() -> dict[str, str] | None:
    """The environment that reaches the test cluster, or None when there is none."""
    if not shutil.which("sinfo"):
        return None
    env = dict(os.environ)
    if "SLURM_CONF" not in env and DEFAULT_CONF.exists():
        env["SLURM_CONF"] = str(DEFAULT_CONF)
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    usable = {"idle", "mixed", "allocated"}
    if out.returncode != 0 or not usable & set(out.stdout.split()):
        return None
    return env


SLURM_ENV = _slurm_env()


needs_slurm = pytest.mark.skipif(SLURM_ENV is None, reason=HOW_TO_START)


# A2C on CartPole, one CPU per peer, one env process per peer.
SMALL = [
    "agent=a2c",
    "env=cartpole",
    "device=cpu",
    "scaling=slurm",
    "scaling.peers=2",
    "scaling.cpus_per_task=1",
    "scaling.time=30",
    "agent.num_actor_cpus=1",
    "log_interval=1",
    "checkpoint_interval=5",
]


FOREVER = "total_steps=1000000000"


# Enough steps that two peers starting a few seconds apart (joining a group
# takes a moment on a loaded machine) still train some of them together.
TOGETHER = 150_000


@pytest.fixture(autouse=True, name="slurm_conf")
def slurm_conf_fixture(monkeypatch):
    """SLURM_CONF for this process (submitit's sacct/squeue calls) and moolib-run."""
    if SLURM_ENV is not None and "SLURM_CONF" in SLURM_ENV:
        monkeypatch.setenv("SLURM_CONF", SLURM_ENV["SLURM_CONF"])


def jobs_report(savedir: Path, tail: int = 40) -> str:
    """The SLURM state of a run's jobs and the end of each job's logs: what a failed
    wait needs to be understood (a job pending, requeued, or its process stuck)."""
    found = jobs_lib.recorded_jobs(savedir, everything=True)
    info = jobs_lib.job_states([j for j, _ in found])
    lines = [f"{role} {job}: {info.get(job, {})}" for job, role in found]
    for path in sorted((savedir / "slurm").glob("*/*_log.*")):
        end = path.read_text(errors="replace").splitlines()[-tail:]
        lines += [f"--- {path.relative_to(savedir)} (last {len(end)} lines)", *end]
    return "\n".join(lines)


@pytest.fixture(name="savedirs")
def savedirs_fixture(request):
    """Savedirs whose recorded jobs are all cancelled at the end of the test; a failed
    test's report shows their jobs' states and logs."""
    dirs: list[Path] = []
    explain = request.node.__dict__.setdefault("explain_failure", [])
    explain.append(("SLURM jobs", lambda: "\n".join(jobs_report(d) for d in dirs)))
    yield dirs
    ids = [j for d in dirs for j, _ in jobs_lib.recorded_jobs(d, everything=True)]
    if ids:
        subprocess.run(["scancel", *ids], capture_output=True)


def moolib_jobs(*args: str) -> str:
    """``moolib-jobs ARGS``."""
    out = subprocess.run(
        [sys.executable, "-m", "moolib.launch.jobs", *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def states(savedir: Path) -> dict[str, str]:
    """role -> state of the latest launch's jobs."""
    found = jobs_lib.recorded_jobs(savedir)
    info = jobs_lib.job_states([j for j, _ in found])
    return {role: info.get(j, {}).get("state", "UNKNOWN") for j, role in found}


def peer_rows(savedir: Path, rank: int) -> list[dict[str, float]]:
    path = savedir / f"peer{rank}" / "logs.tsv"
    return read_logs(path)[1] if path.exists() else []


def both_training(savedir: Path) -> bool:
    """Both peers logged a row in a group of two."""
    return all(any(r["peers"] == 2 for r in peer_rows(savedir, k)) for k in (0, 1))


def job_log(savedir: Path, job_id: str, which: str = "*") -> str:
    """The job's SLURM logs (``which``: out or err, each in the order written)."""
    return "".join(
        p.read_text(errors="replace")
        for p in sorted((savedir / "slurm" / job_id).glob(f"*_log.{which}"))
    )


def all_ended(savedir: Path) -> bool:
    return all(s not in jobs_lib.ACTIVE_STATES for s in states(savedir).values())


def train_forever(tmp_path: Path, savedirs: list[Path], *extra: str) -> tuple[Path, str]:
    """Launches a run that trains until cancelled and waits until both peers
    train together; returns its savedir and moolib-run's output."""
    savedir = tmp_path / "run"
    savedirs.append(savedir)
    result = run([*SMALL, FOREVER, *extra, f"savedir={savedir}"], tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout[-5000:]
    wait_for(lambda: both_training(savedir), 180, "both peers to train together")
    return savedir, result.stdout


def wait_training_together_again(savedir: Path, what: str) -> None:
    """Waits until both peers log rows in a group of two again, after their current rows."""
    counts = [len(peer_rows(savedir, k)) for k in (0, 1)]
    wait_for(
        lambda: all(
            any(r["peers"] == 2 for r in peer_rows(savedir, k)[counts[k] + 2 :]) for k in (0, 1)
        ),
        180,
        what,
    )


def cancel_all(savedir: Path) -> None:
    """``moolib-jobs --cancel``, then every job has ended."""
    moolib_jobs(str(savedir), "--cancel", "--grace", "30")
    wait_for(lambda: all_ended(savedir), 60, "every job to end")


def run_to_the_end(
    tmp_path: Path, savedirs: list[Path], name: str, *args: str, timeout: float = 300
) -> tuple[Path, str]:
    """``moolib-run ARGS scaling.wait=true`` into ``tmp_path/name``, which must succeed;
    returns the savedir and moolib-run's output."""
    savedir = tmp_path / name
    savedirs.append(savedir)
    result = run([*args, "scaling.wait=true", f"savedir={savedir}"], tmp_path, timeout=timeout)
    assert result.returncode == 0, result.stdout[-5000:]
    return savedir, result.stdout


def job_pid(savedir: Path, job_id: str) -> int | None:
    """The pid of the process submitit runs the job in (a peer's: the trainer)."""
    if "_" in job_id:
        array, index = job_id.split("_")
        want = {f"SLURM_ARRAY_JOB_ID={array}", f"SLURM_ARRAY_TASK_ID={index}"}
    else:
        want = {f"SLURM_JOB_ID={job_id}"}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = set((entry / "environ").read_bytes().decode(errors="replace").split("\0"))
        except (OSError, ValueError):
            continue
        args = [a.decode(errors="replace") for a in cmdline]
        # srun's command line (two processes: srun forks) names the same module:
        # only the interpreter that runs it is the job's process.
        runs_it = Path(args[0]).name.startswith("python")
        if runs_it and "submitit.core._submit" in args and str(savedir) in " ".join(args):
            if want <= environ:
                return int(entry.name)
    return None


def sweep_of_two(tmp_path: Path, savedirs: list[Path], *args: str) -> tuple[Path, list[Path]]:
    """Runs ``moolib-run -m ARGS`` over two learning rates, which returns once the
    jobs are submitted; returns the sweep's folder and its points' savedirs, each
    point checked to be its own experiment (group) with its own value."""
    sweep = tmp_path / "sweep"
    started = time.monotonic()
    rates = "agent.optimizer.learning_rate=2e-3,1e-3"
    result = run(["-m", *args, f"hydra.sweep.dir={sweep}", rates], tmp_path, timeout=240)
    points = [sweep / "0", sweep / "1"]
    savedirs.extend(points)
    assert result.returncode == 0, result.stdout[-5000:]
    assert time.monotonic() - started < 240
    configs = [yaml.safe_load((p / "config.yaml").read_text()) for p in points]
    assert configs[0]["group"] != configs[1]["group"]
    assert [c["agent"]["optimizer"]["learning_rate"] for c in configs] == [2e-3, 1e-3]
    return sweep, points


# Ape-X on CartPole (its CartPole tuning: a rate-limited replay, so the learner
# learns each transition a set number of times however loaded the machine is).
APEX = [
    "agent=apex",
    "env=cartpole",
    "device=cpu",
    "scaling=slurm",
    "scaling.actors=2",
    "scaling.cpus_per_task=1",
    "scaling.time=30",
    "agent.num_actor_cpus=1",
    "log_interval=1",
    "checkpoint_interval=5",
    # An actor waits this long for a learner that is gone (requeued) before failing.
    "lost_group_timeout=240",
]


def learner_rows(savedir: Path) -> list[dict[str, float]]:
    path = savedir / "logs.tsv"
    return read_logs(path)[1] if path.exists() else []


def learner_updates(savedir: Path) -> float:
    rows = learner_rows(savedir)
    return rows[-1]["updates"] if rows else 0.0


def role_ids(savedir: Path) -> dict[str, str]:
    """role -> job id of the latest launch."""
    return {role: job_id for job_id, role in jobs_lib.recorded_jobs(savedir)}


def learn_forever(tmp_path: Path, savedirs: list[Path], *extra: str) -> Path:
    """Launches an Ape-X run that trains until cancelled and waits until the learner
    updates on transitions of both actor jobs."""
    savedir = tmp_path / "apex"
    savedirs.append(savedir)
    result = run([*APEX, FOREVER, *extra, f"savedir={savedir}"], tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout[-5000:]
    assert "learner job" in result.stdout and "2 actor jobs: array" in result.stdout, result.stdout
    wait_for(
        lambda: any(r["actors"] == 2 and r["updates"] > 0 for r in learner_rows(savedir)),
        300,
        "the learner to update on both actors' transitions",
    )
    return savedir


def updates_go_on(savedir: Path, what: str, more: int = 50) -> None:
    """Waits until the learner has made ``more`` updates after its current ones."""
    now = learner_updates(savedir)
    wait_for(lambda: learner_updates(savedir) >= now + more, 240, what)


# More CPUs than a node of the test cluster has: SLURM holds such a job pending for
# PartitionConfig, for ever.
TOO_MANY_CPUS = "64"
