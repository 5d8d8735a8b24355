"""Atari 2600 games through gymnasium and ale-py, with the standard preprocessing.

The preprocessing is the one of DQN / IMPALA (Mnih et al. 2015, Machado et al.
2018), built from gymnasium's own wrappers on an ALE env that steps single
frames:

- up to ``noop_max`` (default 30) no-op frames after each reset,
- frame skip 4: an action is repeated for 4 frames, rewards summed, and the
  observation is the pixel-wise max of the last two frames,
- 84x84 grayscale (``cv2.INTER_AREA`` resize),
- a stack of the last 4 observations, channels first: ``uint8`` of shape
  ``(4, 84, 84)``, the newest frame last (``obs[-1]``),
- sticky actions (``repeat_action_probability``, 0.25 as in ALE v5),
- episodes cut (truncated) after ``max_episode_frames // 4`` agent steps
  (108,000 frames = 27,000 steps by default),
- optionally ``episodic_life``: losing a life ends the episode, but only a
  game over resets the game.

Rewards are not clipped.
"""

from __future__ import annotations

import difflib
import functools
import re
from typing import Any, SupportsFloat

import ale_py
import gymnasium
from ale_py.registration import rom_id_to_name
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation, TimeLimit

from .options import check_flag
from .registry import EnvOption

gymnasium.register_envs(ale_py)

FRAME_SKIP = 4
SCREEN_SIZE = 84
FRAME_STACK = 4
DEFAULT_NOOP_MAX = 30
DEFAULT_REPEAT_ACTION_PROBABILITY = 0.25
DEFAULT_MAX_EPISODE_FRAMES = 108_000


def _ale_id(game: str) -> str:
    return f"ALE/{rom_id_to_name(game)}-v5"


# Every rom ale-py knows that has a single-player ALE v5 id (a few roms, such
# as combat, only have multi-player modes and are not registered).
ATARI_GAMES: tuple[str, ...] = tuple(
    sorted(g for g in ale_py.roms.get_all_rom_ids() if _ale_id(g) in gymnasium.registry)
)
_GAME_OF_ID: dict[str, str] = {_ale_id(g): g for g in ATARI_GAMES}


def atari_game(name: str) -> str | None:
    """The ale-py rom id (snake_case, e.g. ``"space_invaders"``) of an Atari
    short name (``"space_invaders"``, case and ``-``/``_`` insensitive) or ALE
    id (``"ALE/SpaceInvaders-v5"``); None when ``name`` is neither."""
    if name in _GAME_OF_ID:
        return _GAME_OF_ID[name]
    key = re.sub(r"[-\s]+", "_", name.strip()).lower()
    return key if key in ATARI_GAMES else None


def atari_id(name: str) -> str:
    """The ALE id (e.g. ``"ALE/Breakout-v5"``) of an Atari short name or ALE id.

    Raises ValueError naming close matches when ``name`` is not a game ale-py
    knows.
    """
    game = atari_game(name)
    if game is None:
        raise ValueError(unknown_name_message(name, ATARI_GAMES))
    return _ale_id(game)


def unknown_name_message(name: str, known: tuple[str, ...] | list[str]) -> str:
    """The message of the ValueError for an unknown environment name: close
    matches among ``known`` (short names, and the ALE ids of Atari games)."""
    key = re.sub(r"[-\s]+", "_", name.strip()).lower()
    candidates = list(known)
    close = difflib.get_close_matches(key, candidates, n=5, cutoff=0.6)
    # Also compare the ALE-id spelling, so "ALE/Breakot-v5" finds breakout.
    close += [
        _GAME_OF_ID[i]
        for i in difflib.get_close_matches(name, list(_GAME_OF_ID), n=3, cutoff=0.8)
        if _GAME_OF_ID[i] not in close
    ]
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    return (
        f"Unknown environment {name!r}.{hint} Known: {', '.join(candidates[:8])}, ... "
        f"({len(candidates)} names; see moolib.envs.list_envs()), or an ALE id "
        "such as 'ALE/Breakout-v5'."
    )


def check_noop_max(value: object) -> None:
    """Raises ValueError unless ``value`` is a number of no-op frames: an int >= 0."""
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"noop_max must be an int >= 0, got {value!r}")


def check_repeat_action_probability(value: Any) -> None:
    """Raises ValueError unless ``value`` is a probability."""
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"repeat_action_probability must be in [0, 1], got {value!r}")


def check_max_episode_frames(value: object) -> None:
    """Raises ValueError unless ``value`` is at least one agent step of frames."""
    if not isinstance(value, int) or value < FRAME_SKIP:
        raise ValueError(f"max_episode_frames must be an int >= {FRAME_SKIP}, got {value!r}")


