"""V-trace off-policy returns and the IMPALA losses (Espeholt et al. 2018).

All tensors are time-major: ``[T, B]`` for per-step quantities and ``[T, B, A]``
for logits, where ``T`` is the unroll length, ``B`` the batch size and ``A`` the
number of actions. ``discounts[t]`` is ``gamma * (1 - done)``, the discount
applied between step ``t`` and step ``t + 1``; a discount of zero stops the
recursion, so returns never leak across an episode end.

V-trace targets are regression targets, not functions of the parameters, so
everything returned by :func:`from_importance_weights` and
:func:`vtrace_from_logits` is computed under :func:`torch.no_grad`. Gradients come
from the losses, which take the learner's logits and baseline directly.

The losses are *sums* over time and batch, not means, as in the IMPALA paper and
its reference implementation: the learning rates and loss weights tuned there
assume that scale, so a bigger batch is a bigger step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..nets import distributions as policy

__all__ = [
    "VTraceFromImportanceWeightsReturns",
    "VTraceReturns",
    "action_log_probs",
    "baseline_loss",
    "entropy_loss",
    "from_importance_weights",
    "policy_gradient_loss",
    "vtrace_from_logits",
]


class VTraceFromImportanceWeightsReturns(NamedTuple):
    """Output of :func:`from_importance_weights`; both fields are ``[T, B]``, no grad.

    Attributes:
        vs: V-trace value targets ``v_s``.
        pg_advantages: ``min(rho_bar_pg, rho_s) * (r_s + gamma_s * v_{s+1} - V(x_s))``.
    """

    vs: torch.Tensor
    pg_advantages: torch.Tensor


class VTraceReturns(NamedTuple):
    """Output of :func:`vtrace_from_logits`; every field is ``[T, B]``, no grad.

    Attributes:
        vs: V-trace value targets ``v_s``.
        pg_advantages: advantages to weight the policy gradient with.
        log_rhos: ``log pi(a_s | x_s) - log mu(a_s | x_s)`` (target minus behaviour).
        behavior_action_log_probs: ``log mu(a_s | x_s)`` under the behaviour (actor) policy.
        target_action_log_probs: ``log pi(a_s | x_s)`` under the target (learner) policy.
    """

    vs: torch.Tensor
    pg_advantages: torch.Tensor
    log_rhos: torch.Tensor
    behavior_action_log_probs: torch.Tensor
    target_action_log_probs: torch.Tensor


def _check_threshold(name: str, value: float | None) -> None:
    # A threshold <= 0 would zero every importance weight and silently stop learning.
    if value is not None and not value > 0:
        raise ValueError(f"{name} must be positive or None (no clipping), got {value!r}")


def _check_time_batch(name: str, tensor: torch.Tensor, shape: torch.Size) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{name} must have shape [T, B] = {list(shape)}, got {list(tensor.shape)}")


def action_log_probs(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``actions`` under the policy ``logits`` [T, B, P]; returns [T, B].
    Discrete actions are [T, B] int64 under logits; continuous ones [T, B, A] floats
    under Gaussian parameters (``moolib.agents.nets.distributions``).

    Differentiable in ``logits``.
    """
    if logits.dim() != 3 or actions.shape[:2] != logits.shape[:2]:
        raise ValueError(
            f"expected logits [T, B, P] and actions [T, B] (or [T, B, A]), got "
            f"{list(logits.shape)} and {list(actions.shape)}"
        )
    return policy.log_probs(logits, actions)


