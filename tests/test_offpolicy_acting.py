"""What an off-policy actor sends to the replay, checked against loop-by-loop definitions.

``ApexActing`` turns a stream of env steps (EnvPool layout: reward and done arrive
with the next observation) into n-step transitions with initial priorities;
``R2D2Acting`` into sequences with the LSTM state they started from. Here a
deterministic stream goes through them and every item is recomputed by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
from moolib.agents.apex import ApexActing, ApexConfig
from moolib.agents.r2d2 import R2D2Acting, R2D2Config
from moolib.agents.registry import OptimizerConfig
from moolib.agents.runtime.offpolicy import make_qnet

OPT = OptimizerConfig("adam", 1e-3, 0.9, 0.999, 1e-8, 0.99, 0.0)
COMMON = dict(
    network="mlp",
    hidden_size=8,
    actor_batch_size=3,
    num_actor_batches=1,
    num_actor_cpus=1,
    batch_size=4,
    reward_clip=0.0,
    grad_norm_clipping=40.0,
    optimizer=OPT,
    actor_loops=1,
    epsilon=0.4,
    epsilon_alpha=7.0,
    weight_sync=10,
    publish_interval=1,
    target_update=10,
    replay_capacity=100,
    priority_exponent=0.6,
    importance_sampling_exponent=0.4,
    min_replay_size=1,
    samples_per_insert=0.0,
    save_replay=False,
)


def stream(steps: int, envs: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        out.append(
            {
                "state": torch.randn(envs, 4, generator=g),
                "reward": torch.randint(0, 3, (envs,), generator=g).float(),
                # The first step starts every episode, as EnvPool's reset step does.
                "done": torch.ones(envs, dtype=torch.bool)
                if t == 0
                else torch.rand(envs, generator=g) < 0.15,
            }
        )
    return out


@pytest.mark.parametrize("n", [1, 3])
def test_apex_transitions_and_priorities_match_their_definitions(n):
    gamma, buffer = 0.9, 5
    cfg = ApexConfig(
        name="apex",
        use_lstm=False,
        discounting=gamma,
        n_step=n,
        actor_buffer_size=buffer,
        **COMMON,
    )
    torch.manual_seed(0)
    model = make_qnet(cfg, (4,), 2)
    envs = 3
    # Greedy actors: actions are argmax Q, so the test knows them.
    acting = ApexActing(cfg, torch.zeros(envs))
    steps = stream(3 * buffer + n + 2, envs)
    sent = []
    actions = []
    for step in steps:
        action, out = acting.step(step, model)
        actions.append(action.clone())
        if out is not None:
            sent.append(out)
    # Each flush sends buffer transitions per env, consecutive, none twice or lost.
    assert len(sent) == (len(steps) - n) // buffer
    with torch.no_grad():
        q = [model(s["state"]) for s in steps]
    for flush, (items, priorities) in enumerate(sent):
        assert items["state"].shape == (buffer * envs, 4)
        for i in range(buffer * envs):
            t, b = flush * buffer + i // envs, i % envs
            # Loop-by-loop n-step return from observation t.
            ret, disc, m = 0.0, 1.0, 0
            for k in range(n):
                r, d = float(steps[t + k + 1]["reward"][b]), bool(steps[t + k + 1]["done"][b])
                ret += disc * r
                m += 1
                disc *= gamma
                if d:
                    disc = 0.0
                    break
            assert torch.equal(items["state"][i], steps[t]["state"][b])
            assert int(items["action"][i]) == int(actions[t][b])
            assert math.isclose(float(items["return"][i]), ret, rel_tol=1e-5, abs_tol=1e-6)
            assert math.isclose(float(items["discount"][i]), disc, rel_tol=1e-5, abs_tol=1e-7)
            assert torch.equal(items["next_state"][i], steps[t + m]["state"][b])
            nxt = q[t + m][b]
            target = ret + disc * float(nxt[int(nxt.argmax())])
            taken = float(q[t][b][int(actions[t][b])])
            assert math.isclose(
                float(priorities[i]), abs(target - taken), rel_tol=1e-4, abs_tol=1e-5
            )


def test_r2d2_sequences_keep_the_state_they_started_from():
    cfg = R2D2Config(
        name="r2d2",
        use_lstm=True,
        discounting=0.99,
        n_step=2,
        sequence_length=6,
        overlap=3,
        burn_in=1,
        priority_eta=0.9,
        value_rescale_epsilon=1e-3,
        **COMMON,
    )
    torch.manual_seed(0)
    model = make_qnet(cfg, (4,), 2)
    envs = 3
    acting = R2D2Acting(cfg, torch.zeros(envs), model)
    steps = stream(40, envs, seed=1)
    cores, sent = [], []
    for step in steps:
        cores.append(tuple(s.clone() for s in acting.core))
        _, out = acting.step(step, model)
        if out is not None:
            sent.append((len(cores) - 1, out))
    assert sent
    for _, (items, priorities) in sent:
        assert items["steps"]["state"].shape[1:] == (6, 4)
        assert priorities.shape == (items["mask"].shape[0],)
        assert bool((priorities >= 0).all()) and bool(torch.isfinite(priorities).all())
        for k in range(items["mask"].shape[0]):
            # The stored state is the one some step of this env was acted on with,
            # at the sequence's first step.
            first = items["steps"]["state"][k, 0]
            matches = [
                (t, b)
                for t, s in enumerate(steps)
                for b in range(envs)
                if torch.equal(s["state"][b], first)
            ]
            assert len(matches) == 1
            t, b = matches[0]
            h, c = items["core"]
            assert torch.equal(h[k], cores[t][0][0, b]) and torch.equal(c[k], cores[t][1][0, b])


def test_a_restarted_actor_loop_counts_once():
    """The learner's ``actors`` column counts actor loops by their index in the run: a
    loop restarted in a new process (a new Rpc name) replaces its predecessor at once
    instead of counting beside it until that one goes stale."""
    from moolib.agents.runtime.offpolicy import _Reports

    reports = _Reports()
    reports.add("learner-actor0-100", 0, 10, [])
    reports.add("learner-actor0-100", 1, 10, [])  # a second loop of the same process
    reports.add("learner-actor1-101", 2, 10, [])
    assert reports.take()[1] == 3
    reports.add("learner-actor0-200", 0, 10, [])  # actor process 0, restarted
    reports.add("learner-actor0-200", 1, 10, [])
    assert reports.take()[1] == 3
    assert reports.take_steps() == 50
