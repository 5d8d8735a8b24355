"""What ``moolib-run`` composes from its packaged config (conf/): ``--cfg job`` shows the
choices made and the tuning file applied (the command line beats it), every env config and
Atari game composes to a config that passes the checks and an env that steps, and
``torch_threads=auto`` follows the cores a peer may use.
"""

from __future__ import annotations

import os
from pathlib import Path

import moolib.conf
import pytest
import yaml
from helpers.run_util import cfg_job
from helpers.toy_envs import first_action
from moolib.launch import config as config_lib
from omegaconf import OmegaConf

CONF = Path(next(iter(moolib.conf.__path__)))


ENV_FILES = sorted(p.stem for p in (CONF / "env").glob("*.yaml"))


# Atari games picked by name: no file each, registered from ale-py's ROM list.
GAMES = (
    "asteroids",
    "beam_rider",
    "breakout",
    "enduro",
    "montezuma_revenge",
    "ms_pacman",
    "pong",
    "qbert",
    "seaquest",
    "space_invaders",
)


def test_cfg_job_shows_choices_and_applies_tuning(tmp_path):
    default = cfg_job(tmp_path)
    # An Atari env's name follows its game (conf/env/atari.yaml: name: ${.game}).
    assert default["agent"]["name"] == "vtrace" and default["env"]["game"] == "breakout"
    assert default["env"]["name"] == "${.game}"
    assert default["scaling"]["name"] == "single" and default["scaling"]["peers"] == 1
    assert default["device"] == "auto"

    tuned = cfg_job(tmp_path, "agent=a2c", "env=cartpole")
    tuning = yaml.safe_load((CONF / "tuning" / "a2c_cartpole.yaml").read_text())
    assert tuned["agent"]["name"] == "a2c" and tuned["env"]["name"] == "cartpole"
    assert tuned["agent"]["hidden_size"] == tuning["agent"]["hidden_size"] == 64
    assert tuned["agent"]["optimizer"]["name"] == "adam"
    assert tuned["agent"]["optimizer"]["learning_rate"] == 2.0e-3
    assert tuned["agent"]["reward_clip"] == 0
    assert tuned["total_steps"] == tuning["total_steps"]
    # Values the tuning leaves alone come from agent/a2c.yaml.
    assert tuned["agent"]["discounting"] == 0.99

    untuned = cfg_job(tmp_path, "agent=a2c", "env=breakout")
    assert untuned["agent"]["name"] == "a2c" and untuned["env"]["game"] == "breakout"
    assert untuned["agent"]["hidden_size"] == 256
    assert untuned["agent"]["optimizer"]["name"] == "rmsprop"
    assert untuned["agent"]["optimizer"]["learning_rate"] == 7.0e-4
    assert untuned["total_steps"] == 50_000_000

    # Hydra's record of the choices made, tuning file included.
    hydra_cfg = cfg_job(tmp_path, "agent=a2c", "env=cartpole", part="hydra")
    choices = hydra_cfg["hydra"]["runtime"]["choices"]
    assert choices["agent"] == "a2c" and choices["env"] == "cartpole"
    assert choices["scaling"] == "single" and choices["tuning"] == "a2c_cartpole"

    vtrace = cfg_job(tmp_path, "agent=vtrace", "env=cartpole")
    assert vtrace["agent"]["name"] == "vtrace" and vtrace["agent"]["hidden_size"] == 64

    # The command line beats the tuning file.
    over = cfg_job(
        tmp_path,
        "agent=a2c",
        "env=cartpole",
        "agent.optimizer.learning_rate=5e-3",
        "agent.hidden_size=32",
        "total_steps=1234",
        "scaling=local",
        "scaling.peers=3",
    )
    assert over["agent"]["optimizer"]["learning_rate"] == 5e-3
    assert over["agent"]["hidden_size"] == 32
    assert over["total_steps"] == 1234
    assert over["agent"]["batch_size"] == 16  # still tuned
    assert over["scaling"] == {"name": "local", "peers": 3, "actors": 2, "peer_prefix": ""}


@pytest.mark.slow
def test_every_env_config_composes(tmp_path):
    from moolib.envs import create_env

    # One file for all the Atari games, one for the MinAtar games, one for the MuJoCo
    # tasks, one for any gymnasium env.
    assert ENV_FILES == [
        "atari",
        "cartpole",
        "cartpole-novel",
        "gym",
        "minatar",
        "mujoco",
        "pendulum",
    ]
    for name in (*ENV_FILES, *GAMES, "minatar-seaquest"):
        cfg = cfg_job(tmp_path, f"env={name}")
        resolved = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)
        named = {
            "atari": "breakout",
            "minatar": "minatar-breakout",
            "mujoco": "mujoco-half_cheetah",
            "gym": "gym:Acrobot-v1",
        }
        assert resolved["env"]["name"] == named.get(name, name)
        # The composed config passes moolib-run's checks, and its env builds and steps.
        config_lib.validate(OmegaConf.create(cfg))
        options = cfg["env"].get("options") or {}
        env = create_env(resolved["env"]["name"], **options)
        try:
            env.reset()
            env.step(first_action(env))
        finally:
            env.close()
    pong = cfg_job(tmp_path, "agent=a2c", "env=pong")
    assert pong["env"]["game"] == "pong" and pong["agent"]["name"] == "a2c"
    # The game is a setting of the one Atari config.
    qbert = cfg_job(tmp_path, "env=atari", "env.game=qbert")
    assert OmegaConf.create(qbert).env.name == "qbert"


@pytest.mark.parametrize(
    "overrides, slurm_cpus, expected",
    [
        (["scaling=single"], None, 15),  # 16 cores less the env worker's
        (["scaling=local", "scaling.peers=2"], None, 7),
        (["scaling=slurm"], "4", 3),  # the task's CPUs, not the node's 16
        (["scaling=local", "scaling.peers=2"], "4", 1),  # local peers inside one task
        (["scaling=single", "torch_threads=3"], None, 3),
    ],
)
def test_auto_torch_threads_follow_the_cores_a_peer_may_use(
    compose_config, monkeypatch, overrides, slurm_cpus, expected
):
    from moolib.agents.runtime import onpolicy

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    if slurm_cpus:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", slurm_cpus)
    cfg = compose_config("agent=a2c", "env=cartpole", "agent.num_actor_cpus=1", *overrides)
    assert onpolicy.torch_threads(config_lib.validate(cfg)) == expected
