"""TorchRL on one of bench/peers.py's tasks (run with TorchRL's own venv).

PPO as in TorchRL's own Atari PPO example (sota-implementations/ppo, ppo_atari:
8 envs, 4,096 frames per batch, mini-batches of 1,024, 3 epochs, Adam 2.5e-4,
clip 0.1, GAE gamma 0.99 lambda 0.95, entropy 0.01, critic coefficient 1.0,
gradient norm 0.5, normalized advantages), collected by a ``Collector`` (the synchronous one)
from a ``ParallelEnv`` of ``--procs`` worker processes, each a ``SerialEnv`` of
its share of the envs. Changed only to match the shared work: the envs are
bench/peers/common.py's (gymnasium's Atari preprocessing as moolib's, no sticky
actions, instead of TorchRL's own transforms), the network is the shallow IMPALA
one (16 8x8/4, 32 4x4/2, 256 units; the example's is the Nature CNN), the MinAtar
paper's for MinAtar, a 64x64 MLP for CartPole, and torch's threads are the cores
less the env processes. Frames per batch shrink with the task: 4,096 on Breakout
and MinAtar, 256 (8 envs x 32 steps) on CartPole.
"""

from __future__ import annotations

import functools

import common
import tensordict
import torch
import torchrl
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.envs import GymWrapper, ParallelEnv, SerialEnv
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import ClipPPOLoss
from torchrl.objectives.value import GAE

ALGOS = ("ppo",)


def one_env(task: str, seed: int) -> GymWrapper:
    """One counted env, wrapped for TorchRL (integer actions)."""
    return GymWrapper(common.make_env(task, seed), categorical_action_encoding=True)


def worker(task: str, n: int, seed: int) -> SerialEnv:
    """One worker process's envs, stepped one after the other."""
    return SerialEnv(n, [functools.partial(one_env, task, seed + i) for i in range(n)])


class Torso(nn.Module):
    """Shallow IMPALA (frames), the MinAtar paper's net (grids) or an MLP (vectors)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.scale = 255.0 if len(shape) == 3 and shape[1] >= 20 else 1.0
        if len(shape) == 1:
            conv, width = nn.Identity(), 64
        elif shape[1] >= 20:
            conv = nn.Sequential(
                nn.Conv2d(shape[0], 16, 8, 4), nn.ReLU(), nn.Conv2d(16, 32, 4, 2), nn.ReLU()
            )
            width = 256
        else:
            conv, width = nn.Sequential(nn.Conv2d(shape[0], 16, 3, 1), nn.ReLU()), 128
        with torch.no_grad():
            n = conv(torch.zeros(1, *shape)).flatten(1).shape[1]
        layers = [nn.Linear(n, width), nn.Tanh() if len(shape) == 1 else nn.ReLU()]
        if len(shape) == 1:
            layers += [nn.Linear(width, width), nn.Tanh()]
        self.net = nn.Sequential(conv, nn.Flatten(), *layers)
        self.width = width
        self.shape = shape

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """Features of observations with any leading batch dims."""
        nd = len(self.shape)
        lead = obs.shape[: obs.dim() - nd]
        x = obs.reshape(-1, *obs.shape[obs.dim() - nd :]).float() / self.scale
        return self.net(x).reshape(*lead, self.width)


def main() -> None:
    """Trains until the meter is done, then prints the result line."""
    args = common.parse_args(ALGOS)
    meter = common.Meter(args)
    torch.set_num_threads(common.learner_threads(args.procs))
    torch.manual_seed(args.seed)
    per = args.envs // args.procs
    env = ParallelEnv(
        args.procs,
        [
            functools.partial(worker, args.task, per, args.seed * 1000 + i * per)
            for i in range(args.procs)
        ],
    )
    obs_shape = tuple(
        env.observation_spec["observation"].shape[-(1 if args.task == "cartpole" else 3) :]
    )
    num_actions = env.action_spec.space.n
    torso = Torso(obs_shape)
    feats = TensorDictModule(torso, in_keys=["observation"], out_keys=["hidden"])
    policy_head = TensorDictModule(
        nn.Linear(torso.width, num_actions), in_keys=["hidden"], out_keys=["logits"]
    )
    actor = ProbabilisticActor(
        tensordict.nn.TensorDictSequential(feats, policy_head),
        in_keys=["logits"],
        spec=env.full_action_spec_unbatched if hasattr(env, "full_action_spec_unbatched") else None,
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )
    critic = ValueOperator(nn.Sequential(torso, nn.Linear(torso.width, 1)), in_keys=["observation"])
    frames = 256 if args.task == "cartpole" else 4096
    hp = dict(
        frames_per_batch=frames,
        mini_batch=frames // 4,
        epochs=3,
        lr=2.5e-4,
        clip=0.1,
        gamma=0.99,
        lmbda=0.95,
        entropy=0.01,
        critic_coef=1.0,
        max_grad_norm=0.5,
    )
    if args.task == "cartpole":
        hp.update(lr=1e-3, clip=0.2, entropy=0.0, epochs=10)
    batch = hp["frames_per_batch"]
    hp = common.tuned(hp, args, "lr", "frames_per_batch")
    if hp["frames_per_batch"] != batch and "mini_batch" not in args.settings:
        hp["mini_batch"] = hp["frames_per_batch"] // 4  # four mini-batches, as published
    frames = hp["frames_per_batch"]
    collector = Collector(env, actor, frames_per_batch=frames, total_frames=-1, device="cpu")
    adv = GAE(gamma=hp["gamma"], lmbda=hp["lmbda"], value_network=critic, average_gae=False)
    loss_fn = ClipPPOLoss(
        actor,
        critic,
        clip_epsilon=hp["clip"],
        entropy_coeff=hp["entropy"],
        critic_coeff=hp["critic_coef"],
        normalize_advantage=True,
    )
    opt = torch.optim.Adam(loss_fn.parameters(), lr=hp["lr"], eps=1e-5)
    meter.cycle_aligned = True  # collect, then learn: whole cycles are timed
    for data in collector:
        if meter.done.is_set():
            break
        for _ in range(hp["epochs"]):
            with torch.no_grad():
                adv(data)
            flat = data.reshape(-1)
            for idx in torch.randperm(flat.shape[0]).split(hp["mini_batch"]):
                out = loss_fn(flat[idx])
                loss = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
                opt.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(loss_fn.parameters(), hp["max_grad_norm"])
                opt.step()
        collector.update_policy_weights_()
        meter.tick()
    meter.done.wait()
    meter.finish(
        lib="torchrl",
        version=torchrl.__version__,
        tensordict=tensordict.__version__,
        torch=torch.__version__,
        algo="PPO",
        env_processes=args.procs,
        settings=hp,
    )


if __name__ == "__main__":
    main()
