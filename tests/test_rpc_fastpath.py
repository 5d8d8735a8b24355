"""The fast paths of a call: arguments and results that skip the Python codec
(none at all, small nests of scalars, None) and those that fall back to it
(tensors, arrays, deep or long nests, objects), functions defined with
define() run from C, and moolib.Future as a plain CPython type. Behaviour
must be that of the codec path in every case: same values, same errors."""

from __future__ import annotations

import asyncio
import collections
import fractions
import gc
import pickle
import weakref

import numpy as np
import pytest
import torch
from helpers.util import DEADLINE, assert_same, run_script, wait_for

import moolib
from moolib.serialization import dumps

pytestmark = pytest.mark.usefixtures("watchdog")

TRANSPORTS = [["shm"], ["tcp"]]


class _Text(str):
    """Not exactly a str: the codec's business."""


# (args, kwargs) of calls, from those that take the fast path to those that
# fall back to the codec.
CALLS = {
    "none": ((), {}),
    "scalars": ((1, -2.5, 3j, "text", b"bytes", None, True), {}),
    "big int": ((2**200, -(2**64)), {}),
    "kwargs": ((), {"a": 1, "b": "two"}),
    "nested, depth 3": (([1, (2, {"k": 3})],), {}),
    "nested, depth 4 (codec)": (([[[[1]]]],), {}),
    "17 items (codec)": ((list(range(17)),), {}),
    "dict with int keys (codec)": (({1: "a"},), {}),
    "set (codec)": (({1, 2},), {}),
    "object (codec)": ((fractions.Fraction(1, 3),), {"f": fractions.Fraction(2, 5)}),
    "tensor (codec)": ((torch.arange(6).view(2, 3),), {"big": torch.ones(5000)}),
    "numpy (codec)": ((np.arange(10, dtype=np.int16),), {"big": np.zeros(3000)}),
    "str subclass (codec)": ((_Text("x"),), {}),
}


def test_the_constants_are_what_the_codec_makes():
    # The core sends these bytes for a call without arguments and a None
    # result; a peer with the Python codec must read them the same.
    assert dumps(((), {})) == (pickle.dumps(((), {}), 5), [])
    assert dumps(None) == (pickle.dumps(None, 5), [])


class _List(list):
    """Not exactly a list."""


class _Dict(dict):
    """Not exactly a dict."""


_Pair = collections.namedtuple("_Pair", "a b")


# Values at and around every rule of the plain check (codec.cc's isPlain,
# _core._is_plain), with the least depth at which each is plain (None:
# never): each scalar type, a subclass of each container, the 16-item and
# depth limits, dict keys.
# fmt: off
PLAIN_CASES = [
    (None, 0), (True, 0), (0, 0), (2**200, 0), (1.5, 0), (3j, 0), ("s", 0), (b"b", 0),
    (_Text("x"), None), (bytearray(b"b"), None),
    ((), 1), ([], 1), ({}, 1), ((1,) * 16, 1), ((1,) * 17, None), ([1] * 16, 1), ([1] * 17, None),
    ({str(i): i for i in range(16)}, 1), ({str(i): i for i in range(17)}, None),
    ({1: "a"}, None), ({"a": {1: 2}}, None), ({"a": [1, (2, {"k": 3})]}, 4),
    ([[[1]]], 3), ([[[[1]]]], 4), ([[[()]]], 4), ([[[[]]]], 4), (((((1,),),),), 4),
    (_List([1]), None), (_Dict(a=1), None), ([_List()], None), ({"k": _Dict()}, None),
    ({_Text("k"): 1}, None), (_Pair(1, 2), None), ([_Pair(1, 2)], None),
    ({1, 2}, None), (frozenset(), None), (fractions.Fraction(1, 3), None), (object(), None),
    (int, None), (len, None),
    (torch.zeros(2), None), (torch.tensor(1.0), None), (np.float32(1.0), None),
    (np.int64(2), None), (np.zeros(3), None),
    ([1, "a", None, [b"x", {"y": 2.0}]], 3), ([torch.zeros(1)], None), ({"t": np.ones(1)}, None),
]
# fmt: on


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 4])
def test_the_plain_rule(depth):
    # The rule exists once, in the core's codec: a value it takes as plain is
    # pickled with pickle alone, anything else by moolib.serialization.
    from moolib import _core

    for value, least in PLAIN_CASES:
        assert _core._is_plain(value, depth) == (least is not None and depth >= least), (
            value,
            depth,
        )


