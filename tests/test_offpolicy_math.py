"""Ape-X and R2D2's math against loop-by-loop definitions (as test_vtrace.py checks V-trace).

The references below walk transitions, windows and streams one element at a time
in float64 Python, straight from the papers' definitions; the code under test is
vectorised.
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from moolib.agents.math import apex, offpolicy, r2d2
from moolib.agents.nets import models, qmodels

NUM_ACTIONS = 4


# -- references ---------------------------------------------------------------------


def reference_n_step(rewards, dones, bootstrap, n, gamma, rescale_eps=None):
    """G_t, transition by transition: sum up to n rewards, stop after an episode's last
    reward (no bootstrap) or at the stream's end (bootstrap from the last observation)."""
    rewards, dones, bootstrap = (
        np.asarray(x, dtype=np.float64) for x in (rewards, dones, bootstrap)
    )
    num_steps, batch = rewards.shape
    out = np.zeros((num_steps, batch))
    for b in range(batch):
        for t in range(num_steps):
            total, scale, last, ended = 0.0, 1.0, t, False
            for k in range(n):
                if t + k >= num_steps:
                    break
                total += scale * rewards[t + k, b]
                scale *= gamma
                last = t + k
                if dones[t + k, b]:
                    ended = True
                    break
            if not ended:
                value = bootstrap[last, b]
                if rescale_eps is not None:
                    value = reference_inverse_h(value, rescale_eps)
                total += scale * value
            out[t, b] = reference_h(total, rescale_eps) if rescale_eps is not None else total
    return out


def reference_h(x, eps):
    return math.copysign(1.0, x) * (math.sqrt(abs(x) + 1.0) - 1.0) + eps * x if x else 0.0


def reference_inverse_h(y, eps):
    # Solve h(x) = y for x by bisection: independent of the closed form under test.
    if y == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while reference_h(hi, eps) < abs(y):
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if reference_h(mid, eps) < abs(y):
            lo = mid
        else:
            hi = mid
    return math.copysign(0.5 * (lo + hi), y)


def reference_double_q(q_online, q_target):
    q_online, q_target = np.asarray(q_online), np.asarray(q_target)
    out = np.zeros(q_online.shape[:-1])
    for index in np.ndindex(*q_online.shape[:-1]):
        best = max(range(q_online.shape[-1]), key=lambda a: q_online[index][a])
        out[index] = q_target[index][best]
    return out


def random_stream(num_steps, batch, seed, end_rate=0.25, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(num_steps, batch, generator=gen, dtype=torch.float64).to(dtype)
    dones = torch.rand(num_steps, batch, generator=gen) < end_rate
    bootstrap = torch.randn(num_steps, batch, generator=gen, dtype=torch.float64).to(dtype)
    return rewards, dones, bootstrap


def tol(dtype):
    t = 1e-5 if dtype == torch.float32 else 1e-10
    return {"rtol": t, "atol": t}


# -- n-step double-Q targets ----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("num_steps,batch", [(1, 1), (4, 3), (12, 5), (40, 2)])
def test_n_step_targets_match_definition(num_steps, batch, n, dtype):
    rewards, dones, bootstrap = random_stream(
        num_steps, batch, seed=num_steps * 10 + n, dtype=dtype
    )
    out = offpolicy.n_step_targets(rewards, dones, bootstrap, n=n, discount=0.97)
    ref = reference_n_step(rewards.numpy(), dones.numpy(), bootstrap.numpy(), n, 0.97)
    assert out.shape == (num_steps, batch) and out.dtype == dtype
    np.testing.assert_allclose(out.numpy(), ref, **tol(dtype))


@pytest.mark.parametrize("n", [3, 5])
def test_rescaled_n_step_targets_match_definition(n):
    rewards, dones, bootstrap = random_stream(20, 3, seed=n)
    rewards = rewards * 30.0  # returns where h is far from linear
    out = offpolicy.n_step_targets(
        rewards, dones, bootstrap * 5.0, n=n, discount=0.997, rescale=True, rescale_epsilon=1e-3
    )
    ref = reference_n_step(
        rewards.numpy(), dones.numpy(), bootstrap.numpy() * 5.0, n, 0.997, rescale_eps=1e-3
    )
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-9, atol=1e-9)


