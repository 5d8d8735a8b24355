"""The stop signals of the processes moolib starts (env workers, moolib-run's peers).

A Ctrl-C reaches every process of the terminal's process group, and timeout,
systemd and SLURM's scancel send SIGTERM to all of a job's processes. A process
started in ``blocked()`` inherits these signals blocked: one that comes while its
interpreter still imports (seconds) stays pending until the process has decided
what to do with it (a handler, or ignoring it) and unblocks them, instead of
killing it mid-import with a traceback.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@contextlib.contextmanager
def blocked() -> Iterator[None]:
    """Blocks the stop signals in this thread while the block runs (processes started
    in it inherit them blocked). Python still runs this process's handlers: another
    thread takes the signal, or this one once the block ends."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def unblock() -> None:
    """Unblocks the stop signals in this thread: any that came while they were blocked
    is handled now, by the disposition in place."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
