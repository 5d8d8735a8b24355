"""PufferLib 3 on one of bench/peers.py's tasks (run with PufferLib's own venv).

Its trainer (``pufferlib.pufferl.PuffeRL``: PPO with its prioritized segment sampling and
its V-trace-clipped GAE, collecting with ``evaluate`` and learning with ``train``, as its
``pufferl.train`` loops) over its vectorization (``pufferlib.vector.Multiprocessing``:
``--envs`` envs on ``--procs`` worker processes, shared-memory buffers, the trainer
stepping one half of the envs while the other half steps; its workers and its trainer
wait on each other by spinning on shared memory, a worker for 0.5 s after each step and
then every 10 ms, as made for one process per core). The settings are PufferLib's
own, as ``pufferl.load_config`` composes them: ``config/default.ini`` under the env's
file, ``config/atari.ini`` for Breakout (and, as the nearest, MinAtar) and
``config/classic_control.ini`` for CartPole.

Kept (default.ini unless named): the Muon optimizer (heavyball's ForeachMuon), learning
rate 0.015, Adam betas 0.95/0.999 and eps 1e-12, gamma 0.995, GAE lambda 0.90, V-trace
clips 1.0/1.0, PPO clip 0.2, value clip 0.2, value coefficient 2.0, entropy 0.001,
gradient norm 1.5, prioritized sampling alpha 0.8 and beta0 0.2, bptt_horizon 64 (the
segment length), update_epochs 1, max_minibatch_size 32768, float32, no torch.compile,
checkpoints every 200 updates (into the runner's ``--dir``), the trainer's reward
clipping to [-1, 1], the Multiprocessing backend with zero-copy batches. Breakout and
MinAtar (atari.ini): batch_size 8192, minibatch_size 2048, anneal_lr False,
total_timesteps 10,000,000. CartPole (classic_control.ini): total_timesteps 500,000,
with default.ini's anneal_lr (a cosine schedule over them); the run ends there, as
PufferLib's ``pufferl.train`` does (classic_control.ini's ``num_envs = 64`` and
``env_batch_size = 64`` sit in its [train] section, which the trainer does not read).

Changed, because the shared work demands it:

- ``device = cpu`` (default.ini: cuda) and torch's threads the cores less the env
  processes.
- The vectorization: ``num_envs = --envs`` (8), ``num_workers = --procs`` (2),
  ``batch_size`` (envs per step of the trainer) = half the envs (atari.ini: 128 envs
  on 16 workers, 64 per step, the same half; default.ini: ``auto``, which
  ``pufferlib.vector.make`` makes half the envs), ``overwork = True`` so that
  ``--procs`` may exceed the physical cores.
- The envs are bench/peers/common.py's (``pufferlib.emulation.GymnasiumPufferEnv`` over
  each): PufferLib's Atari env (atari.ini's [env]: frameskip 1, no sticky actions, one
  frame for its LSTM) and its classic_control CartPole (CartPole-v0, observations
  clipped to [-1, 1]) are not used.
- The network: the shallow IMPALA torso (16 8x8/4, 32 4x4/2, 256 units, frames / 255)
  on Breakout and the MinAtar paper's (16 3x3/1, 128 units) on MinAtar, feed-forward
  (atari.ini: ``rnn_name = Recurrent``, an LSTM of 512 over its Nature CNN of 512 on
  one frame, so ``use_rnn = False`` here), with PufferLib's linear heads and its
  initialization (orthogonal, actor std 0.01, value std 1); CartPole: PufferLib's own
  classic_control policy, ``pufferlib.models.Default`` with 64 units (Linear + GELU).
- CartPole: ``batch_size`` 512 (default.ini's ``auto``: envs x bptt_horizon) and
  ``minibatch_size`` 512 (default.ini: 8192, which the trainer refuses above the batch:
  one minibatch per update).
- ``seed = --seed`` (default.ini: 42), and torch seeded with it for the network.

``--lr-scale`` scales ``learning_rate``, ``--batch-scale`` scales ``batch_size`` (env
steps per update) and with it ``minibatch_size`` (the same number of minibatches) and,
where the batch no longer holds one segment per env, ``bptt_horizon``. ``--set KEY=VALUE``
sets a key of the trainer's config (default.ini's [train]), or of the vectorization
as ``vec.KEY``.

Side effects kept out of the repository: the runner works in ``--dir`` (``import
pufferlib`` links ``resources`` into the working directory; checkpoints go to
``--dir``/experiments), PufferLib's dashboard goes to /dev/null, and the result line to
the real stdout. ``import pufferlib.pufferl`` makes RuntimeWarnings errors and Ctrl-C
an ``os._exit(0)`` in this process and its workers: left as PufferLib has them.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any, TextIO

import common
import numpy as np
import torch
from torch import nn

ALGOS = ("ppo",)
# The name ``pufferl.load_config`` finds each task's ini by: atari.ini lists breakout
# (the nearest for MinAtar too), classic_control.ini cartpole.
CONFIG_NAME = {"breakout": "breakout", "minatar": "breakout", "cartpole": "cartpole"}


class Meter(common.Meter):
    """``common.Meter`` whose result line goes to the stdout the runner started with:
    ``sys.stdout`` is /dev/null meanwhile, where PufferLib's dashboard goes."""

    def __init__(self, args: argparse.Namespace, stdout: TextIO) -> None:
        self.stdout = stdout
        super().__init__(args)

    def finish(self, **info: Any) -> None:
        """Prints the result line on the runner's stdout and leaves."""
        sys.stdout = self.stdout
        super().finish(**info)


