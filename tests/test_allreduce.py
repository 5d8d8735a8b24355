"""Group.all_reduce across processes: members are tests/helpers/group_peer.py
subprocesses around a ``python -m moolib.broker`` subprocess, in groups of 2, 3
and 4, once with every transport allowed (large buffers go through shared
memory, every member being on this host) and once over TCP only (large
buffers go round the ring). Results are compared with sums computed here and
bit for bit between members; then custom ops, concurrent and repeated
all-reduces, errors, membership changes and bad messages; last, the AllReduce
handle API in this process."""

from __future__ import annotations

import asyncio
import itertools
import os
import time

import numpy as np
import pytest
import torch
from helpers.group_util import (
    DTYPES,
    GroupPeer,
    case_data,
    collect,
    join,
    leaves_bytes,
    load,
    nest_sum,
    settle,
    start_group_peers,
    sync_peers,
    wait_members,
)
from helpers.group_util import all_reduce as run_all_reduce
from helpers.util import DEADLINE, assert_same, wait_for

import moolib
from moolib.errors import MembershipChangedError

pytestmark = pytest.mark.usefixtures("watchdog")


@pytest.fixture(autouse=True)
def _drain_peers(request):
    """A test that fails half way leaves no reply behind for the next one."""
    yield from sync_peers(request)


TRANSPORTS = ["shm", "tcp"]  # "shm": every transport allowed; "tcp": TCP only
SIZES = [2, 3, 4]
GROUPS = [f"{t}{n}" for t in TRANSPORTS for n in SIZES]
KILL_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def peers(broker, logs):
    """Four member processes, each with an Rpc of every transport and a TCP-only one."""
    ps = start_group_peers([f"ar{i}" for i in range(4)], broker.address, logs, tcp=True)
    try:
        yield ps
    finally:
        for p in ps:
            p.stop()


class Team:
    """Member processes in one group, and who is who in its member order."""

    def __init__(self, group, peers, transport):
        self.group = group
        self.peers = peers
        self.transport = transport
        self.by_name = {self.member_name(p): p for p in peers}
        self.order: list[str] = []

    def member_name(self, p):
        return p.tcp_name if self.transport == "tcp" else p.name

    def seed(self, p):
        """Makes each member's data differ."""
        return 1 + int(p.name.removeprefix("ar"))

    def join(self, timeout=10.0):
        join(self.peers, self.group, rpc=self.transport, timeout=timeout)
        return self.settle()

    def settle(self):
        status = wait_members(self.peers, self.group, set(self.by_name))
        self.order = status["members"]
        return status

    def inputs(self, case, seeds=None):
        """Every member's data, in member order."""
        seeds = seeds or {}
        return [case_data(case, seeds.get(m, self.seed(self.by_name[m])), m) for m in self.order]

    def run(self, name, case, op=None, out_dir=None):
        seeds = [self.seed(p) for p in self.peers]
        return run_all_reduce(self.peers, self.group, name, case, seeds, op=op, out_dir=out_dir)

    def results(self, replies):
        """The result of every member, in member order (asserting each succeeded)."""
        for p, r in zip(self.peers, replies, strict=True):
            assert r["ok"], f"{self.member_name(p)}: {r}"
        by_member = {
            self.member_name(p): load(r["path"]) for p, r in zip(self.peers, replies, strict=True)
        }
        return [by_member[m] for m in self.order]


@pytest.fixture(scope="module")
def teams(peers):
    out = {}
    for group in GROUPS:
        transport, n = group[:3], int(group[3:])
        out[group] = Team(group, peers[:n], transport)
        join(out[group].peers, group, rpc=transport)
    for team in out.values():
        team.settle()
    return out


_names = itertools.count()


def unique(prefix):
    return f"{prefix}-{next(_names)}"


def assert_identical(results):
    first = leaves_bytes(results[0])
    for i, r in enumerate(results[1:], 1):
        assert leaves_bytes(r) == first, f"member {i}'s result differs from member 0's"


# ---------------------------------------------------------------------------
# Sums


