"""The agent ``apex``: Ape-X DQN (Horgan et al., 2018), trained by the off-policy
runtime (``moolib.agents.runtime.offpolicy``). Its settings, its loss on a sampled
batch, and what an actor does with each env step (``ApexActing``: n-step
transitions with initial priorities for the replay), and how it acts outside training
(``ApexPolicy``). The math is
``moolib.agents.math.apex`` and ``moolib.agents.math.offpolicy``; the network is
``moolib.agents.nets.qmodels.make_dueling_qnet``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from moolib.conf.checks import ConfigError
from torch import nn

from .acting import ActionChoice, QPolicy
from .math import apex as apex_math
from .math.offpolicy import epsilon_greedy, n_step_transitions
from .nets.qmodels import make_dueling_qnet
from .registry import QConfig, register_agent


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


def _clip(rewards: torch.Tensor, clip: float) -> torch.Tensor:
    return rewards.clamp(-clip, clip) if clip > 0 else rewards


class ApexActing:
    """One actor batch of Ape-X: acts epsilon-greedily, keeps the last
    ``actor_buffer_size + n_step`` steps of its ``B`` envs, and every
    ``actor_buffer_size`` steps returns their n-step transitions with initial
    priorities from the actor's own TD errors (``apex_math.initial_priorities``).

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
        priorities = apex_math.initial_priorities(
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


class ApexPolicy(QPolicy):
    """Ape-X's policy outside training: the Q-values of each state alone (its network
    keeps nothing across steps), picked from as its actors do (``acting.QPolicy.pick``)."""

    @torch.no_grad()
    def act(self, env_out: dict[str, torch.Tensor], choice: ActionChoice) -> torch.Tensor:
        """The actions of one step of every env (see ``acting.Policy``)."""
        return self.pick(self.model(env_out["state"]), choice)


@register_agent(
    "apex",
    ApexConfig,
    make_network=make_dueling_qnet,
    acting=ApexActing,
    policy=ApexPolicy,
    runtime="offpolicy",
)
def compute_loss(cfg: ApexConfig, nets: dict, batch: dict) -> tuple[torch.Tensor, dict]:
    """Ape-X's loss on a sampled batch: ``nets`` holds ``online`` and ``target``;
    ``batch`` the sampled ``items`` and their importance ``weights``. The stats carry
    the new ``priorities`` beside the logged numbers, all tensors on the learner's
    device (reading them on the host would wait for the step)."""
    out = apex_math.loss(nets["online"], nets["target"], batch["items"], batch["weights"])
    return out.loss, {
        "priorities": out.priorities,
        "total_loss": out.loss.detach(),
        "mean_abs_td": out.priorities.detach().mean(),
    }