def check_atari_options(
    noop_max: int,
    repeat_action_probability: float,
    max_episode_frames: int,
    full_action_space: bool,
    episodic_life: bool,
) -> None:
    """Raises ValueError for out-of-range Atari options (shared by both backends)."""
    check_flag("full_action_space", full_action_space)
    check_flag("episodic_life", episodic_life)
    check_noop_max(noop_max)
    check_repeat_action_probability(repeat_action_probability)
    check_max_episode_frames(max_episode_frames)


# The options of make_atari, in its order: the env registry's schema of env.options.
ATARI_OPTIONS: tuple[EnvOption, ...] = (
    EnvOption("seed"),
    EnvOption("noop_max", DEFAULT_NOOP_MAX, check_noop_max),
    EnvOption(
        "repeat_action_probability",
        DEFAULT_REPEAT_ACTION_PROBABILITY,
        check_repeat_action_probability,
    ),
    EnvOption("full_action_space", False, functools.partial(check_flag, "full_action_space")),
    EnvOption("max_episode_frames", DEFAULT_MAX_EPISODE_FRAMES, check_max_episode_frames),
    EnvOption("episodic_life", False, functools.partial(check_flag, "episodic_life")),
)


def quiet_ale() -> None:
    """Turns ale-py's informational messages off in this process (its banner, printed
    once by every process that makes an Atari env); warnings and errors still print."""
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Warning)


class EpisodicLife(gymnasium.Wrapper):
    """Ends an episode (``terminated=True``) whenever a life is lost, but resets
    the game only when it is over: the ``reset()`` that follows a lost life
    takes one no-op step instead (DeepMind's training setting, as in OpenAI
    baselines' ``EpisodicLifeEnv`` and envpool's ``episodic_life``).

    gymnasium's ``AtariPreprocessing(terminal_on_life_loss=True)`` differs: its
    reset after a lost life starts a new game.
    """

    def __init__(self, env: gymnasium.Env) -> None:
        super().__init__(env)
        self._lives = 0
        self._life_lost = False

    def _ale_lives(self) -> int:
        return int(self.env.unwrapped.ale.lives())

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = self.env.step(action)
        lives = self._ale_lives()
        # lives > 0: some games (Qbert) show 0 lives for a few frames before
        # the game over; the game over itself terminates.
        self._life_lost = not (terminated or truncated) and 0 < lives < self._lives
        self._lives = lives
        return obs, reward, terminated or self._life_lost, truncated, info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        if self._life_lost and seed is None and options is None:
            self._life_lost = False
            obs, _, terminated, truncated, info = self.env.step(0)
            if not (terminated or truncated):
                self._lives = self._ale_lives()
                return obs, info
        self._life_lost = False
        obs, info = self.env.reset(seed=seed, options=options)
        self._lives = self._ale_lives()
        return obs, info


def make_atari(
    name: str,
    *,
    seed: int | None = None,
    noop_max: int = DEFAULT_NOOP_MAX,
    repeat_action_probability: float = DEFAULT_REPEAT_ACTION_PROBABILITY,
    full_action_space: bool = False,
    max_episode_frames: int = DEFAULT_MAX_EPISODE_FRAMES,
    episodic_life: bool = False,
) -> gymnasium.Env:
    """One Atari game with the standard preprocessing (see the module doc).

    ``name``: a short name (``"breakout"``, ``"space_invaders"``, any of
    ``ATARI_GAMES``) or an ALE id (``"ALE/Breakout-v5"``). ``seed`` seeds the
    emulator (sticky actions), the no-op starts and ``action_space``; without
    it each env draws a fresh random seed. Observations are ``uint8`` arrays of
    shape ``(4, 84, 84)``; ``full_action_space=True`` gives all 18 actions.
    """
    env_id = atari_id(name)
    check_atari_options(
        noop_max, repeat_action_probability, max_episode_frames, full_action_space, episodic_life
    )
    env = gymnasium.make(
        env_id,
        # AtariPreprocessing reads the screen itself (grayscale); a grayscale
        # base observation is just the cheapest one for the base env to make.
        obs_type="grayscale",
        frameskip=1,
        repeat_action_probability=float(repeat_action_probability),
        full_action_space=full_action_space,
        # Counted in agent steps by TimeLimit below instead (as envpool does),
        # so no-op starts do not shorten the episode.
        max_num_frames_per_episode=None,
    )
    env = AtariPreprocessing(
        env,
        noop_max=noop_max,
        frame_skip=FRAME_SKIP,
        screen_size=SCREEN_SIZE,
        terminal_on_life_loss=False,
        grayscale_obs=True,
        scale_obs=False,
    )
    env = TimeLimit(env, max_episode_steps=max_episode_frames // FRAME_SKIP)
    if episodic_life:
        env = EpisodicLife(env)
    env = FrameStackObservation(env, stack_size=FRAME_STACK)
    if seed is not None:
        env.reset(seed=seed)
        env.action_space.seed(seed)
    return env
