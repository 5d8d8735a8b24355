"""Each kind of failure raises its moolib.errors class, triggered for real:
Rpc peers over sockets and shared memory on 127.0.0.1, peer processes killed,
keys that differ, groups whose membership changes, shared memory another
process may not map, and a raw peer answering with status bytes of its own.

Every class of a call's failure is an RpcError (a RuntimeError, as in the
original moolib), so ``except moolib.RpcError`` code keeps working; a timeout is
also a TimeoutError. Deadlines are generous and nothing here asserts on timing."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from helpers import fuzz_wire as fw
from helpers.group_util import settle
from helpers.util import DEADLINE, REPO, TRANSPORT_IDS, TRANSPORTS, child_env, wait_for

import moolib
from moolib import errors

pytestmark = pytest.mark.usefixtures("watchdog")

KEY = "errors-test-key"


def raised(fn, *args):
    """The RpcError that ``fn(*args)`` raises (the test fails if it returns)."""
    with pytest.raises(moolib.RpcError) as info:
        fn(*args)
    return info.value


def assert_kind(error, cls):
    assert type(error) is cls, f"{type(error).__name__}: {error}"
    assert isinstance(error, moolib.RpcError) and isinstance(error, RuntimeError)


@pytest.fixture
def server(make_rpc):
    """A listening Rpc with a function that blocks until released, and one that raises."""
    rpc = make_rpc("err-server", listen=True)
    gate, started = threading.Event(), threading.Event()

    def block():
        started.set()
        return gate.wait(DEADLINE)

    rpc.define("block", block)
    rpc.define("fail", lambda message: (_ for _ in ()).throw(ValueError(message)))
    rpc.define("echo", lambda x: x)
    rpc.gate, rpc.started = gate, started
    yield rpc
    gate.set()


@pytest.fixture
def client(make_rpc, server):
    rpc = make_rpc("err-client", timeout=DEADLINE)
    rpc.connect(server.address)
    assert rpc.sync(server.get_name(), "echo", 1) == 1
    return rpc


# ---------------------------------------------------------------------------
# The classes


# Not failures of a call or collective: a ReplayClient's, and an Accumulator's peers
# holding other models.
NOT_RPC = {
    "ModelMismatchError",
    "ReplayError",
    "ReplayTimeoutError",
    "ShardTimeoutError",
    "ShardUnavailableError",
}


def test_every_class_is_a_documented_rpc_error():
    assert moolib.RpcError is errors.RpcError is moolib.rpc.RpcError is moolib._core.RpcError
    assert issubclass(errors.RpcError, RuntimeError)
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, RuntimeError), name
        assert issubclass(cls, moolib.RpcError) != (name in NOT_RPC), name
        assert getattr(moolib, name, cls) is cls, name
        assert cls.__doc__ and len(cls.__doc__.split()) >= 8, f"{name} needs a docstring"
    assert issubclass(errors.RpcTimeoutError, TimeoutError)
    assert issubclass(errors.ConnectionLostError, ConnectionError)
    assert issubclass(errors.RpcCancelledError, concurrent.futures.CancelledError)
    # A replay call's failure keeps its kind: a timeout, a shard that is gone.
    assert issubclass(errors.ReplayTimeoutError, errors.ReplayError)
    assert issubclass(errors.ReplayTimeoutError, TimeoutError)
    assert issubclass(errors.ShardUnavailableError, errors.ReplayError)
    assert issubclass(errors.ShardUnavailableError, ConnectionError)
    assert issubclass(errors.ShardTimeoutError, errors.ShardUnavailableError)
    assert issubclass(errors.ShardTimeoutError, errors.ReplayTimeoutError)


# ---------------------------------------------------------------------------
# Calls


def test_no_reply_within_the_timeout_raises_rpc_timeout_error(client, server):
    client.set_timeout(1)
    e = raised(client.sync, server.get_name(), "block")
    assert_kind(e, errors.RpcTimeoutError)
    assert isinstance(e, TimeoutError)
    assert "timed out" in str(e) and "no reply" in str(e)
    # The same through a future, and from future.exception().
    future = client.async_(server.get_name(), "block")
    assert_kind(raised(future.result), errors.RpcTimeoutError)
    assert type(future.exception()) is errors.RpcTimeoutError


def test_a_peer_never_found_raises_rpc_timeout_error(client):
    client.set_timeout(1)
    e = raised(client.sync, "nobody-by-this-name", "anything")
    assert_kind(e, errors.RpcTimeoutError)
    assert "was not found" in str(e)


def test_a_peer_behind_a_refused_address_names_the_address(make_rpc, capfd):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there now
    rpc = make_rpc("err-lonely", timeout=2)
    rpc.connect(address)
    e = raised(rpc.sync, "server", "f")
    assert_kind(e, errors.RpcTimeoutError)
    text = str(e)
    assert "peer 'server' was not found" in text and address in text, text
    assert "refused" in text.lower(), text
    # The log says so by then too, not only once the dialer gave up for long.
    err = capfd.readouterr().err
    assert address in err and "refused" in err.lower(), err


def test_a_local_wait_giving_up_is_a_plain_timeout_error(client, server):
    future = client.async_(server.get_name(), "block")
    with pytest.raises(TimeoutError) as info:
        future.result(timeout=0.1)
    assert not isinstance(info.value, moolib.RpcError)  # the call goes on
    server.gate.set()
    assert future.result(timeout=DEADLINE) is True


def test_a_function_not_defined_there_raises_function_not_defined_error(client, server):
    e = raised(client.sync, server.get_name(), "no_such_function")
    assert_kind(e, errors.FunctionNotDefinedError)
    assert "no_such_function" in str(e)
    # A call to this very peer goes the same way.
    local = raised(server.sync, server.get_name(), "no_such_function")
    assert_kind(local, errors.FunctionNotDefinedError)


def test_a_function_that_raises_raises_remote_error(client, server):
    e = raised(client.sync, server.get_name(), "fail", "boom")
    assert_kind(e, errors.RemoteError)
    assert "ValueError" in str(e) and "boom" in str(e)
    assert_kind(raised(server.sync, server.get_name(), "fail", "here"), errors.RemoteError)


def test_a_cancelled_call_raises_rpc_cancelled_error(client, server):
    future = client.async_(server.get_name(), "block")
    assert future.cancel()
    assert future.cancelled()
    e = raised(future.result)
    assert_kind(e, errors.RpcCancelledError)
    assert isinstance(e, concurrent.futures.CancelledError)
    assert type(future.exception()) is errors.RpcCancelledError


def test_closing_the_rpc_fails_its_calls_with_connection_lost_error(make_rpc, client, server):
    future = client.async_(server.get_name(), "block")
    client.close()
    e = raised(future.result, DEADLINE)
    assert_kind(e, errors.ConnectionLostError)
    assert "the Rpc was closed" in str(e)


def test_the_peer_closing_its_rpc_mid_call_raises_connection_lost_error(client, server):
    future = client.async_(server.get_name(), "block")
    assert server.started.wait(DEADLINE)  # else the request could find the function gone
    server.close()
    e = raised(future.result, DEADLINE)
    assert_kind(e, errors.ConnectionLostError)
    assert isinstance(e, ConnectionError)


@pytest.mark.parametrize("transports", TRANSPORTS, ids=TRANSPORT_IDS)
def test_a_peer_killed_mid_call_raises_connection_lost_error(make_rpc, spawn_peer, transports):
    peer = spawn_peer("err-doomed", transports=transports)
    rpc = make_rpc("err-survivor", transports=transports, timeout=DEADLINE)
    rpc.connect(peer.address)
    assert rpc.sync("err-doomed", "pid") == peer.pid
    future = rpc.async_("err-doomed", "hold", "never", DEADLINE)
    peer.kill(signal.SIGKILL)
    e = raised(future.result, DEADLINE * 2)
    assert_kind(e, errors.ConnectionLostError)
    assert "err-doomed" in str(e) and "connection was lost" in str(e)


# ---------------------------------------------------------------------------
# Authentication


@pytest.fixture
def keyed_server(make_rpc):
    rpc = make_rpc("err-vault", listen=True, auth_key=KEY)
    rpc.define("touch", lambda: True)
    return rpc


@pytest.mark.parametrize("caller_key", [KEY + "-wrong", None], ids=["wrong-key", "no-key"])
def test_a_peer_refused_at_authentication_raises_authentication_error(
    make_rpc, keyed_server, caller_key
):
    rpc = make_rpc(auth_key=caller_key, timeout=2)
    rpc.connect(keyed_server.address)
    e = raised(rpc.sync, "err-vault", "touch")
    assert_kind(e, errors.AuthenticationError)
    assert not isinstance(e, TimeoutError)  # waiting longer does not help
    assert "authentication" in str(e) and "err-vault" in str(e)


def test_a_key_only_on_the_caller_raises_authentication_error(make_rpc):
    open_peer = make_rpc("err-open", listen=True)
    open_peer.define("touch", lambda: True)
    rpc = make_rpc(auth_key=KEY, timeout=2)
    rpc.connect(open_peer.address)
    assert_kind(raised(rpc.sync, "err-open", "touch"), errors.AuthenticationError)


# ---------------------------------------------------------------------------
# Groups


@pytest.fixture
def local_broker():
    broker = moolib.Broker()
    broker.address = broker.listen("127.0.0.1:0")
    yield broker
    broker.rpc.close()


def _member(make_rpc, broker, name, group):
    rpc = make_rpc(name, timeout=DEADLINE)
    rpc.connect(broker.address)
    g = moolib.Group(rpc, group)
    g.set_timeout(DEADLINE)
    g.update()
    return g


def _wait_done(groups, handles):
    """Keeps the groups updated (as their programs would) until every handle is done."""
    wait_for(
        lambda: all([g.update() or True for g in groups]) and all(h.done() for h in handles),
        what="the all-reduces to complete",
    )


def test_membership_change_during_all_reduce_raises_membership_changed_error(
    make_rpc, local_broker
):
    groups = [_member(make_rpc, local_broker, f"err-m{i}", "err-members") for i in range(3)]
    settle(groups)
    # Two members start it; the third never does, and a fourth joins meanwhile.
    handles = [g.all_reduce("waits", np.ones(4)) for g in groups[:2]]
    groups.append(_member(make_rpc, local_broker, "err-m3", "err-members"))
    _wait_done(groups, handles)
    for h in handles:
        e = h.exception()
        assert_kind(e, errors.MembershipChangedError)
        assert_kind(raised(h.result), errors.MembershipChangedError)
    settle(groups)  # the group goes on
    results = [g.all_reduce("after", np.ones(4)) for g in groups]
    _wait_done(groups, results)
    for r in results:
        assert r.result().tolist() == [4.0] * 4


def test_all_reduce_of_a_peer_not_or_no_longer_a_member_raises_membership_changed_error(
    make_rpc, local_broker
):
    rpc = make_rpc("err-outsider")
    rpc.connect(local_broker.address)
    never_joined = moolib.Group(rpc, "err-outside")  # update() never called
    handle = never_joined.all_reduce("x", np.ones(2))
    assert_kind(raised(handle.result), errors.MembershipChangedError)
    g = _member(make_rpc, local_broker, "err-closer", "err-closing")
    settle([g])
    g.close()
    assert_kind(raised(g.all_reduce("x", np.ones(2)).result), errors.MembershipChangedError)


def test_a_message_the_group_refuses_is_a_plain_rpc_error(make_rpc, local_broker):
    g = _member(make_rpc, local_broker, "err-target", "err-refusing")
    settle([g])
    prankster = make_rpc("err-prankster", timeout=DEADLINE)
    prankster.connect(local_broker.address)
    e = raised(prankster.sync, "err-target", "__moolib_group/err-refusing", b"not a message")
    assert_kind(e, moolib.RpcError)  # not a RemoteError: no function raised
    assert "malformed group message" in str(e)


def test_all_reduce_past_the_collective_timeout_raises_rpc_timeout_error(make_rpc, local_broker):
    groups = [_member(make_rpc, local_broker, f"err-t{i}", "err-timeout") for i in range(2)]
    for g in groups:
        g.set_collective_timeout(1)
    settle(groups)
    handle = groups[0].all_reduce("alone", np.ones(4))  # the other member never starts it
    _wait_done(groups, [handle])
    e = handle.exception()
    assert_kind(e, errors.RpcTimeoutError)
    assert isinstance(e, TimeoutError)
    assert "err-t1" in str(e)


# A member that all-reduces "big" rounds with whoever is there, until killed.
REDUCING_MEMBER = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import moolib

    name, broker, group, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    rpc = moolib.Rpc()
    rpc.set_name(name)
    if sys.argv[5]:
        rpc.set_transports(sys.argv[5].split(","))
    rpc.connect(broker)
    g = moolib.Group(rpc, group)
    g.set_timeout(2)
    while True:
        g.update()
        if not (g.active() and len(g.members()) == 3):
            time.sleep(0.01)
            continue
        h = g.all_reduce("big", np.ones(size))
        while not h.done():
            g.update()
            time.sleep(0.001)
    """
)


