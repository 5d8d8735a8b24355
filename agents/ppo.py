"""The agent ``ppo``: Proximal Policy Optimization (Schulman et al., 2017), trained by
the on-policy runtime like V-trace and A2C (the same actors, batches and
Accumulator), with the clipped surrogate objective and GAE advantages.

Each learner batch of ``batch_size`` unrolls is learned from ``update_epochs`` times,
each time in ``num_minibatches`` minibatches drawn afresh (``minibatches``): every
minibatch is one gradient offered to the Accumulator, so with
``virtual_batch_size = batch_size / num_minibatches`` each is one optimizer step,
its gradient averaged over the peers. Advantages and returns are computed once per
batch, from the values the actors computed as they acted; the ratio of each
minibatch is to the actors' policy, so actors a version or two behind the learner
are corrected for as PPO corrects for its own epochs. The math is
``moolib.agents.math.ppo``; the defaults are CleanRL's (``conf/agent/ppo.yaml``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from moolib.conf.checks import ConfigError

from .math import ppo as ppo_math
from .math.vtrace import action_log_probs
from .nets.models import make_actor_critic
from .registry import ActorCriticConfig, Update, register_agent


@dataclass(frozen=True)
class PPOConfig(ActorCriticConfig):
    """PPO's settings (``conf/agent/ppo.yaml``): the actor-critic agents' (``baseline_cost``
    is the value loss's coefficient, ``entropy_cost`` the entropy bonus's), and these."""

    gae_lambda: float  # GAE's lambda: 1 is the discounted return, 0 one-step TD
    num_minibatches: int  # minibatches each learner batch is cut into, per epoch
    update_epochs: int  # passes over each learner batch
    clip_coef: float  # the ratio is clipped to [1 - clip_coef, 1 + clip_coef]
    clip_value_loss: bool  # also clip the value's move from the actors' by clip_coef
    normalize_advantages: bool  # advantages to mean 0, deviation 1, per minibatch

    def passes(self) -> int:
        """Each unroll is in one gradient per epoch."""
        return self.update_epochs

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_number("gae_lambda", 0.0, 1.0)
        self.check_int("num_minibatches")
        self.check_int("update_epochs")
        self.check_number("clip_coef", 0.0)
        if self.clip_coef == 0:
            raise ConfigError("agent.clip_coef must be more than 0: at 0 the policy never moves")
        self.check_bool("clip_value_loss")
        self.check_bool("normalize_advantages")
        if self.batch_size % self.num_minibatches:
            raise ConfigError(
                f"agent.batch_size ({self.batch_size}) must be a multiple of "
                f"agent.num_minibatches ({self.num_minibatches}): every minibatch holds "
                "as many unrolls' steps"
            )


# The unroll keys a minibatch keeps: the network's inputs, and what the actors did.
_STEP_KEYS = ("state", "reward", "done", "prev_action", "action", "baseline")


def rollout(cfg: PPOConfig, batch: dict) -> dict[str, torch.Tensor]:
    """The T steps of ``batch``'s unrolls ([T + 1, B], the last one only bootstraps)
    that PPO learns from, [T, B] each: the network's inputs, the actors' actions, the
    log-probability (``log_prob``) and value (``baseline``) they had, and the GAE
    ``advantages`` and ``returns`` from those values."""
    rewards = batch["reward"][1:]
    if cfg.reward_clip:
        rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
    # Discounting stops where an episode ended: the step after it starts anew.
    discounts = (~batch["done"][1:]).float() * cfg.discounting
    values = batch["baseline"]
    advantages = ppo_math.gae(rewards, discounts, values[:-1], values[-1], cfg.gae_lambda)
    steps = {k: batch[k][:-1] for k in _STEP_KEYS}
    with torch.no_grad():
        steps["log_prob"] = action_log_probs(batch["policy_logits"][:-1], batch["action"][:-1])
    steps["advantages"] = advantages
    steps["returns"] = advantages + values[:-1]
    return steps


def minibatches(cfg: PPOConfig, batch: dict, core: tuple) -> Iterator[Update]:
    """PPO's gradients of one learner batch (the runtime's ``updates``): per epoch, its
    steps in ``num_minibatches`` minibatches of a fresh random order. Without an LSTM
    the minibatches are single steps from all unrolls ([1, N]: the network's output at
    a step depends on that step alone); with one, whole unrolls ([T, n]) with their
    LSTM state at the start. Either way each holds ``batch_size / num_minibatches``
    unrolls' steps, its size in the Accumulator."""
    steps = rollout(cfg, batch)
    num_steps, num_unrolls = steps["reward"].shape
    size = num_unrolls // cfg.num_minibatches
    device = steps["reward"].device
    if cfg.use_lstm:
        for _ in range(cfg.update_epochs):
            for chunk in torch.randperm(num_unrolls, device=device).split(size):
                yield Update(
                    {k: v[:, chunk] for k, v in steps.items()},
                    tuple(s[:, chunk] for s in core),
                    size,
                )
        return
    flat = {k: v.flatten(0, 1).unsqueeze(0) for k, v in steps.items()}
    for _ in range(cfg.update_epochs):
        order = torch.randperm(num_steps * num_unrolls, device=device)
        for chunk in order.split(size * num_steps):
            yield Update({k: v[:, chunk] for k, v in flat.items()}, (), size)


@register_agent(
    "ppo",
    PPOConfig,
    make_network=make_actor_critic,
    runtime="onpolicy",
    updates=minibatches,
    continuous_actions=True,
)
def compute_loss(
    cfg: PPOConfig, outputs: dict, batch: dict
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO loss of one minibatch (see ``minibatches``): the clipped surrogate, plus
    ``baseline_cost`` times the (clipped) value loss, plus ``entropy_cost`` times the
    negative entropy; all means over its steps. Its stats add ``approx_kl`` (the
    estimate ``mean(r - 1 - log r)`` of the KL from the actors' policy) and
    ``clip_fraction`` (the share of steps whose ratio was clipped)."""
    logits = outputs["policy_logits"]
    log_ratio = action_log_probs(logits, batch["action"]) - batch["log_prob"]
    advantages = batch["advantages"]
    if cfg.normalize_advantages:
        advantages = ppo_math.normalize(advantages)
    pg_loss = ppo_math.clipped_surrogate_loss(log_ratio, advantages, cfg.clip_coef)
    baseline_loss = ppo_math.value_loss(
        outputs["baseline"],
        batch["baseline"],
        batch["returns"],
        cfg.clip_coef if cfg.clip_value_loss else None,
    )
    entropy_loss = ppo_math.entropy_loss(logits, batch["action"].is_floating_point())
    total = pg_loss + cfg.baseline_cost * baseline_loss + cfg.entropy_cost * entropy_loss
    with torch.no_grad():
        ratio = log_ratio.exp()
        approx_kl = (ratio - 1 - log_ratio).mean()
        clip_fraction = ((ratio - 1).abs() > cfg.clip_coef).float().mean()
    return total, {
        "total_loss": total.detach(),
        "policy_loss": pg_loss.detach(),
        "baseline_loss": baseline_loss.detach(),
        "entropy_loss": entropy_loss.detach(),
        "approx_kl": approx_kl,
        "clip_fraction": clip_fraction,
    }
