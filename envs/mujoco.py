"""gymnasium's MuJoCo tasks (version 5) as moolib envs: ``mujoco-half_cheetah``,
``mujoco-hopper``, ... Continuous actions (a vector of torques in bounds), float32
observations of the robot's state. Needs ``pip install "moolib[mujoco]"`` (the
``mujoco`` package; gymnasium's own MuJoCo envs drive it).

The observations are the env's own, unscaled: ``agent.observation_scaling`` normalizes
them in the actors, with statistics that go in the checkpoints (as
conf/tuning/ppo_mujoco.yaml does, CleanRL's setting).
"""

from __future__ import annotations

import logging
import re

import gymnasium
import numpy as np

from moolib._extras import import_extra

from .gymnasium_env import Float32Observations
from .registry import EnvOption

log = logging.getLogger(__name__)

# The game (moolib's name) -> gymnasium's id.
MUJOCO_IDS: dict[str, str] = {
    "ant": "Ant-v5",
    "half_cheetah": "HalfCheetah-v5",
    "hopper": "Hopper-v5",
    "humanoid": "Humanoid-v5",
    "humanoid_standup": "HumanoidStandup-v5",
    "inverted_double_pendulum": "InvertedDoublePendulum-v5",
    "inverted_pendulum": "InvertedPendulum-v5",
    "pusher": "Pusher-v5",
    "reacher": "Reacher-v5",
    "swimmer": "Swimmer-v5",
    "walker2d": "Walker2d-v5",
}
MUJOCO_GAMES: tuple[str, ...] = tuple(MUJOCO_IDS)
PREFIX = "mujoco-"
MUJOCO_ENVS: tuple[str, ...] = tuple(PREFIX + g for g in MUJOCO_GAMES)


def is_mujoco_name(name: str) -> bool:
    """Whether ``name`` is spelled as a MuJoCo env (``mujoco-...``), known task or not."""
    return name.strip().lower().startswith(("mujoco-", "mujoco_"))


def mujoco_game(name: str) -> str | None:
    """The task (``"half_cheetah"``) of ``"mujoco-half-cheetah"`` (case and ``-``/``_``
    insensitive), or of gymnasium's id ``"HalfCheetah-v5"`` after the prefix; None when
    ``name`` is no MuJoCo env."""
    if not is_mujoco_name(name):
        return None
    rest = name.strip()[len(PREFIX) :]
    by_id = {i.lower(): g for g, i in MUJOCO_IDS.items()}
    if rest.lower() in by_id:
        return by_id[rest.lower()]
    game = re.sub(r"[-\s]+", "_", rest).lower()
    return game if game in MUJOCO_IDS else None


def _warn(message: bytes | str) -> None:
    text = (message.decode(errors="replace") if isinstance(message, bytes) else message).strip()
    # gymnasium's own model files use attributes MuJoCo deprecates: not the user's to fix,
    # and said again by every env made.
    level = logging.DEBUG if "deprecated" in text else logging.WARNING
    log.log(level, "MuJoCo: %s", text)


def route_mujoco_warnings() -> None:
    """MuJoCo's warnings (an unstable simulation, ...) go to Python's logging instead of
    a MUJOCO_LOG.TXT in the working directory (the family's ``prepare``)."""
    mujoco = import_extra("mujoco", "mujoco", "gymnasium's MuJoCo envs")
    setter = getattr(mujoco, "set_mju_user_warning", None)
    if setter is not None:
        setter(_warn)


# The options of make_mujoco, in its order: the env registry's schema of env.options.
MUJOCO_OPTIONS: tuple[EnvOption, ...] = (EnvOption("seed"),)


def make_mujoco(name: str, *, seed: int | None = None) -> gymnasium.Env:
    """The MuJoCo task ``name`` (``"mujoco-half_cheetah"``): gymnasium's ``<Task>-v5`` with
    its defaults (episodes cut at 1,000 steps), float32 observations and actions.
    ``seed`` seeds the env and its action space. Raises ValueError for an unknown task,
    MissingExtraError without the mujoco package."""
    game = mujoco_game(name)
    if game is None:
        raise ValueError(f"unknown MuJoCo env {name!r}; known: {', '.join(MUJOCO_ENVS)}")
    import_extra("mujoco", "mujoco", "gymnasium's MuJoCo envs")
    import_extra("imageio", "mujoco", "gymnasium's MuJoCo envs")
    env = gymnasium.make(MUJOCO_IDS[game])
    if env.observation_space.dtype != np.float32:
        env = Float32Observations(env)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env