def test_episode_end_inside_the_window_cuts_sum_and_bootstrap():
    n, gamma = 3, 0.5
    rewards = torch.tensor([[1.0], [2.0], [4.0], [8.0], [16.0], [32.0]], dtype=torch.float64)
    dones = torch.tensor([[False], [True], [False], [False], [False], [False]])
    bootstrap = torch.tensor([[100.0], [200.0], [300.0], [400.0], [500.0], [600.0]]).double()
    out = offpolicy.n_step_targets(rewards, dones, bootstrap, n=n, discount=gamma)[:, 0]
    # t=0: r0 + g r1, then the episode ended with transition 1: no r2, no bootstrap.
    assert out[0].item() == pytest.approx(1.0 + 0.5 * 2.0)
    # t=1: the ending transition itself.
    assert out[1].item() == pytest.approx(2.0)
    # t=2: a full window in the next episode, bootstrapping from observation 5.
    assert out[2].item() == pytest.approx(4 + 0.5 * 8 + 0.25 * 16 + 0.125 * 500)
    # At the end of the stream the windows shrink and bootstrap from the last observation.
    assert out[4].item() == pytest.approx(16 + 0.5 * 32 + 0.25 * 600)
    assert out[5].item() == pytest.approx(32 + 0.5 * 600)
    transitions = offpolicy.n_step_transitions(rewards, dones, n=n, discount=gamma)
    assert transitions.steps[:, 0].tolist() == [2, 1, 3, 3, 2, 1]
    np.testing.assert_allclose(
        transitions.discounts[:, 0].numpy(), [0.0, 0.0, 0.125, 0.125, 0.25, 0.5]
    )


def test_episode_end_at_the_last_transition_drops_the_bootstrap():
    rewards = torch.ones(5, 2, dtype=torch.float64)
    dones = torch.zeros(5, 2, dtype=torch.bool)
    dones[4, 0] = True  # env 0's episode ends with the sequence's last transition
    bootstrap = torch.full((5, 2), 1000.0, dtype=torch.float64)
    out = offpolicy.n_step_targets(rewards, dones, bootstrap, n=5, discount=0.9)
    ref = reference_n_step(rewards.numpy(), dones.numpy(), bootstrap.numpy(), 5, 0.9)
    np.testing.assert_allclose(out.numpy(), ref)
    assert out[4, 0].item() == pytest.approx(1.0)
    assert out[4, 1].item() == pytest.approx(1.0 + 0.9 * 1000.0)
    assert out[0, 0].item() == pytest.approx(sum(0.9**k for k in range(5)))


def test_targets_carry_no_gradient():
    rewards, dones, bootstrap = random_stream(6, 2, seed=1)
    bootstrap.requires_grad_(True)
    out = offpolicy.n_step_targets(rewards, dones, bootstrap, n=3, discount=0.9)
    assert not out.requires_grad


@pytest.mark.parametrize("shape", [(7, 3), (5,), (2, 3, 4)])
def test_double_q_bootstrap_matches_definition(shape):
    gen = torch.Generator().manual_seed(len(shape))
    q_online = torch.randn(*shape, NUM_ACTIONS, generator=gen, dtype=torch.float64)
    q_target = torch.randn(*shape, NUM_ACTIONS, generator=gen, dtype=torch.float64)
    out = offpolicy.double_q_bootstrap(q_online, q_target)
    np.testing.assert_array_equal(out.numpy(), reference_double_q(q_online, q_target))
    # Not the target network's own max (that would be plain Q-learning).
    assert not torch.equal(out, q_target.max(-1).values)


def test_bad_stream_inputs_raise_value_error():
    rewards, dones, bootstrap = random_stream(4, 2, seed=0)
    with pytest.raises(ValueError, match="rewards and dones"):
        offpolicy.n_step_transitions(rewards, dones[:-1], n=3, discount=0.9)
    with pytest.raises(ValueError, match="n must be"):
        offpolicy.n_step_transitions(rewards, dones, n=0, discount=0.9)
    with pytest.raises(ValueError, match="bootstrap_values"):
        offpolicy.n_step_targets(rewards, dones, bootstrap[:-1], n=3, discount=0.9)


# -- value rescaling ------------------------------------------------------------------


WIDE = torch.cat(
    [
        -torch.logspace(-6, 7, 500, dtype=torch.float64),
        torch.tensor([0.0], dtype=torch.float64),
        torch.logspace(-6, 7, 500, dtype=torch.float64),
    ]
)


@pytest.mark.parametrize("eps", [1e-3, 1e-2])
def test_value_rescale_matches_the_papers_formula(eps):
    out = offpolicy.value_rescale(WIDE, eps)
    ref = [reference_h(x, eps) for x in WIDE.tolist()]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12, atol=1e-12)
    # h(x) = sign(x)(sqrt(|x|+1)-1) + eps x at a few points worked by hand.
    assert offpolicy.value_rescale(torch.tensor(3.0), 1e-3).item() == pytest.approx(1.003)
    assert offpolicy.value_rescale(torch.tensor(-8.0), 1e-3).item() == pytest.approx(-2.008)


