"""``moolib-run ARGS`` whose learner (on its thread or inline) raises at its third
update (a learner bug, or a CUDA error): for tests/test_learner_thread.py."""

from __future__ import annotations

import sys

from moolib.agents.runtime import onpolicy
from moolib.launch.run import main

_learn = onpolicy.Trainer._learn


def _failing(self: onpolicy.Trainer, stats: dict, wait: bool = True) -> bool:
    if self.accumulator.model_version() >= 3:
        raise RuntimeError("injected learner failure at model version 3")
    return _learn(self, stats, wait)


if __name__ == "__main__":
    onpolicy.Trainer._learn = _failing
    sys.argv[0] = "moolib-run"
    main()
