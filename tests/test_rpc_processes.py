"""The Rpc API between processes: this process against peers running
tests/helpers/peer.py, over each transport (default, shm only, tcp only)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import time

import pytest
import torch
from helpers.util import (
    DEADLINE,
    TRANSPORT_IDS,
    TRANSPORTS,
    assert_same,
    client_of,
    connections,
    freeze,
    module_server,
    peer_entry,
    sample_payload,
    transports_to,
    wait_for,
)

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")


@pytest.fixture(scope="module", params=TRANSPORTS, ids=TRANSPORT_IDS)
def server(request, module_spawn_peer):
    """A peer process restricted to the transports of the parameter, shared by the module."""
    return module_server(module_spawn_peer, "srv-", request.param)


@pytest.fixture
def client(make_rpc, server):
    return client_of(make_rpc, server, "client-")


# ---------------------------------------------------------------------------
# Data


def test_payload_roundtrip_exact(client, server):
    payload = sample_payload()
    assert_same(payload, client.sync(server.name, "echo", payload))
    args, kwargs = client.sync(
        server.name, "echo_all", torch.ones(2, 2).t(), flag=True, t=(torch.zeros(1),)
    )
    assert_same(((torch.ones(2, 2),), {"flag": True, "t": (torch.zeros(1),)}), (args, kwargs))
    assert client.sync(server.name, "pid") == server.pid
    used = transports_to(client, server.name)
    if server.transports == ["tcp"]:
        assert set(used) == {"tcp"}
    else:
        assert "shm" in used


def test_large_tensor_roundtrip(client, server):
    big = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)
    back = client.sync(server.name, "echo", big)
    assert back.shape == big.shape and back.dtype == big.dtype
    assert torch.equal(back, big)
    # What arrived over there is right too (checked on the remote side).
    floats = torch.randn(16 << 20 >> 2 << 2)  # 64 MiB of float32
    assert client.sync(server.name, "checksum", floats.view(torch.int32)) == int(
        floats.view(torch.int32).to(torch.int64).sum()
    )
    zeros = client.sync(server.name, "zeros", 64 << 20)
    assert zeros.numel() == 64 << 20 and not zeros.any()


def test_segments_of_sizes_around_the_tcp_read_marks(client, server):
    """Over TCP a receiver reads segments of 32 KiB and more straight into their buffer,
    and while 512 KiB or more of one is still to come it asks the socket to wake it only
    once 256 KiB wait (docs/architecture.md, section 4): sizes on either side of those
    marks, one per call and several in one call, arrive whole both ways."""
    kib = 1 << 10
    sizes = [32 * kib - 1, 32 * kib, 256 * kib, 512 * kib - 1, 512 * kib, 512 * kib + 1]
    sizes += [768 * kib + 3, (1 << 20) + 1, (5 << 20) + 12345]
    g = torch.Generator().manual_seed(7)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    for t in tensors:
        assert torch.equal(client.sync(server.name, "echo", t), t), t.numel()
    back = client.sync(server.name, "echo", tensors)
    assert [b.numel() for b in back] == sizes
    assert all(torch.equal(b, t) for b, t in zip(back, tensors, strict=True))


def test_concurrent_mixed_size_payloads(client, server):
    sizes = [1, 100, 5000, 1 << 16, 1 << 20, 16 << 20, 3, 1 << 22]

    def one(i):
        g = torch.Generator().manual_seed(i)
        x = torch.randint(0, 256, (sizes[i % len(sizes)],), dtype=torch.uint8, generator=g)
        return torch.equal(client.sync(server.name, "echo", x), x)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(one, range(48), timeout=DEADLINE * 2))
    assert all(outcomes)


def test_remote_errors(client, server):
    with pytest.raises(moolib.RpcError) as info:
        client.sync(server.name, "fail", "boom")
    assert "ValueError" in str(info.value) and "boom" in str(info.value)
    with pytest.raises(RuntimeError, match="no_such_function"):
        client.sync(server.name, "no_such_function")
    client.set_timeout(2)
    with pytest.raises(RuntimeError) as info:
        client.sync("ghost-peer", "haunt")
    assert "ghost-peer" in str(info.value) and "haunt" in str(info.value)
    client.set_timeout(DEADLINE)
    assert client.sync(server.name, "add", 2, 3) == 5


def test_many_concurrent_calls_from_threads(client, server):
    def one(i):
        if i % 4 == 0:
            t = torch.full((1000,), i, dtype=torch.int64)
            return client.sync(server.name, "checksum", t) == 1000 * i
        return client.sync(server.name, "add", i, i) == 2 * i

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(one, range(200), timeout=DEADLINE * 2))
    assert len(outcomes) == 200 and all(outcomes)


def test_async_callback_and_futures_across_processes(client, server):
    results = []
    futs = [client.async_(server.name, "add", i, 1) for i in range(50)]
    client.async_callback(server.name, "add", lambda r, e: results.append((r, e)), 40, 2)
    client.async_callback(server.name, "fail", lambda r, e: results.append((r, e)), "bad")
    assert [f.result(timeout=DEADLINE) for f in futs] == list(range(1, 51))
    wait_for(lambda: len(results) == 2, what="both callbacks")
    ok = [r for r in results if r[1] is None]
    bad = [r for r in results if r[1] is not None]
    assert ok == [(42, None)]
    assert bad[0][0] is None and "bad" in str(bad[0][1])


def test_peer_calls_back_into_this_process(client, server):
    # The peer's "call" function makes a nested sync call back into us while our
    # own call to it is waiting.
    client.define("hello", lambda who: f"hello {who}")
    assert client.sync(server.name, "call", client.get_name(), "hello", "there") == "hello there"


# ---------------------------------------------------------------------------
# Transport selection


def test_same_host_peers_switch_to_shm_by_themselves(make_rpc, spawn_peer):
    peer = spawn_peer("auto")
    rpc = make_rpc("auto-client", timeout=DEADLINE)
    rpc.connect(peer.address)  # a TCP address
    assert peer.address.startswith("127.0.0.1:")
    assert rpc.sync("auto", "add", 1, 2) == 3
    wait_for(lambda: "shm" in transports_to(rpc, "auto"), what="an shm connection")
    entry = peer_entry(rpc, "auto")
    assert entry["same_host"] is True
    assert torch.equal(rpc.sync("auto", "echo", torch.arange(100000)), torch.arange(100000))
    # The other side sees us over shm too.
    remote = wait_for(
        lambda: [
            p
            for p in rpc.sync("auto", "info")["peers"]
            if p["name"] == "auto-client" and any(c["transport"] == "shm" for c in p["connections"])
        ],
        what="the peer's view of an shm connection",
    )
    assert remote


def test_tcp_only_caller_never_uses_shm(make_rpc, spawn_peer):
    peer = spawn_peer("tcp-target")
    rpc = make_rpc("tcp-caller", transports=["tcp"], timeout=DEADLINE)
    rpc.connect(peer.address)
    for i in range(20):
        assert rpc.sync("tcp-target", "add", i, 1) == i + 1
    assert torch.equal(rpc.sync("tcp-target", "echo", torch.ones(1 << 18)), torch.ones(1 << 18))
    time.sleep(1.0)  # an upgrade, if any, would have happened by now
    assert transports_to(rpc, "tcp-target") and set(transports_to(rpc, "tcp-target")) == {"tcp"}
    assert rpc.debug_info()["transports"] == ["tcp"]
    remote = rpc.sync("tcp-target", "info")
    (me,) = [p for p in remote["peers"] if p["name"] == "tcp-caller"]
    assert {c["transport"] for c in me["connections"]} == {"tcp"}


# ---------------------------------------------------------------------------
# Discovery and reconnection


@pytest.fixture(scope="module")
def hub(module_spawn_peer):
    return module_spawn_peer("hub", timeout=DEADLINE)


@pytest.mark.parametrize("transports", TRANSPORTS, ids=TRANSPORT_IDS)
def test_discovery_by_name_then_direct_connection(make_rpc, spawn_peer, hub, transports):
    # C connects to the hub; it also listens on TCP so that a tcp-only caller can dial it.
    c = spawn_peer("disc-c-" + moolib.create_uid()[:6], connect=[hub.address])
    a = make_rpc("disc-a-" + moolib.create_uid()[:6], transports=transports, timeout=DEADLINE)
    a.connect(hub.address)
    assert a.sync(c.name, "name") == c.name
    assert a.sync(c.name, "pid") == c.pid
    entry = wait_for(lambda: peer_entry(a, c.name), what="a peer entry for C")
    assert len(entry["connections"]) >= 1
    used = transports_to(a, c.name)
    if transports == ["tcp"]:
        assert set(used) == {"tcp"}
    elif transports == ["shm"]:
        assert "shm" in used


@pytest.mark.parametrize("transports", TRANSPORTS, ids=TRANSPORT_IDS)
def test_discovery_of_connect_only_peer(make_rpc, spawn_peer, hub, transports):
    # C never calls listen(): reachable by name through the hub all the same,
    # and dialed directly (both sides restricted to the same transports).
    name = "disc-nolisten-" + moolib.create_uid()[:6]
    c = spawn_peer(name, listen=None, connect=[hub.address], transports=transports)
    assert c.address is None
    a = make_rpc("disc-a2-" + moolib.create_uid()[:6], transports=transports, timeout=DEADLINE)
    a.connect(hub.address)
    assert a.sync(name, "pid") == c.pid
    wait_for(lambda: connections(a, name), what="a direct connection to C")
    if transports:
        assert set(transports_to(a, name)) <= set(transports)


def test_a_peer_slow_to_shake_hands_is_dialed_once(make_rpc, spawn_peer, hub):
    """While a peer found by name has not finished its handshake (here: stopped, so
    only its kernel accepts), discovery rounds (every 0.5 s) do not dial it again: one
    link to it, not one a round. On a loaded host, slow handshakes piled links up."""
    name = "slow-" + moolib.create_uid()[:6]
    c = spawn_peer(name, connect=[hub.address])
    probe = make_rpc("slow-probe-" + moolib.create_uid()[:6], timeout=DEADLINE)
    probe.connect(hub.address)
    assert probe.sync(name, "name") == name  # the hub knows C
    a = make_rpc("slow-a-" + moolib.create_uid()[:6], transports=["tcp"], timeout=DEADLINE)
    a.connect(hub.address)
    freeze(c.pid)
    try:
        future = a.async_(name, "name")
        time.sleep(3)
    finally:
        os.kill(c.pid, signal.SIGCONT)
    assert future.result(timeout=DEADLINE) == name
    time.sleep(1)  # links dialed meanwhile finish their handshakes now
    assert len(connections(a, name)) == 1, connections(a, name)


def test_restarted_peer_reachable_by_name_again(make_rpc, spawn_peer, hub):
    first = spawn_peer("phoenix", connect=[hub.address])
    a = make_rpc("watcher", timeout=DEADLINE)
    a.connect(hub.address)
    assert a.sync("phoenix", "pid") == first.pid
    a.set_timeout(5)  # per attempt while polling below
    assert first.kill(signal.SIGKILL) == -signal.SIGKILL
    second = spawn_peer("phoenix", connect=[hub.address])  # a new port, same name

    def reaches_second():
        try:
            return a.sync("phoenix", "pid") == second.pid
        except RuntimeError:
            return False

    wait_for(reaches_second, what="the restarted peer")
    assert a.sync("phoenix", "add", 40, 2) == 42


def test_connect_redials_the_same_address(make_rpc, spawn_peer):
    first = spawn_peer("redial")
    port_address = first.address
    a = make_rpc("redialer", timeout=DEADLINE)
    a.connect(port_address)
    assert a.sync("redial", "pid") == first.pid
    a.set_timeout(5)  # per attempt while polling below
    first.kill(signal.SIGKILL)
    second = wait_for(
        lambda: spawn_peer("redial", listen=port_address), timeout=DEADLINE, what="re-listening"
    )
    assert second.address == port_address

    def reaches_second():
        try:
            return a.sync("redial", "pid") == second.pid
        except RuntimeError:
            return False

    wait_for(reaches_second, what="the peer restarted on the same address")


@pytest.mark.parametrize("transports", TRANSPORTS, ids=TRANSPORT_IDS)
def test_killed_peer_calls_fail_after_timeout(make_rpc, spawn_peer, transports):
    peer = spawn_peer("doomed", transports=transports)
    a = make_rpc("survivor", transports=transports, timeout=DEADLINE)
    a.connect(peer.address)
    assert a.sync("doomed", "pid") == peer.pid
    a.set_timeout(2)
    in_flight = a.async_("doomed", "sleep", 30)
    time.sleep(0.2)
    peer.kill(signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(moolib.RpcError):
        in_flight.result(timeout=DEADLINE)
    with pytest.raises(RuntimeError) as info:
        a.sync("doomed", "pid")
    assert "doomed" in str(info.value)
    assert time.monotonic() - start < DEADLINE
    # This peer is still healthy.
    a.define("local", lambda: "fine")
    assert a.sync("survivor", "local") == "fine"


def test_peer_killed_while_sending_a_large_reply(make_rpc, spawn_peer):
    """A reader in the middle of a large TCP segment sees its sender die: it drops the
    connection, the call fails, and the reader's process serves on."""
    peer = spawn_peer("doomed-sender", transports=["tcp"])
    a = make_rpc("reader", transports=["tcp"], timeout=DEADLINE)
    a.connect(peer.address)
    assert a.sync("doomed-sender", "pid") == peer.pid

    def received() -> int:
        return sum(c["bytes_received"] for c in connections(a, "doomed-sender"))

    before = received()
    a.set_timeout(5)
    # 4 GiB of zeros take seconds to cross, so the kill lands mid-segment.
    reply = a.async_("doomed-sender", "zeros", 4 << 30)
    wait_for(lambda: received() > before + (1 << 20), what="the reply's first MiB")
    peer.kill(signal.SIGKILL)
    # The reader drops the connection, and with it the call in flight (no other
    # link to that process is left): a ConnectionLostError.
    wait_for(lambda: not connections(a, "doomed-sender"), what="the dead connection dropped")
    with pytest.raises(moolib.RpcError):
        reply.result(timeout=DEADLINE)
    a.define("local", lambda: "fine")
    assert a.sync("reader", "local") == "fine"


