"""Group membership across processes: a broker run by ``python -m moolib.broker``
and members in tests/helpers/group_peer.py subprocesses (join order, sort order,
sync ids, leaving, members killed with SIGKILL), plus the Group API in this
process."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest
from helpers.group_util import (
    GroupPeer,
    LineProcess,
    agreed_status,
    join,
    settle,
    start_group_peers,
    sync_peers,
    wait_members,
)
from helpers.util import DEADLINE, freeze, process_usage, wait_for

import moolib

pytestmark = pytest.mark.usefixtures("watchdog")


@pytest.fixture(autouse=True)
def _drain_peers(request):
    """A test that fails half way leaves no reply behind for the next one."""
    yield from sync_peers(request)


# A member killed with this timeout must be gone from the others' lists by then
# plus SLACK (broker and members ping every timeout/8; the machine may be loaded).
KILL_TIMEOUT = 2.0
SLACK = 30.0


@pytest.fixture(scope="module")
def peers(broker, logs):
    """Four member processes shared by the module; each test uses its own groups."""
    ps = start_group_peers([f"gp{i}" for i in range(4)], broker.address, logs)
    try:
        yield ps
    finally:
        for p in ps:
            p.stop()


@pytest.fixture
def extra_peer(broker, logs):
    """Starts extra member processes for one test (to kill them); stops them after."""
    made = []

    def make(name, tcp=False):
        p = GroupPeer(name, broker.address, logs, tcp=tcp)
        made.append(p)
        return p

    try:
        yield make
    finally:
        for p in made:
            p.stop()


def names(ps):
    return [p.name for p in ps]


def test_members_ordered_by_sort_order_then_join_order(peers):
    p0, p1, p2, p3 = peers
    # Join one by one (each after the previous shows up), so join order is p0..p3.
    join(peers, "order", sort=[5, 0, 5, -1], one_by_one=True)
    first = wait_members(peers, "order", ["gp3", "gp1", "gp0", "gp2"])
    # Every member reports the same list and sync id (wait_members checks), and
    # update() reported the change.
    assert all(p.request("update", group="order")["changed"] for p in peers)
    # A new sort order reorders everyone, under a new sync id.
    p2.request("sort", group="order", order=-5)
    second = wait_members(peers, "order", ["gp2", "gp3", "gp1", "gp0"])
    assert second["sync_id"] != first["sync_id"]
    assert all(p.request("update", group="order")["changed"] for p in peers)
    # Equal sort orders keep join order: p0 joined before p2.
    p2.request("sort", group="order", order=5)
    wait_members(peers, "order", ["gp3", "gp1", "gp0", "gp2"])
    for p in peers:
        p.request("close", group="order")


def test_sync_id_changes_on_join_and_leave(peers):
    p0, p1, p2, _ = peers
    seen = []
    expected = []
    for p in (p0, p1, p2):
        join([p], "sync")
        expected.append(p.name)
        status = wait_members(peers[: len(expected)], "sync", expected)
        seen.append(status["sync_id"])
        # update() is True once after a change, then False until the next one.
        assert p0.request("update", group="sync")["changed"] is True
        assert p0.request("update", group="sync")["changed"] is False
    p1.request("close", group="sync")
    status = wait_members([p0, p2], "sync", ["gp0", "gp2"])
    seen.append(status["sync_id"])
    assert p0.request("update", group="sync")["changed"] is True
    assert len(set(seen)) == len(seen), f"sync ids repeat: {seen}"
    assert 0 not in seen
    # Joining again gets the end of the list (join order), with a new sync id.
    join([p1], "sync")
    status = wait_members([p0, p1, p2], "sync", ["gp0", "gp2", "gp1"])
    assert status["sync_id"] not in seen
    for p in (p0, p1, p2):
        p.request("close", group="sync")


def test_close_leaves_promptly(peers):
    p0, p1, p2, _ = peers
    # A long timeout: leaving must not wait for it to expire.
    join([p0, p1, p2], "leave", timeout=4 * DEADLINE)
    before = wait_members([p0, p1, p2], "leave", {"gp0", "gp1", "gp2"})
    p2.request("close", group="leave")
    after = wait_members([p0, p1], "leave", {"gp0", "gp1"}, timeout=DEADLINE)
    assert after["sync_id"] != before["sync_id"]
    for p in (p0, p1):
        p.request("close", group="leave")


def test_killed_member_disappears_and_new_member_appears(peers, extra_peer):
    p0, p1, p2, _ = peers
    victim = extra_peer("victim")
    join([p0, p1], "kill", one_by_one=True)
    join([victim], "kill", timeout=KILL_TIMEOUT)
    everyone = [p0, p1, victim]
    before = wait_members(everyone, "kill", ["gp0", "gp1", "victim"])
    victim.kill()
    # Gone from every member's list within its timeout (plus slack for a loaded machine).
    after = wait_members([p0, p1], "kill", ["gp0", "gp1"], timeout=KILL_TIMEOUT + SLACK)
    assert after["sync_id"] != before["sync_id"]
    # A new member appears on every member.
    join([p2], "kill")
    last = wait_members([p0, p1, p2], "kill", ["gp0", "gp1", "gp2"])
    assert last["sync_id"] not in (before["sync_id"], after["sync_id"])
    for p in (p0, p1, p2):
        p.request("close", group="kill")


@pytest.mark.parametrize("rpc", ["default", "tcp"])
def test_a_killed_member_leaves_at_once_not_after_the_group_timeout(peers, extra_peer, rpc):
    """A member whose process ended closed its connections: the broker takes that
    as its death and drops it, rather than wait the group timeout (here longer
    than the test's whole deadline)."""
    p0, p1, _, _ = peers
    victim = extra_peer(f"dead-{rpc}", tcp=rpc == "tcp")
    me = victim.tcp_name if rpc == "tcp" else victim.name
    group = f"dead-{rpc}"
    join([p0, p1], group, timeout=10 * DEADLINE)
    join([victim], group, rpc=rpc, timeout=10 * DEADLINE)
    before = wait_members([p0, p1, victim], group, {"gp0", "gp1", me})
    victim.kill()
    after = wait_members([p0, p1], group, {"gp0", "gp1"}, timeout=DEADLINE)
    assert after["sync_id"] != before["sync_id"]
    for p in (p0, p1):
        p.request("close", group=group)


def test_a_stopped_member_stays_until_the_group_timeout_then_leaves(peers, extra_peer):
    """A hung member keeps its connections open: it is not taken for dead, and
    leaves only once it has not pinged for the group timeout."""
    p0, p1, _, _ = peers
    victim = extra_peer("hung")
    timeout = 8.0
    join([p0, p1, victim], "hung", timeout=timeout)
    before = wait_members([p0, p1, victim], "hung", {"gp0", "gp1", "hung"})
    freeze(victim.proc.pid)
    try:
        stopped = time.monotonic()
        # Well within the timeout, the stopped member is still listed.
        time.sleep(timeout / 4)
        held = agreed_status([p0, p1], "hung")
        assert held is not None and "hung" in held["members"], held
        assert time.monotonic() - stopped < timeout, "the check itself came too late"
        after = wait_members([p0, p1], "hung", {"gp0", "gp1"}, timeout=timeout + SLACK)
        assert after["sync_id"] != before["sync_id"]
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    for p in (p0, p1):
        p.request("close", group="hung")


CHURN_MEMBER = Path(__file__).parent / "helpers" / "churn_member.py"
# Members come and go this many times (half leave, half close their Rpc as a dead
# process does) while three members keep summing with each membership.
CHURNS = 100
# What the allocator's high-water marks and the loop's spare workers move by. glibc
# gives each thread that allocates an arena of its own, and what it frees stays
# there; one arena makes the resident size measure what the process keeps.
ONE_ARENA = {"MALLOC_ARENA_MAX": "1"}
RSS_SLACK_KIB = 4 * 1024
THREAD_SLACK = 2


@pytest.mark.slow
def test_nothing_grows_on_the_survivors_per_membership_change(broker, logs):
    """After 100 joins and leaves, each survivor's descriptors, threads and resident
    size are where they were after the first few."""
    survivors = [
        LineProcess(
            [sys.executable, str(CHURN_MEMBER), broker.address, "churn", "survive", f"s{i}"],
            logs / f"churn-s{i}.log",
            env=ONE_ARENA,
        )
        for i in range(3)
    ]
    try:

        def churned(count):
            """Starts a churner for ``count`` members; waits until it is done."""
            proc = LineProcess(
                [
                    sys.executable,
                    str(CHURN_MEMBER),
                    broker.address,
                    "churn",
                    "churn",
                    str(count),
                    str(len(survivors)),
                ],
                logs / f"churn-{count}.log",
            )
            for i in range(count):
                line = proc.next_line(timeout=DEADLINE, what=f"CHURNED {i + 1}")
                assert line == f"CHURNED {i + 1}", line
            assert proc.proc.wait(timeout=DEADLINE) == 0, proc.log()
            proc.stop()

        def usage():
            # Departed peers are forgotten ~10 s after their last link closed, and
            # spare loop workers end 5 s after the last blocked one: both settle.
            time.sleep(12)
            return [process_usage(p.pid) for p in survivors]

        churned(6)
        before = usage()
        churned(CHURNS)
        after = usage()
        for s, b, a in zip(survivors, before, after, strict=True):
            assert s.alive(), s.log()
            assert a["fds"] <= b["fds"], (b, a)
            assert a["threads"] <= b["threads"] + THREAD_SLACK, (b, a)
            assert a["rss_kib"] - b["rss_kib"] < RSS_SLACK_KIB, (b, a)
    finally:
        for p in survivors:
            p.kill()
            p.stop()


def test_groups_are_independent(peers):
    p0, p1, p2, p3 = peers
    join([p0, p1, p2], "left-group", one_by_one=True)
    join([p2, p3], "right-group", one_by_one=True)
    left = wait_members([p0, p1, p2], "left-group", ["gp0", "gp1", "gp2"])
    right = wait_members([p2, p3], "right-group", ["gp2", "gp3"])
    assert left["sync_id"] != right["sync_id"]
    # Leaving one group does not touch the other.
    p2.request("close", group="right-group")
    wait_members([p3], "right-group", ["gp3"])
    again = wait_members([p0, p1, p2], "left-group", ["gp0", "gp1", "gp2"])
    assert again["sync_id"] == left["sync_id"]
    for p in (p0, p1, p2):
        p.request("close", group="left-group")
    p3.request("close", group="right-group")


def test_group_status_fields(peers):
    p0 = peers[0]
    join([p0], "fields", timeout=7.5)
    status = wait_members([p0], "fields", ["gp0"])
    assert status["name"] == "fields"
    assert status["timeout"] == 7.5
    assert status["active"] is True
    p0.request("close", group="fields")


# ---------------------------------------------------------------------------
# The Group API in this process


def test_group_api_without_broker(make_rpc):
    rpc = make_rpc("lonely")
    g = moolib.Group(rpc, "nobody-here")
    assert g.rpc is rpc
    assert g.name() == "nobody-here"
    assert g.get_timeout() == 10
    g.set_timeout(2.5)
    assert g.get_timeout() == 2.5
    for bad in (0, -1, float("nan"), float("inf"), 1e7):
        with pytest.raises(ValueError, match=r"group timeout \(Group.set_timeout\)"):
            g.set_timeout(bad)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="collective timeout"):
            g.set_collective_timeout(bad)
    g.set_collective_timeout(0)  # the default: derived from the group timeout
    assert g.get_timeout() == 2.5
    with pytest.raises(Exception, match="broker name"):
        g.set_broker_name("")
    g.set_sort_order(-3)
    assert g.update() is False  # starts joining; nothing changed yet
    assert not g.active()
    assert g.members() == []
    assert g.sync_id() == 0
    g.close()
    g.close()  # twice is fine
    with pytest.raises(Exception, match="group name"):
        moolib.Group(rpc, "")
    # A second Group of a name on one Rpc names the group, not its internal function.
    first = moolib.Group(rpc, "twice")
    with pytest.raises(RuntimeError, match="this Rpc already has a Group named 'twice'"):
        moolib.Group(rpc, "twice")
    first.close()
    moolib.Group(rpc, "twice").close()  # the name is free again


