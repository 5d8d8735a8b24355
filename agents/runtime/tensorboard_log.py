"""A run's log rows as TensorBoard event files (``tensorboard.enabled=true``): the numbers
of logs.tsv's columns, against the env steps, written beside logs.tsv, so that
``tensorboard --logdir SAVEDIR`` shows each process that writes a logs.tsv as a run."""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from moolib._extras import import_extra

from .logger import WriteFailures, finite_number

if TYPE_CHECKING:
    from moolib.conf.schema.run_config import RunConfig

# How TensorBoard names its event files (events.out.tfevents.<time>.<host>.<pid>.<n>).
EVENT_FILES = "events.out.tfevents.*"


def import_tensorboard() -> ModuleType:
    """torch's writer of TensorBoard event files (``torch.utils.tensorboard``), or
    MissingExtraError naming the extra that installs TensorBoard (``moolib[tensorboard]``)."""
    # torch's module imports the tensorboard package, which is the extra: import it first,
    # so that its absence is named rather than raised from inside torch.
    import_extra("tensorboard", "tensorboard", "tensorboard.enabled=true")
    from torch.utils import tensorboard

    return tensorboard


class TensorBoardLog:
    """Writes a process's log rows into an event file of its own in ``logdir``: a scalar
    per column of ``columns`` that holds a finite number (``step``, the axis, aside), at
    the row's ``step``. ``resumed_at``: the step of the checkpoint a resumed run goes on
    from (0 for a fresh one). An event file that cannot be written (a full disk) is
    reported once and training goes on, as with logs.tsv; TensorBoard's writer stops
    for good at its first failed write, and so does this process's record in it (its
    rows go on in logs.tsv)."""

    def __init__(self, logdir: Path, columns: tuple[str, ...], resumed_at: int = 0) -> None:
        tensorboard = import_tensorboard()
        self.logdir = Path(logdir)
        self.tags = tuple(c for c in columns if c != "step")
        self._failing = WriteFailures(self.logdir / EVENT_FILES)
        # Rows that a run logged past its last checkpoint (it was killed) are of steps
        # its resume goes over again: TensorBoard hides the earlier files' events from
        # that step on (logs.tsv keeps them). A clean stop logged nothing past it.
        purge_step = resumed_at + 1 if resumed_at else None
        self._writer: Any = tensorboard.SummaryWriter(str(self.logdir), purge_step=purge_step)

    @classmethod
    def for_run(
        cls, cfg: RunConfig, logdir: Path, columns: tuple[str, ...], resumed_at: int
    ) -> TensorBoardLog | None:
        """The event file of a process of moolib-run's run ``cfg`` (None when
        ``cfg.tensorboard`` is off), as ``TensorBoardLog`` takes its arguments."""
        if not cfg.tensorboard.enabled:
            return None
        return cls(logdir, columns, resumed_at)

    def write(self, row: dict[str, Any]) -> None:
        """Writes the numbers of ``row`` at its step and flushes them: a TensorBoard
        watching the run sees each row when logs.tsv does."""
        if self._writer is None:
            return
        step = int(row["step"])
        try:
            for tag in self.tags:
                value = finite_number(row.get(tag))
                if value is not None:
                    self._writer.add_scalar(tag, value, step)
            self._writer.flush()
        except OSError as e:
            self._failing.failed(e)
            writer, self._writer = self._writer, None
            with contextlib.suppress(OSError):
                writer.close()

    def close(self) -> None:
        """Flushes the rows written and closes the event file."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except OSError as e:
            self._failing.failed(e)
