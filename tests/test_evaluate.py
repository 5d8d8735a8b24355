"""Evaluating a run: ``moolib-eval`` on a finished or a running run's savedir (the mean
and spread of seeded episodes, greedy or sampled, videos of them), moolib-run's
``eval_interval`` columns, and the agents' policies that both play through
(docs/toolkit.md, "moolib-eval")."""

from __future__ import annotations

import fcntl
import math
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers.run_util import (
    QUICK,
    RUN_TIMEOUT,
    Run,
    check_ok,
    checkpoint_steps,
    eval_cmd,
    one_error_line,
    read_logs,
    run,
    run_env,
    run_without,
    wait_for,
)
from moolib.agents.acting import ActionChoice
from moolib.agents.offpolicy_run import evaluate
from moolib.agents.registry import get_agent
from moolib.agents.runtime import evaluation
from moolib.agents.runtime.evaluation import EvalError, evaluate_savedir
from moolib.agents.runtime.logger import EVAL_COLUMNS
from moolib.launch import config as config_lib

RETURN = re.compile(r"return +mean (\S+), std (\S+), min (\S+), max (\S+)")
LENGTH = re.compile(r"length +mean (\S+) steps")


@pytest.fixture(scope="module")
def a2c_run(tmp_path_factory) -> Path:
    """A finished A2C CartPole run of 3,000 steps, evaluated once, at its end, by
    moolib-run itself (eval_interval)."""
    root = tmp_path_factory.mktemp("eval")
    savedir = root / "a2c"
    args = [*QUICK, "total_steps=3000", "seed=0", "eval_interval=3000", "eval_episodes=3"]
    check_ok(run([*args, f"savedir={savedir}"], root))
    return savedir


