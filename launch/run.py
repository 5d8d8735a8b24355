"""``moolib-run``: the Hydra app that composes an agent, an env and a scaling mode.

    moolib-run agent=vtrace env=breakout
    moolib-run agent=a2c env=cartpole scaling=local scaling.peers=2
    moolib-run -m agent.optimizer.learning_rate=6e-4,3e-4
    moolib-run agent=vtrace env=breakout scaling=slurm scaling.peers=8
    moolib-run savedir=outputs/my-run            # resumes my-run with its own settings

Before Hydra starts anything, every job of the command line is planned and
checked (``preflight.py``): a mistake stops the run with one ``moolib-run:
error: ...`` line, exit 2, and no folder left behind. A savedir that holds a
``config.yaml`` owns its config: the run resumes with it, the command line's
overrides applied on top (``resume.py``); a finished one says so and exits 0.
The final config is written to ``<savedir>/config.yaml``; peers read it from
there. Ctrl-C stops after a last checkpoint (exit 130); a second one at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from moolib.conf.schema.scaling import scaling_spec
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from . import config as config_lib
from . import output, preflight, report, savedir_lock
from . import resume as resume_lib
from .config import ConfigError, RunConfig
from .peer import stop_on_signals

log = logging.getLogger("moolib.launch")

# Set once the pre-flight checked every job (the task function then skips the probes).
_checked = False
# Set when Hydra hands over to the task function: errors after that are not Hydra's.
_in_task = False
# Group choices of the savedir's run (``agent=apex``) appended to Hydra's command line, so
# that overrides of keys only that agent or env has compose there too; the task function
# takes them off again (the resume asked for no other group).
_saved_choices: list[str] = []
# Set instead when a sweep's savedirs hold runs of different choices (one command line
# cannot carry them all): named if Hydra then cannot compose an override.
_mixed_choices: list[str] = []
# Set by a Ctrl-C before the run started (see _interrupt_preflight).
_interrupted = False


def _hydra_setup() -> Any:
    """Hydra's compose API set up on moolib's configs (a context manager)."""
    from hydra import initialize_config_module

    return initialize_config_module(config_module="moolib.conf", version_base="1.3")


def _or_default(value: object, default: object) -> object:
    return default if value is None else value


def _folder_name(name: object) -> str:
    # A gym id's namespace (env.id=ALE/Pong-v5) or a name=team/run would
    # otherwise nest the default savedir one folder deeper than moolib-plot
    # and the resume look for it.
    return str(name).replace("/", "-")


def _fail(message: str) -> NoReturn:
    print(f"moolib-run: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


@report.with_summary
def _run(cfg: DictConfig) -> int:
    global _in_task
    _in_task = True
    hydra_cfg = HydraConfig.get()
    savedir = Path(hydra_cfg.runtime.output_dir)
    try:
        lines = list(hydra_cfg.overrides.task)
        if _saved_choices and lines[-len(_saved_choices) :] == _saved_choices:
            lines = lines[: -len(_saved_choices)]
        job = preflight.plan(lines, savedir)
        if job.resume is not None and job.resume.finished:
            print(job.resume.finished_message(), flush=True)
            return 0
        final = config_lib.prepare(job.config, savedir)
        if not _checked:
            preflight.check_fits(job, final)
            preflight.check_can_start(job, final)
        elif job.resume is not None:
            # A savedir the pre-flight could not name (an interpolated savedir=).
            preflight.check_fits(job, final)
        lock = savedir_lock.SavedirLock.acquire(savedir)
    except ConfigError as e:
        _fail(str(e))
    try:
        return _start(job, final, savedir)
    finally:
        lock.release()


def _interrupt_preflight(signum: int, frame: Any) -> None:
    """Ctrl-C before the run starts: stops it at once, and is remembered, because a
    library may swallow the KeyboardInterrupt (minatar's import catches everything)."""
    global _interrupted
    _interrupted = True
    raise KeyboardInterrupt


def _start(job: preflight.Job, final: RunConfig, savedir: Path) -> int:
    """Runs a planned, checked job in its savedir (held): prints what it resumes,
    saves the config and trains in its scaling mode."""
    for note in preflight.notes(job, final):
        print(f"moolib-run: note: {note}", flush=True)
    if job.resume is not None:
        print(job.resume.describe(), flush=True)
        resume_lib.record(job.resume)
    config_path = config_lib.save(final, savedir)
    stop = stop_on_signals()
    if _interrupted:
        raise KeyboardInterrupt
    code = scaling_spec(final.scaling.name).start(final, config_path, stop)
    if stop.is_set():
        # Stopped before total_steps (after its last checkpoint, or by cancelling
        # SLURM jobs): say so in the exit status, and end a sweep here rather than
        # starting its next point.
        sys.exit(stop.exit_code)
    if code:
        sys.exit(code)
    return 0


def _preflight(args: argparse.Namespace) -> int | None:
    """Plans and checks every job of the command line before Hydra creates anything.
    Returns an exit status when there is nothing to run, else None."""
    global _checked, _saved_choices, _mixed_choices
    with _hydra_setup():
        overrides = preflight.parse_overrides(args.overrides)
        multirun = bool(args.multirun)
        jobs = preflight.expand(overrides, multirun)
        root = preflight.savedir_of(overrides)
        if root is not None and "${" not in root:
            preflight.check_not_a_sweep(Path(root), multirun)
        planned = [
            preflight.plan(lines, job_num=n, multirun=multirun) for n, lines in enumerate(jobs)
        ]
        # One command line for every job: the choices go in only when all jobs share them.
        if all(job.choices == planned[0].choices for job in planned):
            _saved_choices = planned[0].choices
        else:
            shared = set.intersection(*(set(job.choices) for job in planned))
            _mixed_choices = sorted({c for job in planned for c in job.choices} - shared)
        if args.cfg:
            if args.cfg == "job" and not multirun and planned[0].resume is not None:
                print(preflight.config_for_display(planned[0]), end="")
                return 0
            return None  # Hydra prints it
        checked = []
        for job in planned:
            cfg = config_lib.validate(job.config)
            preflight.check_fits(job, cfg)
            checked.append(cfg)
        if not multirun and planned[0].resume is not None and planned[0].resume.finished:
            print(planned[0].resume.finished_message(), flush=True)
            return 0
        for job, cfg in zip(planned, checked, strict=True):
            if job.resume is None or not job.resume.finished:
                preflight.check_can_start(job, cfg)
    _checked = True
    return None


def main() -> None:
    """Console entry point: checks the command line, then lets Hydra run it."""
    output.quiet_when_closed()
    for resolver, fn in (("or_default", _or_default), ("folder_name", _folder_name)):
        if not OmegaConf.has_resolver(resolver):
            OmegaConf.register_new_resolver(resolver, fn)
    report.register_resolvers()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(sys.argv[1:])
    hydra_only = (
        args.help
        or args.hydra_help
        or args.info
        or args.shell_completion
        or args.config_path
        or args.config_dir
        or args.config_name
        or args.experimental_rerun
    )
    full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    signal.signal(signal.SIGINT, _interrupt_preflight)
    try:
        if not hydra_only:
            code = _preflight(args)
            if code is not None:
                sys.exit(code)
        # Hydra's errors reach us as exceptions (made one line below), not printed by
        # Hydra over several lines with exit 1.
        os.environ["HYDRA_FULL_ERROR"] = "1"
        sys.argv += _saved_choices
        app = hydra.main(config_path="pkg://moolib.conf", config_name="config", version_base="1.3")
        app(_run)()
    except ConfigError as e:
        _fail(str(e))
    except (hydra.errors.HydraException, OmegaConfBaseException) as e:
        if _in_task or full_error:
            raise
        from hydra.core.global_hydra import GlobalHydra

        # Naming the nearest key composes the config again, which needs Hydra set up.
        GlobalHydra.instance().clear()
        with _hydra_setup():
            message = preflight.hydra_message(e, list(args.overrides))
        if _mixed_choices:
            message += (
                f" (the savedirs of this sweep hold runs of {', '.join(_mixed_choices)}: "
                "resume them one at a time to set a key only some of them have)"
            )
        _fail(message)
    except KeyboardInterrupt:
        print("moolib-run: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
