"""Learner-step results that the host needs, read without stalling a GPU.

A learner step on a GPU is queued work: the host launches its kernels and goes on.
Reading one of its results on the host (``.cpu()``, ``float()``) waits for the whole
step, and the GPU then idles while the host samples the next batch and launches the
next step. The off-policy learner needs two such results each step: the new
priorities (for the replay) and the weights it publishes (for the actors).

``HostResults`` copies them to pinned host memory behind the step's kernels and
hands them over after the next step is queued, so the GPU always has a step to run;
the replay's priorities then lag the learner by one step.
On a CPU a step's results are ready when it returns: they are handed over at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Tensors = dict[str, torch.Tensor]


class HostResults:
    """Hands a learner step's tensors to host callbacks once they are computed."""

    def __init__(self, device: torch.device) -> None:
        self._deferred = device.type == "cuda"
        self._pending: list[tuple[torch.cuda.Event, Tensors, Callable[[Tensors], None]]] = []

    def add(self, tensors: Tensors, then: Callable[[Tensors], None]) -> None:
        """Calls ``then`` with host copies of ``tensors`` (results of the step just
        queued): at once on a CPU, else at the next ``hand_over``."""
        if not self._deferred:
            then({k: v.detach() for k, v in tensors.items()})
            return
        # A non-blocking copy to the CPU lands in pinned memory, in stream order.
        host = {k: v.detach().to("cpu", non_blocking=True) for k, v in tensors.items()}
        copied = torch.cuda.Event()
        copied.record()
        self._pending.append((copied, host, then))

    def hand_over(self) -> None:
        """Calls the callbacks of everything added so far, each once its copies are
        done (call it after queueing the next step, and before reading what the
        callbacks write: a checkpoint, the end of the run)."""
        pending, self._pending = self._pending, []
        for copied, host, then in pending:
            copied.synchronize()
            then(host)
