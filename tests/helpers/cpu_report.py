"""Where the suite's CPU goes: a pytest plugin that writes each test's CPU seconds.

Loaded by tests/conftest.py; with ``MOOLIB_TEST_CPU_REPORT=FILE`` in the environment, pytest
appends one JSON line per test to FILE: the wall seconds and the CPU seconds of
the pytest process (its threads: in-process Rpcs) and of the child processes it
reaped meanwhile (peers, brokers, moolib-run and every process they reaped in
turn). Processes not reaped by the test (SLURM's jobs, run by slurmd) are not
counted. The suite runs on 2 cores in CI, where CPU, not wall time, is what the
files share: ``python tests/helpers/cpu_report.py FILE`` sums it per file.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest


def _cpu() -> tuple[float, float]:
    """CPU seconds of this process and of its reaped children."""
    t = os.times()
    return t.user + t.system, t.children_user + t.children_system


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("MOOLIB_TEST_CPU_REPORT")
    if not path:
        yield
        return
    wall, (own, children) = time.monotonic(), _cpu()
    yield
    after = _cpu()
    row = {
        "test": item.nodeid,
        "wall": round(time.monotonic() - wall, 2),
        "own": round(after[0] - own, 2),
        "children": round(after[1] - children, 2),
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def summarize(path: str, top: int = 40) -> str:
    """Per test file: wall and CPU seconds, most CPU first."""
    wall: dict[str, float] = collections.Counter()
    cpu: dict[str, float] = collections.Counter()
    for line in open(path):
        row = json.loads(line)
        name = row["test"].split("::")[0]
        wall[name] += row["wall"]
        cpu[name] += row["own"] + row["children"]
    lines = [f"{'cpu s':>8} {'wall s':>8}  file"]
    for name, seconds in sorted(cpu.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{seconds:8.0f} {wall[name]:8.0f}  {name}")
    lines.append(f"{sum(cpu.values()):8.0f} {sum(wall.values()):8.0f}  in all")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
