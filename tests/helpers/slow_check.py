"""Keeps the ``slow`` marker true: a pytest plugin that names every test which ran
longer than ``slow_after`` seconds (pyproject.toml) without being marked slow.

``-m "not slow"`` is the quick loop while developing; CI runs every test within its
budget (``.ci/run``). A test that grew long without the marker would quietly make
the quick loop slow and hide where CI's time goes: the end of each run lists it.
Reported, not failed: how long a test takes depends on the machine's load.
"""

from __future__ import annotations

import pytest

_long: list[tuple[float, str]] = []
_limit = 90.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "slow_after",
        "seconds after which a test not marked slow is named at the end of the run",
        default="90",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "slow: takes minutes on 2 cores (an agent learning, a soak, SLURM requeues); "
        '-m "not slow" leaves it out of a quick run',
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    global _limit
    _limit = float(session.config.getini("slow_after"))
    _long.clear()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # On the controller this sees every worker's reports (pytest-xdist).
    if report.when == "call" and "slow" not in report.keywords and report.duration > _limit:
        _long.append((report.duration, report.nodeid))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _long:
        return
    terminalreporter.section(f"tests over {_limit:g} s not marked slow")
    for seconds, nodeid in sorted(_long, reverse=True):
        terminalreporter.write_line(f"{seconds:6.0f} s  {nodeid}")
    terminalreporter.write_line(
        "mark them @pytest.mark.slow, or make them shorter (the README's Test section)"
    )
