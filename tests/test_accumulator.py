"""Tests of moolib.Accumulator: data-parallel training across peers.

Most tests run real peers: a broker (``python -m moolib.broker``) and trainers
(tests/helpers/acc_trainer.py), each in its own process, that train a small
model (with a BatchNorm, whose buffers must follow the leader) on deterministic
per-peer, per-step batches and print a JSON line per event with their model
version, leader, gradient stats and a hash of their parameters. The tests
check the parameters against one process training on the union of the batches,
and that members of one membership reporting the same model version always have
identical parameters, also across faults (kill -9 of a peer, of the leader, of
the broker; peers frozen with SIGSTOP) and joins.

The last tests drive several accumulators in this process, step by step, for
exact gradient values, stats and buffers, API contracts, and orderings that
real training only hits by chance (rounds completing while a peer is busy, a
round started just as membership changes).
"""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from helpers import acc_trainer
from helpers.util import DEADLINE, HELPERS, REPO, child_env, freeze, stop_process, wait_for

import moolib

TRAINER = HELPERS / "acc_trainer.py"
GROUP_TIMEOUT = 3.0  # seconds: a member silent this long is dropped


# ---------------------------------------------------------------------------
# Processes


class BrokerProcess:
    """``python -m moolib.broker ADDRESS`` in its own process; ``address`` is where it listens."""

    def __init__(self, log_path, address="127.0.0.1:0"):
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moolib.broker", address],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=child_env(),
            cwd=str(REPO),
            text=True,
        )
        self.lines: list[str] = []
        self._listening = threading.Event()
        self.address = None
        threading.Thread(target=self._read, daemon=True).start()
        end = time.monotonic() + DEADLINE
        while not self._listening.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"broker did not start (rc={self.proc.poll()}): {self.lines}")

    def _read(self):
        with open(self.log_path, "a") as log:
            for line in self.proc.stdout:
                log.write(line)
                log.flush()
                self.lines.append(line)
                m = re.match(r"Broker listening at (\S+)", line)
                if m:
                    self.address = m.group(1)
                    self._listening.set()

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Trainer:
    """A tests/helpers/acc_trainer.py process; ``events`` collects its JSON lines."""

    def __init__(self, log_dir, broker, index, **options):
        args = [sys.executable, str(TRAINER), "--broker", broker, "--index", str(index)]
        options.setdefault("timeout", GROUP_TIMEOUT)
        for key, value in options.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                args.append(flag)
            elif value is not None and value is not False:
                args += [flag, str(value)]
        self.index = index
        self.log_path = log_dir / f"trainer-{index}-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=child_env(),
            cwd=str(REPO),
            text=True,
        )
        self.events: list[dict] = []
        self._eof = False
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.wait(lambda e: e["event"] == "hello", what="hello")
        self.name = self.hello["name"]

    def _read(self):
        for line in self.proc.stdout:
            try:
                self.events.append(json.loads(line))
            except ValueError:
                self.events.append({"event": "garbage", "line": line})
        self._eof = True

    def log(self):
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def describe(self):
        rc, last = self.proc.poll(), self.events[-3:]
        return f"trainer {self.index} (rc={rc}), last events {last}, stderr:\n{self.log()}"

    def find(self, pred, since=0):
        """The first event from position ``since`` on that satisfies ``pred``, or None."""
        for e in self.events[since:]:
            if pred(e):
                return e
        return None

    def wait(self, pred, timeout=DEADLINE, since=0, what="event"):
        """Waits for an event satisfying ``pred`` (fails if the process exits first)."""
        end = time.monotonic() + timeout
        while True:
            e = self.find(pred, since)
            if e is not None:
                return e
            if self._eof:
                e = self.find(pred, since)
                if e is not None:
                    return e
                raise AssertionError(f"trainer exited before {what}: {self.describe()}")
            if time.monotonic() > end:
                raise AssertionError(
                    f"timed out after {timeout}s waiting for {what}: {self.describe()}"
                )
            time.sleep(0.05)

    def steps(self, since=0):
        return [e for e in self.events[since:] if e["event"] == "step"]

    def version(self):
        """The latest model version reported (-1 before any)."""
        for e in reversed(self.events):
            if "version" in e:
                return e["version"]
        return -1

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=DEADLINE)

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def stop(self):
        stop_process(self.proc)
        self._log.close()
        # Kept next to the logs for whoever debugs a failure.
        with open(self.log_path.with_suffix(".events"), "w") as f:
            for e in list(self.events):
                f.write(json.dumps(e) + "\n")


class Cluster:
    """A broker and trainers for one test; cleanup() ends every process it started."""

    def __init__(self, tmp_path):
        self.tmp_path = tmp_path
        self.brokers: list[BrokerProcess] = []
        self.trainers: list[Trainer] = []
        self.broker = None

    def start_broker(self, address="127.0.0.1:0"):
        self.broker = BrokerProcess(self.tmp_path / f"broker-{len(self.brokers)}.log", address)
        self.brokers.append(self.broker)
        return self.broker

    def restart_broker(self):
        """Starts a broker on the address of the last one (retrying while the port is busy)."""
        address = self.broker.address
        end = time.monotonic() + DEADLINE
        while True:
            try:
                return self.start_broker(address)
            except RuntimeError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.5)

    def trainer(self, index, **options):
        t = Trainer(self.tmp_path, self.broker.address, index, **options)
        self.trainers.append(t)
        return t

    def cleanup(self):
        for t in self.trainers:
            try:
                t.stop()
            except Exception:  # noqa: BLE001 - keep cleaning up
                t.proc.kill()
        for b in self.brokers:
            b.kill(signal.SIGTERM)


