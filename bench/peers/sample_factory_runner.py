"""Sample Factory on one of bench/peers.py's tasks (run with Sample Factory's own venv).

APPO with Sample Factory's published Atari settings (sf_examples/atari/atari_params.py:
rollout 128, batch 256, 4 epochs of 4 mini-batches, lr 2.5e-4 linearly decayed, clip
0.1, entropy 0.01, value coefficient 0.5, gradient norm 0.5, normalized inputs and
returns, Adam eps 1e-5) for Breakout and MinAtar, and its defaults for CartPole.
Changed only to match the shared work: the envs are bench/peers/common.py's
(gymnasium's Atari preprocessing as moolib's, no sticky actions, instead of its own
Atari wrappers); ``--procs`` rollout workers of ``--envs / --procs`` envs each (its
Atari file: 8 workers of 1 env); ``async_rl=True`` (Sample Factory's default, the
asynchronous PPO the library is named for; its Atari file turns it off to match
CleanRL's synchronous PPO); the network is its ``convnet_impala`` (the shallow
IMPALA one, 16 8x8/4 and 32 4x4/2) with one 256-unit layer (its Atari file:
``convnet_atari``, the Nature CNN); MinAtar's 10x10 grids are too small for its
conv encoders, so MinAtar's frames are flattened for its MLP encoder of 128 units; CPU only; torch's
threads in the main process are the cores less the env processes. Sample Factory
2.1.1 pins gymnasium<1.0 and numpy<2: it is installed with ``--no-deps`` beside
gymnasium 1.4.0 (the ALE's, as moolib's) and numpy 1.26 (with numpy 2 its rollout
workers fail on the first step).
"""

from __future__ import annotations

from pathlib import Path

import common
import gymnasium
import numpy as np
import sample_factory
import torch
from sample_factory.algo.learning.learner import Learner
from sample_factory.algo.runners.runner import AlgoObserver
from sample_factory.algo.utils.misc import ExperimentStatus
from sample_factory.cfg.arguments import parse_full_cfg, parse_sf_args
from sample_factory.envs.env_utils import register_env
from sample_factory.train import make_runner

ALGOS = ("appo",)
ATARI = dict(
    encoder_conv_architecture="convnet_impala",
    encoder_conv_mlp_layers=[256],
    obs_scale=255.0,
    gamma=0.99,
    exploration_loss_coeff=0.01,
    worker_num_splits=1,
    nonlinearity="relu",
    kl_loss_coeff=0.0,
    use_rnn=False,
    reward_scale=1.0,
    with_vtrace=False,
    recurrence=1,
    batch_size=256,
    rollout=128,
    max_grad_norm=0.5,
    num_epochs=4,
    num_batches_per_epoch=4,
    ppo_clip_ratio=0.1,
    value_loss_coeff=0.5,
    learning_rate=0.00025,
    lr_schedule="linear_decay",
    shuffle_minibatches=False,
    gae_lambda=0.95,
    batched_sampling=False,
    normalize_input=True,
    normalize_returns=True,
    adam_eps=1e-5,
)


def _vtrace_summaries_fixed() -> None:
    """Sample Factory 2.1.1's learner reads the minibatch's GAE advantages in its first
    summary, which V-trace does not compute, and the learner stops there (fixed after
    2.1.1, in its pull requests 286 and 332, not released). The summary gets the
    V-trace advantages the loss used; training is unchanged, and the GAE path, which has
    them, is untouched."""
    record = Learner._record_summaries

    def _record_summaries(self: Learner, var: object) -> object:
        if "advantages" not in var.mb:  # type: ignore[attr-defined]
            var.mb["advantages"] = var.adv  # type: ignore[attr-defined]
        return record(self, var)

    Learner._record_summaries = _record_summaries  # type: ignore[method-assign]


# At import, for its learner runs in a spawned process that imports this module again.
_vtrace_summaries_fixed()


def make(full_env_name: str, cfg: object, env_config: object, render_mode: object = None) -> object:
    """One counted env for a rollout worker."""
    worker = getattr(env_config, "worker_index", 0) if env_config else 0
    index = getattr(env_config, "vector_index", 0) if env_config else 0
    env = common.make_env(cfg.peer_task, cfg.seed * 1000 + worker * 100 + index)  # type: ignore[attr-defined]
    if cfg.peer_task == "minatar":  # type: ignore[attr-defined]
        # Its conv encoders do not fit 10x10 grids; flat, they get its MLP encoder.
        env = gymnasium.wrappers.FlattenObservation(env)
    return env


class Stop(AlgoObserver):
    """Ends training after the first training step once the meter is done."""

    def __init__(self, meter: common.Meter) -> None:
        self.meter = meter

    def on_training_step(self, runner: object, training_iteration_since_resume: int) -> None:
        """Called by the runner's event loop after each training step."""
        if self.meter.done.is_set():
            runner._stop_training()  # type: ignore[attr-defined]


def main() -> None:
    """Trains until the meter is done, then prints the result line."""
    args = common.parse_args(ALGOS)
    meter = common.Meter(args)
    torch.set_num_threads(common.learner_threads(args.procs))
    register_env("peer", make)
    argv = [
        "--env=peer",
        "--experiment=peer",
        f"--train_dir={Path(args.dir) / 'sf'}",
        f"--seed={args.seed}",
    ]
    parser, _ = parse_sf_args(argv=argv, evaluation=False)
    parser.add_argument("--peer_task", default=args.task)
    settings: dict = {}
    if args.task != "cartpole":
        settings.update(ATARI)
    if args.task == "minatar":
        settings.update(obs_scale=1.0, encoder_mlp_layers=[128], normalize_input=False)
        settings.pop("encoder_conv_architecture")
        settings.pop("encoder_conv_mlp_layers")
    settings.update(
        num_workers=args.procs,
        num_envs_per_worker=args.envs // args.procs,
        async_rl=True,
        device="cpu",
        serial_mode=False,
        train_for_env_steps=10**12,
        train_for_seconds=10**9,
        save_every_sec=10**9,
        save_best_every_sec=10**9,
        with_wandb=False,
        experiment_summaries_interval=1000,
    )
    defaults = {k: parser.get_default(k) for k in ("learning_rate", "batch_size")}
    settings = common.tuned(settings, args, "learning_rate", "batch_size", defaults)
    if settings.get("with_vtrace"):
        # Its V-trace takes each rollout as one sequence: it asserts recurrence ==
        # rollout (its DMLab V-trace configs set both to 32) and stalls the learner if not.
        settings["recurrence"] = settings.get("rollout", parser.get_default("rollout"))
    parser.set_defaults(**settings)
    cfg = parse_full_cfg(parser, argv)
    cfg, runner = make_runner(cfg)

    runner.register_observer(Stop(meter))
    status = runner.init()
    if status == ExperimentStatus.SUCCESS:
        runner.run()
    meter.done.wait()
    meter.finish(
        lib="sample-factory",
        version=getattr(sample_factory, "__version__", "2.1.1"),
        torch=torch.__version__,
        numpy=np.__version__,
        algo="APPO",
        env_processes=args.procs,
        settings={
            k: v
            for k, v in settings.items()
            if k
            in (
                "rollout",
                "batch_size",
                "num_workers",
                "num_envs_per_worker",
                "async_rl",
                "num_epochs",
                "num_batches_per_epoch",
                "with_vtrace",
                "recurrence",
                "learning_rate",
                *args.settings,
            )
        },
    )


if __name__ == "__main__":
    main()
