"""The replay table over RPC: many inserting processes, shards, dead shards, kill -9.

Real processes over shared memory and TCP (tests/helpers/replay_peer.py). The
tables are read back with the FIFO selector, which returns the oldest items in
insertion order, so a test can count every item that arrived.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time

import numpy as np
import pytest
import torch
from helpers.util import HELPERS, PeerProcess, freeze, kill_process, stop_process, wait_for

import moolib

REPLAY_PEER = HELPERS / "replay_peer.py"
TRANSPORTS = {"shm": ["shm"], "tcp": ["tcp"]}
# A ReplayClient through its shared memory segments, or through call payloads only.
SHARED_MEMORY = pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "payload"])


def replay_peer(tmp_path, name, *args):
    return PeerProcess(["--name", name, *args], tmp_path / f"{name}.log", script=REPLAY_PEER)


def all_items(replay: moolib.Replay) -> dict:
    """Every item of a FIFO table, oldest first."""
    return replay.sample(replay.size()).items


def served(make_rpc, transports, **table):
    rpc = make_rpc("server", transports=transports, listen=True, timeout=30)
    replay = moolib.Replay(table.pop("capacity", 100_000), selector="fifo", **table)
    replay.serve(rpc, "table")
    return rpc, replay


def client_of(make_rpc, rpc, shared_memory: bool) -> moolib.ReplayClient:
    """A client peer's ReplayClient of the table ``rpc`` serves."""
    client_rpc = make_rpc("client", timeout=30)
    client_rpc.connect(rpc.address)
    return moolib.ReplayClient(
        client_rpc, ("server", "table"), timeout=30, shared_memory=shared_memory
    )


