"""MinAtar on moolib-run: the five games as ``env=minatar-<game>`` options, stepped by a
real ``moolib.EnvPool``, with the paper's settings (sticky actions 0.1), and the paper's
network, which ``network=auto`` picks for their 10x10 grids for both agents.

The learning test (V-trace learns MinAtar Breakout through ``moolib-run``) is in
tests/test_learning.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from moolib.agents.nets import models
from moolib.envs import create_env, create_envpool, list_envs
from moolib.envs.minatar import MINATAR_GAMES, MinAtarEnv
from moolib.launch import config as config_lib
from moolib.launch.config import ConfigError
from omegaconf import OmegaConf

import moolib

# The paper's observation channels per game (Young & Tian 2019, section 3).
CHANNELS = {"asterix": 4, "breakout": 4, "freeway": 7, "seaquest": 10, "space_invaders": 6}
LEFT, RIGHT = 1, 3  # minatar's action indices of 'l' and 'r' (all 6 actions)


def _options(cfg) -> dict:
    return OmegaConf.to_container(cfg.env.options, resolve=True)


def test_the_five_games_are_the_packages_and_named_apart_from_atari():
    assert set(MINATAR_GAMES) == set(CHANNELS)
    names = [f"minatar-{g}" for g in MINATAR_GAMES]
    assert set(names) <= set(list_envs())
    # breakout is Atari's Breakout; minatar-breakout is MinAtar's.
    assert create_env("breakout").observation_space.shape == (4, 84, 84)
    assert create_env("minatar-breakout").observation_space.shape == (4, 10, 10)
    assert create_env("MinAtar-Space-Invaders").observation_space.shape == (6, 10, 10)
    with pytest.raises(ValueError, match="minatar-pong"):
        create_env("minatar-pong")
    with pytest.raises(ValueError, match="Atari games only"):
        create_envpool("minatar-breakout", 2, 1)


@pytest.mark.parametrize("game", list(CHANNELS))
def test_each_game_composes_and_steps_through_envpool(compose_config, game):
    cfg = compose_config(f"env=minatar-{game}")
    config_lib.validate(cfg)
    # One config for the five games: env=minatar-GAME is env=minatar env.game=GAME.
    assert cfg.env == compose_config("env=minatar", f"env.game={game}").env
    assert cfg.env.name == f"minatar-{game}" and cfg.name == f"vtrace-minatar-{game}"
    options = _options(cfg)
    assert options["sticky_action_prob"] == 0.1  # the paper's
    assert options["minimal_action_set"] is False  # the paper's 6 actions

    factory = functools.partial(create_env, cfg.env.name, **options)
    probe = factory()
    assert probe.unwrapped.sticky_action_prob == 0.1  # what minatar.Environment applies
    assert probe.action_space.n == 6
    probe.close()

    batch = 4
    pool = moolib.EnvPool(factory, num_processes=2, batch_size=batch, num_batches=2)
    try:
        futures = [pool.step(b, torch.zeros(batch, dtype=torch.int64)) for b in range(2)]
        gen = torch.Generator().manual_seed(0)
        dones = empty = steps = 0
        rewards = 0.0
        # At least 400 steps of each batch; then on until random play has scored (a
        # random Seaquest scores about once in 1,000 env steps: 400 steps of 4 envs
        # scored nothing in about one run of six).
        for t in range(4000):
            if t >= 400 and (game == "freeway" or (dones > 0 and rewards > 0)):
                break
            b = t % 2
            out = futures[b].result()
            state = out["state"]
            assert state.shape == (batch, CHANNELS[game], 10, 10), state.shape
            assert state.dtype == torch.uint8
            assert int(state.max()) <= 1  # MinAtar's boolean cells as 0/1
            assert out["reward"].dtype == torch.float32
            assert torch.isfinite(out["reward"]).all()
            rewards += float(out["reward"].abs().sum())
            dones += int(out["done"].sum())
            empty += int((state.flatten(1).sum(1) == 0).sum())
            futures[b] = pool.step(b, torch.randint(0, 6, (batch,), generator=gen))
            steps += 1
        for f in futures:
            f.result()
        # The grids show the game (the player, at least), not zeros.
        assert empty < steps * batch // 10, (empty, steps)
        # Random play ends episodes (Freeway's only after 2,500 steps) and scores.
        if game != "freeway":
            assert dones > 0 and rewards > 0, (dones, rewards)
    finally:
        pool.close()


def _paddle(obs: np.ndarray) -> int:
    return int(np.argmax(obs[0, 9]))  # breakout's channel 0 is the paddle, on the last row


def _ignored_fraction(env: MinAtarEnv, steps: int, seed: int) -> float:
    """Alternates left and right; the fraction of moves that went the other way (the
    previous action repeated: a sticky action) among moves that could go either way."""
    rng = np.random.default_rng(seed)
    obs, _ = env.reset(seed=seed)
    moves = ignored = 0
    for t in range(steps):
        action = LEFT if t % 2 else RIGHT
        before = _paddle(obs)
        obs, _, terminated, _, _ = env.step(action)
        if terminated:
            obs, _ = env.reset(seed=int(rng.integers(1 << 30)))
            continue
        if 0 < before < 9:  # at a wall a move one way cannot be told from none
            moved = _paddle(obs) - before
            moves += 1
            ignored += moved == (-1 if action == RIGHT else 1)
    assert moves > steps // 2
    return ignored / moves


def test_sticky_actions_are_applied_as_configured(compose_config):
    options = _options(compose_config("env=minatar-breakout"))
    env = create_env("minatar-breakout", **options)
    fraction = _ignored_fraction(env.unwrapped, 4000, seed=1)
    # 0.1 of the actions repeat the previous one (binomial std at 4000 steps ~0.005).
    assert 0.06 < fraction < 0.14, fraction
    never = create_env("minatar-breakout", **{**options, "sticky_action_prob": 0.0})
    assert _ignored_fraction(never.unwrapped, 1000, seed=1) == 0.0
    always = create_env("minatar-breakout", **{**options, "sticky_action_prob": 1.0})
    obs, _ = always.reset(seed=2)
    for _ in range(5):  # every action repeats the first (none): the paddle stays put
        obs, *_ = always.step(LEFT)
        assert _paddle(obs) == 4
    with pytest.raises(ValueError, match="sticky_action_prob"):
        create_env("minatar-breakout", sticky_action_prob=1.5)
    for flag in ("difficulty_ramping", "minimal_action_set"):
        with pytest.raises(ValueError, match=f"{flag} must be true or false, got 'no'"):
            create_env("minatar-breakout", **{flag: "no"})


def test_game_and_name_must_agree(compose_config):
    with pytest.raises(ConfigError, match=r"env.game 'pong' is not a MinAtar game"):
        config_lib.validate(compose_config("env=minatar", "env.game=pong"))
    with pytest.raises(ConfigError, match=r"env.name=minatar-freeway: env.name follows env.game"):
        config_lib.validate(compose_config("env=minatar-breakout", "env.name=minatar-freeway"))
    with pytest.raises(ConfigError, match="envpool serves Atari games only"):
        config_lib.validate(compose_config("env=minatar-breakout", "env.backend=envpool"))


def test_minatar_network_shapes_and_layers():
    net = models.create_model((4, 10, 10), 6, network="minatar")
    assert isinstance(net, models.MinAtarNet)
    # The paper's: one 3x3 conv, 16 channels, stride 1, then 128 units.
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 1
    conv = convs[0]
    assert conv.weight.shape == (16, 4, 3, 3) and conv.stride == (1, 1)
    hidden = [m for m in net.torso.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in hidden] == [(16 * 8 * 8, 128)]
    T, B = 5, 3
    gen = torch.Generator().manual_seed(0)
    inputs = {
        "state": torch.randint(0, 2, (T, B, 4, 10, 10), generator=gen, dtype=torch.uint8),
        "reward": torch.randn(T, B, generator=gen),
        "done": torch.zeros(T, B, dtype=torch.bool),
        "prev_action": torch.randint(6, (T, B), generator=gen),
    }
    out, core = net(inputs)
    assert out["policy_logits"].shape == (T, B, 6) and out["baseline"].shape == (T, B)
    assert out["action"].shape == (T, B) and core == ()
    out["baseline"].sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    # Cells are 0/1 as they are, not scaled like 0..255 pixels.
    one = {k: v[:1, :1] for k, v in inputs.items()}
    scaled = dict(one, state=one["state"] * 255)
    assert not torch.allclose(net(one)[0]["baseline"], net(scaled)[0]["baseline"])
    lstm = models.create_model((10, 10, 10), 6, network="minatar", use_lstm=True, hidden_size=32)
    inputs["state"] = torch.randint(0, 2, (T, B, 10, 10, 10), generator=gen, dtype=torch.uint8)
    out, core = lstm(inputs, lstm.initial_state(B))
    assert out["policy_logits"].shape == (T, B, 6) and core[0].shape == (1, B, 32)


@pytest.mark.parametrize("agent", ["vtrace", "a2c"])
def test_auto_picks_the_minatar_network_for_both_agents(compose_config, agent):
    cfg = compose_config(f"agent={agent}", "env=minatar-space_invaders")
    config_lib.validate(cfg)
    assert cfg.agent.network == "auto" and cfg.agent.hidden_size == 128  # the tuning's
    assert models.resolve_network("auto", (6, 10, 10)) == "minatar"
    # Atari frames and vectors keep their networks.
    assert models.resolve_network("auto", (4, 84, 84)) == "impala_deep"
    assert models.resolve_network("auto", (4,)) == "mlp"
    # The composed settings build the paper's network for the game's observations.
    env = create_env(cfg.env.name, **_options(cfg))
    shape, actions = env.observation_space.shape, int(env.action_space.n)
    net = models.create_model(
        shape,
        actions,
        network=models.resolve_network(cfg.agent.network, shape),
        use_lstm=cfg.agent.use_lstm,
        hidden_size=cfg.agent.hidden_size,
    )
    assert isinstance(net, models.MinAtarNet)
    params = sum(p.numel() for p in net.parameters())
    # conv 16*6*9+16, fc 1024*128+128, heads over 128+1+6 inputs: the paper's size.
    expected = (16 * 6 * 9 + 16) + (1024 * 128 + 128) + (135 * 6 + 6) + (135 + 1)
    assert params == expected
