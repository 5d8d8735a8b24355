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
loss, network, acting (in training and outside it: ``policy``) and the runtime that
trains it, by name (``runtime="onpolicy"``, the default, or ``"offpolicy"``: the module
``moolib.agents.runtime.<name>``, imported when a run asks for it, never to register an
agent). The trainers and
``moolib-run`` look agents up here and ask their spec; nothing lists them, and
nothing tells them apart by name.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from moolib.conf.checks import (
    ConfigError,
    build_config,
    check_choice,
    check_flag,
    check_int_at_least,
    check_number,
)

from .acting import ActorCriticPolicy
from .nets.models import NETWORKS, make_actor_critic

LossFn = Callable[[Any, dict, dict], tuple[Any, dict[str, float]]]
# (cfg, observation shape, actions: an ActionSpace or a number of discrete actions)
# -> the agent's torch network
NetworkFn = Callable[[Any, Sequence[int], Any], Any]
# (cfg, network, batch size) -> the agent's acting.Policy over that many envs
PolicyFn = Callable[[Any, Any, int], Any]


@dataclass(frozen=True)
class Update:
    """One gradient the on-policy runtime computes and offers the group's Accumulator:
    the network's forward pass over ``batch`` (time-major tensors, the unroll keys and
    any the agent adds) from the LSTM state ``core``, then the agent's loss of it.
    ``size`` is its weight in the Accumulator, in unrolls (``reduce_gradients``), the
    unit of ``virtual_batch_size``."""

    batch: dict
    core: tuple
    size: int


# (cfg, learner batch, its LSTM state) -> the gradients the runtime takes from it, in order
UpdatesFn = Callable[[Any, dict, tuple], Iterable[Update]]


def whole_batch(cfg: Any, batch: dict, core: tuple) -> Iterable[Update]:
    """A learner batch as one gradient of all its ``batch_size`` unrolls: what V-trace
    and A2C take from each batch (an ``UpdatesFn``)."""
    return (Update(batch, core, cfg.batch_size),)


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
    ``QConfig``), adding its fields and their checks.

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
    # Observations normalized by their running mean and variance, and rewards divided
    # by the running deviation of a discounted return, in the actors (gymnasium's
    # NormalizeObservation and NormalizeReward, as CleanRL's continuous PPO; see
    # moolib.agents.runtime.normalization); the episode returns logged stay the env's.
    observation_scaling: bool = dataclasses.field(default=False, kw_only=True)
    reward_scaling: bool = dataclasses.field(default=False, kw_only=True)

    def passes(self) -> int:
        """How many gradients each unroll is part of (1 here: the whole batch once; PPO:
        its epochs). The runtime counts an applied update's env steps as its unrolls
        times ``unroll_length`` over this, so ``steps`` counts each env step once."""
        return 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("learner", ("auto", "thread", "inline"))
        self.check_bool("observation_scaling")
        self.check_bool("reward_scaling")
        self.check_int("unroll_length")
        self.check_int("virtual_batch_size")
        self.check_number("baseline_cost", 0.0)
        self.check_number("entropy_cost", 0.0)


@dataclass(frozen=True)
class QConfig(AgentConfig):
    """Settings Ape-X and R2D2 share. The actor-critic keys their configs carried
    before the schema was split per family (``unroll_length``,
    ``virtual_batch_size``, ``baseline_cost``, ``entropy_cost``) are retired: a
    savedir holding them resumes, and they are ignored."""

    retired_keys: ClassVar[frozenset[str]] = frozenset(
        {"unroll_length", "virtual_batch_size", "baseline_cost", "entropy_cost"}
    )

    actor_loops: int  # actor loops (threads) per actor process, each with its own envs
    epsilon: float  # eps of the actors' eps_i = eps^(1 + epsilon_alpha i / (N - 1))
    epsilon_alpha: float  # alpha of the same
    weight_sync: int  # steps of each env between fetches of the learner's weights
    publish_interval: int  # learner steps between publications of its weights
    n_step: int  # rewards in each return before bootstrapping
    target_update: int  # learner steps between copies of the online net to the target
    replay_capacity: int  # items in the replay; the oldest is evicted past it
    priority_exponent: float  # alpha: P(i) is proportional to p_i^alpha
    importance_sampling_exponent: float  # beta of w_i = (N P(i))^-beta / max w
    min_replay_size: int  # items in the replay before the learner samples
    # Reverb's rate limit: items sampled per item inserted, kept within error_buffer of
    # it (0: no limit; the learner samples as fast as it can, actors never wait).
    samples_per_insert: float
    save_replay: bool  # checkpoints include the replay (resumes keep the experience)

    # What the replay holds, for messages about its fill.
    item_name: ClassVar[str] = "items"

    def steps_per_item(self) -> int:
        """Env steps (of one env) that make one replay item: what converts the
        replay's warm-up, ``min_replay_size`` items, into the run's steps."""
        return 1

    def replay_dedup(self, obs_shape: Sequence[int]) -> tuple[str, ...]:
        """The item leaves the replay stores once per distinct frame (``moolib.Replay``'s
        ``dedup``): none here."""
        return ()

    def episodes_too_short(self, longest: int, seen: int) -> str | None:
        """Why the replay stays empty when none of ``seen`` episodes lasted more than
        ``longest`` steps; None where such episodes still make items."""
        return None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (
            "actor_loops",
            "weight_sync",
            "publish_interval",
            "n_step",
            "target_update",
            "replay_capacity",
            "min_replay_size",
        ):
            self.check_int(name)
        self.check_number("epsilon", 0.0, 1.0)
        self.check_number("epsilon_alpha", 0.0)
        self.check_number("priority_exponent", 0.0)
        self.check_number("importance_sampling_exponent", 0.0, 1.0)
        self.check_number("samples_per_insert", 0.0)
        self.check_bool("save_replay")
        if self.min_replay_size > self.replay_capacity:
            raise ConfigError(
                f"agent.min_replay_size ({self.min_replay_size}) must not exceed "
                f"agent.replay_capacity ({self.replay_capacity}): the learner would never start"
            )