@pytest.mark.parametrize("eps", [1e-3, 1e-2])
def test_inverse_value_rescale_is_exact(eps):
    back = offpolicy.inverse_value_rescale(offpolicy.value_rescale(WIDE, eps), eps)
    np.testing.assert_allclose(back.numpy(), WIDE.numpy(), rtol=1e-5, atol=1e-5)
    # And the other way round, against an inverse found by bisection.
    ys = offpolicy.value_rescale(WIDE, eps)[::50]
    out = offpolicy.inverse_value_rescale(ys, eps)
    ref = [reference_inverse_h(y, eps) for y in ys.tolist()]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6, atol=1e-6)
    forward_again = offpolicy.value_rescale(offpolicy.inverse_value_rescale(ys, eps), eps)
    np.testing.assert_allclose(forward_again.numpy(), ys.numpy(), rtol=1e-5, atol=1e-5)


def test_value_rescale_round_trip_in_float32():
    x = torch.linspace(-1e4, 1e4, 2001, dtype=torch.float32)
    back = offpolicy.inverse_value_rescale(offpolicy.value_rescale(x))
    np.testing.assert_allclose(back.numpy(), x.numpy(), rtol=1e-5, atol=1e-3)


# -- importance weights, epsilons ----------------------------------------------------


def test_importance_weights_match_definition():
    gen = torch.Generator().manual_seed(0)
    probabilities = torch.rand(16, generator=gen, dtype=torch.float64) * 1e-4 + 1e-7
    size, beta = 100_000, 0.4
    out = apex_weights = offpolicy.importance_weights(probabilities, size, beta)
    raw = [(size * p) ** -beta for p in probabilities.tolist()]
    ref = [w / max(raw) for w in raw]
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12)
    assert apex_weights.max().item() == pytest.approx(1.0)
    # The least likely item gets the largest weight.
    assert out.argmax() == probabilities.argmin()
    torch.testing.assert_close(
        offpolicy.importance_weights(probabilities, size, 0.0), torch.ones(16, dtype=torch.float64)
    )
    assert offpolicy.importance_weights(probabilities.float(), size, beta).dtype == torch.float32
    with pytest.raises(ValueError, match="positive"):
        offpolicy.importance_weights(torch.tensor([0.5, 0.0]), 2, 0.4)


def test_epsilon_schedule():
    assert apex.epsilon_schedule(1).tolist() == [0.4]
    eps = apex.epsilon_schedule(8, 0.4, 7.0)
    assert eps.shape == (8,)
    assert eps[0].item() == pytest.approx(0.4)  # eps^(1 + 0)
    assert eps[7].item() == pytest.approx(0.4**8)  # eps^(1 + alpha)
    for i in range(8):
        assert eps[i].item() == pytest.approx(0.4 ** (1 + 7.0 * i / 7))
    assert (eps[1:] < eps[:-1]).all()  # decreasing: a spread from exploring to greedy
    with pytest.raises(ValueError, match="num_actors"):
        apex.epsilon_schedule(0)


def test_epsilon_greedy_explores_at_its_rate():
    q = torch.zeros(20_000, NUM_ACTIONS)
    q[:, 2] = 1.0
    eps = torch.full((20_000,), 0.4)
    eps[:10_000] = 0.0
    actions = offpolicy.epsilon_greedy(q, eps, torch.Generator().manual_seed(0))
    assert (actions[:10_000] == 2).all()
    # Random with probability 0.4, and a random action is the greedy one 1 time in 4.
    off_greedy = (actions[10_000:] != 2).float().mean().item()
    assert off_greedy == pytest.approx(0.4 * 3 / 4, abs=0.02)


# -- networks -------------------------------------------------------------------------


def test_dueling_head_identities():
    torch.manual_seed(0)
    for hidden in (None, 16):
        head = qmodels.DuelingHead(8, NUM_ACTIONS, hidden)
        features = torch.randn(5, 3, 8)
        q = head(features)
        value, advantage = head.streams(features)
        assert q.shape == (5, 3, NUM_ACTIONS)
        # The mean over actions is the value; differences between actions are the advantages'.
        torch.testing.assert_close(q.mean(-1), value.squeeze(-1))
        torch.testing.assert_close(
            q - q.mean(-1, keepdim=True), advantage - advantage.mean(-1, keepdim=True)
        )
        # A constant moved into every advantage changes nothing (identifiability).
        last = head.advantage if hidden is None else head.advantage[-1]
        with torch.no_grad():
            last.bias += 3.0
        torch.testing.assert_close(head(features), q)


