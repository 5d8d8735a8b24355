"""Many peers: the group, all-reduce and the Accumulator at 8 to 64 peers.

Every peer is its own process. A peer imports numpy and moolib only (no torch)
for membership, all-reduce and the kill, so 64 of them fit; for the Accumulator
rows it imports torch (the Accumulator takes torch tensors), ~350 MiB of PSS a
peer, so those rows run up to --acc-max peers (16). Two layouts:

  shm    one host: peers, broker and this script share the network, moolib picks
         the transports (shared memory between the peers);
  netns  every peer, and the broker, in a network namespace of its own
         (``mscale<i>``, ``mscale-b``), joined by veth pairs to one Linux bridge
         (``mscbr0``, 10.214.0.0/16) in this namespace; both ends of every veth
         are rate-shaped with ``tc tbf`` (``--rate``), so peers reach each other
         over TCP as between hosts. Needs root. (This kernel has no netem: no
         latency is added.) The kernel's one ARP table, shared by every
         namespace, is made room for a full mesh while the run lasts.

For each N, beside a limit measured in the same run:

  join       time from "join" (sent to all at once) until every member sees all
             N, beside one lone member's join into a fresh group (the broker's
             join window plus a round trip);
  all-reduce 16 B, 1 MiB and 6 MiB of float32, the slowest member's time per
             all-reduce, median over blocks, beside the ring bound
             2(N-1)/N x size / B (B: a numpy copy's bandwidth for shm, a TCP
             stream through two shaped veths for netns) and the machine bound
             2(N-1) x size / (B x lanes), every member's traffic on this machine;
  acc        the group's optimizer steps per second through an Accumulator
             (virtual batch = N, one gradient per member per step; gradients are
             set, not computed) with a 2-parameter model and a 1.6M-parameter
             one, beside 1 / all-reduce time of 16 B and of 6 MiB;
  kill       members all-reduce a 1 every 10 ms; after kill -9 of one: the time
             until every survivor has done so without it, beside the group timeout;
  join-state a new peer (started beforehand, idle) joins: the time until it
             holds the leader's state (6.4 MB), and the part of it after the
             leader's set_state() call (serialize, send, the joiner's update()
             taking it; before the call: membership, election and the
             leader's loop), beside state size / B;
  costs      the broker's CPU (CPU seconds per second) while the group is idle
             and during the kill, each peer's RSS, descriptors and threads.

Usage: python bench/scale.py [--peers 8,16,32,64] [--layout shm,netns] [--quick]
       [--rate 10gbit] [--group-timeout 10] [--acc-max 16] [--json PATH]
A phase that fails (a deadline passed, an error on a member) is reported in its
cell and the run goes on with the next N: a failure is a finding.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import queue
import runpy
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))


# Loaded by path: bench/ on sys.path would hide the envpool library behind
# bench/envpool.py (in this process, or in a test that imports this file).
size_name = runpy.run_path(os.path.join(_HERE, "allreduce.py"))["size_name"]

NS_PREFIX = "mscale"
BROKER_NS = f"{NS_PREFIX}-b"
BRIDGE = "mscbr0"
BRIDGE_IP = "10.214.0.1"
BROKER_IP = "10.214.0.2"
PREFIX_LEN = 16
SIZES = (16, 1 << 20, 6 << 20)  # bytes of float32
BIG_MODEL = (1600, 1000)  # torch.nn.Linear(1600, 1000): 1,601,000 parameters
HZ = os.sysconf("SC_CLK_TCK")


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def peer_ip(i: int) -> str:
    return f"10.214.{1 + i // 250}.{1 + i % 250}"


# --- peer process ---------------------------------------------------------------


@dataclass
class Peer:
    """The state of one peer process between commands."""

    rank: int
    name: str
    timeout: float
    rpc: Any
    commands: queue.Queue
    group: Any = None

    def pump(self) -> None:
        if self.group is not None:
            self.group.update()

    def next_command(self) -> dict:
        while True:
            self.pump()
            try:
                return self.commands.get(timeout=0.02)
            except queue.Empty:
                pass

    def pending_stop(self) -> bool:
        try:
            cmd = self.commands.get_nowait()
        except queue.Empty:
            return False
        if cmd["op"] != "stop":
            raise RuntimeError(f"expected stop, got {cmd}")
        return True


def peer_join(peer: Peer, cmd: dict) -> dict:
    import moolib

    t0 = time.time()
    peer.group = moolib.Group(peer.rpc, cmd["group"])
    peer.group.set_timeout(peer.timeout)
    peer.group.set_sort_order(peer.rank)
    deadline = t0 + cmd["deadline_s"]
    while not (peer.group.active() and len(peer.group.members()) == cmd["members"]):
        if time.time() > deadline:
            return {"ev": "joined", "error": f"sees {len(peer.group.members())} members"}
        peer.group.update()
        time.sleep(0.005)
    return {"ev": "joined", "t": time.time(), "sync_id": peer.group.sync_id()}


def peer_reduce(peer: Peer, cmd: dict) -> dict:
    import numpy as np

    group, n = peer.group, cmd["members"]
    data = np.full(cmd["bytes"] // 4, peer.rank + 1, dtype=np.float32)
    expected = n * (n + 1) // 2  # ranks 0..n-1 give 1..n
    tiny = np.zeros(1, dtype=np.float32)

    def op(x: Any, name: str = "x") -> Any:
        group.update()
        # A first all-reduce of many members on few cores (the mesh forms inside
        # it) can take longer than the group timeout: waiting is not hanging.
        with group.keepalive():
            return group.all_reduce(name, x).result(timeout=cmd["deadline_s"])

    try:
        first = op(data)
        if first[0] != expected or first[-1] != expected:
            return {"ev": "reduced", "error": f"sum {first[0]} != {expected}"}
        per_op = []
        for _ in range(cmd["blocks"]):
            op(tiny, "barrier")
            t = time.perf_counter()
            for _ in range(cmd["k"]):
                op(data)
            per_op.append((time.perf_counter() - t) / cmd["k"])
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"ev": "reduced", "error": f"{type(e).__name__}: {e}"}
    return {"ev": "reduced", "per_op": per_op}


def peer_acc(peer: Peer, cmd: dict) -> dict:
    """Trains through an Accumulator until "stop": steps with their times and member counts."""
    import torch

    import moolib

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(*cmd["shape"])
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    group = moolib.Group(peer.rpc, cmd["group"])
    group.set_timeout(peer.timeout)
    group.set_sort_order(peer.rank)
    acc = moolib.Accumulator(cmd["group"], model.parameters(), model.buffers(), group=group)
    acc.set_virtual_batch_size(cmd["virtual_batch"])
    grads = [torch.full_like(p, 1e-3) for p in model.parameters()]
    t_ready = time.time()  # torch imported, model built: the join starts here
    steps: list[tuple[float, int]] = []
    t_state = t_connected = t_member = None
    offers: list[tuple[float, float]] = []  # set_state() calls: (called, returned)
    members = 0
    error = None
    try:
        while not peer.pending_stop():
            peer.pump()  # the light group stays, for the kill that comes after
            acc.update()
            count = len(group.members()) if group.active() else 0
            if count != members:
                members = count
                t_member = t_member or (time.time() if count else None)
                emit({"ev": "members", "n": count, "t": time.time()})
            if acc.wants_state():
                t_offer = time.time()
                acc.set_state({"model": model.state_dict()})
                offers.append((t_offer, time.time()))
            if acc.has_new_state():
                model.load_state_dict(acc.state()["model"])
                t_state = time.time()
            if not acc.connected():
                time.sleep(0.005)
                continue
            if t_connected is None:
                t_connected = time.time()
                emit(
                    {
                        "ev": "connected",
                        "t": t_connected,
                        "t_state": t_state,
                        "t_ready": t_ready,
                        "t_member": t_member,
                    }
                )
            if acc.has_gradients():
                opt.step()
                acc.zero_gradients()
                steps.append((time.time(), members))
                if len(steps) == 1 or steps[-2][1] != members:
                    emit({"ev": "step", "t": steps[-1][0], "n": members})
            elif acc.wants_gradients():
                for p, g in zip(model.parameters(), grads, strict=True):
                    p.grad = g
                acc.reduce_gradients(1)
            else:
                acc.wait_gradients(0.02)
    except Exception as e:  # noqa: BLE001 - reported in the table
        error = f"{type(e).__name__}: {e}"
        while not peer.pending_stop():
            time.sleep(0.05)
    acc.close()
    group.close()
    return {
        "ev": "acc_done",
        "t_ready": t_ready,
        "t_state": t_state,
        "t_connected": t_connected,
        "offers": offers,
        "steps": steps,
        "version": acc.model_version(),
        "error": error,
    }


def peer_steps(peer: Peer, cmd: dict) -> dict:
    """All-reduces of a 1 every 10 ms until "stop"; the sum says how many took part,
    announced whenever it changes."""
    import numpy as np

    one, last, errors = np.ones(1, dtype=np.float32), 0, 0
    while not peer.pending_stop():
        peer.group.update()
        try:
            with peer.group.keepalive():
                reduced = peer.group.all_reduce("step", one).result(timeout=cmd["deadline_s"])
            count = int(reduced[0])
        except Exception:  # noqa: BLE001 - a membership change: counted, then on
            errors += 1
            time.sleep(0.01)
            continue
        if count != last:
            last = count
            emit({"ev": "step", "t": time.time(), "n": count})
        time.sleep(0.01)
    return {"ev": "steps_done", "errors": errors}


def peer_warm(peer: Peer, cmd: dict) -> dict:
    """Imports torch ahead of a timed phase."""
    import torch

    return {"ev": "warm", "torch": torch.__version__}


def peer_main(rank: int, name: str, broker: str, host: str, timeout: float) -> None:
    faulthandler.dump_traceback_later(3600, exit=True)
    faulthandler.register(signal.SIGUSR1)  # kill -USR1: where a stuck peer is, in the log
    commands: queue.Queue = queue.Queue()

    def read_commands() -> None:  # EOF: the coordinator went away
        for line in sys.stdin:
            commands.put(json.loads(line))
        os._exit(3)

    threading.Thread(target=read_commands, daemon=True).start()
    import moolib

    rpc = moolib.Rpc()
    rpc.set_name(name)
    rpc.listen(f"{host}:0")
    rpc.connect(broker)
    peer = Peer(rank, name, timeout, rpc, commands)
    emit({"ev": "ready"})
    handlers = {
        "join": peer_join,
        "reduce": peer_reduce,
        "acc": peer_acc,
        "warm": peer_warm,
        "steps": peer_steps,
    }
    while True:
        cmd = peer.next_command()
        emit(handlers[cmd["op"]](peer, cmd))


def sink_main(host: str) -> None:
    """Accepts one stream, reads it to the end, answers one byte."""
    with socket.create_server((host, 0)) as server:
        emit({"port": server.getsockname()[1]})
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")


def stream_main(host: str, port: int, nbytes: int) -> None:
    """Sends nbytes to a sink; prints the seconds until the sink has read them all."""
    chunk = bytes(1 << 20)
    with socket.create_connection((host, port)) as s:
        t = time.perf_counter()
        for _ in range(nbytes >> 20):
            s.sendall(chunk)
        s.shutdown(socket.SHUT_WR)
        s.recv(1)
        emit({"seconds": time.perf_counter() - t})


# --- the network ---------------------------------------------------------------


def _run(cmd: list[str], stdin: str | None = None) -> str:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def remove_network() -> None:
    """Removes this benchmark's veths, namespaces and bridge.

    The veths first, by their ends in this namespace: a deleted namespace's
    devices go away later, in the kernel's own time, and would clash with the
    next run's names."""
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        dev = line.split(":")[1].strip().split("@")[0] if line.count(":") > 1 else ""
        if dev.startswith("mscv"):
            subprocess.run(["ip", "link", "del", dev], capture_output=True)
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in names.splitlines():
        ns = line.split()[0] if line.split() else ""
        if ns.startswith(NS_PREFIX):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def tbf_args(rate: str) -> list[str]:
    """tbf with a bucket of at least 1 ms at the rate (timer granularity) and 256 KiB
    (a TSO segment is up to 64 KiB and must fit)."""
    bits = parse_rate(rate)
    burst = max(bits // 8 // 1000, 256 << 10)
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "10ms"]


