"""Where a run's numbers go: logs.tsv, the terminal and (optionally) wandb."""

from __future__ import annotations

import collections
import csv
import io
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

from moolib._extras import import_extra

if TYPE_CHECKING:
    from moolib.conf.schema.run_config import RunConfig

# The columns an evaluation during training fills (eval_interval; see
# runtime.evaluation.PeriodicEval): the step of the weights evaluated, the episodes'
# mean return, its spread and their mean length. Every run's logs.tsv has them, empty
# in the rows without one, so that its header is the same whatever the settings (and
# a resumed run's rows stay aligned with it).
EVAL_COLUMNS = (
    "eval_step",
    "eval_mean_episode_return",
    "eval_episode_return_std",
    "eval_mean_episode_length",
)

# Columns of logs.tsv, in order. A resumed run appends to the same file.
COLUMNS = (
    "step",
    "sps",
    "env_sps",
    "mean_episode_return",
    "mean_episode_length",
    "episodes",
    "total_loss",
    "policy_loss",
    "baseline_loss",
    "entropy_loss",
    "grad_norm",
    "learning_rate",
    "virtual_batch_size",
    "num_gradients",
    "model_version",
    "actor_model_version",
    "param_sum",
    "peers",
    "env_steps",
    "offered_steps",
    *EVAL_COLUMNS,
    "time",
)


class TsvLog:
    """Appends one row per log interval to ``path`` (header written once) with
    ``columns`` (``COLUMNS``, the on-policy runs' columns, by default). A file that
    already has a header (a resumed run) keeps its columns: rows written by a
    version of moolib with other columns stay aligned with it."""

    def __init__(self, path: Path, columns: tuple[str, ...] = COLUMNS) -> None:
        self.path = Path(path)
        self.columns = tuple(columns)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        if not fresh:
            with open(self.path, newline="") as f:
                header = f.readline().rstrip("\n").split("\t")
            if all(header):
                self.columns = tuple(header)
        self._file = open(self.path, "a", newline="")  # noqa: SIM115 - closed in close()
        self._writer = csv.writer(self._file, delimiter="\t", lineterminator="\n")
        if fresh:
            self._writer.writerow(self.columns)
            self._file.flush()

        self._failing = WriteFailures(self.path)

    def write(self, row: dict[str, Any]) -> None:
        """Writes ``row`` (missing columns stay empty) and flushes it. A row that cannot be
        written (full disk, I/O error) is lost and training goes on: the failure is
        reported once, until a write succeeds again."""
        try:
            self._writer.writerow([_cell(row.get(c)) for c in self.columns])
            self._file.flush()
        except OSError as e:
            self._failing.failed(e)
        else:
            self._failing.succeeded()

    def close(self) -> None:
        try:
            self._file.close()
        except OSError as e:
            self._failing.failed(e)


class WriteFailures:
    """Reports the failed writes of a log file once per run of failures, not per row: a
    full disk must neither end training nor flood the terminal."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.failing = False

    def failed(self, e: OSError) -> None:
        """A write failed with ``e``: logged unless the previous one failed too."""
        if not self.failing:
            self.failing = True
            logging.getLogger("moolib.agents").error(
                "cannot write %s: %s; training goes on, its lines are lost until it can be "
                "written again",
                self.path,
                e.strerror or e,
            )

    def succeeded(self) -> None:
        """A write succeeded: logged when it ends a run of failures."""
        if self.failing:
            self.failing = False
            logging.getLogger("moolib.agents").info("%s can be written again", self.path)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.10g}"
    return str(value)


def _short(value: Any) -> str:
    return "-" if value is None or _is_nan(value) else f"{value:.4g}"


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def format_duration(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``; ``?`` for a negative or unknown duration."""
    return _duration(seconds)


def finite_number(value: Any) -> float | None:
    """``value`` as a float when it is a finite number, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


class StreamStandIn(io.TextIOBase):
    """A text stream that stands in for ``stream`` (sys.stdout, say): what a subclass does
    not write itself, it asks of ``stream``."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _AboveProgress(StreamStandIn):
    """Stands in for sys.stdout/sys.stderr (and the logging handlers writing to them) while a
    progress line is drawn: text written through it first erases the line, which is drawn
    again under the text once the text ends its line -- log lines never glue onto it."""

    def __init__(self, progress: Progress, stream: TextIO) -> None:
        super().__init__(stream)
        self._progress = progress

    def write(self, text: str) -> int:
        if not text:
            return 0
        with self._progress._lock:
            self._progress._erase()
            n = self._stream.write(text)
            self._stream.flush()
            self._progress._pending = not text.endswith("\n")
            if not self._progress._pending:
                self._progress._draw()
        return n

    def flush(self) -> None:
        self._stream.flush()


