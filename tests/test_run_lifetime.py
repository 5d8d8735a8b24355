"""How long the processes of a ``moolib-run`` live: no peer or env worker
outlives its launcher (kill -9, SIGHUP), and a peer that lost its group stops
with a clear message instead of acting for nobody."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers.run_util import (
    QUICK,
    STOP_TIMEOUT,
    Run,
    alive,
    peers_and_workers,
    read_logs,
    run_env,
    session_pids,
    start_local_training,
    wait_for,
)

pytestmark = pytest.mark.timeout(600)


def _training(path):
    def check():
        _, rows = read_logs(path)
        return any(row["model_version"] > 0 for row in rows)

    return check


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP], ids=["kill-9", "sighup"])
def test_launcher_that_dies_takes_its_peers_and_workers_with_it(tmp_path, sig):
    savedir = tmp_path / "run"
    r = start_local_training(tmp_path, savedir)
    try:
        peers, workers, commands = peers_and_workers(r.pid)
        assert len(peers) == 2 and len(workers) >= 4, commands

        os.kill(r.pid, sig)  # the launcher only, as kill -9 or a dropped ssh session does
        r.wait(STOP_TIMEOUT)
        wait_for(
            lambda: not any(alive(p) for p in peers + workers),
            timeout=60,
            what="every peer and env worker to exit after the launcher died",
        )
        peer1_log = (savedir / "peer1" / "stdout.log").read_text(errors="replace")
        if sig == signal.SIGKILL:
            assert "moolib-run (the launcher) is gone: stopping" in peer1_log, peer1_log[-3000:]
        assert "Traceback" not in peer1_log, peer1_log[-3000:]
    finally:
        r.finish()


def test_peer_that_lost_its_group_stops_with_a_message(tmp_path):
    broker = subprocess.Popen(
        [sys.executable, "-m", "moolib.broker", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=run_env(),
        text=True,
    )
    try:
        line = broker.stdout.readline()
        assert "Broker listening at" in line, line
        address = line.split("Broker listening at")[1].strip()
        savedir = tmp_path / "lost"
        r = Run(
            [
                "agent=a2c",
                "env=cartpole",
                "device=cpu",
                "total_steps=100000000",
                "log_interval=1",
                "lost_group_timeout=5",
                f"broker={address}",
                f"savedir={savedir}",
            ],
            tmp_path,
            tmp_path / "out.log",
        )
        try:
            wait_for(_training(savedir / "logs.tsv"), timeout=240, what="training", proc=r)
            broker.kill()
            broker.wait()
            code = r.wait(STOP_TIMEOUT)
            out = r.output()
            assert code == 3, out[-3000:]
            assert "moolib-run: error: peer 0 has been out of its group for 5 s" in out, out[-3000:]
            assert f"the broker at {address} is gone or unreachable" in out
            assert "Traceback" not in out, out[-3000:]
        finally:
            r.finish()
    finally:
        broker.kill()
        broker.wait()


def test_sigterm_to_the_whole_group_stops_an_offpolicy_run_with_a_checkpoint(tmp_path):
    """timeout, systemd and scancel send SIGTERM to every process of the run, env
    workers included: the workers leave stopping to the learner, whose actor
    loops were stepping them, and the run ends as on Ctrl-C (exit 143, a
    checkpoint) instead of failing on a dead worker."""
    savedir = tmp_path / "r2d2"
    r = Run(
        ["agent=r2d2", "env=minatar-breakout", "device=cpu", "log_interval=1"]
        # MinAtar Breakout's first episodes are short: short sequences fill the replay.
        + ["agent.burn_in=4", "agent.sequence_length=20", "agent.overlap=10"]
        + ["agent.min_replay_size=500", f"savedir={savedir}"],
        tmp_path,
        tmp_path / "out.log",
    )
    try:
        wait_for(_training(savedir / "logs.tsv"), timeout=240, what="training", proc=r)
        os.killpg(r.pid, signal.SIGTERM)
        code = r.wait(STOP_TIMEOUT)
        out = r.output()
        assert code == 143, out[-3000:]
        assert "moolib-run: ended with exit code 143" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert (savedir / "checkpoint.pt").is_file()
    finally:
        r.finish()


def test_ctrl_c_while_the_peers_start_stops_the_run_without_a_traceback(tmp_path):
    """Ctrl-C reaches every process of the group, peers that are still importing
    (seconds) included: they start with it pending, not dying mid-import."""
    savedir = tmp_path / "early"
    r = Run(
        ["agent=vtrace", "env=minatar-breakout", "device=cpu", "scaling=local"]
        + ["scaling.peers=2", f"savedir={savedir}"],
        tmp_path,
        tmp_path / "out.log",
    )
    try:
        wait_for(lambda: len(peers_and_workers(r.pid)[0]) == 2, 120, "the peer processes", 0.02, r)
        r.interrupt()  # while they import
        code = r.wait(STOP_TIMEOUT)
        wait_for(lambda: not session_pids(r.pid), 60, "every process of the run to end")
        out = r.output()
    finally:
        r.finish()
    logs = out + "".join(p.read_text(errors="replace") for p in savedir.glob("peer*/stdout.log"))
    assert code == 130, logs[-5000:]
    assert "Traceback" not in logs and "KeyboardInterrupt" not in logs, logs[-5000:]


SLOW_IMPORT_ENV = """
import time

