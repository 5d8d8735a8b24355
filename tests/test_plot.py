"""moolib-plot: logs.tsv drawn in the terminal (plotext) and to a PNG (matplotlib)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import matplotlib.image
import pytest
from moolib.agents.runtime.logger import COLUMNS
from moolib.launch import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def write_logs(path: Path, rows: int = 50, scale: float = 1.0, blank: dict | None = None) -> Path:
    """Writes a logs.tsv like moolib-run's; ``blank`` maps a column to row indices left empty."""
    path.parent.mkdir(parents=True, exist_ok=True)
    blank = blank or {}
    lines = ["\t".join(COLUMNS)]
    for i in range(rows):
        values = {
            "step": i * 1000,
            "sps": 500.0 + i,
            "mean_episode_return": scale * 10 * math.log1p(i),
            "mean_episode_length": 100 + i,
            "episodes": 3 * i,
            "total_loss": 1.0 / (i + 1),
            "policy_loss": 0.1,
            "baseline_loss": 0.2,
            "entropy_loss": -0.01,
            "grad_norm": 2.0 + math.sin(i),
            "learning_rate": 6e-4 * (1 - i / rows),
            "virtual_batch_size": 32,
            "model_version": i,
            "time": i * 2.5,
        }
        # The header is the logger's, whatever it holds: columns these tests do not
        # read get a counter.
        cells = ["" if i in blank.get(c, ()) else str(values.get(c, i)) for c in COLUMNS]
        lines.append("\t".join(cells))
    path.write_text("\n".join(lines) + "\n")
    return path


def assert_png(path: Path) -> None:
    """The file is a real PNG image that matplotlib reads back."""
    assert path.is_file(), path
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert image.shape[2] in (3, 4)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = plot.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def plot_rows(out: str) -> list[str]:
    """The lines of the terminal plot: those with the frame's vertical bars."""
    return [line for line in out.splitlines() if "│" in line or "┤" in line]


# --- drawing ------------------------------------------------------------------------------------


def test_one_file_draws_in_terminal_and_writes_png_beside_it(tmp_path, capsys):
    logs = write_logs(tmp_path / "run1" / "logs.tsv")
    code, out, err = run_main(capsys, str(logs), "--width", "80", "--height", "20")
    assert code == 0, err
    png = tmp_path / "run1" / "mean_episode_return.png"
    assert_png(png)
    assert f"Saved {png}" in out
    assert "mean_episode_return vs step: run1" in out  # title
    assert "┌" in out and "└" in out  # the plot frame
    assert re.search(r"^mean_episode_return\s+step\s*$", out, re.M)  # axis labels
    assert "4.9e4" in out or "49000" in out  # the last x tick (steps go to 49000)
    assert "run1: 50 points, last mean_episode_return" in out
    assert not ANSI.search(out)  # not a terminal: no colors
    rows = plot_rows(out)
    assert len(rows) >= 10
    assert all(len(row) == 80 for row in rows)
    assert err == ""


def test_directory_argument_means_its_logs_tsv(tmp_path, capsys):
    write_logs(tmp_path / "run1" / "logs.tsv")
    code, out, err = run_main(capsys, str(tmp_path / "run1"), "--width", "60", "--height", "12")
    assert code == 0, err
    assert_png(tmp_path / "run1" / "mean_episode_return.png")


def test_any_numeric_column_against_another_x(tmp_path, capsys):
    logs = write_logs(tmp_path / "r" / "logs.tsv")
    code, out, err = run_main(
        capsys, str(logs), "--metric", "grad_norm", "--x", "time", "--width", "60", "--height", "12"
    )
    assert code == 0, err
    assert "grad_norm vs time" in out
    assert re.search(r"^grad_norm\s+time\s*$", out, re.M)
    assert_png(tmp_path / "r" / "grad_norm_vs_time.png")