def test_torsos_are_the_actor_critic_networks_own():
    for network, shape in (
        ("impala_deep", (3, 36, 36)),
        ("impala_shallow", (3, 36, 36)),
        ("mlp", (5,)),
    ):
        torch.manual_seed(0)
        actor_critic = models.create_model(shape, NUM_ACTIONS, network=network, hidden_size=32)
        torso = qmodels.create_torso(shape, network=network, hidden_size=32)
        # Same layers (one definition), same parameter names and shapes.
        assert {k: v.shape for k, v in torso.layers.state_dict().items()} == {
            k: v.shape for k, v in actor_critic.torso.state_dict().items()
        }
        assert torso.output_size == 32
        torso.layers.load_state_dict(actor_critic.torso.state_dict())
        if len(shape) == 3:
            state = torch.randint(0, 256, (6, *shape), dtype=torch.uint8)
        else:
            state = torch.randn(6, *shape)
        seen = []
        actor_critic.torso.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out))
        inputs = {
            "state": state[None],
            "reward": torch.zeros(1, 6),
            "done": torch.zeros(1, 6, dtype=torch.bool),
            "prev_action": torch.zeros(1, 6, dtype=torch.int64),
        }
        actor_critic(inputs)
        torch.testing.assert_close(torso(state), seen[0])
    assert qmodels.create_torso((3, 36, 36), network="impala_deep").observation_scale == 255.0


class CustomTorso(torch.nn.Module):
    """A torso defined elsewhere: anything with output_size and observation_shape."""

    def __init__(self) -> None:
        super().__init__()
        self.observation_shape = (2, 3)
        self.output_size = 7
        self.linear = torch.nn.Linear(6, 7)

    def forward(self, x):
        return self.linear(x.flatten(1).float())


def test_q_networks_take_any_torso_and_keep_shapes():
    net = qmodels.DuelingQNet(CustomTorso(), NUM_ACTIONS, head_hidden_size=8)
    assert net(torch.randn(5, 2, 3)).shape == (5, NUM_ACTIONS)
    assert net(torch.randn(4, 5, 2, 3)).shape == (4, 5, NUM_ACTIONS)
    with pytest.raises(ValueError, match="end in shape"):
        net(torch.randn(5, 3, 2))
    rnn = qmodels.RecurrentQNet(CustomTorso(), NUM_ACTIONS, lstm_size=16)
    q, (h, c) = rnn(make_inputs((2, 3), 6, 3), ())
    assert q.shape == (6, 3, NUM_ACTIONS) and h.shape == c.shape == (1, 3, 16)
    atari = qmodels.DuelingQNet(qmodels.create_torso((4, 84, 84), network="impala_shallow"), 6)
    assert atari(torch.zeros(2, 4, 84, 84, dtype=torch.uint8)).shape == (2, 6)


def make_inputs(shape, num_steps, batch, seed=0, done=None):
    gen = torch.Generator().manual_seed(seed)
    if done is None:
        done = torch.zeros(num_steps, batch, dtype=torch.bool)
    return {
        "state": torch.randn(num_steps, batch, *shape, generator=gen),
        "reward": torch.randn(num_steps, batch, generator=gen),
        "done": done,
        "prev_action": torch.randint(NUM_ACTIONS, (num_steps, batch), generator=gen),
    }


def slice_time(inputs, start, stop=None):
    return {k: v[start:stop] for k, v in inputs.items()}


def recurrent_net(seed=0, observation_shape=(5,)):
    torch.manual_seed(seed)
    torso = qmodels.create_torso(observation_shape, network="mlp", hidden_size=16)
    return qmodels.RecurrentQNet(torso, NUM_ACTIONS, lstm_size=12, head_hidden_size=8)