DTYPE_CASES = [f"t/{d}/5x7" for d in DTYPES]  # every summable type
SIZE_CASES = [
    "t/float32/0",  # empty
    "t/int64/0x3",
    "t/float64/",  # 0-dim
    "t/float32/1",
    "t/int32/2",  # fewer elements than members
    "t/float32/3",
    "t/int16/7",
    "t/float32/16384",  # exactly 64 KiB: the largest sent directly
    "t/float32/16385",  # just over: shared memory or ring
    "t/float32/1000003",
    "t/int8/65537",
    "t/uint8/65539",
    "t/bool/70001",
    "t/int16/32771",
    "t/int64/100003",
    "t/float16/40001",
    "t/bfloat16/33333",
    "t/complex128/4099",
    "t/float64/9001",
    "t/complex64/8193x2",
]
NUMPY_CASES = ["np/float32/5x7", "np/int16/70000", "np/bool/9", "np/complex128/3", "np/uint8/1"]
NEST_CASES = ["nest", "numbers", "empty_nest"]


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("case", DTYPE_CASES + SIZE_CASES + NUMPY_CASES + NEST_CASES)
def test_sum_matches_local_sum(teams, group, case, tmp_path):
    team = teams[group]
    results = team.results(team.run(unique("sum"), case, out_dir=tmp_path))
    expected = nest_sum(team.inputs(case))
    for r in results:
        assert_same(expected, r)
    assert_identical(results)


@pytest.mark.parametrize("group", ["shm4", "tcp4", "tcp3"])
@pytest.mark.parametrize(
    "case", ["randn/float32/1001", "randn/float64/300007", "randn/float32/70001"]
)
def test_random_floats_close_and_bitwise_identical(teams, group, case, tmp_path):
    team = teams[group]
    results = team.results(team.run(unique("randn"), case, out_dir=tmp_path))
    # Summation order may differ from ours (ring, slices): close here, identical there.
    expected = nest_sum(team.inputs(case))
    for r in results:
        assert r.dtype == expected.dtype and r.shape == expected.shape
        torch.testing.assert_close(r, expected, rtol=1e-5, atol=1e-5)
    assert_identical(results)


# ---------------------------------------------------------------------------
# Custom ops


@pytest.mark.parametrize("group", GROUPS)
def test_custom_op_concatenation_is_in_member_order(teams, group, tmp_path):
    team = teams[group]
    results = team.results(team.run(unique("names"), "name", op="add", out_dir=tmp_path))
    for r in results:
        assert r == team.order
    big = team.results(team.run(unique("names-big"), "name_big", op="add", out_dir=tmp_path))
    for r in big:
        assert [name for name, _ in r] == team.order
        for (name, t), data in zip(r, team.inputs("name_big"), strict=True):
            assert torch.equal(t, data[0][1]), name
    assert_identical(big)


@pytest.mark.parametrize("group", ["shm3", "tcp4"])
@pytest.mark.parametrize(
    ("op", "case"), [("max", "t/float32/5x7"), ("max", "t/int64/20000"), ("sub", "t/int64/3x3")]
)
def test_custom_op_folds_in_member_order(teams, group, op, case, tmp_path):
    team = teams[group]
    results = team.results(team.run(unique(op), case, op=op, out_dir=tmp_path))
    inputs = team.inputs(case)
    expected = inputs[0]
    for x in inputs[1:]:
        expected = torch.maximum(expected, x) if op == "max" else expected - x
    for r in results:
        assert_same(expected, r)


# ---------------------------------------------------------------------------
# Several at once


@pytest.mark.parametrize("group", ["shm4", "tcp4", "shm2"])
def test_concurrent_all_reduces_with_different_names(teams, group, tmp_path):
    """Each member starts four all-reduces in its own order before waiting for any."""
    team = teams[group]
    ops = [
        (unique("conc-small"), "t/int32/11", None),
        (unique("conc-big"), "t/float32/200001", None),
        (unique("conc-gather"), "name", "add"),
        (unique("conc-nest"), "nest", None),
    ]
    keys = {}
    for i, p in enumerate(team.peers):
        mine = ops[i % len(ops) :] + ops[: i % len(ops)]
        if i % 2:
            mine.reverse()
        for name, case, op in mine:
            key = f"{name}-{p.name}"
            keys[(name, p.name)] = key
            p.send("start", group=group, key=key, name=name, case=case, seed=team.seed(p), op=op)
        for _ in mine:
            p.reply()
    for name, case, op in ops:
        replies = collect(team.peers, [keys[(name, p.name)] for p in team.peers], tmp_path)
        results = team.results(replies)
        expected = team.order if op == "add" else nest_sum(team.inputs(case))
        for r in results:
            assert_same(expected, r)
        assert_identical(results)