@pytest.mark.parametrize("transports", [["shm", "tcp"], ["tcp"]], ids=["shm", "tcp"])
def test_a_member_killed_during_an_all_reduce_raises_membership_changed_error(
    make_rpc, local_broker, tmp_path, transports
):
    """A member killed with SIGKILL while the others' all-reduce runs: whether
    they hear of it from the broker or from their links to it closing (reading
    from its shared memory socket, sending to it), the others' all-reduce fails
    with MembershipChangedError, every time (it was a ConnectionLostError in
    about one run of eight: issue 51)."""
    size = 1 << 21  # 16 MiB of float64: a round takes a while, the kill lands in it
    survivors = []
    for i in range(2):
        rpc = make_rpc(f"err-k{i}", timeout=DEADLINE)
        if transports:
            rpc.set_transports(transports)
        rpc.connect(local_broker.address)
        g = moolib.Group(rpc, "err-killed")
        g.set_timeout(2)
        survivors.append(g)
    settle(survivors)
    script = tmp_path / "reducing_member.py"
    script.write_text(REDUCING_MEMBER)
    failures = []
    for round_ in range(8):
        victim = subprocess.Popen(
            [
                sys.executable,
                str(script),
                f"err-victim{round_}",
                local_broker.address,
                "err-killed",
                str(size),
                ",".join(transports or []),
            ],
            stdin=subprocess.DEVNULL,
            env=child_env(),
            cwd=str(REPO),
        )
        try:
            wait_for(
                lambda: (
                    all([g.update() or True for g in survivors])
                    and all(len(g.members()) == 3 for g in survivors)
                    and len({g.sync_id() for g in survivors}) == 1
                ),
                what="the victim in the group",
            )
            # A round with the victim in it, then one it is killed in.
            warm = [g.all_reduce("big", np.ones(size)) for g in survivors]
            _wait_done(survivors, warm)
            if any(h.exception() for h in warm):  # the group changed meanwhile: try again
                continue
            handles = [g.all_reduce("big", np.ones(size)) for g in survivors]
            victim.kill()
            victim.wait(timeout=DEADLINE)
            _wait_done(survivors, handles)
            for h in handles:
                e = h.exception()
                if e is not None:
                    assert_kind(e, errors.MembershipChangedError)
                    failures.append(str(e))
        finally:
            if victim.poll() is None:
                victim.kill()
                victim.wait(timeout=DEADLINE)
        settle(survivors)
    assert failures, "no all-reduce was in flight when a member was killed"
    settle(survivors)  # the group goes on
    results = [g.all_reduce("after", np.ones(4)) for g in survivors]
    _wait_done(survivors, results)
    assert [r.result().tolist() for r in results] == [[2.0] * 4] * 2