# ---------------------------------------------------------------------------
# Nested calls between processes


def test_nested_call_through_another_process(make_rpc, spawn_peer, hub):
    b = spawn_peer("nest-b", connect=[hub.address])
    a = make_rpc("nest-a", timeout=DEADLINE)
    a.connect(hub.address)
    for i in range(5):
        assert a.sync("hub", "call", b.name, "add", i, 100) == i + 100


def test_concurrent_nested_calls_through_another_process(make_rpc, spawn_peer):
    # Regression: a function making a sync call while another request, read in
    # the same batch, waited behind it had its outgoing request corked until the
    # batch ended, so the inner call could only time out. The hub gives up on its
    # inner call after 3 s; the outer caller waits longer, so a stuck inner call
    # shows up as the hub's error.
    hub = spawn_peer("nest-hub", timeout=3)
    b = spawn_peer("nest-b2", connect=[hub.address])
    a = make_rpc("nest-a2", timeout=DEADLINE)
    a.connect(hub.address)
    assert a.sync("nest-hub", "call", b.name, "add", 0, 1) == 1
    for _ in range(10):
        futs = [a.async_("nest-hub", "call", b.name, "add", i, 1) for i in range(2)]
        assert [f.result(timeout=DEADLINE) for f in futs] == [1, 2]