def test_group_in_this_process_joins_broker_process(make_rpc, broker, peers):
    p0 = peers[0]
    rpc = make_rpc("local-member")
    rpc.connect(broker.address)
    g = moolib.Group(rpc, "mixed")
    g.update()
    join([p0], "mixed")

    def both():
        return set(g.members()) == {"local-member", "gp0"} and g.active()

    wait_for(both, what="both members seen here")
    status = wait_members([p0], "mixed", set(g.members()))
    assert status["members"] == g.members()
    assert status["sync_id"] == g.sync_id()
    g.close()
    wait_members([p0], "mixed", ["gp0"])
    p0.request("close", group="mixed")


def test_closed_group_is_not_active(make_rpc, broker):
    rpc = make_rpc("closing-member")
    rpc.connect(broker.address)
    g = moolib.Group(rpc, "closing")
    g.update()
    wait_for(lambda: g.active() and g.members() == ["closing-member"], what="membership")
    g.close()
    # It left the group: it is no longer an active member, and not in its own list.
    assert not g.active()
    assert "closing-member" not in g.members()


def _member(make_rpc, broker, name, group, timeout):
    rpc = make_rpc(name)
    rpc.connect(broker.address)
    g = moolib.Group(rpc, group)
    g.set_timeout(timeout)
    g.update()
    return g


