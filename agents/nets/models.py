"""Actor-critic networks for the agents: the IMPALA Atari nets, the MinAtar net, a small MLP
and a tiny net for measuring the loop.

Every network has one interface, so an agent never needs to know which it got::

    outputs, core_state = model(inputs, core_state)

``inputs`` is a dict of time-major tensors:

- ``"state"``: ``[T, B, *observation_shape]`` observations (uint8 frames
  ``[T, B, C, H, W]`` for Atari, uint8 0/1 grids ``[T, B, C, 10, 10]`` for
  MinAtar, float32 vectors for CartPole);
- ``"reward"``: ``[T, B]`` float32, the reward that led to the observation;
- ``"done"``: ``[T, B]`` bool, true where the observation at ``t`` starts a
  new episode (EnvPool returns the reset observation with ``done=True``);
- ``"prev_action"``: ``[T, B]`` int64, the action taken before the observation
  (``[T, B, A]`` float32 for continuous actions).

``outputs`` is a dict with ``"policy_logits"`` ``[T, B, P]`` (float32),
``"baseline"`` ``[T, B]`` (float32) and ``"action"`` ``[T, B]`` (int64): sampled
from the policy in training mode, the argmax in eval mode.

Every network takes its actions as an ``ActionSpace`` (``moolib.envs.actions``) or a
number of discrete ones. For continuous actions (a vector of ``A`` reals) the policy
is a diagonal Gaussian with a state-independent log standard deviation (CleanRL's
continuous PPO): ``policy_logits`` holds ``P = 2A`` values, the mean then the log
std of each dimension (``moolib.agents.nets.distributions`` reads them), and ``action`` is
``[T, B, A]`` float32: sampled in training mode, the mean in eval mode, not clipped
to the env's bounds (the env's ``ClipAction`` does that; the learner needs what the
policy drew).

``core_state`` is ``model.initial_state(batch_size)``: an empty tuple without an
LSTM, else ``(h, c)``, each ``[1, B, hidden_size]`` (``()`` passed to an LSTM
net means the initial state). With an LSTM the state is
carried from one unroll to the next and zeroed at episode ends, so the acting
loop passes it back in unchanged and never resets it itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from moolib.envs.actions import ActionSpace
from torch import nn

from . import distributions as policy_math

__all__ = [
    "NETWORKS",
    "ImpalaNet",
    "MLPNet",
    "MinAtarNet",
    "TinyNet",
    "actor_step",
    "check_observations",
    "create_model",
    "observations_unfit",
    "resolve_network",
]

CoreState = tuple[torch.Tensor, ...]


def scale_observations(state: torch.Tensor, scale: float) -> torch.Tensor:
    """``state`` as float32 divided by ``scale`` (no division when it is 1)."""
    if state.dtype == torch.uint8 and scale != 1.0:
        # One pass over the frames: the division promotes bytes to float32 as it goes.
        return torch.div(state, scale)
    x = state.float()
    return x / scale if scale != 1.0 else x


def unroll_lstm(
    lstm: nn.LSTM, inputs: torch.Tensor, done: torch.Tensor, state: CoreState
) -> tuple[torch.Tensor, CoreState]:
    """Runs ``lstm`` over ``inputs`` [T, B, I] step by step from ``state`` ((h, c), each
    [layers, B, H]), zeroing the state of env b before step t where ``done[t, b]``
    (observation t starts a new episode), so no memory crosses an episode boundary.
    Returns the outputs [T, B, H] and the state after the last step."""
    num_steps, batch_size = inputs.shape[:2]
    notdone = (~done.bool()).float()
    outputs = []
    for t in range(num_steps):
        mask = notdone[t].view(1, batch_size, 1)
        state = tuple(mask * s for s in state)
        output, state = lstm(inputs[t : t + 1], state)
        outputs.append(output)
    return torch.cat(outputs), state


# What an env step gives the network (actor_step adds the previous action).
_STEP_KEYS = ("state", "reward", "done")


def actor_step(
    env_out: Mapping[str, torch.Tensor],
    prev_action: torch.Tensor,
    device: torch.device | None = None,
) -> dict[str, torch.Tensor]:
    """One step of a batch of B envs as an actor gives it to a network, each ``[B]``
    (the inputs above without ``T``; ``v[None]`` adds it): the ``state``, ``reward`` and
    ``done`` of ``env_out`` (on ``device``, when given) and ``prev_action``, which is
    0 where ``done``: nothing the agent did led to an episode's first observation, so
    its input there does not depend on how the previous episode ended."""
    step = {k: env_out[k] if device is None else env_out[k].to(device) for k in _STEP_KEYS}
    done = step["done"].view(-1, *([1] * (prev_action.dim() - 1)))
    step["prev_action"] = prev_action.masked_fill(done, 0)
    return step


def as_action_space(actions: int | ActionSpace) -> ActionSpace:
    """``actions`` as an ``ActionSpace``: a number is that many discrete actions."""
    return actions if isinstance(actions, ActionSpace) else ActionSpace.discrete(int(actions))


class _ActorCritic(nn.Module):
    """The part shared by all networks: core input, optional LSTM core and heads.

    Subclasses build ``self.torso`` mapping ``[N, *observation_shape]`` to
    ``[N, torso_size]`` and call :meth:`_build_core`.
    """

    # The policy head's width: the number of discrete actions, or of dimensions.
    num_actions: int
    action_space: ActionSpace
    use_lstm: bool
    torso: nn.Module

    def _set_actions(self, actions: int | ActionSpace) -> None:
        self.action_space = as_action_space(actions)
        self.num_actions = self.action_space.dim
        self.continuous = self.action_space.continuous

    def _build_core(self, torso_size: int, hidden_size: int) -> None:
        # The core also sees the clipped reward and the previous action: with an
        # LSTM that lets the policy condition on what it just did and got.
        core_input_size = torso_size + 1 + self.num_actions
        if self.use_lstm:
            self.core = nn.LSTM(core_input_size, hidden_size, num_layers=1)
            core_output_size = hidden_size
        else:
            core_output_size = core_input_size
        self.policy = nn.Linear(core_output_size, self.num_actions)
        self.baseline = nn.Linear(core_output_size, 1)
        if self.continuous:
            space = self.action_space
            # CleanRL's continuous PPO: the mean starts near 0 (an orthogonal layer of
            # gain 0.01), the log std at 0 (std 1) for every state.
            nn.init.orthogonal_(self.policy.weight, gain=0.01)
            nn.init.zeros_(self.policy.bias)
            self.policy_log_std = nn.Parameter(torch.zeros(self.num_actions))
            # The previous action enters the core scaled to [-1, 1] by the env's
            # bounds. Not persistent: they are the env's, not learned.
            low = torch.tensor(space.low, dtype=torch.float32)
            high = torch.tensor(space.high, dtype=torch.float32)
            self.register_buffer("action_mid", (high + low) / 2, persistent=False)
            self.register_buffer("action_half_range", (high - low) / 2, persistent=False)

    def _action_input(self, prev_action: torch.Tensor) -> torch.Tensor:
        """The previous actions ``[N]`` (``[N, A]``) as the core's input ``[N, A]``:
        one-hot, or scaled to [-1, 1] (a sample past the bounds is clamped to them)."""
        if self.continuous:
            return ((prev_action.float() - self.action_mid) / self.action_half_range).clamp(
                -1.0, 1.0
            )
        return F.one_hot(prev_action.long(), self.num_actions).float()

    def initial_state(self, batch_size: int = 1) -> CoreState:
        """The core state at the start of training: ``()`` or zero ``(h, c)`` [1, B, H]."""
        if not self.use_lstm:
            return ()
        # Created on the module's device so a CUDA learner gets a CUDA state.
        device = self.policy.weight.device
        shape = (self.core.num_layers, batch_size, self.core.hidden_size)
        return tuple(torch.zeros(shape, device=device) for _ in range(2))

    # Observations are divided by this before the torso (255 for uint8 frames, so
    # actors ship bytes rather than floats). A class attribute rather than code in
    # forward so the Q-networks, which reuse the torso alone, scale the same way.
    observation_scale: float = 1.0

    def _preprocess(self, state: torch.Tensor) -> torch.Tensor:
        """Turns ``[N, *observation_shape]`` observations into float network input."""
        return scale_observations(state, self.observation_scale)

    def forward(
        self, inputs: dict[str, torch.Tensor], core_state: CoreState = ()
    ) -> tuple[dict[str, torch.Tensor], CoreState]:
        """Runs the network on a ``[T, B]`` unroll; see the module docstring."""
        state = inputs["state"]
        num_steps, batch_size = state.shape[:2]
        # The torso has no memory: fold time into the batch for one big call.
        x = self._preprocess(state.reshape(num_steps * batch_size, *state.shape[2:]))
        x = self.torso(x)

        # Reward clipping keeps Atari's score scales out of the input features.
        reward = inputs["reward"].reshape(num_steps * batch_size, 1).float().clamp(-1.0, 1.0)
        prev_action = self._action_input(
            inputs["prev_action"].reshape(num_steps * batch_size, *inputs["prev_action"].shape[2:])
        )
        core_input = torch.cat([x, reward, prev_action], dim=-1)

        if self.use_lstm:
            if not core_state:  # () means "from the start", as for the stateless nets
                core_state = self.initial_state(batch_size)
            core_output, core_state = unroll_lstm(
                self.core,
                core_input.view(num_steps, batch_size, -1),
                inputs["done"],
                core_state,
            )
            core_output = core_output.view(num_steps * batch_size, -1)
        else:
            core_output = core_input

        policy_logits = self.policy(core_output)
        if self.continuous:
            log_std = self.policy_log_std.expand_as(policy_logits)
            policy_logits = torch.cat([policy_logits, log_std], dim=-1)
        baseline = self.baseline(core_output)
        if self.training:
            action = policy_math.sample(policy_logits, self.continuous)
        else:
            action = policy_math.greedy(policy_logits, self.continuous)

        outputs = {
            "policy_logits": policy_logits.view(num_steps, batch_size, -1),
            "baseline": baseline.view(num_steps, batch_size),
            "action": action.view(num_steps, batch_size, *action.shape[1:]),
        }
        return outputs, core_state


class _ResidualBlock(nn.Module):
    """``x + conv(relu(conv(relu(x))))`` with 3x3 convolutions, channels kept."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the block."""
        return x + self.conv1(F.relu(self.conv0(F.relu(x))))


