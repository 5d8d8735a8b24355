"""Authentication with a shared key (MOOLIB_AUTH_KEY, moolib.set_auth_key, Rpc.set_auth_key).

The server is a moolib peer in its own process (tests/helpers/fuzz_peer.py).
Clients are moolib peers in this process, or raw sockets speaking the
handshake by hand (tests/helpers/fuzz_wire.py): HELLO (nonce, role, whether a
key is held), AUTH (HMAC-SHA256 proof over both nonces), then IDENTIFY. No
payload may be unpickled before both proofs passed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time
from pathlib import Path

import pytest
from helpers import fuzz_wire as fw

import moolib

KEY = "correct horse battery staple"
CALL_TIMEOUT = 3.0


class _Evil:
    """Unpickling this runs os.mkdir(path): proof that a payload was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def evil_request(marker: Path, call_id: int = 1) -> bytes:
    return fw.request(call_id, "echo", pickle.dumps(((_Evil(str(marker)),), {}), protocol=5))


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "unpickled"


@pytest.fixture
def peers(tmp_path, marker):
    started: list[fw.PeerProcess] = []

    def start(key: str | None = KEY, mode: str = "rpc") -> fw.PeerProcess:
        tag = f"peer{len(started)}"
        if mode == "env":
            p = fw.PeerProcess(
                tmp_path, marker=marker, env={"MOOLIB_AUTH_KEY": key} if key else None, tag=tag
            )
        else:
            p = fw.PeerProcess(tmp_path, marker=marker, key=key, key_mode=mode, tag=tag)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture
def clients(monkeypatch):
    made: list[moolib.Rpc] = []

    def make(key: str | None, mode: str = "rpc") -> moolib.Rpc:
        if mode == "env":
            if key is None:
                monkeypatch.delenv("MOOLIB_AUTH_KEY", raising=False)
            else:
                monkeypatch.setenv("MOOLIB_AUTH_KEY", key)
        elif mode == "global":
            moolib.set_auth_key(key)
        rpc = moolib.Rpc()
        if mode == "rpc" and key is not None:
            rpc.set_auth_key(key)
        monkeypatch.delenv("MOOLIB_AUTH_KEY", raising=False)
        moolib.set_auth_key(None)
        rpc.set_timeout(CALL_TIMEOUT)
        made.append(rpc)
        return rpc

    yield make
    for rpc in made:
        with contextlib.suppress(Exception):
            rpc.close()


def connect(rpc: moolib.Rpc, server: fw.PeerProcess, transport: str) -> None:
    if transport == "tcp":
        rpc.set_transports(["tcp"])
        rpc.connect(server.tcp)
    elif transport == "shm":
        rpc.connect(server.shm)
    else:  # "upgrade": dial TCP, let the peers move to shared memory by themselves
        rpc.connect(server.tcp)


def transports_to(rpc: moolib.Rpc, name: str) -> list[str]:
    info = rpc.debug_info()
    return [c["transport"] for p in info["peers"] if p["name"] == name for c in p["connections"]]


# --------------------------------------------------------------------------- moolib peers


