"""The env families moolib ships, registered in the order ``list_envs()`` shows them:
classic control (cartpole, pendulum), MinAtar, MuJoCo, Atari (with its envpool
backend), then any gymnasium env by id (``gym:<id>``)."""

from __future__ import annotations

from .atari import ATARI_GAMES, ATARI_OPTIONS, atari_game, make_atari, quiet_ale
from .classic import CLASSIC_ENVS, CLASSIC_OPTIONS, classic_name, make_classic
from .envpool_backend import ENVPOOL_OPTIONS, EnvpoolAtari
from .gymnasium_env import gym_name, make_gym
from .minatar import (
    MINATAR_ENVS,
    MINATAR_GAMES,
    MINATAR_OPTIONS,
    PREFIX,
    is_minatar_name,
    make_minatar,
    minatar_game,
)
from .mujoco import (
    MUJOCO_ENVS,
    MUJOCO_GAMES,
    MUJOCO_OPTIONS,
    is_mujoco_name,
    make_mujoco,
    mujoco_game,
    route_mujoco_warnings,
)
from .mujoco import PREFIX as MUJOCO_PREFIX
from .registry import Backend, EnvSpec, GameSuite, register_env


def _minatar_game(game: str) -> str | None:
    # env.game is the package's own spelling, exactly (conf/env/minatar.yaml).
    return game if game in MINATAR_GAMES else None


def _mujoco_game(game: str) -> str | None:
    # env.game is moolib's spelling of the task, exactly (conf/env/mujoco.yaml).
    return game if game in MUJOCO_GAMES else None


def _any_name(name: str) -> bool:
    # Atari's games are named as themselves: every name not claimed by a suite with a
    # prefix of its own is spelled as an Atari game.
    return True


CLASSIC = register_env(
    EnvSpec(
        family="classic",
        description=(
            "CartPole-v1, cartpole-novel without its velocities, and Pendulum-v1 (a "
            "continuous action): small and fast"
        ),
        names=tuple(CLASSIC_ENVS),
        canonical=classic_name,
        make=make_classic,
        options=CLASSIC_OPTIONS,
    )
)

MINATAR = register_env(
    EnvSpec(
        family="minatar",
        description="MinAtar's five Atari-like games on a 10x10 grid (minatar-<game>)",
        names=MINATAR_ENVS,
        canonical=minatar_game,
        make=make_minatar,
        options=MINATAR_OPTIONS,
        games=GameSuite(
            label="MinAtar",
            config="minatar",
            games=MINATAR_GAMES,
            prefix=PREFIX,
            game_of=_minatar_game,
            claims=is_minatar_name,
            not_a_game=f"is not a MinAtar game (one of {', '.join(MINATAR_GAMES)})",
        ),
        library=("minatar", "MinAtar"),
    )
)

MUJOCO = register_env(
    EnvSpec(
        family="mujoco",
        description="gymnasium's MuJoCo tasks, continuous actions (mujoco-<task>)",
        names=MUJOCO_ENVS,
        canonical=mujoco_game,
        make=make_mujoco,
        options=MUJOCO_OPTIONS,
        games=GameSuite(
            label="MuJoCo",
            config="mujoco",
            games=MUJOCO_GAMES,
            prefix=MUJOCO_PREFIX,
            game_of=_mujoco_game,
            claims=is_mujoco_name,
            not_a_game=f"is not a MuJoCo task (one of {', '.join(MUJOCO_GAMES)})",
            noun="tasks",
        ),
        library=("mujoco", "MuJoCo"),
        prepare=route_mujoco_warnings,
    )
)

ATARI = register_env(
    EnvSpec(
        family="atari",
        description="Atari 2600 games through ale-py, with the DQN/IMPALA preprocessing",
        names=ATARI_GAMES,
        canonical=atari_game,
        make=make_atari,
        options=ATARI_OPTIONS,
        backend=Backend(
            name="envpool",
            make=EnvpoolAtari,
            options=ENVPOOL_OPTIONS,
            library=("envpool", "envpool"),
            serves="Atari games",
        ),
        games=GameSuite(
            label="Atari",
            config="atari",
            games=ATARI_GAMES,
            prefix="",
            game_of=atari_game,
            claims=_any_name,
            not_a_game="is not an Atari game ale-py knows (see moolib.envs.list_envs())",
        ),
        library=("ale-py", "ALE"),
        prepare=quiet_ale,
    )
)

GYMNASIUM = register_env(
    EnvSpec(
        family="gym",
        description=(
            "any gymnasium env with discrete or continuous (Box) actions: gym:<id> or "
            "gym:<module>:<function>"
        ),
        names=(),
        canonical=gym_name,
        make=make_gym,
        options=None,
    )
)