def _deep_torso(in_channels: int) -> nn.Sequential:
    # IMPALA paper, fig. 3 (right): three sections of conv, max-pool, two
    # residual blocks, then a final relu before the fully connected layer.
    layers: list[nn.Module] = []
    for channels in (16, 32, 32):
        layers += [
            nn.Conv2d(in_channels, channels, kernel_size=3, padding=1),
            nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            _ResidualBlock(channels),
            _ResidualBlock(channels),
        ]
        in_channels = channels
    layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _shallow_torso(in_channels: int) -> nn.Sequential:
    # IMPALA paper, fig. 3 (left): two convolutions as in the Nature DQN.
    return nn.Sequential(
        nn.Conv2d(in_channels, 16, kernel_size=8, stride=4),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=4, stride=2),
        nn.ReLU(),
    )


class ImpalaNet(_ActorCritic):
    """The IMPALA Atari network (Espeholt et al. 2018, fig. 3) with optional LSTM.

    Args:
        observation_shape: ``(C, H, W)`` of one observation, e.g. ``(4, 84, 84)``
            for four stacked grayscale frames.
        num_actions: the actions: an ``ActionSpace``, or how many discrete ones.
        deep: the residual network (default); ``False`` for the shallow one.
        use_lstm: put a one-layer LSTM core between the torso and the heads.
        hidden_size: width of the fully connected layer and of the LSTM.

    Observations are uint8 frames, scaled by 1/255 here so actors can ship
    bytes rather than floats.
    """

    def __init__(
        self,
        observation_shape: Sequence[int],
        num_actions: int | ActionSpace,
        *,
        deep: bool = True,
        use_lstm: bool = False,
        hidden_size: int = 256,
    ) -> None:
        super().__init__()
        observation_shape = tuple(observation_shape)
        check_observations("impala_deep" if deep else "impala_shallow", observation_shape)
        self.observation_shape = observation_shape
        self._set_actions(num_actions)
        self.use_lstm = use_lstm
        self.deep = deep
        conv = _deep_torso if deep else _shallow_torso
        conv_layers = conv(observation_shape[0])
        # Any frame size works: measure the flattened conv output once.
        with torch.no_grad():
            conv_size = conv_layers(torch.zeros(1, *observation_shape)).numel()
        self.torso = nn.Sequential(
            conv_layers, nn.Flatten(), nn.Linear(conv_size, hidden_size), nn.ReLU()
        )
        self._build_core(hidden_size, hidden_size)

    observation_scale = 255.0


