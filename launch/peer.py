"""One training peer: ``python -m moolib.launch.peer --config <savedir>/config.yaml
--rank N --broker host:port``. Started by moolib-run's local and SLURM modes.

The first SIGINT, SIGTERM or SIGHUP stops the peer after its current step (the
leader writes a checkpoint first) and it exits 0; a second SIGINT interrupts at
once (exit 130, no traceback). With ``--parent-fd``, the peer stops the same way
when the launcher that started it is gone (the pipe it holds open closes), and
ends for sure shortly after. A peer out of its group for ``lost_group_timeout``
seconds exits with code 3.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moolib import _signals

from . import config as config_lib
from . import output

if TYPE_CHECKING:
    from moolib.conf.schema.run_config import RunConfig

# Seconds a peer whose launcher is gone has to finish its step and checkpoint.
ORPHAN_GRACE = 20.0
# The exit code of a peer that lost its group (see lost_group_timeout).
EXIT_GROUP_LOST = 3


class StopSignal(threading.Event):
    """Set by the first SIGINT/SIGTERM/SIGHUP; ``signum`` is that signal."""

    def __init__(self) -> None:
        super().__init__()
        self.signum: int | None = None

    @property
    def exit_code(self) -> int:
        """128 + the signal's number (130 for Ctrl-C), the shell's convention; 0 if unset."""
        return 128 + self.signum if self.is_set() and self.signum else 0


def stop_on_signals() -> StopSignal:
    """An event set by the first SIGINT/SIGTERM/SIGHUP; a second SIGINT raises
    KeyboardInterrupt. Unblocks those signals (moolib-run starts its peers with them
    blocked: ``moolib._signals``): one that came meanwhile is handled now."""
    stop = StopSignal()
    exiting = threading.Event()
    # Registered after torch's and moolib's own exit callbacks, so it runs before them
    # (atexit runs them last first): a KeyboardInterrupt raised inside one of theirs would
    # print "Exception ignored in atexit callback" with a traceback.
    atexit.register(exiting.set)

    def handle(signum: int, frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            if exiting.is_set():
                # The interpreter is already shutting down: end it now, quietly.
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                os._exit(128 + signal.SIGINT)
            raise KeyboardInterrupt
        if not stop.is_set():
            stop.signum = signum
        stop.set()

    # SIGHUP: the terminal or ssh session went away; stop as cleanly as on Ctrl-C.
    for signum in _signals.STOP_SIGNALS:
        signal.signal(signum, handle)
    _signals.unblock()
    return stop


def stop_with_parent(fd: int, stop: threading.Event, rank: int) -> None:
    """Sets ``stop`` once the launcher holding the other end of pipe ``fd`` is gone
    (exited or killed: the kernel closes its end), then ends this process if it is
    still there ``ORPHAN_GRACE`` seconds later."""

    def watch() -> None:
        try:
            while os.read(fd, 64):
                pass
        except OSError:
            pass
        logging.getLogger("moolib.launch").error(
            "peer %d: moolib-run (the launcher) is gone: stopping", rank
        )
        stop.set()
        deadline = threading.Timer(ORPHAN_GRACE, os._exit, args=(1,))
        deadline.daemon = True
        deadline.start()

    threading.Thread(target=watch, name="moolib-parent-watch", daemon=True).start()


def make_trainer(cfg: RunConfig, rank: int, broker: str) -> Any:
    """The Trainer of peer ``rank`` of the experiment described by ``cfg``; for an
    off-policy agent, its learner (rank 0) or one of its actor processes."""
    from moolib.agents.registry import runtime_of

    return runtime_of(cfg).make_runner(cfg, rank, broker)


def train(cfg: RunConfig, rank: int, broker: str, stop: threading.Event) -> dict:
    """Runs one peer of the experiment described by ``cfg`` until done or stopped;
    exits with ``EXIT_GROUP_LOST`` when the peer lost its group for good, with 2
    when the group's peers have different models, and with 1 when the run's final
    checkpoint could not be written."""
    from moolib.agents.runtime.base import GroupLostError
    from moolib.agents.runtime.checkpoint import FinalWriteError

    import moolib

    try:
        return make_trainer(cfg, rank, broker).run(stop)
    except GroupLostError as e:
        print(f"moolib-run: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_GROUP_LOST)
    except FinalWriteError as e:
        print(f"moolib-run: error: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except moolib.ModelMismatchError as e:
        # Another experiment's peers in this group (e.g. a reused group name).
        print(f"moolib-run: error: peer {rank}: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a peer process."""
    parser = argparse.ArgumentParser(prog="python -m moolib.launch.peer")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--broker", required=True)
    parser.add_argument(
        "--parent-fd", type=int, default=None, help="read end of a pipe the launcher holds open"
    )
    args = parser.parse_args(argv)
    output.quiet_when_closed()
    logging.basicConfig(level=logging.INFO, format=f"[peer {args.rank}] %(message)s")
    cfg = config_lib.load(args.config)
    stop = stop_on_signals()
    if args.parent_fd is not None:
        stop_with_parent(args.parent_fd, stop, args.rank)
    try:
        train(cfg, args.rank, args.broker, stop)
    except KeyboardInterrupt:
        # A second Ctrl-C: stop at once, quietly (the first one asked for a checkpoint).
        return 130
    # Done: a late SIGTERM from the launcher (sent after Ctrl-C reached the
    # whole process group) must not kill the interpreter's clean exit.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
