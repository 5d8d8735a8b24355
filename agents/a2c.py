"""A2C: advantage actor-critic with n-step returns.

The same acting, batching and data-parallel machinery as IMPALA
(``moolib.agents.runtime.onpolicy``); only the loss differs. The unrolls are treated as
on-policy: no importance weights, so keep the actors close to the learner
(small ``num_actor_batches``, a learner step per batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .math import vtrace as vtrace_math
from .nets.models import make_actor_critic
from .registry import ActorCriticConfig, register_agent


@dataclass(frozen=True)
class A2CConfig(ActorCriticConfig):
    """A2C's settings (``conf/agent/a2c.yaml``): the actor-critic agents', no others."""


def n_step_returns(
    rewards: torch.Tensor, discounts: torch.Tensor, bootstrap: torch.Tensor
) -> torch.Tensor:
    """R_t = r_t + discount_t * R_{t+1}, with R_T = bootstrap; all [T, B]."""
    returns = torch.empty_like(rewards)
    running = bootstrap
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + discounts[t] * running
        returns[t] = running
    return returns


@register_agent(
    "a2c", A2CConfig, make_network=make_actor_critic, runtime="onpolicy", continuous_actions=True
)
def compute_loss(
    cfg: A2CConfig, outputs: dict, batch: dict
) -> tuple[torch.Tensor, dict[str, float]]:
    """The A2C loss of one batch of T+1-step unrolls (see ``vtrace.compute_loss``
    for the layout)."""
    rewards = batch["reward"][1:]
    if cfg.reward_clip:
        rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
    discounts = (~batch["done"][1:]).float() * cfg.discounting
    values = outputs["baseline"]
    with torch.no_grad():
        returns = n_step_returns(rewards, discounts, values[-1])
    advantages = returns - values[:-1]

    logits = outputs["policy_logits"][:-1]
    actions = batch["action"][:-1]
    pg_loss = vtrace_math.policy_gradient_loss(logits, actions, advantages)
    baseline_loss = vtrace_math.baseline_loss(advantages)
    entropy_loss = vtrace_math.entropy_loss(logits, actions.is_floating_point())
    total = pg_loss + cfg.baseline_cost * baseline_loss + cfg.entropy_cost * entropy_loss
    return total, {
        "total_loss": total.item(),
        "policy_loss": pg_loss.item(),
        "baseline_loss": baseline_loss.item(),
        "entropy_loss": entropy_loss.item(),
    }
