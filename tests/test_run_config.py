"""The run's typed config (``moolib.conf.schema.run_config.RunConfig``): built once from the
composed config, written to the savedir and read back unchanged, checked the same way
however it is made, and the only config the modules after the checks see."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import sys
import threading
from pathlib import Path

import pytest
import yaml
from moolib.agents.registry import AgentConfig
from moolib.conf.schema import run_config, scaling
from moolib.conf.schema.run_config import EnvConfig, RunConfig, TensorBoardConfig, WandbConfig
from moolib.conf.schema.scaling import ScalingConfig
from moolib.launch import config as config_lib
from moolib.launch.config import ConfigError
from moolib.launch.scaling.local import LocalScalingConfig
from moolib.launch.scaling.slurm import SlurmScalingConfig

CASES = [
    ("agent=vtrace", "env=breakout", "scaling=single"),
    ("agent=a2c", "env=cartpole", "scaling=local", "scaling.peers=3"),
    (
        "agent=a2c",
        "env=gym",
        "env.id=Acrobot-v1",
        "scaling=slurm",
        "+scaling.additional_parameters.exclude=n1",
    ),
    ("agent=apex", "env=minatar-breakout", "scaling=local", "scaling.actors=3", "seed=4"),
    ("agent=r2d2", "env=cartpole-novel", "scaling=slurm", "device=cuda"),
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: " ".join(o))
def test_the_run_config_round_trips_through_its_savedir(compose_config, tmp_path, overrides):
    final = config_lib.prepare(compose_config(*overrides), tmp_path)
    assert isinstance(final, RunConfig)
    assert final.savedir == str(tmp_path) and final.group
    path = config_lib.save(final, tmp_path)
    assert path == tmp_path / config_lib.CONFIG_FILE
    loaded = config_lib.load(path)
    assert loaded == final
    # The file holds the composed config's keys and values, resolved, as it always did.
    composed = compose_config(*overrides)
    from omegaconf import OmegaConf

    expected = OmegaConf.to_container(composed, resolve=True)
    expected.update(savedir=str(tmp_path), group=final.group)
    assert yaml.safe_load(path.read_text()) == expected
    # A second prepare of the same savedir keeps the run's group.
    again = config_lib.prepare(composed, tmp_path)
    assert again.group == final.group


def test_the_nested_settings_are_typed(compose_config):
    cfg = config_lib.validate(compose_config("agent=a2c", "env=atari", "env.game=pong"))
    assert isinstance(cfg.agent, AgentConfig) and cfg.agent.name == "a2c"
    assert isinstance(cfg.env, EnvConfig) and (cfg.env.name, cfg.env.game) == ("pong", "pong")
    assert cfg.env.id is None and cfg.env.option_values()["noop_max"] == 30
    assert type(cfg.scaling) is ScalingConfig and cfg.scaling.peers == 1
    assert isinstance(cfg.wandb, WandbConfig) and cfg.wandb.enabled is False
    assert isinstance(cfg.tensorboard, TensorBoardConfig) and cfg.tensorboard.enabled is False
    local = config_lib.validate(compose_config("env=cartpole", "scaling=local"))
    assert type(local.scaling) is LocalScalingConfig and local.scaling.actors == 2
    slurm = config_lib.validate(compose_config("scaling=slurm", "scaling.tasks_per_node=2"))
    assert isinstance(slurm.scaling, SlurmScalingConfig) and slurm.scaling.peers_per_job == 2
    # The game or id a family's config lacks is not written as a null.
    assert "id" not in cfg.to_dict()["env"] and "game" not in local.to_dict()["env"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.total_steps = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("total_steps", 0, "total_steps must be a positive integer, got 0"),
        ("seed", -1, "seed must be null or an integer >= 0, got -1"),
        ("log_interval", 0, "log_interval must be a number of seconds > 0, got 0"),
        ("torch_threads", "many", "torch_threads must be auto or a positive integer, got 'many'"),
        ("device", "gpu", "device must be auto, cpu, cuda or cuda:N; got 'gpu'"),
    ],
)
def test_a_bad_value_raises_the_same_error_however_the_config_is_made(
    compose_config, tmp_path, key, value, message
):
    """Composed (moolib-run's check), replaced in a RunConfig, or read back from a
    savedir's config.yaml (a peer, a SLURM job): one ConfigError, naming the key."""
    override = f"{key}={value}"
    with pytest.raises(ConfigError) as composed:
        config_lib.validate(compose_config("agent=a2c", "env=cartpole", override))
    assert str(composed.value) == message
    final = config_lib.prepare(compose_config("agent=a2c", "env=cartpole"), tmp_path)
    with pytest.raises(ConfigError) as replaced:
        dataclasses.replace(final, **{key: value})
    assert str(replaced.value) == message
    path = config_lib.save(final, tmp_path)
    saved = yaml.safe_load(path.read_text())
    saved[key] = value
    path.write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError) as loaded:
        config_lib.load(path)
    assert str(loaded.value) == message


def test_a_scaling_or_env_error_keeps_its_message(compose_config):
    with pytest.raises(ConfigError, match=r"^scaling.peers=2 with scaling=single, which runs"):
        config_lib.validate(compose_config("scaling.peers=2"))
    with pytest.raises(ConfigError, match=r"^scaling.peers \(3\) must be a multiple of the peers"):
        config_lib.validate(
            compose_config("agent=a2c", "scaling=slurm", "scaling.peers=3", "scaling.nodes=2")
        )
    with pytest.raises(ConfigError, match=r"^env.options.noop_max=-1: ValueError: noop_max"):
        config_lib.validate(compose_config("env=breakout", "env.options.noop_max=-1"))
    negative = r"^env.decorrelate_steps must be an integer >= 0, got -1$"
    with pytest.raises(ConfigError, match=negative):
        config_lib.validate(compose_config("env=breakout", "env.decorrelate_steps=-1"))


