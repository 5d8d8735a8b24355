"""API compatibility: code written for the original facebookresearch/moolib runs unchanged.

Every test here calls the public API (docs/library.md) the way a program
written for the original moolib does -- its names, argument orders and keyword
forms, the types it gets back, the errors it expects and when, and the call
orders of the original's example agent (examples/vtrace/experiment.py) -- on
real peers: Rpcs talking over real sockets, a real broker, EnvPool worker
processes, and (for the example in miniature) two training processes.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import queue
import sys
import threading
import time

import pytest
import torch
from helpers import toy_envs
from helpers.group_util import HELPERS, LineProcess
from helpers.util import DEADLINE, wait_for

import moolib

# ---------------------------------------------------------------------------
# Module surface


def test_module_names_and_helpers():
    for name in (
        "Rpc",
        "Future",
        "Queue",
        "RpcError",
        "Broker",
        "Group",
        "AllReduce",
        "Accumulator",
        "Batcher",
        "EnvPool",
        "EnvStepperFuture",
        "create_uid",
        "set_log_level",
        "set_logging",
        "set_max_threads",
    ):
        assert hasattr(moolib, name), f"moolib.{name} is missing"
    # Programs catch RuntimeError around calls (the original raised it).
    assert issubclass(moolib.RpcError, RuntimeError)

    uids = {moolib.create_uid() for _ in range(100)}
    assert len(uids) == 100
    assert all(isinstance(u, str) and len(u) >= 16 for u in uids)
    # A uid is a valid peer name (the original example names peers with one).
    rpc = moolib.Rpc()
    try:
        rpc.set_name(next(iter(uids)))
        assert rpc.get_name() in uids
    finally:
        rpc.close()

    moolib.set_max_threads(8)
    for level in ("none", "error", "info", "verbose", "debug"):
        moolib.set_log_level(level)
    moolib.set_log_level("error")
    moolib.set_logging(logging)
    moolib.set_logging(None)


def _params(fn):
    return inspect.signature(fn).parameters


def test_signatures_take_the_originals_keywords():
    """The keyword forms programs use keep their names, defaults and positions."""
    define = _params(moolib.Rpc.define)
    assert list(define)[3:] == ["batch_size", "device"]
    assert define["batch_size"].default is None and define["device"].default is None
    queue = _params(moolib.Rpc.define_queue)
    assert list(queue)[2:4] == ["batch_size", "dynamic_batching"]
    assert queue["batch_size"].default is None and queue["dynamic_batching"].default is False

    acc = _params(moolib.Accumulator)
    assert list(acc)[:4] == ["name", "parameters", "buffers", "group"]
    assert acc["group"].default is None
    batcher = _params(moolib.Batcher)
    assert list(batcher)[:3] == ["size", "device", "dim"]
    assert batcher["device"].default == "cpu" and batcher["dim"].default == 0
    envpool = _params(moolib.EnvPool)
    assert list(envpool)[1:4] == ["num_processes", "batch_size", "num_batches"]
    assert list(_params(moolib.Group))[:2] == ["rpc", "name"]
    assert _params(moolib.Broker)["rpc"].default is None


# ---------------------------------------------------------------------------
# Rpc


@pytest.fixture
def host_client(make_rpc):
    """The README's pair: "host" listens and defines, an unnamed client connects."""
    host = make_rpc(name="host", listen=True)
    client = make_rpc()
    client.connect(host.address)
    return host, client


def test_readme_example(host_client):
    host, client = host_client
    seen = []

    def foo(text):
        seen.append(text)
        return 42

    host.define("foo", foo)
    future = client.async_("host", "foo", "hello world")
    assert isinstance(future, moolib.Future)
    assert future.result() == 42
    assert seen == ["hello world"]
    assert future.done() and future.exception() is None
    assert future.wait(1.0) is True

    host.define("kw", lambda a, b=0, *, c=None: (a, b, c))
    assert client.sync("host", "kw", 1) == (1, 0, None)
    assert client.sync("host", "kw", 1, 2, c="x") == (1, 2, "x")
    assert client.async_("host", "kw", a=5, c=[1]).result() == (5, 0, [1])
    t = client.sync("host", "kw", torch.arange(6).view(2, 3))[0]
    assert torch.equal(t, torch.arange(6).view(2, 3))
    # A peer's name is how others call it, whoever connected to whom.
    client.set_name("client-of-host")
    client.define("back", lambda: "from the client")
    assert host.sync("client-of-host", "back") == "from the client"


