"""moolib.Publisher / moolib.Subscriber: a learner publishing versioned weights
that actors fetch, across real processes over shared memory and TCP."""

from __future__ import annotations

import asyncio
import gc
import pickle
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from helpers.util import DEADLINE, HELPERS, PeerProcess, wait_for

import moolib
import moolib.publish as publish_module

pytestmark = pytest.mark.usefixtures("watchdog")

SCRIPT = HELPERS / "publish_peer.py"
TRANSPORTS = [["shm"], ["tcp"]]
IDS = ["shm", "tcp"]


def weights(version, kb=16):
    """The nest publish_peer.py publishes (every value equal to ``version``)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("publish_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.weights(version, kb), module.check


@pytest.fixture
def spawn(tmp_path):
    """Starts tests/helpers/publish_peer.py processes; all are gone after the test."""
    started = []

    def start(role, name, *args):
        log = tmp_path / f"{role}-{name}-{len(started)}.log"
        p = PeerProcess([role, name, *args], log, script=SCRIPT)
        started.append(p)
        return p

    yield start
    for p in started:
        try:
            p.stop()
        finally:
            if p.alive():
                p.kill()


def send(peer, line):
    peer.proc.stdin.write(line + "\n")
    peer.proc.stdin.flush()


def outcome(peer, timeout=DEADLINE * 2):
    """The DONE or FAIL line of a helper process (fails the test on FAIL)."""
    line = peer.expect("", timeout)
    assert line.startswith("DONE"), f"{peer.name}: {line}\n{peer.log()}"
    return line.split()[1:]


def start_actors(spawn, address, peer, transports, until, n=3, kb=512):
    return [
        spawn(
            "actor",
            f"actor{i}-{moolib.create_uid()[:6]}",
            "--connect",
            address,
            "--peer",
            peer,
            "--until",
            str(until),
            "--transports",
            ",".join(transports),
            "--kb",
            str(kb),
        )
        for i in range(n)
    ]


# ---------------------------------------------------------------------------
# Learner and actors in processes of their own


@pytest.mark.parametrize("transports", TRANSPORTS, ids=IDS)
def test_actors_follow_the_learner(spawn, transports):
    """Versions only go forward, every fetch is exactly one published version, and an
    actor that holds the latest gets nothing (checked in each actor process)."""
    learner = spawn(
        "learner",
        "learner-" + IDS[TRANSPORTS.index(transports)],
        "--transports",
        ",".join(transports),
        "--count",
        "30",
        "--serves",
        "3",  # every actor gets each version, however the 2 cores are shared among them
    )
    actors = start_actors(spawn, learner.address, learner.name, transports, until=29)
    send(learner, "GO")  # the actors fetched nothing (None) until now
    for a in actors:
        distinct, links = outcome(a)
        assert int(distinct) >= 2, f"{a.name} saw {distinct} version(s)"
        assert transports[0] in links.split(","), links
    assert learner.expect("PUBLISHED").split() == ["PUBLISHED", "29"]


class _CountingPickle:
    """moolib.publish's view of the pickle module, counting dumps()."""

    def __init__(self):
        self.dumps_calls = 0

    def __getattr__(self, name):
        return getattr(pickle, name)

    def dumps(self, *args, **kwargs):
        self.dumps_calls += 1
        return pickle.dumps(*args, **kwargs)


@pytest.mark.parametrize("transports", TRANSPORTS, ids=IDS)
def test_one_publication_is_serialized_once(spawn, make_rpc, monkeypatch, transports):
    """60 fetches from 3 processes (2 threads each) of one publication: the weights
    are copied once at publish(), pickled never, and each fetch sends that snapshot."""
    copies = []
    copy_leaf = publish_module._copy_leaf
    monkeypatch.setattr(
        publish_module, "_copy_leaf", lambda *a: (copies.append(a[1][0]), copy_leaf(*a))[1]
    )
    counting = _CountingPickle()
    monkeypatch.setattr(publish_module, "pickle", counting)
    big_dumps = []
    for module in (moolib.serialization, moolib.rpc):
        original = module.dumps

        def dumps(obj, original=original):
            data, buffers = original(obj)
            if len(data) + sum(memoryview(b).nbytes for b in buffers) > 64 << 10:
                big_dumps.append(type(obj))
            return data, buffers

        monkeypatch.setattr(module, "dumps", dumps)

    rpc = make_rpc("learner-once", transports=transports, listen=True, timeout=DEADLINE)
    pub = moolib.Publisher(rpc, "weights")
    nest, _ = weights(7, kb=1024)
    assert pub.publish(nest) == 0
    leaves = len(copies)
    assert leaves == 7 and counting.dumps_calls == 2  # metadata, then the reply stream
    # The learner trains on at once: fetches must see the snapshot, not the model.
    for t in (nest["w"], nest["b"], nest["h"], nest["t"], *nest["list"][:1]):
        t.fill_(99)
    nest["np"].fill(99)

    fetchers = [
        spawn(
            "refetch",
            f"fetcher{i}",
            "--connect",
            rpc.address,
            "--peer",
            "learner-once",
            "--times",
            "20",
            "--expect",
            "0",
            "--value",
            "7",
            "--kb",
            "1024",
            "--transports",
            ",".join(transports),
        )
        for i in range(3)
    ]
    for f in fetchers:
        outcome(f)
    stats = pub.stats()
    assert stats["served"] == 60 and stats["published"] == 1
    assert len(copies) == leaves, "a fetch copied the weights again"
    assert counting.dumps_calls == 2, "a fetch pickled again"
    assert big_dumps == [], f"weights went through the RPC serializer: {big_dumps}"


