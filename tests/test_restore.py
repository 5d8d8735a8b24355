"""A resumed run acts and learns with exactly what it stopped with.

A real Trainer (V-trace on Pong's frames through real EnvPool processes, a real
broker and accumulator) learns a few steps and writes its final checkpoint; a
second Trainer over the same savedir restores it. On fixed observations, the
restored policy gives the outputs the saved model gives, and the same as the
trainer that wrote it; its optimizer holds the same state, on the parameters'
device, so the next update is the one the first trainer would have made. On
CPU, and on CUDA where a device is present (a resumed GPU run once played like
an untrained policy; docs/architecture.md, section 6). A restored trainer's envs
do not play in step (env.decorrelate_steps).
"""

from __future__ import annotations

import pytest
import torch
from moolib.agents.nets.models import create_model, resolve_network
from moolib.agents.runtime import checkpoint
from moolib.agents.runtime.onpolicy import PeerInfo, Trainer, make_envs
from moolib.launch import config as config_lib
from moolib.launch.local import EmbeddedBroker

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]

# Three updates of 2 unrolls of 4 steps; a learning rate that is not 0 by the end.
SMALL = [
    "agent=vtrace",
    "env=pong",
    "agent.actor_batch_size=2",
    "agent.num_actor_batches=2",
    "agent.num_actor_cpus=1",
    "agent.batch_size=2",
    "agent.unroll_length=4",
    "agent.virtual_batch_size=2",
    "agent.hidden_size=16",
    "total_steps=24",
    "torch_threads=1",
    "seed=1",
]


def _observations(shape: tuple[int, ...], device: str) -> dict[str, torch.Tensor]:
    """One step of 8 envs with fixed frames, rewards, episode ends and previous actions."""
    g = torch.Generator().manual_seed(7)
    batch = 8
    return {
        "state": torch.randint(0, 256, (1, batch, *shape), generator=g, dtype=torch.uint8),
        "reward": torch.tensor([[0.0, 1.0, -1.0, 0.0, 0.0, 1.0, 0.0, -1.0]]),
        "done": torch.tensor([[True, False, False, True, False, False, False, False]]),
        "prev_action": torch.randint(0, 6, (1, batch), generator=g),
    }


def _policy(model: torch.nn.Module, inputs: dict, device: str) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        out, _ = model({k: v.to(device) for k, v in inputs.items()})
    return out["policy_logits"].cpu(), out["baseline"].cpu()


def _same(a: torch.Tensor, b: torch.Tensor, device: str) -> bool:
    # CUDA kernels may pick other algorithms for the same op; the CPU's are exact.
    if device == "cpu":
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_a_restored_trainer_acts_and_steps_as_the_saved_one(compose_config, tmp_path, device):
    cfg = config_lib.prepare(compose_config(*SMALL, f"device={device}"), tmp_path)
    peer = PeerInfo(rank=0, savedir=tmp_path, logdir=tmp_path, broker="")
    broker = EmbeddedBroker()
    try:
        peer.broker = broker.address
        first = Trainer(cfg, peer)
        first.run()
        assert first.steps == 24
        second = Trainer(cfg, peer)
    finally:
        broker.close()
    assert second.steps == first.steps
    assert second.accumulator.model_version() == first.accumulator.model_version() == 3

    # The policy: the restored one against the trainer that wrote it, and against
    # the checkpoint's model built afresh on the CPU.
    saved = checkpoint.load_latest(tmp_path).state
    shape = second.model.observation_shape
    inputs = _observations(shape, device)
    fresh = create_model(
        shape,
        second.actions,
        network=resolve_network(second.agent.network, shape),
        use_lstm=second.agent.use_lstm,
        hidden_size=second.agent.hidden_size,
    )
    fresh.load_state_dict(saved["model"])
    logits, baseline = _policy(second.model, inputs, device)
    first_logits, first_baseline = _policy(first.model, inputs, device)
    fresh_logits, fresh_baseline = _policy(fresh, inputs, "cpu")
    assert next(second.model.parameters()).device.type == device
    assert _same(logits, first_logits, device) and _same(baseline, first_baseline, device)
    assert torch.allclose(logits, fresh_logits, rtol=1e-4, atol=1e-5)
    assert torch.allclose(baseline, fresh_baseline, rtol=1e-4, atol=1e-5)

    # The optimizer: every state tensor, on its parameter's device (Adam's step
    # counts stay on the CPU, as torch keeps them).
    params = list(second.model.parameters())
    before = first.optimizer.state_dict()["state"]
    after = second.optimizer.state_dict()["state"]
    assert sorted(after) == sorted(before) == list(range(len(params)))
    for i, p in enumerate(params):
        assert set(after[i]) == set(before[i]) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in after[i].items():
            assert _same(value.cpu(), before[i][key].cpu(), device), (i, key)
            if key != "step":
                assert value.device == p.device, (i, key, value.device)
        assert float(after[i]["step"]) == 3

    # The next update is the one the first trainer makes from the same gradient.
    g = torch.Generator().manual_seed(3)
    for trainer in (first, second):
        for group in trainer.optimizer.param_groups:
            group["lr"] = 1e-3
        for p in trainer.model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        g.manual_seed(3)
        trainer.optimizer.step()
    for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True):
        assert _same(a.detach().cpu(), b.detach().cpu(), device)