def test_plain_values_encode_as_the_python_codec_does():
    # A peer (or moolib.group) that pickles a plain value with
    # moolib.serialization sends the bytes the core's codec sends.
    for value, least in PLAIN_CASES:
        if least is not None and least <= 3:
            assert dumps(value) == (pickle.dumps(value, 5), []), value


@pytest.fixture(params=TRANSPORTS, ids=lambda t: t[0])
def link(request, make_rpc):
    """(client, server) in one process over one transport."""
    server = make_rpc("server", transports=request.param, listen=True, timeout=DEADLINE)
    client = make_rpc("client", transports=request.param, timeout=DEADLINE)
    client.connect(server.address)
    server.define("echo_all", lambda *a, **kw: (a, kw))
    server.define("none", lambda *a, **kw: None)
    server.define("fail", _fail)
    server.define("unpicklable", lambda: lambda: 0)
    return client, server


def _fail(message):
    raise ValueError(message)


@pytest.mark.parametrize("name", list(CALLS))
def test_arguments_arrive_as_sent(link, name):
    client, _ = link
    args, kwargs = CALLS[name]
    assert_same((args, kwargs), client.sync("server", "echo_all", *args, **kwargs))
    assert client.sync("server", "none", *args, **kwargs) is None
    assert_same((args, kwargs), client.async_("server", "echo_all", *args, **kwargs).result())


@pytest.mark.parametrize("name", list(CALLS))
def test_results_arrive_as_returned(make_rpc, name):
    # A call to itself runs the same encoding and decoding without a link.
    rpc = make_rpc("me")
    value = CALLS[name][0]
    rpc.define("value", lambda: value)
    assert_same(value, rpc.sync("me", "value"))


@pytest.mark.parametrize("name", list(CALLS))
def test_every_handler_kind_decodes_and_encodes_alike(make_rpc, name):
    # One codec decodes every request and encodes every reply, whichever
    # kind of handler serves the call.
    rpc = make_rpc("me", timeout=DEADLINE)
    rpc.define("call", lambda *a, **kw: (a, kw))
    rpc.define_deferred("deferred", lambda reply, *a, **kw: reply((a, kw)))
    queue = rpc.define_queue("queue")
    args, kwargs = CALLS[name]
    expected = (args, kwargs)
    assert_same(expected, rpc.sync("me", "call", *args, **kwargs))
    assert_same(expected, rpc.sync("me", "deferred", *args, **kwargs))
    future = rpc.async_("me", "queue", *args, **kwargs)
    reply, got_args, got_kwargs = queue.get(timeout=DEADLINE)
    assert_same(expected, (got_args, got_kwargs))
    reply((got_args, got_kwargs))
    assert_same(expected, future.result(timeout=DEADLINE))


def test_handlers_are_told_their_kind(make_rpc):
    from moolib import _core

    handler = _core.Handler(len, "encoded")
    assert handler.fn is len and handler.kind == "encoded"
    with pytest.raises(ValueError, match="unknown kind 'plain'"):
        _core.Handler(len, "plain")
    with pytest.raises(TypeError, match="must be callable"):
        _core.Handler(3, "call")
    rpc = make_rpc("me", timeout=DEADLINE)
    with pytest.raises(TypeError, match="Handler"):
        rpc._define_owned("f", len)
    # A result that cannot be encoded fails the call, whatever the kind.
    rpc.define_deferred("deferred", lambda reply: reply(lambda: 0))
    with pytest.raises(moolib.RpcError, match="Can't pickle|can't pickle|cannot pickle"):
        rpc.sync("me", "deferred")


