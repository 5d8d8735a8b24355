"""A chaos soak of moolib-run: N local peers, one fault every 20 to 40 s, then checks.

    python bench/chaos.py [--agent a2c --env cartpole] [--peers 8] [--duration 600]
        [--seed 1] [--settle 300] [--baseline-steps N | --baseline] [--out DIR]

Runs ``moolib-run scaling=local`` with every peer in a network namespace of its own
(``scaling.peer_prefix="ip netns exec mchaos{rank}"``; bridge ``mchbr0``, subnet
10.215.0.0/16) and the broker as a process of its own (``python -m moolib.broker``,
passed as ``broker=``), so that each can be hurt alone. For ``--duration`` seconds,
every ``--min-interval`` to ``--max-interval`` seconds (seeded by ``--seed``), one fault:

- ``kill_peer``: kill -9 of a peer (the launcher starts it again);
- ``kill_worker``: kill -9 of one env worker of a peer;
- ``kill_broker``: kill -9 of the broker, started again ``BROKER_DOWN`` s later;
- ``stop_peer``: SIGSTOP of a peer for 5 to 30 s, then SIGCONT;
- ``partition``: a peer's veth (its namespace's side) down for 10 s.

The kinds come in rounds, each kind once per round in a seeded order. Then the faults
stop, the run goes on for ``--settle`` seconds, is stopped cleanly (SIGTERM), and the
script checks and prints a report (also ``<out>/report.json``):

- ``training``: the group's steps grew in every 60-s window in which the broker was up;
- ``versions``: no peer's model version went back while in its group, and every
  logged model version has one ``param_sum`` and one step count on all peers (a peer
  that stepped from another model than the group's would log another);
- ``checkpoints``: every checkpoint written (polled each second) loads and has more
  steps (or as many at a higher version) than the one before;
- ``solved``: with a baseline (``--baseline`` runs one without faults first, or
  ``--baseline-steps``), the group's mean return reached ``--target`` within
  ``--solve-factor`` times the baseline's steps;
- ``whole``: within 60 s of the last fault every peer logs a full group;
- ``resources``: the living processes, their descriptors, threads and shared-memory
  segments (memfds and /dev/shm files they map or hold) are back to what they were
  before the first fault, and no /dev/shm file that one of the run's processes held
  (seen every 5 s) is left with no living holder; RSS over the settle window is flat;
- ``lost_steps``: env steps acted, offered as gradients and applied, summed over every
  peer process that ever ran (``env_steps``/``offered_steps`` of logs.tsv): what was not
  applied is counted, with a bound on what killed peers did after their last row.

Exit status 0 when every check that ran passed. Needs root (ip netns).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
# Loaded by path: bench/ on sys.path would hide the envpool library behind bench/envpool.py.
_procs = runpy.run_path(os.path.join(_HERE, "procs.py"))
descendants, proc_stats = _procs["descendants"], _procs["proc_stats"]
shared_segments = _procs["shared_segments"]

REPO = Path(__file__).resolve().parent.parent
NS_PREFIX = "mchaos"
BRIDGE = "mchbr0"
SUBNET = "10.215"
BROKER_IP = f"{SUBNET}.0.1"
BROKER_DOWN = 3.0  # seconds the broker stays dead before it is started again
PARTITION = 10.0
KINDS = ("kill_peer", "kill_worker", "kill_broker", "stop_peer", "partition")
WINDOW = 60.0  # the training check's window
WHOLE_WITHIN = 60.0


# -- namespaces --------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def veth(rank: int) -> tuple[str, str]:
    """The (bridge side, namespace side) interface names of peer ``rank``."""
    return f"mchv{rank}h", f"mchv{rank}n"


def teardown_network(peers: int = 64) -> None:
    """Removes every namespace, veth and the bridge this script makes (also leftovers)."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        if name.startswith(NS_PREFIX):
            _ip("netns", "del", name, check=False)
    for rank in range(peers):
        _ip("link", "del", veth(rank)[0], check=False)
    _ip("link", "del", BRIDGE, check=False)