def test_recurrent_q_net_steps_equal_an_unroll_and_reset_at_done():
    net = recurrent_net()
    done = torch.zeros(7, 2, dtype=torch.bool)
    done[3, 0] = True
    inputs = make_inputs((5,), 7, 2, seed=1, done=done)
    with torch.no_grad():
        _, warm = net(make_inputs((5,), 4, 2, seed=2), ())
        whole, final = net(inputs, warm)
        state, steps = warm, []
        for t in range(7):
            q, state = net(slice_time(inputs, t, t + 1), state)
            steps.append(q)
        fresh, _ = net(slice_time(inputs, 3), ())
    torch.testing.assert_close(torch.cat(steps), whole)
    for a, b in zip(state, final, strict=True):
        torch.testing.assert_close(a, b)
    # Env 0 starts anew at step 3 whatever it remembered; env 1 carries its memory on.
    torch.testing.assert_close(whole[3:, 0], fresh[:, 0])
    assert not torch.allclose(whole[3:, 1], fresh[:, 1])


# -- burn-in --------------------------------------------------------------------------


def test_burn_in_state_equals_unrolling_and_outputs_equal_the_full_unroll():
    net = recurrent_net()
    inputs = make_inputs((5,), 10, 3, seed=3)
    with torch.no_grad():
        _, stored = net(make_inputs((5,), 5, 3, seed=4), ())
        full, _ = net(inputs, stored)
        _, unrolled_state = net(slice_time(inputs, 0, 4), stored)
    q, state = r2d2.burn_in_unroll(net, inputs, stored, burn_in=4)
    assert q.shape == (6, 3, NUM_ACTIONS)
    for a, b in zip(state, unrolled_state, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(q.detach(), full[4:])
    # The burn-in refreshes the state: it is not the stored one any more.
    assert not torch.allclose(state[0], stored[0])


def test_no_gradient_flows_from_the_burn_in_steps():
    burn_in = 4
    net = recurrent_net()
    inputs = make_inputs((5,), 10, 3, seed=5)
    stored = net.initial_state(3)
    q, state = r2d2.burn_in_unroll(net, inputs, stored, burn_in)
    assert not state[0].requires_grad and not state[1].requires_grad
    # A loss on the steps after burn-in trains the network ...
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(0))
    (q * weights).sum().backward()
    grads = {k: p.grad.clone() for k, p in net.named_parameters()}
    assert all(g.abs().sum() > 0 for g in grads.values())
    # ... with exactly the gradient of an unroll of those steps from a constant state:
    # nothing flows back through the burn-in's computation of that state.
    net.zero_grad()
    constant = tuple(s.detach().clone() for s in state)
    q2, _ = net(slice_time(inputs, burn_in), constant)
    (q2 * weights).sum().backward()
    for k, p in net.named_parameters():
        torch.testing.assert_close(p.grad, grads[k])
    # Without the no_grad, the burn-in steps would add gradient (so the check above can fail).
    net.zero_grad()
    _, live_state = net(slice_time(inputs, 0, burn_in), stored)
    q3, _ = net(slice_time(inputs, burn_in), live_state)
    (q3 * weights).sum().backward()
    assert any(not torch.allclose(p.grad, grads[k]) for k, p in net.named_parameters())
    # And a loss on the burn-in steps alone has nothing to differentiate.
    net.zero_grad()
    with torch.no_grad():
        burn_q, _ = net(slice_time(inputs, 0, burn_in), stored)
    assert not burn_q.requires_grad


# -- sequence priorities -------------------------------------------------------------


def reference_sequence_priority(errors, mask, eta):
    out = []
    for b in range(errors.shape[1]):
        valid = [abs(errors[t, b]) for t in range(errors.shape[0]) if mask[t, b]]
        out.append(eta * max(valid) + (1 - eta) * sum(valid) / len(valid) if valid else 0.0)
    return out


def test_sequence_priorities_match_definition_with_masking():
    gen = torch.Generator().manual_seed(0)
    errors = torch.randn(12, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(12, 6, generator=gen) < 0.7
    mask[:, 4] = False  # no valid step at all
    mask[:, 5] = True
    errors[~mask] = 1e6  # a masked error must count for nothing, even the largest
    out = r2d2.sequence_priorities(errors, mask, eta=0.9)
    ref = reference_sequence_priority(errors.numpy(), mask.numpy(), 0.9)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-12)
    assert out[4].item() == 0.0
    # eta = 1 is the max, eta = 0 the mean.
    col = errors[:, 5].abs()
    assert r2d2.sequence_priorities(errors, mask, 1.0)[5].item() == pytest.approx(col.max().item())
    assert r2d2.sequence_priorities(errors, mask, 0.0)[5].item() == pytest.approx(col.mean().item())


# -- sequence splitting --------------------------------------------------------------


