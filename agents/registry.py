"""Agents as registered parts: what ``agent=NAME`` builds.

An agent is one module of ``moolib.agents`` plus one YAML file in
``moolib/conf/agent/``. The module declares the agent's settings as a dataclass
(a subclass of ``AgentConfig``: one documented field per YAML key, checked in
``__post_init__``) and registers its loss under the YAML's ``name``::

    @dataclass(frozen=True)
    class MyConfig(AgentConfig):
        temperature: float  # softmax temperature of the policy
        def __post_init__(self) -> None:
            super().__post_init__()
            self.check_number("temperature", 0.0)

    @register_agent("mine", MyConfig)
    def compute_loss(cfg: MyConfig, outputs: dict, batch: dict) -> tuple[Tensor, dict]: ...

The spec (``AgentSpec``) carries everything that differs between agents: settings,
loss, network, acting and the runtime that trains it. The trainers and
``moolib-run`` look agents up here and ask their spec; nothing lists them, and
nothing tells them apart by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from moolib.config_checks import (
    ConfigError,
    build_config,
    check_choice,
    check_flag,
    check_int_at_least,
    check_number,
)

from .nets.models import NETWORKS, make_actor_critic

LossFn = Callable[[Any, dict, dict], tuple[Any, dict[str, float]]]
# (cfg, observation shape, number of actions) -> the agent's torch network
NetworkFn = Callable[[Any, Sequence[int], int], Any]


class _Checks:
    """Range checks whose messages name the full key (``agent.batch_size``)."""

    _prefix = "agent"

    def _key(self, name: str) -> str:
        return f"{self._prefix}.{name}"

    def check_int(self, name: str, low: int = 1) -> None:
        """Raises ConfigError unless field ``name`` is an integer >= ``low``."""
        check_int_at_least(self._key(name), getattr(self, name), low)

    def check_number(self, name: str, low: float, high: float | None = None) -> None:
        """Raises ConfigError unless field ``name`` is a number in [low, high]."""
        check_number(self._key(name), getattr(self, name), low, high)

    def check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        """Raises ConfigError unless field ``name`` is one of ``choices``."""
        check_choice(self._key(name), getattr(self, name), choices)

    def check_bool(self, name: str) -> None:
        """Raises ConfigError unless field ``name`` is true or false."""
        check_flag(self._key(name), getattr(self, name))


@dataclass(frozen=True)
class OptimizerConfig(_Checks):
    """``agent.optimizer``: the learner's optimizer."""

    _prefix = "agent.optimizer"

    name: str  # adam or rmsprop
    learning_rate: float  # at step 0 (see schedule)
    beta1: float  # adam's first-moment decay
    beta2: float  # adam's second-moment decay
    epsilon: float  # added to the denominator (adam and rmsprop)
    alpha: float  # rmsprop's smoothing constant
    momentum: float  # rmsprop's momentum
    # Defaults keep configs written before these keys existed (a resumed savedir) valid.
    schedule: str = "linear"  # linear: decays to 0 over total_steps; constant: stays
    centered: bool = False  # rmsprop: normalise by the gradient's variance, not its 2nd moment

    def __post_init__(self) -> None:
        self.check_choice("name", ("adam", "rmsprop"))
        self.check_choice("schedule", ("linear", "constant"))
        self.check_bool("centered")
        self.check_number("learning_rate", 0.0)
        for name in ("beta1", "beta2", "alpha"):
            self.check_number(name, 0.0, 1.0)
        self.check_number("epsilon", 0.0)
        self.check_number("momentum", 0.0)


