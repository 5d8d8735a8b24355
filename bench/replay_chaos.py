"""Replay at scale under shard failures: shards killed (kill -9) and restarted from
their checkpoints while many actor clients insert and sample.

One run has two phases with the same load: a reference (no faults), then the
chaos phase, in which every ``--fault-every`` seconds (random in a range,
seeded) one living shard is killed with SIGKILL and, ``--down`` seconds
later, started again from the checkpoint it last wrote (``Replay.save``, one
every ``--checkpoint-every`` seconds: a temporary file, fsynced, renamed).

Each shard is its own process serving a uniform ``moolib.Replay`` as
``table`` under the peer name ``shard<i>`` at a fixed port; each client is its
own process with one ``ReplayClient`` over all the shards, inserting a batch
(``block=True``: it keeps the keys) and sampling a batch, in turn. Every item
is ``{"id": int64, "payload": uint8[P]}``, the id unique in the run
(``client << 40 | sequence``) and the payload a function of it. Each client
keeps a ledger: for every insert, its ids, the keys acknowledged (with the
shard in their top bits) or the error raised; for every sample, the keys and
ids it got and when. Each shard says when it started, which checkpoint
counter (its insertion counter's tail) it restored, and when it was killed.
A fresh shard saves its empty table before it serves, so every restart is a
load, which gives the keys it hands out a new incarnation.

What is checked, from the ledgers (all times are CLOCK_MONOTONIC, one clock
for every process of the host):

- every sampled item is the item its key was acknowledged for (or one whose
  insert raised), with its payload intact;
- no sampled item comes from a dead shard's memory: an item acknowledged by
  incarnation g of a shard with an insertion counter (the key's low 40
  bits) at or past the tail that incarnation g+1 restored existed only in
  g's memory, and is never sampled after g+1 started;
- no key is acknowledged twice (a restored shard hands out the keys of the
  items it lost again only if its keys do not tell its incarnations apart);
- every acknowledged insert is in its shard's table at the end
  (``update_priorities`` counts the keys present) or was lost with its shard
  (acknowledged after that shard's last checkpoint before it was killed):
  those are counted and printed;
- per restart: how long until the restarted shard took inserts and samples
  again, and until the clients' aggregate throughput was back to 80% of what
  it was before the kill (the target is 5 s);
- the throughput of the chaos phase beside the reference's.

Usage:
  python bench/replay_chaos.py [--shards 8] [--clients 32] [--duration 300]
      [--reference 60] [--fault-every 10:20] [--down 1:3] [--checkpoint-every 5]
      [--seed 0] [--json PATH]
Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SHIFT = 56  # a ReplayClient key: shard index in the top bits
LOCAL = (1 << SHIFT) - 1
COUNTER = (1 << 40) - 1  # a table's key: its incarnation, then this insertion counter
ID_SHIFT = 40  # an item id: client index in the top bits, its sequence number below
RECOVERY_TARGET = 5.0
RECOVERED_FRACTION = 0.8


def now() -> float:
    return time.monotonic()


def payload_of(ids: np.ndarray, size: int) -> np.ndarray:
    """The payload rows of ``ids``: a function of each id, so a torn item shows."""
    cols = np.arange(size, dtype=np.int64)
    return ((ids[:, None] * 7 + cols[None, :]) % 251).astype(np.uint8)


# --- a shard ---------------------------------------------------------------


def shard_main(args: argparse.Namespace) -> None:
    """Serves one table; restores it from ``--checkpoint`` where the file exists."""
    started = now()
    import moolib
    import moolib.replay.table  # torch: part of the process's start, not of the restore

    rpc = moolib.Rpc()
    rpc.set_name(f"shard{args.index}")
    rpc.set_timeout(args.rpc_timeout)
    address = f"127.0.0.1:{args.port}"
    deadline = now() + 60
    while True:  # the port may be held for a moment after a kill
        try:
            rpc.listen(address)
            break
        except Exception:  # noqa: BLE001
            if now() > deadline:
                raise
            time.sleep(0.05)
    listening = now()
    path = Path(args.checkpoint)
    if path.exists():
        replay = moolib.Replay.load(path)
    else:
        replay = moolib.Replay(args.capacity, selector="uniform", seed=args.index)
        # Before any key is handed out: a restart then loads, as a new incarnation.
        replay.save(path)
    info = replay.info()
    replay.serve(rpc, "table")
    # The tail: the insertion counter of the table's next item.
    print(f"READY {started} {now()} {info['inserts']} {info['size']} {listening}", flush=True)
    next_save = now() + args.checkpoint_every
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], max(0.0, next_save - now()))
        if ready and not sys.stdin.readline():
            break
        if now() >= next_save:
            t0 = now()
            replay.save(path)
            print(f"CKPT {t0} {now()}", flush=True)
            next_save = t0 + args.checkpoint_every
    replay.close()
    rpc.close()


# --- a client ---------------------------------------------------------------


def client_main(args: argparse.Namespace) -> None:
    """Inserts and samples in turn until ``--until``; writes its ledger."""
    import moolib

    rpc = moolib.Rpc()
    rpc.set_name(f"client{args.index}")
    rpc.set_timeout(args.rpc_timeout)
    ports = [int(p) for p in args.ports.split(",")]
    for port in ports:
        rpc.connect(f"127.0.0.1:{port}")
    client = moolib.ReplayClient(
        rpc,
        [(f"shard{i}", "table") for i in range(len(ports))],
        timeout=args.call_timeout,
        seed=args.index,
    )
    # Paid before the clock starts: torch's import (the client's tensors) and
    # the first connection to every shard.
    import moolib.replay.schema  # noqa: F401

    deadline = now() + 600
    for i in range(len(ports)):
        while True:
            try:
                rpc.sync(f"shard{i}", "table/info")
                break
            except moolib.RpcError:
                if now() > deadline:
                    raise
    base = args.index << ID_SHIFT
    seq = 0
    ins_meta: list[tuple[float, float, float, float, float]] = []  # first id, n, sent, done, ok
    ins_keys: list[np.ndarray] = []
    raised: list[str] = []
    smp_meta: list[tuple[float, float, float]] = []  # started, done, n
    smp_keys: list[np.ndarray] = []
    smp_ids: list[np.ndarray] = []
    smp_errors: list[str] = []
    torn = 0
    longest = 0.0
    print("READY", flush=True)
    until = float(sys.stdin.readline().split()[1])  # "go UNTIL"
    n = args.batch
    inserted_once = False
    while now() < until:
        ids = np.arange(base + seq, base + seq + n, dtype=np.int64)
        seq += n
        batch = {"id": ids, "payload": payload_of(ids, args.payload)}
        t0 = now()
        try:
            keys = client.insert(batch)
            ok = 1.0
            ins_keys.append(keys.numpy().astype(np.int64))
            inserted_once = True
        except Exception as e:  # noqa: BLE001 - raised to the caller: recorded
            ok = 0.0
            raised.append(f"{type(e).__name__}: {e}")
        t1 = now()
        longest = max(longest, t1 - t0)
        ins_meta.append((float(ids[0]), float(n), t0, t1, ok))
        if not inserted_once or seq < n * len(ports):
            continue  # every shard gets items before anyone samples
        t0 = now()
        try:
            s = client.sample(args.batch)
            got = s.items["id"].numpy().copy()
            bad = payload_of(got, args.payload) != s.items["payload"].numpy()
            torn += int(bad.any(axis=1).sum())
            smp_keys.append(s.keys.numpy().copy())
            smp_ids.append(got)
            smp_meta.append((t0, now(), float(len(got))))
            del s
        except Exception as e:  # noqa: BLE001
            smp_errors.append(f"{type(e).__name__}: {e}")
        longest = max(longest, now() - t0)

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    np.savez(
        args.ledger,
        ins_meta=np.array(ins_meta, dtype=np.float64).reshape(-1, 5),
        ins_keys=cat(ins_keys),
        smp_meta=np.array(smp_meta, dtype=np.float64).reshape(-1, 3),
        smp_keys=cat(smp_keys),
        smp_ids=cat(smp_ids),
        stats=np.array([torn, longest]),
    )
    Path(args.ledger + ".errors.json").write_text(
        json.dumps({"insert": raised, "sample": smp_errors})
    )
    print("DONE", flush=True)
    rpc.close()
    print("CLOSED", flush=True)


# --- the orchestrator --------------------------------------------------------


@dataclass
class Incarnation:
    spawned: float
    ready: float = 0.0
    listening: float = 0.0  # when its Rpc listened (the process's start-up before)
    tail: int = 0  # the key tail it restored (0: a fresh table)
    size: int = 0
    killed: float = float("inf")
    checkpoints: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Shard:
    index: int
    port: int
    checkpoint: Path
    proc: Any = None
    lives: list[Incarnation] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own(role: str, args: argparse.Namespace, *extra: str) -> list[str]:
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--role",
        role,
        "--rpc-timeout",
        str(args.rpc_timeout),
        *extra,
    ]


def read_line(proc: subprocess.Popen, what: str, timeout: float = 120.0) -> str:
    deadline = now() + timeout
    while now() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            return line.strip()
        if proc.poll() is not None:
            break
    raise RuntimeError(f"{what}: no answer (exit status {proc.poll()})")


def start_shard(shard: Shard, args: argparse.Namespace) -> None:
    life = Incarnation(spawned=now())
    shard.proc = subprocess.Popen(
        own(
            "shard",
            args,
            "--index",
            str(shard.index),
            "--port",
            str(shard.port),
            "--checkpoint",
            str(shard.checkpoint),
            "--capacity",
            str(args.capacity),
            "--checkpoint-every",
            str(args.checkpoint_every),
        ),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = read_line(shard.proc, f"shard {shard.index}").split()
    if line[0] != "READY":
        raise RuntimeError(f"shard {shard.index}: {line}")
    life.ready, life.tail, life.size = float(line[2]), int(line[3]), int(line[4])
    life.listening = float(line[5])
    shard.lives.append(life)


def drain_shard(shard: Shard) -> None:
    """Reads the checkpoint lines a living shard printed so far."""
    while select.select([shard.proc.stdout], [], [], 0)[0]:
        line = shard.proc.stdout.readline()
        if not line:
            return
        parts = line.split()
        if parts and parts[0] == "CKPT":
            shard.lives[-1].checkpoints.append((float(parts[1]), float(parts[2])))


def kill_shard(shard: Shard) -> None:
    drain_shard(shard)
    shard.lives[-1].killed = now()
    shard.proc.send_signal(signal.SIGKILL)
    shard.proc.wait()


def stop_shard(shard: Shard) -> None:
    drain_shard(shard)
    shard.proc.stdin.close()
    try:
        shard.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        shard.proc.kill()
        shard.proc.wait()


def run_phase(args: argparse.Namespace, workdir: Path, duration: float, chaos: bool) -> dict:
    """Starts the shards and the clients, runs ``duration`` seconds (with faults
    when ``chaos``), checks the tables, stops everything; returns the record."""
    rng = random.Random(args.seed)
    name = "chaos" if chaos else "reference"
    phase_dir = workdir / name
    phase_dir.mkdir()
    shards = [Shard(i, free_port(), phase_dir / f"shard{i}.ckpt") for i in range(args.shards)]
    clients: list[subprocess.Popen] = []
    faults: list[dict] = []
    try:
        for shard in shards:
            start_shard(shard, args)
        ports = ",".join(str(s.port) for s in shards)
        for c in range(args.clients):
            clients.append(
                subprocess.Popen(
                    own(
                        "client",
                        args,
                        "--index",
                        str(c),
                        "--ports",
                        ports,
                        "--ledger",
                        str(phase_dir / f"client{c}.npz"),
                        "--batch",
                        str(args.batch),
                        "--payload",
                        str(args.payload),
                        "--call-timeout",
                        str(args.call_timeout),
                    ),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for c, proc in enumerate(clients):
            # 32 processes importing torch at once on a loaded machine: minutes.
            if read_line(proc, f"client {c}", timeout=600) != "READY":
                raise RuntimeError(f"client {c} did not start")
        begun = now()
        until = begun + duration
        for proc in clients:
            proc.stdin.write(f"go {until}\n")
            proc.stdin.flush()
        # Faults stop early enough for the last restart's recovery to show.
        quiet = until - args.quiet
        while chaos:
            wait = rng.uniform(*args.fault_every)
            if now() + wait + args.down[1] > quiet:
                break
            time.sleep(wait)
            for shard in shards:
                drain_shard(shard)
            shard = rng.choice(shards)
            kill_shard(shard)
            time.sleep(rng.uniform(*args.down))
            start_shard(shard, args)
            life = shard.lives[-1]
            faults.append(
                {
                    "shard": shard.index,
                    "killed": shard.lives[-2].killed,
                    "ready": life.ready,
                    "restored_tail": life.tail,
                }
            )
            print(
                f"  t={life.ready - begun:6.1f}s shard {shard.index} killed, back after "
                f"{life.ready - shard.lives[-2].killed:.1f} s with {life.size} items "
                f"(key tail {life.tail}; process start {life.listening - life.spawned:.1f} s, "
                f"restore {life.ready - life.listening:.1f} s)",
                flush=True,
            )
        for c, proc in enumerate(clients):
            line = read_line(proc, f"client {c}", timeout=max(60.0, until - now() + 120))
            if line != "DONE":
                raise RuntimeError(f"client {c}: {line}")
        # How long each client takes to close its Rpc and exit (not part of the checks).
        exits = []
        t0 = now()
        for c, proc in enumerate(clients):
            left = max(1.0, t0 + 60 - now())
            try:
                closed = read_line(proc, f"client {c} closing", timeout=left) == "CLOSED"
                proc.wait(timeout=max(1.0, t0 + 60 - now()))
            except (RuntimeError, subprocess.TimeoutExpired):
                closed = False
                proc.kill()
                proc.wait()
            exits.append((c, closed, now() - t0))
        ledgers = [load_ledger(phase_dir / f"client{c}.npz") for c in range(args.clients)]
        present = check_tables(shards, ledgers, args)
        for shard in shards:
            drain_shard(shard)
        stale = stale_temporaries(phase_dir)
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for shard in shards:
            if shard.proc is not None and shard.proc.poll() is None:
                stop_shard(shard)
    return {
        "name": name,
        "begun": begun,
        "until": until,
        "shards": shards,
        "ledgers": ledgers,
        "faults": faults,
        "present": present,
        "stale_tmp": stale,
        "exits": exits,
    }


def stale_temporaries(directory: Path) -> list[str]:
    """Checkpoint temporaries (``<path>.tmp.<pid>.<n>``) whose writer is dead:
    left by a kill during ``save``."""
    stale = []
    for p in directory.glob("*.tmp.*"):
        pid = p.name.split(".tmp.")[1].split(".")[0]
        if not Path(f"/proc/{pid}").exists():
            stale.append(p.name)
    return sorted(stale)


def load_ledger(path: Path) -> dict:
    with np.load(path) as z:
        ledger = {k: z[k] for k in z.files}
    ledger["errors"] = json.loads(Path(str(path) + ".errors.json").read_text())
    return ledger


def acked_items(ledgers: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every acknowledged item: its id, its client key, and when it was acknowledged."""
    ids, keys, times = [], [], []
    for ledger in ledgers:
        meta = ledger["ins_meta"]
        ok = meta[meta[:, 4] == 1]
        n = ok[:, 1].astype(np.int64)
        first = ok[:, 0].astype(np.int64)
        ids.append(np.repeat(first, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)))
        keys.append(ledger["ins_keys"])
        times.append(np.repeat(ok[:, 3], n))
    return np.concatenate(ids), np.concatenate(keys), np.concatenate(times)


