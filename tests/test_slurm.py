"""``scaling=slurm`` against a real SLURM (a single-node test cluster).

Start one with ``scripts/slurm-test-cluster.sh start`` (Debian packages: slurm,
slurmdbd + MariaDB, munge; ~1 min the first time, then ~2 s), then
``export SLURM_CONF=/tmp/moolib-slurm-ci/etc/slurm.conf`` (the tests also find
it there by themselves). Without a cluster these tests are skipped.

Every run is a real ``moolib-run`` with its savedir under tmp_path; every job a
test submits is cancelled at its end, whatever happened.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers.run_util import Run, cfg_job, read_logs, run, run_quick, wait_for

submitit = pytest.importorskip("submitit")
from moolib.launch import jobs as jobs_lib  # noqa: E402 - needs submitit
from moolib.launch import slurm as slurm_lib  # noqa: E402
from moolib.launch import slurm_files, slurm_requeue  # noqa: E402

# Each test waits on SLURM jobs (half a minute to minutes): -m "not slow" leaves the
# file out of a quick run.
pytestmark = pytest.mark.slow

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


_ENV = _slurm_env()
needs_slurm = pytest.mark.skipif(_ENV is None, reason=HOW_TO_START)

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


@pytest.fixture(autouse=True)
def slurm_conf(monkeypatch):
    """SLURM_CONF for this process (submitit's sacct/squeue calls) and moolib-run."""
    if _ENV is not None and "SLURM_CONF" in _ENV:
        monkeypatch.setenv("SLURM_CONF", _ENV["SLURM_CONF"])


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


@pytest.fixture
def savedirs(request):
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


@needs_slurm
def test_two_peers_train_and_log(tmp_path, savedirs):
    savedir, out = run_to_the_end(tmp_path, savedirs, "run", *SMALL, f"total_steps={TOGETHER}")
    assert "broker job" in out and "peer jobs: array" in out, out
    assert "shared" in out  # the savedir must be on a shared filesystem: said
    broker = yaml.safe_load((savedir / "broker.json").read_text())
    assert broker["address"].rsplit(":", 1)[1].isdigit()
    last = {}
    for k in (0, 1):
        rows = peer_rows(savedir, k)
        assert rows, f"peer {k} wrote no logs"
        assert any(r["peers"] == 2 for r in rows), rows
        last[k] = rows[-1]
        assert last[k]["step"] >= TOGETHER
    # One model: the same parameters at the same version on both peers.
    assert last[0]["model_version"] == last[1]["model_version"]
    assert last[0]["param_sum"] == last[1]["param_sum"]
    assert (savedir / "checkpoint.pt").exists()
    # The broker ends by itself once both peers finished.
    wait_for(lambda: all_ended(savedir), 60, "the broker job to end")
    assert set(states(savedir).values()) == {"COMPLETED"}, states(savedir)
    table = moolib_jobs(str(savedir))
    assert table.count("COMPLETED") == 3, table
    # The launcher said each peer job's end, though both may end between two of its polls.
    for job, role in jobs_lib.recorded_jobs(savedir):
        if role.startswith("peer"):
            assert f"moolib-run: job {job}: COMPLETED" in out, out[-3000:]


@needs_slurm
def test_cancelled_peer_leaves_the_other_training_then_cancel_all_and_resume(tmp_path, savedirs):
    savedir, _ = train_forever(tmp_path, savedirs)
    # The jobs listen on every interface: only holders of the launch's key get in.
    launch = slurm_files.read_json(savedir / "jobs.json")[-1]["launch"]
    key_file = savedir / "slurm" / "auth" / launch
    assert key_file.stat().st_mode & 0o077 == 0
    address = slurm_files.read_broker_file(savedir, launch)
    slurm_lib.check_broker(address, 60.0, key_file.read_text())
    for wrong in ("not-the-key", None):  # None: this process's key, here none
        with pytest.raises(TimeoutError):
            slurm_lib.check_broker(address, 3.0, wrong)
    for job_id, _ in jobs_lib.recorded_jobs(savedir):
        assert "without an authentication key" not in job_log(savedir, job_id)
    peer1 = jobs_lib.recorded_jobs(savedir)[2][0]
    subprocess.run(["scancel", peer1], check=True)
    # submitit sees the cancelled job end (through sacct: slurmdbd is needed).
    job = submitit.SlurmJob(folder=savedir / "slurm" / "%j", job_id=peer1)
    wait_for(job.done, 90, "submitit to see the cancelled peer job end")
    assert states(savedir)["peer 1"] == "CANCELLED"
    # Peer 0 drops peer 1 from its group and keeps training alone.
    wait_for(lambda: any(r["peers"] == 1 for r in peer_rows(savedir, 0)[-3:]), 90, "peer 0 alone")
    step = peer_rows(savedir, 0)[-1]["step"]
    wait_for(lambda: peer_rows(savedir, 0)[-1]["step"] > step, 60, "peer 0 to keep training")
    assert states(savedir)["peer 0"] == "RUNNING"

    # The same command again while the jobs run is refused, naming them: a second
    # set of jobs would train in the same folder.
    again = run_quick(tmp_path, *SMALL, FOREVER, f"savedir={savedir}")
    assert again.returncode == 2, again.stdout + again.stderr
    assert "is in use: the SLURM jobs of its last launch are still active" in again.stderr
    peer0 = jobs_lib.recorded_jobs(savedir)[1][0]
    assert f"{peer0} (peer 0, RUNNING)" in again.stderr, again.stderr
    assert len(slurm_files.read_json(savedir / "jobs.json")) == 1

    # Cancel everything: peer 0, the leader, writes a last checkpoint (SIGINT first).
    table = moolib_jobs(str(savedir), "--cancel", "--grace", "60")
    assert "cancelled 2 jobs" in table, table
    wait_for(lambda: all_ended(savedir), 60, "every job to end")
    assert "checkpoint at step" in job_log(savedir, jobs_lib.recorded_jobs(savedir)[1][0])
    stopped_at = peer_rows(savedir, 0)[-1]["step"]

    # The same command again resumes from the leader's checkpoint.
    goal = int(stopped_at) + 20000
    result = run(
        [*SMALL, f"total_steps={goal}", "scaling.wait=true", f"savedir={savedir}"],
        tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-5000:]
    found = jobs_lib.recorded_jobs(savedir)
    assert len(slurm_files.read_json(savedir / "jobs.json")) == 2
    for job_id, role in found[1:]:
        assert "resumed from" in job_log(savedir, job_id), role
    assert peer_rows(savedir, 0)[-1]["step"] >= goal


@needs_slurm
def test_wait_follows_the_jobs_and_ctrl_c_stops_them(tmp_path, savedirs):
    savedir = tmp_path / "run"
    savedirs.append(savedir)
    r = Run([*SMALL, FOREVER, "scaling.wait=true", f"savedir={savedir}"], tmp_path, tmp_path / "o")
    try:
        wait_for(lambda: both_training(savedir), 180, "both peers to train together", proc=r)
        # It follows the jobs, printing their state changes.
        wait_for(lambda: "RUNNING" in r.output(), 120, "a job state to be printed", proc=r)
        r.interrupt()
        assert r.wait(150) == 130, r.output()[-3000:]
        out = r.output()
    finally:
        r.finish()
    assert "cancelling the jobs" in out
    wait_for(lambda: all_ended(savedir), 60, "every job to end")
    # SIGINT first: the leader (either peer) stopped after its step and wrote a
    # last checkpoint, at the step of its last log row.
    final = []
    for k, (job_id, _) in enumerate(jobs_lib.recorded_jobs(savedir)[1:]):
        saved = re.findall(r"checkpoint at step (\d+)", job_log(savedir, job_id))
        if saved:
            final.append(int(saved[-1]) == peer_rows(savedir, k)[-1]["step"])
    assert True in final, final


@needs_slurm
def test_ctrl_c_while_the_broker_job_is_pending_cancels_it(tmp_path, savedirs):
    savedir = tmp_path / "run"
    savedirs.append(savedir)
    # A broker job that cannot start for an hour.
    args = [*SMALL, "+scaling.additional_parameters.begin=now+3600", f"savedir={savedir}"]
    r = Run(args, tmp_path, tmp_path / "o")
    try:
        wait_for(lambda: "PENDING" in r.output(), 120, "the broker job to be pending", proc=r)
        r.interrupt()
        assert r.wait(60) == 130, r.output()[-3000:]
        out = r.output()
    finally:
        r.finish()
    assert "interrupted while waiting for the broker job" in out
    assert "cancelled" in out
    assert [role for _, role in jobs_lib.recorded_jobs(savedir)] == ["broker"]
    wait_for(lambda: states(savedir) == {"broker": "CANCELLED"}, 60, "the broker job cancelled")


@needs_slurm
def test_interrupted_peer_is_requeued_and_rejoins(tmp_path, savedirs):
    savedir, _ = train_forever(tmp_path, savedirs)
    peer1 = jobs_lib.recorded_jobs(savedir)[2][0]
    job = submitit.SlurmJob(folder=savedir / "slurm" / "%j", job_id=peer1)
    before = len(peer_rows(savedir, 1))

    def count(text: str) -> int:
        return job_log(savedir, peer1).count(text)

    job._interrupt()  # preemption: SIGTERM, then USR2 (checkpoint + requeue)
    wait_for(lambda: count("broker at") >= 2, 180, "the interrupted peer to start again")
    assert count("requeued") == 1
    # Interrupted again as it starts (USR2 alone: a time-out), about when its
    # Trainer starts the env workers: the signal waits for them; requeued again.
    job._interrupt(timeout=True)
    wait_for(lambda: count("broker at") >= 3, 180, "the peer to be requeued a second time")
    assert count("requeued") == 2
    # It rejoins the group, with the group's state (not from step 0).
    step_at_interrupt = peer_rows(savedir, 0)[-1]["step"]
    wait_for(
        lambda: any(
            r["peers"] == 2 and r["step"] >= step_at_interrupt
            for r in peer_rows(savedir, 1)[before:]
        ),
        180,
        "the requeued peer to train in the group again",
    )
    assert states(savedir) == {"broker": "RUNNING", "peer 0": "RUNNING", "peer 1": "RUNNING"}
    cancel_all(savedir)


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


@needs_slurm
def test_failed_peer_is_requeued_until_max_failures(tmp_path, savedirs):
    savedir, _ = train_forever(tmp_path, savedirs, "scaling.max_failures=1")
    peer1 = jobs_lib.recorded_jobs(savedir)[2][0]

    def crash() -> None:  # as the OOM killer would
        pid = wait_for(lambda: job_pid(savedir, peer1), 60, "the training process")
        os.kill(pid, signal.SIGKILL)

    crash()
    wait_for(
        lambda: (
            "failed (exit status" in job_log(savedir, peer1)
            and job_log(savedir, peer1).count("broker at") >= 2
        ),
        180,
        "the failed peer job to be requeued and start again",
    )
    assert "requeued (1 of scaling.max_failures=1)" in job_log(savedir, peer1)
    before = len(peer_rows(savedir, 1))
    wait_for(
        lambda: any(r["peers"] == 2 for r in peer_rows(savedir, 1)[before:]),
        300,
        "the requeued peer to train in the group again",
    )
    # Its failures are used up: the next one ends the job; peer 0 trains on alone.
    crash()
    wait_for(lambda: states(savedir)["peer 1"] == "FAILED", 120, "the peer job to fail")
    assert "not requeued" in job_log(savedir, peer1)
    row = next(line.split() for line in moolib_jobs(str(savedir)).splitlines() if peer1 in line)
    assert row[3] == "FAILED" and row[5] == "1", row  # job peer 1 state elapsed fail-requeues
    wait_for(lambda: any(r["peers"] == 1 for r in peer_rows(savedir, 0)[-3:]), 90, "peer 0 alone")
    assert states(savedir)["peer 0"] == "RUNNING"
    cancel_all(savedir)


@needs_slurm
def test_failed_broker_is_requeued_and_the_peers_train_on(tmp_path, savedirs):
    savedir, _ = train_forever(tmp_path, savedirs)
    broker_id = jobs_lib.recorded_jobs(savedir)[0][0]
    pid = wait_for(lambda: job_pid(savedir, broker_id), 60, "the broker process")
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: job_log(savedir, broker_id).count("Broker listening") >= 2,
        300,
        "the failed broker job to be requeued and listen again",
    )
    assert "failed (exit status" in job_log(savedir, broker_id)
    wait_training_together_again(savedir, "both peers to train together again")
    cancel_all(savedir)


