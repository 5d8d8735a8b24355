"""Training runs of ``moolib-run``, end to end: two local peers train one model, a sweep
gives each point its savedir and group, the README's run trains without any extra, a
process count the agent does not read is noted, and a name with a slash makes one default
savedir.

Real processes, real Hydra composition over conf/, real envs: every run is a
``python -m moolib.launch.run`` subprocess in its own session with its own savedir under
tmp_path; runs are short (small total_steps and batches) and nothing asserts on speed.
"""

from __future__ import annotations

import pytest
from helpers.run_util import (
    QUICK,
    check_ok,
    history_steps,
    load_checkpoint,
    load_config,
    load_yaml,
    read_logs,
    run,
    run_without,
)

# The packages of the extras (and the test extra's), which the README's install lacks.
EXTRA_PACKAGES = (
    "minatar",
    "pandas",
    "scipy",
    "seaborn",
    "wandb",
    "tensorboard",
    "envpool",
    "imageio_ffmpeg",
    "pygame",
    "mujoco",
    "imageio",
    "pytest",
)


# -- scaling=local -------------------------------------------------------------------------


def common_versions(a: list[dict], b: list[dict]) -> dict[int, tuple[float, float]]:
    """param_sum of both peers at the model versions (> 0) both logged."""
    pa = {int(r["model_version"]): r["param_sum"] for r in a}
    pb = {int(r["model_version"]): r["param_sum"] for r in b}
    return {v: (pa[v], pb[v]) for v in sorted(set(pa) & set(pb)) if v > 0}


def two_peers_train_one_model(tmp_path, agent: str, total_steps: int) -> tuple[dict, dict]:
    """Runs ``agent`` on CartPole as 2 local peers for ``total_steps`` and checks they
    trained one model together; returns the last log row and the checkpoint."""
    savedir = tmp_path / agent
    out = check_ok(
        run(
            [
                f"agent={agent}",
                "env=cartpole",
                "scaling=local",
                "scaling.peers=2",
                "device=cpu",
                f"total_steps={total_steps}",
                "log_interval=1",
                f"savedir={savedir}",
            ],
            tmp_path,
        )
    )
    assert "2 peers" in out
    assert not (savedir / "logs.tsv").exists()  # each peer logs into its own folder
    _, rows0 = read_logs(savedir / "peer0" / "logs.tsv")
    _, rows1 = read_logs(savedir / "peer1" / "logs.tsv")
    assert rows0 and rows1
    assert (savedir / "peer1" / "stdout.log").exists()
    assert "Traceback" not in (savedir / "peer1" / "stdout.log").read_text(errors="replace")

    last0, last1 = rows0[-1], rows1[-1]
    # Both stop after the same update: the same step count, version and parameters.
    assert last0["step"] == last1["step"] >= total_steps
    assert last0["model_version"] == last1["model_version"] > 0
    assert last0["param_sum"] == last1["param_sum"]
    # They trained together: both in the group, updates summing gradients of both.
    # (Not necessarily at the final row: the first to finish leaves the group.)
    for rows in (rows0, rows1):
        assert any(r["peers"] == 2 and r["num_gradients"] == 2 for r in rows), rows
    # Identical parameters at every version both logged.
    both = common_versions(rows0, rows1)
    assert both
    assert all(a == b for a, b in both.values()), both

    ckpt = load_checkpoint(savedir / "checkpoint.pt")
    assert ckpt["steps"] == int(last0["step"])
    assert ckpt["model_version"] == int(last0["model_version"])
    assert float(f"{ckpt['param_sum']:.10g}") == last0["param_sum"]  # logs.tsv: 10 digits
    assert history_steps(savedir) == [int(last0["step"])]
    return last0, ckpt


@pytest.mark.timeout(600)
def test_local_two_peers_train_one_model(tmp_path):
    # Enough that the peer that starts first cannot finish alone.
    two_peers_train_one_model(tmp_path, "a2c", 150000)


