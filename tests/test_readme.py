"""The documentation's Python examples run as pasted: each ```python block of
README.md and docs/ (wherever an example moved) is extracted and run in a fresh
interpreter (the broker examples against the broker started by the docs' own
command), and prints what its comments say. The README stays a front door, and
every relative link of the documentation resolves."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.util import DEADLINE, REPO, child_env

README = REPO / "README.md"
DOCS = [README, *sorted((REPO / "docs").rglob("*.md"))]
BROKER = "127.0.0.1:4431"  # the address the examples use


def python_blocks() -> list[str]:
    """Every ```python block of the docs, dedented (one may sit in a list item)."""
    pattern = re.compile(r"^( *)```python\n(.*?)^\1```", flags=re.M | re.S)
    return [textwrap.dedent(m.group(2)) for doc in DOCS for m in pattern.finditer(doc.read_text())]


def block(marker: str) -> str:
    found = [b for b in python_blocks() if marker in b]
    assert len(found) == 1, f"one example with {marker!r} in the docs, found {len(found)}"
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
    """The broker, started with the docs' own command (``moolib-broker 127.0.0.1:4431``)."""
    commands = [
        m for d in DOCS for m in re.findall(r"^moolib-broker (\S+)", d.read_text(), flags=re.M)
    ]
    assert commands == [BROKER], commands
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
        'register_agent("mine"',
        "except errors.RpcTimeoutError",
    ]
    assert len(python_blocks()) == len(markers), "an example in the docs that is not run here"
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


def test_errors_example(tmp_path):
    out = finish(start(block("except errors.RpcTimeoutError"), tmp_path, "errors"))
    assert out.splitlines()[-1] == "no answer: RpcTimeoutError", out


def test_replay_and_publisher_examples(tmp_path):
    # The publishing example goes on from the replay example's two peers.
    code = block("moolib.Replay(") + block("moolib.Publisher(")
    out = finish(start(code, tmp_path, "offpolicy"))
    assert out.splitlines()[-2:] == ["torch.Size([32, 4]) 64", "True False"], out


def test_extending_example_registers_an_agent(tmp_path):
    out = finish(start(block('register_agent("mine"'), tmp_path, "extending"))
    assert out.splitlines()[-1] == "True", out


def sh_blocks(doc: Path) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", doc.read_text(), flags=re.M | re.S)


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    # Its first training command names a savedir, and the next line plots it.
    train = next(b for b in sh_blocks(README) if "moolib-run" in b).splitlines()
    first = r"moolib-run agent=a2c env=cartpole total_steps=(\d+) savedir=(\S+)"
    run = re.fullmatch(first, train[0])
    assert run and int(run.group(1)) <= 500_000, train[0]
    assert train[1] == f"moolib-plot {run.group(2)}", train
    # A user who only trains installs the package alone; the test extras are for the tests.
    install = sh_blocks(README)[0]
    assert "pip install -e .  " in install and "[test]" not in install, install
    # The Test section's command is the one .ci/run runs.
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    test = next(b for b in sh_blocks(README) if "pytest" in b)
    assert ci in test.splitlines(), (ci, test)
    # Every example sweep is small: a small env and few steps a point.
    for doc in DOCS:
        for b in sh_blocks(doc):
            for line in b.splitlines():
                if line.startswith("moolib-run -m") and "scaling=slurm" not in line:
                    assert "env=cartpole" in line and "total_steps=" in line, (doc.name, line)


def anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found, seen = set(), {}
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#+ (.*)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        text = re.sub(r"^ *```.*?^ *```", "", doc.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