@pytest.fixture
def cluster(tmp_path, watchdog):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


# ---------------------------------------------------------------------------
# Checks


# Events at which a trainer is in sync with the leader of its membership (not,
# e.g., holding its own initial parameters before it got the leader's state).
SYNCED_EVENTS = {"connected", "state_loaded", "state_sent", "step", "saved"}


def assert_consistent(trainers):
    """Members of one membership (sync id) that report the same model version
    have identical parameters (hashes). Across memberships, histories may fork
    (a member that lost the others may train alone); they must be reconciled
    when members meet again, which this checks in the membership they meet in."""
    seen: dict[tuple, tuple] = {}
    for t in trainers:
        for e in list(t.events):
            if e["event"] not in SYNCED_EVENTS:
                continue
            key = (e["acc_sync"], e["version"])
            first = seen.setdefault(key, (e["hash"], t.index, e["event"]))
            assert first[0] == e["hash"], (
                f"model version {e['version']} (membership {e['acc_sync']}): trainer {t.index} "
                f"({e['event']}) has parameters {e['hash']} but trainer {first[1]} ({first[2]}) "
                f"had {first[0]}"
            )
    return seen


def wait_all(trainers, pred, what, since=None, timeout=DEADLINE):
    """Waits until every trainer reported an event satisfying ``pred``; returns them."""
    since = since or {}
    return [t.wait(pred, timeout=timeout, since=since.get(t.index, 0), what=what) for t in trainers]


def step_at_least(version, members=None):
    """A step to ``version`` or later, of ``members`` members summing all their gradients."""

    def pred(e):
        return (
            e["event"] == "step"
            and e["version"] >= version
            and (members is None or (e["members"], e["stats"]["num_gradients"]) == (members,) * 2)
        )

    return pred


def load_saved(trainers):
    saved = [
        torch.load(t.wait(lambda e: e["event"] == "saved", what="saved")["path"]) for t in trainers
    ]
    return saved


def reference_training(start, leader_index, steps, batch_size, contributions):
    """One process training on the union of the peers' batches.

    ``contributions`` lists the (peer index, round within the step) batches
    summed at every step. BatchNorm statistics follow the leader: only its
    forward passes update them.
    """
    model = acc_trainer.make_model(0)
    with torch.no_grad():
        for p, s in zip(model.parameters(), start, strict=True):
            p.copy_(s)
    opt = acc_trainer.make_optimizer(model)
    params = list(model.parameters())
    total = batch_size * len(contributions)
    for version in range(steps):
        # The mean loss over the union: the sum of batch_size * (gradient of
        # each batch's mean loss), over the total batch size.
        sums = [torch.zeros_like(p) for p in params]
        for index, sub in contributions:
            saved = [b.clone() for b in model.buffers()]
            opt.zero_grad()
            x, y = acc_trainer.batch(index, version, sub, batch_size)
            acc_trainer.loss_fn(model, x, y).backward()
            for s, p in zip(sums, params, strict=True):
                s.add_(p.grad * batch_size)
            if index != leader_index:
                with torch.no_grad():
                    for b, s in zip(model.buffers(), saved, strict=True):
                        b.copy_(s)
        for s, p in zip(sums, params, strict=True):
            p.grad = s / total
        opt.step()
    return model


def check_against_reference(trainers, steps, batch_size, contributions, stats):
    saved = load_saved(trainers)
    by_name = {t.name: t for t in trainers}
    leader = saved[0]["leader"]
    assert leader in by_name, f"leader {leader} is none of the trainers {list(by_name)}"
    for t, s in zip(trainers, saved, strict=True):
        assert s["version"] == steps
        assert s["leader"] == leader, f"trainer {t.index} follows {s['leader']}, not {leader}"
        # Everyone started from the leader's initial model and ends identical.
        assert acc_trainer.tensors_hash(s["start"]) == by_name[leader].hello["hash"]
        for a, b in zip(saved[0]["params"], s["params"], strict=True):
            assert torch.equal(a, b), f"trainer {t.index}: parameters differ from trainer 0's"
        for a, b in zip(saved[0]["buffers"], s["buffers"], strict=True):
            assert torch.equal(a, b), f"trainer {t.index}: buffers differ from trainer 0's"
        got = [e["stats"] for e in t.steps() if e["version"] <= steps]
        assert len(got) == steps and all(g == stats for g in got), f"trainer {t.index}: stats {got}"
    model = reference_training(
        saved[0]["start"], by_name[leader].index, steps, batch_size, contributions
    )
    for name, a, b in zip(
        [n for n, _ in model.named_parameters()],
        model.parameters(),
        saved[0]["params"],
        strict=True,
    ):
        assert torch.allclose(a.detach(), b, rtol=1e-4, atol=1e-5), (
            f"parameter {name} differs from single-process training: {a} vs {b}"
        )
    for name, a, b in zip(
        [n for n, _ in model.named_buffers()], model.buffers(), saved[0]["buffers"], strict=True
    ):
        assert torch.allclose(a.to(torch.float64), b.to(torch.float64), rtol=1e-4, atol=1e-5), (
            f"buffer {name} does not follow the leader's: {a} vs {b}"
        )
    # Sanity: training did something.
    assert not torch.equal(saved[0]["params"][0], saved[0]["start"][0])