def test_errors_name_what_failed(host_client):
    host, client = host_client

    def boom(x):
        raise ValueError(f"boom {x}")

    host.define("boom", boom)
    # An undefined function: RuntimeError naming it.
    with pytest.raises(RuntimeError, match="no_such_function"):
        client.sync("host", "no_such_function", 1)
    # The remote exception's message reaches the caller.
    with pytest.raises(RuntimeError, match="boom 17"):
        client.sync("host", "boom", 17)
    future = client.async_("host", "boom", 18)
    error = future.exception()
    assert isinstance(error, RuntimeError) and "boom 18" in str(error)
    with pytest.raises(RuntimeError, match="boom 18"):
        future.result()

    # An unknown peer: RuntimeError naming peer and function once the timeout passed.
    client.set_timeout(1)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        client.sync("nobody-is-called-this", "some_function")
    assert time.monotonic() - start >= 0.9
    assert "nobody-is-called-this" in str(info.value) and "some_function" in str(info.value)
    future = client.async_("nobody-is-called-this", "other_function")
    assert future.wait(DEADLINE)
    assert "other_function" in str(future.exception())


def test_async_callback_gets_result_and_error(host_client):
    host, client = host_client
    host.define("add", lambda a, b: a + b)
    host.define("fail", lambda: 1 / 0)
    done = threading.Event()
    calls = []

    def callback(result, error):
        calls.append((result, error))
        if len(calls) == 2:
            done.set()

    client.async_callback("host", "add", callback, 2, 3)
    client.async_callback("host", "fail", callback)
    assert done.wait(DEADLINE), f"callbacks: {calls}"
    ok = [c for c in calls if c[1] is None]
    failed = [c for c in calls if c[1] is not None]
    assert ok == [(5, None)]
    assert len(failed) == 1 and failed[0][0] is None
    assert "ZeroDivisionError" in str(failed[0][1])


def test_define_batch_size_and_device(host_client):
    host, client = host_client
    shapes = []

    def linear(x, scale):
        shapes.append((tuple(x.shape), tuple(scale.shape)))
        return x * scale.unsqueeze(-1), x.sum(-1)

    host.define("linear", linear, batch_size=4, device="cpu")
    futures = [
        client.async_("host", "linear", torch.full((3,), float(i)), torch.tensor(i + 1.0))
        for i in range(9)
    ]
    for i, f in enumerate(futures):
        scaled, total = f.result()
        assert torch.equal(scaled, torch.full((3,), float(i * (i + 1))))
        assert total.item() == 3 * i and total.shape == ()
    # fn saw stacked arguments: a leading batch dimension of at most batch_size.
    assert sum(s[0][0] for s in shapes) == 9
    assert all(1 <= x[0] <= 4 and x[1:] == (3,) and sc == (x[0],) for x, sc in shapes)


def test_define_deferred(host_client):
    host, client = host_client
    pending = []

    def later(callback, x):
        pending.append((callback, x))

    host.define_deferred("later", later)
    future = client.async_("host", "later", 21)
    wait_for(lambda: pending, what="the deferred call")
    assert not future.done()
    callback, x = pending[0]
    threading.Thread(target=callback, args=(x * 2,)).start()
    assert future.result(DEADLINE) == 42


def test_define_queue_items(host_client):
    host, client = host_client
    queue = host.define_queue("work")
    assert isinstance(queue, moolib.Queue)
    futures = [client.async_("host", "work", i, key=str(i)) for i in range(3)]
    for _ in range(3):
        item = queue.get(timeout=DEADLINE)
        assert isinstance(item, tuple) and len(item) == 3
        return_callback, args, kwargs = item
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        return_callback((args[0] * 10, kwargs["key"]))
    assert sorted(f.result(DEADLINE) for f in futures) == [(0, "0"), (10, "1"), (20, "2")]


def test_define_queue_batching(host_client):
    host, client = host_client
    queue = host.define_queue("batched", batch_size=4)
    futures = [client.async_("host", "batched", torch.tensor([i, -i])) for i in range(4)]
    return_callback, args, kwargs = queue.get(timeout=DEADLINE)
    (batch,) = args
    assert batch.shape == (4, 2) and kwargs == {}
    return_callback(batch * 3)
    results = sorted((f.result(DEADLINE) for f in futures), key=lambda t: int(t[0]))
    assert [r.tolist() for r in results] == [[3 * i, -3 * i] for i in range(4)]

    dynamic = host.define_queue("dynamic", batch_size=8, dynamic_batching=True)
    future = client.async_("host", "dynamic", torch.ones(2))
    return_callback, (batch,), _ = dynamic.get(timeout=DEADLINE)
    # Handed out without waiting for 8 calls.
    assert 1 <= batch.shape[0] <= 8 and batch.shape[1:] == (2,)
    return_callback(batch + 1)
    assert torch.equal(future.result(DEADLINE), torch.full((2,), 2.0))


