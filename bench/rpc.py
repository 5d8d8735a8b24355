"""RPC benchmark: moolib between two processes on this host, beside the raw limits.

Prints, for the shared-memory and the TCP transport:
  - round trip of a tiny sync call, beside a plain Python socket ping-pong
    between two processes (Unix socket and TCP) measured in the same run, and
    beside one whose two ends poll without blocking (the limit of an RPC that
    spins, as moolib's waits may: no wake-up on either side);
  - async throughput: 10,000 async_ no-op calls, then waiting for all;
  - bandwidth of a 64 MiB float32 tensor argument, beside a 64 MiB memcpy
    and a plain socket sending the same 64 MiB in 1 MiB writes.

Where UCX is available (moolib loads it at run time), the same three figures
for the ucx transport over UCX's own TCP and over its shared memory (UCX_TLS
set per client process), beside ucx_perftest (ucx-utils) on the same UCX
transport: stream_lat (a busy-polling ping-pong of UCP stream messages; its
round trip, twice the one-way latency ucx_perftest prints) and
stream_bw of 64 MiB messages, the limits of an RPC over UCP streams. Both with
endpoints that report a dead peer (ucx_perftest -e), as moolib's do; for UCX's
shared memory that takes UCX_MM_ERROR_HANDLING=y, which both sides get. The
table names the lanes UCX chose for moolib's link. --no-ucx leaves them out.

With --baseline, a second moolib (today's main, say) is measured beside this
one in the same run, rounds interleaved, and the table gains its figures and
the ratio of the two. The baseline is one of:
  - a Python interpreter whose environment has the other moolib installed;
  - a directory holding a source tree of moolib with its core built in place
    (``python setup.py build_ext --inplace``), run with this interpreter;
  - a git ref of this repository: exported (git archive) under
    ~/.cache/moolib-bench and built in place there with this interpreter.
The interpreter may also be one where the original moolib (0.0.9b0) is
installed: it is told apart by its module, and driven through its own API.

Each moolib runs in a client process of its own (with its own server
process), so that the two never share an interpreter; the raw references run
in this process.

Usage: python bench/rpc.py [--repeats N] [--calls N] [--baseline REF_OR_PYTHON_OR_DIR] [--no-ucx]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MIB64 = 64 << 20
CHUNK = 1 << 20
REPO = Path(__file__).resolve().parent.parent


# --- the moolib side: a server, and a client that measures on request --------

# The original moolib (facebookresearch's 0.0.9b0) can be the baseline too. Its Rpc
# differs in what these need: transport names, listen() returns no address,
# debug_info() only prints, and there is no close().
ORIGINAL_TRANSPORTS = {"shm": "shared memory", "tcp": "tcp/ip"}


def is_original(moolib) -> bool:
    return not hasattr(moolib, "_core")


def serve() -> None:
    import moolib

    if is_original(moolib):
        # Without torch imported here, its server never answers a call with a tensor.
        import torch  # noqa: F401

    rpc = moolib.Rpc()
    rpc.set_name("bench-server")
    rpc.define("noop", lambda *args: None)
    rpc.define("take", lambda tensor: None)
    if is_original(moolib):
        with socket.socket() as s:  # a free port (it cannot say which port 0 became)
            s.bind(("127.0.0.1", 0))
            address = f"127.0.0.1:{s.getsockname()[1]}"
        rpc.listen(address)
    else:
        address = rpc.listen("127.0.0.1:0")
        if "ucx" in bench_transports():
            rpc.listen("ucx://127.0.0.1:0")  # advertised: the client upgrades to it
    print(address, flush=True)
    sys.stdin.read()  # until the client closes our stdin


def bench_transports() -> list[str]:
    """The transports a client measures (its server listens for them)."""
    return os.environ.get("MOOLIB_BENCH_TRANSPORTS", "shm,tcp").split(",")


def ucx_available(moolib) -> bool:
    if is_original(moolib):
        return False
    rpc = moolib.Rpc()
    try:
        return rpc.debug_info()["transport_status"].get("ucx", {}).get("available", False)
    finally:
        rpc.close()


def connect(moolib, address: str, transport: str):
    rpc = moolib.Rpc()
    rpc.set_name(f"bench-client-{transport}")
    if is_original(moolib):
        # Its connect() always dials TCP, and its calls wait for the peer: the
        # first one that returns made the link; the transport is narrowed after
        # it (it links every transport the peers share). Which transport then
        # carries the calls cannot be read back there.
        rpc.set_timeout(30)
        rpc.connect(address)
        rpc.sync("bench-server", "noop")
        rpc.set_transports([ORIGINAL_TRANSPORTS[transport]])
        rpc.sync("bench-server", "noop")
        return rpc
    rpc.set_transports([transport])
    rpc.connect(address)
    deadline = time.time() + 30
    while time.time() < deadline:
        peers = {p["name"]: p for p in rpc.debug_info()["peers"]}
        links = peers.get("bench-server", {}).get("connections", [])
        if any(c["transport"] == transport for c in links):
            return rpc
        time.sleep(0.01)
    raise RuntimeError(f"no {transport} link to the server")


def client() -> None:
    """Measures one figure per line read from stdin; answers with a JSON line."""
    import torch

    import moolib

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = server.stdout.readline().strip()
        rpcs = {t: connect(moolib, address, t) for t in bench_transports()}
        tensor = torch.rand(MIB64 // 4)

        def round_trip(rpc, n: int) -> float:
            t = time.perf_counter()
            for _ in range(n):
                rpc.sync("bench-server", "noop")
            return (time.perf_counter() - t) / n

        def async_calls(rpc, n: int) -> float:
            t = time.perf_counter()
            futures = [rpc.async_("bench-server", "noop") for _ in range(n)]
            for f in futures:
                f.result()
            return n / (time.perf_counter() - t)

        def bandwidth(rpc) -> float:
            t = time.perf_counter()
            rpc.sync("bench-server", "take", tensor)
            return MIB64 * 1e-9 / (time.perf_counter() - t)

        for rpc in rpcs.values():
            round_trip(rpc, 500)
            async_calls(rpc, 1000)
            bandwidth(rpc)
        ready = {"ready": moolib.__file__, "original": is_original(moolib)}
        ready["ucx"] = ucx_available(moolib)
        if "ucx" in rpcs:
            # What UCX carries the calls over (transport/device of each lane).
            peer = next(p for p in rpcs["ucx"].debug_info()["peers"] if p["name"] == "bench-server")
            ready["lanes"] = next(
                c["lanes"] for c in peer["connections"] if c["transport"] == "ucx"
            )
        print(json.dumps(ready), flush=True)
        for line in sys.stdin:
            name, _, arg = line.strip().partition(" ")
            kind, _, transport = name.partition("_")
            rpc = rpcs[transport]
            if kind == "rtt":
                value = round_trip(rpc, int(arg))
            elif kind == "async":
                value = async_calls(rpc, int(arg))
            else:
                value = bandwidth(rpc)
            print(json.dumps({"value": value}), flush=True)
        for rpc in rpcs.values():
            if hasattr(rpc, "close"):  # the original's Rpc has none
                rpc.close()
    finally:
        server.stdin.close()
        server.wait(timeout=30)


class Client:
    """A client process of one moolib install."""

    def __init__(self, python: str, env: dict) -> None:
        self.proc = subprocess.Popen(
            [python, __file__, "--client"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        ready = self._read()
        self.module = ready["ready"]
        self.original = ready.get("original", False)
        self.ucx = ready.get("ucx", False)
        self.lanes = ready.get("lanes", "")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench client exited with {self.proc.wait()}")
        return json.loads(line)

    def measure(self, name: str, arg: int = 0) -> float:
        self.proc.stdin.write(f"{name} {arg}\n")
        self.proc.stdin.flush()
        return self._read()["value"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def baseline_env(spec: str) -> tuple[str, dict]:
    """(python, environment) that runs the baseline moolib named by spec."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    path = Path(spec)
    if path.is_file() and os.access(path, os.X_OK):
        return str(path), env
    if not path.is_dir():
        sha = subprocess.check_output(
            ["git", "-C", str(REPO), "rev-parse", "--verify", f"{spec}^{{commit}}"], text=True
        ).strip()
        path = Path.home() / ".cache" / "moolib-bench" / sha[:12]
        if not path.exists():
            # An exported tree, not a worktree: nothing is registered in the repository.
            part = path.with_name(path.name + ".part")
            part.mkdir(parents=True, exist_ok=True)
            archive = subprocess.Popen(
                ["git", "-C", str(REPO), "archive", sha], stdout=subprocess.PIPE
            )
            subprocess.check_call(["tar", "-x", "-C", str(part)], stdin=archive.stdout)
            if archive.wait() != 0:
                raise RuntimeError(f"git archive {sha} failed")
            part.rename(path)
    if not list((path / "moolib").glob("_core*.so")):
        print(f"building the baseline's core in {path} ...", file=sys.stderr, flush=True)
        subprocess.check_call(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=path, env=env
        )
    env["PYTHONPATH"] = str(path)
    return sys.executable, env


