"""``moolib-run`` as researchers live with it: resuming a savedir with its own
settings, finished runs, unknown keys, one-line errors, one run per savedir,
Ctrl-C.

Every check runs the real ``moolib-run`` (``python -m moolib.launch.run``) in
its own session, with short A2C/CartPole runs; a savedir trained once is
reused across the checks of a test.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from helpers.run_util import (
    QUICK,
    STOP_TIMEOUT,
    Run,
    alive,
    check_ok,
    read_logs,
    run,
    session_pids,
    snapshot,
    wait_for,
)
from moolib.launch import plot, savedir_lock


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The run stopped with exit 2 and said why in one ``moolib-run: error:`` line."""
    out = result.stdout
    assert result.returncode == 2, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moolib-run: error: "), out[-5000:]
    return lines[0]


def training_files(folder: Path) -> dict[str, str]:
    """``snapshot`` without what Hydra rewrites on every launch (.hydra/, run.log and a
    sweep's multirun.yaml): the run's own config, logs and checkpoints."""
    hydra_files = (".hydra/", "run.log", "multirun.yaml")
    return {k: v for k, v in snapshot(folder).items() if not any(h in f"/{k}" for h in hydra_files)}


def left_behind(cwd: Path) -> list[str]:
    """What a run left in its working directory (the test's own output log aside)."""
    return [p.name for p in cwd.iterdir() if not p.name.startswith("moolib-run-")]


def checkpoint_steps(savedir: Path) -> int:
    return int(
        torch.load(savedir / "checkpoint.pt", map_location="cpu", weights_only=False)["steps"]
    )


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text())


# -- 1, 2: a savedir owns its config; a finished run says so ---------------------------------


@pytest.mark.timeout(300)
def test_a_name_with_a_slash_makes_one_default_savedir(tmp_path):
    # A gym id's namespace (env.id=ALE/Pong-v5) puts a / in the run's name as well.
    check_ok(run([*QUICK, "total_steps=500", "name=team/pong"], tmp_path))
    made = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(made) == 1 and made[0].name.endswith("-team-pong"), made
    assert (made[0] / "config.yaml").is_file() and (made[0] / "logs.tsv").is_file()
    assert load_yaml(made[0] / "config.yaml")["name"] == "team/pong"


@pytest.mark.timeout(600)
def test_savedir_resumes_with_its_own_config(tmp_path):
    savedir = tmp_path / "run"
    # hidden_size differs from the a2c/cartpole tuning, so defaults cannot pass for it.
    check_ok(
        run([*QUICK, "agent.hidden_size=32", "total_steps=2000", f"savedir={savedir}"], tmp_path)
    )
    first = load_yaml(savedir / "config.yaml")
    _, rows = read_logs(savedir / "logs.tsv")
    step = checkpoint_steps(savedir)
    assert step >= 2000

    # Finished: says so and how to go on; exit 0; nothing written.
    before = snapshot(savedir)
    out = check_ok(run([f"savedir={savedir}"], tmp_path))
    assert f"{savedir} has finished" in out and "total_steps=2000" in out, out
    assert "raise total_steps" in out and f"moolib-run savedir={savedir} total_steps=" in out
    assert snapshot(savedir) == before

    # Overrides that the checkpoint cannot take: one line naming the savedir, what it
    # holds and what was asked; exit 2; the savedir untouched.
    for asked, holds in [
        ("agent=vtrace", "holds a2c on cartpole"),
        ("agent.hidden_size=64", "agent.hidden_size=32"),
    ]:
        line = one_error_line(run([f"savedir={savedir}", asked, "total_steps=9000"], tmp_path))
        assert str(savedir) in line and holds in line and asked.split("=")[0] in line, line
        assert snapshot(savedir) == before, asked
    line = one_error_line(run([f"savedir={savedir}", "+agent.lr=1"], tmp_path))
    assert "unknown key agent.lr" in line and "agent.optimizer.learning_rate" in line, line
    assert snapshot(savedir) == before

    # --cfg job shows what a resume would train with.
    shown = yaml.safe_load(check_ok(run([f"savedir={savedir}", "--cfg", "job"], tmp_path)))
    assert shown["agent"]["name"] == "a2c" and shown["agent"]["hidden_size"] == 32
    assert shown["env"]["name"] == "cartpole" and shown["total_steps"] == 2000

    # A resume with an override: the saved settings plus that override, listed and logged.
    out = check_ok(run([f"savedir={savedir}", "total_steps=4000"], tmp_path))
    assert f"moolib-run: resuming {savedir}" in out and "total_steps=4000 (was 2000)" in out, out
    assert f"at step {step}" in out, out
    cfg = load_yaml(savedir / "config.yaml")
    assert cfg["agent"] == first["agent"] and cfg["env"] == first["env"]
    assert cfg["group"] == first["group"] and cfg["total_steps"] == 4000
    resumes = load_yaml(savedir / "resumes.yaml")
    assert len(resumes) == 1 and resumes[0]["step"] == step
    assert resumes[0]["overrides"] == ["total_steps=4000"]
    assert resumes[0]["changed"] == {"total_steps": {"from": 2000, "to": 4000}}
    _, rows2 = read_logs(savedir / "logs.tsv")
    assert len(rows2) > len(rows) and rows2[len(rows)]["step"] >= step
    assert checkpoint_steps(savedir) >= 4000

    # Another scaling mode resumes the same experiment: its peers read the savedir's config.
    # A key only the new mode has (scaling.actors: scaling=single lacks it) may be set
    # too, before or after the choice.
    out = check_ok(
        run(
            [
                f"savedir={savedir}",
                "scaling.actors=3",
                "scaling=local",
                "scaling.peers=2",
                "total_steps=6000",
            ],
            tmp_path,
        )
    )
    cfg = load_yaml(savedir / "config.yaml")
    assert cfg["agent"] == first["agent"] and cfg["scaling"] == {
        "name": "local",
        "peers": 2,
        "actors": 3,
        "peer_prefix": "",
    }
    assert read_logs(savedir / "peer0" / "logs.tsv")[1]
    assert checkpoint_steps(savedir) >= 6000
    resumes = load_yaml(savedir / "resumes.yaml")
    assert [r["changed"].get("total_steps", {}).get("to") for r in resumes] == [4000, 6000]
    assert resumes[1]["changed"]["scaling"]["from"] == {"name": "single", "peers": 1}
    # The new mode's keys came with it: they are not settings new since the run started.
    assert "scaling.actors" not in resumes[1].get("added", {}), resumes[1]
    # The first run's settings are still there to read.
    assert resumes[0]["changed"]["total_steps"]["from"] == first["total_steps"]


