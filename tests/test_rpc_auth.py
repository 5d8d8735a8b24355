"""Authentication between real peers: a shared key lets calls through (over
every transport); a wrong key, or a key on one side only, refuses the
connection, so calls fail after their timeout (an AuthenticationError) and
the remote function never runs."""

from __future__ import annotations

import time

import pytest
from helpers.util import DEADLINE, TRANSPORT_IDS, TRANSPORTS, peer_entry, transports_to, wait_for

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")

KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def vault(module_spawn_peer):
    """A peer process whose key comes from MOOLIB_AUTH_KEY."""
    return module_spawn_peer("vault", env={"MOOLIB_AUTH_KEY": KEY}, timeout=DEADLINE)


@pytest.fixture
def default_key():
    """Restores moolib's module-level default key."""
    try:
        yield
    finally:
        moolib.set_auth_key(None)


def assert_refused(rpc, peer, marker):
    rpc.set_timeout(2)
    with pytest.raises(RuntimeError) as info:
        rpc.sync(peer, "touch", str(marker))
    assert "timed out" in str(info.value)
    assert peer in str(info.value)
    time.sleep(0.3)
    assert not marker.exists(), "the remote function ran although the connection was refused"
    entry = peer_entry(rpc, peer)
    assert entry is None or not entry["connections"]


@pytest.mark.parametrize("transports", TRANSPORTS, ids=TRANSPORT_IDS)
def test_same_key_calls_work(make_rpc, vault, transports, tmp_path):
    rpc = make_rpc(transports=transports, auth_key=KEY, timeout=DEADLINE)
    rpc.connect(vault.address)
    marker = tmp_path / "ran"
    assert rpc.sync("vault", "touch", str(marker)) is True
    assert marker.read_text() == "vault"
    assert rpc.sync("vault", "add", 20, 22) == 42
    if transports == ["tcp"]:
        assert set(transports_to(rpc, "vault")) == {"tcp"}
    else:  # the shared-memory link authenticates as well
        wait_for(lambda: "shm" in transports_to(rpc, "vault"), what="an shm connection")
        assert rpc.sync("vault", "add", 1, 1) == 2


def assert_new_rpc_gets_in(vault, tmp_path):
    """A fresh Rpc (keyed by process-wide settings) can call the vault."""
    rpc = moolib.Rpc()
    try:
        rpc.set_timeout(DEADLINE)
        rpc.connect(vault.address)
        assert rpc.sync("vault", "touch", str(tmp_path / "ok")) is True
    finally:
        rpc.close()


def test_module_default_key(vault, default_key, tmp_path):
    moolib.set_auth_key(KEY)
    assert_new_rpc_gets_in(vault, tmp_path)
    moolib.set_auth_key(None)
    keyless = moolib.Rpc()
    try:
        keyless.connect(vault.address)
        assert_refused(keyless, "vault", tmp_path / "not-created")
    finally:
        keyless.close()


def test_env_key_in_this_process(vault, monkeypatch, tmp_path):
    monkeypatch.setenv("MOOLIB_AUTH_KEY", KEY)
    assert_new_rpc_gets_in(vault, tmp_path)


@pytest.mark.parametrize("transports", [None, ["tcp"]], ids=["default", "tcp"])
def test_wrong_key_is_refused(make_rpc, vault, transports, tmp_path):
    rpc = make_rpc(transports=transports, auth_key="not-the-key")
    rpc.connect(vault.address)
    assert_refused(rpc, "vault", tmp_path / "marker")


def test_no_key_against_keyed_peer_is_refused(make_rpc, vault, tmp_path):
    rpc = make_rpc()
    rpc.connect(vault.address)
    assert_refused(rpc, "vault", tmp_path / "marker")


def test_key_only_on_caller_is_refused(make_rpc, spawn_peer, tmp_path):
    open_peer = spawn_peer("open-peer")
    rpc = make_rpc(auth_key=KEY)
    rpc.connect(open_peer.address)
    assert_refused(rpc, "open-peer", tmp_path / "marker")
    # Without a key on either side the same peer is reachable.
    plain = make_rpc(timeout=DEADLINE)
    plain.connect(open_peer.address)
    assert plain.sync("open-peer", "touch", str(tmp_path / "plain")) is True


def test_keyed_listener_refuses_wrong_key_in_process(make_rpc):
    ran = []
    server = make_rpc("keyed-server", auth_key=KEY, listen=True)
    server.define("f", lambda: ran.append(1))
    good = make_rpc(auth_key=KEY, timeout=DEADLINE)
    good.connect(server.address)
    good.sync("keyed-server", "f")
    assert ran == [1]
    bad = make_rpc(auth_key=KEY + "x", timeout=2)
    bad.connect(server.address)
    with pytest.raises(RuntimeError, match="timed out"):
        bad.sync("keyed-server", "f")
    assert ran == [1]
    # The refused peer never became a known peer of the server.
    assert all(p["name"] != bad.get_name() for p in server.debug_info()["peers"])
    # No more refusals, each logged by the server, after the test (into pytest's report).
    bad.close()
    wait_for(
        lambda: server.debug_info()["unidentified_connections"] == 0,
        timeout=30,
        what="the server to drop the refused connection",
    )