@pytest.mark.parametrize("group", ["shm4", "tcp4"])
def test_many_names_in_flight(teams, group, tmp_path):
    """Thirty small all-reduces started in a different order on every member."""
    team = teams[group]
    names = [unique("many") for _ in range(30)]
    for i, p in enumerate(team.peers):
        order = names[::-1] if i % 2 else names
        order = order[i:] + order[:i]
        for name in order:
            p.send(
                "start",
                group=group,
                key=f"{name}-{p.name}",
                name=name,
                case="t/int64/3",
                seed=team.seed(p) * 1000 + names.index(name),
            )
        for _ in order:
            p.reply()
    for j, name in enumerate(names):
        results = team.results(
            collect(team.peers, [f"{name}-{p.name}" for p in team.peers], tmp_path)
        )
        seeds = {team.member_name(p): team.seed(p) * 1000 + j for p in team.peers}
        expected = nest_sum(team.inputs("t/int64/3", seeds))
        for r in results:
            assert_same(expected, r)


@pytest.mark.parametrize("group", ["shm3", "tcp3", "shm4"])
@pytest.mark.parametrize("case", ["t/int64/5", "t/float32/300007", "nest"])
def test_repeated_same_name_is_sequenced(teams, group, case, tmp_path):
    """The same name several times in a row, all in flight at once: the n-th call
    on every member reduces together, whatever the timing."""
    team = teams[group]
    name = unique("again")
    rounds = 4
    keys = {p.name: [] for p in team.peers}
    for p in team.peers:
        for k in range(rounds):
            key = f"{name}-{k}-{p.name}"
            keys[p.name].append(key)
            p.send("start", group=group, key=key, name=name, case=case, seed=team.seed(p) * 10 + k)
        for _ in range(rounds):
            p.reply()
    for k in range(rounds):
        replies = collect(team.peers, [keys[p.name][k] for p in team.peers], tmp_path)
        results = team.results(replies)
        seeds = {team.member_name(p): team.seed(p) * 10 + k for p in team.peers}
        expected = nest_sum(team.inputs(case, seeds))
        for r in results:
            assert_same(expected, r)
        assert_identical(results)


# ---------------------------------------------------------------------------
# Errors


def _failures(replies, kinds=("RpcError",)):
    """The error messages of failed all-reduces, each of a moolib.errors class in
    ``kinds`` (a plain RpcError: members that disagree)."""
    assert not any(r["ok"] for r in replies), replies
    for r in replies:
        assert r["type"] in kinds, r
    return [r["error"] for r in replies]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize(
    ("cases", "ops"),
    [
        (["t/float32/3", "t/float32/4"], [None, None]),  # shape
        (["t/float32/5", "t/int32/5"], [None, None]),  # dtype, same byte size
        (["t/float32/20000", "t/float32/20001"], [None, None]),  # large
        (["t/float32/30000", "t/float32/300"], [None, None]),  # large and small
        (["nest", "t/float32/5"], [None, None]),  # structure
        (["t/float32/5", "t/float32/5"], [None, "add"]),  # sum on one, custom op on other
        # The same flat data, structured differently:
        (["t/float32/2x3", "t/float32/3x2"], [None, None]),
        (["t/float32/200x300", "t/float32/300x200"], [None, None]),
        (["keys_a", "keys_b"], [None, None]),
        (["nest_flat", "nest_deep"], [None, None]),
    ],
    ids=[
        "shape",
        "dtype",
        "large",
        "large-small",
        "structure",
        "op",
        "same-size-shape",
        "same-size-shape-large",
        "dict-keys",
        "nesting",
    ],
)
def test_mismatched_data_fails_on_every_member(teams, transport, cases, ops, tmp_path):
    team = teams[f"{transport}3"]
    name = unique("mismatch")
    # Member 0 passes one thing, the other two another.
    keys = []
    for i, p in enumerate(team.peers):
        key = f"{name}-{p.name}"
        keys.append(key)
        j = 0 if i == 0 else 1
        p.send("start", group=team.group, key=key, name=name, case=cases[j], seed=1, op=ops[j])
    for p in team.peers:
        p.reply()
    errors = _failures(collect(team.peers, keys))
    # A member whose data reaches a member that already failed the all-reduce
    # may fail for that reason first; one at least names the mismatch.
    assert any("differen" in e for e in errors), errors
    for e in errors:
        assert "differen" in e or "did not take its data" in e, e
    # The group still works, with the same name too.
    results = team.results(team.run(name, "t/int32/6", out_dir=tmp_path))
    for r in results:
        assert_same(nest_sum(team.inputs("t/int32/6")), r)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_member_starting_after_a_failed_all_reduce_fails_too(teams, transport, tmp_path):
    """Two members fail an all-reduce (mismatch) before the third starts it: the
    third fails too instead of waiting forever."""
    team = teams[f"{transport}3"]
    name = unique("late")
    first, second, late = team.peers
    keys = [f"{name}-{p.name}" for p in team.peers]
    first.send("start", group=team.group, key=keys[0], name=name, case="t/float32/3", seed=1)
    second.send("start", group=team.group, key=keys[1], name=name, case="t/float32/4", seed=1)
    first.reply()
    second.reply()
    _failures(collect([first, second], keys[:2]))
    late.request("start", group=team.group, key=keys[2], name=name, case="t/float32/4", seed=1)
    _failures(collect([late], keys[2:]))
    # Then all goes on as usual.
    results = team.results(team.run(unique("after-late"), "t/int64/4", out_dir=tmp_path))
    for r in results:
        assert_same(nest_sum(team.inputs("t/int64/4")), r)


