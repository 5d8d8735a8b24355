"""``python -m moolib.broker [addr:port]`` (or ``moolib-broker``): runs a broker until stopped.

The Broker class lives in moolib.group, so that running this module does not
import it twice.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from .group import Broker

__all__ = ["main"]

DEFAULT_ADDRESS = "0.0.0.0:4431"


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
