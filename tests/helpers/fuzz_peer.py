"""A moolib peer in its own process, the target of the wire fuzzing and auth tests.

Run as ``python fuzz_peer.py``; configured through the environment:

- ``FUZZ_NAME``: the peer's name (default "fuzz-server").
- ``FUZZ_MARKER``: a path that the function "touch" creates when it runs.
- ``FUZZ_KEY``: an authentication key, applied as ``FUZZ_KEY_MODE`` says:
  "rpc" (``Rpc.set_auth_key``, the default) or "global" (``moolib.set_auth_key``
  before the Rpc is created). ``MOOLIB_AUTH_KEY`` is honoured by the core itself.
- ``FUZZ_LISTEN``: the address to listen on (default "127.0.0.1:0").
- ``FUZZ_TRANSPORTS``: a comma-separated ``set_transports`` list (naming ucx makes the
  peer listen on a ucx:// address beside its TCP one).

It prints one JSON line to stdout: {"pid", "name", "tcp", "listening"}, then
serves until its stdin closes (the test process went away) or it is killed.
Log lines of the core go to stderr (the tests read them from a file).
"""

from __future__ import annotations

import json
import os
import sys

import moolib


def main() -> None:
    key = os.environ.get("FUZZ_KEY")
    mode = os.environ.get("FUZZ_KEY_MODE", "rpc")
    if key is not None and mode == "global":
        moolib.set_auth_key(key)
    rpc = moolib.Rpc()
    if key is not None and mode == "rpc":
        rpc.set_auth_key(key)
    rpc.set_name(os.environ.get("FUZZ_NAME", "fuzz-server"))
    if os.environ.get("FUZZ_TRANSPORTS"):
        rpc.set_transports(os.environ["FUZZ_TRANSPORTS"].split(","))
    marker = os.environ.get("FUZZ_MARKER")

    def echo(x):
        return x

    def touch(*args, **kwargs):
        if marker:
            with open(marker, "a") as f:
                f.write("called\n")
        return True

    rpc.define("echo", echo)
    rpc.define("touch", touch)
    tcp = rpc.listen(os.environ.get("FUZZ_LISTEN", "127.0.0.1:0"))
    info = rpc.debug_info()
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "name": rpc.get_name(),
                "tcp": tcp,
                "listening": list(info["listening"]),
            }
        ),
        flush=True,
    )
    # Serve until the parent closes our stdin (or kills us).
    for _ in sys.stdin:
        pass
    rpc.close()


if __name__ == "__main__":
    main()
