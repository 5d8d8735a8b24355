"""The README's Python examples run as pasted: each code block is extracted from
README.md and run in a fresh interpreter (the broker examples against the
broker started by the README's own command), and prints what its comments say."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.util import DEADLINE, REPO, child_env

README = REPO / "README.md"
BROKER = "127.0.0.1:4431"  # the address the README's examples use


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def block(marker: str) -> str:
    found = [b for b in python_blocks() if marker in b]
    assert len(found) == 1, f"one README example with {marker!r}, found {len(found)}"
    return found[0]


def start(code: str, tmp_path: Path, name: str) -> subprocess.Popen:
    script = tmp_path / f"{name}.py"
    script.write_text(code)
    return subprocess.Popen(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 3 * DEADLINE) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"the example still runs after {timeout}s:\n{out}") from None
    assert proc.returncode == 0, out
    return out


@pytest.fixture
def readme_broker():
    """The broker, started with the README's own command (``moolib-broker 127.0.0.1:4431``)."""
    command = re.search(r"^moolib-broker (\S+)", README.read_text(), flags=re.M)
    assert command and command.group(1) == BROKER
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 4431)) == 0:
            pytest.fail("port 4431, which the README's examples use, is taken on this machine")
    script = shutil.which("moolib-broker", path=str(Path(sys.executable).parent))
    cmd = [script] if script else [sys.executable, "-m", "moolib.broker"]
    proc = subprocess.Popen(
        [*cmd, BROKER], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        line = proc.stdout.readline()
        assert f"Broker listening at {BROKER}" in line, line
        yield
    finally:
        proc.kill()
        proc.wait()


def test_every_python_example_is_run_here():
    markers = [
        'server.set_name("server")',
        "MEMBERS = 2",
        "moolib.Accumulator(",
        "EnvPool(",
        "moolib.Replay(",
        "moolib.Publisher(",
    ]
    assert len(python_blocks()) == len(markers), "a README example this test does not run"
    for m in markers:
        block(m)


def test_rpc_example(tmp_path):
    out = finish(start(block('server.set_name("server")'), tmp_path, "rpc"))
    assert out.splitlines()[-2:] == ["3", "tensor([2., 2., 2.])"], out


def test_group_example_run_twice(tmp_path, readme_broker):
    code = block("MEMBERS = 2")
    procs = [start(code, tmp_path, f"group{i}") for i in range(2)]
    outs = [finish(p) for p in procs]
    lists = [o.splitlines()[-2] for o in outs]
    assert lists[0] == lists[1], outs  # the same ordered list on both
    for out in outs:
        assert out.splitlines()[-1] == "{'w': tensor([2., 2., 2.]), 'n': 2}", out


def test_accumulator_example(tmp_path, readme_broker):
    out = finish(start(block("moolib.Accumulator("), tmp_path, "accumulator"))
    assert out.splitlines()[-1] == "trained to model version 100", out


def test_envpool_example(tmp_path):
    out = finish(start(block("EnvPool("), tmp_path, "envpool"))
    assert out.splitlines()[-1] == "torch.Size([32, 4, 84, 84]) torch.float32", out


def test_replay_and_publisher_examples(tmp_path):
    # The publishing example goes on from the replay example's two peers.
    code = block("moolib.Replay(") + block("moolib.Publisher(")
    out = finish(start(code, tmp_path, "offpolicy"))
    assert out.splitlines()[-2:] == ["torch.Size([32, 4]) 64", "True False"], out
