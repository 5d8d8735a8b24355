"""Where a run's numbers go: logs.tsv, the terminal and (optionally) wandb."""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# Columns of logs.tsv, in order. A resumed run appends to the same file.
COLUMNS = (
    "step",
    "sps",
    "env_sps",
    "mean_episode_return",
    "mean_episode_length",
    "episodes",
    "total_loss",
    "policy_loss",
    "baseline_loss",
    "entropy_loss",
    "grad_norm",
    "learning_rate",
    "virtual_batch_size",
    "num_gradients",
    "model_version",
    "param_sum",
    "peers",
    "time",
)


class TsvLog:
    """Appends one row per log interval to ``path`` (header written once)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 - closed in close()
        self._writer = csv.writer(self._file, delimiter="\t", lineterminator="\n")
        if fresh:
            self._writer.writerow(COLUMNS)
            self._file.flush()

    def write(self, row: dict[str, Any]) -> None:
        """Writes ``row`` (missing columns stay empty) and flushes it."""
        self._writer.writerow([_cell(row.get(c)) for c in COLUMNS])
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.10g}"
    return str(value)


def _short(value: Any) -> str:
    return "-" if value is None or _is_nan(value) else f"{value:.4g}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """One status line (steps, SPS, return, ETA): redrawn in place on a
    terminal, printed as a plain line per log interval otherwise."""

    def __init__(self, total_steps: int, prefix: str = "", stream: Any = None) -> None:
        self.total_steps = total_steps
        self.prefix = prefix
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self._width = 0

    def update(self, row: dict[str, Any]) -> None:
        """Shows the numbers of one log row."""
        step, sps = row["step"], row["sps"]
        left = (self.total_steps - step) / sps if sps and sps > 0 else math.inf
        ret = row.get("mean_episode_return")
        ret_text = "-" if ret is None or math.isnan(ret) else f"{ret:.2f}"
        text = (
            f"{self.prefix}step {step:,}/{self.total_steps:,} "
            f"({100 * step / max(1, self.total_steps):.1f}%)  SPS {sps:,.0f}  "
            f"return {ret_text}  loss {_short(row.get('total_loss'))}  "
            f"ETA {_duration(left)}"
        )
        if self.live:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live and self._width:
            self.stream.write("\n")
            self.stream.flush()


class Wandb:
    """A wandb run for this peer: project, group (one per experiment) and name;
    offline when there is no login. ``run_id`` continues an earlier run."""

    def __init__(
        self,
        *,
        project: str,
        group: str,
        name: str,
        config: dict,
        savedir: Path,
        run_id: str | None,
        mode: str | None,
    ) -> None:
        import wandb

        if mode in (None, "auto"):
            mode = "online" if _wandb_logged_in() else "offline"
        self.run = wandb.init(
            project=project,
            group=group,
            name=name,
            id=run_id,
            resume="allow",
            config=config,
            dir=str(savedir),
            mode=mode,
            reinit="finish_previous",
        )
        self.run_id = self.run.id

    def log(self, row: dict[str, Any]) -> None:
        values = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not _is_nan(v)}
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def _is_nan(v: float) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


class EpisodeStats:
    """Returns and lengths of the episodes finished since the last ``take``."""

    def __init__(self) -> None:
        self.returns: list[float] = []
        self.lengths: list[int] = []

    def add(self, returns: Iterable[float], lengths: Iterable[int]) -> None:
        self.returns.extend(returns)
        self.lengths.extend(lengths)

    def take(self) -> dict[str, Any]:
        n = len(self.returns)
        out = {
            "episodes": n,
            "mean_episode_return": sum(self.returns) / n if n else math.nan,
            "mean_episode_length": sum(self.lengths) / n if n else math.nan,
        }
        self.returns, self.lengths = [], []
        return out


class Clock:
    """Seconds since the run (or its first incarnation) started."""

    def __init__(self, offset: float = 0.0) -> None:
        self.start = time.monotonic() - offset

    def __call__(self) -> float:
        return time.monotonic() - self.start
