"""Small, fast environments for tests and quick runs."""

from __future__ import annotations

import gymnasium

CLASSIC_ENVS: dict[str, str] = {"cartpole": "CartPole-v1"}


def make_cartpole(*, seed: int | None = None) -> gymnasium.Env:
    """gymnasium's CartPole-v1: float32 observations of shape (4,), 2 actions,
    reward 1 per step, episodes cut at 500 steps. ``seed`` seeds the env and
    its ``action_space``; without it each env draws a fresh random seed."""
    env = gymnasium.make(CLASSIC_ENVS["cartpole"])
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env