# ---------------------------------------------------------------------------
# Training matches one process training on the union of the batches


@pytest.mark.parametrize("n", [2, 3])
def test_peers_match_single_process_training(cluster, n):
    steps, batch_size = 8, 4
    cluster.start_broker()
    trainers = [
        cluster.trainer(
            i,
            batch=batch_size,
            virtual_batch=n * batch_size,
            start_members=n,
            timeout=10,
            save_at=steps,
            out=cluster.tmp_path / f"out-{i}.pt",
        )
        for i in range(n)
    ]
    # Virtual batch = one round with every peer: step k sums every peer's batch k.
    contributions = [(i, 0) for i in range(n)]
    stats = {"batch_size": n * batch_size, "num_gradients": n, "num_skipped": 0}
    check_against_reference(trainers, steps, batch_size, contributions, stats)
    assert_consistent(trainers)


def test_virtual_batch_size_is_a_lower_bound_and_skips_count(cluster):
    # Two peers of batch 2, virtual batch 5: peer 1 skips the first round of
    # every step, so a step sums round 0 (peer 0: 2 samples, below 5) and
    # round 1 (both: 4 more) -> 6 samples from 3 gradients, 1 skipped.
    steps, batch_size = 6, 2
    cluster.start_broker()
    options = dict(batch=batch_size, virtual_batch=5, start_members=2, timeout=10, save_at=steps)
    trainers = [
        cluster.trainer(0, out=cluster.tmp_path / "out-0.pt", **options),
        cluster.trainer(1, out=cluster.tmp_path / "out-1.pt", skip_first_round=True, **options),
    ]
    contributions = [(0, 0), (0, 1), (1, 1)]
    stats = {"batch_size": 6, "num_gradients": 3, "num_skipped": 1}
    check_against_reference(trainers, steps, batch_size, contributions, stats)
    assert_consistent(trainers)


def test_parallel_gradients_keep_peers_identical(cluster):
    cluster.start_broker()
    batch_size = 4
    trainers = [
        cluster.trainer(
            i,
            batch=batch_size,
            virtual_batch=2 * batch_size,
            parallel=2,
            start_members=2,
            timeout=10,
        )
        for i in range(2)
    ]
    wait_all(trainers, step_at_least(40), "40 steps with 2 gradient rounds in flight")
    assert_consistent(trainers)
    # Rounds are summed in order until the virtual batch size: one round a step.
    stats = {"batch_size": 2 * batch_size, "num_gradients": 2, "num_skipped": 0}
    for t in trainers:
        for e in t.steps():
            assert e["stats"] == stats, e


# ---------------------------------------------------------------------------
# Leader election


def test_highest_model_version_leads(cluster):
    cluster.start_broker()
    options = dict(start_members=3, timeout=10)
    first = cluster.trainer(0, **options)
    first.wait(lambda e: e["event"] == "connected" and e["is_leader"], what="leading alone")
    second = cluster.trainer(1, **options)
    loaded = second.wait(lambda e: e["event"] == "state_loaded", what="the first peer's state")
    assert loaded["version"] == 0 and loaded["leader"] == first.name, loaded
    assert loaded["hash"] == first.hello["hash"]
    # A third peer with a higher model version (say, from a checkpoint) joins:
    # it leads, and both others get its state.
    high = cluster.trainer(2, model_version=100, **options)
    trainers = [first, second, high]
    wait_all(trainers, step_at_least(110, members=3), "training from version 100")
    for t in (first, second):
        loaded = t.wait(lambda e: e["event"] == "state_loaded" and e["version"] > 0, what="state")
        assert loaded["version"] == 100 and loaded["leader"] == high.name, loaded
        assert loaded["hash"] == high.hello["hash"], loaded  # its initial parameters
    for t in trainers:
        first_step = t.steps()[0]
        assert first_step["version"] == 101, first_step
        assert first_step["leader"] == high.name, first_step
        assert first_step["is_leader"] == (t is high), first_step
    assert_consistent(trainers)


# ---------------------------------------------------------------------------
# Faults


def start_three(cluster, steps=10):
    cluster.start_broker()
    trainers = [cluster.trainer(i, start_members=3, step_sleep=0.005) for i in range(3)]
    wait_all(trainers, step_at_least(steps, members=3), f"{steps} steps with 3 members")
    return trainers


def wait_trained_after(trainers, what, steps=10, members=None):
    """Waits until every trainer stepped ``steps`` past the highest version seen so far."""
    since = {t.index: len(t.events) for t in trainers}
    target = max(t.version() for t in trainers) + steps
    return wait_all(trainers, step_at_least(target, members), what, since=since)


@pytest.mark.parametrize("victim", ["follower", "leader"])
def test_training_goes_on_after_a_peer_is_killed(cluster, victim):
    trainers = start_three(cluster)
    leader = trainers[0].steps()[-1]["leader"]
    assert all(t.steps()[-1]["leader"] == leader for t in trainers)
    dead = next(t for t in trainers if (t.name == leader) == (victim == "leader"))
    survivors = [t for t in trainers if t is not dead]
    dead.kill()
    last = wait_trained_after(survivors, f"training on without the {victim}", members=2)
    assert_consistent(cluster.trainers)
    assert last[0]["leader"] in {t.name for t in survivors}, last
    assert last[0]["leader"] == last[1]["leader"], last


