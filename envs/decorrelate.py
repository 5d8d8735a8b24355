"""Decorrelating the envs of an actor at every start and resume (``env.decorrelate_steps``).

An actor's envs are made afresh at every start and resume of a run, and its env
pool resets them all at its first step. Under a near-deterministic policy in an
env without sticky actions they would then play the same phase of their episodes
side by side, end them together, and hand the learner unrolls that are near
copies of each other (docs/toolkit.md, "Decorrelating the envs"). So each env
made through ``decorrelated`` takes, at its first reset, ``k`` uniformly random
actions before it hands out its first observation, ``k`` drawn uniformly in
``[0, max_steps)`` for each env (resetting again whenever an episode ends on the
way): each env starts at its own phase, as Sample Factory's envs do after the
random actions it has each of them take at the start of a run. Those steps happen
inside the env worker: the actor, the learner and the logs never see them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np


class DecorrelatedStart(gymnasium.Wrapper):
    """``env``, whose first ``reset`` also takes a random number of random actions, uniform
    in ``[0, max_steps)`` and drawn from ``rng`` (fresh entropy by default, as an env
    without a seed draws its own); later resets are the env's own."""

    def __init__(
        self, env: gymnasium.Env, max_steps: int, rng: np.random.Generator | None = None
    ) -> None:
        if max_steps < 1:
            raise ValueError(f"decorrelate_steps must be at least 1 here, got {max_steps}")
        super().__init__(env)
        rng = rng if rng is not None else np.random.default_rng()
        #: Random actions the first reset takes.
        self.start_steps = int(rng.integers(max_steps))
        self._first = True

    def reset(self, **kwargs: Any) -> tuple[Any, dict]:
        obs, info = self.env.reset(**kwargs)
        if not self._first:
            return obs, info
        self._first = False
        for _ in range(self.start_steps):
            obs, _, terminated, truncated, info = self.env.step(self.env.action_space.sample())
            if terminated or truncated:
                obs, info = self.env.reset()
        return obs, info


def make_decorrelated(factory: Callable[[], gymnasium.Env], max_steps: int) -> gymnasium.Env:
    """The env ``factory()`` makes, wrapped in ``DecorrelatedStart`` with ``max_steps``
    (picklable as ``functools.partial(make_decorrelated, factory, max_steps)``)."""
    return DecorrelatedStart(factory(), max_steps)
