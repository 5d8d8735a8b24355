"""TorchRL on one of bench/peers.py's tasks (run with TorchRL's own venv).

Two algorithms, each as TorchRL's own Atari example sets it up (the examples ship in
the torchrl 0.14.1 wheel under site-packages/sota-implementations/; IMPALA's config
file does not, and was read from pytorch/rl's repository,
sota-implementations/impala/config_single_node.yaml, whose keys are those the
wheel's impala_single_node.py reads):

- ``--algo ppo``: sota-implementations/ppo, ppo_atari: 8 envs, 4,096 frames per
  batch, mini-batches of 1,024, 3 epochs, Adam 2.5e-4, clip 0.1, GAE gamma 0.99
  lambda 0.95, entropy 0.01, critic coefficient 1.0, gradient norm 0.5, normalized
  advantages; collected by a ``Collector`` (the synchronous one) from a
  ``ParallelEnv`` of ``--procs`` worker processes, each a ``SerialEnv`` of its share of
  the envs, then learned from (collect, then learn: whole cycles are timed). Frames per
  batch shrink with the task: 4,096 on Breakout and MinAtar, 256 (8 envs x 32 steps)
  on CartPole, with lr 1e-3, clip 0.2, no entropy bonus and 10 epochs there.
- ``--algo impala``: sota-implementations/impala/impala_single_node.py with
  config_single_node.yaml: rollouts of 20 env steps (its 80 frames over frame skip 4),
  learned from in batches of 32 rollouts (640 env steps) with one gradient step each
  (``sgd_updates: 1``, one mini-batch: each sample is learned from once), V-trace
  (``VTrace``, gamma 0.99, rho and c clipped at 1, advantages not normalized) into
  ``A2CLoss`` (critic coefficient 0.5, l2 critic loss, entropy 0.01), RMSprop lr 6e-4
  (alpha 0.99, eps 1e-8, no momentum or weight decay) decaying linearly to 0 over the
  example's 200M frames (50M env steps), gradient norm 40, rewards clipped to their
  sign (the example's ``SignTransform``). Collected as the example does, by an
  asynchronous multi-process ``Collector`` (``backend="process"``, ``sync=False``,
  policy weights updated at each batch) that keeps stepping while the learner learns;
  here its ``--procs`` collector processes each step a ``SerialEnv`` of its share of the
  envs (the example: 12 processes of one env), so a batch is 20 steps of each of a
  process's envs, and batches are gathered until they hold 32 rollouts. Unlike the
  example, no batch is dropped: it sets aside the one that arrives when 32 are held.

Changed only to match the shared work: the envs are bench/peers/common.py's
(gymnasium's Atari preprocessing as moolib's, no sticky actions, instead of TorchRL's
own transforms: no end of life as episode end, which the IMPALA example also uses as
the loss's done, no ``VecNorm`` of the pixels, which are scaled by 1/255 instead, and
the 108,000-frame episode limit instead of 4,500 steps); the network is the shallow
IMPALA one (16 8x8/4, 32 4x4/2, 256 units, shared by policy and value; the examples':
the Nature CNN with 512 units), the MinAtar paper's for MinAtar, a 64x64 MLP for
CartPole; torch's threads in the learning process are the cores less the env
processes (the IMPALA collector's processes keep TorchRL's default of 1 each).
CartPole runs IMPALA's Atari settings too. The tuning sweep scales ``lr`` and the
batch (``frames_per_batch`` for PPO, ``batch_size`` rollouts for IMPALA).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import common
import tensordict
import torch
import torchrl
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import Collector
from torchrl.envs import GymWrapper, ParallelEnv, SerialEnv
from torchrl.modules import ProbabilisticActor, ValueOperator
from torchrl.objectives import A2CLoss, ClipPPOLoss
from torchrl.objectives.value import GAE, VTrace

ALGOS = ("ppo", "impala")
NAMES = {"ppo": "PPO", "impala": "IMPALA"}


def one_env(task: str, seed: int) -> GymWrapper:
    """One counted env, wrapped for TorchRL (integer actions)."""
    return GymWrapper(common.make_env(task, seed), categorical_action_encoding=True)


def worker(task: str, n: int, seed: int) -> SerialEnv:
    """One worker process's envs, stepped one after the other."""
    return SerialEnv(n, [functools.partial(one_env, task, seed + i) for i in range(n)])


def workers(args: Any) -> list[Callable[[], SerialEnv]]:
    """The ``--procs`` worker processes' env constructors, ``--envs`` envs in all."""
    per = args.envs // args.procs
    return [
        functools.partial(worker, args.task, per, args.seed * 1000 + i * per)
        for i in range(args.procs)
    ]


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


def actor_critic(args: Any) -> tuple[ProbabilisticActor, ValueOperator]:
    """The policy (sampling actions, recording their log-probabilities) and the value
    network, one torso shared by both, shaped by an env of the task."""
    env = one_env(args.task, args.seed)
    obs_shape = tuple(
        env.observation_spec["observation"].shape[-(1 if args.task == "cartpole" else 3) :]
    )
    num_actions = env.action_spec.space.n
    spec = env.full_action_spec_unbatched if hasattr(env, "full_action_spec_unbatched") else None
    env.close()
    torso = Torso(obs_shape)
    feats = TensorDictModule(torso, in_keys=["observation"], out_keys=["hidden"])
    policy_head = TensorDictModule(
        nn.Linear(torso.width, num_actions), in_keys=["hidden"], out_keys=["logits"]
    )
    actor = ProbabilisticActor(
        tensordict.nn.TensorDictSequential(feats, policy_head),
        in_keys=["logits"],
        spec=spec,
        distribution_class=torch.distributions.Categorical,
        return_log_prob=True,
    )
    critic = ValueOperator(nn.Sequential(torso, nn.Linear(torso.width, 1)), in_keys=["observation"])
    return actor, critic