@pytest.mark.parametrize("transport", ["tcp", "shm", "upgrade"])
@pytest.mark.parametrize(
    ("server_mode", "client_mode"), [("rpc", "rpc"), ("global", "env"), ("env", "global")]
)
def test_matching_keys_connect(peers, clients, transport, server_mode, client_mode):
    server = peers(KEY, server_mode)
    rpc = clients(KEY, client_mode)
    rpc.set_timeout(20)
    connect(rpc, server, transport)
    assert rpc.sync(server.name, "echo", {"hello": [1, 2, 3]}) == {"hello": [1, 2, 3]}
    expected = {"tcp": "tcp", "shm": "shm", "upgrade": "shm"}[transport]
    assert fw.wait_until(lambda: expected in transports_to(rpc, server.name), 10), transports_to(
        rpc, server.name
    )
    if transport == "upgrade":
        # The shared-memory link was authenticated too: calls keep working over it.
        for i in range(3):
            assert rpc.sync(server.name, "echo", i) == i
    assert "authentication" not in server.stderr()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize(
    ("server_key", "client_key"),
    [(KEY, "a different key"), (KEY, None), (None, KEY)],
    ids=["wrong-key", "client-without-key", "server-without-key"],
)
def test_mismatched_keys_are_refused(peers, clients, marker, transport, server_key, client_key):
    server = peers(server_key)
    rpc = clients(client_key)
    connect(rpc, server, transport)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        rpc.sync(server.name, "touch")
    elapsed = time.monotonic() - start
    assert server.name in str(info.value)
    assert elapsed < CALL_TIMEOUT + 5, (
        f"the call took {elapsed:.1f} s with a {CALL_TIMEOUT} s timeout"
    )
    assert not transports_to(rpc, server.name), "a connection was established"
    assert server.alive()
    assert not marker.exists()
    stderr = server.stderr()
    # The server says why it refused (the core logs to stderr by default).
    assert "authentication" in stderr.lower(), stderr[-2000:]
    # A refused peer does not poison the server: a client with the right key still gets in.
    good = clients(server_key)
    good.set_timeout(20)
    connect(good, server, transport)
    assert good.sync(server.name, "echo", 7) == 7


# --------------------------------------------------------------------------- raw handshakes


def raw_connect(server: fw.PeerProcess, transport: str) -> socket.socket:
    return fw.connect_tcp(server.tcp) if transport == "tcp" else fw.connect_shm(server.shm)


def frames_until_closed(sock: socket.socket, timeout: float = 10.0) -> tuple[list[int], bool]:
    """The types of the frames the server sends until it closes; and whether it closed."""
    types: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            f = fw.read_frame(sock, max(0.1, deadline - time.monotonic()))
        except fw.Closed:
            return types, True
        except TimeoutError:
            return types, False
        types.append(f.type)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_raw_client_with_the_key_authenticates(peers, marker, transport):
    """A hand-written client that follows the protocol gets through; its payload then runs
    (which makes the negative tests below meaningful)."""
    server = peers(KEY)
    with raw_connect(server, transport) as s:
        hello = fw.parse_hello(fw.read_frame(s))
        assert hello.has_key and hello.role == fw.ROLE_SERVER and len(hello.nonce) == fw.NONCE_BYTES
        mine = os.urandom(fw.NONCE_BYTES)
        s.sendall(fw.hello(mine, has_key=True))
        # The server says nothing more until the client has proven itself.
        with pytest.raises((TimeoutError, socket.timeout)):
            fw.read_frame(s, 0.5)
        s.sendall(fw.auth(fw.auth_proof(KEY, "client", hello.nonce, mine)))
        f = fw.read_frame_skipping_keepalives(s)
        assert f.type == fw.AUTH
        proof = fw.MetaReader(f.meta).str()
        assert proof == fw.auth_proof(KEY, "server", mine, hello.nonce), (
            "the server's proof is wrong"
        )
        ident = fw.parse_identify(fw.read_frame_skipping_keepalives(s))
        assert ident["name"] == server.name
        s.sendall(fw.identify("raw-authenticated") + evil_request(marker, 5))
        f = fw.read_frame_skipping_keepalives(s)
        assert f.type == fw.RESPONSE
        r = fw.MetaReader(f.meta)
        assert (r.u64(), r.u8()) == (5, 0)
    assert marker.exists(), "control: an authenticated request should have been unpickled"


