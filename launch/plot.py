"""``moolib-plot``: draws a metric of moolib-run's ``logs.tsv`` in the terminal and to a PNG.

Usage::

    moolib-plot SAVEDIR|SWEEP|logs.tsv [...] [--metric NAME] [--x step] [--smooth N] [--peers]
                [--mean] [--png out.png] [--no-terminal] [--width W] [--height H] [--list]

The input is the tab-separated file that ``moolib-run`` writes for each run: a header row, then
one row per log interval. Any numeric column can be plotted against any other (``--x``, default
``step``); empty cells, ``nan``, infinities and text are gaps in the line, except in the episode
columns (``mean_episode_return``, ``mean_episode_length``) of a row in which no episode ended
(``episodes`` 0): that row has nothing to report, so the line goes on over it. A run resumed from
a checkpoint older than its last row logs those steps again: the rows it superseded are left out.
What each argument stands for:

- a ``logs.tsv`` file (any name): one line;
- a run's savedir: its ``logs.tsv``; a run of several peers (``<savedir>/peer<k>/logs.tsv``, as
  ``scaling=local`` and ``scaling=slurm`` write) gives one line, the mean over its peers with their
  spread (min to max) shaded in the PNG; ``--peers`` draws one line per peer instead;
- a sweep's folder (``multirun/<date>/<time>-<name>``, whose numbered points are savedirs): one
  line per point, labelled by the overrides that tell the points apart (``learning_rate=3e-4``: a
  key is shortened to its last component unless two would read the same), from each point's
  ``.hydra/overrides.yaml`` (else from the differences of their ``config.yaml``);
- any other folder of runs: one line per run, labelled by its folder name.

Several arguments are drawn side by side, one line each, labelled by their folders; with
``--mean`` (runs of one config with several seeds) as one line, their mean, with their spread
(min to max) shaded.

The terminal plot is drawn with plotext (colored when stdout is a terminal and ``NO_COLOR`` is
unset), the PNG with matplotlib's Agg backend: by default ``<metric>.png`` in the first argument's
folder (``<metric>_vs_<x>.png`` when ``--x`` is not ``step``); the last line of the output names
it. Errors (a missing file, a folder without logs, a run that has not logged an episode yet, a
metric or x column that the file does not have) are one line on stderr with the reason, and exit
with code 2.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import output

__all__ = [
    "DEFAULT_METRIC",
    "LOG_FILE",
    "EmptyLogError",
    "PlotError",
    "Run",
    "Series",
    "Source",
    "Table",
    "build_parser",
    "default_png_path",
    "find_runs",
    "load_series",
    "main",
    "mean_of",
    "override_labels",
    "parse_number",
    "read_table",
    "resumed_changes",
    "render_terminal",
    "resolve_log_path",
    "run_labels",
    "smooth",
    "split_segments",
    "sweep_labels",
    "write_png",
]

DEFAULT_METRIC = "mean_episode_return"
LOG_FILE = "logs.tsv"
EXIT_ERROR = 2
# Columns that stay empty until an episode ends (moolib-run's logs.tsv).
EPISODE_COLUMNS = ("mean_episode_return", "mean_episode_length")
EPISODE_COUNT = "episodes"
# Config keys that differ between any two runs, so they tell nothing about a sweep's points.
_RUN_SPECIFIC_KEYS = ("savedir", "group")
_PEER_DIR = re.compile(r"peer(\d+)")

# Smallest terminal plot that still shows a canvas between its title, ticks and labels.
MIN_WIDTH = 30
MIN_HEIGHT = 8

Segment = tuple[list[float], list[float]]


class PlotError(Exception):
    """A problem with the input files or the options; ``main`` prints it and returns 2."""


class EmptyLogError(PlotError):
    """A log that has nothing to draw yet. ``reason`` says why without naming the file
    (``"no episode has finished yet"``, ``"no log rows yet"``, ...), ``detail`` adds counts."""

    def __init__(self, path: Path, reason: str, detail: str) -> None:
        super().__init__(f"{path}: {reason} ({detail})")
        self.path = path
        self.reason = reason
        self.detail = detail


@dataclass
class Table:
    """One log file: its column names and its data rows, as the text cells read from the file.

    ``rows`` leaves out the rows a resume superseded; ``file_rows`` counts the file's data rows,
    all of them, for messages about the file.
    """

    path: Path
    columns: list[str]
    rows: list[list[str]]
    file_rows: int = -1

    def __post_init__(self) -> None:
        if self.file_rows < 0:
            self.file_rows = len(self.rows)

    def values(self, column: str) -> list[float]:
        """Returns the column as floats, one per row; cells that are not finite numbers are NaN.

        Raises:
            PlotError: the file has no such column (the message lists the columns it has).
        """
        if column not in self.columns:
            raise PlotError(missing_column_message(self, column))
        index = self.columns.index(column)
        return [parse_number(row[index]) if index < len(row) else math.nan for row in self.rows]


@dataclass
class Series:
    """One run's line: its label and the unbroken stretches of (x, y) points between gaps.

    The mean of several peers (or runs, ``members``) also has ``band``: per segment, the lowest
    and highest member's values at each x (``peers`` is how many it averages).
    """

    label: str
    path: Path
    segments: list[Segment]
    band: list[tuple[list[float], list[float]]] | None = None
    peers: int = 1
    members: str = "peers"  # what ``band`` spans: a run's peers, or the runs of --mean

    @property
    def num_points(self) -> int:
        """The number of points in all segments together."""
        return sum(len(xs) for xs, _ in self.segments)

    def last(self) -> tuple[float, float]:
        """The last (x, y) point of the series (it must have one)."""
        xs, ys = self.segments[-1]
        return xs[-1], ys[-1]


def parse_number(cell: str) -> float:
    """Parses a TSV cell as a float; empty cells, text, ``nan`` and infinities give NaN."""
    try:
        value = float(cell)
    except ValueError:
        return math.nan
    return value if math.isfinite(value) else math.nan


def missing_column_message(table: Table, column: str) -> str:
    """The error for a column the file does not have: the columns it has, and a close match."""
    message = f"{table.path}: no column '{column}'"
    close = difflib.get_close_matches(column, table.columns, n=1)
    if not close:
        # Close to a word of a column: "retrun" for mean_episode_return.
        words: dict[str, str] = {}
        for name in table.columns:
            for word in name.split("_"):
                if len(word) > 2:
                    words.setdefault(word, name)
        near = difflib.get_close_matches(column, list(words), n=1, cutoff=0.75)
        close = [words[near[0]]] if near else []
    if close:
        message += f" (did you mean '{close[0]}'?)"
    columns = ", ".join(table.columns) if table.columns else "(none)"
    return f"{message}; its columns are: {columns}"


def resolve_log_path(arg: str | os.PathLike[str]) -> Path:
    """Maps a command-line argument to a log file: a directory means ``<dir>/logs.tsv``.

    Raises:
        PlotError: the file (or the directory's ``logs.tsv``) does not exist.
    """
    path = Path(arg)
    if path.is_dir():
        log = path / LOG_FILE
        if not log.is_file():
            raise PlotError(_no_logs_message(path))
        return log
    if not path.exists():
        raise PlotError(f"{path}: no such file or directory")
    if not path.is_file():
        raise PlotError(f"{path}: not a regular file")
    return path


def _no_logs_message(path: Path) -> str:
    """Why a folder has nothing to plot, and what moolib-plot looked for."""
    if (path / "config.yaml").is_file() or (path / ".hydra").is_dir():
        return f"no {LOG_FILE} in {path} yet: the run has not started training"
    return (
        f"no {LOG_FILE} in {path} (nor in its peer<k>/ folders or in runs directly below it); "
        "give a run's savedir, a sweep's folder or a logs.tsv file"
    )


@dataclass
class Run:
    """One experiment: its folder and its log files, one per peer (``peers`` names them)."""

    folder: Path
    logs: list[Path]
    peers: list[str]
    label: str | None = None

    @property
    def key_path(self) -> Path:
        """The path whose parent folder names the run (see ``run_labels``)."""
        return self.logs[0] if not self.peers else self.folder / LOG_FILE


@dataclass
class Source:
    """What one command-line argument stands for: a run, or a folder of runs (a sweep)."""

    path: Path
    runs: list[Run]
    is_folder_of_runs: bool = False


def _run_in(folder: Path) -> Run | None:
    """The run whose savedir is ``folder`` (one logs.tsv, or one per peer), if it is one."""
    log = folder / LOG_FILE
    if log.is_file():
        return Run(folder=folder, logs=[log], peers=[])
    peers: list[tuple[int, Path]] = []
    try:
        entries = list(folder.iterdir())
    except OSError:
        return None
    for entry in entries:
        m = _PEER_DIR.fullmatch(entry.name)
        if m and (entry / LOG_FILE).is_file():
            peers.append((int(m.group(1)), entry))
    if not peers:
        return None
    peers.sort()
    return Run(
        folder=folder,
        logs=[p / LOG_FILE for _, p in peers],
        peers=[p.name for _, p in peers],
    )


def _sort_key(path: Path) -> tuple[int, int, str]:
    """Numbered folders (a sweep's points) in numeric order, then the others by name."""
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def find_runs(arg: str | os.PathLike[str]) -> Source:
    """What a command-line argument stands for: a log file, a run's savedir (one peer or
    several), or a folder of runs such as a sweep's (whose points get override labels).

    Raises:
        PlotError: the path does not exist or holds no logs (the message says what it has).
    """
    path = Path(arg)
    if not path.is_dir():
        log = resolve_log_path(path)
        return Source(path=path, runs=[Run(folder=log.parent, logs=[log], peers=[])])
    run = _run_in(path)
    if run is not None:
        return Source(path=path, runs=[run])
    try:
        children = sorted((c for c in path.iterdir() if c.is_dir()), key=_sort_key)
    except OSError as e:
        raise PlotError(f"{path}: cannot read: {e.strerror or e}") from e
    runs = [r for r in map(_run_in, children) if r is not None]
    if not runs:
        raise PlotError(_no_logs_message(path))
    is_sweep = (path / "multirun.yaml").is_file() or all(r.folder.name.isdigit() for r in runs)
    labels = sweep_labels([r.folder for r in runs]) if is_sweep else None
    if labels is None:
        labels = [r.folder.name for r in runs]
    for r, label in zip(runs, labels, strict=True):
        r.label = label
    return Source(path=path, runs=runs, is_folder_of_runs=True)


def _split_override(override: str) -> tuple[str, str]:
    """``key=value`` of a Hydra override (``+``/``++``/``~`` prefixes dropped from the key)."""
    key, _, value = override.partition("=")
    return key.lstrip("+~").strip(), value.strip()


def _flatten(tree: object, prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"a.b.c": "value"}``."""
    if isinstance(tree, dict):
        out: dict[str, str] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: str(tree)}


# A setting a resume changed: (the step from which the new value applied, old, new).
Change = tuple[int, str, str]


def override_labels(
    settings: Sequence[dict[str, str]], changes: Sequence[dict[str, list[Change]]] | None = None
) -> list[str] | None:
    """Labels for runs from their settings (``{key: value}``): the keys whose values differ
    between the runs, as ``key=value`` joined by ``", "``, each key shortened to its last
    component unless another differing key ends the same. None when nothing differs.
    ``changes`` (per run, by key): a key whose value a resume changed reads as its first
    value and each later one with the step it took over at
    (``learning_rate=0.003 (0.005 from step 1,024)``)."""
    keys: list[str] = []
    for run in settings:
        keys.extend(k for k in run if k not in keys)
    varying = [k for k in keys if len({run.get(k) for run in settings}) > 1]
    if not varying:
        return None
    last = [k.rsplit(".", 1)[-1] for k in varying]
    short = {k: (s if last.count(s) == 1 else k) for k, s in zip(varying, last, strict=True)}
    runs_changes = changes or [{} for _ in settings]

    def shown(run: dict[str, str], changed: dict[str, list[Change]], k: str) -> str:
        history = changed.get(k)
        if not history:
            return f"{short[k]}={run[k]}"
        later = "; ".join(f"{new} from step {step:,}" for step, _, new in history)
        return f"{short[k]}={history[0][1]} ({later})"

    return [
        ", ".join(shown(run, changed, k) for k in varying if k in run) or "(defaults)"
        for run, changed in zip(settings, runs_changes, strict=True)
    ]


def resumed_changes(point: Path) -> dict[str, list[Change]]:
    """The settings that resumes of the run in ``point`` changed after it had trained
    (from its ``resumes.yaml``), by key, in the order they happened."""
    entries = _load_yaml(point / "resumes.yaml")
    out: dict[str, list[Change]] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("changed"), dict):
            continue
        step = entry.get("step")
        if not isinstance(step, int) or step <= 0:
            continue  # no step was trained with the old value
        for key, change in entry["changed"].items():
            if isinstance(change, dict) and {"from", "to"} <= set(change):
                out.setdefault(str(key), []).append((step, str(change["from"]), str(change["to"])))
    return out


def _load_yaml(path: Path) -> object:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def sweep_labels(points: Sequence[Path]) -> list[str] | None:
    """Labels of a sweep's points (their savedirs) by the overrides that tell them apart.

    Each point's ``.hydra/overrides.yaml`` (written by Hydra) is read; when a point lacks it,
    the points' ``config.yaml`` files are compared instead (``savedir`` and ``group`` aside).
    A value that a resume of the point changed is shown with the one it replaced and the
    step it changed at (``resumes.yaml``). None when nothing tells the points apart.
    """
    changes = [resumed_changes(p) for p in points]
    overrides = [_load_yaml(p / ".hydra" / "overrides.yaml") for p in points]
    if all(isinstance(o, list) for o in overrides):
        settings = [dict(_split_override(str(line)) for line in o) for o in overrides]
        for run in settings:
            for key in _RUN_SPECIFIC_KEYS:
                run.pop(key, None)
        labels = override_labels(settings, changes)
        if labels is not None:
            return labels
    configs = [_load_yaml(p / "config.yaml") for p in points]
    if all(isinstance(c, dict) for c in configs):
        settings = [_flatten(c) for c in configs]
        for run in settings:
            for key in _RUN_SPECIFIC_KEYS:
                run.pop(key, None)
        return override_labels(settings, changes)
    return None


def read_table(path: Path) -> Table:
    """Reads a tab-separated log file: the first non-empty row is the header.

    Short rows (a line still being written) are padded with gaps; extra cells are ignored.

    Raises:
        PlotError: the file cannot be read or has no header row.
    """
    try:
        with open(path, newline="", encoding="utf-8-sig", errors="replace") as f:
            rows = [row for row in csv.reader(f, delimiter="\t") if any(c.strip() for c in row)]
    except OSError as e:
        raise PlotError(f"{path}: cannot read: {e.strerror or e}") from e
    except csv.Error as e:
        raise PlotError(f"{path}: not a tab-separated file: {e}") from e
    if not rows:
        raise PlotError(f"{path}: empty file (no header row)")
    columns = [name.strip() for name in rows[0]]
    return Table(
        path=path,
        columns=columns,
        rows=without_superseded(columns, rows[1:]),
        file_rows=len(rows) - 1,
    )


def without_superseded(columns: list[str], rows: list[list[str]]) -> list[list[str]]:
    """Leaves out the rows a resume superseded.

    A run resumed from a checkpoint older than its last row logs those steps
    again, and the rows the earlier attempt logged past the checkpoint belong
    to a history that was thrown away: a row whose ``step`` is lower than the
    one before drops every earlier row at or past its step.
    """
    if "step" not in columns:
        return rows
    index = columns.index("step")
    kept: list[list[str]] = []
    steps: list[float] = []  # kept rows' steps, NaN where a row has none
    for row in rows:
        step = parse_number(row[index]) if index < len(row) else math.nan
        if not math.isnan(step):
            while kept and not math.isnan(steps[-1]) and steps[-1] >= step:
                kept.pop()
                steps.pop()
        kept.append(row)
        steps.append(step)
    return kept


def split_segments(xs: Sequence[float], ys: Sequence[float]) -> list[Segment]:
    """Cuts paired x and y values into unbroken segments: a NaN in either one is a gap."""
    segments: list[Segment] = []
    current: Segment = ([], [])
    for x, y in zip(xs, ys, strict=True):
        if math.isnan(x) or math.isnan(y):
            if current[0]:
                segments.append(current)
                current = ([], [])
            continue
        current[0].append(x)
        current[1].append(y)
    if current[0]:
        segments.append(current)
    return segments


def smooth(ys: Sequence[float], window: int) -> list[float]:
    """Trailing moving average over ``window`` points (fewer at the start); 1 leaves ys as is."""
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    out: list[float] = []
    total = 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Labels each log file by its run folder's name, with as many parent folders as it takes to
    tell them apart (the file name too when two files share a folder)."""
    folders = [p.resolve().parent for p in paths]
    depth = max((len(f.parts) for f in folders), default=1)
    for k in range(1, depth + 1):
        labels = ["/".join(f.parts[-k:]).lstrip("/") or "/" for f in folders]
        if len(set(labels)) == len(labels):
            return labels
    labels = [str(p.resolve()) for p in paths]
    if len(set(labels)) == len(labels):
        return labels
    return [f"{label} ({i + 1})" for i, label in enumerate(labels)]


def load_series(table: Table, metric: str, x: str, label: str, window: int = 1) -> Series:
    """Extracts ``metric`` against ``x`` from a table, smoothed over ``window`` points.

    Smoothing runs within each unbroken segment, so gaps stay gaps.

    Raises:
        PlotError: a column is missing.
        EmptyLogError: no row has numbers in both columns (no rows yet, no finished episode).
    """
    xs = table.values(x)
    ys = table.values(metric)
    if metric in EPISODE_COLUMNS and EPISODE_COUNT in table.columns:
        # A log interval in which no episode ended has no episode figure to report. Breaking the
        # line there would cut a run logged in short intervals into many segments, each starting
        # its moving average over.
        counts = table.values(EPISODE_COUNT)
        ended = [not (math.isnan(y) and n == 0) for y, n in zip(ys, counts, strict=True)]
        xs = [v for v, keep in zip(xs, ended, strict=True) if keep]
        ys = [v for v, keep in zip(ys, ended, strict=True) if keep]
    segments = split_segments(xs, ys)
    if not segments:
        n = table.file_rows
        if n == 0:
            raise EmptyLogError(table.path, "no log rows yet", "only the header")
        rows = f"{n} log row{'s' if n != 1 else ''}"
        if metric in EPISODE_COLUMNS and all(math.isnan(y) for y in ys):
            raise EmptyLogError(
                table.path, "no episode has finished yet", f"{rows}, none with a {metric}"
            )
        raise EmptyLogError(
            table.path,
            "no numeric rows",
            f"none of its {rows} has a number in both '{x}' and '{metric}'",
        )
    if window > 1:
        segments = [(sx, smooth(sy, window)) for sx, sy in segments]
    return Series(label=label, path=table.path, segments=segments)


def mean_of(members: Sequence[Series], label: str, path: Path, of: str = "peers") -> Series:
    """The mean of several peers' series, with their spread (min to max) as ``band``.

    Peers log at their own moments, so each is interpolated linearly at every x that any of them
    logged, within its own unbroken segments; the mean at an x is over the peers that cover it
    (a gap where none does).
    """
    import numpy as np

    grid = np.array(sorted({x for s in members for xs, _ in s.segments for x in xs}))
    values = np.full((len(members), len(grid)), np.nan)
    for i, s in enumerate(members):
        for xs, ys in s.segments:
            order = np.argsort(xs, kind="stable")  # np.interp needs x increasing (any --x)
            sx, sy = np.asarray(xs)[order], np.asarray(ys)[order]
            inside = (grid >= sx[0]) & (grid <= sx[-1])
            values[i, inside] = np.interp(grid[inside], sx, sy)
    covered = ~np.isnan(values).all(axis=0)
    mean = np.full(len(grid), np.nan)
    low = np.full(len(grid), np.nan)
    high = np.full(len(grid), np.nan)
    if covered.any():
        mean[covered] = np.nanmean(values[:, covered], axis=0)
        low[covered] = np.nanmin(values[:, covered], axis=0)
        high[covered] = np.nanmax(values[:, covered], axis=0)
    segments: list[Segment] = []
    band: list[tuple[list[float], list[float]]] = []
    start = None
    for i in range(len(grid) + 1):
        inside = i < len(grid) and bool(covered[i])
        if inside and start is None:
            start = i
        elif not inside and start is not None:
            segments.append((grid[start:i].tolist(), mean[start:i].tolist()))
            band.append((low[start:i].tolist(), high[start:i].tolist()))
            start = None
    return Series(
        label=label, path=path, segments=segments, band=band, peers=len(members), members=of
    )


def default_png_path(first_log: Path, metric: str, x: str = "step") -> Path:
    """``<metric>.png`` (``<metric>_vs_<x>.png`` for another x) in the first log's folder."""
    return first_log.parent / _png_name(metric, x)


def _png_name(metric: str, x: str) -> str:
    name = metric if x == "step" else f"{metric}_vs_{x}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "plot"
    return f"{name}.png"


def _decimate(segment: Segment, max_points: int) -> Segment:
    """Thins a segment to about ``max_points`` points, keeping each bucket's min and max."""
    xs, ys = segment
    n = len(xs)
    if n <= max_points:
        return segment
    buckets = max(1, max_points // 2)
    out_x: list[float] = []
    out_y: list[float] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        chunk = range(lo, hi)
        i_min = min(chunk, key=ys.__getitem__)
        i_max = max(chunk, key=ys.__getitem__)
        for i in sorted({i_min, i_max}):
            out_x.append(xs[i])
            out_y.append(ys[i])
    return out_x, out_y


# Markers that keep runs apart when the terminal plot has no colors.
_PLAIN_MARKERS = ["hd", "+", "x", "o", "*", "#", "@", "%", "=", "~"]


def render_terminal(
    series: Sequence[Series],
    metric: str,
    x: str,
    width: int,
    height: int,
    color: bool = False,
    title: str | None = None,
) -> str:
    """Draws the series with plotext and returns the plot as text (with ANSI colors if ``color``).

    Each series gets one line, broken at its gaps; its legend entry shows its label.
    """
    import plotext

    fig = plotext.figure
    fig.clear()
    plotext.terminal.limit(False, False)
    fig.theme("simple" if color else "colorless")
    fig.plot_size(width, height)
    max_points = 8 * width
    for n, s in enumerate(series):
        xs: list[float] = []
        ys: list[float] = []
        breaks: list[int] = []
        for segment in s.segments:
            sx, sy = _decimate(segment, max_points)
            if xs:
                breaks.append(len(xs))
            xs.extend(sx)
            ys.extend(sy)
        marker = "hd" if color else _PLAIN_MARKERS[n % len(_PLAIN_MARKERS)]
        signal = fig.signal(xs, ys, marker=marker)
        signal.lines()
        for i in breaks:
            signal.line(i, False)
        if len(series) > 1:
            signal.label(s.label)
        fig.draw(signal)
    fig.title(title if title is not None else f"{metric} vs {x}")
    fig.label(x, "x")
    fig.label(metric, "y")
    text = fig.build().string(colorless=not color)
    fig.clear()
    return text


def write_png(
    series: Sequence[Series],
    metric: str,
    x: str,
    path: Path,
    raw: Sequence[Series] | None = None,
    title: str | None = None,
) -> None:
    """Writes the plot as a PNG with matplotlib's Agg backend (no display or pyplot needed).

    ``raw`` (the unsmoothed series, same order) is drawn faintly behind ``series``. Isolated
    points between gaps get a marker so that they stay visible.

    Raises:
        PlotError: the file cannot be written.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    fig = Figure(figsize=(9, 5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for n, s in enumerate(series):
        color = f"C{n % 10}"
        if raw is not None:
            rx, ry = _joined(raw[n].segments)
            ax.plot(rx, ry, color=color, alpha=0.25, linewidth=1)
        if s.band is not None:
            for k, ((sx, _), (lo, hi)) in enumerate(zip(s.segments, s.band, strict=True)):
                spread = f"{s.label}: min to max of its {s.members}" if k == 0 else None
                ax.fill_between(sx, lo, hi, color=color, alpha=0.2, linewidth=0, label=spread)
        xs, ys = _joined(s.segments)
        ax.plot(xs, ys, color=color, linewidth=1.5, label=s.label)
        lone = [seg for seg in s.segments if len(seg[0]) == 1]
        if lone:
            ax.plot([p[0][0] for p in lone], [p[1][0] for p in lone], "o", color=color, ms=3)
    ax.set_xlabel(x)
    ax.set_ylabel(metric)
    ax.set_title(title if title is not None else f"{metric} vs {x}")
    ax.grid(True, alpha=0.3)
    if max((abs(v) for s in series for seg in s.segments for v in seg[0]), default=0) >= 1e4:
        ax.xaxis.set_major_formatter(EngFormatter())
    if len(series) > 1 or any(s.band for s in series):
        ax.legend(fontsize="small")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    except OSError as e:
        raise PlotError(f"{path}: cannot write the PNG: {e.strerror or e}") from e


def _joined(segments: Sequence[Segment]) -> Segment:
    """Concatenates segments with a NaN between them, which matplotlib draws as a gap."""
    xs: list[float] = []
    ys: list[float] = []
    for sx, sy in segments:
        if xs:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.extend(sx)
        ys.extend(sy)
    return xs, ys


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser of ``moolib-plot``."""
    parser = argparse.ArgumentParser(
        prog="moolib-plot",
        description=(
            "Draw a metric of moolib-run's logs.tsv against steps: in the terminal and to a PNG. "
            "A run's savedir gives one line (the mean of its peers, their spread shaded, for a "
            "run of several peers); a sweep's folder one line per point, labelled by its "
            "overrides; several arguments one line each, labelled by their folders. "
            "Empty cells and nan are gaps."
        ),
        epilog=(
            "examples: moolib-plot outputs/2024-05-01/12-00-00-a2c-cartpole;  "
            "moolib-plot multirun/2024-05-01/12-00-00-a2c-cartpole --smooth 5;  "
            "moolib-plot runA runB --metric total_loss --png cmp.png"
        ),
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="RUN",
        help="a run's savedir, a sweep's folder (multirun/<date>/<time>-<name>) or a logs.tsv",
    )
    parser.add_argument(
        "--metric", "-m", default=DEFAULT_METRIC, help=f"column to plot (default: {DEFAULT_METRIC})"
    )
    parser.add_argument("--x", default="step", help="column on the x axis (default: step)")
    parser.add_argument(
        "--smooth",
        type=_at_least(1),
        default=1,
        metavar="N",
        help="moving average over N log rows (default: 1, no smoothing)",
    )
    parser.add_argument(
        "--peers",
        action="store_true",
        help="one line per peer of a run of several peers (default: their mean, spread shaded)",
    )
    parser.add_argument(
        "--mean",
        action="store_true",
        help="one line for all the runs given (e.g. seeds of one config): their mean, with "
        "their spread (min to max) shaded",
    )
    parser.add_argument(
        "--png",
        type=Path,
        default=None,
        metavar="PATH",
        help="where to write the PNG (default: <metric>.png in the first run's folder)",
    )
    parser.add_argument(
        "--no-terminal", action="store_true", help="do not draw in the terminal, only the PNG"
    )
    parser.add_argument(
        "--width",
        type=_at_least(MIN_WIDTH),
        default=None,
        help="terminal plot width in columns (default: the terminal's)",
    )
    parser.add_argument(
        "--height",
        type=_at_least(MIN_HEIGHT),
        default=None,
        help="terminal plot height in rows (default: fits the terminal, at most 30)",
    )
    parser.add_argument(
        "--list", action="store_true", help="print the columns of each file and exit"
    )
    return parser


def _terminal_size(width: int | None, height: int | None) -> tuple[int, int]:
    """The terminal plot size: the given one, else the terminal's (a few rows left for text)."""
    columns, lines = shutil.get_terminal_size(fallback=(100, 30))
    if width is None:
        width = max(MIN_WIDTH, columns)
    if height is None:
        height = max(MIN_HEIGHT, min(30, lines - 4))
    return width, height


def _list_columns(tables: Sequence[Table]) -> None:
    """Prints each table's columns, one a line (under the file name when there are several)."""
    for table in tables:
        if len(tables) > 1:
            print(f"{table.path}:")
        for column in table.columns:
            print(f"  {column}" if len(tables) > 1 else column)


def _summary(s: Series, metric: str, x: str) -> str:
    """One line on a run: its number of points, its last value and its range (and, for the mean
    of several peers, the spread between them at the last point)."""
    last_x, last_y = s.last()
    values = [y for _, ys in s.segments for y in ys]
    line = (
        f"{s.label}: {s.num_points} point{'s' if s.num_points != 1 else ''}, last {metric} "
        f"{last_y:.6g} at {x} {last_x:.6g} "
        f"(min {min(values):.6g}, max {max(values):.6g})"
    )
    if s.band:
        low, high = s.band[-1][0][-1], s.band[-1][1][-1]
        line += f"; its {s.members} at the last point: {low:.6g} to {high:.6g}"
    return line


def _label_runs(sources: Sequence[Source]) -> None:
    """Labels every run: plain runs by their folders (as few parent folders as tell them apart);
    a folder's runs keep their labels, prefixed with the folder's name beside other arguments."""
    plain = [r for src in sources if not src.is_folder_of_runs for r in src.runs]
    for r, label in zip(plain, run_labels([r.key_path for r in plain]), strict=True):
        r.label = label
    folders = [src for src in sources if src.is_folder_of_runs]
    if len(sources) > 1 and folders:
        names = run_labels([src.path / LOG_FILE for src in folders])
        for src, name in zip(folders, names, strict=True):
            for r in src.runs:
                r.label = f"{name}: {r.label}"


def _empty_run(run: Run, errors: Sequence[EmptyLogError]) -> EmptyLogError:
    """One error for a run of several peers none of which has anything to draw."""
    reasons = {e.reason for e in errors}
    reason = errors[0].reason if len(reasons) == 1 else "nothing to plot yet"
    detail = "; ".join(f"{peer}: {e.detail}" for peer, e in zip(run.peers, errors, strict=True))
    return EmptyLogError(run.folder, reason, detail)


def _run_series(
    run: Run, tables: Sequence[Table], args: argparse.Namespace
) -> tuple[list[Series], list[Series], list[EmptyLogError]]:
    """The lines of one run (smoothed, and raw): one, the peers' mean, or one per peer with
    ``--peers``; and the peers skipped for having nothing to draw yet.

    Raises:
        EmptyLogError: no log of the run has anything to draw.
    """
    label = run.label or run.folder.name
    names = [f"{label}/{peer}" for peer in run.peers] if run.peers else [label]
    raw: list[Series] = []
    smoothed: list[Series] = []
    empty: list[EmptyLogError] = []
    for table, name in zip(tables, names, strict=True):
        try:
            raw.append(load_series(table, args.metric, args.x, name))
        except EmptyLogError as e:
            empty.append(e)
            continue
        smoothed.append(load_series(table, args.metric, args.x, name, args.smooth))
    if not raw:
        raise empty[0] if len(empty) == 1 else _empty_run(run, empty)
    if not run.peers or args.peers:
        return smoothed, raw, empty
    total = len(run.logs)
    of = f"{len(raw)} peers" if len(raw) == total else f"{len(raw)} of {total} peers"
    mean_label = f"{label} (mean of {of})"
    return (
        [mean_of(smoothed, mean_label, run.folder)],
        [mean_of(raw, mean_label, run.folder)],
        empty,
    )


def run(args: argparse.Namespace) -> int:
    """Does what the parsed command line asks; raises PlotError on bad input."""
    sources = [find_runs(arg) for arg in args.logs]
    runs = [r for src in sources for r in src.runs]
    tables = {path: read_table(path) for r in runs for path in r.logs}
    if args.list:
        _list_columns(list(tables.values()))
        return 0
    # Missing columns are errors for every file; a file with no numeric rows yet (a run that
    # just started) is only skipped while others have data.
    for table in tables.values():
        table.values(args.x)
        table.values(args.metric)

    _label_runs(sources)
    series: list[Series] = []
    raw: list[Series] = []
    empty: list[EmptyLogError] = []
    for r in runs:
        try:
            lines, raw_lines, skipped = _run_series(r, [tables[p] for p in r.logs], args)
        except EmptyLogError as e:
            empty.append(e)
            continue
        series.extend(lines)
        raw.extend(raw_lines)
        empty.extend(skipped)
    if not series:
        raise PlotError("; ".join(str(e) for e in empty))
    if args.mean and len(series) > 1:
        label = f"mean of {len(series)} runs"
        if len(series) <= 4:  # few enough to name: which runs they are shows in title and legend
            label += f" ({', '.join(s.label for s in series)})"
        first = runs[0].folder
        series = [mean_of(series, label, first, "runs")]
        raw = [mean_of(raw, label, first, "runs")]
    for e in empty:
        print(f"moolib-plot: warning: skipped {e}", file=sys.stderr)

    title = f"{args.metric} vs {args.x}"
    if args.smooth > 1:
        title += f" (moving average of {args.smooth})"
    if len(series) == 1:
        title += f": {series[0].label}"
    elif len(sources) == 1 and sources[0].is_folder_of_runs:
        title += f": {sources[0].path.resolve().name}"

    if args.png is not None:
        png = args.png
    elif sources[0].is_folder_of_runs or runs[0].peers:
        png = sources[0].path / _png_name(args.metric, args.x)
    else:
        png = default_png_path(runs[0].logs[0], args.metric, args.x)
    write_png(series, args.metric, args.x, png, raw=raw if args.smooth > 1 else None, title=title)

    if not args.no_terminal:
        width, height = _terminal_size(args.width, args.height)
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        print(render_terminal(series, args.metric, args.x, width, height, color, title))
        for s in series:
            print(_summary(s, args.metric, args.x))
    print(f"Saved {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``moolib-plot``; returns the exit code (2 on bad input, with the reason)."""
    output.quiet_when_closed()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a usage error (argparse printed it)
        if e.code is None:
            return 0
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    try:
        return run(args)
    except PlotError as e:
        print(f"moolib-plot: error: {e}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
