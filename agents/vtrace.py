"""The agent ``vtrace``: IMPALA's V-trace actor-critic loss (Espeholt et al., 2018);
the V-trace math is ``moolib.agents.math.vtrace``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .math import vtrace as vtrace_math
from .nets.models import make_actor_critic
from .registry import ActorCriticConfig, register_agent


@dataclass(frozen=True)
class VTraceConfig(ActorCriticConfig):
    """IMPALA's settings (``conf/agent/vtrace.yaml``): the actor-critic agents', and
    V-trace's truncation levels of the importance weights."""

    clip_rho_threshold: float  # rho-bar: truncates the weights of the value targets
    clip_pg_rho_threshold: float  # truncates the weights of the policy-gradient advantages

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_number("clip_rho_threshold", 0.0)
        self.check_number("clip_pg_rho_threshold", 0.0)


@register_agent(
    "vtrace",
    VTraceConfig,
    make_network=make_actor_critic,
    runtime="onpolicy",
    continuous_actions=True,
)
def compute_loss(
    cfg: VTraceConfig, outputs: dict, batch: dict
) -> tuple[torch.Tensor, dict[str, float]]:
    """The V-trace loss of one learner batch.

    ``batch`` holds unrolls of T+1 steps (time-major, [T+1, B]): at step t the
    env output (``state``, ``reward`` earned by the previous action, ``done``)
    and what the actor did with it (``action``, ``policy_logits``, ``baseline``).
    ``outputs`` is the learner's forward pass over the same steps. The last
    step only bootstraps; it is the first step of the next unroll.
    """
    rewards = batch["reward"][1:]
    if cfg.reward_clip:
        rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
    # Discounting stops where an episode ended: the step after it starts anew.
    discounts = (~batch["done"][1:]).float() * cfg.discounting
    returns = vtrace_math.vtrace_from_logits(
        behavior_logits=batch["policy_logits"][:-1],
        target_logits=outputs["policy_logits"][:-1],
        actions=batch["action"][:-1],
        discounts=discounts,
        rewards=rewards,
        values=outputs["baseline"][:-1],
        bootstrap_value=outputs["baseline"][-1],
        clip_rho_threshold=cfg.clip_rho_threshold,
        clip_pg_rho_threshold=cfg.clip_pg_rho_threshold,
    )
    pg_loss = vtrace_math.policy_gradient_loss(
        outputs["policy_logits"][:-1], batch["action"][:-1], returns.pg_advantages
    )
    baseline_loss = vtrace_math.baseline_loss(returns.vs - outputs["baseline"][:-1])
    entropy_loss = vtrace_math.entropy_loss(
        outputs["policy_logits"][:-1], batch["action"].is_floating_point()
    )
    total = pg_loss + cfg.baseline_cost * baseline_loss + cfg.entropy_cost * entropy_loss
    return total, {
        "total_loss": total.item(),
        "policy_loss": pg_loss.item(),
        "baseline_loss": baseline_loss.item(),
        "entropy_loss": entropy_loss.item(),
    }
