"""What ``moolib-run`` tells its user around the training itself: the summary at the end of a
run (steps, time, final mean return, savedir, the ``moolib-plot`` command that plots it) and
the lists of choices in ``moolib-run --help``.

The start banner and the progress line are the peers' (``moolib.agents.runtime.logger``): they know
the device they run on and the broker they joined. The summary is the launcher's: it is
printed once every peer of the run is done, from the logs they left in the savedir.
"""

from __future__ import annotations

import functools
import math
import shlex
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moolib.agents.runtime.logger import format_duration
from omegaconf import OmegaConf

from . import plot

__all__ = [
    "RunTotals",
    "choices",
    "plot_command",
    "read_totals",
    "register_resolvers",
    "summary",
    "with_summary",
]

# Config groups a user picks on the command line (tuning/ is picked by them, not by hand).
USER_GROUPS = ("agent", "env", "scaling")


@dataclass
class RunTotals:
    """Where a run's logs leave it: the last step, the training time and the mean return."""

    steps: int
    seconds: float
    mean_return: float | None
    episodes: int
    peers: int


def read_totals(savedir: Path) -> RunTotals | None:
    """The totals of the run in ``savedir`` from its peers' ``logs.tsv``; None without logs.

    The mean return is that of the last log row with finished episodes of each peer,
    weighted by their episodes.
    """
    try:
        source = plot.find_runs(savedir)
    except plot.PlotError:
        return None
    if len(source.runs) != 1:
        return None
    steps, seconds, weighted, episodes = 0, 0.0, 0.0, 0
    logs = source.runs[0].logs
    for path in logs:
        try:
            table = plot.read_table(path)
            step = table.values("step")
            clock = table.values("time")
            returns = table.values("mean_episode_return")
            counts = table.values("episodes")
        except plot.PlotError:
            continue
        steps = max([steps, *(int(s) for s in step if not math.isnan(s))])
        seconds = max([seconds, *(t for t in clock if not math.isnan(t))])
        for ret, count in zip(reversed(returns), reversed(counts), strict=True):
            if not math.isnan(ret):
                n = 1 if math.isnan(count) or count < 1 else int(count)
                weighted += ret * n
                episodes += n
                break
    mean = weighted / episodes if episodes else None
    return RunTotals(
        steps=steps, seconds=seconds, mean_return=mean, episodes=episodes, peers=len(logs)
    )


def _shown_path(path: Path) -> str:
    """``path`` relative to the working directory when it is below it, else absolute."""
    path = Path(path).absolute()
    try:
        shown = str(path.relative_to(Path.cwd()))
    except ValueError:
        shown = str(path)
    return shlex.quote(shown)


def plot_command(path: Path) -> str:
    """The ``moolib-plot`` command line that plots the run (or sweep) in ``path``."""
    return f"moolib-plot {_shown_path(path)}"


def summary(
    savedir: Path,
    total_steps: int,
    *,
    exit_code: int = 0,
    sweep_dir: Path | None = None,
) -> str | None:
    """The block printed when a run ends: how it ended, steps, time, final mean return,
    savedir and how to plot it. None when the savedir holds no logs."""
    totals = read_totals(savedir)
    if totals is None:
        return None
    if exit_code not in (0, None, 130):  # 130: stopped by Ctrl-C
        how = f"ended with exit code {exit_code}"
    elif totals.steps >= total_steps:
        how = "done"
    else:
        how = "stopped"
    steps = f"{totals.steps:,} steps"
    if how != "done":
        steps = f"{totals.steps:,} of {total_steps:,} steps"
    if totals.mean_return is None:
        ret = "no episode finished"
    else:
        peers = f" of {totals.peers} peers" if totals.peers > 1 else ""
        ret = f"mean return {totals.mean_return:.2f} (last logged episodes{peers})"
    lines = [
        f"moolib-run: {how}: {steps} in {format_duration(totals.seconds)}; {ret}",
        f"  savedir  {_shown_path(savedir)}",
        f"  plot     {plot_command(savedir)}",
    ]
    if sweep_dir is not None:
        lines.append(f"  sweep    {plot_command(sweep_dir)}")
    return "\n".join(lines)


def _logs_written_since(savedir: Path, started: float) -> bool:
    """Whether a peer of the run in ``savedir`` wrote its logs since ``started`` (time.time())."""
    try:
        source = plot.find_runs(savedir)
    except plot.PlotError:
        return False
    for run in source.runs:
        for log in run.logs:
            try:
                if log.stat().st_mtime >= started:
                    return True
            except OSError:
                continue
    return False


def _print_summary(started: float, exit_code: int) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from moolib.conf.schema import run_config

    hydra_cfg = HydraConfig.get()
    savedir = Path(hydra_cfg.runtime.output_dir)
    try:
        cfg = run_config.load(savedir / run_config.CONFIG_FILE)
    except (OSError, ValueError):  # ConfigError too
        return
    # A run that did not train now (a config error, a finished run, SLURM jobs just
    # submitted) has nothing to sum up.
    if not cfg.scaling.follows_run:
        return
    if not _logs_written_since(savedir, started):
        return
    sweep_dir = None
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sweep_dir = Path(hydra_cfg.sweep.dir)
    text = summary(savedir, cfg.total_steps, exit_code=exit_code, sweep_dir=sweep_dir)
    if text:
        sys.stdout.flush()
        print(text, flush=True)


def with_summary(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wraps moolib-run's Hydra task function: once it returns or exits, prints the summary
    of the run it trained (nothing when it trained nothing)."""

    @functools.wraps(task)
    def run(cfg: Any) -> Any:
        # Filesystem times are whole seconds on some filesystems.
        started = math.floor(time.time())
        try:
            result = task(cfg)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            _print_summary(started, code)
            raise
        except KeyboardInterrupt:
            _print_summary(started, 130)
            raise
        _print_summary(started, 0)
        return result

    return run


def choices(group: str, chosen: str | None = None, indent: int = 11, width: int = 100) -> str:
    """The options of a config group of moolib.conf (``a2c, vtrace``), the chosen one
    marked ``[...]``, wrapped to ``width`` columns after a first line ``indent`` columns in.
    Options registered in code (the Atari games of ``env``, a hundred of them) are
    summed up with a few examples rather than listed; the five MinAtar games are listed."""
    from moolib.conf import file_options, listed_suites, registered_suites

    def mark(options: list[str]) -> str:
        return ", ".join(f"[{n}]" if n == chosen else n for n in options)

    suites = registered_suites(group)
    text = mark(file_options(group))
    registered = suites.get("Atari", [])
    if registered:
        examples = [n for n in ("breakout", "pong") if n in registered]
        if chosen in registered and chosen not in examples:
            examples.insert(0, chosen)
        shown = mark(examples or registered[:2])
        text += f", or any of {len(registered)} Atari games ({shown}, ...; moolib.envs.list_envs())"
    text += listed_suites(group, mark)
    lines = textwrap.wrap(text, width=width - indent, break_on_hyphens=False)
    return ("\n" + " " * indent).join(lines)


def register_resolvers() -> None:
    """Registers ``${moolib_choices:group,chosen}``, which conf/config.yaml's help uses."""
    if not OmegaConf.has_resolver("moolib_choices"):
        OmegaConf.register_new_resolver("moolib_choices", choices)
