"""PPO (agent=ppo): its math on hand-made tensors against the definitions (GAE, the
clipped surrogate with clipping active and not, the clipped value loss, advantage
normalisation), the minibatches it cuts a learner batch into, its settings' checks,
and its configs as moolib-run composes them (CleanRL's defaults, its tunings)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from moolib.agents import ppo
from moolib.agents.a2c import n_step_returns
from moolib.agents.math import ppo as ppo_math
from moolib.agents.registry import get_agent
from moolib.launch import config as config_lib
from moolib.launch.config import ConfigError


def reference_gae(rewards, discounts, values, bootstrap, lam):
    """The non-recursive definition, in float64: A_s = sum_{t >= s} (prod_{i=s}^{t-1}
    gamma_i lam) delta_t, delta_t = r_t + gamma_t V_{t+1} - V_t, V_T the bootstrap."""
    rewards, discounts, values, bootstrap = (
        np.asarray(x, dtype=np.float64) for x in (rewards, discounts, values, bootstrap)
    )
    num_steps, batch = values.shape
    nexts = np.concatenate([values[1:], bootstrap[None]])
    deltas = rewards + discounts * nexts - values
    out = np.zeros((num_steps, batch))
    for b in range(batch):
        for s in range(num_steps):
            coef = 1.0
            for t in range(s, num_steps):
                out[s, b] += coef * deltas[t, b]
                coef *= discounts[t, b] * lam
    return out


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_is_its_definition(lam):
    gen = torch.Generator().manual_seed(0)
    num_steps, batch = 7, 3
    rewards = torch.randn(num_steps, batch, generator=gen)
    values = torch.randn(num_steps, batch, generator=gen)
    bootstrap = torch.randn(batch, generator=gen)
    # Episode ends (discount 0) in the middle and at the last step.
    discounts = torch.full((num_steps, batch), 0.9)
    discounts[2, 0] = 0.0
    discounts[-1, 1] = 0.0
    got = ppo_math.gae(rewards, discounts, values, bootstrap, lam)
    want = reference_gae(rewards, discounts, values, bootstrap, lam)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)
    # Nothing crosses the episode end: the step before it does not see what follows.
    assert got[2, 0].item() == pytest.approx(rewards[2, 0].item() - values[2, 0].item())
    if lam == 1.0:
        # GAE(1) is the discounted return to the bootstrap, less the value.
        returns = n_step_returns(rewards, discounts, bootstrap)
        torch.testing.assert_close(got + values, returns)


def test_gae_refuses_mismatched_shapes():
    t = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="bootstrap must have shape"):
        ppo_math.gae(t, t, t, torch.zeros(3), 0.95)
    with pytest.raises(ValueError, match="one shape"):
        ppo_math.gae(t, torch.zeros(4, 3), t, torch.zeros(2), 0.95)


def test_clipped_surrogate_clips_only_where_the_ratio_gains_past_the_clip():
    # clip 0.2: [0.8, 1.2]. Per step: the ratio, the advantage, and whether the clip
    # holds its gradient at 0.
    ratios = [1.05, 1.5, 0.5, 0.95, 0.5, 1.5]
    advantages = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    # Active where the ratio went past the clip in the direction the advantage
    # favours (1.5 with A > 0, 0.5 with A < 0); below 0.8 with A > 0, or above 1.2
    # with A < 0, the unclipped term is the pessimistic one and still learns.
    active = [False, True, True, False, False, False]
    log_ratio = torch.tensor(ratios).log().requires_grad_()
    adv = torch.tensor(advantages)
    loss = ppo_math.clipped_surrogate_loss(log_ratio, adv, 0.2)
    per_step = [
        -a * max(0.8, min(r, 1.2)) if c else -a * r
        for r, a, c in zip(ratios, advantages, active, strict=True)
    ]
    assert loss.item() == pytest.approx(sum(per_step) / len(per_step))
    loss.backward()
    # d/d log r of -A r / N is -A r / N where the ratio is unclipped; 0 where clipped.
    want = [
        0.0 if c else -a * r / len(ratios)
        for r, a, c in zip(ratios, advantages, active, strict=True)
    ]
    torch.testing.assert_close(log_ratio.grad, torch.tensor(want))
    # The advantages weight the ratio, they are not learned.
    adv = adv.clone().requires_grad_()
    ppo_math.clipped_surrogate_loss(torch.zeros(6, requires_grad=True), adv, 0.2).backward()
    assert adv.grad is None


def test_clipped_value_loss_keeps_the_larger_error_of_a_clipped_move():
    values = torch.tensor([1.0, 2.0, 0.0, 0.6], requires_grad=True)
    old = torch.tensor([0.5, 0.5, 0.5, 0.5])
    returns = torch.tensor([1.0, 0.0, 3.0, 0.0])
    # clip 0.2: the values moved from 0.5 to at most 0.7 or at least 0.3.
    # 1.0 -> 0.7: error 0 unclipped, 0.09 clipped: 0.09 (clipped: no gradient).
    # 2.0 -> 0.7: 4 against 0.49: 4. 0.0 -> 0.3: 9 against 7.29: 9.
    # 0.6 (within the clip) -> 0.6: 0.36 either way.
    loss = ppo_math.value_loss(values, old, returns, clip=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.09 + 4 + 9 + 0.36) / 4)
    loss.backward()
    # d/dv 0.5 mean (v - R)^2 = (v - R) / N, where the unclipped error is kept.
    torch.testing.assert_close(values.grad, torch.tensor([0.0, 2.0, -3.0, 0.6]) / 4)
    # Without the clip, the plain squared error.
    plain = ppo_math.value_loss(values, old, returns, clip=None)
    assert plain.item() == pytest.approx(0.5 * (0 + 4 + 9 + 0.36) / 4)


def test_normalize_gives_mean_zero_deviation_one():
    adv = torch.tensor([[1.0, 2.0], [3.0, 10.0]])
    out = ppo_math.normalize(adv)
    assert out.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert out.std(correction=0).item() == pytest.approx(1.0, abs=1e-6)
    # Order kept; one step alone is 0, not NaN.
    assert out.flatten().argsort().tolist() == [0, 1, 2, 3]
    assert ppo_math.normalize(torch.tensor([5.0])).item() == 0.0


def test_entropy_loss_is_the_mean_negative_entropy():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])  # p = (.5, .5), (.25, .75)
    entropies = [math.log(2), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]
    assert ppo_math.entropy_loss(logits).item() == pytest.approx(-sum(entropies) / 2)


def _settings(compose_config, *overrides: str) -> ppo.PPOConfig:
    return config_lib.validate(compose_config("agent=ppo", "env=cartpole", *overrides)).agent


def _batch(num_steps: int, num_unrolls: int) -> dict:
    """A learner batch of ``num_unrolls`` unrolls of ``num_steps`` + 1 steps; ``state``
    numbers the steps, so a minibatch says which steps it holds."""
    shape = (num_steps + 1, num_unrolls)
    gen = torch.Generator().manual_seed(1)
    return {
        "state": torch.arange(math.prod(shape), dtype=torch.float32).view(*shape, 1),
        "reward": torch.randn(shape, generator=gen),
        "done": torch.rand(shape, generator=gen) < 0.2,
        "prev_action": torch.zeros(shape, dtype=torch.int64),
        "action": torch.randint(0, 2, shape, generator=gen),
        "policy_logits": torch.randn(*shape, 2, generator=gen),
        "baseline": torch.randn(shape, generator=gen),
    }


def test_minibatches_cover_each_step_once_an_epoch(compose_config):
    cfg = _settings(
        compose_config,
        "agent.batch_size=4",
        "agent.unroll_length=5",
        "agent.num_minibatches=2",
        "agent.update_epochs=3",
        "agent.reward_clip=0",
    )
    batch = _batch(5, 4)
    updates = list(ppo.minibatches(cfg, batch, ()))
    assert len(updates) == 3 * 2
    assert cfg.passes() == 3
    steps = ppo.rollout(cfg, batch)
    learned = batch["state"][:-1].flatten().tolist()
    for epoch in range(3):
        seen = []
        for update in updates[2 * epoch : 2 * epoch + 2]:
            # Single steps from all unrolls, [1, N]: half the batch's 20 steps.
            assert update.batch["state"].shape == (1, 10, 1)
            assert update.size == 2 and update.core == ()
            seen += update.batch["state"].flatten().tolist()
            # Each step keeps its own advantage, return and actor's log-probability.
            index = update.batch["state"][0, :, 0].long()
            t, b = index // 4, index % 4
            for key in ("advantages", "returns", "log_prob", "action", "baseline"):
                torch.testing.assert_close(update.batch[key][0], steps[key][t, b])
        assert sorted(seen) == learned
    # GAE from the actors' values, returns = advantages + values.
    discounts = (~batch["done"][1:]).float() * cfg.discounting
    want = ppo_math.gae(
        batch["reward"][1:], discounts, batch["baseline"][:-1], batch["baseline"][-1], 0.95
    )
    torch.testing.assert_close(steps["advantages"], want)
    torch.testing.assert_close(steps["returns"], want + batch["baseline"][:-1])
    # The epochs draw different orders.
    assert updates[0].batch["state"].tolist() != updates[2].batch["state"].tolist()


def test_minibatches_with_an_lstm_are_whole_unrolls_with_their_state(compose_config):
    cfg = _settings(
        compose_config,
        "agent.use_lstm=true",
        "agent.batch_size=4",
        "agent.unroll_length=5",
        "agent.num_minibatches=2",
        "agent.update_epochs=2",
    )
    batch = _batch(5, 4)
    core = tuple(torch.arange(4.0).view(1, 4, 1).repeat(1, 1, 3) + i for i in (0, 10))
    updates = list(ppo.minibatches(cfg, batch, core))
    assert len(updates) == 2 * 2
    for update in updates:
        assert update.batch["state"].shape == (5, 2, 1) and update.size == 2
        unrolls = (update.batch["state"][0, :, 0] % 4).long()  # step 0 of unroll b is b
        # The steps of those unrolls, in order, and the LSTM state each started from.
        torch.testing.assert_close(update.batch["state"], batch["state"][:-1, unrolls])
        for got, whole in zip(update.core, core, strict=True):
            torch.testing.assert_close(got, whole[:, unrolls])


def test_loss_of_a_minibatch_at_the_actors_policy(compose_config):
    """At the actors' own policy (ratio 1) the clip is inactive: the policy loss is
    minus the mean normalised advantage (0), and the stats are finite."""
    cfg = _settings(compose_config, "agent.batch_size=4", "agent.unroll_length=5")
    batch = _batch(5, 4)
    update = next(iter(ppo.minibatches(cfg, batch, ())))
    # The actors' logits at the minibatch's steps (state numbers them: t * 4 + b).
    index = update.batch["state"][0, :, 0].long()
    outputs = {
        "policy_logits": batch["policy_logits"][:-1].flatten(0, 1)[index][None],
        "baseline": update.batch["baseline"].clone().requires_grad_(),
    }
    loss, stats = ppo.compute_loss(cfg, outputs, update.batch)
    assert stats["policy_loss"].item() == pytest.approx(0.0, abs=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(0.0, abs=1e-6)
    assert stats["clip_fraction"].item() == 0.0
    assert all(math.isfinite(float(v)) for v in stats.values())
    loss.backward()
    assert outputs["baseline"].grad is not None


def test_ppo_is_registered_with_its_minibatches():
    spec = get_agent("ppo")
    assert spec.updates is ppo.minibatches and spec.config is ppo.PPOConfig
    assert spec.runtime_name == "onpolicy"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "agent.num_minibatches=3",
            r"agent.batch_size \(4\) must be a multiple of agent.num_minibatches \(3\)",
        ),
        ("agent.clip_coef=0", "agent.clip_coef must be more than 0"),
        ("agent.gae_lambda=1.5", r"agent.gae_lambda must be a number in \[0.0, 1.0\]"),
        ("agent.update_epochs=0", "agent.update_epochs must be a positive integer"),
        ("agent.clip_value_loss=maybe", "agent.clip_value_loss must be true or false"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(compose_config, override, message):
    with pytest.raises(ConfigError, match=message):
        _settings(compose_config, override)


def test_defaults_are_cleanrls_and_tunings_compose(compose_config):
    # conf/agent/ppo.yaml: CleanRL's ppo_atari.py.
    atari = config_lib.validate(compose_config("agent=ppo", "env=breakout")).agent
    assert (atari.num_actor_batches * atari.actor_batch_size, atari.unroll_length) == (8, 128)
    assert (atari.num_minibatches, atari.update_epochs, atari.clip_coef) == (4, 4, 0.1)
    assert (atari.discounting, atari.gae_lambda) == (0.99, 0.95)
    assert atari.clip_value_loss and atari.normalize_advantages
    assert (atari.entropy_cost, atari.baseline_cost, atari.grad_norm_clipping) == (0.01, 0.5, 0.5)
    opt = atari.optimizer
    assert (opt.name, opt.learning_rate, opt.epsilon, opt.schedule) == (
        "adam",
        2.5e-4,
        1e-5,
        "linear",
    )
    # Every minibatch is an optimizer step.
    assert atari.virtual_batch_size == atari.batch_size // atari.num_minibatches
    # conf/tuning/ppo_cartpole.yaml: its ppo.py (classic control).
    composed = compose_config("agent=ppo", "env=cartpole")
    cartpole = config_lib.validate(composed)
    agent = cartpole.agent
    assert (agent.num_actor_batches * agent.actor_batch_size, agent.clip_coef) == (4, 0.2)
    assert agent.virtual_batch_size == agent.batch_size // agent.num_minibatches == 1
    assert agent.reward_clip == 0 and agent.optimizer.learning_rate == 2.5e-4
    assert cartpole.total_steps == 500_000
    # conf/tuning/ppo_minatar.yaml serves every MinAtar game.
    minatar = config_lib.validate(compose_config("agent=ppo", "env=minatar-breakout"))
    assert minatar.env.name == "minatar-breakout" and minatar.agent.name == "ppo"
    assert minatar.agent.hidden_size == 128 and minatar.total_steps == 5_000_000
    assert minatar.agent.clip_coef == 0.1


def test_a_trainer_counts_each_env_step_once_keeping_the_remainder(compose_config, tmp_path):
    """A real Trainer (EnvPool, broker, Accumulator) on batches of 2 unrolls of 4 steps,
    3 epochs of 2 minibatches of one unroll, 2 summed into each optimizer step: an update
    learns 2 x 4 steps a third time, 8/3 env steps, counted 2 then 3 (8 + 2 = 10 = 3 x 3
    + 1), its remainder in the checkpoint for a resumed or joining peer to go on from."""
    from moolib.agents.runtime import checkpoint
    from moolib.agents.runtime.onpolicy import PeerInfo, Trainer
    from moolib.launch.local import EmbeddedBroker

    overrides = (
        "agent.actor_batch_size=2 agent.num_actor_batches=2 agent.num_actor_cpus=1 "
        "agent.batch_size=2 agent.unroll_length=4 agent.virtual_batch_size=2 "
        "agent.num_minibatches=2 agent.update_epochs=3 agent.hidden_size=16 "
        "total_steps=5 device=cpu torch_threads=1 seed=1"
    ).split()
    final = config_lib.prepare(compose_config("agent=ppo", "env=cartpole", *overrides), tmp_path)
    broker = EmbeddedBroker()
    try:
        peer = PeerInfo(rank=0, savedir=tmp_path, logdir=tmp_path, broker=broker.address)
        trainer = Trainer(final, peer)
        row = trainer.run()
    finally:
        broker.close()
    assert (trainer.steps, trainer.step_remainder) == (5, 1), row
    assert trainer.accumulator.model_version() == 2
    saved = checkpoint.load_latest(tmp_path).state
    assert (saved["steps"], saved["step_remainder"]) == (5, 1)
