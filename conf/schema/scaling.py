"""The ``scaling`` settings of a run, and the scaling modes as registered parts.

``ScalingConfig`` holds the keys every mode has (``conf/scaling/single.yaml``);
``ProcessScalingConfig`` those of the modes that run processes of their own. A mode is
one module of ``moolib.launch.scaling`` (with its YAML in ``conf/scaling/``): it
subclasses these with its own keys and registers, by its name, its settings and the
function that starts a run in it (``register_scaling``). Runtimes and launchers ask
the settings what they need to know of the mode (``on_this_machine``,
``listen_address``, ``actor_processes``, ``follows_run``, ``broker_wait``), never its
name.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from moolib.conf.checks import ConfigError, check_choice, check_int_at_least

# The run's settings (``run_config.RunConfig``, which holds these: named, not imported).
RunConfig = Any


@dataclass(frozen=True)
class ScalingConfig:
    """``scaling=single`` (``conf/scaling/single.yaml``): one peer, in this process, with
    an embedded broker. The other modes' settings subclass it (``ProcessScalingConfig``),
    each in its mode's module of ``moolib.launch.scaling``; what a runtime or the
    launcher needs to know of the mode it asks of the settings, never of the name."""

    name: str  # the scaling mode: a module of moolib.launch.scaling (single, local, slurm)
    peers: int  # peer processes of an on-policy run, in all

    # Whether the run's processes share this machine (its cores are split between its
    # peers) and are reached on its loopback; a mode across machines says False.
    on_this_machine: ClassVar[bool] = True

    @property
    def listen_address(self) -> str:
        """Where a process of the run that serves others (a replay) listens."""
        return "127.0.0.1:0" if self.on_this_machine else "0.0.0.0:0"

    @property
    def actor_processes(self) -> int:
        """Actor processes beside an off-policy run's learner: none here (its actors are
        threads of the learner's process)."""
        return 0

    @property
    def follows_run(self) -> bool:
        """Whether moolib-run trains (or follows the training) until the run ends, rather
        than handing it to a scheduler and returning."""
        return True

    def broker_wait(self, run: RunConfig) -> tuple[float, str]:
        """Seconds to wait for a given broker to answer, and the setting that says so."""
        return float(run.group_timeout), "group_timeout"

    def check(self, run: RunConfig) -> None:
        """Raises ConfigError naming the first bad ``scaling`` key of ``run`` (``peers`` is
        checked >= 1 before)."""
        if self.peers != 1:
            # The lone peer would take itself for one of several: a share of the cores,
            # a peer<k>/ log.
            raise ConfigError(
                f"scaling.peers={self.peers} with scaling=single, which runs one peer: "
                "scaling=local runs several on this machine, scaling=slurm on SLURM"
            )


@dataclass(frozen=True)
class ProcessScalingConfig(ScalingConfig):
    """The keys of the modes that run peer processes (``local``, ``slurm``)."""

    # Off-policy agents: actor processes beside the one learner (peers is not used).
    actors: int

    @property
    def actor_processes(self) -> int:
        """``scaling.actors``: processes of their own."""
        return self.actors

    def check(self, run: RunConfig) -> None:
        """The process count the run's runtime reads (``peers`` or ``actors``) >= 1."""
        check_int_at_least(f"scaling.{run.processes}", getattr(self, run.processes))


# (cfg, config_path, stop) -> exit status; stop: moolib.launch.peer.StopSignal, an Event.
StartFn = Callable[[RunConfig, Path, Any], int]


@dataclass(frozen=True)
class ScalingSpec:
    """A registered scaling mode: what ``scaling=NAME`` runs.

    ``config``: its settings' dataclass (``ScalingConfig`` or a subclass).
    ``start(cfg, config_path, stop)``: trains the run (its config saved at
    ``config_path``) in this mode, or hands it to a scheduler; returns the exit status.
    ``check_machine(cfg)``: raises ConfigError when this machine cannot start the run
    (before anything is made), or None."""

    name: str
    config: type[ScalingConfig]
    start: StartFn
    check_machine: Callable[[RunConfig], None] | None = None


_SCALING_PACKAGE = "moolib.launch.scaling"
_SCALINGS: dict[str, ScalingSpec] = {}


def register_scaling(
    name: str,
    config: type[ScalingConfig],
    *,
    check_machine: Callable[[RunConfig], None] | None = None,
) -> Callable[[StartFn], StartFn]:
    """Decorator registering ``start`` as scaling mode ``name``, from the module of
    ``moolib.launch.scaling`` of that name (``scaling_spec`` imports it to find it)."""

    def register(start: StartFn) -> StartFn:
        module = start.__module__.rpartition(".")[2]
        if module != name:
            raise ValueError(f"scaling mode {name!r} must be registered by a module of that name")
        _SCALINGS[name] = ScalingSpec(name, config, start, check_machine)
        return start

    return register


def scaling_names() -> list[str]:
    """The scaling modes: the modules of ``moolib.launch.scaling``, sorted."""
    package = importlib.import_module(_SCALING_PACKAGE)  # its __init__ holds no code
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__))


def scaling_spec(name: object) -> ScalingSpec:
    """The scaling mode ``name`` (``scaling.name``); its module is imported on the first
    call (the launcher is above this module: nothing here imports it by name). Raises
    ConfigError naming the modes for any other value."""
    check_choice("scaling.name", name, tuple(scaling_names()))
    if name not in _SCALINGS:
        importlib.import_module(f"{_SCALING_PACKAGE}.{name}")
    if name not in _SCALINGS:
        raise ValueError(f"{_SCALING_PACKAGE}.{name} registers no scaling mode {name!r}")
    return _SCALINGS[str(name)]