def test_empty_structure_against_data_fails_on_every_member(teams, tmp_path):
    """One member passes no leaves at all, the other a tensor: like any other
    mismatch, both must fail (not one succeed while the other fails)."""
    team = teams["tcp2"]
    name = unique("empty-vs-data")
    keys = []
    for i, p in enumerate(team.peers):
        key = f"{name}-{p.name}"
        keys.append(key)
        p.send(
            "start",
            group=team.group,
            key=key,
            name=name,
            case=["empty_nest", "t/float32/5"][i],
            seed=1,
        )
    for p in team.peers:
        p.reply()
    replies = collect(team.peers, keys)
    assert not any(r["ok"] for r in replies), replies


@pytest.mark.parametrize(
    ("transport", "case"),
    [("shm", "t/float32/200001"), ("tcp", "t/float32/5"), ("tcp", "t/float32/200001")],
)
def test_member_killed_during_all_reduce_fails_it_everywhere(
    peers, broker, logs, transport, case, tmp_path
):
    """Three members wait in an all-reduce that a fourth never joins; it is
    killed: every survivor's all-reduce fails (never hangs), naming the change."""
    victim = GroupPeer(unique("victim"), broker.address, logs, tcp=True)
    try:
        group = unique(f"fault-kill-{transport}")
        team = Team(group, peers[:3], transport)
        team.join()
        join([victim], group, rpc=transport, timeout=KILL_TIMEOUT)
        vname = victim.tcp_name if transport == "tcp" else victim.name
        wait_members([*team.peers, victim], group, {*team.by_name, vname})
        name = unique("doomed")
        keys = []
        for p in team.peers:
            keys.append(f"{name}-{p.name}")
            p.send("start", group=group, key=keys[-1], name=name, case=case, seed=team.seed(p))
        for p in team.peers:
            p.reply()
        victim.kill()
        # The broker drops the victim, or a send to it finds its links gone.
        errors = _failures(
            collect(team.peers, keys), ("MembershipChangedError", "ConnectionLostError")
        )
        for e in errors:
            assert "membership" in e or vname in e, e
        # The survivors go on as a group of three.
        team.settle()
        results = team.results(team.run(unique("after-kill"), case, out_dir=tmp_path))
        for r in results:
            assert_same(nest_sum(team.inputs(case)), r)
        for p in team.peers:
            p.request("close", group=group)
    finally:
        victim.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_member_joining_during_all_reduce_fails_it_everywhere(peers, transport, tmp_path):
    group = unique(f"fault-join-{transport}")
    team = Team(group, peers[:3], transport)
    team.join()
    name = unique("interrupted")
    waiting = team.peers[:2]  # the third member never calls it
    keys = []
    for p in waiting:
        keys.append(f"{name}-{p.name}")
        p.send("start", group=group, key=keys[-1], name=name, case="t/int32/9", seed=1)
    for p in waiting:
        p.reply()
    newcomer = peers[3]
    join([newcomer], group, rpc=transport)
    errors = _failures(collect(waiting, keys), ("MembershipChangedError",))
    for e in errors:
        assert "membership" in e and "changed" in e, e
    # Everyone, newcomer included, all-reduces fine afterwards.
    team = Team(group, peers, transport)
    team.settle()
    results = team.results(team.run(unique("after-join"), "t/int32/9", out_dir=tmp_path))
    for r in results:
        assert_same(nest_sum(team.inputs("t/int32/9")), r)
    for p in peers:
        p.request("close", group=group)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", ["t/int32/9", "t/float32/100001"])
