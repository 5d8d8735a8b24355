"""A replay shard server or an inserting client in its own process.

Usage:
  replay_peer.py --name NAME --serve TABLE [--capacity N] [--selector S] [--min-size N]
                 [--checkpoint PATH]
  replay_peer.py --name NAME --connect ADDR --insert-to PEER/TABLE --writer W
                 [--batches B] [--batch-size N] [--payload BYTES] [--clients K] [--forever]
                 [--pipelined]

Every item is ``{"id": int64, "batch": int64, "payload": uint8[BYTES]}``; ids
are ``writer * 10**9 + n`` and batch ids ``writer * 10**6 + b``, so a test can
count what arrived. ``--clients K`` inserts from K Rpcs (K connections) in K
threads at once, splitting the batches between them. ``--pipelined`` sends
the batches with ``insert(block=False)`` (then ``flush()``).

Prints ``READY <name> <address or ->`` once set up; an inserter then prints
``INSERTED <batch>`` after each batch, ``VIA <transports>`` (those of its
connections to the server) when a client is done, and ``DONE`` when every client is. Serves, or
keeps its connections, until its stdin closes, or it is killed.

A server with ``--checkpoint`` restores its table from that file where it
exists, and saves it there on each stdin line ``save`` (then prints
``SAVED``); ``--listen`` at a fixed address is retried while the port is
still held (a peer started again where a killed one listened).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

import moolib


def items(writer: int, batch: int, first: int, n: int, payload: int) -> dict:
    ids = torch.arange(first, first + n, dtype=torch.int64) + writer * 10**9
    return {
        "id": ids,
        "batch": torch.full((n,), writer * 10**6 + batch, dtype=torch.int64),
        "payload": (ids % 251).to(torch.uint8).unsqueeze(1).expand(n, payload).contiguous(),
    }


def make_rpc(name: str, args: argparse.Namespace) -> moolib.Rpc:
    rpc = moolib.Rpc()
    rpc.set_name(name)
    if args.transports:
        rpc.set_transports(args.transports.split(","))
    rpc.set_timeout(args.timeout)
    return rpc


def insert_loop(
    client_index: int,
    args: argparse.Namespace,
    lock: threading.Lock,
    done: threading.Event,
    release: threading.Event,
) -> None:
    rpc = make_rpc(f"{args.name}-{client_index}", args)
    rpc.connect(args.connect)
    peer, table = args.insert_to.split("/", 1)
    client = moolib.ReplayClient(rpc, (peer, table), timeout=args.timeout * 4)
    batch = client_index
    while args.forever or batch < args.batches:
        first = batch * args.batch_size
        batch_items = items(args.writer, batch, first, args.batch_size, args.payload)
        client.insert(batch_items, block=not args.pipelined)
        with lock:
            print(f"INSERTED {batch}", flush=True)
        batch += args.clients
    client.flush()
    used = {
        c["transport"]
        for p in rpc.debug_info()["peers"]
        if p["name"] == peer
        for c in p["connections"]
    }
    with lock:
        print(f"VIA {','.join(sorted(used))}", flush=True)
    done.set()
    # Connections stay up until the process is told to end, so a test can count them all at
    # once however the clients' inserts interleave.
    release.wait()
    rpc.close()


def serve(args: argparse.Namespace) -> None:
    rpc = make_rpc(args.name, args)
    deadline = time.monotonic() + 60
    while True:
        try:
            address = rpc.listen(args.listen)
            break
        except Exception:  # noqa: BLE001 - the port of a killed peer may be held a moment
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    if args.checkpoint and os.path.exists(args.checkpoint):
        replay = moolib.Replay.load(args.checkpoint)
    else:
        replay = moolib.Replay(args.capacity, selector=args.selector, min_size=args.min_size)
    replay.serve(rpc, args.serve)
    print(f"READY {args.name} {address}", flush=True)
    for line in sys.stdin:
        if line.strip() == "save":
            replay.save(args.checkpoint)
            print("SAVED", flush=True)
    replay.close()
    rpc.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--connect", default=None)
    parser.add_argument("--transports", default=None)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--serve", default=None)
    parser.add_argument("--capacity", type=int, default=100_000)
    parser.add_argument("--selector", default="fifo")
    parser.add_argument("--min-size", type=int, default=1)
    parser.add_argument("--insert-to", default=None)
    parser.add_argument("--writer", type=int, default=0)
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--payload", type=int, default=8)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--forever", action="store_true")
    parser.add_argument("--pipelined", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()

    if args.serve:
        serve(args)
        return

    print(f"READY {args.name} -", flush=True)
    lock = threading.Lock()
    release = threading.Event()
    done = [threading.Event() for _ in range(args.clients)]
    threads = [
        threading.Thread(target=insert_loop, args=(i, args, lock, done[i], release))
        for i in range(args.clients)
    ]
    for t in threads:
        t.start()
    for d in done:
        d.wait()
    print("DONE", flush=True)
    sys.stdin.read()
    release.set()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
