"""Polling, peer subprocesses and comparison helpers shared by the RPC tests."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

HELPERS = Path(__file__).resolve().parent
PEER_SCRIPT = HELPERS / "peer.py"
REPO = HELPERS.parent.parent

# Generous: the machine may be loaded; nothing here asserts on speed.
DEADLINE = 60.0

# Transport choices tests are parametrized over: None means the default (both).
TRANSPORTS = [None, ["shm"], ["tcp"]]
TRANSPORT_IDS = ["default", "shm", "tcp"]


def kill_process(proc, sig=signal.SIGKILL):
    """Sends ``sig`` (if it still runs) and waits for the exit; returns the exit status."""
    if proc.poll() is None:
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
    try:
        return proc.wait(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(timeout=DEADLINE)


def stop_process(proc):
    """Closes stdin (helper processes exit on EOF), then kills it if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)  # in case a test stopped it
    try:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    except OSError:
        pass
    try:
        return proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        return kill_process(proc)


def freeze(pid: int) -> None:
    """SIGSTOPs ``pid`` and returns once every thread of it is stopped.

    The kernel stops each thread when it next runs, not when kill() returns: on a
    loaded machine a process can still answer a request sent right after.
    """
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rpartition(")")[2].split()[0]
            except FileNotFoundError:
                continue  # a thread that exited
            if state not in ("T", "t"):
                return False
        return True

    wait_for(stopped, what=f"process {pid} stopped")


def process_usage(pid: int) -> dict:
    """A process's open descriptors, threads and resident size (KiB), from /proc."""
    usage = {"fds": len(os.listdir(f"/proc/{pid}/fd"))}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key == "VmRSS":
                usage["rss_kib"] = int(value.split()[0])
            elif key == "Threads":
                usage["threads"] = int(value)
    return usage


def wait_for(cond, timeout=DEADLINE, interval=0.05, what="condition"):
    """Polls ``cond()`` until it returns something truthy; returns that value.

    Raises AssertionError (naming ``what``) if ``timeout`` seconds pass first.
    """
    end = time.monotonic() + timeout
    last_exc = None
    while True:
        try:
            value = cond()
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            value, last_exc = None, e
        if value:
            return value
        if time.monotonic() > end:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")
        time.sleep(interval)


def peer_entry(rpc, name):
    """The debug_info() entry of peer ``name`` as seen by ``rpc``, or None."""
    for p in rpc.debug_info()["peers"]:
        if p["name"] == name:
            return p
    return None


def connections(rpc, name):
    """The connections of ``rpc`` to peer ``name`` (list of dicts, maybe empty)."""
    p = peer_entry(rpc, name)
    return list(p["connections"]) if p else []


def transports_to(rpc, name):
    return sorted(c["transport"] for c in connections(rpc, name))


def child_env(extra=None):
    env = dict(os.environ)
    env.pop("MOOLIB_AUTH_KEY", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


class PeerProcess:
    """A tests/helpers/peer.py subprocess (or another ``script`` that prints the
    same READY line); ``address`` is its bound listen address."""

    def __init__(self, args, log_path, env=None, ready_timeout=DEADLINE, script=PEER_SCRIPT):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=child_env(env),
            cwd=str(REPO),
            text=True,
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.name = None
        self.address = None
        self.pid = self.proc.pid
        line = self.expect("READY", ready_timeout)
        _, self.name, address = line.split()
        self.address = None if address == "-" else address

    def _read(self):
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def expect(self, prefix, timeout=DEADLINE):
        """Waits for a stdout line starting with ``prefix`` and returns it."""
        end = time.monotonic() + timeout
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"peer did not print {prefix!r}; log:\n{self.log()}")
            try:
                line = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(
                    f"peer exited (rc={self.proc.poll()}) before printing {prefix!r}; "
                    f"log:\n{self.log()}"
                )
            if line.startswith(prefix):
                return line

    def log(self):
        try:
            return self.log_path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def alive(self):
        return self.proc.poll() is None

    def kill(self, sig=signal.SIGKILL):
        return kill_process(self.proc, sig)

    def stop(self):
        """Closes stdin (the peer exits on EOF), then kills it if it lingers."""
        stop_process(self.proc)
        self._log.close()


def peer_args(
    name,
    listen="127.0.0.1:0",
    connect=(),
    transports=None,
    auth_key=None,
    timeout=None,
    max_threads=None,
):
    args = ["--name", name]
    if listen:
        args += ["--listen", listen]
    for c in connect:
        args += ["--connect", c]
    if transports:
        args += ["--transports", ",".join(transports)]
    if auth_key is not None:
        args += ["--auth-key", auth_key]
    if timeout is not None:
        args += ["--timeout", str(timeout)]
    if max_threads is not None:
        args += ["--max-threads", str(max_threads)]
    return args


