"""What every peer runner shares (bench/peers.py launches each runner with its
library's own Python): the same envs, the same step and episode counting, and the
one line of result the bench reads.

Only gymnasium, ale-py, numpy and (for MinAtar) the minatar package are imported
here, so that this file loads in each peer library's virtual environment.

Counting is the same for every library and independent of its own statistics:
each env instance (in whatever process the library steps it) adds its steps to a
memory-mapped counter file and appends each finished episode's return to a file,
both in the directory named by ``MOOLIB_PEERS_DIR``; the runner's process sums
them. So "env steps" are steps the envs took, whoever took them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np

START = time.monotonic()  # the runner's start: this module is its first import
COUNT_DIR_VAR = "MOOLIB_PEERS_DIR"
RESULT_PREFIX = "RESULT "
# Seconds a library may take to stop once the measurement is over.
STOP_GRACE = 30.0
# Episodes the score is the mean return of (the most recent ones).
SCORE_WINDOW = 100
# Seconds between the points of a score run's curve.
CURVE_EVERY = 5.0
# Atari: the shared settings (moolib-run's env=breakout with sticky actions off).
FRAME_SKIP, SCREEN, STACK, NOOP_MAX = 4, 84, 4, 30
MAX_EPISODE_FRAMES = 108_000

_instances = itertools.count()


class Counted(gymnasium.Wrapper):
    """Counts the env's steps into ``<dir>/steps-<pid>-<n>`` (one int64, memory-mapped)
    and appends ``<time> <return>`` per finished episode to ``<dir>/episodes-<pid>-<n>``.
    Counts nothing when ``MOOLIB_PEERS_DIR`` is not set."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        folder = os.environ.get(COUNT_DIR_VAR)
        self._steps: np.memmap | None = None
        self._episodes = None
        self._return = 0.0
        if folder:
            name = f"{os.getpid()}-{next(_instances)}"
            self._steps = np.memmap(
                Path(folder) / f"steps-{name}", dtype=np.int64, mode="w+", shape=(1,)
            )
            self._episodes = open(Path(folder) / f"episodes-{name}", "a", buffering=1)  # noqa: SIM115

    def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict[str, Any]]:
        """One step of the env, counted."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        self._return += float(reward)
        if self._steps is not None:
            self._steps[0] += 1
        if terminated or truncated:
            if self._episodes is not None:
                self._episodes.write(f"{time.time():.3f} {self._return}\n")
            self._return = 0.0
        return obs, reward, terminated, truncated, info

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        """Starts an episode (a partial one is not counted as finished)."""
        self._return = 0.0
        return self.env.reset(**kwargs)


class MinAtar(gymnasium.Env):
    """A MinAtar game (the minatar package) as a gymnasium env with the paper's
    settings, as moolib-run's env=minatar-<game>: sticky actions 0.1, difficulty
    ramping, all 6 actions, no time limit; observations uint8 0/1 ``(C, 10, 10)``."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, game: str = "breakout", sticky_action_prob: float = 0.1) -> None:
        from minatar import Environment

        self.game = Environment(game, sticky_action_prob=sticky_action_prob)
        h, w, c = self.game.state_shape()
        self.observation_space = gymnasium.spaces.Box(0, 1, (c, h, w), np.uint8)
        self.action_space = gymnasium.spaces.Discrete(self.game.num_actions())

    def _obs(self) -> np.ndarray:
        return np.ascontiguousarray(self.game.state().transpose(2, 0, 1), dtype=np.uint8)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """A new episode."""
        super().reset(seed=seed)
        if seed is not None:
            self.game.seed(seed)
        self.game.reset()
        return self._obs(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """One frame."""
        reward, terminal = self.game.act(int(action))
        return self._obs(), float(reward), bool(terminal), False, {}


def make_env(task: str, seed: int | None = None) -> gymnasium.Env:
    """The task's env, counted: ``breakout`` (ALE Breakout from pixels: frameskip 4,
    84x84 grey, 4 stacked frames, no sticky actions, up to 30 no-ops after reset,
    episodes of at most 108,000 frames, all as moolib-run's env=breakout with
    ``repeat_action_probability=0``), ``minatar`` (MinAtar Breakout) or
    ``cartpole`` (CartPole-v1)."""
    if task == "breakout":
        import ale_py

        gymnasium.register_envs(ale_py)
        env = gymnasium.make(
            "ALE/Breakout-v5",
            obs_type="grayscale",
            frameskip=1,
            repeat_action_probability=0.0,
            full_action_space=False,
            max_num_frames_per_episode=None,
        )
        env = gymnasium.wrappers.AtariPreprocessing(
            env,
            noop_max=NOOP_MAX,
            frame_skip=FRAME_SKIP,
            screen_size=SCREEN,
            terminal_on_life_loss=False,
            grayscale_obs=True,
            scale_obs=False,
        )
        env = gymnasium.wrappers.TimeLimit(env, MAX_EPISODE_FRAMES // FRAME_SKIP)
        env = gymnasium.wrappers.FrameStackObservation(env, STACK)
    elif task == "minatar":
        env = MinAtar("breakout")
    elif task == "cartpole":
        env = gymnasium.make("CartPole-v1")
    else:
        raise ValueError(f"unknown task {task!r}")
    env = Counted(env)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


def parse_args(libs_algos: tuple[str, ...]) -> argparse.Namespace:
    """The runners' shared command line (bench/peers.py writes it)."""
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=("breakout", "minatar", "cartpole"), required=True)
    p.add_argument("--mode", choices=("throughput", "score"), required=True)
    p.add_argument("--algo", choices=libs_algos, default=libs_algos[0])
    p.add_argument("--envs", type=int, default=8, help="envs in all")
    p.add_argument("--procs", type=int, default=2, help="env processes")
    p.add_argument("--warmup", type=float, default=20.0, help="throughput: untimed seconds")
    p.add_argument("--seconds", type=float, default=30.0, help="throughput: timed seconds")
    p.add_argument("--target", type=float, default=475.0, help="score: the mean return to reach")
    p.add_argument("--cap", type=float, default=300.0, help="score: wall-clock seconds at most")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", required=True, help="the counters' directory")
    p.add_argument("--lr-scale", type=float, default=1.0, help="the tuning sweep's factor")
    p.add_argument("--batch-scale", type=float, default=1.0, help="the tuning sweep's factor")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the library over the runner's own (VALUE is JSON, else a string)",
    )
    args = p.parse_args()
    args.settings = dict(_setting(item) for item in args.set)
    return args