def guard_log_handlers() -> None:
    """Makes the logging handlers that write to files or streams (Hydra's ``run.log``, a
    peer's redirected output) report a failing write once, instead of a traceback per
    record: a full disk must neither end training nor flood the terminal."""
    loggers = [logging.getLogger(), logging.getLogger("moolib.agents")]
    for handler in [h for lg in loggers for h in lg.handlers]:
        if isinstance(handler, logging.StreamHandler) and not getattr(
            handler, "_moolib_guarded", False
        ):
            handler._moolib_guarded = True  # type: ignore[attr-defined]
            handler.handleError = _report_once(handler)  # type: ignore[method-assign]


def _report_once(handler: logging.StreamHandler) -> Any:
    reported = False

    def handle_error(record: logging.LogRecord) -> None:
        nonlocal reported
        if reported:
            return
        reported = True
        name = getattr(handler, "baseFilename", None) or getattr(handler.stream, "name", "?")
        err = sys.exc_info()[1]
        why = getattr(err, "strerror", None) or err
        try:
            sys.__stderr__.write(
                f"moolib-run: cannot write the log {name}: {why}; "
                "training goes on, its lines are lost\n"
            )
            sys.__stderr__.flush()
        except (OSError, ValueError, AttributeError):
            pass

    return handle_error