# A member whose memory the others may not map: it makes itself non-dumpable,
# so that a process of its user without CAP_SYS_PTRACE cannot open its
# descriptors under /proc (as across sandboxes). Run as root, both members
# drop that capability first.
SHM_MEMBER = textwrap.dedent(
    """
    import ctypes, json, sys, time
    import numpy as np
    import moolib
    from moolib import errors

    name, broker, private = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    if private:
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    rpc = moolib.Rpc()
    rpc.set_name(name)
    rpc.set_timeout(60)
    rpc.connect(broker)
    g = moolib.Group(rpc, "err-shm")
    g.set_timeout(60)
    deadline = time.monotonic() + 120
    while not (g.active() and len(g.members()) == 2):
        g.update()
        time.sleep(0.02)
        assert time.monotonic() < deadline, "no group of two"
    # Large enough to go through shared memory.
    h = g.all_reduce("big", np.ones(1 << 18, dtype=np.float32))
    while not h.done():
        g.update()
        time.sleep(0.02)
        assert time.monotonic() < deadline, "the all-reduce never completed"
    e = h.exception()
    print(json.dumps({"type": type(e).__name__, "rpc_error": isinstance(e, moolib.RpcError),
                      "message": str(e)}), flush=True)
    # Stays until its peer is done too: leaving earlier would change membership.
    sys.stdin.read()
    """
)