def parse_rate(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"--rate {rate!r}: give e.g. 10gbit, 1gbit or 500mbit")


def make_network(count: int, rate: str) -> dict:
    """Namespaces mscale0..count-1 and mscale-b, each a veth into bridge mscbr0, shaped."""
    remove_network()
    spaces = [(f"{NS_PREFIX}{i}", f"mscv{i}", peer_ip(i)) for i in range(count)]
    spaces.append((BROKER_NS, "mscvb", BROKER_IP))
    lines = [f"link add {BRIDGE} type bridge", f"addr add {BRIDGE_IP}/{PREFIX_LEN} dev {BRIDGE}"]
    lines.append(f"link set {BRIDGE} up")
    for ns, veth, _ in spaces:
        lines += [
            f"netns add {ns}",
            f"link add {veth}h type veth peer name {veth}n",
            f"link set {veth}n netns {ns}",
            f"link set {veth}h master {BRIDGE} up",
        ]
    _run(["ip", "-batch", "-"], "\n".join(lines) + "\n")
    tbf = tbf_args(rate)
    for ns, veth, ip in spaces:
        inner = [
            f"addr add {ip}/{PREFIX_LEN} dev {veth}n",
            f"link set {veth}n up",
            "link set lo up",
        ]
        _run(["ip", "-n", ns, "-batch", "-"], "\n".join(inner) + "\n")
        _run(["tc", "qdisc", "replace", "dev", f"{veth}h", "root", *tbf])
        _run(["tc", "-n", ns, "qdisc", "replace", "dev", f"{veth}n", "root", *tbf])
    return {"rate": rate, "qdisc": " ".join(tbf), "namespaces": len(spaces), "bridge": BRIDGE}


