"""Idle links stay up: keepalive frames flow while nothing else does."""

from __future__ import annotations

import time

from helpers.util import connections, wait_for


def test_idle_link_sends_keepalives_and_stays_usable(make_rpc, transports):
    server = make_rpc(name="server", listen=True)
    server.define("ping", lambda: "pong")
    client = make_rpc(name="client", transports=transports)
    client.connect(server.address)
    assert client.sync("server", "ping") == "pong"
    wanted = transports[0] if transports else "shm"
    wait_for(lambda: any(c["transport"] == wanted for c in connections(client, "server")))

    def sent():
        return sum(c["bytes_sent"] for c in connections(client, "server"))

    before = sent()
    # The core sends a keepalive on a link idle for a second; watch a few go out.
    wait_for(lambda: sent() >= before + 3 * 24, timeout=60, what="keepalive frames on an idle link")
    time.sleep(1.5)
    assert connections(client, "server"), "the idle link was dropped"
    assert client.sync("server", "ping") == "pong"