def test_errors_carry_the_remote_exception_and_traceback(link):
    client, _ = link
    with pytest.raises(moolib.RpcError) as info:
        client.sync("server", "fail", "the message")
    text = str(info.value)
    assert "remote function 'fail' on peer 'server' raised ValueError: the message" in text
    assert "Remote traceback" in text and "_fail" in text
    with pytest.raises(moolib.RpcError, match="Can't pickle|can't pickle|cannot pickle"):
        client.sync("server", "unpicklable")
    with pytest.raises(moolib.RpcError, match="TypeError"):
        client.sync("server", "fail")  # missing argument: the call itself raises
    with pytest.raises(moolib.RpcError, match="TypeError"):
        client.sync("server", "fail", "m", nope=1)


def test_burst_of_mixed_calls_and_errors(link):
    """Many calls in flight at once travel several to a frame and run several
    to a batch; each still gets its own answer, errors included."""
    client, _ = link
    kinds = list(CALLS.values())
    futures = []
    for i in range(600):
        if i % 5 == 0:
            futures.append(("fail", str(i), client.async_("server", "fail", str(i))))
        else:
            args, kwargs = kinds[i % len(kinds)]
            futures.append(
                ("echo", (args, kwargs), client.async_("server", "echo_all", *args, **kwargs))
            )
    for kind, expected, future in futures:
        if kind == "fail":
            error = future.exception(timeout=DEADLINE)
            assert isinstance(error, moolib.RpcError) and f"ValueError: {expected}" in str(error)
            with pytest.raises(moolib.RpcError):
                future.result(timeout=0)
        else:
            assert_same(expected, future.result(timeout=DEADLINE))


def test_bursts_of_tensor_echoes_and_errors_do_not_deadlock(tmp_path):
    """A frame's tensors are freed wherever its send completes, often in
    another thread's send, inside the connection's write lock; freeing a
    tensor lets go of the GIL. Were it freed there, a thread taking the GIL
    could wait for that lock while the freeing thread waits for the GIL.
    Before the fix, 60 bursts over TCP (where full sockets queue frames) hung
    in most runs; a fresh interpreter keeps a hang from taking the suite."""
    code = f"""
import numpy as np, torch, moolib
server = moolib.Rpc()
server.set_name("server")
server.set_transports(["tcp"])
server.define("echo_all", lambda *a, **kw: (a, kw))
def fail(message):
    raise ValueError(message)
server.define("fail", fail)
client = moolib.Rpc()
client.set_name("client")
client.set_transports(["tcp"])
client.set_timeout({DEADLINE})
client.connect(server.listen("127.0.0.1:0"))
for _ in range(60):
    futures = []
    for i in range(600):
        if i % 5 == 0:
            futures.append(client.async_("server", "fail", str(i)))
        else:
            futures.append(client.async_(
                "server", "echo_all", torch.arange(6), big=torch.ones(5000), arr=np.zeros(3000)))
    for i, f in enumerate(futures):
        if i % 5 == 0:
            assert "ValueError: " + str(i) in str(f.exception(timeout={DEADLINE}))
        else:
            args, kwargs = f.result(timeout={DEADLINE})
            assert args[0].tolist() == list(range(6)) and float(kwargs["big"].sum()) == 5000
print("DONE", flush=True)
"""
    out = run_script(code, tmp_path)
    assert out.returncode == 0, out.stdout
    assert "DONE" in out.stdout


def test_a_blocking_function_does_not_hold_back_a_burst(spawn_peer, make_rpc):
    peer = spawn_peer("blocker")
    client = make_rpc("client", timeout=DEADLINE)
    client.connect(peer.address)
    slow = client.async_("blocker", "sleep", 1.0)
    burst = [client.async_("blocker", "add", i, 1) for i in range(300)]
    assert [f.result(timeout=DEADLINE) for f in burst] == [i + 1 for i in range(300)]
    assert slow.result(timeout=DEADLINE) == 1.0


