"""The Broker: the ``python -m moolib.broker`` command line (and the
``moolib-broker`` console script when installed), and the Python API in this
process (groups it tracks, timeouts, bad requests)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
from helpers.group_util import BrokerProcess
from helpers.util import DEADLINE, wait_for

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")


def _member(make_rpc, address, group, timeout=10.0, broker_name=None, name=None):
    """An Rpc connected to the broker at ``address`` and its Group (joined)."""
    rpc = make_rpc(name or "m-" + moolib.create_uid()[:8])
    rpc.connect(address)
    g = moolib.Group(rpc, group)
    g.set_timeout(timeout)
    if broker_name:
        g.set_broker_name(broker_name)
    g.update()
    return g


def _members(g):
    return g.members() if g.active() else None


# ---------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_cli_port_zero_serves_groups_and_stops_on_signal(sig, tmp_path, make_rpc):
    broker = BrokerProcess(tmp_path / "broker.log")
    try:
        host, port = broker.address.rsplit(":", 1)
        assert host == "127.0.0.1"
        assert int(port) > 0, broker.address
        g = _member(make_rpc, broker.address, "cli")
        me = g.rpc.get_name()
        wait_for(lambda: _members(g) == [me], what="the group served by the CLI broker")
        assert g.sync_id() != 0
        broker.kill(sig)
        rc, out = broker.wait_output()
        assert rc == 0, f"exit status {rc}; log:\n{broker.log()}"
        assert out.splitlines()[-1] == "Broker stopped", out
    finally:
        broker.stop()


def test_cli_name_option(tmp_path, make_rpc):
    broker = BrokerProcess(tmp_path / "broker.log", name="other-broker")
    try:
        g = _member(make_rpc, broker.address, "named", broker_name="other-broker")
        wait_for(lambda: _members(g) == [g.rpc.get_name()], what="membership via 'other-broker'")
        # A group looking for the default name finds no broker there.
        lost = _member(make_rpc, broker.address, "named-default")
        assert not lost.active()
        assert lost.members() == []
    finally:
        broker.stop()


def _taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize(
    "address",
    ["not-an-address", "127.0.0.1:99999", "127.0.0.1:abc", "256.0.0.1:0", "in-use"],
)
def test_cli_bad_address_fails(address, tmp_path):
    holder = _taken_port() if address == "in-use" else None
    if holder:
        address = f"127.0.0.1:{holder.getsockname()[1]}"
    broker = BrokerProcess(tmp_path / "broker.log", address=address, wait=False)
    try:
        rc, out = broker.wait_output()
        assert rc != 0
        assert "Broker listening" not in out
        assert f"cannot listen at {address}" in broker.log()
    finally:
        broker.stop()
        if holder:
            holder.close()


def test_console_script_if_installed(tmp_path, make_rpc):
    script = Path(sys.executable).parent / "moolib-broker"
    if not script.exists():
        script = shutil.which("moolib-broker")
        if script is None:
            pytest.skip("moolib-broker is not installed (pip install -e .)")
    broker = BrokerProcess(tmp_path / "broker.log", argv=[str(script), "127.0.0.1:0"])
    try:
        assert int(broker.address.rsplit(":", 1)[1]) > 0
        g = _member(make_rpc, broker.address, "script")
        wait_for(lambda: _members(g) == [g.rpc.get_name()], what="the group served by the script")
        broker.kill(signal.SIGTERM)
        rc, out = broker.wait_output()
        assert rc == 0
        assert "Broker stopped" in out
    finally:
        broker.stop()


# ---------------------------------------------------------------------------
# The Broker API in this process


@pytest.fixture
def broker():
    b = moolib.Broker()
    b.address = b.listen("127.0.0.1:0")
    try:
        yield b
    finally:
        b.close()


def test_broker_defaults_and_names(make_rpc):
    b = moolib.Broker()
    try:
        assert b.get_name() == "broker"
        assert isinstance(b.rpc, moolib.Rpc)
        assert b.rpc.get_name() == "broker"
        b.set_name("renamed")
        assert b.get_name() == "renamed" and b.rpc.get_name() == "renamed"
        address = b.listen("127.0.0.1:0")
        assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) > 0
        assert b.groups() == {}
        b.update()  # nothing to drop
        assert b.groups() == {}
    finally:
        b.close()
    # On a caller's Rpc it serves under that Rpc's name.
    rpc = make_rpc("my-broker-rpc")
    b2 = moolib.Broker(rpc)
    assert b2.rpc is rpc
    assert b2.get_name() == "my-broker-rpc"


def test_one_broker_two_groups(broker, make_rpc):
    a = [_member(make_rpc, broker.address, "alpha", name=f"alpha-{i}") for i in range(2)]
    b = [_member(make_rpc, broker.address, "beta", name=f"beta-{i}") for i in range(3)]
    both = _member(make_rpc, broker.address, "beta", name="in-both")
    also_alpha = moolib.Group(both.rpc, "alpha")
    also_alpha.update()
    want_a = {"alpha-0", "alpha-1", "in-both"}
    want_b = {"beta-0", "beta-1", "beta-2", "in-both"}

    def settled():
        ga = broker.groups()
        return (
            set(ga.get("alpha", {}).get("members", [])) == want_a
            and set(ga.get("beta", {}).get("members", [])) == want_b
            and all(set(_members(g) or []) == want_a for g in [*a, also_alpha])
            and all(set(_members(g) or []) == want_b for g in [*b, both])
        )

    wait_for(settled, what="both groups complete on the broker and every member")
    groups = broker.groups()
    assert set(groups) == {"alpha", "beta"}
    assert groups["alpha"]["sync_id"] != groups["beta"]["sync_id"]
    for g in [*a, also_alpha]:
        assert g.members() == groups["alpha"]["members"]
        assert g.sync_id() == groups["alpha"]["sync_id"]
    for g in [*b, both]:
        assert g.members() == groups["beta"]["members"]
        assert g.sync_id() == groups["beta"]["sync_id"]
    # Leaving one group leaves the other alone.
    alpha_sync = groups["alpha"]["sync_id"]
    also_alpha.close()
    wait_for(
        lambda: set(broker.groups()["alpha"]["members"]) == {"alpha-0", "alpha-1"},
        what="in-both gone from alpha",
    )
    assert broker.groups()["alpha"]["sync_id"] != alpha_sync
    assert set(broker.groups()["beta"]["members"]) == want_b
    # A group whose last member leaves is forgotten.
    for g in a:
        g.close()
    wait_for(lambda: "alpha" not in broker.groups(), what="alpha forgotten")
    assert "beta" in broker.groups()


def test_update_drops_members_that_stop_pinging(broker, make_rpc):
    stays = _member(make_rpc, broker.address, "drop", timeout=60, name="stays")
    goes = _member(make_rpc, broker.address, "drop", timeout=1, name="goes")

    def both_listed():
        goes.update()  # a member whose program goes 1 s without update() leaves
        return set(broker.groups().get("drop", {}).get("members", [])) == {"stays", "goes"}

    wait_for(both_listed, what="both members on the broker")
    before = broker.groups()["drop"]["sync_id"]
    goes.rpc.close()  # no more pings, and no leave message

    def dropped():
        broker.update()
        return broker.groups()["drop"]["members"] == ["stays"]

    wait_for(dropped, timeout=DEADLINE, what="the silent member dropped by update()")
    assert broker.groups()["drop"]["sync_id"] != before
    wait_for(lambda: _members(stays) == ["stays"], what="the remaining member updated")


def test_malformed_broker_request_gets_an_error(broker, make_rpc):
    g = _member(make_rpc, broker.address, "robust", name="robust-member")
    wait_for(lambda: _members(g) == ["robust-member"], what="membership")
    rpc = make_rpc("prankster")
    rpc.connect(broker.address)
    for args in [("not a broker request",), (), (b"\x01" * 3, 4.5)]:
        with pytest.raises(moolib.RpcError, match="malformed broker request|empty broker request"):
            rpc.async_("broker", "__moolib_broker", *args).result(DEADLINE)
    # The broker still serves: a new member joins and everyone sees it.
    g2 = _member(make_rpc, broker.address, "robust", name="robust-2")
    want = ["robust-member", "robust-2"]
    wait_for(lambda: _members(g) == want and _members(g2) == want, what="second member")
    assert "prankster" not in broker.groups()["robust"]["members"]


def test_broker_gone_members_lose_contact(make_rpc):
    b = moolib.Broker()
    address = b.listen("127.0.0.1:0")
    try:
        gs = [
            _member(make_rpc, address, "orphans", timeout=1, name=f"orphan-{i}") for i in range(2)
        ]
        want = {"orphan-0", "orphan-1"}
        wait_for(lambda: all(set(_members(g) or ()) == want for g in gs), what="both members")
        for g in gs:
            g.update()  # consume the join
        # One member waits for an all-reduce the other never starts.
        pending = gs[0].all_reduce("never", 1.0)
        assert not pending.done()
        # Held, so that neither leaves for not calling update() (after the same
        # 1 s) before it notices the broker is gone: what is tested here.
        with contextlib.ExitStack() as held:
            for g in gs:
                held.enter_context(g.keepalive())
            b.close()
            wait_for(
                lambda: not any(g.active() for g in gs), what="members notice the broker is gone"
            )
    finally:
        b.close()  # again, if the test failed before
    for g in gs:
        assert g.members() == []
        assert g.update() is True
    assert pending.wait(DEADLINE)
    error = pending.exception()
    assert isinstance(error, moolib.RpcError)
    assert "broker" in str(error)
    with pytest.raises(moolib.RpcError, match="not an active member"):
        gs[1].all_reduce("after", 1.0).result(DEADLINE)
