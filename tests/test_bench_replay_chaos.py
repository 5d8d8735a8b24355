"""bench/replay_chaos.py at a size the suite affords: two shards, two clients, a
few kills. What it checks about the items must hold; its recovery times are
printed but not asserted (they measure the machine's load)."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.util import REPO, child_env

BENCH = REPO / "bench" / "replay_chaos.py"


def test_shards_killed_and_restored_lose_only_what_their_checkpoint_missed(tmp_path) -> None:
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--shards",
            "2",
            "--clients",
            "2",
            "--duration",
            "16",
            "--reference",
            "0",
            "--fault-every",
            "2:3",
            "--down",
            "0.2:0.5",
            "--quiet",
            "4",
            "--checkpoint-every",
            "1",
            "--seed",
            "1",
            "--json",
            str(report),
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert report.exists(), proc.stdout + proc.stderr
    got = json.loads(report.read_text())
    assert got["faults"] >= 1, proc.stdout
    assert got["items_pass"], proc.stdout
    checks = got["checks"]
    assert checks["sampled"] > 0
    assert checks["from_dead_memory"] == checks["wrong_key"] == checks["torn"] == 0
    # Restored shards hand out fresh keys; samples go on from the live shard.
    assert checks["acked_twice"] == 0
    assert not [kind for kind in got["errors"] if kind.startswith("sample")], got["errors"]
    for table in got["tables"]:
        assert table["present"] == table["expected"] > 0, table
    assert "items: PASS" in proc.stdout
