"""Runs on this machine: a broker and the run's processes (``scaling=local``), or its one
peer in this process (``scaling=single``)."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import moolib
from moolib import _signals

from .peer import train

if TYPE_CHECKING:
    from moolib.conf.schema.run_config import RunConfig


class EmbeddedBroker:
    """A broker served from this process (a thread keeps it updated)."""

    def __init__(self, address: str = "127.0.0.1:0") -> None:
        self.broker = moolib.Broker()
        self.address = self.broker.listen(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="moolib-broker", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.wait(0.1):
            self.broker.update()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.broker.close()


def run_single(cfg: RunConfig, stop: threading.Event) -> None:
    """``scaling=single``: the run's one peer (an off-policy run's learner, with its actors
    as threads) in this process, beside a broker of its own unless ``cfg.broker`` names
    one. What the point opened (Rpcs, groups, the broker, env workers) is closed when it
    returns: a sweep runs its next point in this same process."""
    broker = None if cfg.broker else EmbeddedBroker()
    try:
        train(cfg, 0, cfg.broker or broker.address, stop)
    finally:
        if broker:
            broker.close()


def check_broker(address: str, timeout: float, auth_key: str | None = None) -> None:
    """Returns once the broker at ``address`` answers (an Rpc connects and a probe
    group joins through it); raises TimeoutError after ``timeout`` seconds.
    ``auth_key`` overrides the process's key (``MOOLIB_AUTH_KEY``)."""
    rpc = moolib.Rpc()
    if auth_key is not None:
        rpc.set_auth_key(auth_key)
    try:
        rpc.connect(address)
        group = moolib.Group(rpc, f"moolib-run-probe/{secrets.token_hex(4)}")
        group.set_timeout(5)
        deadline = time.monotonic() + timeout
        while not group.active():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the broker at {address} did not answer in {timeout:.0f} s")
            group.update()
            time.sleep(0.05)
    finally:
        rpc.close()