def setup_network(peers: int) -> None:
    """A bridge with the broker's address and, per peer, a namespace joined to it by a veth."""
    teardown_network(max(peers, 64))
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{BROKER_IP}/16", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for rank in range(peers):
        ns, (host_if, ns_if) = f"{NS_PREFIX}{rank}", veth(rank)
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("link", "set", host_if, "master", BRIDGE)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.1.{rank + 1}/16", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def set_link(rank: int, up: bool) -> None:
    """Peer ``rank``'s veth, its namespace's side, up or down (a partition)."""
    _ip("-n", f"{NS_PREFIX}{rank}", "link", "set", veth(rank)[1], "up" if up else "down")


# -- processes (from /proc) --------------------------------------------------


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def peer_pids(run_pid: int) -> dict[int, int]:
    """The living peers of the moolib-run ``run_pid``, by rank."""
    peers = {}
    for pid in descendants(run_pid):
        args = cmdline(pid)
        if "moolib.launch.peer" in args and "--rank" in args:
            peers[int(args[args.index("--rank") + 1])] = pid
    return peers


# -- logs --------------------------------------------------------------------


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a logs.tsv, numbers as floats (empty cells: NaN)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f, delimiter="\t"))
    except OSError:
        return []
    out = []
    for row in rows:
        parsed = {}
        for k, v in row.items():
            try:
                parsed[k] = float(v) if v not in ("", None) else math.nan
            except ValueError:
                parsed[k] = v
        out.append(parsed)
    return out