@pytest.mark.parametrize("pipelined", [False, True], ids=["waited", "pipelined"])
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_inserting_processes_lose_and_duplicate_nothing(transport, pipelined, tmp_path, make_rpc):
    rpc, replay = served(make_rpc, TRANSPORTS[transport])
    writers = []
    try:
        for w in range(3):
            writers.append(
                replay_peer(
                    tmp_path,
                    f"writer{w}",
                    "--connect", rpc.address, "--transports", transport,
                    "--insert-to", "server/table", "--writer", str(w),
                    "--batches", "20", "--batch-size", "32", "--payload", "64",
                    *(["--pipelined"] if pipelined else []),
                )
            )  # fmt: skip
        for p in writers:
            # The transport asked for is used (shm after the TCP introduction);
            # a pipelining writer says so after flush(): every batch answered.
            used = p.expect("VIA", timeout=300).split()[1].split(",")
            assert transport in used and (transport == "shm" or used == ["tcp"])
            p.expect("DONE")
        got = all_items(replay)
        ids = got["id"].tolist()
        assert len(ids) == len(set(ids)) == 3 * 20 * 32
        expected = {w * 10**9 + i for w in range(3) for i in range(20 * 32)}
        assert set(ids) == expected
        # Payloads arrived intact, and each writer's items are in its order
        # (batches in flight at once may go in in any order, each one whole).
        assert torch.equal(got["payload"][:, 0], (got["id"] % 251).to(torch.uint8))
        for w in range(3 if not pipelined else 0):
            mine = [i for i in ids if i // 10**9 == w]
            assert mine == sorted(mine)
        for start in range(0, len(ids), 32):
            assert got["batch"][start : start + 32].eq(got["batch"][start]).all()
    finally:
        for p in writers:
            stop_process(p.proc)


def test_64_connections_on_one_shard(tmp_path, make_rpc):
    rpc, replay = served(make_rpc, None)
    writers = []
    try:
        for w in range(4):
            writers.append(
                replay_peer(
                    tmp_path,
                    f"writer{w}",
                    "--connect", rpc.address, "--insert-to", "server/table",
                    "--writer", str(w), "--clients", "16",
                    "--batches", "32", "--batch-size", "8",
                )
            )  # fmt: skip
        wait_for(
            lambda: (
                len([p for p in rpc.debug_info()["peers"] if p["name"].startswith("writer")]) >= 64
            ),
            timeout=300,
            what="64 inserting connections",
        )
        for p in writers:
            p.expect("DONE", timeout=180)
        ids = all_items(replay)["id"].tolist()
        assert len(ids) == len(set(ids)) == 4 * 32 * 8
    finally:
        for p in writers:
            stop_process(p.proc)


def test_sampling_across_shards_follows_priority_mass(make_rpc):
    servers = []
    for i in range(2):
        rpc = make_rpc(f"shard{i}", listen=True, timeout=30)
        replay = moolib.Replay(1000, selector="prioritized", alpha=1.0, seed=i)
        replay.serve(rpc, "table")
        servers.append((rpc, replay))
    # Shard 0 holds 10 items of priority 1, shard 1 holds 10 of priority 3:
    # shard 1 has three quarters of the mass.
    for (_, replay), prio in zip(servers, (1.0, 3.0), strict=True):
        replay.insert({"x": torch.arange(10, dtype=torch.float32)}, torch.full((10,), prio))
    client_rpc = make_rpc("client", timeout=30)
    for rpc, _ in servers:
        client_rpc.connect(rpc.address)
    client = moolib.ReplayClient(client_rpc, [("shard0", "table"), ("shard1", "table")], seed=0)
    from_shard1 = 0
    total = 0
    for _ in range(20):
        s = client.sample(100)
        assert s.keys.shape == (100,) and s.items["x"].shape == (100,)
        shard = s.keys >> 56
        from_shard1 += int((shard == 1).sum())
        total += 100
        # Probabilities are those of the union: priority / total mass (40).
        expected = torch.where(shard == 1, 3.0 / 40, 1.0 / 40).to(torch.float64)
        assert torch.allclose(s.probabilities, expected)
        assert s.size == 20
    assert 0.65 < from_shard1 / total < 0.85
    # Priority updates reach the shard that holds the key.
    s = client.sample(5)
    assert client.update_priorities(s.keys, torch.full((5,), 7.0)) == 5
    masses = [info["priority_mass"] for info in client.info()]
    assert sum(masses) > 40.0
    # Deferred, each shard's part goes with that shard's next sample call
    # (or alone, where the shard draws nothing this time).
    keys = torch.tensor([0, 1, 1 << 56, (1 << 56) + 1])
    client.update_priorities(keys, torch.full((4,), 0.0), block=False)
    assert [r.info()["priority_mass"] for _, r in servers] == masses
    client.sample(50)
    after = [r.info()["priority_mass"] for _, r in servers]
    assert after[0] < masses[0] and after[1] < masses[1]


def _in_thread(fn, what: str):
    """Runs ``fn`` in a thread and returns what it returned or raised, waiting
    at most the tests' deadline: a call that waits for an Rpc timeout longer
    than that (as a call to a dead peer did) fails the test instead."""
    out = []

    def run():
        try:
            out.append(("ok", fn()))
        except Exception as e:  # noqa: BLE001 - returned to the test
            out.append(("raised", e))

    threading.Thread(target=run, daemon=True).start()
    return wait_for(lambda: out, what=what)[0]


def test_a_killed_shard_is_left_out_and_used_again_once_back(tmp_path, make_rpc):
    """kill -9 of one shard of two: samples and inserts go on from the live one
    without raising, a call that only the dead one could serve fails at once
    (not after the Rpc's timeout), and the shard is used again once it is back."""
    live_rpc = make_rpc("live", listen=True, timeout=30)
    live = moolib.Replay(1000, selector="uniform", seed=0)
    live.serve(live_rpc, "table")
    live.insert({"x": torch.zeros(10)})
    doomed = replay_peer(tmp_path, "doomed", "--serve", "table", "--selector", "uniform")
    address = doomed.address
    again = None
    try:
        # Longer than the tests' deadline: a call that waits for it fails _in_thread.
        client_rpc = make_rpc("client", timeout=600)
        client_rpc.connect(live_rpc.address)
        client_rpc.connect(address)
        # The dead shard first: the live one's keys carry its index even alone.
        client = moolib.ReplayClient(client_rpc, [("doomed", "table"), ("live", "table")])
        only_doomed = moolib.ReplayClient(client_rpc, ("doomed", "table"))
        wait_for(lambda: client.info(), what="both shards answering")
        held = only_doomed.insert({"x": torch.ones(10)})
        assert client.sample(50).size == 20
        kill_process(doomed.proc)
        for _ in range(10):
            kind, s = _in_thread(lambda: client.sample(50), "a sample after the kill")
            assert kind == "ok", s
            # Weighed as the union of the live shards (importance weights use it).
            assert (s.keys >> 56).eq(1).all() and s.items["x"].eq(0).all()
            assert s.size == live.size() and torch.allclose(
                s.probabilities, torch.full((50,), 1 / s.size, dtype=torch.float64)
            )
            kind, keys = _in_thread(lambda: client.insert({"x": torch.zeros(2)}), "an insert")
            assert kind == "ok", keys
            assert (keys >> 56).eq(1).all()
        # The dead shard's keys count as not present; the live shard's are updated.
        kind, n = _in_thread(
            lambda: client.update_priorities(torch.cat([held, keys]), torch.ones(12)),
            "an update of both shards' keys",
        )
        assert (kind, n) == ("ok", 2)
        # Deferred updates of the dead shard's keys wait for it, each key once at
        # its latest priority: they do not grow with every update while it is down.
        for i in range(20):
            client.update_priorities(held, torch.full((10,), float(i + 1)), block=False)
        kind, _ = _in_thread(client.flush, "a flush while a shard is down")
        assert kind == "ok"
        deferred_keys, deferred = client._updates[0]
        assert np.frombuffer(deferred_keys, dtype=np.int64).tolist() == held.tolist()  # shard 0
        assert np.frombuffer(deferred, dtype=np.float64).tolist() == [20.0] * 10
        # Only the dead shard could serve these: typed errors, at once.
        for call in (
            lambda: only_doomed.sample(5),
            lambda: only_doomed.insert({"x": torch.ones(1)}),
        ):
            kind, e = _in_thread(call, "a call only the dead shard could serve")
            assert kind == "raised" and isinstance(e, moolib.ShardUnavailableError), e
            assert isinstance(e, ConnectionError) and isinstance(e, moolib.ReplayError), e
            assert "doomed" in str(e)
        again = replay_peer(
            tmp_path, "doomed", "--serve", "table", "--selector", "uniform", "--listen", address
        )

        def used_again():
            return (client.insert({"x": torch.ones(1)}) >> 56).eq(0).all()

        wait_for(used_again, what="inserts going to the restarted shard")
        wait_for(lambda: (client.sample(50).keys >> 56).eq(0).any(), what="sampling it again")
    finally:
        stop_process(doomed.proc)
        if again is not None:
            stop_process(again.proc)


def test_an_insert_in_flight_when_its_shard_dies_raises(tmp_path, make_rpc):
    """The promise: an insert is acknowledged, or raised to its caller. One sent
    to a shard that is then killed raises ShardUnavailableError (whether it
    went in is unknown), and the next one goes to the live shard."""
    live_rpc = make_rpc("live", listen=True, timeout=30)
    live = moolib.Replay(1000, selector="fifo")
    live.serve(live_rpc, "table")
    doomed = replay_peer(tmp_path, "doomed", "--serve", "table")
    try:
        client_rpc = make_rpc("client", timeout=600)
        client_rpc.connect(live_rpc.address)
        client_rpc.connect(doomed.address)
        # Items as the call's payload: the insert is one call, sent at once.
        client = moolib.ReplayClient(
            client_rpc, [("doomed", "table"), ("live", "table")], shared_memory=False
        )
        wait_for(lambda: client.info(), what="both shards answering")
        assert (client.insert({"x": torch.ones(4)}) >> 56).eq(0).all()
        assert (client.insert({"x": torch.ones(4)}) >> 56).eq(1).all()
        # Stopped, the shard takes the next insert's request but never answers.
        freeze(doomed.proc.pid)
        result = []

        def insert():
            try:
                result.append(client.insert({"x": torch.ones(4)}))
            except Exception as e:  # noqa: BLE001 - checked below
                result.append(e)

        thread = threading.Thread(target=insert, daemon=True)
        thread.start()
        wait_for(lambda: client_rpc.debug_info()["pending_calls"], what="the insert sent")
        kill_process(doomed.proc)
        wait_for(lambda: result, what="the insert in flight to fail")
        assert isinstance(result[0], moolib.ShardUnavailableError), result
        assert isinstance(result[0], ConnectionError) and not isinstance(result[0], TimeoutError)
        # The Rpc's error it comes from is kept, class and all.
        assert isinstance(result[0].__cause__, moolib.errors.ConnectionLostError), result
        assert "connection was lost" in str(result[0])
        keys = _in_thread(lambda: client.insert({"x": torch.ones(4)}), "the next insert")[1]
        assert (keys >> 56).eq(1).all()
        assert live.size() == 8
    finally:
        stop_process(doomed.proc)


def test_a_client_killed_mid_insert_leaves_the_table_consistent(tmp_path, make_rpc):
    rpc, replay = served(make_rpc, None)
    writer = replay_peer(
        tmp_path,
        "writer",
        "--connect", rpc.address, "--insert-to", "server/table", "--forever",
        "--batch-size", "64", "--payload", str(256 * 1024),
    )  # fmt: skip
    try:
        writer.expect("INSERTED 3", timeout=120)
        kill_process(writer.proc)
        got = all_items(replay)
        batches = got["batch"].tolist()
        # Every batch that arrived arrived whole: a frame cut by the kill is dropped.
        for b in set(batches):
            assert batches.count(b) == 64
        assert len(set(got["id"].tolist())) == len(batches)
        # The table goes on serving.
        replay.insert({k: v[:1] for k, v in got.items()})
        assert replay.size() == len(batches) + 1
    finally:
        stop_process(writer.proc)


def test_a_sample_waits_past_the_rpc_timeout_for_min_size(make_rpc):
    rpc, replay = served(make_rpc, None, min_size=10)
    client_rpc = make_rpc("client", timeout=2)
    client_rpc.connect(rpc.address)
    client = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=60)
    result = {}

    def sample():
        result["sample"] = client.sample(4)

    t = threading.Thread(target=sample)
    t.start()
    time.sleep(5)  # longer than the RPC timeout: the client must keep asking
    assert "sample" not in result
    replay.insert({"x": torch.arange(10)})
    t.join(timeout=60)
    assert result["sample"].items["x"].tolist() == [0, 1, 2, 3]
    assert replay.info()["samples"] == 4


