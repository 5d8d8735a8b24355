"""Parameter publishing benchmark: moolib.Subscriber fetching a learner's weights.

A learner process publishes a weights nest (a state_dict of 8 float32 tensors)
of each size; this process fetches it over shared memory and over TCP and
prints, per size and transport, beside references measured in the same run:

  - fetch(): the nest over the received memory (no copy on this side);
  - fetch_into(model): the weights copied into a model's tensors in place;
  - what a user would do otherwise: ``model.load_state_dict(rpc.sync(learner,
    "state_dict"))`` with the learner returning ``model.state_dict()`` each call;
  - a plain memcpy of the same bytes (np.copyto), the limit: over shared
    memory a fetch copies the weights once into a shared segment (sender) and
    fetch_into once more out of it (receiver);
  - publish(): the snapshot the learner makes once per version.

Usage: python bench/publish.py [--sizes 4,40,400] [--repeats N]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

import moolib

LEARNER = "bench-learner"
PIECES = 8


def weights(mb: float) -> dict[str, torch.Tensor]:
    n = int(mb * 1e6) // 4 // PIECES
    return {f"layer{i}.weight": torch.rand(n) for i in range(PIECES)}


def serve(sizes: list[float]) -> None:
    """The learner: publishes one nest per size, and serves state_dict() the plain way."""
    torch.set_num_threads(1)
    rpc = moolib.Rpc()
    rpc.set_name(LEARNER)
    models = {mb: weights(mb) for mb in sizes}
    publishers = {mb: moolib.Publisher(rpc, f"weights{mb:g}") for mb in sizes}
    publish_times = {}
    for mb, pub in publishers.items():
        times = []
        for _ in range(5):
            t = time.perf_counter()
            pub.publish(models[mb])
            times.append(time.perf_counter() - t)
        publish_times[mb] = statistics.median(times)
    rpc.define("state_dict", lambda mb: models[mb])
    rpc.define("publish_times", lambda: publish_times)
    print(rpc.listen("127.0.0.1:0"), flush=True)
    sys.stdin.read()  # until the client closes our stdin


def connect(address: str, transport: str) -> moolib.Rpc:
    rpc = moolib.Rpc()
    rpc.set_transports([transport])
    rpc.set_timeout(120)
    rpc.connect(address)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # Over shm, the link dialed by TCP address is replaced by a shared-memory one.
        peers = {p["name"]: p for p in rpc.debug_info()["peers"]}
        if any(c["transport"] == transport for c in peers.get(LEARNER, {}).get("connections", [])):
            return rpc
        time.sleep(0.01)
    raise RuntimeError(f"no {transport} link to the learner")


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    faulthandler.dump_traceback_later(
        int(os.environ.get("BENCH_WATCHDOG", "0")) or 10**6, exit=True
    )
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4,40,400", help="weights sizes in MB")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    if args.serve is not None:
        serve(sizes)
        return
    torch.set_num_threads(1)  # as the learner: the copies are single-threaded on both sides

    learner = subprocess.Popen(
        [sys.executable, __file__, "--serve", "1", "--sizes", args.sizes],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    results: dict[tuple[float, str], dict[str, float]] = {}
    try:
        address = learner.stdout.readline().strip()
        rpcs = {t: connect(address, t) for t in ("shm", "tcp")}
        publish_times = rpcs["shm"].sync(LEARNER, "publish_times")
        for mb in sizes:
            model = weights(mb)
            src = np.random.rand(int(mb * 1e6) // 8)
            dst = np.empty_like(src)
            name = f"weights{mb:g}"
            for transport, rpc in rpcs.items():

                def fetch(rpc=rpc, name=name) -> None:
                    # A fresh subscriber holds no version, so each fetch gets the weights.
                    got = moolib.Subscriber(rpc, LEARNER, name).fetch()
                    assert got is not None
                    del got  # gives the shared segment back, as a user would

                def fetch_into(rpc=rpc, name=name, model=model) -> None:
                    assert moolib.Subscriber(rpc, LEARNER, name).fetch_into(model)

                def plain(rpc=rpc, mb=mb, model=model) -> None:
                    state = rpc.sync(LEARNER, "state_dict", mb)
                    for k, t in model.items():
                        t.copy_(state[k])  # what load_state_dict does

                measures = {
                    "memcpy": lambda dst=dst, src=src: np.copyto(dst, src),
                    "fetch": fetch,
                    "fetch_into": fetch_into,
                    "plain": plain,
                }
                for fn in measures.values():  # warm: shared segments, page tables
                    fn()
                samples: dict[str, list[float]] = {k: [] for k in measures}
                for _ in range(args.repeats):  # interleaved: load hits every figure alike
                    for k, fn in measures.items():
                        samples[k].append(timed(fn))
                results[mb, transport] = {k: statistics.median(v) for k, v in samples.items()}
            del model
        for rpc in rpcs.values():
            rpc.close()
    finally:
        learner.stdin.close()
        learner.wait(timeout=60)

    print(
        f"moolib parameter publishing, two processes on {os.cpu_count()} cores "
        f"(medians of {args.repeats} interleaved rounds; ms, and x memcpy of the same bytes)"
    )
    header = f"{'weights':>8} {'transport':>9} {'memcpy':>8} {'fetch':>14} {'fetch_into':>14}"
    print(header + f" {'sync+load':>14} {'sync+load / fetch_into':>24}")
    for (mb, transport), r in results.items():
        mc = r["memcpy"]

        def cell(k: str, r=r, mc=mc) -> str:
            return f"{r[k] * 1e3:8.2f} ({r[k] / mc:4.1f}x)"

        print(
            f"{mb:>6g}MB {transport:>9} {mc * 1e3:8.2f} {cell('fetch'):>14} "
            f"{cell('fetch_into'):>14} {cell('plain'):>14} {r['plain'] / r['fetch_into']:>24.2f}"
        )
    for mb in sizes:
        mc = results[mb, "shm"]["memcpy"]
        print(
            f"publish() of {mb:g} MB (learner side, once per version): "
            f"{publish_times[mb] * 1e3:.2f} ms ({publish_times[mb] / mc:.1f}x memcpy)"
        )


if __name__ == "__main__":
    main()