# --- the coordinator --------------------------------------------------------------


def proc_stats(pid: int) -> dict:
    """RSS (MiB), descriptors, threads and CPU seconds of a live process."""
    try:
        status = open(f"/proc/{pid}/status").read()  # noqa: SIM115 - read at once
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        return {
            "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "pss_mib": pss_kib(pid) / 1024,
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(fields["Threads"]),
            "cpu_s": (int(stat[11]) + int(stat[12])) / HZ,
        }
    except (OSError, KeyError):
        return {}


def pss_kib(pid: int) -> int:
    """Proportional set size: shared pages (libraries) divided among their users."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def peers_cpu(procs: list[Proc]) -> float:
    """CPU seconds the processes have used so far, all together."""
    return sum(proc_stats(p.proc.pid).get("cpu_s", 0.0) for p in procs)


def summary(stats: list[dict]) -> dict:
    """Median and max of each figure over processes."""
    out = {}
    for key in ("rss_mib", "pss_mib", "fds", "threads"):
        values = [s[key] for s in stats if key in s]
        if values:
            out[key] = {"median": statistics.median(values), "max": max(values)}
    return out


class Proc:
    """A child process talking JSON lines; its stderr goes to a log file."""

    def __init__(self, argv: list[str], log: Any, netns: str | None) -> None:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, os.path.abspath(__file__), *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
        )
        self.events: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))
        self.events.put({"ev": "exit"})

    def send(self, cmd: dict) -> None:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def wait_event(self, kind: str, deadline: float) -> dict | None:
        """The next event of this kind (others before it are dropped); None past the deadline."""
        while True:
            try:
                ev = self.events.get(timeout=max(0.0, deadline - time.time()))
            except queue.Empty:
                return None
            if ev.get("ev") in (kind, "exit"):
                return ev if ev.get("ev") == kind else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def collect(procs: list[Proc], kind: str, deadline: float) -> list[dict | None]:
    return [p.wait_event(kind, deadline) for p in procs]


@dataclass
class Layout:
    """Where the broker and peers run and which addresses they use."""

    name: str
    netns: bool

    def peer_ns(self, i: int) -> str | None:
        return f"{NS_PREFIX}{i}" if self.netns else None

    def peer_host(self, i: int) -> str:
        return peer_ip(i) if self.netns else "127.0.0.1"

    def broker_listen(self) -> str:
        return f"{BROKER_IP}:0" if self.netns else "127.0.0.1:0"


@dataclass
class Run:
    """One N on one layout: its processes, for cleanup."""

    procs: list[Proc] = field(default_factory=list)

    def stop(self) -> None:
        for p in self.procs:
            if p.proc.poll() is None:
                p.proc.kill()
        for p in self.procs:
            p.stop()


def start_broker(run: Run, layout: Layout, log: Any) -> tuple[Proc, str]:
    prefix = ["ip", "netns", "exec", BROKER_NS] if layout.netns else []
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "moolib.broker", layout.broker_listen()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    wrapper = Proc.__new__(Proc)
    wrapper.proc, wrapper.events = proc, queue.Queue()
    run.procs.append(wrapper)
    line = proc.stdout.readline()
    if "listening at" not in line:
        raise RuntimeError(f"the broker did not start: {line!r}")
    return wrapper, line.rsplit(" ", 1)[1].strip()


def solo_join(broker: str, timeout: float) -> float:
    """Seconds for a lone member to be active in a fresh group (the join floor)."""
    import moolib

    rpc = moolib.Rpc()
    try:
        rpc.connect(broker)
        group = moolib.Group(rpc, f"solo{time.monotonic_ns()}")
        group.set_timeout(timeout)
        t = time.time()
        while not group.active():
            if time.time() - t > 60:
                raise RuntimeError("a lone member did not join within 60 s")
            group.update()
            time.sleep(0.002)
        seconds = time.time() - t
        group.close()
        return seconds
    finally:
        rpc.close()


def copy_bandwidth() -> float:
    """Bytes/s of a 6 MiB numpy copy, median of 30 (the shm layout's B)."""
    import numpy as np

    a, b = np.ones(6 << 18, dtype=np.float32), np.empty(6 << 18, dtype=np.float32)
    times = []
    for _ in range(30):
        t = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t)
    return a.nbytes / statistics.median(times)