def test_several_files_one_line_each_labelled_by_run_folder(tmp_path, capsys):
    a = write_logs(tmp_path / "exp" / "lr_small" / "logs.tsv", rows=40)
    b = write_logs(tmp_path / "exp" / "lr_large" / "logs.tsv", rows=60, scale=0.5)
    png = tmp_path / "cmp.png"
    code, out, err = run_main(
        capsys, str(a), str(b.parent), "--png", str(png), "--width", "90", "--height", "20"
    )
    assert code == 0, err
    assert_png(png)
    assert not (a.parent / "mean_episode_return.png").exists()
    # The legend inside the plot names both runs, with different markers (no colors here).
    legend = [row for row in plot_rows(out) if "lr_small" in row or "lr_large" in row]
    assert len(legend) == 2
    assert "lr_small: 40 points" in out and "lr_large: 60 points" in out


def test_same_folder_names_get_parents_to_tell_them_apart(tmp_path):
    paths = [tmp_path / "sweep1" / "0" / "logs.tsv", tmp_path / "sweep2" / "0" / "logs.tsv"]
    assert plot.run_labels(paths) == ["sweep1/0", "sweep2/0"]
    assert plot.run_labels([tmp_path / "a" / "logs.tsv"]) == ["a"]
    two_in_one = plot.run_labels([tmp_path / "a" / "x.tsv", tmp_path / "a" / "y.tsv"])
    assert len(set(two_in_one)) == 2


def test_gaps_break_the_line(tmp_path, capsys):
    # Empty cells and nan in the metric, and a row with no step: three gaps, four segments.
    logs = write_logs(tmp_path / "g" / "logs.tsv", rows=30, blank={"mean_episode_return": {5, 6}})
    text = logs.read_text().splitlines()
    cells = text[1 + 12].split("\t")
    cells[COLUMNS.index("mean_episode_return")] = "nan"
    text[1 + 12] = "\t".join(cells)
    cells = text[1 + 20].split("\t")
    cells[0] = ""
    text[1 + 20] = "\t".join(cells)
    logs.write_text("\n".join(text) + "\n")

    series = plot.load_series(plot.read_table(logs), "mean_episode_return", "step", "g")
    assert [len(xs) for xs, _ in series.segments] == [5, 5, 7, 9]
    assert series.segments[1][0][0] == 7000.0

    code, out, err = run_main(capsys, str(logs), "--width", "70", "--height", "15")
    assert code == 0, err
    assert "g: 26 points" in out
    assert_png(tmp_path / "g" / "mean_episode_return.png")


def test_a_row_in_which_no_episode_ended_does_not_break_the_episode_lines(tmp_path, capsys):
    # Rows 5 and 6: no episode ended (nan, 0 episodes), as moolib-run logs them; row 12: a nan
    # return although episodes ended, which is a gap.
    logs = write_logs(tmp_path / "e" / "logs.tsv", rows=20)
    text = logs.read_text().splitlines()
    for i, value, episodes in [(5, "nan", "0"), (6, "nan", "0"), (12, "nan", "4")]:
        cells = text[1 + i].split("\t")
        cells[COLUMNS.index("mean_episode_return")] = value
        cells[COLUMNS.index("mean_episode_length")] = value
        cells[COLUMNS.index("episodes")] = episodes
        text[1 + i] = "\t".join(cells)
    logs.write_text("\n".join(text) + "\n")
    table = plot.read_table(logs)
    for metric in ["mean_episode_return", "mean_episode_length"]:
        series = plot.load_series(table, metric, "step", "e", 3)
        assert [len(xs) for xs, _ in series.segments] == [10, 7], metric
        assert 5000.0 not in series.segments[0][0] and series.segments[0][0][5] == 7000.0
    # Other columns keep their gaps: a nan loss in a row with no episode still breaks its line.
    cells = text[1 + 5].split("\t")
    cells[COLUMNS.index("total_loss")] = "nan"
    text[1 + 5] = "\t".join(cells)
    logs.write_text("\n".join(text) + "\n")
    series = plot.load_series(plot.read_table(logs), "total_loss", "step", "e")
    assert [len(xs) for xs, _ in series.segments] == [5, 14]
    # A log in which no episode has ended at all still says so.
    none = tmp_path / "none" / "logs.tsv"
    none.parent.mkdir()
    none.write_text("step\tmean_episode_return\tepisodes\n100\tnan\t0\n200\tnan\t0\n")
    with pytest.raises(plot.EmptyLogError, match="no episode has finished yet"):
        plot.load_series(plot.read_table(none), "mean_episode_return", "step", "none")
    code, out, err = run_main(capsys, str(logs), "--width", "70", "--height", "15")
    assert code == 0, err
    assert "e: 17 points" in out


