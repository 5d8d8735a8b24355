"""The env registry: one ``EnvSpec`` per env family, and the lookups every user of an
env name goes through (``moolib.envs.create_env``, ``moolib-run``'s checks, the
trainers' env pools, the Hydra config's game options).

The families moolib ships register in ``moolib.envs.catalog``; a family of one's
own registers with ``register_env(EnvSpec(...))``. A leaf module: the family modules
declare their options with ``EnvOption`` here, and the catalog builds on both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The backend that steps any family's envs: moolib.EnvPool's worker processes over
# the family's ``make``. Other backends (envpool) serve the families that name them.
DEFAULT_BACKEND = "gymnasium"


@dataclass(frozen=True)
class EnvOption:
    """One keyword option of an env family (a key of ``env.options``)."""

    name: str
    # What the env takes when the option is not given.
    default: object = None
    # Raises ValueError, naming the option, for a value the env cannot take; None
    # leaves the value to the env itself.
    check: Callable[[Any], None] | None = None


@dataclass(frozen=True)
class Backend:
    """A backend of its own that steps a family's envs in batches (envpool's C++ threads),
    behind ``moolib.EnvPool``'s interface (``step(batch_index, action)``, ``close()``,
    ``observation_space``, ``num_actions``)."""

    # Its value of ``env.backend``.
    name: str
    # make(env_name, batch_size, num_batches, **options) -> the batched envs.
    make: Callable[..., Any]
    # Every option ``make`` takes, in its order.
    options: tuple[EnvOption, ...]
    # (distribution, shown): the library that steps the envs, named on the start banner.
    library: tuple[str, str]
    # What it serves, for the error of a family it does not ("Atari games").
    serves: str


@dataclass(frozen=True)
class GameSuite:
    """The games of a family whose Hydra config is one parametrised file
    (``conf/env/<config>.yaml`` with ``env.game``): each game is an ``env`` option of
    its own, named ``prefix + game``."""

    # The suite's name in listings ("Atari", "MinAtar").
    label: str
    # The parametrised file of conf/env (and of conf/tuning: <agent>_<config>.yaml).
    config: str
    games: tuple[str, ...]
    # The env name of a game is prefix + game.
    prefix: str
    # The game a value of env.game names (None: not one of the suite's).
    game_of: Callable[[str], str | None]
    # Whether an env name is spelled as one of the suite's, known game or not: the
    # suite whose games env.game is checked against.
    claims: Callable[[str], bool]
    # How the config check says a value of env.game is not one ("is not a ... game").
    not_a_game: str
    # What listings call its members ("the MinAtar games ...", "the MuJoCo tasks ...").
    noun: str = "games"

    def env_name(self, game: str) -> str:
        """The env name of ``game`` (``minatar-breakout``)."""
        return self.prefix + game


@dataclass(frozen=True)
class EnvSpec:
    """Everything that differs between env families."""

    # The family's name ("atari").
    family: str
    # One line on what it is, for listings.
    description: str
    # The short names ``list_envs()`` shows for it (a family of open-ended names, such
    # as gymnasium's ``gym:<id>``, shows none).
    names: tuple[str, ...]
    # The canonical name of an env of this family ("space_invaders" for
    # "ALE/SpaceInvaders-v5"); None when ``name`` is not one of its envs.
    canonical: Callable[[str], str | None]
    # make(env_name, **options) -> one gymnasium env.
    make: Callable[..., Any]
    # Every option ``make`` takes, in its order; None: any (handed on as they are).
    options: tuple[EnvOption, ...] | None
    # A batched backend of its own besides moolib.EnvPool's, if any.
    backend: Backend | None = None
    # The family's games, where its config is one parametrised file.
    games: GameSuite | None = None
    # (distribution, shown): the library behind its envs, named on the start banner.
    library: tuple[str, str] | None = None
    # Called in a process before it makes the family's envs (to quiet a library's banner).
    prepare: Callable[[], None] | None = None

    def option_names(self, backend: str = DEFAULT_BACKEND) -> list[str] | None:
        """The options the env takes on ``backend``, in order; None for any."""
        options = self._options(backend)
        return None if options is None else [o.name for o in options]

    def check_options(self, options: Mapping[str, object], backend: str = DEFAULT_BACKEND) -> None:
        """Runs each given option's check: raises ValueError (naming the option) for a
        value the env cannot take. Options it does not know are left to ``unknown_options``."""
        schema = {o.name: o for o in self._options(backend) or ()}
        for key, value in options.items():
            option = schema.get(key)
            if option is not None and option.check is not None:
                option.check(value)

    def unknown_options(self, options: Iterable[str], backend: str = DEFAULT_BACKEND) -> list[str]:
        """The names among ``options`` the env does not take on ``backend``."""
        names = self.option_names(backend)
        return [] if names is None else [k for k in options if k not in names]

    def _options(self, backend: str) -> tuple[EnvOption, ...] | None:
        if backend != DEFAULT_BACKEND and self.backend is not None:
            return self.backend.options
        return self.options


_specs: dict[str, EnvSpec] = {}


def register_env(spec: EnvSpec) -> EnvSpec:
    """Adds ``spec`` to the registry (after those already there: ``list_envs`` shows
    the families in this order); returns it. Raises ValueError for a family already
    registered."""
    if spec.family in _specs:
        raise ValueError(f"env family {spec.family!r} is already registered")
    _specs[spec.family] = spec
    return spec


def env_specs() -> tuple[EnvSpec, ...]:
    """Every registered family's spec, in registration order."""
    return tuple(_specs.values())


def find_env_spec(name: str) -> EnvSpec | None:
    """The spec of the family that makes the env ``name``; None when none does."""
    return next((s for s in _specs.values() if s.canonical(name) is not None), None)


def list_envs() -> list[str]:
    """Every short name ``create_env`` accepts: ``"cartpole"``, the MinAtar games, then
    the Atari games (ALE ids such as ``"ALE/Breakout-v5"`` are accepted too, and any
    gymnasium env as ``"gym:<id>"``)."""
    return [name for spec in _specs.values() for name in spec.names]


def backend_names() -> tuple[str, ...]:
    """Every value ``env.backend`` may take: the default first."""
    others = [s.backend.name for s in _specs.values() if s.backend is not None]
    return (DEFAULT_BACKEND, *dict.fromkeys(others))


def find_backend(name: str) -> Backend | None:
    """The batched backend called ``name`` (None for the default or an unknown one)."""
    return next(
        (s.backend for s in _specs.values() if s.backend is not None and s.backend.name == name),
        None,
    )


def game_suite_of(name: str) -> GameSuite | None:
    """The game suite that claims the env name ``name`` (the one with the longest
    prefix, so that "minatar-breakout" is MinAtar's, not Atari's)."""
    suites = sorted(
        (s.games for s in _specs.values() if s.games is not None),
        key=lambda suite: -len(suite.prefix),
    )
    return next((suite for suite in suites if suite.claims(name)), None)