def link_bandwidth(nbytes: int, log: Any) -> float:
    """Bytes/s of one TCP stream from mscale0 to mscale1 through the shaped veths and
    the bridge, median of 3."""
    rates = []
    for _ in range(3):
        sink = Proc(["--sink", peer_ip(1)], log, f"{NS_PREFIX}1")
        try:
            port = sink.events.get(timeout=60)["port"]
            sender = Proc(["--stream", peer_ip(1), str(port), str(nbytes)], log, f"{NS_PREFIX}0")
            result = sender.events.get(timeout=120)
            sender.stop()
            rates.append(nbytes / result["seconds"])
        finally:
            sink.stop()
    return statistics.median(rates)


def ring_bound(n: int, size: int, bandwidth: float) -> float:
    return 2 * (n - 1) / n * size / bandwidth


def machine_bound(n: int, size: int, bandwidth: float, lanes: int) -> float:
    """The ring's bytes of all N members, 2(N-1) x size, over ``lanes`` copies or streams
    at ``bandwidth`` each: what one machine can do at best, however the work is split."""
    return 2 * (n - 1) * size / (bandwidth * lanes)


def measure_n(
    layout: Layout, n: int, args: argparse.Namespace, log: Any, bw: float, lanes: int
) -> dict:
    """Every figure for N peers on one layout (see the module doc)."""
    res: dict[str, Any] = {"peers": n, "layout": layout.name, "errors": []}
    run = Run()
    wait_scale = 1 + n / 8  # this machine's 2 cores run every peer
    try:
        broker, broker_addr = start_broker(run, layout, log)
        broker_pid = broker.proc.pid
        res["solo_join_s"] = solo_join(broker_addr, args.group_timeout)
        # Ranks 0..n-1 are the group; rank n the joiner, idle until asked.
        t = time.time()
        peers = []
        for i in range(n + 1):
            argv = ["--peer", str(i), f"p{i}", broker_addr, layout.peer_host(i)]
            peers.append(Proc([*argv, str(args.group_timeout)], log, layout.peer_ns(i)))
        run.procs += peers
        members, joiner = peers[:n], peers[n]
        ready = collect(peers, "ready", time.time() + 60 * wait_scale)
        if not all(ready):
            raise RuntimeError(f"{ready.count(None)} peers did not start")
        res["startup_s"] = time.time() - t

        phases = res["phase_s"] = {"start": res["startup_s"]}
        # Membership.
        cpu0 = proc_stats(broker_pid)["cpu_s"]
        t_go = time.time()
        for p in members:
            p.send({"op": "join", "group": "g", "members": n, "deadline_s": 60 * wait_scale})
        joined = collect(members, "joined", time.time() + 90 * wait_scale)
        bad = [i for i, j in enumerate(joined) if not j or "error" in j]
        if bad:
            raise RuntimeError(f"join: members {bad[:8]} failed: {joined[bad[0]]}")
        res["join_s"] = max(j["t"] for j in joined) - t_go
        res["broker_cpu_join"] = (proc_stats(broker_pid)["cpu_s"] - cpu0) / res["join_s"]
        # The broker's cost of a steady group: pings only.
        idle = 3.0 if args.quick else 6.0
        cpu0, t0 = proc_stats(broker_pid)["cpu_s"], time.time()
        time.sleep(idle)
        res["broker_cpu_idle"] = (proc_stats(broker_pid)["cpu_s"] - cpu0) / (time.time() - t0)

        # All-reduce.
        res["reduce"] = {}
        blocks = 3 if args.quick or n >= 32 else 5
        t_phase, cpu_peers = time.time(), peers_cpu(members)
        phases["join"] = t_phase - t_go
        progress(res, "start and join")
        for size in SIZES:
            k = 20 if size < 1024 else (2 if args.quick else 3)
            for p in members:
                p.send(
                    {
                        "op": "reduce",
                        "bytes": size,
                        "members": n,
                        "k": k,
                        "blocks": blocks,
                        "deadline_s": 60 * wait_scale,
                    }
                )
            got = collect(members, "reduced", time.time() + 300 * wait_scale)
            bad = [g for g in got if not g or "error" in g]
            if bad:
                res["reduce"][size] = {"error": str(bad[0])[:300]}
                res["errors"].append(f"all-reduce {size_name(size)}: {bad[0]}")
                progress(res, f"all-reduce {size_name(size)}B FAILED: {str(bad[0])[:200]}")
                continue
            progress(res, f"all-reduce {size_name(size)}B")
            rounds = [max(g["per_op"][b] for g in got) for b in range(blocks)]
            res["reduce"][size] = {
                "median_s": statistics.median(rounds),
                "bound_s": ring_bound(n, size, bw),
                "machine_bound_s": machine_bound(n, size, bw, lanes),
            }

        phases["reduce"] = time.time() - t_phase
        # After the all-reduces: every link they needed is open.
        res["light"] = summary([proc_stats(p.proc.pid) for p in members])
        res["broker"] = proc_stats(broker_pid)
        # How busy the peers kept the cores: near 1, the all-reduces wait for CPU.
        res["reduce_cpu_share"] = (peers_cpu(members) - cpu_peers) / (
            phases["reduce"] * (os.cpu_count() or 1)
        )
        t_phase = time.time()
        if n <= args.acc_max:
            res["acc"] = accumulator_phase(members, joiner, args, wait_scale)
            res["heavy"] = res["acc"].pop("heavy", {})
        else:
            res["acc"] = {"skipped": f"N > --acc-max {args.acc_max} (torch peers' memory)"}
        phases["acc"] = time.time() - t_phase
        progress(res, "accumulator")
        t_phase = time.time()
        res["kill"] = kill_phase(members, broker_pid, args, wait_scale)
        phases["kill"] = time.time() - t_phase
        progress(res, "kill")
    except Exception as e:  # noqa: BLE001 - the run goes on with the next N
        res["errors"].append(f"{type(e).__name__}: {e}")
    finally:
        run.stop()
    return res


