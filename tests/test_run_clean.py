"""A run ends clean, and says what happened: a network that cannot take the env's
observations is a config error before anything starts; every point of a sweep releases
what it opened (its Rpcs, groups and broker); a Ctrl-C right after a log row leaves the
logs, the summary and ``moolib-plot`` on the last real row; ``log_interval`` must be > 0.

The launcher runs as real processes (``python -m moolib.launch.run``) where the exit code
and the output are the point; the sweep's points run in this process, as Hydra runs them,
to count what each leaves behind.
"""

from __future__ import annotations

import pytest
from helpers.run_util import QUICK, check_ok, run, run_quick, snapshot


def one_error_line(result) -> str:
    """The run stopped with exit 2 and said why in one ``moolib-run: error:`` line."""
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-5000:]
    assert "Traceback" not in out, out[-5000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moolib-run: error: "), out[-5000:]
    return lines[0]


# -- a network that cannot take the env's observations ----------------------------------------


@pytest.mark.parametrize(
    "overrides, names",
    [
        (
            ["agent=a2c", "env=cartpole", "agent.network=impala_deep"],
            ["agent.network=impala_deep", "env=cartpole", "shape (4,)", "image observations"],
        ),
        (
            ["agent=a2c", "env=cartpole", "agent.network=minatar"],
            ["agent.network=minatar", "env=cartpole", "shape (4,)", "(mlp here)"],
        ),
        (
            ["agent=apex", "env=cartpole", "agent.network=impala_shallow"],
            ["agent.network=impala_shallow", "env=cartpole", "shape (4,)"],
        ),
        # Images, but too small for the shallow network's strided convolutions.
        (
            ["agent=vtrace", "env=minatar-breakout", "agent.network=impala_shallow"],
            ["agent.network=impala_shallow", "env=minatar-breakout", "shape (4, 10, 10)", "20x20"],
        ),
        # Every point of a sweep is checked before the first starts.
        (
            ["-m", "agent=a2c", "env=cartpole", "agent.network=mlp,impala_deep"],
            ["agent.network=impala_deep", "env=cartpole", "shape (4,)"],
        ),
    ],
    ids=[
        "impala-cartpole",
        "minatar-cartpole",
        "apex-shallow-cartpole",
        "shallow-minatar",
        "sweep",
    ],
)
def test_a_network_that_cannot_take_the_observations_is_a_config_error(tmp_path, overrides, names):
    line = one_error_line(run_quick(tmp_path, *overrides, "device=cpu", "total_steps=100"))
    for name in names:
        assert name in line, line
    assert list(tmp_path.iterdir()) == []  # no outputs/ or multirun/ folder


@pytest.mark.timeout(300)
def test_a_resume_with_a_network_that_cannot_take_the_observations_is_refused(tmp_path):
    savedir = tmp_path / "run"
    check_ok(run([*QUICK, "total_steps=2000", f"savedir={savedir}"], tmp_path))
    before = snapshot(savedir)
    result = run_quick(tmp_path, f"savedir={savedir}", "agent.network=impala_deep")
    line = one_error_line(result)
    assert "agent.network=impala_deep" in line and "env=cartpole" in line, line
    assert "shape (4,)" in line, line
    assert snapshot(savedir) == before  # nothing written, nothing recorded as resumed
