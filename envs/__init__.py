"""Environments for moolib's toolkit, installed as ``moolib.envs``.

- ``create_env(name, **options)``: one gymnasium env: ``"cartpole"`` (small
  and fast, for tests and quick runs) or an Atari game by short name
  (``"breakout"``, ``"space_invaders"``, ...; see ``ATARI_GAMES``) or ALE id
  (``"ALE/Breakout-v5"``), with the standard DeepMind/IMPALA preprocessing
  (see ``moolib.envs.atari``): ``uint8`` observations of shape ``(4, 84, 84)``;
  or a MinAtar game (``"minatar-breakout"``, ...; see ``MINATAR_ENVS`` and
  ``moolib.envs.minatar``): ``uint8`` 0/1 observations of shape ``(C, 10, 10)``;
  or any gymnasium env with discrete actions, ``"gym:<id>"`` or your own
  factory ``"gym:<module>:<function>"`` (see ``moolib.envs.gymnasium_env``).
  Picklable as ``functools.partial(create_env, "breakout", ...)``, the form
  ``moolib.EnvPool`` expects.
- ``create_envpool(name, batch_size, num_batches, **options)``: the same
  Atari games stepped by the envpool library (optional), behind
  ``moolib.EnvPool``'s interface.

Each family is an ``EnvSpec`` in the env registry (``moolib.envs.registry``; the
families moolib ships register in ``moolib.envs.catalog``): its names, how it is
made, alone and batched, and the options it takes. Every user of an env name
(these functions, ``moolib-run``'s checks, the trainers) resolves it there.
"""

from __future__ import annotations

from . import catalog  # noqa: F401 - registers the families moolib ships
from .atari import ATARI_GAMES
from .create import create_batched, create_env, create_envpool, env_spec
from .envpool_backend import EnvpoolAtari, EnvpoolFuture
from .minatar import MINATAR_ENVS
from .pools import actor_pool, env_factory, probe_env
from .registry import (
    DEFAULT_BACKEND,
    Backend,
    EnvOption,
    EnvSpec,
    GameSuite,
    env_specs,
    find_env_spec,
    list_envs,
    register_env,
)

__all__ = [
    "ATARI_GAMES",
    "DEFAULT_BACKEND",
    "Backend",
    "EnvOption",
    "EnvSpec",
    "EnvpoolAtari",
    "EnvpoolFuture",
    "GameSuite",
    "MINATAR_ENVS",
    "actor_pool",
    "create_batched",
    "create_env",
    "create_envpool",
    "env_factory",
    "env_spec",
    "env_specs",
    "find_env_spec",
    "list_envs",
    "probe_env",
    "register_env",
]