def source_commit() -> str | None:
    """The moolib commit measured (with "+" if its tree had changes), for the results file."""
    try:
        head = _run(["git", "-C", _HERE, "rev-parse", "--short", "HEAD"]).strip()
        dirty = _run(["git", "-C", _HERE, "status", "--porcelain", "--untracked-files=no"])
    except (RuntimeError, OSError):
        return None
    return head + ("+" if dirty.strip() else "")


def progress(res: dict, what: str) -> None:
    """A line on stderr as each phase ends: a long run shows where it is."""
    stamp = time.strftime("%H:%M:%S")
    print(f"  {stamp} {res['layout']} N={res['peers']}: {what} done", file=sys.stderr, flush=True)


def accumulator_phase(
    members: list[Proc], joiner: Proc, args: argparse.Namespace, wait_scale: float
) -> dict:
    """Steps/s with a near-free model, then with 1.6M parameters, after which a new
    peer joins and the time until it holds the leader's state is taken."""
    n = len(members)
    out: dict[str, Any] = {}
    window = 4.0 if args.quick else 8.0
    joiner.send({"op": "warm"})  # its torch import is not part of its join
    for label, shape, name in (("tiny", (1, 1), "acc-tiny"), ("1.6M", BIG_MODEL, "acc-big")):
        big = label == "1.6M"
        cmd = {"op": "acc", "group": name, "shape": shape, "virtual_batch": n}
        for p in members:
            p.send(cmd)
        connected = collect(members, "connected", time.time() + 120 * wait_scale)
        entry: dict[str, Any] = {}
        out[label] = entry
        if all(connected):
            t_start = time.time()
            time.sleep(window)
            entry["window"] = (t_start, time.time())
            if big:
                out["heavy"] = summary([proc_stats(p.proc.pid) for p in members])
                entry.update(join_state(joiner, cmd, wait_scale))
        else:
            entry["error"] = f"{connected.count(None)} members never connected"
        everyone = [*members, joiner] if big and "window" in entry else members
        for p in everyone:
            p.send({"op": "stop"})
        done = collect(everyone, "acc_done", time.time() + 60 * wait_scale)
        entry.update(acc_rate(done, entry.get("window"), n))
        if "join_state_s" in entry:
            entry.update(join_breakdown(entry, done[:n]))
        errors = {d["error"] for d in done if d and d.get("error")}
        if errors:
            entry["member_errors"] = sorted(errors)[:3]
    return out