def test_split_segments_and_lone_points():
    nan = math.nan
    xs = [0.0, 1.0, 2.0, 3.0, 4.0, nan, 6.0]
    ys = [nan, 1.0, nan, 3.0, 4.0, 5.0, 6.0]
    assert plot.split_segments(xs, ys) == [([1.0], [1.0]), ([3.0, 4.0], [3.0, 4.0]), ([6.0], [6.0])]
    assert plot.split_segments([nan], [nan]) == []


def test_lone_points_between_gaps_are_plotted(tmp_path, capsys):
    path = tmp_path / "lone" / "logs.tsv"
    path.parent.mkdir()
    path.write_text("step\tv\n1\t1\n2\t\n3\t3\n4\tnan\n5\t5\n6\t6\n")
    code, out, err = run_main(capsys, str(path), "--metric", "v", "--width", "40", "--height", "9")
    assert code == 0, err
    assert "lone: 4 points, last v 6 at step 6 (min 1, max 6)" in out
    assert_png(tmp_path / "lone" / "v.png")


def test_cells_are_parsed_generically():
    assert plot.parse_number("1.5") == 1.5
    assert plot.parse_number(" 2e3 ") == 2000.0
    for cell in ["", "nan", "NaN", "inf", "-inf", "abc", "True"]:
        assert math.isnan(plot.parse_number(cell)), cell


def test_short_and_long_rows_and_text_columns(tmp_path, capsys):
    # A last line still being written (short), an extra cell, and a text column.
    path = tmp_path / "r" / "logs.tsv"
    path.parent.mkdir()
    path.write_text("step\tname\tloss\n1\ta\t0.5\n2\tb\t0.4\textra\n3\tc\n")
    table = plot.read_table(path)
    assert table.columns == ["step", "name", "loss"]
    assert table.values("loss")[:2] == [0.5, 0.4] and math.isnan(table.values("loss")[2])
    code, out, err = run_main(capsys, str(path), "--metric", "loss", "--no-terminal")
    assert code == 0, err
    assert_png(tmp_path / "r" / "loss.png")


def test_rows_a_resume_superseded_are_left_out(tmp_path, capsys):
    # Logged to step 400, resumed from the checkpoint at 200 (its rows from 300 on
    # belong to a discarded history), then resumed again from 500 after a crash.
    path = tmp_path / "resumed" / "logs.tsv"
    path.parent.mkdir()
    steps = [100, 200, 300, 400, 250, 350, 450, 500, 600, 500, 550]
    path.write_text("step\tloss\n" + "".join(f"{s}\t{s / 1000}\n" for s in steps))
    table = plot.read_table(path)
    assert table.values("step") == [100, 200, 250, 350, 450, 500, 550]
    assert table.values("loss") == [0.1, 0.2, 0.25, 0.35, 0.45, 0.5, 0.55]
    # Without a step column nothing is left out.
    other = tmp_path / "other" / "logs.tsv"
    other.parent.mkdir()
    other.write_text("time\tloss\n2\t1\n1\t2\n")
    assert plot.read_table(other).values("loss") == [1, 2]
    code, out, err = run_main(capsys, str(path), "--metric", "loss")
    assert code == 0, err
    assert "resumed: 7 points, last loss 0.55 at step 550" in out, out


