"""Checkpoints under trouble: a damaged checkpoint, a full disk, a leader that was paused
while the others went on. Nothing is lost and nothing happens silently.

Every check runs the real ``moolib-run`` (``python -m moolib.launch.run``) in its own
session with short A2C/CartPole runs.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import struct
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch
import yaml
from helpers.run_util import (
    QUICK,
    STOP_TIMEOUT,
    Run,
    check_ok,
    cmdline,
    read_logs,
    run,
    session_pids,
    snapshot,
    wait_for,
)
from helpers.util import freeze
from moolib.agents.runtime import checkpoint


def disk_steps(path: Path) -> int:
    # torch.load reads the payload and ignores the trailer: this reads checkpoints of
    # any version of moolib-run.
    return int(torch.load(path, map_location="cpu", weights_only=False)["steps"])


# -- damaged checkpoints -----------------------------------------------------------------


def flip_tensor_byte(path: Path) -> None:
    """Flips one bit in the middle of the largest tensor stored in the checkpoint."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    data[start + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(data))


def damage(path: Path, how: str) -> None:
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    else:
        flip_tensor_byte(path)


@pytest.mark.timeout(900)
def test_damaged_checkpoint_is_named_and_the_newest_intact_one_is_used(tmp_path):
    savedir = tmp_path / "run"
    check_ok(
        run([*QUICK, "total_steps=2000", "checkpoint_history=5", f"savedir={savedir}"], tmp_path)
    )
    check_ok(run([f"savedir={savedir}", "total_steps=4000"], tmp_path))
    latest = savedir / "checkpoint.pt"
    step = disk_steps(latest)
    newest = savedir / "checkpoints" / f"checkpoint_{step}.pt"
    older = sorted((savedir / "checkpoints").glob("checkpoint_*.pt"))
    assert newest in older and len(older) == 2, older
    pristine = {p: p.read_bytes() for p in [latest, *older]}

    def restore() -> None:
        for p in (savedir / "checkpoints").glob("checkpoint_*.pt"):
            p.unlink()
        for p, data in pristine.items():
            p.write_bytes(data)

    total = 6000
    for how in ("truncated", "empty", "flipped"):
        restore()
        damage(latest, how)
        out = check_ok(run([f"savedir={savedir}", f"total_steps={total}"], tmp_path))
        # One line names the damaged file and the fallback used, before training starts.
        warning = [line for line in out.splitlines() if line.startswith("moolib-run: warning:")]
        assert len(warning) == 1, out[-5000:]
        assert str(latest) in warning[0] and f"{newest} (step {step:,})" in warning[0], warning
        assert f"its checkpoint at step {step:,}" in out, out[-5000:]
        assert yaml.safe_load((savedir / "resumes.yaml").read_text())[-1]["step"] == step
        assert f"resumed from {newest} at step {step}" in out, out[-5000:]
        # Trained on from the fallback; the intact older checkpoint is as it was.
        assert checkpoint.verify(latest)["steps"] >= total
        assert newest.read_bytes() == pristine[newest], how
        total += 2000

    # Nothing intact: one line, exit 2, nothing written or overwritten.
    restore()
    for p in pristine:
        flip_tensor_byte(p)
    before = snapshot(savedir)
    r = run([f"savedir={savedir}", f"total_steps={total}"], tmp_path)
    out = r.stdout
    lines = [line for line in out.splitlines() if line.strip()]
    assert r.returncode == 2 and "Traceback" not in out, out[-5000:]
    assert len(lines) == 1 and lines[0].startswith("moolib-run: error: "), out[-5000:]
    assert "no intact checkpoint" in lines[0] and str(latest) in lines[0], lines
    assert snapshot(savedir) == before


