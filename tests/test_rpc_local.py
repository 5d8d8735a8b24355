"""The Rpc API with real peers in one process (several Rpc objects talking over
loopback), parametrized over the transports: default, shm only and tcp only."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import os
import re
import socket
import threading
import time

import pytest
import torch
from helpers.util import (
    DEADLINE,
    assert_same,
    connections,
    sample_payload,
    transports_to,
    wait_for,
)

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")


@pytest.fixture
def pair(make_rpc, transports):
    """(client, server): the server listens on a free loopback port, the client
    connects to it; both are restricted to ``transports``."""
    server = make_rpc("server", transports=transports, listen=True, timeout=DEADLINE)
    client = make_rpc("client", transports=transports, timeout=DEADLINE)
    client.connect(server.address)
    return client, server


def result(fut, timeout=DEADLINE):
    return fut.result(timeout=timeout)


# ---------------------------------------------------------------------------
# Calls and data


def test_roundtrip_payload_exact(pair, transports):
    client, server = pair
    server.define("echo", lambda x: x)
    server.define("echo_all", lambda *a, **kw: (a, kw))
    payload = sample_payload()
    assert_same(payload, client.sync("server", "echo", payload))
    a, kw = client.sync("server", "echo_all", 1, torch.ones(2), key=[torch.zeros(3)], other=None)
    assert_same(((1, torch.ones(2)), {"key": [torch.zeros(3)], "other": None}), (a, kw))
    used = transports_to(client, "server")
    if transports == ["tcp"]:
        assert used and set(used) == {"tcp"}
    else:
        wait_for(lambda: "shm" in transports_to(client, "server"), what="an shm connection")


def test_received_tensor_is_usable_and_independent(pair):
    client, server = pair
    server.define("make", lambda: torch.arange(10000, dtype=torch.float32))
    first = client.sync("server", "make")
    second = client.sync("server", "make")
    first += 1  # received memory must be writable and not shared between results
    assert torch.equal(second, torch.arange(10000, dtype=torch.float32))
    assert torch.equal(first, torch.arange(1, 10001, dtype=torch.float32))


@pytest.mark.parametrize("restricted", [["shm"], ["tcp"]], ids=["shm", "tcp"])
def test_payload_bytes_go_over_selected_transport(make_rpc, restricted):
    server = make_rpc("server", listen=True, timeout=DEADLINE)
    client = make_rpc("client", transports=restricted, timeout=DEADLINE)
    client.connect(server.address)
    server.define("size", lambda t: t.numel())
    assert client.sync("server", "size", torch.zeros(1)) == 1

    def sent():
        totals = {"shm": 0, "tcp": 0}
        for c in connections(client, "server"):
            totals[c["transport"]] += c["bytes_sent"]
        return totals

    before = sent()
    payload = torch.ones(1 << 20, dtype=torch.uint8)
    for _ in range(3):
        assert client.sync("server", "size", payload) == 1 << 20
    after = sent()
    if restricted == ["tcp"]:
        assert after["tcp"] - before["tcp"] >= 3 << 20
        assert "shm" not in transports_to(client, "server")
    else:
        # bytes_sent of an shm connection counts only its signalling stream (the
        # payload goes through shared memory), so: requests went over shm, and
        # the payload did not go over the TCP connection.
        assert after["shm"] > before["shm"]
        assert after["tcp"] - before["tcp"] < 1 << 20


def test_call_self_by_name(make_rpc):
    rpc = make_rpc("me")
    rpc.define("twice", lambda x: x * 2)
    assert rpc.sync("me", "twice", 21) == 42
    assert torch.equal(rpc.sync("me", "twice", torch.ones(3)), torch.full((3,), 2.0))


def test_names_and_uids(make_rpc):
    a, b = moolib.Rpc(), moolib.Rpc()
    try:
        assert a.get_name() and b.get_name() and a.get_name() != b.get_name()
        a.set_name("alice")
        assert a.get_name() == "alice"
    finally:
        a.close()
        b.close()
    uids = {moolib.create_uid() for _ in range(100)}
    assert len(uids) == 100
    assert all(re.fullmatch(r"[0-9a-f]{32}", u) for u in uids)


def test_argument_validation(make_rpc):
    rpc = make_rpc("v")
    with pytest.raises(RuntimeError):
        rpc.set_transports(["carrier-pigeon"])
    with pytest.raises(RuntimeError):
        rpc.set_transports([])
    for bad in (0, -1, float("nan"), float("inf"), 1e7):
        with pytest.raises(ValueError, match=r"call timeout \(Rpc.set_timeout\)"):
            rpc.set_timeout(bad)
    with pytest.raises(TypeError, match="number of seconds"):
        rpc.set_timeout("3")
    with pytest.raises(ValueError):
        moolib.set_log_level("loud")
    rpc.set_timeout(3.5)
    assert rpc.get_timeout() == 3.5
    rpc.define("f", lambda: 1)
    with pytest.raises(RuntimeError, match="already defined"):
        rpc.define("f", lambda: 2)
    with pytest.raises(ValueError):
        rpc.define("g", lambda x: x, batch_size=0)
    with pytest.raises(ValueError):
        rpc.define_queue("q", batch_size=0)
    with pytest.raises(RuntimeError, match="not defined"):
        rpc.undefine("never-defined")
    # A name where a function belongs fails here, not on the first call's thread.
    with pytest.raises(TypeError, match="define: fn must be callable, got str 'h'"):
        rpc.define("h", "h")
    with pytest.raises(TypeError, match="define_deferred: fn must be callable, got int 5"):
        rpc.define_deferred("h", 5)
    with pytest.raises(TypeError, match="async_callback: callback must be callable"):
        rpc.async_callback("v", "f", None)
    assert rpc.sync("v", "f") == 1  # nothing was defined as "h"; "f" still answers
    with pytest.raises(TypeError, match=r"async_\(\): the function's name must be a str, got int"):
        rpc.async_("v", 5)
    with pytest.raises(TypeError, match=r"sync\(\): the peer's name must be a str, got NoneType"):
        rpc.sync(None, "f")
    # Names and counts are checked as the original's C++ signatures check them.
    for define in (
        lambda: rpc.define(5, lambda: 1),
        lambda: rpc.define_deferred(5, lambda cb: cb(1)),
        lambda: rpc.define_queue(5),
    ):
        with pytest.raises(TypeError, match="the function's name must be a str, got int"):
            define()
    with pytest.raises(TypeError, match="batch_size must be an int, got float"):
        rpc.define("g", lambda x: x, batch_size=2.5)
    with pytest.raises(TypeError, match="batch_size must be an int, got float"):
        rpc.define_queue("q", batch_size=2.5)
    with pytest.raises(TypeError, match="max threads must be an int, got float"):
        moolib.set_max_threads(2.5)
    assert rpc.sync("v", "f") == 1


# ---------------------------------------------------------------------------
# Errors


def test_unknown_peer_times_out_naming_peer_and_function(pair):
    client, _ = pair
    client.set_timeout(2)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        client.sync("nobody-here", "some_function")
    assert isinstance(info.value, moolib.RpcError)
    assert "nobody-here" in str(info.value) and "some_function" in str(info.value)
    assert time.monotonic() - start >= 1.5  # it waited for the timeout, not less


def test_undefined_function_error_names_it(pair):
    client, server = pair
    server.define("present", lambda: 1)
    assert client.sync("server", "present") == 1
    with pytest.raises(RuntimeError, match="absent_fn"):
        client.sync("server", "absent_fn")


def test_remote_exception_reaches_caller(pair):
    client, server = pair

    def boom(x):
        raise ValueError(f"boom {x}")

    server.define("boom", boom)
    with pytest.raises(moolib.RpcError) as info:
        client.sync("server", "boom", 7)
    message = str(info.value)
    assert "ValueError" in message and "boom 7" in message
    # The peer is still fine afterwards.
    server.define("ok", lambda: "ok")
    assert client.sync("server", "ok") == "ok"


def test_unpicklable_result_is_an_error_not_a_hang(pair):
    client, server = pair
    server.define("lock", lambda: threading.Lock())
    with pytest.raises(moolib.RpcError, match="(?i)pickle|lock"):
        client.sync("server", "lock")


def test_system_exit_in_function_is_reported(pair):
    client, server = pair

    def leave():
        raise SystemExit(3)

    server.define("leave", leave)
    with pytest.raises(moolib.RpcError, match="SystemExit"):
        client.sync("server", "leave")
    server.define("still", lambda: "alive")
    assert client.sync("server", "still") == "alive"


def test_listen_on_taken_port_raises(make_rpc):
    first = make_rpc("first", listen=True)
    second = make_rpc("second")
    with pytest.raises(RuntimeError):
        second.listen(first.address)
    with pytest.raises(RuntimeError):
        second.listen("not-an-address")


@pytest.mark.parametrize(
    "address, reason",
    [
        ("not-an-address", "expected host:port"),
        ("127.0.0.1:99999", "bad port"),
        ("localhost:", "bad port"),
        ("tcp://127.0.0.1:4431", "unknown scheme 'tcp://'"),
        ("::1:4431", "write IPv6 addresses as [addr]:port"),
    ],
)
def test_connect_to_a_malformed_address_raises(make_rpc, address, reason):
    rpc = make_rpc("dialer")
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        rpc.connect(address)
    # Nothing of it is left dialing, and the Rpc works on.
    server = make_rpc("after-a-bad-address", listen=True)
    server.define("f", lambda: 1)
    rpc.connect(server.address)
    assert rpc.sync("after-a-bad-address", "f") == 1


@pytest.fixture
def core_log():
    """(level, message) of every core log line while the test runs, through a logger of its own."""
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("moolib-test-capture")
    logger.propagate = False
    handler = Collect()
    logger.addHandler(handler)
    moolib.set_logging(logger)
    try:
        yield records
    finally:
        moolib.set_logging(None)
        logger.removeHandler(handler)


def test_connect_that_keeps_failing_is_logged_once(make_rpc, core_log):
    with socket.socket() as s:  # a port that refuses: bound, never listening
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
        rpc = make_rpc("keeps-dialing")
        rpc.connect(address)

        def said() -> list[str]:
            return [m for lvl, m in core_log if address in m and lvl >= logging.ERROR]

        # After 10 s of failures (the first ones are normal: peers start in any order).
        wait_for(lambda: said(), timeout=60, what="an error about the failing connect")
        assert "no link after" in said()[0] and "still trying" in said()[0], said()
        time.sleep(4)  # more failed attempts (every 1.6 s): no more errors
        assert len(said()) == 1, said()


def test_connect_to_its_own_address_is_said_once_and_dropped(make_rpc, core_log):
    """Every peer given the same address list, its own among them: the dial that
    reaches itself is named once and dropped, not redialed (5 errors a second
    before) or taken for a reflection attack; the other links work."""
    me = make_rpc("me", listen=True)
    other = make_rpc("other", listen=True)
    for rpc in (me, other):
        rpc.define("twice", lambda x: x * 2)
    for address in (me.address, other.address):
        me.connect(address)
        other.connect(address)

    def said(rpc_address: str) -> list[str]:
        return [m for lvl, m in core_log if lvl >= logging.ERROR and rpc_address in m]

    wait_for(
        lambda: said(me.address) and said(other.address),
        timeout=60,
        what="each peer saying it reached itself",
    )
    assert other.sync("me", "twice", 21) == 42
    assert me.sync("other", "twice", 2) == 4
    time.sleep(3)  # redials came every 100 ms before
    for address in (me.address, other.address):
        assert len(said(address)) == 1, said(address)
        assert "reached this Rpc itself" in said(address)[0], said(address)
    assert not [m for lvl, m in core_log if "nonce" in m], core_log
    assert other.sync("me", "twice", 21) == 42


def test_close_fails_calls_in_flight_and_later_use(make_rpc):
    server = make_rpc("server", listen=True)
    client = make_rpc("client", timeout=DEADLINE)
    client.connect(server.address)
    release = threading.Event()
    server.define("block", lambda: release.wait(DEADLINE))
    try:
        fut = client.async_("server", "block")
        wait_for(lambda: client.debug_info()["pending_calls"] >= 1, what="a pending call")
        client.close()
        assert fut.wait(DEADLINE)
        with pytest.raises(moolib.RpcError):
            fut.result()
        with pytest.raises(RuntimeError, match="closed"):
            client.async_("server", "block")
    finally:
        release.set()


def test_context_manager_closes():
    with moolib.Rpc() as rpc:
        rpc.define("f", lambda: 1)
        assert rpc.sync(rpc.get_name(), "f") == 1
    with pytest.raises(RuntimeError, match="closed"):
        rpc.sync(rpc.get_name(), "f")


# ---------------------------------------------------------------------------
# define variants


def test_batched_define_returns_each_caller_its_slice(pair):
    client, server = pair
    sizes = []
    lock = threading.Lock()

    def double(x, offset):
        with lock:
            sizes.append(x.shape[0])
        assert x.dim() == 2 and offset.dim() == 1
        time.sleep(0.05)  # lets more calls queue up behind a running batch
        return x * 2 + offset[:, None]

    server.define("double", double, batch_size=4)
    end = time.monotonic() + DEADLINE
    while True:
        futs = [
            client.async_("server", "double", torch.full((3,), float(i)), offset=torch.tensor(i))
            for i in range(10)
        ]
        for i, f in enumerate(futs):
            out = result(f)
            assert out.shape == (3,)
            assert torch.equal(out, torch.full((3,), 3.0 * i))
        if max(sizes) > 1 or time.monotonic() > end:
            break
    assert max(sizes) <= 4
    assert max(sizes) > 1, "concurrent calls were never batched"
    assert sum(sizes) % 10 == 0


def test_batched_define_nests_and_device(pair):
    client, server = pair

    def fn(obs):
        assert obs["a"].shape[0] == obs["b"][0].shape[0]
        return {"sum": obs["a"] + obs["b"][0], "neg": (-obs["a"],)}

    server.define("fn", fn, batch_size=3, device="cpu")
    futs = [
        client.async_(
            "server", "fn", {"a": torch.full((2,), i), "b": [torch.ones(2, dtype=torch.int64)]}
        )
        for i in range(5)
    ]
    for i, f in enumerate(futs):
        out = result(f)
        assert torch.equal(out["sum"], torch.full((2,), i + 1))
        assert isinstance(out["neg"], tuple)
        assert torch.equal(out["neg"][0], torch.full((2,), -i))


def test_batched_define_exception_fails_every_caller(pair):
    client, server = pair

    def bad(x):
        raise KeyError("batched-failure")

    server.define("bad", bad, batch_size=2)
    futs = [client.async_("server", "bad", torch.zeros(1)) for _ in range(3)]
    for f in futs:
        with pytest.raises(moolib.RpcError, match="batched-failure"):
            result(f)


def test_define_deferred_answers_from_another_thread(pair):
    client, server = pair
    timers = []

    def later(callback, x, delay=0.2):
        t = threading.Timer(delay, callback, args=(x + 1,))
        timers.append(t)
        t.start()

    server.define_deferred("later", later)
    futs = [client.async_("server", "later", i, delay=0.05 * (5 - i)) for i in range(5)]
    assert [result(f) for f in futs] == [1, 2, 3, 4, 5]
    assert torch.equal(client.sync("server", "later", torch.ones(2)), torch.full((2,), 2.0))
    for t in timers:
        t.join(DEADLINE)


def test_define_deferred_error_and_dropped_callback(pair):
    client, server = pair
    server.define_deferred("refuse", lambda cb: cb.error("refused-by-server"))
    server.define_deferred("forget", lambda cb: None)
    with pytest.raises(moolib.RpcError, match="refused-by-server"):
        client.sync("server", "refuse")
    # A callback dropped unanswered answers with an error (rather than a timeout).
    with pytest.raises(moolib.RpcError, match="without replying"):
        client.sync("server", "forget")


def test_undefine_then_call_fails_and_redefine_works(pair):
    client, server = pair
    server.define("f", lambda: "v1")
    assert client.sync("server", "f") == "v1"
    server.undefine("f")
    assert "f" not in server.debug_info()["functions"]
    with pytest.raises(RuntimeError, match="'f'"):
        client.sync("server", "f")
    server.define("f", lambda: "v2")
    assert client.sync("server", "f") == "v2"


def test_undefine_waits_for_calls_in_flight(pair):
    client, server = pair
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(DEADLINE)
        return "finished"

    server.define("slow", slow)
    fut = client.async_("server", "slow")
    assert started.wait(DEADLINE)
    undefined = threading.Event()
    t = threading.Thread(target=lambda: (server.undefine("slow"), undefined.set()))
    t.start()
    try:
        assert not undefined.wait(0.5)  # blocked while the call runs
    finally:
        release.set()
    t.join(DEADLINE)
    assert undefined.is_set()
    assert result(fut) == "finished"


# ---------------------------------------------------------------------------
# Queues


def test_queue_plain(pair):
    client, server = pair
    queue = server.define_queue("q")
    assert queue.empty()
    with pytest.raises(TimeoutError):
        queue.get(timeout=0.2)
    futs = [client.async_("server", "q", i, scale=10) for i in range(5)]
    wait_for(lambda: queue.qsize() == 5, what="5 queued calls")
    seen = []
    for item in queue:
        reply, args, kwargs = item
        seen.append(args[0])
        reply(args[0] * kwargs["scale"])
        if len(seen) == 5:
            break
    assert sorted(seen) == [0, 1, 2, 3, 4]
    assert [result(f) for f in futs] == [0, 10, 20, 30, 40]
    assert queue.empty()
    # Replying with an error reaches the caller.
    fut = client.async_("server", "q", -1)
    reply, args, _ = queue.get(timeout=DEADLINE)
    reply.error("negative-not-allowed")
    with pytest.raises(moolib.RpcError, match="negative-not-allowed"):
        result(fut)


def test_queue_batched_waits_for_full_batch(pair):
    client, server = pair
    queue = server.define_queue("q", batch_size=4)
    futs = [client.async_("server", "q", torch.full((2,), float(i))) for i in range(3)]
    wait_for(lambda: queue.qsize() == 3, what="3 queued calls")
    with pytest.raises(TimeoutError):
        queue.get(timeout=0.5)
    assert not any(f.done() for f in futs)
    futs.append(client.async_("server", "q", torch.full((2,), 3.0)))
    reply, args, kwargs = queue.get(timeout=DEADLINE)
    (batch,) = args
    assert batch.shape == (4, 2) and kwargs == {}
    assert sorted(batch[:, 0].tolist()) == [0.0, 1.0, 2.0, 3.0]
    reply(batch * 100)
    for i, f in enumerate(futs):
        assert torch.equal(result(f), torch.full((2,), 100.0 * i))


def test_queue_dynamic_batching(pair):
    client, server = pair
    queue = server.define_queue("q", batch_size=4, dynamic_batching=True)
    futs = [client.async_("server", "q", torch.tensor([i])) for i in range(2)]
    wait_for(lambda: queue.qsize() == 2, what="2 queued calls")
    reply, (batch,), _ = queue.get(timeout=DEADLINE)
    assert batch.shape == (2, 1)  # handed out without waiting for 4
    reply(batch + 1)
    assert [result(f).item() for f in futs] == [1, 2]

    futs = [client.async_("server", "q", torch.tensor([i])) for i in range(6)]
    wait_for(lambda: queue.qsize() == 6, what="6 queued calls")
    reply, (first,), _ = queue.get(timeout=DEADLINE)
    assert first.shape[0] == 4
    reply(first * 2)
    reply, (second,), _ = queue.get(timeout=DEADLINE)
    assert second.shape[0] == 2
    reply(second * 2)
    assert [result(f).item() for f in futs] == [0, 2, 4, 6, 8, 10]


def test_queue_and_future_awaitable_in_asyncio(pair):
    client, server = pair
    queue = server.define_queue("q")
    server.define("inc", lambda x: x + 1)

    async def serve(n):
        for _ in range(n):
            reply, args, _ = await queue
            reply(args[0] * 3)

    async def main():
        server_task = asyncio.ensure_future(serve(3))
        await asyncio.sleep(0.05)  # the server is waiting on an empty queue now
        values = await asyncio.gather(*(client.async_("server", "q", i) for i in range(3)))
        await asyncio.wait_for(server_task, DEADLINE)
        inc = await client.async_("server", "inc", 41)
        with pytest.raises(moolib.RpcError, match="nope"):
            await client.async_("server", "nope")
        return values, inc

    values, inc = asyncio.run(asyncio.wait_for(main(), DEADLINE))
    assert values == [0, 3, 6]
    assert inc == 42


# ---------------------------------------------------------------------------
# Futures and callbacks


def test_async_callback_success_and_error(pair):
    client, server = pair
    server.define("add", lambda a, b: a + b)
    got = []
    done = threading.Event()

    def callback(res, err):
        got.append((res, err, threading.current_thread() is threading.main_thread()))
        done.set()

    client.async_callback("server", "add", callback, 2, 3)
    assert done.wait(DEADLINE)
    assert got[0] == (5, None, False)

    done.clear()
    client.async_callback("server", "missing", callback)
    assert done.wait(DEADLINE)
    res, err, _ = got[1]
    assert res is None
    assert isinstance(err, moolib.RpcError) and "missing" in str(err)


def test_future_methods(pair):
    client, server = pair
    release = threading.Event()
    server.define("block", lambda: release.wait(DEADLINE) and "released")
    server.define("fail", lambda: 1 / 0)
    try:
        fut = client.async_("server", "block")
        assert not fut.done()
        assert fut.wait(0.2) is False
        with pytest.raises(TimeoutError):
            fut.result(timeout=0.1)
        with pytest.raises(TimeoutError):
            fut.exception(timeout=0.1)
        callbacks = []
        fut.add_done_callback(lambda f: callbacks.append(f.done()))
        release.set()
        assert fut.wait(DEADLINE) is True
        assert fut.done() and fut.result() == "released"
        assert fut.exception() is None
        assert fut.cancel() is False and not fut.cancelled()
        wait_for(lambda: callbacks == [True], what="the done callback")

        bad = client.async_("server", "fail")
        err = bad.exception(timeout=DEADLINE)
        assert isinstance(err, moolib.RpcError) and "ZeroDivisionError" in str(err)
        with pytest.raises(moolib.RpcError, match="ZeroDivisionError"):
            bad.result()
    finally:
        release.set()


def test_future_cancel(pair):
    client, server = pair
    release = threading.Event()
    server.define("block", lambda: release.wait(DEADLINE))
    try:
        fut = client.async_("server", "block")
        assert fut.cancel() is True
        assert fut.done() and fut.cancelled()
        assert fut.cancel() is False
        with pytest.raises(moolib.RpcError, match="cancel"):
            fut.result(timeout=DEADLINE)
    finally:
        release.set()
    # The connection is still usable after a cancelled call completes remotely.
    server.define("ok", lambda: "ok")
    assert client.sync("server", "ok") == "ok"
    wait_for(lambda: client.debug_info()["pending_calls"] == 0, what="no pending calls")


# ---------------------------------------------------------------------------
# Threads


def test_many_concurrent_sync_calls_from_threads(pair):
    client, server = pair
    server.define("square", lambda x: x * x)
    server.define("tsum", lambda t: t.sum().item())

    def one(i):
        if i % 3 == 0:
            return client.sync("server", "tsum", torch.full((100,), float(i))) == 100.0 * i
        return client.sync("server", "square", i) == i * i

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(one, range(200), timeout=DEADLINE * 2))
    assert len(outcomes) == 200 and all(outcomes)


def test_nested_calls(make_rpc, transports):
    hub = make_rpc("hub", transports=transports, listen=True, timeout=DEADLINE)
    a = make_rpc("a", transports=transports, timeout=DEADLINE)
    b = make_rpc("b", transports=transports, timeout=DEADLINE)
    a.connect(hub.address)
    b.connect(hub.address)
    b.define("leaf", lambda x: x + 1)
    hub.define("middle", lambda x: hub.sync("b", "leaf", x) * 10)
    # a.top calls the hub which calls b: three levels, each inside a defined function.
    a.define("top", lambda x: a.sync("hub", "middle", x) + 5)
    for i in range(10):
        assert hub.sync("a", "top", i) == (i + 1) * 10 + 5
    # b reaches a by name although neither listens: found through the hub.
    assert b.sync("a", "top", 100) == 1015


def test_concurrent_nested_calls_in_one_process(make_rpc):
    # All peers of this process share one thread pool, smaller than the calls
    # that block in it: a worker blocked in a nested call has another run in
    # its place (tests/test_rpc_nested.py goes further).
    original = moolib._core.get_max_threads()
    moolib.set_max_threads(2)
    try:
        server = make_rpc("server", listen=True, timeout=DEADLINE)
        inner = make_rpc("inner", timeout=DEADLINE)
        client = make_rpc("client", timeout=DEADLINE)
        inner.connect(server.address)
        client.connect(server.address)
        inner.define("leaf", lambda x: x * 3)
        server.define("outer", lambda x: server.sync("inner", "leaf", x) + 1)
        assert client.sync("server", "outer", 1) == 4
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            values = list(pool.map(lambda i: client.sync("server", "outer", i), range(40)))
        assert values == [3 * i + 1 for i in range(40)]
    finally:
        moolib.set_max_threads(original)


def test_set_max_threads_then_many_concurrent_calls(make_rpc):
    original = moolib._core.get_max_threads()
    moolib.set_max_threads(2)
    try:
        server = make_rpc("server", listen=True, timeout=DEADLINE)
        client = make_rpc("client", timeout=DEADLINE)
        client.connect(server.address)
        server.define("slow_id", lambda i: (time.sleep(0.01), i)[1])
        futs = [client.async_("server", "slow_id", i) for i in range(100)]
        assert [result(f) for f in futs] == list(range(100))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            values = list(pool.map(lambda i: client.sync("server", "slow_id", i), range(64)))
        assert values == list(range(64))
    finally:
        moolib.set_max_threads(original)


def test_calls_sent_together_run_together(pair):
    """Requests read in one batch must not wait for each other: a function that
    blocks (here until all four calls are in) once held the rest of its batch."""
    client, server = pair
    barrier = threading.Barrier(4, timeout=DEADLINE)
    server.define("meet", lambda: barrier.wait() >= 0)
    for _ in range(10):  # the barrier resets after each round
        futures = [client.async_("server", "meet") for _ in range(4)]
        assert [result(f) for f in futures] == [True] * 4


def test_a_quick_reply_does_not_wait_for_a_blocked_call(pair):
    """Nor may a reply that is ready wait (corked) behind a blocked function."""
    client, server = pair
    release = threading.Event()
    server.define("block", lambda: release.wait(DEADLINE))
    server.define("quick", lambda x: x)
    try:
        for i in range(10):
            blocked = client.async_("server", "block")
            quick = [client.async_("server", "quick", k) for k in range(3)]
            assert [result(f) for f in quick] == [0, 1, 2], f"round {i}"
            assert not blocked.done()
            release.set()
            assert result(blocked) is True
            release.clear()
    finally:
        release.set()


def test_a_pool_shrunk_then_grown_has_all_its_threads(make_rpc):
    """Threads a smaller pool ended leave when they next wake up, in any order:
    growing it again must start exactly the missing ones."""
    original = moolib._core.get_max_threads()
    try:
        moolib.set_max_threads(4)
        server = make_rpc("server", listen=True, timeout=DEADLINE)
        client = make_rpc("client", timeout=DEADLINE)
        client.connect(server.address)
        server.define("ident", threading.get_ident)
        barrier = threading.Barrier(4, timeout=DEADLINE)
        server.define("meet", lambda: barrier.wait() >= 0)
        for round_ in range(3):
            moolib.set_max_threads(1)
            for _ in range(20):  # wake some of the ended threads, not all
                [result(f) for f in [client.async_("server", "ident") for _ in range(4)]]
            moolib.set_max_threads(4)
            futures = [client.async_("server", "meet") for _ in range(4)]
            assert [result(f) for f in futures] == [True] * 4, f"round {round_}"
    finally:
        moolib.set_max_threads(original)


# ---------------------------------------------------------------------------
# Logging


def test_listen_on_all_interfaces_without_key_warns(core_log):
    rpc = moolib.Rpc()
    try:
        bound = rpc.listen("0.0.0.0:0")
        assert bound.rsplit(":", 1)[1] != "0"
        wait_for(
            lambda: any("authentication" in m and lvl >= logging.WARNING for lvl, m in core_log),
            timeout=30,
            what="a warning about authentication",
        )
    finally:
        rpc.close()


def test_set_logging_to_python_logging_module(make_rpc):
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append((record.levelno, record.getMessage()))

    logger = logging.getLogger("moolib")
    handler = Collect()
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    old_log_level = moolib._core.get_log_level()
    moolib.set_logging(logging)  # the module: log to the "moolib" logger
    moolib.set_log_level("info")
    try:
        server = make_rpc("logged-server", listen=True)
        client = make_rpc("logged-client", timeout=DEADLINE)
        client.connect(server.address)
        server.define("f", lambda: 1)
        assert client.sync("logged-server", "f") == 1
        wait_for(
            lambda: any("logged-server" in m or "logged-client" in m for _, m in records),
            timeout=30,
            what="an info line about the connection",
        )
    finally:
        moolib.set_log_level(old_log_level)
        moolib.set_logging(None)
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_no_descriptor_or_thread_leak_over_many_rpcs():
    def fds():
        return len(os.listdir("/proc/self/fd"))

    def threads():
        return len(os.listdir("/proc/self/task"))

    def lifetime(i):
        server = moolib.Rpc()
        server.set_name(f"leak-server-{i}")
        address = server.listen("127.0.0.1:0")
        client = moolib.Rpc()
        client.set_timeout(DEADLINE)
        client.connect(address)
        server.define("f", lambda x: x)
        assert torch.equal(client.sync(f"leak-server-{i}", "f", torch.ones(5000)), torch.ones(5000))
        if i % 2:
            client.close()
            server.close()
        # else: dropped without close()

    lifetime(0)
    gc.collect()
    fds_before, threads_before = fds(), threads()
    for i in range(1, 61):
        lifetime(i)
    gc.collect()
    # Closing is asynchronous: allow it to settle, then compare.
    wait_for(lambda: fds() <= fds_before + 10, timeout=30, what="descriptors to be released")
    assert threads() <= threads_before + 4


def test_first_large_shm_call_right_after_connect():
    """Regression: a request carrying shared memory that arrived in the same read as the
    peer's IDENTIFY frame was refused ('file descriptors before the handshake')."""
    # One worker makes both frames pile up before they are read, which widens
    # the window (about half of the attempts fail then; ~2% with the default pool).
    original = moolib._core.get_max_threads()
    moolib.set_max_threads(1)
    big = torch.ones(1 << 20)
    try:
        for i in range(40):
            server, client = moolib.Rpc(), moolib.Rpc()
            try:
                for rpc in (server, client):
                    rpc.set_transports(["shm"])
                server.set_name(f"shm-first-{i}")
                server.define("echo", lambda x: x)
                client.set_timeout(5)
                client.connect(server.listen("127.0.0.1:0"))
                # The first request carries a shared-memory segment.
                assert torch.equal(client.sync(f"shm-first-{i}", "echo", big), big)
            finally:
                client.close()
                server.close()
    finally:
        moolib.set_max_threads(original)


def test_an_empty_peer_or_function_name_is_refused_at_once(make_rpc):
    # No peer or function has an empty name: the call is refused, not left to
    # wait out its timeout.
    rpc = make_rpc("v", timeout=5)
    for call in (rpc.sync, rpc.async_):
        with pytest.raises(ValueError, match=r"peer's name must be 1 to 1024 characters, got 0"):
            call("", "f")
        with pytest.raises(ValueError, match=r"function's name must be 1 to 1024 characters"):
            call("v", "")
        with pytest.raises(ValueError, match=r"peer's name .* got 1025"):
            call("p" * 1025, "f")