def tuned(
    settings: dict[str, Any],
    args: argparse.Namespace,
    lr_key: str,
    batch_key: str,
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The runner's ``settings`` with the tuning sweep's factors (``--lr-scale``,
    ``--batch-scale``) applied to the library's learning rate and batch size (env steps
    per update, or the library's nearest key), then ``--set``'s settings over them.
    ``defaults`` are the library's own values of keys the runner does not set."""
    out = dict(settings)
    known = {**(defaults or {}), **settings}
    if args.lr_scale != 1:
        out[lr_key] = float(known[lr_key]) * args.lr_scale
    if args.batch_scale != 1:
        out[batch_key] = max(1, round(int(known[batch_key]) * args.batch_scale))
    out.update(args.settings)
    return out


def _setting(item: str) -> tuple[str, Any]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise SystemExit(f"--set takes KEY=VALUE, got {item!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def learner_threads(procs: int) -> int:
    """Torch threads for the learner's process: the cores less one per env process, at
    least 1 (moolib-run's ``torch_threads=auto``)."""
    return max(1, len(os.sched_getaffinity(0)) - procs)


def count_steps(folder: Path) -> int:
    """Env steps the ``Counted`` envs writing into ``folder`` have taken, all together
    (bench/peers.py reads it too, to stop a runner that takes none)."""
    total = 0
    for f in Path(folder).glob("steps-*"):
        try:
            total += int(np.fromfile(f, dtype=np.int64, count=1)[0])
        except (OSError, IndexError):
            pass
    return total


class Meter:
    """Watches the counters from a thread of the runner's process; ``done`` is set when
    the throughput window has passed (``warmup`` seconds after the first env step,
    then ``seconds``) or when the score is reached or the cap has passed."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(args.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        os.environ[COUNT_DIR_VAR] = str(self.dir)
        # Child processes (spawned or forked env workers) import this module too.
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (here, os.environ.get("PYTHONPATH")) if p
        )
        self.done = threading.Event()
        self.result: dict[str, Any] = {"task": args.task, "mode": args.mode, "seed": args.seed}
        # Score mode: [seconds from the start, env steps, score], every CURVE_EVERY s.
        self.curve: list[list[float]] = []
        if args.mode == "score":
            self.result["curve"] = self.curve
        self._lock = threading.Lock()
        # Set by a runner whose loop alternates collecting and learning: the window then
        # starts and ends at ``tick``s (the start of a collection), whole cycles only.
        self.cycle_aligned = False
        self._first: float | None = None
        self._mark: tuple[float, int] | None = None
        threading.Thread(target=self._watch, daemon=True).start()
        threading.Thread(target=self._finish_late, daemon=True).start()

    def steps(self) -> int:
        """Env steps taken so far, all envs together."""
        return count_steps(self.dir)

    def returns(self) -> list[float]:
        """Returns of the finished episodes, oldest first."""
        rows = []
        for f in self.dir.glob("episodes-*"):
            for line in f.read_text().splitlines():
                parts = line.split()
                if len(parts) == 2:
                    rows.append((float(parts[0]), float(parts[1])))
        return [r for _, r in sorted(rows)]

    def tick(self) -> None:
        """Called by a runner with ``cycle_aligned`` set at the start of each collection:
        the throughput window opens and closes at ticks."""
        if self.args.mode == "throughput":
            self._window(time.monotonic(), self.steps())

    def _window(self, now: float, steps: int) -> None:
        a = self.args
        if self._first is None and steps > 0:
            self._first = now
        if self._first is not None and self._mark is None and now >= self._first + a.warmup:
            self._mark = (now, steps)
        elif self._mark is not None and now >= self._mark[0] + a.seconds:
            self.result.update(
                env_sps=(steps - self._mark[1]) / (now - self._mark[0]),
                startup_s=self._first - START,
                window_s=now - self._mark[0],
            )
            self.done.set()

    def _watch(self) -> None:
        a = self.args
        best = float("-inf")
        last_point = float("-inf")
        while not self.done.is_set():
            time.sleep(0.25)
            now, steps = time.monotonic(), self.steps()
            if a.mode == "throughput":
                if self._first is None and steps > 0:
                    self._first = now
                if not self.cycle_aligned:
                    self._window(now, steps)
            else:
                returns = self.returns()
                score = (
                    float(np.mean(returns[-SCORE_WINDOW:]))
                    if len(returns) >= SCORE_WINDOW
                    else float("nan")
                )
                if score == score:
                    best = max(best, score)
                    if now - last_point >= CURVE_EVERY:
                        last_point = now
                        self.curve.append([round(now - START, 1), steps, round(score, 3)])
                self.result.update(
                    steps=steps,
                    seconds=now - START,
                    episodes=len(returns),
                    score=score,
                    best_score=best if best > float("-inf") else None,
                )
                if score >= a.target:
                    self.result["reached"] = True
                    self.done.set()
                elif now - START >= a.cap:
                    self.result["reached"] = False
                    self.done.set()

    def finish(self, **info: Any) -> None:
        """Prints the result line (with ``info``: the library, its version, the
        settings) and leaves at once, whatever the library's processes do."""
        with self._lock:
            self.result.update(info)
            print(RESULT_PREFIX + json.dumps(self.result), flush=True)
            sys.stdout.flush()
            os._exit(0)

    def _finish_late(self) -> None:
        """When the library has not stopped ``STOP_GRACE`` seconds after ``done`` (a
        loop that waits on a failed component), the result is printed all the same."""
        self.done.wait()
        time.sleep(STOP_GRACE)
        self.finish(note=f"the library had not stopped {STOP_GRACE:.0f} s after the end")
