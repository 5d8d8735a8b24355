"""Small deterministic envs for the EnvPool tests, in every API style EnvPool accepts.

ToyEnv's observations, rewards and episode ends depend on the actions taken and
on how many episodes the instance has played, so a hand-stepped copy reproduces
every value only if EnvPool routes each action to the right env and resets at
the right moments.
"""

from __future__ import annotations

import os
import time

import gymnasium
import numpy as np
from gymnasium import spaces


class ToyEnv:
    """gymnasium API: reset() -> (obs, info), step() -> 5-tuple; dict observations."""

    action_space = spaces.Discrete(7)

    def __init__(self) -> None:
        self.episodes = 0
        self.t = 0
        self.total = 0

    def _obs(self) -> dict:
        grid = np.full((3, 5), self.total % 251, dtype=np.uint8)
        grid[self.t % 3, self.episodes % 5] = 255
        return {
            "grid": grid,
            "t": np.int64(self.t),
            "pos": np.array([self.total, -self.t], dtype=np.float32) / 4,
        }

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        self.episodes += 1
        self.t = 0
        self.total = self.episodes
        return self._obs(), {}

    def _advance(self, action: int) -> tuple[float, bool, bool]:
        if not 0 <= action < 7:
            raise ValueError(f"action {action} out of range")
        self.t += 1
        self.total += action
        reward = float(action) - 2.5 + 0.125 * self.episodes
        terminated = self.total % 11 == 0
        truncated = self.t >= 9 + self.episodes % 4
        return reward, terminated, truncated

    def step(self, action: int) -> tuple:
        reward, terminated, truncated = self._advance(action)
        return self._obs(), reward, terminated, truncated, {}


class OldGymEnv(ToyEnv):
    """Old gym API: reset() -> obs, step() -> (obs, reward, done, info)."""

    def reset(self) -> dict:  # type: ignore[override]
        return super().reset()[0]

    def step(self, action: int) -> tuple:
        reward, terminated, truncated = self._advance(action)
        return self._obs(), reward, terminated or truncated, {}


class ThreeTupleEnv(OldGymEnv):
    """Old gym API with a 3-tuple step: (obs, reward, done)."""

    def step(self, action: int) -> tuple:
        return super().step(action)[:3]


class ArrayEnv:
    """Non-dict observations (a vector), old gym API, no action_space."""

    def __init__(self) -> None:
        self.t = 0

    def reset(self) -> np.ndarray:
        self.t = 0
        return np.zeros(4, dtype=np.float64)

    def step(self, action: int) -> tuple:
        self.t += 1
        return np.full(4, self.t * 10 + action, dtype=np.float64), 1.0, self.t >= 6, {}


class BigImageEnv:
    """Large RGB observations (480x640x3 uint8): the region is sized from them."""

    action_space = spaces.Discrete(3)

    def __init__(self) -> None:
        self.t = 0

    def reset(self, **kwargs: object) -> tuple:
        self.t = 0
        return self._obs(0), {}

    def _obs(self, action: int) -> np.ndarray:
        obs = np.zeros((480, 640, 3), dtype=np.uint8)
        if self.t:
            obs[self.t % 480, :, action] = 200
        obs[-1, -1, :] = self.t % 256
        return obs

    def step(self, action: int) -> tuple:
        self.t += 1
        return self._obs(action), 0.0, False, self.t >= 50, {}


class BoxActionEnv:
    """Continuous actions of shape (2,): the observation echoes the action."""

    action_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)

    def reset(self, **kwargs: object) -> tuple:
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action: np.ndarray) -> tuple:
        return np.asarray(action, dtype=np.float32) * 2, float(action.sum()), False, False, {}


class FailingEnv(ToyEnv):
    """Raises on action 6 (other actions behave as ToyEnv)."""

    def step(self, action: int) -> tuple:
        if action == 6:
            raise KeyError("the toy env refuses action six")
        return super().step(action)


class SlowEnv(ToyEnv):
    """Sleeps ``delay`` seconds in every step."""

    delay = 2.0

    def step(self, action: int) -> tuple:
        time.sleep(self.delay)
        return super().step(action)


def broken_factory() -> ToyEnv:
    raise OSError("cannot create the toy env")


def pid_reporting_env() -> ToyEnv:
    """A ToyEnv whose first observation's 't' is the worker's pid."""
    env = ToyEnv()
    env.t = os.getpid()
    original = env.reset

    def reset(**kwargs: object) -> tuple:
        obs, info = original()
        obs["t"] = np.int64(os.getpid())
        return obs, info

    env.reset = reset  # type: ignore[method-assign]
    return env


class MisbehavingEnv:
    """Returns observations shaped like ``example`` (an array, or a dict of
    arrays), each element equal to the step count in the episode, with reward
    1.0; on action 1 it returns ``bad_obs`` (if given) or ``bad_reward``
    instead. Make one with functools.partial for EnvPool."""

    action_space = spaces.Discrete(2)
    _UNSET = object()

    def __init__(self, example: object, bad_obs: object = _UNSET, bad_reward: object = 1.0) -> None:
        self.example = example
        self.bad_obs = bad_obs
        self.bad_reward = bad_reward
        self.t = 0

    def _obs(self) -> object:
        if isinstance(self.example, dict):
            return {k: np.full_like(v, self.t) for k, v in self.example.items()}
        return np.full_like(self.example, self.t)

    def reset(self, **kwargs: object) -> tuple:
        self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple:
        self.t += 1
        if action != 1:
            return self._obs(), 1.0, False, False, {}
        obs = self._obs() if self.bad_obs is self._UNSET else self.bad_obs
        return obs, self.bad_reward, False, False, {}


class LineEnv(gymnasium.Env):
    """A deterministic walk on a line (gymnasium, for moolib-run as
    ``env=gym env.id=helpers.toy_envs:LineEnv``): every reset starts at 0, each action
    moves by ``action - 1``, the observation is ``(position, steps)``; an episode ends
    1,000 away from 0 or after 100,000 steps. Under a policy that always takes the same
    action, every env plays the same episode in step."""

    observation_space = spaces.Box(-1e6, 1e6, (2,), np.float32)
    action_space = spaces.Discrete(3)

    def __init__(self) -> None:
        self.position = 0
        self.t = 0

    def _obs(self) -> np.ndarray:
        return np.array([self.position, self.t], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple:
        self.position = self.t = 0
        return self._obs(), {}

    def step(self, action: int) -> tuple:
        self.position += int(action) - 1
        self.t += 1
        return self._obs(), 0.0, abs(self.position) >= 1000, self.t >= 100_000, {}


def first_action(env: gymnasium.Env):
    """An action ``env`` takes: action 0 of a discrete space, the zero vector of a Box."""
    space = env.action_space
    if isinstance(space, spaces.Discrete):
        return 0
    return np.zeros(space.shape, space.dtype)
