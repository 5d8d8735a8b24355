"""A subscriber in its own process, checking every publication it fetches.

Usage: subscriber_peer.py --name NAME --connect ADDR [--transports shm|tcp]
                          --until VERSION [--into]

Fetches from peer ``learner`` (publisher name ``weights``) until it holds
``VERSION``. Each publication must be a nest whose every element equals its
version (the test publishes them so), and versions must never go back.
``--into`` fetches into a preallocated state dict instead. Prints ``READY``,
then ``OK <fetches that returned weights> <nones>``, or ``BAD <why>``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import moolib


def check(version: int, weights: dict) -> str | None:
    for key, t in weights.items():
        if not bool((t == version).all()):
            return f"{key} of version {version} holds {t.flatten()[:4].tolist()}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--connect", required=True)
    parser.add_argument("--transports", default=None)
    parser.add_argument("--until", type=int, required=True)
    parser.add_argument("--into", action="store_true")
    args = parser.parse_args()

    rpc = moolib.Rpc()
    rpc.set_name(args.name)
    if args.transports:
        rpc.set_transports([args.transports])
    rpc.set_timeout(30)
    rpc.connect(args.connect)
    sub = moolib.Subscriber(rpc, "learner", "weights")
    print(f"READY {args.name} -", flush=True)
    target = {
        "big": torch.zeros(1 << 18, dtype=torch.float32),
        "small": torch.zeros(3, dtype=torch.int64),
    }
    got = nones = 0
    last = -1
    deadline = time.monotonic() + 240
    while sub.version < args.until and time.monotonic() < deadline:
        if args.into:
            fresh = sub.fetch_into(target)
            weights = target
        else:
            result = sub.fetch()
            fresh = result is not None
            weights = result[1] if fresh else None
        if not fresh:
            nones += 1
            time.sleep(0.001)
            continue
        got += 1
        if sub.version <= last:
            print(f"BAD version went from {last} to {sub.version}", flush=True)
            return
        last = sub.version
        bad = check(last, weights)
        if bad:
            print(f"BAD {bad}", flush=True)
            return
    print(f"OK {got} {nones}" if sub.version >= args.until else "BAD timed out", flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