@pytest.mark.timeout(600)
def test_sweep_points_resume_with_their_own_config(tmp_path):
    sweep = tmp_path / "sweep"
    lrs = "agent.optimizer.learning_rate=1e-3,3e-3"
    check_ok(
        run(
            ["-m", *QUICK, "agent.hidden_size=32", "total_steps=1000", lrs, f"savedir={sweep}"],
            tmp_path,
        )
    )
    first_steps = checkpoint_steps(sweep / "1")
    # Every point resumes its own a2c/cartpole config (not the default vtrace/breakout);
    # point 1 with a new learning rate.
    lrs = "agent.optimizer.learning_rate=1e-3,5e-3"
    out = check_ok(run(["-m", f"savedir={sweep}", lrs, "total_steps=2000"], tmp_path))
    for k, lr in [(0, 1e-3), (1, 5e-3)]:
        point = sweep / str(k)
        assert f"resuming {point}" in out, out
        cfg = load_yaml(point / "config.yaml")
        assert cfg["agent"]["name"] == "a2c" and cfg["agent"]["hidden_size"] == 32
        assert cfg["agent"]["optimizer"]["learning_rate"] == lr and cfg["total_steps"] == 2000
        assert checkpoint_steps(point) >= 2000
    # moolib-plot names both rates of point 1, and the step where the new one took over.
    labels = [r.label for r in plot.find_runs(sweep).runs]
    assert labels == [
        "learning_rate=0.001",
        f"learning_rate=0.003 (0.005 from step {first_steps:,})",
    ], labels
    # Finished points say so and are left alone.
    before = training_files(sweep)
    out = check_ok(run(["-m", f"savedir={sweep}", lrs], tmp_path))
    assert out.count("has finished") == 2, out
    assert training_files(sweep) == before
    # A point's folder is resumed as a run of its own; the sweep's folder is not a run.
    line = one_error_line(run([f"savedir={sweep}"], tmp_path))
    assert "sweep" in line and f"savedir={sweep / '0'}" in line, line


# -- 4: unknown keys ---------------------------------------------------------------------------


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


# -- 5: every failure a user can cause is one line, exit 2 ------------------------------------


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


# -- 5: Ctrl-C ---------------------------------------------------------------------------------


def _training(logs: Path):
    def check():
        _, rows = read_logs(logs)
        return any(row["model_version"] > 0 for row in rows)

    return check


@pytest.mark.timeout(600)
def test_a_second_run_in_a_busy_savedir_is_refused_and_ctrl_c_exits_130(tmp_path):
    savedir = tmp_path / "stopped"
    args = [*QUICK, "total_steps=100000000", "checkpoint_interval=100000", f"savedir={savedir}"]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        wait_for(_training(savedir / "logs.tsv"), timeout=240, what="training", proc=r)
        assert not (savedir / "checkpoint.pt").exists()
        # A second run in the same savedir (the same command in another terminal)
        # is refused while this one trains, naming it, and writes nothing there.
        config = (savedir / "config.yaml").read_text()
        for extra in ([], ["scaling=local"]):
            line = one_error_line(run([*args, *extra], tmp_path))
            assert f"savedir={savedir} is in use: moolib-run (pid {r.pid} on host " in line
            assert (savedir / "config.yaml").read_text() == config
        code, out = r.ctrl_c(STOP_TIMEOUT)
    finally:
        r.finish()
    assert code == 130, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    _, rows = read_logs(savedir / "logs.tsv")
    assert checkpoint_steps(savedir) == int(rows[-1]["step"]) > 0
    # Its end frees the savedir: resuming it may start.
    savedir_lock.check_free(savedir)


@pytest.mark.timeout(600)
def test_second_ctrl_c_stops_every_peer_at_once_without_traceback(tmp_path):
    import time

    savedir = tmp_path / "twice"
    args = [
        *QUICK,
        "scaling=local",
        "scaling.peers=2",
        "total_steps=100000000",
        f"savedir={savedir}",
    ]
    r = Run(args, tmp_path, tmp_path / "out.log")
    try:
        wait_for(_training(savedir / "peer0" / "logs.tsv"), timeout=240, what="training", proc=r)
        pids = session_pids(r.pid)
        r.interrupt()
        time.sleep(0.2)
        code, out = r.ctrl_c(STOP_TIMEOUT)
        wait_for(
            lambda: not session_pids(r.pid) and not any(alive(p) for p in pids),
            timeout=30,
            what="every process of the run to exit",
        )
    finally:
        r.finish()
    assert code == 130, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    peer1 = (savedir / "peer1" / "stdout.log").read_text(errors="replace")
    assert "Traceback" not in peer1, peer1[-5000:]