def test_asyncio_await_future_and_queue(host_client):
    host, client = host_client
    host.define("square", lambda x: x * x)
    queue = host.define_queue("aq")

    async def serve():
        return_callback, args, kwargs = await queue
        return_callback(args[0] + kwargs["plus"])

    async def main():
        assert await client.async_("host", "square", 7) == 49
        server = asyncio.ensure_future(serve())
        answer = await client.async_("host", "aq", 40, plus=2)
        await server
        return answer

    assert asyncio.run(asyncio.wait_for(main(), DEADLINE)) == 42


def test_asyncio_async_for_over_queue(host_client):
    host, client = host_client
    queue = host.define_queue("stream")

    async def main():
        futures = [client.async_("host", "stream", i) for i in range(3)]
        served = 0
        async for return_callback, args, _kwargs in queue:
            return_callback(-args[0])
            served += 1
            if served == 3:
                break
        return sorted([await f for f in futures])

    assert asyncio.run(asyncio.wait_for(main(), DEADLINE)) == [-2, -1, 0]


def test_calls_across_processes(spawn_peer, make_rpc):
    remote = spawn_peer("remote-peer")
    client = make_rpc()
    client.connect(remote.address)
    args, kwargs = client.sync("remote-peer", "echo_all", 1, [2, 3], x=torch.ones(2, 2))
    assert args == (1, [2, 3]) and list(kwargs) == ["x"]
    assert torch.equal(kwargs["x"], torch.ones(2, 2))
    assert client.async_("remote-peer", "add", torch.arange(3), 1).result().tolist() == [1, 2, 3]
    with pytest.raises(RuntimeError, match="raised in another process"):
        client.sync("remote-peer", "fail", "raised in another process")


# ---------------------------------------------------------------------------
# Broker, Group, all_reduce


class _BrokerThread:
    """A broker in this process, updated by a thread as the original's broker loop does."""

    def __init__(self, broker):
        self.broker = broker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.05):
            self.broker.update()

    def close(self):
        self._stop.set()
        self._thread.join(DEADLINE)
        self.broker.close()


@pytest.fixture
def local_broker():
    """``moolib.Broker()`` named and listening, updated by a thread; yields its address."""
    broker = moolib.Broker()
    broker.set_name("broker")
    address = broker.listen("127.0.0.1:0")
    runner = _BrokerThread(broker)
    try:
        yield address
    finally:
        runner.close()


def _update_until(groups, cond, what):
    def step():
        for g in groups:
            g.update()
        return cond()

    return wait_for(step, what=what)


class Stat:
    """A custom stats object, like the original example's StatSum, summed by an op."""

    def __init__(self, value):
        self.value = value

    def __iadd__(self, other):
        self.value += other.value
        return self


def add_stats(dst, src):
    for k, v in dst.items():
        v += src[k]
    return dst


