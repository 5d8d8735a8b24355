"""Parameter publishing: a learner publishes while subscriber processes fetch.

Every publication fills its tensors with its version number, so a subscriber
can tell a torn or stale publication from the one it asked for.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers.util import HELPERS, PeerProcess, stop_process, wait_for

import moolib
from moolib import publish

SUBSCRIBER = HELPERS / "subscriber_peer.py"


def weights(version: int) -> dict:
    return {
        "big": torch.full((1 << 18,), float(version)),
        "small": torch.full((3,), version, dtype=torch.int64),
    }


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_subscribers_get_every_publication_whole_and_never_older(transport, tmp_path, make_rpc):
    rpc = make_rpc("learner", listen=True, timeout=30)
    pub = moolib.Publisher(rpc, "weights")
    pub.publish(weights(0))
    subs = []
    try:
        for i in range(3):
            args = ["--name", f"actor{i}", "--connect", rpc.address]
            args += ["--transports", transport, "--until", "300"]
            if i == 2:
                args.append("--into")
            subs.append(PeerProcess(args, tmp_path / f"actor{i}.log", script=SUBSCRIBER))
        for version in range(1, 301):
            pub.publish(weights(version))
        for s in subs:
            line = s.expect("OK", timeout=240)
            fetched, nones = map(int, line.split()[1:])
            assert 1 <= fetched <= 301
    finally:
        for s in subs:
            stop_process(s.proc)


def test_fetch_returns_weights_only_when_newer(make_rpc):
    rpc = make_rpc("learner", listen=True, timeout=30)
    pub = moolib.Publisher(rpc, "weights")
    actor = make_rpc("actor", timeout=30)
    actor.connect(rpc.address)
    sub = moolib.Subscriber(actor, "learner", "weights")
    assert sub.fetch() is None and sub.version == -1  # nothing published yet
    assert pub.publish(weights(0)) == 0
    version, got = sub.fetch()
    assert version == 0 and sub.version == 0 and torch.equal(got["big"], weights(0)["big"])
    assert sub.fetch() is None
    assert pub.publish(weights(5), version=5) == 5
    assert pub.publish(weights(6)) == 6
    assert sub.fetch()[0] == 6
    with pytest.raises(ValueError, match="version 6 does not increase"):
        pub.publish(weights(6), version=6)
    # The learner changing its tensors after publishing changes nothing published.
    w = weights(7)
    pub.publish(w)
    w["big"].fill_(-1)
    assert sub.fetch()[1]["big"].eq(7).all()


def test_one_publication_is_serialized_once_for_many_fetches(make_rpc, monkeypatch):
    built = []
    real = publish._snapshot
    monkeypatch.setattr(publish, "_snapshot", lambda *a: built.append(a) or real(*a))
    rpc = make_rpc("learner", listen=True, timeout=30)
    pub = moolib.Publisher(rpc, "weights")
    pub.publish(weights(1), version=1)
    actors = []
    for i in range(8):
        a = make_rpc(f"actor{i}", timeout=30)
        a.connect(rpc.address)
        actors.append(moolib.Subscriber(a, "learner", "weights"))
    results = []
    threads = [threading.Thread(target=lambda s=s: results.append(s.fetch())) for s in actors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 8 and all(r[0] == 1 for r in results)
    assert all(r[1]["big"].eq(1).all() and r[1]["small"].eq(1).all() for r in results)
    assert len(built) == 1
    # Every reply hands the RPC layer the same snapshot objects: the layout
    # bytes and the buffer it sends out of band, built once.
    first, second = pub._fetch(-1, None), pub._fetch(-1, None)
    assert first[2] is second[2] and first[3] is second[3]


def test_a_restarted_publisher_is_followed_even_with_lower_versions(make_rpc):
    learner = make_rpc("learner", listen=True, timeout=30)
    pub = moolib.Publisher(learner, "weights")
    pub.publish(weights(50), version=50)
    actor = make_rpc("actor", timeout=30)
    actor.connect(learner.address)
    sub = moolib.Subscriber(actor, "learner", "weights")
    assert sub.fetch()[0] == 50
    pub.close()
    # The learner restarts from an older checkpoint, under the same name.
    restarted = moolib.Publisher(learner, "weights", first_version=40)
    restarted.publish(weights(40))
    version, got = sub.fetch()
    assert version == 40 and got["small"].eq(40).all()
    assert sub.fetch() is None


def test_fetch_into_refuses_a_mismatched_target_naming_the_key(make_rpc):
    rpc = make_rpc("learner", listen=True, timeout=30)
    pub = moolib.Publisher(rpc, "weights")
    model = torch.nn.Linear(4, 2)
    pub.publish(model.state_dict())
    actor = make_rpc("actor", timeout=30)
    actor.connect(rpc.address)
    sub = moolib.Subscriber(actor, "learner", "weights")
    mismatch = r"weights\['bias'\]: published torch.float32 \(2,\), the target has .* \(3,\)"
    with pytest.raises(ValueError, match=mismatch):
        sub.fetch_into(torch.nn.Linear(4, 3))
    with pytest.raises(ValueError, match="not in the target: bias"):
        sub.fetch_into(torch.nn.Linear(4, 2, bias=False))
    assert sub.version == -1  # nothing was taken
    other = torch.nn.Linear(4, 2)
    assert sub.fetch_into(other) is True
    assert torch.equal(other.weight, model.weight) and torch.equal(other.bias, model.bias)
    assert sub.fetch_into(other) is False


def test_fetch_from_a_dead_publisher_fails_naming_the_peer(tmp_path, make_rpc):
    actor = make_rpc("actor", timeout=2)
    sub = moolib.Subscriber(actor, "nobody", "weights")
    with pytest.raises(moolib.RpcError, match="peer 'nobody'"):
        sub.fetch()
    learner = make_rpc("learner", listen=True, timeout=30)
    pub = moolib.Publisher(learner, "weights")
    pub.publish(weights(1))
    actor.connect(learner.address)
    sub = moolib.Subscriber(actor, "learner", "weights")
    wait_for(lambda: sub.fetch(), what="the first fetch")
    learner.close()
    with pytest.raises(moolib.RpcError, match="peer 'learner'"):
        sub.fetch()