class Progress:
    """The status line of a peer: steps, learned SPS, mean return, loss and ETA.

    On a terminal the line is redrawn in place and anything else the process writes through
    Python (print, logging, warnings) while it is shown is written above it (see ``start``);
    elsewhere (a log file, a pipe) it is printed as a plain line per log interval. Every line
    also goes, time-stamped, into ``log_path`` when one is given (each peer's
    ``<logdir>/progress.log``), so that the terminal's record outlives the terminal.

    SPS is over the last few log intervals. Until the learner has learned from any step it
    shows the env steps per second the actors make instead ("warming up"); at the end the
    ETA is 0:00.
    """

    # Log rows the SPS and ETA average over.
    WINDOW = 4
    # What a terminal too narrow for the whole line leaves out, in this order: the loss,
    # then the total steps (the percentage and the ETA say how far), the SPS, the return,
    # the note. The step, its percentage and the ETA always show.
    FIT_DROPS = ("loss", "total", "rate", "return", "note")

    def __init__(
        self,
        total_steps: int,
        prefix: str = "",
        stream: Any = None,
        log_path: Path | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.prefix = prefix
        self.stream = stream or sys.stdout
        self.live = _isatty(self.stream)
        self._text = ""  # the line as last drawn
        self._shown = False  # whether the line is on the screen now
        self._pending = False  # text written above it that has not ended its line yet
        self._lock = threading.RLock()
        self._rows: collections.deque[tuple[float, float, float]] = collections.deque(
            maxlen=self.WINDOW + 1
        )
        self._first_step: float | None = None
        self._return: float | None = None
        self._loss: float | None = None  # the last ones logged: an interval may have none
        self._saved: list[tuple[Any, Any]] = []
        self._log = None
        self._stream_failing: WriteFailures | None = None
        if log_path is not None:
            log_path = Path(log_path)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            self._log_failing = WriteFailures(log_path)

    # -- what the line says ---------------------------------------------------------------

    def _parts(self, row: dict[str, Any], note: str = "") -> dict[str, str]:
        """The parts of the line for one log row (see ``_render``), which joins the window
        that the SPS is taken over; ``note`` goes before the ETA."""
        step = float(row["step"])
        now = finite_number(row.get("time"))
        if self._first_step is None:
            self._first_step = step
        if now is not None:
            acted = (finite_number(row.get("env_sps")) or 0.0) * self._since_last(now)
            self._rows.append((now, step, acted))
        ret = finite_number(row.get("mean_episode_return"))
        if ret is not None:
            self._return = ret
        learned_sps, env_sps = self._rates(row)
        done = step >= self.total_steps
        percent = 100.0 if done else 100.0 * step / max(1, self.total_steps)
        if learned_sps > 0 or done:
            rate = f"SPS {learned_sps:,.0f}"
        else:
            # Nothing learned over the window: say what the actors do instead of "SPS 0".
            state = "warming up" if step == self._first_step else "learner waiting"
            rate = f"{state}: acting {env_sps:,.0f} env steps/s"
        loss = finite_number(row.get("total_loss"))
        if loss is not None:
            self._loss = loss
        if done:
            eta = 0.0
        elif learned_sps > 0:
            eta = (self.total_steps - step) / learned_sps
        else:
            eta = math.inf
        return {
            "step": f"step {int(step):,}",
            "total": f"/{self.total_steps:,}",
            "percent": f" ({percent:.1f}%)",
            "rate": rate,
            "return": f"return {'-' if self._return is None else f'{self._return:.2f}'}",
            "loss": f"loss {_short(self._loss)}",
            "note": note,
            "eta": f"ETA {_duration(eta)}",
        }

    def _render(self, parts: dict[str, str], dropped: tuple[str, ...] = ()) -> str:
        """The line of ``parts`` without those ``dropped``."""
        step = parts["step"] + ("" if "total" in dropped else parts["total"]) + parts["percent"]
        shown = [
            parts[k] for k in ("rate", "return", "loss", "note") if parts[k] and k not in dropped
        ]
        return self.prefix + "  ".join([step, *shown, parts["eta"]])

    def _since_last(self, now: float) -> float:
        return max(0.0, now - self._rows[-1][0]) if self._rows else 0.0

    def _rates(self, row: dict[str, Any]) -> tuple[float, float]:
        """(learned, acted) env steps per second over the window; the row's own numbers
        while the window holds a single row."""
        if len(self._rows) >= 2:
            (t0, s0, _), (t1, s1, _) = self._rows[0], self._rows[-1]
            if t1 - t0 > 0:
                acted = sum(a for _, _, a in list(self._rows)[1:])
                return max(0.0, (s1 - s0) / (t1 - t0)), acted / (t1 - t0)
        return finite_number(row.get("sps")) or 0.0, finite_number(row.get("env_sps")) or 0.0

    # -- drawing ---------------------------------------------------------------------------

    def start(self, time: float, step: float) -> None:
        """Starts the line at ``step`` at ``time`` (the clock the rows' ``time`` is on), so
        that the first row's SPS covers the run up to it: a run that ends within its first
        log interval still shows how fast it went. On a terminal, also routes sys.stdout,
        sys.stderr and the logging handlers writing to them through the line (text goes
        above it) until ``close``."""
        if not self._rows:
            self._rows.append((time, step, 0.0))
        if not self.live or self._saved:
            return
        originals = {id(sys.stdout): sys.stdout, id(sys.stderr): sys.stderr}
        guards = {key: _AboveProgress(self, stream) for key, stream in originals.items()}
        self._saved.append((sys, ("stdout", sys.stdout)))
        self._saved.append((sys, ("stderr", sys.stderr)))
        sys.stdout = guards[id(sys.stdout)]
        sys.stderr = guards[id(sys.stderr)]
        for handler in _stream_handlers():
            guard = guards.get(id(handler.stream))
            if guard is not None:
                self._saved.append((handler, handler.stream))
                handler.setStream(guard)  # type: ignore[arg-type]

    def update(self, row: dict[str, Any], note: str = "") -> None:
        """Shows the numbers of one log row, and ``note`` (what the peer waits for, say)."""
        parts = self._parts(row, note)
        text = self._render(parts)
        self._record(text)
        with self._lock:
            if self.live:
                self._text = self._fit(parts)
                if self._pending:
                    # Someone left a line unfinished: start the progress line below it.
                    self.stream.write("\n")
                    self._pending = False
                self._erase()
                self._draw()
            else:
                try:
                    self.stream.write(text + "\n")
                    self.stream.flush()
                except OSError as e:
                    # A peer's output redirected to a full disk: the line is in progress.log.
                    if self._stream_failing is None:
                        self._stream_failing = WriteFailures(
                            Path(getattr(self.stream, "name", "stdout"))
                        )
                    self._stream_failing.failed(e)

    def record(self, text: str) -> None:
        """Keeps ``text`` in the log file only (e.g. the start banner, already printed)."""
        self._record(text)

    def close(self) -> None:
        """Ends the line (it stays on screen), restores the streams, closes the log file."""
        with self._lock:
            if self.live and self._shown:
                self.stream.write("\n")
                self.stream.flush()
            self._shown = False
            self._text = ""
        for owner, saved in reversed(self._saved):
            if owner is sys:
                setattr(sys, saved[0], saved[1])
            else:
                owner.setStream(saved)
        self._saved.clear()
        if self._log is not None:
            try:
                self._log.close()
            except OSError as e:
                self._log_failing.failed(e)
            self._log = None

    def _record(self, text: str) -> None:
        if self._log is None:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        try:
            for line in text.rstrip("\n").splitlines() or [""]:
                self._log.write(f"{stamp}  {line}\n")
            self._log.flush()
        except OSError as e:
            self._log_failing.failed(e)
        else:
            self._log_failing.succeeded()

    def _fit(self, parts: dict[str, str]) -> str:
        """The line of ``parts`` within the terminal's width (a wrapped line could not be
        redrawn): the parts that matter least are left out first (``FIT_DROPS``), and only
        a line still too wide is cut. A terminal of width 0 (a pseudo-terminal whose size
        was never set) sets no limit."""
        text = self._render(parts)
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
            return text
        if columns <= 0:
            return text
        # The last column stays free: a line that fills it wraps on some terminals.
        for n in range(len(self.FIT_DROPS) + 1):
            text = self._render(parts, self.FIT_DROPS[:n])
            if len(text) < columns:
                return text
        return text[: max(1, columns - 2)] + "…"

    def _erase(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * len(self._text) + "\r")
            self.stream.flush()
            self._shown = False

    def _draw(self) -> None:
        if self.live and self._text and not self._shown:
            self.stream.write("\r" + self._text)
            self.stream.flush()
            self._shown = True


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _stream_handlers() -> list[logging.StreamHandler]:
    """The logging handlers that write to a stream: the root logger's and every logger's."""
    loggers = [logging.getLogger()]
    loggers += [
        lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)
    ]
    return [
        h
        for lg in loggers
        for h in lg.handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]