def reference_sequences(dones, length, overlap, burn_in):
    """Every sequence of a [T, B] stream with episode starts `dones`, walked episode by
    episode: {(env, first global step): real steps}, and the ones still open."""
    num_steps, batch = dones.shape
    stride = length - overlap
    emitted = {}
    for b in range(batch):
        starts = [0] + [t for t in range(1, num_steps) if dones[t, b]]
        for i, e0 in enumerate(starts):
            boundary = starts[i + 1] if i + 1 < len(starts) else None
            s = e0
            while True:
                if boundary is not None and s >= boundary:
                    break
                if boundary is not None and s + length - 1 >= boundary:
                    real = boundary - s + 1  # up to and including the boundary step
                    if real >= burn_in + 2:
                        emitted[(b, s)] = real
                elif s + length - 1 <= num_steps - 1:
                    emitted[(b, s)] = length
                else:
                    break  # not complete yet
                s += stride
    return emitted


def run_splitter(dones, length, overlap, burn_in, hidden=3):
    num_steps, batch = dones.shape
    splitter = r2d2.SequenceSplitter(batch, length, overlap, burn_in)
    got = {}
    for t in range(num_steps):
        step = {
            "state": torch.stack([torch.full((2,), 1000.0 * b + t) for b in range(batch)]),
            "reward": torch.arange(batch, dtype=torch.float32) + t,
            "done": dones[t].clone(),
            "prev_action": torch.full((batch,), t % NUM_ACTIONS),
            "action": torch.full((batch,), (t + 1) % NUM_ACTIONS),
            "t": torch.full((batch,), t),
        }
        # A recognisable state per step and env: h = t + b/10, c = -h.
        h = (
            (t + torch.arange(batch, dtype=torch.float32) / 10)
            .view(1, batch, 1)
            .expand(1, batch, hidden)
        )
        out = splitter.add(step, (h.clone(), -h.clone()))
        if out is None:
            continue
        k = out["env"].shape[0]
        assert out["mask"].shape == (k, length)
        for i in range(k):
            b = int(out["env"][i])
            first = int(out["steps"]["t"][i, 0])
            real = int(out["mask"][i].sum())
            assert (b, first) not in got
            got[(b, first)] = real
            mask = out["mask"][i]
            # The mask is a prefix; the real steps are the stream's, in order.
            assert mask[:real].all() and not mask[real:].any()
            ts = out["steps"]["t"][i, :real]
            assert ts.tolist() == list(range(first, first + real))
            assert out["steps"]["state"][i, :real, 0].tolist() == [
                1000.0 * b + x for x in ts.tolist()
            ]
            assert (
                out["steps"]["done"][i, :real].tolist() == dones[first : first + real, b].tolist()
            )
            # Padding: zeros, and done so that nothing bootstraps through it.
            assert not out["steps"]["state"][i, real:].any()
            assert not out["steps"]["t"][i, real:].any()
            assert out["steps"]["done"][i, real:].all()
            # The stored state is the one the first step was acted with.
            torch.testing.assert_close(out["core"][0][i], torch.full((hidden,), first + b / 10))
            torch.testing.assert_close(out["core"][1][i], torch.full((hidden,), -(first + b / 10)))
    return got