def test_all_reduce_right_after_a_join(peers, transport, case, tmp_path):
    """Each member starts as soon as it sees the new member, while others may
    not have seen it yet: messages for the new sync id that arrive early are
    kept, and the all-reduce succeeds everywhere."""
    group = unique(f"fresh-join-{transport}")
    old = Team(group, peers[:3], transport)
    old.join()
    newcomer = peers[3]
    name = unique("fresh")
    for p in old.peers:
        p.send(
            "start",
            group=group,
            key=f"{name}-{p.name}",
            name=name,
            case=case,
            seed=old.seed(p),
            when_members=4,
        )
    join([newcomer], group, rpc=transport)
    newcomer.send(
        "start",
        group=group,
        key=f"{name}-{newcomer.name}",
        name=name,
        case=case,
        seed=old.seed(newcomer),
        when_members=4,
    )
    for p in peers:
        p.reply()
    team = Team(group, peers, transport)
    team.settle()
    results = team.results(collect(peers, [f"{name}-{p.name}" for p in peers], tmp_path))
    for r in results:
        assert_same(nest_sum(team.inputs(case)), r)
    assert_identical(results)
    for p in peers:
        p.request("close", group=group)


def test_malformed_group_messages_get_errors_and_group_keeps_working(
    teams, broker, make_rpc, tmp_path
):
    team = teams["shm3"]
    target = team.order[0]
    rpc = make_rpc("prankster")
    rpc.connect(broker.address)
    function = f"__moolib_group/{team.group}"
    for args in [("not a collective message",), (b"\x01" * 64,), (), ({"kind": 1}, [1, 2, 3])]:
        with pytest.raises(moolib.RpcError, match="malformed group message"):
            rpc.async_(target, function, *args).result(DEADLINE)
    with pytest.raises(moolib.RpcError, match="__moolib_group/no-such-group"):
        rpc.async_(target, "__moolib_group/no-such-group", b"x").result(DEADLINE)
    results = team.results(team.run(unique("after-prank"), "nest", out_dir=tmp_path))
    for r in results:
        assert_same(nest_sum(team.inputs("nest")), r)


# ---------------------------------------------------------------------------
# The AllReduce handle, in this process


@pytest.fixture
def local_broker():
    b = moolib.Broker()
    b.address = b.listen("127.0.0.1:0")
    try:
        yield b
    finally:
        b.close()


def _local_group(make_rpc, broker, name, group="local"):
    rpc = make_rpc(name)
    rpc.connect(broker.address)
    g = moolib.Group(rpc, group)
    g.update()
    return g


@pytest.mark.parametrize("n", [11, 16])
def test_many_members_sum_small_buffers_alike(make_rpc, local_broker, n):
    """Past 8 members small buffers go by recursive doubling (11: three members
    fold into others first; 16: a power of two): the sums are right, and every
    member gets the same bits."""
    groups = [
        _local_group(make_rpc, local_broker, f"many{n}-{i}", group=f"many{n}") for i in range(n)
    ]
    settle(groups)
    rng = np.random.default_rng(n)
    data = [
        {
            "ints": np.arange(7, dtype=np.int64) * (i + 1) - i,
            "floats": torch.from_numpy(rng.standard_normal(1000).astype(np.float32)),
            "halves": torch.from_numpy(rng.standard_normal(33).astype(np.float16)),
            "scalar": float(i) / 3,
        }
        for i in range(n)
    ]
    handles = [g.all_reduce("small", d) for g, d in zip(groups, data, strict=True)]
    _wait_updating(groups, handles)
    results = [h.result() for h in handles]
    assert results[0]["ints"].tolist() == sum(d["ints"] for d in data).tolist()
    exact = sum(d["floats"].double() for d in data)
    assert torch.allclose(results[0]["floats"].double(), exact, atol=1e-4)
    exact = sum(d["halves"].double() for d in data)
    assert torch.allclose(results[0]["halves"].double(), exact, atol=0.1)
    assert results[0]["scalar"] == pytest.approx(sum(d["scalar"] for d in data))
    for r in results[1:]:
        assert r["ints"].tolist() == results[0]["ints"].tolist()
        for key in ("floats", "halves"):
            assert r[key].numpy().tobytes() == results[0][key].numpy().tobytes(), key
        assert r["scalar"] == results[0]["scalar"]
    for g in groups:
        g.close()


def _many_members(make_rpc, broker, n, group):
    """n members of one group in this process, settled."""
    groups = [_local_group(make_rpc, broker, f"{group}-{i}", group=group) for i in range(n)]
    settle(groups)
    return groups


def _member_order(groups):
    by_name = {g.rpc.get_name(): g for g in groups}
    return [by_name[name] for name in groups[0].members()]