class Policy(nn.Module):
    """A torso (shallow IMPALA for frames, the MinAtar paper's for 10x10 grids), then
    PufferLib's linear actor and value heads, initialized as its models are."""

    def __init__(self, shape: tuple[int, ...], actions: int) -> None:
        super().__init__()
        from pufferlib.pytorch import layer_init

        c, h, _ = shape
        self.scale = 255.0 if h >= 20 else 1.0
        if h >= 20:
            conv = [layer_init(nn.Conv2d(c, 16, 8, 4)), nn.ReLU()]
            conv += [layer_init(nn.Conv2d(16, 32, 4, 2)), nn.ReLU()]
            width = 256
        else:
            conv, width = [layer_init(nn.Conv2d(c, 16, 3, 1)), nn.ReLU()], 128
        with torch.no_grad():
            n = nn.Sequential(*conv)(torch.zeros(1, *shape)).numel()
        self.encoder = nn.Sequential(
            *conv, nn.Flatten(), layer_init(nn.Linear(n, width)), nn.ReLU()
        )
        self.actor = layer_init(nn.Linear(width, actions), std=0.01)
        self.value = layer_init(nn.Linear(width, 1), std=1.0)

    def forward_eval(
        self, obs: torch.Tensor, state: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and values of a batch of observations (collection)."""
        hidden = self.encoder(obs.float() / self.scale)
        return self.actor(hidden), self.value(hidden)

    def forward(
        self, obs: torch.Tensor, state: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same, for learning (no recurrent state)."""
        return self.forward_eval(obs, state)


def creator(task: str) -> Any:
    """PufferLib's env creator: the shared counted env, wrapped for PufferLib."""
    import pufferlib.emulation

    def make(buf: Any = None, seed: int = 0) -> Any:
        env = common.make_env(task, seed)
        return pufferlib.emulation.GymnasiumPufferEnv(env=env, buf=buf, seed=seed)

    return make


def load_config(task: str) -> dict:
    """``pufferl.load_config`` for the task's ini (over default.ini); it parses the
    command line too, so it sees none."""
    import pufferlib.pufferl

    argv, sys.argv = sys.argv, sys.argv[:1]
    try:
        return pufferlib.pufferl.load_config(CONFIG_NAME[task])
    finally:
        sys.argv = argv


def settings(args: argparse.Namespace, config: dict) -> tuple[dict, dict]:
    """The trainer's config and the vectorization's settings: the ini files', with the
    changes the module docstring names and the tuning sweep's factors."""
    train = dict(config["train"])
    changed: dict[str, Any] = dict(device="cpu", seed=args.seed, use_rnn=False)
    if args.task == "cartpole":
        changed.update(batch_size=args.envs * train["bptt_horizon"])
        changed.update(minibatch_size=changed["batch_size"])
    out = common.tuned(changed, args, "learning_rate", "batch_size", train)
    batch = {**train, **changed}["batch_size"]
    if out.get("batch_size", batch) != batch:
        factor = out["batch_size"] / batch
        if "minibatch_size" not in args.settings:
            mini = {**train, **changed}["minibatch_size"]
            out["minibatch_size"] = max(1, round(mini * factor))
        if "bptt_horizon" not in args.settings:
            out["bptt_horizon"] = min(train["bptt_horizon"], out["batch_size"] // args.envs)
    vec = dict(config["vec"])
    vec.update(num_envs=args.envs, num_workers=args.procs, batch_size=args.envs // 2)
    vec.update(overwork=True)
    for key in [k for k in out if k.startswith("vec.")]:
        vec[key[len("vec.") :]] = out.pop(key)
    unknown = set(out) - set(train)
    if unknown:
        raise SystemExit(f"--set: no key {sorted(unknown)} in PufferLib's [train] config")
    train.update(out)
    train["data_dir"] = str(Path(args.dir) / "experiments")
    return train, vec


def main() -> None:
    """Trains until the meter is done (or PufferLib's total_timesteps), then prints the
    result line."""
    args = common.parse_args(ALGOS)
    args.dir = str(Path(args.dir).resolve())
    stdout, sys.stdout = sys.stdout, open(os.devnull, "w")  # noqa: SIM115
    meter = Meter(args, stdout)
    os.chdir(args.dir)  # import pufferlib links resources/ into the working directory
    torch.set_num_threads(common.learner_threads(args.procs))
    torch.manual_seed(args.seed)
    import pufferlib.models
    import pufferlib.pufferl
    import pufferlib.vector

    config = load_config(args.task)
    train, vec = settings(args, config)
    vec.pop("seed", None)  # vector.make does not pass it on; the trainer's seed seeds
    backend = getattr(pufferlib.vector, vec.pop("backend"))
    vecenv = pufferlib.vector.make(creator(args.task), backend=backend, **vec)
    try:
        driver = vecenv.driver_env
        if args.task == "cartpole":
            policy: nn.Module = pufferlib.models.Default(driver, hidden_size=64)
        else:
            shape = driver.single_observation_space.shape
            policy = Policy(shape, int(driver.single_action_space.n))
        trainer = pufferlib.pufferl.PuffeRL(dict(train, env=args.task), vecenv, policy)
        meter.cycle_aligned = True  # collect, then learn: whole cycles are timed
        while not meter.done.is_set() and trainer.global_step < train["total_timesteps"]:
            meter.tick()
            if meter.done.is_set():
                break
            trainer.evaluate()
            trainer.train()
        if not meter.done.is_set():
            meter.result.setdefault("reached", False)
            meter.result["note"] = (
                f"PufferLib's run ended at its total_timesteps {train['total_timesteps']:,} "
                f"({trainer.global_step:,} steps collected)"
            )
    finally:
        vecenv.close()  # its workers are not daemons and would step on
    reported = {k: v for k, v in train.items() if k != "data_dir"}
    reported["vec"] = dict(vec)
    reported["network"] = (
        "pufferlib.models.Default(64)" if args.task == "cartpole" else type(policy).__name__
    )
    meter.finish(
        lib="pufferlib",
        version=version("pufferlib"),
        torch=torch.__version__,
        numpy=np.__version__,
        algo="PPO",
        env_processes=args.procs,
        settings=reported,
    )


if __name__ == "__main__":
    main()