def optimize(opt: torch.optim.Optimizer, out: TensorDictBase, max_grad_norm: float) -> None:
    """One gradient step on a loss module's output (its objective, critic and entropy
    terms), the gradients' norm clipped."""
    loss = out["loss_objective"] + out["loss_critic"] + out["loss_entropy"]
    opt.zero_grad()
    loss.backward()
    params = [p for group in opt.param_groups for p in group["params"]]
    nn.utils.clip_grad_norm_(params, max_grad_norm)
    opt.step()


def train(collector: Any, meter: common.Meter, learn: Callable[[TensorDictBase], bool]) -> None:
    """Feeds the collector's batches to ``learn`` until the meter is done; after a batch
    that ``learn`` learned from, the collector gets the new weights. A loop that
    alternates (``meter.cycle_aligned``) ticks the meter at each collection's start."""
    for data in collector:
        if meter.done.is_set():
            break
        if learn(data):
            collector.update_policy_weights_()
        if meter.cycle_aligned:
            meter.tick()


def ppo(args: Any, meter: common.Meter) -> dict[str, Any]:
    """TorchRL's PPO as its ppo_atari example (see the docstring); its settings."""
    frames = 256 if args.task == "cartpole" else 4096
    hp: dict[str, Any] = dict(
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
    actor, critic = actor_critic(args)
    env = ParallelEnv(args.procs, workers(args))
    collector = Collector(
        env, actor, frames_per_batch=hp["frames_per_batch"], total_frames=-1, device="cpu"
    )
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

    def learn(data: TensorDictBase) -> bool:
        for _ in range(hp["epochs"]):
            with torch.no_grad():
                adv(data)
            flat = data.reshape(-1)
            for idx in torch.randperm(flat.shape[0]).split(hp["mini_batch"]):
                optimize(opt, loss_fn(flat[idx]), hp["max_grad_norm"])
        return True

    meter.cycle_aligned = True  # collect, then learn: whole cycles are timed
    train(collector, meter, learn)
    return hp


def impala(args: Any, meter: common.Meter) -> dict[str, Any]:
    """TorchRL's IMPALA as its impala_single_node example (see the docstring); its
    settings."""
    hp: dict[str, Any] = dict(
        unroll=20,
        batch_size=32,
        lr=6e-4,
        rmsprop_alpha=0.99,
        rmsprop_eps=1e-8,
        anneal_lr_env_steps=50_000_000,
        gamma=0.99,
        entropy=0.01,
        critic_coef=0.5,
        loss_critic_type="l2",
        max_grad_norm=40.0,
    )
    hp = common.tuned(hp, args, "lr", "batch_size")
    actor, critic = actor_critic(args)
    per = args.envs // args.procs
    collector = Collector(
        workers(args),
        actor,
        backend="process",
        sync=False,
        frames_per_batch=per * hp["unroll"],
        total_frames=-1,
        device="cpu",
        update_at_each_batch=True,
        num_threads=common.learner_threads(args.procs),
    )
    vtrace = VTrace(gamma=hp["gamma"], value_network=critic, actor_network=actor, average_adv=False)
    loss_fn = A2CLoss(
        actor,
        critic,
        entropy_coeff=hp["entropy"],
        critic_coeff=hp["critic_coef"],
        loss_critic_type=hp["loss_critic_type"],
    )
    opt = torch.optim.RMSprop(
        loss_fn.parameters(), lr=hp["lr"], alpha=hp["rmsprop_alpha"], eps=hp["rmsprop_eps"]
    )
    updates = hp["anneal_lr_env_steps"] // (hp["unroll"] * hp["batch_size"])
    held: list[TensorDictBase] = []
    done = 0

    def learn(data: TensorDictBase) -> bool:
        nonlocal done
        held.append(data)
        if sum(d.shape[0] for d in held) < hp["batch_size"]:
            return False
        batch = torch.cat(held, 0)  # [rollouts, unroll]
        held.clear()
        batch["next", "reward"] = batch["next", "reward"].sign()
        with torch.no_grad():
            vtrace(batch)
        for group in opt.param_groups:
            group["lr"] = hp["lr"] * max(0.0, 1 - done / updates)
        optimize(opt, loss_fn(batch.reshape(-1)), hp["max_grad_norm"])
        done += 1
        return True

    train(collector, meter, learn)
    hp["rollouts_per_update"] = math.ceil(hp["batch_size"] / per) * per
    return hp


def main() -> None:
    """Trains until the meter is done, then prints the result line."""
    args = common.parse_args(ALGOS)
    meter = common.Meter(args)
    torch.set_num_threads(common.learner_threads(args.procs))
    torch.manual_seed(args.seed)
    hp = {"ppo": ppo, "impala": impala}[args.algo](args, meter)
    meter.done.wait()
    meter.finish(
        lib="torchrl",
        version=torchrl.__version__,
        tensordict=tensordict.__version__,
        torch=torch.__version__,
        algo=NAMES[args.algo],
        env_processes=args.procs,
        settings=hp,
    )


if __name__ == "__main__":
    main()