def start_banner(
    cfg: RunConfig,
    *,
    rank: int,
    device: Any,
    savedir: Path,
    broker: str,
    env_detail: str = "",
    peers: int | None = None,
) -> str:
    """The block a peer prints when it starts: agent, env, device, peers, savedir, broker.
    ``peers``: how many it says the run has (default: ``scaling.peers``)."""
    peers = cfg.scaling.peers if peers is None else peers
    who = f", peer {rank} of {peers}" if peers > 1 else ""
    env = f"{cfg.env.name}{f' ({env_detail})' if env_detail else ''}"
    device_text = str(device)
    if getattr(device, "type", None) == "cuda":
        import torch

        device_text += f" ({torch.cuda.get_device_name(device)})"
    origin = "given by broker=" if cfg.broker else "started by moolib-run"
    lines = [
        f"moolib-run: {cfg.agent.name} on {env}{who}",
        f"  device   {device_text}",
        f"  scaling  {cfg.scaling.name}, {peers} peer{'s' if peers != 1 else ''}; "
        f"group {cfg.group}",
        f"  broker   {broker} ({origin})",
        f"  savedir  {savedir}",
        f"  steps    {cfg.total_steps:,}; a log row every {cfg.log_interval:g} s, "
        f"a checkpoint every {cfg.checkpoint_interval:g} s",
    ]
    return "\n".join(lines)


class Wandb:
    """A wandb run for this peer: project, group (one per experiment) and name;
    offline when there is no login. ``run_id`` continues an earlier run."""

    def __init__(
        self,
        *,
        project: str,
        group: str,
        name: str,
        config: dict,
        savedir: Path,
        run_id: str | None,
        mode: str | None,
    ) -> None:
        wandb = import_wandb()
        if mode in (None, "auto"):
            mode = "online" if _wandb_logged_in() else "offline"
        self.run = wandb.init(
            project=project,
            group=group,
            name=name,
            id=run_id,
            resume="allow",
            config=config,
            dir=str(savedir),
            mode=mode,
            reinit="finish_previous",
        )
        self.run_id = self.run.id

    @classmethod
    def for_run(cls, cfg: RunConfig, name: str, logdir: Path, run_id: str | None) -> Wandb | None:
        """The wandb run of a process of moolib-run's run ``cfg`` (None when ``cfg.wandb`` is
        off): in the run's project and group, named ``name``, continuing ``run_id``."""
        if not cfg.wandb.enabled:
            return None
        return cls(
            project=cfg.wandb.project,
            group=cfg.group,
            name=name,
            config=cfg.to_dict(),
            savedir=logdir,
            run_id=run_id,
            mode=cfg.wandb.mode,
        )

    def log(self, row: dict[str, Any]) -> None:
        values = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not _is_nan(v)}
        self.run.log(values, step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


def _is_nan(v: float) -> bool:
    return isinstance(v, float) and math.isnan(v)


def import_wandb() -> ModuleType:
    """The wandb module, or MissingExtraError naming the extra (``moolib[wandb]``)."""
    return import_extra("wandb", "wandb", "wandb.enabled=true")


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


class EpisodeStats:
    """Returns and lengths of the episodes finished since the last ``take``."""

    def __init__(self) -> None:
        self.returns: list[float] = []
        self.lengths: list[int] = []

    def add(self, returns: Iterable[float], lengths: Iterable[int]) -> None:
        self.returns.extend(returns)
        self.lengths.extend(lengths)

    def __len__(self) -> int:
        """The episodes finished since the last ``take``."""
        return len(self.returns)

    def take(self) -> dict[str, Any]:
        n = len(self.returns)
        out = {
            "episodes": n,
            "mean_episode_return": sum(self.returns) / n if n else math.nan,
            "mean_episode_length": sum(self.lengths) / n if n else math.nan,
        }
        self.returns, self.lengths = [], []
        return out


class Clock:
    """Seconds since the run (or its first incarnation) started."""

    def __init__(self, offset: float = 0.0) -> None:
        self.start = time.monotonic() - offset

    def __call__(self) -> float:
        return time.monotonic() - self.start
