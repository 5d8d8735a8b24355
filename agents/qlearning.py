"""Ape-X and R2D2 as agents of ``moolib-run``: their settings, networks, losses, and
what an actor does with each env step.

The math is in :mod:`moolib.agents.math.offpolicy`, :mod:`moolib.agents.math.apex` and
:mod:`moolib.agents.math.r2d2`; the runtime that runs actors and the learner is
:mod:`moolib.agents.runtime.offpolicy`. This module joins the two: for each agent,
how to build the network (the one definition that learner and actors both
build), how an actor batch turns env steps into replay items with their initial
priorities (``ApexActing``, ``R2D2Acting``), and how the learner takes its loss
on a sampled batch. :mod:`moolib.agents.qagents` registers them as the agents'
specs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from moolib.config_checks import ConfigError

from .math import apex, r2d2
from .math.offpolicy import epsilon_greedy, n_step_transitions
from .nets.models import resolve_network
from .nets.qmodels import DuelingQNet, RecurrentQNet, create_torso
from .registry import AgentConfig, get_agent

__all__ = [
    "ApexActing",
    "ApexConfig",
    "QConfig",
    "R2D2Acting",
    "R2D2Config",
    "make_acting",
    "make_dueling_qnet",
    "make_qnet",
    "make_recurrent_qnet",
]


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
class ApexConfig(QConfig):
    """Ape-X DQN's settings (``conf/agent/apex.yaml``)."""

    # Steps each env buffers before its n-step transitions are made, prioritized and
    # sent (the last n_step - 1 wait for the next window, to have full returns).
    actor_buffer_size: int

    item_name: ClassVar[str] = "transitions"

    def replay_dedup(self, obs_shape: Sequence[int]) -> tuple[str, ...]:
        """Image states: a transition's next state is a later transition's state (and
        its frames overlap its neighbours'), so both are stored once."""
        return ("state", "next_state") if len(obs_shape) == 3 else ()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_int("actor_buffer_size")
        if self.use_lstm:
            raise ConfigError("agent.use_lstm must be false for apex (use agent=r2d2 for memory)")


