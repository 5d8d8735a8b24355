"""What a researcher sees of ``moolib-run`` and ``moolib-plot``, run as they would run them.

Real ``moolib-run`` subprocesses (some on a pseudo-terminal, as in an interactive shell), real
``moolib-plot`` on what they wrote: the start banner, the progress line (and its record in the
log folder), log lines that never glue onto it, one ALE banner at most, the summary at the end
and its plot command, ``--help``, a reader that closes stdout early; plots of a run, of multi-peer
runs, sweeps and several runs side by side, and the one-line errors of runs with nothing to plot.
"""

from __future__ import annotations

import io
import math
import os
import re
import select
import shlex
import subprocess
from pathlib import Path

import matplotlib.image
import moolib.conf
import pytest
from helpers.run_util import (
    RUN_TIMEOUT,
    Run,
    check_ok,
    kill_session,
    plot_cmd,
    read_logs,
    run,
    run_cmd,
    run_env,
    run_in_terminal,
    run_quick,
    screen_lines,
    wait_for,
)
from moolib.agents.runtime.logger import Progress
from moolib.envs.minatar import MINATAR_GAMES
from moolib.envs.mujoco import MUJOCO_GAMES

CONF = Path(next(iter(moolib.conf.__path__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALE_BANNER = "A.L.E: Arcade Learning Environment"
CARTPOLE = ["agent=a2c", "env=cartpole", "device=cpu", "log_interval=1"]
# Small Breakout runs on CPU: 8 envs in 2 actor batches, 4 unrolls of 10 steps per update.
SMALL_ATARI = [
    "agent=vtrace",
    "env=breakout",
    "device=cpu",
    "agent.actor_batch_size=8",
    "agent.batch_size=4",
    "agent.unroll_length=10",
    "agent.virtual_batch_size=4",
]
PROGRESS = re.compile(r"\[peer \d+\] step [\d,]+/[\d,]+ \(")


def plot(cwd: Path, *args: str, code: int = 0) -> subprocess.CompletedProcess:
    """``moolib-plot ARGS`` as a user types it; checks its exit code and that no traceback
    shows."""
    r = subprocess.run(
        plot_cmd(*args), cwd=cwd, env=run_env(), capture_output=True, text=True, timeout=120
    )
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    return r


def saved_png(out: str, cwd: Path) -> Path:
    """The PNG that moolib-plot (run in ``cwd``) says it wrote, checked to be an image."""
    m = re.search(r"^Saved (.+\.png)$", out, re.M)
    assert m, out
    path = cwd / m.group(1)
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    return path


def summary_plot_command(out: str) -> list[str]:
    """The ``moolib-plot ...`` command of the summary that moolib-run printed at its end."""
    m = re.search(r"^  plot +(moolib-plot .+)$", out, re.M)
    assert m, out[-3000:]
    return shlex.split(m.group(1))


# -- point 6: plots of what moolib-run makes ----------------------------------------------------


@pytest.mark.timeout(600)
def test_plot_draws_a_real_runs_logs(tmp_path):
    savedir = tmp_path / "plotted"
    check_ok(
        run(
            [
                "agent=a2c",
                "env=cartpole",
                "device=cpu",
                "total_steps=4000",
                "log_interval=1",
                f"savedir={savedir}",
            ],
            tmp_path,
        )
    )
    _, rows = read_logs(savedir / "logs.tsv")
    points = sum(1 for r in rows if not math.isnan(r["mean_episode_return"]))
    assert points >= 1

    def plot(*args):
        r = subprocess.run(
            plot_cmd(*args),
            cwd=tmp_path,
            env=run_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    out = plot(str(savedir / "logs.tsv"), "--width", "60", "--height", "12")
    png = savedir / "mean_episode_return.png"
    assert f"Saved {png}" in out
    assert f"plotted: {points} point{'s' if points != 1 else ''}, last mean_episode_return" in out
    assert "┌" in out  # the terminal plot
    check_png(png)

    loss_png = tmp_path / "loss.png"
    out = plot(str(savedir), "--metric", "total_loss", "--png", str(loss_png), "--no-terminal")
    assert out.strip() == f"Saved {loss_png}"
    check_png(loss_png)


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_plot_a_multi_peer_run_a_sweep_and_runs_side_by_side(tmp_path):
    local = tmp_path / "local"
    out = check_ok(
        run(
            [
                *CARTPOLE,
                "scaling=local",
                "scaling.peers=2",
                # Enough that the peer that starts first cannot finish alone.
                "total_steps=150000",
                f"savedir={local}",
            ],
            tmp_path,
        )
    )
    for k in (0, 1):
        _, rows = read_logs(local / f"peer{k}" / "logs.tsv")
        assert any(r["mean_episode_return"] == r["mean_episode_return"] for r in rows), rows
    assert not (local / "logs.tsv").exists()

    # The savedir plots as the group: the mean of its two peers.
    r = plot(tmp_path, str(local), "--width", "80", "--height", "14")
    assert saved_png(r.stdout, tmp_path) == local / "mean_episode_return.png"
    assert "local (mean of 2 peers)" in r.stdout
    assert re.search(r"its peers at the last point: \S+ to \S+", r.stdout), r.stdout
    assert "┌" in r.stdout  # the terminal plot
    # The command that the run's summary gives is that one.
    command = summary_plot_command(out)
    assert command[0] == "moolib-plot" and Path(tmp_path, command[1]).resolve() == local

    # --peers: one line each.
    png = tmp_path / "peers.png"
    r = plot(tmp_path, str(local), "--peers", "--png", str(png), "--width", "80", "--height", "14")
    assert saved_png(r.stdout, tmp_path) == png
    assert re.search(r"^local/peer0: \d+ points?, last", r.stdout, re.M), r.stdout
    assert re.search(r"^local/peer1: \d+ points?, last", r.stdout, re.M), r.stdout

    # A sweep: one line per point, labelled by the override that tells them apart.
    sweep = tmp_path / "sweep"
    check_ok(
        run(
            [
                "-m",
                *CARTPOLE,
                "total_steps=3000",
                "agent.optimizer.learning_rate=1e-3,3e-3",
                f"savedir={sweep}",
            ],
            tmp_path,
        )
    )
    r = plot(tmp_path, str(sweep), "--width", "80", "--height", "14")
    assert saved_png(r.stdout, tmp_path) == sweep / "mean_episode_return.png"
    labels = re.findall(r"^(.+): \d+ points?, last mean_episode_return", r.stdout, re.M)
    assert labels == ["learning_rate=0.001", "learning_rate=0.003"], r.stdout
    assert "mean_episode_return vs step: sweep" in r.stdout

    # Several savedirs side by side: one line each, labelled by its folder.
    png = tmp_path / "cmp.png"
    r = plot(tmp_path, str(local), str(sweep / "1"), "--no-terminal", "--png", str(png))
    assert r.stdout.strip() == f"Saved {png}"
    saved_png(r.stdout, tmp_path)
    r = plot(tmp_path, str(local), str(sweep / "0"), str(sweep / "1"), "--width", "80")
    labels = re.findall(r"^(.+): \d+ points?, last", r.stdout, re.M)
    assert labels == ["local (mean of 2 peers)", "0", "1"], r.stdout

    # Nothing to plot: one line saying what is missing, exit 2.
    empty = tmp_path / "empty"
    empty.mkdir()
    r = plot(tmp_path, str(empty), code=2)
    assert r.stdout == ""
    assert r.stderr.startswith(f"moolib-plot: error: no logs.tsv in {empty}")
    assert r.stderr.count("\n") == 1, r.stderr

    # Rows, but no episode finished yet (the first rows of a slow game): the run's header and
    # rows, with their episode cells emptied.
    header, *lines = (local / "peer0" / "logs.tsv").read_text().splitlines()
    columns = header.split("\t")
    blank = {columns.index(c) for c in ("mean_episode_return", "mean_episode_length")}
    young = tmp_path / "young"
    young.mkdir()
    rows = [
        "\t".join("" if i in blank else c for i, c in enumerate(line.split("\t"))) for line in lines
    ]
    (young / "logs.tsv").write_text("\n".join([header, *rows]) + "\n")
    r = plot(tmp_path, str(young), code=2)
    assert r.stderr == (
        f"moolib-plot: error: {young / 'logs.tsv'}: no episode has finished yet "
        f"({len(rows)} log row{'s' if len(rows) != 1 else ''}, none with a mean_episode_return)\n"
    )


# -- point 7: what the terminal shows -----------------------------------------------------------


@pytest.mark.timeout(600)
def test_terminal_banner_progress_log_lines_and_summary(tmp_path):
    savedir = tmp_path / "tty"
    code, raw = run_in_terminal([*CARTPOLE, "total_steps=20000", f"savedir={savedir}"], tmp_path)
    screen = screen_lines(raw)
    text = "\n".join(screen)
    assert code == 0, text[-5000:]
    assert "Traceback" not in text, text[-5000:]

    # One compact block at the start: agent, env, device, peers, broker, savedir.
    assert screen[0] == "moolib-run: a2c on cartpole (gymnasium)", screen[:8]
    block = "\n".join(screen[:6])
    assert "  device   cpu" in block
    assert "  scaling  single, 1 peer" in block
    assert re.search(r"^  broker   127\.0\.0\.1:\d+ \(started by moolib-run\)$", block, re.M)
    assert f"  savedir  {savedir}" in block

    # The progress line ends at 100% with an ETA of 0:00; log lines (the last checkpoint's)
    # stand on their own lines, never glued onto it.
    progress = [line for line in screen if PROGRESS.search(line)]
    assert progress, text[-3000:]
    assert "(100.0%)" in progress[-1] and progress[-1].endswith("ETA 0:00"), progress[-1]
    logged = [line for line in screen if "checkpoint at step" in line]
    assert logged, text[-3000:]
    for line in logged:
        assert not PROGRESS.search(line) and "ETA" not in line, line
        # In the peers' format, not Hydra's ([2026-12-01 ...][moolib.agents][INFO] - ...).
        assert line.startswith("[peer 0] checkpoint at step "), line
    assert not re.search(r"^\[\d{4}-\d\d-\d\d ", text, re.M), text[-3000:]
    assert "SPS 0 " not in raw

    # At the end: steps, time, final mean return, savedir and how to plot it.
    _, rows = read_logs(savedir / "logs.tsv")
    steps = int(rows[-1]["step"])
    m = re.search(
        rf"^moolib-run: done: {steps:,} steps in \d+:\d\d; mean return (\S+) ", text, re.M
    )
    assert m, text[-3000:]
    assert float(m.group(1)) > 0
    assert re.search(r"^  savedir  tty$", text, re.M), text[-3000:]
    command = summary_plot_command(text)
    r = plot(tmp_path, *command[1:], "--no-terminal")
    assert saved_png(r.stdout, tmp_path) == savedir / "mean_episode_return.png"

    # The progress lines are kept in the log folder too, with the banner.
    kept = (savedir / "progress.log").read_text()
    assert "moolib-run: a2c on cartpole" in kept
    kept_progress = [line for line in kept.splitlines() if PROGRESS.search(line)]
    assert len(kept_progress) >= len(rows) - 1
    assert "(100.0%)" in kept_progress[-1]


@pytest.mark.timeout(600)
def test_local_atari_run_warms_up_and_prints_one_ale_banner_at_most(tmp_path):
    savedir = tmp_path / "atari"
    code, raw = run_in_terminal(
        [
            *SMALL_ATARI,
            "scaling=local",
            "scaling.peers=2",
            "total_steps=120",
            "log_interval=0.5",
            f"savedir={savedir}",
        ],
        tmp_path,
    )
    screen = screen_lines(raw)
    text = "\n".join(screen)
    assert code == 0, text[-5000:]
    peer1 = (savedir / "peer1" / "stdout.log").read_text(errors="replace")
    # Every env process (the probe and each worker of each peer) used to print it.
    assert (raw + peer1).count(ALE_BANNER) <= 1, raw + peer1
    assert "Traceback" not in text + peer1

    assert screen[0] == "moolib-run: vtrace on breakout (ALE " + screen[0].split("ALE ")[1]
    assert screen[0].endswith(", peer 0 of 2"), screen[0]
    assert any(line.startswith("  scaling  local, 2 peers") for line in screen[:6])

    # Before the learner's first update the line says what the actors do, not "SPS 0"
    # (whether a line comes before it depends on the machine's speed: see
    # test_progress_line_before_and_between_updates for the lines themselves).
    for log in (savedir / "peer0" / "progress.log", savedir / "peer1" / "progress.log"):
        lines = [line for line in log.read_text().splitlines() if PROGRESS.search(line)]
        assert lines, log
        assert not any(" SPS 0 " in line for line in lines), lines
        warm = [line for line in lines if "step 0/" in line]
        assert all(re.search(r"warming up: acting [\d,]+ env steps/s", w) for w in warm), warm
        assert "(100.0%)" in lines[-1] and lines[-1].endswith("ETA 0:00"), lines[-1]
    # Peer 1 logs into its folder; its progress lines are there as on peer 0's terminal.
    assert re.search(r"^\[peer 1\] step [\d,]+/120 \(100\.0%\)", peer1, re.M), peer1[-2000:]
    assert re.search(r"^moolib-run: (done|stopped): ", text, re.M), text[-3000:]


def test_progress_line_before_and_between_updates(tmp_path):
    log = tmp_path / "progress.log"
    out = io.StringIO()
    progress = Progress(1000, prefix="[peer 1] ", stream=out, log_path=log)
    rows = [
        # The actors act, the learner has not learned from a step yet.
        {"step": 0, "time": 10.0, "env_sps": 300.0},
        {"step": 0, "time": 11.0, "env_sps": 320.0, "mean_episode_return": 1.5},
        # Its first updates.
        {"step": 200, "time": 12.0, "env_sps": 310.0, "total_loss": 0.25},
        {"step": 400, "time": 13.0, "env_sps": 310.0},
    ]
    # Then it waits (for its peers, say) over a whole window while the actors act on.
    rows += [{"step": 400, "time": 14.0 + i, "env_sps": 280.0} for i in range(Progress.WINDOW)]
    rows.append({"step": 1000, "time": 20.0, "env_sps": 300.0})
    for row in rows:
        progress.update(row)
    progress.close()
    lines = out.getvalue().splitlines()
    kept = log.read_text().splitlines()
    assert all(k.endswith(" " + line) for k, line in zip(kept, lines, strict=True)), kept
    assert lines[0].startswith("[peer 1] step 0/1,000 (0.0%)  warming up: acting 300 env"), lines
    assert lines[0].endswith("return -  loss -  ETA ?"), lines[0]
    assert "warming up: acting 320 env steps/s  return 1.50" in lines[1], lines[1]
    assert "step 200/1,000 (20.0%)  SPS 100  return 1.50  loss 0.25" in lines[2], lines[2]
    assert "step 400/1,000 (40.0%)  SPS 133  " in lines[3], lines[3]
    waiting = lines[4 + Progress.WINDOW - 1]
    assert "step 400/1,000 (40.0%)  learner waiting: acting 280 env steps/s  " in waiting
    assert " SPS 0 " not in "\n".join(lines)
    assert lines[-1].startswith("[peer 1] step 1,000/1,000 (100.0%)  SPS "), lines[-1]
    assert lines[-1].endswith("ETA 0:00"), lines[-1]

    # A run that ends within its first log interval: its one row's SPS covers the run from
    # where the line started.
    out = io.StringIO()
    quick = Progress(20000, stream=out)
    quick.start(5.0, 0)
    quick.update({"step": 20224, "time": 6.0, "env_sps": 20000.0})
    quick.close()
    assert "(100.0%)  SPS 20,224  " in out.getvalue(), out.getvalue()


def drawn_on_terminal(columns: int, rows: list[dict], log: Path) -> str:
    """The progress line as last drawn on a pseudo-terminal ``columns`` wide (0: a size
    that was never set) after ``rows``."""
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    with os.fdopen(slave, "w") as stream:
        progress = Progress(50_000_000, prefix="[peer 0] ", stream=stream, log_path=log)
        assert progress.live
        progress.start(0.0, 0)
        for row in rows:
            progress.update(row)
        progress.close()
    raw = b""
    while select.select([master], [], [], 0.1)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        raw += chunk
    os.close(master)
    drawn = [t for t in raw.decode().replace("\n", "\r").split("\r") if t.strip()]
    return drawn[-1]


def test_progress_line_fits_the_terminal_with_what_matters_first(tmp_path):
    rows = [
        {"step": 10_000_000, "time": 600.0, "total_loss": 658.8, "mean_episode_return": 196.33},
        {"step": 12_345_678, "time": 700.0, "total_loss": 658.8},
    ]
    full = (
        "[peer 0] step 12,345,678/50,000,000 (24.7%)  SPS 17,637  return 196.33  loss 658.8  "
        "ETA 35:35"
    )
    # 80 columns: the loss and the total give way; the step, SPS, return and ETA stay.
    line = drawn_on_terminal(80, rows, tmp_path / "a.log")
    assert len(line) < 80, line
    assert re.fullmatch(
        r"\[peer 0\] step 12,345,678 \(24\.7%\)  SPS 17,637  return 196\.33  ETA 35:35",
        line,
    ), line
    # Narrower still: the SPS, then the return go, and the ETA stays to the last.
    line = drawn_on_terminal(50, rows, tmp_path / "b.log")
    assert len(line) < 50 and line.startswith("[peer 0] step 12,345,678 (24.7%)  "), line
    assert "ETA " in line and "SPS" not in line, line
    # Width 0 (a pseudo-terminal whose size was never set) sets no limit.
    line = drawn_on_terminal(0, rows, tmp_path / "c.log")
    assert line == full, line
    # The record in progress.log is always whole.
    kept = (tmp_path / "a.log").read_text().splitlines()[-1]
    assert kept.endswith("  " + full), kept


@pytest.mark.timeout(600)
def test_a_closed_stdout_ends_the_output_quietly_and_training_goes_on(tmp_path):
    """``moolib-run ... | head -2``: the reader takes two lines and is gone. The run used
    to end in a BrokenPipeError traceback, exit 1."""
    savedir = tmp_path / "piped"
    with open(tmp_path / "stderr.log", "wb") as err:
        proc = subprocess.Popen(
            run_cmd(*CARTPOLE, "total_steps=20000", f"savedir={savedir}"),
            cwd=tmp_path,
            env=run_env(),
            stdout=subprocess.PIPE,
            stderr=err,
            start_new_session=True,
        )
        try:
            first = [proc.stdout.readline() for _ in range(2)]
            proc.stdout.close()
            code = proc.wait(timeout=RUN_TIMEOUT)
        finally:
            if proc.poll() is None:
                proc.kill()
            kill_session(proc.pid)
    errors = (tmp_path / "stderr.log").read_text(errors="replace")
    assert first[0].startswith(b"moolib-run: a2c on cartpole"), first
    assert code == 0, errors[-5000:]
    assert "Traceback" not in errors and "BrokenPipe" not in errors, errors[-5000:]
    # It trained to the end after its reader was gone: logs, checkpoint, progress record.
    _, rows = read_logs(savedir / "logs.tsv")
    assert rows[-1]["step"] >= 20000, rows[-1]
    assert "checkpoint.pt" in {p.name for p in savedir.iterdir()}
    kept = [line for line in (savedir / "progress.log").read_text().splitlines()]
    assert any("(100.0%)" in line for line in kept), kept[-5:]


def test_moolib_plot_on_a_closed_stdout_ends_quietly(tmp_path):
    """``moolib-plot DIR --list | head -3``, its reader gone before it writes."""
    (tmp_path / "logs.tsv").write_text("step\tmean_episode_return\tepisodes\n10\t1.5\t2\n")
    read, write = os.pipe()
    os.close(read)
    try:
        r = subprocess.run(
            plot_cmd(str(tmp_path), "--list"),
            env=run_env(),
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr


@pytest.mark.timeout(600)
def test_ctrl_c_prints_a_summary_of_where_the_run_stopped(tmp_path):
    savedir = tmp_path / "stopped"
    r = Run([*CARTPOLE, "total_steps=100000000", f"savedir={savedir}"], tmp_path, tmp_path / "o")
    try:

        def learned():
            _, rows = read_logs(savedir / "logs.tsv")
            return any(row["step"] > 0 for row in rows)

        wait_for(learned, timeout=240, what="the run to learn", proc=r)
        r.interrupt()
        r.wait(120)
        out = r.output()
    finally:
        r.finish()
    assert "Traceback" not in out, out[-3000:]
    _, rows = read_logs(savedir / "logs.tsv")
    steps = int(rows[-1]["step"])
    assert re.search(
        rf"^moolib-run: stopped: {steps:,} of 100,000,000 steps in \d+:\d\d; ", out, re.M
    ), out[-3000:]
    assert summary_plot_command(out)[1] == "stopped"


def test_help_says_what_moolib_run_is_and_what_to_pick(tmp_path):
    r = run_quick(tmp_path, "--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("moolib-run trains an RL agent with moolib"), out[:500]
    assert "Examples:\n  moolib-run agent=vtrace env=breakout\n" in out
    groups = {}
    for group in ("agent", "env", "scaling"):
        m = re.search(rf"^  {group} +(.+(?:\n {{11}}.+)*)", out, re.M)
        assert m, out
        groups[group] = re.sub(r"\s*\n\s*", " ", m.group(1)).strip()
    # The env group's Atari games (one per ROM of ale-py) are summed up, not listed;
    # the five MinAtar games and the MuJoCo tasks are listed.
    env, games = groups["env"].split(", or any of ")
    games, minatar = games.split(", or the MinAtar games ")
    minatar, mujoco = minatar.split(", or the MuJoCo tasks ")
    groups["env"] = env
    assert re.fullmatch(r"\d+ Atari games \(\[breakout\], pong, \.\.\.; .+\)", games), games
    assert re.split(r",\s*", minatar) == [f"minatar-{g}" for g in MINATAR_GAMES], minatar
    assert re.split(r",\s*", mujoco) == [f"mujoco-{g}" for g in MUJOCO_GAMES], mujoco
    assert int(games.split()[0]) > 50, games
    for group, options in groups.items():
        shipped = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
        listed = re.split(r",\s*", options)
        assert sorted(o.strip("[]") for o in listed) == shipped, (group, options)
    assert "[vtrace]" in groups["agent"]
    assert "[single]" in groups["scaling"]
    # Only what a user picks: not the tuning files, nor Hydra's own groups.
    assert "tuning" not in out and "hydra/" not in out and "a2c_cartpole" not in out
    # Hydra's options follow.
    assert "--multirun,-m" in out and "--cfg,-c" in out
    assert out.index("Examples:") < out.index("--multirun")

    r = run_quick(tmp_path, "agent=a2c", "env=cartpole", "--help")
    assert r.returncode == 0, r.stderr
    assert re.search(r"^  agent +\[a2c\], apex, ppo, r2d2, vtrace$", r.stdout, re.M), r.stdout
    assert "[cartpole]" in r.stdout and "[breakout]" not in r.stdout
    r = run_quick(tmp_path, "env=minatar-seaquest", "--help")
    assert r.returncode == 0, r.stderr
    assert "[minatar-seaquest]" in r.stdout and "[breakout]" not in r.stdout
