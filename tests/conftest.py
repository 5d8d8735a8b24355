"""Shared fixtures of the RPC tests (helpers live in tests/helpers/)."""

from __future__ import annotations

import faulthandler
import os
import signal

import pytest
from helpers.group_util import BrokerProcess
from helpers.util import TRANSPORT_IDS, TRANSPORTS, PeerSpawner

import moolib

# MOOLIB_TEST_CPU_REPORT=FILE: each test's CPU seconds (tests/helpers/cpu_report.py);
# the slow marker, and the long tests that lack it (tests/helpers/slow_check.py).
pytest_plugins = ["helpers.cpu_report", "helpers.slow_check"]

# A shell runs background commands (`cmd &`) with SIGINT ignored, and children
# inherit that: the Ctrl-C tests' processes would then never see their SIGINT.
# A handler (unlike SIG_IGN) is reset on exec, so children start as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# The files that take minutes (agents learning, SLURM jobs requeued, wheels built),
# longest first: with the README's ``-n 3 --dist loadfile``, each worker takes the
# next file as it frees up, so the short files fill in beside the long ones instead
# of one long file running alone at the end. Measured in `.ci/run` (its
# ``--durations`` list); a file missing here only runs later, in name order.
LONG_FILES = (
    "test_r2d2_learning.py",
    "test_offpolicy_learning.py",
    "test_slurm_runs.py",
    "test_offpolicy_run.py",
    "test_slurm_requeue.py",
    "test_accumulator.py",
    "test_slurm_offpolicy.py",
    "test_run_resume.py",
    "test_run_errors.py",
    "test_checkpoints.py",
    "test_packaging.py",
    "test_run_training.py",
    "test_publish.py",
    "test_run_processes.py",
    "test_run_stop.py",
    "test_learning.py",
    "test_run_output.py",
    "test_run_compose.py",
    "test_evaluate.py",
    "test_slurm_launch.py",
)


def pytest_collection_modifyitems(config, items):
    """Puts the long files' tests first, each file's tests keeping their order."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report gets a section from each of ``item.explain_failure``'s
    (title, function) pairs, which fixtures register: made here, while the test's
    fixtures still live and before the report leaves a pytest-xdist worker."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for title, explain in getattr(item, "explain_failure", []):
            try:
                report.sections.append((title, explain()))
            except Exception as e:  # noqa: BLE001 - the failure itself matters more
                report.sections.append((title, f"(could not be gathered: {e!r})"))


@pytest.fixture(autouse=True)
def _no_default_auth_key(monkeypatch):
    """Every test starts without a process-wide key (tests that want one set it)."""
    monkeypatch.delenv("MOOLIB_AUTH_KEY", raising=False)
    moolib.set_auth_key(None)
    yield
    moolib.set_auth_key(None)


# The terminal's stderr, saved before pytest captures fd 2 for each test: a
# dump written to fd 2 while a test runs lands in the capture's file, which an
# exit from faulthandler's thread throws away unread.
_terminal_stderr: int | None = None


def pytest_configure(config):
    global _terminal_stderr
    _terminal_stderr = os.dup(2)
    # pytest-xdist's --dist loadfile hands out files with the most tests first, which
    # put the two-test learning file last, alone on one worker for minutes. Keep the
    # collection order (LONG_FILES first) instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.fixture
def watchdog():
    """Dumps every thread's stack to the terminal and exits if a test hangs.

    pytest-timeout cannot: its signal handler needs the GIL, which a deadlock
    involving the GIL never gives it; faulthandler's thread needs none."""
    faulthandler.dump_traceback_later(240, exit=True, file=_terminal_stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(params=TRANSPORTS, ids=TRANSPORT_IDS)
def transports(request):
    return request.param


@pytest.fixture
def make_rpc():
    """Creates in-process Rpcs (optionally named, listening, restricted) and closes them after."""
    made = []

    def make(name=None, transports=None, timeout=None, listen=False, auth_key=None):
        rpc = moolib.Rpc()
        made.append(rpc)
        if name:
            rpc.set_name(name)
        if transports:
            rpc.set_transports(transports)
        if auth_key is not None:
            rpc.set_auth_key(auth_key)
        if timeout:
            rpc.set_timeout(timeout)
        if listen:
            rpc.address = rpc.listen("127.0.0.1:0")
        return rpc

    yield make
    for rpc in made:
        rpc.close()


@pytest.fixture
def spawn_peer(tmp_path):
    """Starts tests/helpers/peer.py subprocesses; all are stopped (or killed) after the test."""
    spawner = PeerSpawner(tmp_path)
    try:
        yield spawner
    finally:
        spawner.cleanup()


@pytest.fixture(scope="module")
def module_spawn_peer(tmp_path_factory):
    """Like spawn_peer, for peers shared by the tests of a module."""
    spawner = PeerSpawner(tmp_path_factory.mktemp("peers"))
    try:
        yield spawner
    finally:
        spawner.cleanup()


@pytest.fixture(scope="module")
def logs(tmp_path_factory, request):
    """A folder for the logs of a module's helper processes."""
    return tmp_path_factory.mktemp(request.module.__name__.removeprefix("test_"))


@pytest.fixture(scope="module")
def broker(logs):
    """A broker process (python -m moolib.broker) shared by the module's tests."""
    b = BrokerProcess(logs / "broker.log")
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="module")
def compose_config():
    """Composes moolib-run's packaged Hydra config from a list of overrides."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="moolib.conf", version_base="1.3"):
        yield lambda *overrides: compose("config", overrides=list(overrides))