@pytest.mark.parametrize("how", ["sigstop", "hung_loop"])
def test_a_member_that_stops_calling_update_is_dropped_then_rejoins(cluster, how):
    """Four members; one stops calling update() with its process alive (frozen
    by SIGSTOP, or its loop hung while its core threads run on): the other
    three drop it and train on; once it calls update() again it rejoins."""
    cluster.start_broker()
    trainers = [cluster.trainer(i, start_members=4, step_sleep=0.005) for i in range(4)]
    wait_all(trainers, step_at_least(5, members=4), "5 steps with 4 members")
    stuck, others = trainers[3], trainers[:3]
    if how == "sigstop":
        freeze(stuck.proc.pid)
    else:
        stuck.send("pause")
        stuck.wait(lambda e: e["event"] == "paused", what="the loop paused")
    wait_trained_after(others, f"3 members training on ({how})", members=3)
    assert stuck.alive()
    if how == "sigstop":
        stuck.proc.send_signal(signal.SIGCONT)
    else:
        stuck.send("resume")
    wait_trained_after(trainers, "4 members training together again", members=4)
    assert_consistent(cluster.trainers)


def test_peer_joining_mid_training_gets_the_state(cluster):
    cluster.start_broker()
    trainers = [cluster.trainer(i, start_members=2, step_sleep=0.005) for i in range(2)]
    wait_all(trainers, step_at_least(10, members=2), "10 steps with 2 members")
    late = cluster.trainer(2, step_sleep=0.005)
    loaded = late.wait(lambda e: e["event"] == "state_loaded", what="the state")
    assert loaded["version"] >= 10 and loaded["hash"] != late.hello["hash"], loaded
    everyone = [*trainers, late]
    wait_trained_after(everyone, "training with the new peer", members=3)
    # Its parameters at the version it loaded are those the others had there.
    there = [e for t in trainers for e in list(t.events) if e.get("version") == loaded["version"]]
    assert there and all(e["hash"] == loaded["hash"] for e in there), (loaded, there)
    assert_consistent(everyone)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_peers_started_together_hold_the_leaders_model(cluster, transport):
    """docs/library.md's loop in two processes started together, whose models
    start from different seeds: they meet in the group's first membership (the
    broker's join window), the one that does not lead loads the leader's state
    before it offers gradients, and both end at model version 10 with the same
    weights, bit for bit (issue 51: each used to train alone from its own
    weights, without a word)."""
    broker = cluster.start_broker()
    peers, outs = [], []
    try:
        for seed in (1, 2):
            out = cluster.tmp_path / f"docs-loop-{seed}.json"
            args = ["--broker", broker.address, "--seed", str(seed), "--transport", transport]
            proc = subprocess.Popen(
                [sys.executable, str(HELPERS / "docs_acc_loop.py"), *args, "--out", str(out)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=child_env(),
                cwd=str(REPO),
                text=True,
            )
            peers.append(proc)
            outs.append(out)
        for proc in peers:
            assert proc.stdout.readline().strip() == "ready"
        for proc in peers:  # go, together
            proc.stdin.write("go\n")
            proc.stdin.flush()
        for proc in peers:
            assert proc.stdout.readline().strip() == "done"
        for proc in peers:  # leave once both are done
            proc.stdin.write("close\n")
            proc.stdin.flush()
        for proc in peers:
            assert proc.wait(timeout=DEADLINE) == 0
    finally:
        for proc in peers:
            stop_process(proc)
    first, second = (json.loads(out.read_text()) for out in outs)
    assert first["initial"] != second["initial"]
    assert sorted(first["events"] + second["events"]) == ["loaded", "sent"], (first, second)
    assert first["final"] == second["final"]


@pytest.mark.parametrize("order", sorted(acc_trainer.ORDERS))
def test_every_call_order_trains_through_a_late_join_and_a_killed_leader(cluster, order):
    """The loop's calls in docs/library.md's order, in the original example's
    (skip while not connected, first) and with gradients before the state:
    each trains, takes in a late peer and goes on after the leader dies."""
    cluster.start_broker()
    first = [cluster.trainer(i, start_members=2, step_sleep=0.005, order=order) for i in range(2)]
    wait_all(first, step_at_least(5, members=2), f"5 steps with 2 members ({order})")
    late = cluster.trainer(2, step_sleep=0.005, order=order)
    loaded = late.wait(lambda e: e["event"] == "state_loaded", what="the late peer's state")
    assert loaded["hash"] != late.hello["hash"], loaded
    everyone = [*first, late]
    last = wait_trained_after(everyone, "training with the late peer", members=3)
    leader = last[0]["leader"]
    dead = next(t for t in everyone if t.name == leader)
    dead.kill()
    survivors = [t for t in everyone if t is not dead]
    last = wait_trained_after(survivors, "training on after the leader died", members=2)
    assert last[0]["leader"] == last[1]["leader"] != leader, last
    assert_consistent(cluster.trainers)


def test_peers_that_trained_apart_are_reconciled_when_they_meet(cluster):
    """Two peers at the same model version each train one step alone (the other
    one frozen and dropped from the group): when they meet again, at equal model
    versions, their parameters differ, and one must get the other's state."""
    cluster.start_broker()
    a, b = (cluster.trainer(i, start_members=2, stop_at=5) for i in range(2))
    wait_all([a, b], step_at_least(5, members=2), "5 steps together")

    def alone_one_step(t, other):
        since = len(t.events)
        freeze(other.proc.pid)
        t.send("stop_at 6")
        step = t.wait(
            lambda e: e["event"] == "step" and e["members"] == 1, since=since, what="a step alone"
        )
        assert step["version"] == 6, step
        return step

    try:
        step_a = alone_one_step(a, b)
        # a stops before b wakes: b must not rejoin a in between.
        freeze(a.proc.pid)
        b.proc.send_signal(signal.SIGCONT)
        step_b = alone_one_step(b, a)
    finally:
        a.proc.send_signal(signal.SIGCONT)
        b.proc.send_signal(signal.SIGCONT)
    assert step_a["hash"] != step_b["hash"]  # different batches: different models
    since = {t.index: len(t.events) for t in (a, b)}
    met = wait_all(
        [a, b],
        lambda e: e["event"] == "connected" and e["members"] == 2,
        "meeting again",
        since=since,
    )
    assert met[0]["version"] == met[1]["version"] == 6, met
    assert met[0]["acc_sync"] == met[1]["acc_sync"], met
    assert met[0]["hash"] == met[1]["hash"], f"the peers met with different models: {met}"
    for t in (a, b):
        t.send("stop_at none")
    wait_trained_after([a, b], "training together again", members=2)
    assert_consistent([a, b])


def test_training_goes_on_after_the_broker_restarts(cluster):
    trainers = start_three(cluster)
    address = cluster.broker.address
    cluster.broker.kill()
    since = {t.index: len(t.events) for t in trainers}
    wait_all(trainers, lambda e: e["event"] == "disconnected", "losing the broker", since=since)
    broker = cluster.restart_broker()
    assert broker.address == address
    wait_trained_after(trainers, "training after the broker restarted", members=3)
    assert_consistent(trainers)


# ---------------------------------------------------------------------------
# One process, several accumulators: exact values and API contracts


class _Peer:
    """An Accumulator over one parameter vector and one buffer, in this process."""

    def __init__(self, broker_address, weight, buffer):
        self.w = torch.nn.Parameter(torch.tensor(weight))
        self.buf = torch.tensor(buffer)
        self.acc = moolib.Accumulator("acc_local", [self.w], [self.buf])
        self.acc.group.set_timeout(10)
        self.acc.connect(broker_address)
        self.received = []

    def poll(self):
        """One turn of a training loop, without the gradients."""
        self.acc.update()
        if self.acc.wants_state():
            self.acc.set_state({"w": self.w.detach().clone(), "note": "from the leader"})
        if self.acc.has_new_state():
            st = self.acc.state()
            self.received.append(st)
            with torch.no_grad():
                self.w.copy_(st["w"])

    def reduce(self, grad, batch_size):
        self.w.grad = torch.tensor(grad)
        self.acc.reduce_gradients(batch_size)

    def close(self):
        self.acc.group.close()
        self.acc.rpc.close()


@pytest.fixture
def local_broker():
    broker = moolib.Broker()
    address = broker.listen("127.0.0.1:0")
    stop = threading.Event()

    def run():
        while not stop.wait(0.05):
            broker.update()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield address
    finally:
        stop.set()
        thread.join(timeout=DEADLINE)
        broker.close()


@pytest.fixture
def make_peer(local_broker, watchdog):
    made = []

    def make(weight, buffer=(0.0,)):
        p = _Peer(local_broker, list(weight), list(buffer))
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.close()


def poll_until(peers, cond, what):
    def step():
        for p in peers:
            p.poll()
        return cond()

    return wait_for(step, what=what)


def connect_all(peers):
    poll_until(
        peers,
        lambda: all(p.acc.connected() and len(p.acc.group.members()) == len(peers) for p in peers),
        f"{len(peers)} accumulators connected",
    )


def test_exact_gradients_stats_and_buffers(make_peer):
    a = make_peer([0.0, 0.0, 0.0], [1.0, 2.0])
    b = make_peer([9.0, 9.0, 9.0], [7.0, 8.0])
    peers = [a, b]
    assert not a.acc.connected() and not a.acc.wants_gradients()
    with pytest.raises(RuntimeError):
        a.acc.skip_gradients()
    with pytest.raises(RuntimeError):
        a.acc.state()

    connect_all(peers)
    leader = a.acc.get_leader()
    assert leader == b.acc.get_leader() and leader in (a.acc.rpc.get_name(), b.acc.rpc.get_name())
    lead, follow = (a, b) if a.acc.is_leader() else (b, a)
    assert not follow.acc.is_leader()
    # The follower got the leader's state.
    assert follow.received and follow.received[-1]["note"] == "from the leader"
    assert torch.equal(follow.w.detach(), lead.w.detach())
    assert a.acc.model_version() == b.acc.model_version() == 0

    for p in peers:
        p.acc.set_virtual_batch_size(10)
        with pytest.raises(ValueError):
            p.acc.reduce_gradients(0)
        with pytest.raises(ValueError):
            p.acc.set_virtual_batch_size(0)
        with pytest.raises(ValueError):
            p.acc.set_parallel_gradients(0)
    assert all(p.acc.wants_gradients() for p in peers)

    # Round 1: the leader sends 4 samples, the follower skips: 4 < 10.
    lead.reduce([1.0, 2.0, 3.0], 4)
    follow.acc.skip_gradients()
    assert not lead.acc.wants_gradients()  # one round in flight at most
    with pytest.raises(RuntimeError):
        lead.acc.skip_gradients()
    poll_until(peers, lambda: all(p.acc.wants_gradients() for p in peers), "round 1")
    assert not any(p.acc.has_gradients() for p in peers)
    # The follower's buffers now are the leader's.
    assert torch.equal(follow.buf, lead.buf)

    # Round 2: 2 + 6 more samples: 12 >= 10, the sum is applied.
    lead.buf += 1
    leader_buf = lead.buf.clone()
    lead.reduce([0.0, 0.0, 1.0], 2)
    follow.reduce([5.0, 5.0, 5.0], 6)
    poll_until(peers, lambda: all(p.acc.has_gradients() for p in peers), "round 2")
    expected = (4 * torch.tensor([1.0, 2.0, 3.0]) + 2 * torch.tensor([0.0, 0.0, 1.0]) + 30) / 12
    for p in peers:
        assert torch.allclose(p.w.grad, expected), (p.w.grad, expected)
        assert p.acc.get_gradient_stats() == {
            "batch_size": 12,
            "num_gradients": 3,
            "num_skipped": 1,
        }
    assert torch.equal(a.w.grad, b.w.grad)
    assert torch.equal(follow.buf, leader_buf)
    # has_gradients holds until zero_gradients, which bumps the version.
    for _ in range(5):
        for p in peers:
            p.poll()
    assert all(p.acc.has_gradients() and not p.acc.wants_gradients() for p in peers)
    for p in peers:
        p.acc.zero_gradients()
        assert not p.acc.has_gradients()
        assert p.acc.model_version() == 1
        assert torch.equal(p.w.grad, torch.zeros(3))
    assert all(p.acc.wants_gradients() for p in peers)


def test_connected_with_the_leaders_state_until_it_is_read(make_peer, local_broker):
    """As in the original: a follower is connected as soon as the leader's
    state arrived, and has_new_state() holds from then until state() is read;
    meanwhile it neither offers gradients nor sends state."""
    lead = make_peer([1.0, 2.0])
    poll_until([lead], lambda: lead.acc.connected(), "the first peer connected")
    assert lead.acc.is_leader() and not lead.acc.has_new_state()
    lead.acc.set_model_version(3)
    follower = moolib.Accumulator(
        "acc_local", [torch.nn.Parameter(torch.zeros(2))], [torch.zeros(1)]
    )
    follower.connect(local_broker)
    try:

        def follower_connected():
            lead.poll()
            follower.update()
            return follower.connected()

        wait_for(follower_connected, what="the follower connected")
        assert follower.has_new_state()
        assert follower.model_version() == 3
        assert follower.get_leader() == lead.acc.rpc.get_name()
        assert not follower.wants_gradients() and not follower.wants_state()
        with pytest.raises(RuntimeError, match="state"):
            follower.skip_gradients()
        for _ in range(3):  # still there, however often update() runs
            follower.update()
            assert follower.connected() and follower.has_new_state()
        assert follower.state()["note"] == "from the leader"
        assert not follower.has_new_state()
        with pytest.raises(RuntimeError):
            follower.state()
        assert follower.connected() and follower.wants_gradients()
    finally:
        follower.group.close()
        follower.rpc.close()


def _refusals(accs):
    """Calls update() on every accumulator until each raised; returns the errors."""
    errors = [None] * len(accs)

    def all_raised():
        for i, acc in enumerate(accs):
            try:
                acc.update()
            except moolib.ModelMismatchError as e:
                assert errors[i] is None, f"raised twice: {errors[i]} / {e}"
                errors[i] = str(e)
        return all(errors)

    wait_for(all_raised, what="a ModelMismatchError from every member's update()")
    return errors


@pytest.mark.parametrize(
    ("shapes", "expected"),
    [
        ([[(10,)], [(5,), (10,)]], "'{a}' has 1 parameters, '{b}' has 2"),
        ([[(2, 3)], [(3, 2)]], "parameter 0 is float32[2, 3] on '{a}' and float32[3, 2] on '{b}'"),
    ],
    ids=["count", "shape"],
)
def test_peers_with_different_models_are_refused_on_every_member(local_broker, shapes, expected):
    """Two peers of one group whose models differ get a clear error on both,
    once, rather than electing forever or summing mismatched gradients."""
    models = [[torch.nn.Parameter(torch.zeros(s)) for s in model] for model in shapes]
    accs = [moolib.Accumulator("acc_mismatch", m, []) for m in models]
    try:
        for acc in accs:
            acc.group.set_timeout(10)
            acc.connect(local_broker)
        names = [acc.rpc.get_name() for acc in accs]
        for me, error in enumerate(_refusals(accs)):
            a, b = names[me], names[1 - me]
            assert "accumulator 'acc_mismatch' of group 'acc_mismatch'" in error, error
            assert "peers have different models" in error, error
            if me == 0:
                assert expected.format(a=a, b=b) in error, error
            else:
                assert f"on '{a}'" in error or f"'{a}' has" in error, error
        # Refused, not livelocked: quiet, unconnected and not electing again.
        sync_ids = [acc.group.sync_id() for acc in accs]
        for _ in range(20):
            for acc in accs:
                acc.update()
                assert not acc.connected() and not acc.wants_gradients()
            time.sleep(0.01)
        assert [acc.group.sync_id() for acc in accs] == sync_ids
        # Once the odd one leaves, the other trains on alone.
        accs[1].group.close()
        wait_for(lambda: accs[0].update() or accs[0].connected(), what="connected alone")
    finally:
        for acc in accs:
            acc.group.close()
            acc.rpc.close()


def test_a_state_that_never_comes_is_reported_and_the_peer_elects_again(
    make_peer, local_broker, caplog
):
    """A leader whose loop never calls set_state(): the waiting peer does not
    wait forever; it logs what it waits for and elects again, and takes the
    state once the leader sends it."""
    lead = make_peer([1.0, 2.0])
    poll_until([lead], lambda: lead.acc.connected(), "the leader connected")
    lead.acc.set_model_version(5)
    follower = moolib.Accumulator(
        "acc_local", [torch.nn.Parameter(torch.zeros(2))], [torch.zeros(1)]
    )
    follower.group.set_collective_timeout(2)
    follower.connect(local_broker)
    try:
        with caplog.at_level(logging.ERROR, logger="moolib"):

            def reported():
                lead.acc.update()  # but never wants_state()/set_state()
                follower.update()
                return "no state from the leader" in caplog.text

            wait_for(reported, what="the missing state reported")
        assert f"leader '{lead.acc.rpc.get_name()}'" in caplog.text, caplog.text
        assert "wants_state() and set_state()" in caplog.text, caplog.text
        assert not follower.connected()

        def connected():
            lead.poll()
            follower.update()
            return follower.connected()

        wait_for(connected, what="the follower connected once the state was sent")
        assert follower.state()["note"] == "from the leader"
    finally:
        follower.group.close()
        follower.rpc.close()


def wait_gradients(peers, expected, what):
    """Polls until every peer has gradients; each must be ``expected`` (checked as they come)."""
    expected = torch.tensor(expected)
    end = time.monotonic() + DEADLINE
    while not all(p.acc.has_gradients() for p in peers):
        for i, p in enumerate(peers):
            p.poll()
            if p.acc.has_gradients():
                got = p.w.grad.tolist()
                assert torch.allclose(p.w.grad, expected), (
                    f"{what}: peer {i} got gradients {got}, expected {expected.tolist()}"
                )
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_parallel_rounds_fill_the_virtual_batch_in_order(make_peer):
    """With 2 rounds in flight, a step takes the rounds in order up to the virtual
    batch size: the same rounds on every peer, whenever each calls update()."""
    a = make_peer([0.0, 0.0])
    b = make_peer([0.0, 0.0])
    connect_all([a, b])
    for p in (a, b):
        p.acc.set_virtual_batch_size(2)
        p.acc.set_parallel_gradients(2)
    a.reduce([1.0, 0.0], 1)
    b.reduce([0.0, 1.0], 1)
    assert a.acc.wants_gradients()
    a.reduce([10.0, 0.0], 1)
    assert not a.acc.wants_gradients()
    # Round 1 (2 samples) completes the virtual batch; b uses it and goes on.
    wait_gradients([b], [0.5, 0.5], "round 1 on b")
    assert b.acc.get_gradient_stats()["batch_size"] == 2
    b.acc.zero_gradients()
    b.reduce([0.0, 10.0], 1)
    wait_gradients([b], [5.0, 5.0], "round 2 on b")
    # a calls update() only once both its rounds are done (white box: the
    # AllReduce objects of the rounds in flight), as a busy peer may.
    rounds = list(a.acc._rounds)
    wait_for(lambda: all(getattr(r, "future", r).done() for r in rounds), what="a's rounds")
    wait_gradients([a], [0.5, 0.5], "round 1 on a")
    assert a.acc.get_gradient_stats()["batch_size"] == 2, a.acc.get_gradient_stats()
    a.acc.zero_gradients()
    wait_gradients([a], [5.0, 5.0], "round 2 on a")


def test_round_started_as_a_peer_joins_does_not_shift_rounds(make_peer):
    """A peer whose group learned of a new member in the background, before its
    accumulator's update() noticed, starts a round: the next rounds must still
    pair up the same way on every member."""
    a = make_peer([0.0, 0.0, 0.0])
    b = make_peer([0.0, 0.0, 0.0])
    connect_all([a, b])
    c = make_peer([0.0, 0.0, 0.0])
    # b and c go on (c joins); a's accumulator is not updated meanwhile.
    poll_until([b, c], lambda: len(a.acc.group.members()) == 3, "a's group seeing c")
    # Gradients computed before noticing (a loop that checked wants_gradients()
    # just before the membership changed does this).
    try:
        a.reduce([100.0, 100.0, 100.0], 1)
    except RuntimeError:
        pass  # refusing a round outside the elected membership is fine too
    peers = [a, b, c]
    poll_until(
        peers,
        lambda: (
            all(p.acc.connected() and p.acc.wants_gradients() for p in peers)
            and all(len(p.acc.group.members()) == 3 for p in peers)
        ),
        "3 accumulators connected",
    )
    for p, g in zip(peers, ([3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0]), strict=True):
        p.reduce(g, 1)
    wait_gradients(peers, [1.0, 1.0, 1.0], "the first round of 3 peers")
    stats = [p.acc.get_gradient_stats() for p in peers]
    assert stats == [{"batch_size": 3, "num_gradients": 3, "num_skipped": 0}] * 3, stats


def test_update_survives_membership_changing_under_it(make_peer):
    """Membership changes on a core thread at any time: update() may find the
    group active and, a moment later, a new membership without this peer (it
    was just dropped, e.g. after a stall). It must not raise, and the
    accumulator must recover once it is a member again."""
    a = make_peer([0.0])
    b = make_peer([0.0])
    connect_all([a, b])
    group, me = a.acc.group, a.acc.rpc.get_name()
    real_members, real_sync_id = group.members, group.sync_id
    # That interleaving, pinned down: the next membership, read right after
    # active(), lacks this peer.
    group.members = lambda: [m for m in real_members() if m != me]
    group.sync_id = lambda: real_sync_id() + 1
    try:
        a.acc.update()
    finally:
        del group.members, group.sync_id
    assert not a.acc.connected()
    # Membership changes again for real (a was dropped and comes back, or, as
    # here, another peer joins): everyone elects afresh and trains on.
    c = make_peer([0.0])
    peers = [a, b, c]
    connect_all(peers)
    for p, g in zip(peers, ([3.0], [6.0], [9.0]), strict=True):
        p.reduce(g, 1)
    wait_gradients(peers, [6.0], "a round after recovering")


def test_accumulator_needs_parameters():
    with pytest.raises(ValueError):
        moolib.Accumulator("acc_empty", [], [])


def test_arguments_are_checked_as_the_original_binds_them():
    """Counts are ints, as the original's C++ signatures take them: a float is a
    TypeError rather than a fractional batch; parameters and buffers are tensors."""
    with pytest.raises(TypeError, match="Accumulator parameters must be tensors, got int at"):
        moolib.Accumulator("acc_ints", [1, 2], [])
    with pytest.raises(TypeError, match="Accumulator buffers must be tensors, got str at index 1"):
        moolib.Accumulator("acc_bufs", [torch.zeros(2)], [torch.zeros(1), "b"])
    acc = moolib.Accumulator("acc_args", [torch.zeros(2, requires_grad=True)], [])
    for setter, what in (
        (acc.set_virtual_batch_size, "virtual batch size"),
        (acc.set_parallel_gradients, "parallel gradients"),
        (acc.reduce_gradients, "batch_size"),
    ):
        with pytest.raises(TypeError, match=f"{what} must be an int, got float"):
            setter(2.5)
        with pytest.raises(TypeError, match=f"{what} must be an int, got bool"):
            setter(True)
        with pytest.raises(ValueError, match=f"{what} must be at least 1, got 0"):
            setter(0)
    with pytest.raises(ValueError, match="model version must be at least 0, got -1"):
        acc.set_model_version(-1)
    acc.set_virtual_batch_size(np.int64(8))  # numpy's ints pass, as they do there
    acc.set_model_version(np.int64(4))
    assert acc.model_version() == 4 and type(acc.model_version()) is int


def test_close_leaves_the_group_and_closes_the_rpc_it_made(make_peer, local_broker):
    """close(): the others see the member leave at once (not after its timeout), the Rpc
    the accumulator made is closed, and a second close() does nothing. An accumulator
    over a group it was given leaves that group and its Rpc open: they are the caller's."""
    a, b = make_peer([1.0]), make_peer([2.0])
    connect_all([a, b])
    a.acc.close()
    a.acc.close()
    poll_until([b], lambda: b.acc.group.members() == [b.acc.rpc.get_name()], "b alone")
    with pytest.raises(RuntimeError, match="this Rpc is closed"):
        a.acc.rpc.connect(local_broker)
    assert not a.acc.connected()

    rpc = moolib.Rpc()
    try:
        group = moolib.Group(rpc, "acc_given")
        w = torch.nn.Parameter(torch.zeros(1))
        acc = moolib.Accumulator("acc_given", [w], [], group=group)
        acc.close()
        # The accumulator's function is gone; the caller's Rpc and group still work.
        assert not any("__moolib_accumulator" in f for f in rpc.debug_info()["functions"])
        rpc.connect(local_broker)

        def joined():
            group.update()
            return group.active()

        wait_for(joined, what="the given group joined")
        group.close()
    finally:
        rpc.close()


def test_wait_gradients_blocks_until_the_oldest_round_is_summed(make_peer):
    a = make_peer([0.0, 0.0])
    b = make_peer([0.0, 0.0])
    connect_all([a, b])
    for p in (a, b):
        p.acc.set_virtual_batch_size(2)
    assert a.acc.wait_gradients(0) is False  # no round in flight: at once
    a.reduce([1.0, 0.0], 1)
    # b has offered nothing yet: a's round cannot be summed.
    assert a.acc.wait_gradients(0.3) is False
    assert not a.acc.has_gradients()
    b.reduce([0.0, 1.0], 1)
    assert a.acc.wait_gradients(DEADLINE) is True
    a.acc.update()
    assert a.acc.has_gradients()
    assert a.w.grad.tolist() == [0.5, 0.5]
