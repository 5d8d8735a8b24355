"""Small, fast environments for tests and quick runs: CartPole (discrete actions), and
Pendulum (one continuous action)."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

from .registry import EnvOption

# Short name -> the gymnasium id it is made from.
CLASSIC_ENVS: dict[str, str] = {
    "cartpole": "CartPole-v1",
    "cartpole-novel": "CartPole-v1",
    "pendulum": "Pendulum-v1",
}


def _seeded(env: gymnasium.Env, seed: int | None) -> gymnasium.Env:
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


def make_cartpole(*, seed: int | None = None) -> gymnasium.Env:
    """gymnasium's CartPole-v1: float32 observations of shape (4,), 2 actions,
    reward 1 per step, episodes cut at 500 steps. ``seed`` seeds the env and
    its ``action_space``; without it each env draws a fresh random seed."""
    return _seeded(gymnasium.make(CLASSIC_ENVS["cartpole"]), seed)


def make_pendulum(*, seed: int | None = None) -> gymnasium.Env:
    """gymnasium's Pendulum-v1, the smallest continuous-action task: float32
    observations ``(cos theta, sin theta, angular velocity)``, one torque in
    [-2, 2], rewards from about -16 to 0 a step, episodes cut at 200 steps (a
    return near -150 is solved, -1,200 random). Options as ``make_cartpole``."""
    return _seeded(gymnasium.make(CLASSIC_ENVS["pendulum"]), seed)


class HideVelocities(gymnasium.ObservationWrapper):
    """CartPole with the velocities removed: observations ``(x, theta)``, shape (2,).

    One observation says where the cart and pole are, not where they are going,
    so a policy has to remember earlier observations (or their differences) to
    balance the pole: the test bed of a recurrent agent (R2D2) against a
    feed-forward one."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        space = env.observation_space
        keep = [0, 2]  # cart position, pole angle
        self.observation_space = gymnasium.spaces.Box(
            low=space.low[keep], high=space.high[keep], dtype=np.float32
        )
        self._keep = keep

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.asarray(observation, dtype=np.float32)[self._keep]


def make_cartpole_novel(*, seed: int | None = None) -> gymnasium.Env:
    """CartPole-v1 with no velocities in the observation (``cartpole-novel``):
    ``(x, theta)`` float32, 2 actions, episodes cut at 500 steps. Options as
    ``make_cartpole``."""
    return _seeded(HideVelocities(gymnasium.make(CLASSIC_ENVS["cartpole-novel"])), seed)


# The options of make_classic, in its order: the env registry's schema of env.options.
CLASSIC_OPTIONS: tuple[EnvOption, ...] = (EnvOption("seed"),)


def classic_name(name: str) -> str | None:
    """The short name (``"cartpole"``) of a classic env, case and blanks aside; None
    when ``name`` is none."""
    key = name.strip().lower()
    return key if key in CLASSIC_ENVS else None


_MAKERS: dict[str, Any] = {
    "cartpole": make_cartpole,
    "cartpole-novel": make_cartpole_novel,
    "pendulum": make_pendulum,
}


def make_classic(name: str, *, seed: int | None = None) -> gymnasium.Env:
    """The classic env ``name`` (``"cartpole"``, ``"cartpole-novel"`` or ``"pendulum"``).
    Raises ValueError for another name."""
    key = classic_name(name)
    if key is None:
        raise ValueError(f"unknown classic env {name!r}; known: {', '.join(CLASSIC_ENVS)}")
    return _MAKERS[key](seed=seed)