def _drop_ptrace_capability() -> None:
    if os.geteuid() == 0:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(24, 19, 0, 0, 0)  # PR_CAPBSET_DROP, SYS_PTRACE


def test_shared_memory_no_member_may_map_raises_shared_memory_unavailable_error(
    local_broker, tmp_path
):
    script = tmp_path / "shm_member.py"
    script.write_text(SHM_MEMBER)
    procs = []
    try:
        for name, private in [("err-shm-open", "0"), ("err-shm-private", "1")]:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), name, local_broker.address, private],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=(tmp_path / f"{name}.log").open("wb"),
                    env=child_env(),
                    cwd=str(REPO),
                    text=True,
                    preexec_fn=_drop_ptrace_capability,
                )
            )
        outcomes = []
        for p in procs:
            line = p.stdout.readline()
            if not line:
                p.wait(DEADLINE)
                logs = {
                    q.name: q.read_text("utf-8", "replace")[-2000:] for q in tmp_path.glob("*.log")
                }
                pytest.fail(f"a member exited (rc={p.returncode}): {logs}")
            outcomes.append(json.loads(line))
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
        for p in procs:
            try:
                p.wait(DEADLINE)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    # The member that could not map fails with this error, and tells the other.
    for o in outcomes:
        assert o["type"] == "SharedMemoryUnavailableError", o
        assert o["rpc_error"], o
    assert any("cannot share memory" in o["message"] for o in outcomes), outcomes