def test_a_call_that_times_out_is_a_replay_error_and_a_timeout_error(make_rpc):
    rpc, replay = served(make_rpc, None, min_size=10)
    client_rpc = make_rpc("client", timeout=1)
    client_rpc.connect(rpc.address)
    # The rate limiter holds the sample past the client's timeout.
    client = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=1)
    with pytest.raises(moolib.errors.ReplayTimeoutError, match="sample of 4 timed out") as info:
        client.sample(4)
    assert isinstance(info.value, moolib.ReplayError) and isinstance(info.value, TimeoutError)
    assert not isinstance(info.value, ConnectionError)  # the shard is there
    # A shard that never replies: its Rpc timeout is the cause, and the shard is down.
    nobody = moolib.ReplayClient(client_rpc, ("nobody", "table"), timeout=1)
    with pytest.raises(moolib.ReplayError, match="'nobody'") as info:
        nobody.info()
    error = info.value
    assert isinstance(error, TimeoutError) and isinstance(error, moolib.ShardUnavailableError)
    assert isinstance(error, ConnectionError) and type(error) is moolib.errors.ShardTimeoutError
    assert isinstance(error.__cause__, moolib.errors.RpcTimeoutError), repr(error.__cause__)
    with pytest.raises(moolib.ShardUnavailableError, match="no replay shard is reachable"):
        nobody.sample(1)


def replay_mappings() -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of ReplayClient segments."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if "memfd:moolib-replay" in line:
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def in_replay_segment(t: torch.Tensor) -> bool:
    return any(a <= t.data_ptr() < b for a, b in replay_mappings())


def shm_pair(make_rpc, **table):
    rpc, replay = served(make_rpc, ["shm"], **table)
    client_rpc = make_rpc("client", transports=["shm"], timeout=30)
    client_rpc.connect(rpc.address)
    return replay, moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30)


def rows(start: int, n: int) -> dict:
    x = torch.arange(start, start + n, dtype=torch.float32)
    return {"x": x[:, None].expand(n, 1000).contiguous(), "k": torch.arange(start, start + n)}


