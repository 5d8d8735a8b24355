"""Broker: tracks groups of peers. ``python -m moolib.broker [addr:port]`` runs one."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from . import _core
from .rpc import Rpc

__all__ = ["Broker", "main"]

DEFAULT_ADDRESS = "0.0.0.0:4431"


class Broker:
    """A peer that keeps track of groups: members, liveness and sync ids.

    Groups find it by name ("broker" unless ``Group.set_broker_name`` says
    otherwise). Call ``update()`` regularly: it drops members that missed their
    timeout.
    """

    def __init__(self, rpc: Rpc | None = None) -> None:
        if rpc is None:
            rpc = Rpc()
            rpc.set_name("broker")
        self.rpc = rpc
        self._service = _core.Broker(rpc)

    def set_name(self, name: str) -> None:
        """Sets the name groups address the broker by."""
        self.rpc.set_name(name)

    def get_name(self) -> str:
        return self.rpc.get_name()

    def listen(self, address: str) -> str:
        """Listens on ``address`` ("host:port"; port 0 picks one); returns the bound address."""
        return self.rpc.listen(address)

    def connect(self, address: str) -> None:
        self.rpc.connect(address)

    def update(self) -> None:
        """Drops members that have not pinged within their timeout."""
        self._service.update()

    def groups(self) -> dict[str, dict[str, Any]]:
        """``{group: {"sync_id": int, "members": [names]}}`` as the broker sees them now."""
        return self._service.groups()

    def close(self) -> None:
        """Stops serving (closes the Rpc)."""
        self.rpc.close()


def main(argv: list[str] | None = None) -> int:
    """Runs a broker until Ctrl-C or SIGTERM."""
    parser = argparse.ArgumentParser(prog="moolib-broker", description="Run a moolib broker.")
    parser.add_argument(
        "address", nargs="?", default=DEFAULT_ADDRESS, help="host:port to listen on"
    )
    parser.add_argument("--name", default="broker", help="the name groups reach the broker by")
    args = parser.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    broker = Broker()
    broker.set_name(args.name)
    try:
        address = broker.listen(args.address)
    except RuntimeError as e:
        print(f"moolib-broker: cannot listen at {args.address}: {e}", file=sys.stderr)
        return 1
    print(f"Broker listening at {address}", flush=True)
    while not stop.wait(0.25):
        broker.update()
    broker.close()
    print("Broker stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
