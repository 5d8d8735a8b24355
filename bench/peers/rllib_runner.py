"""Ray RLlib on one of bench/peers.py's tasks (run with RLlib's own venv).

APPO (RLlib's new API stack) with RLlib's own defaults for it (V-trace, clip 0.4,
lr 5e-4, entropy 0.01, value coefficient 0.5, gradient clip 40), the learner in
the driver process (``num_learners=0``, CPU), ``--procs`` env runners (Ray actor
processes) of ``--envs / --procs`` envs each, rollout fragments of 50 steps (RLlib's
Atari examples). Changed only to match the shared work: the envs are
bench/peers/common.py's (gymnasium's Atari preprocessing as moolib's, no sticky
actions), turned channels-last and scaled to [0, 1] floats as RLlib's Atari wrapper
does for its conv encoder; the network is the shallow IMPALA one (conv filters 16
8x8/4 and 32 4x4/2, one 256-unit layer), the MinAtar paper's for MinAtar (16 3x3/1,
128 units), 64x64 for CartPole; torch's threads in the driver are the cores less
the env processes; Ray gets the machine's cores and a 1 GB object store.
"""

from __future__ import annotations

import os

import common
import gymnasium
import numpy as np
import ray
import torch
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.tune.registry import register_env

ALGOS = ("appo",)


class ChannelsLast(gymnasium.ObservationWrapper):
    """Frames ``(C, H, W)`` uint8 to ``(H, W, C)`` float32 in [0, 1] (RLlib's encoders
    take channels last)."""

    def __init__(self, env: gymnasium.Env, scale: float) -> None:
        super().__init__(env)
        c, h, w = env.observation_space.shape
        self.scale = scale
        self.observation_space = gymnasium.spaces.Box(0.0, 1.0, (h, w, c), np.float32)

    def observation(self, observation: np.ndarray) -> np.ndarray:
        """The frame, channels last, scaled."""
        return np.asarray(observation, dtype=np.float32).transpose(1, 2, 0) / self.scale


def make(config: dict) -> gymnasium.Env:
    """One counted env for an env runner."""
    seed = config.get("seed", 0) * 1000 + config.worker_index * 100 + config.vector_index
    env = common.make_env(config["task"], seed)
    if config["task"] == "breakout":
        env = ChannelsLast(env, 255.0)
    elif config["task"] == "minatar":
        env = ChannelsLast(env, 1.0)
    return env


def model(task: str) -> DefaultModelConfig:
    """The shared network class for the task."""
    if task == "breakout":
        return DefaultModelConfig(
            conv_filters=[[16, 8, 4], [32, 4, 2]],
            fcnet_hiddens=[256],
            head_fcnet_hiddens=[],
            vf_share_layers=True,
        )
    if task == "minatar":
        return DefaultModelConfig(
            conv_filters=[[16, 3, 1]],
            fcnet_hiddens=[128],
            head_fcnet_hiddens=[],
            vf_share_layers=True,
        )
    return DefaultModelConfig(fcnet_hiddens=[64, 64], vf_share_layers=False)


def main() -> None:
    """Trains until the meter is done, then prints the result line."""
    args = common.parse_args(ALGOS)
    meter = common.Meter(args)
    torch.set_num_threads(common.learner_threads(args.procs))
    ray.init(
        num_cpus=max(len(os.sched_getaffinity(0)), args.procs),
        object_store_memory=10**9,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                common.COUNT_DIR_VAR: os.environ[common.COUNT_DIR_VAR],
                "PYTHONPATH": os.environ["PYTHONPATH"],
            }
        },
    )
    register_env("peer", make)
    config = (
        APPOConfig()
        .environment("peer", env_config={"task": args.task, "seed": args.seed})
        .framework("torch")
        .env_runners(
            num_env_runners=args.procs,
            num_envs_per_env_runner=args.envs // args.procs,
            rollout_fragment_length=50,
        )
        .learners(num_learners=0)
        .rl_module(model_config=model(args.task))
        .reporting(min_time_s_per_iteration=1)
        .debugging(seed=args.seed)
    )
    batch_key = "train_batch_size_per_learner"
    defaults = {"lr": config.lr, batch_key: config.train_batch_size_per_learner}
    changed = common.tuned({}, args, "lr", batch_key, defaults)
    config = config.training(**changed)
    algo = config.build_algo()
    try:
        while not meter.done.is_set():
            algo.train()
    finally:
        try:
            algo.stop()
        finally:
            ray.shutdown()
    meter.finish(
        lib="rllib",
        version=ray.__version__,
        torch=torch.__version__,
        gymnasium=gymnasium.__version__,
        algo="APPO",
        env_processes=args.procs,
        settings={
            "rollout_fragment_length": 50,
            "lr": config.lr,
            "entropy_coeff": config.entropy_coeff,
            "clip_param": config.clip_param,
            "train_batch_size_per_learner": config.train_batch_size_per_learner,
            "num_epochs": config.num_epochs,
            **changed,
        },
    )


if __name__ == "__main__":
    main()
