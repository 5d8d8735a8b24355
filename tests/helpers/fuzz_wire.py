"""Hand-built moolib wire frames and a peer process to throw them at.

The layout mirrors moolib/core/rpc/wire.h: a 24-byte little-endian header
('<IBBHIIQ': magic, version, type, reserved, numSegments, metaLength,
reserved2), numSegments segment descriptors ('<QIIQ': length, kind, sharedId,
offset), the meta bytes, then the bytes of every inline segment.

Handshake metas (moolib/core/rpc/rpc_links.cc):
  HELLO    u8 version, str nonce (u32 length + 32 bytes), u8 role (0: dialer), u8 hasKey,
           str host identity
  AUTH     str proof, HMAC-SHA256(key, b"moolib-auth-v1|" + role + b"|" + verifier + prover)
  IDENTIFY str name, str incarnation, str host, u32 count + that many str addresses
  REQUEST  u64 call id, str function; segments: the pickle of (args, kwargs), buffers
  RESPONSE u64 call id, u8 status, str error; segments: pickle, buffers
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

MAGIC = 0x314F4F4D  # "MOO1"
VERSION = 1
HEADER = struct.Struct("<IBBHIIQ")
DESC = struct.Struct("<QIIQ")
assert HEADER.size == 24 and DESC.size == 24

HELLO, AUTH, IDENTIFY, REQUEST, RESPONSE, KEEPALIVE, FIND_PEER, PEER_INFO, SHM_RELEASE = range(
    1, 10
)
KIND_INLINE, KIND_SHARED = 0, 1
NONCE_BYTES = 32
ROLE_CLIENT, ROLE_SERVER = 0, 1

# Limits of the core, for building frames just past them.
MAX_SEGMENTS = 8192
MAX_META = 1 << 20
MAX_HANDSHAKE_FRAME = 64 << 10

HELPERS = Path(__file__).resolve().parent
PEER_SCRIPT = HELPERS / "fuzz_peer.py"


# --------------------------------------------------------------------------- frames


def u8(v: int) -> bytes:
    return struct.pack("<B", v)


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def wstr(b: bytes | str) -> bytes:
    if isinstance(b, str):
        b = b.encode()
    return u32(len(b)) + b


def header(
    ftype: int,
    num_segments: int,
    meta_length: int,
    magic: int = MAGIC,
    version: int = VERSION,
    reserved: int = 0,
    reserved2: int = 0,
) -> bytes:
    return HEADER.pack(magic, version, ftype, reserved, num_segments, meta_length, reserved2)


def desc(length: int, kind: int = KIND_INLINE, shared_id: int = 0, offset: int = 0) -> bytes:
    return DESC.pack(length, kind, shared_id, offset)


def frame(ftype: int, meta: bytes = b"", segments: list[bytes] | tuple = ()) -> bytes:
    """A well-formed frame with inline segments."""
    out = [header(ftype, len(segments), len(meta))]
    out += [desc(len(s)) for s in segments]
    out.append(meta)
    out += list(segments)
    return b"".join(out)


def hello_meta(
    nonce: bytes, role: int = ROLE_CLIENT, has_key: bool = False, version: int = VERSION
) -> bytes:
    return u8(version) + wstr(nonce) + u8(role) + u8(1 if has_key else 0) + wstr(b"fuzz-host")


def hello(nonce: bytes | None = None, role: int = ROLE_CLIENT, has_key: bool = False) -> bytes:
    return frame(
        HELLO, hello_meta(nonce if nonce is not None else os.urandom(NONCE_BYTES), role, has_key)
    )


def auth_proof(key: bytes | str, role: str, verifier_nonce: bytes, prover_nonce: bytes) -> bytes:
    if isinstance(key, str):
        key = key.encode()
    message = b"moolib-auth-v1|" + role.encode() + b"|" + verifier_nonce + prover_nonce
    return hmac.new(key, message, hashlib.sha256).digest()


def auth(proof: bytes) -> bytes:
    return frame(AUTH, wstr(proof))


def identify(
    name: str,
    incarnation: str = "0123456789abcdef",
    host: str = "fuzz-host",
    addresses: tuple[str, ...] = (),
) -> bytes:
    meta = wstr(name) + wstr(incarnation) + wstr(host) + u32(len(addresses))
    meta += b"".join(wstr(a) for a in addresses)
    return frame(IDENTIFY, meta)


def request(call_id: int, function: str, pickled: bytes, buffers: tuple[bytes, ...] = ()) -> bytes:
    return frame(REQUEST, u64(call_id) + wstr(function), [pickled, *buffers])


@dataclass
class Frame:
    type: int
    meta: bytes
    segments: list[bytes] = field(default_factory=list)


class Closed(Exception):
    """The peer closed the connection."""


def recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"wanted {n} bytes, got {len(buf)}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except ConnectionResetError as e:
            raise Closed(str(e)) from e
        if not chunk:
            raise Closed(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket, timeout: float = 10.0) -> Frame:
    """Reads one frame (inline segments only) sent by a moolib peer."""
    deadline = time.monotonic() + timeout
    magic, version, ftype, _, nseg, meta_len, _ = HEADER.unpack(recv_exact(sock, 24, deadline))
    assert magic == MAGIC and version == VERSION, (hex(magic), version)
    assert nseg < 64 and meta_len < (1 << 20), (nseg, meta_len)
    descs = [DESC.unpack(recv_exact(sock, 24, deadline)) for _ in range(nseg)]
    meta = recv_exact(sock, meta_len, deadline) if meta_len else b""
    segments = []
    for length, kind, _, _ in descs:
        assert kind == KIND_INLINE
        segments.append(recv_exact(sock, length, deadline) if length else b"")
    return Frame(ftype, meta, segments)


def read_frame_skipping_keepalives(sock: socket.socket, timeout: float = 10.0) -> Frame:
    deadline = time.monotonic() + timeout
    while True:
        f = read_frame(sock, max(0.1, deadline - time.monotonic()))
        if f.type != KEEPALIVE:
            return f


class MetaReader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int) -> bytes:
        assert self.pos + n <= len(self.data), "meta overrun"
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def str(self) -> bytes:
        return self.take(self.u32())

    def strings(self) -> list[bytes]:
        return [self.str() for _ in range(self.u32())]


@dataclass
class Hello:
    version: int
    nonce: bytes
    role: int
    has_key: bool


def parse_hello(f: Frame) -> Hello:
    assert f.type == HELLO, f.type
    r = MetaReader(f.meta)
    return Hello(r.u8(), r.str(), r.u8(), r.u8() != 0)


def parse_identify(f: Frame) -> dict:
    assert f.type == IDENTIFY, f.type
    r = MetaReader(f.meta)
    return {
        "name": r.str().decode(),
        "incarnation": r.str().decode(),
        "host": r.str().decode(),
        "addresses": [a.decode() for a in r.strings()],
    }


def wait_closed(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Reads (and drops) until the peer closes; returns whether it did within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False


def send_all_ignoring_reset(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
        return False


# --------------------------------------------------------------------------- sockets


def tcp_host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def shm_socket_name(address: str) -> bytes:
    """The abstract Unix socket behind a "shm://NAME" address (moolib/core/runtime/socket.cc)."""
    assert address.startswith("shm://"), address
    return b"\0moolib/" + address[len("shm://") :].encode()


def connect_tcp(address: str, timeout: float = 10.0) -> socket.socket:
    s = socket.create_connection(tcp_host_port(address), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def connect_shm(address: str, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(shm_socket_name(address))
    return s


def abort(sock: socket.socket) -> None:
    """Closes with a reset (SO_LINGER 0) rather than a FIN, where the family allows it."""
    with contextlib.suppress(OSError):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


# --------------------------------------------------------------------------- peer process


class PeerProcess:
    """tests/helpers/fuzz_peer.py in a subprocess; stderr goes to a file."""

    def __init__(
        self,
        tmp_path: Path,
        env: dict | None = None,
        name: str = "fuzz-server",
        marker: Path | None = None,
        key: str | None = None,
        key_mode: str = "rpc",
        tag: str = "peer",
    ) -> None:
        self.stderr_path = tmp_path / f"{tag}.stderr"
        full_env = {k: v for k, v in os.environ.items() if k != "MOOLIB_AUTH_KEY"}
        full_env["FUZZ_NAME"] = name
        full_env["PYTHONUNBUFFERED"] = "1"
        if marker is not None:
            full_env["FUZZ_MARKER"] = str(marker)
        if key is not None:
            full_env["FUZZ_KEY"] = key
            full_env["FUZZ_KEY_MODE"] = key_mode
        full_env.update(env or {})
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=full_env,
            cwd=str(tmp_path),
        )
        line = self._read_line(60.0)
        self.info = json.loads(line)
        self.pid: int = self.info["pid"]
        self.name: str = self.info["name"]
        self.tcp: str = self.info["tcp"]
        shm = [a for a in self.info["listening"] if a.startswith("shm://")]
        self.shm: str | None = shm[0] if shm else None

    def _read_line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"peer did not start; stderr:\n{self.stderr()}")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 4096)
                if not chunk:
                    continue
                buf += chunk
        return buf.split(b"\n", 1)[0].decode()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stderr(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._stderr.flush()
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=30)
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.close()
        with contextlib.suppress(Exception):
            self._stderr.close()


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