def classify(shard: Shard, keys: np.ndarray, acked_at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For items acknowledged by ``shard`` (local keys, times): the incarnation
    that acknowledged each, and whether it was lost with it (acknowledged past
    the key tail its successor restored)."""
    spawned = np.array([life.spawned for life in shard.lives])
    life = np.searchsorted(spawned, acked_at, side="right") - 1
    tails = np.array([life.tail for life in shard.lives[1:]] + [np.iinfo(np.int64).max])
    return life, (keys & COUNTER) >= tails[life]


def check_tables(shards: list[Shard], ledgers: list[dict], args: argparse.Namespace) -> list[dict]:
    """Counts each shard's acknowledged keys present in its table now, through a
    ``ReplayClient`` of this process (``update_priorities`` counts them)."""
    import moolib

    ids, keys, times = acked_items(ledgers)
    rpc = moolib.Rpc()
    rpc.set_name("checker")
    rpc.set_timeout(60)
    out = []
    try:
        for shard in shards:
            rpc.connect(f"127.0.0.1:{shard.port}")
        for shard in shards:
            client = moolib.ReplayClient(rpc, (f"shard{shard.index}", "table"), timeout=60)
            mine = (keys >> SHIFT) == shard.index
            local = keys[mine] & LOCAL
            _, lost = classify(shard, local, times[mine])
            kept = np.unique(local[~lost])
            found = count_present(client, kept)
            out.append(
                {
                    "shard": shard.index,
                    "acked": int(mine.sum()),
                    "lost_with_shard": int(lost.sum()),
                    "expected": int(len(kept)),
                    "present": found,
                }
            )
    finally:
        rpc.close()
    return out


def count_present(client: Any, keys: np.ndarray) -> int:
    present = 0
    for i in range(0, len(keys), 1 << 16):
        part = keys[i : i + (1 << 16)]
        present += int(client.update_priorities(part, np.ones(len(part))))
    return present


# --- the report ----------------------------------------------------------------


def throughput(phase: dict, start: float, end: float) -> tuple[float, float]:
    """Items/s acknowledged and sampled over [start, end), every client together."""
    if "counts" not in phase:
        # Per side: the completion times, sorted, and the items done by each.
        sides = []
        for side, done_col, n_col in (("ins_meta", 3, 1), ("smp_meta", 1, 2)):
            rows = [ledger[side] for ledger in phase["ledgers"]]
            m = np.concatenate(rows) if rows else np.zeros((0, 5))
            if side == "ins_meta":
                m = m[m[:, 4] == 1]
            order = np.argsort(m[:, done_col])
            t = m[order, done_col]
            sides.append((t, np.concatenate([[0.0], np.cumsum(m[order, n_col])])))
        phase["counts"] = sides
    out = []
    for t, total in phase["counts"]:
        a, b = np.searchsorted(t, [start, end])
        out.append((total[b] - total[a]) / max(end - start, 1e-9))
    return out[0], out[1]


def lowest_rate(phase: dict, start: float, end: float) -> float:
    """The lowest aggregate rate (inserted + sampled items/s) of a 1 s window in [start, end)."""
    starts = np.arange(start, max(start, end - 1), 0.25)
    return min((sum(throughput(phase, x, x + 1)) for x in starts), default=0.0)


def recoveries(phase: dict) -> list[dict]:
    """Per restart: when the shard took inserts and samples again, and when the
    aggregate rate (inserted + sampled items in a 1 s window) was back to
    RECOVERED_FRACTION of the 5 s before the kill."""
    out = []
    shard_of_acks: list[tuple[np.ndarray, np.ndarray]] = []
    shard_of_samples: list[tuple[np.ndarray, np.ndarray]] = []
    for ledger in phase["ledgers"]:
        m = ledger["ins_meta"]
        ok = m[m[:, 4] == 1]
        first_keys = ledger["ins_keys"][np.cumsum(ok[:, 1]).astype(np.int64) - ok[:, 1].astype(int)]
        shard_of_acks.append((first_keys >> SHIFT, ok[:, 3]))
        s = ledger["smp_meta"]
        ends = np.repeat(s[:, 1], s[:, 2].astype(np.int64))
        shard_of_samples.append((ledger["smp_keys"] >> SHIFT, ends))
    ack_shard = np.concatenate([a for a, _ in shard_of_acks])
    ack_time = np.concatenate([t for _, t in shard_of_acks])
    smp_shard = np.concatenate([a for a, _ in shard_of_samples])
    smp_time = np.concatenate([t for _, t in shard_of_samples])
    for fault in phase["faults"]:
        killed, ready, index = fault["killed"], fault["ready"], fault["shard"]
        before = sum(throughput(phase, killed - 5, killed))
        back = None
        t = ready
        while t < phase["until"] - 1:
            if sum(throughput(phase, t, t + 1)) >= RECOVERED_FRACTION * before:
                back = t + 1 - ready
                break
            t += 0.25
        first_ins = ack_time[(ack_shard == index) & (ack_time > ready)]
        first_smp = smp_time[(smp_shard == index) & (smp_time > ready)]
        dip = lowest_rate(phase, killed, ready + RECOVERY_TARGET)
        out.append(
            {
                **fault,
                "down_s": ready - killed,
                "rate_before": before,
                "lowest_1s_rate": dip,
                "aggregate_back_s": back,
                "first_insert_s": float(first_ins.min() - ready) if len(first_ins) else None,
                "first_sample_s": float(first_smp.min() - ready) if len(first_smp) else None,
            }
        )
    return out


def sample_checks(phase: dict) -> dict:
    """Checks every sampled item against the ledgers (see the module's docstring)."""
    ids, keys, times = acked_items(phase["ledgers"])
    order = np.argsort(ids)
    ids, keys, times = ids[order], keys[order], times[order]
    shards = phase["shards"]
    lost_item = np.zeros(len(ids), dtype=bool)
    life_of = np.zeros(len(ids), dtype=np.int64)
    for shard in shards:
        mine = (keys >> SHIFT) == shard.index
        life_of[mine], lost_item[mine] = classify(shard, keys[mine] & LOCAL, times[mine])
    sampled = wrong_key = unacked = dead = unknown = 0
    twice = int(len(keys) - len(np.unique(keys)))
    raised_ids: set = set()
    raised = np.concatenate(
        [
            np.concatenate(
                [np.arange(int(f), int(f) + int(n)) for f, n, *_ in m[m[:, 4] == 0]] or [[]]
            )
            for m in (ledger["ins_meta"] for ledger in phase["ledgers"])
        ]
    ).astype(np.int64)
    for ledger in phase["ledgers"]:
        sids, skeys = ledger["smp_ids"], ledger["smp_keys"]
        s = ledger["smp_meta"]
        ends = np.repeat(s[:, 1], s[:, 2].astype(np.int64))
        sampled += len(sids)
        pos = np.searchsorted(ids, sids)
        pos = np.minimum(pos, len(ids) - 1)
        known = ids[pos] == sids if len(ids) else np.zeros(len(sids), dtype=bool)
        unacked += int((~known).sum())
        raised_ids.update(sids[~known].tolist())
        unknown += int((~known & ~np.isin(sids, raised)).sum())
        k = pos[known]
        wrong_key += int((keys[k] != skeys[known]).sum())
        # Sampled from the incarnation alive when the sample came back: a
        # later one than the item's, which lost it, means a dead one's memory.
        for shard in shards:
            on = (skeys[known] >> SHIFT) == shard.index
            if not on.any():
                continue
            spawned = np.array([life.spawned for life in shard.lives])
            serving = np.searchsorted(spawned, ends[known][on], side="right") - 1
            dead += int((lost_item[k[on]] & (serving > life_of[k[on]])).sum())
    return {
        "sampled": sampled,
        "wrong_key": wrong_key,
        "from_raised_insert": unacked,
        "from_raised_insert_distinct": len(raised_ids),
        "from_dead_memory": dead,
        "never_inserted": unknown,
        "acked_twice": twice,
        "torn": int(sum(ledger["stats"][0] for ledger in phase["ledgers"])),
    }


def error_summary(phase: dict) -> dict:
    counts: dict[str, int] = {}
    for ledger in phase["ledgers"]:
        for side in ("insert", "sample"):
            for msg in ledger["errors"][side]:
                kind = f"{side}: {msg.split(':')[0]}"
                counts[kind] = counts.get(kind, 0) + 1
    return counts


def report(args: argparse.Namespace, ref: dict | None, chaos: dict) -> bool:
    ok = True
    print()
    print(
        f"{args.shards} shards, {args.clients} clients, batch {args.batch} items of "
        f"{8 + args.payload} B, checkpoint every {args.checkpoint_every} s, "
        f"rpc timeout {args.rpc_timeout} s, seed {args.seed}"
    )
    rows = []
    for phase in [p for p in (ref, chaos) if p is not None]:
        ins, smp = throughput(phase, phase["begun"] + 5, phase["until"])
        rows.append((phase["name"], phase["until"] - phase["begun"], ins, smp))
    print(
        f"{'phase':<10} {'seconds':>8} {'inserted/s':>11} {'sampled/s':>10} "
        f"{'lowest 1 s / mean':>18} {'checkpoints':>12} {'save s (median, max)':>21}"
    )
    for (name, secs, ins, smp), phase in zip(rows, [p for p in (ref, chaos) if p], strict=True):
        low = lowest_rate(phase, phase["begun"] + 5, phase["until"] - 1) / max(ins + smp, 1e-9)
        saves = [b - a for s in phase["shards"] for life in s.lives for a, b in life.checkpoints]
        took = f"{np.median(saves):.2f}, {max(saves):.2f}" if saves else "-"
        print(
            f"{name:<10} {secs:8.0f} {ins:11.0f} {smp:10.0f} {low:18.2f} {len(saves):12d} "
            f"{took:>21}"
        )
    if ref is not None:
        print(
            f"chaos / reference: inserts {rows[1][2] / max(rows[0][2], 1e-9):.2f}, "
            f"samples {rows[1][3] / max(rows[0][3], 1e-9):.2f}"
        )
    longest = max(float(ledger["stats"][1]) for ledger in chaos["ledgers"])
    print(f"longest single insert or sample call in the chaos phase: {longest:.1f} s")
    print("client errors raised in the chaos phase:", error_summary(chaos) or "none")
    checks = sample_checks(chaos)
    print(
        f"sampled items: {checks['sampled']}; not the item their key was acknowledged "
        f"for: {checks['wrong_key']}; torn payloads: {checks['torn']}; from a dead "
        f"incarnation's memory: {checks['from_dead_memory']}; from inserts that raised: "
        f"{checks['from_raised_insert']} ({checks['from_raised_insert_distinct']} distinct); "
        f"ids never inserted: {checks['never_inserted']}; keys acknowledged twice: "
        f"{checks['acked_twice']}"
    )
    ok &= checks["wrong_key"] == checks["torn"] == checks["from_dead_memory"] == 0
    ok &= checks["acked_twice"] == 0
    ok &= checks["never_inserted"] == 0
    print(f"{'shard':>5} {'acked':>9} {'lost w/ shard':>13} {'expected':>9} {'present':>9}")
    for row in chaos["present"]:
        print(
            f"{row['shard']:5d} {row['acked']:9d} {row['lost_with_shard']:13d} "
            f"{row['expected']:9d} {row['present']:9d}"
        )
        ok &= row["present"] == row["expected"]
    lost = sum(r["lost_with_shard"] for r in chaos["present"])
    acked = sum(r["acked"] for r in chaos["present"])
    print(
        f"acknowledged: {acked}; lost with their shard: {lost} ({100 * lost / max(acked, 1):.3f}%)"
    )
    print(
        f"{'shard':>5} {'down s':>7} {'back in use s (ins/smp)':>24} "
        f"{'aggregate at 80% s':>19} {'lowest 1 s rate / before':>25}"
    )
    recs = recoveries(chaos)
    recovered = True
    for r in recs:
        fi = "-" if r["first_insert_s"] is None else f"{r['first_insert_s']:.1f}"
        fs = "-" if r["first_sample_s"] is None else f"{r['first_sample_s']:.1f}"
        back = "never" if r["aggregate_back_s"] is None else f"{r['aggregate_back_s']:.1f}"
        ratio = r["lowest_1s_rate"] / max(r["rate_before"], 1e-9)
        print(f"{r['shard']:5d} {r['down_s']:7.1f} {fi + ' / ' + fs:>24} {back:>19} {ratio:25.2f}")
        worst = max(
            x if x is not None else float("inf")
            for x in (r["first_insert_s"], r["first_sample_s"], r["aggregate_back_s"])
        )
        recovered &= worst <= RECOVERY_TARGET
    stuck = [(c, round(t, 1)) for c, closed, t in chaos["exits"] if not closed or t > 10]
    print(f"clients whose close and exit took over 10 s or failed (index, s): {stuck or 'none'}")
    if chaos["stale_tmp"]:
        print(f"checkpoint temporary files left by kills: {len(chaos['stale_tmp'])}")
    print(
        f"items: {'PASS' if ok else 'FAIL'}; recovery within {RECOVERY_TARGET:.0f} s: "
        f"{'PASS' if recovered else 'FAIL'}"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "throughput": rows,
                    "checks": checks,
                    "tables": chaos["present"],
                    "recoveries": recs,
                    "errors": error_summary(chaos),
                    "stale_tmp": chaos["stale_tmp"],
                    "faults": len(chaos["faults"]),
                    "slow_exits": stuck,
                    "items_pass": ok,
                    "recovery_pass": recovered,
                },
                indent=1,
            )
        )
    return ok and recovered


