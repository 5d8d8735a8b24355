"""Ray RLlib on one of bench/peers.py's tasks (run with RLlib's own venv).

Two algorithms of RLlib's new API stack, each set up as RLlib's tuned Atari example
for it (ray-project/ray; the wheel does not ship rllib/tuned_examples/, so the files
were read from the repository: rllib/tuned_examples/appo/pong_appo.py, whose
settings rllib/examples/algorithms/appo/atari_appo.py repeats for Breakout, and
rllib/tuned_examples/impala/pong_impala.py, the same as
rllib/examples/algorithms/impala/pong_impala.py):

- ``--algo appo`` (APPOConfig), pong_appo.py's ``.training``: train batch 500 per
  learner, target network update frequency 2, lr 5e-4 (times the square root of the
  learners: 1), value coefficient 1.0, entropy 0.01 falling linearly to 0 at 3M env
  steps, weights broadcast every 5 training steps, a circular buffer of 4 batches each
  sampled up to 2 times; 2 aggregator actors per learner; APPO's defaults otherwise
  (V-trace, clip 0.4, grad clip 40, rollout fragments of 50). One epoch
  (``num_epochs=1``, the default) of one mini-batch per sample of the buffer, but the
  buffer hands each batch to the learner up to 2 times (fewer when newer batches push
  it out first): up to 2 gradient steps per batch, so it is not one pass (bench/peers.py
  classes it with PPO; ``trained_per_sampled`` in the result says how many it made).
- ``--algo impala`` (IMPALAConfig), pong_impala.py's ``.training``: train batch 500 per
  learner, grad clip 30 by global norm, lr 9e-4 (times the square root of the
  learners: 1), value coefficient 1.0, entropy 0.02 falling linearly to 0 at 3M env
  steps; IMPALA's defaults otherwise (V-trace, rho and c clipped at 1, weights broadcast
  every training step, rollout fragments of 50). One pass: ``num_epochs=1`` (the
  default), one mini-batch, and a plain queue to the learner that hands each batch
  over once.

Both as the examples run: one learner (the config's default ``num_learners=1``, a Ray
actor of its own, updating asynchronously), on CPU (``num_gpus_per_learner=0``, as the
examples' script picks with no GPU), ``clip_rewards=True`` (an old-API-stack option:
nothing on the new stack reads it in 2.60.0, so rewards are not clipped in either).
Changed only to match the shared work:

- the envs are bench/peers/common.py's (gymnasium's Atari preprocessing as moolib's,
  84x84, no sticky actions, no life loss as episode end; the examples' own
  ``wrap_atari_for_new_api_stack`` makes 64x64 frames, ends an episode at each lost
  life and presses fire on reset, and stacks 4 frames in a connector), turned
  channels-last and scaled to [0, 1] floats as that wrapper does for RLlib's encoders;
- ``--procs`` env runners (Ray actor processes) of ``--envs / --procs`` envs each (the
  examples: 2 runners of 2 envs for APPO, of 5 envs for IMPALA);
- the network is the shallow IMPALA one (conv 16 8x8/4 and 32 4x4/2, one 256-unit
  layer, shared by policy and value; the examples: 4 convs 16-128 4x4/2 and 256 units),
  the MinAtar paper's for MinAtar (16 3x3/1, 128 units), 64x64 for CartPole;
- torch's threads where the learning is: the learner actor gets
  ``num_cpus_per_learner`` = the cores less the env processes (Ray gives an actor as
  many threads as CPUs; the example's 1 on the 2-core VM), and Ray is told of as many
  CPUs as its actors ask for (env runners, learner, aggregators), at least the
  machine's cores: Ray's CPUs are only its scheduling units, the processes share the
  cores as every other library's do; a 1 GB object store, no dashboard;
- ``min_time_s_per_iteration=1`` (IMPALA's default 10) so that ``train()`` returns
  often enough for the runner to stop on time: it sets only how results are reported.

CartPole runs RLlib's tuned CartPole example where there is one:
rllib/tuned_examples/appo/cartpole_appo.py for ``--algo appo`` (APPO's defaults but
2 iterations of the circular buffer per batch, value coefficient 0.05, no entropy
bonus, the default network of two 256-unit layers shared by policy and value);
IMPALA has none on the new API stack, so it runs its Atari settings on a 64x64 MLP.
The tuning sweep scales ``lr`` and ``train_batch_size_per_learner``.
"""

from __future__ import annotations

import os

import common
import gymnasium
import numpy as np
import ray
import torch
from ray.rllib.algorithms.appo import APPOConfig
from ray.rllib.algorithms.impala import IMPALAConfig
from ray.rllib.core import ALL_MODULES
from ray.rllib.core.rl_module.default_model_config import DefaultModelConfig
from ray.rllib.utils.metrics import (
    ENV_RUNNER_RESULTS,
    LEARNER_RESULTS,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_TRAINED_LIFETIME,
)
from ray.tune.registry import register_env

