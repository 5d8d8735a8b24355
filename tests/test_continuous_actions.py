"""Continuous actions (docs/toolkit.md, "Continuous actions"): the action spaces the agents
act in, the Gaussian policy of the actor-critic networks and its math, reward scaling,
the Pendulum and MuJoCo envs, and moolib-run and moolib-eval on them end to end. That
PPO learns Pendulum is tests/test_learning.py's."""

from __future__ import annotations

import functools
import math
import re
import subprocess
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch
from helpers.run_util import check_ok, eval_cmd, read_logs, run, run_env, run_quick
from moolib.agents import a2c, ppo, vtrace
from moolib.agents.acting import ActionChoice, ActorCriticPolicy
from moolib.agents.nets import distributions as policy
from moolib.agents.nets.models import NETWORKS, actor_step, create_model
from moolib.agents.registry import get_agent
from moolib.agents.runtime import evaluation
from moolib.agents.runtime.normalization import (
    ObservationScaler,
    ReturnScaler,
    ScaledObservations,
)
from moolib.envs import create_env, probe_env
from moolib.envs.actions import ActionSpace
from moolib.envs.mujoco import MUJOCO_ENVS, mujoco_game
from moolib.launch import config as config_lib

import moolib

BOX = ActionSpace.box([-2.0, 0.0], [2.0, 1.0])


# -- action spaces -----------------------------------------------------------------------------


def test_action_spaces_of_gymnasium_spaces():
    assert ActionSpace.of(gymnasium.spaces.Discrete(3)) == ActionSpace.discrete(3)
    box = ActionSpace.of(gymnasium.spaces.Box(-1, 1, (6,), np.float32))
    assert box.continuous and box.dim == 6 and box.low == (-1.0,) * 6
    assert str(box) == "6 continuous in [-1, 1]" and str(ActionSpace.discrete(3)) == "3 discrete"
    assert str(BOX) == "2 continuous"
    for space, message in [
        (gymnasium.spaces.Discrete(3, start=1), "its actions start at 1"),
        (gymnasium.spaces.Box(-1, 1, (2, 2)), "must be a vector"),
        (gymnasium.spaces.Box(-np.inf, 1, (2,)), "need finite bounds"),
        (gymnasium.spaces.MultiBinary(3), "act in a discrete action space"),
    ]:
        with pytest.raises(ValueError, match=message):
            ActionSpace.of(space, "the env")
    with pytest.raises(ValueError, match="low < high"):
        ActionSpace.box([1.0], [1.0])


def test_clip_and_zeros():
    actions = torch.tensor([[-5.0, 0.5], [1.0, 7.0]])
    assert BOX.clip(actions).tolist() == [[-2.0, 0.5], [1.0, 1.0]]
    assert BOX.zeros(3).shape == (3, 2) and BOX.zeros(3).dtype == torch.float32
    discrete = ActionSpace.discrete(4)
    assert discrete.zeros(3).dtype == torch.int64 and discrete.zeros(3).shape == (3,)
    ints = torch.tensor([3, 0])
    assert discrete.clip(ints) is ints
    g = torch.Generator().manual_seed(0)
    drawn = BOX.sample(1000, g)
    assert drawn.shape == (1000, 2) and torch.equal(BOX.clip(drawn), drawn)
    assert drawn[:, 0].min() < -1.5 and drawn[:, 0].max() > 1.5
    assert set(discrete.sample(1000, g).tolist()) == {0, 1, 2, 3}


# -- the Gaussian policy's math ------------------------------------------------------------------


def gaussian_params(mean: torch.Tensor, log_std: torch.Tensor) -> torch.Tensor:
    return torch.cat([mean, log_std.expand_as(mean)], dim=-1)


