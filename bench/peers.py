"""moolib beside the libraries a researcher would pick instead, on the same work.

    python bench/peers.py [--sample-factory-python PATH] [--rllib-python PATH]
                          [--torchrl-python PATH] [--sb3-python PATH]
                          [--rounds 3] [--warmup 20] [--seconds 30] [--envs 8] [--procs 2]
                          [--seeds 3] [--score-cap 240] [--score-task minatar]
                          [--only throughput|score] [--results runs.jsonl]
    python bench/peers.py --check [--... -python PATH]

Installs nothing: each peer runs in its own virtual environment, whose Python is
given (docs/benchmarks.md says how each venv was made, versions pinned); a peer
whose Python is not given is skipped, and the output says so. Each peer's side is
a small runner, ``bench/peers/<lib>_runner.py``, that this bench launches with that
Python; the runners share ``bench/peers/common.py``: the same envs (gymnasium's
Atari preprocessing, as moolib-run's env=breakout) and the same counting of env
steps and episodes, in the env instances themselves, whichever process steps them.

Two figures per library, each on the same machine in the same call:

- *Throughput*: Breakout from pixels (ALE, frameskip 4, 84x84 grey, 4 stacked
  frames, no sticky actions), ``--envs`` envs on ``--procs`` env processes (SB3's
  SubprocVecEnv can only run one env per process: it gets ``--envs`` processes),
  the shallow IMPALA network for all, CPU only; env steps/s over ``--seconds``
  after ``--warmup`` seconds of stepping, median over ``--rounds`` rounds, each
  round running every library once (the order rotating), beside the EnvPool
  limit of the same processes (moolib.EnvPool with that many envs on that many
  processes stepped with random actions and nothing else: bench/train.py's
  ``envpool_limit``), measured once per round.
- *Time to a score*: MinAtar Breakout (``--score-task cartpole``: CartPole-v1)
  until the mean return of the last 100 finished episodes reaches 10 (CartPole:
  475), wall-clock from the process's start and env steps, ``--seeds`` seeds
  each, runs capped at ``--score-cap`` seconds; seeds interleave like rounds.
  ``--results FILE`` keeps each finished run (one JSON line) and takes the runs
  already there instead of running them again: hours of runs resume after a stop.

moolib's side is moolib-run (V-trace) with bench/train.py's helpers: its
throughput is its actors' env steps/s from its logs.tsv (as ``run_sps`` reads
them), the warm-up counted from its first steps as the runners count theirs.

``--check``: every available library for a few seconds of CartPole, then the
printed table is parsed back and every row must hold a positive figure; exits 1
otherwise.
"""

from __future__ import annotations

import argparse
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


@dataclass(frozen=True)
class Row:
    """One library and algorithm: moolib's (``python_flag`` None) or a peer's."""

    lib: str
    algo: str
    python_flag: str | None = None
    runner: str | None = None


