"""EnvPool benchmark: moolib.EnvPool beside gymnasium's AsyncVectorEnv, the envpool
library and the single-process limit.

Every figure is env steps/s with batch 32 x 2, double-buffered: step batch 0,
step batch 1, then alternately take a batch's result and step that batch again
with fresh random actions. Configurations:

  Breakout: gymnasium's raw-frame ``ALE/Breakout-v5`` (210x160x3 uint8
  observations, frameskip 4, sticky actions 0.25, ``gym.make`` defaults):
    - limit: one env stepped in a loop in one fresh process, times the
      process count (2). For reading the ratios, also: the same loop in 2
      processes at once (summed: what the machine's 2 cores give right now)
      and 32 envs stepped in turn in one process, times 2 (the cost of
      stepping many envs per process, whatever the pool);
    - moolib.EnvPool(create_env, num_processes=2, batch_size=32, num_batches=2);
    - gymnasium AsyncVectorEnv, one process per env as it works: 2 instances
      of 32 envs (64 processes), one per batch, stepped with step_async /
      step_wait; autoreset SAME_STEP (moolib's semantics); with
      shared_memory=True (the default) and shared_memory=False; with --extra
      also max_concurrency=1 per instance (gymnasium's knob for more envs
      than cores);
    - the envpool library's C++ Atari, configured for the same raw frames
      (img 210x160 RGB, stack 1, frameskip 4, sticky 0.25, no no-ops, no fire
      reset) with num_envs=64, batch_size=32, num_threads=2 (its async API:
      recv a batch of 32, send it actions).
  Toy env: a minimal gymnasium env in Python (4 float32 observation, constant
  reward, episodes of 100 steps), through moolib.EnvPool and AsyncVectorEnv
  as above; also the env alone in a loop in one process (its own cost).
  The original moolib's test env (with --original-python PATH): the env of the
  original moolib's own EnvPool test (a 4x4 float32 tensor that actions keep,
  double or halve), stepped by moolib.EnvPool(env, num_processes=4,
  batch_size=32, num_batches=2) -- that test's settings -- and, in the same
  rounds, by the original moolib's EnvPool with the same settings, run by the
  Python at PATH (where the original is installed) in a subprocess. The
  original 0.0.9b0 builds from its PyPI sdist against torch 2.13 (CPU) with
  USE_CUDA=0 and CMAKE_POLICY_VERSION_MINIMUM=3.5 once two things are changed
  in its copy: its CMakeLists.txt finds pybind11 2.13.6 from pip
  (find_package(pybind11 CONFIG) with pybind11_DIR from pybind11.get_cmake_dir())
  instead of add_subdirectory(third_party/pybind11), which predates Python 3.11;
  and RpcDeferredReturn in src/rpc.h picks its function type through a
  specialised trait instead of std::conditional_t, whose void(const void&)
  branch GCC 12 rejects. py/moolib and the built _C module then go into that
  Python's site-packages.
  Preprocessed Atari, if ``moolib.envs.create_env`` exists: Breakout through
  it in moolib.EnvPool, and through ``moolib.envs.create_envpool`` (the
  envpool library, 1 thread per batch), beside its single-process limit.

Each measurement builds a fresh pool, warms up, counts steps for --seconds and
closes the pool. Measurements run in interleaved rounds (the order rotates each
round) so load from elsewhere on the machine hits all alike; the table gives
the median and best over rounds, and ratios of medians. CPU lines under each
table split the counted time of the stepping processes (from /proc schedstat)
into on a CPU, runnable but waiting for a CPU (the machine's other load) and
blocked, and give env steps per CPU-second (a pool's workers and parent
together): the cost per step, apart from time lost waiting for a CPU.

Usage: python bench/envpool.py [--seconds S] [--warmup S] [--rounds N] [--quick]
                               [--extra] [--original-python PATH] [--json]
BENCH_WATCHDOG=seconds bounds the whole run (default 900): past it, every
process this benchmark started is killed.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib.util
import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

# This file is named envpool.py: keep its folder off the path so that
# `import envpool` finds the library (moolib's workers inherit this path).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import numpy as np  # noqa: E402

# Loaded by path: bench/ on sys.path would hide the envpool library behind
# bench/envpool.py (in this process, or in a test that imports this file).
descendants = runpy.run_path(os.path.join(_HERE, "procs.py"))["descendants"]

DEFAULT_WATCHDOG = 900
BATCH_SIZE = 32
NUM_BATCHES = 2
NUM_PROCESSES = 2
TOY_EPISODE = 100
# The settings of the original moolib's EnvPool test (batch size and batches as above).
GRID_PROCESSES = 4
GRID_ACTIONS = 3
# Target (issue 4) and the original moolib's published figures on these machines.
TARGET_BREAKOUT_RATIO = 0.95  # of the limit
ORIGINAL_BREAKOUT = 3670.0
ORIGINAL_SINGLE = 2000.0  # single-process gymnasium Breakout then: the original's limit 2 x this


# --- envs (module level: cloudpickle sends them to moolib's workers by value) ---


def make_breakout():
    import ale_py
    import gymnasium as gym

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # no banner per process
    gym.register_envs(ale_py)
    return gym.make("ALE/Breakout-v5")


def make_toy():
    import gymnasium as gym

    class ToyEnv(gym.Env):
        """4 float32 zeros, reward 1, episodes of TOY_EPISODE steps."""

        observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
        action_space = gym.spaces.Discrete(2)

        def __init__(self) -> None:
            self._obs = np.zeros(4, np.float32)
            self._t = 0

        def reset(self, *, seed=None, options=None):
            self._t = 0
            return self._obs, {}

        def step(self, action):
            self._t += 1
            return self._obs, 1.0, self._t >= TOY_EPISODE, False, {}

    return ToyEnv()


def make_atari():
    import ale_py
    import moolib.envs

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)

    return moolib.envs.create_env("breakout")


class GridEnv:
    """The env of the original moolib's EnvPool test, in the old gym API it uses.

    Observation {"n": a 4x4 float32 tensor}, reset to ones except 4 at [0, 0],
    0.5 at [3, 1] and 0.25 at [1, 2]. Action 0 leaves the tensor as it is, 1
    doubles it and 2 halves it, in place; the reward is |sum - 4| and the
    episode ends when the sum falls below 1. That test returns them as 0-d
    tensors, which both pools convert with float() and bool(); here the env
    does that conversion itself, the same work on both sides. Doubling has no
    bound: an episode can reach an infinite reward and stay there, which is
    why moolib's pool counts non-finite rewards here.
    """

    def __init__(self) -> None:
        self.grid = None

    def reset(self) -> dict:
        import torch

        self.grid = torch.ones(4, 4)
        for (row, col), value in {(0, 0): 4.0, (3, 1): 0.5, (1, 2): 0.25}.items():
            self.grid[row, col] = value
        return {"n": self.grid}

    def step(self, action) -> tuple:
        if action == 1:
            self.grid.mul_(2)
        elif action == 2:
            self.grid.div_(2)
        elif action != 0:
            raise RuntimeError(f"GridEnv: no action {action}")
        total = float(self.grid.sum())
        return {"n": self.grid}, abs(total - 4), total < 1


FACTORIES: dict[str, Callable] = {"breakout": make_breakout, "toy": make_toy, "atari": make_atari}


def num_actions(env) -> int:
    return int(env.action_space.n)


# --- measurements: each builds a fresh pool, warms up, counts, closes ---------


class Counter:
    """Counts env steps after a warm-up; done after `seconds` of counting."""

    def __init__(self, warmup: float, seconds: float) -> None:
        self.warmup, self.seconds = warmup, seconds
        self.start = time.perf_counter()
        self.t0: float | None = None
        self.steps = 0

    def add(self, n: int) -> bool:
        """Records n steps; returns False when the measurement is over."""
        now = time.perf_counter()
        if self.t0 is None:
            if now - self.start >= self.warmup:
                self.t0 = now  # steps of the result just taken started before t0
            return True
        self.steps += n
        return now - self.t0 < self.seconds

    def rate(self) -> float:
        return self.steps / (time.perf_counter() - self.t0)


# CPU accounting of the last measurement's stepping processes (if any), as
# fractions of the counted time: on a CPU (run), runnable but waiting for one
# (wait: the machine's other load), blocked (idle: pool workers only); the
# parent's CPU; and env steps per CPU-second of all of them (per_cpu).
LAST_CPU: dict[str, float] = {}


def sched_times(pids: list[int]) -> list[tuple[float, float]]:
    """(seconds on a CPU, seconds runnable but waiting) of each process."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/schedstat") as f:
                run, wait, _ = f.read().split()
            out.append((int(run) / 1e9, int(wait) / 1e9))
        except (OSError, ValueError):
            out.append((0.0, 0.0))
    return out


