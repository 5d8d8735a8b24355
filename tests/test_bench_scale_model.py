"""bench/scale_model.py on a scale.py result made here from known unit costs: the fit
recovers them from the 8 and 16 peer rows, the check then matches the 32 and 64 rows, a
figure made off by 2x is flagged, and the predictions and breakages are all there."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.util import REPO

MODEL = REPO / "bench" / "scale_model.py"
MIB = 1 << 20
C_MSG, C_BYTE, HOP = 100e-6, 1e-9, 0.5e-3  # CPU s a message, CPU s a byte, s a hop
CORES = 2

# Per all-reduce of S bytes: (messages, bytes / S, hops, a peer's links), counted by
# hand from docs/architecture.md for the code as it is now: direct among <= 8
# members, recursive doubling above; shared memory (shm) or a ring of 256 KiB
# chunks (netns) for 1 and 6 MiB.
COUNTS = {
    ("shm", 8): {16: (56, 56, 1, 7), MIB: (168, 24, 3, 7), 6 * MIB: (168, 24, 3, 7)},
    ("shm", 16): {16: (64, 64, 4, 4), MIB: (720, 48, 3, 15), 6 * MIB: (720, 48, 3, 15)},
    ("shm", 32): {16: (160, 160, 5, 5), MIB: (2976, 96, 3, 31), 6 * MIB: (2976, 96, 3, 31)},
    ("shm", 64): {16: (384, 384, 6, 6), MIB: (12096, 192, 3, 63), 6 * MIB: (12096, 192, 3, 63)},
    ("netns", 8): {16: (56, 56, 1, 7), MIB: (112, 14, 14, 2), 6 * MIB: (336, 14, 16, 2)},
    ("netns", 16): {16: (64, 64, 4, 4), MIB: (480, 30, 30, 2), 6 * MIB: (960, 30, 31, 2)},
    ("netns", 32): {16: (160, 160, 5, 5), MIB: (1984, 62, 62, 2), 6 * MIB: (1984, 62, 62, 2)},
    ("netns", 64): {16: (384, 384, 6, 6), MIB: (8064, 126, 126, 2), 6 * MIB: (8064, 126, 126, 2)},
}  # fmt: skip


def row(layout: str, n: int) -> dict:
    counts = COUNTS[(layout, n)]
    links = max(c[3] for c in counts.values())
    reduce = {
        str(size): {"median_s": (C_MSG * m + C_BYTE * b * size) / CORES + HOP * h}
        for size, (m, b, h, _) in counts.items()
    }
    return {
        "peers": n,
        "layout": layout,
        "errors": [],
        "join_s": 1.0 + 0.002 * n,
        "broker_cpu_idle": n * (300e-6 + 2e-6 * n),  # ping interval 1 s
        "reduce": reduce,
        "light": {
            "fds": {"median": 11 + 3.0 * links},
            "rss_mib": {"median": 100 + 0.5 * links},
            "threads": {"median": 20},
        },
        "kill": {"next_step_s": 0.6 + 0.01 * n},
    }


def run_model(tmp_path, results: list[dict]) -> tuple[str, dict]:
    raw, report = tmp_path / "scale.json", tmp_path / "report.json"
    settings = {"cores": CORES, "group_timeout": 10.0, "quick": False}
    raw.write_text(json.dumps({"settings": settings, "results": results}))
    cmd = [sys.executable, str(MODEL), "--json", str(raw), "--report", str(report)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(report.read_text())


def test_fit_recovers_the_costs_and_the_check_flags_what_is_off(tmp_path) -> None:
    results = [row(lay, n) for lay in ("shm", "netns") for n in (8, 16, 32, 64)]
    results[-1]["reduce"][str(6 * MIB)]["median_s"] *= 2  # netns 64: off by 2x
    out, report = run_model(tmp_path, results)

    for fit in report["fits"].values():
        assert fit["fitted_from"] == [8, 16], fit
        assert abs(fit["c_msg"] / C_MSG - 1) < 1e-6, fit
        assert abs(fit["c_byte"] / C_BYTE - 1) < 1e-6, fit
        assert abs(fit["hop"] / HOP - 1) < 1e-6, fit
        assert abs(fit["c_ping"] / 300e-6 - 1) < 1e-6 and abs(fit["c_name"] / 2e-6 - 1) < 1e-6
        assert [round(v, 6) for v in fit["fds"]] == [11, 3], fit
    for c in report["in_sample"]:
        assert abs(c["ratio"] - 1) < 1e-6, c
    assert {(c["layout"], c["peers"]) for c in report["check"]} == {
        (lay, n) for lay in ("shm", "netns") for n in (32, 64)
    }
    off = [c for c in report["check"] if not c["ok"]]
    assert [(c["layout"], c["peers"], c["figure"]) for c in off] == [("netns", 64, "ar 6 MiB s")], (
        off
    )
    assert abs(off[0]["ratio"] - 2) < 1e-6, off
    assert "check: 35 of 36 figures at N = 32, 64 within 1.5x; 1 off" in out, out
    assert "| netns | 64 | ar 6 MiB s |" in out and "NO (off by > 1.5x)" in out
    for a in ("A1", "A2", "A3", "A4", "A5", "A6"):
        assert a in out, a

    preds = report["predictions"]
    assert sorted(preds) == ["1024", "256"], preds
    for key in ("join s", "broker cpu per change (CPU s)", "election messages", "ar 16 B s",
                "ar 6 MiB s", "peer fds", "peer rss MiB"):  # fmt: skip
        assert preds["256"][key] > 0 and preds["1024"][key] >= preds["256"][key], key
    assert preds["1024"]["election messages"] == 1024 * 1023
    assert abs(preds["1024"]["peer fds"] - (11 + 3 * 1023)) < 1e-6
    firsts = [b["first_n"] for b in report["breaks"] if b["first_n"]]
    assert firsts == sorted(firsts) and firsts, report["breaks"]
    fds = next(b for b in report["breaks"] if b["limit"].startswith("peer fds"))
    assert fds["first_n"] == 339  # 11 + 3 (N - 1) > 1,024