@pytest.mark.parametrize(
    "length,overlap,burn_in", [(8, 4, 0), (8, 4, 3), (6, 0, 0), (7, 5, 2), (80, 40, 40)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_sequence_splitting_matches_reference(length, overlap, burn_in, seed):
    num_steps, batch = max(60, 5 * length), 4
    gen = torch.Generator().manual_seed(seed)
    # Episodes of varied lengths: some shorter than a sequence, some much longer.
    dones = torch.rand(num_steps, batch, generator=gen) < (3.0 / length)
    dones[:, 3] = False  # one env never ends an episode
    dones[0] = True
    got = run_splitter(dones, length, overlap, burn_in)
    assert got == reference_sequences(dones.numpy(), length, overlap, burn_in)
    assert any(real < length for real in got.values())  # some padded ones
    assert sum(1 for (b, _) in got if b == 3) >= 2  # overlapping full ones


def test_sequence_splitting_by_hand():
    # One env, length 6, overlap 3; episode starts at steps 0 and 8.
    dones = torch.zeros(16, 1, dtype=torch.bool)
    dones[0, 0] = dones[8, 0] = True
    got = run_splitter(dones, 6, 3, burn_in=0)
    # Episode 1 (steps 0..7, boundary 8): [0..5] full; [3..8] ends on the boundary (full);
    # [6..8] padded. Episode 2 from 8: [8..13] full, [11..16) still open.
    assert got == {(0, 0): 6, (0, 3): 6, (0, 6): 3, (0, 8): 6}
    # With burn-in 1, the 3-step sequence keeps one transition after the burn-in.
    assert run_splitter(dones, 6, 3, burn_in=1)[(0, 6)] == 3
    assert (0, 6) not in run_splitter(dones, 6, 3, burn_in=2)


def test_sequence_splitter_rejects_bad_settings():
    with pytest.raises(ValueError, match="overlap"):
        r2d2.SequenceSplitter(2, 8, 8)
    with pytest.raises(ValueError, match="burn_in"):
        r2d2.SequenceSplitter(2, 8, 4, burn_in=7)


# -- the Ape-X loss and the actors' priorities --------------------------------------------


def test_apex_initial_priorities_match_definition():
    gen = torch.Generator().manual_seed(0)
    num_steps, batch = 9, 3
    q = torch.randn(num_steps + 1, batch, NUM_ACTIONS, generator=gen, dtype=torch.float64)
    actions = torch.randint(NUM_ACTIONS, (num_steps, batch), generator=gen)
    rewards, dones, _ = random_stream(num_steps, batch, seed=2, end_rate=0.3)
    out = apex.initial_priorities(q, actions, rewards, dones, n=3, discount=0.99)
    # The actor's own network is online and target: the bootstrap is max_a Q(s', a).
    bootstrap = q[1:].max(-1).values.numpy()
    targets = reference_n_step(rewards.numpy(), dones.numpy(), bootstrap, 3, 0.99)
    ref = np.zeros((num_steps, batch))
    for t in range(num_steps):
        for b in range(batch):
            ref[t, b] = abs(targets[t, b] - q[t, b, actions[t, b]].item())
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-10)


def test_apex_loss_matches_definition_and_trains_only_the_online_q():
    torch.manual_seed(0)
    torso = qmodels.create_torso((5,), network="mlp", hidden_size=16)
    online = qmodels.DuelingQNet(torso, NUM_ACTIONS, head_hidden_size=8)
    target = copy.deepcopy(online)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.1 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(1)
    batch_size = 8
    rewards, dones, _ = random_stream(3, batch_size, seed=3)
    transitions = offpolicy.n_step_transitions(rewards.float(), dones, n=3, discount=0.99)
    batch = {
        "state": torch.randn(batch_size, 5, generator=gen),
        "next_state": torch.randn(batch_size, 5, generator=gen),
        "action": torch.randint(NUM_ACTIONS, (batch_size,), generator=gen),
        "return": transitions.returns[0],
        "discount": transitions.discounts[0],
    }
    weights = offpolicy.importance_weights(torch.rand(batch_size, generator=gen) + 0.1, 1000, 0.4)
    out = apex.loss(online, target, batch, weights)

    with torch.no_grad():
        q, q_next, q_target_next = (
            online(batch["state"]),
            online(batch["next_state"]),
            target(batch["next_state"]),
        )
    ref_loss, ref_delta = 0.0, []
    for i in range(batch_size):
        best = int(q_next[i].argmax())
        g = batch["return"][i].item() + batch["discount"][i].item() * q_target_next[i, best].item()
        delta = g - q[i, batch["action"][i]].item()
        ref_delta.append(delta)
        ref_loss += weights[i].item() * 0.5 * delta**2 / batch_size
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-5)
    np.testing.assert_allclose(out.td_errors.numpy(), ref_delta, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.priorities.numpy(), np.abs(ref_delta), rtol=1e-5, atol=1e-6)
    assert not out.priorities.requires_grad

    out.loss.backward()
    assert all(p.grad is None for p in target.parameters())
    # d loss / d Q(s_i, a_i) = -w_i delta_i / B, and nothing through the next state's Q.
    q_leaf = online(batch["state"]).detach().requires_grad_(True)
    delta = apex.td_errors(
        q_leaf, batch["action"], batch["return"], batch["discount"], q_next, q_target_next
    )
    (weights * 0.5 * delta.pow(2)).mean().backward()
    expected = torch.zeros(batch_size, NUM_ACTIONS)
    for i in range(batch_size):
        expected[i, batch["action"][i]] = -weights[i] * ref_delta[i] / batch_size
    torch.testing.assert_close(q_leaf.grad, expected, rtol=1e-4, atol=1e-6)


# -- the R2D2 loss --------------------------------------------------------------------


