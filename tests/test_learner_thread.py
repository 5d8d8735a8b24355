"""The on-policy loop's two threads (docs/architecture.md, section 6): the actors act on
``PolicySlots`` while the learner thread learns and publishes; or one thread, the
acting thread learning between its steps (``agent.learner=inline``).

- the slots: an acting thread never sees a torn or older model while a learner thread
  publishes as fast as it can;
- a run stopped by SIGTERM (learning on a thread or inline) writes a checkpoint
  that resumes, and its actors' model version moves forward, never ahead of the
  learner's;
- an exception in the learner (its thread, or inline) ends the run with its
  traceback and a non-zero exit, with every env worker gone (it never hangs with
  the actors stepping).

Ctrl-C and SLURM's preemption take the same path as SIGTERM (the stop event):
tests/test_run_stop.py (Ctrl-C of two local peers) and tests/test_slurm_requeue.py (a
preempted peer requeued) run them through this loop too.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.run_util import (
    STOP_TIMEOUT,
    Run,
    alive,
    check_ok,
    read_logs,
    run,
    run_env,
    session_pids,
    wait_for,
)
from moolib.agents.registry import agent_config
from moolib.agents.runtime.onpolicy import learner_mode
from moolib.agents.runtime.policy_slots import PolicySlots
from moolib.conf.checks import ConfigError

HELPERS = Path(__file__).parent / "helpers"
CARTPOLE = ["agent=a2c", "env=cartpole", "device=cpu", "log_interval=0.5", "torch_threads=1"]
# Where the loop learns (agent.learner): on its own thread, or in the acting thread.
LEARNERS = ["thread", "inline"]


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_actors_see_whole_versions_moving_forward_while_the_learner_publishes(device):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model.register_buffer("count", torch.zeros(16))
    model.to(device)
    slots = PolicySlots(model, version=0)
    publishes = 3000
    failures: list[str] = []

    def learner() -> None:
        # On CUDA the learner works on a stream of its own, as the Trainer's does.
        stream = torch.cuda.Stream() if device == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for version in range(1, publishes + 1):
                with torch.no_grad():
                    for t in [*model.parameters(), *model.buffers()]:
                        t.fill_(version)  # every tensor of version v holds v
                slots.publish(model, version)

    def values(policy: torch.nn.Module) -> set[float]:
        tensors = [*policy.parameters(), *policy.buffers()]
        return {float(v) for t in tensors for v in t.detach().cpu().flatten()}

    thread = threading.Thread(target=learner)
    seen: list[int] = []
    thread.start()
    try:
        while thread.is_alive() or not seen or seen[-1] < publishes:
            with slots.acting() as (policy, version):
                before = values(policy)
                time.sleep(0)  # the learner runs meanwhile
                after = values(policy)
            # Version 0 is the model as it was built; every later one is uniform.
            if version > 0 and not before == after == {float(version)}:
                failures.append(f"version {version}: {sorted(before)[:3]} {sorted(after)[:3]}")
            seen.append(version)
    finally:
        thread.join()
    assert not failures, failures[:5]
    assert seen == sorted(seen), "the actors' version went back"
    assert seen[-1] == publishes == slots.version
    assert len(set(seen)) > 1  # the actors acted while the learner published


def _checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("learner", LEARNERS)
def test_sigterm_stops_with_a_checkpoint_that_resumes_and_actor_versions_move_forward(
    tmp_path, learner
):
    savedir = tmp_path / "run"
    args = [
        *CARTPOLE,
        f"agent.learner={learner}",
        "total_steps=100000000",
        "checkpoint_interval=100000",
        f"savedir={savedir}",
    ]
    r = Run(args, tmp_path, tmp_path / "first.out")
    try:
        wait_for(
            lambda: (
                (savedir / "logs.tsv").exists()
                and any(row["model_version"] >= 20 for row in read_logs(savedir / "logs.tsv")[1])
            ),
            240,
            "the run to learn 20 updates",
            proc=r,
        )
        r.proc.send_signal(signal.SIGTERM)
        code = r.wait(STOP_TIMEOUT)
        out = r.output()
    finally:
        r.finish()
    assert code != 0, out[-3000:]  # stopped before total_steps, and says so
    assert "Traceback" not in out, out[-5000:]
    _, rows = read_logs(savedir / "logs.tsv")
    ckpt = _checkpoint(savedir / "checkpoint.pt")
    assert ckpt["steps"] == int(rows[-1]["step"]) > 0
    assert ckpt["model_version"] == int(rows[-1]["model_version"])
    # The version the actors acted with: forward only, never ahead of the learner's.
    actor = [int(row["actor_model_version"]) for row in rows]
    assert actor == sorted(actor), actor
    assert all(row["actor_model_version"] <= row["model_version"] for row in rows), rows
    assert actor[-1] > 0

    # The same savedir resumes from that checkpoint and goes on from its step.
    more = ckpt["steps"] + 4000
    out2 = check_ok(run([*args[:-3], f"total_steps={more}", f"savedir={savedir}"], tmp_path))
    assert f"at step {ckpt['steps']}" in out2, out2[-3000:]
    _, rows2 = read_logs(savedir / "logs.tsv")
    resumed = rows2[len(rows) :]
    assert resumed and resumed[-1]["step"] >= more
    assert resumed[0]["model_version"] >= ckpt["model_version"]
    actor2 = [int(row["actor_model_version"]) for row in resumed]
    assert actor2 == sorted(actor2) and actor2[0] >= ckpt["model_version"], actor2


@pytest.mark.timeout(300)
@pytest.mark.parametrize("learner", LEARNERS)
def test_an_exception_in_the_learner_ends_the_run_with_its_traceback(tmp_path, learner):
    savedir = tmp_path / "run"
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                str(HELPERS / "failing_learner.py"),
                *CARTPOLE,
                f"agent.learner={learner}",
                "total_steps=100000000",
                f"savedir={savedir}",
            ],
            cwd=tmp_path,
            env=run_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        code = proc.wait(timeout=240)  # never hangs with the actors stepping
        wait_for(lambda: not session_pids(proc.pid), 30, "every process of the run to exit")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert code not in (0, None), text[-3000:]
    assert "Traceback" in text, text[-3000:]
    assert "RuntimeError: injected learner failure at model version 3" in text, text[-3000:]
    # The traceback reaches into the learner (its thread's loop, or the acting
    # thread's turns of it), where it was raised.
    where = "_learner_loop" if learner == "thread" else "in run"
    assert where in text and "_learner_step" in text and "_failing" in text, text[-3000:]
    assert not alive(proc.pid)


def _agent(**settings):
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="moolib.conf", version_base="1.3"):
        cfg = compose("config", overrides=["agent=vtrace", "env=cartpole"])
    return agent_config({**cfg.agent, **settings})


def test_auto_learns_inline_on_a_cpu_for_python_bound_networks_and_on_a_thread_otherwise():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    vector, frames = (4,), (4, 84, 84)
    auto = _agent()
    assert auto.learner == "auto"
    assert learner_mode(auto, cpu, vector) == "inline"  # auto: the MLP
    assert learner_mode(_agent(network="tiny"), cpu, frames) == "inline"
    assert learner_mode(auto, cpu, frames) == "thread"  # auto: the deep IMPALA network
    assert learner_mode(_agent(network="minatar"), cpu, (4, 10, 10)) == "thread"
    assert learner_mode(auto, cuda, vector) == "thread"
    # Set, it is kept whatever the network and device.
    assert learner_mode(_agent(learner="thread"), cpu, vector) == "thread"
    assert learner_mode(_agent(learner="inline"), cuda, frames) == "inline"
    with pytest.raises(ConfigError, match=r"agent.learner"):
        _agent(learner="process")
