"""Running ``moolib-run`` / ``moolib-plot`` as real subprocesses, and reading what they write.

Every run gets its own session (``start_new_session=True``): the session id is
the launcher's pid, so every process it starts (peers, EnvPool workers) can be
found in ``/proc`` afterwards -- to check that none is left, and to kill
leftovers one by one when a test fails.
"""

from __future__ import annotations

import csv
import hashlib
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

# Generous: the machine may have two slow, busy cores; nothing asserts on speed.
RUN_TIMEOUT = 300.0
STOP_TIMEOUT = 120.0


def run_env(extra: dict | None = None) -> dict:
    """The environment of a moolib-run child: wandb offline and quiet, no auth key."""
    env = dict(os.environ)
    env.pop("MOOLIB_AUTH_KEY", None)
    env.pop("WANDB_API_KEY", None)
    env["WANDB_MODE"] = "offline"
    env["WANDB_SILENT"] = "true"
    env["PYTHONUNBUFFERED"] = "1"
    env["HYDRA_FULL_ERROR"] = "0"
    # One torch thread per process: several peers (and their EnvPool workers) on a
    # 2-core machine otherwise slow each other down many times over.
    env["OMP_NUM_THREADS"] = "1"
    if extra:
        env.update(extra)
    return env


def run_cmd(*args: str) -> list[str]:
    """``moolib-run ARGS`` through the interpreter running the tests."""
    return [sys.executable, "-m", "moolib.launch.run", *args]


def eval_cmd(*args: str) -> list[str]:
    """``moolib-eval ARGS``: the console script installed beside this interpreter."""
    script = Path(sys.executable).with_name("moolib-eval")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-m", "moolib.launch.evaluate", *args]


def plot_cmd(*args: str) -> list[str]:
    """``moolib-plot ARGS``: the console script installed beside this interpreter."""
    script = Path(sys.executable).with_name("moolib-plot")
    if script.exists():
        return [str(script), *args]
    return [sys.executable, "-m", "moolib.launch.plot", *args]


# -- processes -----------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, session) of ``pid``, or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[3])


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an exited process not yet reaped)."""
    st = _stat(pid)
    return st is not None and st[0] not in ("Z", "X")


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        st = _stat(int(entry))
        if st and st[2] == sid and st[0] not in ("Z", "X"):
            found.append(int(entry))
    return sorted(found)


def kill_session(sid: int) -> None:
    """Kills the processes of session ``sid`` (only ever one a test started), one by one."""
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Run:
    """``moolib-run ARGS`` in the background, in its own session, output to a file."""

    def __init__(self, args: list[str], cwd: Path, log: Path, env: dict | None = None) -> None:
        self.args = args
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in finish()
        self.proc = subprocess.Popen(
            run_cmd(*args),
            cwd=cwd,
            env=run_env(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def interrupt(self) -> None:
        """Ctrl-C: SIGINT to the whole foreground process group, as a terminal sends it."""
        os.killpg(self.pid, signal.SIGINT)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def ctrl_c(self, timeout: float) -> tuple[int, str]:
        """Ctrl-C, then the run's exit code and output once it has ended."""
        self.interrupt()
        code = self.wait(timeout)
        return code, self.output()

    def finish(self) -> None:
        """Kills whatever of the run is left (the launcher and everything it started)."""
        if self.proc.poll() is None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        kill_session(self.pid)
        self._log.close()


