"""MinAtar (Young & Tian, 2019): five Atari-like games on a 10x10 grid, from the
``minatar`` package, behind gymnasium's API.

The games are the package's own (``minatar.Environment``); this module only
adapts its interface:

- names ``"minatar-asterix"``, ``"minatar-breakout"``, ``"minatar-freeway"``,
  ``"minatar-seaquest"``, ``"minatar-space_invaders"`` (``-``/``_`` and case
  insensitive); the prefix keeps them apart from the Atari games of the same name;
- observations: the package's ``10 x 10 x C`` boolean state, channels first, as
  ``uint8`` 0/1 of shape ``(C, 10, 10)`` (C is 4, 4, 7, 10 and 6 for the games
  above): a byte per cell, the dtype ``moolib.EnvPool``'s shared memory carries;
- the paper's settings by default: sticky actions with probability 0.1 (applied
  by ``minatar.Environment`` itself), difficulty ramping on, all 6 actions
  (``minimal_action_set=True`` gives each game's own subset) and no time limit
  (Freeway ends itself after 2,500 steps; ``max_episode_steps`` truncates).

One MinAtar step is one frame: the paper's frame budgets are env steps here.
The ``minatar`` package is a pip extra (``pip install "moolib[minatar]"``): it
brings pandas, scipy and seaborn, which nothing else needs.
"""

from __future__ import annotations

import functools
import re
from typing import Any, SupportsFloat

import gymnasium
import numpy as np
from gymnasium.wrappers import TimeLimit

from moolib._extras import import_extra

from .options import check_flag
from .registry import EnvOption

# The games of the minatar package (minatar/environments/), in its own spelling.
MINATAR_GAMES: tuple[str, ...] = ("asterix", "breakout", "freeway", "seaquest", "space_invaders")
PREFIX = "minatar-"
# The names ``create_env`` accepts for them.
MINATAR_ENVS: tuple[str, ...] = tuple(PREFIX + g for g in MINATAR_GAMES)
DEFAULT_STICKY_ACTION_PROB = 0.1


def is_minatar_name(name: str) -> bool:
    """Whether ``name`` is spelled as a MinAtar env (``minatar-...``), known game or not."""
    return name.strip().lower().startswith(("minatar-", "minatar_"))


def minatar_game(name: str) -> str | None:
    """The minatar game (e.g. ``"space_invaders"``) of ``"minatar-space-invaders"``
    (case and ``-``/``_`` insensitive); None when ``name`` is no MinAtar env."""
    if not is_minatar_name(name):
        return None
    game = re.sub(r"[-\s]+", "_", name.strip()[len(PREFIX) :]).lower()
    return game if game in MINATAR_GAMES else None


def check_sticky_action_prob(value: Any) -> None:
    """Raises ValueError unless ``value`` is a probability."""
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"sticky_action_prob must be in [0, 1], got {value!r}")


def check_max_episode_steps(value: object) -> None:
    """Raises ValueError unless ``value`` is None (no time limit) or a positive int."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_episode_steps must be a positive int, got {value!r}")


class MinAtarEnv(gymnasium.Env):
    """One MinAtar game (``minatar.Environment``) with gymnasium's API; see the module doc.

    Args:
        game: one of ``MINATAR_GAMES``.
        sticky_action_prob: probability that the previous action is repeated instead
            of the one given (0.1 in the paper).
        difficulty_ramping: games speed up as an episode goes on (the paper's setting).
        minimal_action_set: only the game's distinct actions instead of all 6.
        seed: seeds the game and the sticky actions; without it each env draws its own.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        game: str,
        *,
        sticky_action_prob: float = DEFAULT_STICKY_ACTION_PROB,
        difficulty_ramping: bool = True,
        minimal_action_set: bool = False,
        seed: int | None = None,
    ) -> None:
        Environment = import_extra("minatar", "minatar", "MinAtar's games").Environment

        if game not in MINATAR_GAMES:
            raise ValueError(f"unknown MinAtar game {game!r}; known: {', '.join(MINATAR_GAMES)}")
        check_sticky_action_prob(sticky_action_prob)
        check_flag("difficulty_ramping", difficulty_ramping)
        check_flag("minimal_action_set", minimal_action_set)
        self.game = Environment(
            game,
            sticky_action_prob=float(sticky_action_prob),
            difficulty_ramping=difficulty_ramping,
        )
        if seed is not None:
            self.game.seed(seed)
        self.actions = (
            list(self.game.minimal_action_set())
            if minimal_action_set
            else list(range(self.game.num_actions()))
        )
        height, width, channels = self.game.state_shape()
        self.observation_space = gymnasium.spaces.Box(
            0, 1, shape=(channels, height, width), dtype=np.uint8
        )
        self.action_space = gymnasium.spaces.Discrete(len(self.actions))
        if seed is not None:
            self.action_space.seed(seed)

    @property
    def sticky_action_prob(self) -> float:
        """The probability that the game repeats the previous action (as minatar applies it)."""
        return float(self.game.sticky_action_prob)

    def _observation(self) -> np.ndarray:
        return np.ascontiguousarray(self.game.state().transpose(2, 0, 1), dtype=np.uint8)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Starts a new episode (reseeding the game first when ``seed`` is given)."""
        super().reset(seed=seed)
        if seed is not None:
            self.game.seed(seed)
        self.game.reset()
        return self._observation(), {}

    def step(self, action: Any) -> tuple[np.ndarray, SupportsFloat, bool, bool, dict[str, Any]]:
        """One frame of the game: ``(observation, reward, terminated, False, {})``."""
        reward, terminated = self.game.act(self.actions[int(action)])
        return self._observation(), float(reward), bool(terminated), False, {}


def make_minatar(
    name: str,
    *,
    seed: int | None = None,
    sticky_action_prob: float = DEFAULT_STICKY_ACTION_PROB,
    difficulty_ramping: bool = True,
    minimal_action_set: bool = False,
    max_episode_steps: int | None = None,
) -> gymnasium.Env:
    """A MinAtar game by name (``"minatar-breakout"``, any of ``MINATAR_ENVS``) with the
    paper's settings by default (see the module doc); ``max_episode_steps`` truncates
    episodes (none by default, as in the paper). Raises ValueError for an unknown game
    or a bad option."""
    game = minatar_game(name)
    if game is None:
        raise ValueError(f"unknown MinAtar env {name!r}; known: {', '.join(MINATAR_ENVS)}")
    env: gymnasium.Env = MinAtarEnv(
        game,
        sticky_action_prob=sticky_action_prob,
        difficulty_ramping=difficulty_ramping,
        minimal_action_set=minimal_action_set,
        seed=seed,
    )
    if max_episode_steps is not None:
        check_max_episode_steps(max_episode_steps)
        env = TimeLimit(env, max_episode_steps=max_episode_steps)
    return env


# The options of make_minatar, in its order: the env registry's schema of env.options.
MINATAR_OPTIONS: tuple[EnvOption, ...] = (
    EnvOption("seed"),
    EnvOption("sticky_action_prob", DEFAULT_STICKY_ACTION_PROB, check_sticky_action_prob),
    EnvOption("difficulty_ramping", True, functools.partial(check_flag, "difficulty_ramping")),
    EnvOption("minimal_action_set", False, functools.partial(check_flag, "minimal_action_set")),
    EnvOption("max_episode_steps", None, check_max_episode_steps),
)
