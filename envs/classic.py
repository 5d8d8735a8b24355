"""Small, fast environments for tests and quick runs."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

from .registry import EnvOption

# Short name -> the gymnasium id it is made from.
CLASSIC_ENVS: dict[str, str] = {"cartpole": "CartPole-v1", "cartpole-novel": "CartPole-v1"}


def make_cartpole(*, seed: int | None = None) -> gymnasium.Env:
    """gymnasium's CartPole-v1: float32 observations of shape (4,), 2 actions,
    reward 1 per step, episodes cut at 500 steps. ``seed`` seeds the env and
    its ``action_space``; without it each env draws a fresh random seed."""
    env = gymnasium.make(CLASSIC_ENVS["cartpole"])
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


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
    env = HideVelocities(gymnasium.make(CLASSIC_ENVS["cartpole-novel"]))
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env


# The options of make_classic, in its order: the env registry's schema of env.options.
CLASSIC_OPTIONS: tuple[EnvOption, ...] = (EnvOption("seed"),)


def classic_name(name: str) -> str | None:
    """The short name (``"cartpole"``) of a classic env, case and blanks aside; None
    when ``name`` is none."""
    key = name.strip().lower()
    return key if key in CLASSIC_ENVS else None


def make_classic(name: str, *, seed: int | None = None) -> gymnasium.Env:
    """The classic env ``name`` (``"cartpole"`` or ``"cartpole-novel"``). Raises
    ValueError for another name."""
    key = classic_name(name)
    if key is None:
        raise ValueError(f"unknown classic env {name!r}; known: {', '.join(CLASSIC_ENVS)}")
    make: Any = make_cartpole_novel if key == "cartpole-novel" else make_cartpole
    return make(seed=seed)
