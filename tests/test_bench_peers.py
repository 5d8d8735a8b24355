"""bench/peers.py: its check mode with no peer venvs (says which are missing, still
measures moolib, prints a table that parses), the runners' shared counting on the real
ALE, and a runner that cannot start reported as a failure. Nothing here asserts speed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers.util import REPO, child_env

BENCH = REPO / "bench" / "peers.py"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    return _load(BENCH, "bench_peers")


def _fake_python(tmp_path: Path, name: str, body: str) -> Path:
    """An executable that stands in for a peer venv's Python: a shell script."""
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def test_check_skips_missing_venvs_reports_a_broken_one_and_measures_moolib(
    peers: ModuleType, tmp_path: Path
) -> None:
    # SB3's "Python" dies at start: both its rows are reported with the error and the
    # bench goes on to measure the rest.
    broken = _fake_python(tmp_path, "broken-python", "echo 'no such library' >&2; exit 3")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--check", "--sb3-python", str(broken)],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    for flag in ("--sample-factory-python", "--rllib-python", "--torchrl-python"):
        assert f"skipped (no {flag} given)" in out, out
    for algo in ("PPO", "A2C"):
        assert f"stable-baselines3 {algo}: FAILED" in out, out
    assert out.count("exit 3\nno such library") == 2, out
    rows = peers.parse_table(out)
    assert [(r["library"], r["algorithm"]) for r in rows] == [
        ("moolib", "V-trace"),
        ("moolib", "A2C"),
        ("stable-baselines3", "PPO"),
        ("stable-baselines3", "A2C"),
    ], out
    for moolib in rows[:2]:
        assert float(moolib["env steps/s (median)"].replace(",", "")) > 0, out
    assert float(rows[0]["EnvPool limit"].replace(",", "")) > 0, out
    assert rows[2]["env steps/s (median)"] == rows[3]["env steps/s (median)"] == "-", out
    assert proc.returncode == 1 and "check FAILED" in out, out


# A "runner" that steps CartPole 50 times through the shared counters, then hangs (as
# a library whose env workers died, waiting on them).
STALL = """\
import os, sys, time
sys.path.insert(0, {peers!r})
import common
os.environ[common.COUNT_DIR_VAR] = sys.argv[sys.argv.index("--dir") + 1]
env = common.make_env("cartpole", seed=0)
env.reset(seed=0)
for _ in range(50):
    _, _, term, trunc, _ = env.step(env.action_space.sample())
    if term or trunc:
        env.reset()
time.sleep(600)
"""


@pytest.mark.parametrize(
    ("stalls", "limits", "why"),
    [
        (False, (3, 120), "took no env step in 3 s after its start"),
        (True, (120, 5), "took no env step for 5 s after 50 steps"),
    ],
    ids=["never-steps", "stops-stepping"],
)
def test_a_runner_that_takes_no_steps_is_stopped_and_reported(
    peers: ModuleType, tmp_path: Path, stalls: bool, limits: tuple[float, float], why: str
) -> None:
    if stalls:
        script = tmp_path / "stall.py"
        script.write_text(STALL.format(peers=str(REPO / "bench" / "peers")))
        body = f'exec {sys.executable} {script} "$@"'
    else:
        body = "exec sleep 600"
    res = peers.run_peer(
        str(_fake_python(tmp_path, "python", body)),
        peers.ROWS[-1],
        ["--task", "cartpole", "--mode", "score"],
        timeout=600,
        limits=peers.Limits(*limits),
    )
    assert why in res.get("error", ""), res


def _row(peers: ModuleType, lib: str, algo: str):
    return next(r for r in peers.ROWS if (r.lib, r.algo) == (lib, algo))