def test_group_all_reduce(make_rpc):
    # The original broker script: an Rpc named "broker" given to Broker(rpc).
    broker_rpc = make_rpc(name="broker")
    broker = moolib.Broker(broker_rpc)
    address = broker_rpc.listen("127.0.0.1:0")
    runner = _BrokerThread(broker)
    try:
        rpcs = [make_rpc(name=f"member-{i}") for i in range(2)]
        groups = [moolib.Group(rpcs[0], "workers"), moolib.Group(rpc=rpcs[1], name="workers")]
        for rpc, group, order in zip(rpcs, groups, (5, 1), strict=True):
            group.set_timeout(30)
            group.set_sort_order(order)
            rpc.connect(address)
        assert groups[0].name() == "workers"
        changed = []

        def joined():
            return all(g.active() and len(g.members()) == 2 for g in groups)

        def step():
            for g in groups:
                changed.append(g.update())
            return joined() and groups[0].sync_id() == groups[1].sync_id()

        wait_for(step, what="both members in the group")
        assert any(changed) and all(isinstance(c, bool) for c in changed)
        # Ordered by sort order (lowest first), the same list on every member.
        assert groups[0].members() == groups[1].members() == ["member-1", "member-0"]

        sums = [g.all_reduce("sum", torch.full((3,), float(i + 1))) for i, g in enumerate(groups)]
        assert all(isinstance(s, moolib.AllReduce) for s in sums)
        for s in sums:
            assert torch.equal(s.result(DEADLINE), torch.full((3,), 3.0))
            assert s.done() and s.exception() is None

        nests = [
            g.all_reduce("nest", {"a": torch.tensor([i, 1]), "n": [i + 0.5, 2]})
            for i, g in enumerate(groups)
        ]
        for n in nests:
            out = n.result(DEADLINE)
            assert torch.equal(out["a"], torch.tensor([1, 2])) and out["n"] == [2.0, 4]

        # The original example's global stats: custom objects folded by an op.
        stats = [
            g.all_reduce("stats", {"steps": Stat(10 * (i + 1)), "episodes": Stat(i)}, op=add_stats)
            for i, g in enumerate(groups)
        ]
        for s in stats:
            out = s.result(DEADLINE)
            assert (out["steps"].value, out["episodes"].value) == (30, 1)

        async def awaited():
            futures = [g.all_reduce("awaited", torch.ones(2)) for g in groups]
            return [await f for f in futures]

        for out in asyncio.run(asyncio.wait_for(awaited(), DEADLINE)):
            assert torch.equal(out, torch.full((2,), 2.0))
    finally:
        runner.close()


# ---------------------------------------------------------------------------
# Accumulator


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2)
    )


def _hash(model):
    return b"".join(p.detach().numpy().tobytes() for p in model.parameters())


class _Learner:
    """One peer running the original example's accumulator loop, one iteration per poll()."""

    BATCH = 5

    def __init__(self, accumulator, model, seed):
        self.acc = accumulator
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=0.01)
        self.gen = torch.Generator().manual_seed(seed)
        self.states_loaded = 0
        self.states_sent = 0
        self.versions = {}  # model version -> parameters after the step

    def poll(self):
        acc = self.acc
        acc.update()
        if acc.wants_state():
            acc.set_state({"model": self.model.state_dict(), "optimizer": self.opt.state_dict()})
            self.states_sent += 1
        if acc.has_new_state():
            state = acc.state()
            self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.states_loaded += 1
        if not acc.connected():
            return
        if acc.has_gradients():
            self.opt.step()
            acc.zero_gradients()
            self.versions[acc.model_version()] = _hash(self.model)
        elif acc.wants_gradients():
            x = torch.randn(self.BATCH, 4, generator=self.gen)
            loss = (self.model(x) - x[:, :2]).pow(2).mean()
            loss.backward()
            acc.reduce_gradients(self.BATCH)


def test_accumulator_loop_of_the_original_example(local_broker, make_rpc, watchdog):
    # docs/library.md's form: no group; the accumulator's own Rpc connects to the broker.
    model_a = _model(1)
    acc_a = moolib.Accumulator("model", model_a.parameters(), model_a.buffers())
    # The example's form: keywords and a Group on the program's Rpc.
    model_b = _model(2)
    rpc_b = make_rpc()
    rpc_b.connect(local_broker)
    acc_b = moolib.Accumulator(
        group=moolib.Group(rpc_b, "model"),
        name="model",
        parameters=model_b.parameters(),
        buffers=model_b.buffers(),
    )
    acc_a.connect(local_broker)
    learners = [_Learner(acc_a, model_a, 1), _Learner(acc_b, model_b, 2)]
    try:
        # B resumes from a checkpoint at version 100, as the original example does:
        # the highest model version leads, so A takes B's state and version.
        acc_b.set_model_version(100)
        for acc in (acc_a, acc_b):
            acc.set_virtual_batch_size(2 * _Learner.BATCH)
            assert not acc.connected() and not acc.has_new_state()
            assert not acc.wants_gradients() and not acc.has_gradients()
            with pytest.raises(RuntimeError):
                acc.state()  # no new state yet

        def trained_together(n):
            for learner in learners:
                learner.poll()
            a, b = learners
            return len(set(a.versions) & set(b.versions)) >= n

        # The first peer in the group may train alone until the other joins
        # (A, from version 0: it then drops that and takes B's version 100).
        wait_for(lambda: trained_together(4), what="four steps on both peers")

        assert acc_a.get_leader() == acc_b.get_leader() is not None
        assert [acc_a.is_leader(), acc_b.is_leader()].count(True) == 1
        assert acc_b.is_leader() and acc_a.get_leader() == acc_b.rpc.get_name()
        leader, follower = learners[1], learners[0]
        # The follower started from other parameters and took the leader's state, once.
        assert follower.states_loaded == 1 and leader.states_sent >= 1
        assert leader.states_loaded == 0
        with pytest.raises(RuntimeError):
            follower.acc.state()  # read already
        common = set(leader.versions) & set(follower.versions)
        assert len(common) >= 4 and min(common) > 100
        for v in common:
            assert leader.versions[v] == follower.versions[v], f"parameters differ at version {v}"
        stats = acc_a.get_gradient_stats()
        assert stats == {"batch_size": 10, "num_gradients": 2, "num_skipped": 0}
        assert isinstance(acc_a.model_version(), int)
    finally:
        acc_a.group.close()
        acc_a.rpc.close()
        acc_b.group.close()


