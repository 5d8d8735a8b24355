"""``scaling=slurm`` against a real SLURM (the test cluster of
scripts/slurm-test-cluster.sh; tests/helpers/slurm_util.py says how to start it):
on-policy runs: peers and their broker as jobs, logs, cancels, Ctrl-C, a sweep, an
existing broker."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml
from helpers.run_util import Run, run, run_quick, wait_for
from helpers.slurm_util import (  # noqa: F401 - the fixtures are used by name
    FOREVER,
    SMALL,
    TOGETHER,
    all_ended,
    both_training,
    cancel_all,
    job_log,
    moolib_jobs,
    needs_slurm,
    peer_rows,
    run_to_the_end,
    savedirs_fixture,
    slurm_conf_fixture,
    states,
    submitit,
    sweep_of_two,
    train_forever,
)
from moolib.launch import jobs as jobs_lib
from moolib.launch import slurm as slurm_lib
from moolib.launch import slurm_files

# Each test waits on SLURM jobs (half a minute to minutes): -m "not slow" leaves the
# file out of a quick run.
pytestmark = pytest.mark.slow


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
