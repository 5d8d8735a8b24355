"""Group members for the membership-churn test (tests/test_group.py).

Usage: churn_member.py BROKER GROUP survive NAME
       churn_member.py BROKER GROUP churn COUNT SURVIVORS

``survive``: one member named NAME that sums a 1 MiB numpy array with the
group over and over (a round a membership change fails is simply started
again), calling update() between rounds; prints ``ROUNDS N`` after each
hundredth round. It never imports torch, so what it holds is moolib's.

``churn``: COUNT members one after another, each a fresh Rpc that joins, waits
until it sees SURVIVORS + 1 members, sums one round with them, and goes: every
other one leaves with Group.close(), the rest only close their Rpc, as a process
that dies does. Prints ``CHURNED N`` after each one.
"""

from __future__ import annotations

import sys
import time

import numpy as np

import moolib
from moolib.errors import MembershipChangedError

# Short, so that members learn of each change quickly (they ping every timeout/8).
GROUP_TIMEOUT = 3.2
DEADLINE = 120.0


def member(broker: str, group_name: str, name: str) -> tuple[moolib.Rpc, moolib.Group]:
    rpc = moolib.Rpc()
    rpc.set_name(name)
    rpc.set_timeout(60)
    rpc.connect(broker)
    group = moolib.Group(rpc, group_name)
    group.set_timeout(GROUP_TIMEOUT)
    return rpc, group


def one_round(group: moolib.Group, data: np.ndarray) -> bool:
    """One all-reduce; False if a membership change failed it (the caller retries)."""
    try:
        # Waiting for a slow joiner is not a reason to leave.
        with group.keepalive():
            group.all_reduce("sum", data).result()
        return True
    except MembershipChangedError:
        return False


def survive(broker: str, group_name: str, name: str) -> None:
    _, group = member(broker, group_name, name)
    data = np.ones(1 << 18, dtype=np.float32)
    rounds = 0
    while True:
        group.update()
        if not group.active():
            time.sleep(0.01)
            continue
        if one_round(group, data):
            rounds += 1
            if rounds % 100 == 0:
                print(f"ROUNDS {rounds}", flush=True)


def churn(broker: str, group_name: str, count: int, survivors: int) -> None:
    data = np.ones(1 << 18, dtype=np.float32)
    for i in range(count):
        rpc, group = member(broker, group_name, f"churn-{i}")
        end = time.monotonic() + DEADLINE
        while True:
            assert time.monotonic() < end, f"churn-{i} never summed a round with the group"
            group.update()
            if len(group.members()) == survivors + 1 and one_round(group, data):
                break
            time.sleep(0.005)
        if i % 2 == 0:
            group.close()
        rpc.close()
        print(f"CHURNED {i + 1}", flush=True)


def main() -> None:
    broker, group_name, mode = sys.argv[1:4]
    moolib.set_log_level("info")  # membership changes, in the test's log of this process
    if mode == "survive":
        survive(broker, group_name, sys.argv[4])
    else:
        churn(broker, group_name, int(sys.argv[4]), int(sys.argv[5]))


if __name__ == "__main__":
    main()
