"""Short-lived clients, one after another: the departed peers a long-lived peer must forget.

Usage: churn_client.py ADDRESS PEER COUNT {call,group} [THREADS]

Each client is a fresh moolib.Rpc that connects to ADDRESS and then either
calls PEER's "name" once ("call") or joins a group of its own with PEER as the
broker and leaves it ("group"); then it closes. THREADS (default 1) run
clients side by side, each one client after another. Prints ``DONE COUNT``
once all are done.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import moolib


def one_client(address: str, peer: str, mode: str, index: int) -> None:
    """Connects, calls or joins a group and leaves, and closes."""
    rpc = moolib.Rpc()
    try:
        rpc.set_timeout(60)
        rpc.connect(address)
        if mode == "call":
            name = rpc.sync(peer, "name")
            assert name == peer, name
            return
        group = moolib.Group(rpc, f"churn-{os.getpid()}-{threading.get_ident()}-{index}")
        group.set_broker_name(peer)
        # Short: a new group's join window is a ping interval (an eighth of
        # this), which 3,000 clients wait through one after another; and a
        # member whose leave is lost with its connection is dropped soon after.
        group.set_timeout(0.5)
        end = time.monotonic() + 60
        while not group.active():
            group.update()
            assert time.monotonic() < end, "the group never became active"
            time.sleep(0.005)
        group.close()
    finally:
        rpc.close()


def main() -> None:
    address, peer, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    threads = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            for i in range(n):
                one_client(address, peer, mode, i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    workers = [
        threading.Thread(target=run, args=(count // threads + (t < count % threads),))
        for t in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    print(f"DONE {count}", flush=True)


if __name__ == "__main__":
    main()
