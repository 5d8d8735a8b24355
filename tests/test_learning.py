"""Learning tests: moolib-run's agents solve CartPole on CPU within a bounded number of steps.

Each test runs the real ``moolib-run agent=<a> env=cartpole`` (with its tuned
config, conf/tuning/<a>_cartpole.yaml) in a subprocess with ``total_steps`` as
the bound, and watches its logs.tsv. Once a log row shows the target mean
episode return the run is stopped early with Ctrl-C (SIGINT), which saves
CI time; the assertion is on the rows of logs.tsv either way.
"""

from __future__ import annotations

import math

import pytest
from helpers.run_util import STOP_TIMEOUT, Run, read_logs, wait_for

# CartPole-v1 is "solved" at a mean return of 195; a random policy gets about 22.
SOLVED = 195.0
# A row's mean over a handful of episodes at least (not one lucky episode).
MIN_EPISODES = 5
BOUND = 500_000  # env steps


def good_rows(rows: list[dict], threshold: float) -> list[dict]:
    return [
        r
        for r in rows
        if r.get("episodes", 0) >= MIN_EPISODES
        and not math.isnan(r.get("mean_episode_return", math.nan))
        and r["mean_episode_return"] >= threshold
    ]


def learn(tmp_path, agent: str, threshold: float, seed: int) -> None:
    savedir = tmp_path / "run"
    args = [
        f"agent={agent}",
        "env=cartpole",
        "device=cpu",
        f"seed={seed}",
        f"total_steps={BOUND}",
        "log_interval=1",
        f"savedir={savedir}",
    ]
    run = Run(args, tmp_path, tmp_path / "out.log")
    logs = savedir / "logs.tsv"
    try:

        def reached_or_done():
            if run.proc.poll() is not None:
                return True
            return logs.exists() and good_rows(read_logs(logs)[1], threshold)

        # Generous: ~20k steps/s on an idle 2-core machine, far fewer on a busy one.
        wait_for(reached_or_done, timeout=900, what=f"return >= {threshold}", proc=None)
        interrupted = run.proc.poll() is None
        if interrupted:
            run.interrupt()  # reached: stop early (Ctrl-C)
        code = run.wait(STOP_TIMEOUT)
        out = run.output()
        # 130: stopped by Ctrl-C (after its checkpoint), unless it had just finished.
        assert code == 0 or (interrupted and code == 130), out[-5000:]
    finally:
        run.finish()

    header, rows = read_logs(logs)
    assert rows, out[-3000:]
    returns = [r["mean_episode_return"] for r in rows if not math.isnan(r["mean_episode_return"])]
    best = max(returns)
    reached = good_rows(rows, threshold)
    assert reached, (
        f"{agent} on CartPole: best mean episode return {best:.1f} over {len(rows)} rows up to "
        f"step {int(rows[-1]['step'])}, wanted >= {threshold} (over >= {MIN_EPISODES} episodes)"
    )
    first = reached[0]
    assert first["step"] <= BOUND + 10_000  # the bound (one update of slack past total_steps)
    # It learned: early episodes were near random.
    assert returns[0] < threshold / 2
    print(
        f"{agent}: mean episode return {first['mean_episode_return']:.1f} at step "
        f"{int(first['step'])} (best {best:.1f})"
    )


@pytest.mark.timeout(1200)
def test_a2c_solves_cartpole(tmp_path):
    learn(tmp_path, "a2c", SOLVED, seed=1)


@pytest.mark.timeout(1200)
def test_vtrace_solves_cartpole(tmp_path):
    learn(tmp_path, "vtrace", SOLVED, seed=1)
