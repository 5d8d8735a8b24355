"""Replay benchmark: moolib.Replay beside other replay buffers and memcpy, in one run.

Two workloads at batch 512:
  - CartPole transitions: obs float32[4], action int64, reward float32,
    next_obs float32[4], done bool;
  - Atari transitions: obs/next_obs uint8[4, 84, 84] (consecutive stacked
    frames, so obs and next_obs share 3 of 4 frames and neighbours share the
    rest), action, reward, done; moolib stores the frames deduplicated.

For each: items/s of insert, and of sample + update_priorities, for
  - moolib.Replay in this process (prioritized, alpha 0.6);
  - torchrl's PrioritizedReplayBuffer (LazyTensorStorage, alpha 0.6, beta
    0.4, the same priority updates). Its sampler is torchrl's C++ extension,
    built for one torch release: where it does not load in this interpreter,
    ``--torchrl-python PATH`` runs these rows in another one (a venv with a
    torch/torchrl pair that works), in a worker process that makes the same
    items from the same seeds and runs each round when told, so the rounds
    still interleave; the versions it used are printed;
  - cpprb's PrioritizedReplayBuffer (C++/Cython; for Atari with its
    next_of/stack_compress frame compression);
  - the raw limit: a torch copy of the same bytes (memcpy).
Ratios are moolib's figure over the reference's.

Then the same table served over RPC (shared memory, as on one host): items/s
inserted by 1, 4 and 32 processes at once through ``ReplayClient`` (each
sends its share of the batches, after all have connected, pipelined with
``insert(block=False)``: an actor needs no keys back), and sampled with
priority updates by one process (each update deferred with
``update_priorities(block=False)``, so it travels with the next sample
call; then again with ``prefetch=True``: the next batch is drawn while this
one is updated). The rows "waited" do the same one process, waiting for
every reply (``block=True``, the default). The client processes start once; each
round runs every RPC row once after the in-process backends, and the figures
are medians of the 3 rounds.

Usage: python bench/replay.py [--quick] [--no-rpc] [--torchrl-python PATH]
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# moolib is imported where it is used: the torchrl worker runs in an
# interpreter that may not have it.

BATCH = 512


# --- data -------------------------------------------------------------------


def cartpole_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        obs = rng.standard_normal((BATCH + 1, 4)).astype(np.float32)
        out.append(
            {
                "obs": obs[:-1],
                "action": rng.integers(0, 2, BATCH).astype(np.int64),
                "reward": np.ones(BATCH, dtype=np.float32),
                "next_obs": obs[1:].copy(),
                "done": rng.random(BATCH) < 0.05,
            }
        )
        out[-1]["obs"] = np.ascontiguousarray(out[-1]["obs"])
    return out


def atari_batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Consecutive stacked 84x84 frames of one synthetic episode, every frame distinct."""
    rng = np.random.default_rng(seed)
    background = rng.integers(0, 40, size=(84, 84), dtype=np.uint8)
    steps = n * BATCH
    frames = np.empty((steps + 4, 84, 84), dtype=np.uint8)
    x, y, dx, dy = 40, 20, 2, 3
    for t in range(steps + 4):
        f = frames[t]
        f[:] = background
        x, y = x + dx, y + dy
        if not 2 <= x <= 80:
            dx = -dx
        if not 2 <= y <= 80:
            dy = -dy
        f[y : y + 2, x : x + 2] = 200
        f[0, :4] = np.frombuffer(np.int32(t).tobytes(), dtype=np.uint8)  # a score counter
    out = []
    for b in range(n):
        t0 = b * BATCH
        idx = np.arange(t0, t0 + BATCH)[:, None] + np.arange(4)
        out.append(
            {
                "obs": frames[idx],
                "action": rng.integers(0, 4, BATCH).astype(np.int64),
                "reward": rng.random(BATCH).astype(np.float32),
                "next_obs": frames[idx + 1],
                "done": np.zeros(BATCH, dtype=bool),
            }
        )
    return out


def nbytes(batch: dict[str, np.ndarray]) -> int:
    return sum(v.nbytes for v in batch.values())


# --- backends: each returns (insert items/s, sample+update items/s, note) --------


def timed(fn: Callable[[], Any], items: int) -> float:
    t = time.perf_counter()
    fn()
    return items / (time.perf_counter() - t)


def run_moolib(batches, capacity, atari, samples) -> tuple[float, float, str]:
    import moolib

    replay = moolib.Replay(capacity, alpha=0.6, dedup=("obs", "next_obs") if atari else (), seed=0)
    tensors = [{k: torch.from_numpy(v) for k, v in b.items()} for b in batches]
    prio = torch.rand(BATCH, dtype=torch.float64) + 0.1

    def insert() -> None:
        for b in tensors:
            replay.insert(b, prio)

    def sample() -> None:
        for _ in range(samples):
            s = replay.sample(BATCH)
            replay.update_priorities(s.keys, prio)

    ins = timed(insert, len(batches) * BATCH)
    smp = timed(sample, samples * BATCH)
    info = replay.info()
    return ins, smp, f"{info['bytes_per_item']:.0f} B/item stored"


