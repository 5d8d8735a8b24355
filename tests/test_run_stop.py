"""How a ``moolib-run`` stops: Ctrl-C (once, twice, while the peers start, swallowed by
an import in the pre-flight) and SIGTERM to the whole group end the run with exit 130 or
143, a checkpoint of where it was, no traceback and no process left; a Ctrl-C right after
a log row leaves that row the last word of the logs, the summary and ``moolib-plot``.

The runs are real ``moolib-run`` subprocesses in their own session; the Ctrl-C right after
a row stops a trainer in this process, at that row.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import pytest
from helpers.run_util import (
    QUICK,
    STOP_TIMEOUT,
    Run,
    alive,
    load_checkpoint,
    peers_and_workers,
    read_logs,
    session_pids,
    start_local_training,
    training,
    wait_for,
)
from moolib.launch import config as config_lib
from moolib.launch import local

# -- Ctrl-C and SIGTERM --------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_ctrl_c_stops_local_run_cleanly(tmp_path):
    savedir = tmp_path / "ctrlc"
    # The only checkpoint is the one written on Ctrl-C.
    r = start_local_training(tmp_path, savedir, "checkpoint_interval=100000")
    try:
        # Every process of the run: the launcher, 2 peers, their EnvPool workers.
        peers, workers, commands = peers_and_workers(r.pid)
        pids = [r.pid, *peers, *workers]
        assert r.pid in session_pids(r.pid)
        assert len(peers) == 2, commands
        assert len(workers) >= 4, commands  # num_actor_cpus=2 per peer
        assert not (savedir / "checkpoint.pt").exists()

        code, out = r.ctrl_c(STOP_TIMEOUT)
        assert code == 130, out[-5000:]  # stopped by Ctrl-C, after its checkpoint
        wait_for(
            lambda: not session_pids(r.pid) and not any(alive(p) for p in pids),
            timeout=30,
            what="every process of the run to exit",
        )
        assert "Traceback" not in out, out[-5000:]
        peer1_log = (savedir / "peer1" / "stdout.log").read_text(errors="replace")
        assert "Traceback" not in peer1_log, peer1_log[-5000:]
    finally:
        r.finish()

    # The leader wrote a checkpoint on the way out, at the step the peers stopped.
    ckpt = load_checkpoint(savedir / "checkpoint.pt")
    _, rows0 = read_logs(savedir / "peer0" / "logs.tsv")
    _, rows1 = read_logs(savedir / "peer1" / "logs.tsv")
    assert ckpt["steps"] > 0
    assert ckpt["steps"] in (int(rows0[-1]["step"]), int(rows1[-1]["step"]))
    # The terminal (peer 0's output) says which peer wrote it, peer 1 too: its own line
    # goes to its file. Which one leads is the group's choice, either may.
    wrote = f"] checkpoint at step {ckpt['steps']}: {savedir / 'checkpoint.pt'}"
    writer = 1 if f"[peer 1{wrote}" in peer1_log else 0
    assert re.search(rf"^\[peer {writer}{re.escape(wrote)}$", out, re.M), out[-5000:]
    assert not list(savedir.glob(".checkpoint.pt.*"))


@pytest.mark.timeout(600)
def test_second_ctrl_c_stops_every_peer_at_once_without_traceback(tmp_path):
    import time

    savedir = tmp_path / "twice"
    args = [
        *QUICK,
        "scaling=local",
        "scaling.peers=2",
        "total_steps=100000000",
        f"savedir={savedir}",
    ]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        wait_for(training(savedir / "peer0" / "logs.tsv"), timeout=240, what="training", proc=r)
        pids = session_pids(r.pid)
        r.interrupt()
        time.sleep(0.2)
        code, out = r.ctrl_c(STOP_TIMEOUT)
        wait_for(
            lambda: not session_pids(r.pid) and not any(alive(p) for p in pids),
            timeout=30,
            what="every process of the run to exit",
        )
    finally:
        r.finish()
    assert code == 130, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    peer1 = (savedir / "peer1" / "stdout.log").read_text(errors="replace")
    assert "Traceback" not in peer1, peer1[-5000:]


@pytest.mark.timeout(600)
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


@pytest.mark.timeout(600)
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


@pytest.mark.timeout(600)
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
        wait_for(training(savedir / "logs.tsv"), timeout=240, what="training", proc=r)
        os.killpg(r.pid, signal.SIGTERM)
        code = r.wait(STOP_TIMEOUT)
        out = r.output()
        assert code == 143, out[-3000:]
        assert "moolib-run: ended with exit code 143" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert (savedir / "checkpoint.pt").is_file()
    finally:
        r.finish()


# -- a Ctrl-C right after a log row --------------------------------------------------------


def _record_rows(monkeypatch, stop: threading.Event | None = None) -> list[dict]:
    """The rows written to logs.tsv from now on, in order; with ``stop``, which is set as
    the first row with finished episodes is written: a Ctrl-C right after a log row."""
    from moolib.agents.runtime.logger import TsvLog

    written: list[dict] = []
    write = TsvLog.write

    def recorded(log, row):
        write(log, row)
        written.append(dict(row))
        if stop is not None and row.get("episodes", 0) > 0:
            stop.set()

    monkeypatch.setattr(TsvLog, "write", recorded)
    return written


def _check_the_last_real_row_stays(savedir: Path, written: list[dict], stopped_at: dict):
    """No row after ``stopped_at`` takes its place: the logs, the summary and moolib-plot all
    end on the last row with episodes, the return the last progress line showed."""
    from moolib.launch import plot, report

    after = written[written.index(stopped_at) + 1 :]
    # A later row at the same step would supersede it (a resume's rule) with no return.
    assert all(r["step"] > stopped_at["step"] for r in after), (stopped_at, after)
    last_real = [r for r in written if r.get("episodes", 0) > 0][-1]
    ret = last_real["mean_episode_return"]
    totals = report.read_totals(savedir)
    assert totals is not None and totals.mean_return == pytest.approx(ret), (totals, last_real)
    text = report.summary(savedir, 10**9, exit_code=130)
    assert text is not None and f"mean return {ret:.2f}" in text, text
    table = plot.read_table(savedir / "logs.tsv")
    series = plot.load_series(table, "mean_episode_return", "step", "run")
    assert series.last() == (pytest.approx(last_real["step"]), pytest.approx(ret))


@pytest.mark.timeout(300)
def test_ctrl_c_right_after_a_row_leaves_that_row_the_last_word(
    compose_config, tmp_path, monkeypatch
):
    from moolib.agents.runtime.onpolicy import PeerInfo, Trainer

    stop = threading.Event()
    written = _record_rows(monkeypatch, stop)
    cfg = compose_config(*QUICK, "total_steps=1000000000", "torch_threads=1")
    final = config_lib.prepare(cfg, tmp_path)
    broker = local.EmbeddedBroker()
    guard = threading.Timer(120, stop.set)  # never hangs, whatever happens
    guard.start()
    try:
        peer = PeerInfo(rank=0, savedir=tmp_path, logdir=tmp_path, broker=broker.address)
        Trainer(final, peer).run(stop)
    finally:
        guard.cancel()
        broker.close()
    stopped_at = next(r for r in written if r.get("episodes", 0) > 0)
    _check_the_last_real_row_stays(tmp_path, written, stopped_at)


@pytest.mark.timeout(300)
def test_ctrl_c_right_after_a_row_and_a_learner_step_leaves_that_row_the_last_word(
    compose_config, tmp_path, monkeypatch
):
    """Ape-X's learner: stopped by the first learner step after a row with episodes (its
    losses are new, its actors' steps not reported yet)."""
    from moolib.agents.runtime.offpolicy import Learner
    from moolib.launch.peer import make_trainer

    stop = threading.Event()
    written = _record_rows(monkeypatch)
    update = Learner._update

    def learner_step(learner, stats):
        learned = update(learner, stats)
        if learned and any(r.get("episodes", 0) > 0 for r in written):
            stop.set()
        return learned

    monkeypatch.setattr(Learner, "_update", learner_step)
    cfg = compose_config(
        *QUICK,
        "agent=apex",
        "total_steps=1000000000",
        "agent.min_replay_size=100",
        "torch_threads=1",
    )
    final = config_lib.prepare(cfg, tmp_path)
    broker = local.EmbeddedBroker()
    guard = threading.Timer(180, stop.set)
    guard.start()
    try:
        make_trainer(final, 0, broker.address).run(stop)
    finally:
        guard.cancel()
        broker.close()
    stopped_at = [r for r in written if r.get("episodes", 0) > 0][0]
    _check_the_last_real_row_stays(tmp_path, written, stopped_at)