@needs_slurm
def test_interrupted_broker_is_requeued_and_the_peers_train_on(tmp_path, savedirs):
    savedir, _ = train_forever(tmp_path, savedirs)
    broker_id = jobs_lib.recorded_jobs(savedir)[0][0]
    port = yaml.safe_load((savedir / "broker.json").read_text())["port"]
    job = submitit.SlurmJob(folder=savedir / "slurm" / "%j", job_id=broker_id)
    job._interrupt()
    wait_for(
        lambda: job_log(savedir, broker_id).count("Starting with JobEnvironment") >= 2,
        300,
        "the broker job to be requeued and start again",
    )
    # Back on the same node, on the same port.
    wait_for(lambda: job_log(savedir, broker_id).count("Broker listening") >= 2, 60, "the broker")
    assert yaml.safe_load((savedir / "broker.json").read_text())["port"] == port
    wait_training_together_again(savedir, "both peers to train together again")

    # Interrupted again, and its port taken meanwhile (as if requeued on
    # another node): it listens elsewhere, and the peers follow broker.json.
    job._interrupt()
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

        def take_port() -> bool:
            try:
                squatter.bind(("0.0.0.0", port))
            except OSError:
                return False
            squatter.listen()
            return True

        wait_for(take_port, 120, "the interrupted broker to free its port", interval=0.05)
        wait_for(lambda: job_log(savedir, broker_id).count("Broker listening") >= 3, 180, "broker")
    new = yaml.safe_load((savedir / "broker.json").read_text())
    assert new["port"] != port
    moved = f"the broker moved to {new['address']}"
    for job_id, role in jobs_lib.recorded_jobs(savedir)[1:]:
        wait_for(lambda j=job_id: moved in job_log(savedir, j), 60, f"{role} to follow the broker")
    wait_training_together_again(savedir, "both peers to train together through the moved broker")
    cancel_all(savedir)


