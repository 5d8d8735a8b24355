"""What the off-policy learning tests read from a run's savedir: its low-epsilon
actors' logged returns and its checkpoints' greedy returns."""

from __future__ import annotations

import statistics
from pathlib import Path

from moolib.agents.offpolicy_run import evaluate
from moolib.agents.runtime import checkpoint

from helpers.run_util import read_logs

# Learning runs: their budget is env steps; on a loaded 2-core box they take minutes.
LEARN_TIMEOUT = 900
SMALL = ["device=cpu", "log_interval=1", "seed=0"]


def _logged(savedir: Path, column: str) -> list[float]:
    _, rows = read_logs(savedir / "logs.tsv")
    return [r[column] for r in rows if r["episodes"] > 0 and r[column] == r[column]]


def learned(savedir: Path, column: str = "return_eps_lt_0.1") -> float:
    """The best logged mean return of the run's low-epsilon actors (the best of many
    rows of a few episodes each: an optimistic figure)."""
    return max(_logged(savedir, column), default=float("nan"))


def final(savedir: Path, column: str = "return_eps_lt_0.1", rows: int = 10) -> float:
    """The low-epsilon actors' mean return over the last ``rows`` log rows that saw
    their episodes: what the policy of the run's end scores while acting."""
    values = _logged(savedir, column)[-rows:]
    return statistics.mean(values) if values else float("nan")


def greedy_history(savedir: Path) -> dict[str, float]:
    """Checkpoint file name -> greedy mean return over 10 episodes, for each checkpoint
    the run's history keeps."""
    return {
        p.name: statistics.mean(evaluate(savedir, episodes=10, checkpoint_path=p))
        for p in checkpoint.list_history(savedir)
    }