def run(
    args: list[str], cwd: Path, timeout: float = RUN_TIMEOUT, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Runs ``moolib-run ARGS`` to its end; returns its exit code and output (stdout+stderr)."""
    log = Path(cwd) / f"moolib-run-{time.monotonic_ns()}.out"
    r = Run(args, cwd, log, env)
    try:
        try:
            code = r.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(
                f"moolib-run {' '.join(args)} still runs after {timeout}s; output:\n"
                + r.output()[-5000:]
            ) from e
        return subprocess.CompletedProcess(r.proc.args, code, r.output(), "")
    finally:
        r.finish()


def run_quick(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``moolib-run ARGS`` for something short (composition, a rejected config)."""
    return subprocess.run(
        run_cmd(*args), cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=120
    )


def cfg_job(tmp_path: Path, *overrides: str, part: str = "job") -> dict:
    """``moolib-run OVERRIDES --cfg PART``: the composed config, parsed."""
    r = run_quick(tmp_path, *overrides, "--cfg", part)
    assert r.returncode == 0, r.stdout + r.stderr
    return yaml.safe_load(r.stdout)


# -- outputs ---------------------------------------------------------------------------------


def number(cell: str) -> float:
    try:
        return float(cell)
    except ValueError:
        return math.nan


def read_logs(path: Path) -> tuple[list[str], list[dict[str, float]]]:
    """The header and the rows (cells as floats; empty cells are nan) of a logs.tsv."""
    with open(path, newline="") as f:
        reader = csv.reader(f, delimiter="\t")
        header = next(reader)
        rows = [
            {k: number(v) for k, v in zip(header, cells, strict=False)} for cells in reader if cells
        ]
    return header, rows


def tensorboard_runs(folder: Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The scalars of the TensorBoard runs under ``folder``, as ``tensorboard --logdir
    FOLDER`` finds them (a run per folder of event files: ``.``, ``peer1``), read with
    TensorBoard's own reader: {run: {tag: [(step, value), ...] in the order written}}."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer(size_guidance={"scalars": 0})  # 0: every event, none sampled
    mux.AddRunsFromDirectory(str(folder))
    mux.Reload()
    return {
        run: {tag: [(e.step, e.value) for e in mux.Scalars(run, tag)] for tag in tags["scalars"]}
        for run, tags in mux.Runs().items()
    }


def assert_tensorboard_has_the_rows(scalars: dict, rows: list[dict[str, float]]) -> None:
    """``scalars`` (a run of ``tensorboard_runs``) holds exactly logs.tsv's ``rows``: a
    tag per column (step aside), each the column's finite numbers at their rows' steps
    (TensorBoard keeps them as 32-bit floats)."""
    columns = {k for r in rows for k, v in r.items() if k != "step" and math.isfinite(v)}
    assert set(scalars) == columns, (sorted(scalars), sorted(columns))
    for tag in columns:
        logged = [(int(r["step"]), r[tag]) for r in rows if math.isfinite(r.get(tag, math.nan))]
        assert [s for s, _ in scalars[tag]] == [s for s, _ in logged], tag
        values = [v for _, v in scalars[tag]]
        assert values == pytest.approx([v for _, v in logged], rel=1e-6), tag


def wait_for(cond, timeout: float, what: str, interval: float = 0.5, proc: Run | None = None):
    """Polls ``cond()`` until truthy (returns its value); fails naming ``what`` after
    ``timeout`` seconds, or as soon as ``proc`` exits."""
    end = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except (OSError, ValueError, StopIteration, KeyError):
            value = None
        if value:
            return value
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(
                f"moolib-run exited ({proc.proc.returncode}) before {what}; output:\n"
                + proc.output()[-5000:]
            )
        if time.monotonic() > end:
            extra = f"; output:\n{proc.output()[-5000:]}" if proc else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{extra}")
        time.sleep(interval)


# -- a terminal ------------------------------------------------------------------------------


def run_in_terminal(
    args: list[str], cwd: Path, timeout: float = RUN_TIMEOUT, columns: int = 160
) -> tuple[int, str]:
    """Runs ``moolib-run ARGS`` on a pseudo-terminal (its stdin, stdout and stderr, as in an
    interactive shell) ``columns`` wide; returns its exit code and everything it wrote, raw
    (carriage returns and escape sequences included)."""
    import fcntl
    import select
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    proc = subprocess.Popen(
        run_cmd(*args),
        cwd=cwd,
        env=run_env(),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"moolib-run {' '.join(args)} still runs after {timeout}s; output:\n"
                    + b"".join(chunks).decode(errors="replace")[-5000:]
                )
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every process holding the terminal is gone
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=30)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        kill_session(proc.pid)
    return code, b"".join(chunks).decode(errors="replace")


def screen_lines(raw: str) -> list[str]:
    """The lines a terminal shows for ``raw`` output: a carriage return goes back to the start
    of the line (later text overwrites), ``ESC[K`` erases to its end, ``ESC[2K`` all of it."""
    import re

    lines: list[str] = []
    line: list[str] = []
    col = 0
    for token in re.split(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)", raw):
        if token == "\r":
            col = 0
        elif token == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        elif token.startswith("\x1b["):
            if token in ("\x1b[K", "\x1b[0K"):
                del line[col:]
            elif token == "\x1b[2K":
                line = []
        else:
            for ch in token:
                if col < len(line):
                    line[col] = ch
                else:
                    line.extend(" " * (col - len(line)))
                    line.append(ch)
                col += 1
    if line:
        lines.append("".join(line).rstrip())
    return lines


def start_local_training(tmp_path: Path, savedir: Path, *extra: str) -> Run:
    """A 2-peer ``scaling=local`` A2C CartPole run that trains until stopped; returns
    once both peers have applied an update (the caller must ``finish()`` it)."""
    args = [
        "agent=a2c",
        "env=cartpole",
        "scaling=local",
        "scaling.peers=2",
        "device=cpu",
        "total_steps=100000000",
        "log_interval=1",
        *extra,
        f"savedir={savedir}",
    ]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        for k in (0, 1):
            path = savedir / f"peer{k}" / "logs.tsv"
            wait_for(
                lambda path=path: any(row["model_version"] > 0 for row in read_logs(path)[1]),
                timeout=240,
                what=f"peer {k} to train",
                proc=r,
            )
    except BaseException:
        r.finish()
        raise
    return r


def peers_and_workers(sid: int) -> tuple[list[int], list[int], dict[int, str]]:
    """The peer processes and EnvPool workers of run session ``sid``, and every
    process's command line (for messages)."""
    commands = {pid: cmdline(pid) for pid in session_pids(sid)}
    peers = [p for p, c in commands.items() if "moolib.launch.peer" in c]
    workers = [p for p, c in commands.items() if "_envpool_worker" in c]
    return peers, workers, commands


# What every logs.tsv row carries (docs/toolkit.md, "What a run writes"), which users'
# scripts and ``moolib-plot --metric`` read by name: a contract, so a literal, kept here
# once. Not agents/runtime/logger.py's COLUMNS: a column renamed or dropped there must fail the
# test of a run's header, not change what it expects.
DOCUMENTED_COLUMNS = {
    "step",
    "sps",
    "mean_episode_return",
    "mean_episode_length",
    "episodes",
    "total_loss",
    "policy_loss",
    "baseline_loss",
    "entropy_loss",
    "grad_norm",
    "learning_rate",
    "virtual_batch_size",
    "model_version",
    "param_sum",
    "peers",
    "env_steps",
    "offered_steps",
    "eval_step",
    "eval_mean_episode_return",
    "eval_episode_return_std",
    "eval_mean_episode_length",
    "time",
}

# A quick A2C CartPole run on the CPU, for tests of what happens around a run.
QUICK = ["agent=a2c", "env=cartpole", "device=cpu", "log_interval=1"]


def check_ok(result: subprocess.CompletedProcess) -> str:
    """The output of a moolib-run that exited 0 without a traceback."""
    out = result.stdout
    assert result.returncode == 0, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    return out


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (hidden ones included) with a hash of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# -- what a run says and leaves ---------------------------------------------------------------


def one_error_line(result: subprocess.CompletedProcess, program: str = "moolib-run") -> str:
    """The run (``program``) stopped with exit 2 and said why in one ``moolib-run: error:``
    line (``result`` of ``run``, whose output is all in stdout, or of ``run_quick``)."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: "), out[-5000:]
    return lines[0]


def load_yaml(path: Path) -> Any:
    """The YAML file at ``path``, parsed."""
    return yaml.safe_load(path.read_text())


def load_config(savedir: Path) -> dict:
    """The resolved config a run wrote into ``savedir``."""
    return yaml.safe_load((savedir / "config.yaml").read_text())


def load_checkpoint(path: Path) -> dict:
    """The checkpoint at ``path``, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=False)