def test_member_that_stops_calling_update_leaves_and_rejoins(make_rpc, broker):
    """Liveness follows the program: a member whose process is alive but which
    no longer calls update() leaves within its timeout; update() rejoins it."""
    a = _member(make_rpc, broker, "lively", "liveness", timeout=2.0)
    b = _member(make_rpc, broker, "stalled", "liveness", timeout=2.0)
    settle([a, b])
    # From here on only a calls update().
    wait_for(
        lambda: a.update() is not None and a.members() == ["lively"],
        what="the stalled member leaving the others' list",
    )
    assert not b.active() and b.members() == []
    # The remaining member does not wait for it.
    assert a.all_reduce("alone", 1).result(DEADLINE) == 1
    assert b.update() is True  # it noticed it left; the call rejoins
    settle([a, b])
    handles = [g.all_reduce("together", 1) for g in (a, b)]
    assert [h.result(DEADLINE) for h in handles] == [2, 2]


def test_keepalive_keeps_a_member_through_a_long_gap_between_updates(make_rpc, broker):
    a = _member(make_rpc, broker, "steady", "held", timeout=2.0)
    b = _member(make_rpc, broker, "computing", "held", timeout=2.0)
    settle([a, b])
    sync_id = a.sync_id()
    with b.keepalive(), b.keepalive():  # nested holds count
        end = time.monotonic() + 5.0  # 2.5 timeouts without b.update()
        while time.monotonic() < end:
            a.update()
            assert a.members() == ["steady", "computing"] or a.members() == [
                "computing",
                "steady",
            ]
            time.sleep(0.05)
    assert b.active() and a.sync_id() == b.sync_id() == sync_id
    # Released: the usual rule applies again.
    wait_for(
        lambda: a.update() is not None and a.members() == ["steady"],
        what="the member leaving once its hold ended and it stopped calling update()",
    )
    with pytest.raises(Exception, match="released more often than held"):
        b._hold_membership(False)
