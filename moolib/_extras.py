"""The packages that only some runs need come with pip extras (``moolib[minatar]``,
``moolib[wandb]``, ``moolib[tensorboard]``, ``moolib[envpool]``, ``moolib[video]``,
``moolib[mujoco]``): the
default install stays light. Each is imported where it is used, through
``import_extra``, so that a missing one is one line that says what installs it."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtraError(ImportError):
    """A package of one of moolib's pip extras is not installed."""


def import_extra(module: str, extra: str, needed_for: str) -> ModuleType:
    """``import module``, or MissingExtraError naming ``extra``, the pip extra that
    installs it (``needed_for`` says what needs it: ``"MinAtar's games"``). An
    ImportError from inside an installed package is raised as it is."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name != module:
            raise
        raise MissingExtraError(
            f"the {module} package (for {needed_for}) is not installed: "
            f'pip install "moolib[{extra}]"'
        ) from e