def test_gaussian_log_probs_and_entropy_are_torch_distributions():
    torch.manual_seed(0)
    mean, log_std = torch.randn(4, 3, 2), torch.randn(2)
    params = gaussian_params(mean, log_std)
    actions = torch.randn(4, 3, 2)
    normal = torch.distributions.Normal(mean, log_std.exp())
    assert torch.allclose(policy.log_probs(params, actions), normal.log_prob(actions).sum(-1))
    assert torch.allclose(policy.entropies(params, True), normal.entropy().sum(-1))
    assert torch.equal(policy.greedy(params, True), mean)
    # Samples: the mean and deviation asked for.
    many = gaussian_params(torch.full((20000, 1), 3.0), torch.tensor([math.log(0.5)]))
    drawn = policy.sample(many, True, torch.Generator().manual_seed(1))
    assert drawn.shape == (20000, 1)
    assert abs(drawn.mean().item() - 3.0) < 0.02 and abs(drawn.std().item() - 0.5) < 0.02


def test_discrete_math_is_the_softmax():
    logits = torch.randn(4, 3, 5)
    actions = torch.randint(5, (4, 3))
    categorical = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(policy.log_probs(logits, actions), categorical.log_prob(actions))
    assert torch.allclose(policy.entropies(logits), categorical.entropy())
    assert policy.sample(logits).shape == (4, 3)
    with pytest.raises(ValueError, match="mean and a log std per dimension"):
        policy.log_probs(logits, torch.zeros(4, 3, 5))


# -- networks ------------------------------------------------------------------------------------


def inputs(obs_shape: tuple, actions: torch.Tensor, t: int = 5, b: int = 3) -> dict:
    return {
        "state": torch.randint(0, 255, (t, b, *obs_shape)).to(torch.uint8)
        if len(obs_shape) == 3
        else torch.randn(t, b, *obs_shape),
        "reward": torch.randn(t, b),
        "done": torch.zeros(t, b, dtype=torch.bool),
        "prev_action": actions,
    }


@pytest.mark.parametrize("network", NETWORKS)
@pytest.mark.parametrize("use_lstm", [False, True])
def test_every_network_has_a_gaussian_head(network, use_lstm):
    obs_shape = (4, 84, 84) if network.startswith("impala") else (4, 10, 10)
    if network in ("mlp", "tiny"):
        obs_shape = (5,)
    model = create_model(obs_shape, BOX, network=network, use_lstm=use_lstm, hidden_size=16)
    prev = torch.randn(5, 3, 2)
    out, _ = model(inputs(obs_shape, prev), model.initial_state(3))
    assert out["policy_logits"].shape == (5, 3, 4)
    assert out["action"].shape == (5, 3, 2) and out["action"].dtype == torch.float32
    mean, log_std = policy.split_gaussian(out["policy_logits"])
    assert torch.equal(log_std, model.policy_log_std.expand_as(log_std))
    model.eval()
    out, _ = model(inputs(obs_shape, prev), model.initial_state(3))
    assert torch.equal(out["action"], policy.split_gaussian(out["policy_logits"])[0])
    # The log std is learned and checkpointed; the env's bounds are not state.
    keys = set(model.state_dict())
    assert "policy_log_std" in keys and not keys & {"action_mid", "action_half_range"}


def test_previous_actions_enter_scaled_to_the_bounds():
    model = create_model((3,), BOX, network="mlp", hidden_size=8)
    scaled = model._action_input(torch.tensor([[2.0, 0.0], [0.0, 0.5], [-9.0, 9.0]]))
    assert scaled.tolist() == [[1.0, -1.0], [0.0, 0.0], [-1.0, 1.0]]
    # An episode's first step: the previous action is zeroed, whole vectors at a time.
    step = actor_step(
        {"state": torch.zeros(2, 3), "reward": torch.zeros(2), "done": torch.tensor([True, False])},
        torch.ones(2, 2),
    )
    assert step["prev_action"].tolist() == [[0.0, 0.0], [1.0, 1.0]]


def test_a_discrete_network_is_as_before():
    model = create_model((4,), 2, network="mlp")
    assert not hasattr(model, "policy_log_std") and not model.continuous
    out, _ = model(inputs((4,), torch.zeros(5, 3, dtype=torch.int64)))
    assert out["action"].dtype == torch.int64 and out["policy_logits"].shape == (5, 3, 2)


# -- the losses ----------------------------------------------------------------------------------


def agent_cfg(compose_config, name: str, *overrides: str):
    cfg = compose_config(f"agent={name}", "env=pendulum", *(f"agent.{o}" for o in overrides))
    return config_lib.validate(cfg).agent


