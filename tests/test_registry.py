"""Agents and envs are registered parts: every config group option composes, and
every agent, env and model it names builds and takes a step.

- each ``conf/agent/*.yaml`` is a registered agent whose dataclass has exactly the
  YAML's keys; composed with a small env, the Trainer built from it (real EnvPool
  processes, a real broker and accumulator) takes one learner step;
- each env option (its files, and every Atari game ale-py knows, registered by name
  without a file each) composes, passes moolib-run's checks, and its env steps once;
- an agent defined outside the package's lists (registered, not listed) validates.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import moolib.conf
import pytest
import yaml
from helpers.toy_envs import first_action
from moolib.agents import registry
from moolib.agents.registry import (
    ActorCriticConfig,
    AgentConfig,
    agent_config,
    agent_names,
    get_agent,
)
from moolib.launch import config as config_lib
from moolib.launch.config import ConfigError
from omegaconf import OmegaConf

CONF = Path(next(iter(moolib.conf.__path__)))
AGENT_FILES = sorted(p.stem for p in (CONF / "agent").glob("*.yaml"))
ENV_FILES = sorted(p.stem for p in (CONF / "env").glob("*.yaml"))

# One learner step as small as the machinery allows: 2 envs in 2 batches, one
# worker process, learner batches of 2 unrolls of 4 steps.
TINY = [
    "agent.actor_batch_size=2",
    "agent.num_actor_batches=2",
    "agent.num_actor_cpus=1",
    "agent.batch_size=2",
    "agent.unroll_length=4",
    "agent.virtual_batch_size=2",
    "agent.hidden_size=16",
    "total_steps=1",
    "device=cpu",
    "torch_threads=1",
    "seed=1",
]


def test_every_agent_file_is_a_registered_agent_with_a_typed_config(compose_config):
    assert AGENT_FILES == agent_names()
    for name in AGENT_FILES:
        shipped = yaml.safe_load((CONF / "agent" / f"{name}.yaml").read_text())
        assert shipped["name"] == name
        spec = get_agent(name)
        assert issubclass(spec.config, AgentConfig) and callable(spec.compute_loss)
        # The dataclass documents exactly the YAML's settings.
        fields = {f.name for f in dataclasses.fields(spec.config)}
        assert fields == set(shipped), (name, fields ^ set(shipped))
        composed = compose_config(f"agent={name}", "env=cartpole")
        settings = agent_config(OmegaConf.to_container(composed.agent, resolve=True))
        assert type(settings) is spec.config
        assert settings.batch_size == composed.agent.batch_size


ONPOLICY = [a for a in AGENT_FILES if get_agent(a).runtime.name == "onpolicy"]
OFFPOLICY = [a for a in AGENT_FILES if get_agent(a).runtime.name == "offpolicy"]
# Off-policy agents: the learner's replay starts sampling at 16 items; sequences of
# 8 steps for r2d2.
TINY_OFFPOLICY = [
    "agent.actor_batch_size=2",
    "agent.num_actor_batches=2",
    "agent.num_actor_cpus=1",
    "agent.batch_size=4",
    "agent.hidden_size=16",
    "agent.min_replay_size=16",
    "agent.replay_capacity=1000",
    "agent.samples_per_insert=0",
    "device=cpu",
    "torch_threads=1",
    "seed=1",
    "log_interval=0.01",
]
SEQUENCES = ["agent.sequence_length=8", "agent.overlap=4", "agent.burn_in=2"]


@pytest.mark.parametrize("agent", OFFPOLICY)
def test_every_offpolicy_agent_builds_and_learns_from_its_actors(compose_config, agent, tmp_path):
    """The learner built from the YAML, with its actor loop as a thread (real EnvPool
    processes, a real broker, the replay served over RPC): items arrive, it samples
    them and takes learner steps with a finite loss, and actors hear the run is over."""
    from moolib.launch.local import EmbeddedBroker
    from moolib.launch.peer import make_trainer

    extra = SEQUENCES if agent == "r2d2" else []
    cfg = compose_config(
        f"agent={agent}", "env=cartpole", *TINY_OFFPOLICY, *extra, "total_steps=600"
    )
    final = config_lib.prepare(cfg, tmp_path)
    broker = EmbeddedBroker()
    try:
        learner = make_trainer(final, 0, broker.address)
        assert learner.loss_fn is get_agent(agent).compute_loss
        assert isinstance(learner.agent, get_agent(agent).config)
        learner.run()
    finally:
        broker.close()
    _, rows = _read_tsv(tmp_path / "logs.tsv")
    assert learner.steps >= 600
    assert learner.updates >= 1, rows
    losses = [r["total_loss"] for r in rows if r["total_loss"] != ""]
    assert losses and all(math.isfinite(float(v)) for v in losses), rows
    assert max(int(r["replay_size"]) for r in rows) >= 16


def _read_tsv(path: Path) -> tuple[list[str], list[dict]]:
    lines = path.read_text().splitlines()
    header = lines[0].split("\t")
    return header, [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]


# PPO: minibatches of one unroll's steps, two summed into each optimizer step.
MINIBATCHES = ["agent.num_minibatches=2"]


@pytest.mark.parametrize("agent", ONPOLICY)
def test_every_agent_builds_and_takes_a_learner_step(compose_config, agent, tmp_path):
    from moolib.agents.runtime.onpolicy import PeerInfo, Trainer
    from moolib.launch.local import EmbeddedBroker

    extra = MINIBATCHES if agent == "ppo" else []
    cfg = compose_config(f"agent={agent}", "env=cartpole", *TINY, *extra)
    final = config_lib.prepare(cfg, tmp_path)
    broker = EmbeddedBroker()
    try:
        trainer = Trainer(
            final, PeerInfo(rank=0, savedir=tmp_path, logdir=tmp_path, broker=broker.address)
        )
        assert trainer.loss_fn is get_agent(agent).compute_loss
        assert isinstance(trainer.agent, get_agent(agent).config)
        row = trainer.run()
    finally:
        broker.close()
    # One optimizer step on 2 unrolls of 4 steps, with a finite loss and gradients (its
    # learning rate, decayed linearly to total_steps=1, is 0 by then: no change to check);
    # an agent that learns from each unroll more than once counts its steps once.
    assert trainer.steps == 2 * 4 // trainer.agent.passes(), row
    assert math.isfinite(float(row["total_loss"])), row
    assert 0 < float(row["grad_norm"]) < math.inf, row


@pytest.mark.slow
def test_every_env_option_composes_and_steps(compose_config):
    from moolib.envs import ATARI_GAMES, create_env
    from moolib.envs.minatar import MINATAR_GAMES

    options = moolib.conf.group_options("env")
    assert ENV_FILES == [
        "atari",
        "cartpole",
        "cartpole-novel",
        "gym",
        "minatar",
        "mujoco",
        "pendulum",
    ]
    # Every game ale-py knows is an option by name; no file each.
    assert set(ATARI_GAMES) <= set(options) and len(ATARI_GAMES) > 50
    needs_noop_max_0 = []
    for option in options:
        cfg = compose_config(f"env={option}", "agent=a2c")
        config_lib.validate(cfg)
        name = cfg.env.name
        defaults = {
            "atari": "breakout",
            "minatar": "minatar-breakout",
            "mujoco": "mujoco-half_cheetah",
            "gym": "gym:Acrobot-v1",
        }
        assert name == defaults.get(option, option)
        env_options = OmegaConf.to_container(cfg.env.options, resolve=True)
        try:
            env = create_env(name, **env_options)
        except ValueError as e:
            # A few ROMs (backgammon) have no NOOP action for the no-op starts; with
            # env.options.noop_max=0 they build (moolib-run's pre-flight names the key).
            assert "NOOP" in str(e), (option, e)
            needs_noop_max_0.append(option)
            env = create_env(name, **{**env_options, "noop_max": 0})
        try:
            env.reset(seed=0)
            _, reward, terminated, truncated, _ = env.step(first_action(env))
            assert math.isfinite(float(reward)) and not truncated, option
        finally:
            env.close()
    assert len(needs_noop_max_0) < 5, needs_noop_max_0
    # The game is a setting of the one Atari config; the run is named after it.
    cfg = compose_config("env=atari", "env.game=pong")
    assert cfg.env.name == "pong" and cfg.name == "vtrace-pong"
    assert compose_config("env=pong").env == cfg.env
    # Every MinAtar game is an option by name too, over the one MinAtar config.
    assert {f"minatar-{g}" for g in MINATAR_GAMES} <= set(options)
    cfg = compose_config("env=minatar", "env.game=freeway")
    assert cfg.env.name == "minatar-freeway" and cfg.name == "vtrace-minatar-freeway"
    assert compose_config("env=minatar-freeway").env == cfg.env
    # A tuning file still applies to its agent and env.
    assert compose_config("agent=a2c", "env=cartpole").agent.hidden_size == 64


def test_env_game_and_name_must_agree(compose_config):
    with pytest.raises(ConfigError, match=r"env.game 'nosuch' is not an Atari game"):
        config_lib.validate(compose_config("env.game=nosuch"))
    with pytest.raises(
        ConfigError, match=r"env.name=pong: env.name follows env.game \(here it is breakout\)"
    ):
        config_lib.validate(compose_config("env=breakout", "env.name=pong"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["agent.batch_size=-1"], "agent.batch_size must be a positive integer, got -1"),
        (["agent.clip_rho_threshold=-1"], "agent.clip_rho_threshold must be a number >= 0.0"),
        (["agent.optimizer.beta2=2"], "agent.optimizer.beta2 must be a number in [0.0, 1.0]"),
        (["agent.use_lstm=3"], "agent.use_lstm must be true or false, got 3"),
        (["agent.network=resnet"], "agent.network must be one of auto, impala_deep"),
        (["agent.name=a3c"], "agent.name must be one of a2c, apex, ppo, r2d2, vtrace; got 'a3c'"),
    ],
)
def test_agent_dataclass_names_the_bad_key(compose_config, overrides, message):
    cfg = compose_config("agent=vtrace", *overrides)
    with pytest.raises(ConfigError) as e:
        config_lib.validate(cfg)
    assert message in str(e.value)


def test_an_agent_is_registered_not_listed(compose_config, monkeypatch):
    """An agent defined anywhere (here: in a test) validates once registered: no list
    in moolib-run or the Trainer names the agents."""

    @dataclasses.dataclass(frozen=True)
    class TemperedConfig(ActorCriticConfig):
        temperature: float  # softmax temperature of the policy

        def __post_init__(self) -> None:
            super().__post_init__()
            self.check_number("temperature", 0.0)

    def compute_loss(cfg, outputs, batch):
        raise AssertionError("not called")

    monkeypatch.setitem(
        registry._AGENTS, "tempered", registry.AgentSpec("tempered", TemperedConfig, compute_loss)
    )
    values = OmegaConf.to_container(compose_config("agent=a2c").agent, resolve=True)
    values.update(name="tempered", temperature=0.5)
    settings = agent_config(values)
    assert isinstance(settings, TemperedConfig) and settings.temperature == 0.5
    assert get_agent("tempered").compute_loss is compute_loss
    with pytest.raises(ConfigError, match="agent.temperature must be a number >= 0.0, got -1"):
        agent_config({**values, "temperature": -1})
    with pytest.raises(ConfigError, match="agent.temperature is missing"):
        agent_config({k: v for k, v in values.items() if k != "temperature"})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["agent=apex", "agent.epsilon=1.5"], "agent.epsilon must be a number in [0.0, 1.0]"),
        (
            ["agent=apex", "agent.min_replay_size=10", "agent.replay_capacity=5"],
            "agent.min_replay_size (10) must not exceed agent.replay_capacity (5)",
        ),
        (["agent=apex", "agent.use_lstm=true"], "agent.use_lstm must be false for apex"),
        (["agent=apex", "agent.n_step=0"], "agent.n_step must be a positive integer, got 0"),
        (
            ["agent=apex", "agent.replay_capacity=1e5"],
            "agent.replay_capacity must be a positive integer, got 100000.0 (write 100000: ",
        ),
        (
            ["agent=apex", "agent.samples_per_insert=-1"],
            "agent.samples_per_insert must be a number >= 0.0",
        ),
        (["agent=r2d2", "agent.use_lstm=false"], "agent.use_lstm must be true for r2d2"),
        (
            ["agent=r2d2", "agent.sequence_length=120", "agent.overlap=120"],
            "agent.overlap (120) must be less than agent.sequence_length (120)",
        ),
        (
            ["agent=r2d2", "agent.sequence_length=120", "agent.burn_in=119"],
            "agent.burn_in (119) must leave a transition to learn from",
        ),
        (
            ["agent=r2d2", "agent.priority_eta=2"],
            "agent.priority_eta must be a number in [0.0, 1.0]",
        ),
        (
            ["agent=r2d2", "agent.optimizer.schedule=cosine"],
            "agent.optimizer.schedule must be one of linear, constant; got 'cosine'",
        ),
        (
            ["agent=apex", "scaling=local", "scaling.actors=0"],
            "scaling.actors must be a positive integer, got 0",
        ),
        (
            ["agent=r2d2", "scaling=slurm", "scaling.actors=0"],
            "scaling.actors must be a positive integer, got 0",
        ),
        (
            ["agent=apex", "scaling=slurm", "scaling.actors=3", "scaling.tasks_per_node=2"],
            "scaling.actors (3) must be a multiple of the actors per job",
        ),
    ],
)
def test_offpolicy_settings_are_checked_naming_the_key(compose_config, overrides, message):
    with pytest.raises(ConfigError) as e:
        config_lib.validate(compose_config("env=cartpole", *overrides))
    assert message in str(e.value)


ACTOR_CRITIC_KEYS = {"unroll_length", "virtual_batch_size", "baseline_cost", "entropy_cost"}


def test_the_config_schema_is_per_agent_family(compose_config):
    """Actor-critic agents carry the unroll and loss-weight keys; off-policy agents do
    not, and a savedir written when they did (its config.yaml has them) still builds."""
    for name in ONPOLICY:
        assert issubclass(get_agent(name).config, ActorCriticConfig)
    for name in OFFPOLICY:
        config = get_agent(name).config
        assert not issubclass(config, ActorCriticConfig)
        assert not ACTOR_CRITIC_KEYS & {f.name for f in dataclasses.fields(config)}
        values = OmegaConf.to_container(compose_config(f"agent={name}").agent, resolve=True)
        assert not ACTOR_CRITIC_KEYS & set(values)
        old = {
            **values,
            "unroll_length": 1,
            "virtual_batch_size": values["batch_size"],
            "baseline_cost": 0.0,
            "entropy_cost": 0.0,
        }
        assert agent_config(old) == agent_config(values)
        # A key no config of the agent ever had is still an error naming it.
        with pytest.raises(ConfigError, match="unknown key agent.clip_rho_threshold"):
            agent_config({**values, "clip_rho_threshold": 1.0})
    # An actor-critic agent needs its keys, named when missing.
    values = OmegaConf.to_container(compose_config("agent=vtrace").agent, resolve=True)
    del values["unroll_length"]
    with pytest.raises(ConfigError, match="agent.unroll_length is missing"):
        agent_config(values)