@pytest.mark.timeout(600)
def test_a_savedir_whose_checkpoints_are_all_gone_is_refused(tmp_path):
    """Its logs went on from step 0 again, appended to the old ones: refused as a damaged
    one is, naming what is missing and how to start over."""
    savedir = tmp_path / "run"
    check_ok(run([*QUICK, "total_steps=2000", f"savedir={savedir}"], tmp_path))
    (savedir / "checkpoint.pt").unlink()
    for p in (savedir / "checkpoints").glob("*.pt"):
        p.unlink()
    logged = int(read_logs(savedir / "logs.tsv")[1][-1]["step"])
    before = snapshot(savedir)
    r = run([f"savedir={savedir}", "total_steps=4000"], tmp_path)
    lines = [line for line in r.stdout.splitlines() if line.strip()]
    assert r.returncode == 2 and "Traceback" not in r.stdout, r.stdout[-5000:]
    assert len(lines) == 1 and lines[0].startswith("moolib-run: error: "), r.stdout[-5000:]
    assert f"savedir={savedir} has no checkpoint" in lines[0], lines
    assert f"for the {logged:,} steps its logs.tsv logged" in lines[0], lines
    assert "give a new savedir, or delete" in lines[0], lines
    assert snapshot(savedir) == before


# -- a full disk ---------------------------------------------------------------------------


@pytest.fixture
def tiny_fs(tmp_path):
    """A 4 MiB tmpfs (needs root, as in the CI sandbox); unmounted at the end."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode(errors='replace').strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(folder: Path) -> Path:
    """Writes a file into ``folder`` until its filesystem is full."""
    filler = folder / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * 4096
        try:
            while True:
                f.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
    return filler


def progress_steps(text: str) -> list[int]:
    return [int(m.replace(",", "")) for m in re.findall(r"\[peer 0\] step ([\d,]+)/", text)]


@pytest.mark.timeout(900)
def test_full_disk_does_not_end_training(tmp_path, tiny_fs):
    savedir = tiny_fs / "run"
    latest = savedir / "checkpoint.pt"
    args = [*QUICK, "total_steps=1000000000", "checkpoint_interval=1", f"savedir={savedir}"]
    r = Run(args, tmp_path, tmp_path / "out.log")
    filler = None
    try:
        wait_for(lambda: "checkpoint at step" in r.output(), 240, "a first checkpoint", proc=r)
        mark = len(r.output())
        filler = fill(tiny_fs)
        failed = "could not be written to"
        wait_for(lambda: failed in r.output()[mark:], 120, "a failed checkpoint", proc=r)
        for name in ("logs.tsv", "progress.log"):
            # The last page of a log file takes a few more rows before a write fails.
            wait_for(
                lambda name=name: f"cannot write {savedir / name}" in r.output()[mark:],
                240,
                f"a failed write of {name}",
                proc=r,
            )
        # The previous checkpoint is intact; training goes on, many rows later.
        kept = checkpoint.verify(latest)["steps"]
        at = max(progress_steps(r.output()))
        lines_at = len(progress_steps(r.output()[mark:]))
        wait_for(
            lambda: (
                len(progress_steps(r.output()[mark:])) >= lines_at + 5
                and r.output()[mark:].count(failed) >= 2
            ),
            180,
            "training on a full disk",
            proc=r,
        )
        out = r.output()[mark:]
        assert max(progress_steps(out)) > at > kept, out[-5000:]
        assert "Traceback" not in out and "Logging error" not in out, out[-5000:]
        assert checkpoint.verify(latest)["steps"] == kept
        line = next(x for x in out.splitlines() if failed in x)
        assert f"{failed} {latest}: No space left on device" in line, line
        # Each log file's failure is reported once, not per row.
        for name in ("logs.tsv", "progress.log"):
            said = [x for x in out.splitlines() if f"cannot write {savedir / name}" in x]
            assert len(said) == 1, (name, out[-5000:])
        assert not [p for p in savedir.iterdir() if p.name.endswith(".tmp")]

        # Space again: the next interval writes a checkpoint.
        filler.unlink()
        filler = None
        mark = len(r.output())
        found = wait_for(
            lambda: re.search(r"checkpoint at step (\d+): ", r.output()[mark:]),
            120,
            "a checkpoint after space was freed",
            proc=r,
        )
        assert int(found.group(1)) > kept
        assert checkpoint.verify(latest)["steps"] >= int(found.group(1))
        code, out = r.ctrl_c(STOP_TIMEOUT)
    finally:
        if filler is not None:
            filler.unlink(missing_ok=True)
        r.finish()
    assert code == 130, out[-5000:]
    assert "Traceback" not in out, out[-5000:]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("agent", ["a2c", "apex"])
def test_a_final_checkpoint_that_cannot_be_written_fails_the_run(tmp_path, tiny_fs, agent):
    """The end-of-run checkpoint (here on Ctrl-C) on a full disk: the steps since the
    last checkpoint are lost, so the run says so and exits 1, not as if it ended well."""
    savedir = tiny_fs / "run"
    latest = savedir / "checkpoint.pt"
    args = [*QUICK, f"agent={agent}", "total_steps=1000000000", "checkpoint_interval=2"]
    r = Run([*args, f"savedir={savedir}"], tmp_path, tmp_path / "out.log")
    try:
        wait_for(lambda: "checkpoint at step" in r.output(), 240, "a first checkpoint", proc=r)
        fill(tiny_fs)
        kept = checkpoint.verify(latest)["steps"]
        code, out = r.ctrl_c(STOP_TIMEOUT)
    finally:
        r.finish()
    assert code == 1, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    error = next((x for x in out.splitlines() if x.startswith("moolib-run: error: ")), "")
    assert re.search(
        rf"the final checkpoint \(step [\d,]+\) could not be written to {latest}: No space "
        rf"left on device; the savedir's latest checkpoint is at step {kept:,}, where a "
        "resume would go on",
        error,
    ), out[-5000:]
    assert checkpoint.verify(latest)["steps"] == kept
    assert "moolib-run: ended with exit code 1" in out, out[-5000:]


# -- a paused leader -----------------------------------------------------------------------


def peer_pid(sid: int, rank: int) -> int:
    for pid in session_pids(sid):
        line = cmdline(pid)
        if "moolib.launch.peer" in line and f"--rank {rank} " in line:
            return pid
    raise AssertionError(f"no peer {rank} in session {sid}")


class StepWatcher(threading.Thread):
    """Reads the steps of ``checkpoint.pt`` every 50 ms while the test runs."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.seen: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                step = disk_steps(self.path)
            except Exception:  # noqa: BLE001 - not there yet
                step = None
            if step is not None and (not self.seen or self.seen[-1] != step):
                self.seen.append(step)
            time.sleep(0.05)