ALGOS = ("appo", "impala")
CONFIGS = {"appo": APPOConfig, "impala": IMPALAConfig}
NAMES = {"appo": "APPO", "impala": "IMPALA"}
# The ``.training`` settings of RLlib's tuned Atari examples (see the docstring), for
# one learner (their lr is scaled by the square root of the learners).
TRAINING: dict[str, dict] = {
    "appo": {  # rllib/tuned_examples/appo/pong_appo.py
        "train_batch_size_per_learner": 500,
        "target_network_update_freq": 2,
        "lr": 0.0005,
        "vf_loss_coeff": 1.0,
        "entropy_coeff": [[0, 0.01], [3_000_000, 0.0]],
        "broadcast_interval": 5,
        "circular_buffer_num_batches": 4,
        "circular_buffer_iterations_per_batch": 2,
    },
    "impala": {  # rllib/tuned_examples/impala/pong_impala.py
        "train_batch_size_per_learner": 500,
        "grad_clip": 30.0,
        "grad_clip_by": "global_norm",
        "lr": 0.0009,
        "vf_loss_coeff": 1.0,
        "entropy_coeff": [[0, 0.02], [3_000_000, 0.0]],
    },
}
# rllib/tuned_examples/appo/cartpole_appo.py's ``.training`` (APPO's defaults else).
CARTPOLE_APPO = {
    "circular_buffer_iterations_per_batch": 2,
    "vf_loss_coeff": 0.05,
    "entropy_coeff": 0.0,
}
# The examples' aggregator actors per learner (pong_appo.py's ``.learners``).
AGGREGATORS = {"appo": 2, "impala": 0}
BATCH_KEY = "train_batch_size_per_learner"


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


def model(task: str, algo: str) -> DefaultModelConfig:
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
    if algo == "appo":  # cartpole_appo.py: the default network, shared
        return DefaultModelConfig(vf_share_layers=True)
    return DefaultModelConfig(fcnet_hiddens=[64, 64], vf_share_layers=False)


def training(task: str, algo: str) -> tuple[dict, dict]:
    """The ``.training`` settings the runner gives, and RLlib's defaults of the keys the
    sweep scales where the runner gives none."""
    if task == "cartpole" and algo == "appo":
        defaults = APPOConfig()
        return CARTPOLE_APPO, {"lr": defaults.lr, BATCH_KEY: defaults.train_batch_size_per_learner}
    return TRAINING[algo], {}


def trained_per_sampled(result: dict) -> float | None:
    """Env steps learned from per env step sampled, over the run so far, from a
    ``train()`` result: how many times the learner used each sample."""
    sampled = result.get(ENV_RUNNER_RESULTS, {}).get(NUM_ENV_STEPS_SAMPLED_LIFETIME)
    trained = (
        result.get(LEARNER_RESULTS, {}).get(ALL_MODULES, {}).get(NUM_ENV_STEPS_TRAINED_LIFETIME)
    )
    if not sampled or trained is None:
        return None
    return round(float(trained) / float(sampled), 3)


def main() -> None:
    """Trains until the meter is done, then prints the result line."""
    args = common.parse_args(ALGOS)
    meter = common.Meter(args)
    threads = common.learner_threads(args.procs)
    torch.set_num_threads(threads)
    aggregators = AGGREGATORS[args.algo]
    ray.init(
        num_cpus=max(len(os.sched_getaffinity(0)), args.procs + threads + aggregators),
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
        CONFIGS[args.algo]()
        .environment("peer", env_config={"task": args.task, "seed": args.seed}, clip_rewards=True)
        .framework("torch")
        .env_runners(
            num_env_runners=args.procs,
            num_envs_per_env_runner=args.envs // args.procs,
            rollout_fragment_length=50,
        )
        .learners(
            num_learners=1,
            num_gpus_per_learner=0,
            num_cpus_per_learner=threads,
            num_aggregator_actors_per_learner=aggregators,
        )
        .rl_module(model_config=model(args.task, args.algo))
        .reporting(min_time_s_per_iteration=1)
        .debugging(seed=args.seed)
    )
    given, defaults = training(args.task, args.algo)
    changed = common.tuned(given, args, "lr", BATCH_KEY, defaults)
    config = config.training(**changed)
    algo = config.build_algo()
    result: dict = {}
    try:
        while not meter.done.is_set():
            result = algo.train()
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
        algo=NAMES[args.algo],
        env_processes=args.procs,
        trained_per_sampled=trained_per_sampled(result),
        settings={
            "rollout_fragment_length": config.rollout_fragment_length,
            "num_learners": config.num_learners,
            "num_cpus_per_learner": config.num_cpus_per_learner,
            "num_aggregator_actors_per_learner": config.num_aggregator_actors_per_learner,
            "num_epochs": config.num_epochs,
            "minibatch_size": config.minibatch_size,
            **({"clip_param": config.clip_param} if args.algo == "appo" else {}),
            **changed,
        },
    )


if __name__ == "__main__":
    main()