@torch.no_grad()
def from_importance_weights(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
) -> VTraceFromImportanceWeightsReturns:
    """V-trace targets and policy-gradient advantages from log importance weights.

    Args:
        log_rhos: ``[T, B]`` log of ``pi(a_t | x_t) / mu(a_t | x_t)``.
        discounts: ``[T, B]`` per-step discount, ``gamma * (1 - done)``.
        rewards: ``[T, B]`` rewards (already clipped/scaled as the agent wants).
        values: ``[T, B]`` baseline ``V(x_t)`` under the target policy.
        bootstrap_value: ``[B]`` ``V(x_T)``, the value of the state after the unroll.
        clip_rho_threshold: ``rho_bar``, the clip of the importance weights in the
            temporal differences (``None``: no clipping).
        clip_pg_rho_threshold: the clip of the importance weights in the policy
            gradient advantages (``None``: no clipping).

    Returns:
        ``vs`` and ``pg_advantages``, both ``[T, B]`` in the dtype of ``values``,
        computed without gradient.

    The trace coefficients are ``c_t = min(1, rho_t)`` (``c_bar = 1`` as in the
    paper). ``vs`` is computed backwards with
    ``v_t - V_t = delta_t + gamma_t c_t (v_{t+1} - V_{t+1})``, where
    ``delta_t = min(rho_bar, rho_t) (r_t + gamma_t V_{t+1} - V_t)``, ``V_T`` is the
    bootstrap value and ``v_T - V_T = 0``.
    """
    _check_threshold("clip_rho_threshold", clip_rho_threshold)
    _check_threshold("clip_pg_rho_threshold", clip_pg_rho_threshold)
    if values.dim() != 2:
        raise ValueError(f"values must have shape [T, B], got {list(values.shape)}")
    shape = values.shape
    _check_time_batch("log_rhos", log_rhos, shape)
    _check_time_batch("discounts", discounts, shape)
    _check_time_batch("rewards", rewards, shape)
    if bootstrap_value.shape != shape[1:]:
        raise ValueError(
            f"bootstrap_value must have shape [B] = {list(shape[1:])}, "
            f"got {list(bootstrap_value.shape)}"
        )

    # Work in the dtype of the values so float64 callers get float64 targets.
    dtype = values.dtype
    log_rhos = log_rhos.to(dtype)
    discounts = discounts.to(dtype)
    rewards = rewards.to(dtype)
    bootstrap_value = bootstrap_value.to(dtype)

    rhos = torch.exp(log_rhos)
    clipped_rhos = rhos if clip_rho_threshold is None else rhos.clamp(max=clip_rho_threshold)
    cs = rhos.clamp(max=1.0)

    # V(x_{t+1}) for every t, the last one being the bootstrap value.
    values_t_plus_1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)

    # Backward recursion on vs_t - V_t; T is an unroll length (tens of steps), so
    # a Python loop over time costs little next to the network.
    vs_minus_v = torch.empty_like(values)
    acc = torch.zeros_like(bootstrap_value)
    for t in range(shape[0] - 1, -1, -1):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values

    # The advantage at t bootstraps from the V-trace target at t + 1 (the
    # bootstrap value at the end), not from the raw baseline.
    vs_t_plus_1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    clipped_pg_rhos = (
        rhos if clip_pg_rho_threshold is None else rhos.clamp(max=clip_pg_rho_threshold)
    )
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_t_plus_1 - values)
    return VTraceFromImportanceWeightsReturns(vs=vs, pg_advantages=pg_advantages)


@torch.no_grad()
def vtrace_from_logits(
    behavior_logits: torch.Tensor,
    target_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
) -> VTraceReturns:
    """V-trace from the behaviour (actor) and target (learner) policy logits.

    Args:
        behavior_logits: ``[T, B, P]`` policy logits (or Gaussian parameters) the
            actors sampled ``actions`` from.
        target_logits: ``[T, B, P]`` those of the policy being learned.
        actions: ``[T, B]`` int64 actions taken (``[T, B, A]`` floats, continuous).
        discounts, rewards, values, bootstrap_value, clip_rho_threshold,
            clip_pg_rho_threshold: as in :func:`from_importance_weights`.

    Returns:
        A :class:`VTraceReturns`; every field is ``[T, B]`` and carries no
        gradient (use :func:`policy_gradient_loss` on ``target_logits`` for the
        policy gradient).
    """
    if behavior_logits.shape != target_logits.shape:
        raise ValueError(
            f"behavior_logits and target_logits must have the same shape [T, B, A], "
            f"got {list(behavior_logits.shape)} and {list(target_logits.shape)}"
        )
    behavior_action_log_probs = action_log_probs(behavior_logits, actions)
    target_action_log_probs = action_log_probs(target_logits, actions)
    log_rhos = target_action_log_probs - behavior_action_log_probs
    vtrace = from_importance_weights(
        log_rhos=log_rhos,
        discounts=discounts,
        rewards=rewards,
        values=values,
        bootstrap_value=bootstrap_value,
        clip_rho_threshold=clip_rho_threshold,
        clip_pg_rho_threshold=clip_pg_rho_threshold,
    )
    return VTraceReturns(
        vs=vtrace.vs,
        pg_advantages=vtrace.pg_advantages,
        log_rhos=log_rhos,
        behavior_action_log_probs=behavior_action_log_probs,
        target_action_log_probs=target_action_log_probs,
    )


def policy_gradient_loss(
    logits: torch.Tensor, actions: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    """``sum_{t,b} -log pi(a_t | x_t) * advantage_t`` (a scalar).

    ``advantages`` is detached: it weights the gradient of the log-probability
    and must not be pushed around itself. Summed over T and B (IMPALA scale).
    """
    if advantages.shape != actions.shape[:2]:
        raise ValueError(
            f"advantages must be [T, B] = {list(actions.shape[:2])}, got {list(advantages.shape)}"
        )
    cross_entropy = -action_log_probs(logits, actions)
    return torch.sum(cross_entropy * advantages.detach())


def baseline_loss(advantages: torch.Tensor) -> torch.Tensor:
    """``0.5 * sum(advantages ** 2)`` (a scalar), with ``advantages = vs - values``.

    Gradients flow into whatever ``advantages`` depends on (the baseline); pass
    detached targets. Summed, not averaged (IMPALA scale).
    """
    return 0.5 * torch.sum(advantages**2)


def entropy_loss(logits: torch.Tensor, continuous: bool = False) -> torch.Tensor:
    """Negative entropy of the policy (a scalar): ``sum_{t,b,a} p * log p`` for discrete
    actions, minus the Gaussian's entropy for continuous ones.

    Minimising it (with a positive cost) raises the entropy, keeping exploration
    alive. Summed over T and B (IMPALA scale).
    """
    return -policy.entropies(logits, continuous).sum()
