"""The path docs/toolkit.md gives for playing a checkpoint,
``moolib.agents.offpolicy_run.evaluate``, kept for those who call it: the function
is ``moolib.agents.runtime.evaluation.evaluate`` (any agent's, not only the
off-policy ones'). It is imported when asked for, not with this module: the
registry imports every module of ``moolib.agents`` to find the agents, and finding
them must not import a runtime."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "evaluate":
        from .runtime.evaluation import evaluate

        return evaluate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