def test_tables_parse_back_and_pair_rows_of_one_class(peers: ModuleType) -> None:
    moolib, sb3 = _row(peers, "moolib", "V-trace"), _row(peers, "stable-baselines3", "A2C")
    sf1 = _row(peers, "sample-factory", "APPO 1 pass")
    ppo = _row(peers, "stable-baselines3", "PPO")
    text = peers.throughput_table(
        [(moolib, [300.0, 100.0, 200.0]), (sf1, [50.0]), (ppo, [20.0]), (sb3, [])],
        [1000.0, 3000.0],
    )
    rows = peers.parse_table("before\n" + text + "\nafter")
    assert [r["library"] for r in rows] == [
        "moolib",
        "sample-factory",
        "stable-baselines3",
        "stable-baselines3",
    ]
    assert rows[0]["env steps/s (median)"] == "200"
    assert rows[0]["EnvPool limit"] == "2,000"
    assert rows[0]["/ limit"] == "0.100"
    assert rows[0]["moolib / this"] == "1.00"
    # Sample Factory's one-pass APPO is of V-trace's class; PPO has no moolib row.
    assert rows[1]["class"] == rows[0]["class"] and rows[1]["moolib / this"] == "4.00"
    assert rows[2]["moolib / this"] == "-"
    assert rows[3]["env steps/s (median)"] == "-"
    runs = [
        {"reached": True, "seconds": 50.0, "steps": 1000, "best_score": 11.0},
        {"reached": False, "seconds": 99.0, "steps": 5000, "best_score": 6.5},
    ]
    scored = peers.parse_table(
        peers.score_table([(moolib, runs), (sb3, runs[1:]), (sf1, [])], "minatar", 99.0)
    )
    assert scored[0]["reached (cap 99 s)"] == "1/2"
    # Of two runs, one short of the target: the higher middle one did not reach it.
    assert scored[0]["median seconds"] == "> 99"
    assert scored[0]["median best score"] == "8.75"
    assert scored[0]["best score"] == "11.00"
    assert scored[1]["reached (cap 99 s)"] == "0/1"
    assert scored[1]["median seconds"] == "> 99"
    assert scored[1]["median env steps"] == "-"
    assert scored[2]["median seconds"] == "-"
    three = peers.parse_table(peers.score_table([(moolib, [*runs, runs[0]])], "minatar", 99.0))
    assert three[0]["median seconds"] == "50" and three[0]["median env steps"] == "1,000"


def _score_args(peers: ModuleType, **changes: object):
    """The command line of a score comparison (what its functions read)."""
    args = {
        "score_task": "minatar",
        "score_cap": 30.0,
        "envs": 8,
        "procs": 2,
        "seeds": 5,
        "first_step_seconds": 60.0,
        "stall_seconds": 60.0,
        "tune": False,
        "tuning_seed": 0,
        "plot": None,
    }
    return peers.argparse.Namespace(**{**args, **changes})


def test_score_runs_resume_from_the_results_file(peers: ModuleType, tmp_path, monkeypatch) -> None:
    ran: list[int] = []

    def fake_moolib_score(task: str, envs: int, procs: int, seed: int, cap: float, *_) -> dict:
        ran.append(seed)
        return {"reached": seed == 1, "seconds": 10.0 + seed, "steps": 100, "best_score": 9.5}

    monkeypatch.setattr(peers, "moolib_score", fake_moolib_score)
    results = tmp_path / "runs.jsonl"
    args = _score_args(peers, seeds=2)
    moolib = peers.ROWS[0]

    def scores() -> str:
        return peers.scores(args, [moolib], peers.Results(str(results), "abc123"))

    first = scores()
    assert ran == [1, 2]  # the held-out seeds: 1 to --seeds
    entries = [json.loads(line) for line in results.read_text().splitlines()]
    assert [e["seed"] for e in entries] == [1, 2]
    for e in entries:  # each run with its commit and the load around it
        assert e["commit"] == "abc123" and e["kind"] == "score" and e["lib"] == "moolib"
        assert len(e["load_before"]) == len(e["load_after"]) == 3
    # A line cut short by a kill is skipped; both runs are taken from the file.
    with results.open("a") as f:
        f.write('{"key": "[\\"minatar\\", 30.0')
    assert scores() == first and ran == [1, 2]
    # A third seed runs only that seed; another cap is another run.
    args.seeds = 3
    scores()
    assert ran == [1, 2, 3]
    args.score_cap = 60.0
    scores()
    assert ran == [1, 2, 3, 1, 2, 3]
    # One commit per comparison: the file is refused to another.
    with pytest.raises(SystemExit, match="holds runs of moolib abc123, and this is def456"):
        peers.Results(str(results), "def456")


