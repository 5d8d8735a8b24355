"""The env pools a trainer's actors step, on the backend its config names: the
family's own (envpool), or moolib.EnvPool's worker processes over ``create_env``."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from .actions import ActionSpace
from .create import create_batched, create_env
from .decorrelate import make_decorrelated
from .registry import DEFAULT_BACKEND


def env_factory(
    name: str, options: Mapping[str, Any]
) -> tuple[Callable[[], Any], tuple[int, ...], ActionSpace]:
    """A picklable factory of the env ``name`` with ``options`` (quiet in each worker
    process), with the observation shape and action space of one env it made."""
    factory = functools.partial(create_env, name, **options)
    probe = factory()
    try:
        return (
            factory,
            tuple(probe.observation_space.shape),
            ActionSpace.of(probe.action_space, name),
        )
    finally:
        probe.close()


def actor_pool(
    name: str,
    backend: str,
    options: Mapping[str, Any],
    *,
    batch_size: int,
    num_batches: int,
    num_workers: int,
    decorrelate_steps: int = 0,
) -> tuple[Any, tuple[int, ...], ActionSpace]:
    """``num_batches`` batches of ``batch_size`` envs of ``name`` stepped on ``backend``
    by ``num_workers`` worker processes (threads of a backend of the family's own), with
    the observation shape and action space. With ``decorrelate_steps``, each env
    of moolib.EnvPool takes a random number of random actions, uniform in
    ``[0, decorrelate_steps)``, at its first reset (``moolib.envs.decorrelate``); a
    backend of the family's own steps its envs in its own code and ignores it."""
    if backend != DEFAULT_BACKEND:
        pool = create_batched(
            name, backend, batch_size, num_batches, num_threads=num_workers, **options
        )
        shape = tuple(pool.observation_space.shape)
        return pool, shape, ActionSpace.discrete(pool.num_actions)
    import moolib

    factory, shape, actions = env_factory(name, options)
    if decorrelate_steps > 0:
        factory = functools.partial(make_decorrelated, factory, decorrelate_steps)
    return moolib.EnvPool(factory, num_workers, batch_size, num_batches), shape, actions


def probe_env(
    name: str, backend: str, options: Mapping[str, Any]
) -> tuple[tuple[int, ...], ActionSpace]:
    """Makes the env once (a batch of one on a backend of the family's own) and closes
    it: its observation shape and action space. Raises what the env raises, and
    ValueError for actions the agents cannot take (``ActionSpace.of``)."""
    if backend != DEFAULT_BACKEND:
        pool = create_batched(name, backend, 1, 1, num_threads=1, **options)
        try:
            return tuple(pool.observation_space.shape), ActionSpace.discrete(pool.num_actions)
        finally:
            pool.close()
    env = create_env(name, **options)
    try:
        return tuple(env.observation_space.shape), ActionSpace.of(env.action_space, name)
    finally:
        env.close()
