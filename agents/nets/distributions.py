"""The actor-critic agents' action distributions, read from their policy head's output
(the ``policy_logits`` of ``moolib.agents.nets.models``, ``[..., P]``):

- discrete actions (int64 ``[...]``): a categorical over ``P`` logits;
- continuous actions (float ``[..., A]``): a diagonal Gaussian whose ``P = 2A`` parameters
  are the mean then the log standard deviation of each dimension (CleanRL's continuous
  PPO: a state-independent log std, learned).

Which one is told by the actions (a float tensor is a vector of reals) or, where there
are none, by ``continuous``. The networks sample from it, and every loss and every
actor reads the distribution here, so an agent's math never asks which kind of action
it learns.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["entropies", "greedy", "log_probs", "sample", "split_gaussian"]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def split_gaussian(params: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and log standard deviation ``[..., A]`` of Gaussian parameters ``[..., 2A]``."""
    if params.shape[-1] % 2:
        raise ValueError(
            f"Gaussian policy parameters are a mean and a log std per dimension, "
            f"got {params.shape[-1]} values"
        )
    mean, log_std = params.chunk(2, dim=-1)
    return mean, log_std


def log_probs(params: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """The log-probability of each action under its policy: ``actions`` ``[...]`` int64
    under logits ``[..., n]``, or ``[..., A]`` floats under Gaussian parameters
    ``[..., 2A]``; returns ``[...]``. Differentiable in ``params``."""
    if actions.is_floating_point():
        mean, log_std = split_gaussian(params)
        if actions.shape != mean.shape:
            raise ValueError(
                f"expected continuous actions {list(mean.shape)} for policy parameters "
                f"{list(params.shape)}, got {list(actions.shape)}"
            )
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z.pow(2) - log_std - _LOG_SQRT_2PI).sum(-1)
    if actions.shape != params.shape[:-1]:
        raise ValueError(
            f"expected actions {list(params.shape[:-1])} for logits {list(params.shape)}, "
            f"got {list(actions.shape)}"
        )
    return F.log_softmax(params, dim=-1).gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)


def entropies(params: torch.Tensor, continuous: bool = False) -> torch.Tensor:
    """The entropy of each step's policy ``[...]`` (of a Gaussian: the sum over its
    dimensions of ``log_std + (1 + log 2 pi) / 2``)."""
    if continuous:
        _, log_std = split_gaussian(params)
        return (log_std + 0.5 + _LOG_SQRT_2PI).sum(-1)
    log_policy = F.log_softmax(params, dim=-1)
    return -(log_policy.exp() * log_policy).sum(-1)


def sample(
    params: torch.Tensor, continuous: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """An action drawn from each step's policy: ``[...]`` int64, or ``[..., A]`` floats
    (not clipped to the env's bounds: the learner needs the action the policy drew)."""
    if continuous:
        mean, log_std = split_gaussian(params)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return mean + noise * log_std.exp()
    probs = F.softmax(params.reshape(-1, params.shape[-1]), dim=-1)
    drawn = torch.multinomial(probs, 1, generator=generator)
    return drawn.view(params.shape[:-1])


def greedy(params: torch.Tensor, continuous: bool = False) -> torch.Tensor:
    """Each step's most likely action: the argmax of the logits, or the Gaussian's mean."""
    if continuous:
        return split_gaussian(params)[0]
    return params.argmax(dim=-1)
