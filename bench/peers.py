"""moolib beside the libraries a researcher would pick instead, on the same work.

    python bench/peers.py [--sample-factory-python PATH] [--rllib-python PATH]
                          [--torchrl-python PATH] [--sb3-python PATH]
                          [--pufferlib-python PATH]
                          [--only throughput|score] [--results FILE.jsonl]
                          [--rounds 5] [--warmup 20] [--seconds 30] [--envs 8] [--procs 2]
                          [--tune] [--tuning-seed 0] [--seeds 5] [--score-cap 240]
                          [--score-task minatar] [--plot PNG]
    python bench/peers.py --check [--... -python PATH]

Installs nothing: each peer runs in its own virtual environment, whose Python is
given (``bash bench/peers/setup.sh`` builds them from the lockfiles in
bench/peers/locks/); a peer whose Python is not given is skipped, and the output
says so. The bench runs under moolib's Python. Each peer's side is a small runner,
``bench/peers/<lib>_runner.py``, that this bench launches with that Python; the
runners share ``bench/peers/common.py``: the same envs (gymnasium's Atari
preprocessing, as moolib-run's env=breakout) and the same counting of env steps and
episodes, in the env instances themselves, whichever process steps them. Each row
(``ROWS``) is a library, an algorithm, its class and the library settings changed
for it; ratios pair rows of one class only.

Two figures per row, each on the same machine in the same call:

- *Throughput*: Breakout from pixels (ALE, frameskip 4, 84x84 grey, 4 stacked
  frames, no sticky actions), ``--envs`` envs on ``--procs`` env processes (SB3's
  SubprocVecEnv can only run one env per process: it gets ``--envs`` processes),
  the shallow IMPALA network for all, CPU only; env steps/s over ``--seconds``
  after ``--warmup`` seconds of stepping, ``--rounds`` rounds, each round running
  every row once (the order rotating) and the EnvPool limit of the same processes
  (moolib.EnvPool with that many envs on that many processes stepped with random
  actions and nothing else: bench/train.py's ``envpool_limit``). The headline is
  moolib's ratio to the best peer of its class in each round: median and range.
- *Time to a score*: MinAtar Breakout (``--score-task cartpole``: CartPole-v1)
  until the mean return of the last 100 finished episodes reaches 10 (CartPole:
  475), wall-clock from the process's start and env steps, on the held-out seeds 1
  to ``--seeds``, runs capped at ``--score-cap`` seconds; seeds interleave like
  rounds. Each row runs its published settings; with ``--tune`` also the pick of
  the same sweep for every row (``SWEEP``: its learning rate and batch size scaled)
  on ``--tuning-seed``, which is never scored.

``--results FILE`` keeps every run (one JSON line, with the moolib commit, the load
average around it and the share of the CPU other processes took during it) and
takes the runs already there instead of running them again: hours of runs resume
after a stop. Each run waits for a quiet machine first, and a run during which
other processes took more than ``--max-others`` of the CPU is run again. A run
that takes no env step in ``--first-step-seconds``, or none for
``--stall-seconds``, is stopped and reported.

moolib's side is moolib-run with bench/train.py's helpers: its throughput is its
actors' env steps/s from its logs.tsv (as ``run_sps`` reads them), the warm-up
counted from its first steps as the runners count theirs.

``--check``: every available row for a few seconds of CartPole, then the printed
table is parsed back and every row must hold a positive figure; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
RUNNERS = HERE / "peers"
RESULT_PREFIX = "RESULT "
SCORE_TARGETS = {"minatar": 10.0, "cartpole": 475.0}
SCORE_WINDOW = 100  # episodes the score is the mean return of (as bench/peers/common.py)
# Seconds a runner may take to start (imports, processes) before its timed part, and
# so before its first env step: past it, the run is stopped and reported.
STARTUP_ALLOWANCE = 240.0
# Seconds a run may go without an env step once it has taken one (a learning phase
# between collections is shorter: TorchRL's PPO took about 40 s per batch here).
STALL_ALLOWANCE = 180.0


# Algorithm classes: a throughput ratio pairs rows of one class only.
ONE_PASS = "one pass"  # IMPALA-like: each sample learned from once (V-trace, APPO 1 epoch)
A2C_CLASS = "A2C"  # synchronous actor-critic, one pass
# Several passes over each batch (epochs, or RLlib's APPO handing each batch to its
# learner up to twice): another algorithm, shown apart.
PPO_CLASS = "PPO"


@dataclass(frozen=True)
class Row:
    """One library and algorithm setting: moolib's (``python_flag`` None) or a peer's.

    ``algo`` names it in the tables; ``runner_algo`` is the runner's (or moolib-run's
    agent) algorithm; ``settings`` are the library's own settings changed for this row
    (passed as the runner's ``--set``), over the runner's published ones."""

    lib: str
    algo: str
    klass: str
    runner_algo: str
    python_flag: str | None = None
    runner: str | None = None
    settings: tuple[tuple[str, Any], ...] = ()


_SF = ("--sample-factory-python", "sample_factory_runner.py")
_ONE_EPOCH = (("num_epochs", 1), ("num_batches_per_epoch", 1))
ROWS = (
    Row("moolib", "V-trace", ONE_PASS, "vtrace"),
    Row("moolib", "A2C", A2C_CLASS, "a2c"),
    Row("sample-factory", "APPO 1 pass", ONE_PASS, "appo", *_SF, _ONE_EPOCH),
    Row(
        "sample-factory",
        "APPO 1 pass V-trace",
        ONE_PASS,
        "appo",
        *_SF,
        # Sample Factory refuses normalized returns with V-trace.
        (*_ONE_EPOCH, ("with_vtrace", True), ("normalize_returns", False)),
    ),
    Row("sample-factory", "APPO", PPO_CLASS, "appo", *_SF),
    Row("rllib", "APPO", PPO_CLASS, "appo", "--rllib-python", "rllib_runner.py"),
    Row(
        "rllib",
        "APPO 1 pass",
        ONE_PASS,
        "appo",
        "--rllib-python",
        "rllib_runner.py",
        # Its circular buffer hands each batch to the learner once, not up to twice.
        (("circular_buffer_iterations_per_batch", 1),),
    ),
    Row("rllib", "IMPALA", ONE_PASS, "impala", "--rllib-python", "rllib_runner.py"),
    Row("torchrl", "PPO", PPO_CLASS, "ppo", "--torchrl-python", "torchrl_runner.py"),
    Row("torchrl", "IMPALA", ONE_PASS, "impala", "--torchrl-python", "torchrl_runner.py"),
    Row("stable-baselines3", "PPO", PPO_CLASS, "ppo", "--sb3-python", "sb3_runner.py"),
    Row("stable-baselines3", "A2C", A2C_CLASS, "a2c", "--sb3-python", "sb3_runner.py"),
    Row("pufferlib", "PPO", PPO_CLASS, "ppo", "--pufferlib-python", "pufferlib_runner.py"),
)


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def bench_train() -> ModuleType:
    """bench/train.py, whose helpers measure moolib-run and the EnvPool limit."""
    return _load(HERE / "train.py", "bench_train")


@functools.cache
def runners_common() -> ModuleType:
    """bench/peers/common.py, whose counters say how many env steps a runner took."""
    return _load(RUNNERS / "common.py", "peers_common")


@dataclass(frozen=True)
class Limits:
    """How long a run may go without an env step: ``first_step_s`` from its start,
    ``stall_s`` after its last step (``--first-step-seconds``, ``--stall-seconds``)."""

    first_step_s: float = STARTUP_ALLOWANCE
    stall_s: float = STALL_ALLOWANCE


class Watchdog:
    """Says why a run that takes no env steps should be stopped: none within
    ``first_step_s`` of its start (it failed to start, or hangs there), or none for
    ``stall_s`` after the last one (its workers died, or it waits on them)."""

    def __init__(self, limits: Limits) -> None:
        self.first_step_s = limits.first_step_s
        self.stall_s = limits.stall_s
        self.start = time.monotonic()
        self._steps = 0
        self._last = self.start

    def check(self, steps: int) -> str | None:
        """The reason to stop, given the steps taken so far; None while it steps."""
        now = time.monotonic()
        if steps > self._steps:
            self._steps, self._last = steps, now
            return None
        if self._steps == 0 and now - self.start > self.first_step_s:
            return f"took no env step in {self.first_step_s:.0f} s after its start"
        if self._steps > 0 and now - self._last > self.stall_s:
            return f"took no env step for {self.stall_s:.0f} s after {self._steps:,} steps"
        return None


# -- moolib's side -------------------------------------------------------------------------


def moolib_overrides(task: str, envs: int, procs: int, agent: str = "vtrace") -> list[str]:
    """moolib-run's overrides for ``agent`` on ``task`` with ``envs`` envs (two batches,
    double buffered) on ``procs`` env processes, the shallow IMPALA network on
    Breakout."""
    if envs % 2:
        raise ValueError(f"--envs must be even (two batches of envs), got {envs}")
    shape = [
        f"agent.actor_batch_size={envs // 2}",
        "agent.num_actor_batches=2",
        f"agent.num_actor_cpus={procs}",
    ]
    if task == "breakout":
        return [
            f"agent={agent}",
            "env=breakout",
            "agent.network=impala_shallow",
            "env.options.repeat_action_probability=0",
            *shape,
        ]
    if task == "minatar":
        return [f"agent={agent}", "env=minatar-breakout", *shape]
    if task == "cartpole":
        return [f"agent={agent}", "env=cartpole", *shape]
    raise ValueError(f"unknown task {task!r}")


def moolib_throughput(
    task: str,
    envs: int,
    procs: int,
    warmup: float,
    seconds: float,
    limits: Limits = Limits(),
    agent: str = "vtrace",
) -> dict:
    """moolib-run's actors' env steps/s over at least ``seconds``, from the first
    logs.tsv row ``warmup`` seconds after its first steps (as the runners count from
    their first env step) to the last, with its learned SPS beside. Waits for the rows
    however loaded the machine is (up to ``STARTUP_ALLOWANCE`` more seconds)."""
    from importlib.metadata import version

    bt = bench_train()
    num = bt._num
    with tempfile.TemporaryDirectory() as savedir, tempfile.TemporaryFile() as err:
        overrides = moolib_overrides(task, envs, procs, agent)
        cmd = bt._run_command([*overrides, "device=cpu"], savedir)
        env = dict(os.environ, WANDB_MODE="disabled")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        logs = Path(savedir) / "logs.tsv"
        deadline = time.monotonic() + limits.first_step_s + warmup + seconds
        watchdog = Watchdog(limits)
        first_steps: float | None = None
        timed: list[dict] = []
        why = None
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)
                rows = [r for r in bt._read_rows(logs) if num(r, "step") > 0]
                why = watchdog.check(int(num(rows[-1], "step")) if rows else 0)
                if why is not None:
                    break
                if not rows:
                    continue
                if first_steps is None:
                    first_steps = num(rows[0], "time")
                timed = [r for r in rows if num(r, "time") >= first_steps + warmup]
                if len(timed) >= 2 and num(timed[-1], "time") - num(timed[0], "time") >= seconds:
                    break
        finally:
            bt._interrupt(proc)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    result: dict[str, Any] = {
        "version": version("moolib"),
        "command": "moolib-run " + " ".join(cmd[3:]),
    }
    if len(timed) < 2:
        status = why or f"exit {proc.returncode}"
        result["error"] = f"no timed rows from {result['command']} ({status}):\n{stderr[-2000:]}"
        return result
    first, last = timed[0], timed[-1]
    span = num(last, "time") - num(first, "time")
    # Each row's env_sps is over the interval since the row before it.
    result["env_sps"] = (
        sum(
            num(r, "env_sps") * (num(r, "time") - num(prev, "time"))
            for prev, r in zip(timed[:-1], timed[1:], strict=True)
        )
        / span
    )
    result["learned_sps"] = (num(last, "step") - num(first, "step")) / span
    result["startup_s"] = first_steps
    return result


def rolling_score(rows: list[dict]) -> float:
    """The mean return of the last ``SCORE_WINDOW`` episodes (or a few more: whole log
    rows) from moolib-run's logs.tsv rows, each row a mean over its episodes; nan
    before that many episodes finished."""
    num = bench_train()._num
    total, weight = 0.0, 0
    for row in reversed(rows):
        n = num(row, "episodes")
        if n == n and n > 0:
            total += num(row, "mean_episode_return") * n
            weight += n
        if weight >= SCORE_WINDOW:
            return total / weight
    return float("nan")


def moolib_score(
    task: str,
    envs: int,
    procs: int,
    seed: int,
    cap: float,
    limits: Limits = Limits(),
    agent: str = "vtrace",
    extra: tuple[str, ...] = (),
) -> dict:
    """One moolib-run on ``task`` (with the overrides ``extra``) until its score reaches
    the target or ``cap`` seconds have passed since its start; wall-clock from the
    start, env steps learned from, and the score's curve as the runners record it."""
    bt = bench_train()
    target = SCORE_TARGETS[task]
    result: dict[str, Any] = {"reached": False, "best_score": None}
    with tempfile.TemporaryDirectory() as savedir, tempfile.TemporaryFile() as err:
        overrides = [*moolib_overrides(task, envs, procs, agent), *extra]
        cmd = bt._run_command([*overrides, f"seed={seed}"], savedir)
        cmd = [c if not c.startswith("log_interval=") else "log_interval=1" for c in cmd]
        start = time.monotonic()
        env = dict(os.environ, WANDB_MODE="disabled")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        logs = Path(savedir) / "logs.tsv"
        watchdog = Watchdog(limits)
        curve: list[list[float]] = result.setdefault("curve", [])
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                rows = [r for r in bt._read_rows(logs) if r.get("step")]
                why = watchdog.check(int(bt._num(rows[-1], "step")) if rows else 0)
                if why is not None:
                    result["error"] = f"moolib-run {why}"
                    break
                score = rolling_score(rows)
                now = time.monotonic() - start
                if score == score:
                    best = result["best_score"]
                    result["best_score"] = score if best is None else max(best, score)
                    if not curve or now - curve[-1][0] >= runners_common().CURVE_EVERY:
                        curve.append([round(now, 1), int(bt._num(rows[-1], "step")), score])
                result.update(
                    steps=int(bt._num(rows[-1], "step")) if rows else 0,
                    seconds=time.monotonic() - start,
                    score=score,
                )
                if score >= target:
                    result["reached"] = True
                    break
                if time.monotonic() - start >= cap:
                    break
        finally:
            bt._interrupt(proc)
        if "steps" not in result or "error" in result:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-2000:]
            result["error"] = f"{result.get('error', f'exit {proc.returncode}')}\n{tail}"
    result["command"] = "moolib-run " + " ".join(cmd[3:])
    return result