def test_samples_are_written_into_the_clients_shared_memory_and_kept_while_used(make_rpc):
    # 16 items: each insert of 16 replaces the table, so each sample tells which.
    replay, client = shm_pair(make_rpc, capacity=16)
    replay.insert(rows(0, 16))
    a = client.sample(16)
    # The table gathered the batch straight into this client's segment.
    assert in_replay_segment(a.items["x"]) and in_replay_segment(a.keys)
    assert torch.equal(a.items["x"], rows(0, 16)["x"]) and a.items["k"].tolist() == list(range(16))
    assert a.keys.tolist() == list(range(16)) and a.probabilities.eq(1.0).all() and a.size == 16
    replay.insert(rows(16, 16))
    b = client.sample(16)
    # A sample still held keeps its memory: the next one went elsewhere.
    assert a.items["k"].tolist() == list(range(16)) and b.items["k"].tolist() == list(range(16, 32))
    where = a.items["x"].data_ptr()
    del a
    gc.collect()
    replay.insert(rows(32, 16))
    c = client.sample(16)
    # Freed, its segment serves the next sample.
    assert c.items["x"].data_ptr() == where and c.items["k"].tolist() == list(range(32, 48))
    assert torch.equal(c.items["x"], rows(32, 16)["x"]) and c.keys.tolist() == list(range(32, 48))
    assert b.items["k"].tolist() == list(range(16, 32))
    # Priority updates of shared-memory keys reach the table.
    assert client.update_priorities(c.keys, torch.full((16,), 2.0)) == 16


def test_inserts_go_through_shared_memory_and_are_checked_against_the_layout(make_rpc):
    replay, client = shm_pair(make_rpc)
    assert client.insert(rows(0, 8)).tolist() == list(range(8))  # learns the layout
    before = len(replay_mappings())
    keys = client.insert(rows(8, 100), torch.linspace(0.5, 2.0, 100, dtype=torch.float64))
    assert keys.tolist() == list(range(8, 108))
    assert len(replay_mappings()) > before  # the table mapped the client's segment
    got = replay.sample(replay.size()).items
    assert got["k"].tolist() == list(range(108))
    assert torch.equal(got["x"], rows(0, 108)["x"])
    bad = rows(0, 4)
    bad["x"] = bad["x"].double()
    with pytest.raises(moolib.ReplayError, match="leaf x has dtype torch.float64"):
        client.insert(bad)
    with pytest.raises(moolib.ReplayError, match="priority at batch index 1 is nan"):
        client.insert(rows(0, 2), torch.tensor([1.0, float("nan")]))
    assert replay.size() == 108


def test_a_table_that_cannot_map_the_clients_memory_sends_samples_as_replies(make_rpc, monkeypatch):
    def elsewhere(pid, fd, *args, **kwargs):
        raise FileNotFoundError(f"/proc/{pid}/fd/{fd}")  # as for a client on another host

    monkeypatch.setattr(moolib.replay.segments.ShmRegion, "open_peer", staticmethod(elsewhere))
    replay, client = shm_pair(make_rpc)
    replay.insert(rows(0, 32))
    s = client.sample(8)
    assert s.items["k"].tolist() == list(range(8)) and not in_replay_segment(s.items["x"])
    assert client.insert(rows(32, 4)).tolist() == list(range(32, 36))
    assert replay.size() == 36


def test_a_segment_the_table_let_go_is_mapped_again(make_rpc, monkeypatch):
    # Every new mapping drops the others (idle for more than 0 s).
    monkeypatch.setattr(moolib.replay.segments, "_SEGMENT_IDLE", 0.0)
    replay, client = shm_pair(make_rpc, capacity=16)
    replay.insert(rows(0, 16))
    a = client.sample(16)
    replay.insert(rows(16, 16))
    b = client.sample(16)  # mapping b's segment dropped a's
    del a
    gc.collect()
    replay.insert(rows(32, 16))
    c = client.sample(16)  # a's segment again: unknown to the table, so mapped anew
    assert in_replay_segment(c.items["x"])
    assert c.items["k"].tolist() == list(range(32, 48))
    assert b.items["k"].tolist() == list(range(16, 32))


def test_prefetch_draws_the_next_batch_before_sample_returns(make_rpc):
    rpc, replay = served(make_rpc, ["shm"], capacity=16)
    client_rpc = make_rpc("client", transports=["shm"], timeout=30)
    client_rpc.connect(rpc.address)
    client = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30, prefetch=True)
    replay.insert(rows(0, 16))
    a = client.sample(16)
    assert a.items["k"].tolist() == list(range(16))
    # The next batch was asked for before sample() returned: 32 drawn.
    wait_for(lambda: replay.info()["samples"] == 32, timeout=30, what="the prefetched batch")
    replay.insert(rows(16, 16))
    b = client.sample(16)  # drawn before that insert
    assert b.items["k"].tolist() == list(range(16)) and in_replay_segment(b.items["x"])
    c = client.sample(16)
    assert c.items["k"].tolist() == list(range(16, 32)) and c.keys.tolist() == list(range(16, 32))
    assert a.items["k"].tolist() == list(range(16))  # still held, still intact
    # Another batch size: the prefetched one is dropped, not returned.
    d = client.sample(4)
    assert d.items["k"].tolist() == list(range(16, 20))