def single_loop(
    env_name: str, warmup: float, seconds: float, num_envs: int = 1
) -> tuple[float, float, float]:
    """num_envs envs stepped in turn (one step each) with random actions, in this
    process. Returns (steps/s, share of the counted time on a CPU, share runnable
    but waiting for one)."""
    envs = [FACTORIES[env_name]() for _ in range(num_envs)]
    n = num_actions(envs[0])
    rng = np.random.default_rng()
    for env in envs:
        env.reset(seed=int(rng.integers(1 << 30)))
    counter = Counter(warmup, seconds)
    actions = rng.integers(0, n, 4096).tolist()
    j = steps = 0
    before = None
    while True:
        for env in envs:
            _, _, terminated, truncated, _ = env.step(actions[j & 4095])
            j += 1
            if terminated or truncated:
                env.reset()
        steps += num_envs
        if steps >= 16:  # the clock is read every 16 steps or more
            if not counter.add(steps):
                break
            steps = 0
            if before is None and counter.t0 is not None:
                before = sched_times([os.getpid()])[0]
    rate = counter.rate()
    after = sched_times([os.getpid()])[0]
    span = time.perf_counter() - counter.t0
    for env in envs:
        env.close()
    return rate, (after[0] - before[0]) / span, (after[1] - before[1]) / span


