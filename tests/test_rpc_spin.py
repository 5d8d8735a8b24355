"""The spin before a blocking wait (moolib/core/runtime/spin.h; docs/architecture.md,
"Adaptive spin"): its budget comes from MOOLIB_SPIN_US (unset: 20 us; 0 turns
it off; a bad value is named and turns it off) and is zero in a process that
has one CPU, or one CPU's time (a cgroup quota);
a thread whose spins keep running out turns to blocking, and its budget
stretches to its blocked waits (up to four times); and calls behave
the same with spinning on or off, on both transports, in bursts, with errors
and with large arguments."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path

import pytest
from helpers.util import DEADLINE, TRANSPORT_IDS, TRANSPORTS, run_script

pytestmark = pytest.mark.usefixtures("watchdog")

_PRINT_STATS = "import json, moolib._core as c; print(json.dumps(c._spin_stats()))\n"


@pytest.mark.parametrize(
    ("value", "budget"),
    [(None, 20), ("0", 0), ("7", 7), ("20", 20), ("", 20), ("999999", 10000)],
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


@pytest.mark.parametrize("value", ["fast", "-3", "20us"])
def test_a_bad_moolib_spin_us_is_named_and_turns_spinning_off(tmp_path, value):
    out = run_script(_PRINT_STATS, tmp_path, env={"MOOLIB_SPIN_US": value})
    assert out.returncode == 0, out.stdout
    assert f"MOOLIB_SPIN_US='{value}' is not a whole number of microseconds" in out.stdout
    assert json.loads(out.stdout.splitlines()[-1])["budget_us"] == 0


def test_a_process_on_one_cpu_never_spins(tmp_path):
    code = "import os\nos.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n" + _PRINT_STATS
    out = run_script(code, tmp_path, env={"MOOLIB_SPIN_US": "50"})
    assert out.returncode == 0, out.stdout
    assert json.loads(out.stdout.splitlines()[-1])["budget_us"] == 0


@contextlib.contextmanager
def _cgroup_with_quota(cpus: float):
    """A new cgroup whose CPU quota is ``cpus`` CPUs (cgroup v2's cpu.max, or v1's
    cpu.cfs_quota_us); yields its cgroup.procs file. Skips where none can be made."""
    name = f"moolib-test-{uuid.uuid4().hex[:8]}"
    v2 = next(
        (
            Path(root)
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
            if "cpu" in _read(Path(root) / "cgroup.subtree_control").split()
        ),
        None,
    )
    folder = (v2 or Path("/sys/fs/cgroup/cpu")) / name
    try:
        folder.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here: {e}")
    try:
        if v2:
            (folder / "cpu.max").write_text(f"{int(cpus * 100000)} 100000")
        else:
            period = int(_read(folder / "cpu.cfs_period_us"))
            (folder / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        yield folder / "cgroup.procs"
    finally:
        folder.rmdir()  # empty again: its one process has exited


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.parametrize(("cpus", "spins"), [(1.0, False), (2.5, True)])
def test_a_process_with_one_cpus_time_never_spins(tmp_path, cpus, spins):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: the budget is always zero")
    with _cgroup_with_quota(cpus) as procs:
        # The script joins the cgroup before moolib reads its budget.
        code = f"open({str(procs)!r}, 'w').write('0')\n" + _PRINT_STATS
        out = run_script(code, tmp_path, env={"MOOLIB_SPIN_US": "20"})
    assert out.returncode == 0, out.stdout
    assert json.loads(out.stdout.splitlines()[-1])["budget_us"] == (20 if spins else 0)


def _client_script(peer, transports, body: str) -> str:
    """A script that connects an Rpc ``rpc`` to ``peer`` over ``transports``, then runs ``body``
    (with ``name`` the peer's name and ``c`` moolib._core)."""
    args = (peer.address, peer.name, transports)
    return (
        f"""
import json
import moolib
import moolib._core as c

address, name, transports = {args!r}
rpc = moolib.Rpc()
rpc.set_name("spin-client-" + moolib.create_uid()[:8])
rpc.set_transports(transports)
rpc.set_timeout(60)
rpc.connect(address)
assert rpc.sync(name, "echo", 0) == 0
"""
        + body
    )


_SLOW_CALLS = """
import threading
stats = {}


def slow_calls():
    # A thread of its own starts with a fresh policy (it spins first).
    before = c._spin_stats()
    stats["budget_before"] = before["thread_budget_us"]
    for _ in range(200):
        # Each reply comes 2 ms after the request: a 20 us spin never sees it.
        assert rpc.sync(name, "sleep", 0.002) == 0.002
    after = c._spin_stats()
    stats["budget_after"] = after["thread_budget_us"]
    stats.update({k: after[k] - before[k] for k in ("waits", "spins")})


thread = threading.Thread(target=slow_calls)
thread.start()
thread.join()
print(json.dumps(stats))
"""


@pytest.mark.parametrize("transports", TRANSPORTS[1:], ids=TRANSPORT_IDS[1:])
def test_spins_that_keep_running_out_turn_a_thread_to_blocking(tmp_path, spawn_peer, transports):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU here: no process spins")
    peer = spawn_peer("spin-slow-srv", transports=transports, timeout=DEADLINE)
    script = _client_script(peer, transports, _SLOW_CALLS)
    out = run_script(script, tmp_path, env={"MOOLIB_SPIN_US": "20"})
    assert out.returncode == 0, out.stdout
    stats = json.loads(out.stdout.splitlines()[-1])
    # A call whose thread lost its core for the 2 ms finds its reply there and does not wait.
    assert stats["waits"] >= 100, stats
    # About 13 spins before blocking wins, then one trial spin every 64 waits;
    # other threads of the process may add a few.
    assert stats["spins"] <= 50, stats
    # The thread's budget starts at MOOLIB_SPIN_US and follows its blocked waits (at
    # least 2 ms each) up to four times that: on a machine whose idle CPUs wake slowly,
    # a peer's answer takes longer than 20 us even when it is quick to make.
    assert stats["budget_before"] == 20, stats
    assert stats["budget_after"] == 80, stats


_WORKLOAD = """
import torch

rpc.define("twice", lambda x: 2 * x)
for i in range(3000):
    assert rpc.sync(name, "echo", i) == i
# A burst of calls, every fifth one failing, waited for in reverse.
futures = [
    rpc.async_(name, "fail", f"no {i}") if i % 5 == 0 else rpc.async_(name, "add", i, 1)
    for i in range(2000)
]
for i in reversed(range(2000)):
    if i % 5 == 0:
        try:
            futures[i].result()
        except Exception as e:
            assert f"no {i}" in str(e), e
        else:
            raise AssertionError(f"call {i} should have failed")
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
    out = run_script(_client_script(peer, transports, _WORKLOAD), tmp_path, env=env)
    assert out.returncode == 0, out.stdout
    stats = json.loads(out.stdout.splitlines()[-1])
    spinning = spin != "0" and len(os.sched_getaffinity(0)) >= 2
    assert stats["budget_us"] == (20 if spinning else 0)
    # Every sync waited, so a spinning process counted its waits.
    assert (stats["waits"] >= 3000) if spinning else (stats["waits"] == stats["spins"] == 0)