def _gather_data(i):
    """Member i's part of an all-gather: i % 4 out-of-band tensors of sizes
    that differ between members (one segment each), so members send different
    numbers of segments of different sizes."""
    tensors = [
        torch.arange(1100 + 37 * i + 5 * k, dtype=torch.float32) * (i + 1) for k in range(i % 4)
    ]
    return [(i, f"member {i}", tensors)]


def _check_gathered(result, n):
    assert [i for i, _, _ in result] == list(range(n))
    for i, label, tensors in result:
        expected = _gather_data(i)[0][2]
        assert label == f"member {i}"
        assert len(tensors) == len(expected)
        for t, e in zip(tensors, expected, strict=True):
            assert torch.equal(t, e), (i, t.shape, e.shape)


@pytest.mark.parametrize("n", [3, 9, 11, 16])
def test_many_members_gather_segments_of_every_size(make_rpc, local_broker, n):
    """A custom op all-gathers every member's opaque segments (past 8 members
    by Bruck's rounds: 11 members, whose last round carries fewer blocks, and
    16, a power of two; 3 and 9 members one hop and one round past it):
    members that send different numbers and sizes of segments all get every
    member's, in member order, alike."""
    groups = _member_order(_many_members(make_rpc, local_broker, n, f"gather{n}"))
    for name in ("first", "second"):
        handles = [
            g.all_reduce(name, _gather_data(i), op=lambda a, b: a + b) for i, g in enumerate(groups)
        ]
        _wait_updating(groups, handles)
        results = [h.result() for h in handles]
        for r in results:
            _check_gathered(r, n)
    for g in groups:
        g.close()


def _collective_regions():
    """The collectives' shared regions this process holds (their memfds)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:moolib-collective")
        except OSError:
            pass  # closed meanwhile
    return count


@pytest.mark.parametrize("n", [3, 9, 11, 16])
def test_many_members_large_sums_through_shared_memory(make_rpc, local_broker, n):
    """Past 8 members the shared-memory sum's rounds go by Bruck's all-gather
    of the regions and two dissemination barriers: sums of 1 MiB and of an odd
    size are right and bitwise identical on every member, and 20 of them back
    to back reuse the members' regions (the "done" barrier retires each op, so
    its region goes back to the member's cache instead of piling up)."""
    groups = _member_order(_many_members(make_rpc, local_broker, n, f"shmsum{n}"))
    rng = np.random.default_rng(n)
    sizes = {"mib": 1 << 18, "odd": 300007}  # float32 elements: 1 MiB, and an odd count
    data = [
        {
            k: torch.from_numpy(rng.standard_normal(size).astype(np.float32))
            for k, size in sizes.items()
        }
        for _ in range(n)
    ]
    for step in range(20):
        handles = [g.all_reduce("big", d) for g, d in zip(groups, data, strict=True)]
        _wait_updating(groups, handles)
        results = [h.result() for h in handles]
        if step == 0:
            for key in sizes:
                exact = sum(d[key].double() for d in data)
                assert torch.allclose(results[0][key].double(), exact, atol=1e-3), key
        for r in results[1:]:
            for key in sizes:
                assert r[key].numpy().tobytes() == results[0][key].numpy().tobytes(), key
        assert _collective_regions() > 0  # they went through shared memory
    # Every op retires once every member is done reading: a member then holds
    # the few regions its cache keeps (4), not one for each of the 20 ops.
    wait_for(
        lambda: _collective_regions() <= 4 * n,
        what=f"at most {4 * n} collective regions (not one for each op of each member)",
    )
    for g in groups:
        g.close()


@pytest.mark.parametrize("when", ["started", "finished"])
def test_many_members_shared_memory_sum_survives_a_member_leaving(make_rpc, local_broker, when):
    """A member of 11 leaves (its Rpc closes) right after starting a
    shared-memory sum, or once its own sum is done (the others may then wait
    in the "done" barrier for rounds it was to pass on): each other member's
    sum completes right or fails as a membership change, never hangs; the 10
    left go on summing, and the ops cut short leave no region behind."""
    groups = _member_order(_many_members(make_rpc, local_broker, 11, f"leaving-{when}"))
    leaver = groups[5]
    survivors = [g for g in groups if g is not leaver]
    data = [torch.full((1 << 18,), float(i + 1)) for i in range(11)]
    handles = [g.all_reduce("cut", d) for g, d in zip(groups, data, strict=True)]
    if when == "finished":
        _wait_updating(groups, [handles[5]])
    leaver.close()
    leaver.rpc.close()
    _wait_updating(survivors, [h for g, h in zip(groups, handles, strict=True) if g is not leaver])
    for g, h in zip(groups, handles, strict=True):
        if g is leaver:
            continue
        if h.exception() is None:
            assert torch.equal(h.result(), torch.full((1 << 18,), 66.0))
        else:
            assert isinstance(h.exception(), MembershipChangedError), h.exception()
    settle(survivors)
    for step in range(3):
        handles = [g.all_reduce(f"after{step}", torch.ones(1 << 18)) for g in survivors]
        _wait_updating(survivors, handles)
        for h in handles:
            assert torch.equal(h.result(), torch.full((1 << 18,), 10.0))
    wait_for(
        lambda: _collective_regions() <= 4 * len(survivors),
        what="the regions of the ops cut short gone",
    )
    for g in survivors:
        g.close()


