"""Stable-Baselines3 on one of bench/peers.py's tasks (run with SB3's own venv).

PPO (or A2C), rl-baselines3-zoo's published settings for Atari (for Breakout and
MinAtar; A2C with its ``RMSpropTFLike`` optimizer, eps 1e-5) and for CartPole-v1,
without the zoo's linear schedules of PPO's CartPole learning rate and clip (a run
here has no planned length to decay over); the zoo's ``DummyVecEnv`` (every env
in the learner's process) for the score, and ``SubprocVecEnv`` for the throughput
from pixels, where SB3's docs advise it for envs that cost more to step than a
process hop (Breakout's emulator and preprocessing). Changed only to match the
shared work: the envs are bench/peers/common.py's (gymnasium's Atari
preprocessing, as moolib's, instead of SB3's AtariWrapper, which adds episodic
life, fire-on-reset and reward clipping on the env side), the network is the
shallow IMPALA one (16 8x8/4, 32 4x4/2, 256 units) for Breakout and the MinAtar
paper's (16 3x3/1, 128 units) for MinAtar, and torch's threads are the cores less
the env processes. SubprocVecEnv runs one process per env (it cannot put several
envs in one process), so ``--envs`` processes step the envs in the throughput.
"""

from __future__ import annotations

import functools
import inspect

import common
import stable_baselines3
import torch
from stable_baselines3 import A2C, PPO
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.sb2_compat.rmsprop_tf_like import RMSpropTFLike
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv
from torch import nn

ALGOS = ("ppo", "a2c")


class Torso(BaseFeaturesExtractor):
    """The shallow IMPALA torso (frames) or the MinAtar paper's (10x10 grids)."""

    def __init__(self, space: object, features_dim: int = 256) -> None:
        super().__init__(space, features_dim)
        c, h, _ = space.shape  # type: ignore[attr-defined]
        if h >= 20:
            conv = nn.Sequential(
                nn.Conv2d(c, 16, 8, 4), nn.ReLU(), nn.Conv2d(16, 32, 4, 2), nn.ReLU()
            )
        else:
            conv = nn.Sequential(nn.Conv2d(c, 16, 3, 1), nn.ReLU())
        with torch.no_grad():
            n = conv(torch.zeros(1, *space.shape)).numel()  # type: ignore[attr-defined]
        self.net = nn.Sequential(conv, nn.Flatten(), nn.Linear(n, features_dim), nn.ReLU())

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Features of a batch of observations (already scaled by SB3 for frames)."""
        return self.net(obs.float())


class Stop(BaseCallback):
    """Ends ``learn`` once the meter is done."""

    def __init__(self, meter: common.Meter) -> None:
        super().__init__()
        self.meter = meter

    def _on_rollout_start(self) -> None:
        self.meter.tick()

    def _on_step(self) -> bool:
        return not self.meter.done.is_set()


def settings(task: str, algo: str) -> tuple[dict, dict]:
    """rl-baselines3-zoo's hyperparameters for the task (its Atari ones for Breakout
    and MinAtar), and the policy's keyword arguments."""
    if task == "cartpole":
        policy: dict = {}
        if algo == "ppo":
            hp = dict(
                n_steps=32,
                batch_size=256,
                gae_lambda=0.8,
                gamma=0.98,
                n_epochs=20,
                ent_coef=0.0,
                learning_rate=1e-3,
                clip_range=0.2,
            )
        else:
            hp = dict(ent_coef=0.0)
        return hp, policy
    width = 256 if task == "breakout" else 128
    policy = dict(
        features_extractor_class=Torso,
        features_extractor_kwargs=dict(features_dim=width),
        net_arch=[],
    )
    if task == "minatar":
        policy["normalize_images"] = False  # 0/1 cells
    if algo == "ppo":
        hp = dict(
            n_steps=128,
            n_epochs=4,
            batch_size=256,
            learning_rate=2.5e-4,
            clip_range=0.1,
            vf_coef=0.5,
            ent_coef=0.01,
        )
    else:
        hp = dict(ent_coef=0.01, vf_coef=0.25)
        policy["optimizer_class"] = RMSpropTFLike
        policy["optimizer_kwargs"] = dict(eps=1e-5)
    return hp, policy


def main() -> None:
    """Trains until the meter is done, then prints the result line."""
    args = common.parse_args(ALGOS)
    meter = common.Meter(args)
    torch.set_num_threads(common.learner_threads(args.procs))
    vec_env = SubprocVecEnv if args.mode == "throughput" else DummyVecEnv
    envs = vec_env(
        [
            functools.partial(common.make_env, args.task, args.seed * 1000 + i)
            for i in range(args.envs)
        ]
    )
    hp, policy = settings(args.task, args.algo)
    cls = PPO if args.algo == "ppo" else A2C
    signature = inspect.signature(cls.__init__).parameters
    defaults = {k: signature[k].default for k in ("learning_rate", "n_steps")}
    hp = common.tuned(hp, args, "learning_rate", "n_steps", defaults)
    model = cls(
        "MlpPolicy" if args.task == "cartpole" else "CnnPolicy",
        envs,
        seed=args.seed,
        device="cpu",
        policy_kwargs=policy,
        verbose=0,
        **hp,
    )
    meter.cycle_aligned = True  # collect a rollout, then learn: whole cycles are timed
    model.learn(total_timesteps=10**12, callback=Stop(meter))
    meter.done.wait()
    meter.finish(
        lib="stable-baselines3",
        version=stable_baselines3.__version__,
        torch=torch.__version__,
        algo=args.algo.upper(),
        env_processes=args.envs if vec_env is SubprocVecEnv else 0,
        vec_env=vec_env.__name__,
        settings=hp,
    )


if __name__ == "__main__":
    main()
