"""Accumulator: data-parallel gradients across a group, with a virtual batch size.

Every member takes part in every gradient round, with gradients
(``reduce_gradients``) or without (``skip_gradients``); a round sums
``batch_size * grad`` and the batch sizes of all members through the group's
all-reduce. Rounds are added up in order until the summed batch size reaches
the virtual batch size; then every member's ``.grad`` is set to the sum divided
by that batch size (the gradient of the mean loss over the union of the
batches), identically everywhere, and ``has_gradients()`` is True until
``zero_gradients()``.

After every membership change the members elect a leader (the highest model
version; the first in member order among equals) through an all-reduce of
their model versions and lineages. A member whose (version, lineage) differs
from the leader's -- a new peer, or one that diverged -- gets the leader's state:
the leader sees ``wants_state()`` and calls ``set_state(obj)``; the member sees
``has_new_state()`` and loads ``state()``. Model buffers (e.g. batch-norm
statistics) follow the leader: each round carries the leader's buffers.

As in the original moolib, a member is ``connected()`` as soon as it is in the
group with a leader and holds the leader's model: on the leader and the members
in step with it at once, on the others when the leader's state arrives, from
which point ``has_new_state()`` is True until ``state()`` is read. Until it is
read, the member neither offers gradients nor sends its state (its model is not
the one its version says), so the calls of a training loop may come in any
order. docs/architecture.md (section 5) describes the protocol.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from ._checks import check_int
from .errors import MembershipChangedError, ModelMismatchError
from .group import Group
from .rpc import Rpc

__all__ = ["Accumulator"]

log = logging.getLogger("moolib")


def _next_lineage(lineage: int, sync_id: int) -> int:
    """The lineage after an election: the same on every member that computes it."""
    return ((lineage * 0x9E3779B97F4A7C15) ^ sync_id) & ((1 << 62) - 1)


def _torch() -> Any:
    import torch

    return torch


class Accumulator:
    """Sums gradients of identical models across a group of peers (see module doc).

    ``parameters`` and ``buffers`` are the model's (e.g. ``model.parameters()``,
    ``model.buffers()``). Without ``group``, the accumulator makes its own Rpc
    and a group named ``name``; ``connect(address)`` then reaches the broker, and
    ``close()`` leaves the group and closes that Rpc.
    """

    def __init__(
        self, name: str, parameters: Iterable, buffers: Iterable, group: Group | None = None
    ) -> None:
        torch = _torch()
        self._torch = torch
        self._name = name
        self._params = [p for p in parameters]
        self._buffers = [b for b in buffers]
        if not self._params:
            raise ValueError("Accumulator needs at least one parameter")
        for what, tensors in (("parameters", self._params), ("buffers", self._buffers)):
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor):
                    raise TypeError(
                        f"Accumulator {what} must be tensors, got {type(t).__name__} at index {i}"
                    )
        # Made here (no group given): this accumulator's own, which close() closes.
        self._owns_group = group is None
        if group is None:
            group = Group(Rpc(), name)
        self._group = group
        self._rpc: Rpc = group.rpc
        self._state_function = f"__moolib_accumulator/{name}/state"
        self._rpc.define(self._state_function, self._receive_state)

        self._virtual_batch_size = 1
        self._parallel = 1
        self._model_version = 0
        self._lineage = secrets.randbits(62)

        self._sync_id: int | None = None
        self._phase = "idle"  # idle | electing | waiting_state | ready | refused
        self._election: Any = None
        self._leader: str | None = None
        self._leader_version = 0
        self._leader_lineage = 0
        self._needers: list[str] = []
        self._incoming: tuple | None = None  # (sync id, version, lineage, state)
        # The leader's state, received and not read yet: it outlives elections
        # (this peer already took its version and lineage).
        self._new_state: Any = None
        self._has_new_state = False

        self._rounds: deque[Any] = deque()  # AllReduce of [grads, meta(, buffers)]
        self._sum: Any = None
        self._sum_meta = [0.0, 0, 0]  # batch size, gradients, skipped
        self._has_gradients = False
        # Summed gradients that reached the virtual batch size, in round order,
        # waiting for the previous ones to be applied.
        self._ready: deque[tuple[Any, list[float]]] = deque()
        self._stats = {"batch_size": 0, "num_gradients": 0, "num_skipped": 0}

        # Flat layout of parameters (by dtype) for the reductions.
        self._dtype = self._params[0].dtype
        for p in self._params:
            if p.dtype != self._dtype:
                raise ValueError("all parameters must have the same dtype")
        self._numels = [p.numel() for p in self._params]
        self._total = sum(self._numels)
        # (shape, dtype) of every parameter and buffer: peers must agree on it.
        self._layout = tuple(
            tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors)
            for tensors in (self._params, self._buffers)
        )

    # Connection -------------------------------------------------------------

    def connect(self, address: str) -> None:
        """Connects this accumulator's Rpc to the broker at ``address``."""
        self._rpc.connect(address)

    def close(self) -> None:
        """Stops taking part: its function on the Rpc is undefined and, when the accumulator
        made its own Rpc and group (none given), the group is left (the broker hears it at
        once) and the Rpc closed. A given group and its Rpc stay open: they are the caller's.
        Without it, the Rpc lives on until garbage collected (the function it serves refers
        back to the accumulator), still reaching for its broker. Safe to call twice."""
        try:
            self._rpc.undefine(self._state_function)
        except Exception:  # noqa: BLE001 - undefined already, or the Rpc was closed first
            pass
        if self._owns_group:
            self._group.close()
            self._rpc.close()

    def connected(self) -> bool:
        """Whether this peer is in the group, knows its leader and has received its model."""
        return self._phase == "ready" and self._group.active()

    def update(self) -> None:
        """Advances membership, leader election, state transfer and gradient rounds. Call often.

        Raises ``ModelMismatchError`` (on every member, once per membership) when
        members' models differ in their number, shapes or dtypes of parameters or
        buffers; the accumulator then stays unconnected until membership changes.
        """
        self._group.update()
        if not self._group.active():
            if self._phase != "idle":
                self._reset("idle")
                self._sync_id = None
            return
        sync_id = self._group.sync_id()
        if sync_id != self._sync_id:
            self._start_election(sync_id)
        if self._phase == "refused":
            return
        if self._phase == "electing" and self._election.done():
            self._finish_election()
        if self._phase == "waiting_state" and self._incoming is None:
            waited = time.monotonic() - self._waiting_since
            if waited > self._group.get_collective_timeout():
                # The leader's loop may not call wants_state()/set_state(), or
                # the state was lost: say so, and have every member elect again
                # (under a new sync id) rather than wait forever.
                log.error(
                    "accumulator '%s': no state from the leader '%s' after %.0f s "
                    "(does its loop call wants_state() and set_state()?); electing again",
                    self._name,
                    self._leader,
                    waited,
                )
                self._reset("idle")
                self._group._resync()
                return
        if self._phase == "waiting_state" and self._incoming is not None:
            sync_id, version, lineage, state = self._incoming
            self._incoming = None
            if sync_id == self._sync_id:
                self._new_state, self._has_new_state = state, True
                self._model_version, self._lineage = version, lineage
                self._phase = "ready"
        if self._phase == "ready":
            self._collect_rounds()

    def _reset(self, phase: str) -> None:
        self._phase = phase
        self._rounds.clear()
        self._sum = None
        self._sum_meta = [0.0, 0, 0]
        self._ready.clear()
        # A round can complete on some members and fail on others when
        # membership changes at its end: gradients not yet applied are
        # dropped everywhere, so no member steps with what others lack.
        if self._has_gradients:
            self._has_gradients = False
            for p in self._params:
                if p.grad is not None:
                    p.grad.zero_()
        self._election = None
        self._needers = []

    def _start_election(self, sync_id: int) -> None:
        self._reset("electing")
        self._sync_id = sync_id
        members = self._group.members()
        if self._rpc.get_name() not in members:
            # Membership moved on between update()'s check and here (e.g. this
            # peer was dropped after a stall): try again on the next update().
            self._reset("idle")
            self._sync_id = None
            return
        self._election_members = members
        # Every member's model layout comes along, so peers with different
        # models are refused here, before any gradient is summed.
        vote = (self._model_version, self._lineage, self._layout)
        self._election = self._group._gather_at(f"{self._name}/elect", vote, sync_id)

    def _failed(self, what: str, error: BaseException) -> None:
        # A membership change (or the group losing the broker) is how rounds
        # normally end; anything else (a member stuck past the collective
        # timeout, a lost link) ends them too, and the log says so.
        if not isinstance(error, MembershipChangedError):
            log.warning("accumulator '%s': %s failed, electing again: %s", self._name, what, error)

    def _finish_election(self) -> None:
        error = self._election.exception()
        if error is not None:
            # update() sees the new sync id next, or elects again under this one.
            self._failed("the election", error)
            self._sync_id = None
            self._phase = "idle"
            return
        votes = self._election.result()
        members = self._election_members
        mismatch = self._layout_mismatch(members, [layout for _, _, layout in votes])
        if mismatch:
            self._phase = "refused"
            raise ModelMismatchError(mismatch)
        table = [(version, lineage) for version, lineage, _ in votes]
        versions = [v for v, _ in table]
        leader = versions.index(max(versions))
        self._leader = members[leader]
        self._leader_version, self._leader_lineage = table[leader]
        me = members.index(self._rpc.get_name())
        self._needers = [
            members[i] for i, row in enumerate(table) if i != leader and row != table[leader]
        ]
        if me != leader and table[me] != table[leader]:
            self._phase = "waiting_state"
            self._waiting_since = time.monotonic()
        else:
            # The members in step with the leader start a lineage of this
            # membership: peers that later train apart (each in a membership
            # of its own) then differ even at equal model versions.
            self._lineage = _next_lineage(self._leader_lineage, self._sync_id)
            self._phase = "ready"

    def _layout_mismatch(self, members: list[str], layouts: list[Any]) -> str | None:
        """A message naming the peers and the first parameter or buffer whose count,
        shape or dtype differs from this peer's, or None when every layout matches."""
        mine = self._layout
        me = self._rpc.get_name()
        for name, theirs in zip(members, layouts, strict=True):
            if theirs == mine:
                continue
            where = f"accumulator '{self._name}' of group '{self._group.name()}'"
            for kind, a, b in zip(("parameters", "buffers"), mine, theirs, strict=True):
                if len(a) != len(b):
                    return (
                        f"{where}: peers have different models: '{me}' has {len(a)} {kind}, "
                        f"'{name}' has {len(b)}"
                    )
                for i, (x, y) in enumerate(zip(a, b, strict=True)):
                    if x != y:
                        return (
                            f"{where}: peers have different models: {kind[:-1]} {i} is "
                            f"{x[1]}{list(x[0])} on '{me}' and {y[1]}{list(y[0])} on '{name}'"
                        )
        return None

    # State --------------------------------------------------------------------

    def wants_state(self) -> bool:
        """True on the leader when peers wait for its state: call ``set_state``."""
        return (
            self._phase == "ready"
            and not self._has_new_state
            and self.is_leader()
            and bool(self._needers)
        )

    def set_state(self, state: Any) -> None:
        """Sends ``state`` (e.g. model and optimizer state dicts) to the peers that need it."""
        needers, self._needers = self._needers, []
        for peer in needers:
            self._rpc.async_callback(
                peer,
                self._state_function,
                lambda _result, _error: None,
                self._sync_id,
                self._model_version,
                self._lineage,
                state,
            )

    def _receive_state(self, sync_id: int, version: int, lineage: int, state: Any) -> None:
        self._incoming = (sync_id, version, lineage, state)

    def has_new_state(self) -> bool:
        """True from the leader's state's arrival until ``state()`` reads it: load it then."""
        return self._has_new_state

    def state(self) -> Any:
        """The leader's state (load it into the model and optimizer); read once."""
        if not self._has_new_state:
            raise RuntimeError("no new state: check has_new_state() first")
        state, self._new_state, self._has_new_state = self._new_state, None, False
        return state

    # Gradients ----------------------------------------------------------------

    def wants_gradients(self) -> bool:
        """Whether to compute gradients now (and then call ``reduce_gradients``)."""
        return (
            self._phase == "ready"
            and not self._has_new_state
            and not self._has_gradients
            and len(self._rounds) < self._parallel
            and self._group.active()
            and self._group.sync_id() == self._sync_id
        )

    def reduce_gradients(self, batch_size: int) -> None:
        """Adds this peer's ``.grad`` (of a mean loss over ``batch_size`` samples) to the sum."""
        batch_size = check_int("batch_size", batch_size, low=1)
        torch = self._torch
        grads = torch.cat(
            [
                (
                    p.grad.detach().reshape(-1)
                    if p.grad is not None
                    else torch.zeros(n, dtype=self._dtype)
                ).to("cpu", self._dtype)
                for p, n in zip(self._params, self._numels, strict=True)
            ]
        )
        grads.mul_(batch_size)
        self._start_round(grads, [float(batch_size), 1.0, 0.0])

    def skip_gradients(self) -> None:
        """Takes part in this round without gradients."""
        grads = self._torch.zeros(self._total, dtype=self._dtype)
        self._start_round(grads, [0.0, 0.0, 1.0])

    def _start_round(self, grads: Any, meta: list[float]) -> None:
        torch = self._torch
        if self._phase != "ready":
            raise RuntimeError("the accumulator is not connected: check connected() first")
        if self._has_new_state:
            raise RuntimeError(
                "the leader's state has not been read: load state() before computing gradients"
            )
        if len(self._rounds) >= self._parallel:
            raise RuntimeError("too many gradient rounds in flight: check wants_gradients() first")
        tensors = [grads, torch.tensor(meta, dtype=torch.float64)]
        if self._buffers:
            leader = self.is_leader()
            buffers = torch.cat(
                [
                    b.detach().reshape(-1).to("cpu", torch.float64)
                    if leader
                    else torch.zeros(b.numel(), dtype=torch.float64)
                    for b in self._buffers
                ]
            )
            tensors.append(buffers)
        # Bound to the membership the leader was elected in: a round offered
        # after the group moved on fails at once (update() then re-syncs)
        # instead of pairing with other members' rounds of the next membership.
        self._rounds.append(self._group._sum_at(f"{self._name}/grads", tensors, self._sync_id))

    def _collect_rounds(self) -> None:
        while self._rounds and self._rounds[0].done():
            r = self._rounds.popleft()
            error = r.exception()
            if error is not None:
                # Every member drops its rounds of this membership; update() re-syncs.
                self._failed("a gradient round", error)
                self._reset("idle")
                self._sync_id = None
                return
            grads, meta, *buffers = r.result()
            self._apply_buffers(buffers[0] if buffers else None)
            self._sum = grads if self._sum is None else self._sum.add_(grads)
            meta = meta.tolist()
            self._sum_meta = [a + b for a, b in zip(self._sum_meta, meta, strict=True)]
            # Cut after the round that reaches the virtual batch size, so
            # every member groups the same rounds however many it collects
            # per update().
            if self._sum_meta[0] > 0 and self._sum_meta[0] >= self._virtual_batch_size:
                self._ready.append((self._sum, self._sum_meta))
                self._sum = None
                self._sum_meta = [0.0, 0, 0]
        if not self._has_gradients and self._ready:
            self._write_gradients(*self._ready.popleft())

    def _apply_buffers(self, flat: Any) -> None:
        if flat is None or self.is_leader():
            return
        offset = 0
        with self._torch.no_grad():
            for b in self._buffers:
                n = b.numel()
                b.copy_(flat[offset : offset + n].view(b.shape).to(b.dtype))
                offset += n

    def _write_gradients(self, total: Any, meta: list[float]) -> None:
        batch_size, num_gradients, num_skipped = meta
        total.div_(batch_size)
        offset = 0
        for p, n in zip(self._params, self._numels, strict=True):
            g = total[offset : offset + n].view(p.shape).to(p.device)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n
        self._stats = {
            "batch_size": int(batch_size),
            "num_gradients": int(num_gradients),
            "num_skipped": int(num_skipped),
        }
        self._has_gradients = True

    def wait_gradients(self, timeout: float | None = None) -> bool:
        """Blocks, without holding the GIL, until the oldest gradient round in flight is
        complete (its sum waits for ``update()``), for at most ``timeout`` seconds.
        Returns whether one is; False at once when no round is in flight. A learner on
        a thread of its own blocks here rather than polling ``update()``, which would
        take the GIL from the other threads at every poll. (Not in the original
        moolib.)"""
        if not self._rounds:
            return False
        return bool(self._rounds[0].wait(timeout))

    def has_gradients(self) -> bool:
        """Whether summed gradients reached the virtual batch size and are in ``.grad``."""
        return self._has_gradients

    def zero_gradients(self) -> None:
        """After the optimizer step: zeroes ``.grad`` and increments the model version."""
        for p in self._params:
            if p.grad is not None:
                p.grad.zero_()
        self._has_gradients = False
        self._model_version += 1

    def get_gradient_stats(self) -> dict[str, int]:
        """``batch_size``, ``num_gradients``, ``num_skipped`` of the last summed gradients."""
        return dict(self._stats)

    # Settings and queries -----------------------------------------------------

    def set_virtual_batch_size(self, n: int) -> None:
        """Gradients are applied once at least ``n`` samples were summed."""
        self._virtual_batch_size = check_int("virtual batch size", n, low=1)

    def set_parallel_gradients(self, n: int) -> None:
        """Lets up to ``n`` gradient rounds be in flight at once."""
        self._parallel = check_int("parallel gradients", n, low=1)

    def model_version(self) -> int:
        return self._model_version

    def lineage(self) -> int:
        """The lineage of this peer's model: changes at each election, equal on members
        in step with the leader (kept in checkpoints to tell their history apart)."""
        return self._lineage

    def set_model_version(self, n: int) -> None:
        """Sets the model version (e.g. after loading a checkpoint): the highest leads."""
        self._model_version = check_int("model version", n, low=0)

    def get_leader(self) -> str | None:
        """The leader's name, once elected."""
        return self._leader if self._phase in ("ready", "waiting_state") else None

    def is_leader(self) -> bool:
        return self.get_leader() == self._rpc.get_name()

    @property
    def group(self) -> Group:
        return self._group

    @property
    def rpc(self) -> Rpc:
        return self._rpc
