"""Two hosts on one machine: a peer in a network namespace of its own.

A network namespace has its own loopback, and moolib's host identity includes
it, so a peer there is "another host": it must be told only addresses it can
reach (never a loopback or shared-memory one) and it reaches other peers by
name over TCP. Needs root (ip netns); skipped otherwise.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.util import DEADLINE, PEER_SCRIPT, REPO, child_env, peer_entry

KEY = "netns-test-key"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _add_namespace(name: str) -> None:
    """Adds network namespace ``name`` (a leftover of an interrupted run replaced);
    skips the test where namespaces are unavailable."""
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"network namespaces unavailable (needs root and iproute2): {e}")


@pytest.fixture
def namespace():
    """A namespace joined to this one by a veth pair: (name, host-side IP)."""
    tag = os.getpid() % 200 + 20
    name, host_if, ns_if = f"moons{tag}", f"moo{tag}h", f"moo{tag}n"
    host_ip, ns_ip = f"10.213.{tag}.1", f"10.213.{tag}.2"
    # A leftover of an interrupted run would make the names clash.
    subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
    _add_namespace(name)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", name)
        _ip("addr", "add", f"{host_ip}/24", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ns_ip}/24", "dev", ns_if)
        _ip("netns", "exec", name, "ip", "link", "set", ns_if, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield name, host_ip
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)


class NamespacedPeer:
    """tests/helpers/peer.py run inside a namespace (ip netns exec)."""

    def __init__(self, namespace: str, args: list[str], log_path) -> None:
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, str(PEER_SCRIPT), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=child_env(),
            cwd=str(REPO),
            text=True,
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True
        ).start()
        deadline = time.monotonic() + DEADLINE
        while True:
            assert time.monotonic() < deadline, "the namespaced peer did not start"
            try:
                if lines.get(timeout=0.5).startswith("READY"):
                    return
            except queue.Empty:
                assert self.proc.poll() is None, "the namespaced peer exited"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self._log.close()


def test_peer_on_another_host_gets_only_reachable_addresses(
    make_rpc, spawn_peer, namespace, tmp_path
):
    ns, host_ip = namespace
    hub = make_rpc("hub", auth_key=KEY, timeout=DEADLINE)
    port = hub.listen("0.0.0.0:0").rsplit(":", 1)[1]
    # C is on this host, listening on every interface, and joined the hub over loopback.
    spawn_peer(
        "C", listen="0.0.0.0:0", connect=[f"127.0.0.1:{port}"], auth_key=KEY, timeout=DEADLINE
    )
    # A is on the "other host" and reaches the hub through the veth pair.
    a = NamespacedPeer(
        ns,
        [
            "--name",
            "A",
            "--connect",
            f"{host_ip}:{port}",
            "--auth-key",
            KEY,
            "--timeout",
            str(DEADLINE),
        ],
        tmp_path / "peer-A.log",
    )
    try:
        # A finds C by name through the hub and dials it directly.
        assert hub.sync("A", "call", "C", "name") == "C"
        info = hub.sync("A", "info")
        entry = peer_entry_from(info, "C")
        assert entry is not None, info
        assert entry["addresses"], entry
        for address in entry["addresses"]:
            assert not address.startswith(("127.", "[::1]", "shm://")), entry
        assert [c["transport"] for c in entry["connections"]] == ["tcp"] * len(entry["connections"])
        assert any(c["remote"].startswith(f"{host_ip}:") for c in entry["connections"]), entry
        # The hub's own view of A: same-host is false, and A's loopback never leaks to C either.
        assert peer_entry(hub, "A")["same_host"] is False
    finally:
        a.stop()


def peer_entry_from(info: dict, name: str) -> dict | None:
    return next((p for p in info["peers"] if p["name"] == name), None)


DUAL_STACK_CLIENT = """
import sys, moolib
server = moolib.Rpc()
server.set_name("server")
server.define("where", lambda: "reached")
port = server.listen(sys.argv[1] + ":0").rsplit(":", 1)[1]
client = moolib.Rpc()
client.set_timeout(30)
client.connect(f"dualhost:{port}")
print(client.sync("server", "where"))
"""


@pytest.mark.parametrize("listen", ["127.0.0.1", "[::1]"])
def test_a_name_with_several_addresses_reaches_a_peer_on_any_of_them(tmp_path, listen):
    """On most hosts "localhost" resolves to ::1 and then 127.0.0.1: connect()
    tries each address in turn, so a peer listening on 127.0.0.1 alone is
    reached. The name lives in the namespace's own /etc/hosts (ip netns exec
    mounts /etc/netns/NAME/hosts there), so this machine's is left alone."""
    name = f"moodual{os.getpid() % 1000}"
    etc = Path("/etc/netns") / name
    _add_namespace(name)
    try:
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("::1 dualhost\n127.0.0.1 dualhost\n")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        script = tmp_path / "dual.py"
        script.write_text(DUAL_STACK_CLIENT)
        out = subprocess.run(
            ["ip", "netns", "exec", name, sys.executable, str(script), listen],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=3 * DEADLINE,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.strip() == "reached"
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        shutil.rmtree(etc, ignore_errors=True)