def join_state(joiner: Proc, cmd: dict, wait_scale: float) -> dict:
    """A new peer joins the Accumulator's group: seconds until it holds the leader's state."""
    t_join = time.time()
    joiner.send(cmd)
    got = joiner.wait_event("connected", time.time() + 120 * wait_scale)
    if got is None or got["t_state"] is None:
        return {"join_error": f"the joiner did not get the state: {got}"}
    return {
        # From the joiner's start (torch imported, model built) to the state in hand.
        "join_state_s": got["t_state"] - got["t_ready"],
        "join_command_s": got["t_state"] - t_join,
        "join_member_s": (got["t_member"] or got["t_state"]) - got["t_ready"],
        "t_ready": got["t_ready"],
        "t_state": got["t_state"],
        "state_bytes": (BIG_MODEL[0] * BIG_MODEL[1] + BIG_MODEL[1]) * 4,
    }


def join_breakdown(entry: dict, done: list[dict | None]) -> dict:
    """Splits the joiner's wait at the leader's set_state() call: before it, the
    membership, the election and the leader's loop coming round to
    wants_state(); after it, what moolib does with the state (serialize, send,
    the joiner's update() taking it), the part to set beside size / B."""
    calls = [c for d in done if d for c in d.get("offers", []) if c[0] <= entry["t_state"]]
    if not calls:
        return {"join_error": "no member called set_state() before the joiner held the state"}
    called, returned = max(calls)
    return {
        "join_offer_s": called - entry["t_ready"],
        "join_transfer_s": entry["t_state"] - called,
        "join_set_state_s": returned - called,
    }


def kill_phase(
    members: list[Proc], broker_pid: int, args: argparse.Namespace, wait_scale: float
) -> dict:
    """Members step (a 4-byte all-reduce, 10 ms apart); kill -9 of the last one; the time
    until every survivor has stepped with the N-1 others, and until each sees N-1."""
    n = len(members)
    victim, survivors = members[-1], members[:-1]
    for p in members:
        p.send({"op": "steps", "deadline_s": 60 * wait_scale})
    firsts = collect(members, "step", time.time() + 120 * wait_scale)
    if not all(f and f["n"] == n for f in firsts):
        return {"error": f"members did not step together: {firsts[:4]}"}
    time.sleep(1.0)
    cpu0 = proc_stats(broker_pid)["cpu_s"]
    t_kill = time.time()
    victim.proc.kill()
    deadline = t_kill + args.group_timeout * 3 + 60 * wait_scale
    out: dict[str, Any] = {}
    stepped = []
    for p in survivors:
        while True:
            ev = p.wait_event("step", deadline)
            if ev is None or ev["n"] == n - 1:
                stepped.append(ev)
                break
    if all(stepped):
        out["next_step_s"] = max(ev["t"] for ev in stepped) - t_kill
        out["first_step_s"] = min(ev["t"] for ev in stepped) - t_kill
    else:
        out["error"] = f"{stepped.count(None)} survivors took no step without the dead member"
    out["broker_cpu"] = (proc_stats(broker_pid)["cpu_s"] - cpu0) / (time.time() - t_kill)
    for p in survivors:
        p.send({"op": "stop"})
    done = collect(survivors, "steps_done", time.time() + 60 * wait_scale)
    out["failed_steps"] = sum(d["errors"] for d in done if d)
    return out