def test_a_run_under_others_load_is_run_again_and_the_last_try_kept(
    peers: ModuleType, tmp_path
) -> None:
    class Load(peers.OtherLoad):
        """Others' shares, one per run, as the machine would measure them."""

        def __init__(self, shares: list[float]) -> None:
            super().__init__()
            self.shares, self.waited = shares, 0

        def wait_quiet(self, limit: float, window: float = 5.0, patience: float = 600.0) -> float:
            self.waited += 1
            return 0.01

        def share(self, since: tuple[float, float, float]) -> float:
            return self.shares.pop(0)

    path = tmp_path / "runs.jsonl"
    calls: list[str] = []

    def results(shares: list[float]) -> object:
        return peers.Results(str(path), "abc123", max_others=0.1, reruns=2, load=Load(shares))

    def measure(name: str) -> dict:
        calls.append(name)
        return {"steps": len(calls)}

    # Loaded, then quiet: two lines, the first marked rerun; the quiet one is the result.
    first = results([0.5, 0.02])
    assert first.run({"run": "a"}, lambda: measure("a")) == ({"steps": 2}, False)
    assert first.load.waited == 2  # each try waited for a quiet machine
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["others_cpu_share"], e.get("rerun"), e.get("loaded")) for e in lines] == [
        (0.5, True, None),
        (0.02, None, None),
    ]
    # Loaded on every try: 1 + reruns tries, the last kept and marked loaded.
    results([0.3, 0.4, 0.6]).run({"run": "b"}, lambda: measure("b"))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e.get("loaded") for e in lines if e["run"] == "b"] == [None, None, True]
    assert calls.count("b") == 3
    # A resume takes a's quiet run and b's last try; a run cut short during a rerun
    # (only its rerun line in the file) runs again.
    with path.open("a") as f:
        f.write(json.dumps({**lines[0], "key": json.dumps({"run": "c"}), "run": "c"}) + "\n")
    again = results([0.0])
    assert again.run({"run": "a"}, lambda: measure("a")) == ({"steps": 2}, True)
    assert again.run({"run": "b"}, lambda: measure("b"))[1] is True
    assert again.run({"run": "c"}, lambda: measure("c"))[1] is False and calls[-1] == "c"


# In a process of its own, which the bench's cgroup takes in: a helper that a run's
# process starts and never reaps (double-forked, as daemons are), burning half a second.
_ORPHAN_CPU = """
import importlib.util, json, os, sys, time
spec = importlib.util.spec_from_file_location("bench_peers", sys.argv[1])
peers = importlib.util.module_from_spec(spec)
sys.modules["bench_peers"] = peers
spec.loader.exec_module(peers)
load = peers.OtherLoad()
before = load.mark()
if os.fork() == 0:
    if os.fork() == 0:
        start = time.process_time()
        while time.process_time() - start < 0.5:
            pass
    os._exit(0)
os.wait()
time.sleep(1.5)
after = load.mark()
print(json.dumps({"group": load.group is not None, "own": after[1] - before[1]}))
"""


