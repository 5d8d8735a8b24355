"""Checks a composed moolib-run config and fills in what is decided at launch.

Hydra already refuses unknown keys; this catches values of the wrong type or
out of range, naming the key, before any process starts.
"""

from __future__ import annotations

import datetime
import secrets
from pathlib import Path

from moolib.agents.run_config import CONFIG_FILE, load, save
from omegaconf import DictConfig, OmegaConf

from moolib.config_checks import (
    ConfigError,
    check_choice,
    check_flag,
    check_int_at_least,
    check_number,
    env_options,
    one_line,
    resolve_device,
)

# Importable from here too (moolib.launch.config.ConfigError, ...), where they lived first.
__all__ = [
    "CONFIG_FILE",
    "ConfigError",
    "check_flag",
    "check_int_at_least",
    "env_name_error",
    "load",
    "one_line",
    "prepare",
    "save",
    "validate",
]


def _int_at_least(cfg: DictConfig, key: str, low: int = 1) -> None:
    check_int_at_least(key, OmegaConf.select(cfg, key), low)


def _number(cfg: DictConfig, key: str, low: float, high: float | None = None) -> None:
    check_number(key, OmegaConf.select(cfg, key), low, high)


def _seconds(cfg: DictConfig, key: str) -> None:
    """A number of seconds > 0 (0 would do the thing at every step of the loop)."""
    value = OmegaConf.select(cfg, key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not value > 0:
        raise ConfigError(f"{key} must be a number of seconds > 0, got {value!r}")


def _flag(cfg: DictConfig, key: str) -> None:
    check_flag(key, OmegaConf.select(cfg, key))


def _choice(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> None:
    check_choice(key, OmegaConf.select(cfg, key), choices)


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


def validate(cfg: DictConfig) -> None:
    """Raises ConfigError naming the first bad key. The agent's settings are checked
    by its registered dataclass (``moolib.agents.registry``), the rest here."""
    from moolib.agents.registry import agent_config

    agent_config(cfg.agent)
    for key in ("total_steps", "checkpoint_history", "scaling.peers"):
        _int_at_least(cfg, key)
    if cfg.scaling.name == "single" and cfg.scaling.peers != 1:
        # The lone peer would take itself for one of several: a share of the cores, a peer<k>/ log.
        raise ConfigError(
            f"scaling.peers={cfg.scaling.peers} with scaling=single, which runs one peer: "
            "scaling=local runs several on this machine, scaling=slurm on SLURM"
        )
    seed = cfg.seed
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"seed must be null or an integer >= 0, got {seed!r}")
    name = cfg.name
    if not isinstance(name, str) or not name:
        # It names the run's folder, its group and its wandb runs.
        shown = OmegaConf.to_object(name) if OmegaConf.is_config(name) else name
        raise ConfigError(f"name must be a non-empty string, got {shown!r}")
    _flag(cfg, "wandb.enabled")
    # 0 would log every update: tens of thousands of lines a minute.
    _seconds(cfg, "log_interval")
    _seconds(cfg, "checkpoint_interval")
    _number(cfg, "group_timeout", 0.1, 1e6)
    _number(cfg, "lost_group_timeout", 1.0)
    threads = cfg.torch_threads
    if threads != "auto" and (
        isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
    ):
        raise ConfigError(f"torch_threads must be auto or a positive integer, got {threads!r}")
    from moolib.envs.registry import backend_names

    _choice(cfg, "env.backend", backend_names())
    _choice(cfg, "wandb.mode", ("auto", "online", "offline", "disabled"))
    from moolib.agents.registry import runtime_of

    # The scaling key counting the run's processes: scaling.peers, or scaling.actors
    # beside a learner.
    what = runtime_of(cfg).processes
    if cfg.scaling.name in ("local", "slurm"):
        _int_at_least(cfg, f"scaling.{what}")
    if cfg.scaling.name == "slurm":
        for key in (
            "scaling.time",
            "scaling.nodes",
            "scaling.tasks_per_node",
            "scaling.cpus_per_task",
            "scaling.broker_cpus",
        ):
            _int_at_least(cfg, key)
        per_job = cfg.scaling.nodes * cfg.scaling.tasks_per_node
        # Off-policy runs spread their actor processes over the array's jobs (the
        # learner has a job of its own); the others their peers.
        count = cfg.scaling[what]
        if count % per_job:
            raise ConfigError(
                f"scaling.{what} ({count}) must be a multiple of the {what} per job, "
                f"scaling.nodes x scaling.tasks_per_node ({per_job})"
            )
        _flag(cfg, "scaling.wait")
        if cfg.scaling.gpus_per_task is not None:
            _int_at_least(cfg, "scaling.gpus_per_task", low=0)
        _number(cfg, "scaling.broker_timeout", 1.0)
        _int_at_least(cfg, "scaling.max_failures", low=0)
        if cfg.scaling.array_parallelism is not None:
            _int_at_least(cfg, "scaling.array_parallelism")
    if cfg.device != "auto":
        # On SLURM the peers run on other nodes: this one (a login node) may have no GPU.
        resolve_device(cfg.device, cuda_here=cfg.scaling.name != "slurm")
    _check_env(cfg)


def _check_env(cfg: DictConfig) -> None:
    """The env's name, game and backend agree with the env registry, and its options
    pass the checks of the family's options schema."""
    from moolib.envs.registry import DEFAULT_BACKEND, find_backend, find_env_spec, game_suite_of

    name = str(cfg.env.name)
    game = cfg.env.get("game")
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
    backend = str(cfg.env.backend)
    if backend != DEFAULT_BACKEND and (spec.backend is None or spec.backend.name != backend):
        served = find_backend(backend)
        serves = served.serves if served is not None else "no env"
        raise ConfigError(f"env.backend={backend} serves {serves} only; {name} needs gymnasium")
    for key, value in env_options(cfg).items():
        try:
            spec.check_options({key: value}, backend)
        except (TypeError, ValueError) as e:
            error = f"{type(e).__name__}: {one_line(str(e))}"
            raise ConfigError(f"env.options.{key}={value!r}: {error}") from e


def prepare(cfg: DictConfig, savedir: Path) -> DictConfig:
    """The run's final config: validated, resolved, with ``savedir`` and ``group``
    filled in. A savedir that holds a config from an earlier run keeps that
    run's group (a resumed experiment stays one experiment)."""
    validate(cfg)
    out = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(out, dict)
    out.pop("hydra", None)
    out["savedir"] = str(savedir)
    previous = savedir / CONFIG_FILE
    if out.get("group") is None:
        if previous.exists():
            out["group"] = OmegaConf.load(previous).get("group")
        if out.get("group") is None:
            stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
            out["group"] = f"{out['name']}-{stamp}-{secrets.token_hex(2)}"
    final = OmegaConf.create(out)
    OmegaConf.set_struct(final, True)
    return final
