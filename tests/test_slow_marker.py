"""The suite's own bookkeeping (tests/helpers/slow_check.py): a long test without the
slow marker is named at the end of the run, a marked one is not, and
``-m "not slow"`` leaves the marked ones out."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from helpers.util import REPO

TESTS = textwrap.dedent(
    """
    import time

    import pytest


    def test_long_and_unmarked():
        time.sleep(0.6)


    @pytest.mark.slow
    def test_long_and_marked():
        time.sleep(0.6)


    def test_quick():
        pass
    """
)


def run_pytest(tmp_path, *args: str) -> str:
    (tmp_path / "test_sample.py").write_text(TESTS)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "helpers.slow_check", "--strict-markers"]
        + ["-o", "slow_after=0.3", "-p", "no:cacheprovider", *args, "test_sample.py"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(REPO / "tests"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout + out.stderr


def test_a_long_test_without_the_marker_is_named(tmp_path):
    out = run_pytest(tmp_path)
    assert "3 passed" in out, out
    section = out.partition("tests over 0.3 s not marked slow")[2]
    assert "test_sample.py::test_long_and_unmarked" in section, out
    assert "test_long_and_marked" not in section and "test_quick" not in section, out


def test_not_slow_leaves_the_marked_tests_out(tmp_path):
    out = run_pytest(tmp_path, "-m", "not slow", "-v")
    assert "2 passed, 1 deselected" in out, out
    assert "test_long_and_marked" not in out.partition("tests over")[0], out
