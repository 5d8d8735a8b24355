"""When an Rpc goes away: objects that own an Rpc and define their own methods
on it are garbage collected like any other cycle (their connections close,
their groups are left, their address is free), an Rpc deleted with calls in
flight fails them and leaves the process healthy, and close(), ``del`` or a
fixture's teardown release the listening address before they return."""

from __future__ import annotations

import gc
import socket
import threading
import weakref

import pytest
import torch
from helpers.fresh_interpreter import run
from helpers.util import DEADLINE, connections, wait_for

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")

# A large argument: over shm it travels in shared memory, over tcp it keeps
# the connection busy for a while; either way the callee's threads hold the
# Rpc while they release it, after the caller already has its reply.
LARGE = 16 << 20  # float32 elements: 64 MiB
ROUNDS = 20


def free_address() -> str:
    """A loopback address with a port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def listen_again(address: str) -> None:
    """A new Rpc listens on exactly ``address`` (raises if it is still taken)."""
    rpc = moolib.Rpc()
    try:
        assert rpc.listen(address) == address
    finally:
        rpc.close()


def collected(refs: list[weakref.ref], collect=gc.collect) -> None:
    """Collects until every object of ``refs`` is gone.

    A function that has just replied may still be returning on a core thread,
    holding its object for a moment: a collection then finds it alive, and
    the next one frees it. On a core that hides references from the collector
    it is never freed.
    """
    wait_for(
        lambda: collect() is not None and all(r() is None for r in refs),
        what="the objects to be garbage collected",
    )


class Service:
    """Owns an Rpc and serves its own bound methods: a cycle through the Rpc."""

    def __init__(self, name: str, transports: list[str] | None = None) -> None:
        self.rpc = moolib.Rpc()
        self.rpc.set_name(name)
        if transports:
            self.rpc.set_transports(transports)
        self.address = self.rpc.listen("127.0.0.1:0")
        self.rpc.define("add", self.add)
        self.rpc.define("double", self.double, batch_size=4)
        self.rpc.define_deferred("later", self.later)
        self.queue = self.rpc.define_queue("queued")
        self.served = 0
        self.stop = threading.Event()
        self.worker = threading.Thread(
            target=self.serve_queue, args=(self.queue, self.stop), daemon=True
        )
        self.worker.start()

    def add(self, a: int, b: int) -> int:
        self.served += 1
        return a + b

    def double(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def later(self, reply, x: int) -> None:
        threading.Thread(target=reply, args=(x + 100,)).start()

    @staticmethod
    def serve_queue(queue: moolib.Queue, stop: threading.Event) -> None:
        # Holds only the queue, not the service: the service stays collectable.
        while not stop.is_set():
            try:
                reply, args, kwargs = queue.get(timeout=0.1)
            except TimeoutError:
                continue
            reply(("queued", *args))


@pytest.fixture
def queue_workers():
    """Stops the queue-serving threads of the Services a test made."""
    made = []
    yield made
    for stop, worker in made:
        stop.set()
        worker.join(DEADLINE)


def start_service(name: str, client: moolib.Rpc, workers: list, transports=None):
    """A Service the client has called every function of; returns (weakref, address).

    Nothing but the Service's own cycle refers to it once this returns.
    """
    svc = Service(name, transports)
    workers.append((svc.stop, svc.worker))
    client.connect(svc.address)
    assert client.sync(name, "add", 2, 3) == 5
    assert torch.equal(client.sync(name, "double", torch.ones(3)), torch.full((3,), 2.0))
    assert client.sync(name, "later", 1) == 101
    assert client.sync(name, "queued", 7) == ("queued", 7)
    return weakref.ref(svc), svc.address


@pytest.mark.parametrize("transports", [None, ["tcp"]], ids=["default", "tcp"])
def test_an_object_owning_an_rpc_with_its_own_methods_is_collected(
    make_rpc, queue_workers, transports
):
    client = make_rpc("client", transports=transports, timeout=DEADLINE)
    ref, address = start_service("svc", client, queue_workers, transports)
    assert connections(client, "svc")

    collected([ref])
    # Its listener is gone by the time gc.collect() returned...
    listen_again(address)
    # ...and so are its links: the peer sees them close and its calls fail.
    wait_for(lambda: not connections(client, "svc"), what="the client's links to svc to close")
    client.set_timeout(2)
    with pytest.raises(moolib.RpcError):
        client.sync("svc", "add", 1, 1)


def test_collection_on_a_core_thread_closes_the_rpc(make_rpc, queue_workers):
    """The collector may run inside a function on a core thread (it runs wherever
    Python allocates): closing the collected Rpc there must not deadlock."""
    client = make_rpc("client", timeout=DEADLINE)
    collector = make_rpc("collector", listen=True)
    collector.define("collect", lambda: gc.collect() >= 0)
    client.connect(collector.address)
    gc.disable()  # the collection happens in "collect", not here
    try:
        ref, address = start_service("svc-core", client, queue_workers)
        collected([ref], lambda: client.sync("collector", "collect"))
        listen_again(address)
    finally:
        gc.enable()


def test_undefine_releases_the_function_and_its_owner(make_rpc):
    rpc = make_rpc("host", listen=True)

    class Handler:
        def f(self) -> int:
            return 1

    handler = Handler()
    ref = weakref.ref(handler)
    rpc.define("f", handler.f)
    assert rpc.sync("host", "f") == 1
    del handler
    assert ref() is not None  # the Rpc serves it
    rpc.undefine("f")
    assert ref() is None
    rpc.define("f", lambda: 2)  # the name is free again
    assert rpc.sync("host", "f") == 2


def group_members(broker: moolib.Broker, group: str) -> list[str]:
    return broker.groups().get(group, {}).get("members", [])


@pytest.fixture
def broker():
    """An in-process broker on a free loopback port."""
    b = moolib.Broker()
    b.address = b.listen("127.0.0.1:0")
    yield b
    b.close()


class GroupMember:
    """Owns an Rpc and a Group on it, and serves a method of its own."""

    def __init__(self, name: str, broker_address: str) -> None:
        self.rpc = moolib.Rpc()
        self.rpc.set_name(name)
        self.rpc.connect(broker_address)
        self.group = moolib.Group(self.rpc, "gc-group")
        # Far longer than the test waits: only leaving removes the member.
        self.group.set_timeout(600)
        self.rpc.define("status", self.status)

    def status(self) -> bool:
        return self.group.active()


class Trainer:
    """Owns an Accumulator with an Rpc of its own (the usual single-model setup)."""

    def __init__(self, name: str, broker_address: str) -> None:
        self.model = torch.nn.Linear(3, 2)
        self.accumulator = moolib.Accumulator(
            "gc-acc", self.model.parameters(), self.model.buffers()
        )
        self.accumulator.group.set_timeout(600)
        self.accumulator.rpc.set_name(name)
        self.accumulator.connect(broker_address)

    def step(self) -> None:
        self.accumulator.update()


def join(broker: moolib.Broker, kind: str):
    """Makes a member of ``kind`` join its group; returns (weakrefs, group name, member name)."""
    if kind == "group":
        member = GroupMember("gc-member", broker.address)
        refs = [weakref.ref(member), weakref.ref(member.group), weakref.ref(member.rpc)]
        group, step = "gc-group", member.group.update
    else:
        member = Trainer("gc-trainer", broker.address)
        acc = member.accumulator
        refs = [weakref.ref(member), weakref.ref(acc), weakref.ref(acc.group)]
        group, step = "gc-acc", member.step
    name = member.rpc.get_name() if kind == "group" else member.accumulator.rpc.get_name()

    def joined():
        step()
        return group_members(broker, group) == [name]

    wait_for(joined, what=f"{name} to join {group}")
    return refs, group, name


@pytest.mark.parametrize("kind", ["group", "accumulator"])
def test_a_collected_group_member_leaves_the_broker_group(broker, kind):
    refs, group, name = join(broker, kind)

    collected(refs)
    # The member's timeout is 600 s: only its leaving explains this.
    wait_for(
        lambda: name not in group_members(broker, group),
        what=f"{name} to leave {group} at the broker",
    )


def test_deleting_rpcs_with_calls_in_flight(tmp_path):
    proc = run(
        tmp_path,
        """
        for round in range(4):
            # Functions still running when their Rpc goes away run to completion
            # (occupying pool threads): release them at the end of each round.
            release = threading.Event()
            server = moolib.Rpc()
            server.set_name(f"server{round}")
            address = server.listen("127.0.0.1:0")
            server.define("block", lambda: release.wait(600))
            server.define("echo", lambda x: x)
            client = moolib.Rpc()
            client.set_timeout(60)
            client.connect(address)
            check(client.sync(f"server{round}", "echo", 5) == 5, "warm-up call")
            client.set_timeout(2)
            pending = [client.async_(f"server{round}", "block") for _ in range(3)]
            if round % 2 == 0:
                del server  # the callee goes away: the client's calls time out
                gc.collect()
                for f in pending:
                    check(f.wait(60), "call to a deleted peer completes")
                    check(f.exception() is not None, "call to a deleted peer fails")
                del client
            else:
                del client  # the caller goes away with its calls in flight
                gc.collect()
                for f in pending:
                    check(f.wait(60), "call of a deleted Rpc completes")
                    check(f.exception() is not None, "call of a deleted Rpc fails")
                del server
            gc.collect()
            release.set()
        # The process is still healthy.
        a, b = moolib.Rpc(), moolib.Rpc()
        b.set_name("b")
        a.connect(b.listen("127.0.0.1:0"))
        b.define("add", lambda x, y: x + y)
        check(a.sync("b", "add", 2, 2) == 4, "call after the deletions")
        print("DELETE-OK", flush=True)
        """,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "DELETE-OK" in proc.stdout


# close() and deletion release the address before they return -----------------


def serve_once(address: str, client: moolib.Rpc, transports, tensor: torch.Tensor) -> moolib.Rpc:
    """An Rpc listening on exactly ``address`` that the client has called with ``tensor``."""
    server = moolib.Rpc()
    server.set_name("relisten")
    if transports:
        server.set_transports(transports)
    assert server.listen(address) == address
    server.define("size", lambda t: t.numel())
    client.connect(address)
    assert client.sync("relisten", "size", tensor) == tensor.numel()
    return server


@pytest.fixture(scope="module")
def large() -> torch.Tensor:
    return torch.ones(LARGE)


def _client(transports) -> moolib.Rpc:
    client = moolib.Rpc()
    client.set_timeout(DEADLINE)
    if transports:
        client.set_transports(transports)
    return client


TRANSPORT_CASES = pytest.mark.parametrize("transports", [None, ["tcp"]], ids=["default", "tcp"])


@TRANSPORT_CASES
@pytest.mark.parametrize("how", ["close", "del"])
def test_listening_again_right_after_close_or_del(large, transports, how):
    address = free_address()
    for _ in range(ROUNDS):
        client = _client(transports)
        server = serve_once(address, client, transports, large)
        if how == "close":
            server.close()
        else:
            del server
        listen_again(address)
        client.close()


def served(address: str, client: moolib.Rpc, transports, tensor: torch.Tensor):
    """A yield fixture's body that forgets close(): its teardown just drops the Rpc."""
    server = serve_once(address, client, transports, tensor)
    yield server
    del server


@TRANSPORT_CASES
def test_a_fixture_that_drops_its_rpc_frees_its_address(large, transports):
    address = free_address()
    for _ in range(ROUNDS):
        client = _client(transports)
        fixture = served(address, client, transports, large)
        server = next(fixture)  # setup
        assert server.debug_info()["listening"][0] == address  # the test
        del server
        next(fixture, None)  # teardown
        del fixture
        listen_again(address)  # the next test's setup
        client.close()