# ---------------------------------------------------------------------------
# Batcher


def test_batcher_unrolls_as_in_the_original_example():
    T, B, learn_batch = 4, 3, 5
    time_batcher = moolib.Batcher(T + 1, torch.device("cpu"))
    learn_batcher = moolib.Batcher(learn_batch, "cpu", dim=1)
    assert learn_batcher.size() == learn_batch
    t = 0
    unrolls = []
    for _ in range(13):
        time_batcher.stack(
            {
                "env": {"frame": torch.full((B, 2), float(t)), "done": torch.zeros(B, dtype=bool)},
                "actor": {"action": torch.arange(B) + 100 * t},
            }
        )
        t += 1
        if not time_batcher.empty():
            unroll = time_batcher.get()
            assert unroll["env"]["frame"].shape == (T + 1, B, 2)
            assert unroll["actor"]["action"].shape == (T + 1, B)
            unrolls.append(unroll)
            learn_batcher.cat(unroll)
            # Keep the last step as the first of the next unroll.
            time_batcher.stack({k: {kk: vv[-1] for kk, vv in v.items()} for k, v in unroll.items()})
    assert len(unrolls) == 3  # 13 stacks: 5, then 4 after each carried-over step
    batches = []
    while not learn_batcher.empty():
        batches.append(learn_batcher.get())
    # 3 unrolls of 3 envs = 9 columns: one batch of 5, 4 kept for the next.
    assert len(batches) == 1
    batch = batches[0]
    assert batch["env"]["frame"].shape == (T + 1, learn_batch, 2)
    assert batch["env"]["done"].dtype == torch.bool
    expected = torch.cat([u["actor"]["action"] for u in unrolls], dim=1)[:, :learn_batch]
    assert torch.equal(batch["actor"]["action"], expected)
    # The 4 columns left over wait for one more; a thread's cat wakes an awaiting task.
    assert learn_batcher.empty()
    filler = {k: {kk: vv[:, :1] for kk, vv in v.items()} for k, v in unrolls[0].items()}

    async def awaited():
        task = asyncio.ensure_future(_await(learn_batcher))
        await asyncio.sleep(0.05)
        assert not task.done()
        await asyncio.get_running_loop().run_in_executor(None, learn_batcher.cat, filler)
        return await task

    batch = asyncio.run(asyncio.wait_for(awaited(), DEADLINE))
    tail = torch.cat([u["actor"]["action"] for u in unrolls], dim=1)[:, learn_batch:]
    assert torch.equal(batch["actor"]["action"][:, :4], tail)
    assert torch.equal(batch["actor"]["action"][:, 4:], unrolls[0]["actor"]["action"][:, :1])
    assert learn_batcher.empty()


async def _await(awaitable):
    return await awaitable


# ---------------------------------------------------------------------------
# EnvPool


