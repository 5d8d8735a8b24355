"""The agents' networks: shapes, the LSTM core's state handling, gradients, action choice."""

from __future__ import annotations

import pytest
import torch
from moolib.agents.nets import models

NUM_ACTIONS = 4
# Small frames and widths keep the equivalence tests fast; the shape test uses 84x84.
SMALL = {
    "impala_deep": (3, 36, 36),
    "impala_shallow": (3, 36, 36),
    "mlp": (5,),
    "tiny": (3, 36, 36),
}
FULL = {
    "impala_deep": (4, 84, 84),
    "impala_shallow": (4, 84, 84),
    "mlp": (4,),
    "tiny": (4, 84, 84),
}
NETWORK_IDS = list(SMALL)


def make_inputs(observation_shape, num_steps, batch, seed=0, done=None):
    gen = torch.Generator().manual_seed(seed)
    if len(observation_shape) == 3:
        state = torch.randint(
            0, 256, (num_steps, batch, *observation_shape), generator=gen, dtype=torch.uint8
        )
    else:
        state = torch.randn(num_steps, batch, *observation_shape, generator=gen)
    if done is None:
        done = torch.zeros(num_steps, batch, dtype=torch.bool)
    return {
        "state": state,
        "reward": torch.randn(num_steps, batch, generator=gen),
        "done": done,
        "prev_action": torch.randint(NUM_ACTIONS, (num_steps, batch), generator=gen),
    }


def slice_time(inputs, start, stop=None):
    stop = start + 1 if stop is None else stop
    return {key: value[start:stop] for key, value in inputs.items()}


def make_model(network, use_lstm, hidden_size=32, observation_shape=None, seed=0):
    torch.manual_seed(seed)
    shape = SMALL[network] if observation_shape is None else observation_shape
    return models.create_model(
        shape, NUM_ACTIONS, network=network, use_lstm=use_lstm, hidden_size=hidden_size
    )


def warm_state(model, observation_shape, batch):
    """A non-zero core state, as after some unrolls (so resets are observable)."""
    with torch.no_grad():
        _, state = model(
            make_inputs(observation_shape, 3, batch, seed=99), model.initial_state(batch)
        )
    return state


@pytest.mark.parametrize("use_lstm", [False, True], ids=["ff", "lstm"])
@pytest.mark.parametrize("network", NETWORK_IDS)
def test_output_shapes_and_dtypes(network, use_lstm):
    num_steps, batch = 3, 2
    shape = FULL[network]
    model = models.create_model(shape, NUM_ACTIONS, network=network, use_lstm=use_lstm)
    hidden = {"mlp": 64, "tiny": 16}.get(network, 256)  # the networks' defaults
    state = model.initial_state(batch)
    if use_lstm:
        assert len(state) == 2
        for s in state:
            assert s.shape == (1, batch, hidden) and s.dtype == torch.float32
            assert not s.any()
    else:
        assert state == ()

    inputs = make_inputs(shape, num_steps, batch)
    if network == "mlp":
        assert inputs["state"].dtype == torch.float32
    else:
        assert inputs["state"].dtype == torch.uint8
    outputs, new_state = model(inputs, state)
    assert set(outputs) == {"policy_logits", "baseline", "action"}
    assert outputs["policy_logits"].shape == (num_steps, batch, NUM_ACTIONS)
    assert outputs["policy_logits"].dtype == torch.float32
    assert outputs["baseline"].shape == (num_steps, batch)
    assert outputs["baseline"].dtype == torch.float32
    assert outputs["action"].shape == (num_steps, batch)
    assert outputs["action"].dtype == torch.int64
    assert ((outputs["action"] >= 0) & (outputs["action"] < NUM_ACTIONS)).all()
    assert len(new_state) == len(state)
    for old, new in zip(state, new_state, strict=True):
        assert new.shape == old.shape