def test_smoothing(tmp_path, capsys):
    assert plot.smooth([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert plot.smooth([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
    assert plot.smooth([3.0, 6.0, 9.0, 0.0], 3) == [3.0, 4.5, 6.0, 5.0]
    with pytest.raises(ValueError):
        plot.smooth([1.0], 0)

    logs = write_logs(tmp_path / "s" / "logs.tsv", blank={"mean_episode_return": {10}})
    series = plot.load_series(plot.read_table(logs), "mean_episode_return", "step", "s", 4)
    # Smoothing starts over after a gap: the first point after it is its own value.
    assert series.segments[1][1][0] == pytest.approx(10 * math.log1p(11))
    code, out, err = run_main(capsys, str(logs), "--smooth", "4", "--width", "70", "--height", "14")
    assert code == 0, err
    assert "moving average of 4" in out
    assert_png(tmp_path / "s" / "mean_episode_return.png")


def test_png_option_and_no_terminal(tmp_path, capsys):
    logs = write_logs(tmp_path / "r" / "logs.tsv")
    png = tmp_path / "new" / "dir" / "out.png"
    code, out, err = run_main(capsys, str(logs), "--png", str(png), "--no-terminal")
    assert code == 0, err
    assert_png(png)
    assert out == f"Saved {png}\n"
    assert not (tmp_path / "r" / "mean_episode_return.png").exists()


def test_width_and_height(tmp_path, capsys):
    logs = write_logs(tmp_path / "r" / "logs.tsv")
    for width, height in [(40, 10), (120, 30)]:
        code, out, err = run_main(capsys, str(logs), "--width", str(width), "--height", str(height))
        assert code == 0, err
        lines = out.splitlines()
        plot_part = lines[: lines.index("") if "" in lines else height]
        assert len(plot_part) == height
        assert all(len(line) == width for line in plot_part)


def test_colors_only_when_asked():
    series = [plot.Series("a", Path("a/logs.tsv"), [([1.0, 2.0, 3.0], [1.0, 3.0, 2.0])])]
    colored = plot.render_terminal(series, "m", "step", 50, 12, color=True)
    plain = plot.render_terminal(series, "m", "step", 50, 12, color=False)
    assert ANSI.search(colored)
    assert not ANSI.search(plain)
    assert ANSI.sub("", colored).split() == plain.split()


def test_default_png_path():
    assert plot.default_png_path(Path("x/logs.tsv"), "total_loss") == Path("x/total_loss.png")
    assert plot.default_png_path(Path("x/logs.tsv"), "a/b c", "time") == Path("x/a_b_c_vs_time.png")


def test_list_columns(tmp_path, capsys):
    a = write_logs(tmp_path / "a" / "logs.tsv")
    code, out, err = run_main(capsys, str(a), "--list")
    assert code == 0, err
    assert out.splitlines() == list(COLUMNS)
    assert not (tmp_path / "a" / "mean_episode_return.png").exists()

    b = tmp_path / "b" / "logs.tsv"
    b.parent.mkdir()
    b.write_text("step\tfoo\n1\t2\n")
    code, out, err = run_main(capsys, str(a), str(b), "--list")
    assert code == 0, err
    assert out.splitlines() == [f"{a}:", *(f"  {c}" for c in COLUMNS), f"{b}:", "  step", "  foo"]


# --- errors -------------------------------------------------------------------------------------


def test_missing_file(tmp_path, capsys):
    code, out, err = run_main(capsys, str(tmp_path / "nope.tsv"))
    assert code == 2
    assert f"moolib-plot: error: {tmp_path / 'nope.tsv'}: no such file" in err
    assert out == ""


def test_directory_without_logs(tmp_path, capsys):
    code, _, err = run_main(capsys, str(tmp_path))
    assert code == 2
    assert f"moolib-plot: error: no logs.tsv in {tmp_path} (" in err
    assert err.count("\n") == 1


def test_one_missing_file_among_several(tmp_path, capsys):
    a = write_logs(tmp_path / "a" / "logs.tsv")
    code, _, err = run_main(capsys, str(a), str(tmp_path / "b" / "logs.tsv"))
    assert code == 2
    assert "b/logs.tsv: no such file" in err
    assert not (tmp_path / "a" / "mean_episode_return.png").exists()


def test_metric_that_is_not_a_column_lists_the_columns(tmp_path, capsys):
    logs = write_logs(tmp_path / "r" / "logs.tsv")
    code, out, err = run_main(capsys, str(logs), "--metric", "mean_return")
    assert code == 2
    assert f"{logs}: no column 'mean_return'" in err
    assert "did you mean 'mean_episode_return'?" in err
    assert "its columns are: " + ", ".join(COLUMNS) in err
    assert out == ""
    assert not (tmp_path / "r" / "mean_return.png").exists()
    # A misspelt word of a column name finds it too.
    code, _, err = run_main(capsys, str(logs), "--metric", "retrun")
    assert code == 2 and "did you mean 'mean_episode_return'?" in err, err
    # Nothing close: no guess.
    code, _, err = run_main(capsys, str(logs), "--metric", "xyzzy")
    assert code == 2 and "did you mean" not in err, err


def test_x_that_is_not_a_column(tmp_path, capsys):
    logs = write_logs(tmp_path / "r" / "logs.tsv")
    code, _, err = run_main(capsys, str(logs), "--x", "frames")
    assert code == 2
    assert "no column 'frames'" in err and "its columns are: step, sps" in err


def test_metric_missing_in_one_of_several_files(tmp_path, capsys):
    a = write_logs(tmp_path / "a" / "logs.tsv")
    b = tmp_path / "b" / "logs.tsv"
    b.parent.mkdir()
    b.write_text("step\tother\n1\t2\n")
    code, _, err = run_main(capsys, str(a), str(b))
    assert code == 2
    assert f"{b}: no column 'mean_episode_return'; its columns are: step, other" in err


def test_no_numeric_rows(tmp_path, capsys):
    path = tmp_path / "r" / "logs.tsv"
    path.parent.mkdir()
    path.write_text("step\tmean_episode_return\n1\t\n2\tnan\n3\tn/a\n")
    code, out, err = run_main(capsys, str(path))
    assert code == 2
    assert (
        f"{path}: no episode has finished yet (3 log rows, none with a mean_episode_return)" in err
    )
    assert out == ""
    # Two rows at one step (a peer waiting for its group logs on at the step it stopped at):
    # the count is the file's rows, as a reader of the file would count them.
    path.write_text("step\tmean_episode_return\n1\t\n2\tnan\n2\tnan\n")
    code, out, err = run_main(capsys, str(path))
    assert code == 2
    assert "(3 log rows, none with a mean_episode_return)" in err

    # Another metric that has no numbers: the generic message.
    path.write_text("step\tgrad_norm\n1\t\n2\tnan\n")
    code, out, err = run_main(capsys, str(path), "--metric", "grad_norm")
    assert code == 2
    assert f"{path}: no numeric rows" in err
    assert "none of its 2 log rows has a number in both 'step' and 'grad_norm'" in err


def test_header_only(tmp_path, capsys):
    path = tmp_path / "r" / "logs.tsv"
    path.parent.mkdir()
    path.write_text("\t".join(COLUMNS) + "\n")
    code, _, err = run_main(capsys, str(path))
    assert code == 2
    assert f"{path}: no log rows yet (only the header)" in err


def test_empty_file(tmp_path, capsys):
    path = tmp_path / "logs.tsv"
    path.write_text("")
    code, _, err = run_main(capsys, str(path))
    assert code == 2
    assert "empty file (no header row)" in err


def test_run_without_rows_is_skipped_beside_runs_with_some(tmp_path, capsys):
    a = write_logs(tmp_path / "a" / "logs.tsv")
    b = tmp_path / "b" / "logs.tsv"
    b.parent.mkdir()
    b.write_text("\t".join(COLUMNS) + "\n")
    code, out, err = run_main(capsys, str(a), str(b), "--no-terminal")
    assert code == 0, err
    assert f"warning: skipped {b}: no log rows yet" in err
    assert_png(tmp_path / "a" / "mean_episode_return.png")

    code, _, err = run_main(capsys, str(b), str(b.parent))
    assert code == 2
    assert "no log rows yet" in err


def test_unwritable_png(tmp_path, capsys):
    logs = write_logs(tmp_path / "r" / "logs.tsv")
    blocker = tmp_path / "file"
    blocker.write_text("")
    code, _, err = run_main(capsys, str(logs), "--png", str(blocker / "out.png"))
    assert code == 2
    assert "cannot write the PNG" in err


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "the following arguments are required: RUN"),
        (["x.tsv", "--smooth", "0"], "argument --smooth: must be at least 1, got 0"),
        (["x.tsv", "--smooth", "two"], "argument --smooth: not an integer: 'two'"),
        (["x.tsv", "--width", "10"], "argument --width: must be at least 30, got 10"),
        (["x.tsv", "--height", "3"], "argument --height: must be at least 8, got 3"),
        (["x.tsv", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_options(capsys, args, message):
    code, _, err = run_main(capsys, *args)
    assert code == 2
    assert message in err


def test_help(capsys):
    code, out, _ = run_main(capsys, "--help")
    assert code == 0
    assert "--metric" in out and "--smooth" in out and "--png" in out


# --- the installed console script ---------------------------------------------------------------


def console_script() -> str:
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        script = Path(folder) / "moolib-plot"
        if script.is_file() and os.access(script, os.X_OK):
            return str(script)
    pytest.fail("the moolib-plot console script is not installed next to this Python")


def test_console_script_draws_and_writes(tmp_path):
    a = write_logs(tmp_path / "run_a" / "logs.tsv")
    b = write_logs(tmp_path / "run_b" / "logs.tsv", scale=0.5, blank={"mean_episode_return": {7}})
    proc = subprocess.run(
        [console_script(), str(a.parent), str(b), "--width", "100", "--height", "24"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "run_a" / "mean_episode_return.png"
    assert_png(png)
    assert f"Saved {png}" in proc.stdout
    assert "mean_episode_return vs step" in proc.stdout
    assert re.search(r"^mean_episode_return\s+step\s*$", proc.stdout, re.M)
    assert "run_a: 50 points" in proc.stdout and "run_b: 49 points" in proc.stdout
    assert len(plot_rows(proc.stdout)) >= 18


def test_console_script_error_exit_code(tmp_path):
    logs = write_logs(tmp_path / "r" / "logs.tsv")
    proc = subprocess.run(
        [console_script(), str(logs), "--metric", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "moolib-plot: error:" in proc.stderr and "its columns are: step" in proc.stderr
    assert proc.stdout == ""


# --- runs of several peers, sweeps --------------------------------------------------------------


def write_point(folder: Path, overrides: list[str] | None, config: dict | None, scale: float):
    """A sweep point as moolib-run leaves it: logs.tsv, .hydra/overrides.yaml, config.yaml."""
    import yaml

    write_logs(folder / "logs.tsv", rows=20, scale=scale)
    if overrides is not None:
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if config is not None:
        (folder / "config.yaml").write_text(yaml.safe_dump(config))


def test_sweep_points_are_labelled_by_the_overrides_that_differ(tmp_path, capsys):
    sweep = tmp_path / "12-00-00-a2c-cartpole"
    common = ["agent=a2c", "env=cartpole", f"savedir={sweep}"]
    points = [("3e-4", "0.1", 1.0), ("3e-4", "0.2", 0.8), ("1e-3", "0.1", 0.6)]
    for n, (lr, other, scale) in enumerate(points):
        overrides = [*common, f"agent.optimizer.learning_rate={lr}", f"foo.learning_rate={other}"]
        write_point(sweep / str(n), overrides, None, scale)
    (sweep / "multirun.yaml").write_text("{}\n")
    code, out, err = run_main(capsys, str(sweep), "--width", "90", "--height", "16")
    assert code == 0, err
    # Two keys end in learning_rate: both stay whole; the keys all points share are left out.
    labels = re.findall(r"^(.+): 20 points", out, re.M)
    assert labels == [
        "agent.optimizer.learning_rate=3e-4, foo.learning_rate=0.1",
        "agent.optimizer.learning_rate=3e-4, foo.learning_rate=0.2",
        "agent.optimizer.learning_rate=1e-3, foo.learning_rate=0.1",
    ]
    assert f"Saved {sweep / 'mean_episode_return.png'}" in out
    assert_png(sweep / "mean_episode_return.png")
    assert "mean_episode_return vs step: 12-00-00-a2c-cartpole" in out

    assert plot.override_labels([{"a.b.lr": "1", "seed": "0"}, {"a.b.lr": "2", "seed": "0"}]) == [
        "lr=1",
        "lr=2",
    ]
    assert plot.override_labels([{"x": "1"}, {"x": "1"}]) is None


def test_sweep_without_overrides_is_labelled_from_its_configs(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    for n, lr in enumerate([0.001, 0.002, 0.004]):
        config = {
            "agent": {"optimizer": {"learning_rate": lr}, "name": "a2c"},
            "savedir": str(sweep / str(n)),
            "group": f"g{n}",
        }
        write_point(sweep / str(n), None, config, 1.0 + n)
    code, out, err = run_main(capsys, str(sweep), "--no-terminal")
    assert code == 0, err
    assert plot.sweep_labels([sweep / "0", sweep / "1", sweep / "2"]) == [
        "learning_rate=0.001",
        "learning_rate=0.002",
        "learning_rate=0.004",
    ]
    # Nothing tells them apart: their folder names.
    for n in range(3):
        (sweep / str(n) / "config.yaml").unlink()
    assert plot.find_runs(sweep).runs[2].label == "2"


def test_multi_peer_run_is_their_mean_with_its_spread(tmp_path, capsys):
    run = tmp_path / "local"
    write_logs(run / "peer0" / "logs.tsv", rows=10, scale=1.0)
    write_logs(run / "peer1" / "logs.tsv", rows=10, scale=3.0)
    (run / "peer2").mkdir()  # a peer that has not logged yet
    code, out, err = run_main(capsys, str(run), "--width", "80", "--height", "14")
    assert code == 0, err
    assert_png(run / "mean_episode_return.png")
    m = re.search(
        r"^local \(mean of 2 peers\): 10 points, last mean_episode_return (\S+)", out, re.M
    )
    assert m, out
    last = 10 * math.log1p(9)
    assert float(m.group(1)) == pytest.approx(2 * last, rel=1e-5)  # (1x + 3x) / 2
    assert re.search(r"its peers at the last point: (\S+) to (\S+)$", out, re.M)

    series = plot.mean_of(
        [
            plot.Series("a", Path("a"), [([0.0, 10.0], [0.0, 10.0])]),
            plot.Series("b", Path("b"), [([5.0, 15.0], [20.0, 30.0])]),
        ],
        "m",
        Path("m"),
    )
    # Each peer counts where it logged (interpolated between its rows), not beyond.
    assert series.segments == [([0.0, 5.0, 10.0, 15.0], [0.0, 12.5, 17.5, 30.0])]
    assert series.band == [([0.0, 5.0, 10.0, 30.0], [0.0, 20.0, 25.0, 30.0])]
    assert series.peers == 2

    png = tmp_path / "peers.png"
    code, out, err = run_main(capsys, str(run), "--peers", "--png", str(png), "--width", "60")
    assert code == 0, err
    assert_png(png)
    assert re.search(r"^local/peer0: 10 points", out, re.M) and "local/peer1: 10 points" in out

    write_logs(run / "peer0" / "logs.tsv", rows=0)
    (run / "peer1" / "logs.tsv").write_text("\t".join(COLUMNS) + "\n1\t2\n")
    code, out, err = run_main(capsys, str(run))
    assert code == 2
    assert err.startswith(f"moolib-plot: error: {run}: nothing to plot yet (peer0: only the header")
    assert err.count("\n") == 1


def test_mean_draws_runs_of_several_seeds_as_one_line_with_their_spread(tmp_path, capsys):
    seeds = [tmp_path / f"breakout-seed{i}" for i in range(3)]
    for i, run in enumerate(seeds):
        write_logs(run / "logs.tsv", rows=10, scale=1.0 + i)
    png = tmp_path / "seeds.png"
    code, out, err = run_main(capsys, *map(str, seeds), "--mean", "--png", str(png))
    assert code == 0, err
    assert_png(png)
    named = r"mean of 3 runs \(breakout-seed0, breakout-seed1, breakout-seed2\)"
    m = re.search(rf"^{named}: 10 points, last mean_episode_return (\S+)", out, re.M)
    assert m, out
    last = 10 * math.log1p(9)
    assert float(m.group(1)) == pytest.approx(2 * last, rel=1e-5)  # (1x + 2x + 3x) / 3
    low, high = re.search(r"its runs at the last point: (\S+) to (\S+)$", out, re.M).groups()
    assert float(low) == pytest.approx(last, rel=1e-5)
    assert float(high) == pytest.approx(3 * last, rel=1e-5)
    # Without --mean: one line each.
    code, out, err = run_main(capsys, *map(str, seeds), "--png", str(png))
    assert code == 0 and "mean of" not in out and out.count(": 10 points") == 3