BOGUS = [
    "random-proof",
    "empty-proof",
    "oversized-proof",
    "wrong-key",
    "server-role-proof",
    "swapped-nonces",
    "proof-from-another-connection",
    "no-auth-frame",
    "request-right-after-hello",
    "hello-claims-no-key",
    "second-hello",
]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("variant", BOGUS)
def test_bogus_authentication_never_unpickles(peers, marker, transport, variant):
    server = peers(KEY)
    other = None
    with raw_connect(server, transport) as s:
        hello = fw.parse_hello(fw.read_frame(s))
        assert hello.has_key
        mine = os.urandom(fw.NONCE_BYTES)
        hello_frame = fw.hello(mine, has_key=variant != "hello-claims-no-key")
        good_proof = fw.auth_proof(KEY, "client", hello.nonce, mine)
        if variant == "random-proof":
            handshake = hello_frame + fw.auth(os.urandom(32))
        elif variant == "empty-proof":
            handshake = hello_frame + fw.auth(b"")
        elif variant == "oversized-proof":
            handshake = hello_frame + fw.auth(good_proof * 8)
        elif variant == "wrong-key":
            handshake = hello_frame + fw.auth(
                fw.auth_proof("not the key", "client", hello.nonce, mine)
            )
        elif variant == "server-role-proof":
            handshake = hello_frame + fw.auth(fw.auth_proof(KEY, "server", hello.nonce, mine))
        elif variant == "swapped-nonces":
            handshake = hello_frame + fw.auth(fw.auth_proof(KEY, "client", mine, hello.nonce))
        elif variant == "proof-from-another-connection":
            # A valid proof, but for another connection's server nonce (a replay).
            other = raw_connect(server, transport)
            other_hello = fw.parse_hello(fw.read_frame(other))
            handshake = hello_frame + fw.auth(fw.auth_proof(KEY, "client", other_hello.nonce, mine))
        elif variant in ("no-auth-frame", "request-right-after-hello", "hello-claims-no-key"):
            handshake = hello_frame
        else:  # second-hello
            handshake = hello_frame + fw.hello(os.urandom(fw.NONCE_BYTES), has_key=True)
        tail = evil_request(marker)
        if variant != "request-right-after-hello":
            tail = fw.identify("intruder") + tail
        # Everything in one write: the server must not get ahead of its checks.
        fw.send_all_ignoring_reset(s, handshake + tail)
        types, closed = frames_until_closed(s)
    if other is not None:
        other.close()
    assert closed, f"the server kept the connection open (got frame types {types})"
    assert fw.AUTH not in types and fw.IDENTIFY not in types, (
        f"the server went on with the handshake: {types}"
    )
    time.sleep(0.5)
    assert not marker.exists(), "a payload was unpickled on a connection that failed authentication"
    assert server.alive()
    stderr = server.stderr()
    if variant in (
        "random-proof",
        "wrong-key",
        "server-role-proof",
        "swapped-nonces",
        "proof-from-another-connection",
    ):
        assert "authentication" in stderr.lower(), stderr[-2000:]
    assert "closing connection" in stderr, stderr[-2000:]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "keyless"])
@pytest.mark.parametrize("source", ["same-connection", "other-connection"])
def test_replayed_server_nonce_is_rejected(peers, marker, transport, keyed, source):
    server = peers(KEY if keyed else None)
    other = None
    with raw_connect(server, transport) as s:
        hello = fw.parse_hello(fw.read_frame(s))
        nonce = hello.nonce
        if source == "other-connection":
            other = raw_connect(server, transport)
            nonce = fw.parse_hello(fw.read_frame(other)).nonce
        # Reflect the server's nonce, with a proof that would be valid for it if we had the key.
        proof = fw.auth_proof(KEY, "client", hello.nonce, nonce)
        data = fw.hello(nonce, has_key=keyed)
        if keyed:
            data += fw.auth(proof)
        data += fw.identify("reflector") + evil_request(marker)
        fw.send_all_ignoring_reset(s, data)
        types, closed = frames_until_closed(s)
    if other is not None:
        other.close()
    assert closed, f"a HELLO with the server's own nonce was accepted (frames {types})"
    assert fw.IDENTIFY not in types and fw.AUTH not in types, types
    time.sleep(0.5)
    assert not marker.exists()
    assert server.alive()
    stderr = server.stderr()
    assert "nonce" in stderr.lower(), stderr[-2000:]