def span(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(":")
    return float(lo), float(hi or lo)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--role", choices=("run", "shard", "client"), default="run")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=300.0)
    parser.add_argument("--reference", type=float, default=60.0, help="0: no reference phase")
    parser.add_argument("--fault-every", type=span, default=(10.0, 20.0))
    parser.add_argument("--down", type=span, default=(1.0, 3.0))
    parser.add_argument(
        "--quiet", type=float, default=15.0, help="seconds without faults at the end"
    )
    parser.add_argument("--checkpoint-every", type=float, default=5.0)
    parser.add_argument("--capacity", type=int, default=4_000_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--payload", type=int, default=24)
    parser.add_argument("--rpc-timeout", type=float, default=10.0)
    parser.add_argument("--call-timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--workdir", default=None)
    # Set by the orchestrator for its shards and clients.
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--checkpoint", default="")
    parser.add_argument("--ports", default="")
    parser.add_argument("--ledger", default="")
    args = parser.parse_args()
    if args.role == "shard":
        return shard_main(args)
    if args.role == "client":
        return client_main(args)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="replay-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        ref = None
        if args.reference > 0:
            print(f"reference: {args.reference:.0f} s, no faults", flush=True)
            ref = run_phase(args, workdir, args.reference, chaos=False)
        print(f"chaos: {args.duration:.0f} s", flush=True)
        chaos = run_phase(args, workdir, args.duration, chaos=True)
        ok = report(args, ref, chaos)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
