"""The on-policy actors' running normalizations, as CleanRL's continuous PPO has them in
gymnasium's wrappers: ``agent.observation_scaling`` (``NormalizeObservation``, then a
clip of 10) and ``agent.reward_scaling`` (``NormalizeReward``, then a clip of 10).

Done in the actors rather than in each env: the statistics are the peer's, over all
its envs, and go in its checkpoints, so that an evaluation of a checkpoint
(``moolib-eval``, ``eval_interval``) sees observations scaled as training last saw
them (``ScaledObservations``); and the envs' own rewards stay what the EnvPool's
episode returns sum, so the logged returns are the task's. The unrolls hold what the
network was fed: the scaled observations and rewards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["ObservationScaler", "ReturnScaler", "RunningMeanStd", "ScaledObservations"]

# What the normalized values are clipped to (CleanRL's continuous PPO).
CLIP = 10.0
EPSILON = 1e-8


class RunningMeanStd:
    """The mean and variance of every value of shape ``shape`` seen so far, updated a batch
    at a time (Chan et al.'s parallel update; gymnasium's RunningMeanStd, which starts
    from a count of 1e-4 at mean 0, variance 1)."""

    def __init__(self, shape: Sequence[int] = ()) -> None:
        self.mean = torch.zeros(tuple(shape), dtype=torch.float64)
        self.var = torch.ones(tuple(shape), dtype=torch.float64)
        self.count = 1e-4

    def update(self, values: torch.Tensor) -> None:
        """Adds ``values`` ``[N, *shape]``."""
        values = values.double().reshape(-1, *self.mean.shape)
        n = values.shape[0]
        batch_mean = values.mean(0)
        batch_var = values.var(0, unbiased=False)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean = self.mean + delta * n / total
        m2 = self.var * self.count + batch_var * n + delta.pow(2) * self.count * n / total
        self.var = m2 / total
        self.count = total

    def state_dict(self) -> dict:
        """The statistics, for a checkpoint."""
        return {"count": self.count, "mean": self.mean.clone(), "var": self.var.clone()}

    def load_state_dict(self, state: dict) -> None:
        """Takes statistics ``state_dict`` gave."""
        self.count = float(state["count"])
        self.mean = torch.as_tensor(state["mean"], dtype=torch.float64).clone()
        self.var = torch.as_tensor(state["var"], dtype=torch.float64).clone()


class ObservationScaler(RunningMeanStd):
    """Normalizes the observations of a batch of envs by the running mean and variance of
    all it has seen, and clips them to ``[-CLIP, CLIP]``."""

    def __call__(self, observations: torch.Tensor, update: bool = True) -> torch.Tensor:
        """``observations`` ``[B, *shape]`` normalized (float32), after adding them to the
        statistics when ``update``."""
        if update:
            self.update(observations)
        return normalize(observations, self.mean, self.var)


def normalize(observations: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``(observations - mean) / sqrt(var + EPSILON)`` clipped to ``[-CLIP, CLIP]``, float32."""
    mean = mean.to(device=observations.device, dtype=torch.float32)
    std = (var + EPSILON).sqrt().to(device=observations.device, dtype=torch.float32)
    return ((observations.float() - mean) / std).clamp(-CLIP, CLIP)


class ScaledObservations(nn.Module):
    """``model`` fed its observations normalized by fixed statistics (a checkpoint's, or
    the trainer's of the moment): what evaluations play, with the network's interface
    (``forward(inputs, core_state)``, ``initial_state``, ``action_space``). The
    statistics are buffers, so a copy loads new ones with ``load_state_dict``."""

    def __init__(self, model: nn.Module, mean: torch.Tensor, var: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.as_tensor(mean, dtype=torch.float64).clone())
        self.register_buffer("var", torch.as_tensor(var, dtype=torch.float64).clone())
        space = getattr(model, "action_space", None)
        if space is not None:
            self.action_space = space

    def forward(self, inputs: dict, core_state: tuple = ()) -> tuple[dict, tuple]:
        """The network's outputs for ``inputs`` with ``inputs["state"]`` normalized."""
        scaled = {**inputs, "state": normalize(inputs["state"], self.mean, self.var)}
        return self.model(scaled, core_state)

    def initial_state(self, batch_size: int = 1) -> tuple:
        """The network's initial core state."""
        return self.model.initial_state(batch_size)


class ReturnScaler:
    """Scales the rewards of ``num_envs`` envs stepped together.

    Each env keeps a discounted return ``R = gamma * R + r``, zeroed after the step
    that ends its episode; the variance of every ``R`` so far is tracked, and a reward
    is returned as ``r / sqrt(var + epsilon)``, clipped to ``[-clip, clip]``.
    """

    def __init__(self, num_envs: int, gamma: float, clip: float = CLIP) -> None:
        self.gamma = gamma
        self.clip = clip
        self.returns = torch.zeros(num_envs, dtype=torch.float64)
        self.stats = RunningMeanStd()

    def __call__(
        self, reward: torch.Tensor, done: torch.Tensor, envs: slice = slice(None)
    ) -> torch.Tensor:
        """The scaled rewards ``[B]`` (float32) of one step of the envs ``envs`` (of the
        ``num_envs``): ``reward`` and ``done`` as ``moolib.EnvPool`` gives them (``done``:
        the step ended an episode, and ``reward`` is that episode's last)."""
        returns = self.returns[envs] * self.gamma + reward.double().cpu()
        self.stats.update(returns)
        self.returns[envs] = returns.masked_fill(done.cpu(), 0.0)
        scaled = reward.float() / float((self.stats.var + EPSILON).sqrt())
        return scaled.clamp(-self.clip, self.clip)

    def state_dict(self) -> dict:
        """The statistics (for a checkpoint): the envs' returns restart at a resume."""
        return self.stats.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Takes statistics ``state_dict`` gave."""
        self.stats.load_state_dict(state)
