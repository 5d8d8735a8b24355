"""A run's settings, typed: ``RunConfig``, one frozen dataclass with a documented field
per key of moolib-run's config (``moolib/conf``), its checks in ``__post_init__``.

It is built once, from the config Hydra composed (``launch/config.py``) or from the
one a savedir holds (``load``), and handed on as it is: the launchers, peers,
trainers and loggers read its attributes and never see omegaconf. This module is
the other edge: ``save`` writes it to ``<savedir>/config.yaml`` in the YAML that
moolib-run has always written there, and ``load`` reads it back (peers, SLURM
jobs, resumes and evaluations).

Where the run's device is decided (``auto`` to cuda or cpu) and checked (CUDA on
this machine) is here too, once: ``resolve_device``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moolib.conf.checks import (
    ConfigError,
    build_config,
    check_choice,
    check_flag,
    check_int_at_least,
    check_number,
    one_line,
)

from .scaling import ScalingConfig, scaling_spec

if TYPE_CHECKING:
    import torch
    from moolib.agents.registry import AgentConfig

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
class WandbConfig:
    """``wandb``: logging to Weights & Biases."""

    enabled: bool
    project: str
    mode: str  # auto (online when logged in, else offline), online, offline or disabled


@dataclass(frozen=True)
class TensorBoardConfig:
    """``tensorboard``: logs.tsv's numbers as TensorBoard event files beside it."""

    enabled: bool


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
    # Env steps between evaluations of the learner's weights while it trains
    # (agents.runtime.evaluation.PeriodicEval); 0: none. Defaults keep a config.yaml
    # written before these keys existed valid.
    eval_interval: int = dataclasses.field(default=0, kw_only=True)
    eval_episodes: int = dataclasses.field(default=10, kw_only=True)  # episodes per evaluation
    broker: str | None  # host:port of a running broker; None: the run starts one
    group_timeout: float  # seconds before a silent peer leaves the group
    lost_group_timeout: float  # seconds out of its group before a peer stops
    wandb: WandbConfig
    # A config.yaml written before the setting existed has none: off.
    tensorboard: TensorBoardConfig = TensorBoardConfig(enabled=False)

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
        from moolib.agents.registry import agent_config

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
            tensorboard=lambda v: build_config(TensorBoardConfig, v, "tensorboard"),
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
        from moolib.agents.registry import runtime_of_agent

        return runtime_of_agent(self.agent.name).processes

    def __post_init__(self) -> None:
        for key in ("total_steps", "checkpoint_history", "eval_episodes"):
            check_int_at_least(key, getattr(self, key))
        check_int_at_least("eval_interval", self.eval_interval, 0)
        check_int_at_least("scaling.peers", self.scaling.peers)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise ConfigError(f"seed must be null or an integer >= 0, got {seed!r}")
        if not isinstance(self.name, str) or not self.name:
            # It names the run's folder, its group and its wandb runs.
            raise ConfigError(f"name must be a non-empty string, got {self.name!r}")
        check_flag("wandb.enabled", self.wandb.enabled)
        check_flag("tensorboard.enabled", self.tensorboard.enabled)
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


def load(path: Path, *, device: str | None = None) -> RunConfig:
    """A config written by ``save``, checked again. Raises ConfigError naming a bad key.
    ``device`` takes the place of the saved one: an evaluation plays on the CPU,
    where a run that trained on a GPU would not load."""
    from omegaconf import DictConfig, OmegaConf

    values = OmegaConf.load(path)
    if device is not None and isinstance(values, DictConfig):
        values.device = device
    return RunConfig.from_dict(values)  # type: ignore[arg-type]