def acc_rate(done: list[dict | None], window: tuple[float, float] | None, n: int) -> dict:
    """The group's steps per second in the window, from the member that reported most."""
    if not window or not any(done):
        return {}
    lo, hi = window
    best = max((d for d in done if d), key=lambda d: len(d["steps"]))
    times = [t for t, members in best["steps"] if lo <= t <= hi and members == n]
    if len(times) < 2:
        return {"steps_per_s": len(times) / (hi - lo)}
    return {"steps_per_s": (len(times) - 1) / (times[-1] - times[0])}


# --- output ---------------------------------------------------------------------


def fmt(x: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def table(results: list[dict], settings: dict) -> str:
    """The results as a markdown table, one row per layout and N."""
    head = [
        "layout",
        "N",
        "join s (lone)",
        "ar 16 B ms",
        "ar 1 MiB ms (ring; machine)",
        "ar 6 MiB ms (ring; machine)",
        "steps/s tiny (1/ar16B)",
        "steps/s 1.6M (1/ar6MiB)",
        "kill: next step s (timeout)",
        "join: state s; from set_state ms (size/B)",
        "broker CPU idle/join/kill",
        "peer RSS (PSS) MiB light; torch",
        "peer fds",
        "peer threads",
    ]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        red = r.get("reduce", {})
        cells = [r["layout"], str(r["peers"])]
        cells.append(f"{fmt(r.get('join_s'), 1, 2)} ({fmt(r.get('solo_join_s'), 1, 2)})")
        ar = [red.get(s, {}) for s in SIZES]
        cells.append(fmt(ar[0].get("median_s"), 1e3, 2) if "error" not in ar[0] else "FAILED")
        for a in ar[1:]:
            cells.append(
                "FAILED"
                if "error" in a
                else f"{fmt(a.get('median_s'), 1e3)} ({fmt(a.get('bound_s'), 1e3)}; "
                f"{fmt(a.get('machine_bound_s'), 1e3)})"
            )
        acc = r.get("acc", {})
        for label, a in ((("tiny", ar[0])), ("1.6M", ar[2])):
            e = acc.get(label, {})
            limit = 1 / a["median_s"] if a.get("median_s") else None
            text = "FAILED" if "error" in e else fmt(e.get("steps_per_s"))
            cells.append(f"{text} ({fmt(limit)})")
        big, kill = acc.get("1.6M", {}), r.get("kill", {})
        text = "FAILED" if "error" in kill else fmt(kill.get("next_step_s"), 1, 2)
        cells.append(f"{text} ({settings['group_timeout']:g})")
        state = "FAILED" if "join_error" in big else fmt(big.get("join_state_s"), 1, 2)
        bw = settings["bandwidth_Bps"][r["layout"]]
        size = (BIG_MODEL[0] * BIG_MODEL[1] + BIG_MODEL[1]) * 4
        moved = fmt(big.get("join_transfer_s"), 1e3)
        cells.append(f"{state}; {moved} ({size / bw * 1e3:.1f} ms)")
        cpu = [r.get("broker_cpu_idle"), r.get("broker_cpu_join"), kill.get("broker_cpu")]
        cells.append("/".join(fmt(c, 1, 3) for c in cpu))
        light, heavy = r.get("light", {}), r.get("heavy", {})

        def med_max(d: dict, key: str, digits: int = 0) -> str:
            if key not in d:
                return "-"
            return f"{d[key]['median']:.{digits}f}/{d[key]['max']:.{digits}f}"

        def mem(d: dict) -> str:
            rss, pss = (d.get(k, {}).get("median") for k in ("rss_mib", "pss_mib"))
            return f"{fmt(rss, 1, 0)} ({fmt(pss, 1, 0)})"

        cells.append(f"{mem(light)}; {mem(heavy)}")
        cells.append(f"{med_max(light, 'fds')} ; {med_max(heavy, 'fds')}")
        cells.append(f"{med_max(light, 'threads')} ; {med_max(heavy, 'threads')}")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of ``table``'s output (within other text) as dicts by column header;
    rows printed before the header (as each N finishes) are left out."""
    lines = text.splitlines()
    starts = [i for i, x in enumerate(lines) if x.startswith("| layout |")]
    if not starts:
        return []
    lines = [x for x in lines[starts[0] :] if x.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [
        dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True))
        for line in lines[1:]
    ]


NEIGH = "/proc/sys/net/ipv4/neigh/default/gc_thresh{}"


@contextlib.contextmanager
def neighbour_table(entries: int) -> Iterator[str]:
    """Room for ``entries`` ARP entries while the run lasts, the old limits restored after.

    The kernel keeps one neighbour table for all namespaces (gc_thresh1-3 exist only
    in the first one; 128/512/1024 by default), and a full mesh of N namespaces
    needs N x (N-1) entries: past gc_thresh3 the kernel logs "neighbor table
    overflow" and drops packets, so at 32 peers the mesh stalls for reasons that
    have nothing to do with moolib."""
    paths = [NEIGH.format(i) for i in (1, 2, 3)]
    old = [int(open(p).read()) for p in paths]  # noqa: SIM115 - read at once
    new = [max(o, entries * f) for o, f in zip(old, (1, 2, 4), strict=True)]
    try:
        for path, value in zip(paths, new, strict=True):
            with open(path, "w") as f:
                f.write(str(value))
        yield f"gc_thresh1-3 {'/'.join(map(str, old))} -> {'/'.join(map(str, new))}"
    finally:
        for path, value in zip(paths, old, strict=True):
            with open(path, "w") as f:
                f.write(str(value))


@contextlib.contextmanager
def network(layouts: list[str], count: int, rate: str) -> Iterator[dict | None]:
    """The namespaces for the netns layout, removed however the run ends."""
    if "netns" not in layouts:
        yield None
        return
    with neighbour_table((count + 1) ** 2) as neigh:
        try:
            net = make_network(count, rate)
            net["neighbour_table"] = neigh
            yield net
        finally:
            remove_network()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", default="8,16,32,64", help="peer counts, comma-separated")
    parser.add_argument("--layout", default="shm,netns", help="shm, netns or both")
    parser.add_argument("--quick", action="store_true", help="shorter windows and fewer blocks")
    parser.add_argument("--rate", default="10gbit", help="tc tbf rate of every veth (netns)")
    parser.add_argument("--group-timeout", type=float, default=10.0, help="Group.set_timeout")
    parser.add_argument(
        "--acc-max",
        type=int,
        default=16,
        help="the Accumulator rows up to this N (its peers import torch: ~330 MiB PSS each)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the raw results here")
    parser.add_argument("--log", default=None, help="the peers' stderr (default: a temp file)")
    args = parser.parse_args()
    try:
        peers = [int(p) for p in args.peers.split(",")]
    except ValueError:
        parser.error(f"--peers {args.peers!r}: give comma-separated integers, e.g. 8,16")
    layouts = args.layout.split(",")
    if min(peers) < 2 or not set(layouts) <= {"shm", "netns"}:
        parser.error("need at least 2 peers; layouts are shm and netns")
    if "netns" in layouts:
        parse_rate(args.rate)
        if max(peers) + 1 > 250 * 200:
            parser.error("too many peers for 10.214.0.0/16")
        if os.geteuid() != 0:
            parser.error("the netns layout needs root (ip netns, tc)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # As between hosts: every connection authenticated (and no warning per listener).
    os.environ.setdefault("MOOLIB_AUTH_KEY", f"bench-scale-{os.getpid()}")
    log_path = args.log or f"/tmp/bench-scale-{os.getpid()}.log"
    started = time.time()
    results = []
    settings: dict[str, Any] = {
        "cores": os.cpu_count(),
        "commit": source_commit(),
        "group_timeout": args.group_timeout,
        "quick": args.quick,
        "bandwidth_Bps": {},
    }
    with open(log_path, "a") as log, network(layouts, max(peers) + 1, args.rate) as net:
        if net:
            settings["netns"] = net
            print(
                f"netns: {net['namespaces']} namespaces, veths into bridge {BRIDGE} "
                f"({BRIDGE_IP}/{PREFIX_LEN}), tc qdisc on both ends of each veth: {net['qdisc']}; "
                f"ARP table {net['neighbour_table']}",
                flush=True,
            )
        for name in layouts:
            layout = Layout(name, name == "netns")
            # A copy runs on one core, so the cores copy side by side; one TCP
            # stream through veths already keeps both cores busy (sender,
            # receiver and the kernel's softirq work), so streams do not add up.
            lanes = 1 if layout.netns else os.cpu_count() or 1
            if layout.netns:
                nbytes = (32 if args.quick else 128) << 20
                bw = link_bandwidth(nbytes, log)
                what = f"one TCP stream mscale0 -> mscale1 through the bridge, {nbytes >> 20} MiB"
            else:
                bw, what = copy_bandwidth(), "numpy copy of 6 MiB, median of 30"
            settings["bandwidth_Bps"][name] = bw
            settings.setdefault("lanes", {})[name] = lanes
            print(f"{name}: B = {bw / 1e9:.2f} GB/s ({what})", flush=True)
            for n in peers:
                r = measure_n(layout, n, args, log, bw, lanes)
                results.append(r)
                print(table([r], settings).splitlines()[-1], flush=True)
                for e in r["errors"]:
                    print(f"  {name} N={n}: {e}", flush=True)
    settings["elapsed_s"] = time.time() - started
    print(
        f"\nmany peers on {os.cpu_count()} cores, group timeout {args.group_timeout:g} s, "
        f"{settings['elapsed_s']:.0f} s (peers' stderr: {log_path})"
    )
    print(table(results, settings))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "results": results}, f, indent=1, default=str)


def run_main() -> None:
    """main(), with Ctrl-C said in one line: the processes and namespaces are gone by then."""
    try:
        main()
    except KeyboardInterrupt:
        print("scale bench: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        rank, name, broker, host, timeout = sys.argv[2:7]
        peer_main(int(rank), name, broker, host, float(timeout))
    elif len(sys.argv) > 1 and sys.argv[1] == "--sink":
        sink_main(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--stream":
        stream_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        run_main()