def test_many_members_gather_links_few_peers(make_rpc, local_broker):
    """Bruck's all-gather among 16 members: each member sends to and hears from
    4 others (2^k away, k < 4), so it links to at most 8 members and the broker,
    not to all 15 others (a full mesh of descriptors as the group grows)."""
    groups = _member_order(_many_members(make_rpc, local_broker, 16, "mesh16"))
    for name in ("a", "b", "c"):
        handles = [
            g.all_reduce(name, _gather_data(i), op=lambda a, b: a + b) for i, g in enumerate(groups)
        ]
        _wait_updating(groups, handles)
        for h in handles:
            _check_gathered(h.result(), 16)
    for g in groups:
        linked = [p["name"] for p in g.rpc.debug_info()["peers"] if p["connections"]]
        assert len(linked) <= 2 * 4 + 1, (g.rpc.get_name(), sorted(linked))
    for g in groups:
        g.close()


def test_all_reduce_when_not_active_fails_at_once(make_rpc, local_broker):
    rpc = make_rpc("not-joined")
    rpc.connect(local_broker.address)
    g = moolib.Group(rpc, "idle")  # update() never called: never joins
    for data, op in [(torch.ones(3), None), (1, None), ([1], lambda a, b: a + b)]:
        h = g.all_reduce("x", data, op=op)
        assert h.done()
        assert isinstance(h.exception(), moolib.RpcError)
        with pytest.raises(moolib.RpcError, match="not an active member"):
            h.result()
    # Closed: fails at once too.
    g2 = _local_group(make_rpc, local_broker, "closer", group="closing")
    settle([g2])
    g2.close()
    h = g2.all_reduce("x", torch.ones(3))
    assert h.done()
    with pytest.raises(moolib.RpcError, match="closed"):
        h.result()


