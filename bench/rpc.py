"""RPC benchmark: moolib between two processes on this host, beside the raw limits.

Prints, for the shared-memory and the TCP transport:
  - round trip of a tiny sync call, beside a plain Python socket ping-pong
    (Unix socket and TCP) measured in the same run;
  - async throughput: 10,000 async_ no-op calls, then waiting for all;
  - bandwidth of a 64 MiB float32 tensor argument, beside a 64 MiB memcpy and a
    plain socket transfer of 64 MiB measured in the same run.

Usage: python bench/rpc.py [--repeats N]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import moolib

MIB64 = 64 << 20


def serve() -> None:
    rpc = moolib.Rpc()
    rpc.set_name("bench-server")
    rpc.define("noop", lambda *args: None)
    rpc.define("take", lambda tensor: None)
    print(rpc.listen("127.0.0.1:0"), flush=True)
    sys.stdin.read()  # until the client closes our stdin


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# --- raw references ---------------------------------------------------------


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
        self.data = memoryview(bytearray(os.urandom(1 << 20) * 64))
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

    def bulk(self) -> None:
        self.sock.sendall(b"b")
        self.sock.sendall(self.data)
        self.sock.recv(1)

    def close(self) -> None:
        # Close every peer before waiting for any: each forked child holds
        # copies of the sockets that existed when it was forked.
        self.sock.close()

    def wait(self) -> None:
        os.waitpid(self.pid, 0)


# --- moolib -------------------------------------------------------------------


def connect(address: str, transport: str) -> moolib.Rpc:
    rpc = moolib.Rpc()
    rpc.set_name(f"bench-client-{transport}")
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


def moolib_round_trip(rpc: moolib.Rpc, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        rpc.sync("bench-server", "noop")
    return (time.perf_counter() - t) / n


def moolib_async(rpc: moolib.Rpc, n: int = 10_000) -> float:
    t = time.perf_counter()
    futures = [rpc.async_("bench-server", "noop") for _ in range(n)]
    for f in futures:
        f.result()
    return n / (time.perf_counter() - t)


def interleaved(repeats: int, measures: dict) -> dict:
    """Runs every measure once per round, rounds interleaved, and keeps the
    median of each: load from elsewhere on the machine then hits every figure
    alike, which keeps the ratios meaningful."""
    samples = {name: [] for name in measures}
    for _ in range(repeats):
        for name, fn in measures.items():
            samples[name].append(fn())
    return {name: statistics.median(v) for name, v in samples.items()}


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
    args = parser.parse_args()

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    tensor = torch.rand(MIB64 // 4)
    src = np.random.rand(MIB64 // 8)
    dst = np.empty_like(src)
    try:
        address = server.stdout.readline().strip()
        rpcs = {t: connect(address, t) for t in ("shm", "tcp")}
        raw = {"unix": RawPeer(socket.AF_UNIX), "tcp": RawPeer(socket.AF_INET)}
        for rpc in rpcs.values():
            moolib_round_trip(rpc, 500)
            rpc.sync("bench-server", "take", tensor)
        n = args.calls

        def timed(fn):
            return lambda: median_time(fn, 1)

        m = interleaved(
            args.repeats,
            {
                "rtt_unix": lambda: raw["unix"].round_trip(n),
                "rtt_shm": lambda: moolib_round_trip(rpcs["shm"], n),
                "rtt_tcp_raw": lambda: raw["tcp"].round_trip(n),
                "rtt_tcp": lambda: moolib_round_trip(rpcs["tcp"], n),
                "async_shm": lambda: moolib_async(rpcs["shm"]),
                "async_tcp": lambda: moolib_async(rpcs["tcp"]),
                "memcpy": timed(lambda: np.copyto(dst, src)),
                "bw_shm": timed(lambda: rpcs["shm"].sync("bench-server", "take", tensor)),
                "bulk_tcp": timed(raw["tcp"].bulk),
                "bw_tcp": timed(lambda: rpcs["tcp"].sync("bench-server", "take", tensor)),
                "bulk_unix": timed(raw["unix"].bulk),
            },
        )
        for peer in raw.values():
            peer.close()
        for peer in raw.values():
            peer.wait()
        for rpc in rpcs.values():
            rpc.close()
    finally:
        server.stdin.close()
        server.wait(timeout=30)

    us, gb = 1e6, MIB64 * 1e-9
    rows = [
        (
            "sync round trip, shm (us)",
            m["rtt_shm"] * us,
            "unix socket ping-pong",
            m["rtt_unix"] * us,
        ),
        (
            "sync round trip, tcp (us)",
            m["rtt_tcp"] * us,
            "tcp socket ping-pong",
            m["rtt_tcp_raw"] * us,
        ),
        ("async no-op calls/s, shm", m["async_shm"], "-", None),
        ("async no-op calls/s, tcp", m["async_tcp"], "-", None),
        ("64 MiB tensor arg, shm (GB/s)", gb / m["bw_shm"], "64 MiB memcpy", gb / m["memcpy"]),
        (
            "64 MiB tensor arg, tcp (GB/s)",
            gb / m["bw_tcp"],
            "tcp socket 64 MiB",
            gb / m["bulk_tcp"],
        ),
        (
            "(64 MiB over a unix socket, GB/s)",
            gb / m["bulk_unix"],
            "64 MiB memcpy",
            gb / m["memcpy"],
        ),
    ]
    cores = os.cpu_count()
    print(
        f"moolib RPC, two processes on {cores} cores (medians of {args.repeats} interleaved rounds)"
    )
    print(f"{'figure':<34}{'moolib':>14}{'reference':>30}{'ratio':>8}")
    for name, value, ref_name, ref in rows:
        ref_text = f"{ref_name} {ref:,.1f}" if ref is not None else ref_name
        ratio = f"{value / ref:.2f}" if ref else ""
        print(f"{name:<34}{value:>14,.1f}{ref_text:>30}{ratio:>8}")


if __name__ == "__main__":
    if "--serve" in sys.argv:
        serve()
    else:
        main()