def test_held_samples_beyond_the_segment_bound_come_as_replies(make_rpc, monkeypatch):
    monkeypatch.setattr(moolib.replay.segments, "_MAX_SEGMENTS", 3)
    replay, client = shm_pair(make_rpc, capacity=16)
    replay.insert(rows(0, 16))
    held = [client.sample(4) for _ in range(5)]
    # Three in segments (three open fds), then payloads: all intact.
    assert [in_replay_segment(s.items["x"]) for s in held] == [True] * 3 + [False] * 2
    assert all(s.items["k"].tolist() == [0, 1, 2, 3] for s in held)
    del held
    gc.collect()
    assert in_replay_segment(client.sample(4).items["x"])  # freed ones serve again


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_pipelined_insert_that_fails_is_raised_and_the_others_go_in_once(transport, make_rpc):
    rpc, replay = served(make_rpc, TRANSPORTS[transport])
    client_rpc = make_rpc("client", transports=TRANSPORTS[transport], timeout=30)
    client_rpc.connect(rpc.address)
    client = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30, max_inflight=3)
    assert client.insert(rows(0, 8), block=False) is None  # learns the layout (waits)
    nan = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    # Batch 4 is refused by the table: its priority 1 is NaN. Its error
    # comes from a later insert (once that one sent its own batch) or flush().
    batches = [(rows(8 * b, 4), nan if b == 4 else torch.ones(4)) for b in range(1, 9)]
    raised = insert_pipelined(client, batches)
    assert len(raised) == 1 and "priority at batch index 1 is nan" in raised[0]
    client.flush()  # raised once
    k = sorted(all_items(replay)["k"].tolist())
    sent = list(range(8)) + [i for b in range(1, 9) if b != 4 for i in range(8 * b, 8 * b + 4)]
    assert k == sent  # every other batch once, none of batch 4
    # One batch in flight at most: the failure of the one before is raised by
    # the next insert, which sent its own batch first; a blocking one too.
    client = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30, max_inflight=1)
    client.insert(rows(200, 4), block=False)  # the layout, and no shared memory yet
    client.insert(rows(300, 4), nan, block=False)
    with pytest.raises(moolib.ReplayError, match="priority at batch index 1 is nan"):
        client.insert(rows(400, 4), block=False)
    client.insert(rows(500, 4), nan, block=False)
    raised = []
    for call in (lambda: client.insert(rows(600, 4)), client.flush):
        try:
            call()  # the blocking insert raises it if its reply came by then
        except moolib.ReplayError as e:
            raised.append(str(e))
    assert len(raised) == 1 and "priority at batch index 1 is nan" in raised[0]
    k = sorted(all_items(replay)["k"].tolist())
    assert k == sorted(sent + [i for b in (200, 400, 600) for i in range(b, b + 4)])


def insert_pipelined(client: moolib.ReplayClient, batches: list) -> list[str]:
    """Inserts each (items, priorities) without waiting, then flushes: the errors raised."""
    raised = []
    for call in [
        *(functools.partial(client.insert, items, p, block=False) for items, p in batches),
        client.flush,
    ]:
        try:
            call()
        except moolib.ReplayError as e:
            raised.append(str(e))
    return raised


@SHARED_MEMORY
def test_a_refused_pipelined_insert_loses_no_other_batch(shared_memory, make_rpc):
    # Ten pipelined batches of 3 rows, the 6th of another dtype: one error,
    # naming the leaf, and the 9 others go in exactly once, whichever call
    # the error comes from (it depends on when the refusal's reply arrives:
    # repeated to meet each case).
    rpc, replay = served(make_rpc, None)
    client = client_of(make_rpc, rpc, shared_memory)
    client.insert(rows(0, 3))  # the table's layout
    start = 3
    for round in range(25):
        batches = [(rows(start + 3 * b, 3), None) for b in range(10)]
        batches[5][0]["x"] = batches[5][0]["x"].double()
        raised = insert_pipelined(client, batches)
        assert len(raised) == 1 and "leaf x has dtype torch.float64" in raised[0], raised
        k = sorted(all_items(replay)["k"].tolist())
        good = [start + 3 * b + i for b in range(10) if b != 5 for i in range(3)]
        assert k[-27:] == good and len(k) == 3 + 27 * (round + 1)
        start += 30


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_deferred_priority_update_rides_with_the_next_sample(transport, make_rpc):
    rpc = make_rpc("server", transports=TRANSPORTS[transport], listen=True, timeout=30)
    replay = moolib.Replay(100, selector="prioritized", alpha=1.0, seed=0)
    replay.serve(rpc, "table")
    client_rpc = make_rpc("client", transports=TRANSPORTS[transport], timeout=30)
    client_rpc.connect(rpc.address)
    client = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30, seed=0)
    keys = replay.insert(rows(0, 4), torch.ones(4))
    client.sample(4)  # the client learns the layout: later samples use shared memory
    assert replay.info()["priority_mass"] == 4.0
    with pytest.raises(ValueError, match="priority for key 2 is -1.0"):
        client.update_priorities(keys, torch.tensor([1.0, 1.0, -1.0, 1.0]), block=False)
    only = torch.tensor([0.0, 0.0, 5.0, 0.0])
    assert client.update_priorities(keys, only, block=False) is None
    assert replay.info()["priority_mass"] == 4.0  # not sent yet
    s = client.sample(64)  # the update is made before the draw
    assert s.items["k"].eq(2).all() and s.probabilities.eq(1.0).all()
    assert replay.info()["priority_mass"] == 5.0
    # Deferred updates apply in order; flush() sends what no sample took.
    client.update_priorities(torch.tensor([0, 1]), torch.tensor([1.0, 1.0]), block=False)
    client.update_priorities(torch.tensor([1]), torch.tensor([2.0]), block=False)
    client.flush()
    assert replay.info()["priority_mass"] == 8.0


def test_client_arguments_are_checked(make_rpc):
    rpc = make_rpc("args-client")
    with pytest.raises(ValueError, match="ReplayClient needs at least one"):
        moolib.ReplayClient(rpc, [])
    with pytest.raises(ValueError, match="a shard is a \\(peer, name\\) pair, got 'server'"):
        moolib.ReplayClient(rpc, ["server"])
    with pytest.raises(TypeError, match="a shard's peer and name are str, got \\('server', 5\\)"):
        moolib.ReplayClient(rpc, [("server", 5)])
    replay = moolib.Replay(capacity=4)
    with pytest.raises(TypeError, match="Replay.serve: name must be a str, got int"):
        replay.serve(rpc, 5)
    with pytest.raises(TypeError, match="Replay.serve needs a moolib.Rpc, got str"):
        replay.serve("rpc", "table")
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got str"):
        moolib.ReplayClient(rpc, ("server", "table"), timeout="30")
    with pytest.raises(ValueError, match="timeout must be positive, got 0"):
        moolib.ReplayClient(rpc, ("server", "table"), timeout=0)