# --- raw references -----------------------------------------------------------


def busy_recv(sock: socket.socket) -> bytes:
    """Receives one byte polling without blocking (no wake-up, one CPU burnt); b"" at EOF."""
    while True:
        try:
            return sock.recv(1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass


def socket_pair(family: int) -> tuple[socket.socket, int]:
    """A connected socket to a forked echo/sink child; returns (socket, child pid)."""
    if family == socket.AF_UNIX:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
        srv.close()
        for s in (a, b):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pid = os.fork()
    if pid == 0:
        a.close()
        buf = bytearray(MIB64)
        view = memoryview(buf)
        while True:
            head = b.recv(1)
            if not head:
                os._exit(0)
            if head == b"p":  # ping: answer at once
                b.sendall(b"p")
            elif head == b"s":  # busy-polling pings, as many as the next 4 bytes say
                count = int.from_bytes(b.recv(4, socket.MSG_WAITALL), "little")
                for _ in range(count):
                    if not busy_recv(b):
                        os._exit(0)
                    b.send(b"p")
            else:  # bulk: receive 64 MiB, then acknowledge
                got = 0
                while got < MIB64:
                    got += b.recv_into(view[got:], MIB64 - got)
                b.sendall(b"k")
    b.close()
    return a, pid


class RawPeer:
    """A plain Python socket to a forked echo/sink child: the raw limit."""

    def __init__(self, family: int) -> None:
        self.sock, self.pid = socket_pair(family)
        self.data = memoryview(bytearray(os.urandom(CHUNK) * (MIB64 // CHUNK)))
        for _ in range(500):
            self.ping()

    def ping(self) -> None:
        self.sock.sendall(b"p")
        self.sock.recv(1)

    def round_trip(self, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.ping()
        return (time.perf_counter() - t) / n

    def busy_round_trip(self, n: int) -> float:
        """A ping-pong whose two ends poll instead of blocking: the limit of a spinning RPC."""
        self.sock.sendall(b"s" + n.to_bytes(4, "little"))
        t = time.perf_counter()
        for _ in range(n):
            self.sock.send(b"p")
            busy_recv(self.sock)
        return (time.perf_counter() - t) / n

    def bulk(self) -> float:
        """GB/s of 64 MiB sent in 1 MiB writes, as a program streaming data would."""
        t = time.perf_counter()
        self.sock.sendall(b"b")
        for offset in range(0, MIB64, CHUNK):
            self.sock.sendall(self.data[offset : offset + CHUNK])
        self.sock.recv(1)
        return MIB64 * 1e-9 / (time.perf_counter() - t)

    def close(self) -> None:
        # Close every peer before waiting for any: each forked child holds
        # copies of the sockets that existed when it was forked.
        self.sock.close()

    def wait(self) -> None:
        os.waitpid(self.pid, 0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ucx_perftest(settings: dict, test: str, args: list[str]) -> float:
    """One ucx_perftest run (server and client processes) with UCX's settings as
    moolib's client has them, and endpoints with error handling as moolib's: the
    round trip in seconds (stream_lat: twice its one-way latency) or the bandwidth
    in GB/s (stream_bw)."""
    env = dict(os.environ, **settings)
    port = str(free_port())
    server = subprocess.Popen(
        ["ucx_perftest", "-p", port], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for _ in range(50):  # the server needs a moment to listen
            out = subprocess.run(
                ["ucx_perftest", "127.0.0.1", "-p", port, "-e", "-t", test, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=120,
            )
            final = re.search(r"^Final:\s+(.*)$", out.stdout, re.M)
            if final:
                cols = [float(x) for x in final.group(1).split()]
                # iterations, latency p50/average/overall (us), bandwidth
                # average/overall (MB/s), message rate average/overall. A ping-pong's
                # latency is half its round trip (400,000 iterations at 5.75 us took
                # 4.6 s of wall-clock); the round trip is what a sync call makes.
                if test.endswith("lat"):
                    return 2 * cols[3] * 1e-6
                return cols[5] * 1.048576e-3
            time.sleep(0.1)
        raise RuntimeError(f"ucx_perftest {test} with {settings}: {out.stdout}{out.stderr}")
    finally:
        server.kill()
        server.wait(timeout=30)


# UCX's transports measured: its TCP, and its shared memory ("sm": posix, sysv,
# cma; with tcp, which UCX's client-server connection manager needs to connect).
# moolib's endpoints ask UCX to report a dead peer, which UCX 1.13's shared memory
# offers only with UCX_MM_ERROR_HANDLING=y (without it, UCX sends over its TCP).
# ucx_perftest runs with the same settings, and with error handling (-e) too.
UCX_ENV = {
    "ucx-tcp": {"UCX_TLS": "tcp"},
    "ucx-shm": {"UCX_TLS": "sm,tcp", "UCX_MM_ERROR_HANDLING": "y"},
}


def memcpy_rate(src: np.ndarray, dst: np.ndarray) -> float:
    t = time.perf_counter()
    np.copyto(dst, src)
    return MIB64 * 1e-9 / (time.perf_counter() - t)


# --- the run ------------------------------------------------------------------


def main() -> None:
    faulthandler.dump_traceback_later(
        int(os.environ.get("BENCH_WATCHDOG", "0")) or 10**6, exit=True
    )
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--calls", type=int, default=10_000, help="sync calls timed per round trip figure"
    )
    parser.add_argument(
        "--async-calls", type=int, default=10_000, help="async_ calls per throughput figure"
    )
    parser.add_argument(
        "--baseline",
        metavar="REF_OR_PYTHON_OR_DIR",
        help="a second moolib measured beside this one (see above)",
    )
    parser.add_argument("--no-ucx", action="store_true", help="leave the ucx rows out")
    args = parser.parse_args()

    # Raw references first: forking after the clients start would copy them.
    raw = {"unix": RawPeer(socket.AF_UNIX), "tcp": RawPeer(socket.AF_INET)}
    clients = {"moolib": Client(sys.executable, dict(os.environ))}
    if args.baseline:
        clients["base"] = Client(*baseline_env(args.baseline))
    ucx = not args.no_ucx and clients["moolib"].ucx
    perftest = ucx and shutil.which("ucx_perftest") is not None
    if ucx:
        for who, settings in UCX_ENV.items():
            env = dict(os.environ, **settings, MOOLIB_BENCH_TRANSPORTS="ucx")
            clients[who] = Client(sys.executable, env)
    src = np.random.rand(MIB64 // 8)
    dst = np.empty_like(src)
    n, na = args.calls, args.async_calls

    measures = {
        "rtt_unix": lambda: raw["unix"].round_trip(n),
        "rtt_tcp_raw": lambda: raw["tcp"].round_trip(n),
        "busy_unix": lambda: raw["unix"].busy_round_trip(n),
        "busy_tcp": lambda: raw["tcp"].busy_round_trip(n),
        "memcpy": lambda: memcpy_rate(src, dst),
        "bulk_tcp": raw["tcp"].bulk,
        "bulk_unix": raw["unix"].bulk,
    }
    for who, settings in UCX_ENV.items() if ucx else ():
        c = clients[who]
        measures[f"{who}:rtt"] = lambda c=c: c.measure("rtt_ucx", n)
        measures[f"{who}:async"] = lambda c=c: c.measure("async_ucx", na)
        measures[f"{who}:bw"] = lambda c=c: c.measure("bw_ucx")
        if perftest:
            measures[f"{who}:perf_lat"] = lambda settings=settings: ucx_perftest(
                settings, "stream_lat", ["-n", str(n)]
            )
            measures[f"{who}:perf_bw"] = lambda settings=settings: ucx_perftest(
                settings, "stream_bw", ["-s", str(MIB64), "-n", "20"]
            )
    for who, c in clients.items():
        if who in UCX_ENV:
            continue
        for t in ("shm", "tcp"):
            measures[f"{who}:rtt_{t}"] = lambda c=c, t=t: c.measure(f"rtt_{t}", n)
            measures[f"{who}:async_{t}"] = lambda c=c, t=t: c.measure(f"async_{t}", na)
            measures[f"{who}:bw_{t}"] = lambda c=c, t=t: c.measure(f"bw_{t}")
    # Every measure once per round, rounds interleaved, and the median of
    # each kept: load from elsewhere on the machine then hits every figure
    # alike, which keeps the ratios meaningful.
    samples = {name: [] for name in measures}
    try:
        for _ in range(args.repeats):
            for name, fn in measures.items():
                samples[name].append(fn())
    finally:
        for c in clients.values():
            c.close()
        for peer in raw.values():
            peer.close()
        for peer in raw.values():
            peer.wait()
    m = {name: statistics.median(v) for name, v in samples.items()}

    us = 1e6
    rows = [
        ("sync round trip, shm (us)", "rtt_shm", us, "unix socket ping-pong", m["rtt_unix"] * us),
        ("sync round trip, tcp (us)", "rtt_tcp", us, "tcp socket ping-pong", m["rtt_tcp_raw"] * us),
        ("async no-op calls/s, shm", "async_shm", 1, "", None),
        ("async no-op calls/s, tcp", "async_tcp", 1, "", None),
        ("64 MiB tensor arg, shm (GB/s)", "bw_shm", 1, "64 MiB memcpy", m["memcpy"]),
        ("64 MiB tensor arg, tcp (GB/s)", "bw_tcp", 1, "tcp socket, 1 MiB writes", m["bulk_tcp"]),
    ]
    cores = os.cpu_count()
    print(
        f"moolib RPC, two processes on {cores} cores (medians of {args.repeats} interleaved "
        f"rounds, load average {os.getloadavg()[0]:.2f} at the end)"
    )
    for who, c in clients.items():
        if who in UCX_ENV:
            continue
        if c.original:
            print(
                f"  {who}: {c.module} (the original moolib: its shm and tcp figures are calls "
                "after set_transports() narrowed it to that transport, which it cannot confirm)"
            )
        else:
            print(f"  {who}: {c.module}")
    head = f"{'figure':<32}{'moolib':>12}"
    if "base" in clients:
        head += f"{'base':>12}{'x base':>8}"
    head += f"{'reference':>36}{'ratio':>7}"
    print(head)
    for label, key, scale, ref_name, ref in rows:
        value = m[f"moolib:{key}"] * scale
        line = f"{label:<32}{value:>12,.1f}"
        if "base" in clients:
            base = m[f"base:{key}"] * scale
            # How many times better: less time for a round trip, more of the rest.
            better = base / value if key.startswith("rtt") else value / base
            line += f"{base:>12,.1f}{better:>8.2f}"
        ref_text = f"{ref_name} {ref:,.1f}" if ref is not None else ""
        ratio = f"{value / ref:.2f}" if ref else ""
        line += f"{ref_text:>36}{ratio:>7}"
        print(line)
    print(
        f"{'(busy-polling ping-pong, us)':<32}{'':>12}   unix {m['busy_unix'] * us:,.1f}, "
        f"tcp {m['busy_tcp'] * us:,.1f}: the sync round trips are "
        f"{m['moolib:rtt_shm'] / m['busy_unix']:.2f} and {m['moolib:rtt_tcp'] / m['busy_tcp']:.2f} "
        "of them"
    )
    print(
        f"{'(64 MiB over a unix socket, GB/s)':<32}{m['bulk_unix']:>12,.1f}"
        f"   (1 MiB writes; memcpy {m['memcpy']:,.1f})"
    )
    if not ucx:
        why = "--no-ucx" if args.no_ucx else "UCX is not available to moolib here"
        print(f"(no ucx rows: {why})")
        return
    print(f"{'ucx transport':<32}{'moolib':>12}{'ucx_perftest':>36}{'ratio':>7}")
    for who in UCX_ENV:
        perf_lat = m.get(f"{who}:perf_lat")
        perf_bw = m.get(f"{who}:perf_bw")
        for label, key, scale, ref_name, ref in [
            (f"sync round trip, {who} (us)", "rtt", us, "stream_lat round trip", perf_lat),
            (f"async no-op calls/s, {who}", "async", 1, "", None),
            (f"64 MiB tensor arg, {who} (GB/s)", "bw", 1, "stream_bw 64 MiB", perf_bw),
        ]:
            value = m[f"{who}:{key}"] * scale
            ref = ref * scale if ref is not None else None
            ref_text = f"{ref_name} {ref:,.1f}" if ref is not None else ""
            ratio = f"{value / ref:.2f}" if ref else ""
            print(f"{label:<32}{value:>12,.1f}{ref_text:>36}{ratio:>7}")
    for who in UCX_ENV:
        print(f"({who}: moolib's UCX lanes {clients[who].lanes}; settings {UCX_ENV[who]})")
    if not perftest:
        print("(no ucx_perftest on PATH: install ucx-utils for the limits)")


if __name__ == "__main__":
    if "--serve" in sys.argv:
        serve()
    elif "--client" in sys.argv:
        client()
    else:
        main()