@pytest.mark.parametrize("transports", TRANSPORTS, ids=IDS)
def test_publishing_during_fetches(spawn, make_rpc, transports):
    """The learner publishes back to back while 3 actor processes fetch 4 MB nests:
    each fetch is one whole version, and old snapshots are freed once no fetch uses them."""
    rpc = make_rpc("learner-busy", transports=transports, listen=True, timeout=DEADLINE)
    pub = moolib.Publisher(rpc, "weights")
    last = 40
    actors = start_actors(spawn, rpc.address, "learner-busy", transports, until=last, kb=4096)
    snapshots = []

    def learn():
        for version in range(last + 1):
            nest, _ = weights(version, kb=4096)
            pub.publish(nest)
            snapshots.append(weakref.ref(pub._current))
            if pub.stats()["served"] < 3 * (version + 1):
                time.sleep(0.005)

    learner = threading.Thread(target=learn)
    learner.start()
    try:
        for a in actors:
            outcome(a)
    finally:
        learner.join()
    assert pub.stats()["published"] == last + 1

    def freed():
        gc.collect()
        return [r() is None for r in snapshots[:-1]] == [True] * last

    wait_for(freed, what="snapshots no fetch uses to be freed")
    assert snapshots[-1]() is pub._current


@pytest.mark.parametrize("transports", TRANSPORTS, ids=IDS)
def test_subscriber_survives_a_learner_restart(spawn, make_rpc, transports):
    rpc = make_rpc("actor-restart", transports=transports, timeout=DEADLINE)
    first = spawn("learner", "learner-r", "--transports", ",".join(transports), "--count", "3")
    rpc.connect(first.address)
    sub = moolib.Subscriber(rpc, "learner-r", "weights", timeout=DEADLINE)
    assert sub.fetch() is None and sub.version == -1
    send(first, "GO")
    wait_for(lambda: sub.fetch() is None and sub.version == 2, what="version 2")
    first.kill()
    with pytest.raises(moolib.RpcError, match="learner-r"):
        moolib.Subscriber(rpc, "learner-r", "weights", timeout=3).fetch()

    # A new learner under the same name continues from the last version.
    second = spawn(
        "learner", "learner-r", "--transports", ",".join(transports), "--start", "2", "--count", "3"
    )
    rpc.connect(second.address)
    wait_for(lambda: sub.fetch() is None, what="the new learner to answer")
    assert sub.version == 2
    model, check = weights(-1, kb=512)
    send(second, "GO")
    seen = []
    deadline = time.monotonic() + DEADLINE
    while sub.version < 5 and time.monotonic() < deadline:
        if sub.fetch_into(model):
            assert check(model, sub.version, step=False) is None
            seen.append(sub.version)
    assert seen and seen == sorted(set(seen)) and seen[0] >= 3 and seen[-1] == 5


# ---------------------------------------------------------------------------
# Errors and edge cases


@pytest.fixture
def pair(make_rpc):
    learner = make_rpc("learner-local", listen=True, timeout=DEADLINE)
    actor = make_rpc("actor-local", timeout=DEADLINE)
    actor.connect(learner.address)
    return learner, actor


def test_nothing_published_fetches_none(pair):
    learner, actor = pair
    pub = moolib.Publisher(learner, "weights")
    sub = moolib.Subscriber(actor, "learner-local", "weights", timeout=DEADLINE)
    model = torch.nn.Linear(3, 2)
    before = model.weight.detach().clone()
    assert (pub.version, sub.version) == (-1, -1)
    assert sub.fetch() is None
    assert sub.fetch_into(model) is False
    assert sub.version == -1 and torch.equal(model.weight, before)
    assert pub.stats() == {"published": 0, "served": 0, "unchanged": 2, "bytes": 0}
    # The raw protocol, for users of plain rpc calls.
    assert actor.sync("learner-local", "weights", -1) is None
    # A name nobody publishes is an error that says so, not None.
    typo = moolib.Subscriber(actor, "learner-local", "weight", timeout=DEADLINE)
    with pytest.raises(moolib.RpcError, match="no Publisher named 'weight' there"):
        typo.fetch()


