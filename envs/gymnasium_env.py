"""Any gymnasium env, or a researcher's own factory, as a moolib env (``gym:<id>``).

``create_env("gym:Acrobot-v1")`` makes a registered gymnasium id;
``create_env("gym:mypkg.envs:make_env", size=5)`` imports ``mypkg.envs`` and
calls ``make_env(size=5)``. What the agents can learn from is checked when the
env is made, so a run refuses it before it starts: discrete actions, or a vector
of reals within finite bounds (``moolib.envs.actions``), and observations in one
array (a ``Box``; float64 observations and actions are handed on as float32, the
dtype the networks take and give).
"""

from __future__ import annotations

import difflib
import importlib
import re
from typing import Any

import gymnasium
import numpy as np

from .actions import ActionSpace

PREFIX = "gym:"
# module.path:function, the form of a factory (a registered id has no colon or,
# as gymnasium's "module:EnvId-v0", an id that is not a Python identifier).
_FACTORY = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_]\w*)$")


def is_gym_name(name: str) -> bool:
    """Whether ``name`` names a gymnasium env (``gym:<id>`` or ``gym:<module>:<function>``)."""
    return name.startswith(PREFIX) and len(name) > len(PREFIX)


def gym_name(name: str) -> str | None:
    """``name`` itself when it names a gymnasium env, else None (the registry's resolver)."""
    return name if is_gym_name(name) else None


def float32_box(space: gymnasium.spaces.Box) -> gymnasium.spaces.Box:
    """``space`` with float32 bounds and dtype (cast here: gymnasium warns of a cast it makes)."""
    return gymnasium.spaces.Box(
        low=space.low.astype(np.float32),
        high=space.high.astype(np.float32),
        shape=space.shape,
        dtype=np.float32,
    )


class Float32Observations(gymnasium.ObservationWrapper):
    """float64 observations as float32, the networks' dtype."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        self.observation_space = float32_box(env.observation_space)

    def observation(self, observation: Any) -> np.ndarray:
        return np.asarray(observation, dtype=np.float32)


class _Float32Actions(gymnasium.ActionWrapper):
    """Continuous actions taken as float32, the networks' dtype, and handed to the env
    in its own (float64)."""

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        self.action_space = float32_box(env.action_space)

    def action(self, action: Any) -> np.ndarray:
        return np.asarray(action, dtype=self.env.action_space.dtype)


def _make(target: str, options: dict[str, Any]) -> Any:
    factory = _FACTORY.match(target)
    if factory:
        module_name, function = factory.groups()
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ValueError(
                f"{PREFIX}{target}: cannot import {module_name} ({e}); is it on PYTHONPATH?"
            ) from e
        make = getattr(module, function, None)
        if not callable(make):
            raise ValueError(f"{PREFIX}{target}: {module_name} has no function {function}")
        return make(**options)
    # gymnasium's own "module:EnvId-v0" imports the module, which registers the id.
    if ":" not in target and target not in gymnasium.registry:
        close = difflib.get_close_matches(target, list(gymnasium.registry), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"{PREFIX}{target}: gymnasium has no env {target!r}{hint} (a factory of your "
            "own is module:function, e.g. gym:mypkg.envs:make_env)"
        )
    return gymnasium.make(target, **options)


def _check_spaces(name: str, env: gymnasium.Env) -> None:
    """Raises ValueError unless the agents can act in ``env``."""
    observations = env.observation_space
    ActionSpace.of(env.action_space, name)
    if not isinstance(observations, gymnasium.spaces.Box):
        raise ValueError(
            f"{name}: moolib's agents need observations in one array (gymnasium.spaces.Box); "
            f"this env's are {observations} (flatten them, e.g. with "
            "gymnasium.wrappers.FlattenObservation, in a factory of your own)"
        )


def make_gym(name: str, *, seed: int | None = None, **options: Any) -> gymnasium.Env:
    """The env ``name`` (``gym:<id>`` or ``gym:<module>:<function>``) names, made with
    ``options`` as keyword arguments. ``seed`` seeds the env and its action space;
    without it each env draws a fresh random seed. Raises ValueError when it cannot
    be made or when the agents cannot act in it (the message says which)."""
    env = _make(name[len(PREFIX) :], options)
    if not isinstance(env, gymnasium.Env):
        raise ValueError(f"{name}: the factory returned {type(env).__name__}, not a gymnasium.Env")
    try:
        _check_spaces(name, env)
    except ValueError:
        env.close()
        raise
    if env.observation_space.dtype == np.float64:
        env = Float32Observations(env)
    if isinstance(env.action_space, gymnasium.spaces.Box) and env.action_space.dtype != np.float32:
        env = _Float32Actions(env)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env