def test_single_member_and_handle_api(make_rpc, local_broker):
    g = _local_group(make_rpc, local_broker, "solo")
    settle([g])
    data = {"t": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": [3, 1.5, True]}
    h = g.all_reduce("solo", data)
    assert h.wait(DEADLINE)
    assert h.done()
    assert h.exception() is None
    result = h.result()
    assert_same(data, result)
    assert h.result() is result  # computed once
    called = []
    h.add_done_callback(lambda x: called.append(x))
    wait_for(lambda: called, what="the done callback on a completed all-reduce")
    assert called == [h]
    assert g.all_reduce("solo-op", ["only"], op=lambda a, b: a + b).result(DEADLINE) == ["only"]
    assert g.all_reduce("empty", {}).result(DEADLINE) == {}


def test_unsupported_leaves_raise(make_rpc, local_broker):
    g = _local_group(make_rpc, local_broker, "picky")
    settle([g])
    with pytest.raises(TypeError, match="cannot sum"):
        g.all_reduce("s", {"a": torch.ones(2), "b": "text"})
    with pytest.raises(TypeError, match="cannot sum"):
        g.all_reduce("n", None)
    with pytest.raises(TypeError, match="all_reduce: op must be callable, got int 5"):
        g.all_reduce("o", torch.ones(2), op=5)
    if hasattr(torch, "uint16"):
        with pytest.raises(Exception, match="cannot sum"):
            g.all_reduce("u16", torch.zeros(3, dtype=torch.uint16))
    for bad in ("", "x" * 1025):
        with pytest.raises(Exception, match="name must be"):
            g.all_reduce(bad, 1)
    assert g.all_reduce("x" * 1024, 1).result(DEADLINE) == 1
    # Anything picklable goes with a custom op.
    assert g.all_reduce("s", ["text"], op=lambda a, b: a + b).result(DEADLINE) == ["text"]


def test_handle_of_two_members_in_this_process(make_rpc, local_broker):
    a = _local_group(make_rpc, local_broker, "pair-a", group="pair")
    b = _local_group(make_rpc, local_broker, "pair-b", group="pair")
    settle([a, b])
    ha = a.all_reduce("p", torch.tensor([1.0, 2.0]))
    # b has not started: a cannot be done, and a bounded wait says so.
    assert not ha.wait(0.05)
    with pytest.raises(TimeoutError):
        ha.result(timeout=0.05)
    called = []
    ha.add_done_callback(lambda x: called.append(x.result()))
    hb = b.all_reduce("p", torch.tensor([10.0, 20.0]))
    for h in (ha, hb):
        assert torch.equal(h.result(DEADLINE), torch.tensor([11.0, 22.0]))
    wait_for(lambda: called, what="the done callback")
    assert torch.equal(called[0], torch.tensor([11.0, 22.0]))

    async def both():
        return await asyncio.gather(
            a.all_reduce("q", np.array([1, 2], dtype=np.int64)),
            b.all_reduce("q", np.array([3, 4], dtype=np.int64)),
        )

    ra, rb = asyncio.run(asyncio.wait_for(both(), DEADLINE))
    for r in (ra, rb):
        assert isinstance(r, np.ndarray) and r.dtype == np.int64
        assert r.tolist() == [4, 6]
    # cancel() stops waiting here; the other member still completes.
    hc = a.all_reduce("c", 1)
    hc.cancel()
    assert b.all_reduce("c", 2).result(DEADLINE) == 3
    # Closing fails what is pending here, at once.
    hd = a.all_reduce("d", 1)
    a.close()
    with pytest.raises(moolib.RpcError, match="closed"):
        hd.result(DEADLINE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_come_back_on_their_device(make_rpc, local_broker):
    a = _local_group(make_rpc, local_broker, "gpu-a", group="gpu")
    b = _local_group(make_rpc, local_broker, "gpu-b", group="gpu")
    settle([a, b])
    x = {"big": torch.ones(100000, device="cuda"), "small": torch.arange(3, device="cuda")}
    ha, hb = a.all_reduce("g", x), b.all_reduce("g", x)
    for h in (ha, hb):
        r = h.result(DEADLINE)
        assert r["big"].device == x["big"].device and r["small"].device == x["small"].device
        assert torch.equal(r["big"].cpu(), torch.full((100000,), 2.0))
        assert torch.equal(r["small"].cpu(), torch.arange(3) * 2)


def _wait_updating(groups, handles):
    """Waits for every handle while the groups' programs go on calling update()."""
    end = time.monotonic() + 3 * DEADLINE
    while not all(h.done() for h in handles):
        assert time.monotonic() < end, "the all-reduces never completed"
        for g in groups:
            g.update()
        time.sleep(0.02)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("size", [3, 1 << 20], ids=["direct", "large"])
def test_all_reduce_a_member_never_starts_fails_naming_it(make_rpc, local_broker, transport, size):
    """A member that stays in the group but never starts an all-reduce does not
    make the others wait forever: after the collective timeout it fails on
    every member that started it, naming the one they wait for."""
    groups = []
    for i in range(3):
        rpc = make_rpc(f"late{i}", transports=["tcp"] if transport == "tcp" else None)
        rpc.connect(local_broker.address)
        g = moolib.Group(rpc, "deadline")
        g.set_collective_timeout(2)
        assert g.get_collective_timeout() == 2
        g.update()
        groups.append(g)
    settle(groups)
    order = groups[0].members()
    absent = next(g for g in groups if g.rpc.get_name() == order[-1])
    started = [g for g in groups if g is not absent]
    handles = [g.all_reduce("never", torch.ones(size)) for g in started]
    _wait_updating(groups, handles)
    for h in handles:
        error = str(h.exception())
        assert "all_reduce 'never'" in error and "timed out after 2 s" in error, error
        assert f"'{absent.rpc.get_name()}'" in error, error
    # The group goes on: the next all-reduce of every member completes.
    handles = [g.all_reduce("after", torch.ones(3)) for g in groups]
    _wait_updating(groups, handles)
    assert all(torch.equal(h.result(), torch.full((3,), 3.0)) for h in handles)


def test_collective_timeout_defaults_and_bad_values(make_rpc, local_broker):
    g = _local_group(make_rpc, local_broker, "defaults")
    assert g.get_collective_timeout() == 60
    g.set_timeout(45)
    assert g.get_collective_timeout() == 90  # twice the group timeout when that is longer
    with pytest.raises(Exception, match="collective timeout"):
        g.set_collective_timeout(-1)