@dataclass(frozen=True)
class AgentConfig(_Checks):
    """The settings every agent has (keys of every ``conf/agent/*.yaml``). An agent's
    own config subclasses it (or the config of its family: ``ActorCriticConfig``,
    ``moolib.agents.qlearning.QConfig``), adding its fields and their checks.

    ``retired_keys`` names keys an agent's configs once carried and no longer
    read: a savedir written then still resumes (its ``config.yaml`` has them), and
    they are dropped unchecked."""

    retired_keys: ClassVar[frozenset[str]] = frozenset()

    name: str  # the agent's registered name (and its YAML's name)
    # auto: the deep IMPALA network for images, MinAtar's for small grids (10x10), an MLP
    # for vectors; or one of NETWORKS.
    network: str
    use_lstm: bool  # an LSTM core between the torso and the heads
    hidden_size: int  # width of the torso's output (and of the LSTM)
    actor_batch_size: int  # envs in one actor batch (the model acts on a batch at once)
    num_actor_batches: int  # actor batches in flight (2: one steps while one acts)
    num_actor_cpus: int  # env worker processes; each steps a slice of every batch
    batch_size: int  # items in one learner batch (unrolls, transitions, sequences)
    discounting: float  # the discount factor, in [0, 1]
    reward_clip: float  # rewards clipped to [-reward_clip, reward_clip]; 0: not clipped
    grad_norm_clipping: float  # gradients' global norm is clipped to this
    optimizer: OptimizerConfig

    def __post_init__(self) -> None:
        for name in (
            "actor_batch_size",
            "num_actor_batches",
            "num_actor_cpus",
            "batch_size",
            "hidden_size",
        ):
            self.check_int(name)
        self.check_number("discounting", 0.0, 1.0)
        for name in ("reward_clip", "grad_norm_clipping"):
            self.check_number(name, 0.0)
        self.check_choice("name", tuple(agent_names()))
        self.check_choice("network", ("auto", *NETWORKS))
        self.check_bool("use_lstm")
        if self.num_actor_cpus > self.actor_batch_size:
            raise ConfigError(
                f"agent.num_actor_cpus ({self.num_actor_cpus}) must not exceed "
                f"agent.actor_batch_size ({self.actor_batch_size}): each process steps "
                "a slice of every actor batch"
            )