@dataclass(frozen=True)
class R2D2Config(QConfig):
    """R2D2's settings (``conf/agent/r2d2.yaml``)."""

    sequence_length: int  # stored steps per sequence, burn-in included
    overlap: int  # steps shared by consecutive sequences of an episode
    burn_in: int  # steps unrolled without gradient to refresh the stored LSTM state
    priority_eta: float  # p = eta max|delta| + (1 - eta) mean|delta| over a sequence
    value_rescale_epsilon: float  # eps of h(x) = sign(x)(sqrt(|x|+1)-1) + eps x

    item_name: ClassVar[str] = "sequences"

    def steps_per_item(self) -> int:
        """Within an episode a sequence starts every ``sequence_length - overlap`` steps."""
        return self.sequence_length - self.overlap

    def episodes_too_short(self, longest: int, seen: int) -> str | None:
        """No sequence is stored of an episode shorter than the burn-in and a transition
        (``r2d2.SequenceSplitter``)."""
        need = self.burn_in + 2
        if longest >= need:
            return None
        return (
            f"r2d2: the replay is empty: all {seen} episodes so far ended within {longest} "
            f"steps, and a sequence needs at least agent.burn_in + 2 = {need} (its burn-in "
            "and a transition to learn from); lower agent.burn_in and agent.sequence_length "
            "for this env (as conf/tuning/r2d2_cartpole.yaml does)"
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_int("sequence_length", 2)
        self.check_int("overlap", 0)
        self.check_int("burn_in", 0)
        self.check_number("priority_eta", 0.0, 1.0)
        self.check_number("value_rescale_epsilon", 1e-12)
        if self.overlap >= self.sequence_length:
            raise ConfigError(
                f"agent.overlap ({self.overlap}) must be less than agent.sequence_length "
                f"({self.sequence_length})"
            )
        if self.burn_in > self.sequence_length - 2:
            raise ConfigError(
                f"agent.burn_in ({self.burn_in}) must leave a transition to learn from: at "
                f"most agent.sequence_length - 2 = {self.sequence_length - 2}"
            )
        if not self.use_lstm:
            raise ConfigError("agent.use_lstm must be true for r2d2 (its LSTM is its point)")


def _torso(cfg: Any, obs_shape: Sequence[int]) -> nn.Module:
    return create_torso(
        obs_shape,
        network=resolve_network(cfg.network, tuple(obs_shape)),
        hidden_size=cfg.hidden_size,
    )


def make_dueling_qnet(cfg: Any, obs_shape: Sequence[int], num_actions: int) -> nn.Module:
    """Ape-X's network: a dueling Q-head on the torso ``cfg`` names."""
    return DuelingQNet(_torso(cfg, obs_shape), num_actions, head_hidden_size=cfg.hidden_size)


def make_recurrent_qnet(cfg: Any, obs_shape: Sequence[int], num_actions: int) -> nn.Module:
    """R2D2's network: the torso, an LSTM, and a dueling Q-head."""
    return RecurrentQNet(
        _torso(cfg, obs_shape),
        num_actions,
        lstm_size=cfg.hidden_size,
        head_hidden_size=cfg.hidden_size,
    )


def make_qnet(cfg: QConfig, obs_shape: Sequence[int], num_actions: int) -> nn.Module:
    """The agent's Q-network, as its spec builds it: the one definition the learner
    and every actor build."""
    return get_agent(cfg.name).make_network(cfg, obs_shape, num_actions)


def _clip(rewards: torch.Tensor, clip: float) -> torch.Tensor:
    return rewards.clamp(-clip, clip) if clip > 0 else rewards


# -- the learner's losses ---------------------------------------------------------------------


def apex_loss(cfg: ApexConfig, nets: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    """Ape-X's loss on a sampled batch: ``nets`` holds ``online`` and ``target``;
    ``batch`` the sampled ``items`` and their importance ``weights``. The stats carry
    the new ``priorities`` beside the logged numbers, all tensors on the learner's
    device (reading them on the host would wait for the step)."""
    out = apex.loss(nets["online"], nets["target"], batch["items"], batch["weights"])
    return out.loss, {
        "priorities": out.priorities,
        "total_loss": out.loss.detach(),
        "mean_abs_td": out.priorities.detach().mean(),
    }


def r2d2_loss(cfg: R2D2Config, nets: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    """R2D2's loss on sampled sequences (see ``apex_loss`` for the arguments)."""
    out = r2d2.loss(
        nets["online"],
        nets["target"],
        batch["items"],
        batch["weights"],
        burn_in=cfg.burn_in,
        n=cfg.n_step,
        discount=cfg.discounting,
        eta=cfg.priority_eta,
        rescale_epsilon=cfg.value_rescale_epsilon,
    )
    valid = out.mask.to(out.td_errors.dtype)
    # Over the steps that count (0 if none does), without reading the mask on the host.
    mean_abs = (out.td_errors.detach().abs() * valid).sum() / valid.sum().clamp(min=1.0)
    return out.loss, {
        "priorities": out.priorities,
        "total_loss": out.loss.detach(),
        "mean_abs_td": mean_abs,
    }


# -- acting ------------------------------------------------------------------------------------


class ApexActing:
    """One actor batch of Ape-X: acts epsilon-greedily, keeps the last
    ``actor_buffer_size + n_step`` steps of its ``B`` envs, and every
    ``actor_buffer_size`` steps returns their n-step transitions with initial
    priorities from the actor's own TD errors (``apex.initial_priorities``).

    Buffers are preallocated once; a step copies the env's output into them (it is
    a view of shared memory the next env step overwrites)."""

    def __init__(
        self, cfg: ApexConfig, epsilons: torch.Tensor, model: nn.Module | None = None
    ) -> None:
        # model: unused (Ape-X's network keeps no state across steps), taken as every
        # agent's acting is made: acting(cfg, epsilons, model).
        self.cfg = cfg
        self.epsilons = epsilons
        self.batch_size = len(epsilons)
        self.n = cfg.n_step
        self.length = cfg.actor_buffer_size + cfg.n_step  # steps held
        self.pos = 0
        self.buffers: dict[str, torch.Tensor] = {}

    def _allocate(self, state: torch.Tensor, num_actions: int) -> None:
        s, b = self.length, self.batch_size
        self.buffers = {
            "state": torch.empty((s, *state.shape), dtype=state.dtype),
            "q": torch.empty((s, b, num_actions)),
            "action": torch.empty((s, b), dtype=torch.int64),
            "reward": torch.empty((s, b)),
            "done": torch.empty((s, b), dtype=torch.bool),
        }

    @staticmethod
    def evaluator(model: nn.Module) -> Callable[[torch.Tensor, float, bool, int], torch.Tensor]:
        """Q-values of one env's steps as ``runtime.offpolicy.evaluate`` plays them:
        ``q(state, reward, done, prev_action)`` for a state batch of 1."""
        return lambda state, reward, done, prev_action: model(state)

    @torch.no_grad()
    def step(self, env_out: dict, model: nn.Module) -> tuple[torch.Tensor, Any]:
        """Acts on one env step; returns the actions and, when the buffer is full,
        ``(items, priorities)`` for the replay (else None)."""
        state = env_out["state"]
        q = model(state)
        action = epsilon_greedy(q, self.epsilons)
        if not self.buffers:
            self._allocate(state, q.shape[-1])
        buf, t = self.buffers, self.pos
        buf["state"][t].copy_(state)
        buf["q"][t].copy_(q)
        buf["action"][t].copy_(action)
        buf["reward"][t].copy_(env_out["reward"])
        buf["done"][t].copy_(env_out["done"])
        self.pos += 1
        if self.pos < self.length:
            return action, None
        return action, self._transitions()

    def _transitions(self) -> tuple[dict, torch.Tensor]:
        buf, n, cfg = self.buffers, self.n, self.cfg
        # Transition t goes from observation t to t + 1: its reward and done arrive
        # with observation t + 1.
        rewards = _clip(buf["reward"][1:], cfg.reward_clip)
        dones = buf["done"][1:]
        priorities = apex.initial_priorities(
            buf["q"], buf["action"][:-1], rewards, dones, n=n, discount=cfg.discounting
        )
        returns, discounts, steps = n_step_transitions(
            rewards, dones, n=n, discount=cfg.discounting
        )
        keep = self.length - n  # transitions whose window is whole
        b = self.batch_size
        envs = torch.arange(b).expand(keep, b)
        nxt = torch.arange(keep)[:, None] + steps[:keep]
        items = {
            "state": buf["state"][:keep].flatten(0, 1).clone(),
            "action": buf["action"][:keep].flatten(),
            "return": returns[:keep].flatten(),
            "discount": discounts[:keep].flatten(),
            "next_state": buf["state"][nxt, envs].flatten(0, 1),
        }
        prios = priorities[:keep].flatten()
        # The last n steps start the next window.
        for v in buf.values():
            v[:n] = v[keep:].clone()
        self.pos = n
        return items, prios


class R2D2Acting:
    """One actor batch of R2D2: acts epsilon-greedily with the LSTM state carried
    across steps, cuts the steps into overlapping sequences
    (``r2d2.SequenceSplitter``) and returns completed ones with their priorities
    (R2D2's eta-mix of the actor's own TD errors over each sequence)."""

    def __init__(self, cfg: R2D2Config, epsilons: torch.Tensor, model: nn.Module) -> None:
        self.cfg = cfg
        self.epsilons = epsilons
        self.batch_size = len(epsilons)
        self.core = model.initial_state(self.batch_size)
        self.prev_action = torch.zeros(self.batch_size, dtype=torch.int64)
        self.splitter = r2d2.SequenceSplitter(
            self.batch_size, cfg.sequence_length, cfg.overlap, cfg.burn_in
        )

    @staticmethod
    def evaluator(model: nn.Module) -> Callable[[torch.Tensor, float, bool, int], torch.Tensor]:
        """Q-values of one env's steps as ``runtime.offpolicy.evaluate`` plays them, the
        LSTM state carried from step to step, the inputs an actor gives the network."""
        core = model.initial_state(1)

        def q_values(state: torch.Tensor, reward: float, done: bool, prev: int) -> torch.Tensor:
            nonlocal core
            inputs = {
                "state": state[None],
                "reward": torch.tensor([[reward]]),
                "done": torch.tensor([[done]]),
                "prev_action": torch.tensor([[prev]]),
            }
            q, core = model(inputs, core)
            return q[0]

        return q_values

    @torch.no_grad()
    def step(self, env_out: dict, model: nn.Module) -> tuple[torch.Tensor, Any]:
        """Acts on one env step; returns the actions and ``(items, priorities)`` of the
        sequences this step completed (or None)."""
        done = env_out["done"]
        prev = torch.where(done, torch.zeros_like(self.prev_action), self.prev_action)
        inputs = {
            "state": env_out["state"][None],
            "reward": env_out["reward"][None],
            "done": done[None],
            "prev_action": prev[None],
        }
        core_before = self.core
        q, self.core = model(inputs, core_before)
        action = epsilon_greedy(q[0], self.epsilons)
        self.prev_action = action
        step = {k: v[0] for k, v in inputs.items()}
        step["action"] = action
        sequences = self.splitter.add(step, core_before)
        if sequences is None:
            return action, None
        items = {"steps": sequences["steps"], "mask": sequences["mask"], "core": sequences["core"]}
        cfg = self.cfg
        priorities = r2d2.loss(
            model,
            model,
            items,
            torch.ones(len(sequences["env"])),
            burn_in=cfg.burn_in,
            n=cfg.n_step,
            discount=cfg.discounting,
            eta=cfg.priority_eta,
            rescale_epsilon=cfg.value_rescale_epsilon,
        ).priorities
        return action, (items, priorities)


def make_acting(cfg: QConfig, epsilons: torch.Tensor, model: nn.Module) -> ApexActing | R2D2Acting:
    """The acting state of one actor batch of the agent ``cfg`` describes (its spec's)."""
    acting = get_agent(cfg.name).acting
    assert acting is not None, f"{cfg.name} does not act off-policy"
    return acting(cfg, epsilons, model)
