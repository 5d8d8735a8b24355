"""End-to-end tests of ``moolib-run`` (the Hydra app) and ``moolib-plot``.

Real processes, real Hydra composition over conf/, real envs: every run is a
``python -m moolib.launch.run`` subprocess in its own session with its own
savedir under tmp_path; runs are short (small total_steps and batches) and
nothing asserts on speed.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import moolib.conf
import pytest
import torch
import yaml
from helpers.run_util import (
    STOP_TIMEOUT,
    alive,
    cfg_job,
    check_ok,
    peers_and_workers,
    plot_cmd,
    read_logs,
    run,
    run_env,
    run_quick,
    session_pids,
    start_local_training,
    wait_for,
)
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

# What every logs.tsv row carries (docs/toolkit.md, "What a run writes").
EXPECTED_COLUMNS = {
    "step",
    "sps",
    "mean_episode_return",
    "mean_episode_length",
    "episodes",
    "total_loss",
    "policy_loss",
    "baseline_loss",
    "entropy_loss",
    "grad_norm",
    "learning_rate",
    "virtual_batch_size",
    "model_version",
    "param_sum",
    "peers",
    "env_steps",
    "offered_steps",
    "time",
}
# Small Breakout runs on CPU: 8 envs in 2 actor batches, 4 unrolls of 10 steps per update.
SMALL_ATARI = [
    "device=cpu",
    "agent.actor_batch_size=8",
    "agent.batch_size=4",
    "agent.unroll_length=10",
    "agent.virtual_batch_size=4",
    "log_interval=1",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_config(savedir: Path) -> dict:
    return yaml.safe_load((savedir / "config.yaml").read_text())


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def history_steps(savedir: Path) -> list[int]:
    names = [p.name for p in (savedir / "checkpoints").iterdir()]
    steps = []
    for name in names:
        m = re.fullmatch(r"checkpoint_(\d+)\.pt", name)
        assert m, f"unexpected file in checkpoints/: {name}"
        steps.append(int(m.group(1)))
    return sorted(steps)


# -- a run, and a resumed run --------------------------------------------------------------


@pytest.mark.timeout(600)
def test_vtrace_breakout_cpu_logs_checkpoints_and_resumes(tmp_path):
    savedir = tmp_path / "breakout"
    base = ["agent=vtrace", "env=breakout", *SMALL_ATARI, "seed=0", f"savedir={savedir}"]

    out1 = check_ok(run([*base, "total_steps=300"], tmp_path))
    assert "resumed" not in out1

    # The resolved config.
    cfg = load_config(savedir)
    assert cfg["agent"]["name"] == "vtrace" and cfg["env"]["name"] == "breakout"
    assert cfg["device"] == "cpu" and cfg["total_steps"] == 300
    assert cfg["agent"]["actor_batch_size"] == 8 and cfg["agent"]["unroll_length"] == 10
    assert cfg["savedir"] == str(savedir)
    assert cfg["group"] and cfg["name"] == "vtrace-breakout"  # interpolations resolved
    # The loaded config is what launch/config.py accepts.
    config_lib.validate(OmegaConf.create(cfg))

    # logs.tsv: the expected columns, rows up to total_steps.
    header, rows1 = read_logs(savedir / "logs.tsv")
    assert EXPECTED_COLUMNS <= set(header), EXPECTED_COLUMNS - set(header)
    assert rows1
    steps1 = [r["step"] for r in rows1]
    assert steps1 == sorted(steps1)
    last1 = int(steps1[-1])
    assert last1 >= 300
    trained = [r for r in rows1 if r["model_version"] > 0]
    assert trained, rows1
    assert not any(math.isinf(r["total_loss"]) for r in trained)
    assert any(math.isfinite(r["total_loss"]) and r["grad_norm"] >= 0 for r in trained)
    assert any(r["virtual_batch_size"] == 4 for r in trained)  # one peer's 4 unrolls
    assert rows1[-1]["peers"] == 1

    # Checkpoint (and its history entry) at the last step.
    ckpt1 = load_checkpoint(savedir / "checkpoint.pt")
    assert ckpt1["steps"] == last1
    assert ckpt1["model_version"] == int(rows1[-1]["model_version"])
    assert {"model", "optimizer"} <= set(ckpt1)
    assert history_steps(savedir) == [last1]
    assert not list(savedir.glob(".checkpoint.pt.*"))  # no temp file left

    # Same savedir, more steps: resumes from the checkpoint.
    out2 = check_ok(run([*base, "total_steps=600"], tmp_path))
    assert re.search(rf"resumed from .*checkpoint\.pt at step {last1}\b", out2), out2[-3000:]

    text = (savedir / "logs.tsv").read_text()
    assert text.count("\nstep\t") == 0 and text.startswith("step\t")  # the header, once
    header2, rows = read_logs(savedir / "logs.tsv")
    assert header2 == header
    assert _same_rows(rows[: len(rows1)], rows1)  # the first run's rows, kept
    rows2 = rows[len(rows1) :]
    assert rows2, "the resumed run logged nothing"
    steps2 = [r["step"] for r in rows2]
    assert steps2[0] >= last1 and steps2 == sorted(steps2)  # continues, does not restart at 0
    assert steps2[-1] > last1 and steps2[-1] >= 600
    assert rows2[-1]["model_version"] > rows1[-1]["model_version"]

    ckpt2 = load_checkpoint(savedir / "checkpoint.pt")
    assert ckpt2["steps"] == int(steps2[-1])
    assert ckpt2["model_version"] == int(rows2[-1]["model_version"])
    assert history_steps(savedir) == [last1, int(steps2[-1])]
    # A resumed experiment stays one experiment.
    assert load_config(savedir)["group"] == cfg["group"]
    assert load_config(savedir)["total_steps"] == 600


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    def norm(r):
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}

    return [norm(r) for r in a] == [norm(r) for r in b]


# -- scaling=local ---------------------------------------------------------------------------


def common_versions(a: list[dict], b: list[dict]) -> dict[int, tuple[float, float]]:
    """param_sum of both peers at the model versions (> 0) both logged."""
    pa = {int(r["model_version"]): r["param_sum"] for r in a}
    pb = {int(r["model_version"]): r["param_sum"] for r in b}
    return {v: (pa[v], pb[v]) for v in sorted(set(pa) & set(pb)) if v > 0}


@pytest.mark.timeout(600)
def test_local_two_peers_train_one_model(tmp_path):
    savedir = tmp_path / "local"
    out = check_ok(
        run(
            [
                "agent=a2c",
                "env=cartpole",
                "scaling=local",
                "scaling.peers=2",
                "device=cpu",
                # Enough that the peer that starts first cannot finish alone.
                "total_steps=150000",
                "log_interval=1",
                f"savedir={savedir}",
            ],
            tmp_path,
        )
    )
    assert "2 peers" in out
    assert not (savedir / "logs.tsv").exists()  # each peer logs into its own folder
    _, rows0 = read_logs(savedir / "peer0" / "logs.tsv")
    _, rows1 = read_logs(savedir / "peer1" / "logs.tsv")
    assert rows0 and rows1
    assert (savedir / "peer1" / "stdout.log").exists()
    assert "Traceback" not in (savedir / "peer1" / "stdout.log").read_text(errors="replace")

    last0, last1 = rows0[-1], rows1[-1]
    # Both stop after the same update: the same step count, version and parameters.
    assert last0["step"] == last1["step"] >= 150000
    assert last0["model_version"] == last1["model_version"] > 0
    assert last0["param_sum"] == last1["param_sum"]
    # They trained together: both in the group, updates summing gradients of both.
    # (Not necessarily at the final row: the first to finish leaves the group.)
    for rows in (rows0, rows1):
        assert any(r["peers"] == 2 and r["num_gradients"] == 2 for r in rows), rows
    # Identical parameters at every version both logged.
    both = common_versions(rows0, rows1)
    assert both
    assert all(a == b for a, b in both.values()), both

    ckpt = load_checkpoint(savedir / "checkpoint.pt")
    assert ckpt["steps"] == int(last0["step"])
    assert ckpt["model_version"] == int(last0["model_version"])
    assert float(f"{ckpt['param_sum']:.10g}") == last0["param_sum"]  # logs.tsv: 10 digits
    assert history_steps(savedir) == [int(last0["step"])]


@pytest.mark.timeout(600)
def test_ctrl_c_stops_local_run_cleanly(tmp_path):
    savedir = tmp_path / "ctrlc"
    # The only checkpoint is the one written on Ctrl-C.
    r = start_local_training(tmp_path, savedir, "checkpoint_interval=100000")
    try:
        # Every process of the run: the launcher, 2 peers, their EnvPool workers.
        peers, workers, commands = peers_and_workers(r.pid)
        pids = [r.pid, *peers, *workers]
        assert r.pid in session_pids(r.pid)
        assert len(peers) == 2, commands
        assert len(workers) >= 4, commands  # num_actor_cpus=2 per peer
        assert not (savedir / "checkpoint.pt").exists()

        code, out = r.ctrl_c(STOP_TIMEOUT)
        assert code == 130, out[-5000:]  # stopped by Ctrl-C, after its checkpoint
        wait_for(
            lambda: not session_pids(r.pid) and not any(alive(p) for p in pids),
            timeout=30,
            what="every process of the run to exit",
        )
        assert "Traceback" not in out, out[-5000:]
        peer1_log = (savedir / "peer1" / "stdout.log").read_text(errors="replace")
        assert "Traceback" not in peer1_log, peer1_log[-5000:]
    finally:
        r.finish()

    # The leader wrote a checkpoint on the way out, at the step the peers stopped.
    ckpt = load_checkpoint(savedir / "checkpoint.pt")
    _, rows0 = read_logs(savedir / "peer0" / "logs.tsv")
    _, rows1 = read_logs(savedir / "peer1" / "logs.tsv")
    assert ckpt["steps"] > 0
    assert ckpt["steps"] in (int(rows0[-1]["step"]), int(rows1[-1]["step"]))
    # The terminal (peer 0's output) says which peer wrote it, peer 1 too: its own line
    # goes to its file. Which one leads is the group's choice, either may.
    wrote = f"] checkpoint at step {ckpt['steps']}: {savedir / 'checkpoint.pt'}"
    writer = 1 if f"[peer 1{wrote}" in peer1_log else 0
    assert re.search(rf"^\[peer {writer}{re.escape(wrote)}$", out, re.M), out[-5000:]
    assert not list(savedir.glob(".checkpoint.pt.*"))


# -- config composition ----------------------------------------------------------------------


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


def test_every_env_config_composes(tmp_path):
    from moolib.envs import create_env

    # One file for all the Atari games, one for the MinAtar games, one for any gymnasium env.
    assert ENV_FILES == ["atari", "cartpole", "cartpole-novel", "gym", "minatar"]
    for name in (*ENV_FILES, *GAMES, "minatar-seaquest"):
        cfg = cfg_job(tmp_path, f"env={name}")
        resolved = OmegaConf.to_container(OmegaConf.create(cfg), resolve=True)
        named = {"atari": "breakout", "minatar": "minatar-breakout", "gym": "gym:Acrobot-v1"}
        assert resolved["env"]["name"] == named.get(name, name)
        # The composed config passes moolib-run's checks, and its env builds and steps.
        config_lib.validate(OmegaConf.create(cfg))
        options = cfg["env"].get("options") or {}
        env = create_env(resolved["env"]["name"], **options)
        try:
            env.reset()
            env.step(0)
        finally:
            env.close()
    pong = cfg_job(tmp_path, "agent=a2c", "env=pong")
    assert pong["env"]["game"] == "pong" and pong["agent"]["name"] == "a2c"
    # The game is a setting of the one Atari config.
    qbert = cfg_job(tmp_path, "env=atari", "env.game=qbert")
    assert OmegaConf.create(qbert).env.name == "qbert"


# -- override errors -------------------------------------------------------------------------


def run_error(tmp_path: Path, *overrides: str) -> tuple[int, str, Path]:
    savedir = tmp_path / "err"
    r = run_quick(tmp_path, *overrides, f"savedir={savedir}", "total_steps=100")
    return r.returncode, r.stdout + r.stderr, savedir


@pytest.mark.parametrize(
    "overrides, messages",
    [
        (["nosuchkey=1"], ["unknown key nosuchkey", "nearest known key: "]),
        (["agent.nosuch=1"], ["unknown key agent.nosuch", "nearest known key: agent."]),
        (
            ["env=nosuchgame"],
            ["env=nosuchgame: no such env option", "options: ", "breakout", "cartpole"],
        ),
        (["agent=nosuchagent"], ["agent=nosuchagent: no such agent option", "a2c", "vtrace"]),
        (["agent=impala"], ["agent=impala: no such agent option; nearest: vtrace (impala is"]),
        (
            ["agent=apex", "env=cartpole", "scaling.actors=3"],
            ["unknown key scaling.actors in scaling=single: scaling=local and scaling=slurm have"],
        ),
        (
            ["agent=apex", "env=cartpole", "+agent.burn_in=3"],
            [
                "unknown key agent.burn_in ('+agent.burn_in=3' adds it",
                "in agent=apex: agent=r2d2 has",
            ],
        ),
    ],
    ids=[
        "unknown-key",
        "unknown-nested-key",
        "unknown-env",
        "unknown-agent",
        "agent-by-its-paper-name",
        "key-of-another-scaling",
        "added-key-of-another-agent",
    ],
)
def test_hydra_override_errors(tmp_path, overrides, messages):
    code, out, savedir = run_error(tmp_path, *overrides)
    assert code == 2, out
    assert out.startswith("moolib-run: error: ") and out.count("\n") == 1, out
    for m in messages:
        assert m in out, out
    assert "Traceback" not in out, out
    assert not savedir.exists()  # nothing started, nothing made


@pytest.mark.parametrize(
    "savedir, message",
    [
        # As zsh passes it: Hydra's grammar cannot read a value starting with ~.
        ("~/runs/x", "bad override 'savedir=~/runs/x': the shell did not expand ~ here"),
        # Quoted for Hydra: it would have made a folder named '~' in the current directory.
        ("'~/runs/x'", "savedir=~/runs/x: a path starting with ~ is not expanded here"),
    ],
    ids=["bare", "quoted"],
)
def test_a_savedir_starting_with_tilde_is_refused(tmp_path, savedir, message):
    r = run_quick(tmp_path, "agent=a2c", "env=cartpole", f"savedir={savedir}", "total_steps=100")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert message in out and "write savedir=$HOME/runs/x" in out, out
    assert "Traceback" not in out, out
    assert not (tmp_path / "~").exists()


@pytest.mark.timeout(300)
def test_a_process_count_the_agent_does_not_read_is_noted(tmp_path):
    # scaling.actors is for the off-policy agents: a2c runs scaling.peers peers.
    savedir = tmp_path / "noted"
    args = ["agent=a2c", "env=cartpole", "device=cpu", "scaling=local", "scaling.actors=3"]
    out = check_ok(run([*args, "total_steps=2000", f"savedir={savedir}"], tmp_path))
    assert (
        "moolib-run: note: scaling.actors is not used by agent=a2c, which runs "
        "scaling.peers=2 peers (scaling.actors is for apex and r2d2)"
    ) in out, out[-3000:]
    assert "2 peers" in out
    assert (savedir / "peer1" / "logs.tsv").exists()


@pytest.mark.parametrize(
    "overrides, messages",
    [
        (["agent.batch_size=-1"], ["agent.batch_size must be a positive integer", "-1"]),
        (["agent.batch_size=abc"], ["agent.batch_size must be a positive integer"]),
        (["agent.unroll_length=2e1"], ["agent.unroll_length must be a positive", "(write 20: "]),
        (["agent.discounting=1.5"], ["agent.discounting must be a number in [0.0, 1.0]"]),
        (["agent.optimizer.name=sgd"], ["agent.optimizer.name", "adam", "rmsprop", "'sgd'"]),
        (["env.backend=foo"], ["env.backend", "gymnasium", "envpool", "'foo'"]),
        (
            ["agent.actor_batch_size=4", "agent.num_actor_cpus=8"],
            ["agent.num_actor_cpus (8) must not exceed agent.actor_batch_size (4)"],
        ),
        (["scaling=local", "scaling.peers=0"], ["scaling.peers must be a positive integer"]),
        (["scaling.peers=3"], ["scaling.peers=3 with scaling=single, which runs one peer"]),
        (["device=tpu"], ["device must be auto, cpu, cuda or cuda:N", "'tpu'"]),
        (["seed=abc"], ["seed must be null or an integer >= 0, got 'abc'"]),
        (["name=[1,2]"], ["name must be a non-empty string, got [1, 2]"]),
        (["wandb.enabled=maybe"], ["wandb.enabled must be true or false, got 'maybe'"]),
        (["group_timeout=0"], ["group_timeout must be a number in [0.1, 1000000.0]", "0"]),
        (["torch_threads=0"], ["torch_threads must be auto or a positive integer", "0"]),
        (["env=cartpole", "env.backend=envpool"], ["env.backend=envpool", "cartpole"]),
        (["env.name=nosuchgame"], ["env.name 'nosuchgame' is not a known environment"]),
        # Atari's Breakout with MinAtar's options, were env.name taken as given.
        (
            ["env=minatar", "env.name=breakout"],
            ["env.name=breakout: env.name follows env.game (here it is minatar-breakout)"],
        ),
        (
            ["env.options.full_action_space=maybe"],
            ["env.options.full_action_space='maybe'", "must be true or false, got 'maybe'"],
        ),
    ],
    ids=[
        "negative-batch-size",
        "string-batch-size",
        "exponent-int",
        "discounting",
        "optimizer",
        "backend",
        "actor-cpus",
        "peers",
        "single-peers",
        "device",
        "seed",
        "name",
        "wandb-enabled",
        "group-timeout",
        "torch-threads",
        "envpool-cartpole",
        "env-name",
        "minatar-env-name",
        "env-flag",
    ],
)
def test_bad_values_exit_2_naming_the_key(tmp_path, overrides, messages):
    code, out, savedir = run_error(tmp_path, *overrides)
    assert code == 2, out
    assert "moolib-run: error: " in out, out
    for m in messages:
        assert m in out, out
    assert "Traceback" not in out, out
    assert not savedir.exists()  # nothing started, nothing made


def run_without(cwd: Path, packages: tuple[str, ...], *args: str) -> subprocess.CompletedProcess:
    """moolib-run with ``args``, in a Python where ``packages`` cannot be imported (as
    when they are not installed)."""
    launcher = (
        f"import runpy, sys; sys.modules.update(dict.fromkeys({packages!r})); "
        "sys.argv[0] = 'moolib-run'; runpy.run_module('moolib.launch.run', run_name='__main__')"
    )
    return subprocess.run(
        [sys.executable, "-c", launcher, *args],
        cwd=cwd,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "missing, overrides, message",
    [
        (
            "minatar",
            ["env=minatar-breakout"],
            "env=minatar-breakout: the minatar package (for MinAtar's games) is not installed: "
            'pip install "moolib[minatar]"',
        ),
        (
            "wandb",
            ["env=cartpole", "wandb.enabled=true"],
            "the wandb package (for wandb.enabled=true) is not installed: "
            'pip install "moolib[wandb]"',
        ),
    ],
    ids=["minatar", "wandb"],
)
def test_a_missing_extra_exits_2_naming_it(tmp_path, missing, overrides, message):
    # The launcher itself, in a Python where the extra's package cannot be imported
    # (as when it is not installed): pip's extras keep the default install light.
    savedir = tmp_path / "err"
    r = run_without(tmp_path, (missing,), "agent=a2c", *overrides, f"savedir={savedir}")
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    assert f"moolib-run: error: {message}" in out, out
    assert "Traceback" not in out, out
    assert not savedir.exists()


# The packages of the extras (and the test extra's), which the README's install lacks.
EXTRA_PACKAGES = ("minatar", "pandas", "scipy", "seaborn", "wandb", "envpool", "pytest")


def test_the_readme_run_needs_no_extra(tmp_path):
    # The README's CartPole run, in a Python where no extra's package can be imported
    # (as after the README's `pip install -e .`): it trains, checkpoints and exits 0.
    savedir = tmp_path / "cartpole"
    args = ["agent=a2c", "env=cartpole", "total_steps=3000", f"savedir={savedir}"]
    r = run_without(tmp_path, EXTRA_PACKAGES, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "moolib-run: done: " in out, out
    assert (savedir / "checkpoint.pt").is_file(), out


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(tmp_path):
    code, out, savedir = run_error(tmp_path, "device=cuda")
    assert code == 2, out
    assert "moolib-run: error: device=cuda" in out and "CUDA is not available" in out, out
    assert not (savedir / "config.yaml").exists()


# -- sweeps ----------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_multirun_sweep_gives_each_point_its_savedir_and_group(tmp_path):
    savedir = tmp_path / "sweep"
    out = check_ok(
        run(
            [
                "-m",
                "agent=a2c",
                "env=cartpole",
                "device=cpu",
                "total_steps=2000",
                "log_interval=1",
                "agent.optimizer.learning_rate=1e-3,2e-3",
                f"savedir={savedir}",
            ],
            tmp_path,
        )
    )
    assert "Launching 2 jobs" in out
    groups = set()
    for k, lr in [(0, 1e-3), (1, 2e-3)]:
        point = savedir / str(k)
        cfg = load_config(point)
        assert cfg["agent"]["optimizer"]["learning_rate"] == lr
        assert cfg["savedir"] == str(point)
        groups.add(cfg["group"])
        _, rows = read_logs(point / "logs.tsv")
        assert rows and rows[-1]["step"] >= 2000
        assert (point / "checkpoint.pt").exists()
    assert len(groups) == 2
    assert not (savedir / "logs.tsv").exists() and not (savedir / "checkpoint.pt").exists()


# -- wandb -----------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_wandb_offline_run_and_resume_keep_the_run_id(tmp_path):
    savedir = tmp_path / "wb"
    base = [
        "agent=a2c",
        "env=cartpole",
        "device=cpu",
        "log_interval=1",
        "wandb.enabled=true",
        f"savedir={savedir}",
    ]
    check_ok(run([*base, "total_steps=2000"], tmp_path))
    runs1 = sorted((savedir / "wandb").glob("offline-run-*"))
    assert len(runs1) == 1, list((savedir / "wandb").iterdir())
    run_id = runs1[0].name.rsplit("-", 1)[1]
    assert load_checkpoint(savedir / "checkpoint.pt")["wandb_ids"] == {"0": run_id}
    # Project, group (the experiment's) and run name reach wandb.
    group = load_config(savedir)["group"]
    record = (runs1[0] / f"run-{run_id}.wandb").read_bytes()
    assert group.encode() in record
    assert b"a2c-cartpole-peer0" in record

    out = check_ok(run([*base, "total_steps=4000"], tmp_path))
    assert "resumed from" in out
    runs2 = sorted((savedir / "wandb").glob("offline-run-*"))
    assert len(runs2) == 2
    assert {r.name.rsplit("-", 1)[1] for r in runs2} == {run_id}  # the same run, continued
    assert load_checkpoint(savedir / "checkpoint.pt")["wandb_ids"] == {"0": run_id}


# -- moolib-plot ------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_plot_draws_a_real_runs_logs(tmp_path):
    savedir = tmp_path / "plotted"
    check_ok(
        run(
            [
                "agent=a2c",
                "env=cartpole",
                "device=cpu",
                "total_steps=4000",
                "log_interval=1",
                f"savedir={savedir}",
            ],
            tmp_path,
        )
    )
    _, rows = read_logs(savedir / "logs.tsv")
    points = sum(1 for r in rows if not math.isnan(r["mean_episode_return"]))
    assert points >= 1

    def plot(*args):
        r = subprocess.run(
            plot_cmd(*args),
            cwd=tmp_path,
            env=run_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    out = plot(str(savedir / "logs.tsv"), "--width", "60", "--height", "12")
    png = savedir / "mean_episode_return.png"
    assert f"Saved {png}" in out
    assert f"plotted: {points} point{'s' if points != 1 else ''}, last mean_episode_return" in out
    assert "┌" in out  # the terminal plot
    check_png(png)

    loss_png = tmp_path / "loss.png"
    out = plot(str(savedir), "--metric", "total_loss", "--png", str(loss_png), "--no-terminal")
    assert out.strip() == f"Saved {loss_png}"
    check_png(loss_png)


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
