"""Any gymnasium env, or a factory of the user's own, as ``gym:<id>``: made through
``moolib.envs.create_env``, stepped by ``moolib.EnvPool`` workers, and trained on
by ``moolib-run env=gym env.id=...``; what the agents cannot act in is refused
with a message that says why."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import moolib.envs as envs
import numpy as np
import pytest
import torch
from helpers.run_util import QUICK, check_ok, read_logs, run, run_quick

# A corridor: action 1 walks right, 0 left; reaching the end pays 1. float64
# observations, as a hand-written env often has them.
MODULE = textwrap.dedent(
    """
    import gymnasium
    import numpy as np


    class Corridor(gymnasium.Env):
        def __init__(self, length=5):
            self.length = length
            self.observation_space = gymnasium.spaces.Box(0, 1, (length,), np.float64)
            self.action_space = gymnasium.spaces.Discrete(2)

        def _obs(self):
            obs = np.zeros(self.length)
            obs[self.pos] = 1
            return obs

        def reset(self, seed=None, options=None):
            super().reset(seed=seed)
            self.pos, self.t = 0, 0
            return self._obs(), {}

        def step(self, action):
            self.pos = min(self.length - 1, max(0, self.pos + (1 if action == 1 else -1)))
            self.t += 1
            end = self.pos == self.length - 1
            return self._obs(), float(end), end, self.t >= 50, {}


    def make(length=5):
        return Corridor(length)


    def make_dict_observations():
        return gymnasium.wrappers.TimeLimit(DictCorridor(), 10)


    class DictCorridor(Corridor):
        def __init__(self):
            super().__init__()
            self.observation_space = gymnasium.spaces.Dict({"pos": self.observation_space})


    def make_multi_discrete():
        env = Corridor()
        env.action_space = gymnasium.spaces.MultiDiscrete([2, 2])
        return env


    def make_unbounded_actions():
        env = Corridor()
        env.action_space = gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        return env


    def not_an_env():
        return 42
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "lib"
    folder.mkdir()
    (folder / "corridor_envs.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", str(folder))  # for processes started afresh
    return folder


def test_a_registered_id_is_made_with_its_options():
    env = envs.create_env("gym:Acrobot-v1", seed=3, max_episode_steps=7)
    obs, _ = env.reset()
    assert obs.shape == (6,) and obs.dtype == np.float32 and env.action_space.n == 3
    steps = 0
    done = False
    while not done:
        _, _, terminated, truncated, _ = env.step(0)
        done = terminated or truncated
        steps += 1
    assert steps == 7  # the option reached gymnasium.make


def test_a_factory_of_ones_own_with_float64_observations(user_module):
    env = envs.create_env("gym:corridor_envs:make", length=3, seed=1)
    obs, _ = env.reset()
    # float64 is handed on as float32, the networks' dtype.
    assert obs.dtype == np.float32 and env.observation_space.dtype == np.float32
    assert obs.tolist() == [1.0, 0.0, 0.0]
    obs, reward, terminated, _, _ = env.step(1)
    obs, reward, terminated, _, _ = env.step(1)
    assert (obs.tolist(), reward, terminated) == ([0.0, 0.0, 1.0], 1.0, True)


@pytest.mark.parametrize(
    "name, message",
    [
        ("gym:Acrobat-v1", "gymnasium has no env 'Acrobat-v1'; did you mean Acrobot-v1?"),
        (
            "gym:corridor_envs:make_multi_discrete",
            "act in a discrete action space (gymnasium.spaces.Discrete) or a vector of reals",
        ),
        ("gym:corridor_envs:make_unbounded_actions", "continuous actions need finite bounds"),
        ("gym:corridor_envs:make_dict_observations", "need observations in one array"),
        ("gym:corridor_envs:not_an_env", "the factory returned int, not a gymnasium.Env"),
        ("gym:corridor_envs:nope", "corridor_envs has no function nope"),
        ("gym:no_such_module:make", "cannot import no_such_module"),
    ],
)
def test_what_agents_cannot_act_in_is_refused_saying_why(user_module, name, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        envs.create_env(name)


def test_unknown_names_point_at_gym_ids():
    with pytest.raises(ValueError, match="Any other gymnasium env: 'gym:<id>'"):
        envs.create_env("Acrobot-v1")


def test_moolib_envpool_workers_make_the_users_env(user_module):
    import moolib

    factory = functools.partial(envs.create_env, "gym:corridor_envs:make", length=4)
    with moolib.EnvPool(factory, 2, 2, 1) as pool:
        out = pool.step(0, torch.zeros(2, dtype=torch.int64)).result()
        assert out["state"].shape == (2, 4) and out["state"].dtype == torch.float32
        for _ in range(3):
            out = pool.step(0, torch.ones(2, dtype=torch.int64)).result()
        assert out["done"].all() and (out["reward"] == 1).all()


@pytest.mark.timeout(600)
def test_moolib_run_trains_on_the_users_env(tmp_path, user_module):
    savedir = tmp_path / "run"
    args = [
        # Rows 5 a second: a run on an idle machine learns its 20000 steps in about a
        # second, and a row at its end still counts the episodes of the first updates.
        *(a for a in QUICK if not a.startswith("log_interval=")),
        "log_interval=0.2",
        "env=gym",
        "env.id=corridor_envs:make",
        "+env.options.length=6",
        "total_steps=20000",
        f"savedir={savedir}",
    ]
    out = check_ok(run(args, tmp_path))
    assert "a2c on gym:corridor_envs:make" in out, out[-3000:]
    _, rows = read_logs(savedir / "logs.tsv")
    assert int(rows[-1]["step"]) >= 20000
    assert any(float(r["mean_episode_return"]) == 1.0 for r in rows)
    # env.options of a gymnasium env start empty: a key is added with a plus.
    refused = run_quick(
        tmp_path, *QUICK, "env=gym", "env.id=corridor_envs:make", "env.options.length=6"
    )
    assert refused.returncode == 2
    assert "is added with a plus: +env.options.length=..." in refused.stderr