@dataclass(frozen=True)
class ProcessGroup:
    """Processes of a run that do the same work, as a runtime lays them out: the
    launchers start, restart, name and place them from this alone (``scaling=local``'s
    one supervisor; ``scaling=slurm``'s jobs, one job array per group)."""

    role: str  # what logs and jobs call one: peer, learner, actor
    first_rank: int
    count: int
    # The scaling key that sets ``count`` (peers, actors); None: one, always.
    key: str | None
    # The run ends when these processes have ended (a learner); else when all have.
    ends_run: bool
    # After an unplanned end while the run goes on: "crashed" starts it again when it
    # was killed by a signal or exited with 1 after running a while; "failed" when it
    # exited with anything but 0; "never" does not.
    restart: str
    # Whether it trains on the run's device (gets the GPUs on SLURM); else CPUs only.
    uses_device: bool

    @property
    def ranks(self) -> range:
        """The ranks of the group's processes."""
        return range(self.first_rank, self.first_rank + self.count)

    def name_of(self, rank: int) -> str:
        """``peer 2``, ``actor 0``; a group of one by design: its role (``learner``)."""
        return self.role if self.key is None else f"{self.role} {rank - self.first_rank}"


class Runtime:
    """What trains an agent's runs, and how a run's processes are laid out: the
    launcher starts, names and counts them by asking the agent's runtime, never by
    telling agents apart. Subclassed by ``moolib.agents.runtime.onpolicy.OnPolicyRuntime``
    and ``moolib.agents.runtime.offpolicy.OffPolicyRuntime``, each registered
    (``register_runtime``) under the name of its module."""

    name: ClassVar[str]  # its module's in moolib.agents.runtime: onpolicy, offpolicy
    # The scaling key that counts the run's processes: peers (alike, each acting and
    # learning) or actors (actor processes beside one learner, rank 0).
    processes: ClassVar[str]
    # What the run's processes are, for messages: "peers", "actor processes beside its
    # learner".
    processes_described: ClassVar[str]
    # Where its training logs are, for messages ({savedir} filled in).
    training_logs: ClassVar[str]

    @classmethod
    def process_groups(cls, cfg: Any) -> tuple[ProcessGroup, ...]:
        """The processes the run ``cfg`` (a ``RunConfig``) needs when they are processes
        of their own (``scaling=local``, ``scaling=slurm``), rank 0 first."""
        raise NotImplementedError

    @classmethod
    def role(cls, cfg: Any, rank: int) -> str:
        """How logs and job names call process ``rank``: ``peer 2``, ``learner``, ``actor 0``."""
        for group in cls.process_groups(cfg):
            if rank in group.ranks:
                return group.name_of(rank)
        raise ValueError(f"the run has no process of rank {rank}")

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
    ``policy(cfg, model, batch_size)``: how it acts outside training, greedily or
    sampled (an ``acting.Policy``: what evaluation plays; the actor-critic agents'
    by default). ``runtime_name``: the runtime that trains it, by name; ``runtime``: that
    runtime (see ``Runtime``), its module imported when first asked for.
    ``updates``: the gradients the on-policy runtime takes from one learner batch
    (an ``UpdatesFn``: ``whole_batch``, or PPO's epochs of minibatches).
    ``continuous_actions``: whether it learns in envs whose actions are vectors of reals
    (its network's Gaussian policy; a Q-learner's argmax has nothing to range over)."""

    name: str
    config: type[AgentConfig]
    compute_loss: LossFn
    make_network: NetworkFn = make_actor_critic
    acting: Callable[..., Any] | None = None
    runtime_name: str = "onpolicy"
    policy: PolicyFn = ActorCriticPolicy
    updates: UpdatesFn = whole_batch
    continuous_actions: bool = False

    @property
    def runtime(self) -> type[Runtime]:
        """The runtime that trains the agent (see ``runtime_named``)."""
        return runtime_named(self.runtime_name)


_AGENTS: dict[str, AgentSpec] = {}
_discovered = False
_RUNTIMES: dict[str, type[Runtime]] = {}


def register_runtime(runtime: type[Runtime]) -> type[Runtime]:
    """Class decorator: ``runtime`` is the one named ``runtime.name``, the name of the
    module of ``moolib.agents.runtime`` that defines it (``runtime_named`` imports that
    module to find it)."""
    module = runtime.__module__.rpartition(".")[2]
    if runtime.name != module:
        raise ValueError(f"runtime {runtime.name!r} must be defined in a module of that name")
    _RUNTIMES[runtime.name] = runtime
    return runtime


def _runtime_module(name: str) -> str:
    return f"{__package__ or 'moolib.agents'}.runtime.{name}"


def runtime_named(name: str) -> type[Runtime]:
    """The runtime registered as ``name``; its module, ``moolib.agents.runtime.<name>``,
    is imported on the first call (so an agent that names it imports no runtime)."""
    if name not in _RUNTIMES:
        importlib.import_module(_runtime_module(name))
    if name not in _RUNTIMES:
        raise ValueError(f"{_runtime_module(name)} registers no runtime named {name!r}")
    return _RUNTIMES[name]


def register_agent(
    name: str,
    config: type[AgentConfig],
    *,
    make_network: NetworkFn = make_actor_critic,
    acting: Callable[..., Any] | None = None,
    policy: PolicyFn = ActorCriticPolicy,
    runtime: str = "onpolicy",
    updates: UpdatesFn = whole_batch,
    continuous_actions: bool = False,
) -> Callable[[LossFn], LossFn]:
    """Decorator registering ``compute_loss(cfg, outputs, batch) -> (loss, stats)``
    as agent ``name`` (the ``name:`` of its YAML), with settings ``config``, network
    ``make_network``, ``acting``, ``policy``, the runtime named ``runtime``,
    on-policy the ``updates`` it takes from each learner batch, and whether it learns
    ``continuous_actions`` (see ``AgentSpec``; the
    defaults: the on-policy actor-critic agents'). An off-policy agent's loss takes the
    online and target networks and a sampled batch instead of outputs."""
    # Checked without importing the runtime: that waits until a run needs it.
    if (
        not isinstance(runtime, str)
        or not runtime.isidentifier()
        or importlib.util.find_spec(_runtime_module(runtime)) is None
    ):
        raise ValueError(f"runtime must name a module of moolib.agents.runtime, got {runtime!r}")

    def register(loss: LossFn) -> LossFn:
        known = _AGENTS.get(name)
        if known is not None and known.compute_loss is not loss:
            raise ValueError(
                f"agent {name!r} is registered twice ({known.compute_loss} and {loss})"
            )
        _AGENTS[name] = AgentSpec(
            name, config, loss, make_network, acting, runtime, policy, updates, continuous_actions
        )
        return loss

    return register


def _discover() -> None:
    """Imports every module of ``moolib.agents`` once, so each registers its agents;
    not its packages (the math, the networks and the runtimes define no agent)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    package = importlib.import_module(__package__ or "moolib.agents")
    for module in pkgutil.iter_modules(package.__path__):
        if not module.ispkg:
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
    return _AGENTS[name]


def runtime_of_agent(name: str) -> type[Runtime]:
    """The runtime that trains agent ``name``."""
    return get_agent(name).runtime


def runtime_of(cfg: Any) -> type[Runtime]:
    """The runtime that trains the run ``cfg`` (a ``RunConfig``: this module is below
    ``moolib.conf.schema.run_config``, which imports it) describes."""
    return runtime_of_agent(cfg.agent.name)


def agent_config(values: Mapping[str, Any]) -> AgentConfig:
    """The typed, checked settings of the agent that ``values`` (a run config's ``agent``
    keys, as plain Python) describe; the ``agent`` of a ``RunConfig``
    (``moolib.conf.schema.run_config``), which builds it. Raises ConfigError naming the key,
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
