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
"""

from __future__ import annotations

from typing import Any

import gymnasium

from .atari import ATARI_GAMES, atari_game, make_atari, unknown_name_message
from .classic import CLASSIC_ENVS, make_cartpole, make_cartpole_novel
from .envpool_backend import EnvpoolAtari, EnvpoolFuture
from .gymnasium_env import is_gym_name, make_gym
from .minatar import MINATAR_ENVS, make_minatar, minatar_game

__all__ = [
    "ATARI_GAMES",
    "EnvpoolAtari",
    "EnvpoolFuture",
    "MINATAR_ENVS",
    "create_env",
    "create_env_quietly",
    "create_envpool",
    "list_envs",
]


def list_envs() -> list[str]:
    """Every short name ``create_env`` accepts: ``"cartpole"``, the MinAtar games, then
    the Atari games (ALE ids such as ``"ALE/Breakout-v5"`` are accepted too)."""
    return [*CLASSIC_ENVS, *MINATAR_ENVS, *ATARI_GAMES]


def create_env(name: str, **options: Any) -> gymnasium.Env:
    """One environment, by short name or ALE id.

    ``"cartpole"``: options ``seed``. ``"cartpole-novel"``: CartPole with the velocities
    hidden (observations ``(x, theta)``; needs memory), options ``seed``. Atari games:
    options ``seed``, ``noop_max`` (30), ``repeat_action_probability`` (0.25),
    ``full_action_space`` (False), ``max_episode_frames`` (108,000),
    ``episodic_life`` (False); see ``moolib.envs.atari.make_atari``. MinAtar
    games (``"minatar-breakout"``, ...): options ``seed``, ``sticky_action_prob``
    (0.1), ``difficulty_ramping`` (True), ``minimal_action_set`` (False),
    ``max_episode_steps`` (None); see ``moolib.envs.minatar.make_minatar``. Any other
    gymnasium env with discrete actions: ``"gym:Acrobot-v1"`` (a registered id) or
    ``"gym:mypkg.envs:make_env"`` (a factory of your own), options passed to
    ``gymnasium.make`` or the factory, and ``seed``; see
    ``moolib.envs.gymnasium_env.make_gym``.

    Without a ``seed`` each env draws a fresh random one (note that a seed
    bound in a factory, as in ``partial(create_env, "pong", seed=1)``, gives
    every env made by it the same seed). Raises ValueError naming close
    matches for an unknown name, TypeError for an unknown option.
    """
    key = name.strip().lower()
    if key == "cartpole":
        return make_cartpole(**options)
    if key == "cartpole-novel":
        return make_cartpole_novel(**options)
    if minatar_game(name) is not None:
        return make_minatar(name, **options)
    if atari_game(name) is not None:
        return make_atari(name, **options)
    if is_gym_name(name):
        return make_gym(name, **options)
    raise ValueError(
        unknown_name_message(name, list_envs())
        + " Any other gymnasium env: 'gym:<id>', or 'gym:<module>:<function>' for a factory."
    )


def create_env_quietly(name: str, **options: Any) -> gymnasium.Env:
    """``create_env``, with ale-py's informational messages turned off in this process first:
    ALE prints its banner ("A.L.E: Arcade Learning Environment ...") once in every process
    that makes an Atari env, which is every env worker of a run. Its warnings and errors
    still print. Picklable as ``functools.partial(create_env_quietly, name, ...)``."""
    if atari_game(name) is not None:
        import ale_py

        ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Warning)
    return create_env(name, **options)


def create_envpool(name: str, batch_size: int, num_batches: int, **options: Any) -> EnvpoolAtari:
    """``batch_size * num_batches`` envs of an Atari game run by the envpool
    library, with ``moolib.EnvPool``'s ``step(batch_index, action)``
    interface. Options: ``num_threads``, ``seed`` and the Atari options of
    ``create_env``; see ``EnvpoolAtari`` (its docstring says how its resets
    differ from ``moolib.EnvPool``'s). Needs ``pip install 'moolib[envpool]'``.
    """
    if name.strip().lower() in CLASSIC_ENVS or minatar_game(name) is not None:
        raise ValueError(
            f"create_envpool serves Atari games only, not {name!r}; use create_env "
            "(with moolib.EnvPool) for it"
        )
    if atari_game(name) is None:
        raise ValueError(unknown_name_message(name, list_envs()))
    return EnvpoolAtari(name, batch_size, num_batches, **options)