ROWS = (
    Row("moolib", "V-trace"),
    Row("sample-factory", "APPO", "--sample-factory-python", "sample_factory_runner.py"),
    Row("rllib", "APPO", "--rllib-python", "rllib_runner.py"),
    Row("torchrl", "PPO", "--torchrl-python", "torchrl_runner.py"),
    Row("stable-baselines3", "PPO", "--sb3-python", "sb3_runner.py"),
    Row("stable-baselines3", "A2C", "--sb3-python", "sb3_runner.py"),
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


def moolib_overrides(task: str, envs: int, procs: int) -> list[str]:
    """moolib-run's overrides for ``task`` with ``envs`` envs (two batches, double
    buffered) on ``procs`` env processes, the shallow IMPALA network on Breakout."""
    if envs % 2:
        raise ValueError(f"--envs must be even (two batches of envs), got {envs}")
    shape = [
        f"agent.actor_batch_size={envs // 2}",
        "agent.num_actor_batches=2",
        f"agent.num_actor_cpus={procs}",
    ]
    if task == "breakout":
        return [
            "agent=vtrace",
            "env=breakout",
            "agent.network=impala_shallow",
            "env.options.repeat_action_probability=0",
            *shape,
        ]
    if task == "minatar":
        # The tuning file's learner batch is half an actor batch (16 of 32 envs);
        # kept so with fewer envs (conf/tuning/vtrace_minatar.yaml says why).
        learn = max(1, envs // 4)
        return [
            "agent=vtrace",
            "env=minatar-breakout",
            *shape,
            f"agent.batch_size={learn}",
            f"agent.virtual_batch_size={learn}",
        ]
    if task == "cartpole":
        return ["agent=vtrace", "env=cartpole", *shape]
    raise ValueError(f"unknown task {task!r}")


def moolib_throughput(
    task: str, envs: int, procs: int, warmup: float, seconds: float, limits: Limits = Limits()
) -> dict:
    """moolib-run's actors' env steps/s over at least ``seconds``, from the first
    logs.tsv row ``warmup`` seconds after its first steps (as the runners count from
    their first env step) to the last, with its learned SPS beside. Waits for the rows
    however loaded the machine is (up to ``STARTUP_ALLOWANCE`` more seconds)."""
    from importlib.metadata import version

    bt = bench_train()
    num = bt._num
    with tempfile.TemporaryDirectory() as savedir, tempfile.TemporaryFile() as err:
        cmd = bt._run_command([*moolib_overrides(task, envs, procs), "device=cpu"], savedir)
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
    task: str, envs: int, procs: int, seed: int, cap: float, limits: Limits = Limits()
) -> dict:
    """One moolib-run on ``task`` until its score reaches the target or ``cap`` seconds
    have passed since its start; wall-clock from the start, env steps learned from."""
    bt = bench_train()
    target = SCORE_TARGETS[task]
    result: dict[str, Any] = {"reached": False, "best_score": None}
    with tempfile.TemporaryDirectory() as savedir, tempfile.TemporaryFile() as err:
        cmd = bt._run_command([*moolib_overrides(task, envs, procs), f"seed={seed}"], savedir)
        cmd = [c if not c.startswith("log_interval=") else "log_interval=1" for c in cmd]
        start = time.monotonic()
        env = dict(os.environ, WANDB_MODE="disabled")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
        logs = Path(savedir) / "logs.tsv"
        watchdog = Watchdog(limits)
        try:
            while proc.poll() is None:
                time.sleep(0.5)
                rows = [r for r in bt._read_rows(logs) if r.get("step")]
                why = watchdog.check(int(bt._num(rows[-1], "step")) if rows else 0)
                if why is not None:
                    result["error"] = f"moolib-run {why}"
                    break
                score = rolling_score(rows)
                if score == score:
                    best = result["best_score"]
                    result["best_score"] = score if best is None else max(best, score)
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
        cmd = [python, str(RUNNERS / row.runner), *runner_args, "--algo", row.algo.lower()]
        cmd += ["--dir", counters]
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


def throughput_table(rows: list[tuple[Row, list[float]]], limits: list[float]) -> str:
    """The throughput table (markdown): per row the median env steps/s over its rounds,
    the EnvPool limit's median beside it, and the ratios."""
    limit = statistics.median(limits) if limits else float("nan")
    medians = [statistics.median(v) if v else float("nan") for _, v in rows]
    moolib = medians[0] if rows and rows[0][0].lib == "moolib" else float("nan")
    lines = [
        "| library | algorithm | env steps/s (median) | rounds | EnvPool limit | / limit "
        "| moolib / this |",
        "|---|---|---|---|---|---|---|",
    ]
    for (row, values), median in zip(rows, medians, strict=True):
        lines.append(
            f"| {row.lib} | {row.algo} | {_fmt(median)} | {len(values)} | {_fmt(limit)} "
            f"| {_fmt(median / limit, 3)} | {_fmt(moolib / median, 2)} |"
        )
    return "\n".join(lines)


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


def available(args: argparse.Namespace) -> list[Row]:
    """The rows to run: moolib's, and each peer's whose Python was given and exists; says
    which are skipped and why."""
    rows = []
    for row in ROWS:
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


def throughput(args: argparse.Namespace, rows: list[Row], task: str) -> str:
    """Runs every row ``args.rounds`` times, interleaved, and the EnvPool limit once per
    round; prints each run as it ends and returns the table."""
    values: dict[Row, list[float]] = {r: [] for r in rows}
    limits: list[float] = []
    bt = bench_train()
    pool_cfg = bt._config(moolib_overrides(task, args.envs, args.procs))
    for rnd in range(args.rounds):
        order = rows[rnd % len(rows) :] + rows[: rnd % len(rows)]
        for row in order:
            if row.lib == "moolib":
                res = moolib_throughput(
                    task, args.envs, args.procs, args.warmup, args.seconds, run_limits(args)
                )
            else:
                res = run_peer(
                    _python(args, row),
                    row,
                    [
                        "--task",
                        task,
                        "--mode",
                        "throughput",
                        "--envs",
                        str(args.envs),
                        "--procs",
                        str(args.procs),
                        "--warmup",
                        str(args.warmup),
                        "--seconds",
                        str(args.seconds),
                        "--seed",
                        str(rnd),
                    ],
                    args.first_step_seconds + args.warmup + args.seconds,
                    run_limits(args),
                )
            if "error" in res or res.get("env_sps") != res.get("env_sps"):
                print(f"  round {rnd + 1} {row.lib} {row.algo}: FAILED\n{res.get('error', res)}")
                continue
            values[row].append(res["env_sps"])
            extra = {k: v for k, v in res.items() if k not in ("env_sps", "task", "mode")}
            print(
                f"  round {rnd + 1} {row.lib} {row.algo}: {res['env_sps']:,.0f} env steps/s "
                f"({_versions(res) or ''}; {json.dumps(extra)})",
                flush=True,
            )
        limit = bt.envpool_limit(pool_cfg, args.envpool_seconds)
        limits.append(limit)
        print(f"  round {rnd + 1} EnvPool limit: {limit:,.0f} env steps/s", flush=True)
    return throughput_table([(r, values[r]) for r in rows], limits)


def _run_key(args: argparse.Namespace, row: Row, seed: int) -> str:
    """What makes two score runs the same run, for ``--results``."""
    return json.dumps(
        [args.score_task, args.score_cap, args.envs, args.procs, seed, row.lib, row.algo]
    )


def _load_results(path: Path | None) -> dict[str, dict]:
    """The runs a ``--results`` file already holds, by their key; a line cut short (the
    bench killed while writing it) is skipped."""
    done: dict[str, dict] = {}
    if path is None or not path.exists():
        return done
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        done[entry["key"]] = entry["result"]
    return done


def scores(args: argparse.Namespace, rows: list[Row]) -> str:
    """Runs every row once per seed, interleaved; prints each run and returns the table.
    With ``--results``, each run is appended there as it ends and runs already there
    are taken from it instead of run again, so a long comparison resumes."""
    task = args.score_task
    results = Path(args.results) if args.results else None
    done = _load_results(results)
    runs: dict[Row, list[dict]] = {r: [] for r in rows}
    for seed in range(args.seeds):
        for row in rows:
            key = _run_key(args, row, seed)
            source = f" (from {results})" if key in done else ""
            if key in done:
                res = done[key]
            elif row.lib == "moolib":
                res = moolib_score(
                    task, args.envs, args.procs, seed, args.score_cap, run_limits(args)
                )
            else:
                res = run_peer(
                    _python(args, row),
                    row,
                    [
                        "--task",
                        task,
                        "--mode",
                        "score",
                        "--envs",
                        str(args.envs),
                        "--procs",
                        str(args.procs),
                        "--target",
                        str(SCORE_TARGETS[task]),
                        "--cap",
                        str(args.score_cap),
                        "--seed",
                        str(seed),
                    ],
                    args.first_step_seconds + args.score_cap,
                    run_limits(args),
                )
            if "error" in res:
                print(f"  seed {seed} {row.lib} {row.algo}: FAILED\n{res['error']}")
                continue
            if results is not None and not source:
                with results.open("a") as f:
                    f.write(json.dumps({"key": key, "result": res}) + "\n")
            runs[row].append(res)
            print(
                f"  seed {seed} {row.lib} {row.algo}: reached={res.get('reached')} "
                f"seconds={res.get('seconds', 0):.0f} steps={res.get('steps', 0):,} "
                f"score={res.get('score')} best={res.get('best_score')}{source}",
                flush=True,
            )
    return score_table([(r, runs[r]) for r in rows], task, args.score_cap)


def check(args: argparse.Namespace, rows: list[Row]) -> int:
    """A few seconds of CartPole per available library; the table must parse back with a
    positive figure in every row. Returns the exit status."""
    args.rounds, args.warmup, args.seconds, args.envpool_seconds = 1, 3.0, 6.0, 2.0
    table = throughput(args, rows, "cartpole")
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


def main() -> None:
    """The command."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--sample-factory-python", "--rllib-python", "--torchrl-python", "--sb3-python"):
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
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=float, default=20.0, help="untimed stepping per run")
    p.add_argument("--seconds", type=float, default=30.0, help="timed stepping per run")
    p.add_argument("--envpool-seconds", type=float, default=10.0)
    p.add_argument("--envs", type=int, default=8, help="envs in all")
    p.add_argument("--procs", type=int, default=2, help="env processes")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--score-task", choices=tuple(SCORE_TARGETS), default="minatar")
    p.add_argument("--score-cap", type=float, default=240.0, help="seconds per run at most")
    p.add_argument(
        "--results",
        default=None,
        help="a file each score run is appended to; runs already in it are not run again",
    )
    args = p.parse_args()
    # Killed (kill, a job's end), it stops as on Ctrl-C: each runner's process
    # group and moolib-run are stopped on the way out, not left stepping.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(
        f"{platform.node()}: {len(os.sched_getaffinity(0))} cores, {platform.machine()}, "
        f"Python {platform.python_version()}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = available(args)
    if args.check:
        sys.exit(check(args, rows))
    if args.only in (None, "throughput"):
        print(f"Throughput: Breakout, {args.envs} envs on {args.procs} env processes, CPU")
        print(throughput(args, rows, "breakout"), flush=True)
    if args.only in (None, "score"):
        print(f"Time to a score: {args.score_task}, cap {args.score_cap:.0f} s per run")
        print(scores(args, rows), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