class MinAtarNet(_ActorCritic):
    """The network of the MinAtar paper (Young & Tian, 2019) for small grids of channels:
    one 3x3 convolution with 16 channels and stride 1 (no padding), then a fully
    connected layer of ``hidden_size`` units (128 in the paper), with optional LSTM.

    Args:
        observation_shape: ``(C, H, W)`` of one observation, e.g. ``(4, 10, 10)``.
        num_actions: the actions: an ``ActionSpace``, or how many discrete ones.
        hidden_size: width of the fully connected layer (and of the LSTM).
        use_lstm: put a one-layer LSTM core between the torso and the heads.

    Observations are taken as they are (MinAtar's 0/1 cells), not scaled.
    """

    def __init__(
        self,
        observation_shape: Sequence[int],
        num_actions: int | ActionSpace,
        *,
        hidden_size: int = 128,
        use_lstm: bool = False,
    ) -> None:
        super().__init__()
        observation_shape = tuple(observation_shape)
        check_observations("minatar", observation_shape)
        self.observation_shape = observation_shape
        self._set_actions(num_actions)
        self.use_lstm = use_lstm
        channels, height, width = observation_shape
        conv_size = 16 * (height - 2) * (width - 2)
        self.torso = nn.Sequential(
            nn.Conv2d(channels, 16, kernel_size=3, stride=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(conv_size, hidden_size),
            nn.ReLU(),
        )
        self._build_core(hidden_size, hidden_size)


class MLPNet(_ActorCritic):
    """A two-layer MLP torso for small vector observations (CartPole & co).

    Args:
        observation_shape: shape of one observation; it is flattened.
        num_actions: the actions: an ``ActionSpace``, or how many discrete ones.
        hidden_size: width of both hidden layers (and of the LSTM).
        use_lstm: put a one-layer LSTM core between the torso and the heads.
    """

    def __init__(
        self,
        observation_shape: Sequence[int],
        num_actions: int | ActionSpace,
        *,
        hidden_size: int = 64,
        use_lstm: bool = False,
    ) -> None:
        super().__init__()
        self.observation_shape = tuple(observation_shape)
        self._set_actions(num_actions)
        self.use_lstm = use_lstm
        input_size = math.prod(self.observation_shape)
        self.torso = nn.Sequential(
            nn.Flatten(),
            nn.Linear(input_size, hidden_size),
            nn.ReLU(),
            nn.Linear(hidden_size, hidden_size),
            nn.ReLU(),
        )
        self._build_core(hidden_size, hidden_size)


class _Subsample(nn.Module):
    """Every ``stride``-th cell of ``[N, C, H, W]`` images, high and wide, as float32
    divided by ``scale``: subsampled before it is converted, which is most of the
    tiny network's cost on whole frames."""

    def __init__(self, stride: int, scale: float) -> None:
        super().__init__()
        self.stride = stride
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Subsamples and scales ``x``."""
        if self.stride > 1:
            x = x[..., :: self.stride, :: self.stride]
        return scale_observations(x, self.scale)


class TinyNet(_ActorCritic):
    """A network that costs almost nothing beside an env step: one fully connected
    layer on the observations, images subsampled to at most ``TINY_CELLS`` cells high
    and wide (every k-th pixel), vectors as they are. For measuring what moolib-run's
    loop costs apart from its network (``bench/train.py``'s loop limit) and for quick
    runs of the machinery; it learns little from frames.

    Args:
        observation_shape: shape of one observation.
        num_actions: the actions: an ``ActionSpace``, or how many discrete ones.
        hidden_size: width of the layer (and of the LSTM).
        use_lstm: put a one-layer LSTM core between the torso and the heads.
    """

    def __init__(
        self,
        observation_shape: Sequence[int],
        num_actions: int | ActionSpace,
        *,
        hidden_size: int = 16,
        use_lstm: bool = False,
    ) -> None:
        super().__init__()
        self.observation_shape = tuple(observation_shape)
        self._set_actions(num_actions)
        self.use_lstm = use_lstm
        stride, scale = 1, 1.0
        if len(self.observation_shape) == 3:
            stride = max(1, math.ceil(max(self.observation_shape[1:]) / TINY_CELLS))
            # Frames are bytes: scaled to [0, 1] as the IMPALA nets do.
            scale = 255.0
        # The torso takes the observations as they come (observation_scale is 1, and
        # _preprocess passes them on) and scales only the cells it keeps.
        subsample = _Subsample(stride, scale)
        with torch.no_grad():
            input_size = subsample(torch.zeros(1, *self.observation_shape)).numel()
        self.torso = nn.Sequential(
            subsample, nn.Flatten(), nn.Linear(input_size, hidden_size), nn.ReLU()
        )
        self._build_core(hidden_size, hidden_size)

    def _preprocess(self, state: torch.Tensor) -> torch.Tensor:
        return state


NETWORKS = ("impala_deep", "impala_shallow", "minatar", "mlp", "tiny")
# The tiny network's images: at most this many cells high and wide.
TINY_CELLS = 8
# Images at most this high and wide are grids of a few cells (MinAtar's 10x10), not
# frames: auto gives them the MinAtar network, whose 3x3 convolution keeps every cell,
# where the IMPALA nets' pooling and strides would leave little of them.
SMALL_IMAGE = 16


# The smallest frames (pixels high and wide) each convolutional network takes: the
# shallow IMPALA network's strided convolutions (8x8 by 4, then 4x4 by 2) need 20, the
# MinAtar network's unpadded 3x3 convolution 3; the deep one pads all it does.
MIN_FRAME = {"impala_deep": 1, "impala_shallow": 20, "minatar": 3}


def observations_unfit(network: str, observation_shape: Sequence[int]) -> str | None:
    """What ``network`` (a name of ``NETWORKS``) needs that observations of
    ``observation_shape`` are not (``needs image observations (C, H, W)``), or None when it
    takes them: the convolutional networks take images ``(C, H, W)`` of at least
    ``MIN_FRAME`` pixels high and wide; the MLP takes any."""
    shape = tuple(observation_shape)
    smallest = MIN_FRAME.get(network)
    if smallest is None:
        return None
    if len(shape) != 3:
        return "needs image observations (C, H, W)"
    if min(shape[1:]) < smallest:
        return f"needs images of at least {smallest}x{smallest} pixels"
    return None


def check_observations(network: str, observation_shape: Sequence[int]) -> None:
    """Raises ValueError unless ``network`` takes observations of ``observation_shape``
    (see ``observations_unfit``)."""
    unfit = observations_unfit(network, observation_shape)
    if unfit:
        raise ValueError(f"{network} {unfit}, got shape {tuple(observation_shape)}")


def resolve_network(network: str, observation_shape: Sequence[int]) -> str:
    """The network an agent config's ``network`` names: ``auto`` is the deep IMPALA
    network for images (3-d observations), the MinAtar network for small images (at
    most ``SMALL_IMAGE`` cells high and wide) and an MLP for vectors."""
    if network == "auto":
        if len(observation_shape) != 3:
            return "mlp"
        return "minatar" if max(observation_shape[1:]) <= SMALL_IMAGE else "impala_deep"
    return network


def create_model(
    observation_shape: Sequence[int],
    num_actions: int | ActionSpace,
    *,
    network: str = "impala_deep",
    use_lstm: bool = False,
    hidden_size: int | None = None,
) -> nn.Module:
    """Builds a network by name (the ``network`` setting of the agent configs).

    Args:
        observation_shape: shape of one observation (without T and B).
        num_actions: the actions: an ``ActionSpace``, or how many discrete ones.
        network: ``"impala_deep"``, ``"impala_shallow"``, ``"minatar"``, ``"mlp"`` or
            ``"tiny"``.
        use_lstm: add the LSTM core.
        hidden_size: width of the hidden layers; ``None`` takes the network's
            default (256 for the IMPALA nets, 128 for MinAtar's, 64 for the MLP, 16
            for the tiny one).

    Raises:
        ValueError: for an unknown network name.
    """
    kwargs = {} if hidden_size is None else {"hidden_size": hidden_size}
    if network == "impala_deep":
        return ImpalaNet(observation_shape, num_actions, deep=True, use_lstm=use_lstm, **kwargs)
    if network == "impala_shallow":
        return ImpalaNet(observation_shape, num_actions, deep=False, use_lstm=use_lstm, **kwargs)
    if network == "minatar":
        return MinAtarNet(observation_shape, num_actions, use_lstm=use_lstm, **kwargs)
    if network == "mlp":
        return MLPNet(observation_shape, num_actions, use_lstm=use_lstm, **kwargs)
    if network == "tiny":
        return TinyNet(observation_shape, num_actions, use_lstm=use_lstm, **kwargs)
    raise ValueError(f"unknown network {network!r}; expected one of {', '.join(NETWORKS)}")


def make_actor_critic(
    cfg: Any, obs_shape: Sequence[int], num_actions: int | ActionSpace
) -> nn.Module:
    """The network of an actor-critic agent's settings ``cfg`` (its ``network``,
    ``use_lstm`` and ``hidden_size``: an ``AgentConfig``)."""
    return create_model(
        obs_shape,
        num_actions,
        network=resolve_network(cfg.network, tuple(obs_shape)),
        use_lstm=bool(cfg.use_lstm),
        hidden_size=cfg.hidden_size,
    )