class PeerSpawner:
    """Starts peer subprocesses and guarantees they are gone at cleanup()."""

    def __init__(self, directory):
        self.directory = Path(directory)
        self.peers: list[PeerProcess] = []

    def __call__(self, name, env=None, **kwargs):
        log = self.directory / f"peer-{name}-{len(self.peers)}.log"
        p = PeerProcess(peer_args(name, **kwargs), log, env=env)
        self.peers.append(p)
        return p

    def cleanup(self):
        for p in self.peers:
            try:
                p.stop()
            finally:
                if p.alive():
                    p.kill()


def run_script(code, tmp_path, timeout=DEADLINE * 2, env=None, name="script.py"):
    """Runs ``code`` in a fresh interpreter; returns CompletedProcess (stdout+stderr text).

    The process is killed (and the test fails) if it does not exit by ``timeout``.
    """
    path = Path(tmp_path) / name
    path.write_text(code)
    proc = subprocess.Popen(
        [sys.executable, str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env(env),
        cwd=str(REPO),
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        raise AssertionError(
            f"script hung (killed after {timeout}s); output:\n{out[-4000:]}"
        ) from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


# ---------------------------------------------------------------------------
# Payloads and exact comparison


# Every dtype a tensor crossing the wire may have; optional ones exist in newer torch.
BASE_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
OPTIONAL_DTYPE_NAMES = [
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
]


def all_dtypes(optional=("uint16", "uint32", "uint64")):
    return BASE_DTYPES + [getattr(torch, n) for n in optional if hasattr(torch, n)]


def make_tensor(dtype, shape=(5, 7), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        real = torch.randn(shape, generator=g, dtype=torch.float64)
        imag = torch.randn(shape, generator=g, dtype=torch.float64)
        return torch.complex(real, imag).to(dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g, dtype=torch.float32) * 100).to(dtype)
    if dtype in (torch.uint8,) or str(dtype).startswith("torch.uint"):
        return torch.randint(0, 250, shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**31)), min(info.max, 2**31 - 1)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def sample_payload():
    """A nest of Python objects, tensors of every dtype (incl. non-contiguous) and arrays."""
    tensors = {str(d): make_tensor(d, seed=i) for i, d in enumerate(all_dtypes())}
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    big = torch.arange(4096, dtype=torch.int64).reshape(64, 64)  # above the in-band threshold
    return {
        "none": None,
        "int": 12345678901234567890,
        "float": 3.25,
        "str": "héllo wörld",
        "bytes": b"\x00\x01\xffabc",
        "bool": True,
        "list": [1, "two", 3.0, [4, (5, 6)]],
        "tuple": (1, (2, (3,))),
        "set": {1, 2, 3},
        "dtypes": tensors,
        "scalar": torch.tensor(7.5, dtype=torch.float64),
        "empty": torch.empty(0, 3, dtype=torch.int32),
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "expanded": torch.arange(3).expand(4, 3),
        "big_strided": big[:, ::2],
        "big_transposed": big.t(),
        "requires_grad": torch.ones(3, requires_grad=True),
        "nest": [{"a": (torch.ones(2, 2), [torch.zeros(1, dtype=torch.bfloat16)])}],
        "np": {
            "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
            "i64": np.arange(10000, dtype=np.int64),
            "bool": np.array([True, False, True]),
            "c128": np.array([1 + 2j, 3 - 4j]),
            "f16": np.linspace(0, 1, 9).astype(np.float16),
            "noncontig": np.arange(40, dtype=np.int16).reshape(5, 8)[:, ::3],
            "fortran": np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),
        },
    }


def assert_same(a, b, path="root"):
    """Exact structural equality: types, dtypes, shapes and every value."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype, f"{path}: dtype {b.dtype} != {a.dtype}"
        assert a.shape == b.shape, f"{path}: shape {b.shape} != {a.shape}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        if str(a.dtype).startswith("torch.uint") and a.dtype != torch.uint8:
            same = torch.equal(a.to(torch.int64), b.to(torch.int64))
        else:
            same = torch.equal(a.detach(), b.detach())
        assert same, f"{path}: values differ"
        return
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray), f"{path}: {type(b)} is not an ndarray"
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {b.dtype}{b.shape}"
        assert np.array_equal(a, b), f"{path}: values differ"
        return
    assert type(a) is type(b), f"{path}: type {type(b)} != {type(a)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys differ"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {b!r} != {a!r}"


def module_server(module_spawn_peer, prefix, transports):
    """A peer process restricted to ``transports``, named after them, for a module."""
    name = prefix + TRANSPORT_IDS[TRANSPORTS.index(transports)]
    peer = module_spawn_peer(name, transports=transports, timeout=DEADLINE)
    peer.transports = transports
    return peer


def client_of(make_rpc, server, prefix):
    """A fresh in-process Rpc on the server's transports, connected to it."""
    import moolib

    rpc = make_rpc(prefix + moolib.create_uid()[:8], transports=server.transports, timeout=DEADLINE)
    rpc.connect(server.address)
    return rpc


def run_in_threads(*targets):
    """Runs each callable on a thread of its own; raises the first error any of them raised."""
    errors = []

    def run(fn):
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE)
    assert not any(t.is_alive() for t in threads), "threads still running"
    if errors:
        raise errors[0]