def checkpoint_steps(savedir: Path) -> int:
    """The step of the latest checkpoint in ``savedir``."""
    return int(
        torch.load(savedir / "checkpoint.pt", map_location="cpu", weights_only=False)["steps"]
    )


def history_steps(savedir: Path) -> list[int]:
    """The steps of the checkpoints kept in ``savedir/checkpoints/``, in order."""
    names = [p.name for p in (savedir / "checkpoints").iterdir()]
    steps = []
    for name in names:
        m = re.fullmatch(r"checkpoint_(\d+)\.pt", name)
        assert m, f"unexpected file in checkpoints/: {name}"
        steps.append(int(m.group(1)))
    return sorted(steps)


def training(logs: Path) -> Callable[[], bool]:
    """A condition for ``wait_for``: a row of ``logs`` (a logs.tsv) shows an applied update."""

    def check():
        _, rows = read_logs(logs)
        return any(row["model_version"] > 0 for row in rows)

    return check


def run_without(
    cwd: Path,
    packages: tuple[str, ...],
    *args: str,
    program: str = "moolib-run",
    module: str = "moolib.launch.run",
) -> subprocess.CompletedProcess:
    """moolib-run (or ``program``, whose ``module`` it runs) with ``args``, in a Python
    where ``packages`` cannot be imported (as when they are not installed)."""
    launcher = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({packages!r})); "
        f"sys.argv[0] = {program!r}; runpy.run_module({module!r}, run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", launcher, *args],
        cwd=cwd,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
