"""``scaling=slurm`` against a real SLURM (the test cluster of
scripts/slurm-test-cluster.sh; tests/helpers/slurm_util.py says how to start it):
the launch itself: config checks, refused and stuck submissions, broker checks, keys and files."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest
from helpers.run_util import cfg_job, run, wait_for
from helpers.slurm_util import (  # noqa: F401 - the fixtures are used by name
    APEX,
    SLURM_ENV,
    SMALL,
    TOO_MANY_CPUS,
    needs_slurm,
    role_ids,
    savedirs_fixture,
    slurm_conf_fixture,
    states,
)
from moolib.launch import jobs as jobs_lib
from moolib.launch import slurm as slurm_lib
from moolib.launch import slurm_files

# Each test waits on SLURM jobs (half a minute to minutes): -m "not slow" leaves the
# file out of a quick run.
pytestmark = pytest.mark.slow


@needs_slurm
def test_a_refused_actor_array_cancels_the_jobs_already_submitted(tmp_path, savedirs):
    savedir = tmp_path / "refused"
    savedirs.append(savedir)
    # More array tasks than the cluster's MaxArraySize (1001 by default): sbatch
    # refuses the actors' array after the broker and the learner job were submitted.
    result = run([*APEX, "scaling.actors=2000", f"savedir={savedir}"], tmp_path, timeout=180)
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert "moolib-run: error: sbatch could not submit the actors job array (2000 jobs)" in out
    assert [role for _, role in jobs_lib.recorded_jobs(savedir)] == ["broker", "learner"]
    ids = role_ids(savedir)
    assert f"cancelled this launch's jobs: {ids['learner']}, {ids['broker']}" in out, out
    # Nothing is left waiting for actors that will never come.
    wait_for(
        lambda: set(states(savedir).values()) == {"CANCELLED"},
        60,
        "the broker and learner jobs cancelled",
    )


@needs_slurm
@pytest.mark.parametrize(
    "asks, what",
    [
        (f"scaling.cpus_per_task={TOO_MANY_CPUS}", "peer job"),
        (f"scaling.broker_cpus={TOO_MANY_CPUS}", "broker job"),
    ],
)
def test_a_job_slurm_can_never_start_stops_the_launch(tmp_path, savedirs, asks, what):
    savedir = tmp_path / "stuck"
    savedirs.append(savedir)
    result = run([*SMALL, asks, f"savedir={savedir}"], tmp_path, timeout=180)
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    assert re.search(
        rf"moolib-run: error: the {what} [0-9_]+ cannot start: SLURM holds it pending for "
        "PartitionConfig, which waiting does not change",
        out,
    ), out[-3000:]
    assert "moolib-run: cancelled this launch's jobs: " in out
    ids = [job for job, _ in jobs_lib.recorded_jobs(savedir)]
    wait_for(
        lambda: (
            not any(v["state"] in jobs_lib.ACTIVE_STATES for v in jobs_lib.job_states(ids).values())
        ),
        60,
        "the launch's jobs to leave the queue",
    )


@needs_slurm
def test_pending_array_tasks_are_seen_and_cancelled():
    """A pending array is one line in squeue and sacct (``12_[0-1]``) unless expanded:
    its tasks once read as unknown, and moolib-jobs --cancel left them queued."""
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--array=0-1", "-c", TOO_MANY_CPUS, "--wrap", "sleep 60"],
        env=SLURM_ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.strip().split(";")[0]
    tasks = [f"{array}_0", f"{array}_1"]
    try:
        wait_for(
            lambda: all(
                jobs_lib.job_states(tasks).get(t, {}).get("reason") == "PartitionConfig"
                for t in tasks
            ),
            60,
            "SLURM to give the tasks' pending reason",
        )
        info = jobs_lib.job_states(tasks)
        assert all(info[t]["state"] == "PENDING" for t in tasks), info
        assert jobs_lib.is_stuck(info[tasks[0]]["reason"])
        jobs_lib.cancel_jobs(tasks, grace=1)
        wait_for(lambda: not jobs_lib.job_states(tasks), 60, "the tasks to leave the queue")
    finally:
        subprocess.run(["scancel", array], env=SLURM_ENV, capture_output=True, timeout=60)


def test_slurm_config_composes_and_bad_values_name_their_key(tmp_path):
    cfg = cfg_job(tmp_path, "scaling=slurm")
    for key in ("partition", "time", "nodes", "gpus_per_task", "cpus_per_task", "mem"):
        assert key in cfg["scaling"]
    for key in ("constraint", "account", "qos", "additional_parameters", "wait", "max_failures"):
        assert key in cfg["scaling"]
    for bad, message in [
        (["scaling.time=0"], "scaling.time must be a positive integer"),
        (["scaling.max_failures=-1"], "scaling.max_failures must be an integer >= 0"),
        (["scaling.wait=yes"], "scaling.wait must be true or false, got 'yes'"),
        (["scaling.gpus_per_task=one"], "scaling.gpus_per_task must be an integer >= 0"),
        (
            ["scaling.peers=3", "scaling.tasks_per_node=2"],
            "scaling.peers (3) must be a multiple of the peers per job",
        ),
    ]:
        base = ["agent=a2c", "env=cartpole", "scaling=slurm", f"savedir={tmp_path}/r"]
        result = run([*base, *bad], tmp_path, timeout=120)
        assert result.returncode == 2 and message in result.stdout, (bad, result.stdout)


def test_slurm_config_accepts_cuda_without_a_local_gpu():
    """The launcher may run on a login node without GPUs; the jobs have them."""
    import moolib.launch.run  # noqa: F401 - registers the config's resolvers
    import torch
    from hydra import compose, initialize_config_module
    from moolib.launch import config

    overrides = ["agent=a2c", "env=cartpole", "device=cuda:0"]
    with initialize_config_module("moolib.conf", version_base=None):
        slurm = compose("config", [*overrides, "scaling=slurm"])
        single = compose("config", overrides)
    config.validate(slurm)
    if not torch.cuda.is_available():
        with pytest.raises(config.ConfigError, match="CUDA is not available"):
            config.validate(single)


def test_a_running_broker_job_whose_log_never_shows_means_no_shared_savedir(tmp_path, monkeypatch):
    """As when the compute node writes the savedir on its own disk: the job runs
    (sacct says so) but nothing it writes reaches the launcher."""
    import threading
    from types import SimpleNamespace

    job = SimpleNamespace(
        job_id="42",
        state="RUNNING",
        done=lambda: False,
        paths=SimpleNamespace(stdout=tmp_path / "slurm/42/42_0_log.out", stderr=None),
    )
    monkeypatch.setattr(slurm_lib, "SHARED_FS_GRACE", 1.0)
    with pytest.raises(RuntimeError, match="not on a filesystem shared with the compute nodes"):
        slurm_lib._wait_for_broker(job, tmp_path, "abc", 60.0, "key", threading.Event())
    # Once the log is there, the launcher keeps waiting for the broker file instead.
    job.paths.stdout.parent.mkdir(parents=True)
    job.paths.stdout.touch()
    with pytest.raises(TimeoutError, match="did not write"):
        slurm_lib._wait_for_broker(job, tmp_path, "abc", 3.0, "key", threading.Event())


def test_broker_check_fails_in_bounded_time_without_a_broker():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer"):
        slurm_lib.check_broker(f"127.0.0.1:{port}", 2.0)
    assert time.monotonic() - started < 10


def test_broker_check_passes_against_a_broker():
    from moolib.launch.local import EmbeddedBroker

    broker = EmbeddedBroker()
    try:
        slurm_lib.check_broker(broker.address, 30.0)
    finally:
        broker.close()


def test_moolib_jobs_without_recorded_jobs_says_so(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "moolib.launch.jobs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "no jobs recorded" in out.stderr
    # A savedir that is not there (a typo) is named as such.
    out = subprocess.run(
        [sys.executable, "-m", "moolib.launch.jobs", str(tmp_path / "typo")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and f"{tmp_path / 'typo'}: no such directory" in out.stderr


def test_auth_key_file_is_private_and_sets_the_key_of_new_rpcs(tmp_path):
    from moolib.launch.local import EmbeddedBroker

    import moolib

    assert not slurm_files.use_auth_key(tmp_path, "abc")  # no key for this launch
    path = slurm_files.write_auth_key(tmp_path, "abc", "s3cret")
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    keyless = EmbeddedBroker()
    try:
        with pytest.raises(TimeoutError):  # a keyless broker and a keyed peer: no link
            slurm_lib.check_broker(keyless.address, 3.0, "s3cret")
    finally:
        keyless.close()
    assert slurm_files.use_auth_key(tmp_path, "abc")
    try:
        keyed = EmbeddedBroker()  # its Rpc is created after use_auth_key: it has the key
        try:
            slurm_lib.check_broker(keyed.address, 60.0, "s3cret")
            with pytest.raises(TimeoutError):
                slurm_lib.check_broker(keyed.address, 3.0, "wrong")
        finally:
            keyed.close()
    finally:
        moolib.set_auth_key(None)


def test_broker_file_is_read_only_for_its_own_launch(tmp_path):
    assert slurm_files.read_broker_file(tmp_path, "abc") is None
    slurm_files.write_json_atomic(tmp_path / "broker.json", {"address": "h:1", "launch": "abc"})
    assert slurm_files.read_broker_file(tmp_path, "abc") == "h:1"
    assert slurm_files.read_broker_file(tmp_path, "other") is None  # a stale file from a rerun
    assert not list(tmp_path.glob(".*.tmp"))
