"""The actors' copies of the learner's model: three slots, written and read without a race.

The learner thread changes its model in place (the optimizer step, a state loaded
from the group); the acting thread runs batched forward passes at the same time.
Acting on the learner's own tensors would read parameters half-way through an
update, and copying them for every acting step would cost a full model copy per
step. Instead (docs/architecture.md, section 6):

- there are three copies of the model, the *slots*. One is the *front*: the
  newest published version. The acting thread reads the front slot for one
  forward pass at a time and marks it as read meanwhile;
- after each update the learner copies its parameters and buffers into a slot
  that is neither the front nor being read (of three, one always is), then makes
  it the front. So the learner never waits for the actors, the actors never wait
  for a copy, no slot is written while it is read, and each acting step sees one
  whole version;
- the version the actors see only moves forward: they always take the front,
  and a newer front only ever replaces it.

On a GPU the slot copy runs on the learner's CUDA stream: the acting stream waits
for the copy's event before reading the slot, and the learner's stream waits for
the event of the last forward pass that read a slot before writing it again.
"""

from __future__ import annotations

import contextlib
import copy
import threading
from collections.abc import Iterator

import torch

__all__ = ["PolicySlots"]

_SLOTS = 3


class PolicySlots:
    """Publishes ``model``'s parameters and buffers from one learner thread to one
    acting thread (see the module doc). ``version`` is the version of ``model`` now."""

    def __init__(self, model: torch.nn.Module, version: int) -> None:
        self._models = [copy.deepcopy(model).requires_grad_(False) for _ in range(_SLOTS)]
        self._tensors = [_tensors(m) for m in self._models]
        self._versions = [int(version)] * _SLOTS
        self._front = 0
        self._reading = -1  # the slot the acting thread reads now, if any
        self._lock = threading.Lock()  # guards _front, _reading and _versions
        self._device = next(iter(model.parameters())).device
        self._cuda = self._device.type == "cuda"
        # CUDA events: a slot's copy is done; the last forward pass that read it is done.
        self._written: list[torch.cuda.Event | None] = [None] * _SLOTS
        self._read: list[torch.cuda.Event | None] = [None] * _SLOTS

    @property
    def version(self) -> int:
        """The newest published version (the front slot's)."""
        with self._lock:
            return self._versions[self._front]

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Copies ``model`` (the learner's, of the same architecture) into a free slot
        and makes it the front, as ``version``. Called by the learner thread only."""
        with self._lock:
            slot = next(i for i in range(_SLOTS) if i not in (self._front, self._reading))
        if self._cuda and self._read[slot] is not None:
            torch.cuda.current_stream(self._device).wait_event(self._read[slot])
        # One call for all tensors: each torch call gives up the GIL, and on a small
        # model a call per tensor hands the GIL to the acting thread and back each time.
        with torch.no_grad():
            torch._foreach_copy_(self._tensors[slot], _tensors(model))
        if self._cuda:
            self._written[slot] = self._record()
        with self._lock:
            self._versions[slot] = int(version)
            self._front = slot

    @contextlib.contextmanager
    def acting(self) -> Iterator[tuple[torch.nn.Module, int]]:
        """The front slot's model and version, for one forward pass of the acting
        thread (one thread only); the slot is not written until the block ends."""
        with self._lock:
            slot = self._front
            self._reading = slot
        if self._cuda and self._written[slot] is not None:
            torch.cuda.current_stream(self._device).wait_event(self._written[slot])
        try:
            yield self._models[slot], self._versions[slot]
        finally:
            if self._cuda:
                self._read[slot] = self._record()
            with self._lock:
                self._reading = -1

    def _record(self) -> torch.cuda.Event:
        """An event at this point of the calling thread's stream on the model's device."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]