@pytest.mark.timeout(600)
def test_local_two_peers_train_one_ppo_model_a_step_a_minibatch(tmp_path):
    """PPO's epochs of minibatches through the Accumulator: with conf/tuning/ppo_cartpole.yaml
    (batches of 4 unrolls of 128 steps, 4 epochs of 4 minibatches, virtual_batch_size 1)
    each round of one minibatch per peer is one optimizer step, and the peers stay one
    model through every one of them."""
    # Each peer's batch of 512 steps makes 16 updates of 64 steps (two minibatches of
    # one unroll's 128 steps, each in 4 epochs). Enough steps that the peer that starts
    # first cannot finish alone: it learns about 1,000 steps a second alone, and the
    # other's start can lag by 10 s and more on a loaded machine (3,000 did not do).
    last, ckpt = two_peers_train_one_model(tmp_path, "ppo", 30000)
    # An optimizer step a minibatch: 64 env steps an update of both peers' (32 of one
    # peer alone), where a step a batch (A2C's) would count 1,024.
    versions, step = int(last["model_version"]), int(last["step"])
    assert 32 * versions <= step <= 64 * versions, (versions, step)
    assert ckpt["step_remainder"] == 0


@pytest.mark.timeout(300)
def test_a_process_count_the_agent_does_not_read_is_noted(tmp_path):
    # scaling.actors is for the off-policy agents: a2c runs scaling.peers peers.
    savedir = tmp_path / "noted"
    args = ["agent=a2c", "env=cartpole", "device=cpu", "scaling=local", "scaling.actors=3"]
    out = check_ok(run([*args, "total_steps=2000", f"savedir={savedir}"], tmp_path))
    assert (
        "moolib-run: note: scaling.actors is not used by agent=a2c, which runs "
        "scaling.peers=2 peers (scaling.actors is for apex and r2d2)"
    ) in out, out[-3000:]
    assert "2 peers" in out
    assert (savedir / "peer1" / "logs.tsv").exists()


# -- sweeps --------------------------------------------------------------------------------


@pytest.mark.timeout(600)
def test_multirun_sweep_gives_each_point_its_savedir_and_group(tmp_path):
    savedir = tmp_path / "sweep"
    out = check_ok(
        run(
            [
                "-m",
                "agent=a2c",
                "env=cartpole",
                "device=cpu",
                "total_steps=2000",
                "log_interval=1",
                "agent.optimizer.learning_rate=1e-3,2e-3",
                f"savedir={savedir}",
            ],
            tmp_path,
        )
    )
    assert "Launching 2 jobs" in out
    groups = set()
    for k, lr in [(0, 1e-3), (1, 2e-3)]:
        point = savedir / str(k)
        cfg = load_config(point)
        assert cfg["agent"]["optimizer"]["learning_rate"] == lr
        assert cfg["savedir"] == str(point)
        groups.add(cfg["group"])
        _, rows = read_logs(point / "logs.tsv")
        assert rows and rows[-1]["step"] >= 2000
        assert (point / "checkpoint.pt").exists()
    assert len(groups) == 2
    assert not (savedir / "logs.tsv").exists() and not (savedir / "checkpoint.pt").exists()


# -- where a run writes, and with what installed -------------------------------------------


@pytest.mark.timeout(300)
def test_a_name_with_a_slash_makes_one_default_savedir(tmp_path):
    # A gym id's namespace (env.id=ALE/Pong-v5) puts a / in the run's name as well.
    check_ok(run([*QUICK, "total_steps=500", "name=team/pong"], tmp_path))
    made = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(made) == 1 and made[0].name.endswith("-team-pong"), made
    assert (made[0] / "config.yaml").is_file() and (made[0] / "logs.tsv").is_file()
    assert load_yaml(made[0] / "config.yaml")["name"] == "team/pong"


def test_the_readme_run_needs_no_extra(tmp_path):
    # The README's CartPole run, in a Python where no extra's package can be imported
    # (as after the README's `pip install -e .`): it trains, checkpoints and exits 0.
    savedir = tmp_path / "cartpole"
    args = ["agent=a2c", "env=cartpole", "total_steps=3000", f"savedir={savedir}"]
    r = run_without(tmp_path, EXTRA_PACKAGES, *args)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "moolib-run: done: " in out, out
    assert (savedir / "checkpoint.pt").is_file(), out
