"""``scaling=slurm`` against a real SLURM (the test cluster of
scripts/slurm-test-cluster.sh; tests/helpers/slurm_util.py says how to start it):
off-policy runs: a learner job and actor jobs, preempted, cancelled or killed."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import pytest
from helpers.run_util import wait_for
from helpers.slurm_util import (  # noqa: F401 - the fixtures are used by name
    APEX,
    all_ended,
    cancel_all,
    job_log,
    job_pid,
    learn_forever,
    learner_rows,
    moolib_jobs,
    needs_slurm,
    role_ids,
    run_to_the_end,
    savedirs_fixture,
    slurm_conf_fixture,
    states,
    submitit,
    sweep_of_two,
    updates_go_on,
)
from moolib.launch import jobs as jobs_lib

# Each test waits on SLURM jobs (half a minute to minutes): -m "not slow" leaves the
# file out of a quick run.
pytestmark = pytest.mark.slow


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