@pytest.mark.timeout(900)
def test_a_paused_leader_does_not_write_stale_state_on_waking(tmp_path):
    savedir = tmp_path / "run"
    latest = savedir / "checkpoint.pt"
    args = [
        *QUICK,
        "scaling=local",
        "scaling.peers=2",
        "total_steps=1000000000",
        "checkpoint_interval=1",
        "group_timeout=3",
        "lost_group_timeout=600",
        f"savedir={savedir}",
    ]
    r = Run(args, tmp_path, tmp_path / "out.log")
    outputs = {0: r.output, 1: lambda: (savedir / "peer1" / "stdout.log").read_text()}
    writes = re.compile(r"checkpoint at step (\d+): ")
    watcher = StepWatcher(latest)
    stopped = None
    try:
        wait_for(lambda: latest.exists(), 240, "a first checkpoint", proc=r)
        watcher.start()

        def leader() -> int | None:
            # The peer that wrote the newest checkpoint on disk.
            step = disk_steps(latest)
            for rank, out in outputs.items():
                if str(step) in writes.findall(out()):
                    return rank
            return None

        def leader_found() -> tuple[int] | None:
            # One read: the newest checkpoint may change between two.
            rank = leader()
            return None if rank is None else (rank,)

        rank = wait_for(leader_found, 60, "a leader")[0]
        other = 1 - rank
        stopped = peer_pid(r.pid, rank)
        freeze(stopped)
        paused_at = disk_steps(latest)
        marks = {k: len(out()) for k, out in outputs.items()}
        # The other peer leads on alone and checkpoints further.
        wait_for(
            lambda: any(
                int(s) > paused_at for s in writes.findall(outputs[other]()[marks[other] :])
            ),
            180,
            "the other peer to checkpoint on its own",
            proc=r,
        )
        time.sleep(4)  # a few more checkpoints; well past group_timeout
        ahead = disk_steps(latest)
        assert ahead > paused_at
        woke = len(outputs[rank]())
        os.kill(stopped, signal.SIGCONT)
        stopped = None
        time.sleep(10)  # several checkpoint intervals of the woken peer
        woken_out = outputs[rank]()[woke:]
        stale = [int(s) for s in writes.findall(woken_out) if int(s) < ahead]
        assert not stale, woken_out[-5000:]
        assert "skipped a stale checkpoint write" in woken_out or not writes.search(woken_out), (
            woken_out[-5000:]
        )

        # The end: exactly one peer writes the final checkpoint.
        marks = {k: len(out()) for k, out in outputs.items()}
        r.interrupt()
        code = r.wait(STOP_TIMEOUT)
        ends = {k: out()[marks[k] :] for k, out in outputs.items()}
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        watcher.done.set()
        r.finish()
    assert code == 130, r.output()[-5000:]
    seen = watcher.seen
    assert all(a <= b for a, b in zip(seen, seen[1:], strict=False)), seen
    final = checkpoint.verify(latest)["steps"]
    assert final >= max(seen)
    finals = [k for k, text in ends.items() if f"checkpoint at step {final}: " in text]
    assert finals, ends
    if len(finals) == 1:
        quiet = 1 - finals[0]
        # The other peer declined to write, or it led, wrote its last checkpoint and left
        # first, and the peer that stayed finished its step alone (steps moved on), led
        # the group it re-formed and wrote after it. Never a write past the final one.
        earlier = [int(s) for s in writes.findall(ends[quiet])]
        declined = "not writing a checkpoint" in ends[quiet] or "skipped a stale" in ends[quiet]
        assert declined or (earlier and max(earlier) < final), ends
    # Else the leader wrote its last checkpoint and left first, and the other peer, at
    # the same step, led the group it re-formed and wrote the same step again: nothing
    # stale either way (the watcher saw the steps on disk only go forward).