def test_envpool_double_buffering_as_in_the_original_example():
    B = 4
    envs = moolib.EnvPool(toy_envs.ToyEnv, num_processes=2, batch_size=B, num_batches=2)
    try:
        prev_action = [torch.zeros(B, dtype=torch.long) for _ in range(2)]
        running_reward = [torch.zeros(B) for _ in range(2)]
        futures = [envs.step(i, prev_action[i]) for i in range(2)]
        assert all(isinstance(f, moolib.EnvStepperFuture) for f in futures)
        gen = torch.Generator().manual_seed(0)
        episodes = 0
        for step in range(30):
            for i in range(2):
                out = futures[i].result()
                assert {"grid", "t", "pos", "reward", "done"} <= set(out)
                assert out["reward"].dtype == torch.float32 and out["reward"].shape == (B,)
                assert out["done"].dtype == torch.bool and out["done"].shape == (B,)
                assert out["grid"].dtype == torch.uint8 and out["grid"].shape == (B, 3, 5)
                if step == 0:  # the first step resets: nothing done, no reward
                    assert not out["done"].any() and not out["reward"].any()
                    assert torch.equal(out["t"], torch.zeros(B, dtype=torch.int64))
                # The original example's bookkeeping, on the result tensors.
                running_reward[i] += out["reward"]
                episodes += int(out["done"].sum().item())
                running_reward[i] *= ~out["done"]
                action = torch.randint(0, 7, (B,), generator=gen)
                futures[i] = envs.step(i, action)
        assert episodes > 0  # ToyEnv episodes last at most 12 steps

        for bad in (
            torch.zeros(B, dtype=torch.float32),
            torch.zeros(B + 1, dtype=torch.long),
            torch.zeros(B, 2, dtype=torch.long),
        ):
            with pytest.raises(RuntimeError):
                envs.step(0, bad)
        # A rejected action changed nothing: the pending steps still complete.
        for f in futures:
            assert f.result()["reward"].shape == (B,)
    finally:
        envs.close()


def test_envpool_state_key_and_env_errors():
    envs = moolib.EnvPool(toy_envs.ArrayEnv, 1, 2, 1)
    try:
        out = envs.step(0, torch.zeros(2, dtype=torch.long)).result()
        assert out["state"].shape == (2, 4)
        assert out["reward"].dtype == torch.float32 and out["done"].dtype == torch.bool
    finally:
        envs.close()
    envs = moolib.EnvPool(toy_envs.FailingEnv, 1, 2, 1)
    try:
        envs.step(0, torch.zeros(2, dtype=torch.long)).result()
        with pytest.raises(RuntimeError, match="refuses action six"):
            envs.step(0, torch.tensor([1, 6])).result()
    finally:
        envs.close()


# ---------------------------------------------------------------------------
# The original example in miniature: two training processes and a broker process


class MiniVtrace(LineProcess):
    """tests/helpers/mini_vtrace.py: the original example's program, made small."""

    def __init__(self, broker_address, seed, log_dir):
        argv = [
            sys.executable,
            str(HELPERS / "mini_vtrace.py"),
            "--connect",
            broker_address,
            "--seed",
            str(seed),
        ]
        super().__init__(argv, log_dir / f"mini-vtrace-{seed}.log")
        self.events = []

    def describe(self):
        return f"mini_vtrace {self.pid}"

    def poll(self):
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                self.lines.put(None)
                raise AssertionError(f"{self.describe()} exited; log:\n{self.log()}")
            self.events.append(json.loads(line))

    def steps(self):
        return {e["version"]: e for e in self.events if e["event"] == "step"}


def test_original_example_in_miniature(broker, logs, watchdog):
    peers = [MiniVtrace(broker.address, seed, logs) for seed in (1, 2)]
    try:

        def trained_together():
            for p in peers:
                p.poll()
            a, b = (p.steps() for p in peers)
            common = set(a) & set(b)
            # Both trained on and the stats all-reduce summed the other's env steps.
            return (
                len(common) >= 20
                and any(e["global_steps"] > e["local_steps"] for e in a.values())
                and any(e["global_steps"] > e["local_steps"] for e in b.values())
            )

        wait_for(trained_together, timeout=DEADLINE * 2, what="two peers training together")
    finally:
        for p in peers:
            p.stop()
    a, b = (p.steps() for p in peers)
    common = sorted(set(a) & set(b))
    for v in common:
        assert a[v]["hash"] == b[v]["hash"], f"parameters differ at model version {v}"
        assert a[v]["batch_size"] == b[v]["batch_size"] >= 8
    # The leader sent its state; the other peer loaded it, then stepped with it.
    sent = [[e for e in p.events if e["event"] == "state_sent"] for p in peers]
    loaded = [[e for e in p.events if e["event"] == "state_loaded"] for p in peers]
    assert sum(map(len, sent)) >= 1 and sum(map(len, loaded)) >= 1
    follower = 0 if loaded[0] else 1
    first = loaded[follower][0]
    leader_steps = peers[1 - follower].steps()
    if first["version"] in leader_steps:
        assert leader_steps[first["version"]]["hash"] == first["hash"]
    assert peers[follower].steps()[first["version"] + 1]["leader"] is False
    # Training moved the parameters.
    assert len({a[v]["hash"] for v in common}) == len(common)
