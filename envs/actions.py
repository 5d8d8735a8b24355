"""What an env's actions are, as the agents see them: ``n`` discrete choices, or a vector of
``dim`` real numbers within bounds (a gymnasium ``Box`` of one dimension).

``ActionSpace.of(space)`` reads a gymnasium space and refuses, in one line naming it, one
the agents cannot act in. The networks size their heads by it, the actors allocate
their actions by it, and ``moolib-run`` names it on its banner.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ActionSpace"]


@dataclass(frozen=True)
class ActionSpace:
    """Discrete (``n`` actions, ``0 .. n-1``) or continuous (``low`` and ``high`` per
    dimension, each finite: a Gaussian policy's samples are clipped to them)."""

    n: int = 0
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.continuous:
            if self.n:
                raise ValueError("an action space is discrete (n) or continuous (low, high)")
            if len(self.low) != len(self.high):
                raise ValueError(f"low {self.low} and high {self.high} differ in length")
            for lo, hi in zip(self.low, self.high, strict=True):
                if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
                    raise ValueError(
                        f"continuous actions need finite bounds with low < high, got "
                        f"low {list(self.low)}, high {list(self.high)}"
                    )
        elif self.n < 1:
            raise ValueError(f"a discrete action space needs at least one action, got n={self.n}")

    @classmethod
    def discrete(cls, n: int) -> ActionSpace:
        """``n`` discrete actions."""
        return cls(n=int(n))

    @classmethod
    def box(cls, low: Sequence[float], high: Sequence[float]) -> ActionSpace:
        """A vector of ``len(low)`` reals, dimension ``i`` within ``[low[i], high[i]]``."""
        return cls(low=tuple(float(v) for v in low), high=tuple(float(v) for v in high))

    @classmethod
    def of(cls, space: Any, name: str = "this env") -> ActionSpace:
        """The action space of a gymnasium space. Raises ValueError, naming ``name`` and the
        space, for one the agents cannot act in: a ``Discrete`` space not starting at 0, a
        ``Box`` of more than one dimension or with an infinite bound, or another kind."""
        import gymnasium
        import numpy as np

        if isinstance(space, gymnasium.spaces.Discrete):
            if int(space.start) != 0:
                raise ValueError(f"{name}: its actions start at {space.start}; agents pick 0..n-1")
            return cls.discrete(int(space.n))
        if isinstance(space, gymnasium.spaces.Box):
            if len(space.shape) != 1:
                raise ValueError(
                    f"{name}: continuous actions must be a vector (a Box of one dimension); "
                    f"this env's are {space}"
                )
            low = np.asarray(space.low, dtype=np.float64)
            high = np.asarray(space.high, dtype=np.float64)
            if not (np.isfinite(low).all() and np.isfinite(high).all()):
                raise ValueError(
                    f"{name}: continuous actions need finite bounds (the policy's samples are "
                    f"clipped to them); this env's are {space}"
                )
            return cls.box(low.tolist(), high.tolist())
        raise ValueError(
            f"{name}: moolib's agents act in a discrete action space "
            f"(gymnasium.spaces.Discrete) or a vector of reals (a Box of one dimension); "
            f"this env's is {space}"
        )

    @property
    def continuous(self) -> bool:
        """Whether the actions are vectors of reals."""
        return bool(self.low)

    @property
    def dim(self) -> int:
        """The policy head's width: the number of discrete actions, or of dimensions."""
        return len(self.low) if self.continuous else self.n

    def zeros(self, batch_size: int, device: Any = None) -> Any:
        """The actions of ``batch_size`` envs before any was taken, as a torch tensor:
        ``[B]`` int64 zeros, or ``[B, dim]`` float32 zeros."""
        import torch

        if self.continuous:
            return torch.zeros((batch_size, self.dim), dtype=torch.float32, device=device)
        return torch.zeros(batch_size, dtype=torch.int64, device=device)

    @functools.cached_property
    def _bounds(self) -> tuple[Any, Any]:
        # Made once: clip runs at every actor step.
        import torch

        return (
            torch.tensor(self.low, dtype=torch.float32),
            torch.tensor(self.high, dtype=torch.float32),
        )

    def sample(self, batch_size: int, generator: Any = None) -> Any:
        """``batch_size`` uniformly random actions, as a torch tensor (``zeros``' shape and
        dtype), drawn with ``generator``."""
        import torch

        if not self.continuous:
            return torch.randint(0, self.n, (batch_size,), generator=generator)
        low, high = self._bounds
        return low + (high - low) * torch.rand((batch_size, self.dim), generator=generator)

    def clip(self, actions: Any) -> Any:
        """Torch ``actions`` ``[..., dim]`` clipped to the bounds, as float32 (discrete ones
        are returned as they are): what an env is stepped with, where the learner keeps
        what the policy drew."""
        if not self.continuous:
            return actions
        import torch

        low, high = (b.to(actions.device) for b in self._bounds)
        return torch.clamp(actions.float(), low, high)

    def __str__(self) -> str:
        if self.continuous:
            lows, highs = set(self.low), set(self.high)
            if len(lows) == 1 and len(highs) == 1:
                return f"{self.dim} continuous in [{self.low[0]:g}, {self.high[0]:g}]"
            return f"{self.dim} continuous"
        return f"{self.n} discrete"