@pytest.mark.parametrize("use_lstm", [False, True], ids=["ff", "lstm"])
@pytest.mark.parametrize("network", NETWORK_IDS)
def test_steps_one_by_one_equal_one_unroll(network, use_lstm):
    num_steps, batch = 5, 2
    shape = SMALL[network]
    model = make_model(network, use_lstm).eval()
    done = torch.zeros(num_steps, batch, dtype=torch.bool)
    done[2, 1] = True  # an episode end inside the unroll, for one env only
    inputs = make_inputs(shape, num_steps, batch, seed=1, done=done)
    start = warm_state(model, shape, batch)

    with torch.no_grad():
        whole, whole_state = model(inputs, start)
        state = start
        steps = []
        for t in range(num_steps):
            out, state = model(slice_time(inputs, t), state)
            steps.append(out)
    for key in ("policy_logits", "baseline", "action"):
        stepped = torch.cat([out[key] for out in steps])
        torch.testing.assert_close(stepped, whole[key], rtol=1e-5, atol=1e-5)
    for a, b in zip(state, whole_state, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("network", NETWORK_IDS)
def test_lstm_state_is_reset_at_done(network):
    num_steps, batch, k = 6, 2, 3
    shape = SMALL[network]
    model = make_model(network, use_lstm=True).eval()
    done = torch.zeros(num_steps, batch, dtype=torch.bool)
    done[k, 0] = True  # env 0 starts a new episode at step k; env 1 carries on
    inputs = make_inputs(shape, num_steps, batch, seed=2, done=done)
    start = warm_state(model, shape, batch)
    assert any(s.abs().sum() > 0 for s in start)

    with torch.no_grad():
        carried, _ = model(inputs, start)
        fresh, _ = model(slice_time(inputs, k, num_steps), model.initial_state(batch))
    for key in ("policy_logits", "baseline"):
        # After the done, env 0 behaves as if started from scratch ...
        torch.testing.assert_close(carried[key][k:, 0], fresh[key][:, 0], rtol=1e-5, atol=1e-5)
        # ... while env 1 still remembers its past (the state does matter).
        assert not torch.allclose(carried[key][k:, 1], fresh[key][:, 1], atol=1e-6)


@pytest.mark.parametrize("network", NETWORK_IDS)
def test_done_at_first_step_ignores_the_given_state(network):
    num_steps, batch = 3, 2
    shape = SMALL[network]
    model = make_model(network, use_lstm=True).eval()
    done = torch.zeros(num_steps, batch, dtype=torch.bool)
    done[0] = True
    inputs = make_inputs(shape, num_steps, batch, seed=3, done=done)
    with torch.no_grad():
        warm, _ = model(inputs, warm_state(model, shape, batch))
        fresh, _ = model(inputs, model.initial_state(batch))
        # () stands for the initial state.
        implicit, _ = model(inputs, ())
    torch.testing.assert_close(warm["policy_logits"], fresh["policy_logits"])
    torch.testing.assert_close(implicit["policy_logits"], fresh["policy_logits"])


@pytest.mark.parametrize("use_lstm", [False, True], ids=["ff", "lstm"])
@pytest.mark.parametrize("network", NETWORK_IDS)
def test_gradients_reach_every_parameter(network, use_lstm):
    num_steps, batch = 3, 2
    shape = SMALL[network]
    model = make_model(network, use_lstm).train()
    inputs = make_inputs(shape, num_steps, batch, seed=4)
    outputs, _ = model(inputs, model.initial_state(batch))
    # Random weights so no parameter's gradient cancels out by symmetry.
    gen = torch.Generator().manual_seed(5)
    loss = (
        outputs["policy_logits"] * torch.randn(num_steps, batch, NUM_ACTIONS, generator=gen)
    ).sum()
    loss = loss + (outputs["baseline"] * torch.randn(num_steps, batch, generator=gen)).sum()
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("network", NETWORK_IDS)
def test_eval_mode_takes_the_argmax(network):
    model = make_model(network, use_lstm=False).eval()
    inputs = make_inputs(SMALL[network], 4, 3, seed=6)
    with torch.no_grad():
        outputs, _ = model(inputs, ())
    torch.testing.assert_close(outputs["action"], outputs["policy_logits"].argmax(-1))


def test_training_mode_samples_from_the_policy():
    model = models.MLPNet((2,), 2, hidden_size=8).train()
    with torch.no_grad():
        # A constant policy with P(action 0) = 0.7, whatever the input.
        model.policy.weight.zero_()
        model.policy.bias.copy_(torch.tensor([0.7, 0.3]).log())
    batch = 4000
    torch.manual_seed(0)
    inputs = {
        "state": torch.randn(1, batch, 2),
        "reward": torch.zeros(1, batch),
        "done": torch.zeros(1, batch, dtype=torch.bool),
        "prev_action": torch.zeros(1, batch, dtype=torch.int64),
    }
    with torch.no_grad():
        sampled, _ = model(inputs, ())
        greedy, _ = model.eval()(inputs, ())
    frequency = (sampled["action"] == 0).float().mean().item()
    assert 0.65 < frequency < 0.75
    assert (greedy["action"] == 0).all()


def test_reward_input_is_clipped():
    model = make_model("mlp", use_lstm=False).eval()
    inputs = make_inputs(SMALL["mlp"], 1, 2, seed=7)
    outputs = {}
    for reward in (1.0, 5.0, 0.5):
        inputs["reward"] = torch.full((1, 2), reward)
        with torch.no_grad():
            outputs[reward] = model(inputs, ())[0]["policy_logits"]
    torch.testing.assert_close(outputs[1.0], outputs[5.0])
    assert not torch.allclose(outputs[1.0], outputs[0.5])


@pytest.mark.parametrize("network", ["impala_deep", "impala_shallow"])
def test_impala_frames_are_scaled_to_unit_range(network):
    model = make_model(network, use_lstm=False).eval()
    inputs = make_inputs(SMALL[network], 2, 3, seed=8)
    seen = []
    model.torso.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(inputs, ())
    (torso_input,) = seen
    assert torso_input.dtype == torch.float32
    expected = inputs["state"].reshape(6, *SMALL[network]).float() / 255.0
    torch.testing.assert_close(torso_input, expected)


def test_create_model_kinds_and_errors():
    deep = models.create_model((4, 84, 84), 6, network="impala_deep")
    shallow = models.create_model((4, 84, 84), 6, network="impala_shallow", hidden_size=128)
    mlp = models.create_model((4,), 2, network="mlp", use_lstm=True)
    assert isinstance(deep, models.ImpalaNet) and deep.deep
    assert isinstance(shallow, models.ImpalaNet) and not shallow.deep
    assert shallow.policy.in_features == 128 + 1 + 6  # fc output + reward + one-hot action
    assert isinstance(mlp, models.MLPNet) and mlp.core.hidden_size == 64
    with pytest.raises(ValueError, match="unknown network 'resnet'.*impala_deep"):
        models.create_model((4, 84, 84), 6, network="resnet")
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        models.ImpalaNet((4,), 2)
