"""The sync() round trip between processes: a caller serves the connection its
reply comes on (it takes the connection from the event loop while it waits,
and gives it back after). These tests cover what must still work around
that: frames that arrive while nobody waits, many threads and both sides
calling over one connection, nested calls, large replies, timeouts, bursts
of calls, and a peer that dies between syncs or while one waits."""

from __future__ import annotations

import functools
import signal
import threading
import time

import pytest
from helpers.util import (
    DEADLINE,
    TRANSPORT_IDS,
    TRANSPORTS,
    client_of,
    module_server,
    run_in_threads,
    wait_for,
)

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")


@pytest.fixture(scope="module", params=TRANSPORTS[1:], ids=TRANSPORT_IDS[1:])
def server(request, module_spawn_peer):
    """A peer process on one transport (shm, tcp), shared by the module."""
    return module_server(module_spawn_peer, "sync-srv-", request.param)


@pytest.fixture
def client(make_rpc, server):
    rpc = client_of(make_rpc, server, "sync-client-")
    assert rpc.sync(server.name, "pid") == server.pid
    return rpc


def test_back_to_back_syncs_return_their_own_results(client, server):
    for i in range(2000):
        assert client.sync(server.name, "echo", i) == i


def test_peer_request_reaches_us_while_nobody_waits(client, server):
    # Our syncs served the connection themselves; the peer's call back into us
    # then arrives while no thread of ours waits on it, and must still be read.
    client.define("hello", lambda who: f"hello {who}")
    for round_ in range(20):
        for i in range(20):
            assert client.sync(server.name, "echo", i) == i
        future = client.async_(server.name, "call", client.get_name(), "hello", round_)
        # Poll without waiting on the future: waiting would serve the connection.
        wait_for(future.done, what="the peer's call back into us")
        assert future.result() == f"hello {round_}"


def test_many_threads_sync_over_one_connection(client, server):
    def work(t: int) -> None:
        for i in range(300):
            assert client.sync(server.name, "echo", (t, i)) == (t, i)

    run_in_threads(*(functools.partial(work, t) for t in range(8)))


def test_both_sides_sync_at_once(client, server):
    # Some threads call plain functions while others call a function that
    # calls back into us with its own sync, so both processes wait on and
    # serve the same connection concurrently.
    client.define("twice", lambda x: 2 * x)

    def plain(t: int) -> None:
        for i in range(200):
            assert client.sync(server.name, "add", t, i) == t + i

    def nested() -> None:
        for i in range(100):
            assert client.sync(server.name, "call", client.get_name(), "twice", i) == 2 * i

    run_in_threads(*(functools.partial(plain, t) for t in range(3)), nested, nested, nested)


def test_a_function_blocked_outside_moolib_does_not_hold_back_its_callers_next_call(client, server):
    # The worker that reads our syncs keeps the connection while it runs them
    # (Loop::runInlineTasks); one that blocks where the core cannot see it (a
    # threading.Event) must still let our next call through, or hold would
    # wait for a release that never comes.
    for round_ in range(5):
        for i in range(20):
            assert client.sync(server.name, "echo", i) == i
        key = f"{client.get_name()}-{round_}"
        held = client.async_(server.name, "hold", key, DEADLINE)
        assert client.sync(server.name, "release", key) is True
        assert held.result(timeout=DEADLINE) is True


@pytest.mark.parametrize("how", ["call", "call_async"])
def test_functions_calling_back_over_the_connection_they_were_read_from(client, server, how):
    # The peer's function waits for a call of its own into us, over the
    # connection its request came on: with sync (which takes that connection
    # over) or with a future's result().
    client.define("twice", lambda x: 2 * x)
    for i in range(100):
        assert client.sync(server.name, how, client.get_name(), "twice", i) == 2 * i
        assert client.sync(server.name, "echo", i) == i


@pytest.mark.parametrize("size", [1, 300_000, 64 << 20])
def test_sync_with_a_large_reply(client, server, size):
    for _ in range(3):
        reply = client.sync(server.name, "zeros", size)
        assert reply.numel() == size and int(reply.sum()) == 0
        assert client.sync(server.name, "echo", size) == size


def test_timeout_fires_while_the_caller_serves_the_connection(client, server):
    client.set_timeout(0.5)
    start = time.monotonic()
    with pytest.raises(moolib.RpcError, match="timed out"):
        client.sync(server.name, "sleep", 3)
    assert time.monotonic() - start < DEADLINE
    client.set_timeout(DEADLINE)
    # The late reply is dropped; the connection goes on working.
    for i in range(50):
        assert client.sync(server.name, "echo", i) == i


def test_peer_killed_between_syncs(make_rpc, spawn_peer, server):
    peer = spawn_peer("sync-doomed", transports=server.transports)
    rpc = make_rpc("sync-survivor", transports=server.transports, timeout=DEADLINE)
    rpc.connect(peer.address)
    for i in range(100):
        assert rpc.sync("sync-doomed", "echo", i) == i
    rpc.set_timeout(2)
    peer.kill(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        rpc.sync("sync-doomed", "pid")
    assert time.monotonic() - start < DEADLINE
    # The loss is noticed without anyone calling: the link goes away.
    wait_for(
        lambda: (
            not any(
                p["name"] == "sync-doomed" and p["connections"] for p in rpc.debug_info()["peers"]
            )
        ),
        what="the dead peer's connection to close",
    )


def test_peer_killed_while_a_sync_waits(make_rpc, spawn_peer, server):
    peer = spawn_peer("sync-victim", transports=server.transports)
    rpc = make_rpc("sync-waiter", transports=server.transports, timeout=DEADLINE)
    rpc.connect(peer.address)
    assert rpc.sync("sync-victim", "pid") == peer.pid
    rpc.set_timeout(2)
    killer = threading.Timer(0.5, peer.kill)
    killer.start()
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError):
            rpc.sync("sync-victim", "sleep", 30)
    finally:
        killer.join()
    assert time.monotonic() - start < DEADLINE
    rpc.define("local", lambda: "fine")
    assert rpc.sync("sync-waiter", "local") == "fine"


def test_burst_results_collected_between_syncs(client, server):
    # While replies to a burst are due, a caller done with its own reply
    # gives the connection back to the loop, which reads the rest.
    for round_ in range(5):
        futures = [client.async_(server.name, "echo", (round_, i)) for i in range(300)]
        for i, f in enumerate(futures):
            if i % 50 == 0:
                assert client.sync(server.name, "add", i, 1) == i + 1
            assert f.result() == (round_, i)