@needs_slurm
def test_one_job_runs_two_peers_one_per_task(tmp_path, savedirs):
    # Two tasks of one job, each its own peer (rank from the task), in one group.
    savedir, out = train_forever(tmp_path, savedirs, "scaling.tasks_per_node=2")
    assert "1 peer jobs of 2 peers (one per task)" in out, out
    assert [role for _, role in jobs_lib.recorded_jobs(savedir)] == ["broker", "peers 0-1"]
    peer_job = jobs_lib.recorded_jobs(savedir)[1][0]
    assert len(list((savedir / "slurm" / peer_job).glob("*_log.out"))) == 2
    table = moolib_jobs(str(savedir))
    assert "peers 0-1" in table and "RUNNING" in table, table
    cancel_all(savedir)


@needs_slurm
def test_one_job_spans_two_nodes_one_peer_per_node(tmp_path, savedirs):
    # The test cluster's partition "two" has a second node (a second slurmd on
    # this machine): srun starts one task on each, and the ranks come from them.
    savedir, out = train_forever(tmp_path, savedirs, "scaling.nodes=2", "scaling.partition=two")
    assert "1 peer jobs of 2 peers (one per task)" in out, out
    peer_job = jobs_lib.recorded_jobs(savedir)[1][0]
    assert jobs_lib.job_states([peer_job])[peer_job]["node"] == "node[1-2]"
    logs = sorted(p.read_text() for p in (savedir / "slurm" / peer_job).glob("*_log.out"))
    assert len(logs) == 2
    assert any("node=0(2)" in log and "peer 0:" in log for log in logs), logs
    assert any("node=1(2)" in log and "peer 1:" in log for log in logs), logs
    cancel_all(savedir)