def single_processes(
    env_name: str, count: int, warmup: float, seconds: float, num_envs: int = 1
) -> float:
    """single_loop in `count` fresh processes at once; the sum of their rates."""
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--single",
                env_name,
                str(warmup),
                str(seconds),
                str(num_envs),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    got = []
    for p in procs:
        out, _ = p.communicate(timeout=120 + warmup + seconds)
        if p.returncode != 0:
            raise RuntimeError(f"single-process loop exited with {p.returncode}")
        got.append([float(x) for x in out.strip().splitlines()[-1].split()])
    rates, runs, waits = zip(*got, strict=True)
    LAST_CPU.update(
        run=statistics.mean(runs), wait=statistics.mean(waits), per_cpu=sum(rates) / sum(runs)
    )
    return sum(rates)


def moolib_pool(env_name: str, warmup: float, seconds: float) -> float:
    import moolib

    factory = FACTORIES[env_name]
    n = num_actions(factory())
    pool = moolib.EnvPool(
        factory, num_processes=NUM_PROCESSES, batch_size=BATCH_SIZE, num_batches=NUM_BATCHES
    )
    return double_buffered(pool, n, warmup, seconds)


def grid_pool(warmup: float, seconds: float, original: bool = False) -> float:
    """GridEnv in moolib.EnvPool (the original's, if `original`) with its test's settings."""
    import moolib

    # The original has no nonfinite_rewards (it stores whatever the env gives).
    extra = {} if original else {"nonfinite_rewards": "count"}
    pool = moolib.EnvPool(
        GridEnv,
        num_processes=GRID_PROCESSES,
        batch_size=BATCH_SIZE,
        num_batches=NUM_BATCHES,
        **extra,
    )
    return double_buffered(pool, GRID_ACTIONS, warmup, seconds)


# Where the original moolib that the last original_pool() ran was imported from.
ORIGINAL_FROM: list[str] = []


