"""V-trace and the IMPALA losses against direct computations of their definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from moolib.agents.math import vtrace

CLIPS = [(1.0, 1.0), (None, None), (0.5, 2.0), (2.0, None)]
CLIP_IDS = ["clip1-1", "noclip", "clip0.5-2", "clip2-none"]


def reference_vtrace(log_rhos, discounts, rewards, values, bootstrap, clip_rho, clip_pg):
    """The non-recursive definition of the paper (eq. 1), element by element in float64.

    v_s = V(x_s) + sum_{t=s}^{T-1} (prod_{i=s}^{t-1} gamma_i c_i) delta_t,
    delta_t = rho_t (r_t + gamma_t V(x_{t+1}) - V(x_t)),
    with gamma_i the per-step discount (0 at an episode end), c_i = min(1, rho_i),
    rho_t clipped at clip_rho and V(x_T) the bootstrap value.
    """
    log_rhos, discounts, rewards, values, bootstrap = (
        np.asarray(x, dtype=np.float64) for x in (log_rhos, discounts, rewards, values, bootstrap)
    )
    num_steps, batch = values.shape
    vs = np.zeros((num_steps, batch))
    pg = np.zeros((num_steps, batch))
    for b in range(batch):

        def value(t, b=b):
            return values[t, b] if t < num_steps else bootstrap[b]

        for s in range(num_steps):
            total = values[s, b]
            for t in range(s, num_steps):
                coef = 1.0
                for i in range(s, t):
                    coef *= discounts[i, b] * min(1.0, math.exp(log_rhos[i, b]))
                rho = math.exp(log_rhos[t, b])
                if clip_rho is not None:
                    rho = min(clip_rho, rho)
                delta = rho * (rewards[t, b] + discounts[t, b] * value(t + 1) - values[t, b])
                total += coef * delta
            vs[s, b] = total
        for s in range(num_steps):
            vs_next = vs[s + 1, b] if s + 1 < num_steps else bootstrap[b]
            rho = math.exp(log_rhos[s, b])
            if clip_pg is not None:
                rho = min(clip_pg, rho)
            pg[s, b] = rho * (rewards[s, b] + discounts[s, b] * vs_next - values[s, b])
    return vs, pg


def random_inputs(num_steps, batch, dtype, episode_ends, seed):
    gen = torch.Generator().manual_seed(seed)
    # Spread of log_rhos wide enough that some rhos exceed each clip threshold.
    log_rhos = torch.randn(num_steps, batch, generator=gen, dtype=torch.float64).to(dtype)
    discounts = torch.full((num_steps, batch), 0.9, dtype=dtype)
    if episode_ends:
        dones = torch.rand(num_steps, batch, generator=gen) < 0.3
        dones[0, 0] = True  # at least one episode end in every case
        discounts = discounts * (~dones).to(dtype)
    rewards = torch.randn(num_steps, batch, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(num_steps, batch, generator=gen, dtype=torch.float64).to(dtype)
    bootstrap = torch.randn(batch, generator=gen, dtype=torch.float64).to(dtype)
    return log_rhos, discounts, rewards, values, bootstrap


def tolerances(dtype):
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    return {"rtol": tol, "atol": tol}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clips", CLIPS, ids=CLIP_IDS)
@pytest.mark.parametrize("episode_ends", [False, True], ids=["no-ends", "ends"])
@pytest.mark.parametrize("num_steps,batch", [(1, 1), (5, 3), (13, 4), (20, 2)])
def test_from_importance_weights_matches_definition(num_steps, batch, episode_ends, clips, dtype):
    clip_rho, clip_pg = clips
    inputs = random_inputs(num_steps, batch, dtype, episode_ends, seed=num_steps * 100 + batch)
    out = vtrace.from_importance_weights(
        *inputs, clip_rho_threshold=clip_rho, clip_pg_rho_threshold=clip_pg
    )
    ref_vs, ref_pg = reference_vtrace(*(x.numpy() for x in inputs), clip_rho, clip_pg)
    assert out.vs.dtype == dtype and out.pg_advantages.dtype == dtype
    assert out.vs.shape == (num_steps, batch) and out.pg_advantages.shape == (num_steps, batch)
    np.testing.assert_allclose(out.vs.numpy(), ref_vs, **tolerances(dtype))
    np.testing.assert_allclose(out.pg_advantages.numpy(), ref_pg, **tolerances(dtype))


def log_softmax_np(logits):
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("clips", CLIPS, ids=CLIP_IDS)
@pytest.mark.parametrize("episode_ends", [False, True], ids=["no-ends", "ends"])
@pytest.mark.parametrize("num_steps,batch,num_actions", [(1, 2, 2), (7, 3, 4), (16, 2, 6)])
def test_vtrace_from_logits_matches_definition(
    num_steps, batch, num_actions, episode_ends, clips, dtype
):
    clip_rho, clip_pg = clips
    gen = torch.Generator().manual_seed(7 * num_steps + batch)
    behavior_logits = torch.randn(num_steps, batch, num_actions, generator=gen).to(dtype)
    target_logits = torch.randn(num_steps, batch, num_actions, generator=gen).to(dtype)
    actions = torch.randint(num_actions, (num_steps, batch), generator=gen)
    _, discounts, rewards, values, bootstrap = random_inputs(
        num_steps, batch, dtype, episode_ends, seed=num_actions
    )
    out = vtrace.vtrace_from_logits(
        behavior_logits,
        target_logits,
        actions,
        discounts,
        rewards,
        values,
        bootstrap,
        clip_rho_threshold=clip_rho,
        clip_pg_rho_threshold=clip_pg,
    )

    idx = actions.numpy()[..., None]
    ref_behavior = np.take_along_axis(log_softmax_np(behavior_logits.numpy()), idx, -1)[..., 0]
    ref_target = np.take_along_axis(log_softmax_np(target_logits.numpy()), idx, -1)[..., 0]
    ref_log_rhos = ref_target - ref_behavior
    ref_vs, ref_pg = reference_vtrace(
        ref_log_rhos, discounts.numpy(), rewards.numpy(), values.numpy(), bootstrap.numpy(),
        clip_rho, clip_pg,
    )  # fmt: skip
    tol = tolerances(dtype)
    np.testing.assert_allclose(out.behavior_action_log_probs.numpy(), ref_behavior, **tol)
    np.testing.assert_allclose(out.target_action_log_probs.numpy(), ref_target, **tol)
    np.testing.assert_allclose(out.log_rhos.numpy(), ref_log_rhos, **tol)
    np.testing.assert_allclose(out.vs.numpy(), ref_vs, **tol)
    np.testing.assert_allclose(out.pg_advantages.numpy(), ref_pg, **tol)
    for field in out:
        assert field.shape == (num_steps, batch) and field.dtype == dtype


def test_on_policy_vs_is_the_bootstrapped_n_step_return():
    # With rho = 1 everywhere V-trace reduces to the n-step return
    # vs_t = r_t + gamma_t vs_{t+1}, whatever the baseline is.
    num_steps, batch = 9, 3
    _, discounts, rewards, values, bootstrap = random_inputs(
        num_steps, batch, torch.float64, episode_ends=True, seed=3
    )
    logits = torch.randn(num_steps, batch, 5, dtype=torch.float64)
    actions = torch.randint(5, (num_steps, batch))
    out = vtrace.vtrace_from_logits(logits, logits, actions, discounts, rewards, values, bootstrap)
    expected = torch.empty_like(values)
    acc = bootstrap
    for t in reversed(range(num_steps)):
        acc = rewards[t] + discounts[t] * acc
        expected[t] = acc
    torch.testing.assert_close(out.vs, expected)
    torch.testing.assert_close(out.log_rhos, torch.zeros_like(values))


def test_episode_end_stops_the_return():
    # A zero discount at step k cuts vs[:k+1] off from everything after k.
    num_steps, batch, k = 10, 2, 4
    log_rhos, discounts, rewards, values, bootstrap = random_inputs(
        num_steps, batch, torch.float64, episode_ends=False, seed=11
    )
    discounts[k] = 0.0
    before = vtrace.from_importance_weights(log_rhos, discounts, rewards, values, bootstrap)
    rewards2, values2 = rewards.clone(), values.clone()
    rewards2[k + 1 :] += 100.0
    values2[k + 1 :] -= 50.0
    after = vtrace.from_importance_weights(log_rhos, discounts, rewards2, values2, bootstrap + 7)
    torch.testing.assert_close(after.vs[: k + 1], before.vs[: k + 1])
    torch.testing.assert_close(after.pg_advantages[: k + 1], before.pg_advantages[: k + 1])
    assert not torch.allclose(after.vs[k + 1 :], before.vs[k + 1 :])


def test_vtrace_returns_carry_no_gradient():
    num_steps, batch, num_actions = 6, 2, 3
    behavior_logits = torch.randn(num_steps, batch, num_actions)
    target_logits = torch.randn(num_steps, batch, num_actions, requires_grad=True)
    values = torch.randn(num_steps, batch, requires_grad=True)
    bootstrap = torch.randn(batch, requires_grad=True)
    rewards = torch.randn(num_steps, batch, requires_grad=True)
    out = vtrace.vtrace_from_logits(
        behavior_logits,
        target_logits,
        torch.randint(num_actions, (num_steps, batch)),
        torch.full((num_steps, batch), 0.99),
        rewards,
        values,
        bootstrap,
    )
    for name, field in out._asdict().items():
        assert not field.requires_grad, name
        assert field.grad_fn is None, name

    # The baseline loss differentiates the values only, with vs a constant target:
    # d/dV 0.5 * sum((vs - V)^2) = -(vs - V).
    loss = vtrace.baseline_loss(out.vs - values)
    loss.backward()
    torch.testing.assert_close(values.grad, -(out.vs - values).detach())
    assert target_logits.grad is None and bootstrap.grad is None and rewards.grad is None


def test_policy_gradient_loss_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 0.5]], [[0.0, -1.0, 3.0]]], requires_grad=True)  # [2,1,3]
    actions = torch.tensor([[1], [2]])
    advantages = torch.tensor([[2.0], [-0.5]], requires_grad=True)
    loss = vtrace.policy_gradient_loss(logits, actions, advantages)

    expected = 0.0
    grad = np.zeros((2, 1, 3))
    for t in range(2):
        row = logits[t, 0].detach().double().numpy()
        probs = np.exp(row) / np.exp(row).sum()
        a, adv = actions[t, 0].item(), advantages[t, 0].item()
        expected += -math.log(probs[a]) * adv
        # d(-log p_a)/d logits = softmax - onehot(a)
        grad[t, 0] = (probs - np.eye(3)[a]) * adv
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    np.testing.assert_allclose(logits.grad.numpy(), grad, rtol=1e-5, atol=1e-6)
    assert advantages.grad is None  # advantages are weights, never trained


def test_baseline_loss_by_hand():
    advantages = torch.tensor([[1.0, -2.0], [0.5, 3.0]])
    assert vtrace.baseline_loss(advantages).item() == pytest.approx(0.5 * (1 + 4 + 0.25 + 9))


def test_entropy_loss_by_hand():
    logits = torch.tensor([[[0.0, 0.0]], [[math.log(3.0), 0.0]]], requires_grad=True)  # [2,1,2]
    # Uniform over 2 actions: sum p log p = -log 2; (3/4, 1/4): 3/4 log 3/4 + 1/4 log 1/4.
    expected = -math.log(2.0) + 0.75 * math.log(0.75) + 0.25 * math.log(0.25)
    loss = vtrace.entropy_loss(logits)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # The uniform policy is the entropy maximum: zero gradient there.
    torch.testing.assert_close(logits.grad[0], torch.zeros(1, 2))
    assert logits.grad[1].abs().sum() > 0


def test_losses_are_sums_not_means():
    logits = torch.randn(4, 3, 5)
    actions = torch.randint(5, (4, 3))
    adv = torch.randn(4, 3)
    doubled = vtrace.policy_gradient_loss(
        torch.cat([logits, logits]), torch.cat([actions, actions]), torch.cat([adv, adv])
    )
    torch.testing.assert_close(doubled, 2 * vtrace.policy_gradient_loss(logits, actions, adv))
    torch.testing.assert_close(
        vtrace.entropy_loss(torch.cat([logits, logits])), 2 * vtrace.entropy_loss(logits)
    )


def test_bad_inputs_raise_value_error():
    num_steps, batch = 4, 2
    inputs = random_inputs(num_steps, batch, torch.float32, False, seed=0)
    with pytest.raises(ValueError, match="bootstrap_value"):
        vtrace.from_importance_weights(*inputs[:4], torch.zeros(batch + 1))
    with pytest.raises(ValueError, match="rewards"):
        vtrace.from_importance_weights(inputs[0], inputs[1], inputs[2][:-1], inputs[3], inputs[4])
    with pytest.raises(ValueError, match="clip_rho_threshold"):
        vtrace.from_importance_weights(*inputs, clip_rho_threshold=0.0)
    with pytest.raises(ValueError, match="behavior_logits"):
        vtrace.vtrace_from_logits(
            torch.zeros(num_steps, batch, 3),
            torch.zeros(num_steps, batch, 4),
            torch.zeros(num_steps, batch, dtype=torch.int64),
            *inputs[1:],
        )
