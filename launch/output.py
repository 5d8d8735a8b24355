"""Standard output that its reader may close: ``moolib-run ... | head -2``.

Python ignores SIGPIPE, so a write to a pipe whose reader is gone raises
BrokenPipeError: in the middle of a run (a traceback, and training lost), and
again when the interpreter flushes stdout at exit. ``quiet_when_closed`` makes
the first such write point stdout at ``/dev/null`` (the way the Python docs'
"Note on SIGPIPE" ends output) and carry on: what follows is not shown, and the
run goes on writing its logs, checkpoints and exit status as before.
"""

from __future__ import annotations

import os
import sys

from moolib.agents.runtime.logger import StreamStandIn

__all__ = ["quiet_when_closed"]


class _QuietWhenClosed(StreamStandIn):
    """Stands in for sys.stdout: writes through to it until its reader is gone, then
    sends what is written to /dev/null."""

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        # The stream's own descriptor now leads nowhere: its buffered text, flushed at
        # exit, and child processes started later write there without an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)


def quiet_when_closed() -> None:
    """Makes sys.stdout end its output quietly when its reader closes it (see above)."""
    if not isinstance(sys.stdout, _QuietWhenClosed) and sys.stdout is not None:
        sys.stdout = _QuietWhenClosed(sys.stdout)
