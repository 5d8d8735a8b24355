"""Hydra configuration of moolib-run, shipped as package data (``moolib.conf``).

Most options of a config group are YAML files here (``agent/a2c.yaml``). The
Atari games are one parametrised file, ``env/atari.yaml`` (``game: breakout``);
importing this package registers every game ale-py knows as an ``env`` option
of its own in Hydra's ConfigStore (``env=pong`` is ``env=atari env.game=pong``),
so no per-game file exists and a new ROM needs no edit here. The MinAtar games
are registered the same way over ``env/minatar.yaml`` (``env=minatar-breakout``
is ``env=minatar env.game=breakout``), and so is each game's tuning: a file
``tuning/<agent>_minatar.yaml`` serves ``env=minatar-<game>`` for every game.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING

from hydra.core.config_store import ConfigStore

if TYPE_CHECKING:
    from moolib.envs import GameSuite

_registered: tuple[str, ...] | None = None


def _game_suites() -> list[GameSuite]:
    """The env registry's game suites (none without ale-py: env=atari env.game=...
    still composes)."""
    try:
        from moolib.envs import env_specs
    except ImportError:
        return []
    return [spec.games for spec in env_specs() if spec.games is not None]


def register_games() -> tuple[str, ...]:
    """Registers an ``env`` option for every game of the env registry's game suites
    (``env=GAME`` for Atari, ``env=minatar-GAME`` for MinAtar), with their tunings
    (idempotent); returns the games' env options."""
    global _registered
    if _registered is not None:
        return _registered
    store = ConfigStore.instance()
    files = set(file_options("env"))
    tunings = file_options("tuning")
    options: list[str] = []
    for suite in _game_suites():
        for game in suite.games:
            option = suite.env_name(game)
            options.append(option)
            if option not in files:
                # Defaults relative to the env group: the game's option is its suite's file,
                # re-gamed.
                store.store(
                    group="env",
                    name=option,
                    node={"defaults": [suite.config, "_self_"], "game": game},
                )
        # tuning: ${agent}_${env} names the env option, so a suite's tuning file
        # (a2c_minatar.yaml) is registered again under each of its games' options.
        suffix = f"_{suite.config}"
        for tuning in tunings:
            if tuning.endswith(suffix):
                agent = tuning.removesuffix(suffix)
                for game in suite.games:
                    store.store(
                        group="tuning",
                        name=f"{agent}_{suite.env_name(game)}",
                        node={"defaults": [tuning, "_self_"]},
                        package="_global_",
                    )
    _registered = tuple(options)
    return _registered


def file_options(group: str) -> list[str]:
    """The options of ``group`` shipped as YAML files, sorted."""
    folder = resources.files(__name__) / group
    if not folder.is_dir():
        return []
    return sorted(
        e.name.removesuffix(".yaml") for e in folder.iterdir() if e.name.endswith(".yaml")
    )


def registered_options(group: str) -> list[str]:
    """The options of ``group`` registered in code (the Atari and MinAtar games of ``env``,
    the per-game MinAtar tunings of ``tuning``), sorted."""
    register_games()
    try:
        names = ConfigStore.instance().list(group)
    except OSError:  # no such group in the store
        return []
    return sorted(n.removesuffix(".yaml") for n in names if n.endswith(".yaml"))


def options_setting(group: str, key: str) -> list[str]:
    """The file options of ``group`` whose YAML has ``key`` (dotted, below the group:
    ``actors`` for ``scaling.actors``), sorted."""
    from omegaconf import OmegaConf

    folder = resources.files(__name__) / group
    absent = object()
    return [
        option
        for option in file_options(group)
        if OmegaConf.select(OmegaConf.load(str(folder / f"{option}.yaml")), key, default=absent)
        is not absent
    ]


def registered_suites(group: str) -> dict[str, list[str]]:
    """The games registered as options of ``env``, by suite, sorted: ``{"Atari":
    [...], "MinAtar": ["minatar-asterix", ...]}`` (suites without options are left
    out); ``{}`` for the other groups."""
    if group != "env":  # the tunings registered per MinAtar game are no one's choice
        return {}
    files = set(file_options(group))
    names = [n for n in registered_options(group) if n not in files]
    from moolib.envs.registry import game_suite_of

    suites: dict[str, list[str]] = {}
    for name in names:
        suite = game_suite_of(name)
        if suite is not None:
            suites.setdefault(suite.label, []).append(name)
    return {label: found for label, found in suites.items() if found}


def listed_suites(group: str, mark: Callable[[list[str]], str] = ", ".join) -> str:
    """The game suites of ``group`` other than Atari's (whose hundred games are summed up
    apart), each listed in full: ``", or the MinAtar games minatar-asterix, ..."``;
    ``mark`` writes a suite's options."""
    from moolib.envs.registry import env_specs

    nouns = {s.games.label: s.games.noun for s in env_specs() if s.games is not None}
    return "".join(
        f", or the {label} {nouns.get(label, 'games')} {mark(names)}"
        for label, names in registered_suites(group).items()
        if label != "Atari"
    )


def group_options(group: str) -> list[str]:
    """Every option ``group=OPTION`` accepts: its files, then the registered ones."""
    files = file_options(group)
    return files + [n for n in registered_options(group) if n not in files]


register_games()
