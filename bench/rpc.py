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


def raw_ping_pong(family: int, n: int) -> float:
    s, pid = socket_pair(family)
    try:
        for _ in range(500):
            s.sendall(b"p")
            s.recv(1)
        t = time.perf_counter()
        for _ in range(n):
            s.sendall(b"p")
            s.recv(1)
        return (time.perf_counter() - t) / n
    finally:
        s.close()
        os.waitpid(pid, 0)


def raw_bulk(family: int, repeats: int) -> float:
    s, pid = socket_pair(family)
    data = memoryview(bytearray(os.urandom(1 << 20) * 64))

    def once() -> None:
        s.sendall(b"b")
        s.sendall(data)
        s.recv(1)

    try:
        once()
        return MIB64 / median_time(once, repeats)
    finally:
        s.close()
        os.waitpid(pid, 0)


def memcpy_bandwidth(repeats: int) -> float:
    # numpy's copy is a single-threaded memcpy, like the copy into shared memory.
    src = np.random.rand(MIB64 // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    return MIB64 / median_time(lambda: np.copyto(dst, src), repeats)


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
    for _ in range(500):
        rpc.sync("bench-server", "noop")
    t = time.perf_counter()
    for _ in range(n):
        rpc.sync("bench-server", "noop")
    return (time.perf_counter() - t) / n


def moolib_async(rpc: moolib.Rpc, repeats: int, n: int = 10_000) -> float:
    def once() -> None:
        futures = [rpc.async_("bench-server", "noop") for _ in range(n)]
        for f in futures:
            f.result()

    once()
    return n / median_time(once, repeats)


def moolib_bandwidth(rpc: moolib.Rpc, repeats: int) -> float:
    tensor = torch.rand(MIB64 // 4)
    rpc.sync("bench-server", "take", tensor)
    return MIB64 / median_time(lambda: rpc.sync("bench-server", "take", tensor), repeats)


def main() -> None:
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
    try:
        address = server.stdout.readline().strip()
        results = {}
        for transport in ("shm", "tcp"):
            rpc = connect(address, transport)
            results[transport] = (
                moolib_round_trip(rpc, args.calls),
                moolib_async(rpc, args.repeats),
                moolib_bandwidth(rpc, args.repeats),
            )
            rpc.close()
        unix_rtt = raw_ping_pong(socket.AF_UNIX, args.calls)
        tcp_rtt = raw_ping_pong(socket.AF_INET, args.calls)
        memcpy = memcpy_bandwidth(args.repeats)
        unix_bulk = raw_bulk(socket.AF_UNIX, args.repeats)
        tcp_bulk = raw_bulk(socket.AF_INET, args.repeats)
    finally:
        server.stdin.close()
        server.wait(timeout=30)

    shm, tcp = results["shm"], results["tcp"]
    us = 1e6
    gb = 1e-9
    print(f"moolib RPC, two processes on {os.cpu_count()} cores (medians)")
    print(f"{'figure':<34}{'moolib':>14}{'reference':>30}{'ratio':>8}")
    rows = [
        ("sync round trip, shm (us)", shm[0] * us, "unix socket ping-pong", unix_rtt * us),
        ("sync round trip, tcp (us)", tcp[0] * us, "tcp socket ping-pong", tcp_rtt * us),
        ("async no-op calls/s, shm", shm[1], "-", None),
        ("async no-op calls/s, tcp", tcp[1], "-", None),
        ("64 MiB tensor arg, shm (GB/s)", shm[2] * gb, "64 MiB memcpy", memcpy * gb),
        ("64 MiB tensor arg, tcp (GB/s)", tcp[2] * gb, "tcp socket 64 MiB", tcp_bulk * gb),
        ("(64 MiB over a unix socket, GB/s)", unix_bulk * gb, "64 MiB memcpy", memcpy * gb),
    ]
    for name, value, ref_name, ref in rows:
        ref_text = f"{ref_name} {ref:,.1f}" if ref is not None else ref_name
        ratio = f"{value / ref:.2f}" if ref else ""
        print(f"{name:<34}{value:>14,.1f}{ref_text:>30}{ratio:>8}")


if __name__ == "__main__":
    if "--serve" in sys.argv:
        serve()
    else:
        main()
