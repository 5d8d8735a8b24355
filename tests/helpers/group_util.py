"""Broker and group-member subprocesses, and all-reduce payloads, for the
Broker, Group and all-reduce tests.

``BrokerProcess`` runs ``python -m moolib.broker``; ``GroupPeer`` runs
tests/helpers/group_peer.py, which the tests drive with JSON commands.
``case_data(case, seed, me)`` builds the data a member all-reduces; the peers
and the tests both call it, so the tests can compute the expected result.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

try:  # imported as helpers.group_util by the tests, as group_util by group_peer.py
    from helpers.util import DEADLINE, REPO, child_env, kill_process, stop_process, wait_for
except ImportError:  # pragma: no cover - only inside group_peer.py
    from util import DEADLINE, REPO, child_env, kill_process, stop_process, wait_for

HELPERS = Path(__file__).resolve().parent
GROUP_PEER = HELPERS / "group_peer.py"


# ---------------------------------------------------------------------------
# Processes


class LineProcess:
    """A subprocess whose stdout lines are collected by a thread."""

    def __init__(self, argv, log_path, stdin=True, env=None):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=child_env(env),
            cwd=str(REPO),
            text=True,
        )
        self.pid = self.proc.pid
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[str] = []
        self._eof = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.seen.append(line)
            self.lines.put(line)
        self.lines.put(None)
        self._eof.set()

    def next_line(self, timeout=DEADLINE, what="a line"):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"{self.describe()} printed no {what} within {timeout}s; log:\n{self.log()}"
            ) from None
        if line is None:
            self.lines.put(None)  # keep reporting the exit
            raise AssertionError(
                f"{self.describe()} exited (rc={self.proc.poll()}) before printing {what}; "
                f"log:\n{self.log()}"
            )
        return line

    def describe(self):
        return f"process {self.pid}"

    def log(self):
        try:
            self._log.flush()
            return self.log_path.read_text(errors="replace")[-4000:]
        except (OSError, ValueError):
            return ""

    def alive(self):
        return self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        """Sends ``sig`` and waits for the exit; returns the exit status."""
        return kill_process(self.proc, sig)

    def stop(self):
        """Closes stdin (the process exits on EOF), then kills it if it lingers."""
        stop_process(self.proc)
        self._log.close()


class BrokerProcess(LineProcess):
    """``python -m moolib.broker ADDRESS [--name NAME]``; ``address`` is where it listens."""

    def __init__(self, log_path, address="127.0.0.1:0", name=None, argv=None, wait=True):
        argv = argv or [sys.executable, "-m", "moolib.broker", address]
        if name:
            argv += ["--name", name]
        super().__init__(argv, log_path, stdin=False)
        self.address = None
        if wait:
            line = self.next_line(what="'Broker listening at'")
            m = re.fullmatch(r"Broker listening at (\S+)", line)
            assert m, f"unexpected first line {line!r}"
            self.address = m.group(1)

    def describe(self):
        return f"broker {self.pid}"

    def wait_output(self, timeout=DEADLINE):
        """Waits for the exit; returns (exit status, all it printed to stdout)."""
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.describe()} did not exit; log:\n{self.log()}") from None
        assert self._eof.wait(timeout), "stdout not closed after the exit"
        return rc, "\n".join(self.seen)

    def stop(self):
        if self.alive():
            self.kill(signal.SIGTERM)
        self._log.close()


class PeerError(AssertionError):
    pass


class GroupPeer(LineProcess):
    """A tests/helpers/group_peer.py process: one or two Rpcs that join groups on command.

    ``name`` is its default Rpc (all transports); with ``tcp=True`` it also has
    ``name + "-tcp"``, restricted to TCP.
    """

    def __init__(self, name, broker_address, log_dir, tcp=False):
        argv = [sys.executable, str(GROUP_PEER), "--name", name, "--broker", broker_address]
        if tcp:
            argv += ["--tcp-name", name + "-tcp"]
        super().__init__(argv, Path(log_dir) / f"group-peer-{name}.log")
        self.name = name
        self.tcp_name = name + "-tcp" if tcp else None
        line = self.next_line(what="READY")
        assert line == f"READY {name}", f"unexpected first line {line!r}; log:\n{self.log()}"

    def describe(self):
        return f"group peer {self.name!r} (pid {self.pid})"

    def send(self, cmd, **kwargs):
        kwargs["cmd"] = cmd
        self.proc.stdin.write(json.dumps(kwargs) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout=DEADLINE * 2, check=True):
        line = self.next_line(timeout, what="a reply")
        reply = json.loads(line)
        if check and not reply["ok"]:
            raise PeerError(f"{self.describe()}: {reply}")
        return reply

    def request(self, cmd, check=True, timeout=DEADLINE * 2, **kwargs):
        self.send(cmd, **kwargs)
        return self.reply(timeout, check)

    def status(self, group):
        return self.request("status", group=group)

    def sync(self, timeout=DEADLINE * 2):
        """Skips replies left over (by a test that failed half way) up to now."""
        token = f"sync-{time.monotonic_ns()}"
        self.send("ping", token=token)
        end = time.monotonic() + timeout
        while True:
            line = self.next_line(max(0.1, end - time.monotonic()), what=f"reply {token}")
            if json.loads(line).get("token") == token:
                return


def sync_peers(request):
    """After a test: every live module peer has answered everything asked of it."""
    yield
    if "peers" in request.fixturenames:
        for p in request.getfixturevalue("peers"):
            if p.alive():
                p.sync()


def start_group_peers(names, broker_address, log_dir, tcp=False):
    """Starts group peers concurrently (each takes a while to import torch)."""
    out = [None] * len(names)
    errors = []

    def start(i, name):
        try:
            out[i] = GroupPeer(name, broker_address, log_dir, tcp=tcp)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for p in out:
            if p is not None:
                p.stop()
        raise errors[0]
    return out


def join(peers, group, *, rpc="default", timeout=10.0, sort=None, one_by_one=False):
    """Makes ``peers`` join ``group``; with one_by_one, each after the previous one
    shows up in the group, so join order is the order of ``peers``."""
    for i, p in enumerate(peers):
        kw = {"sort": sort[i]} if sort is not None else {}
        p.request("join", group=group, rpc=rpc, group_timeout=timeout, **kw)
        if one_by_one:
            me = p.tcp_name if rpc == "tcp" else p.name
            wait_for(lambda p=p, me=me: me in p.status(group)["members"], what=f"{me} in {group}")


def agreed_status(peers, group):
    """The status all ``peers`` agree on (same members and sync id), or None."""
    statuses = [p.status(group) for p in peers]
    first = statuses[0]
    if not first["active"]:
        return None
    for s in statuses[1:]:
        if not s["active"] or (s["members"], s["sync_id"]) != (first["members"], first["sync_id"]):
            return None
    return first


def wait_members(peers, group, expected, timeout=DEADLINE):
    """Waits until every peer in ``peers`` sees exactly ``expected`` (a list, in order, or
    a set) under one sync id; returns that status."""

    def check():
        s = agreed_status(peers, group)
        if s is None:
            return None
        if isinstance(expected, (set, frozenset)):
            return s if set(s["members"]) == expected else None
        return s if s["members"] == list(expected) else None

    return wait_for(check, timeout, interval=0.1, what=f"members of {group} == {expected}")


def all_reduce(peers, group, name, case, seeds, op=None, out_dir=None, timeout=DEADLINE):
    """Runs one all-reduce on every peer (all started before any is waited for).

    Returns one reply per peer: {"ok": True, "path": pickled result} or
    {"ok": False, "error": ..., "type": ...}.
    """
    keys = []
    for p, seed in zip(peers, seeds, strict=True):
        key = f"{name}-{time.monotonic_ns()}"
        keys.append(key)
        p.send("start", group=group, key=key, name=name, case=case, seed=seed, op=op)
    for p in peers:
        p.reply()
    return collect(peers, keys, out_dir, timeout)


def collect(peers, keys, out_dir=None, timeout=DEADLINE):
    """Waits for the all-reduces ``keys`` (one per peer) and returns the replies."""
    for p, key in zip(peers, keys, strict=True):
        path = str(Path(out_dir) / f"{key}-{p.name}.pkl") if out_dir else None
        p.send("result", key=key, wait=timeout, out=path)
    return [p.reply(timeout * 2, check=False) for p in peers]


# ---------------------------------------------------------------------------
# Payloads
#
# Specs: "t/<dtype>/<shape>" (a tensor), "np/<dtype>/<shape>" (a numpy array),
# "randn/<dtype>/<shape>" (random floats), or a name from NAMED_CASES. Shapes are
# "5x7", "1000003", "0x3", or "" (0-dim). Tensor values are whole numbers small
# enough that every sum is exact in any order, except for integers, which use
# their whole range (sums wrap) and "randn".

DTYPES = {
    "bool": torch.bool,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}

# Whole numbers in [-R, R) for floats: 4 members' sums (and partial sums) stay exact.
_FLOAT_RANGE = {
    torch.float16: 256,
    torch.bfloat16: 32,
    torch.float32: 1 << 20,
    torch.float64: 1 << 40,
    torch.complex64: 1 << 20,
    torch.complex128: 1 << 40,
}


def _shape(text):
    return tuple(int(s) for s in text.split("x")) if text else ()


def exact_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 5, shape, generator=g) == 0
    if dtype in _FLOAT_RANGE:
        r = _FLOAT_RANGE[dtype]
        if dtype.is_complex:
            real = torch.randint(-r, r, shape, generator=g, dtype=torch.int64)
            imag = torch.randint(-r, r, shape, generator=g, dtype=torch.int64)
            return torch.complex(real.double(), imag.double()).to(dtype)
        return torch.randint(-r, r, shape, generator=g, dtype=torch.int64).to(dtype)
    if dtype == torch.int64:
        return torch.randint(-(2**62), 2**62, shape, generator=g, dtype=torch.int64) * 2
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, generator=g, dtype=torch.int64).to(dtype)


def _nest(seed):
    def t(d, shape, k):
        return exact_tensor(DTYPES[d], shape, seed * 100 + k)

    return {
        "a": t("int64", (3, 4), 1),
        "b": [
            t("float32", (7,), 2),
            t("float32", (2, 3), 3).numpy(),
            (seed * 3 + 1, 0.5 * seed, seed % 2 == 0),
        ],
        "c": (t("bfloat16", (4,), 4), {"x": t("int16", (5,), 5).numpy(), "y": t("bool", (6,), 6)}),
        # Same type as b[0]: one buffer of more than 64 KiB with small leaves in it.
        "big": t("float32", (20000,), 7),
        "transposed": t("float64", (3, 5), 8).t(),
        "strided": t("int32", (6, 8), 9)[::2, 1::3],
        "scalar": t("float32", (), 10),
        "empty": t("float32", (0, 3), 11),
    }


NAMED_CASES = {
    "nest": _nest,
    "numbers": lambda seed: [seed + 1, 2.5 * seed, seed == 1, -(seed**3)],
    "np_scalars": lambda seed: {"i": np.int32(seed - 7), "f": np.float64(seed * 0.25)},
    "empty_nest": lambda seed: {"a": [], "b": ()},
    "grad": lambda seed: exact_tensor(torch.float32, (5,), seed).requires_grad_(),
    # Pairs of equal flat size and dtypes that differ in structure.
    "keys_a": lambda seed: {"a": exact_tensor(torch.float32, (4,), seed), "b": seed},
    "keys_b": lambda seed: {"a": exact_tensor(torch.float32, (4,), seed), "c": seed},
    "nest_flat": lambda seed: [exact_tensor(torch.float32, (3,), seed)] * 2,
    "nest_deep": lambda seed: [[exact_tensor(torch.float32, (3,), seed)]] * 2,
}


def case_data(case, seed, me=None):
    """The data a member with ``seed`` (and name ``me``) all-reduces for ``case``."""
    if case == "name":
        return [me]
    if case == "name_big":  # a gathered payload of more than 64 KiB
        return [(me, torch.full((40000,), seed, dtype=torch.int32))]
    if case in NAMED_CASES:
        return NAMED_CASES[case](seed)
    kind, dtype, shape = case.split("/")
    if kind == "randn":
        g = torch.Generator().manual_seed(seed)
        return torch.randn(_shape(shape), generator=g, dtype=DTYPES[dtype])
    t = exact_tensor(DTYPES[dtype], _shape(shape), seed)
    if kind == "np":
        return t.numpy()
    assert kind == "t", case
    return t


def _add(a, b):
    if isinstance(a, torch.Tensor):
        return a | b if a.dtype == torch.bool else a + b
    if isinstance(a, np.ndarray) or isinstance(a, np.generic):
        return (a | b) if a.dtype == np.bool_ else (a + b).astype(a.dtype)
    if isinstance(a, bool):
        return a or b
    return a + b


def nest_sum(values):
    """The sum (bool: or) of equally structured nests, folded in order."""
    first = values[0]
    if isinstance(first, dict):
        return {k: nest_sum([v[k] for v in values]) for k in first}
    if isinstance(first, (list, tuple)):
        items = [nest_sum([v[i] for v in values]) for i in range(len(first))]
        return type(first)(items)
    out = first
    for v in values[1:]:
        out = _add(out, v)
    if isinstance(first, torch.Tensor):
        out = out.detach().clone().requires_grad_(first.requires_grad)
    return out


def leaves_bytes(value):
    """Every leaf of a nest as (type, dtype, shape, raw bytes), to compare bit for bit."""
    if isinstance(value, dict):
        return [(k, leaves_bytes(v)) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [leaves_bytes(v) for v in value])
    if isinstance(value, torch.Tensor):
        flat = value.detach().contiguous().reshape(-1)
        return (
            "tensor",
            str(value.dtype),
            tuple(value.shape),
            flat.view(torch.uint8).numpy().tobytes(),
        )
    if isinstance(value, np.ndarray | np.generic):
        return ("ndarray", str(value.dtype), np.shape(value), np.ascontiguousarray(value).tobytes())
    return (type(value).__name__, repr(value))


def load(path):
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


__all__ = [
    "BrokerProcess",
    "GroupPeer",
    "PeerError",
    "agreed_status",
    "all_reduce",
    "case_data",
    "collect",
    "exact_tensor",
    "join",
    "leaves_bytes",
    "load",
    "nest_sum",
    "start_group_peers",
    "sync_peers",
    "wait_members",
]


def settle(groups) -> None:
    """Calls update() on in-process groups (as their programs would) until every
    one is active with all of them as members, under one sync id."""
    want = {g.rpc.get_name() for g in groups}
    wait_for(
        lambda: (
            all([g.update() or True for g in groups])
            and all(g.active() and set(g.members()) == want for g in groups)
            and len({g.sync_id() for g in groups}) == 1
        ),
        what=f"members {sorted(want)} seeing each other",
    )