@SHARED_MEMORY
def test_a_client_of_a_loaded_table_keeps_the_items_key_order(shared_memory, tmp_path, make_rpc):
    table = moolib.Replay(10, selector="fifo")
    table.insert({"b": torch.zeros(2), "a": torch.ones(2)})
    table.save(tmp_path / "r")
    rpc = make_rpc("server", listen=True, timeout=30)
    moolib.Replay.load(tmp_path / "r").serve(rpc, "table")
    client = client_of(make_rpc, rpc, shared_memory)
    for _ in range(3):  # the first sample learns the layout, the next ones use it
        assert list(client.sample(2).items) == ["b", "a"]
    client.insert({"b": torch.zeros(1), "a": torch.ones(1)})
    assert list(client.sample(3).items) == ["b", "a"]


@SHARED_MEMORY
def test_a_refused_call_raises_its_error_and_the_shard_stays_in_use(shared_memory, make_rpc):
    rpc, replay = served(make_rpc, None)
    client = client_of(make_rpc, rpc, shared_memory)
    keys = client.insert(rows(0, 8))
    assert client.sample(4).size == 8
    nan = torch.tensor([1.0, float("nan"), 1.0, 1.0])
    bad_dtype = {**rows(8, 4), "x": rows(8, 4)["x"].double()}
    refused = [
        (lambda: client.update_priorities(keys[:4], nan), "priority for key 1 is nan"),
        (lambda: client.insert(rows(8, 4), nan), "priority at batch index 1 is nan"),
        (lambda: client.insert(bad_dtype), "leaf x has dtype torch.float64"),
        (lambda: client.insert({"x": rows(8, 4)["x"]}), r"missing leaves \['k'\]"),
    ]
    for call, message in refused:
        with pytest.raises((moolib.ReplayError, ValueError), match=message):
            call()
        # The table is healthy: the next calls go to it at once.
        s = client.sample(4)
        assert s.size == 8 and s.items["k"].tolist() == [0, 1, 2, 3]
    with pytest.raises((moolib.ReplayError, ValueError), match="priority at batch index 1 is nan"):
        client.insert(rows(8, 4), nan, block=False)
        client.flush()
    assert client.insert(rows(8, 4)).tolist() == [8, 9, 10, 11]
    assert replay.size() == 12 and client.update_priorities(keys, torch.ones(8)) == 8


# Two tables on in-process peers, and a client of both (shards 0 and 1).


def two_shards(make_rpc, shared_memory, selector="fifo"):
    client_rpc = make_rpc("client", timeout=30)
    tables = []
    for i in range(2):
        rpc = make_rpc(f"shard{i}", listen=True, timeout=30)
        table = moolib.Replay(1000, selector=selector, seed=i)
        table.serve(rpc, "table")
        client_rpc.connect(rpc.address)
        tables.append(table)
    shards = [("shard0", "table"), ("shard1", "table")]
    client = moolib.ReplayClient(
        client_rpc, shards, timeout=30, seed=0, shared_memory=shared_memory
    )
    return tables, client


@SHARED_MEMORY
@pytest.mark.parametrize("block", [True, False], ids=["waited", "pipelined"])
def test_inserts_into_fresh_shards_go_to_each_in_turn(shared_memory, block, make_rpc):
    tables, client = two_shards(make_rpc, shared_memory)
    for b in range(6):
        # Each shard's first insert finds a table without a layout yet.
        client.insert(rows(8 * b, 8), torch.ones(8), block=block)
    client.flush()
    assert [t.size() for t in tables] == [24, 24]
    for i, table in enumerate(tables):
        # Batches in flight at once may go in in any order.
        expected = [k for b in range(i, 6, 2) for k in range(8 * b, 8 * b + 8)]
        assert sorted(all_items(table)["k"].tolist()) == expected
    s = client.sample(8)
    assert s.items["x"].shape == (8, 1000) and s.size == 48
    assert torch.equal(s.items["x"][:, 0], s.items["k"].float())
    # Each shard's layout was learned from it, for its next batches.
    assert all((s.layout is not None) == shared_memory for s in client._shards)


@SHARED_MEMORY
def test_each_shard_takes_inserts_of_its_own_layout(shared_memory, make_rpc):
    tables, client = two_shards(make_rpc, shared_memory)
    tables[1].insert({"x": torch.zeros(1, 3)})
    # Shard 0 has no layout yet, shard 1 stores x of shape (3,).
    for b in range(3):
        client.insert({"x": torch.full((2, 5), float(b))})
        client.insert({"x": torch.full((2, 3), float(b))})
    with pytest.raises(moolib.ReplayError, match=r"leaf x has item shape \(3,\); the table stores"):
        client.insert({"x": torch.zeros(2, 3)})  # shard 0's turn
    assert tables[0].sample(6).items["x"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert tables[1].sample(7).items["x"][:, 0].tolist() == [0, 0, 0, 1, 1, 2, 2]
    # Batches of two layouts cannot be one batch: a sample says which shards differ.
    with pytest.raises(moolib.ReplayError, match="shards hold items of different layouts"):
        for _ in range(20):
            client.sample(4)


@SHARED_MEMORY
@pytest.mark.parametrize("selector", ["uniform", "prioritized"])
def test_a_sharded_sample_has_the_size_of_the_union(shared_memory, selector, make_rpc):
    tables, client = two_shards(make_rpc, shared_memory, selector=selector)
    tables[0].insert(rows(0, 4))
    tables[1].insert(rows(4, 6))
    drawn = set()
    for i in range(60):
        s = client.sample(1 + i % 2)
        drawn.update((s.keys >> 56).tolist())
        # Every item has priority 1: size * probability is 1, as in one table of 10.
        assert s.size == 10
        assert torch.allclose(s.size * s.probabilities, torch.ones_like(s.probabilities))
    assert drawn == {0, 1}


def test_a_restarted_table_never_writes_into_another_clients_memory(make_rpc):
    """A table that comes back (its peer restarted) knows none of the segments
    its clients mapped before: a client naming its old mapping is told so and
    maps its segment again, rather than meeting another client's mapping that
    the new table numbered alike."""
    rpc, replay = served(make_rpc, ["shm"], capacity=16)
    address = rpc.address
    clients = []
    for name in ("client1", "client2"):
        client_rpc = make_rpc(name, transports=["shm"], timeout=30)
        client_rpc.connect(address)
        clients.append(moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30))
    replay.insert(rows(0, 16))
    for client in clients:  # each maps a segment of its own on the table
        assert client.sample(16).items["k"].tolist() == list(range(16))
    table = _restarted(make_rpc, rpc, replay, capacity=16)
    table.insert(rows(100, 16))
    first, second = clients

    def sample(client):
        # Calls in flight when the old peer went may fail once; the shard is then
        # asked again after its retry delay.
        deadline = time.monotonic() + 60
        while True:
            try:
                return client.sample(16)
            except moolib.ReplayError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    held = sample(second)  # maps its segment on the new table first
    assert held.items["k"].tolist() == list(range(100, 116))
    table.insert(rows(200, 16))
    mine = sample(first)
    assert mine.items["k"].tolist() == list(range(200, 216))
    assert torch.equal(mine.items["x"], rows(200, 16)["x"])
    # The other client's batch is as it was drawn.
    assert held.items["k"].tolist() == list(range(100, 116))
    assert torch.equal(held.items["x"], rows(100, 16)["x"])


