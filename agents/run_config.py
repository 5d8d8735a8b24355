"""A run's settings, typed: ``RunConfig``, one frozen dataclass with a documented field
per key of moolib-run's config (``moolib/conf``), its checks in ``__post_init__``.

It is built once, from the config Hydra composed (``launch/config.py``) or from the
one a savedir holds (``load``), and handed on as it is: the launchers, peers,
trainers and loggers read its attributes and never see omegaconf. This module is
the other edge: ``save`` writes it to ``<savedir>/config.yaml`` in the YAML that
moolib-run has always written there, and ``load`` reads it back (peers, SLURM
jobs, resumes and ``evaluate``).

Where the run's device is decided (``auto`` to cuda or cpu) and checked (CUDA on
this machine) is here too, once: ``resolve_device``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from moolib.config_checks import (
    ConfigError,
    build_config,
    check_choice,
    check_flag,
    check_int_at_least,
    check_number,
    one_line,
)

if TYPE_CHECKING:
    import torch

    from .registry import AgentConfig

CONFIG_FILE = "config.yaml"


def resolve_device(value: object, *, cuda_here: bool = True) -> torch.device:
    """The torch device the setting ``device`` names: ``auto`` is CUDA when this machine
    has it, else CPU. Raises ConfigError for a value torch cannot read, and for CUDA on
    a machine without it, unless ``cuda_here`` is False (a launcher whose runs go to
    other machines: a SLURM login node may have no GPU, its jobs' nodes do)."""
    import torch

    if value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N; got {value!r}") from e
    if cuda_here and device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={value}: CUDA is not available on this machine")
    return device


def env_name_error(name: str, follows: str, key: str = "game") -> ConfigError:
    """``env.name`` set to something else than what ``env.game`` (a gymnasium env's
    ``env.id``) makes it."""
    pick = (
        "pick the game with env.game=GAME or env=GAME (MinAtar: env=minatar-GAME)"
        if key == "game"
        else f"pick the env with env.{key}"
    )
    return ConfigError(
        f"env.name={name}: env.name follows env.{key} (here it is {follows}); {pick}, not env.name"
    )


@dataclass(frozen=True)
class EnvConfig:
    """``env``: the environment (``conf/env/*.yaml``). ``RunConfig`` runs its ``check``
    last of its own, where moolib-run always checked the env: after the run's keys."""

    # game and id come first, keyword-only, so that config.yaml lists them before the
    # name that follows them, as conf/env does.
    # The game of a family whose config serves many (atari, minatar); None: no such key.
    game: str | None = dataclasses.field(default=None, kw_only=True)
    # A gymnasium env's id, or module:function (env=gym); None: no such key.
    id: str | None = dataclasses.field(default=None, kw_only=True)
    name: str  # the env's name in the env registry (runs are named <agent>-<name>)
    backend: str  # what steps it: gymnasium (moolib.EnvPool) or a family's own (envpool)
    # Keyword options of the env (free-form: checked by its family's options schema).
    options: Mapping[str, Any] | None
    # At every start and resume each env's first reset also takes a random number of
    # random actions, uniform in [0, decorrelate_steps) (moolib.envs.decorrelate); 0:
    # none. A config.yaml written before the setting existed has none.
    decorrelate_steps: int = dataclasses.field(default=0, kw_only=True)

    def check(self) -> None:
        """Raises ConfigError unless the name, game and backend agree with the env
        registry, the options pass the checks of the family's options schema and
        ``decorrelate_steps`` is an integer >= 0."""
        check_int_at_least("env.decorrelate_steps", self.decorrelate_steps, 0)
        from moolib.envs.registry import (
            DEFAULT_BACKEND,
            find_backend,
            find_env_spec,
            game_suite_of,
        )

        name, game = str(self.name), self.game
        # The suite is the config's (conf/env/minatar.yaml names its env minatar-<game>).
        suite = game_suite_of(name)
        if game is not None and suite is not None and suite.game_of(str(game)) is None:
            raise ConfigError(f"env.game {game!r} {suite.not_a_game}")
        spec = find_env_spec(name)
        if spec is None:
            raise ConfigError(
                f"env.name {name!r} is not a known environment (see moolib.envs.list_envs())"
            )
        if game is not None and suite is not None:
            follows = suite.env_name(str(game))
            if spec.canonical(follows) != spec.canonical(name):
                raise env_name_error(name, follows)
        backend = str(self.backend)
        if backend != DEFAULT_BACKEND and (spec.backend is None or spec.backend.name != backend):
            served = find_backend(backend)
            serves = served.serves if served is not None else "no env"
            raise ConfigError(f"env.backend={backend} serves {serves} only; {name} needs gymnasium")
        for key, value in self.option_values().items():
            try:
                spec.check_options({key: value}, backend)
            except (TypeError, ValueError) as e:
                error = f"{type(e).__name__}: {one_line(str(e))}"
                raise ConfigError(f"env.options.{key}={value!r}: {error}") from e

    def option_values(self) -> dict[str, Any]:
        """The options as keyword arguments of the env (none when unset). Raises
        ConfigError when they are not a mapping."""
        if self.options is None:
            return {}
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"env.options must be a mapping of settings, got {self.options!r}")
        return dict(self.options)


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
StartFn = Callable[["RunConfig", Path, Any], int]


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
    spec = importlib.util.find_spec(_SCALING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))


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


@dataclass(frozen=True)
class WandbConfig:
    """``wandb``: logging to Weights & Biases."""

    enabled: bool
    project: str
    mode: str  # auto (online when logged in, else offline), online, offline or disabled