def test_a_saved_config_from_before_env_decorrelation_resumes_without_it(compose_config, tmp_path):
    """A savedir's config.yaml written before env.decorrelate_steps existed loads, with
    none (the command line of a resume brings the current default)."""
    final = config_lib.prepare(compose_config("agent=a2c", "env=cartpole"), tmp_path)
    assert final.env.decorrelate_steps == 100
    values = final.to_dict()
    del values["env"]["decorrelate_steps"]
    assert RunConfig.from_dict(values).env.decorrelate_steps == 0


def test_a_saved_config_from_before_tensorboard_loads_with_it_off(compose_config, tmp_path):
    composed = compose_config("agent=a2c", "env=cartpole", "tensorboard.enabled=true")
    values = config_lib.prepare(composed, tmp_path).to_dict()
    assert values["tensorboard"] == {"enabled": True}
    with pytest.raises(ConfigError, match=r"^tensorboard.enabled must be true or false, got 1$"):
        RunConfig.from_dict({**values, "tensorboard": {"enabled": 1}})
    del values["tensorboard"]
    assert RunConfig.from_dict(values).tensorboard.enabled is False


def test_a_saved_config_with_an_unknown_or_missing_key_is_refused(compose_config, tmp_path):
    final = config_lib.prepare(compose_config("agent=a2c", "env=cartpole"), tmp_path)
    values = final.to_dict()
    with pytest.raises(ConfigError, match=r"^unknown key scaling.nodes \(ScalingConfig has no"):
        RunConfig.from_dict({**values, "scaling": {**values["scaling"], "nodes": 2}})
    del values["lost_group_timeout"]
    with pytest.raises(ConfigError, match=r"^lost_group_timeout is missing \(RunConfig needs"):
        RunConfig.from_dict(values)


# Modules that read Hydra's or the savedir's config as such: the edges. Every other
# module of the toolkit takes the typed RunConfig and never imports omegaconf.
OMEGACONF_EDGES = {
    "moolib.conf.schema.run_config",  # save and load of <savedir>/config.yaml
    "moolib.conf",  # the Hydra config's helpers
    "moolib.launch.config",  # DictConfig -> RunConfig
    "moolib.launch.preflight",  # composes and plans each job
    "moolib.launch.report",  # Hydra's resolvers of --help
    "moolib.launch.resume",  # merges the command line into a saved config
    "moolib.launch.run",  # Hydra's entry point
}


# A scaling mode of a user's: settings with a key of their own, and a start.
MODE = """
from dataclasses import dataclass

from moolib.conf.checks import check_int_at_least
from moolib.conf.schema.scaling import ScalingConfig, register_scaling


@dataclass(frozen=True)
class MineConfig(ScalingConfig):
    lanes: int

    def check(self, run):
        super().check(run)
        check_int_at_least("scaling.lanes", self.lanes)


started = []


@register_scaling("mine", MineConfig)
def start(cfg, config_path, stop):
    started.append((cfg.scaling.lanes, config_path))
    return 0
"""


def test_a_new_scaling_mode_is_one_module(compose_config, tmp_path, monkeypatch):
    """A module in moolib.launch.scaling is a mode: found by its name, its settings built
    and checked as the run's scaling, its start the one the launcher calls."""
    (tmp_path / "mine.py").write_text(MODE)
    package = importlib.import_module("moolib.launch.scaling")
    monkeypatch.setattr(package, "__path__", [*package.__path__, str(tmp_path)])
    monkeypatch.setattr(scaling, "_SCALINGS", dict(scaling._SCALINGS))
    monkeypatch.delitem(sys.modules, "moolib.launch.scaling.mine", raising=False)
    assert scaling.scaling_names() == ["local", "mine", "single", "slurm"]
    values = config_lib.prepare(compose_config("agent=a2c", "env=cartpole"), tmp_path).to_dict()
    values["scaling"] = {"name": "mine", "peers": 1, "lanes": 2}
    cfg = RunConfig.from_dict(values)
    assert type(cfg.scaling).__name__ == "MineConfig" and cfg.scaling.lanes == 2
    with pytest.raises(ConfigError, match=r"^scaling.lanes must be a positive integer, got 0"):
        RunConfig.from_dict({**values, "scaling": {**values["scaling"], "lanes": 0}})
    with pytest.raises(ConfigError, match=r"^scaling.name must be one of local, mine, single"):
        RunConfig.from_dict({**values, "scaling": {"name": "theirs", "peers": 1}})
    path = tmp_path / "config.yaml"
    assert scaling.scaling_spec("mine").start(cfg, path, threading.Event()) == 0
    assert sys.modules["moolib.launch.scaling.mine"].started == [(2, path)]


def test_only_the_edges_import_omegaconf():
    found = set()
    for package in (
        "moolib",
        "moolib.envs",
        "moolib.agents",
        "moolib.agents.math",
        "moolib.agents.nets",
        "moolib.agents.runtime",
        "moolib.launch",
        "moolib.launch.scaling",
        "moolib.conf",
        "moolib.conf.schema",
    ):
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations
        folder = Path(next(iter(spec.submodule_search_locations)))
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(n == "omegaconf" or n.startswith("omegaconf.") for n in names):
                    found.add(name)
    assert found == OMEGACONF_EDGES


def test_the_device_is_resolved_in_one_place(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run_config.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"^device=cuda: CUDA is not available on this machine"):
        run_config.resolve_device("cuda")
    # A SLURM launcher's jobs run on other nodes.
    assert run_config.resolve_device("cuda:1", cuda_here=False) == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert run_config.resolve_device("auto") == torch.device("cuda")