def _restarted(make_rpc, rpc, replay, capacity: int) -> moolib.Replay:
    """Stops the serving peer ``rpc`` and its table, and starts the same peer again at
    the same address with a fresh table, which it returns."""
    address = rpc.address
    rpc.close()
    replay.close()
    again = make_rpc("server", transports=["shm"], timeout=30)
    wait_for(lambda: _listens(again, address), timeout=60, what=f"listening again at {address}")
    table = moolib.Replay(capacity, selector="fifo")
    table.serve(again, "table")
    return table


def _listens(rpc, address: str) -> bool:
    try:
        rpc.listen(address)
    except Exception:  # noqa: BLE001 - the port may still be held for a moment
        return False
    return True


@pytest.mark.parametrize("layout", ["fresh", "other"])
def test_a_table_restarted_without_a_failed_call_is_learned_anew(layout, make_rpc):
    """The client's shared-memory calls say which layout their rows are in: a table
    that came back fresh (its peer restarted, and no call of the client failed
    meanwhile) takes the next insert as the call's payload and learns its layout
    from it; one of another layout refuses it naming what differs, and a sample
    says so, rather than reading or writing rows laid out for other items."""
    rpc, replay = served(make_rpc, ["shm"], capacity=64)
    address = rpc.address
    client_rpc = make_rpc("client", transports=["shm"], timeout=30)
    client_rpc.connect(address)
    client = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30)
    client.insert(rows(0, 4))
    client.insert(rows(4, 4))  # through shared memory: the layout is learned
    assert client.sample(8).items["k"].tolist() == list(range(8))
    table = _restarted(make_rpc, rpc, replay, capacity=64)
    if layout == "other":
        table.insert({"y": torch.zeros(2, 3)})
    # The client's Rpc finds the peer again before the replay client calls it.
    wait_for(
        lambda: _answers(client_rpc, "server", "table/info"),
        timeout=60,
        what="the client reaching the restarted table",
    )
    if layout == "fresh":
        assert client.insert(rows(100, 4)).tolist() == [0, 1, 2, 3]
        assert client.insert(rows(104, 4)).tolist() == [4, 5, 6, 7]
        got = client.sample(8)
        assert got.items["k"].tolist() == list(range(100, 108))
        assert torch.equal(got.items["x"], rows(100, 8)["x"])
        assert table.size() == 8
    else:
        with pytest.raises(moolib.ReplayError, match="missing leaves"):
            client.insert(rows(100, 4))
        with pytest.raises(moolib.ReplayError, match="different layouts"):
            client.sample(2)
        assert table.size() == 2


def _answers(rpc, peer: str, fn: str) -> bool:
    try:
        rpc.sync(peer, fn)
    except moolib.RpcError:
        return False
    return True


def test_mapping_a_segment_again_writes_over_no_rows(make_rpc):
    """A table that comes back knowing the items' layout (restored from its
    checkpoint) but not this client's segments maps them again when asked: that
    leaves alone the rows another shard already wrote into the same sample, and
    the rows of an insert staged there."""
    rpc, replay = served(make_rpc, ["shm"], capacity=64)
    other_rpc = make_rpc("other", transports=["shm"], listen=True, timeout=30)
    other = moolib.Replay(64, selector="fifo")
    other.serve(other_rpc, "table")
    client_rpc = make_rpc("client", transports=["shm"], timeout=30)
    client_rpc.connect(rpc.address)
    client_rpc.connect(other_rpc.address)
    both = moolib.ReplayClient(client_rpc, [("other", "table"), ("server", "table")], seed=0)
    one = moolib.ReplayClient(client_rpc, ("server", "table"), timeout=30)
    other.insert(rows(0, 8))
    replay.insert(rows(100, 8))
    one.insert(rows(108, 2))  # the layout is learned:
    one.insert(rows(110, 2))  # this batch went through a segment the table mapped
    both.sample(16)  # each shard maps the segment, freed at once
    gc.collect()
    table = _restarted(make_rpc, rpc, replay, capacity=64)
    table.insert(rows(200, 8))  # the same layout, as a restored table has
    wait_for(
        lambda: _answers(client_rpc, "server", "table/info"),
        timeout=60,
        what="the client reaching the restarted table",
    )
    got = both.sample(16)
    drawn = got.keys >> 56
    assert drawn.eq(0).any() and drawn.eq(1).any()
    assert torch.equal(got.items["x"][:, 0].long(), got.items["k"]), got.items["k"]
    one.insert(rows(300, 4))
    stored = all_items(table)
    assert stored["k"].tolist() == [*range(200, 208), *range(300, 304)]
    assert torch.equal(stored["x"][:, 0].long(), stored["k"])