@dataclass(frozen=True)
class RunConfig:
    """A moolib-run run's settings (``conf/config.yaml`` and the groups it composes), in
    the order of ``config.yaml``. Built by ``from_dict``; ``__post_init__`` raises
    ConfigError naming the first bad key (the agent's keys are checked by its own
    dataclass, first)."""

    agent: AgentConfig  # the agent's typed settings (moolib.agents.registry)
    env: EnvConfig
    scaling: ScalingConfig  # the settings' class of the mode scaling.name (scaling_spec)
    name: str  # the run's name (wandb runs are <name>-peer<rank>)
    group: str | None  # the experiment's group; None until launch.config.prepare sets it
    savedir: str | None  # where config, logs and checkpoints go; set by prepare
    device: str  # auto, cpu, cuda or cuda:N (see torch_device)
    torch_threads: int | str  # torch's threads per peer, or auto (runtime.onpolicy.torch_threads)
    seed: int | None
    total_steps: int  # env steps learned from, summed over all peers
    log_interval: float  # seconds between logs.tsv rows and progress lines
    checkpoint_interval: float  # seconds between checkpoints
    checkpoint_history: int  # older checkpoints kept in <savedir>/checkpoints
    broker: str | None  # host:port of a running broker; None: the run starts one
    group_timeout: float  # seconds before a silent peer leaves the group
    lost_group_timeout: float  # seconds out of its group before a peer stops
    wandb: WandbConfig

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> RunConfig:
        """The checked settings ``values`` describe: a composed or loaded config (a
        DictConfig, resolved here) or the same as plain Python. Raises ConfigError naming
        the first bad key."""
        from omegaconf import DictConfig, OmegaConf

        if isinstance(values, DictConfig):
            values = OmegaConf.to_container(values, resolve=True)  # type: ignore[assignment]
        if not isinstance(values, Mapping):
            raise ConfigError(f"a run config must be a mapping of settings, got {values!r}")
        # The agent first, as the checks always went: its errors come before the rest.
        # The registry (and torch, through the agents' networks) only once a config is
        # built: moolib-run --cfg job and --help start without them.
        from .registry import agent_config

        agent = agent_config(values.get("agent"))  # type: ignore[arg-type]
        scaling = values.get("scaling")
        spec = scaling_spec(scaling.get("name") if isinstance(scaling, Mapping) else None)
        return build_config(
            cls,
            values,
            "",
            agent=lambda _: agent,
            env=lambda v: build_config(EnvConfig, v, "env"),
            scaling=lambda v: build_config(spec.config, v, "scaling"),
            wandb=lambda v: build_config(WandbConfig, v, "wandb"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain Python, as ``config.yaml`` holds them (for wandb too)."""
        out = dataclasses.asdict(self)
        # A family's config has game or id (or neither), not both as null.
        out["env"] = {
            k: v for k, v in out["env"].items() if k not in ("game", "id") or v is not None
        }
        return out

    def torch_device(self) -> torch.device:
        """The torch device this process trains on (``device``; ``auto``: CUDA when this
        machine has it). Raises ConfigError for CUDA on a machine without it."""
        return resolve_device(self.device)

    @property
    def processes(self) -> str:
        """The scaling key counting the run's processes: ``peers``, or ``actors`` beside
        a learner (the agent's runtime decides)."""
        from .registry import runtime_of_agent

        return runtime_of_agent(self.agent.name).processes

    def __post_init__(self) -> None:
        for key in ("total_steps", "checkpoint_history"):
            check_int_at_least(key, getattr(self, key))
        check_int_at_least("scaling.peers", self.scaling.peers)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"seed must be null or an integer >= 0, got {seed!r}")
        if not isinstance(self.name, str) or not self.name:
            # It names the run's folder, its group and its wandb runs.
            raise ConfigError(f"name must be a non-empty string, got {self.name!r}")
        check_flag("wandb.enabled", self.wandb.enabled)
        # 0 would log every update: tens of thousands of lines a minute.
        for key in ("log_interval", "checkpoint_interval"):
            value = getattr(self, key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or not value > 0:
                raise ConfigError(f"{key} must be a number of seconds > 0, got {value!r}")
        check_number("group_timeout", self.group_timeout, 0.1, 1e6)
        check_number("lost_group_timeout", self.lost_group_timeout, 1.0)
        threads = self.torch_threads
        if threads != "auto" and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ConfigError(f"torch_threads must be auto or a positive integer, got {threads!r}")
        from moolib.envs.registry import backend_names

        check_choice("env.backend", self.env.backend, backend_names())
        check_choice("wandb.mode", self.wandb.mode, ("auto", "online", "offline", "disabled"))
        self.scaling.check(self)
        if self.device != "auto":
            # Across machines (SLURM) the peers run on other nodes: this one (a login
            # node) may have no GPU.
            resolve_device(self.device, cuda_here=self.scaling.on_this_machine)
        self.env.check()


def save(cfg: RunConfig, savedir: Path) -> Path:
    """Writes the run's config into the savedir (what peers and resumes read)."""
    from omegaconf import OmegaConf

    savedir.mkdir(parents=True, exist_ok=True)
    path = savedir / CONFIG_FILE
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(cfg.to_dict()))
    tmp.replace(path)
    return path


def load(path: Path) -> RunConfig:
    """A config written by ``save``, checked again. Raises ConfigError naming a bad key."""
    from omegaconf import OmegaConf

    return RunConfig.from_dict(OmegaConf.load(path))  # type: ignore[arg-type]
