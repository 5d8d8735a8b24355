"""Parameter publishing: what a fetch of the latest weights costs an actor.

A learner process publishes a state dict of N float32 tensors (4, 40 and
400 MB in all); an actor process fetches it with ``Subscriber.fetch()`` (the
weights as tensors over the received memory) and ``fetch_into()`` (copied into
its own model), over shared memory and over TCP. Beside them, in the same run:
a memcpy of the same bytes in the actor (the limit a fetch is measured
against), and what a user would do without a publisher: a function on the
learner returning ``state_dict()``, called with ``rpc.sync``.

Usage: python bench/publish.py [--sizes-mb 4 40 400] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

import moolib

TENSORS = 16


def state_dict(total_mb: int) -> dict:
    n = total_mb * (1 << 20) // 4 // TENSORS
    return {f"layer{i}.weight": torch.randn(n) for i in range(TENSORS)}


def learner(sizes: list[int]) -> None:
    rpc = moolib.Rpc()
    rpc.set_name("learner")
    print(rpc.listen("127.0.0.1:0"), flush=True)
    for mb in sizes:
        weights = state_dict(mb)
        moolib.Publisher(rpc, f"w{mb}").publish(weights)
        rpc.define(f"state_dict{mb}", lambda w=weights: w)
    sys.stdin.read()
    rpc.close()


def timed(fn, rounds: int) -> float:
    fn()  # warm-up: connections, allocations
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def actor(address: str, transport: str, sizes: list[int], rounds: int) -> None:
    rpc = moolib.Rpc()
    rpc.set_name(f"actor-{transport}")
    rpc.set_transports([transport])
    rpc.set_timeout(120)
    rpc.connect(address)
    for mb in sizes:
        target = {k: torch.empty_like(v) for k, v in state_dict(mb).items()}
        source = {k: torch.randn_like(v) for k, v in target.items()}

        def fetch(mb=mb) -> None:
            assert moolib.Subscriber(rpc, "learner", f"w{mb}").fetch() is not None

        def fetch_into(mb=mb, target=target) -> None:
            assert moolib.Subscriber(rpc, "learner", f"w{mb}").fetch_into(target)

        def memcpy(target=target, source=source) -> None:
            for k, v in source.items():
                target[k].copy_(v)

        def user(mb=mb, target=target) -> None:
            got = rpc.sync("learner", f"state_dict{mb}")
            for k, v in got.items():
                target[k].copy_(v)

        row = {name: timed(fn, rounds) for name, fn in
               (("memcpy", memcpy), ("fetch", fetch), ("fetch_into", fetch_into),
                ("sync_state_dict_copy", user))}  # fmt: skip
        rate = mb * (1 << 20) / 1e9 / row["memcpy"]
        print(
            f"| {transport} | {mb} MB | {row['memcpy'] * 1e3:.2f} ms ({rate:.1f} GB/s)"
            f" | {row['fetch'] * 1e3:.2f} ms ({row['fetch'] / row['memcpy']:.2f}x)"
            f" | {row['fetch_into'] * 1e3:.2f} ms ({row['fetch_into'] / row['memcpy']:.2f}x)"
            f" | {row['sync_state_dict_copy'] * 1e3:.2f} ms"
            f" ({row['sync_state_dict_copy'] / row['fetch_into']:.2f}x fetch_into) |",
            flush=True,
        )
    rpc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[4, 40, 400])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--transport", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "learner":
        learner(args.sizes_mb)
        return
    if args.role == "actor":
        actor(args.address, args.transport, args.sizes_mb, args.rounds)
        return
    sizes = [str(s) for s in args.sizes_mb]
    server = subprocess.Popen(
        [sys.executable, __file__, "--role", "learner", "--sizes-mb", *sizes],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    address = server.stdout.readline().strip()
    print(
        "| transport | weights | memcpy (limit) | fetch() (x memcpy) "
        "| fetch_into() (x memcpy) | rpc.sync(state_dict) + copy (x fetch_into) |"
    )
    print("|---|---|---|---|---|---|")
    try:
        for transport in ("shm", "tcp"):
            subprocess.run(
                [sys.executable, __file__, "--role", "actor", "--address", address,
                 "--transport", transport, "--rounds", str(args.rounds),
                 "--sizes-mb", *sizes],
                check=True,
            )  # fmt: skip
    finally:
        server.stdin.close()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
