"""Ape-X DQN's math (Horgan et al., 2018): the actors' epsilons, their initial
priorities, and the learner's prioritized double-Q n-step loss.

The network is :class:`moolib.agents.nets.qmodels.DuelingQNet`; the n-step transitions
and targets are :mod:`moolib.agents.math.offpolicy`'s. An actor acts epsilon-greedily
with its own epsilon (:func:`epsilon_schedule`), cuts its steps into n-step
transitions (:func:`moolib.agents.math.offpolicy.n_step_transitions`) and sends them
to the replay with :func:`initial_priorities`; the learner samples a batch with
its sampling probabilities, weighs it (:func:`moolib.agents.math.offpolicy.importance_weights`),
takes :func:`loss` and writes the priorities it returns back. Gradients are then
clipped by norm (``grad_norm_clipping``, 40 in the paper) as every agent's are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .offpolicy import double_q_bootstrap, n_step_targets

__all__ = ["ApexLoss", "epsilon_schedule", "initial_priorities", "loss", "td_errors"]


def epsilon_schedule(
    num_actors: int, epsilon: float = 0.4, alpha: float = 7.0, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The actors' exploration rates ``eps_i = eps^(1 + alpha i / (N - 1))``, ``[N]``.

    ``N`` counts every acting env of the run (all envs of all actors of all peers):
    env ``i`` of the run takes entry ``i``. With ``N = 1`` the one actor gets ``eps``.
    """
    if isinstance(num_actors, bool) or not isinstance(num_actors, int) or num_actors < 1:
        raise ValueError(f"num_actors must be a positive integer, got {num_actors!r}")
    if not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
    if num_actors == 1:
        return torch.tensor([epsilon], dtype=dtype)
    exponents = 1.0 + alpha * torch.arange(num_actors, dtype=torch.float64) / (num_actors - 1)
    return torch.pow(torch.tensor(epsilon, dtype=torch.float64), exponents).to(dtype)


@torch.no_grad()
def initial_priorities(
    q_values: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    dones: torch.Tensor,
    *,
    n: int,
    discount: float,
) -> torch.Tensor:
    """An actor's priorities ``|delta_t|`` ``[T, B]`` for the transitions of its rollout.

    As in the paper, the actor uses its own network as both the online and the
    target network of the double-Q target (it has the Q-values of every step it
    acted on, so this costs no extra forward pass).

    Args:
        q_values: ``[T + 1, B, A]``, the actor's Q-values of observations 0..T.
        actions: ``[T, B]`` the actions taken at observations 0..T-1.
        rewards, dones: ``[T, B]`` per transition (see :mod:`moolib.agents.math.offpolicy`).
        n, discount: window and gamma; the windows (and so the priorities) are those of
            :func:`moolib.agents.math.offpolicy.n_step_transitions` on the same rollout.
    """
    if q_values.shape[0] != rewards.shape[0] + 1:
        raise ValueError(
            f"q_values must cover T + 1 = {rewards.shape[0] + 1} observations, "
            f"got {q_values.shape[0]}"
        )
    bootstrap = double_q_bootstrap(q_values[1:], q_values[1:])
    targets = n_step_targets(rewards, dones, bootstrap, n=n, discount=discount)
    taken = q_values[:-1].gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    return (targets - taken).abs()


def td_errors(
    q: torch.Tensor,
    actions: torch.Tensor,
    returns: torch.Tensor,
    discounts: torch.Tensor,
    q_online_next: torch.Tensor,
    q_target_next: torch.Tensor,
) -> torch.Tensor:
    """``delta = G - Q(s, a)`` ``[B]`` of a batch of n-step transitions, differentiable
    in ``q``; ``G = returns + discounts * Q_target(s', argmax_a Q_online(s', a))``.

    Args:
        q: ``[B, A]`` online Q-values of the transitions' first observations.
        actions: ``[B]`` the actions taken there.
        returns, discounts: ``[B]`` as :func:`moolib.agents.math.offpolicy.n_step_transitions`
            gives them.
        q_online_next, q_target_next: ``[B, A]`` both networks' Q-values of the
            observations the transitions bootstrap from.
    """
    with torch.no_grad():
        targets = returns + discounts * double_q_bootstrap(q_online_next, q_target_next)
    taken = q.gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    return targets - taken


class ApexLoss(NamedTuple):
    """Output of :func:`loss`.

    Attributes:
        loss: the scalar to differentiate.
        priorities: ``[B]`` ``|delta|``, the sampled items' new priorities (no grad).
        td_errors: ``[B]`` ``delta`` (no grad), for logs.
    """

    loss: torch.Tensor
    priorities: torch.Tensor
    td_errors: torch.Tensor


def loss(
    online: nn.Module,
    target: nn.Module,
    batch: dict[str, torch.Tensor],
    weights: torch.Tensor,
) -> ApexLoss:
    """Ape-X's learner loss on a sampled batch: ``mean_i w_i delta_i^2 / 2``.

    Args:
        online: the network being trained (a :class:`DuelingQNet`).
        target: its periodically updated copy.
        batch: ``state`` and ``next_state`` ``[B, *observation_shape]`` (the observations
            ``t`` and ``t + m``), ``action`` ``[B]``, and the transitions'
            ``return`` and ``discount`` ``[B]``.
        weights: ``[B]`` importance weights
            (:func:`moolib.agents.math.offpolicy.importance_weights`).
    """
    batch_size = batch["action"].shape[0]
    # One online pass over both observations (one larger batch rather than two calls).
    q_both = online(torch.cat([batch["state"], batch["next_state"]]))
    q, q_online_next = q_both[:batch_size], q_both[batch_size:].detach()
    with torch.no_grad():
        q_target_next = target(batch["next_state"])
    delta = td_errors(
        q, batch["action"], batch["return"], batch["discount"], q_online_next, q_target_next
    )
    value = (weights.to(delta.dtype) * 0.5 * delta.pow(2)).mean()
    detached = delta.detach()
    return ApexLoss(value, detached.abs(), detached)
