"""What ``moolib-run`` refuses: a bad override, value, key or input is one
``moolib-run: error:`` line that names it, exit 2, before anything starts or is written (no
savedir, no outputs/ folder). Unknown keys name the nearest known one; a missing extra
names its pip install; a network that cannot take the env's observations,
``scaling=slurm`` without SLURM, ``device=cuda`` without CUDA and an interval of zero are
config errors too.

Every check runs the real launcher (``python -m moolib.launch.run``) as a subprocess;
none trains.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.run_util import one_error_line, run, run_cmd, run_env, run_quick, run_without


def run_error(tmp_path: Path, *overrides: str) -> tuple[int, str, Path]:
    savedir = tmp_path / "err"
    r = run_quick(tmp_path, *overrides, f"savedir={savedir}", "total_steps=100")
    return r.returncode, r.stdout + r.stderr, savedir


def left_behind(cwd: Path) -> list[str]:
    """What a run left in its working directory (the test's own output log aside)."""
    return [p.name for p in cwd.iterdir() if not p.name.startswith("moolib-run-")]


# -- overrides Hydra cannot take, and keys nobody has --------------------------------------


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


@pytest.mark.parametrize(
    "override, unknown, nearest",
    [
        ("+agent.lr=1", "agent.lr", "agent.optimizer.learning_rate"),
        ("agent.lr=1", "agent.lr", "agent.optimizer.learning_rate"),
        ("++total_step=5", "total_step", "total_steps"),
        (
            "agent.optimizer.learning_rat=1",
            "agent.optimizer.learning_rat",
            "agent.optimizer.learning_rate",
        ),
        (
            "+env.options.repeat_action_prob=0",
            "env.options.repeat_action_prob",
            "env.options.repeat_action_probability",
        ),
    ],
    ids=["plus-lr", "lr", "force-add", "typo", "env-option"],
)
def test_unknown_keys_are_refused_naming_the_nearest(tmp_path, override, unknown, nearest):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = "env=breakout" if "env.options" in override else "env=cartpole"
    line = one_error_line(run(["agent=a2c", env, "total_steps=100", override], cwd, timeout=120))
    assert f"unknown key {unknown}" in line and f"nearest known key: {nearest}" in line, line
    assert not left_behind(cwd)  # no outputs/ folder


def test_unknown_env_option_under_a_free_map_is_refused_by_the_env(tmp_path):
    """``env.options`` is handed to the env as it is: the env names what it does not take."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    line = one_error_line(
        run(["agent=a2c", "env=cartpole", "+env.options.frobnicate=1"], cwd, timeout=120)
    )
    assert "unknown key env.options.frobnicate" in line and "env.options.seed" in line, line
    assert not left_behind(cwd)


# -- bad values ----------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "overrides",
    [
        ["log_interval=0"],
        ["log_interval=0.0"],
        ["-m", "log_interval=5,0"],
        ["checkpoint_interval=0"],
    ],
    ids=["zero", "zero-float", "sweep", "checkpoint-zero"],
)
def test_an_interval_of_zero_is_refused(tmp_path, overrides):
    """log_interval=0 logged every update (52,838 lines in 40 s), and checkpoint_interval=0
    wrote a checkpoint at every step: refused as the other bad values are."""
    result = run_quick(tmp_path, *overrides, "agent=a2c", "env=cartpole", "total_steps=100")
    line = one_error_line(result)
    key = overrides[-1].split("=")[0]
    assert f"{key} must be a number of seconds > 0, got 0" in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, names",
    [
        (
            ["agent=a2c", "env=cartpole", "agent.network=impala_deep"],
            ["agent.network=impala_deep", "env=cartpole", "shape (4,)", "image observations"],
        ),
        (
            ["agent=a2c", "env=cartpole", "agent.network=minatar"],
            ["agent.network=minatar", "env=cartpole", "shape (4,)", "(mlp here)"],
        ),
        (
            ["agent=apex", "env=cartpole", "agent.network=impala_shallow"],
            ["agent.network=impala_shallow", "env=cartpole", "shape (4,)"],
        ),
        # Images, but too small for the shallow network's strided convolutions.
        (
            ["agent=vtrace", "env=minatar-breakout", "agent.network=impala_shallow"],
            ["agent.network=impala_shallow", "env=minatar-breakout", "shape (4, 10, 10)", "20x20"],
        ),
        # Every point of a sweep is checked before the first starts.
        (
            ["-m", "agent=a2c", "env=cartpole", "agent.network=mlp,impala_deep"],
            ["agent.network=impala_deep", "env=cartpole", "shape (4,)"],
        ),
    ],
    ids=[
        "impala-cartpole",
        "minatar-cartpole",
        "apex-shallow-cartpole",
        "shallow-minatar",
        "sweep",
    ],
)
def test_a_network_that_cannot_take_the_observations_is_a_config_error(tmp_path, overrides, names):
    line = one_error_line(run_quick(tmp_path, *overrides, "device=cpu", "total_steps=100"))
    for name in names:
        assert name in line, line
    assert list(tmp_path.iterdir()) == []  # no outputs/ or multirun/ folder


# -- what this machine or Python lacks -----------------------------------------------------


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
        (
            "tensorboard",
            ["env=cartpole", "tensorboard.enabled=true"],
            "the tensorboard package (for tensorboard.enabled=true) is not installed: "
            'pip install "moolib[tensorboard]"',
        ),
    ],
    ids=["minatar", "wandb", "tensorboard"],
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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda(tmp_path):
    code, out, savedir = run_error(tmp_path, "device=cuda")
    assert code == 2, out
    assert "moolib-run: error: device=cuda" in out and "CUDA is not available" in out, out
    assert not (savedir / "config.yaml").exists()


def slurm_run_refusal(cwd: Path, env: dict[str, str]) -> str:
    """The one error line of a scaling=slurm run refused in ``cwd``, which it left empty."""
    result = subprocess.run(
        run_cmd("agent=a2c", "env=cartpole", "scaling=slurm", "total_steps=100"),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    line = one_error_line(result)
    assert list(cwd.iterdir()) == [], line  # no outputs/ folder, nothing to resume
    return line


def test_scaling_slurm_without_slurm_is_refused_before_anything_is_written(tmp_path):
    """It used to fail in submitit (``Could not detect "srun"``, exit 1) after the savedir
    was made, which the next run, without scaling=slurm, then resumed and failed alike."""
    # This interpreter's folder only: no srun or sbatch, even where a test cluster runs.
    line = slurm_run_refusal(tmp_path, run_env({"PATH": str(Path(sys.executable).parent)}))
    assert "scaling=slurm: no SLURM on this machine" in line, line
    assert "sbatch and srun not found on PATH" in line, line


def test_scaling_slurm_whose_controller_does_not_answer_is_refused_before_anything_is_written(
    tmp_path,
):
    """SLURM's client commands installed, but no cluster configured (as on this machine
    once scripts/slurm-test-cluster.sh has installed them): sbatch used to fail after the
    savedir was made."""
    if not all(shutil.which(c) for c in ("sbatch", "srun", "sinfo")):
        pytest.skip("SLURM's commands are not installed (scripts/slurm-test-cluster.sh start)")
    (tmp_path / "run").mkdir()
    conf = tmp_path / "slurm.conf"
    conf.touch()  # a cluster configured nowhere: sinfo fails at once
    line = slurm_run_refusal(tmp_path / "run", run_env({"SLURM_CONF": str(conf)}))
    assert "scaling=slurm: SLURM does not answer on this machine (sinfo: " in line, line
    assert "Unable to process configuration file" in line, line


# -- every failure a user can cause is one line, exit 2 ------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "case",
    [
        "savedir-is-a-file",
        "savedir-under-a-file",
        "savedir-unwritable",
        "savedir-config-unreadable",
        "env-option",
        "env-name",
        "broker",
        "broker-not-host-port",
        "hydra-group-option",
        "hydra-gymnasium-id",
        "hydra-syntax",
        "hydra-sweep-without-m",
    ],
)
def test_user_errors_are_one_line_exit_2_and_leave_nothing(tmp_path, case):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    broken = tmp_path / "broken"
    if case == "savedir-config-unreadable":
        broken.mkdir()
        (broken / "config.yaml").write_text("agent: [unclosed\n")
    args, names = {
        "savedir-is-a-file": ([f"savedir={a_file}"], [f"savedir={a_file}", "not a directory"]),
        "savedir-under-a-file": ([f"savedir={a_file}/run"], [f"savedir={a_file}/run", str(a_file)]),
        # Not writable even for root: nothing can be made in /proc.
        "savedir-unwritable": (
            ["savedir=/proc/moolib-run-test"],
            ["savedir=/proc/moolib-run-test"],
        ),
        # YAML's error spans lines; the message is still one.
        "savedir-config-unreadable": (
            [f"savedir={broken}"],
            [f"{broken}/config.yaml cannot be read", "expected ',' or ']'"],
        ),
        "env-option": (
            ["env=breakout", "env.options.repeat_action_probability=2"],
            ["env.options.repeat_action_probability=2", "[0, 1]"],
        ),
        "env-name": (["env.name=nosuchgame"], ["env.name", "nosuchgame"]),
        "broker": (
            [f"broker=127.0.0.1:{_closed_port()}", "group_timeout=1"],
            ["broker=127.0.0.1:", "no broker answered"],
        ),
        # Refused at once, not after group_timeout.
        "broker-not-host-port": (["broker=localhost"], ["broker=localhost", "expected host:port"]),
        "hydra-group-option": (["env=cartpol"], ["env=cartpol", "cartpole"]),
        # Hydra reads the slash as a group env/ALE; the user meant gymnasium's id.
        "hydra-gymnasium-id": (
            ["env=ALE/SpaceInvaders-v5"],
            ["env=ALE/SpaceInvaders-v5", "is env=space_invaders here"],
        ),
        "hydra-syntax": (["agent.batch_size=[1"], ["agent.batch_size=[1"]),
        "hydra-sweep-without-m": (["total_steps=1,2"], ["total_steps=1,2"]),
    }[case]
    overrides = ["agent=a2c", "env=cartpole", "total_steps=100", *args]
    result = run(overrides, cwd, timeout=120)
    line = one_error_line(result)
    for name in names:
        assert name in line, line
    # Nothing left behind: no outputs/ (or any) folder, no savedir made.
    assert not left_behind(cwd)
    made = ["broken"] if broken.exists() else []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", *made, "cwd"]
    if made:
        assert [p.name for p in broken.iterdir()] == ["config.yaml"]