def torchrl_versions() -> str:
    import tensordict
    import torchrl

    return (
        f"torch {torch.__version__}, torchrl {torchrl.__version__}, "
        f"tensordict {tensordict.__version__}, {sys.executable}"
    )


def torchrl_prioritized(capacity: int) -> Any:
    """torchrl's PrioritizedReplayBuffer, or None where its C++ sampler does not load."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchrl.data import LazyTensorStorage, PrioritizedReplayBuffer
    except ImportError:
        return None
    # torchrl logs every storage it initializes at INFO.
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    try:
        return PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=LazyTensorStorage(capacity))
    except (RuntimeError, ImportError):
        return None


def run_torchrl(batches, capacity, atari, samples) -> tuple[float, float, str] | None:
    """torchrl's PrioritizedReplayBuffer in this process: extend, then sample
    with return_info and update_priority, batch by batch as moolib's rows."""
    rb = torchrl_prioritized(capacity)
    if rb is None:
        return None
    from tensordict import TensorDict

    tds = [
        TensorDict({k: torch.from_numpy(v) for k, v in b.items()}, batch_size=[BATCH])
        for b in batches
    ]
    prio = torch.rand(BATCH) + 0.1

    def insert() -> None:
        # extend() gives new items the largest priority so far; the batch's
        # own priorities (as moolib's insert takes them) are one update more.
        for td in tds:
            rb.update_priority(rb.extend(td), prio)

    def sample() -> None:
        for _ in range(samples):
            _, info = rb.sample(BATCH, return_info=True)
            rb.update_priority(info["index"], prio)

    ins, smp = timed(insert, len(batches) * BATCH), timed(sample, samples * BATCH)
    # It must give back what went in (the check is not timed).
    got, info = rb.sample(8, return_info=True)
    total = len(batches) * BATCH
    for j, i in enumerate(info["index"].tolist()):
        t = i + (total - 1 - i) // capacity * capacity  # the latest item in slot i
        assert np.array_equal(got["obs"][j].numpy(), batches[t // BATCH]["obs"][t % BATCH])
    return ins, smp, "prioritized"


class TorchrlWorker:
    """torchrl's rows run by another interpreter (--torchrl-python): a worker
    process that makes the same items and runs one round per request."""

    def __init__(self, python: str, atari: bool, nbatches: int, capacity: int, samples: int):
        cmd = [python, __file__, "--torchrl-worker", "--batches", str(nbatches)]
        cmd += ["--capacity", str(capacity), "--samples", str(samples)]
        cmd += ["--atari"] if atari else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().strip()
        if not line.startswith("READY "):
            self.proc.kill()
            raise RuntimeError(f"torchrl worker ({python}) did not start: {line!r}")
        self.versions = line.removeprefix("READY ")

    def __call__(self, batches, capacity, atari, samples) -> tuple[float, float, str] | None:
        self.proc.stdin.write("GO\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "RESULT":
            raise RuntimeError(f"torchrl worker failed: {line}")
        return float(line[1]), float(line[2]), "prioritized"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def torchrl_worker(args: argparse.Namespace) -> None:
    """The worker side of TorchrlWorker."""
    batches = atari_batches(args.batches) if args.atari else cartpole_batches(args.batches)
    if torchrl_prioritized(args.capacity) is None:
        print("NO torchrl's PrioritizedReplayBuffer does not load here", flush=True)
        return
    print(f"READY {torchrl_versions()}", flush=True)
    for line in sys.stdin:
        if line.strip() != "GO":
            break
        ins, smp, _ = run_torchrl(batches, args.capacity, args.atari, args.samples)
        print(f"RESULT {ins} {smp}", flush=True)


def run_cpprb(batches, capacity, atari, samples) -> tuple[float, float, str] | None:
    try:
        import cpprb
    except ImportError:
        return None
    env = {
        "obs": {"shape": batches[0]["obs"].shape[1:], "dtype": batches[0]["obs"].dtype},
        "action": {"dtype": np.int64},
        "reward": {},
        "done": {"dtype": np.bool_},
    }
    kwargs: dict[str, Any] = {}
    if atari:
        # cpprb's own compression: next_obs from the next item, stacks shared.
        # It stacks frames on the last axis, so it gets (84, 84, 4) frames.
        kwargs = {"next_of": "obs", "stack_compress": "obs"}
        batches = [
            {
                **b,
                "obs": np.ascontiguousarray(np.moveaxis(b["obs"], 1, -1)),
                "next_obs": np.ascontiguousarray(np.moveaxis(b["next_obs"], 1, -1)),
            }
            for b in batches
        ]
        env["obs"] = {"shape": (84, 84, 4), "dtype": np.uint8}
    else:
        env["next_obs"] = {"shape": 4, "dtype": np.float32}
    rb = cpprb.PrioritizedReplayBuffer(capacity, env, alpha=0.6, **kwargs)
    prio = np.random.default_rng(0).random(BATCH) + 0.1

    def insert() -> None:
        for b in batches:
            rb.add(**b, priorities=prio)

    def sample() -> None:
        for _ in range(samples):
            s = rb.sample(BATCH, beta=0.4)
            rb.update_priorities(s["indexes"], prio)

    ins, smp = timed(insert, len(batches) * BATCH), timed(sample, samples * BATCH)
    # It must give back what went in (the check is not timed).
    s = rb.sample(8, beta=0.4)
    total = len(batches) * BATCH
    for j, i in enumerate(s["indexes"].tolist()):
        t = i + (total - 1 - i) // capacity * capacity  # the latest item in slot i
        for k in ("obs", "next_obs"):
            assert np.array_equal(s[k][j], batches[t // BATCH][k][t % BATCH]), k
    return ins, smp, "next_of/stack_compress" if atari else ""


def run_memcpy(batches, capacity, atari, samples) -> tuple[float, float, str]:
    """The bytes of one batch copied with torch, as an insert and as a sample."""
    src = {k: torch.from_numpy(v) for k, v in batches[0].items()}
    dst = {k: torch.empty_like(v) for k, v in src.items()}
    for k, v in src.items():
        dst[k].copy_(v)  # the pages exist before the clock starts

    rounds = 4 * len(batches)  # short copies: more of them for a stable figure

    def copy_all() -> None:
        for _ in range(rounds):
            for k, v in src.items():
                dst[k].copy_(v)

    rate = timed(copy_all, rounds * BATCH)
    return rate, rate, f"{nbytes(batches[0]) // BATCH} B/item"


BACKENDS: list[tuple[str, Callable[..., tuple[float, float, str] | None]]] = [
    ("torchrl", run_torchrl),
    ("cpprb", run_cpprb),
    ("memcpy", run_memcpy),
]


# --- over RPC ---------------------------------------------------------------------


def make_batches(atari: bool, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    raw = atari_batches(n, seed) if atari else cartpole_batches(n, seed)
    return [{k: torch.from_numpy(v) for k, v in b.items()} for b in raw]


def rpc_client(args: argparse.Namespace) -> None:
    """A child process: inserts its batches, or samples and updates, on each GO."""
    import moolib

    rpc = moolib.Rpc()
    rpc.set_timeout(120)
    rpc.connect(args.address)
    client = moolib.ReplayClient(
        rpc, ("server", "replay"), timeout=300, prefetch=args.role == "prefetch"
    )
    client.info()  # connected (over shared memory once the handshake is done)
    inserting = args.role.startswith("insert")
    batches = make_batches(args.atari, args.batches, args.rank) if inserting else []
    # An actor needs no keys back, and a learner's update needs no count:
    # without "-sync", batches are pipelined and each update rides with the
    # next sample call (flush() waits for the last of them).
    block = args.role.endswith("-sync")
    prio = torch.rand(BATCH, dtype=torch.float64) + 0.1
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "GO":
            break
        t = time.perf_counter()
        if batches:
            for b in batches:
                client.insert(b, prio, block=block)
        else:
            for _ in range(args.batches):
                s = client.sample(BATCH)
                client.update_priorities(s.keys, prio, block=block)
        client.flush()
        print(f"DONE {time.perf_counter() - t}", flush=True)
    rpc.close()


def spawn_clients(address: str, role: str, n: int, atari: bool, batches: int) -> list:
    procs = []
    for rank in range(n):
        cmd = [sys.executable, __file__, "--role", role, "--address", address]
        cmd += ["--rank", str(rank), "--batches", str(batches)] + (["--atari"] if atari else [])
        procs.append(
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    for p in procs:
        assert p.stdout.readline().strip() == "READY"
    return procs


def rpc_round(procs: list, items: int) -> float:
    """Items/s of one GO round, timed from GO to the last DONE."""
    t = time.perf_counter()
    for p in procs:
        p.stdin.write("GO\n")
        p.stdin.flush()
    for p in procs:
        assert p.stdout.readline().startswith("DONE")
    return items / (time.perf_counter() - t)


class RpcRows:
    """The table served by this process over shared memory, and the client
    processes of every RPC row, started once; ``round()`` runs each row once,
    so that the rows' rounds interleave with the in-process backends'."""

    def __init__(self, atari: bool, total_batches: int, samples: int, capacity: int) -> None:
        import moolib

        self.server = moolib.Rpc()
        self.server.set_name("server")
        self.server.set_transports(["shm"])
        address = self.server.listen("127.0.0.1:0")
        dedup = ("obs", "next_obs") if atari else ()
        self.replay = moolib.Replay(capacity, alpha=0.6, dedup=dedup, seed=0)
        self.replay.serve(self.server, "replay")
        self.rows: list[tuple[str, list, int]] = []
        try:
            for n, role, row in (
                (1, "insert-sync", "insert, waited"),
                (1, "insert", "insert, 1 proc"),
                (4, "insert", "insert, 4 proc"),
                (32, "insert", "insert, 32 proc"),
            ):
                per = max(1, total_batches // n)
                procs = spawn_clients(address, role, n, atari, per)
                self.rows.append((row, procs, n * per * BATCH))
            for role, row in (
                ("sample-sync", "s+u, waited"),
                ("sample", "sample+update"),
                ("prefetch", "... prefetch"),
            ):
                procs = spawn_clients(address, role, 1, atari, samples)
                self.rows.append((row, procs, samples * BATCH))
        except BaseException:
            self.close()
            raise
        self.rates: dict[str, list[float]] = {}

    def round(self) -> None:
        for name, procs, items in self.rows:
            self.rates.setdefault(name, []).append(rpc_round(procs, items))

    def medians(self) -> list[tuple[str, float]]:
        return [(name, float(np.median(r))) for name, r in self.rates.items()]

    def close(self) -> None:
        for _, procs, _ in self.rows:
            for p in procs:
                p.stdin.close()
            for p in procs:
                p.wait(timeout=120)
        self.replay.close()
        self.server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer batches")
    parser.add_argument("--no-rpc", action="store_true", help="only the in-process rows")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--address", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--torchrl-python",
        default=None,
        metavar="PATH",
        help="run torchrl's rows in this interpreter (where torchrl's prioritized sampler "
        "does not load in this one)",
    )
    parser.add_argument("--torchrl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--capacity", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--atari", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torchrl_worker:
        torchrl_worker(args)
        return
    if args.role:
        rpc_client(args)
        return
    scale = 4 if args.quick else 1
    workloads = [
        ("CartPole", cartpole_batches(200 // scale), 100_000, False, 200 // scale),
        ("Atari", atari_batches(16 // scale), 8192, True, 40 // scale),
    ]
    print(f"batch {BATCH}; items/s, median of 3 interleaved rounds; ratio = moolib / reference")
    print(f"moolib: torch {torch.__version__}, {sys.executable}")
    if args.torchrl_python is None and torchrl_prioritized(16) is not None:
        print(f"torchrl in this process: {torchrl_versions()}")
    header = f"{'workload':9} {'operation':15} {'backend':9} {'items/s':>12} {'moolib/x':>9}  note"
    print(header)
    print("-" * len(header))
    for name, batches, capacity, atari, samples in workloads:
        results: dict[str, list[tuple[float, float, str]]] = {}
        backends = [("moolib", run_moolib), *BACKENDS]
        worker = None
        if args.torchrl_python:
            worker = TorchrlWorker(args.torchrl_python, atari, len(batches), capacity, samples)
            print(f"{name:9} torchrl in a worker: {worker.versions}")
            backends[1] = ("torchrl", worker)
        rpc = None if args.no_rpc else RpcRows(atari, len(batches), samples, capacity)
        # Rounds interleave the backends, so the machine's load moves them alike.
        for _ in range(3):
            for backend, fn in backends:
                r = fn(batches, capacity, atari, samples)
                if r is not None:
                    results.setdefault(backend, []).append(r)
            if rpc is not None:
                rpc.round()
        if worker is not None:
            worker.close()
        if rpc is not None:
            rpc.close()
        med = {}
        for b, rs in results.items():
            ins, smp = (float(np.median([r[i] for r in rs])) for i in (0, 1))
            med[b] = (ins, smp, rs[0][2])
        ours = med["moolib"]
        for op, i in (("insert", 0), ("sample+update", 1)):
            for backend, m in med.items():
                ratio = "" if backend == "moolib" else f"{ours[i] / m[i]:9.2f}"
                print(f"{name:9} {op:15} {backend:9} {m[i]:12,.0f} {ratio:>9}  {m[2]}")
        missing = [b for b, _ in BACKENDS if b not in med]
        if missing:
            print(
                f"{name:9} (not here: {', '.join(missing)}; torchrl's row needs its "
                "prioritized sampler: see --torchrl-python)"
            )
        if rpc is None:
            continue
        for op, rate in rpc.medians():
            i = 0 if op.startswith("insert") else 1
            refs = "  ".join(f"{rate / m[i]:.2f}x {b}" for b, m in med.items())
            print(f"{name:9} {op:15} {'rpc, shm':9} {rate:12,.0f} {'':>9}  ({refs})")


if __name__ == "__main__":
    main()
