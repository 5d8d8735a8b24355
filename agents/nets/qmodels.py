"""Q-networks for the value-based agents: Ape-X's dueling network and R2D2's recurrent one.

Both sit on a :class:`Torso`, the observation encoder of one of the actor-critic
networks of :mod:`moolib.agents.nets.models` (the IMPALA Atari nets, the MLP, or any
network ``create_model`` knows): the torso is defined once, there, and taken from
it here, so a network added there is a Q-network torso too. Any module with
``observation_shape`` and ``output_size`` attributes that maps
``[N, *observation_shape]`` to ``[N, output_size]`` can stand in for it.

Ape-X (Horgan et al., 2018)::

    q = net(state)                        # [..., *observation_shape] -> [..., A]

R2D2 (Kapturowski et al., 2019), with the same inputs as the actor-critic nets
(``state``, ``reward``, ``done``, ``prev_action``, all ``[T, B, ...]``)::

    q, core_state = net(inputs, core_state)   # q: [T, B, A]; core_state: (h, c) [1, B, H]

The LSTM state is zeroed before a step whose observation starts an episode
(``done``), as in the actor-critic nets, so an actor passes back the state it got
and never resets it itself; it keeps, per step, the state it acted with
(:class:`moolib.agents.math.r2d2.SequenceSplitter` stores it at each sequence start).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from moolib.envs.actions import ActionSpace
from torch import nn

from .models import (
    CoreState,
    as_action_space,
    create_model,
    resolve_network,
    scale_observations,
    unroll_lstm,
)

__all__ = ["DuelingHead", "DuelingQNet", "RecurrentQNet", "Torso", "create_torso"]


class Torso(nn.Module):
    """An observation encoder ``[N, *observation_shape] -> [N, output_size]``: the torso
    of an actor-critic network of :mod:`moolib.agents.nets.models`, with its input scaling.

    Args:
        layers: the torso's layers (taking scaled float observations).
        observation_shape: shape of one observation.
        observation_scale: observations are divided by this first (255 for frames).
    """

    def __init__(
        self, layers: nn.Module, observation_shape: Sequence[int], observation_scale: float
    ) -> None:
        super().__init__()
        self.layers = layers
        self.observation_shape = tuple(observation_shape)
        self.observation_scale = float(observation_scale)
        with torch.no_grad():
            probe = layers(torch.zeros(1, *self.observation_shape))
        self.output_size = int(probe.shape[-1])

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        """Encodes ``[N, *observation_shape]`` observations into ``[N, output_size]``."""
        x = scale_observations(state, self.observation_scale)
        if x.dim() == 4 and x.device.type == "cpu":
            # Frames in channels-last layout: the convolutions keep it, and torch's CPU
            # max-pooling is several times faster on it than on NCHW (it took 59% of the
            # deep IMPALA torso's forward pass). The same values, about 2x faster acting
            # and 1.6x faster learner steps on CPU (docs/decisions/channels-last.md).
            x = x.contiguous(memory_format=torch.channels_last)
        return self.layers(x)


def create_torso(
    observation_shape: Sequence[int], *, network: str, hidden_size: int | None = None
) -> Torso:
    """The torso of the actor-critic network ``network`` (a name ``create_model``
    takes, already resolved from ``auto``), on its own.

    The network is built and everything but its torso dropped, so there is one
    definition of every torso. Raises ValueError for an unknown network.
    """
    source = create_model(
        observation_shape, 1, network=network, use_lstm=False, hidden_size=hidden_size
    )
    return Torso(source.torso, observation_shape, source.observation_scale)


class DuelingHead(nn.Module):
    """Dueling Q-values (Wang et al., 2016): ``Q(s, a) = V(s) + A(s, a) - mean_a A(s, a)``.

    Subtracting the mean advantage makes the split into V and A identifiable (any
    constant moved from A to V would otherwise give the same Q).

    Args:
        input_size: width of the features.
        num_actions: size of the discrete action space.
        hidden_size: width of a hidden layer in each stream (the paper's 512); ``None``:
            each stream is one linear layer.
    """

    def __init__(self, input_size: int, num_actions: int, hidden_size: int | None = None) -> None:
        super().__init__()
        self.num_actions = num_actions

        def stream(outputs: int) -> nn.Module:
            if hidden_size is None:
                return nn.Linear(input_size, outputs)
            return nn.Sequential(
                nn.Linear(input_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, outputs)
            )

        self.value = stream(1)
        self.advantage = stream(num_actions)

    def streams(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The value ``[..., 1]`` and the advantages ``[..., A]`` of ``features [..., I]``."""
        return self.value(features), self.advantage(features)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Q-values ``[..., A]`` of ``features [..., I]``."""
        value, advantage = self.streams(features)
        return value + advantage - advantage.mean(dim=-1, keepdim=True)


class DuelingQNet(nn.Module):
    """Ape-X's network: a torso and a dueling head, no memory.

    Args:
        torso: the observation encoder (see :func:`create_torso`).
        num_actions: size of the discrete action space.
        head_hidden_size: hidden width of each dueling stream (``None``: linear streams).
    """

    def __init__(
        self, torso: nn.Module, num_actions: int, *, head_hidden_size: int | None = None
    ) -> None:
        super().__init__()
        self.torso = torso
        self.num_actions = num_actions
        self.observation_shape = tuple(torso.observation_shape)
        self.head = DuelingHead(torso.output_size, num_actions, head_hidden_size)

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        """Q-values ``[*lead, A]`` of observations ``[*lead, *observation_shape]`` (any
        leading dimensions: ``[B]`` transitions, ``[T, B]`` unrolls)."""
        obs_dims = len(self.observation_shape)
        lead = state.shape[: state.dim() - obs_dims]
        if tuple(state.shape[len(lead) :]) != self.observation_shape:
            raise ValueError(
                f"observations must end in shape {self.observation_shape}, got {tuple(state.shape)}"
            )
        features = self.torso(state.reshape(-1, *self.observation_shape))
        return self.head(features).view(*lead, self.num_actions)


class RecurrentQNet(nn.Module):
    """R2D2's network: torso, LSTM core, dueling head.

    The LSTM sees the torso's features, the previous action (one-hot) and the reward
    that came with the observation, as in the paper (the reward unclipped: R2D2
    rescales values instead of clipping rewards; 0 at an episode's first step).

    Args:
        torso: the observation encoder (see :func:`create_torso`).
        num_actions: size of the discrete action space.
        lstm_size: width of the LSTM (the paper's 512).
        head_hidden_size: hidden width of each dueling stream (``None``: linear streams).
    """

    def __init__(
        self,
        torso: nn.Module,
        num_actions: int,
        *,
        lstm_size: int = 512,
        head_hidden_size: int | None = None,
    ) -> None:
        super().__init__()
        self.torso = torso
        self.num_actions = num_actions
        self.observation_shape = tuple(torso.observation_shape)
        self.core = nn.LSTM(torso.output_size + 1 + num_actions, lstm_size, num_layers=1)
        self.head = DuelingHead(lstm_size, num_actions, head_hidden_size)

    def initial_state(self, batch_size: int = 1) -> CoreState:
        """Zero ``(h, c)``, each ``[1, B, lstm_size]``, on the module's device."""
        device = self.core.weight_ih_l0.device
        shape = (1, batch_size, self.core.hidden_size)
        return (torch.zeros(shape, device=device), torch.zeros(shape, device=device))

    def forward(
        self, inputs: dict[str, torch.Tensor], core_state: CoreState = ()
    ) -> tuple[torch.Tensor, CoreState]:
        """Q-values ``[T, B, A]`` of a ``[T, B]`` unroll from ``core_state`` (``()``: the
        initial state), and the state after its last step."""
        state = inputs["state"]
        num_steps, batch_size = state.shape[:2]
        features = self.torso(state.reshape(num_steps * batch_size, *state.shape[2:]))
        # The reward that comes with an episode's first observation (done) is the last
        # one of the previous episode (EnvPool's layout), and a fresh env's first step
        # (or evaluate's) has none: the net sees 0 there, so that the input at an
        # episode's start does not depend on how the previous episode ended, and acting,
        # learning and greedy evaluation feed the same inputs.
        done = inputs["done"].reshape(num_steps * batch_size, 1).bool()
        reward = inputs["reward"].reshape(num_steps * batch_size, 1).float().masked_fill(done, 0.0)
        prev_action = F.one_hot(
            inputs["prev_action"].reshape(num_steps * batch_size).long(), self.num_actions
        ).float()
        core_input = torch.cat([features, reward, prev_action], dim=-1)
        if not core_state:
            core_state = self.initial_state(batch_size)
        core_output, core_state = unroll_lstm(
            self.core, core_input.view(num_steps, batch_size, -1), inputs["done"], core_state
        )
        return self.head(core_output), core_state


def _torso(cfg: Any, obs_shape: Sequence[int]) -> nn.Module:
    return create_torso(
        obs_shape,
        network=resolve_network(cfg.network, tuple(obs_shape)),
        hidden_size=cfg.hidden_size,
    )


def _discrete(cfg: Any, actions: int | ActionSpace) -> int:
    # A Q-network rates each of a finite set of actions; moolib-run refuses the run
    # before it gets here (its pre-flight reads the agent's continuous_actions).
    space = as_action_space(actions)
    if space.continuous:
        raise ValueError(f"agent {cfg.name} learns Q-values of discrete actions; these are {space}")
    return space.n


def make_dueling_qnet(
    cfg: Any, obs_shape: Sequence[int], num_actions: int | ActionSpace
) -> nn.Module:
    """Ape-X's network: a dueling Q-head on the torso ``cfg`` names."""
    return DuelingQNet(
        _torso(cfg, obs_shape), _discrete(cfg, num_actions), head_hidden_size=cfg.hidden_size
    )


def make_recurrent_qnet(
    cfg: Any, obs_shape: Sequence[int], num_actions: int | ActionSpace
) -> nn.Module:
    """R2D2's network: the torso, an LSTM, and a dueling Q-head."""
    return RecurrentQNet(
        _torso(cfg, obs_shape),
        _discrete(cfg, num_actions),
        lstm_size=cfg.hidden_size,
        head_hidden_size=cfg.hidden_size,
    )