# -- the peers' side -----------------------------------------------------------------------


def run_peer(
    python: str,
    row: Row,
    runner_args: list[str],
    timeout: float,
    limits: Limits = Limits(),
) -> dict:
    """Runs ``row``'s runner with ``python`` and returns its result line, parsed; on a
    failure, ``{"error": ...}`` with why and the end of its output. A runner that takes
    no env step within ``limits`` (see ``Watchdog``) or has not answered in
    ``timeout`` seconds is stopped then, not waited for. The runner's whole
    process group (its env workers too) is killed once it has answered."""
    assert row.runner is not None
    common = runners_common()
    with (
        tempfile.TemporaryDirectory() as counters,
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile() as err,
    ):
        cmd = [python, str(RUNNERS / row.runner), *runner_args, "--algo", row.runner_algo]
        cmd += ["--dir", counters]
        for key, value in row.settings:
            cmd += ["--set", f"{key}={json.dumps(value)}"]
        proc = subprocess.Popen(
            cmd, cwd=RUNNERS, stdout=out, stderr=err, text=True, start_new_session=True
        )
        watchdog = Watchdog(limits)
        deadline = time.monotonic() + timeout
        why = None
        try:
            # The runner prints its result line and exits.
            while proc.poll() is None:
                time.sleep(0.5)
                why = watchdog.check(common.count_steps(Path(counters)))
                if why is None and time.monotonic() > deadline:
                    why = f"had not answered in {timeout:.0f} s"
                if why is not None:
                    break
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        text = out.read()
        result = None
        for line in text.splitlines():
            if line.startswith(RESULT_PREFIX):
                result = json.loads(line[len(RESULT_PREFIX) :])
        if result is None:
            err.seek(0)
            tail = err.read().decode(errors="replace")[-3000:]
            status = why or f"exit {proc.returncode}"
            return {"error": f"{' '.join(cmd)}: {status}\n{text[-1000:]}{tail}"}
    return result