def stop_processes(procs: list[subprocess.Popen], interrupted: bool) -> None:
    """Stops a run's processes: SIGTERM, and up to 60 s to checkpoint and end; after a
    Ctrl-C, SIGINT (a stopping peer then raises KeyboardInterrupt) and 5 s. Whatever still
    runs after that is killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT if interrupted else signal.SIGTERM)
    deadline = time.monotonic() + (5 if interrupted else 60)
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def peer_prefix(prefix: str, rank: int) -> list[str]:
    """The words put before peer ``rank``'s command (``scaling.peer_prefix``, its
    ``{rank}`` replaced by the rank), e.g. ``ip netns exec ns1`` or ``taskset -c 1``."""
    return [word.replace("{rank}", str(rank)) for word in shlex.split(prefix)]


def _peer_cmd(
    config_path: Path, rank: int, address: str, parent_r: int, prefix: str = ""
) -> list[str]:
    return [
        *peer_prefix(prefix, rank),
        sys.executable,
        "-m",
        "moolib.launch.peer",
        "--config",
        str(config_path),
        "--rank",
        str(rank),
        "--broker",
        address,
        "--parent-fd",
        str(parent_r),
    ]


def _start_peer(
    config_path: Path, rank: int, address: str, parent_r: int, out: Any = None, prefix: str = ""
) -> subprocess.Popen:
    """Peer ``rank``'s process (behind ``prefix``: ``scaling.peer_prefix``), its output
    into ``out`` (a file) or on this terminal; started with the stop signals blocked, so
    that one that comes before its handler is in place waits for it."""
    with _signals.blocked():
        return subprocess.Popen(
            _peer_cmd(config_path, rank, address, parent_r, prefix),
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            pass_fds=(parent_r,),
        )


def final_checkpoint_line(savedir: Path, peer_logs: dict[Path, int]) -> str | None:
    """The line in which a peer that logs to a file (``peer_logs``: each file and where
    this run's output in it starts) said that it wrote the savedir's checkpoint as it is
    now: the final one, which the leader writes and which peer 0's terminal, when peer 0
    did not lead, only says it did not write. None when none of them wrote it."""
    from moolib.agents.runtime import checkpoint

    try:
        step = checkpoint.verify(savedir / checkpoint.LATEST)["steps"]
    except (OSError, checkpoint.CheckpointError):
        return None
    said = f"] checkpoint at step {step}: "
    for path, start in peer_logs.items():
        try:
            with open(path, "rb") as f:
                f.seek(start)
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        lines = [line for line in text.splitlines() if said in line]
        if lines:
            return lines[-1]
    return None


# A peer that crashes sooner than this after its start would crash again (a bad
# setting, an import error): it is not started again.
MIN_RUN_BEFORE_RESTART = 30.0


def restart_verdict(code: int, ran_for: float) -> str:
    """What the local launcher does about a peer that ended with ``code`` after
    ``ran_for`` seconds while others run, as the line it prints ("" for nothing).
    Killed by a signal (kill -9, the OOM killer), or crashed (exit 1, e.g. one of
    its env workers died) after running a while: it is started again, and rejoins
    the group, which hands it the leader's model. A peer that ended by itself
    (done, its group lost, another experiment's model) is left alone."""
    if code < 0:
        return f"was killed by signal {-code}; starting it again"
    if code != 1:
        return ""
    if ran_for < MIN_RUN_BEFORE_RESTART:
        return (
            f"exited with code 1 {ran_for:.0f} s after its start; not starting it again "
            "(it would fail again: see its log)"
        )
    return "exited with code 1; starting it again"


def _verdict(policy: str, code: int, ran_for: float) -> str:
    """``restart_verdict`` for a process of a group that restarts as ``policy`` says
    (``ProcessGroup.restart``)."""
    if policy == "crashed":
        return restart_verdict(code, ran_for)
    if policy == "failed" and code != 0:
        return f"exited with code {code}; starting it again"
    return ""


def run(cfg: RunConfig, config_path: Path, stop: threading.Event) -> int:
    """Starts the run's processes as its runtime lays them out (``process_groups``) and
    a broker unless ``cfg.broker`` names one; waits for them. One that ends while the
    run goes on is started again as its group says (a crashed peer rejoins the group,
    which hands it the leader's model; a failed actor rejoins its learner). ``stop``
    (Ctrl-C/SIGTERM) is passed on to every process. The run ends with the processes
    of a group that ends it (the learner), else with all. Returns 0 when those
    finished cleanly."""
    from moolib.agents.registry import runtime_of

    runtime = runtime_of(cfg)
    groups = runtime.process_groups(cfg)
    group_of = {rank: g for g in groups for rank in g.ranks}
    enders = [rank for rank, g in group_of.items() if g.ends_run] or list(group_of)
    broker = None if cfg.broker else EmbeddedBroker()
    address = cfg.broker or broker.address
    savedir = Path(cfg.savedir)
    procs: dict[int, subprocess.Popen] = {}
    # Each process holds the read end of this pipe and stops when it closes: when
    # this process ends, however (kill -9 included), none acts on alone.
    parent_r, parent_w = os.pipe()
    interrupted = False
    # Where each process logging to a file (not this terminal) starts writing in it.
    peer_logs: dict[Path, int] = {}

    def start(rank: int) -> subprocess.Popen:
        logdir = runtime.logdir(savedir, rank, cfg)
        logdir.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            # Rank 0 draws the progress line here; the others log to files.
            return _start_peer(config_path, rank, address, parent_r, None, prefix)
        with open(logdir / "stdout.log", "ab") as out:
            peer_logs.setdefault(logdir / "stdout.log", out.tell())
            return _start_peer(config_path, rank, address, parent_r, out, prefix)

    def ended() -> bool:
        return all(procs[rank].poll() is not None for rank in enders)

    prefix = cfg.scaling.peer_prefix
    started: dict[int, float] = {}
    settled: set[int] = set()  # ended, and not to be started again
    try:
        for rank in group_of:
            procs[rank] = start(rank)
            started[rank] = time.monotonic()
        signalled = False
        while not ended():
            if stop.is_set() and not signalled:
                for p in procs.values():
                    if p.poll() is None:
                        p.send_signal(signal.SIGTERM)
                signalled = True
            if not signalled:
                for rank, p in procs.items():
                    code = p.poll()
                    if code is None or rank in settled:
                        continue
                    ran_for = time.monotonic() - started[rank]
                    verdict = _verdict(group_of[rank].restart, code, ran_for)
                    if verdict:
                        who = runtime.role(cfg, rank)
                        print(f"moolib-run: {who} {verdict}", file=sys.stderr, flush=True)
                    if verdict.endswith("starting it again"):
                        procs[rank] = start(rank)
                        started[rank] = time.monotonic()
                    else:
                        settled.add(rank)
            time.sleep(0.1)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        os.close(parent_r)
        stop_processes(list(procs.values()), interrupted)
        if broker:
            broker.close()
        os.close(parent_w)
    line = final_checkpoint_line(savedir, peer_logs)
    if line:
        print(line, flush=True)
    failed = [(rank, procs[rank].returncode) for rank in enders if procs[rank].returncode]
    for rank, code in failed:
        print(f"moolib-run: {runtime.role(cfg, rank)} exited with code {code}", file=sys.stderr)
    return 1 if failed else 0
