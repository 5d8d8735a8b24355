"""R2D2's math (Kapturowski et al., 2019): sequences for the replay, burn-in, the
rescaled n-step double-Q loss and the sequence priorities.

The network is :class:`moolib.agents.nets.qmodels.RecurrentQNet`. An actor steps its
envs, acts epsilon-greedily on its Q-values, and hands every step, with the LSTM
state it acted with, to a :class:`SequenceSplitter`, which returns the sequences
completed so far for the replay. The learner samples sequences and takes
:func:`loss`, which refreshes each sequence's stored state by a burn-in, learns
on the rest, and returns the new priorities.

Steps use the EnvPool layout of :mod:`moolib.agents.nets.models` (``reward`` and
``done`` arrive with the observation that follows the action), so the last step
of a sequence only bootstraps, and the step that starts the next episode closes
the previous episode's sequences (it carries that episode's last reward and
``done``) and opens the next episode's first one. Sequences never cross an
episode boundary otherwise.

Sequences are stored and sampled one per row: ``[K, L, ...]`` (batch-major), the
learner's network runs time-major.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..nets.models import CoreState
from .offpolicy import RESCALE_EPSILON, double_q_bootstrap, n_step_targets

__all__ = [
    "R2D2Loss",
    "SequenceSplitter",
    "burn_in_unroll",
    "loss",
    "sequence_priorities",
]

# The keys the network reads; a sequence also holds "action" and anything else the
# actor put in its steps.
_INPUT_KEYS = ("state", "reward", "done", "prev_action")


class SequenceSplitter:
    """Cuts the step streams of an actor's ``batch_size`` envs into overlapping sequences.

    Within an episode a sequence starts every ``sequence_length - overlap`` steps
    and is emitted once it has ``sequence_length`` steps. When an episode ends
    (a step with ``done``), every sequence still open gets that step as its last
    one and is padded to ``sequence_length`` and emitted: padded steps are zeros
    with ``done`` true (nothing bootstraps from them), and ``mask`` is false there.
    A closing sequence that would have no transition after ``burn_in`` (nothing to
    learn from) is dropped. Each sequence keeps the LSTM state its first step was
    acted with.

    Steps go into one preallocated ring of ``sequence_length`` steps per key, and
    sequences are gathered from it with one index per key, whatever the number of
    envs.

    Args:
        batch_size: envs in the actor's batch.
        sequence_length: steps per sequence (burn-in included).
        overlap: steps shared by consecutive sequences of one episode.
        burn_in: the learner's burn-in steps, to drop closing sequences that are
            too short to learn from.
    """

    def __init__(
        self, batch_size: int, sequence_length: int, overlap: int, burn_in: int = 0
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0 <= overlap < sequence_length:
            raise ValueError(
                f"overlap must be in [0, sequence_length = {sequence_length}), got {overlap}"
            )
        if not 0 <= burn_in <= sequence_length - 2:
            raise ValueError(
                f"burn_in must leave a transition to learn from: at most sequence_length - 2 "
                f"= {sequence_length - 2}, got {burn_in}"
            )
        self.batch_size = batch_size
        self.length = sequence_length
        self.stride = sequence_length - overlap
        self.burn_in = burn_in
        self._ring: dict[str, torch.Tensor] = {}
        self._core: tuple[torch.Tensor, ...] = ()
        self._step = 0  # steps added so far (the ring position is _step % length)
        # Per env: the index within its episode of the next step (0: it starts one).
        self._episode_step = torch.zeros(batch_size, dtype=torch.int64)

    def _store(self, step: dict[str, torch.Tensor], core_state: CoreState) -> None:
        position = self._step % self.length
        if not self._ring:
            self._ring = {
                k: torch.zeros((self.length, *v.shape), dtype=v.dtype, device=v.device)
                for k, v in step.items()
            }
            self._core = tuple(
                torch.zeros((self.length, *s.shape[1:]), dtype=s.dtype, device=s.device)
                for s in core_state
            )
        if step.keys() != self._ring.keys():
            raise ValueError(f"steps must keep their keys {sorted(self._ring)}, got {sorted(step)}")
        for k, v in step.items():
            self._ring[k][position].copy_(v)
        for ring, s in zip(self._core, core_state, strict=True):
            ring[position].copy_(s[0])  # [1, B, H] -> [B, H]

    def add(self, step: dict[str, torch.Tensor], core_state: CoreState) -> dict | None:
        """Adds one step of every env and returns the sequences it completed, if any.

        Args:
            step: ``[B, ...]`` tensors of one step: at least ``state``, ``reward``,
                ``done`` (bool), ``prev_action`` and ``action``.
            core_state: ``(h, c)``, each ``[1, B, H]``: the state the actor acted on
                this step with (before the network's own reset at ``done``).

        Returns:
            ``None``, or ``{"steps": {key: [K, L, ...]}, "mask": [K, L] bool,
            "core": (h, c) each [K, H], "env": [K] int64}`` for K sequences.
        """
        if not core_state:
            raise ValueError("core_state must be the (h, c) the step was acted with, not ()")
        done = step["done"].bool().cpu()
        if done.shape != (self.batch_size,):
            raise ValueError(f"step['done'] must have shape [{self.batch_size}], got {done.shape}")
        now = self._step
        self._store(step, core_state)
        envs, starts, lengths = [], [], []

        if now > 0:
            # Episodes that ended with the previous step: their open sequences take
            # this step as their last one. Open: started at a multiple of the stride,
            # at most length - 1 steps ago (else emitted already).
            for b in torch.nonzero(done).flatten().tolist():
                ended = int(self._episode_step[b])  # steps of the episode that ended
                first = max(0, ended - self.length + 1)
                first = -(-first // self.stride) * self.stride
                for offset in range(first, ended, self.stride):
                    real = ended - offset + 1
                    if real >= self.burn_in + 2:
                        envs.append(b)
                        starts.append(now - real + 1)
                        lengths.append(real)
            new_episode = done
        else:
            new_episode = torch.ones(self.batch_size, dtype=torch.bool)
        self._episode_step[new_episode] = 0

        # Sequences that this step fills.
        since = self._episode_step - (self.length - 1)
        full = (since >= 0) & (since % self.stride == 0)
        for b in torch.nonzero(full).flatten().tolist():
            envs.append(b)
            starts.append(now - self.length + 1)
            lengths.append(self.length)

        self._episode_step += 1
        self._step += 1
        if not envs:
            return None
        return self._gather(envs, starts, lengths)

    def _gather(self, envs: list[int], starts: list[int], lengths: list[int]) -> dict:
        device = next(iter(self._ring.values())).device
        env = torch.tensor(envs, dtype=torch.int64)
        start = torch.tensor(starts, dtype=torch.int64)
        offsets = torch.arange(self.length, dtype=torch.int64)
        mask = offsets[None, :] < torch.tensor(lengths, dtype=torch.int64)[:, None]  # [K, L]
        # Padded entries read whatever is in the ring and are overwritten below.
        positions = (start[:, None] + offsets[None, :]) % self.length  # [K, L]
        index_t, index_b = positions.to(device), env[:, None].expand_as(positions).to(device)
        pad = ~mask.to(device)
        steps = {}
        for k, ring in self._ring.items():
            values = ring[index_t, index_b]  # [K, L, ...]
            fill = pad.view(*pad.shape, *([1] * (values.dim() - 2)))
            padding = torch.ones_like(values) if k == "done" else torch.zeros_like(values)
            steps[k] = torch.where(fill, padding, values)
        first = (start % self.length).to(device)
        core = tuple(ring[first, env.to(device)] for ring in self._core)
        return {"steps": steps, "mask": mask.to(device), "core": core, "env": env}


def sequence_priorities(
    td_errors: torch.Tensor, mask: torch.Tensor, eta: float = 0.9
) -> torch.Tensor:
    """R2D2's priority of each sequence: ``eta max_t |delta_t| + (1 - eta) mean_t |delta_t|``
    over its valid steps; ``[T, B]`` -> ``[B]``. A sequence with no valid step gets 0."""
    if td_errors.shape != mask.shape:
        raise ValueError(
            f"td_errors and mask must have one shape, got {list(td_errors.shape)} "
            f"and {list(mask.shape)}"
        )
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta must be in [0, 1], got {eta!r}")
    valid = mask.bool()
    errors = torch.where(valid, td_errors.detach().abs(), torch.zeros_like(td_errors))
    count = valid.sum(dim=0)
    largest = errors.max(dim=0).values
    mean = errors.sum(dim=0) / count.clamp(min=1).to(errors.dtype)
    return eta * largest + (1.0 - eta) * mean


def _time_slice(inputs: dict[str, torch.Tensor], start: int, stop: int | None) -> dict:
    return {k: v[start:stop] for k, v in inputs.items()}


def burn_in_unroll(
    net: nn.Module, inputs: dict[str, torch.Tensor], core_state: CoreState, burn_in: int
) -> tuple[torch.Tensor, CoreState]:
    """Unrolls ``net`` over time-major ``inputs`` ``[L, B]`` from a stored ``core_state``:
    the first ``burn_in`` steps without gradient, only to refresh the state (the
    stored one is stale: an older network made it), then the rest with gradient.

    Returns the Q-values of steps ``burn_in..L-1`` ``[L - burn_in, B, A]`` and the
    state after the burn-in (which no gradient flows through).
    """
    if burn_in > 0:
        with torch.no_grad():
            _, core_state = net(_time_slice(inputs, 0, burn_in), core_state)
    q, _ = net(_time_slice(inputs, burn_in, None), core_state)
    return q, core_state


class R2D2Loss(NamedTuple):
    """Output of :func:`loss`.

    Attributes:
        loss: the scalar to differentiate.
        priorities: ``[B]`` the sequences' new priorities (no grad).
        td_errors: ``[L - burn_in - 1, B]`` ``delta`` in rescaled space (no grad).
        mask: ``[L - burn_in - 1, B]`` the transitions the loss counts.
    """

    loss: torch.Tensor
    priorities: torch.Tensor
    td_errors: torch.Tensor
    mask: torch.Tensor


def loss(
    online: nn.Module,
    target: nn.Module,
    sequences: dict,
    weights: torch.Tensor,
    *,
    burn_in: int,
    n: int,
    discount: float,
    eta: float = 0.9,
    rescale_epsilon: float = RESCALE_EPSILON,
) -> R2D2Loss:
    """R2D2's learner loss on sampled sequences.

    Both networks burn in on the first ``burn_in`` steps from the stored state; the
    loss covers transitions ``burn_in..L-2`` whose next step is real, with targets
    ``h(n-step return + discount * h^-1(Q_target(s', argmax Q_online(s'))))``. Per
    sequence the squared errors are summed over time, then weighted by ``weights``
    and averaged over the batch: ``mean_b w_b sum_t delta_tb^2 / 2``.

    Args:
        online: the network being trained (a :class:`RecurrentQNet`).
        target: its periodically updated copy.
        sequences: as :class:`SequenceSplitter` makes them: ``steps`` (``state``,
            ``reward``, ``done``, ``prev_action``, ``action``; ``[B, L, ...]``),
            ``mask`` ``[B, L]``, ``core`` ``(h, c)`` each ``[B, H]``.
        weights: ``[B]`` importance weights.
        burn_in, n, discount, eta, rescale_epsilon: the paper's 40, 5, 0.997, 0.9, 1e-3.
    """
    steps = sequences["steps"]
    length = steps["action"].shape[1]
    if not 0 <= burn_in <= length - 2:
        raise ValueError(f"burn_in must be in [0, L - 2 = {length - 2}], got {burn_in}")
    inputs = {k: steps[k].transpose(0, 1) for k in _INPUT_KEYS}
    core = tuple(s.unsqueeze(0) for s in sequences["core"])
    q_online, _ = burn_in_unroll(online, inputs, core, burn_in)
    with torch.no_grad():
        q_target, _ = target(inputs, core)
        q_target = q_target[burn_in:]

    actions = steps["action"].transpose(0, 1)[burn_in:-1]
    rewards = steps["reward"].transpose(0, 1)[burn_in + 1 :].to(q_online.dtype)
    dones = steps["done"].transpose(0, 1)[burn_in + 1 :]
    valid = sequences["mask"].transpose(0, 1)[burn_in + 1 :].bool()

    bootstrap = double_q_bootstrap(q_online[1:].detach(), q_target[1:])
    targets = n_step_targets(
        rewards,
        dones,
        bootstrap,
        n=n,
        discount=discount,
        rescale=True,
        rescale_epsilon=rescale_epsilon,
    )
    taken = q_online[:-1].gather(-1, actions.long().unsqueeze(-1)).squeeze(-1)
    delta = targets - taken
    per_sequence = 0.5 * (delta.pow(2) * valid.to(delta.dtype)).sum(dim=0)
    value = (weights.to(delta.dtype) * per_sequence).mean()
    detached = delta.detach()
    priorities = sequence_priorities(detached, valid, eta)
    return R2D2Loss(value, priorities, detached, valid)