def test_the_cpu_of_a_runs_helpers_it_never_reaps_counts_as_the_benchs(tmp_path) -> None:
    """RLlib's Ray processes are not reaped by its runner: counted by reaped children
    alone, their CPU read as others' load and every RLlib run was run again."""
    out = subprocess.run(
        [sys.executable, "-c", _ORPHAN_CPU, str(BENCH)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    if not got["group"]:
        pytest.skip("no cgroup of its own for the bench here (needs root and a cgroup filesystem)")
    assert got["own"] >= 0.45, got


def test_tuning_sweeps_every_row_alike_on_its_seed_and_scores_the_pick_on_held_out_seeds(
    peers: ModuleType, tmp_path, monkeypatch
) -> None:
    calls: list[tuple[int, tuple[str, ...]]] = []

    def fake_moolib_score(
        task: str, envs: int, procs: int, seed: int, cap: float, limits, agent, extra
    ) -> dict:
        calls.append((seed, extra))
        # The doubled learning rate with the halved batch reaches the target soonest.
        fast = "agent.optimizer.learning_rate=0.002" in extra and "agent.batch_size=8" in extra
        best = 10.0 if fast else 5.0 + len(extra)
        curve = [[5.0, 50, best / 2], [20.0, 100, best]]
        return {"reached": fast, "seconds": 20.0, "steps": 100, "best_score": best, "curve": curve}

    monkeypatch.setattr(peers, "moolib_score", fake_moolib_score)
    args = _score_args(peers, tune=True, plot=str(tmp_path / "curves.png"))
    results = tmp_path / "runs.jsonl"
    text = peers.scores(args, [peers.ROWS[0]], peers.Results(str(results), "abc123"))
    # Six sweep runs on seed 0 (the published setting among them: no overrides), then
    # held-out seeds 1-5 with the published setting and with the pick.
    assert [seed for seed, _ in calls[:6]] == [0] * 6 and () in [e for _, e in calls[:6]]
    assert [seed for seed, _ in calls[6:]] == [1, 2, 3, 4, 5] * 2
    assert all(extra == () for _, extra in calls[6:11])
    picked = calls[11][1]
    assert "agent.optimizer.learning_rate=0.002" in picked and "agent.batch_size=8" in picked
    entries = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(entries) == 16
    assert {(e["lr_scale"], e["batch_scale"]) for e in entries[11:]} == {(2.0, 0.5)}
    tables = text.split("\n\n")
    assert tables[0].startswith("published settings, held-out seeds 1-5")
    assert tables[1].startswith("tuned settings (the sweep's pick per row), held-out seeds 1-5")
    assert peers.parse_table(tables[0])[0]["reached (cap 30 s)"] == "0/5"
    assert peers.parse_table(tables[1])[0]["reached (cap 30 s)"] == "5/5"
    assert tables[2] == f"curves: {tmp_path / 'curves.png'}"
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_are_chosen_by_name_and_a_wrong_name_lists_them(peers: ModuleType) -> None:
    args = peers.argparse.Namespace(
        rows="moolib:A2C, stable-baselines3:A2C", sb3_python=sys.executable
    )
    for row in peers.ROWS:
        if row.python_flag:
            setattr(args, row.python_flag.lstrip("-").replace("-", "_"), args.sb3_python)
    chosen = peers.available(args)
    assert [(r.lib, r.algo) for r in chosen] == [("moolib", "A2C"), ("stable-baselines3", "A2C")]
    args.rows = "moolib:PPO"
    with pytest.raises(SystemExit, match=r"no row \['moolib:PPO'\]; the rows are: moolib:V-trace"):
        peers.available(args)


def test_a_throughput_window_without_steps_is_a_failed_run(
    peers: ModuleType, monkeypatch, capsys
) -> None:
    figures = {"V-trace": 500.0, "A2C": 0.0}  # A2C stepped, then stalled in its window
    monkeypatch.setattr(
        peers, "measure_throughput", lambda args, row, task, rnd: {"env_sps": figures[row.algo]}
    )
    monkeypatch.setattr(peers.bench_train(), "envpool_limit", lambda cfg, seconds: 1000.0)
    args = peers.argparse.Namespace(
        rounds=1, warmup=1.0, seconds=1.0, envpool_seconds=1.0, envs=8, procs=2
    )
    rows = [_row(peers, "moolib", "V-trace"), _row(peers, "moolib", "A2C")]
    text = peers.throughput(args, rows, "cartpole", peers.Results(None, "abc123"))
    assert "moolib A2C: FAILED\nno env step in its timed window" in capsys.readouterr().out
    table = peers.parse_table(text)
    assert table[0]["env steps/s (median)"] == "500"
    assert table[1]["env steps/s (median)"] == "-" and table[1]["rounds"] == "0"


def test_round_ratios_pair_moolib_with_the_best_peer_of_its_class(peers: ModuleType) -> None:
    vtrace, a2c = _row(peers, "moolib", "V-trace"), _row(peers, "moolib", "A2C")
    sf1 = _row(peers, "sample-factory", "APPO 1 pass")
    rllib = _row(peers, "rllib", "IMPALA")
    sb3_a2c, ppo = _row(peers, "stable-baselines3", "A2C"), _row(peers, "stable-baselines3", "PPO")
    rows = [vtrace, a2c, sf1, rllib, sb3_a2c, ppo]
    rounds = [
        {vtrace: 300.0, sf1: 100.0, rllib: 150.0, ppo: 1000.0, a2c: 90.0},
        {vtrace: 200.0, sf1: 200.0, ppo: 1000.0, a2c: 80.0, sb3_a2c: 40.0},
        {sf1: 100.0},  # moolib failed in this round: no ratio from it
    ]
    lines = peers.round_ratios(rounds, rows)
    # The PPO row, faster, is another class: it enters no ratio.
    assert lines[0].startswith("moolib V-trace / best one pass peer, per round: 2.00x, 1.00x;")
    assert "median 1.50x, range 1.00-2.00x over 2 rounds" in lines[0]
    assert "per round: 2.00x; median 2.00x" in lines[1]


def test_moolib_rolling_score_takes_the_last_hundred_episodes(peers: ModuleType) -> None:
    rows = [
        {"episodes": "80", "mean_episode_return": "0"},
        {"episodes": "", "mean_episode_return": ""},
        {"episodes": "60", "mean_episode_return": "10"},
        {"episodes": "40", "mean_episode_return": "20"},
    ]
    assert peers.rolling_score(rows) == pytest.approx((60 * 10 + 40 * 20) / 100)
    assert peers.rolling_score(rows[-1:]) != peers.rolling_score(rows[-1:])  # nan: too few


def test_common_counts_steps_and_episodes_of_the_real_ale(tmp_path, monkeypatch) -> None:
    common = _load(REPO / "bench" / "peers" / "common.py", "peers_common")
    monkeypatch.setenv(common.COUNT_DIR_VAR, str(tmp_path))
    env = common.make_env("breakout", seed=1)
    obs, _ = env.reset(seed=1)
    assert obs.shape == (4, 84, 84) and str(obs.dtype) == "uint8"
    for _ in range(7):
        env.step(env.action_space.sample())
    counts = list(tmp_path.glob("steps-*"))
    assert len(counts) == 1
    assert int(counts[0].read_bytes()[:8][::-1].hex(), 16) == 7  # little-endian int64
    cart = common.make_env("cartpole", seed=2)
    cart.reset(seed=2)
    done = False
    while not done:
        _, _, terminated, truncated, _ = cart.step(0)  # always left: falls within ~10 steps
        done = terminated or truncated
    episodes = [p for p in tmp_path.glob("episodes-*") if p.read_text()]
    assert len(episodes) == 1
    ((stamp, ret),) = [line.split() for line in episodes[0].read_text().splitlines()]
    assert 1 <= float(ret) < 50


def test_a_runner_that_fails_is_reported_with_its_error(peers: ModuleType) -> None:
    # This interpreter has no stable_baselines3: the runner's import fails.
    pytest.importorskip("moolib")
    if importlib.util.find_spec("stable_baselines3") is not None:
        pytest.skip("stable_baselines3 is installed here")
    row = _row(peers, "stable-baselines3", "A2C")
    res = peers.run_peer(
        sys.executable, row, ["--task", "cartpole", "--mode", "throughput"], timeout=120
    )
    assert "error" in res and "stable_baselines3" in res["error"], res
