"""A script run in a fresh interpreter with moolib, torch and ``check`` imported, for
tests of the whole process around live Rpcs: it must exit on its own, with code 0."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

from helpers.util import run_script

PRELUDE = textwrap.dedent(
    """
    import faulthandler, gc, os, subprocess, sys, threading, time
    faulthandler.dump_traceback_later(90, exit=True)  # a hang shows its stacks
    import multiprocessing as mp
    import torch
    import moolib

    def check(cond, what):
        if not cond:
            print("CHECK FAILED:", what, flush=True)
            os._exit(17)
    """
)


def run(tmp_path: Path, body: str, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``body`` (indented as in the test) after ``PRELUDE``; ``kwargs`` go to
    ``run_script`` (``env``, ``timeout``)."""
    return run_script(PRELUDE + textwrap.dedent(body), tmp_path, **kwargs)
