"""The agent ``r2d2``: R2D2 (Kapturowski et al., 2019), trained by the off-policy
runtime (``moolib.agents.runtime.offpolicy``). Its settings, its loss on sampled
sequences, and what an actor does with each env step (``R2D2Acting``: overlapping
sequences with their priorities for the replay), and how it acts outside training
(``R2D2Policy``). The math is
``moolib.agents.math.r2d2``; the network is
``moolib.agents.nets.qmodels.make_recurrent_qnet``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from moolib.conf.checks import ConfigError
from torch import nn

from .acting import ActionChoice, QPolicy
from .math import r2d2 as r2d2_math
from .math.offpolicy import epsilon_greedy
from .nets.models import actor_step
from .nets.qmodels import make_recurrent_qnet
from .registry import QConfig, register_agent


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
        self.splitter = r2d2_math.SequenceSplitter(
            self.batch_size, cfg.sequence_length, cfg.overlap, cfg.burn_in
        )

    @torch.no_grad()
    def step(self, env_out: dict, model: nn.Module) -> tuple[torch.Tensor, Any]:
        """Acts on one env step; returns the actions and ``(items, priorities)`` of the
        sequences this step completed (or None)."""
        step = actor_step(env_out, self.prev_action)
        core_before = self.core
        q, self.core = model({k: v[None] for k, v in step.items()}, core_before)
        action = epsilon_greedy(q[0], self.epsilons)
        self.prev_action = action
        step["action"] = action
        sequences = self.splitter.add(step, core_before)
        if sequences is None:
            return action, None
        items = {"steps": sequences["steps"], "mask": sequences["mask"], "core": sequences["core"]}
        cfg = self.cfg
        priorities = r2d2_math.loss(
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


class R2D2Policy(QPolicy):
    """R2D2's policy outside training: the Q-values of each step with the LSTM state
    carried from step to step and the inputs its actors give the network, acted on
    as they do (``acting.QPolicy.pick``)."""

    @torch.no_grad()
    def act(self, env_out: dict[str, torch.Tensor], choice: ActionChoice) -> torch.Tensor:
        """The actions of one step of every env (see ``acting.Policy``)."""
        self.prev_action = self.pick(self.forward(env_out)[0], choice)
        return self.prev_action


@register_agent(
    "r2d2",
    R2D2Config,
    make_network=make_recurrent_qnet,
    acting=R2D2Acting,
    policy=R2D2Policy,
    runtime="offpolicy",
)
def compute_loss(cfg: R2D2Config, nets: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    """R2D2's loss on sampled sequences (see ``moolib.agents.apex.compute_loss`` for the
    arguments)."""
    out = r2d2_math.loss(
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