import gymnasium

print("importing the env module", flush=True)
try:  # as some libraries do around optional imports: a bare except
    time.sleep(60)
except:  # noqa: E722
    pass


def make():
    return gymnasium.make("CartPole-v1")
"""


def test_ctrl_c_swallowed_by_an_import_during_the_preflight_still_stops_the_run(tmp_path):
    """The pre-flight makes the env once; an import that catches every exception
    (minatar's does, around matplotlib) swallows the KeyboardInterrupt of a Ctrl-C
    there. The run must still not start."""
    (tmp_path / "slowenv.py").write_text(SLOW_IMPORT_ENV)
    savedir = tmp_path / "swallowed"
    r = Run(
        [*QUICK, "env=gym", "env.id=slowenv:make", f"savedir={savedir}"],
        tmp_path,
        tmp_path / "out.log",
        env={"PYTHONPATH": str(tmp_path)},
    )
    try:
        wait_for(lambda: "importing the env module" in r.output(), 120, "the import", proc=r)
        code, out = r.ctrl_c(STOP_TIMEOUT)
    finally:
        r.finish()
    assert code == 130, out[-5000:]
    assert "moolib-run: interrupted" in out, out[-5000:]
    assert not (savedir / "logs.tsv").exists(), out[-5000:]


def test_a_killed_peer_is_started_again_behind_its_prefix_and_rejoins(tmp_path):
    """scaling=local: a peer killed by a signal comes back (behind scaling.peer_prefix,
    its {rank} replaced) and trains in the full group again; the others go on."""
    savedir = tmp_path / "run"
    r = start_local_training(tmp_path, savedir, "scaling.peer_prefix='env MOOLIB_TEST_RANK={rank}'")
    try:
        peers, _, commands = peers_and_workers(r.pid)
        assert len(peers) == 2, commands
        ranks = {}
        for pid in peers:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            rank = int(commands[pid].split("--rank ")[1].split()[0])
            assert f"MOOLIB_TEST_RANK={rank}".encode() in environ, commands[pid]
            ranks[rank] = pid
        log1 = savedir / "peer1" / "logs.tsv"
        os.kill(ranks[1], signal.SIGKILL)
        # Reaped by the launcher (its pid gone, not only a zombie leader whose
        # threads may still write): every row after these is the new process's.
        wait_for(
            lambda: not os.path.exists(f"/proc/{ranks[1]}"), timeout=60, what="peer 1 to be reaped"
        )
        before = read_logs(log1)[1]

        def rejoined():
            rows = read_logs(log1)[1][len(before) :]
            # The new process trains in a group of 2. (Its totals start again from
            # 0, but its first row may already be past the killed one's last.)
            return any(row["peers"] == 2 and row["offered_steps"] > 0 for row in rows)

        wait_for(rejoined, timeout=240, what="peer 1 to come back and train in the group", proc=r)
        peers_now, _, commands = peers_and_workers(r.pid)
        assert len(peers_now) == 2 and ranks[1] not in peers_now, commands
        assert "peer 1 was killed by signal 9; starting it again" in r.output()
    finally:
        r.finish()


def test_a_peer_that_crashes_soon_after_its_start_is_not_started_again_in_a_loop():
    """scaling=local restarts a killed peer whenever, a crashed one only after it ran a
    while (a bad setting would crash it again at once), and none that ended by itself."""
    from moolib.launch.local import MIN_RUN_BEFORE_RESTART, restart_verdict

    assert restart_verdict(-9, 1.0) == "was killed by signal 9; starting it again"
    assert restart_verdict(1, MIN_RUN_BEFORE_RESTART + 1) == "exited with code 1; starting it again"
    early = restart_verdict(1, 2.0)
    assert "not starting it again" in early and "2 s after its start" in early
    for code in (0, 2, 3):
        assert restart_verdict(code, 1000.0) == ""
