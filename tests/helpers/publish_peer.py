"""A learner or an actor in its own process, for tests/test_publish.py.

learner: publish_peer.py learner NAME [--transports T] [--start V] [--count K] [--kb N]
                         [--serves S]
    Listens on 127.0.0.1:0, prints ``READY <name> <address>``, then waits for
    a line ``GO`` on stdin and publishes versions start+1 .. start+K of
    ``weights(version)`` under "weights". Each next version waits until S
    fetches (1 by default) got the previous one (or 2 s passed), so that
    actors see many.
    Prints ``PUBLISHED <last>`` and serves until stdin closes.

actor: publish_peer.py actor NAME --connect ADDR --peer LEARNER --until V [--transports T]
    Fetches "weights" from LEARNER in a loop, alternating fetch() and
    fetch_into(), until it holds version V. Checks that versions never go back
    and that every value of every leaf equals the version; then that a further
    fetch gets nothing newer. Prints ``DONE <distinct versions seen> <transports>``
    or ``FAIL <why>`` (exit 1).

refetch: publish_peer.py refetch NAME --connect ADDR --peer LEARNER --times N --expect V
    N fetches, each by a fresh Subscriber (so each gets the whole snapshot),
    each checked to be version V with every value equal to ``--value``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch

import moolib


def weights(version: float, kb: int) -> dict:
    """A nest of several dtypes and both libraries, every value equal to ``version``."""
    n = kb * 1024 // 4
    return {
        "w": torch.full((n // 2, 2), float(version)),
        "b": torch.full((3,), version, dtype=torch.int64),
        "h": torch.full((5, 7), float(version), dtype=torch.bfloat16),
        "t": torch.full((4, 6), float(version)).t(),  # non-contiguous
        "np": np.full(n // 4, version, dtype=np.float64),
        "list": [torch.full((2,), version, dtype=torch.int32), np.full(3, version, np.int16)],
        "step": int(version),
    }


def check(nest: dict, version: int, step: bool = True) -> str | None:
    """Why ``nest`` is not ``weights(version)``, or None (``step``: check the
    Python value too, which fetch_into does not write)."""
    if step and nest["step"] != version:
        return f"step {nest['step']} in version {version}"
    leaves = [nest["w"], nest["b"], nest["h"], nest["t"], nest["np"], *nest["list"]]
    for i, leaf in enumerate(leaves):
        values = leaf.float().unique().tolist() if torch.is_tensor(leaf) else np.unique(leaf)
        if len(values) != 1 or values[0] != version:
            return f"leaf {i} holds {list(values)[:5]} in version {version}"
    return None


def connect(rpc: moolib.Rpc, address: str, peer: str, transports: str | None) -> list:
    rpc.connect(address)
    deadline = time.monotonic() + 60
    want = transports.split(",")[0] if transports else None
    while time.monotonic() < deadline:
        links = [
            c["transport"]
            for p in rpc.debug_info()["peers"]
            if p["name"] == peer
            for c in p["connections"]
        ]
        if links and (want is None or want in links):
            return sorted(links)
        time.sleep(0.02)
    raise SystemExit(f"FAIL no link to {peer}")


def learner(args: argparse.Namespace, rpc: moolib.Rpc) -> None:
    pub = moolib.Publisher(rpc, "weights", version=args.start)
    print("READY", args.name, rpc.listen("127.0.0.1:0"), flush=True)
    if sys.stdin.readline().strip() != "GO":
        return
    for version in range(args.start + 1, args.start + args.count + 1):
        served = pub.stats()["served"]
        pub.publish(weights(version, args.kb))
        # A subscriber is served each version once at most: --serves N waits (2 s at most)
        # until N of them have it.
        deadline = time.monotonic() + 2
        while pub.stats()["served"] < served + args.serves and time.monotonic() < deadline:
            time.sleep(0.001)
    print("PUBLISHED", pub.version, flush=True)
    sys.stdin.read()


def actor(args: argparse.Namespace, rpc: moolib.Rpc) -> None:
    links = connect(rpc, args.connect, args.peer, args.transports)
    sub = moolib.Subscriber(rpc, args.peer, "weights", timeout=60)
    model = weights(-1, args.kb)
    seen = []
    print("READY", args.name, "-", flush=True)
    deadline = time.monotonic() + 120
    use_into = False
    while sub.version < args.until:
        if time.monotonic() > deadline:
            raise SystemExit(f"FAIL stuck at version {sub.version}")
        before = sub.version
        if use_into:
            got = sub.fetch_into(model)
            version = sub.version if got else None
            nest = model
        else:
            got = sub.fetch()
            version, nest = got if got is not None else (None, None)
        if version is None:
            use_into = not use_into
            if sub.version != before:
                raise SystemExit(f"FAIL version moved from {before} to {sub.version} on nothing")
            continue
        if version <= before or sub.version != version:
            raise SystemExit(f"FAIL version went from {before} to {version} ({sub.version})")
        why = check(nest, version, step=not use_into)
        if why:
            raise SystemExit(f"FAIL {why}")
        seen.append(version)
        use_into = not use_into
    if sub.fetch() is not None or sub.fetch_into(model) or sub.version != args.until:
        raise SystemExit("FAIL a fetch at the latest version got something")
    print("DONE", len(set(seen)), ",".join(links), flush=True)
    sys.stdin.read()


def refetch(args: argparse.Namespace, rpc: moolib.Rpc) -> None:
    connect(rpc, args.connect, args.peer, args.transports)
    print("READY", args.name, "-", flush=True)
    errors = []

    def run(n: int) -> None:
        for _ in range(n):
            got = moolib.Subscriber(rpc, args.peer, "weights", timeout=60).fetch()
            if got is None or got[0] != args.expect:
                errors.append(f"got {None if got is None else got[0]}")
                return
            why = check(got[1], args.value)
            if why:
                errors.append(why)
                return

    # Concurrent fetches from this process too, not only across processes.
    threads = [threading.Thread(target=run, args=(args.times // 2,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"FAIL {errors[0]}" if errors else "DONE", flush=True)
    sys.stdin.read()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["learner", "actor", "refetch"])
    parser.add_argument("name")
    parser.add_argument("--transports", default=None)
    parser.add_argument("--connect", default=None)
    parser.add_argument("--peer", default=None)
    parser.add_argument("--start", type=int, default=-1)
    parser.add_argument("--count", type=int, default=30)
    parser.add_argument("--serves", type=int, default=1)
    parser.add_argument("--until", type=int, default=0)
    parser.add_argument("--times", type=int, default=20)
    parser.add_argument("--expect", type=int, default=0)
    parser.add_argument("--value", type=int, default=0)
    parser.add_argument("--kb", type=int, default=512)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rpc = moolib.Rpc()
    rpc.set_name(args.name)
    rpc.set_timeout(60)
    if args.transports:
        rpc.set_transports(args.transports.split(","))
    try:
        {"learner": learner, "actor": actor, "refetch": refetch}[args.role](args, rpc)
    except SystemExit as e:
        print(e.code if isinstance(e.code, str) else f"FAIL exit {e.code}", flush=True)
        raise SystemExit(1) from None
    finally:
        rpc.close()


if __name__ == "__main__":
    main()
