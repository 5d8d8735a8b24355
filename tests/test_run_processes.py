"""The processes of a ``moolib-run`` and what they hold live no longer than the run needs
them: no peer or env worker outlives its launcher (kill -9, SIGHUP); a peer that lost its
group stops with a message instead of acting for nobody; a killed peer is started again (a
crashed one not in a loop); a savedir takes one run at a time and is free again when it
ends; each point of a sweep releases what it opened (its Rpcs, groups and broker,
descriptors, threads).

The launcher runs as real processes (``python -m moolib.launch.run``); the sweep's points
run in this process, as Hydra runs them, to count what each leaves behind.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers.run_util import (
    QUICK,
    STOP_TIMEOUT,
    Run,
    alive,
    checkpoint_steps,
    one_error_line,
    peers_and_workers,
    read_logs,
    run,
    run_env,
    start_local_training,
    training,
    wait_for,
)
from moolib.launch import config as config_lib
from moolib.launch import local, savedir_lock

import moolib

# -- peers and env workers live no longer than their launcher and group --------------------


@pytest.mark.timeout(600)
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


@pytest.mark.timeout(600)
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
            wait_for(training(savedir / "logs.tsv"), timeout=240, what="training", proc=r)
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


@pytest.mark.timeout(600)
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


@pytest.mark.timeout(600)
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


# -- one run per savedir -------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_a_second_run_in_a_busy_savedir_is_refused_and_ctrl_c_exits_130(tmp_path):
    savedir = tmp_path / "stopped"
    args = [*QUICK, "total_steps=100000000", "checkpoint_interval=100000", f"savedir={savedir}"]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        wait_for(training(savedir / "logs.tsv"), timeout=240, what="training", proc=r)
        assert not (savedir / "checkpoint.pt").exists()
        # A second run in the same savedir (the same command in another terminal)
        # is refused while this one trains, naming it, and writes nothing there.
        config = (savedir / "config.yaml").read_text()
        for extra in ([], ["scaling=local"]):
            line = one_error_line(run([*args, *extra], tmp_path))
            assert f"savedir={savedir} is in use: moolib-run (pid {r.pid} on host " in line
            assert (savedir / "config.yaml").read_text() == config
        code, out = r.ctrl_c(STOP_TIMEOUT)
    finally:
        r.finish()
    assert code == 130, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    _, rows = read_logs(savedir / "logs.tsv")
    assert checkpoint_steps(savedir) == int(rows[-1]["step"]) > 0
    # Its end frees the savedir: resuming it may start.
    savedir_lock.check_free(savedir)


# -- every point of a sweep releases what it opened ----------------------------------------


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _python_threads() -> list[str]:
    # Not the dummies: threading's stand-ins for the core's threads that ran Python code
    # (logged a line here), which it keeps for good.
    dummy = threading._DummyThread  # type: ignore[attr-defined]
    return sorted(t.name for t in threading.enumerate() if not isinstance(t, dummy))


def _settled(measure, limit: int, timeout: float = 30.0) -> int:
    """``measure()`` once it is at most ``limit``, else its value after ``timeout`` seconds:
    an Rpc's sockets close on its threads, a moment after close() returns."""
    deadline = time.monotonic() + timeout
    while True:
        value = measure()
        if value <= limit or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


class _RpcCensus:
    """Every moolib Rpc made while it counts, and which of them were closed: an Rpc alive
    and not closed is still connected, or still trying to connect, to its broker."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import weakref

        self.made: list[weakref.ref] = []
        self.closed: set[int] = set()
        init, close = moolib.Rpc.__init__, moolib.Rpc.close

        def counted_init(rpc, *args, **kwargs):
            init(rpc, *args, **kwargs)
            self.made.append(weakref.ref(rpc))

        def counted_close(rpc):
            self.closed.add(id(rpc))
            close(rpc)

        monkeypatch.setattr(moolib.Rpc, "__init__", counted_init)
        monkeypatch.setattr(moolib.Rpc, "close", counted_close)

    def open(self) -> list[str]:
        """The names of the Rpcs alive and not closed."""
        alive = [r() for r in self.made]
        return [rpc.get_name() for rpc in alive if rpc is not None and id(rpc) not in self.closed]


class _CoreLog(logging.Handler):
    """The core's log lines, verbose ones included (each failed dial is one)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


# Points that end quickly: a2c on CartPole, and Ape-X with its actors as threads.
POINTS = {
    "a2c": ["agent=a2c", "total_steps=3000"],
    "apex": ["agent=apex", "total_steps=1500", "agent.min_replay_size=100"],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("agent", sorted(POINTS))
def test_each_point_of_a_sweep_releases_what_it_opened(
    compose_config, tmp_path, monkeypatch, agent
):
    """Two points run one after the other in this process, as Hydra runs a -m sweep's
    (scaling=single: launch.local.run_single). The garbage collector is off, as it may well
    be for seconds in a real sweep: what a point leaves for it to close stays open. After
    each point no Rpc of it is open, nothing dials its broker (gone by then: every failed
    dial is a verbose line of the core's log, and after 11 s the 'no link after 11 s,
    still trying' error), and the second point leaves no more descriptors and threads than
    the first."""
    core_log = _CoreLog()
    # Each point's broker's address, and how many lines the core had logged when it closed.
    closed_brokers: list[tuple[str, int]] = []

    class RecordedBroker(local.EmbeddedBroker):
        def close(self) -> None:
            super().close()
            closed_brokers.append((self.address, len(core_log.lines)))

    monkeypatch.setattr(local, "EmbeddedBroker", RecordedBroker)
    census = _RpcCensus(monkeypatch)
    logger = logging.getLogger("test-run-clean.moolib-core")
    logger.addHandler(core_log)
    logger.setLevel(logging.DEBUG)
    moolib.set_logging(logger)
    moolib.set_log_level("verbose")
    threads_before = _python_threads()

    def point(n: int) -> None:
        cfg = compose_config(*POINTS[agent], "env=cartpole", "device=cpu", "log_interval=1")
        final = config_lib.prepare(cfg, tmp_path / str(n))
        local.run_single(final, threading.Event())
        assert (tmp_path / str(n) / "checkpoint.pt").exists()

    gc.collect()
    gc.disable()
    try:
        point(0)
        assert census.open() == [], "Rpcs of the finished point still open"
        fds, threads = _fds(), _os_threads()
        point(1)
        assert census.open() == [], "Rpcs of the finished point still open"
        # The first point's broker is gone for the whole second point, the second's now:
        # give a leftover Rpc time to dial them again (it does every 1.6 s at most).
        time.sleep(5)
        dials = [
            line
            for address, logged in closed_brokers
            for line in core_log.lines[logged:]
            if f"connect to {address}" in line or f'connect("{address}")' in line
        ]
        assert dials == [], dials[:5]
        assert _settled(_fds, fds) <= fds, os.listdir("/proc/self/fd")
        assert _settled(_os_threads, threads) <= threads
        assert _python_threads() == threads_before
    finally:
        gc.enable()
        moolib.set_logging(None)
        moolib.set_log_level("error")
        logger.removeHandler(core_log)
    assert len(closed_brokers) == 2 and closed_brokers[0][0] != closed_brokers[1][0]