def _restart_shard(tmp_path, name: str, address: str, checkpoint) -> PeerProcess:
    """The shard ``name`` started again at ``address``, from ``checkpoint``."""
    return replay_peer(
        tmp_path, name, "--serve", "table", "--listen", address, "--checkpoint", str(checkpoint)
    )


def _save(shard: PeerProcess) -> None:
    shard.proc.stdin.write("save\n")
    shard.proc.stdin.flush()


def test_a_restored_shard_never_hands_out_a_lost_items_key_again(tmp_path, make_rpc):
    """Items acknowledged after a shard's last checkpoint are lost with it when
    it is killed; the shard restored from that checkpoint (twice: the second
    time with no save between) hands out keys that none of them had, so a
    key held from before names no other item."""
    checkpoint = tmp_path / "shard.ckpt"
    shard = replay_peer(tmp_path, "shard", "--serve", "table", "--checkpoint", str(checkpoint))
    address = shard.address
    lives = [shard]
    try:
        client_rpc = make_rpc("client", timeout=60)
        client_rpc.connect(address)
        client = moolib.ReplayClient(client_rpc, ("shard", "table"))
        kept = client.insert(rows(0, 8))
        _save(shard)
        shard.expect("SAVED")
        handed_out = [kept, client.insert(rows(8, 8))]  # acknowledged, then lost
        for life in range(2):
            kill_process(lives[-1].proc)
            lives.append(_restart_shard(tmp_path, "shard", address, checkpoint))
            wait_for(lambda: _answers(client_rpc, "shard", "table/info"), what="the shard back")
            new = client.insert(rows(100 + 8 * life, 8))
            assert not set(new.tolist()) & {k for keys in handed_out for k in keys.tolist()}
            handed_out.append(new)
            # The lost items' keys name nothing; the restored items' keys still do.
            assert client.update_priorities(handed_out[1], torch.full((8,), 5.0)) == 0
            assert client.update_priorities(kept, torch.ones(8)) == 8
            assert client.sample(16).items["k"].tolist() == list(range(8)) + [
                100 + 8 * life + i for i in range(8)
            ]
    finally:
        for life in lives:
            stop_process(life.proc)


def test_a_save_holds_the_tables_lock_only_to_copy(tmp_path):
    """Samples go on while a checkpoint is hashed and written: the table's state
    is copied under the lock, the file written after it is released. A sample
    made while the temporary file is being written (bytes in it, well short of
    its final size) returns before the save does."""
    replay = moolib.Replay(4096, selector="uniform", seed=0)
    for start in range(0, 4096, 256):
        replay.insert({"x": torch.full((256, 64 * 1024), start % 251, dtype=torch.uint8)})
    path = tmp_path / "big.ckpt"
    replay.save(path)
    final = path.stat().st_size
    for _ in range(10):
        saving = threading.Thread(target=replay.save, args=(path,))
        saving.start()
        seen = None
        while saving.is_alive() and seen is None:
            tmp = [p for p in tmp_path.glob("big.ckpt.tmp.*")]
            try:
                written = tmp[0].stat().st_size if tmp else 0
            except FileNotFoundError:
                written = 0
            # Past the header, and short of the end by more than the writer's
            # last buffer: the state is being written, not being finished.
            if 1 << 20 < written < final - (4 << 20):
                replay.sample(1)
                after = tmp[0].stat().st_size if tmp[0].exists() else final
                seen = after < final - (2 << 20)
        saving.join()
        if seen:
            break
    assert seen, "no sample returned while a save was writing"
    assert moolib.Replay.load(path).size() == 4096


def test_a_shard_killed_while_saving_removes_its_temporary_at_its_next_start(tmp_path, make_rpc):
    """kill -9 during a save leaves the shard's temporary file; the shard
    started again removes it (only its own: another checkpoint's, and one of
    a live process, stay)."""
    checkpoint = tmp_path / "shard.ckpt"
    shard = replay_peer(tmp_path, "shard", "--serve", "table", "--checkpoint", str(checkpoint))
    address = shard.address
    lives = [shard]
    others = [
        tmp_path / f"other.ckpt.tmp.{shard.proc.pid}.1",  # another checkpoint's
        tmp_path / f"shard.ckpt.tmp.{os.getpid()}.1",  # a live process's
    ]
    try:
        client_rpc = make_rpc("client", timeout=60)
        client_rpc.connect(address)
        client = moolib.ReplayClient(client_rpc, ("shard", "table"))
        big = {"k": torch.zeros(64, dtype=torch.int64), "x": torch.ones(64, 64 * 1024)}
        for _ in range(16):  # 256 MB: a save takes a while
            client.insert(big)
        _save(shard)
        shard.expect("SAVED", timeout=120)
        for path in others:
            path.write_bytes(b"x")
        stale = []
        for _ in range(5):
            _save(lives[-1])
            # Killed as soon as its temporary is there: mid-save.
            seen = wait_for(
                lambda: [p for p in tmp_path.glob("shard.ckpt.tmp.*") if p not in others],
                interval=0.001,
                what="the save's temporary",
            )
            kill_process(lives[-1].proc)
            stale = [p for p in seen if p.exists()]
            if stale:
                break
            # The save was done before the kill: again, from the restored table.
            lives.append(_restart_shard(tmp_path, "shard", address, checkpoint))
        assert stale, "no save caught in the act"
        lives.append(_restart_shard(tmp_path, "shard", address, checkpoint))
        assert not any(p.exists() for p in stale)
        assert all(p.exists() for p in others)
        assert moolib.Replay.load(checkpoint).size() == 16 * 64
    finally:
        for life in lives:
            stop_process(life.proc)