def continuous_batch(model, t: int = 6, b: int = 4) -> dict:
    """A [T+1, B] batch as the on-policy actors make it, acted by ``model``."""
    torch.manual_seed(3)
    batch = inputs((5,), torch.zeros(t + 1, b, 2), t + 1, b)
    batch["done"][3, 1] = True
    with torch.no_grad():
        out, _ = model(batch)
    batch.update({k: out[k] for k in ("action", "policy_logits", "baseline")})
    return batch


@pytest.mark.parametrize("name, loss", [("a2c", a2c.compute_loss), ("vtrace", vtrace.compute_loss)])
def test_a2c_and_vtrace_losses_train_the_gaussian(compose_config, name, loss):
    cfg = agent_cfg(compose_config, name)
    model = create_model((5,), BOX, network="mlp", hidden_size=8)
    batch = continuous_batch(model)
    out, _ = model({k: batch[k] for k in ("state", "reward", "done", "prev_action")})
    total, stats = loss(cfg, out, batch)
    total.backward()
    assert math.isfinite(total.item()) and all(math.isfinite(v) for v in stats.values())
    assert model.policy_log_std.grad is not None and model.policy_log_std.grad.abs().sum() > 0
    # The entropy term is the Gaussian's: -(sum over B, T of its entropy).
    entropy = policy.entropies(out["policy_logits"][:-1], True).sum().item()
    assert stats["entropy_loss"] == pytest.approx(-entropy, rel=1e-5)


