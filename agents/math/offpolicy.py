"""The math Ape-X and R2D2 share: n-step double-Q targets, value rescaling,
prioritized replay's importance weights, epsilon-greedy acting.

Layout: time-major like :mod:`moolib.agents.math.vtrace`, in *transition* form. Step
``t`` of a stream of ``T + 1`` observations is the transition from observation
``t`` to ``t + 1``: ``rewards[t]`` is the reward its action earned and ``dones[t]``
is true when the episode ended with it (in the EnvPool layout, where the reward
and ``done`` arrive with the next observation, that is ``batch["reward"][1:]``
and ``batch["done"][1:]``). ``bootstrap_values[t]`` is the value of observation
``t + 1``.

The n-step return of transition ``t`` sums ``m = min(n, T - t)`` rewards, so a
window that runs past the last observation is cut there and bootstraps from it;
an episode end inside the window stops the sum after that episode's last reward
and drops the bootstrap::

    G_t = sum_{k<m} gamma^k r_{t+k} prod_{j<k} (1 - d_{t+j})
          + gamma^m prod_{j<m} (1 - d_{t+j}) * bootstrap_{t+m-1}

EnvPool returns the next episode's first observation in place of a terminal one
and does not tell a time limit from a terminal state: both end the sum.

Targets are regression targets: everything here but the losses built from them
is computed without gradient.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "NStepTransitions",
    "double_q_bootstrap",
    "epsilon_greedy",
    "importance_weights",
    "inverse_value_rescale",
    "n_step_targets",
    "n_step_transitions",
    "value_rescale",
]

# R2D2's epsilon in h(x) (Kapturowski et al., 2019, after Pohlen et al., 2018).
RESCALE_EPSILON = 1e-3


class NStepTransitions(NamedTuple):
    """n-step transitions of a stream (see the module doc); all ``[T, B]``.

    Attributes:
        returns: the discounted sum of the window's rewards.
        discounts: ``gamma^m``, or 0 where the episode ended inside the window;
            the weight of the bootstrap value.
        steps: ``m``, the transitions in the window (int64), up to and including
            the one that ended the episode: transition ``t`` bootstraps from
            observation ``t + m`` (where the episode goes on).
    """

    returns: torch.Tensor
    discounts: torch.Tensor
    steps: torch.Tensor


def _check_stream(rewards: torch.Tensor, dones: torch.Tensor, n: int, discount: float) -> None:
    if rewards.dim() < 1 or rewards.shape != dones.shape:
        raise ValueError(
            f"rewards and dones must have one shape [T, ...], got {list(rewards.shape)} "
            f"and {list(dones.shape)}"
        )
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1], got {discount!r}")


@torch.no_grad()
def n_step_transitions(
    rewards: torch.Tensor, dones: torch.Tensor, *, n: int, discount: float
) -> NStepTransitions:
    """The n-step returns, bootstrap discounts and window lengths of a stream.

    Args:
        rewards: ``[T, B]`` (or ``[T]``) reward of each transition.
        dones: same shape, bool: the episode ended with that transition.
        n: the most rewards in one window.
        discount: gamma.

    What an actor stores per transition for Ape-X (with observations ``t`` and
    ``t + m``); windows of the last ``n - 1`` transitions are shorter, so an actor
    that wants full windows keeps those back for its next rollout.
    """
    _check_stream(rewards, dones, n, discount)
    num_steps = rewards.shape[0]
    notdone = (~dones.bool()).to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    discounts = torch.ones_like(rewards)
    steps = torch.zeros(rewards.shape, dtype=torch.int64, device=rewards.device)
    # 1 while the window's episode goes on (kept apart from discounts, which gamma = 0
    # would zero too).
    alive = torch.ones_like(rewards)
    # Vectorised over t: the k-th transition of every window at once; windows that
    # reached the stream's end (t + k = T) or their episode's end stop growing.
    for k in range(min(n, num_steps)):
        count = num_steps - k  # windows that have a k-th transition: t < T - k
        returns[:count] += discounts[:count] * rewards[k:]
        steps[:count] += alive[:count].long()
        alive[:count] *= notdone[k:]
        discounts[:count] *= discount * notdone[k:]
    return NStepTransitions(returns, discounts, steps)


@torch.no_grad()
def n_step_targets(
    rewards: torch.Tensor,
    dones: torch.Tensor,
    bootstrap_values: torch.Tensor,
    *,
    n: int,
    discount: float,
    rescale: bool = False,
    rescale_epsilon: float = RESCALE_EPSILON,
) -> torch.Tensor:
    """n-step targets ``G_t`` of a stream (module doc), ``[T, B]``, without gradient.

    Args:
        rewards, dones: as in :func:`n_step_transitions`.
        bootstrap_values: ``[T, B]``, the value of observation ``t + 1`` (e.g.
            :func:`double_q_bootstrap` of the Q-values of observations 1..T).
        n, discount: window and gamma.
        rescale: R2D2's value rescaling: the values are ``h``-rescaled, so the
            target is ``h(returns + discounts * h^-1(bootstrap))``.
        rescale_epsilon: the epsilon of ``h``.
    """
    if bootstrap_values.shape != rewards.shape:
        raise ValueError(
            f"bootstrap_values must have the shape of rewards {list(rewards.shape)}, "
            f"got {list(bootstrap_values.shape)}"
        )
    returns, discounts, steps = n_step_transitions(rewards, dones, n=n, discount=discount)
    index = torch.arange(rewards.shape[0], device=rewards.device).view(
        -1, *([1] * (rewards.dim() - 1))
    )
    bootstrap = bootstrap_values.gather(0, index + steps - 1)
    if rescale:
        bootstrap = inverse_value_rescale(bootstrap, rescale_epsilon)
    targets = returns + discounts * bootstrap
    return value_rescale(targets, rescale_epsilon) if rescale else targets


@torch.no_grad()
def double_q_bootstrap(q_online: torch.Tensor, q_target: torch.Tensor) -> torch.Tensor:
    """Double Q-learning's value of a state (van Hasselt et al., 2016): the target
    network's Q of the online network's greedy action. ``[..., A]`` -> ``[...]``."""
    if q_online.shape != q_target.shape:
        raise ValueError(
            f"q_online and q_target must have one shape, got {list(q_online.shape)} "
            f"and {list(q_target.shape)}"
        )
    greedy = q_online.argmax(dim=-1, keepdim=True)
    return q_target.gather(-1, greedy).squeeze(-1)


def value_rescale(x: torch.Tensor, epsilon: float = RESCALE_EPSILON) -> torch.Tensor:
    """``h(x) = sign(x) (sqrt(|x| + 1) - 1) + epsilon x`` (R2D2, after Pohlen et al.)."""
    return torch.sign(x) * (torch.sqrt(x.abs() + 1.0) - 1.0) + epsilon * x


def inverse_value_rescale(x: torch.Tensor, epsilon: float = RESCALE_EPSILON) -> torch.Tensor:
    """The exact inverse of :func:`value_rescale`:
    ``h^-1(x) = sign(x) (((sqrt(1 + 4 eps (|x| + 1 + eps)) - 1) / (2 eps))^2 - 1)``."""
    if epsilon <= 0:
        raise ValueError(f"epsilon must be positive, got {epsilon!r}")
    root = torch.sqrt(1.0 + 4.0 * epsilon * (x.abs() + 1.0 + epsilon))
    return torch.sign(x) * (((root - 1.0) / (2.0 * epsilon)) ** 2 - 1.0)


@torch.no_grad()
def importance_weights(probabilities: torch.Tensor, size: int, beta: float) -> torch.Tensor:
    """Prioritized replay's weights (Schaul et al., 2016) of a sampled batch:
    ``w_i = (N P(i))^-beta / max_j w_j``, the max over the batch, so weights only
    ever scale updates down.

    Args:
        probabilities: ``[B]`` the probability with which each item was sampled.
        size: ``N``, the items in the replay when they were sampled.
        beta: the exponent (0: no correction, 1: full correction).
    """
    if size < 1:
        raise ValueError(f"size must be a positive integer, got {size!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if probabilities.numel() == 0 or not bool((probabilities > 0).all()):
        raise ValueError("probabilities must be a non-empty tensor of positive numbers")
    # In float64: N P(i) spans many orders of magnitude in a large replay.
    weights = (size * probabilities.double()).pow(-beta)
    return (weights / weights.max()).to(probabilities.dtype)


def epsilon_greedy(
    q_values: torch.Tensor, epsilons: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Actions ``[B]`` (int64): per row of ``q_values [B, A]``, a uniformly random
    action with probability ``epsilons[b]``, else the greedy one. A ``generator``
    must live on ``q_values``' device."""
    batch, num_actions = q_values.shape
    device = q_values.device
    greedy = q_values.argmax(dim=-1)
    explore = torch.rand(batch, generator=generator, device=device) < epsilons.to(device)
    random = torch.randint(num_actions, (batch,), generator=generator, device=device)
    return torch.where(explore, random, greedy)