def incarnations(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """A peer's rows split by process: a restarted peer's counters start again at 0."""
    runs: list[list[dict[str, Any]]] = []
    for row in rows:
        if (
            not runs
            or row["env_steps"] < runs[-1][-1]["env_steps"]
            or row["offered_steps"] < runs[-1][-1]["offered_steps"]
        ):
            runs.append([])
        runs[-1].append(row)
    return runs


# -- the soak ------------------------------------------------------------------


@dataclass
class Soak:
    """One moolib-run under faults, and what was seen of it."""

    args: argparse.Namespace
    savedir: Path
    faults: bool
    events: list[dict[str, Any]] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    checkpoint_errors: list[str] = field(default_factory=list)
    broker_up: list[list[float]] = field(default_factory=list)  # [start, end] intervals
    run: subprocess.Popen | None = None
    broker: subprocess.Popen | None = None
    port: int = 0
    t0: float = 0.0
    stop_monitor: threading.Event = field(default_factory=threading.Event)
    stopped: set[int] = field(default_factory=set)
    cut: set[int] = field(default_factory=set)
    faults_done: list[str] = field(default_factory=list)
    dev_shm_seen: set[str] = field(default_factory=set)  # /dev/shm files the run held

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, kind: str, **what: Any) -> None:
        entry = {"t": round(self.now(), 1), "kind": kind, **what}
        self.events.append(entry)
        print(f"[chaos {entry['t']:7.1f}s] {kind} {what}", flush=True)

    # broker
    def start_broker(self) -> None:
        log = open(self.savedir.parent / "broker.log", "ab")  # noqa: SIM115 - lives with it
        self.broker = subprocess.Popen(
            [sys.executable, "-m", "moolib.broker", f"{BROKER_IP}:{self.port}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.broker_up.append([self.now(), math.inf])

    def kill_broker(self) -> None:
        assert self.broker is not None
        self.broker.kill()
        self.broker.wait()
        self.broker_up[-1][1] = self.now()
        self.event("kill_broker", pid=self.broker.pid, down_s=BROKER_DOWN)
        time.sleep(BROKER_DOWN)
        self.start_broker()
        self.event("broker_started", pid=self.broker.pid)

    # the run
    def start_run(self) -> None:
        a = self.args
        cmd = [
            sys.executable,
            "-m",
            "moolib.launch.run",
            f"agent={a.agent}",
            f"env={a.env}",
            "scaling=local",
            f"scaling.peers={a.peers}",
            f"scaling.peer_prefix='ip netns exec {NS_PREFIX}{{rank}}'",
            f"broker={BROKER_IP}:{self.port}",
            f"savedir={self.savedir}",
            f"seed={a.seed}",
            "device=cpu",
            "total_steps=1_000_000_000",
            f"log_interval={a.log_interval}",
            f"checkpoint_interval={a.checkpoint_interval}",
            f"group_timeout={a.group_timeout}",
            "torch_threads=1",
            "agent.num_actor_cpus=1",
            *a.override,
        ]
        self.event("start_run", command=" ".join(cmd[2:]))
        log = open(self.savedir.parent / "moolib-run.log", "ab")  # noqa: SIM115
        self.run = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO
        )
        log.close()

    def living(self) -> dict[str, Any]:
        """The run's processes now: the launcher, peers by rank, their env workers."""
        assert self.run is not None
        peers = peer_pids(self.run.pid)
        workers = {r: descendants(p) for r, p in peers.items()}
        return {"run": self.run.pid, "peers": peers, "workers": workers}

    def pids(self, live: dict[str, Any] | None = None) -> list[int]:
        """Every living process of the run (``living()``'s, or ``live``), the broker included."""
        live = live or self.living()
        pids = [live["run"], *live["peers"].values()]
        pids += [w for ws in live["workers"].values() for w in ws]
        return pids + ([self.broker.pid] if self.broker and self.broker.poll() is None else [])

    def note_dev_shm(self, live: dict[str, Any]) -> None:
        """Remembers the /dev/shm files the run's processes hold now (moolib's own shared
        memory is memfds, gone with their last holder; a library below may use files)."""
        for pid in self.pids(live):
            self.dev_shm_seen |= {
                name for name, _ in shared_segments(pid) if name.startswith("/dev/shm/")
            }

    def orphaned_dev_shm(self) -> list[str]:
        """/dev/shm files the run's processes held that still exist with no living holder."""
        held = {name for pid in self.pids() for name, _ in shared_segments(pid)}
        return sorted(n for n in self.dev_shm_seen - held if os.path.exists(n))

    def wait_for_group(self, timeout: float) -> float:
        """Seconds until every peer logged a full group; raises TimeoutError."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.group_whole(since=-math.inf):
                return time.monotonic() - start
            if self.run is not None and self.run.poll() is not None:
                raise RuntimeError(f"moolib-run exited with {self.run.returncode}")
            time.sleep(1)
        raise TimeoutError(f"the group of {self.args.peers} did not form in {timeout:.0f} s")

    def group_whole(self, since: float) -> bool:
        """Every peer's newest row, logged after ``since`` (seconds of this soak), shows
        a full, connected group."""
        for rank in range(self.args.peers):
            seen = self.last_rows.get(rank)
            if not seen or seen[0] < since or seen[1].get("peers") != self.args.peers:
                return False
        return True

    # monitoring
    last_rows: dict[int, tuple[float, dict]] = field(default_factory=dict)

    def monitor(self) -> None:
        """Every second: new log rows (stamped with this soak's clock), the checkpoint;
        every 5 s: the processes' RSS, descriptors and threads."""
        from moolib.agents.runtime import checkpoint

        seen_rows: dict[int, int] = {}
        ckpt_stat: tuple | None = None
        tick = 0
        while not self.stop_monitor.wait(1.0):
            tick += 1
            now = self.now()
            step = 0.0
            for rank in range(self.args.peers):
                rows = read_rows(self.savedir / f"peer{rank}" / "logs.tsv")
                if len(rows) > seen_rows.get(rank, 0):
                    seen_rows[rank] = len(rows)
                    self.last_rows[rank] = (now, rows[-1])
                if rows:
                    step = max(step, max(r["step"] for r in rows))
            latest = self.savedir / checkpoint.LATEST
            try:
                st = latest.stat()
                key = (st.st_ino, st.st_mtime_ns, st.st_size)
            except OSError:
                key = None
            if key is not None and key != ckpt_stat:
                ckpt_stat = key
                try:
                    state = checkpoint.load(latest)
                    self.checkpoints.append(
                        {
                            "t": round(now, 1),
                            "steps": int(state["steps"]),
                            "model_version": int(state["model_version"]),
                            "param_sum": float(state["param_sum"]),
                        }
                    )
                except (OSError, checkpoint.CheckpointError) as e:
                    self.checkpoint_errors.append(f"{now:.1f}s: {e}")
            sample: dict[str, Any] = {"t": round(now, 1), "step": step}
            if tick % 5 == 0 and self.run is not None and self.run.poll() is None:
                live = self.living()
                procs = {"run": proc_stats(live["run"])}
                for r, pid in live["peers"].items():
                    procs[f"peer{r}"] = proc_stats(pid)
                    for i, w in enumerate(live["workers"][r]):
                        procs[f"peer{r}.worker{i}"] = proc_stats(w)
                if self.broker is not None:
                    procs["broker"] = proc_stats(self.broker.pid)
                sample["procs"] = {k: v for k, v in procs.items() if v}
                self.note_dev_shm(live)
            self.samples.append(sample)

    # faults
    def inject(self, kind: str, rng: random.Random) -> None:
        live = self.living()
        ranks = sorted(r for r in live["peers"] if r not in self.stopped | self.cut)
        if kind == "kill_broker":
            self.kill_broker()
            return
        if not ranks:
            self.event("skipped", fault=kind, why="no peer to hurt")
            return
        rank = rng.choice(ranks)
        pid = live["peers"][rank]
        if kind == "kill_peer":
            os.kill(pid, signal.SIGKILL)
            self.event(kind, rank=rank, pid=pid, last_row=self.last_rows.get(rank, (0, {}))[1])
        elif kind == "kill_worker":
            workers = live["workers"][rank]
            if not workers:
                self.event("skipped", fault=kind, rank=rank, why="no env worker")
                return
            w = rng.choice(workers)
            os.kill(w, signal.SIGKILL)
            self.event(kind, rank=rank, pid=w)
        elif kind == "stop_peer":
            seconds = rng.uniform(5, 30)
            os.kill(pid, signal.SIGSTOP)
            self.stopped.add(rank)
            self.event(kind, rank=rank, pid=pid, seconds=round(seconds, 1))

            def resume() -> None:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                self.stopped.discard(rank)
                self.event("cont_peer", rank=rank, pid=pid)

            threading.Timer(seconds, resume).start()
        elif kind == "partition":
            set_link(rank, up=False)
            self.cut.add(rank)
            self.event(kind, rank=rank, seconds=PARTITION)

            def heal() -> None:
                set_link(rank, up=True)
                self.cut.discard(rank)
                self.event("heal", rank=rank)

            threading.Timer(PARTITION, heal).start()

    def heal_all(self) -> None:
        """Ends every fault still in effect (also on errors)."""
        for rank in list(self.cut):
            set_link(rank, up=True)
        self.cut.clear()
        if self.run is not None:
            for pid in list(self.living()["peers"].values()):
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.stopped.clear()

    def stop_run(self) -> int | None:
        """Stops moolib-run cleanly (SIGTERM: the leader writes the final checkpoint);
        kills what is left after 120 s. Returns its exit status."""
        if self.run is None:
            return None
        if self.run.poll() is None:
            self.run.send_signal(signal.SIGTERM)
            try:
                self.run.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.run.pid, signal.SIGKILL)
                self.run.wait()
        return self.run.returncode

    def kill_everything(self) -> None:
        for proc in (self.run, self.broker):
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind((BROKER_IP, 0))
        return s.getsockname()[1]


def last_resources(soak: Soak) -> dict[str, Any]:
    """The newest sample with the processes' resources (taken every fifth sample)."""
    return next(s for s in reversed(soak.samples) if "procs" in s)


def run_soak(args: argparse.Namespace, out: Path, faults: bool) -> dict[str, Any]:
    """One run (with or without faults) and its report."""
    savedir = out / ("soak" if faults else "baseline") / "run"
    savedir.parent.mkdir(parents=True, exist_ok=True)
    soak = Soak(args, savedir, faults)
    rng = random.Random(args.seed)
    setup_network(args.peers)
    soak.t0 = time.monotonic()
    monitor = threading.Thread(target=soak.monitor, daemon=True)
    report: dict[str, Any] = {}
    try:
        soak.port = free_port()
        soak.start_broker()
        time.sleep(1)
        soak.start_run()
        monitor.start()
        formed = soak.wait_for_group(args.form_timeout)
        soak.event("group_formed", after_s=round(formed, 1))
        time.sleep(2 * args.log_interval + 5)  # a resource sample of the whole group
        before = last_resources(soak)
        faults_start = soak.now()
        kinds: list[str] = []
        end = faults_start + (args.duration if faults else 0)
        if faults:
            while True:
                wait = rng.uniform(args.min_interval, args.max_interval)
                if soak.now() + wait > end:
                    break
                time.sleep(wait)
                if soak.run.poll() is not None:
                    raise RuntimeError(f"moolib-run exited with {soak.run.returncode}")
                if args.max_faults is not None and len(soak.faults_done) >= args.max_faults:
                    break
                if not kinds:
                    kinds = list(KINDS)
                    rng.shuffle(kinds)
                soak.faults_done.append(kinds[0])
                soak.inject(kinds.pop(0), rng)
            time.sleep(max(0.0, end - soak.now()))
            # Faults still in effect end on their own timers; wait for them.
            while soak.stopped or soak.cut:
                time.sleep(0.5)
        else:
            # The baseline: until the target is reached (or --baseline-timeout).
            while soak.now() - faults_start < args.baseline_timeout:
                rows = [
                    row
                    for r in range(args.peers)
                    for row in read_rows(savedir / f"peer{r}" / "logs.tsv")
                ]
                if steps_to_target(rows, args.target, args.peers) is not None:
                    break
                time.sleep(5)
        faults_end = soak.now()
        soak.event("faults_stopped")
        whole_after = None
        settle = args.settle if faults else 0.0
        while soak.now() - faults_end < max(WHOLE_WITHIN, settle):
            if whole_after is None and soak.group_whole(since=faults_end):
                whole_after = soak.now() - faults_end
                soak.event("group_whole", after_s=round(whole_after, 1))
            if soak.now() - faults_end >= WHOLE_WITHIN and whole_after is None:
                break
            time.sleep(1)
        while soak.now() - faults_end < settle:
            time.sleep(1)
        after = last_resources(soak)
        shm_left = soak.orphaned_dev_shm()
        code = soak.stop_run()
        soak.event("run_stopped", exit=code)
        time.sleep(2)
        soak.stop_monitor.set()
        monitor.join()
        report = analyse(
            soak,
            faults_start=faults_start,
            faults_end=faults_end,
            whole_after=whole_after,
            before=before,
            after=after,
            shm_left=shm_left,
            exit_code=code,
        )
    finally:
        soak.stop_monitor.set()
        soak.heal_all()
        soak.kill_everything()
        teardown_network(args.peers)
    (savedir.parent / "events.json").write_text(json.dumps(soak.events, indent=1))
    (savedir.parent / "samples.json").write_text(json.dumps(soak.samples))
    return report


# -- checks ----------------------------------------------------------------------


def steps_to_target(rows: list[dict[str, Any]], target: float, window: int) -> float | None:
    """The group's step at which the mean return of the last ``window`` rows (all peers,
    in step order, rows that saw episodes) first reaches ``target``."""
    rows = sorted(
        (r for r in rows if r.get("episodes", 0) > 0 and not math.isnan(r["mean_episode_return"])),
        key=lambda r: r["step"],
    )
    for i in range(window - 1, len(rows)):
        returns = [r["mean_episode_return"] for r in rows[i - window + 1 : i + 1]]
        if sum(returns) / window >= target:
            return rows[i]["step"]
    return None


def analyse(soak: Soak, **seen: Any) -> dict[str, Any]:
    """The checks of the module docstring, from what the soak saw and the logs."""
    args = soak.args
    checks: dict[str, dict[str, Any]] = {}
    logs = {r: read_rows(soak.savedir / f"peer{r}" / "logs.tsv") for r in range(args.peers)}
    all_rows = [row for rows in logs.values() for row in rows]

    # Training went on in every 60-s window in which the broker was up.
    steps = [(s["t"], s["step"]) for s in soak.samples]
    stalls = []
    for start, stop in soak.broker_up:
        stop = min(stop, seen["faults_end"])
        t = max(start, seen["faults_start"])
        while t + WINDOW <= stop:
            inside = [st for ts, st in steps if t <= ts <= t + WINDOW]
            if not inside or inside[-1] <= inside[0]:
                stalls.append([round(t, 1), round(t + WINDOW, 1)])
            t += 5.0
    checks["training"] = {"ok": not stalls, "windows_without_steps": stalls[:10]}

    # Versions: never back on a peer in its group; one param_sum and step per version.
    # Compared at the 10 digits logs.tsv holds: rounding a checkpoint's exact sum and
    # a logged one to fewer digits could split one value in two.
    back = []
    by_version: dict[int, set] = {}
    steps_at: dict[int, set] = {}
    for rank, rows in logs.items():
        high = -1
        for row in rows:
            if not row.get("peers", 0) > 0:
                continue
            v = int(row["model_version"])
            if v < high:
                back.append({"rank": rank, "from": high, "to": v, "step": row["step"]})
            high = max(high, v)
            by_version.setdefault(v, set()).add(f"{row['param_sum']:.10g}")
            steps_at.setdefault(v, set()).add(row["step"])
    for c in soak.checkpoints:
        by_version.setdefault(c["model_version"], set()).add(f"{c['param_sum']:.10g}")
        steps_at.setdefault(c["model_version"], set()).add(c["steps"])
    forks = {v: sorted(p) for v, p in by_version.items() if len(p) > 1}
    step_forks = {v: sorted(s) for v, s in steps_at.items() if len(s) > 1}
    shared = sum(1 for v in by_version if len(by_version[v]) == 1 and len(steps_at[v]) == 1)
    checks["versions"] = {
        "ok": not back and not forks and not step_forks,
        "went_back": back[:10],
        "versions_with_two_models": dict(list(forks.items())[:10]),
        "versions_with_two_step_counts": dict(list(step_forks.items())[:10]),
        "versions_checked": len(by_version),
        "versions_agreeing": shared,
    }

    # Checkpoints: each loads, each further along than the one before.
    order = [(c["steps"], c["model_version"]) for c in soak.checkpoints]
    backwards = [[a, b] for a, b in zip(order, order[1:], strict=False) if b < a]
    checks["checkpoints"] = {
        "ok": bool(order) and not backwards and not soak.checkpoint_errors,
        "written": len(order),
        "first_last": [order[0], order[-1]] if order else None,
        "went_back": backwards,
        "failed_to_load": soak.checkpoint_errors,
    }

    # Solved: the mean return reached the target within the allowed steps.
    reached = steps_to_target(all_rows, args.target, args.peers)
    checks["solved"] = {"steps_to_target": reached, "target": args.target}
    if args.baseline_steps:
        bound = args.solve_factor * args.baseline_steps
        checks["solved"].update(
            ok=reached is not None and reached <= bound,
            baseline_steps=args.baseline_steps,
            bound=bound,
        )

    # Whole again within a minute; resources back to the living set; RSS flat.
    checks["whole"] = {
        "ok": seen["whole_after"] is not None and seen["whole_after"] <= WHOLE_WITHIN,
        "after_s": seen["whole_after"],
    }
    checks["resources"] = resources(soak, seen["before"], seen["after"], seen["shm_left"])

    # Lost steps: acted, offered and applied, over every peer process that ran.
    applied = max((c["steps"] for c in soak.checkpoints), default=0)
    acted = offered = 0.0
    tails = []
    processes = 0
    for rows in logs.values():
        runs = incarnations(rows)
        processes += len(runs)
        for i, run in enumerate(runs):
            acted += run[-1]["env_steps"]
            offered += run[-1]["offered_steps"]
            if i < len(runs) - 1:
                # Killed: what it did after its last row is not in its logs.
                tails.append(run[-1]["env_sps"] * args.log_interval)
    checks["lost_steps"] = {
        # A killed process's offers after its last row are not logged: at most its
        # last row's rate over one log interval each.
        "ok": offered + sum(tails) >= applied,
        "peer_processes": processes,
        "acted": int(acted),
        "offered": int(offered),
        "applied": int(applied),
        "offered_not_applied": int(offered - applied),
        "acted_not_offered": int(acted - offered),
        "killed_processes_unlogged_at_most": int(sum(tails)),
    }
    report = {
        "faults": [e for e in soak.events if e["kind"] in KINDS],
        "exit_code": seen["exit_code"],
        "checks": checks,
        "ok": all(c.get("ok", True) for c in checks.values()),
    }
    return report


def resources(
    soak: Soak, before: dict[str, Any], after: dict[str, Any], shm_left: list[str]
) -> dict[str, Any]:
    """Processes, descriptors, threads and shared-memory segments after the settle
    against before the faults; /dev/shm files the run's processes held that no living
    one holds; the RSS trend over the settle window."""
    b, a = before["procs"], after["procs"]
    problems = []
    if sorted(b) != sorted(a):
        problems.append(f"processes {sorted(b)} before, {sorted(a)} after")
    totals = {}
    for key in ("fds", "threads", "shm"):
        tb = sum(p[key] for p in b.values())
        ta = sum(p[key] for p in a.values())
        totals[key] = [tb, ta]
        # Spare loop workers linger 5 s and a peer's links come and go: a little slack.
        if ta > tb * 1.1 + 4 * len(b):
            problems.append(f"{key}: {tb} before, {ta} after")
    if shm_left:
        problems.append(f"/dev/shm files left by the run's processes: {shm_left[:10]}")
    # The baseline has no settle window (it stops at the target): its RSS is
    # still growing from the start then, and is not checked.
    window = soak.args.settle if soak.faults else 0.0
    settle = [
        s for s in soak.samples if "procs" in s and after["t"] - window <= s["t"] <= after["t"]
    ]
    rss = [(s["t"], sum(p["rss"] for p in s["procs"].values())) for s in settle]
    growth = 0.0
    if len(rss) >= 4:
        # Least-squares slope over the window, as a share of the mean RSS.
        n = len(rss)
        mt = sum(t for t, _ in rss) / n
        mr = sum(r for _, r in rss) / n
        slope = sum((t - mt) * (r - mr) for t, r in rss) / max(
            1e-9, sum((t - mt) ** 2 for t, _ in rss)
        )
        growth = slope * (rss[-1][0] - rss[0][0]) / mr
        if growth > 0.05:
            problems.append(f"RSS grew {100 * growth:.1f}% over the settle window")
    return {
        "ok": not problems,
        "problems": problems,
        "processes": [len(b), len(a)],
        "fds_threads_shm_before_after": totals,
        "rss_mib_first_last": [round(rss[0][1] / 2**20), round(rss[-1][1] / 2**20)]
        if rss
        else None,
        "rss_growth_over_settle": round(growth, 4),
    }


def print_report(report: dict[str, Any], title: str) -> None:
    print(f"\n== {title} ==")
    for fault in report.get("faults", []):
        what = {k: v for k, v in fault.items() if k not in ("t", "kind", "last_row")}
        print(f"  {fault['t']:7.1f}s  {fault['kind']:<12} {what}")
    for name, check in report.get("checks", {}).items():
        status = {True: "PASS", False: "FAIL", None: "info"}[check.get("ok")]
        detail = {k: v for k, v in check.items() if k != "ok"}
        print(f"  {status}  {name}: {json.dumps(detail)}")
    print(f"  moolib-run exit status: {report.get('exit_code')}")
    print(f"  overall: {'PASS' if report.get('ok') else 'FAIL'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Runs the soak (and the baseline, with ``--baseline``) and prints the report."""
    p = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", default="a2c")
    p.add_argument("--env", default="cartpole")
    p.add_argument("--peers", type=int, default=8)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    p.add_argument("--min-interval", type=float, default=20.0)
    p.add_argument("--max-interval", type=float, default=40.0)
    p.add_argument("--max-faults", type=int, default=None, help="stop after this many")
    p.add_argument("--settle", type=float, default=300.0, help="seconds after the faults")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-interval", type=float, default=2.0)
    p.add_argument("--checkpoint-interval", type=float, default=15.0)
    p.add_argument("--group-timeout", type=float, default=10.0)
    p.add_argument("--form-timeout", type=float, default=300.0)
    p.add_argument("--target", type=float, default=195.0, help="mean return to reach")
    p.add_argument("--solve-factor", type=float, default=2.0)
    p.add_argument("--baseline-steps", type=float, default=None)
    p.add_argument(
        "--baseline", action="store_true", help="first run without faults for the baseline"
    )
    p.add_argument("--baseline-timeout", type=float, default=1800.0)
    p.add_argument("--out", type=Path, default=Path("chaos-out"))
    p.add_argument("override", nargs="*", help="more moolib-run overrides (key=value)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("bench/chaos.py needs root (ip netns)", file=sys.stderr)
        return 2
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    # A SIGTERM ends the soak through the finally blocks (namespaces removed).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    reports = {}
    if args.baseline:
        base = run_soak(args, out, faults=False)
        reports["baseline"] = base
        print_report(base, "baseline (no faults)")
        args.baseline_steps = base["checks"]["solved"]["steps_to_target"]
    report = run_soak(args, out, faults=True)
    report["command"] = " ".join(["python", "bench/chaos.py", *(argv or sys.argv[1:])])
    report["seed"] = args.seed
    reports["soak"] = report
    (out / "report.json").write_text(json.dumps(reports, indent=1))
    print_report(report, f"chaos soak, seed {args.seed}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
