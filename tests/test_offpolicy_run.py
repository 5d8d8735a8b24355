"""Ape-X and R2D2 through ``moolib-run``: scaling=local, actors killed and
restarted, resumes, and nothing left behind.

Real processes (the launcher, a learner serving its replay over RPC, actor
processes with their EnvPool workers), real Hydra composition, real envs. The
learning tests are in ``test_offpolicy_learning.py`` and ``test_r2d2_learning.py``.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest
import torch
from helpers.run_util import (
    STOP_TIMEOUT,
    Run,
    assert_tensorboard_has_the_rows,
    check_ok,
    peers_and_workers,
    read_logs,
    run,
    session_pids,
    tensorboard_runs,
    wait_for,
)

SMALL = ["device=cpu", "log_interval=1", "seed=0"]


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


# -- scaling=local: actors die, actors join ------------------------------------------------


def _actors(sid: int) -> dict[int, int]:
    """Actor processes of a run: {actor index: pid}."""
    peers, _, commands = peers_and_workers(sid)
    found = {}
    for pid in peers:
        m = re.search(r"--rank (\d+)", commands[pid])
        if m and int(m.group(1)) > 0:
            found[int(m.group(1)) - 1] = pid
    return found


def _updates(savedir: Path) -> float:
    _, rows = read_logs(savedir / "logs.tsv")
    return rows[-1]["updates"] if rows else 0.0


@pytest.mark.timeout(600)
def test_a_killed_actor_does_not_stop_learning_and_a_new_one_joins(tmp_path):
    savedir = tmp_path / "run"
    args = [
        "agent=apex",
        "env=cartpole",
        "scaling=local",
        "scaling.actors=2",
        *SMALL,
        "total_steps=1000000000",
        f"savedir={savedir}",
    ]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        wait_for(lambda: _updates(savedir) > 0, 240, "the learner to update", proc=r)
        wait_for(lambda: len(_actors(r.pid)) == 2, 60, "two actor processes", proc=r)
        victim = _actors(r.pid)[0]
        joined = savedir / "actor0" / "stdout.log"
        wait_for(lambda: joined.read_text().count("acting") >= 1, 120, "actor 0 to act", proc=r)
        os.kill(victim, signal.SIGKILL)
        at_kill = _updates(savedir)
        # The learner goes on updating...
        wait_for(lambda: _updates(savedir) > at_kill + 20, 240, "updates after the kill", proc=r)
        # ...and actor 0 is started again, and acts for the learner.
        wait_for(lambda: _actors(r.pid).get(0) not in (None, victim), 120, "a new actor 0", proc=r)
        wait_for(lambda: joined.read_text().count("acting") >= 2, 240, "the new actor", proc=r)
        assert "actor 0 exited with code -9; starting it again" in r.output()
        after_join = _updates(savedir)
        wait_for(lambda: _updates(savedir) > after_join + 20, 240, "more updates", proc=r)
        _, rows = read_logs(savedir / "logs.tsv")
        # Not necessarily in the last row: the replay's rate limit may hold the actors back
        # for a log interval.
        assert any(row["inserts_per_s"] > 0 for row in rows[-5:]), rows[-5:]
        # The restarted actor took its predecessor's place in the count.
        assert max(row["actors"] for row in rows) <= 2, [row["actors"] for row in rows]
        r.interrupt()
        assert r.wait(STOP_TIMEOUT) == 130
        wait_for(lambda: not session_pids(r.pid), 60, "every process of the run to end")
    finally:
        r.finish()


@pytest.mark.timeout(300)
def test_killing_the_launcher_leaves_nothing_behind(tmp_path):
    savedir = tmp_path / "run"
    args = [
        "agent=apex",
        "env=cartpole",
        "scaling=local",
        "scaling.actors=1",
        *SMALL,
        "total_steps=1000000000",
        f"savedir={savedir}",
    ]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        wait_for(lambda: _updates(savedir) > 0, 240, "the learner to update", proc=r)
        peers, workers, _ = peers_and_workers(r.pid)
        assert len(peers) == 2 and workers
        os.kill(r.pid, signal.SIGKILL)
        wait_for(lambda: not session_pids(r.pid), 90, "every process of the run to end")
    finally:
        r.finish()


@pytest.mark.timeout(300)
def test_ctrl_c_of_a_single_run_checkpoints_and_leaves_nothing_behind(tmp_path):
    savedir = tmp_path / "run"
    args = ["agent=apex", "env=cartpole", *SMALL, "total_steps=1000000000", f"savedir={savedir}"]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        wait_for(lambda: _updates(savedir) > 0, 240, "the learner to update", proc=r)
        r.interrupt()
        assert r.wait(STOP_TIMEOUT) == 130
        wait_for(lambda: not session_pids(r.pid), 60, "every process of the run to end")
        state = load_checkpoint(savedir / "checkpoint.pt")
        assert state["updates"] > 0
    finally:
        r.finish()


def test_r2d2_says_why_its_replay_stays_empty_when_episodes_are_shorter_than_its_burn_in(
    tmp_path,
):
    """A sequence needs burn_in + 2 steps of one episode; an untrained CartPole policy
    ends its episodes long before 102, so nothing reaches the replay: the run says so."""
    savedir = tmp_path / "r2d2"
    sequences = ["agent.sequence_length=120", "agent.overlap=40", "agent.burn_in=100"]
    args = ["agent=r2d2", "env=cartpole", *SMALL, *sequences, "total_steps=40000"]
    out = check_ok(run([*args, f"savedir={savedir}"], tmp_path))
    _, rows = read_logs(savedir / "logs.tsv")
    assert rows[-1]["replay_size"] == 0 and rows[-1]["updates"] == 0
    assert "r2d2: the replay is empty: all " in out, out[-3000:]
    assert "a sequence needs at least agent.burn_in + 2 = 102" in out
    assert out.count("r2d2: the replay is empty") == 1  # once, not every log row
    # The progress line says what the learner waits for (conf/tuning/r2d2_cartpole.yaml).
    assert "loss -  replay 0/200 before learning  ETA" in out, out[-3000:]


# -- full runs and resumes -----------------------------------------------------------------


def test_a_resume_may_set_a_key_only_its_agent_has_and_a_run_too_short_to_learn_is_noted(
    tmp_path,
):
    savedir = tmp_path / "apex"
    # conf/tuning/apex_cartpole.yaml: the learner waits for 1,000 transitions.
    args = ["agent=apex", "env=cartpole", *SMALL, f"savedir={savedir}"]
    out = check_ok(run([*args, "total_steps=500"], tmp_path))
    assert (
        "moolib-run: note: total_steps=500 ends before the learner starts: it waits for "
        "agent.min_replay_size=1,000 transitions, about 1,000 env steps" in out
    ), out[-3000:]
    steps = load_checkpoint(savedir / "checkpoint.pt")["steps"]
    # The savedir alone picks the agent: agent.save_replay is a key agent=vtrace (the
    # default) does not have. A resume that does not keep the replay starts it empty.
    more = f"total_steps={steps + 500}"
    out = check_ok(run([f"savedir={savedir}", more, "agent.n_step=2"], tmp_path))
    assert f"ends before the learner starts from step {steps:,} (the replay is not" in out
    assert "agent.n_step=2 (was 3)" in out, out[-3000:]
    steps = load_checkpoint(savedir / "checkpoint.pt")["steps"]
    _, before = read_logs(savedir / "logs.tsv")
    # TensorBoard too, turned on by a resume: the learner writes its rows from then on.
    more = [f"total_steps={steps + 3000}", "agent.save_replay=true", "tensorboard.enabled=true"]
    out = check_ok(run([f"savedir={savedir}", *more], tmp_path))
    assert "agent.save_replay=true (was false)" in out and "note:" not in out, out[-3000:]
    _, rows = read_logs(savedir / "logs.tsv")
    assert_tensorboard_has_the_rows(tensorboard_runs(savedir)["."], rows[len(before) :])
    assert (savedir / "replay.bin").exists()
    assert load_checkpoint(savedir / "checkpoint.pt")["updates"] > 0


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "agent, env, extra",
    [
        ("apex", "cartpole", ["agent.save_replay=true"]),
        ("r2d2", "cartpole-novel", []),
    ],
)
@pytest.mark.slow
def test_local_run_and_resume(tmp_path, agent, env, extra):
    savedir = tmp_path / agent
    base = [
        f"agent={agent}",
        f"env={env}",
        "scaling=local",
        "scaling.actors=2",
        *SMALL,
        *extra,
        f"savedir={savedir}",
    ]
    out1 = check_ok(run([*base, "total_steps=20000"], tmp_path))
    assert "resumed" not in out1
    first = load_checkpoint(savedir / "checkpoint.pt")
    assert first["steps"] >= 20000 and first["updates"] > 0
    assert {"model", "target", "optimizer"} <= set(first)
    _, rows1 = read_logs(savedir / "logs.tsv")
    assert max(r["actors"] for r in rows1) == 2
    for index in (0, 1):
        assert "Traceback" not in (savedir / f"actor{index}" / "stdout.log").read_text()
    if "agent.save_replay=true" in extra:
        assert (savedir / "replay.bin").exists()

    out2 = check_ok(run([*base, "total_steps=40000"], tmp_path))
    assert re.search(rf"resumed from .*checkpoint\.pt at step {first['steps']}\b", out2), out2[
        -3000:
    ]
    second = load_checkpoint(savedir / "checkpoint.pt")
    assert second["steps"] >= 40000 and second["updates"] > first["updates"]
    _, rows = read_logs(savedir / "logs.tsv")
    resumed = rows[len(rows1) :]
    # Steps go on from the checkpoint's, not from 0.
    assert resumed and min(r["step"] for r in resumed) >= first["steps"]
    assert resumed[-1]["step"] >= 40000
    if "agent.save_replay=true" in extra:
        # The replay came back with the checkpoint: the resumed learner updates at once
        # (min_replay_size is met by the restored items) and its replay is not empty.
        assert "replay restored from" in out2
        assert resumed[0]["replay_size"] >= rows1[-1]["replay_size"]
