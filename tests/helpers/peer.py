"""A moolib peer in its own process, for the multi-process RPC tests.

Usage: peer.py --name NAME [--listen ADDR] [--connect ADDR ...] [--transports shm,tcp]
               [--auth-key KEY] [--timeout S] [--max-threads N] [--nofile N] [--broker]

``--nofile`` lowers the soft descriptor limit first; ``--broker`` also serves
as the groups' broker (updated every 0.25 s; "groups" returns its groups).

Prints ``READY <name> <bound address or ->`` once set up, then serves until its
stdin closes (so it never outlives the test that started it) or it is killed.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import threading
import time
from pathlib import Path

import torch

import moolib


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--listen", default=None)
    parser.add_argument("--connect", action="append", default=[])
    parser.add_argument("--transports", default=None)
    parser.add_argument("--auth-key", default=None)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--max-threads", type=int, default=None)
    parser.add_argument("--nofile", type=int, default=None)
    parser.add_argument("--broker", action="store_true")
    args = parser.parse_args()

    if args.nofile:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, hard))

    if args.max_threads:
        moolib.set_max_threads(args.max_threads)
    rpc = moolib.Rpc()
    rpc.set_name(args.name)
    if args.transports:
        rpc.set_transports(args.transports.split(","))
    if args.auth_key is not None:
        rpc.set_auth_key(args.auth_key)
    if args.timeout:
        rpc.set_timeout(args.timeout)

    def touch(path):
        Path(path).write_text(args.name)
        return True

    def fail(message):
        raise ValueError(message)

    def sleep(seconds):
        time.sleep(seconds)
        return seconds

    def call(peer, fn, *a, **kw):
        return rpc.sync(peer, fn, *a, **kw)

    def call_async(peer, fn, *a, **kw):
        return rpc.async_(peer, fn, *a, **kw).result()

    # hold blocks outside any moolib wait until a later release call.
    gates: dict[str, threading.Event] = {}

    def hold(key, seconds):
        return gates.setdefault(key, threading.Event()).wait(seconds)

    def release(key):
        gates.setdefault(key, threading.Event()).set()
        return True

    def info():
        return rpc.debug_info()

    rpc.define("echo", lambda x: x)
    rpc.define("echo_all", lambda *a, **kw: (a, kw))
    rpc.define("add", lambda a, b: a + b)
    rpc.define("pid", os.getpid)
    rpc.define("name", lambda: args.name)
    rpc.define("fail", fail)
    rpc.define("sleep", sleep)
    rpc.define("touch", touch)
    rpc.define("call", call)
    rpc.define("call_async", call_async)
    rpc.define("hold", hold)
    rpc.define("release", release)
    rpc.define("info", info)
    rpc.define("zeros", lambda n: torch.zeros(n, dtype=torch.uint8))
    rpc.define("checksum", lambda t: int(t.to(torch.int64).sum()))

    if args.broker:
        broker = moolib.Broker(rpc)
        rpc.define("groups", broker.groups)

        def update() -> None:
            while True:
                broker.update()
                time.sleep(0.25)

        threading.Thread(target=update, daemon=True).start()

    address = rpc.listen(args.listen) if args.listen else "-"
    for c in args.connect:
        rpc.connect(c)
    print(f"READY {args.name} {address}", flush=True)

    # Exit as soon as the test closes our stdin (or dies).
    sys.stdin.read()
    os._exit(0)


if __name__ == "__main__":
    threading.current_thread().name = "peer-main"
    main()
