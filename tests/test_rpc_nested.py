"""Nested calls never deadlock: functions that call back into their caller (or
through a third peer) with sync() while many such calls are in flight all
complete, whatever the size of the thread pool, with peers in one process or in
separate processes.

A function blocked in a nested sync() holds a core thread; with a fixed pool,
enough of them in flight once left no thread to run the calls they waited for.
Every call here gets a long rpc timeout, so a stall shows as calls not done by
the deadline (a test failure), never as a timeout error."""

from __future__ import annotations

import time

import pytest
from helpers.util import DEADLINE, run_script

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")

# Far beyond DEADLINE: a call must complete, not time out.
RPC_TIMEOUT = 4 * DEADLINE
ROUNDS = 3
NESTED = [64, 256]
# None: the default pool size.
MAX_THREADS = [1, 2, None]
MAX_THREADS_IDS = ["threads1", "threads2", "default"]
TRANSPORTS = [["shm"], ["tcp"]]
TRANSPORT_IDS = ["shm", "tcp"]


def _pool_size(size):
    original = moolib._core.get_max_threads()
    if size is not None:
        moolib.set_max_threads(size)
    yield size
    moolib.set_max_threads(original)


@pytest.fixture(params=MAX_THREADS, ids=MAX_THREADS_IDS)
def max_threads(request):
    """The pool size of this process for the test (restored after)."""
    yield from _pool_size(request.param)


@pytest.fixture(params=TRANSPORTS, ids=TRANSPORT_IDS)
def transport(request):
    return request.param


def run_rounds(
    caller, peer: str, function: str, n: int, expected, args=lambda i: (i,), rounds: int = ROUNDS
) -> None:
    """Launches n async_ calls at once, ``rounds`` times; each must complete with its value."""
    for r in range(rounds):
        futures = [caller.async_(peer, function, *args(i)) for i in range(n)]
        end = time.monotonic() + DEADLINE
        for f in futures:
            f.wait(max(0.0, end - time.monotonic()))
        done = sum(f.done() for f in futures)
        assert done == n, f"round {r}: {n - done} of {n} nested calls stalled"
        assert [f.result() for f in futures] == [expected(i) for i in range(n)], f"round {r}"


@pytest.mark.parametrize("n", NESTED)
def test_nested_calls_back_into_the_caller(make_rpc, transport, max_threads, n):
    server = make_rpc("server", transports=transport, listen=True, timeout=RPC_TIMEOUT)
    client = make_rpc("client", transports=transport, timeout=RPC_TIMEOUT)
    client.connect(server.address)
    client.define("g", lambda i: i * 2)
    # f blocks its thread until g, which needs a thread of the same pool, has run.
    server.define("f", lambda i: server.sync("client", "g", i) + 1)
    run_rounds(client, "server", "f", n, lambda i: 2 * i + 1)


@pytest.mark.parametrize("n", NESTED)
def test_nested_calls_through_a_third_peer(make_rpc, transport, max_threads, n):
    server = make_rpc("server", transports=transport, listen=True, timeout=RPC_TIMEOUT)
    third = make_rpc("third", transports=transport, timeout=RPC_TIMEOUT)
    client = make_rpc("client", transports=transport, timeout=RPC_TIMEOUT)
    third.connect(server.address)
    client.connect(server.address)
    # client -> server.f -> third.h -> client.g: two levels of functions blocked at once.
    client.define("g", lambda i: i * 3)
    third.define("h", lambda i: third.sync("client", "g", i) + 1)
    server.define("f", lambda i: server.sync("third", "h", i) * 2)
    run_rounds(client, "server", "f", n, lambda i: (3 * i + 1) * 2)


@pytest.fixture(params=MAX_THREADS[::2], ids=MAX_THREADS_IDS[::2])
def both_pools(request):
    """The pool size of this process and of the peer process (restored after)."""
    yield from _pool_size(request.param)


@pytest.mark.parametrize("n", NESTED)
def test_nested_calls_across_processes(make_rpc, spawn_peer, transport, both_pools, n):
    peer = spawn_peer(
        "nest-peer", transports=transport, timeout=RPC_TIMEOUT, max_threads=both_pools
    )
    client = make_rpc("nest-client", transports=transport, timeout=RPC_TIMEOUT)
    client.connect(peer.address)
    # client -> peer.call -> client.g -> peer.add: a function blocked in each
    # process waits for one that needs a thread of the other's blocked pool.
    client.define("g", lambda i: client.sync(peer.name, "add", i, 1000))
    run_rounds(
        client, peer.name, "call", n, lambda i: i + 1000, args=lambda i: ("nest-client", "g", i)
    )
    assert peer.alive()


IDLE_SCRIPT = """
import os, time
import moolib

def threads():
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                return int(line.split()[1])

server = moolib.Rpc(); server.set_name("server"); server.set_timeout(%(timeout)s)
client = moolib.Rpc(); client.set_name("client"); client.set_timeout(%(timeout)s)
client.connect(server.listen("127.0.0.1:0"))
client.define("g", lambda i: i)
server.define("f", lambda i: server.sync("client", "g", i))
assert client.sync("server", "f", 1) == 1
time.sleep(6)  # threads started by that call end first
before = threads()
futures = [client.async_("server", "f", i) for i in range(128)]
assert [f.result(%(deadline)s) for f in futures] == list(range(128))
during = threads()
end = time.monotonic() + %(deadline)s
while threads() > before and time.monotonic() < end:
    time.sleep(0.1)
print("THREADS", before, during, threads(), flush=True)
server.close(); client.close()
"""


def test_threads_started_for_blocked_ones_end_when_idle(tmp_path):
    """Threads started in place of blocked ones end once idle: a burst of nested
    calls leaves no lasting threads behind."""
    code = IDLE_SCRIPT % {"timeout": RPC_TIMEOUT, "deadline": DEADLINE}
    out = run_script(code, tmp_path, env={"MOOLIB_MAX_THREADS": "2"})
    assert out.returncode == 0, out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("THREADS"))
    before, during, after = map(int, line.split()[1:])
    # Blocked calls had threads started to stand in for them ...
    assert during > before, line
    # ... which ended once idle.
    assert after <= before, line
