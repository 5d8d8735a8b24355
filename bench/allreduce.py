"""All-reduce benchmark: moolib Group.all_reduce beside torch.distributed (gloo).

For every peer count (separate processes on this host) and every size (float32
elements), each worker process joins a moolib group and a torch.distributed gloo
process group over 127.0.0.1, checks once that both sum correctly, warms up, then
times both in interleaved rounds (alternate blocks, the order swapped every
round) so load from elsewhere on the machine hits both alike:

  - moolib: ``group.all_reduce("x", tensor).result()`` (returns a new tensor);
  - gloo:   ``dist.all_reduce(tensor)`` (in place).

A block starts after a gloo barrier, runs k back-to-back all-reduces (k chosen
per size so a block takes a while) and records its time / k; a round's figure
is the largest over the processes (the op is done when the last one is). The
table gives the median and min over rounds, and the ratio moolib/gloo of the
medians.

Usage: python bench/allreduce.py [--peers 2,4] [--sizes 1K,1M,16M] [--repeats N] [--json]
BENCH_WATCHDOG=seconds bounds the whole run (default 600): past it, every
process is killed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

DEFAULT_WATCHDOG = 600
# Targets and the reference of the original moolib (1M floats, 4 peers, on these machines).
TARGET_RATIO = 1.0  # moolib/gloo, from 1M elements up
TARGET_1M_4_MS = 2.5
ORIGINAL_1M_4_MS = 10.8
ORIGINAL_GLOO_1M_4_MS = 13.7


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def size_name(n: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def batch_size(n: int) -> int:
    """All-reduces per timed block: enough that a block is not just the barrier's skew."""
    return max(1, min(100, (4 << 20) // max(n, 1)))


# --- worker -------------------------------------------------------------------


def wait_for_group(group, world: int) -> None:
    """Waits until every worker sees the same complete, ordered membership.

    A member learns of a change only with its own next ping of the broker (up
    to a second apart), so one worker may already see all the others while
    another still sees fewer (and would sum alone) or another sync id. So: wait
    for the expected order and a sync id that has stayed put for longer than
    the ping interval, then check with the others (over gloo) that they all
    hold that same sync id; all go on together or all wait again.
    """
    import torch
    import torch.distributed as dist

    want = [f"w{r}" for r in range(world)]
    deadline = time.time() + 60
    while True:
        stable_since, sync_id = time.time(), None
        while True:
            if time.time() > deadline:
                raise RuntimeError(f"moolib group never settled on {want}: {group.members()}")
            group.update()
            now_id = group.sync_id()
            if not (group.active() and group.members() == want) or now_id != sync_id:
                stable_since, sync_id = time.time(), now_id
            elif time.time() - stable_since > 1.2:
                break
            time.sleep(0.01)
        ids = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
        mine = torch.tensor([sync_id >> 32, sync_id & 0xFFFFFFFF], dtype=torch.int64)
        dist.all_gather(ids, mine)
        ok = all(torch.equal(i, ids[0]) for i in ids) and group.sync_id() == sync_id
        agreed = torch.tensor([int(ok)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # all go on, or all wait again
        if agreed.item():
            return


def measure(group, rank: int, world: int, n: int, repeats: int) -> dict:
    """Checks both all-reduces once on n elements, then times them in interleaved rounds."""
    import torch
    import torch.distributed as dist

    def moolib_op(t):
        group.update()  # as a training loop does: a member that stops calling it leaves
        return group.all_reduce("x", t).result()

    # Integer values: sums are exact in float32, so the check can be strict.
    base = torch.arange(n, dtype=torch.float32).remainder_(13)
    data = base + rank
    expected = base * world + world * (world - 1) // 2
    got_moolib = moolib_op(data)
    got_gloo = data.clone()
    dist.all_reduce(got_gloo)
    errors = []
    if not torch.equal(got_moolib, expected):
        bad = int((got_moolib != expected).sum())
        errors.append(f"moolib: {bad} of {n} elements wrong")
    if not torch.equal(got_gloo, expected):
        bad = int((got_gloo != expected).sum())
        errors.append(f"gloo: {bad} of {n} elements wrong")
    if not torch.equal(data, base + rank):
        errors.append("moolib changed its input tensor")

    k = batch_size(n)
    spare = [data.clone() for _ in range(k)]  # gloo sums in place: fresh copies per block

    def moolib_block():
        dist.barrier()
        t = time.perf_counter()
        for _ in range(k):
            moolib_op(data)
        return (time.perf_counter() - t) / k

    def gloo_block():
        for s in spare:
            s.copy_(data)
        dist.barrier()
        t = time.perf_counter()
        for s in spare:
            dist.all_reduce(s)
        return (time.perf_counter() - t) / k

    for _ in range(2):  # warm-up
        moolib_block()
        gloo_block()
    samples = {"moolib": [], "gloo": []}
    order = [("moolib", moolib_block), ("gloo", gloo_block)]
    for r in range(repeats):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            samples[name].append(fn())
    return {"batch": k, "errors": errors, **samples}


def worker(rank: int, world: int, broker: str, port: int, sizes: list[int], repeats: int) -> None:
    # Exit if the parent goes away (its end of our stdin closes).
    def orphan_guard() -> None:
        sys.stdin.read()
        os._exit(3)

    threading.Thread(target=orphan_guard, daemon=True).start()
    faulthandler.dump_traceback_later(
        int(os.environ.get("BENCH_WATCHDOG", "0")) or DEFAULT_WATCHDOG, exit=True
    )

    import torch
    import torch.distributed as dist

    import moolib

    torch.set_num_threads(1)

    rpc = moolib.Rpc()
    rpc.set_name(f"w{rank}")
    rpc.connect(broker)
    group = moolib.Group(rpc, f"bench{world}")
    group.set_sort_order(rank)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    wait_for_group(group, world)

    results = {n: measure(group, rank, world, n, repeats) for n in sizes}

    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "results": results}), flush=True)
    group.close()
    rpc.close()
    sys.stdout.flush()
    os._exit(0)  # skip slow interpreter teardown; all output is flushed


# --- parent -------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Children:
    """Worker processes, killed on exit, Ctrl-C or the watchdog."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.expired = False  # set by the watchdog, which then ends the run
        self.lock = threading.Lock()

    def spawn(self, args: list[str]) -> subprocess.Popen:
        env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        with self.lock:
            self.procs.append(p)
        return p

    def kill_all(self) -> None:
        with self.lock:
            procs = list(self.procs)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def run_peers(
    children: Children, broker_addr: str, world: int, sizes: list[int], repeats: int
) -> dict:
    port = free_port()
    procs = [
        children.spawn(
            [
                "--worker",
                str(rank),
                str(world),
                broker_addr,
                str(port),
                ",".join(map(str, sizes)),
                str(repeats),
            ]
        )
        for rank in range(world)
    ]
    # Not communicate(): that closes the workers' stdin, which tells them to exit.
    outputs = [p.stdout.read() for p in procs]
    for p in procs:
        p.wait()
    failed = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{world} peers: workers failed (rank, exit code): {failed}")
    per_rank = [json.loads(out.strip().splitlines()[-1])["results"] for out in outputs]
    figures = {}
    for n in sizes:
        key = str(n)
        entry = {"errors": sorted({e for r in per_rank for e in r[key]["errors"]})}
        entry["batch"] = per_rank[0][key]["batch"]
        for impl in ("moolib", "gloo"):
            # A round's figure is the slowest process's: the op is done when all are.
            rounds = [max(r[key][impl][i] for r in per_rank) for i in range(repeats)]
            entry[impl] = {
                "median_ms": statistics.median(rounds) * 1e3,
                "min_ms": min(rounds) * 1e3,
                "rounds_ms": [x * 1e3 for x in rounds],
            }
        entry["ratio"] = entry["moolib"]["median_ms"] / entry["gloo"]["median_ms"]
        figures[n] = entry
    return figures


def target_text(world: int, n: int, entry: dict) -> str:
    notes = []
    if entry["errors"]:
        notes.append("WRONG RESULT: " + "; ".join(entry["errors"]))
    if n >= 1 << 20:
        ok = entry["ratio"] <= TARGET_RATIO
        notes.append(f"ratio<={TARGET_RATIO:.1f} {'ok' if ok else 'MISSED'}")
    if world == 4 and n == 1 << 20:
        ok = entry["moolib"]["median_ms"] <= TARGET_1M_4_MS
        notes.append(f"<={TARGET_1M_4_MS} ms {'ok' if ok else 'MISSED'}")
    return ", ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", default="2,4", help="peer counts, comma-separated")
    parser.add_argument("--sizes", default="1K,1M,16M", help="float32 elements (K/M suffixes)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved rounds per figure")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    peers = [int(p) for p in args.peers.split(",")]
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if min(peers) < 2 or args.repeats < 1:
        parser.error("need at least 2 peers and 1 repeat")

    import moolib

    children = Children()
    limit = int(os.environ.get("BENCH_WATCHDOG", "0")) or DEFAULT_WATCHDOG

    def watchdog() -> None:
        children.expired = True
        print(f"allreduce bench: watchdog: over {limit} s, killing everything", file=sys.stderr)
        children.kill_all()
        os._exit(2)

    timer = threading.Timer(limit, watchdog)
    timer.daemon = True
    timer.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    broker = moolib.Broker()
    broker_addr = broker.listen("127.0.0.1:0")
    stop = threading.Event()

    def serve_broker() -> None:
        while not stop.wait(0.1):
            broker.update()

    threading.Thread(target=serve_broker, daemon=True).start()
    started = time.time()
    results = {}
    try:
        for world in peers:
            results[world] = run_peers(children, broker_addr, world, sizes, args.repeats)
    except KeyboardInterrupt:
        print("allreduce bench: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception:
        if children.expired:  # the workers were killed: the watchdog reports and exits
            time.sleep(60)
        raise
    finally:
        children.kill_all()
        stop.set()
        broker.close()
        timer.cancel()
    elapsed = time.time() - started

    if args.json:
        print(
            json.dumps(
                {
                    "cores": os.cpu_count(),
                    "repeats": args.repeats,
                    "elapsed_s": elapsed,
                    "results": [
                        {"peers": w, "elements": n, **entry, "notes": target_text(w, n, entry)}
                        for w, by_size in results.items()
                        for n, entry in by_size.items()
                    ],
                    "targets": {
                        "ratio_from_1M": TARGET_RATIO,
                        "moolib_1M_4_peers_ms": TARGET_1M_4_MS,
                    },
                    "reference_original_moolib": {
                        "moolib_1M_4_peers_ms": ORIGINAL_1M_4_MS,
                        "gloo_1M_4_peers_ms": ORIGINAL_GLOO_1M_4_MS,
                    },
                },
                indent=1,
            )
        )
        return

    print(
        f"all-reduce of float32 tensors, peers in separate processes on {os.cpu_count()} cores, "
        f"over 127.0.0.1 (ms per all-reduce, slowest process; median/min of "
        f"{args.repeats} interleaved rounds; {elapsed:.0f} s)"
    )
    header = (
        f"{'peers':>5}{'elements':>9}{'k':>5}{'moolib med':>12}{'min':>9}"
        f"{'gloo med':>11}{'min':>9}{'ratio':>7}  targets"
    )
    print(header)
    any_error = False
    for world, by_size in results.items():
        for n, e in by_size.items():
            any_error |= bool(e["errors"])
            m, g = e["moolib"], e["gloo"]
            print(
                f"{world:>5}{size_name(n):>9}{e['batch']:>5}{m['median_ms']:>12.3f}"
                f"{m['min_ms']:>9.3f}{g['median_ms']:>11.3f}{g['min_ms']:>9.3f}"
                f"{e['ratio']:>7.3f}  {target_text(world, n, e)}"
            )
    print(
        f"targets: moolib/gloo <= {TARGET_RATIO:.1f} from 1M elements up; 1M floats, 4 peers "
        f"<= {TARGET_1M_4_MS} ms"
    )
    ratio = ORIGINAL_1M_4_MS / ORIGINAL_GLOO_1M_4_MS
    print(
        f"original moolib on these machines, 1M floats, 4 peers: {ORIGINAL_1M_4_MS} ms "
        f"(gloo {ORIGINAL_GLOO_1M_4_MS} ms there, ratio {ratio:.2f})"
    )
    print("k: all-reduces per timed block (after a gloo barrier)")
    if any_error:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, broker, port, sizes, repeats = sys.argv[2:8]
        worker(
            int(rank),
            int(world),
            broker,
            int(port),
            [int(s) for s in sizes.split(",")],
            int(repeats),
        )
    else:
        main()
