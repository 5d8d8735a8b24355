"""Making envs by name, through the registry: one env (``create_env``), or a batch of
them on a family's own backend (``create_batched``, ``create_envpool``)."""

from __future__ import annotations

from typing import Any

import gymnasium

from .atari import unknown_name_message
from .registry import Backend, EnvSpec, find_backend, find_env_spec, list_envs


def env_spec(name: str) -> EnvSpec:
    """The spec of the family that makes ``name``. Raises ValueError naming close
    matches for an unknown name."""
    spec = find_env_spec(name)
    if spec is None:
        raise ValueError(
            unknown_name_message(name, list_envs())
            + " Any other gymnasium env: 'gym:<id>', or 'gym:<module>:<function>' for a factory."
        )
    return spec


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
    ``moolib.envs.gymnasium_env.make_gym``. (Each family's options are its spec's:
    ``moolib.envs.find_env_spec(name).option_names()``.)

    Without a ``seed`` each env draws a fresh random one (note that a seed
    bound in a factory, as in ``partial(create_env, "pong", seed=1)``, gives
    every env made by it the same seed). Raises ValueError naming close
    matches for an unknown name, TypeError for an unknown option.

    The family's library is told first to keep its informational messages to
    itself in this process (the family's ``prepare``): ALE would print its
    banner ("A.L.E: Arcade Learning Environment ...") once in every process
    that makes an Atari env, which is every env worker of a pool. Its warnings
    and errors still print.
    """
    spec = env_spec(name)
    if spec.prepare is not None:
        spec.prepare()
    return spec.make(name, **options)


def batched_backend(name: str, backend: str, caller: str) -> Backend:
    """The backend ``backend`` of the family of ``name``. Raises ValueError for an
    unknown name, or a family the backend does not serve (``caller`` says who asked)."""
    spec = find_env_spec(name)
    if spec is None:
        raise ValueError(unknown_name_message(name, list_envs()))
    if spec.backend is None or spec.backend.name != backend:
        served = find_backend(backend)
        serves = f"serves {served.serves} only" if served is not None else "is no env backend"
        raise ValueError(
            f"{caller} {serves}, not {name!r}; use create_env (with moolib.EnvPool) for it"
        )
    return spec.backend


def create_batched(
    name: str, backend: str, batch_size: int, num_batches: int, **options: Any
) -> Any:
    """``batch_size * num_batches`` envs of ``name`` stepped by the family's own
    ``backend`` (``"envpool"``), with ``moolib.EnvPool``'s ``step(batch_index, action)``
    interface. Raises ValueError when the backend does not serve the env."""
    made = batched_backend(name, backend, f"env.backend={backend}")
    return made.make(name, batch_size, num_batches, **options)


def create_envpool(name: str, batch_size: int, num_batches: int, **options: Any) -> Any:
    """``batch_size * num_batches`` envs of an Atari game run by the envpool
    library, with ``moolib.EnvPool``'s ``step(batch_index, action)``
    interface. Options: ``num_threads``, ``seed`` and the Atari options of
    ``create_env``; see ``EnvpoolAtari`` (its docstring says how its resets
    differ from ``moolib.EnvPool``'s). Needs ``pip install 'moolib[envpool]'``.
    """
    made = batched_backend(name, "envpool", "create_envpool")
    return made.make(name, batch_size, num_batches, **options)
