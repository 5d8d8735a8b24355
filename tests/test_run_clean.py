"""A run ends clean, and says what happened: a network that cannot take the env's
observations is a config error before anything starts; every point of a sweep releases
what it opened (its Rpcs, groups and broker); a Ctrl-C right after a log row leaves the
logs, the summary and ``moolib-plot`` on the last real row; ``log_interval`` and
``checkpoint_interval`` must be > 0.

The launcher runs as real processes (``python -m moolib.launch.run``) where the exit code
and the output are the point; the sweep's points run in this process, as Hydra runs them,
to count what each leaves behind.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.run_util import QUICK, check_ok, run, run_cmd, run_env, run_quick, snapshot
from moolib.launch import config as config_lib
from moolib.launch import local

import moolib


def one_error_line(result) -> str:
    """The run stopped with exit 2 and said why in one ``moolib-run: error:`` line."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moolib-run: error: "), out[-5000:]
    return lines[0]


# -- a network that cannot take the env's observations ----------------------------------------


@pytest.mark.parametrize(
    "overrides, names",
    [
        (
            ["agent=a2c", "env=cartpole", "agent.network=impala_deep"],
            ["agent.network=impala_deep", "env=cartpole", "shape (4,)", "image observations"],
        ),
        (
            ["agent=a2c", "env=cartpole", "agent.network=minatar"],
            ["agent.network=minatar", "env=cartpole", "shape (4,)", "(mlp here)"],
        ),
        (
            ["agent=apex", "env=cartpole", "agent.network=impala_shallow"],
            ["agent.network=impala_shallow", "env=cartpole", "shape (4,)"],
        ),
        # Images, but too small for the shallow network's strided convolutions.
        (
            ["agent=vtrace", "env=minatar-breakout", "agent.network=impala_shallow"],
            ["agent.network=impala_shallow", "env=minatar-breakout", "shape (4, 10, 10)", "20x20"],
        ),
        # Every point of a sweep is checked before the first starts.
        (
            ["-m", "agent=a2c", "env=cartpole", "agent.network=mlp,impala_deep"],
            ["agent.network=impala_deep", "env=cartpole", "shape (4,)"],
        ),
    ],
    ids=[
        "impala-cartpole",
        "minatar-cartpole",
        "apex-shallow-cartpole",
        "shallow-minatar",
        "sweep",
    ],
)
def test_a_network_that_cannot_take_the_observations_is_a_config_error(tmp_path, overrides, names):
    line = one_error_line(run_quick(tmp_path, *overrides, "device=cpu", "total_steps=100"))
    for name in names:
        assert name in line, line
    assert list(tmp_path.iterdir()) == []  # no outputs/ or multirun/ folder


@pytest.mark.timeout(300)
def test_a_resume_with_a_network_that_cannot_take_the_observations_is_refused(tmp_path):
    savedir = tmp_path / "run"
    check_ok(run([*QUICK, "total_steps=2000", f"savedir={savedir}"], tmp_path))
    before = snapshot(savedir)
    result = run_quick(tmp_path, f"savedir={savedir}", "agent.network=impala_deep")
    line = one_error_line(result)
    assert "agent.network=impala_deep" in line and "env=cartpole" in line, line
    assert "shape (4,)" in line, line
    assert snapshot(savedir) == before  # nothing written, nothing recorded as resumed


# -- scaling=slurm where there is no SLURM ---------------------------------------------------


def slurm_run_refusal(cwd: Path, env: dict[str, str]) -> str:
    """The one error line of a scaling=slurm run refused in ``cwd``, which it left empty."""
    result = subprocess.run(
        run_cmd("agent=a2c", "env=cartpole", "scaling=slurm", "total_steps=100"),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    line = one_error_line(result)
    assert list(cwd.iterdir()) == [], line  # no outputs/ folder, nothing to resume
    return line


def test_scaling_slurm_without_slurm_is_refused_before_anything_is_written(tmp_path):
    """It used to fail in submitit (``Could not detect "srun"``, exit 1) after the savedir
    was made, which the next run, without scaling=slurm, then resumed and failed alike."""
    # This interpreter's folder only: no srun or sbatch, even where a test cluster runs.
    line = slurm_run_refusal(tmp_path, run_env({"PATH": str(Path(sys.executable).parent)}))
    assert "scaling=slurm: no SLURM on this machine" in line, line
    assert "sbatch and srun not found on PATH" in line, line


def test_scaling_slurm_whose_controller_does_not_answer_is_refused_before_anything_is_written(
    tmp_path,
):
    """SLURM's client commands installed, but no cluster configured (as on this machine
    once scripts/slurm-test-cluster.sh has installed them): sbatch used to fail after the
    savedir was made."""
    if not all(shutil.which(c) for c in ("sbatch", "srun", "sinfo")):
        pytest.skip("SLURM's commands are not installed (scripts/slurm-test-cluster.sh start)")
    (tmp_path / "run").mkdir()
    conf = tmp_path / "slurm.conf"
    conf.touch()  # a cluster configured nowhere: sinfo fails at once
    line = slurm_run_refusal(tmp_path / "run", run_env({"SLURM_CONF": str(conf)}))
    assert "scaling=slurm: SLURM does not answer on this machine (sinfo: " in line, line
    assert "Unable to process configuration file" in line, line


# -- every point of a sweep releases what it opened -------------------------------------------


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


# -- a Ctrl-C right after a log row -----------------------------------------------------------


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


# -- log_interval and checkpoint_interval must be more than 0 -------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        ["log_interval=0"],
        ["log_interval=0.0"],
        ["-m", "log_interval=5,0"],
        ["checkpoint_interval=0"],
    ],
    ids=["zero", "zero-float", "sweep", "checkpoint-zero"],
)
def test_an_interval_of_zero_is_refused(tmp_path, overrides):
    """log_interval=0 logged every update (52,838 lines in 40 s), and checkpoint_interval=0
    wrote a checkpoint at every step: refused as the other bad values are."""
    result = run_quick(tmp_path, *overrides, "agent=a2c", "env=cartpole", "total_steps=100")
    line = one_error_line(result)
    key = overrides[-1].split("=")[0]
    assert f"{key} must be a number of seconds > 0, got 0" in line, line
    assert list(tmp_path.iterdir()) == []