def test_a_trainer_that_cannot_restore_leaves_nothing_running(
    compose_config, tmp_path, monkeypatch
):
    """A savedir whose every checkpoint is damaged refuses to start (rather than
    train from scratch over them), and the env workers and the accumulator's Rpc
    it had started by then are closed, not left to the garbage collector."""
    from moolib.agents.runtime import onpolicy

    cfg = config_lib.prepare(compose_config(*SMALL, "device=cpu"), tmp_path)
    (tmp_path / "checkpoint.pt").write_bytes(b"not a checkpoint")
    pools, closed = [], []
    make_envs, close = onpolicy.make_envs, onpolicy.moolib.Accumulator.close

    def recorded_envs(cfg):
        made = make_envs(cfg)
        pools.append(made[0])
        return made

    def recorded_close(accumulator):
        closed.append(accumulator)
        close(accumulator)

    monkeypatch.setattr(onpolicy, "make_envs", recorded_envs)
    monkeypatch.setattr(onpolicy.moolib.Accumulator, "close", recorded_close)
    broker = EmbeddedBroker()
    try:
        peer = PeerInfo(rank=0, savedir=tmp_path, logdir=tmp_path, broker=broker.address)
        with pytest.raises(checkpoint.CheckpointError, match="no intact checkpoint"):
            Trainer(cfg, peer)
    finally:
        broker.close()
    assert len(pools) == 1 and pools[0]._closed
    assert len(closed) == 1
    with pytest.raises(RuntimeError):
        pools[0].step(0, torch.zeros(2, dtype=torch.int64))


# A deterministic env (a walk on a line that every reset starts at 0) under a
# deterministic policy: V-trace with 2 actor batches of 4 envs.
LINE = [
    "agent=vtrace",
    "env=gym",
    "env.id=helpers.toy_envs:LineEnv",
    "agent.actor_batch_size=4",
    "agent.num_actor_batches=2",
    "agent.num_actor_cpus=1",
    "agent.batch_size=2",
    "agent.unroll_length=6",
    "agent.virtual_batch_size=2",
    "agent.hidden_size=16",
    "torch_threads=1",
    "seed=1",
    "device=cpu",
]


@pytest.mark.parametrize("decorrelate_steps", [0, 10_000])
def test_a_restored_trainer_decorrelates_its_envs(compose_config, tmp_path, decorrelate_steps):
    """After a restore, the envs' first unrolls that reach the learner are not copies of
    each other (docs/toolkit.md, "Decorrelating the envs"), even with an env and a
    policy that leave nothing to chance; without decorrelation they are. (Two of the 8
    envs draw the same number of random steps with probability 0.3%, and then walk to
    the same place with probability about 1%.)"""
    overrides = [*LINE, f"env.decorrelate_steps={decorrelate_steps}"]
    cfg = config_lib.prepare(compose_config(*overrides, "total_steps=12"), tmp_path)
    broker = EmbeddedBroker()
    try:
        peer = PeerInfo(rank=0, savedir=tmp_path, logdir=tmp_path, broker=broker.address)
        Trainer(cfg, peer).run()
        # The policy the checkpoint holds always stays put (action 1).
        state = checkpoint.load_latest(tmp_path).state
        state["model"]["policy.weight"].zero_()
        state["model"]["policy.bias"].copy_(torch.tensor([-50.0, 50.0, -50.0]))
        checkpoint.save(tmp_path, state, state["steps"], history=0)
        # Four more updates (of 2 envs x 6 steps): they need the first unrolls of both
        # actor batches (4 envs each). With two, one unroll was enough, and under load
        # the learner finished before the other batch's unroll came.
        cfg = config_lib.prepare(compose_config(*overrides, "total_steps=60"), tmp_path)
        second = Trainer(cfg, peer)
        assert second.steps == 12
        unrolls: list[torch.Tensor] = []
        cat = second.batcher.cat

        def recorded(nest: dict) -> None:
            unrolls.append(nest["batch"]["state"].clone())
            cat(nest)

        second.batcher.cat = recorded
        second.run()
    finally:
        broker.close()
    assert second.steps == 60
    assert len(unrolls) >= 2, len(unrolls)
    # The first unroll of each actor batch: [steps, 8 envs, (position, steps)].
    first = torch.cat(unrolls[:2], dim=1)
    envs = {tuple(first[:, e].flatten().tolist()) for e in range(first.shape[1])}
    if decorrelate_steps:
        assert len(envs) == 8, first
    else:
        assert len(envs) == 1, first


@pytest.mark.parametrize(
    "env", [["env=cartpole"], ["env=breakout", "env.backend=envpool"]], ids=["gymnasium", "envpool"]
)
def test_a_backend_that_cannot_decorrelate_says_so(compose_config, tmp_path, caplog, env):
    """The envpool backend steps its envs in its own code: its run says that they start
    without env.decorrelate_steps' random actions, rather than ignoring the setting."""
    small = ["agent.actor_batch_size=2", "agent.num_actor_batches=1", "agent.num_actor_cpus=1"]
    overrides = [*env, *small, "env.decorrelate_steps=100", "device=cpu"]
    cfg = config_lib.prepare(compose_config(*overrides), tmp_path)
    with caplog.at_level("INFO", logger="moolib.agents"):
        envs, _, _ = make_envs(cfg)
    envs.close()
    said = [r.getMessage() for r in caplog.records if "decorrelate_steps" in r.getMessage()]
    assert len(said) == ("env.backend=envpool" in env), said