def test_versions_must_increase(pair):
    learner, _ = pair
    pub = moolib.Publisher(learner, "weights")
    assert pub.publish({"w": torch.zeros(2)}) == 0
    assert pub.publish({"w": torch.zeros(2)}, version=5) == 5
    for bad in (5, 4):
        with pytest.raises(
            ValueError,
            match=rf"version {bad}: it is already at version 5, and "
            r"versions must increase",
        ):
            pub.publish({"w": torch.zeros(2)}, version=bad)
    with pytest.raises(TypeError, match="version must be an int"):
        pub.publish({"w": torch.zeros(2)}, version=6.0)
    assert pub.version == 5 and pub.publish({"w": torch.zeros(2)}) == 6
    with pytest.raises(TypeError, match=r"cannot publish object at w\[1\]"):
        pub.publish({"w": [torch.zeros(1), object()]})
    # A restarted learner continues from a given version.
    other = moolib.Publisher(learner, "weights2", version=41)
    assert other.version == 41 and other.publish({"w": torch.zeros(1)}) == 42


def test_constructor_arguments_are_checked(pair):
    learner, actor = pair
    with pytest.raises(TypeError, match="Publisher: name must be a str, got int"):
        moolib.Publisher(learner, 5)
    with pytest.raises(TypeError, match="timeout must be a number of seconds, got str"):
        moolib.Subscriber(actor, "learner-local", "weights", timeout="3")
    with pytest.raises(ValueError, match="timeout must be positive, got -3"):
        moolib.Subscriber(actor, "learner-local", "weights", timeout=-3)


def test_fetch_into_a_different_model_names_the_key(pair):
    learner, actor = pair
    pub = moolib.Publisher(learner, "weights")
    sub = moolib.Subscriber(actor, "learner-local", "weights", timeout=DEADLINE)
    pub.publish(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).state_dict())
    cases = [
        (
            torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 5)),
            r"key '1.weight': published float32 \[2, 3\], the target has float32 \[5, 3\]",
        ),
        (
            torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).double(),
            r"key '0.weight': published float32 \[3, 4\], the target has float64 \[3, 4\]",
        ),
        (
            torch.nn.Sequential(torch.nn.Linear(4, 3)),
            r"publishes '1.weight' \(float32 \[2, 3\]\) but the target has no such key",
        ),
        (
            torch.nn.Sequential(
                torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)
            ),
            r"the target has '2.weight' but 'weights' does not publish it",
        ),
    ]
    for model, message in cases:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ValueError, match=message):
            sub.fetch_into(model)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), "a refused fetch wrote"
        assert sub.version == -1
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    pointers = [p.data_ptr() for p in model.parameters()]
    assert sub.fetch_into(model) and sub.version == 0
    assert pointers == [p.data_ptr() for p in model.parameters()], "fetch_into reallocated"
    _, published = moolib.Subscriber(actor, "learner-local", "weights").fetch()
    for k, v in model.state_dict().items():
        assert torch.equal(v, published[k]), k


def test_fetch_into_copies_exactly(pair):
    learner, actor = pair
    pub = moolib.Publisher(learner, "weights")
    sub = moolib.Subscriber(actor, "learner-local", "weights", timeout=DEADLINE)
    source = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.BatchNorm1d(30))
    source(torch.randn(8, 40))  # running stats and num_batches_tracked change
    pub.publish(source.state_dict())
    target = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.BatchNorm1d(30))
    assert sub.fetch_into(target)
    for (k, a), (k2, b) in zip(
        source.state_dict().items(), target.state_dict().items(), strict=True
    ):
        assert k == k2 and torch.equal(a, b), k
    # numpy arrays, and a target nest that mixes libraries.
    pub.publish({"a": np.arange(10, dtype=np.float32), "b": [torch.arange(6).view(2, 3)]})
    target = {"a": torch.zeros(10), "b": [np.zeros((2, 3), dtype=np.int64)]}
    assert sub.fetch_into(target) and sub.version == 1
    assert torch.equal(target["a"], torch.arange(10, dtype=torch.float32))
    assert np.array_equal(target["b"][0], np.arange(6).reshape(2, 3))
    version, nest = moolib.Subscriber(actor, "learner-local", "weights").fetch()
    assert version == 1 and isinstance(nest["a"], np.ndarray) and torch.is_tensor(nest["b"][0])


