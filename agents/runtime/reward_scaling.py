"""Reward scaling for the on-policy actors (``agent.reward_scaling``): each reward divided
by the running standard deviation of a discounted return, then clipped, as gymnasium's
``NormalizeReward`` wrapper followed by a clip of 10 (CleanRL's continuous PPO).

Done in the actors rather than in each env: the envs' own rewards stay what the
EnvPool's episode returns sum, so the logged returns are the task's, and the
statistics are the peer's, over all its envs.
"""

from __future__ import annotations

import torch

__all__ = ["ReturnScaler"]


class ReturnScaler:
    """Scales the rewards of ``num_envs`` envs stepped together.

    Each env keeps a discounted return ``R = gamma * R + r``, zeroed after the step
    that ends its episode; the variance of every ``R`` so far is tracked (Chan et al.'s
    parallel update, as gymnasium's running mean and variance), and a reward is
    returned as ``r / sqrt(var + epsilon)``, clipped to ``[-clip, clip]``.
    """

    def __init__(
        self, num_envs: int, gamma: float, clip: float = 10.0, epsilon: float = 1e-8
    ) -> None:
        self.gamma = gamma
        self.clip = clip
        self.epsilon = epsilon
        self.returns = torch.zeros(num_envs, dtype=torch.float64)
        # gymnasium's RunningMeanStd starts from a count of 1e-4 at mean 0, variance 1.
        self.count = 1e-4
        self.mean = 0.0
        self.var = 1.0

    def _update(self, values: torch.Tensor) -> None:
        n = values.numel()
        batch_mean = float(values.mean())
        batch_var = float(values.var(unbiased=False))
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        m2 = self.var * self.count + batch_var * n + delta * delta * self.count * n / total
        self.var = m2 / total
        self.count = total

    def __call__(
        self, reward: torch.Tensor, done: torch.Tensor, envs: slice = slice(None)
    ) -> torch.Tensor:
        """The scaled rewards ``[B]`` (float32) of one step of the envs ``envs`` (of the
        ``num_envs``): ``reward`` and ``done`` as ``moolib.EnvPool`` gives them (``done``:
        the step ended an episode, and ``reward`` is that episode's last)."""
        returns = self.returns[envs] * self.gamma + reward.double().cpu()
        self._update(returns)
        self.returns[envs] = returns.masked_fill(done.cpu(), 0.0)
        scaled = reward.float() / float((self.var + self.epsilon) ** 0.5)
        return scaled.clamp(-self.clip, self.clip)

    def state_dict(self) -> dict[str, float]:
        """The statistics (for a checkpoint): the envs' returns restart at a resume."""
        return {"count": self.count, "mean": self.mean, "var": self.var}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Takes statistics ``state_dict`` gave."""
        self.count = float(state["count"])
        self.mean = float(state["mean"])
        self.var = float(state["var"])