def test_ppo_minibatches_carry_vector_actions(compose_config):
    cfg = agent_cfg(
        compose_config,
        "ppo",
        "batch_size=4",
        "num_minibatches=2",
        "update_epochs=1",
        "unroll_length=6",
    )
    model = create_model((5,), BOX, network="mlp", hidden_size=8)
    batch = continuous_batch(model)
    updates = list(ppo.minibatches(cfg, batch, ()))
    assert len(updates) == 2
    mini = updates[0].batch
    assert mini["action"].shape == (1, 12, 2) and mini["log_prob"].shape == (1, 12)
    out, _ = model({k: mini[k] for k in ("state", "reward", "done", "prev_action")})
    total, stats = ppo.compute_loss(cfg, out, mini)
    total.backward()
    # Acted by this very model: the ratio is 1, nothing clipped.
    assert float(stats["approx_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert float(stats["clip_fraction"]) == 0.0
    assert model.policy_log_std.grad.abs().sum() > 0


def test_which_agents_learn_continuous_actions():
    assert {
        n for n in ("a2c", "vtrace", "ppo", "apex", "r2d2") if get_agent(n).continuous_actions
    } == {
        "a2c",
        "vtrace",
        "ppo",
    }


# -- reward scaling ------------------------------------------------------------------------------


class _Rewards(gymnasium.Env):
    """Hands out the rewards it is given, one a step, and never ends."""

    observation_space = gymnasium.spaces.Box(0, 1, (1,), np.float32)
    action_space = gymnasium.spaces.Discrete(1)

    def __init__(self, rewards):
        self.rewards = list(rewards)

    def reset(self, seed=None, options=None):
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), self.rewards.pop(0), False, False, {}


def test_reward_scaling_is_gymnasiums_normalize_reward_then_a_clip():
    rewards = np.random.default_rng(0).normal(3.0, 5.0, 300).tolist()
    env = gymnasium.wrappers.NormalizeReward(_Rewards(rewards), gamma=0.97)
    env.reset()
    theirs = [env.step(0)[1] for _ in rewards]
    scaler = ReturnScaler(1, gamma=0.97, clip=1e9)
    ours = [scaler(torch.tensor([r]), torch.tensor([False])).item() for r in rewards]
    assert np.allclose(ours, theirs, rtol=1e-4)
    # Clipped; and an episode's end restarts its env's return (the others' go on).
    scaler = ReturnScaler(2, gamma=1.0, clip=1.0)
    assert scaler(torch.tensor([100.0, 100.0]), torch.tensor([True, False])).tolist() == [1, 1]
    assert scaler.returns.tolist() == [0.0, 100.0]
    state = scaler.state_dict()
    other = ReturnScaler(2, gamma=1.0)
    other.load_state_dict(state)
    assert other.stats.count == state["count"] and float(other.stats.var) == float(state["var"])


def test_observation_scaling_is_gymnasiums_normalize_observation_then_a_clip():
    observations = np.random.default_rng(1).normal([0.0, 50.0], [1.0, 20.0], (300, 2))
    observations[250] = [0.0, 1e6]  # far out: clipped to 10

    class Given(_Rewards):
        observation_space = gymnasium.spaces.Box(-np.inf, np.inf, (2,), np.float64)

        def step(self, action):
            return observations[self.t], 0.0, False, False, {}

    given = Given([])
    env = gymnasium.wrappers.NormalizeObservation(given)
    env.reset()
    theirs = []
    for t in range(len(observations)):
        given.t = t
        theirs.append(np.clip(env.step(0)[0], -10, 10))
    scaler = ObservationScaler((2,))
    scaler(torch.zeros(1, 2))  # the reset observation, which the wrapper counts too
    ours = [scaler(torch.tensor(o)[None])[0].numpy() for o in observations]
    assert np.allclose(ours, theirs, atol=1e-4)
    assert ours[250][1] == 10.0
    # Frozen (what an evaluation feeds the network): the statistics stay as they are.
    count = scaler.count
    scaler(torch.zeros(4, 2), update=False)
    assert scaler.count == count


def test_an_evaluation_feeds_the_network_the_scaled_observations():
    model = create_model((2,), BOX, network="mlp", hidden_size=8).eval()
    mean, var = torch.tensor([1.0, -2.0]), torch.tensor([4.0, 0.25])
    scaled = ScaledObservations(model, mean, var).eval()
    step = inputs((2,), torch.zeros(1, 3, 2), 1, 3)
    out, _ = scaled(step)
    expected, _ = model({**step, "state": (step["state"] - mean) / var.sqrt()})
    assert torch.allclose(out["policy_logits"], expected["policy_logits"], atol=1e-5)
    assert scaled.action_space == BOX and scaled.initial_state(3) == ()
    # A copy takes new statistics with the weights (eval_interval's evaluations).
    copy = ScaledObservations(create_model((2,), BOX, network="mlp", hidden_size=8), mean, var)
    copy.load_state_dict(ScaledObservations(model, mean * 0, var).state_dict())
    assert torch.equal(copy.mean, torch.zeros(2, dtype=torch.float64))


# -- envs ----------------------------------------------------------------------------------------


def test_pendulum_and_mujoco_envs():
    shape, actions = probe_env("pendulum", "gymnasium", {})
    assert shape == (3,) and actions == ActionSpace.box([-2.0], [2.0])
    assert mujoco_game("mujoco-Half-Cheetah") == "half_cheetah"
    assert mujoco_game("mujoco-HalfCheetah-v5") == "half_cheetah"
    assert mujoco_game("mujoco-nope") is None and "mujoco-hopper" in MUJOCO_ENVS
    env = create_env("mujoco-half_cheetah", seed=1)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (17,) and obs.dtype == np.float32
    assert np.abs(obs).max() < 1  # the env's own small initial state, unscaled
    for _ in range(50):
        obs, reward, *_ = env.step(env.action_space.sample())
    assert obs.dtype == np.float32 and math.isfinite(reward)
    env.close()
    with pytest.raises(ValueError, match="Unknown environment 'mujoco-nope'. Did you mean"):
        create_env("mujoco-nope")


def test_envpool_steps_vector_actions():
    factory = functools.partial(create_env, "pendulum")
    with moolib.EnvPool(factory, 1, 2, 1) as pool:
        out = pool.step(0, torch.zeros(2, 1)).result()
        assert out["state"].shape == (2, 3)
        for _ in range(200):
            out = pool.step(0, torch.full((2, 1), 2.0)).result()
        assert out["done"].all()  # Pendulum's 200-step limit
        assert (out["episode_return"] < 0).all()


# -- moolib-run and moolib-eval ------------------------------------------------------------------


def train(tmp_path, agent: str, env: str, steps: int) -> tuple[str, Path, list[dict]]:
    """``moolib-run agent=AGENT env=ENV`` for ``steps`` steps, which must succeed: its
    output, savedir and log rows."""
    savedir = tmp_path / "run"
    args = [f"agent={agent}", f"env={env}", "device=cpu", f"total_steps={steps}"]
    out = check_ok(run([*args, "log_interval=1", f"savedir={savedir}"], tmp_path))
    assert f"{agent} on {env}" in out, out[-3000:]
    _, rows = read_logs(savedir / "logs.tsv")
    assert rows[-1]["step"] >= steps
    return out, savedir, rows


@pytest.mark.timeout(600)
def test_ppo_trains_on_pendulum_and_moolib_eval_plays_it(tmp_path):
    _, savedir, rows = train(tmp_path, "ppo", "pendulum", 8192)
    returns = [r["mean_episode_return"] for r in rows if not math.isnan(r["mean_episode_return"])]
    # The env's own returns (rewards scaled for the loss only): -1,600 to 0 an episode.
    assert returns and all(-1700 < x < 0 for x in returns), returns
    state = torch.load(savedir / "checkpoint.pt", weights_only=False)
    assert "policy_log_std" in state["model"] and "reward_scaling" in state
    r = subprocess.run(
        eval_cmd(f"savedir={savedir}", "episodes=2", "policy=sampled", "seed=1"),
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"return +mean (\S+),", r.stdout)
    assert m and -1700 < float(m.group(1)) < 0, r.stdout
    assert re.search(r"length +mean 200", r.stdout), r.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("agent", ["a2c", "vtrace"])
def test_a2c_and_vtrace_run_on_pendulum(tmp_path, agent):
    _, _, rows = train(tmp_path, agent, "pendulum", 4000)
    assert all(math.isfinite(r["total_loss"]) for r in rows if not math.isnan(r["total_loss"]))


@pytest.mark.timeout(600)
def test_ppo_runs_on_a_mujoco_task_and_its_evaluation_scales_as_training_did(tmp_path):
    _, savedir, _ = train(tmp_path, "ppo", "mujoco-hopper", 4096)
    assert not (tmp_path / "MUJOCO_LOG.TXT").exists()
    # conf/tuning/ppo_mujoco.yaml scales observations: their statistics are checkpointed.
    state = torch.load(savedir / "checkpoint.pt", weights_only=False)
    stats = state["observation_scaling"]
    assert stats["mean"].shape == (11,) and stats["count"] > 4096
    loaded = evaluation.load_checkpointed(savedir)
    played = evaluation.network(loaded.cfg, loaded.state)
    assert isinstance(played, ScaledObservations) and torch.equal(played.mean, stats["mean"])
    r = subprocess.run(
        eval_cmd(f"savedir={savedir}", "episodes=2"),
        cwd=tmp_path,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and re.search(r"return +mean \S+,", r.stdout), r.stdout + r.stderr


@pytest.mark.parametrize("agent", ["apex", "r2d2"])
def test_a_q_learner_is_refused_continuous_actions_in_one_line(tmp_path, agent):
    r = run_quick(tmp_path, f"agent={agent}", "env=pendulum", "device=cpu")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].endswith(
        f"agent={agent} cannot act in env=pendulum: its actions are 1 continuous in [-2, 2], "
        f"and {agent} rates each of a finite set of actions (agent=a2c or agent=ppo or "
        "agent=vtrace learn continuous actions)"
    ), r.stderr


def test_the_actor_critic_policy_plays_a_gaussian():
    model = create_model((3,), ActionSpace.box([-2.0], [2.0]), network="mlp").eval()
    play = ActorCriticPolicy(None, model, 2)
    env_out = {
        "state": torch.zeros(2, 3),
        "reward": torch.zeros(2),
        "done": torch.ones(2, dtype=torch.bool),
    }
    greedy = play.act(env_out, ActionChoice(greedy=True))
    assert greedy.shape == (2, 1) and torch.allclose(greedy[0], greedy[1])
    drawn = play.act(
        env_out, ActionChoice(greedy=False, generator=torch.Generator().manual_seed(0))
    )
    assert not torch.equal(drawn, greedy)
    assert play.env_actions(torch.tensor([[5.0], [-5.0]])).tolist() == [[2.0], [-2.0]]