# ---------------------------------------------------------------------------
# Codes on the wire


def _serve_one_call(listener: socket.socket, status: int, text: bytes) -> None:
    """Completes a keyless handshake as the accepting side, then answers the
    first request with ``status`` and ``text``."""
    sock, _ = listener.accept()
    with sock:
        fw.read_frame(sock)  # the caller's hello
        sock.sendall(fw.hello(role=fw.ROLE_SERVER))
        sock.sendall(fw.identify("err-raw"))
        while True:
            f = fw.read_frame_skipping_keepalives(sock, DEADLINE)
            if f.type == fw.REQUEST:
                break
        call_id = fw.MetaReader(f.meta).u64()
        sock.sendall(fw.frame(fw.RESPONSE, fw.u64(call_id) + fw.u8(status) + fw.wstr(text)))
        fw.wait_closed(sock, DEADLINE)


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (1, errors.RemoteError),
        (2, errors.FunctionNotDefinedError),
        (4, errors.ConnectionLostError),
        (9, moolib.RpcError),
        (200, moolib.RpcError),  # a code of a later version: a plain RpcError
    ],
)
def test_the_status_byte_of_a_reply_picks_the_class(make_rpc, status, cls):
    listener = socket.create_server(("127.0.0.1", 0))
    with listener:
        listener.settimeout(DEADLINE)
        server = threading.Thread(
            target=_serve_one_call, args=(listener, status, b"bad \xff\xfe utf-8"), daemon=True
        )
        server.start()
        rpc = make_rpc("err-caller", timeout=DEADLINE)
        rpc.connect(f"127.0.0.1:{listener.getsockname()[1]}")
        e = raised(rpc.sync, "err-raw", "anything")
        rpc.close()
        server.join(DEADLINE)
    assert_kind(e, cls)
    assert "bad" in str(e)  # the text arrives, its invalid bytes replaced
