"""PPO's math (Schulman et al. 2017), with generalized advantage estimation (GAE,
Schulman et al. 2016).

Tensors are time-major where they have time: ``[T, B]`` per step, as in
``moolib.agents.math.vtrace``; ``discounts[t]`` is ``gamma * (1 - done)`` between step
``t`` and ``t + 1``, so nothing leaks across an episode end. The losses take a
minibatch of any shape (steps of unrolls, or single steps drawn from many) and are
*means* over it, as PPO's are: its learning rate and coefficients assume that scale,
whatever the size of a minibatch.
"""

from __future__ import annotations

import torch

from ..nets import distributions as policy

__all__ = [
    "clipped_surrogate_loss",
    "entropy_loss",
    "gae",
    "normalize",
    "value_loss",
]


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    discounts: torch.Tensor,
    values: torch.Tensor,
    bootstrap: torch.Tensor,
    lam: float,
) -> torch.Tensor:
    """The GAE(lambda) advantages [T, B] of an unroll: ``A_t = delta_t + discount_t *
    lam * A_{t+1}``, with ``delta_t = r_t + discount_t * V_{t+1} - V_t`` and ``V_T =
    bootstrap``. ``rewards``, ``discounts`` and ``values`` are [T, B], ``bootstrap`` [B];
    the returns the value is regressed on are ``advantages + values``."""
    if not rewards.shape == discounts.shape == values.shape:
        raise ValueError(
            f"rewards, discounts and values must have one shape [T, B], got "
            f"{list(rewards.shape)}, {list(discounts.shape)} and {list(values.shape)}"
        )
    if bootstrap.shape != values.shape[1:]:
        raise ValueError(
            f"bootstrap must have shape [B] = {list(values.shape[1:])}, got {list(bootstrap.shape)}"
        )
    next_values = torch.cat([values[1:], bootstrap.unsqueeze(0)])
    deltas = rewards + discounts * next_values - values
    advantages = torch.empty_like(deltas)
    running = torch.zeros_like(bootstrap, dtype=deltas.dtype)
    for t in reversed(range(deltas.shape[0])):
        running = deltas[t] + discounts[t] * lam * running
        advantages[t] = running
    return advantages


def normalize(advantages: torch.Tensor, epsilon: float = 1e-8) -> torch.Tensor:
    """``advantages`` less their mean, over their standard deviation (plus ``epsilon``),
    over the whole minibatch. The population's deviation: one of a single step is 0,
    not NaN."""
    mean = advantages.mean()
    std = advantages.std(correction=0)
    return (advantages - mean) / (std + epsilon)


def clipped_surrogate_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, clip: float
) -> torch.Tensor:
    """PPO's clipped surrogate objective, negated to be minimised (a scalar): the mean of
    ``max(-A r, -A clip(r, 1 - clip, 1 + clip))``, with ``r = exp(log_ratio)`` the ratio
    of the learner's probability of each action to the actor's. ``advantages`` is
    detached: it weights the ratio and is not learned."""
    if log_ratio.shape != advantages.shape:
        raise ValueError(
            f"log_ratio and advantages must have one shape, got {list(log_ratio.shape)} "
            f"and {list(advantages.shape)}"
        )
    ratio = log_ratio.exp()
    advantages = advantages.detach()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip, 1.0 + clip)
    return torch.max(unclipped, clipped).mean()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    clip: float | None,
) -> torch.Tensor:
    """``0.5 * mean((values - returns)^2)`` (a scalar); with ``clip``, PPO's clipped value
    loss: the larger of that error and the error of ``old_values`` (the actor's) moved
    towards ``values`` by at most ``clip``, per step, so one minibatch cannot move the
    value far from the one the advantages came from."""
    returns = returns.detach()
    error = (values - returns).pow(2)
    if clip is not None:
        old_values = old_values.detach()
        moved = old_values + (values - old_values).clamp(-clip, clip)
        error = torch.max(error, (moved - returns).pow(2))
    return 0.5 * error.mean()


def entropy_loss(logits: torch.Tensor, continuous: bool = False) -> torch.Tensor:
    """The negative entropy of the policy ``logits`` [..., P], averaged over the steps (a
    scalar): minimised with a positive cost, it keeps the policy exploring."""
    return -policy.entropies(logits, continuous).mean()
