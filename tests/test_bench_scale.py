"""bench/scale.py at its smallest: 4 light peers on one host (no Accumulator rows, so no
torch import in the peers; a short group timeout, so the kill costs seconds). Checks
that every phase ran, the table parses back and the raw results hold the figures.
Nothing here asserts speed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from types import ModuleType

import pytest
from helpers.util import REPO, child_env

BENCH = REPO / "bench" / "scale.py"


@pytest.fixture(scope="module")
def scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_scale", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_scale"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_four_light_peers_on_one_host(scale: ModuleType, tmp_path) -> None:
    raw = tmp_path / "scale.json"
    cmd = [sys.executable, str(BENCH), "--peers", "4", "--layout", "shm", "--quick"]
    cmd += ["--acc-max", "0", "--group-timeout", "3", "--json", str(raw)]
    cmd += ["--log", str(tmp_path / "peers.log")]
    proc = subprocess.run(
        cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=400
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    (row,) = scale.parse_table(out)
    assert (row["layout"], row["N"]) == ("shm", "4"), row
    join, lone = row["join s (lone)"].rstrip(")").split(" (")
    assert float(join) > 0 and float(lone) > 0, row
    assert float(row["ar 16 B ms"]) > 0, row
    for column in ("ar 1 MiB ms (ring; machine)", "ar 6 MiB ms (ring; machine)"):
        measured, bounds = row[column].rstrip(")").split(" (")
        ring, machine = bounds.split("; ")
        assert float(measured) > 0 and 0 <= float(ring) <= float(machine), row
    assert row["kill: next step s (timeout)"].endswith("(3)"), row
    assert row["steps/s tiny (1/ar16B)"].startswith("-"), row  # --acc-max 0: not run

    results = json.loads(raw.read_text())
    (r,) = results["results"]
    assert r["errors"] == [], r["errors"]
    assert sorted(int(k) for k in r["reduce"]) == list(scale.SIZES), r["reduce"]
    for figures in r["reduce"].values():
        assert figures["median_s"] > 0, figures
        assert 0 < figures["bound_s"] <= figures["machine_bound_s"], figures
    # The three survivors stepped together again without the killed member.
    assert r["kill"]["next_step_s"] > 0, r["kill"]
    assert r["light"]["fds"]["max"] > 0 and r["light"]["threads"]["max"] > 0, r["light"]
    assert r["acc"] == {"skipped": "N > --acc-max 0 (torch peers' memory)"}
    assert results["settings"]["bandwidth_Bps"]["shm"] > 0
    assert results["settings"]["commit"].rstrip("+"), results["settings"]  # what was measured


def test_bad_arguments_are_refused_precisely() -> None:
    for args, message in (
        (["--peers", "4,x"], "--peers '4,x'"),
        (["--peers", "1"], "at least 2 peers"),
        (["--layout", "tcp"], "layouts are shm and netns"),
    ):
        proc = subprocess.run(
            [sys.executable, str(BENCH), *args],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)
