"""scripts/reproduce.sh: every result figure by name, its exact moolib-run command (the one
docs/results.md shows), each composing into a valid config; a run resumes its savedir."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.run_util import read_logs, run_env
from helpers.util import REPO
from hydra import compose, initialize_config_module
from moolib.envs.minatar import MINATAR_GAMES
from moolib.launch import config as config_lib

SCRIPT = REPO / "scripts" / "reproduce.sh"
RESULTS_DOC = REPO / "docs" / "results.md"


def script(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    # The script runs moolib-run from PATH: the one installed beside this interpreter.
    bin_dir = str(Path(sys.executable).parent)
    extra = {"PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=run_env(extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def names() -> list[str]:
    r = script("--list")
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_every_figure_is_named_and_its_command_is_in_the_docs():
    listed = names()
    minatar = [f"minatar-{g}-seed{s}" for g in MINATAR_GAMES for s in (0, 1)]
    atari = [
        "pong-cpu",
        "breakout-cpu",
        "pong-cpu-nosticky",
        "breakout-cpu-nosticky",
        "breakout-cpu-nosticky-entropy",
    ]
    continuous = ["ppo-pendulum-seed1", "ppo-half_cheetah-seed1"]
    assert listed == [*minatar, *atari, *continuous]
    doc = RESULTS_DOC.read_text()
    for name in listed:
        r = script("--print", name)
        assert r.returncode == 0, r.stderr
        command = r.stdout.strip()
        assert command.startswith("moolib-run ") and command.endswith(f"savedir=results/{name}")
        # The docs show the exact command of every figure.
        assert f"`{command}`" in doc, command
    assert "total_steps=5000000" in script("--print", "minatar-seaquest-seed1").stdout
    r = script("--print", "nosuch")
    assert r.returncode == 2 and "no result named 'nosuch'" in r.stderr
    assert script("nosuch").returncode == 2


@pytest.fixture(scope="module")
def hydra_conf():
    with initialize_config_module(config_module="moolib.conf", version_base="1.3"):
        yield


def test_every_command_composes_into_a_valid_config(hydra_conf):
    for name in names():
        printed = script("--print", name)
        assert printed.returncode == 0, (name, printed.stderr)
        args = shlex.split(printed.stdout)[1:]
        overrides = [a for a in args if not a.startswith("savedir=")]
        cfg = compose("config", overrides=overrides)
        config_lib.validate(cfg)
        if name.startswith("minatar-"):
            game = re.fullmatch(r"minatar-(\w+)-seed(\d)", name)
            assert game and cfg.env.name == f"minatar-{game.group(1)}"
            assert cfg.seed == int(game.group(2)) and cfg.total_steps == 5_000_000
            assert cfg.env.options.sticky_action_prob == 0.1
            assert cfg.agent.name == "vtrace" and cfg.agent.hidden_size == 128
        elif name.startswith("ppo-"):
            # Continuous actions: PPO with its tuning for the env.
            env = {"pendulum": "pendulum", "half_cheetah": "mujoco-half_cheetah"}
            task = re.fullmatch(r"ppo-(\w+)-seed(\d)", name)
            assert task and cfg.env.name == env[task.group(1)] and cfg.agent.name == "ppo"
            assert cfg.agent.reward_scaling and cfg.device == "cpu"
            assert cfg.total_steps == (100_000 if task.group(1) == "pendulum" else 1_000_000)
        else:
            assert cfg.agent.network == "impala_shallow" and cfg.device == "cpu"
            game, _, setting = name.partition("-cpu")
            assert cfg.env.name == game
            # The published curves were made without sticky actions (the -nosticky runs).
            sticky = 0.0 if setting.startswith("-nosticky") else 0.25
            assert cfg.env.options.repeat_action_probability == sticky
            # The -entropy run differs from its -nosticky run in its entropy cost alone.
            assert cfg.agent.entropy_cost == (0.003 if setting.endswith("-entropy") else 0.0006)


def test_running_a_name_again_resumes_its_savedir(tmp_path):
    env = {"MOOLIB_RESULTS": str(tmp_path / "results")}
    small = ["total_steps=3000", "log_interval=1", "agent.actor_batch_size=8"]
    first = script("minatar-breakout-seed0", *small, env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    savedir = tmp_path / "results" / "minatar-breakout-seed0"
    assert (savedir / "checkpoint.pt").is_file() and (savedir / "config.yaml").is_file()
    steps = read_logs(savedir / "logs.tsv")[1][-1]["step"]
    assert 3000 <= steps
    # Again, with more steps: the same savedir goes on from its checkpoint.
    more = ["total_steps=6000", *small[1:]]
    second = script("minatar-breakout-seed0", *more, env=env, timeout=300)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-3000:]
    assert f"resuming {savedir}" in out or "resuming results" in out, out[-3000:]
    assert "total_steps=6000 (was 3000)" in out, out[-3000:]
    assert read_logs(savedir / "logs.tsv")[1][-1]["step"] >= 6000
    assert not any(p.name != "minatar-breakout-seed0" for p in (tmp_path / "results").iterdir())
    assert os.access(SCRIPT, os.X_OK)