@dataclass(frozen=True)
class ActorCriticConfig(AgentConfig):
    """The settings of the on-policy actor-critic agents (V-trace, A2C), trained on
    unrolls by ``moolib.agents.runtime.onpolicy.Trainer``."""

    unroll_length: int  # env steps in one unroll (plus one to bootstrap)
    virtual_batch_size: int  # unrolls summed over all peers before each optimizer step
    baseline_cost: float  # weight of the value loss
    entropy_cost: float  # weight of the entropy bonus
    # thread: learning on a thread of its own beside the acting thread; inline: the
    # acting thread learns between its steps; auto: inline on a CPU for the MLP and
    # tiny networks, thread otherwise (moolib.agents.runtime.onpolicy.learner_mode).
    learner: str = dataclasses.field(default="auto", kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("learner", ("auto", "thread", "inline"))
        self.check_int("unroll_length")
        self.check_int("virtual_batch_size")
        self.check_number("baseline_cost", 0.0)
        self.check_number("entropy_cost", 0.0)


class Runtime:
    """What trains an agent's runs, and how a run's processes are laid out: the
    launcher starts, names and counts them by asking the agent's runtime, never by
    telling agents apart. Subclassed by ``moolib.agents.runtime.onpolicy.OnPolicyRuntime``
    and ``moolib.agents.runtime.offpolicy.OffPolicyRuntime``."""

    name: ClassVar[str]  # as logged and tested: onpolicy, offpolicy
    # The scaling key that counts the run's processes: peers (alike, each acting and
    # learning) or actors (actor processes beside one learner, rank 0).
    processes: ClassVar[str]

    @classmethod
    def has_learner(cls) -> bool:
        """Whether rank 0 is a learner of its own and the other ranks its actors."""
        return cls.processes == "actors"

    @classmethod
    def role(cls, rank: int) -> str:
        """How logs and job names call process ``rank``: ``peer 2``, ``learner``, ``actor 0``."""
        if not cls.has_learner():
            return f"peer {rank}"
        return "learner" if rank == 0 else f"actor {rank - 1}"

    @classmethod
    def logdir(cls, savedir: Path, rank: int, cfg: Any) -> Path:
        """Where process ``rank`` of the run ``cfg`` (a ``RunConfig``) describes writes
        its logs."""
        raise NotImplementedError

    @classmethod
    def make_runner(cls, cfg: Any, rank: int, broker: str) -> Any:
        """What process ``rank`` runs (``.run(stop)`` trains until done or stopped)."""
        raise NotImplementedError


@dataclass(frozen=True)
class AgentSpec:
    """A registered agent: everything that differs between agents.

    ``config``: its settings' dataclass. ``compute_loss``: its loss (see
    ``register_agent``). ``make_network(cfg, obs_shape, num_actions)``: its network,
    the one definition learners, actors and checks build. ``acting``: the off-policy
    actors' per-batch acting state, made as ``acting(cfg, epsilons, model)`` (None:
    the agent acts by sampling its policy, as the on-policy runtime does).
    ``runtime``: what trains it (see ``Runtime``)."""

    name: str
    config: type[AgentConfig]
    compute_loss: LossFn
    make_network: NetworkFn = make_actor_critic
    acting: Callable[..., Any] | None = None
    # None until the registry resolves it: the on-policy runtime, which registers
    # itself as the default (this module cannot import it: it imports this one).
    runtime: type[Runtime] | None = None


_AGENTS: dict[str, AgentSpec] = {}
_discovered = False
_default_runtime: list[type[Runtime]] = []


def set_default_runtime(runtime: type[Runtime]) -> type[Runtime]:
    """Class decorator: ``runtime`` trains the agents registered without one."""
    _default_runtime[:] = [runtime]
    return runtime


def register_agent(
    name: str,
    config: type[AgentConfig],
    *,
    make_network: NetworkFn = make_actor_critic,
    acting: Callable[..., Any] | None = None,
    runtime: type[Runtime] | None = None,
) -> Callable[[LossFn], LossFn]:
    """Decorator registering ``compute_loss(cfg, outputs, batch) -> (loss, stats)``
    as agent ``name`` (the ``name:`` of its YAML), with settings ``config``, network
    ``make_network``, and ``acting`` and ``runtime`` (see ``AgentSpec``; the default:
    the on-policy actor-critic agents'). An off-policy agent's loss takes the online
    and target networks and a sampled batch instead of outputs."""
    if runtime is not None and not (isinstance(runtime, type) and issubclass(runtime, Runtime)):
        raise ValueError(f"runtime must be a subclass of Runtime, got {runtime!r}")

    def register(loss: LossFn) -> LossFn:
        known = _AGENTS.get(name)
        if known is not None and known.compute_loss is not loss:
            raise ValueError(
                f"agent {name!r} is registered twice ({known.compute_loss} and {loss})"
            )
        _AGENTS[name] = AgentSpec(name, config, loss, make_network, acting, runtime)
        return loss

    return register


def _discover() -> None:
    """Imports every module of ``moolib.agents`` once, so each registers its agents."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = importlib.import_module(__package__ or "moolib.agents")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")


def agent_names() -> list[str]:
    """The registered agents' names, sorted."""
    _discover()
    return sorted(_AGENTS)


def get_agent(name: str) -> AgentSpec:
    """The agent registered as ``name``; ConfigError naming the known ones if none is."""
    _discover()
    if name not in _AGENTS:
        raise ConfigError(f"agent.name must be one of {', '.join(agent_names())}; got {name!r}")
    spec = _AGENTS[name]
    if spec.runtime is None:
        spec = _AGENTS[name] = dataclasses.replace(spec, runtime=_default_runtime[0])
    return spec


def runtime_of_agent(name: str) -> type[Runtime]:
    """The runtime that trains agent ``name``."""
    runtime = get_agent(name).runtime
    assert runtime is not None
    return runtime


def runtime_of(cfg: Any) -> type[Runtime]:
    """The runtime that trains the run ``cfg`` (a ``RunConfig``: this module is below
    ``moolib.agents.run_config``, which imports it) describes."""
    return runtime_of_agent(cfg.agent.name)


def agent_config(values: Mapping[str, Any]) -> AgentConfig:
    """The typed, checked settings of the agent that ``values`` (a run config's ``agent``
    keys, as plain Python) describe; the ``agent`` of a ``RunConfig``
    (``moolib.agents.run_config``), which builds it. Raises ConfigError naming the key,
    and for settings that are not a mapping."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"agent must be a mapping of settings, got {values!r}")
    name = values.get("name")
    spec = get_agent(name)  # type: ignore[arg-type]
    return build_config(
        spec.config,
        values,
        "agent",
        optimizer=lambda v: build_config(OptimizerConfig, v, "agent.optimizer"),
    )