def make_sequences(length, batch, hidden, seed, ends=None):
    gen = torch.Generator().manual_seed(seed)
    done = torch.zeros(batch, length, dtype=torch.bool)
    mask = torch.ones(batch, length, dtype=torch.bool)
    if ends:
        for b, (end, real) in ends.items():
            done[b, end] = True
            mask[b, real:] = False
            done[b, real:] = True
    steps = {
        "state": torch.randn(batch, length, 5, generator=gen),
        "reward": torch.randn(batch, length, generator=gen) * 10,
        "done": done,
        "prev_action": torch.randint(NUM_ACTIONS, (batch, length), generator=gen),
        "action": torch.randint(NUM_ACTIONS, (batch, length), generator=gen),
    }
    for b in range(batch):
        steps["state"][b, ~mask[b]] = 0.0
        steps["reward"][b, ~mask[b]] = 0.0
    core = (torch.randn(batch, hidden, generator=gen), torch.randn(batch, hidden, generator=gen))
    return {"steps": steps, "mask": mask, "core": core}


def test_r2d2_loss_matches_definition():
    length, batch, burn_in, n, gamma, eta = 14, 3, 4, 3, 0.997, 0.9
    online = recurrent_net(seed=0)
    target = recurrent_net(seed=1)
    # Env 1's episode ends inside (done at step 9), padded from step 10; env 2 is full.
    sequences = make_sequences(length, batch, 12, seed=0, ends={1: (9, 10)})
    weights = torch.tensor([1.0, 0.5, 0.25])
    out = r2d2.loss(
        online, target, sequences, weights, burn_in=burn_in, n=n, discount=gamma, eta=eta
    )

    steps = sequences["steps"]
    inputs = {k: steps[k].transpose(0, 1) for k in ("state", "reward", "done", "prev_action")}
    core = tuple(s[None] for s in sequences["core"])
    with torch.no_grad():
        q_on, _ = online(inputs, core)
        q_tg, _ = target(inputs, core)
    q_on, q_tg = q_on.double().numpy(), q_tg.double().numpy()
    ref_loss, ref_priorities = 0.0, []
    num = length - burn_in - 1
    ref_delta = np.zeros((num, batch))
    for b in range(batch):
        errors = []
        for t in range(burn_in, length - 1):
            if not sequences["mask"][b, t + 1]:
                continue
            # Walk the window: rewards of transitions t.. (they arrive with step t + 1 ..).
            total, scale, ended, last = 0.0, 1.0, False, t
            for k in range(n):
                if t + k + 1 >= length:
                    break
                total += scale * steps["reward"][b, t + k + 1].item()
                scale *= gamma
                last = t + k + 1
                if steps["done"][b, t + k + 1]:
                    ended = True
                    break
            if not ended:
                best = int(np.argmax(q_on[last, b]))
                total += scale * reference_inverse_h(float(q_tg[last, b, best]), 1e-3)
            delta = reference_h(total, 1e-3) - q_on[t, b, steps["action"][b, t]]
            ref_delta[t - burn_in, b] = delta
            errors.append(abs(delta))
            ref_loss += weights[b].item() * 0.5 * delta**2 / batch
        ref_priorities.append(eta * max(errors) + (1 - eta) * sum(errors) / len(errors))
    assert out.loss.item() == pytest.approx(ref_loss, rel=1e-4)
    np.testing.assert_allclose(out.priorities.numpy(), ref_priorities, rtol=1e-4)
    valid = out.mask.numpy()
    assert valid.shape == (num, batch) and valid[:, 0].all() and valid[:, 2].all()
    assert valid[: 9 - burn_in, 1].all() and not valid[9 - burn_in :, 1].any()
    np.testing.assert_allclose(out.td_errors.numpy()[valid], ref_delta[valid], rtol=1e-4, atol=1e-4)


def test_r2d2_loss_ignores_padding_and_trains_only_the_online_net():
    length, burn_in = 12, 4
    online = recurrent_net(seed=0)
    target = recurrent_net(seed=1)
    sequences = make_sequences(length, 2, 12, seed=1, ends={0: (7, 8)})
    weights = torch.ones(2)
    out = r2d2.loss(online, target, sequences, weights, burn_in=burn_in, n=5, discount=0.997)
    # Garbage in the padded steps changes nothing.
    noisy = copy.deepcopy(sequences)
    noisy["steps"]["state"][0, 8:] = 1e3
    noisy["steps"]["reward"][0, 8:] = -1e3
    again = r2d2.loss(online, target, noisy, weights, burn_in=burn_in, n=5, discount=0.997)
    assert again.loss.item() == pytest.approx(out.loss.item(), rel=1e-6)
    torch.testing.assert_close(again.priorities, out.priorities)
    out.loss.backward()
    assert all(p.grad is None for p in target.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in online.parameters())
