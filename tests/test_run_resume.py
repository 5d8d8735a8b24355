"""Resuming a savedir with ``moolib-run``: the same savedir with more steps continues its
logs, checkpoints and wandb run where they stopped; a savedir (a sweep's point too) resumes
with its own config and records what an override changed; a finished run says so and
writes nothing; overrides or a network its checkpoint cannot take are refused in one line,
the savedir untouched.

Every check runs the real ``moolib-run`` (``python -m moolib.launch.run``) in its own
session, with short runs; a savedir trained once is reused across the checks of a test.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import yaml
from helpers.run_util import (
    DOCUMENTED_COLUMNS,
    QUICK,
    assert_tensorboard_has_the_rows,
    check_ok,
    checkpoint_steps,
    history_steps,
    load_checkpoint,
    load_config,
    load_yaml,
    one_error_line,
    read_logs,
    run,
    run_quick,
    snapshot,
    tensorboard_runs,
)
from moolib.agents.runtime.tensorboard_log import EVENT_FILES, TensorBoardLog
from moolib.launch import config as config_lib
from moolib.launch import plot
from omegaconf import OmegaConf

# Small Breakout runs on CPU: 8 envs in 2 actor batches, 4 unrolls of 10 steps per update.
SMALL_ATARI = [
    "device=cpu",
    "agent.actor_batch_size=8",
    "agent.batch_size=4",
    "agent.unroll_length=10",
    "agent.virtual_batch_size=4",
    "log_interval=1",
]


def training_files(folder: Path) -> dict[str, str]:
    """``snapshot`` without what Hydra rewrites on every launch (.hydra/, run.log and a
    sweep's multirun.yaml): the run's own config, logs and checkpoints."""
    hydra_files = (".hydra/", "run.log", "multirun.yaml")
    return {k: v for k, v in snapshot(folder).items() if not any(h in f"/{k}" for h in hydra_files)}


# -- a run, and a resumed run --------------------------------------------------------------


@pytest.mark.timeout(600)
def test_vtrace_breakout_cpu_logs_checkpoints_and_resumes(tmp_path):
    savedir = tmp_path / "breakout"
    base = ["agent=vtrace", "env=breakout", *SMALL_ATARI, "seed=0", f"savedir={savedir}"]

    out1 = check_ok(run([*base, "total_steps=300"], tmp_path))
    assert "resumed" not in out1

    # The resolved config.
    cfg = load_config(savedir)
    assert cfg["agent"]["name"] == "vtrace" and cfg["env"]["name"] == "breakout"
    assert cfg["device"] == "cpu" and cfg["total_steps"] == 300
    assert cfg["agent"]["actor_batch_size"] == 8 and cfg["agent"]["unroll_length"] == 10
    assert cfg["savedir"] == str(savedir)
    assert cfg["group"] and cfg["name"] == "vtrace-breakout"  # interpolations resolved
    # The loaded config is what launch/config.py accepts.
    config_lib.validate(OmegaConf.create(cfg))

    # logs.tsv: the documented columns, rows up to total_steps.
    header, rows1 = read_logs(savedir / "logs.tsv")
    assert DOCUMENTED_COLUMNS <= set(header), DOCUMENTED_COLUMNS - set(header)
    assert rows1
    steps1 = [r["step"] for r in rows1]
    assert steps1 == sorted(steps1)
    last1 = int(steps1[-1])
    assert last1 >= 300
    trained = [r for r in rows1 if r["model_version"] > 0]
    assert trained, rows1
    assert not any(math.isinf(r["total_loss"]) for r in trained)
    assert any(math.isfinite(r["total_loss"]) and r["grad_norm"] >= 0 for r in trained)
    assert any(r["virtual_batch_size"] == 4 for r in trained)  # one peer's 4 unrolls
    assert rows1[-1]["peers"] == 1

    # Checkpoint (and its history entry) at the last step.
    ckpt1 = load_checkpoint(savedir / "checkpoint.pt")
    assert ckpt1["steps"] == last1
    assert ckpt1["model_version"] == int(rows1[-1]["model_version"])
    assert {"model", "optimizer"} <= set(ckpt1)
    assert history_steps(savedir) == [last1]
    assert not list(savedir.glob(".checkpoint.pt.*"))  # no temp file left

    # Same savedir, more steps: resumes from the checkpoint.
    out2 = check_ok(run([*base, "total_steps=600"], tmp_path))
    assert re.search(rf"resumed from .*checkpoint\.pt at step {last1}\b", out2), out2[-3000:]

    text = (savedir / "logs.tsv").read_text()
    assert text.count("\nstep\t") == 0 and text.startswith("step\t")  # the header, once
    header2, rows = read_logs(savedir / "logs.tsv")
    assert header2 == header
    assert _same_rows(rows[: len(rows1)], rows1)  # the first run's rows, kept
    rows2 = rows[len(rows1) :]
    assert rows2, "the resumed run logged nothing"
    steps2 = [r["step"] for r in rows2]
    assert steps2[0] >= last1 and steps2 == sorted(steps2)  # continues, does not restart at 0
    assert steps2[-1] > last1 and steps2[-1] >= 600
    assert rows2[-1]["model_version"] > rows1[-1]["model_version"]

    ckpt2 = load_checkpoint(savedir / "checkpoint.pt")
    assert ckpt2["steps"] == int(steps2[-1])
    assert ckpt2["model_version"] == int(rows2[-1]["model_version"])
    assert history_steps(savedir) == [last1, int(steps2[-1])]
    # A resumed experiment stays one experiment.
    assert load_config(savedir)["group"] == cfg["group"]
    assert load_config(savedir)["total_steps"] == 600


def _same_rows(a: list[dict], b: list[dict]) -> bool:
    def norm(r):
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()}

    return [norm(r) for r in a] == [norm(r) for r in b]


@pytest.mark.timeout(600)
def test_wandb_offline_run_and_resume_keep_the_run_id(tmp_path):
    savedir = tmp_path / "wb"
    base = [
        "agent=a2c",
        "env=cartpole",
        "device=cpu",
        "log_interval=1",
        "wandb.enabled=true",
        f"savedir={savedir}",
    ]
    check_ok(run([*base, "total_steps=2000"], tmp_path))
    runs1 = sorted((savedir / "wandb").glob("offline-run-*"))
    assert len(runs1) == 1, list((savedir / "wandb").iterdir())
    run_id = runs1[0].name.rsplit("-", 1)[1]
    assert load_checkpoint(savedir / "checkpoint.pt")["wandb_ids"] == {"0": run_id}
    # Project, group (the experiment's) and run name reach wandb.
    group = load_config(savedir)["group"]
    record = (runs1[0] / f"run-{run_id}.wandb").read_bytes()
    assert group.encode() in record
    assert b"a2c-cartpole-peer0" in record

    out = check_ok(run([*base, "total_steps=4000"], tmp_path))
    assert "resumed from" in out
    runs2 = sorted((savedir / "wandb").glob("offline-run-*"))
    assert len(runs2) == 2
    assert {r.name.rsplit("-", 1)[1] for r in runs2} == {run_id}  # the same run, continued
    assert load_checkpoint(savedir / "checkpoint.pt")["wandb_ids"] == {"0": run_id}


@pytest.mark.timeout(600)
def test_tensorboard_has_the_rows_of_logs_tsv_and_a_resume_appends_its_own(tmp_path):
    savedir = tmp_path / "tb"
    # Rows every 0.2 s: a few in each of these short runs.
    base = ["agent=a2c", "env=cartpole", "device=cpu", "log_interval=0.2"]
    base += ["tensorboard.enabled=true", f"savedir={savedir}"]
    check_ok(run([*base, "total_steps=2000"], tmp_path))
    _, rows = read_logs(savedir / "logs.tsv")
    first = sorted(savedir.glob(EVENT_FILES))
    assert len(first) == 1, sorted(p.name for p in savedir.iterdir())
    runs = tensorboard_runs(savedir)
    assert list(runs) == ["."], runs.keys()  # one peer: its event file beside its logs.tsv
    assert_tensorboard_has_the_rows(runs["."], rows)
    # The step axis is the env steps, as logs.tsv's and the checkpoint's.
    assert runs["."]["sps"][-1][0] == checkpoint_steps(savedir) >= 2000

    out = check_ok(run([*base, "total_steps=4000"], tmp_path))
    assert "resumed from" in out
    _, more = read_logs(savedir / "logs.tsv")
    assert len(more) > len(rows) and _same_rows(more[: len(rows)], rows)
    files = sorted(savedir.glob(EVENT_FILES))
    assert len(files) == 2 and first[0] in files  # a file of its own beside the first
    runs = tensorboard_runs(savedir)
    assert_tensorboard_has_the_rows(runs["."], more)
    assert runs["."]["sps"][-1][0] == checkpoint_steps(savedir) >= 4000


def test_tensorboard_hides_the_rows_a_killed_run_logged_past_its_checkpoint(tmp_path):
    """A run killed at step 30 after a checkpoint at 20 resumes from 20: logs.tsv keeps
    its row at 30, TensorBoard shows the resumed run's instead."""
    columns = ("step", "sps", "time")
    killed = TensorBoardLog(tmp_path, columns)
    for step in (10, 20, 30):
        killed.write({"step": step, "sps": 1.0, "time": step / 10})
    killed.close()
    resumed = TensorBoardLog(tmp_path, columns, resumed_at=20)
    for step in (30, 40):
        resumed.write({"step": step, "sps": 2.0, "time": step / 10})
    resumed.close()
    rows = [{"step": s, "sps": v, "time": s / 10} for s, v in ((10, 1), (20, 1), (30, 2), (40, 2))]
    assert_tensorboard_has_the_rows(tensorboard_runs(tmp_path)["."], rows)


# -- a savedir owns its config; a finished run says so -------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_savedir_resumes_with_its_own_config(tmp_path):
    savedir = tmp_path / "run"
    # hidden_size differs from the a2c/cartpole tuning, so defaults cannot pass for it.
    check_ok(
        run([*QUICK, "agent.hidden_size=32", "total_steps=2000", f"savedir={savedir}"], tmp_path)
    )
    first = load_yaml(savedir / "config.yaml")
    _, rows = read_logs(savedir / "logs.tsv")
    step = checkpoint_steps(savedir)
    assert step >= 2000

    # Finished: says so and how to go on; exit 0; nothing written.
    before = snapshot(savedir)
    out = check_ok(run([f"savedir={savedir}"], tmp_path))
    assert f"{savedir} has finished" in out and "total_steps=2000" in out, out
    assert "raise total_steps" in out and f"moolib-run savedir={savedir} total_steps=" in out
    assert snapshot(savedir) == before

    # Overrides that the checkpoint cannot take: one line naming the savedir, what it
    # holds and what was asked; exit 2; the savedir untouched.
    for asked, holds in [
        ("agent=vtrace", "holds a2c on cartpole"),
        ("agent.hidden_size=64", "agent.hidden_size=32"),
    ]:
        line = one_error_line(run([f"savedir={savedir}", asked, "total_steps=9000"], tmp_path))
        assert str(savedir) in line and holds in line and asked.split("=")[0] in line, line
        assert snapshot(savedir) == before, asked
    line = one_error_line(run([f"savedir={savedir}", "+agent.lr=1"], tmp_path))
    assert "unknown key agent.lr" in line and "agent.optimizer.learning_rate" in line, line
    assert snapshot(savedir) == before

    # --cfg job shows what a resume would train with.
    shown = yaml.safe_load(check_ok(run([f"savedir={savedir}", "--cfg", "job"], tmp_path)))
    assert shown["agent"]["name"] == "a2c" and shown["agent"]["hidden_size"] == 32
    assert shown["env"]["name"] == "cartpole" and shown["total_steps"] == 2000

    # A resume with an override: the saved settings plus that override, listed and logged.
    out = check_ok(run([f"savedir={savedir}", "total_steps=4000"], tmp_path))
    assert f"moolib-run: resuming {savedir}" in out and "total_steps=4000 (was 2000)" in out, out
    assert f"at step {step}" in out, out
    cfg = load_yaml(savedir / "config.yaml")
    assert cfg["agent"] == first["agent"] and cfg["env"] == first["env"]
    assert cfg["group"] == first["group"] and cfg["total_steps"] == 4000
    resumes = load_yaml(savedir / "resumes.yaml")
    assert len(resumes) == 1 and resumes[0]["step"] == step
    assert resumes[0]["overrides"] == ["total_steps=4000"]
    assert resumes[0]["changed"] == {"total_steps": {"from": 2000, "to": 4000}}
    _, rows2 = read_logs(savedir / "logs.tsv")
    assert len(rows2) > len(rows) and rows2[len(rows)]["step"] >= step
    assert checkpoint_steps(savedir) >= 4000

    # Another scaling mode resumes the same experiment: its peers read the savedir's config.
    # A key only the new mode has (scaling.actors: scaling=single lacks it) may be set
    # too, before or after the choice.
    out = check_ok(
        run(
            [
                f"savedir={savedir}",
                "scaling.actors=3",
                "scaling=local",
                "scaling.peers=2",
                "total_steps=6000",
            ],
            tmp_path,
        )
    )
    cfg = load_yaml(savedir / "config.yaml")
    assert cfg["agent"] == first["agent"] and cfg["scaling"] == {
        "name": "local",
        "peers": 2,
        "actors": 3,
        "peer_prefix": "",
    }
    assert read_logs(savedir / "peer0" / "logs.tsv")[1]
    assert checkpoint_steps(savedir) >= 6000
    resumes = load_yaml(savedir / "resumes.yaml")
    assert [r["changed"].get("total_steps", {}).get("to") for r in resumes] == [4000, 6000]
    assert resumes[1]["changed"]["scaling"]["from"] == {"name": "single", "peers": 1}
    # The new mode's keys came with it: they are not settings new since the run started.
    assert "scaling.actors" not in resumes[1].get("added", {}), resumes[1]
    # The first run's settings are still there to read.
    assert resumes[0]["changed"]["total_steps"]["from"] == first["total_steps"]


@pytest.mark.timeout(600)
def test_sweep_points_resume_with_their_own_config(tmp_path):
    sweep = tmp_path / "sweep"
    lrs = "agent.optimizer.learning_rate=1e-3,3e-3"
    check_ok(
        run(
            ["-m", *QUICK, "agent.hidden_size=32", "total_steps=1000", lrs, f"savedir={sweep}"],
            tmp_path,
        )
    )
    first_steps = checkpoint_steps(sweep / "1")
    # Every point resumes its own a2c/cartpole config (not the default vtrace/breakout);
    # point 1 with a new learning rate.
    lrs = "agent.optimizer.learning_rate=1e-3,5e-3"
    out = check_ok(run(["-m", f"savedir={sweep}", lrs, "total_steps=2000"], tmp_path))
    for k, lr in [(0, 1e-3), (1, 5e-3)]:
        point = sweep / str(k)
        assert f"resuming {point}" in out, out
        cfg = load_yaml(point / "config.yaml")
        assert cfg["agent"]["name"] == "a2c" and cfg["agent"]["hidden_size"] == 32
        assert cfg["agent"]["optimizer"]["learning_rate"] == lr and cfg["total_steps"] == 2000
        assert checkpoint_steps(point) >= 2000
    # moolib-plot names both rates of point 1, and the step where the new one took over.
    labels = [r.label for r in plot.find_runs(sweep).runs]
    assert labels == [
        "learning_rate=0.001",
        f"learning_rate=0.003 (0.005 from step {first_steps:,})",
    ], labels
    # Finished points say so and are left alone.
    before = training_files(sweep)
    out = check_ok(run(["-m", f"savedir={sweep}", lrs], tmp_path))
    assert out.count("has finished") == 2, out
    assert training_files(sweep) == before
    # A point's folder is resumed as a run of its own; the sweep's folder is not a run.
    line = one_error_line(run([f"savedir={sweep}"], tmp_path))
    assert "sweep" in line and f"savedir={sweep / '0'}" in line, line


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