@pytest.mark.parametrize("transports", TRANSPORTS, ids=lambda t: t[0])
def test_peer_process_over_each_transport(spawn_peer, make_rpc, transports):
    peer = spawn_peer("far", transports=transports)
    client = make_rpc("client", transports=transports, timeout=DEADLINE)
    client.connect(peer.address)
    for name, (args, kwargs) in CALLS.items():
        if name.startswith("str subclass"):
            continue  # its class lives in this test module, which the peer cannot import
        assert_same((args, kwargs), client.sync("far", "echo_all", *args, **kwargs))
    assert client.sync("far", "pid") != 0  # no arguments, an int back
    futures = [client.async_("far", "echo", i) for i in range(1000)]
    assert [f.result(timeout=DEADLINE) for f in futures] == list(range(1000))
    with pytest.raises(moolib.RpcError, match="ValueError: boom"):
        client.sync("far", "fail", "boom")


def test_future_api(make_rpc):
    rpc = make_rpc("me")
    rpc.define("twice", lambda x: 2 * x)
    rpc.define("fail", _fail)
    f = rpc.async_("me", "twice", 21)
    assert isinstance(f, moolib.Future)
    assert f.wait(DEADLINE) is True and f.wait(timeout=DEADLINE) is True
    assert f.done() and not f.cancelled()
    assert f.result() == 42 and f.result(DEADLINE) == 42 and f.result(timeout=None) == 42
    assert f.exception() is None
    assert f.cancel() is False
    assert [bytes(s) for s in f._segments()] == [dumps(42)[0]]
    ref = weakref.ref(f)
    del f
    gc.collect()
    assert ref() is None
    with pytest.raises(TypeError):
        moolib.Future()
    g = rpc.async_("me", "fail", "x")
    assert isinstance(g.exception(timeout=DEADLINE), moolib.RpcError)
    with pytest.raises(RuntimeError, match="has not succeeded"):
        g._segments()
    with pytest.raises(TypeError):
        g.result(nope=1)
    with pytest.raises(TypeError):
        g.result(1, 2)
    with pytest.raises(TypeError):
        g.wait("soon")
    with pytest.raises(TypeError):
        g.add_done_callback(3)


def test_future_timeout_cancel_callback_and_await(spawn_peer, make_rpc):
    peer = spawn_peer("slow")
    rpc = make_rpc("client", timeout=DEADLINE)
    rpc.connect(peer.address)
    f = rpc.async_("slow", "sleep", 0.5)
    with pytest.raises(TimeoutError):
        f.result(timeout=0.01)
    assert f.wait(0.01) in (True, False)
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.result()))
    assert f.result(timeout=DEADLINE) == 0.5
    wait_for(lambda: seen == [0.5], what="the done callback")
    c = rpc.async_("slow", "sleep", 0.5)
    assert c.cancel() is True and c.cancelled() and c.done()
    with pytest.raises(moolib.RpcError, match="cancelled"):
        c.result()

    async def main():
        return await rpc.async_("slow", "add", 2, 3)

    assert asyncio.run(main()) == 5


def test_fork_and_exit_with_a_burst_in_flight(spawn_peer, tmp_path):
    peer = spawn_peer("target")
    code = f"""
import os, sys
import moolib

rpc = moolib.Rpc()
rpc.set_timeout({DEADLINE})
rpc.connect({peer.address!r})
assert rpc.sync("target", "add", 1, 2) == 3
burst = [rpc.async_("target", "echo", i) for i in range(2000)]
pid = os.fork()
if pid == 0:
    # The parent's Rpc and its calls in flight belong to the parent.
    child = moolib.Rpc()
    child.set_timeout({DEADLINE})
    child.connect({peer.address!r})
    ok = [child.async_("target", "echo", i) for i in range(500)]
    assert [f.result() for f in ok] == list(range(500))
    child.close()
    os._exit(0)
assert [f.result() for f in burst] == list(range(2000))
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
# Exit with a burst still in flight: the process must end cleanly.
more = [rpc.async_("target", "echo", None, ) for _ in range(2000)]
more += [rpc.async_("target", "sleep", 0.2)]
print("DONE", flush=True)
sys.exit(0)
"""
    out = run_script(code, tmp_path)
    assert out.returncode == 0, out.stdout
    assert "DONE" in out.stdout
    rpc = moolib.Rpc()
    try:
        rpc.set_timeout(DEADLINE)
        rpc.connect(peer.address)
        assert rpc.sync("target", "add", 2, 2) == 4  # the peer is unharmed
    finally:
        rpc.close()
