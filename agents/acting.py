"""An agent's policy outside training: how it picks the actions of a batch of envs
from their observations, greedily or sampled, with nothing learned or stored. What
evaluation plays (``moolib-eval``, moolib-run's ``eval_interval``); each agent's spec
makes it (``AgentSpec.policy``), so evaluation never asks which agent it plays.

``ActorCriticPolicy`` is the actor-critic agents' (a2c, vtrace), the default; the
off-policy agents register theirs beside their actors' acting (``apex.ApexPolicy``,
``r2d2.R2D2Policy``). Each feeds its network what the agent's actors feed it
(``nets.models.actor_step``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from moolib.envs.actions import ActionSpace
from torch import nn

from .math.offpolicy import epsilon_greedy
from .nets import distributions as policy_math
from .nets.models import actor_step

__all__ = ["ActionChoice", "ActorCriticPolicy", "Policy", "QPolicy"]


@dataclass(frozen=True)
class ActionChoice:
    """How a policy picks its actions: ``greedy``, the action it rates highest, or
    sampled: drawn from the actor-critic's softmax, or epsilon-greedy with
    ``epsilon`` for a Q-learner. ``generator`` draws the samples (seeded, so that an
    evaluation plays the same episodes again)."""

    greedy: bool = True
    epsilon: float = 0.01
    generator: torch.Generator | None = None


class Policy:
    """An agent's policy over a batch of ``batch_size`` envs, made by its spec as
    ``policy(cfg, model, batch_size)`` with ``model`` the agent's network (its
    ``make_network``'s, weights loaded). ``act(env_out, choice)`` takes one step of
    every env (``state`` ``[B, ...]``, ``reward`` ``[B]``, ``done`` ``[B]``: true at an
    episode's first observation, as ``moolib.EnvPool`` gives them) and returns the
    actions ``[B]`` (``[B, A]`` continuous, as the policy drew them: ``env_actions``
    clips them to the env's bounds); it carries what the network keeps from step to
    step (the previous actions, an LSTM's state, zeroed where ``done``)."""

    def __init__(self, cfg: Any, model: nn.Module, batch_size: int) -> None:
        self.cfg = cfg
        self.model = model
        # The actor-critic networks say what their actions are; a Q-network's are discrete.
        space = getattr(model, "action_space", None)
        self.action_space: ActionSpace | None = space
        self.prev_action = (
            space.zeros(batch_size)
            if space is not None
            else torch.zeros(batch_size, dtype=torch.int64)
        )
        self.core: tuple = ()  # the network's initial state, to begin with

    def env_actions(self, actions: torch.Tensor) -> torch.Tensor:
        """``act``'s actions as the envs take them: continuous ones clipped to the bounds."""
        return actions if self.action_space is None else self.action_space.clip(actions)

    def forward(self, env_out: dict[str, torch.Tensor]) -> Any:
        """The output of a network that takes a step's inputs and a core state (the
        actor-critic networks, R2D2's) for one step of every env: fed as the agent's
        actors feed it (``nets.models.actor_step``, ``[T=1, B]``), from the core state
        it left after the previous step, which it carries on."""
        step = actor_step(env_out, self.prev_action)
        out, self.core = self.model({k: v[None] for k, v in step.items()}, self.core)
        return out

    def act(self, env_out: dict[str, torch.Tensor], choice: ActionChoice) -> torch.Tensor:
        """The actions of one step of every env."""
        raise NotImplementedError

    @staticmethod
    def described(choice: ActionChoice) -> str:
        """How this policy picks its actions under ``choice``, for messages."""
        return "greedy" if choice.greedy else "sampled from its policy"


class ActorCriticPolicy(Policy):
    """The actor-critic agents' policy: the network's policy logits, from the inputs
    and LSTM state the on-policy actors give it; greedy is the most likely action (a
    Gaussian's mean), sampled is drawn from the policy (``moolib.agents.nets.distributions``)."""

    @torch.no_grad()
    def act(self, env_out: dict[str, torch.Tensor], choice: ActionChoice) -> torch.Tensor:
        """The actions of one step of every env (see ``Policy``)."""
        logits = self.forward(env_out)["policy_logits"][0]
        continuous = self.action_space is not None and self.action_space.continuous
        if choice.greedy:
            action = policy_math.greedy(logits, continuous)
        else:
            action = policy_math.sample(logits, continuous, choice.generator)
        self.prev_action = action
        return action


class QPolicy(Policy):
    """A Q-learner's policy (apex, r2d2): its subclass computes the Q-values of a step
    (``act``) and picks from them with ``pick``: the argmax, or epsilon-greedy with
    ``choice.epsilon`` (as its actors act, with one epsilon for every env)."""

    @staticmethod
    def pick(q_values: torch.Tensor, choice: ActionChoice) -> torch.Tensor:
        """The actions ``[B]`` for ``q_values [B, A]``."""
        if choice.greedy:
            return q_values.argmax(dim=-1)
        epsilons = torch.full((q_values.shape[0],), float(choice.epsilon))
        return epsilon_greedy(q_values, epsilons, choice.generator)

    @staticmethod
    def described(choice: ActionChoice) -> str:
        """How this policy picks its actions under ``choice``, for messages."""
        return "greedy" if choice.greedy else f"epsilon-greedy (epsilon {choice.epsilon:g})"