def test_call_waits_for_a_peer_that_joins_later(make_rpc, spawn_peer, hub):
    a = make_rpc("early-caller", timeout=DEADLINE)
    a.connect(hub.address)
    assert a.sync("hub", "name") == "hub"
    fut = a.async_("late-joiner", "pid")  # nobody by that name yet
    time.sleep(0.5)
    assert not fut.done()
    late = spawn_peer("late-joiner", listen=None, connect=[hub.address])
    assert fut.result(timeout=DEADLINE) == late.pid


def test_connect_before_the_peer_listens(make_rpc, spawn_peer):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{probe.getsockname()[1]}"
    probe.close()
    a = make_rpc("eager", timeout=DEADLINE)
    a.connect(address)  # nothing listens there yet: it keeps trying
    time.sleep(0.5)
    peer = spawn_peer("latecomer", listen=address)
    assert a.sync("latecomer", "pid") == peer.pid


def test_peer_with_two_threads_serves_many_concurrent_calls(make_rpc, spawn_peer):
    peer = spawn_peer("two-threads", max_threads=2)
    a = make_rpc("many-caller", timeout=DEADLINE)
    a.connect(peer.address)
    futs = [a.async_("two-threads", "sleep", 0.01) for _ in range(100)]
    assert all(f.result(timeout=DEADLINE) == 0.01 for f in futs)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        values = list(pool.map(lambda i: a.sync("two-threads", "add", i, 1), range(200)))
    assert values == [i + 1 for i in range(200)]