def test_fetch_from_an_unknown_peer_fails_in_time(make_rpc):
    rpc = make_rpc("actor-alone")
    rpc.set_timeout(2)
    for timeout in (1.0, None):
        sub = moolib.Subscriber(rpc, "no-such-learner", "weights", timeout=timeout)
        start = time.monotonic()
        with pytest.raises(moolib.RpcError, match="no-such-learner"):
            sub.fetch()
        assert time.monotonic() - start < DEADLINE
        assert sub.version == -1


def test_fetch_from_a_dead_learner_fails(spawn, make_rpc):
    learner = spawn("learner", "learner-dead", "--count", "1")
    rpc = make_rpc("actor-dead", timeout=DEADLINE)
    rpc.connect(learner.address)
    sub = moolib.Subscriber(rpc, "learner-dead", "weights", timeout=5)
    send(learner, "GO")
    wait_for(lambda: sub.fetch() is None and sub.version == 0, what="version 0")
    learner.kill()
    with pytest.raises(moolib.RpcError, match="from peer 'learner-dead'"):
        sub.fetch()
    assert sub.version == 0


def test_async_variants(pair):
    learner, actor = pair
    pub = moolib.Publisher(learner, "weights")
    sub = moolib.Subscriber(actor, "learner-local", "weights", timeout=DEADLINE)

    async def main():
        assert await sub.fetch_async() is None
        pub.publish({"w": torch.full((3,), 5.0)})
        version, nest = await sub.fetch_async()
        assert version == 0 and torch.equal(nest["w"], torch.full((3,), 5.0))
        assert await sub.fetch_into_async({"w": torch.zeros(3)}) is False
        pub.publish({"w": torch.full((3,), 6.0)})
        target = {"w": torch.zeros(3)}
        assert await sub.fetch_into_async(target) is True
        assert torch.equal(target["w"], torch.full((3,), 6.0)) and sub.version == 1
        lost = moolib.Subscriber(actor, "no-such-learner", "weights", timeout=1)
        with pytest.raises(moolib.RpcError, match="no-such-learner"):
            await lost.fetch_async()

    asyncio.run(main())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_weights(pair):
    learner, actor = pair
    pub = moolib.Publisher(learner, "weights")
    sub = moolib.Subscriber(actor, "learner-local", "weights", timeout=DEADLINE)
    model = torch.nn.Linear(64, 32).cuda()
    pub.publish(model.state_dict())
    with torch.no_grad():
        model.weight.add_(1)  # after the snapshot
    version, nest = moolib.Subscriber(actor, "learner-local", "weights").fetch()
    assert nest["weight"].device.type == "cuda"
    assert torch.equal(nest["weight"] + 1, model.weight)
    target = torch.nn.Linear(64, 32).cuda()
    assert sub.fetch_into(target)
    assert torch.equal(target.weight + 1, model.weight)
    cpu = torch.nn.Linear(64, 32)
    assert moolib.Subscriber(actor, "learner-local", "weights").fetch_into(cpu)
    assert torch.equal(cpu.weight.cuda() + 1, model.weight)


def test_large_snapshots_go_out_in_segments(pair, monkeypatch):
    """Leaves are grouped into segments of bounded size (never split), and come back exact."""
    monkeypatch.setattr(publish_module, "_CHUNK", 4096)
    learner, actor = pair
    pub = moolib.Publisher(learner, "weights")
    nest = {
        "a": torch.arange(1000, dtype=torch.float32),  # 4000 bytes: a segment alone
        "b": torch.arange(10, dtype=torch.int64),
        "c": torch.arange(3000, dtype=torch.float64),  # 24000 bytes: bigger than a segment
        "d": [np.arange(5, dtype=np.int16), torch.empty(0)],
        "e": torch.ones(2, 3, dtype=torch.bool),
    }
    pub.publish(nest)
    assert len(pub._current.reply[1]) == 4  # a | b | c | d, e
    version, raw, buffers = actor.sync("learner-local", "weights", -1)
    assert version == 0 and len(buffers) == 4
    sub = moolib.Subscriber(actor, "learner-local", "weights", timeout=DEADLINE)
    _, got = sub.fetch()
    target = {k: v for k, v in got.items() if k != "d"}
    target = {k: torch.zeros_like(v) for k, v in target.items()}
    target["d"] = [np.zeros(5, dtype=np.int16), torch.empty(0)]
    for k in ("a", "b", "c", "e"):
        assert torch.equal(got[k], nest[k]), k
    assert np.array_equal(got["d"][0], nest["d"][0]) and got["d"][1].shape == (0,)
    pub.publish(nest)
    assert sub.fetch_into(target) and sub.version == 1
    for k in ("a", "b", "c", "e"):
        assert torch.equal(target[k], nest[k]), k
