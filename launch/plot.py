"""``moolib-plot``: draws a metric of moolib-run's ``logs.tsv`` in the terminal and to a PNG.

Usage::

    moolib-plot savedir/logs.tsv [other_run/ ...] [--metric NAME] [--x step] [--smooth N]
                [--png out.png] [--no-terminal] [--width W] [--height H] [--list]

The input is the tab-separated file that ``moolib-run`` writes for each run: a header row, then
one row per log interval. Any numeric column can be plotted against any other (``--x``, default
``step``); empty cells, ``nan``, infinities and text are gaps in the line. A directory argument
stands for ``<dir>/logs.tsv``; several files give one line each, labelled by their run folder.

The terminal plot is drawn with plotext (colored when stdout is a terminal and ``NO_COLOR`` is
unset), the PNG with matplotlib's Agg backend: by default ``<metric>.png`` beside the first log
file (``<metric>_vs_<x>.png`` when ``--x`` is not ``step``). Errors (a missing file, a metric or x
column that the file does not have, no numeric rows) are printed with the reason and exit with
code 2.
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

__all__ = [
    "DEFAULT_METRIC",
    "LOG_FILE",
    "PlotError",
    "Series",
    "Table",
    "build_parser",
    "default_png_path",
    "load_series",
    "main",
    "parse_number",
    "read_table",
    "render_terminal",
    "resolve_log_path",
    "run_labels",
    "smooth",
    "split_segments",
    "write_png",
]

DEFAULT_METRIC = "mean_episode_return"
LOG_FILE = "logs.tsv"
EXIT_ERROR = 2

# Smallest terminal plot that still shows a canvas between its title, ticks and labels.
MIN_WIDTH = 30
MIN_HEIGHT = 8

Segment = tuple[list[float], list[float]]


class PlotError(Exception):
    """A problem with the input files or the options; ``main`` prints it and returns 2."""


@dataclass
class Table:
    """One log file: its column names and its data rows, as the text cells read from the file."""

    path: Path
    columns: list[str]
    rows: list[list[str]]

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
    """One run's line: its label and the unbroken stretches of (x, y) points between gaps."""

    label: str
    path: Path
    segments: list[Segment]

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
            raise PlotError(f"{path}: directory has no {LOG_FILE}")
        return log
    if not path.exists():
        raise PlotError(f"{path}: no such file")
    if not path.is_file():
        raise PlotError(f"{path}: not a regular file")
    return path


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
    return Table(path=path, columns=columns, rows=rows[1:])


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
        PlotError: a column is missing, or no row has numbers in both columns.
    """
    xs = table.values(x)
    ys = table.values(metric)
    segments = split_segments(xs, ys)
    if not segments:
        raise PlotError(
            f"{table.path}: no numeric rows: none of its {len(table.rows)} data rows has a "
            f"number in both '{x}' and '{metric}'"
        )
    if window > 1:
        segments = [(sx, smooth(sy, window)) for sx, sy in segments]
    return Series(label=label, path=table.path, segments=segments)


def default_png_path(first_log: Path, metric: str, x: str = "step") -> Path:
    """``<metric>.png`` (``<metric>_vs_<x>.png`` for another x) in the first log's folder."""
    name = metric if x == "step" else f"{metric}_vs_{x}"
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "plot"
    return first_log.parent / f"{name}.png"


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
    if len(series) > 1:
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
            "Several files give one line each, labelled by their run folder; a directory stands "
            "for <dir>/logs.tsv. Empty cells and nan are gaps."
        ),
    )
    parser.add_argument("logs", nargs="+", help="logs.tsv files or run directories")
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
        "--png",
        type=Path,
        default=None,
        metavar="PATH",
        help="where to write the PNG (default: <metric>.png beside the first logs.tsv)",
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
    """One line on a run: its number of points, its last value and its range."""
    last_x, last_y = s.last()
    values = [y for _, ys in s.segments for y in ys]
    return (
        f"{s.label}: {s.num_points} points, last {metric} {last_y:.6g} at {x} {last_x:.6g} "
        f"(min {min(values):.6g}, max {max(values):.6g})"
    )


def run(args: argparse.Namespace) -> int:
    """Does what the parsed command line asks; raises PlotError on bad input."""
    paths = [resolve_log_path(arg) for arg in args.logs]
    tables = [read_table(path) for path in paths]
    if args.list:
        _list_columns(tables)
        return 0

    labels = run_labels(paths)
    series: list[Series] = []
    raw: list[Series] = []
    empty: list[PlotError] = []
    for table, label in zip(tables, labels, strict=True):
        # Missing columns are errors for every file; a file with no numeric rows yet (a run that
        # just started) is only skipped while others have data.
        table.values(args.x)
        table.values(args.metric)
        try:
            raw.append(load_series(table, args.metric, args.x, label))
        except PlotError as e:
            empty.append(e)
            continue
        series.append(load_series(table, args.metric, args.x, label, args.smooth))
    if not series:
        raise PlotError("; ".join(str(e) for e in empty))
    for e in empty:
        print(f"moolib-plot: warning: skipped {e}", file=sys.stderr)

    title = f"{args.metric} vs {args.x}"
    if args.smooth > 1:
        title += f" (moving average of {args.smooth})"
    if len(series) == 1:
        title += f": {series[0].label}"

    png = args.png if args.png is not None else default_png_path(paths[0], args.metric, args.x)
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