# -- the write rules, on files ---------------------------------------------------------------


def _state(steps: int, version: int) -> dict:
    model = {"w": torch.full((64,), float(steps))}
    return {"model": model, "steps": steps, "model_version": version}


def test_a_write_never_replaces_a_newer_checkpoint(tmp_path):
    checkpoint.save(tmp_path, _state(200, 20), 200, history=3)
    before = snapshot(tmp_path)
    for stale in (_state(100, 10), _state(200, 19)):
        with pytest.raises(checkpoint.StaleWriteError, match="further than"):
            checkpoint.save(tmp_path, stale, stale["steps"], history=3)
        assert snapshot(tmp_path) == before
    # Asked under the lock, right before the renames: a peer no longer leading writes nothing.
    with pytest.raises(checkpoint.NotAllowedError):
        checkpoint.save(tmp_path, _state(300, 30), 300, history=3, may_write=lambda: False)
    assert snapshot(tmp_path) == before
    checkpoint.save(tmp_path, _state(300, 30), 300, history=3)
    assert checkpoint.load(tmp_path / "checkpoint.pt")["steps"] == 300
    # History entries are files of their own: damage to the latest spoils no other.
    entry = tmp_path / "checkpoints" / "checkpoint_300.pt"
    assert os.stat(entry).st_ino != os.stat(tmp_path / "checkpoint.pt").st_ino
    flip_tensor_byte(tmp_path / "checkpoint.pt")
    with pytest.raises(checkpoint.CheckpointError, match="digest"):
        checkpoint.load(tmp_path / "checkpoint.pt")
    loaded = checkpoint.load_latest(tmp_path)
    assert loaded.path == entry and loaded.state["steps"] == 300 and loaded.skipped
    # A damaged latest is no reason to refuse a write: it is replaced.
    checkpoint.save(tmp_path, _state(250, 25), 250, history=3)
    assert checkpoint.load(tmp_path / "checkpoint.pt")["steps"] == 250


def test_a_checkpoint_of_an_older_moolib_still_resumes(tmp_path, caplog):
    """Written before checkpoints carried a digest: a plain torch.save file loads,
    with a warning; a truncated one is still refused."""
    torch.save(_state(100, 10), tmp_path / "checkpoint.pt")
    with caplog.at_level("WARNING", logger="moolib.agents"):
        loaded = checkpoint.load_latest(tmp_path)
    assert loaded.state["steps"] == 100 and not loaded.skipped
    assert "no digest (written by an older moolib)" in caplog.text
    data = (tmp_path / "checkpoint.pt").read_bytes()
    (tmp_path / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.load(tmp_path / "checkpoint.pt")