@needs_slurm
def test_an_existing_broker_is_used_instead_of_a_broker_job(tmp_path, savedirs):
    from moolib.launch.local import EmbeddedBroker

    savedir = tmp_path / "run"
    savedirs.append(savedir)
    broker = EmbeddedBroker("127.0.0.1:0")  # the jobs run on this host
    try:
        result = run(
            [
                *SMALL,
                f"total_steps={TOGETHER}",
                "scaling.wait=true",
                f"broker={broker.address}",
                f"savedir={savedir}",
            ],
            tmp_path,
            timeout=300,
        )
    finally:
        broker.close()
    assert result.returncode == 0, result.stdout[-5000:]
    assert "broker job" not in result.stdout
    assert [role for _, role in jobs_lib.recorded_jobs(savedir)] == ["peer 0", "peer 1"]
    assert not (savedir / "broker.json").exists()
    for k in (0, 1):
        assert any(r["peers"] == 2 for r in peer_rows(savedir, k))


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


@needs_slurm
def test_sweep_gives_each_point_its_own_group_and_returns(tmp_path, savedirs):
    sweep, points = sweep_of_two(tmp_path, savedirs, *SMALL, "total_steps=20000")
    for p in points:
        wait_for(lambda p=p: all_ended(p), 240, f"the jobs of {p.name} to end")
        assert set(states(p).values()) == {"COMPLETED"}, states(p)
        for k in (0, 1):
            assert peer_rows(p, k)[-1]["step"] >= 20000
    # The sweep's folder shows every point's jobs.
    table = moolib_jobs(str(sweep))
    assert table.count("COMPLETED") == 6 and "0: broker" in table and "1: peer 1" in table, table


