"""The spin before a blocking wait (moolib/core/spin.h; docs/architecture.md,
"A tiny sync() round trip"): its budget comes from MOOLIB_SPIN_US (0 turns it
off) and is zero in a process that has one CPU; a thread whose spins keep
running out turns to blocking; and calls behave the same with spinning on or
off, on both transports, in bursts, with errors and with large arguments."""

from __future__ import annotations

import json
import os
import threading

import pytest
from helpers.util import DEADLINE, TRANSPORT_IDS, TRANSPORTS, client_of, module_server, run_script

from moolib import _core

pytestmark = pytest.mark.usefixtures("watchdog")

_PRINT_STATS = "import json, moolib._core as c; print(json.dumps(c._spin_stats()))\n"


@pytest.mark.parametrize(
    ("value", "budget"),
    [(None, 20), ("0", 0), ("7", 7), ("", 20), ("fast", 20), ("-3", 20), ("999999", 10000)],
)
def test_budget_comes_from_moolib_spin_us(tmp_path, value, budget):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: the budget is always zero")
    env = {"MOOLIB_SPIN_US": value} if value is not None else {}
    # child_env keeps this process's environment: drop a MOOLIB_SPIN_US set around the tests.
    code = "import os\nos.environ.pop('MOOLIB_SPIN_US', None)\n" if value is None else ""
    out = run_script(code + _PRINT_STATS, tmp_path, env=env)
    assert out.returncode == 0, out.stdout
    assert json.loads(out.stdout.splitlines()[-1])["budget_us"] == budget


def test_a_process_on_one_cpu_never_spins(tmp_path):
    code = "import os\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n" + _PRINT_STATS
    out = run_script(code, tmp_path, env={"MOOLIB_SPIN_US": "50"})
    assert out.returncode == 0, out.stdout
    assert json.loads(out.stdout.splitlines()[-1])["budget_us"] == 0


@pytest.fixture(scope="module", params=TRANSPORTS[1:], ids=TRANSPORT_IDS[1:])
def server(request, module_spawn_peer):
    """A peer process on one transport (shm, tcp), shared by the module."""
    return module_server(module_spawn_peer, "spin-srv-", request.param)


def test_spins_that_keep_running_out_turn_a_thread_to_blocking(make_rpc, server):
    if _core._spin_stats()["budget_us"] == 0:
        pytest.skip("spinning is off in this process")
    client = client_of(make_rpc, server, "spin-client-")
    assert client.sync(server.name, "echo", 1) == 1
    calls = 200
    stats = {}

    def slow_calls() -> None:
        # A thread of its own starts with a fresh policy (it spins first).
        before = _core._spin_stats()
        for _ in range(calls):
            # Each reply comes 2 ms after the request: a 20 us spin never sees it.
            assert client.sync(server.name, "sleep", 0.002) == 0.002
        after = _core._spin_stats()
        stats.update({k: after[k] - before[k] for k in ("waits", "spins")})

    thread = threading.Thread(target=slow_calls)
    thread.start()
    thread.join(DEADLINE)
    assert not thread.is_alive()
    assert stats["waits"] >= calls
    # About 13 spins before blocking wins, then one trial spin every 64 waits;
    # other threads of this process may add a few.
    assert stats["spins"] <= calls // 4, stats


_WORKLOAD = """
import json
import moolib, torch
import moolib._core as c

address, name, transports = {args}
rpc = moolib.Rpc()
rpc.set_name("spin-load-" + moolib.create_uid()[:8])
rpc.set_transports(transports)
rpc.set_timeout(60)
rpc.connect(address)
rpc.define("twice", lambda x: 2 * x)
assert rpc.sync(name, "echo", 0) == 0
for i in range(3000):
    assert rpc.sync(name, "echo", i) == i
# A burst of calls, every fifth one failing, waited for in reverse.
futures = [
    rpc.async_(name, "fail", f"no {{i}}") if i % 5 == 0 else rpc.async_(name, "add", i, 1)
    for i in range(2000)
]
for i in reversed(range(2000)):
    if i % 5 == 0:
        try:
            futures[i].result()
        except Exception as e:
            assert f"no {{i}}" in str(e), e
        else:
            raise AssertionError(f"call {{i}} should have failed")
    else:
        assert futures[i].result() == i + 1
# The peer calls back into us while we wait on it.
for i in range(200):
    assert rpc.sync(name, "call", rpc.get_name(), "twice", i) == 2 * i
t = torch.arange(1 << 20, dtype=torch.int64) % 7
assert rpc.sync(name, "checksum", t) == int(t.sum())
print(json.dumps(c._spin_stats()))
"""


@pytest.mark.parametrize("spin", ["0", "20"], ids=["blocking", "spinning"])
@pytest.mark.parametrize("transports", TRANSPORTS[1:], ids=TRANSPORT_IDS[1:])
def test_calls_behave_the_same_spinning_or_not(tmp_path, spawn_peer, transports, spin):
    env = {"MOOLIB_SPIN_US": spin}
    peer = spawn_peer("spin-load-srv", transports=transports, timeout=DEADLINE, env=env)
    args = (peer.address, peer.name, transports)
    out = run_script(_WORKLOAD.format(args=repr(args)), tmp_path, env=env)
    assert out.returncode == 0, out.stdout
    stats = json.loads(out.stdout.splitlines()[-1])
    spinning = spin != "0" and len(os.sched_getaffinity(0)) >= 2
    assert stats["budget_us"] == (20 if spinning else 0)
    # Every sync waited, so a spinning process counted its waits.
    assert (stats["waits"] >= 3000) if spinning else (stats["waits"] == stats["spins"] == 0)