def moolib_eval(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        eval_cmd(*args),
        cwd=cwd,
        env=run_env(env),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


def evaluated(cwd: Path, *args: str, env: dict | None = None) -> dict:
    """moolib-eval ARGS, which must succeed: what it printed, and its numbers."""
    r = moolib_eval(cwd, *args, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    ret, length = RETURN.search(r.stdout), LENGTH.search(r.stdout)
    assert ret and length, r.stdout
    mean, std, low, high = map(float, ret.groups())
    return {
        "out": r.stdout,
        "mean": mean,
        "std": std,
        "min": low,
        "max": high,
        "length": float(length.group(1)),
    }


def test_eval_interval_logs_an_evaluation_in_its_own_columns(a2c_run):
    header, rows = read_logs(a2c_run / "logs.tsv")
    assert set(EVAL_COLUMNS) <= set(header)
    done = [r for r in rows if not math.isnan(r["eval_step"])]
    # eval_interval=3000 of 3,000 steps: one evaluation, of the weights at the end.
    assert len(done) == 1, rows
    row = done[0]
    steps = checkpoint_steps(a2c_run)
    assert row["eval_step"] == row["step"] == steps
    # The final checkpoint holds those weights: played again, the same seeded episodes.
    returns = evaluate(a2c_run, episodes=3, seed=0)
    assert row["eval_mean_episode_return"] == pytest.approx(statistics.fmean(returns))
    assert row["eval_episode_return_std"] == pytest.approx(statistics.pstdev(returns))
    # CartPole pays 1 a step.
    assert row["eval_mean_episode_length"] == row["eval_mean_episode_return"]


def test_moolib_eval_prints_the_mean_and_spread_of_seeded_episodes(a2c_run, monkeypatch):
    args = (f"savedir={a2c_run}", "episodes=5", "seed=3")
    first = evaluated(a2c_run.parent, *args)
    steps = checkpoint_steps(a2c_run)
    assert f"a2c on cartpole, the checkpoint at step {steps:,}" in first["out"]
    assert "5, greedy, seeds 3-7, on the CPU" in first["out"]
    # Played again, in this process, the same episodes: and others from other seeds.
    returns = evaluate(a2c_run, episodes=5, seed=3)
    assert evaluate(a2c_run, episodes=5, seed=4)[:4] == returns[1:]
    monkeypatch.setattr(evaluation, "MAX_BATCH", 2)
    assert evaluate(a2c_run, episodes=5, seed=3) == returns  # as batches of 2 envs
    assert first["mean"] == pytest.approx(statistics.fmean(returns), abs=0.005)
    assert first["std"] == pytest.approx(statistics.pstdev(returns), abs=0.005)
    assert (first["min"], first["max"]) == (min(returns), max(returns))
    assert first["length"] == first["mean"]
    assert 8 <= first["min"] <= first["max"] <= 500  # CartPole's shortest and longest


def test_sampled_actions_are_seeded_and_not_the_greedy_ones(a2c_run):
    args = (f"savedir={a2c_run}", "episodes=5", "policy=sampled")
    sampled = evaluated(a2c_run.parent, *args)
    assert "sampled from its policy" in sampled["out"]
    # evaluate() samples with any epsilon > 0; seeded alike, it plays the same episodes.
    returns = evaluate(a2c_run, episodes=5, epsilon=0.5)
    assert sampled["mean"] == pytest.approx(statistics.fmean(returns), abs=0.005)
    greedy = evaluate(a2c_run, episodes=5)
    assert sorted(greedy) != sorted(returns)


def decoded_frames(path: Path) -> list[np.ndarray]:
    import imageio_ffmpeg

    frames = imageio_ffmpeg.read_frames(str(path))
    meta = next(frames)
    width, height = meta["size"]
    return [np.frombuffer(f, dtype=np.uint8).reshape(height, width, 3) for f in frames]


def test_video_writes_an_mp4_of_each_episode_beside_the_run(a2c_run, monkeypatch):
    out = evaluated(a2c_run.parent, f"savedir={a2c_run}", "episodes=2", "seed=4", "video=true")
    folder = a2c_run / "videos" / f"step{checkpoint_steps(a2c_run)}-greedy-seed4"
    assert f"videos    {folder} (2 MP4s" in out["out"]
    videos = sorted(folder.iterdir())
    assert [p.name for p in videos] == ["episode-0.mp4", "episode-1.mp4"]
    _, played = evaluate_savedir(a2c_run, 2, ActionChoice(), seed=4)
    frames = [decoded_frames(p) for p in videos]
    # A frame after the reset and one after every step.
    assert [len(f) for f in frames] == [n + 1 for n in played.lengths]
    first = frames[0][0]
    assert first.shape == (400, 600, 3)
    # CartPole: a white background, a black cart, and the pole moves.
    assert (first > 230).all(axis=-1).mean() > 0.8
    assert (first < 40).all(axis=-1).sum() > 500
    assert np.abs(frames[0][-1].astype(int) - first).mean() > 0.01
    # The episode's own start: CartPole reset with seed 4, drawn here.
    import gymnasium

    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    env = gymnasium.make("CartPole-v1", render_mode="rgb_array")
    env.reset(seed=4)
    drawn = env.render()
    env.close()
    assert np.abs(drawn.astype(int) - first).mean() < 2


def test_video_without_its_extra_is_one_line(a2c_run, tmp_path):
    r = run_without(
        tmp_path,
        ("imageio_ffmpeg",),
        f"savedir={a2c_run}",
        "video=true",
        "seed=99",
        program="moolib-eval",
        module="moolib.launch.evaluate",
    )
    line = one_error_line(r, "moolib-eval")
    assert 'pip install "moolib[video]"' in line, line
    assert not list((a2c_run / "videos").glob("*-seed99"))


BLIND_ENV = """
import gymnasium
import numpy as np


class Blind(gymnasium.Env):
    # Draws no frames; every episode lasts 5 steps and pays 1.5 a step.
    metadata = {"render_modes": []}
    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(4, np.float32), 1.5, self.t >= 5, False, {}


def make():
    return Blind()
"""


def blind_savedir(a2c_run: Path, tmp_path: Path) -> Path:
    """The A2C run's checkpoint on an env of the same shapes that draws no frames."""
    (tmp_path / "blind_env.py").write_text(BLIND_ENV)
    savedir = tmp_path / "blind"
    savedir.mkdir()
    shutil.copy(a2c_run / "checkpoint.pt", savedir)
    cfg = yaml.safe_load((a2c_run / "config.yaml").read_text())
    cfg["env"].update(id="blind_env:make", name="gym:blind_env:make")
    (savedir / "config.yaml").write_text(yaml.safe_dump(cfg))
    return savedir


def test_the_mean_return_of_known_episodes(a2c_run, tmp_path):
    savedir = blind_savedir(a2c_run, tmp_path)
    out = evaluated(tmp_path, f"savedir={savedir}", "episodes=3", env={"PYTHONPATH": str(tmp_path)})
    assert (out["mean"], out["std"], out["min"], out["max"]) == (7.5, 0.0, 7.5, 7.5)
    assert out["length"] == 5.0


def _no_checkpoint(a2c_run: Path, tmp_path: Path) -> list[str]:
    (tmp_path / "run").mkdir()
    shutil.copy(a2c_run / "config.yaml", tmp_path / "run")
    return [f"savedir={tmp_path / 'run'}"]


def _damaged_checkpoint(a2c_run: Path, tmp_path: Path) -> list[str]:
    args = _no_checkpoint(a2c_run, tmp_path)
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    return args


BAD = {
    "an unknown key": (
        lambda run, tmp: [f"savedir={run}", "episode=3"],
        "unknown key episode; nearest known key: episodes",
    ),
    "a bad value": (
        lambda run, tmp: [f"savedir={run}", "episodes=0"],
        "episodes must be a positive integer, got '0'",
    ),
    "not key=value": (lambda run, tmp: [str(run)], "arguments are key=value"),
    "no checkpoint": (_no_checkpoint, "holds no checkpoint yet"),
    "an env that cannot draw": (
        lambda run, tmp: [f"savedir={blind_savedir(run, tmp)}", "video=true"],
        "env gym:blind_env:make cannot draw its frames for video=true",
    ),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_is_one_line(a2c_run, tmp_path, case):
    make, expected = BAD[case]
    args = make(a2c_run, tmp_path)
    r = moolib_eval(tmp_path, *args, env={"PYTHONPATH": str(tmp_path)})
    line = one_error_line(r, "moolib-eval")
    assert expected in line, line


# Folders that hold no run to evaluate: each an EvalError, which moolib-eval prints as
# the lines above.
NOT_A_RUN = {
    "not a folder": (lambda run, tmp: tmp / "missing", "is not a folder"),
    "not a savedir": (lambda run, tmp: tmp, "holds no run (no config.yaml)"),
    "a damaged checkpoint": (
        lambda run, tmp: Path(_damaged_checkpoint(run, tmp)[0].partition("=")[2]),
        "no intact checkpoint in",
    ),
}


@pytest.mark.parametrize("case", NOT_A_RUN, ids=list(NOT_A_RUN))
def test_a_folder_without_a_run_to_evaluate_says_why(a2c_run, tmp_path, case):
    make, expected = NOT_A_RUN[case]
    with pytest.raises(EvalError, match=re.escape(expected)):
        evaluate_savedir(make(a2c_run, tmp_path), 1, ActionChoice())


def test_a_running_run_is_evaluated_without_touching_its_files(a2c_run, tmp_path):
    savedir = tmp_path / "running"
    shutil.copytree(a2c_run, savedir, ignore=shutil.ignore_patterns("videos"))
    # Resumed from its checkpoint, it trains on without a log row or checkpoint for an
    # hour: anything that changes in its files meanwhile is the evaluation's doing.
    args = ["total_steps=100000000", "log_interval=3600", "checkpoint_interval=3600"]
    r = Run([f"savedir={savedir}", *args], tmp_path, tmp_path / "out.log")
    try:
        wait_for(lambda: "moolib-run: a2c on cartpole" in r.output(), 120, "the run", proc=r)

        def files() -> dict[str, bytes]:
            watched = [".moolib-run.lock", "logs.tsv", "config.yaml", "checkpoint.pt"]
            found = {name: (savedir / name).read_bytes() for name in watched}
            for path in sorted((savedir / "checkpoints").iterdir()):
                found[f"checkpoints/{path.name}"] = path.read_bytes()
            return found

        before = files()
        out = evaluated(tmp_path, f"savedir={savedir}", "episodes=3", "video=true")
        assert r.proc.poll() is None, r.output()  # it trained all along
        assert files() == before
        # The run still holds its savedir.
        fd = os.open(savedir / ".moolib-run.lock", os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert f"the checkpoint at step {checkpoint_steps(a2c_run):,}" in out["out"]
        assert len(list((savedir / "videos").rglob("*.mp4"))) == 3  # all it wrote
    finally:
        r.finish()


def test_an_off_policy_run_evaluates_too(tmp_path):
    savedir = tmp_path / "apex"
    args = ["agent=apex", "env=cartpole", "device=cpu", "log_interval=1", "seed=0"]
    args += ["total_steps=1000", "agent.min_replay_size=100"]
    args += ["eval_interval=1000", "eval_episodes=3", f"savedir={savedir}"]
    check_ok(run(args, tmp_path))
    _, rows = read_logs(savedir / "logs.tsv")
    (row,) = [r for r in rows if not math.isnan(r["eval_step"])]
    assert 1000 <= row["eval_step"] <= checkpoint_steps(savedir)
    # Sampled with an epsilon of 0: the greedy actions, drawn as a sampled policy is.
    args = (f"savedir={savedir}", "episodes=3", "policy=sampled", "epsilon=0")
    out = evaluated(tmp_path, *args)
    assert "apex on cartpole" in out["out"]
    assert "epsilon-greedy (epsilon 0)" in out["out"]
    # The learner's evaluation at its end played its final weights, as this does.
    assert out["mean"] == pytest.approx(row["eval_mean_episode_return"], abs=0.005)


POLICY_CASES = [
    ("agent=a2c", "agent.use_lstm=true"),
    ("agent=vtrace",),
    ("agent=apex",),
    ("agent=r2d2",),
]


@pytest.mark.parametrize("overrides", POLICY_CASES, ids=lambda o: " ".join(o))
def test_a_policy_acts_on_a_batch_of_envs_as_on_each_alone(compose_config, overrides):
    """What evaluation plays as one batch picks the same actions as one env at a time:
    each env's network state and previous action are its own, reset where it starts
    an episode."""
    cfg = config_lib.validate(compose_config(*overrides, "env=cartpole", "device=cpu"))
    spec = get_agent(cfg.agent.name)
    torch.manual_seed(0)
    model = spec.make_network(cfg.agent, (4,), 2).eval()
    g = torch.Generator().manual_seed(1)
    envs, steps = 3, 12
    stream = [
        {
            "state": torch.randn(envs, 4, generator=g),
            "reward": torch.rand(envs, generator=g),
            "done": torch.ones(envs, dtype=torch.bool)
            if t == 0
            else torch.rand(envs, generator=g) < 0.2,
        }
        for t in range(steps)
    ]
    batch = spec.policy(cfg.agent, model, envs)
    alone = [spec.policy(cfg.agent, model, 1) for _ in range(envs)]
    choice = ActionChoice()
    for step in stream:
        together = batch.act(step, choice)
        one_by_one = [
            int(alone[i].act({k: v[i : i + 1] for k, v in step.items()}, choice))
            for i in range(envs)
        ]
        assert together.tolist() == one_by_one