def original_pool(python: str, warmup: float, seconds: float) -> float:
    """grid_pool(original=True) in a fresh process of `python` (which imports the
    original moolib); its CPU accounting goes to LAST_CPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own moolib
    proc = subprocess.run(
        [python, os.path.abspath(__file__), "--original-child", str(warmup), str(seconds)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        timeout=120 + warmup + seconds,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"original moolib's pool ({python}) exited with {proc.returncode}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    ORIGINAL_FROM[:] = [got["moolib"]]
    LAST_CPU.update(got["cpu"])
    return got["rate"]


def original_child(warmup: float, seconds: float) -> None:
    """The subprocess of original_pool: measures, prints one JSON line, ends its pool."""
    import moolib

    if hasattr(moolib, "_core"):  # this project's package, not the original
        raise SystemExit(f"--original-python: {moolib.__file__} is not the original moolib")
    try:
        rate = grid_pool(warmup, seconds, original=True)
        print(json.dumps({"rate": rate, "cpu": LAST_CPU, "moolib": moolib.__file__}), flush=True)
    finally:
        kill_descendants()  # the original's pool has no close(): its workers go with it


def moolib_envpool_backend(warmup: float, seconds: float) -> float:
    """moolib.envs' envpool backend: one envpool instance per batch, 1 thread each."""
    import moolib.envs

    n = num_actions(make_atari())
    pool = moolib.envs.create_envpool(
        "breakout", BATCH_SIZE, NUM_BATCHES, num_threads=NUM_PROCESSES // NUM_BATCHES
    )
    return double_buffered(pool, n, warmup, seconds)


def double_buffered(pool, n: int, warmup: float, seconds: float) -> float:
    """Steps a pool with moolib.EnvPool's interface, double-buffered; closes it."""
    import torch

    rng = np.random.default_rng()
    LAST_CPU.clear()
    workers = descendants()
    try:

        def actions():
            return torch.from_numpy(rng.integers(0, n, BATCH_SIZE))

        futures = [pool.step(b, actions()) for b in range(NUM_BATCHES)]
        counter = Counter(warmup, seconds)
        before = None
        b = 0
        while True:
            futures[b].result()
            more = counter.add(BATCH_SIZE)
            if before is None and counter.t0 is not None:
                before = sched_times(workers)
                parent_before = time.process_time()
            futures[b] = pool.step(b, actions())
            b = (b + 1) % NUM_BATCHES
            if not more:
                break
        rate = counter.rate()
        if workers:
            after = sched_times(workers)
            parent = time.process_time() - parent_before
            span = time.perf_counter() - counter.t0
            pairs = list(zip(before, after, strict=True))
            busy = sum(a[0] - z[0] for z, a in pairs)
            run = statistics.mean((a[0] - z[0]) / span for z, a in pairs)
            wait = statistics.mean((a[1] - z[1]) / span for z, a in pairs)
            LAST_CPU.update(
                run=run,
                wait=wait,
                idle=max(0.0, 1 - run - wait),
                parent=parent / span,
                per_cpu=rate * span / (busy + parent),
            )
        for f in futures:
            f.result()
        return rate
    finally:
        if hasattr(pool, "close"):  # the original moolib's EnvPool has none
            pool.close()


def async_vector_env(
    env_name: str, warmup: float, seconds: float, shared_memory: bool, max_concurrency=None
) -> float:
    from gymnasium.vector import AsyncVectorEnv, AutoresetMode

    factory = FACTORIES[env_name]
    vecs = []
    try:
        for _ in range(NUM_BATCHES):
            vecs.append(
                AsyncVectorEnv(
                    [factory] * BATCH_SIZE,
                    shared_memory=shared_memory,
                    autoreset_mode=AutoresetMode.SAME_STEP,
                    max_concurrency=max_concurrency,
                )
            )
        rng = np.random.default_rng()
        n = int(vecs[0].single_action_space.n)
        for v in vecs:
            v.reset(seed=int(rng.integers(1 << 30)))
        for v in vecs:
            v.step_async(rng.integers(0, n, BATCH_SIZE))
        counter = Counter(warmup, seconds)
        b = 0
        while True:
            vecs[b].step_wait()
            more = counter.add(BATCH_SIZE)
            if more:
                vecs[b].step_async(rng.integers(0, n, BATCH_SIZE))
            b = (b + 1) % NUM_BATCHES
            if not more:
                break
        for v in vecs[b : b + 1]:  # the other batch is still stepping
            v.step_wait()
        return counter.rate()
    finally:
        for v in vecs:
            v.close(terminate=True)