# -- off-policy: a learner job and actor jobs ---------------------------------------------

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


@needs_slurm
def test_a_refused_actor_array_cancels_the_jobs_already_submitted(tmp_path, savedirs):
    savedir = tmp_path / "refused"
    savedirs.append(savedir)
    # More array tasks than the cluster's MaxArraySize (1001 by default): sbatch
    # refuses the actors' array after the broker and the learner job were submitted.
    result = run([*APEX, "scaling.actors=2000", f"savedir={savedir}"], tmp_path, timeout=180)
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert "moolib-run: error: sbatch could not submit the actors job array (2000 jobs)" in out
    assert [role for _, role in jobs_lib.recorded_jobs(savedir)] == ["broker", "learner"]
    ids = role_ids(savedir)
    assert f"cancelled this launch's jobs: {ids['learner']}, {ids['broker']}" in out, out
    # Nothing is left waiting for actors that will never come.
    wait_for(
        lambda: set(states(savedir).values()) == {"CANCELLED"},
        60,
        "the broker and learner jobs cancelled",
    )


# More CPUs than a node of the test cluster has: SLURM holds such a job pending for
# PartitionConfig, for ever.
TOO_MANY_CPUS = "64"


@needs_slurm
@pytest.mark.parametrize(
    "asks, what",
    [
        (f"scaling.cpus_per_task={TOO_MANY_CPUS}", "peer job"),
        (f"scaling.broker_cpus={TOO_MANY_CPUS}", "broker job"),
    ],
)
def test_a_job_slurm_can_never_start_stops_the_launch(tmp_path, savedirs, asks, what):
    savedir = tmp_path / "stuck"
    savedirs.append(savedir)
    result = run([*SMALL, asks, f"savedir={savedir}"], tmp_path, timeout=180)
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert re.search(
        rf"moolib-run: error: the {what} [0-9_]+ cannot start: SLURM holds it pending for "
        "PartitionConfig, which waiting does not change",
        out,
    ), out[-3000:]
    assert "moolib-run: cancelled this launch's jobs: " in out
    ids = [job for job, _ in jobs_lib.recorded_jobs(savedir)]
    wait_for(
        lambda: (
            not any(v["state"] in jobs_lib.ACTIVE_STATES for v in jobs_lib.job_states(ids).values())
        ),
        60,
        "the launch's jobs to leave the queue",
    )


