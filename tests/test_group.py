"""Group membership across processes: a broker run by ``python -m moolib.broker``
and members in tests/helpers/group_peer.py subprocesses (join order, sort order,
sync ids, leaving, members killed with SIGKILL), plus the Group API in this
process."""

from __future__ import annotations

import time

import pytest
from helpers.group_util import (
    GroupPeer,
    join,
    settle,
    start_group_peers,
    sync_peers,
    wait_members,
)
from helpers.util import DEADLINE, wait_for

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

    def make(name):
        p = GroupPeer(name, broker.address, logs)
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
