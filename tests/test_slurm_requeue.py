"""``scaling=slurm`` against a real SLURM (the test cluster of
scripts/slurm-test-cluster.sh; tests/helpers/slurm_util.py says how to start it):
requeues: a peer or the broker interrupted, failed or preempted comes back and training goes on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest
import yaml
from helpers.run_util import wait_for
from helpers.slurm_util import (  # noqa: F401 - the fixtures are used by name
    cancel_all,
    job_log,
    job_pid,
    moolib_jobs,
    needs_slurm,
    peer_rows,
    savedirs_fixture,
    slurm_conf_fixture,
    states,
    submitit,
    train_forever,
    wait_training_together_again,
)
from moolib.launch import jobs as jobs_lib
from moolib.launch import slurm_requeue

# Each test waits on SLURM jobs (half a minute to minutes): -m "not slow" leaves the
# file out of a quick run.
pytestmark = pytest.mark.slow


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