def envpool_library(env_name: str, warmup: float, seconds: float) -> float:
    import envpool

    assert env_name == "breakout"
    env = envpool.make_gymnasium(
        "Breakout-v5",
        num_envs=BATCH_SIZE * NUM_BATCHES,
        batch_size=BATCH_SIZE,
        num_threads=NUM_PROCESSES,
        img_height=210,
        img_width=160,
        gray_scale=False,
        stack_num=1,
        frame_skip=4,
        repeat_action_probability=0.25,
        noop_max=1,
        use_fire_reset=False,
        episodic_life=False,
        reward_clip=False,
        max_episode_steps=27000,  # 108,000 frames, as ALE/Breakout-v5
        seed=int(np.random.default_rng().integers(1 << 30)),
    )
    try:
        n = int(env.action_space.n)
        rng = np.random.default_rng()
        env.async_reset()
        counter = Counter(warmup, seconds)
        while True:
            *_, info = env.recv()
            more = counter.add(BATCH_SIZE)
            env.send(rng.integers(0, n, BATCH_SIZE), info["env_id"])
            if not more:
                break
        return counter.rate()
    finally:
        env.close()


def atari_available() -> str | None:
    """None if moolib.envs.create_env("breakout") works, else why not."""
    try:
        import moolib.envs

        if not hasattr(moolib.envs, "create_env"):
            return "moolib.envs has no create_env"
        make_atari().close()
        return None
    except Exception as e:  # noqa: BLE001 - reported as the reason to skip
        return f"{type(e).__name__}: {e}"


# --- process bookkeeping --------------------------------------------------------


def kill_descendants() -> None:
    for pid in descendants():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- parent ---------------------------------------------------------------------


def plan(args, atari_skip: str | None) -> list[dict]:
    """The measurements: key, table group, what runs, processes, label."""
    w, s = args.warmup, args.seconds
    moolib_label = "moolib.EnvPool(create_env, 2, 32, 2)"
    rows = [
        dict(
            key="b_single",
            group="breakout",
            fn=lambda: single_processes("breakout", 1, w, s),
            procs="1",
            scale=NUM_PROCESSES,
            label="limit: 1 env in a loop in 1 process, x 2",
        ),
        dict(
            key="b_pair",
            group="breakout",
            fn=lambda: single_processes("breakout", 2, w, s),
            procs="2",
            label="(1 env in a loop in 2 processes at once, sum)",
        ),
        dict(
            key="b_single32",
            group="breakout",
            fn=lambda: single_processes("breakout", 1, w, s, BATCH_SIZE),
            procs="1",
            scale=NUM_PROCESSES,
            label="(32 envs stepped in turn in 1 process, x 2)",
        ),
        dict(
            key="b_moolib",
            group="breakout",
            fn=lambda: moolib_pool("breakout", w, s),
            procs="2",
            label=moolib_label,
        ),
        dict(
            key="b_avec_shm",
            group="breakout",
            fn=lambda: async_vector_env("breakout", w, s, True),
            procs="64",
            label="2 x AsyncVectorEnv(32 envs), shared_memory=True",
        ),
        dict(
            key="b_avec_pipe",
            group="breakout",
            fn=lambda: async_vector_env("breakout", w, s, False),
            procs="64",
            label="2 x AsyncVectorEnv(32 envs), shared_memory=False",
        ),
    ]
    if args.extra:
        rows.append(
            dict(
                key="b_avec_mc1",
                group="breakout",
                fn=lambda: async_vector_env("breakout", w, s, True, 1),
                procs="64",
                label="2 x AsyncVectorEnv(32 envs), shm, max_concurrency=1",
            )
        )
    rows += [
        dict(
            key="b_envpool",
            group="breakout",
            fn=lambda: envpool_library("breakout", w, s),
            procs="1+2thr",
            label="envpool library: 64 envs, batch_size=32, num_threads=2",
        ),
        dict(
            key="t_moolib",
            group="toy",
            fn=lambda: moolib_pool("toy", w, s),
            procs="2",
            label=moolib_label,
        ),
        dict(
            key="t_avec_shm",
            group="toy",
            fn=lambda: async_vector_env("toy", w, s, True),
            procs="64",
            label="2 x AsyncVectorEnv(32 envs), shared_memory=True",
        ),
        dict(
            key="t_single",
            group="toy",
            fn=lambda: single_processes("toy", 1, w, s),
            procs="1",
            label="(1 env in a loop in 1 process: the env's own cost)",
        ),
    ]
    rows.append(
        dict(
            key="g_moolib",
            group="grid",
            fn=lambda: grid_pool(w, s),
            procs=str(GRID_PROCESSES),
            label=f"moolib.EnvPool(GridEnv, {GRID_PROCESSES}, 32, 2)",
        )
    )
    if args.original_python:
        rows.append(
            dict(
                key="g_original",
                group="grid",
                fn=lambda: original_pool(args.original_python, w, s),
                procs=str(GRID_PROCESSES),
                label=f"original moolib: EnvPool(GridEnv, {GRID_PROCESSES}, 32, 2)",
            )
        )
    if atari_skip is None:
        rows += [
            dict(
                key="a_single",
                group="atari",
                fn=lambda: single_processes("atari", 1, w, s),
                procs="1",
                scale=NUM_PROCESSES,
                label="limit: 1 env in a loop in 1 process, x 2",
            ),
            dict(
                key="a_moolib",
                group="atari",
                fn=lambda: moolib_pool("atari", w, s),
                procs="2",
                label=moolib_label,
            ),
            dict(
                key="a_envpool",
                group="atari",
                fn=lambda: moolib_envpool_backend(w, s),
                procs="1+2thr",
                label="moolib.envs.create_envpool('breakout', 32, 2, num_threads=1)",
            ),
        ]
    if importlib.util.find_spec("envpool") is None:  # optional: its rows are skipped
        rows = [r for r in rows if r["key"] not in ("b_envpool", "a_envpool")]
    if args.only:
        keep = set(args.only.split(","))
        asked = {r["group"] for r in rows if r["key"] in keep}
        limits = {"b_single", "a_single"}  # the ratios of their groups need them
        rows = [r for r in rows if r["key"] in keep or (r["key"] in limits and r["group"] in asked)]
    return rows