# -- the tables ----------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None or value != value:
        return "-"
    return f"{value:,.{digits}f}"


def _baseline(rows: list[Row], row: Row) -> Row | None:
    """moolib's row of ``row``'s algorithm class, if there is one."""
    return next((r for r in rows if r.lib == "moolib" and r.klass == row.klass), None)


def throughput_table(rows: list[tuple[Row, list[float]]], limits: list[float]) -> str:
    """The throughput table (markdown): per row its class, the median env steps/s over
    its rounds, the EnvPool limit's median beside it, and moolib's row of the same
    class over it ("-" where moolib has no row of that class: another algorithm)."""
    limit = statistics.median(limits) if limits else float("nan")
    medians = {r: statistics.median(v) if v else float("nan") for r, v in rows}
    listed = [r for r, _ in rows]
    lines = [
        "| library | algorithm | class | env steps/s (median) | rounds | EnvPool limit "
        "| / limit | moolib / this |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, values in rows:
        base = _baseline(listed, row)
        ratio = medians[base] / medians[row] if base is not None else None
        lines.append(
            f"| {row.lib} | {row.algo} | {row.klass} | {_fmt(medians[row])} | {len(values)} "
            f"| {_fmt(limit)} | {_fmt(medians[row] / limit, 3)} | {_fmt(ratio, 2)} |"
        )
    return "\n".join(lines)


def round_ratios(rounds: list[dict[Row, float]], rows: list[Row]) -> list[str]:
    """For each moolib row: its env steps/s over the best peer of its class in each
    round (the like-for-like figure, measured minutes apart), with the median and the
    range over the rounds in which both ran."""
    lines = []
    for base in (r for r in rows if r.lib == "moolib"):
        peers = [r for r in rows if r.klass == base.klass and r.lib != "moolib"]
        ratios = []
        for figures in rounds:
            best = max((figures[r] for r in peers if r in figures), default=None)
            if base in figures and best:
                ratios.append(figures[base] / best)
        if not ratios:
            lines.append(f"moolib {base.algo} / best {base.klass} peer: no round with both")
            continue
        lines.append(
            f"moolib {base.algo} / best {base.klass} peer, per round: "
            + ", ".join(f"{x:.2f}x" for x in ratios)
            + f"; median {statistics.median(ratios):.2f}x, range {min(ratios):.2f}-"
            f"{max(ratios):.2f}x over {len(ratios)} rounds"
        )
    return lines


def _median_to_target(runs: list[dict], key: str) -> float | None:
    """The median over all runs of ``key`` at the target (of an even number, the higher
    middle one), a run that did not reach it counting as more than any that did; None
    when that median run did not reach it."""
    values = [r[key] if r.get("reached") else float("inf") for r in runs]
    if not values:
        return None
    median = statistics.median_high(values)
    return None if median == float("inf") else median


def score_table(rows: list[tuple[Row, list[dict]]], task: str, cap: float) -> str:
    """The time-to-score table (markdown): per row the runs that reached the target
    within the cap, the median wall-clock seconds and env steps to the target over all
    runs (a run that did not reach it counting as longer than any that did: ``> cap``
    when the median run did not), and the median and the highest of the runs' best
    scores."""
    lines = [
        f"| library | algorithm | task | target | reached (cap {cap:.0f} s) | median seconds "
        "| median env steps | median best score | best score |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row, runs in rows:
        ok = [r for r in runs if r.get("reached")]
        best = [r["best_score"] for r in runs if r.get("best_score") is not None]
        seconds = _median_to_target(runs, "seconds")
        late = f"> {cap:.0f}" if runs and seconds is None else "-"
        lines.append(
            f"| {row.lib} | {row.algo} | {task} | {SCORE_TARGETS[task]:g} | "
            f"{len(ok)}/{len(runs)} | "
            f"{_fmt(seconds) if seconds is not None else late} | "
            f"{_fmt(_median_to_target(runs, 'steps'))} | "
            f"{_fmt(statistics.median(best) if best else None, 2)} | "
            f"{_fmt(max(best) if best else None, 2)} |"
        )
    return "\n".join(lines)


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the first markdown table in ``text``, as dicts keyed by its header."""
    lines = [line.strip() for line in text.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("| library")), None)
    if start is None:
        return []
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == len(header):
            rows.append(dict(zip(header, cells, strict=True)))
    return rows


# -- the command ---------------------------------------------------------------------------


def row_name(row: Row) -> str:
    """How ``--rows`` names a row: ``lib:algo``."""
    return f"{row.lib}:{row.algo}"


def available(args: argparse.Namespace) -> list[Row]:
    """The rows to run: those ``--rows`` names (all by default), moolib's and each
    peer's whose Python was given and exists; says which are skipped and why."""
    names = [n.strip() for n in args.rows.split(",")] if args.rows else None
    unknown = set(names or ()) - {row_name(r) for r in ROWS}
    if unknown:
        known = ", ".join(row_name(r) for r in ROWS)
        raise SystemExit(f"--rows: no row {sorted(unknown)}; the rows are: {known}")
    rows = []
    for row in ROWS:
        if names is not None and row_name(row) not in names:
            continue
        if row.python_flag is None:
            rows.append(row)
            continue
        python = getattr(args, row.python_flag.lstrip("-").replace("-", "_"))
        if python is None:
            print(f"{row.lib} {row.algo}: skipped (no {row.python_flag} given)", flush=True)
        elif not Path(python).exists():
            print(f"{row.lib} {row.algo}: skipped ({row.python_flag} {python} does not exist)")
        else:
            rows.append(row)
    return rows


def run_limits(args: argparse.Namespace) -> Limits:
    """The command line's ``Limits``."""
    return Limits(args.first_step_seconds, args.stall_seconds)


def _python(args: argparse.Namespace, row: Row) -> str:
    assert row.python_flag is not None
    return getattr(args, row.python_flag.lstrip("-").replace("-", "_"))


def _versions(result: dict) -> str:
    keys = ("version", "torch", "tensordict", "ray", "gymnasium", "ale_py")
    return ", ".join(f"{k} {result[k]}" for k in keys if result.get(k))


def moolib_commit() -> str:
    """The commit of the moolib checkout this bench runs from, with ``+dirty`` when its
    tracked files differ from it; ``unknown`` outside a git checkout."""
    repo = str(HERE.parent)
    try:
        head = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


class CpuGroup:
    """A CPU-accounting cgroup (v1's cpuacct, or a v2 group's cpu.stat): the CPU seconds
    every process that was ever in it used, those that ended included."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version

    def seconds(self) -> float:
        """The group's CPU seconds so far."""
        if self.version == 1:
            return int((self.path / "cpuacct.usage").read_text()) / 1e9
        for line in (self.path / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value) / 1e6
        raise OSError(f"{self.path}/cpu.stat has no usage_usec")


def own_cpu_group() -> CpuGroup | None:
    """A cgroup of this process's own (its children inherit it), made under the cgroup
    filesystem's CPU accounting and removed when the process exits; None where none
    can be made (not root, no such filesystem)."""
    roots = [
        (Path("/sys/fs/cgroup/cpuacct"), 1),
        (Path("/sys/fs/cgroup/unified"), 2),
        (Path("/sys/fs/cgroup"), 2),
    ]
    for root, version in roots:
        if not (root / "cgroup.procs").exists():
            continue
        if version == 2 and not (root / "cgroup.controllers").exists():
            continue
        path = root / f"moolib-bench-{os.getpid()}"
        try:
            path.mkdir(exist_ok=True)
            (path / "cgroup.procs").write_text(str(os.getpid()))
            group = CpuGroup(path, version)
            group.seconds()
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            continue
        atexit.register(_leave_cpu_group, root, path)
        return group
    return None


def _leave_cpu_group(root: Path, path: Path) -> None:
    # A cgroup is removed once empty: this process goes back to the root's (its runs
    # have ended by now).
    with contextlib.suppress(OSError):
        (root / "cgroup.procs").write_text(str(os.getpid()))
        path.rmdir()


class OtherLoad:
    """The share of the machine's CPU that processes other than this bench and the runs
    it started took: /proc/stat's busy time less the CPU of this bench's processes.
    The load average cannot say it: it counts the run itself, and a run's load lingers
    in it for minutes after the run ends.

    The bench's processes are counted by a CPU-accounting cgroup of its own, which its
    runs and everything they start inherit (``own_cpu_group``): a peer's helper
    processes that their runner never reaps (Ray's raylet, GCS and workers, which RLlib
    starts) count as the bench's, which the CPU of reaped children alone would miss
    and call others'. Where no cgroup can be made (not root, no cgroup filesystem), the
    bench's own CPU and its reaped children's stand in."""

    def __init__(self) -> None:
        self.cores = len(os.sched_getaffinity(0))
        self.tick = os.sysconf("SC_CLK_TCK")
        self.group = own_cpu_group()

    def mark(self) -> tuple[float, float, float]:
        """The machine's busy CPU seconds, this bench's own, and the time: now."""
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = (sum(fields[:8]) - fields[3] - fields[4]) / self.tick  # less idle, iowait
        if self.group is not None:
            own = self.group.seconds()
        else:
            t = os.times()
            own = t.user + t.system + t.children_user + t.children_system
        return busy, own, time.monotonic()

    def share(self, since: tuple[float, float, float]) -> float:
        """Of all cores' time since ``mark()`` gave ``since``, the share others took."""
        busy, own, now = self.mark()
        elapsed = max(now - since[2], 1e-6) * self.cores
        return max(0.0, (busy - since[0]) - (own - since[1])) / elapsed

    def wait_quiet(self, limit: float, window: float = 5.0, patience: float = 600.0) -> float:
        """Waits until others took at most ``limit`` over ``window`` seconds, for up to
        ``patience`` seconds (then runs anyway: the run's own share tells); the last
        window's share."""
        deadline = time.monotonic() + patience
        while True:
            since = self.mark()
            time.sleep(window)
            share = self.share(since)
            if share <= limit or time.monotonic() >= deadline:
                return share
            print(f"  waiting for a quiet machine: others took {share:.0%} of the CPU", flush=True)


class Results:
    """The runs of one comparison, one JSON line each (``--results``): what was run,
    its result, the moolib commit, when, and the load average before and after it.
    A run the file holds without an error is taken from it, not run again, so hours of
    runs resume after a stop (a failed one is run again); a file holding another
    commit's runs is refused: one commit for the whole table.

    With ``max_others`` (a share of the CPU), each run first waits for the machine to
    be that quiet, and a run during which other processes took more is recorded as
    ``rerun`` and run again, up to ``reruns`` times; the last try is kept, marked
    ``loaded`` if it was loaded too."""

    def __init__(
        self,
        path: str | None,
        commit: str,
        max_others: float | None = None,
        reruns: int = 2,
        load: OtherLoad | None = None,
    ) -> None:
        self.path = Path(path) if path else None
        self.commit = commit
        self.max_others = max_others
        self.reruns = reruns
        self.load = load or OtherLoad()
        self.done: dict[str, dict] = {}
        if self.path is None or not self.path.exists():
            return
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue  # cut short: the bench was killed while writing it
            if entry.get("commit") != commit:
                raise SystemExit(
                    f"{self.path} holds runs of moolib {entry.get('commit')}, and this is "
                    f"{commit}: a comparison is of one commit; give another --results file"
                )
            if "error" not in entry["result"] and not entry.get("rerun"):
                self.done[entry["key"]] = entry["result"]

    def run(self, key: dict[str, Any], measure: Any) -> tuple[dict, bool]:
        """``key``'s result and whether it came from the file; else ``measure()``'s,
        appended to the file (run again while other processes loaded the machine)."""
        name = json.dumps(key, sort_keys=True)
        if name in self.done:
            return self.done[name], True
        for attempt in range(self.reruns + 1):
            entry = self._measure(name, key, measure)
            others = entry.get("others_cpu_share", 0.0)
            loaded = self.max_others is not None and others > self.max_others
            rerun = loaded and attempt < self.reruns and "error" not in entry["result"]
            if rerun:
                entry["rerun"] = True
                print(f"  others took {others:.0%} of the CPU during that run: again", flush=True)
            elif loaded:
                entry["loaded"] = True
            self._append(entry)
            if not rerun:
                break
        result = entry["result"]
        if "error" not in result:
            self.done[name] = result
        return result, False

    def _measure(self, name: str, key: dict[str, Any], measure: Any) -> dict:
        entry: dict[str, Any] = {"key": name, **key}
        if self.max_others is not None:
            entry["others_cpu_share_before"] = round(self.load.wait_quiet(self.max_others), 3)
        before, started, since = os.getloadavg(), time.time(), self.load.mark()
        entry["result"] = measure()
        entry.update(
            commit=self.commit,
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            wall_s=round(time.time() - started, 1),
            load_before=[round(x, 2) for x in before],
            load_after=[round(x, 2) for x in os.getloadavg()],
            others_cpu_share=round(self.load.share(since), 3),
            host=platform.node(),
            cores=len(os.sched_getaffinity(0)),
        )
        return entry

    def _append(self, entry: dict) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")


def _row_key(row: Row) -> dict[str, Any]:
    return {"lib": row.lib, "algo": row.algo, "settings": dict(row.settings)}


def _runner_args(args: argparse.Namespace, task: str, mode: str, seed: int) -> list[str]:
    common = ["--task", task, "--mode", mode, "--envs", str(args.envs)]
    common += ["--procs", str(args.procs), "--seed", str(seed)]
    if mode == "throughput":
        return [*common, "--warmup", str(args.warmup), "--seconds", str(args.seconds)]
    return [*common, "--target", str(SCORE_TARGETS[task]), "--cap", str(args.score_cap)]


def measure_throughput(args: argparse.Namespace, row: Row, task: str, rnd: int) -> dict:
    """One throughput run of ``row``."""
    if row.lib == "moolib":
        return moolib_throughput(
            task,
            args.envs,
            args.procs,
            args.warmup,
            args.seconds,
            run_limits(args),
            row.runner_algo,
        )
    return run_peer(
        _python(args, row),
        row,
        _runner_args(args, task, "throughput", rnd),
        args.first_step_seconds + args.warmup + args.seconds,
        run_limits(args),
    )


# The tuning sweep: the same for every library, factors of its own learning rate and
# batch size (env steps per update, or the library's nearest key: each runner says).
SWEEP = tuple((lr, batch) for lr in (0.5, 1.0, 2.0) for batch in (0.5, 1.0))


def moolib_scaled(row: Row, task: str, envs: int, procs: int, lr: float, batch: float) -> tuple:
    """moolib-run's overrides for the sweep's factors: its learning rate and its
    learner batch (unrolls per update, the virtual batch with it where they are equal,
    as with one peer)."""
    if lr == 1 and batch == 1:
        return ()
    cfg = bench_train()._config(moolib_overrides(task, envs, procs, row.runner_algo))
    extra = [f"agent.optimizer.learning_rate={cfg.agent.optimizer.learning_rate * lr}"]
    if batch != 1:
        size = max(1, round(cfg.agent.batch_size * batch))
        extra.append(f"agent.batch_size={size}")
        if cfg.agent.virtual_batch_size == cfg.agent.batch_size:
            extra.append(f"agent.virtual_batch_size={size}")
    return tuple(extra)


def measure_score(
    args: argparse.Namespace, row: Row, seed: int, lr: float = 1.0, batch: float = 1.0
) -> dict:
    """One time-to-a-score run of ``row``, its learning rate and batch size scaled by
    ``lr`` and ``batch`` (the tuning sweep's factors)."""
    task = args.score_task
    if row.lib == "moolib":
        extra = moolib_scaled(row, task, args.envs, args.procs, lr, batch)
        return moolib_score(
            task,
            args.envs,
            args.procs,
            seed,
            args.score_cap,
            run_limits(args),
            row.runner_algo,
            extra,
        )
    scales = ["--lr-scale", str(lr), "--batch-scale", str(batch)]
    return run_peer(
        _python(args, row),
        row,
        [*_runner_args(args, task, "score", seed), *scales],
        args.first_step_seconds + args.score_cap,
        run_limits(args),
    )


def throughput(args: argparse.Namespace, rows: list[Row], task: str, results: Results) -> str:
    """Runs every row ``args.rounds`` times, interleaved, and the EnvPool limit once per
    round; prints each run as it ends and returns the table, then moolib's ratio to the
    best peer of its class per round."""
    values: dict[Row, list[float]] = {r: [] for r in rows}
    limits: list[float] = []
    rounds: list[dict[Row, float]] = []
    bt = bench_train()
    pool_cfg = bt._config(moolib_overrides(task, args.envs, args.procs))
    shared = {"task": task, "envs": args.envs, "procs": args.procs}
    timing = {"warmup": args.warmup, "seconds": args.seconds}
    for rnd in range(args.rounds):
        figures: dict[Row, float] = {}
        order = rows[rnd % len(rows) :] + rows[: rnd % len(rows)]
        for row in order:
            key = {"kind": "throughput", **shared, **timing, "round": rnd, **_row_key(row)}
            res, cached = results.run(
                key, functools.partial(measure_throughput, args, row, task, rnd)
            )
            source = " (from the results file)" if cached else ""
            # A window without a step (a library that stalled after its warm-up, shorter
            # than the stall bound) is a failed run, not a figure of 0.
            if "error" in res or not res.get("env_sps", 0) > 0:
                why = res.get("error") or f"no env step in its timed window: {res}"
                print(f"  round {rnd + 1} {row.lib} {row.algo}: FAILED\n{why}")
                continue
            values[row].append(res["env_sps"])
            figures[row] = res["env_sps"]
            extra = {k: v for k, v in res.items() if k not in ("env_sps", "task", "mode")}
            print(
                f"  round {rnd + 1} {row.lib} {row.algo}: {res['env_sps']:,.0f} env steps/s "
                f"({_versions(res) or ''}; {json.dumps(extra)}){source}",
                flush=True,
            )
        key = {"kind": "envpool", **shared, "seconds": args.envpool_seconds, "round": rnd}
        pool, _ = results.run(
            key, lambda: {"env_sps": bt.envpool_limit(pool_cfg, args.envpool_seconds)}
        )
        limits.append(pool["env_sps"])
        rounds.append(figures)
        print(f"  round {rnd + 1} EnvPool limit: {pool['env_sps']:,.0f} env steps/s", flush=True)
    table = throughput_table([(r, values[r]) for r in rows], limits)
    return "\n".join([table, "", *round_ratios(rounds, rows)])


def _ranking(res: dict) -> tuple[float, float]:
    """Orders runs best first: those that reached the target, sooner first, then the
    others by their best score."""
    if res.get("reached"):
        return (0.0, res["seconds"])
    best = res.get("best_score")
    return (1.0, -best if best is not None else float("inf"))


def _score_run(
    args: argparse.Namespace,
    results: Results,
    row: Row,
    seed: int,
    scales: tuple[float, float],
    label: str,
) -> dict:
    """One score run through ``results``, printed as it ends."""
    shared = {"task": args.score_task, "cap": args.score_cap, "envs": args.envs}
    key = {"kind": "score", **shared, "procs": args.procs, "seed": seed, **_row_key(row)}
    key.update(lr_scale=scales[0], batch_scale=scales[1])
    res, cached = results.run(key, functools.partial(measure_score, args, row, seed, *scales))
    source = " (from the results file)" if cached else ""
    name = f"  {label} seed {seed} {row.lib} {row.algo} (lr x{scales[0]:g}, batch x{scales[1]:g})"
    if "error" in res:
        print(f"{name}: FAILED\n{res['error']}", flush=True)
    else:
        print(
            f"{name}: reached={res.get('reached')} seconds={res.get('seconds', 0):.0f} "
            f"steps={res.get('steps', 0):,} score={res.get('score')} "
            f"best={res.get('best_score')}{source}",
            flush=True,
        )
    return res


def tune(args: argparse.Namespace, rows: list[Row], results: Results) -> dict[Row, tuple]:
    """The sweep on the tuning seed, the same for every row (interleaved: each setting
    of every row, then the next setting); each row's best setting by ``_ranking``."""
    runs: dict[Row, list[tuple[tuple[float, float], dict]]] = {r: [] for r in rows}
    for scales in SWEEP:
        for row in rows:
            res = _score_run(args, results, row, args.tuning_seed, scales, "tuning")
            if "error" not in res:
                runs[row].append((scales, res))
    picked = {}
    for row in rows:
        if runs[row]:
            scales, _ = min(runs[row], key=lambda item: _ranking(item[1]))
            picked[row] = scales
            print(f"  tuned {row.lib} {row.algo}: lr x{scales[0]:g}, batch x{scales[1]:g}")
        else:
            print(f"  tuned {row.lib} {row.algo}: every sweep run failed")
    return picked


def scores(args: argparse.Namespace, rows: list[Row], results: Results) -> str:
    """Time to a score on the held-out seeds (1 to ``--seeds``; the tuning seed is
    another), each row with its published settings, and with ``--tune`` also with the
    setting its sweep picked; seeds interleaved. Prints each run and returns the
    tables. Each run goes into ``results`` as it ends; runs already there are taken
    from it."""
    seeds = range(1, args.seeds + 1)
    picked = tune(args, rows, results) if args.tune else {}
    tables = []
    panels: dict[str, dict[Row, list[dict]]] = {}
    for label, choice in (("published", {r: (1.0, 1.0) for r in rows}), ("tuned", picked)):
        if not choice:
            continue
        runs: dict[Row, list[dict]] = panels.setdefault(label, {r: [] for r in rows})
        for seed in seeds:
            for row in (r for r in rows if r in choice):
                res = _score_run(args, results, row, seed, choice[row], label)
                if "error" not in res:
                    runs[row].append(res)
        title = f"{label} settings" + (" (the sweep's pick per row)" if label == "tuned" else "")
        chosen = [(r, runs[r]) for r in rows if r in choice]
        table = score_table(chosen, args.score_task, args.score_cap)
        tables.append(f"{title}, held-out seeds {seeds[0]}-{seeds[-1]}:\n{table}")
    if args.plot:
        plot_curves(panels, args.score_task, SCORE_TARGETS[args.score_task], Path(args.plot))
        tables.append(f"curves: {args.plot}")
    return "\n\n".join(tables)


def plot_curves(
    panels: dict[str, dict[Row, list[dict]]], task: str, target: float, path: Path
) -> None:
    """The score runs' curves as a PNG: a panel per setting (published, tuned), per row
    the median over its seeds of the score against wall-clock seconds (each seed's
    curve faint), the target as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    for ax, (label, runs) in zip(axes[0], panels.items(), strict=True):
        for i, (row, seeds) in enumerate(runs.items()):
            curves = [np.asarray(r["curve"], dtype=float) for r in seeds if r.get("curve")]
            if not curves:
                continue
            color = f"C{i % 10}"
            end = max(c[-1, 0] for c in curves)
            grid = np.linspace(0.0, end, 200)
            # A run that stopped (reached the target) holds its last score after.
            held = [np.interp(grid, c[:, 0], c[:, 2], left=np.nan) for c in curves]
            for c in curves:
                ax.plot(c[:, 0], c[:, 2], color=color, alpha=0.2, linewidth=0.8)
            with warnings.catch_warnings():  # before any seed's first point: all nan
                warnings.simplefilter("ignore", RuntimeWarning)
                median = np.nanmedian(np.vstack(held), axis=0)
            ax.plot(grid, median, color=color, label=f"{row.lib} {row.algo}")
        ax.axhline(target, color="black", linestyle=":", linewidth=1)
        ax.set_title(f"{task}: {label} settings, median of held-out seeds")
        ax.set_xlabel("wall-clock seconds from the start")
        ax.set_ylabel(f"mean return of the last {runners_common().SCORE_WINDOW} episodes")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def check(args: argparse.Namespace, rows: list[Row]) -> int:
    """A few seconds of CartPole per available library; the table must parse back with a
    positive figure in every row. Returns the exit status."""
    args.rounds, args.warmup, args.seconds, args.envpool_seconds = 1, 3.0, 6.0, 2.0
    table = throughput(args, rows, "cartpole", Results(None, moolib_commit()))
    print(table, flush=True)
    parsed = parse_table(table)
    bad = [
        r["library"] + " " + r["algorithm"]
        for r in parsed
        if not _positive(r["env steps/s (median)"])
    ]
    if len(parsed) != len(rows) or bad or not _positive(parsed[0]["EnvPool limit"]):
        print(f"check FAILED: {len(parsed)} rows parsed of {len(rows)}; no figure: {bad}")
        return 1
    print(f"check passed: {len(parsed)} rows, each with a figure")
    return 0


def _positive(cell: str) -> bool:
    try:
        return float(cell.replace(",", "")) > 0
    except ValueError:
        return False


EPILOG = """\
The peers' venvs: `bash bench/peers/setup.sh [DIR]` builds one per library
(default DIR: ~/moolib-peer-venvs) from the lockfiles in bench/peers/locks/, and
prints the --...-python flags to give here. This bench itself runs under moolib's
Python (the venv moolib is installed in): moolib's side is moolib-run from that
venv, each peer's side a runner (bench/peers/<lib>_runner.py) that the bench
starts with that peer's Python. A peer whose Python is not given is skipped.

Every run goes into --results (JSON lines: the run, its result, the moolib commit,
the load average before and after, and the share of the CPU other processes took
during it); give a file under bench/results/ to keep the evidence with the figures.
The machine must be quiet: each run waits for other processes to take under
--max-others of the CPU, and one during which they took more is run again. Runs
already in the file are not run again (a failed one is), so a long comparison
resumes after a stop; a file of another moolib commit is refused.

Examples:
  python bench/peers.py --check --sb3-python ~/moolib-peer-venvs/sb3/bin/python \\
      --pufferlib-python ~/moolib-peer-venvs/pufferlib/bin/python
  python bench/peers.py --only throughput --rounds 5 --results bench/results/peers.jsonl \\
      --sample-factory-python ~/moolib-peer-venvs/sf/bin/python ...
"""


def main() -> None:
    """The command."""
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag in (
        "--sample-factory-python",
        "--rllib-python",
        "--torchrl-python",
        "--sb3-python",
        "--pufferlib-python",
    ):
        p.add_argument(flag, default=None, help="that library's venv's Python")
    p.add_argument("--check", action="store_true", help="a few seconds of CartPole each")
    p.add_argument(
        "--first-step-seconds",
        type=float,
        default=STARTUP_ALLOWANCE,
        help="a run that takes no env step this long after its start is stopped and "
        "reported; the bench goes on with the next",
    )
    p.add_argument(
        "--stall-seconds",
        type=float,
        default=STALL_ALLOWANCE,
        help="likewise a run that takes no env step this long after its last one",
    )
    p.add_argument("--only", choices=("throughput", "score"), default=None)
    p.add_argument(
        "--rows",
        default=None,
        help="comma-separated rows to run, as lib:algo (e.g. 'moolib:V-trace,"
        "stable-baselines3:A2C'); all by default",
    )
    p.add_argument("--rounds", type=int, default=5, help="throughput rounds, interleaved")
    p.add_argument("--warmup", type=float, default=20.0, help="untimed stepping per run")
    p.add_argument("--seconds", type=float, default=30.0, help="timed stepping per run")
    p.add_argument("--envpool-seconds", type=float, default=10.0)
    p.add_argument("--envs", type=int, default=8, help="envs in all")
    p.add_argument("--procs", type=int, default=2, help="env processes")
    p.add_argument("--seeds", type=int, default=5, help="held-out seeds of the score: 1 to SEEDS")
    p.add_argument(
        "--tune",
        action="store_true",
        help="first sweep each row's learning rate and batch size (x0.5, x1, x2 and x0.5, "
        "x1) on --tuning-seed, then score the pick on the held-out seeds too",
    )
    p.add_argument("--tuning-seed", type=int, default=0, help="the sweep's seed (not held out)")
    p.add_argument("--plot", default=None, help="a PNG for the score runs' curves")
    p.add_argument("--score-task", choices=tuple(SCORE_TARGETS), default="minatar")
    p.add_argument("--score-cap", type=float, default=240.0, help="seconds per run at most")
    p.add_argument(
        "--results",
        default=None,
        help="the JSON-lines file every run is appended to (see below)",
    )
    p.add_argument(
        "--max-others",
        type=float,
        default=0.1,
        help="the share of the machine's CPU other processes may take during a run (0.1: "
        "10%%); each run waits (up to 10 minutes) for a machine that quiet, and a run "
        "during which others took more is run again (negative: no check)",
    )
    p.add_argument(
        "--reruns",
        type=int,
        default=2,
        help="how many times a run under load is run again; the last try is kept, marked loaded",
    )
    args = p.parse_args()
    # Killed (kill, a job's end), it stops as on Ctrl-C: each runner's process
    # group and moolib-run are stopped on the way out, not left stepping.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    commit = moolib_commit()
    print(
        f"{platform.node()}: {len(os.sched_getaffinity(0))} cores, {platform.machine()}, "
        f"Python {platform.python_version()}, moolib {commit}, "
        f"load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = available(args)
    if args.check:
        sys.exit(check(args, rows))
    others = args.max_others if args.max_others >= 0 else None
    results = Results(args.results, commit, others, args.reruns)
    if args.only in (None, "throughput"):
        print(f"Throughput: Breakout, {args.envs} envs on {args.procs} env processes, CPU")
        print(throughput(args, rows, "breakout", results), flush=True)
    if args.only in (None, "score"):
        print(f"Time to a score: {args.score_task}, cap {args.score_cap:.0f} s per run")
        print(scores(args, rows, results), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