@needs_slurm
def test_pending_array_tasks_are_seen_and_cancelled():
    """A pending array is one line in squeue and sacct (``12_[0-1]``) unless expanded:
    its tasks once read as unknown, and moolib-jobs --cancel left them queued."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--array=0-1", "-c", TOO_MANY_CPUS, "--wrap", "sleep 60"],
        env=_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.strip().split(";")[0]
    tasks = [f"{array}_0", f"{array}_1"]
    try:
        wait_for(
            lambda: all(
                jobs_lib.job_states(tasks).get(t, {}).get("reason") == "PartitionConfig"
                for t in tasks
            ),
            60,
            "SLURM to give the tasks' pending reason",
        )
        info = jobs_lib.job_states(tasks)
        assert all(info[t]["state"] == "PENDING" for t in tasks), info
        assert jobs_lib.is_stuck(info[tasks[0]]["reason"])
        jobs_lib.cancel_jobs(tasks, grace=1)
        wait_for(lambda: not jobs_lib.job_states(tasks), 60, "the tasks to leave the queue")
    finally:
        subprocess.run(["scancel", array], env=_ENV, capture_output=True, timeout=60)


@needs_slurm
def test_apex_learner_and_actor_jobs_learn_and_end_together(tmp_path, savedirs):
    goal = 20000
    savedir, out = run_to_the_end(
        tmp_path, savedirs, "apex", *APEX, f"total_steps={goal}", timeout=600
    )
    assert "learner job" in out and "2 actor jobs: array" in out, out
    roles = [role for _, role in jobs_lib.recorded_jobs(savedir)]
    assert roles == ["broker", "learner", "actor 0", "actor 1"], roles
    rows = learner_rows(savedir)
    assert rows, "the learner wrote no logs"
    # The learner updated on what both actor jobs inserted into its replay.
    assert rows[-1]["step"] >= goal and rows[-1]["updates"] > 0
    assert max(r["actors"] for r in rows) == 2
    assert rows[-1]["replay_size"] > 0 and any(r["inserts_per_s"] > 0 for r in rows)
    assert (savedir / "checkpoint.pt").exists()
    ids = role_ids(savedir)
    for role in ("actor 0", "actor 1"):
        assert "acting on" in job_log(savedir, ids[role]), role
    # The learner's end ends its actors (they hear it) and the broker: all COMPLETED.
    wait_for(lambda: all_ended(savedir), 90, "every job to end")
    assert set(states(savedir).values()) == {"COMPLETED"}, states(savedir)
    table = moolib_jobs(str(savedir))
    assert "learner" in table and "actor 1" in table and table.count("COMPLETED") == 4, table


@needs_slurm
def test_actor_jobs_preempted_cancelled_or_killed_never_stop_learning(tmp_path, savedirs):
    savedir = learn_forever(tmp_path, savedirs)
    ids = role_ids(savedir)
    # Actor 1's job preempted: requeued, it acts for the learner again.
    job = submitit.SlurmJob(folder=savedir / "slurm" / "%j", job_id=ids["actor 1"])
    job._interrupt()  # SIGTERM, then USR2 (requeue)
    wait_for(
        lambda: job_log(savedir, ids["actor 1"]).count("acting on") >= 2,
        240,
        "the preempted actor 1 to act again",
    )
    assert "requeued" in job_log(savedir, ids["actor 1"])
    rows = len(learner_rows(savedir))
    wait_for(
        lambda: any(r["actors"] == 2 for r in learner_rows(savedir)[rows + 2 :]),
        120,
        "the learner to hear from both actors again",
    )
    updates_go_on(savedir, "updates after actor 1 came back")
    # Actor 1's job cancelled: the learner goes on updating on actor 0's transitions.
    subprocess.run(["scancel", ids["actor 1"]], check=True)
    wait_for(lambda: states(savedir)["actor 1"] == "CANCELLED", 90, "actor 1 cancelled")
    wait_for(
        lambda: any(r["actors"] == 1 for r in learner_rows(savedir)[-3:]),
        90,
        "the learner to see one actor",
    )
    updates_go_on(savedir, "updates with actor 1 gone")
    # Actor 0's process killed (as by the OOM killer): its job is requeued, and the
    # new actor feeds the learner again.
    pid = wait_for(lambda: job_pid(savedir, ids["actor 0"]), 60, "actor 0's process")
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: job_log(savedir, ids["actor 0"]).count("acting on") >= 2,
        240,
        "the requeued actor 0 to act again",
    )
    assert "failed (exit status" in job_log(savedir, ids["actor 0"])
    updates_go_on(savedir, "updates after actor 0 came back")
    assert states(savedir)["learner"] == "RUNNING"
    cancel_all(savedir)


@needs_slurm
def test_preempted_learner_resumes_from_its_checkpoint_and_the_actors_rejoin(tmp_path, savedirs):
    savedir = learn_forever(tmp_path, savedirs, "agent.save_replay=true")
    ids = role_ids(savedir)
    learner = ids["learner"]
    wait_for(lambda: (savedir / "checkpoint.pt").exists(), 120, "a checkpoint")
    before = len(learner_rows(savedir))
    job = submitit.SlurmJob(folder=savedir / "slurm" / "%j", job_id=learner)
    job._interrupt()  # preemption: SIGTERM, then USR2 (checkpoint + requeue)
    wait_for(
        lambda: job_log(savedir, learner).count("broker at") >= 2,
        240,
        "the preempted learner to start again",
    )
    wait_for(lambda: "resumed from" in job_log(savedir, learner, "err"), 120, "a resume")
    log = job_log(savedir, learner, "err")
    assert "requeued" in job_log(savedir, learner)
    # It resumed from the checkpoint it wrote as it was preempted, with its replay.
    before_resume, after_resume = log.split("resumed from", 1)
    saved = re.findall(r"checkpoint at step (\d+)", before_resume)
    resumed = [int(re.match(r" \S+ at step (\d+)", after_resume).group(1))]
    assert saved and int(saved[-1]) == resumed[-1], (saved, resumed)
    assert "replay restored from" in log  # a new run has none to restore
    stopped = learner_rows(savedir)[before - 1]
    # The preempted learner may log rows after `before` until it exits; the new
    # one starts only after that, so rows from here on are all the new one's.
    before = len(learner_rows(savedir))
    # The actors (their jobs still running) reconnect and feed the new learner.
    for role in ("actor 0", "actor 1"):
        wait_for(
            lambda r=role: "the learner restarted" in job_log(savedir, ids[r]),
            240,
            f"{role} to reconnect to the requeued learner",
        )
    wait_for(
        lambda: any(
            r["actors"] == 2 and r["updates"] > stopped["updates"]
            for r in learner_rows(savedir)[before:]
        ),
        240,
        "the resumed learner to update on both actors' transitions",
    )
    after = learner_rows(savedir)[before:]
    # Not from 0: steps and updates go on from the checkpoint's.
    assert min(r["step"] for r in after) >= resumed[-1]
    assert min(r["updates"] for r in after) > 0
    assert states(savedir) == {
        "broker": "RUNNING",
        "learner": "RUNNING",
        "actor 0": "RUNNING",
        "actor 1": "RUNNING",
    }
    cancel_all(savedir)


@needs_slurm
def test_r2d2_learner_and_actor_job_run_to_the_end(tmp_path, savedirs):
    r2d2 = ["agent=r2d2", "env=cartpole-novel", "scaling.actors=1", "total_steps=10000"]
    savedir, _ = run_to_the_end(tmp_path, savedirs, "r2d2", *APEX, *r2d2, timeout=600)
    rows = learner_rows(savedir)
    assert rows and rows[-1]["step"] >= 10000 and rows[-1]["updates"] > 0, rows[-1:]
    assert [role for _, role in jobs_lib.recorded_jobs(savedir)] == ["broker", "learner", "actor 0"]
    wait_for(lambda: all_ended(savedir), 90, "every job to end")
    assert set(states(savedir).values()) == {"COMPLETED"}, states(savedir)


@needs_slurm
def test_apex_sweep_gives_each_point_its_learner_and_actors_and_returns(tmp_path, savedirs):
    sweep, points = sweep_of_two(tmp_path, savedirs, *APEX, "scaling.actors=1", "total_steps=5000")
    for p in points:
        wait_for(lambda p=p: all_ended(p), 300, f"the jobs of {p.name} to end")
        assert set(states(p).values()) == {"COMPLETED"}, states(p)
        assert learner_rows(p)[-1]["step"] >= 5000
    table = moolib_jobs(str(sweep))
    assert "0: learner" in table and "1: actor 0" in table and table.count("COMPLETED") == 6, table


# -- without a cluster ------------------------------------------------------------------


def test_slurm_config_composes_and_bad_values_name_their_key(tmp_path):
    cfg = cfg_job(tmp_path, "scaling=slurm")
    for key in ("partition", "time", "nodes", "gpus_per_task", "cpus_per_task", "mem"):
        assert key in cfg["scaling"]
    for key in ("constraint", "account", "qos", "additional_parameters", "wait", "max_failures"):
        assert key in cfg["scaling"]
    for bad, message in [
        (["scaling.time=0"], "scaling.time must be a positive integer"),
        (["scaling.max_failures=-1"], "scaling.max_failures must be an integer >= 0"),
        (["scaling.wait=yes"], "scaling.wait must be true or false, got 'yes'"),
        (["scaling.gpus_per_task=one"], "scaling.gpus_per_task must be an integer >= 0"),
        (
            ["scaling.peers=3", "scaling.tasks_per_node=2"],
            "scaling.peers (3) must be a multiple of the peers per job",
        ),
    ]:
        base = ["agent=a2c", "env=cartpole", "scaling=slurm", f"savedir={tmp_path}/r"]
        result = run([*base, *bad], tmp_path, timeout=120)
        assert result.returncode == 2 and message in result.stdout, (bad, result.stdout)


def test_slurm_config_accepts_cuda_without_a_local_gpu():
    """The launcher may run on a login node without GPUs; the jobs have them."""
    import moolib.launch.run  # noqa: F401 - registers the config's resolvers
    import torch
    from hydra import compose, initialize_config_module
    from moolib.launch import config

    overrides = ["agent=a2c", "env=cartpole", "device=cuda:0"]
    with initialize_config_module("moolib.conf", version_base=None):
        slurm = compose("config", [*overrides, "scaling=slurm"])
        single = compose("config", overrides)
    config.validate(slurm)
    if not torch.cuda.is_available():
        with pytest.raises(config.ConfigError, match="CUDA is not available"):
            config.validate(single)


def test_a_running_broker_job_whose_log_never_shows_means_no_shared_savedir(tmp_path, monkeypatch):
    """As when the compute node writes the savedir on its own disk: the job runs
    (sacct says so) but nothing it writes reaches the launcher."""
    import threading
    from types import SimpleNamespace

    job = SimpleNamespace(
        job_id="42",
        state="RUNNING",
        done=lambda: False,
        paths=SimpleNamespace(stdout=tmp_path / "slurm/42/42_0_log.out", stderr=None),
    )
    monkeypatch.setattr(slurm_lib, "SHARED_FS_GRACE", 1.0)
    with pytest.raises(RuntimeError, match="not on a filesystem shared with the compute nodes"):
        slurm_lib._wait_for_broker(job, tmp_path, "abc", 60.0, "key", threading.Event())
    # Once the log is there, the launcher keeps waiting for the broker file instead.
    job.paths.stdout.parent.mkdir(parents=True)
    job.paths.stdout.touch()
    with pytest.raises(TimeoutError, match="did not write"):
        slurm_lib._wait_for_broker(job, tmp_path, "abc", 3.0, "key", threading.Event())


def test_broker_check_fails_in_bounded_time_without_a_broker():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer"):
        slurm_lib.check_broker(f"127.0.0.1:{port}", 2.0)
    assert time.monotonic() - started < 10


def test_broker_check_passes_against_a_broker():
    from moolib.launch.local import EmbeddedBroker

    broker = EmbeddedBroker()
    try:
        slurm_lib.check_broker(broker.address, 30.0)
    finally:
        broker.close()


@needs_slurm
def test_a_preempted_job_whose_requeue_did_not_take_is_requeued_by_its_batch_script(tmp_path):
    """submitit's ``scontrol requeue`` can die of the preemption's own SIGTERM: the job's
    run then ends as if requeued, and nothing would bring it back. Its batch script,
    still running, requeues it (and counts no failure)."""
    folder = tmp_path / "slurm"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        'echo "run ${SLURM_RESTART_COUNT:-0}"\n'
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        f"  mkdir -p {folder}/$SLURM_JOB_ID\n"
        f"  touch {folder}/$SLURM_JOB_ID/{slurm_requeue.REQUEUED_MARKER.format(restart=0)}\n"
        f"  {sys.executable} -m moolib.launch.slurm_requeue {folder} 1 0\n"
        "fi\n"
    )
    log = tmp_path / "job.log"
    out = subprocess.run(
        ["sbatch", "--parsable", "--requeue", "--open-mode=append", "-o", str(log), str(script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    try:
        wait_for(lambda: "run 1" in log.read_text(), 120, "the job to run a second time")
        assert "was preempted and is still running: requeued" in log.read_text()
        assert not (folder / job_id / "failures").exists()
    finally:
        subprocess.run(["scancel", job_id], capture_output=True)


def test_moolib_jobs_without_recorded_jobs_says_so(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "moolib.launch.jobs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "no jobs recorded" in out.stderr
    # A savedir that is not there (a typo) is named as such.
    out = subprocess.run(
        [sys.executable, "-m", "moolib.launch.jobs", str(tmp_path / "typo")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and f"{tmp_path / 'typo'}: no such directory" in out.stderr


def test_auth_key_file_is_private_and_sets_the_key_of_new_rpcs(tmp_path):
    from moolib.launch.local import EmbeddedBroker

    import moolib

    assert not slurm_files.use_auth_key(tmp_path, "abc")  # no key for this launch
    path = slurm_files.write_auth_key(tmp_path, "abc", "s3cret")
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    keyless = EmbeddedBroker()
    try:
        with pytest.raises(TimeoutError):  # a keyless broker and a keyed peer: no link
            slurm_lib.check_broker(keyless.address, 3.0, "s3cret")
    finally:
        keyless.close()
    assert slurm_files.use_auth_key(tmp_path, "abc")
    try:
        keyed = EmbeddedBroker()  # its Rpc is created after use_auth_key: it has the key
        try:
            slurm_lib.check_broker(keyed.address, 60.0, "s3cret")
            with pytest.raises(TimeoutError):
                slurm_lib.check_broker(keyed.address, 3.0, "wrong")
        finally:
            keyed.close()
    finally:
        moolib.set_auth_key(None)


def test_broker_file_is_read_only_for_its_own_launch(tmp_path):
    assert slurm_files.read_broker_file(tmp_path, "abc") is None
    slurm_files.write_json_atomic(tmp_path / "broker.json", {"address": "h:1", "launch": "abc"})
    assert slurm_files.read_broker_file(tmp_path, "abc") == "h:1"
    assert slurm_files.read_broker_file(tmp_path, "other") is None  # a stale file from a rerun
    assert not list(tmp_path.glob(".*.tmp"))