LEGEND = """\
configurations (all: batch 32 x 2, double-buffered; random actions; one fresh pool per figure):
  moolib.EnvPool(create_env, 2, 32, 2): num_processes=2, batch_size=32, num_batches=2; step(0),
      step(1), then result() of the older batch and step it again.
  2 x AsyncVectorEnv(32 envs): gymnasium's one process per env, so 64 processes; one instance
      per batch, step_async / step_wait alternately; autoreset_mode=SAME_STEP (as moolib);
      copy=True (default); shared_memory=True is gymnasium's default.{mc1}
  envpool library: envpool.make_gymnasium("Breakout-v5", num_envs=64, batch_size=32,
      num_threads=2), raw frames (img 210x160, gray_scale=False, stack_num=1; its frames are
      3x210x160), frame_skip=4, repeat_action_probability=0.25, noop_max=1, no fire reset,
      no episodic life, no reward clip; async recv() of 32, send() their actions.
  limit: gym.make("ALE/Breakout-v5") stepped in a plain loop in one fresh process, times 2.
  Breakout everywhere else is gym.make("ALE/Breakout-v5") too: 210x160x3 uint8 frames,
      frameskip 4, repeat_action_probability 0.25, full_action_space False.
  preprocessed: moolib.envs.create_env("breakout") (84x84 gray, 4 stacked, noop starts,
      frame skip 4 with max of 2, sticky 0.25); create_envpool: the same preprocessing by the
      envpool library, one instance of 32 envs and 1 thread per batch (2 threads in all).
  toy env: gymnasium.Env in Python; observation 4 float32 zeros, reward 1, done after {toy}
      steps.
  GridEnv: the env of the original moolib's EnvPool test (its test/unit/test_envpool.py):
      observation {{"n": 4x4 float32 tensor}}, actions 0 keep / 1 double / 2 halve it, reward
      |sum - 4|, done when the sum < 1; old gym API (reset() -> obs, step() -> 3-tuple);
      reward and done a Python float and bool (that test's are 0-d tensors, which
      both pools convert with float()/bool(): done here in the env, on both sides).
      Stepped with that test's settings: num_processes=4, batch_size=32, num_batches=2, random
      actions in 0..2. moolib's pool gets nonfinite_rewards="count" (doubling without bound
      reaches an infinite reward; the original stores it unchecked). The original runs in a
      fresh subprocess of --original-python per round, beside moolib's fresh pool."""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=2.0, help="counted seconds per figure")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before counting")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="1 round of 1 s (a smoke run)")
    parser.add_argument(
        "--extra", action="store_true", help="also AsyncVectorEnv with max_concurrency=1"
    )
    parser.add_argument(
        "--original-python",
        default="",
        metavar="PATH",
        help="a Python that imports the original moolib: its EnvPool row on GridEnv",
    )
    parser.add_argument("--only", default="", help="comma-separated keys (debugging)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--single", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--original-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.original_child:  # a child of original_pool, under the original's Python
        original_child(*(float(x) for x in args.original_child))
        return

    if args.single:  # a child running single_loop
        name, warmup, seconds, num_envs = args.single
        print(*single_loop(name, float(warmup), float(seconds), int(num_envs)), flush=True)
        return
    if args.quick:
        args.seconds, args.warmup, args.rounds = 1.0, 0.5, 1
    if args.seconds <= 0 or args.rounds < 1:
        parser.error("need --seconds > 0 and --rounds >= 1")

    limit = int(os.environ.get("BENCH_WATCHDOG", "0")) or DEFAULT_WATCHDOG
    faulthandler.dump_traceback_later(max(1, limit - 5))

    def watchdog() -> None:
        print(f"envpool bench: watchdog: over {limit} s, killing everything", file=sys.stderr)
        kill_descendants()
        os._exit(2)

    timer = threading.Timer(limit, watchdog)
    timer.daemon = True
    timer.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    load = os.getloadavg()
    started = time.time()
    atari_skip = atari_available()
    rows = plan(args, atari_skip)
    samples: dict[str, list[float]] = {r["key"]: [] for r in rows}
    walls: dict[str, list[float]] = {r["key"]: [] for r in rows}  # start-up and close included
    cpu: dict[str, list[dict]] = {r["key"]: [] for r in rows}
    try:
        for rnd in range(args.rounds):
            shift = rnd % len(rows)
            for row in rows[shift:] + rows[:shift]:
                t = time.perf_counter()
                LAST_CPU.clear()
                samples[row["key"]].append(row["fn"]() * row.get("scale", 1))
                walls[row["key"]].append(time.perf_counter() - t)
                if LAST_CPU:
                    cpu[row["key"]].append(dict(LAST_CPU))
    except KeyboardInterrupt:
        print("envpool bench: interrupted", file=sys.stderr)
        sys.exit(130)
    finally:
        kill_descendants()  # nothing should be left; a failed close leaves nothing either
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
    elapsed = time.time() - started
    load_end = os.getloadavg()
    left = descendants()

    med = {k: statistics.median(v) for k, v in samples.items()}
    best = {k: max(v) for k, v in samples.items()}
    limit_b = med.get("b_single")
    out = []
    for r in rows:
        k = r["key"]
        entry = {
            "key": k,
            "group": r["group"],
            "label": r["label"],
            "processes": r["procs"],
            "median": med[k],
            "best": best[k],
            "rounds": samples[k],
            "wall_s": walls[k],
        }
        if cpu[k]:
            entry["cpu"] = {part: statistics.median(c[part] for c in cpu[k]) for part in cpu[k][0]}
        if r["group"] == "breakout":
            entry["ratio_to_limit"] = med[k] / limit_b
        elif r["group"] == "atari":
            entry["ratio_to_limit"] = med[k] / med["a_single"]
        elif r["group"] == "grid" and "g_original" in med:
            entry["ratio_to_original"] = med[k] / med["g_original"]
            # Both run in every round, one right after the other: the ratio within
            # a round is less exposed to load that comes and goes over a run.
            pairs = zip(samples[k], samples["g_original"], strict=True)
            entry["ratio_per_round"] = [a / b for a, b in pairs]
        out.append(entry)

    if args.json:
        print(
            json.dumps(
                {
                    "load_average": load,
                    "load_average_end": load_end,
                    "cores": os.cpu_count(),
                    "elapsed_s": elapsed,
                    "seconds": args.seconds,
                    "warmup": args.warmup,
                    "rounds": args.rounds,
                    "atari_skipped": atari_skip,
                    "original_moolib": ORIGINAL_FROM[0] if ORIGINAL_FROM else None,
                    "processes_left": left,
                    "results": out,
                },
                indent=1,
            )
        )
        return

    print(
        f"EnvPool benchmark: env steps/s, batch {BATCH_SIZE} x {NUM_BATCHES} double-buffered, "
        f"on {os.cpu_count()} cores; load average at start {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}, at the end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}"
    )
    print(
        f"median and best of {args.rounds} interleaved round(s) of {args.seconds:g} s counted "
        f"after {args.warmup:g} s of warm-up; ratios of medians; {elapsed:.0f} s in all"
    )
    titles = {
        "breakout": "ALE/Breakout-v5, raw frames (210x160x3 uint8, frameskip 4, sticky actions "
        "0.25); ratio: to the limit",
        "toy": f"toy env (Python; 4 float32 observation, reward 1, {TOY_EPISODE}-step episodes)",
        "grid": "GridEnv, the original moolib's EnvPool test env (4x4 float32 tensor), that "
        "test's settings; ratio: to the original moolib in the same rounds",
        "atari": "preprocessed Breakout, moolib.envs.create_env('breakout') (same machine, "
        "same rounds); ratio: to its limit",
    }
    references = {
        "breakout": (
            "original moolib (its published figure; its limit then 2 x 2,000)",
            ORIGINAL_BREAKOUT,
            ORIGINAL_BREAKOUT / (NUM_PROCESSES * ORIGINAL_SINGLE),
        ),
    }
    width = 62
    for group in ("breakout", "toy", "grid", "atari"):
        entries = [e for e in out if e["group"] == group]
        if not entries:
            continue
        print()
        print(titles[group])
        print(f"{'configuration':<{width}}{'procs':>7}{'median':>11}{'best':>11}{'ratio':>7}")
        for e in entries:
            ratio = e.get("ratio_to_limit", e.get("ratio_to_original"))
            ratio_text = f"{ratio:>7.2f}" if ratio is not None else " " * 7
            note = ""
            if e["key"] == "g_moolib" and "ratio_per_round" in e:
                per_round = e["ratio_per_round"]
                note = (
                    f"  per-round ratios: median {statistics.median(per_round):.2f}, "
                    f"{min(per_round):.2f} to {max(per_round):.2f}"
                )
            if e["key"] == "b_moolib":
                ok = e["ratio_to_limit"] >= TARGET_BREAKOUT_RATIO
                note = f"  target >= {TARGET_BREAKOUT_RATIO:.2f}: {'ok' if ok else 'MISSED'}"
            print(
                f"{e['label']:<{width}}{e['processes']:>7}{e['median']:>11,.0f}"
                f"{e['best']:>11,.0f}{ratio_text}{note}"
            )
        if group in references:
            label, value, ratio = references[group]
            print(f"{label:<{width}}{'2':>7}{value:>11,.0f}{'':>11}{ratio:>7.2f}")
        base = {"breakout": "b_single", "toy": "t_single", "atari": "a_single"}.get(group)
        base_cpu = next((e.get("cpu") for e in entries if e["key"] == base), None)
        for e in entries:
            c = e.get("cpu")
            if not c:
                continue
            line = f"  {e['label']}: on a CPU {c['run']:.0%}, waiting for one {c['wait']:.0%}"
            if "idle" in c:
                line += f", idle {c['idle']:.0%} (each worker); parent {c['parent']:.0%}"
            line += f"; {c['per_cpu']:,.0f} steps per CPU-second"
            if e["key"] != base and base_cpu and group not in ("toy", "grid"):
                line += f" = {c['per_cpu'] / base_cpu['per_cpu']:.2f} of the single loop's"
            print(line)
    if ORIGINAL_FROM:
        print(f"\noriginal moolib imported from {ORIGINAL_FROM[0]} by {args.original_python}")
    elif not args.original_python:
        print("\noriginal moolib not run: give --original-python PATH for its row")
    if atari_skip is not None:
        print(f"\npreprocessed Atari skipped: {atari_skip}")
    if importlib.util.find_spec("envpool") is None:
        print("\nenvpool library rows skipped: envpool is not installed")
    print()
    print(
        LEGEND.format(
            toy=TOY_EPISODE,
            mc1="\n      max_concurrency=1: at most 1 env of an instance steps at a time."
            if args.extra
            else "",
        )
    )
    print(
        "CPU lines: medians over rounds of the stepping processes' shares of the counted "
        "time (/proc schedstat):\n  on a CPU, runnable but waiting for a CPU (other load on "
        "the machine), blocked; steps per CPU-second\n  counts a pool's workers and parent "
        "together: the cost per step, apart from time lost waiting for a CPU."
    )
    print(f"processes left running: {len(left)}{' ' + str(left) if left else ''}")


if __name__ == "__main__":
    main()
