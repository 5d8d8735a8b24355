"""Robustness of the wire protocol: malformed, truncated and oversized frames.

A moolib peer runs in its own process (tests/helpers/fuzz_peer.py). Raw
sockets throw hand-built frames at it (layout in tests/helpers/fuzz_wire.py,
mirroring moolib/core/rpc/wire.h) while well-behaved moolib clients in this process
keep calling it. The peer must stay up, keep answering, log why it closed the
bad connections, and never allocate what a frame merely claims.

The fuzzing is seeded: set MOOLIB_FUZZ_SEED to replay a run (failures print it).
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import os
import pickle
import random
import resource
import select
import socket
import threading
import time

import numpy as np
import pytest
from helpers import fuzz_wire as fw

import moolib

GiB = 1 << 30
MiB = 1 << 20

RSS_LIMIT = 1 * GiB
TCP_FRAMES = 10_000
SHM_FRAMES = 400
# A hang guard, not a speed requirement: the barrage takes about 1 s here, and much longer
# only on a machine that is starved or where the peer stopped reading.
FUZZ_TIME_LIMIT = 180.0  # seconds for the whole TCP + shm barrage
MAX_HALF_OPEN = 120

INTERESTING_U32 = [
    0, 1, 2, 3, 4, 7, 8, 23, 24, 25, 31, 32, 33, 64, 127, 128, 255, 256, 1023, 1024,
    2730, 2731, 4095, 4096, 8191, 8192, 8193, 65535, 65536, 65537, MiB - 1, MiB, MiB + 1,
    1 << 24, (1 << 31) - 1, 1 << 31, (1 << 32) - 2, (1 << 32) - 1,
]  # fmt: skip
INTERESTING_U64 = INTERESTING_U32 + [
    1 << 32, (1 << 36) - 1, 1 << 36, (1 << 36) + 1, 1 << 40, 1 << 48, (1 << 63) - 1, 1 << 63,
    (1 << 64) - 24, (1 << 64) - 1,
]  # fmt: skip


def seed() -> int:
    env = os.environ.get("MOOLIB_FUZZ_SEED")
    return int(env) if env else random.SystemRandom().randrange(1 << 32)


# --------------------------------------------------------------------------- generators


def pick_u32(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.5:
        return rng.choice(INTERESTING_U32)
    if r < 0.8:
        return rng.randrange(0, 64)
    return rng.getrandbits(32)


def pick_u64(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.5:
        return rng.choice(INTERESTING_U64)
    if r < 0.8:
        return rng.randrange(0, 4096)
    return rng.getrandbits(64)


def pick_type(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.8:
        return rng.randrange(1, 10)
    if r < 0.9:
        return rng.choice([0, 10, 11, 127, 128, 255])
    return rng.randrange(256)


def random_blob(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.45:
        n = rng.randrange(1, 64)
    elif r < 0.9:
        n = rng.randrange(1, 2048)
    else:
        n = rng.randrange(1, 70_000)
    return rng.randbytes(n)


def random_desc(rng: random.Random, allow_shared: bool = True) -> bytes:
    r = rng.random()
    if r < 0.6:
        kind = fw.KIND_INLINE
    elif r < 0.8 and allow_shared:
        kind = fw.KIND_SHARED
    else:
        kind = rng.choice([2, 3, 255, 1 << 31, (1 << 32) - 1, rng.getrandbits(32)])
    return fw.desc(pick_u64(rng), kind, pick_u32(rng), pick_u64(rng))


def random_header_frame(rng: random.Random, ftype: int | None = None) -> bytes:
    """A header that is mostly plausible, with random counts and lengths, and what follows."""
    magic = fw.MAGIC if rng.random() < 0.95 else rng.getrandbits(32)
    version = fw.VERSION if rng.random() < 0.95 else rng.randrange(256)
    nseg = pick_u32(rng)
    meta_len = pick_u32(rng)
    out = [
        fw.header(
            pick_type(rng) if ftype is None else ftype,
            nseg,
            meta_len,
            magic=magic,
            version=version,
            reserved=rng.choice([0, 0, 0, rng.getrandbits(16)]),
            reserved2=rng.choice([0, 0, 0, rng.getrandbits(64)]),
        )
    ]
    # Never more than a few KiB of tables, metadata and segment bytes per frame.
    out += [random_desc(rng) for _ in range(min(nseg, rng.randrange(0, 48)))]
    out.append(rng.randbytes(min(meta_len, rng.randrange(0, 4096))))
    if rng.random() < 0.5:
        out.append(rng.randbytes(rng.randrange(0, 4096)))
    return b"".join(out)


def mutated_hello(rng: random.Random) -> bytes:
    """A HELLO with one or more fields out of range, or truncated metadata."""
    version = fw.VERSION if rng.random() < 0.6 else rng.randrange(256)
    nonce_len_field = rng.choice([0, 1, 31, 32, 32, 33, 64, 65, 128, pick_u32(rng)])
    nonce = rng.randbytes(min(nonce_len_field, 128))
    role = rng.choice([0, 0, 1, 2, 255])
    has_key = rng.choice([0, 1, 2, 255])
    meta = fw.u8(version) + fw.u32(nonce_len_field) + nonce + fw.u8(role) + fw.u8(has_key)
    if rng.random() < 0.3:
        meta = meta[: rng.randrange(len(meta) + 1)]
    if rng.random() < 0.2:
        meta += rng.randbytes(rng.randrange(1, 64))
    meta_field = len(meta) if rng.random() < 0.8 else pick_u32(rng)
    segs = [] if rng.random() < 0.9 else [rng.randbytes(rng.randrange(0, 64))]
    out = fw.header(fw.HELLO, len(segs), meta_field) + b"".join(fw.desc(len(s)) for s in segs)
    return out + meta + b"".join(segs)


def random_identify(rng: random.Random) -> bytes:
    name = "fuzz-raw-" + rng.randbytes(6).hex()
    if rng.random() < 0.02:
        name = "fuzz-server"  # the server's own name: rejected with a log line
    addresses = tuple(
        rng.choice(["127.0.0.1:1", "shm://nowhere", "", "x" * rng.randrange(300)])
        for _ in range(rng.randrange(0, 3))
    )
    return fw.identify(
        name, rng.randbytes(8).hex(), "fuzz-host-" + rng.randbytes(4).hex(), addresses
    )


def post_handshake_frame(rng: random.Random, allow_shared: bool) -> bytes:
    """A frame for a connection that completed HELLO + IDENTIFY (no key).

    Requests only ever name functions that are not defined, so no pickle from
    here is ever unpickled.
    """
    r = rng.random()
    if r < 0.15:
        # Gigantic claims: segments of up to 64 GiB announced, a few bytes sent.
        n = rng.randrange(1, 4)
        descs = [
            fw.desc(
                rng.choice(
                    [GiB, 8 * GiB, (1 << 36) - 1, 1 << 36, (1 << 64) - 1, rng.getrandbits(36)]
                )
            )
            for _ in range(n)
        ]
        meta = fw.u64(rng.getrandbits(64)) + fw.wstr("undefined-" + rng.randbytes(4).hex())
        return (
            fw.header(fw.REQUEST, n, len(meta))
            + b"".join(descs)
            + meta
            + rng.randbytes(rng.randrange(64))
        )
    if r < 0.3:
        meta = fw.u64(rng.getrandbits(64)) + fw.wstr(rng.randbytes(rng.randrange(0, 24)))
        if rng.random() < 0.3:
            meta = meta[: rng.randrange(len(meta) + 1)]
        segs = [rng.randbytes(rng.randrange(0, 256)) for _ in range(rng.randrange(0, 4))]
        return fw.frame(fw.REQUEST, meta, segs)
    if r < 0.45:
        meta = fw.u64(rng.getrandbits(64)) + fw.u8(rng.randrange(256)) + fw.wstr(rng.randbytes(16))
        if rng.random() < 0.3:
            meta = meta[: rng.randrange(len(meta) + 1)]
        return fw.frame(fw.RESPONSE, meta, [rng.randbytes(rng.randrange(0, 64))])
    if r < 0.55:
        name = rng.choice([b"fuzz-server", rng.randbytes(8), b""])
        meta = fw.u32(rng.choice([len(name), pick_u32(rng)])) + name
        return fw.frame(fw.FIND_PEER, meta)
    if r < 0.65:
        meta = (
            fw.u8(rng.randrange(3)) + fw.wstr(rng.randbytes(8)) + fw.wstr(b"inc") + fw.wstr(b"host")
        )
        meta += fw.u32(rng.choice([0, 1, 2, pick_u32(rng)])) + fw.wstr(b"127.0.0.1:1")
        if rng.random() < 0.3:
            meta = meta[: rng.randrange(len(meta) + 1)]
        return fw.frame(fw.PEER_INFO, meta)
    if r < 0.72:
        return fw.frame(fw.SHM_RELEASE, rng.randbytes(rng.choice([0, 2, 4, 8])))
    if r < 0.78:
        return fw.frame(fw.KEEPALIVE, rng.randbytes(rng.randrange(0, 16)))
    if r < 0.84:
        return rng.choice([fw.hello(), fw.auth(rng.randbytes(32)), random_identify(rng)])
    if r < 0.9:
        meta = fw.u64(1) + fw.wstr("undefined")
        d = fw.desc(rng.randrange(0, 4096), fw.KIND_SHARED, pick_u32(rng), pick_u64(rng))
        return fw.header(fw.REQUEST, 1, len(meta)) + d + meta
    return random_header_frame(rng)


def maybe_truncate(rng: random.Random, data: bytes) -> bytes:
    if len(data) > 1 and rng.random() < 0.35:
        return data[: rng.randrange(1, len(data))]
    return data


def connection_payload(rng: random.Random, shm: bool = False) -> tuple[bytes, int, str]:
    """What one raw connection sends: (bytes, number of fuzz frames, category)."""
    r = rng.random()
    if r < 0.2:
        return random_blob(rng), 1, "random-bytes"
    if r < 0.55:
        return maybe_truncate(rng, random_header_frame(rng)), 1, "random-header"
    if r < 0.65:
        return maybe_truncate(rng, mutated_hello(rng)), 1, "mutated-hello"
    if r < 0.8:
        tail = random_blob(rng) if rng.random() < 0.4 else random_header_frame(rng)
        return fw.hello() + maybe_truncate(rng, tail), 1, "hello-then-garbage"
    if r < 0.84:
        # Frames that claim the largest sizes before any handshake.
        frames = [
            fw.header(fw.HELLO, (1 << 32) - 1, (1 << 32) - 1),
            fw.header(fw.HELLO, fw.MAX_SEGMENTS, 0),
            fw.header(fw.HELLO, 0, fw.MAX_META),
            fw.header(fw.HELLO, 0, fw.MAX_HANDSHAKE_FRAME + 1),
            fw.header(fw.HELLO, 1, 16) + fw.desc((1 << 64) - 1),
            fw.header(fw.HELLO, 2, 0) + fw.desc(1 << 63) + fw.desc(1 << 63),
            fw.header(fw.HELLO, 1, 0) + fw.desc(fw.MAX_HANDSHAKE_FRAME + 1),
            fw.header(fw.REQUEST, 1, 0) + fw.desc(60 * GiB),
        ]
        return rng.choice(frames) + rng.randbytes(rng.randrange(0, 32)), 1, "gigantic-claim"
    # A complete (keyless) handshake, then frames for an identified peer.
    n = rng.randrange(1, 6)
    body = b"".join(post_handshake_frame(rng, shm) for _ in range(n))
    return fw.hello() + random_identify(rng) + maybe_truncate(rng, body), n, "handshaken-garbage"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "touched"


@pytest.fixture
def peer(tmp_path, marker):
    p = fw.PeerProcess(tmp_path, marker=marker)
    yield p
    p.stop()


class GoodClient:
    """A moolib peer in this process that keeps calling the server's echo."""

    def __init__(
        self,
        server: fw.PeerProcess,
        transports: list[str] | None = None,
        address: str | None = None,
    ) -> None:
        self.server = server
        self.rpc = moolib.Rpc()
        self.rpc.set_timeout(30)
        if transports:
            self.rpc.set_transports(transports)
        self.rpc.connect(address or server.tcp)
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._n = 0

    def call_once(self) -> None:
        self._n += 1
        n = self._n
        if n % 10 == 0:
            payload = np.arange(20_000 + n % 7, dtype=np.int64)  # out-of-band segment
            result = self.rpc.sync(self.server.name, "echo", payload)
            good = isinstance(result, np.ndarray) and np.array_equal(result, payload)
        else:
            payload = {"n": n, "s": "x" * (n % 50)}
            result = self.rpc.sync(self.server.name, "echo", payload)
            good = result == payload
        if good:
            self.ok += 1
        else:
            self.errors.append(f"call {n}: wrong answer {result!r:.200}")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.call_once()
            except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
                self.errors.append(f"call {self._n}: {type(e).__name__}: {e}")
            self._stop.wait(0.01)

    def start(self) -> GoodClient:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(60)
            assert not self._thread.is_alive(), "the well-behaved client is stuck in a call"

    def transports(self) -> list[str]:
        info = self.rpc.debug_info()
        return [
            c["transport"]
            for p in info["peers"]
            if p["name"] == self.server.name
            for c in p["connections"]
        ]

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            self.rpc.close()


# --------------------------------------------------------------------------- barrage driver


class Barrage:
    """Sends connection payloads in batches over fresh sockets and checks the server hangs up."""

    def __init__(self, rng: random.Random, connect, shm: bool) -> None:
        self.rng = rng
        self.connect = connect
        self.shm = shm
        self.frames = 0
        self.connections = 0
        self.categories: dict[str, int] = {}
        self.half_open: list[socket.socket] = []
        self.not_closed_by_server = 0
        self.connect_failures = 0
        # Descriptors to pass along: an empty memfd and a 4 KiB one.
        self.memfds = [os.memfd_create("fuzz-fd0"), os.memfd_create("fuzz-fd1")] if shm else []
        if self.memfds:
            os.ftruncate(self.memfds[1], 4096)

    def _send(self, sock: socket.socket, data: bytes) -> None:
        sock.settimeout(10)
        try:
            if self.shm and self.rng.random() < 0.1:
                # Descriptors riding along with the garbage.
                fds = array.array(
                    "i", [self.rng.choice(self.memfds) for _ in range(self.rng.randrange(1, 4))]
                )
                n = sock.sendmsg([data[:1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                data = data[n:]
            # Sometimes dribble the first bytes to exercise partial reads.
            if len(data) > 8 and self.rng.random() < 0.1:
                cut = self.rng.randrange(1, 8)
                sock.sendall(data[:cut])
                time.sleep(0)
                data = data[cut:]
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError):
            pass  # the server already hung up: fine
        except TimeoutError:
            raise AssertionError("the server stopped reading from a connection") from None

    def batch(self, size: int) -> None:
        closing: list[socket.socket] = []
        for _ in range(size):
            try:
                sock = self.connect()
            except OSError:
                self.connect_failures += 1
                continue
            self.connections += 1
            data, nframes, category = connection_payload(self.rng, self.shm)
            self.frames += nframes
            self.categories[category] = self.categories.get(category, 0) + 1
            self._send(sock, data)
            end = self.rng.random()
            if end < 0.03 and len(self.half_open) < MAX_HALF_OPEN:
                self.half_open.append(sock)  # left half-open until the end of the test
            elif end < 0.2:
                fw.abort(sock)  # reset
            elif end < 0.3:
                sock.close()  # plain close, not waiting for the server
            else:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)
                closing.append(sock)
        self._await_hangup(closing)

    def _await_hangup(self, socks: list[socket.socket], timeout: float = 15.0) -> None:
        """Drains every socket until the server closes it (it has seen our FIN at least)."""
        pending = {s.fileno(): s for s in socks}
        for s in socks:
            s.setblocking(False)
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            ready, _, _ = select.select(list(pending), [], [], 0.5)
            for fd in ready:
                s = pending[fd]
                try:
                    data = s.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    del pending[fd]
                    s.close()
        self.not_closed_by_server += len(pending)
        for s in pending.values():
            s.close()

    def close(self) -> None:
        for s in self.half_open:
            fw.abort(s)
        self.half_open.clear()
        for fd in self.memfds:
            os.close(fd)
        self.memfds = []


def closing_log_lines(stderr: str) -> list[str]:
    return [
        line for line in stderr.splitlines() if "error]" in line and "closing connection" in line
    ]


# --------------------------------------------------------------------------- tests


def test_random_and_truncated_frames_do_not_disturb_the_peer(peer, marker):
    run_seed = seed()
    rng = random.Random(run_seed)
    ctx = f"MOOLIB_FUZZ_SEED={run_seed}"
    assert peer.shm is not None, "the peer should listen on shared memory too"

    base_fds = peer.open_fds()
    shm_client = GoodClient(peer)  # upgrades itself to shared memory
    tcp_client = GoodClient(peer, transports=["tcp"])
    clients = [shm_client, tcp_client]
    try:
        for c in clients:
            c.call_once()  # connected and answering before the barrage starts
        assert fw.wait_until(lambda: "shm" in shm_client.transports(), 10), (
            f"the default client did not move to shared memory: {shm_client.transports()}"
        )
        for c in clients:
            c.start()
        rss_max = peer.rss_bytes()
        start = time.monotonic()
        tcp = Barrage(rng, lambda: fw.connect_tcp(peer.tcp), shm=False)
        shm = Barrage(rng, lambda: fw.connect_shm(peer.shm), shm=True)
        try:
            while tcp.frames < TCP_FRAMES or shm.frames < SHM_FRAMES:
                assert time.monotonic() - start < FUZZ_TIME_LIMIT, (
                    f"{ctx}: only {tcp.frames} tcp / {shm.frames} shm frames in {FUZZ_TIME_LIMIT} s"
                )
                if tcp.frames < TCP_FRAMES:
                    tcp.batch(48)
                if shm.frames < SHM_FRAMES:
                    shm.batch(4)
                assert peer.alive(), f"{ctx}: the peer died; stderr tail:\n{peer.stderr()[-3000:]}"
                rss_max = max(rss_max, peer.rss_bytes())
                assert rss_max < RSS_LIMIT, f"{ctx}: peer RSS reached {rss_max / MiB:.0f} MiB"
            fuzz_seconds = time.monotonic() - start

            # The half-open connections are still there: the clients must be served meanwhile.
            for c in clients:
                c.call_once()
        finally:
            tcp.close()
            shm.close()
        for c in clients:
            c.stop()
        # Some more calls after the barrage, then a brand-new client.
        for c in clients:
            for _ in range(5):
                c.call_once()
        fresh = GoodClient(peer)
        try:
            for _ in range(3):
                fresh.call_once()
            assert not fresh.errors, fresh.errors[:5]
        finally:
            fresh.close()
        rss_max = max(rss_max, peer.rss_bytes())
    finally:
        for c in clients:
            c.close()

    stats = (
        f"{ctx}: {tcp.frames} tcp frames over {tcp.connections} connections, "
        f"{shm.frames} shm frames over {shm.connections}, {fuzz_seconds:.1f} s, "
        f"categories {tcp.categories}, "
        f"rss max {rss_max / MiB:.0f} MiB, calls ok {[c.ok for c in clients]}"
    )
    print(stats)
    assert tcp.frames >= TCP_FRAMES and shm.frames >= SHM_FRAMES, stats
    assert not marker.exists(), f"{stats}: a fuzz frame ran a function"
    assert peer.alive(), f"{stats}\nstderr tail:\n{peer.stderr()[-3000:]}"
    for c in clients:
        assert not c.errors, f"{stats}\nwell-behaved client failed: {c.errors[:5]}"
        assert c.ok > 10, stats
    assert rss_max < RSS_LIMIT, stats
    assert tcp.connect_failures == 0 and shm.connect_failures == 0, stats
    # Every connection we half-closed was closed by the server in turn.
    assert tcp.not_closed_by_server == 0 and shm.not_closed_by_server == 0, stats
    stderr = peer.stderr()
    lines = closing_log_lines(stderr)
    assert len(lines) >= 100, (
        f"{stats}\nexpected logs about closed connections; stderr tail:\n{stderr[-2000:]}"
    )
    assert any("(shm)" in line for line in lines), (
        "no shared-memory connection was closed with a log"
    )
    # Nothing leaked: the server's descriptors go back to what a few links need.
    assert fw.wait_until(lambda: peer.open_fds() <= base_fds + 16, 30), (
        f"{stats}: the peer holds {peer.open_fds()} descriptors (started with {base_fds})"
    )


def _handshake(sock: socket.socket, name: str = "raw-client") -> dict:
    """Completes a keyless handshake as the dialing side; returns the server's identity."""
    hello = fw.parse_hello(fw.read_frame(sock))
    assert hello.version == fw.VERSION and hello.role == fw.ROLE_SERVER and not hello.has_key
    assert len(hello.nonce) == fw.NONCE_BYTES
    sock.sendall(fw.hello())
    ident = fw.parse_identify(fw.read_frame_skipping_keepalives(sock))
    sock.sendall(fw.identify(name))
    return ident


def _connect(peer: fw.PeerProcess, transport: str) -> socket.socket:
    return fw.connect_tcp(peer.tcp) if transport == "tcp" else fw.connect_shm(peer.shm)


TOUCH_ARGS = pickle.dumps((("arg",), {}), protocol=5)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_identified_raw_client_runs_functions(peer, marker, transport):
    """Control for the tests below: after a complete handshake, "touch" does run."""
    with _connect(peer, transport) as s:
        ident = _handshake(s)
        assert ident["name"] == peer.name
        s.sendall(fw.request(42, "touch", TOUCH_ARGS))
        f = fw.read_frame_skipping_keepalives(s)
        assert f.type == fw.RESPONSE
        r = fw.MetaReader(f.meta)
        assert (r.u64(), r.u8()) == (42, 0)
        assert pickle.loads(f.segments[0]) is True
    assert marker.exists()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize(
    "variant",
    ["after-hello", "pipelined-with-hello", "before-hello", "no-segments", "after-server-identify"],
)
def test_request_before_identify_is_rejected(peer, marker, transport, variant):
    req = fw.request(1, "touch", TOUCH_ARGS)
    with _connect(peer, transport) as s:
        hello = fw.parse_hello(fw.read_frame(s))
        assert hello.role == fw.ROLE_SERVER
        if variant == "after-hello":
            s.sendall(fw.hello())
            s.sendall(req)
        elif variant == "pipelined-with-hello":
            s.sendall(fw.hello() + req + fw.identify("sneaky") + req)
        elif variant == "before-hello":
            s.sendall(req + fw.hello() + fw.identify("sneaky"))
        elif variant == "no-segments":
            s.sendall(fw.hello() + fw.frame(fw.REQUEST, fw.u64(1) + fw.wstr("touch")))
        else:
            s.sendall(fw.hello())
            fw.parse_identify(fw.read_frame_skipping_keepalives(s))  # the server identified itself
            s.sendall(req)
        assert fw.wait_closed(s, 10), (
            "the server kept a connection that sent a request before identify"
        )
    time.sleep(0.5)
    assert not marker.exists(), "a request sent before the handshake completed was executed"
    assert peer.alive()
    stderr = peer.stderr()
    assert "closing connection" in stderr and "handshake" in stderr, stderr[-2000:]


def test_gigantic_claims_are_refused_without_allocating(peer):
    """Frames announcing huge sizes close their connection; the peer never allocates them."""
    rss_before = peer.rss_bytes()
    pre_handshake = [
        fw.header(fw.HELLO, (1 << 32) - 1, 0),
        fw.header(fw.HELLO, 0, (1 << 32) - 1),
        fw.header(fw.HELLO, fw.MAX_SEGMENTS + 1, 0),
        fw.header(fw.HELLO, 0, fw.MAX_META + 1),
        fw.header(fw.HELLO, 0, fw.MAX_HANDSHAKE_FRAME + 1),
        fw.header(fw.HELLO, 1, 0) + fw.desc((1 << 64) - 1),
        fw.header(fw.HELLO, 3, 0) + fw.desc(1 << 63) + fw.desc(1 << 63) + fw.desc(24),
        fw.header(fw.REQUEST, 1, 0) + fw.desc(60 * GiB),
        fw.header(fw.HELLO, 1, 0) + fw.desc(0, kind=fw.KIND_SHARED),
    ]
    for i, data in enumerate(pre_handshake):
        for transport in ("tcp", "shm"):
            with _connect(peer, transport) as s:
                s.sendall(data)
                assert fw.wait_closed(s, 10), (
                    f"claim {i} over {transport} did not close the connection"
                )
    # After a complete handshake larger frames are allowed, but what is merely
    # announced must still not become resident memory.
    socks = []
    for claim in (GiB, 8 * GiB, (1 << 36) - 1, 1 << 36, (1 << 64) - 1):
        s = fw.connect_tcp(peer.tcp)
        _handshake(s, f"raw-{claim}")
        meta = fw.u64(1) + fw.wstr("undefined")
        s.sendall(fw.header(fw.REQUEST, 1, len(meta)) + fw.desc(claim) + meta + b"\0" * 4096)
        socks.append(s)
    time.sleep(0.5)
    rss = peer.rss_bytes()
    for s in socks:
        s.close()
    assert peer.alive()
    assert rss - rss_before < 256 * MiB, f"RSS grew by {(rss - rss_before) / MiB:.0f} MiB"
    assert "closing connection" in peer.stderr()
    client = GoodClient(peer)
    try:
        client.call_once()
        assert not client.errors
    finally:
        client.close()


def test_unidentified_connections_cost_bounded_memory(peer):
    """Connections that never complete the handshake must each cost little memory.

    Before the handshake a connection may send at most kMaxHandshakeFrame (64 KiB)
    of tables and metadata, so it needs no larger buffer than that; anyone who
    can reach the port can open thousands of such connections.
    """
    # Both processes need a descriptor per connection (the peer inherits our limit).
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    count = min(2000, soft - 200)
    rss_before = peer.rss_bytes()
    socks = []
    try:
        for _ in range(count):
            s = fw.connect_tcp(peer.tcp)
            s.sendall(fw.hello()[:10])  # a partial header: the connection is in use
            socks.append(s)
        fw.wait_until(lambda: peer.rss_bytes() - rss_before > count * 128 * 1024, 3)
        grown = peer.rss_bytes() - rss_before
    finally:
        for s in socks:
            fw.abort(s)
    assert peer.alive()
    per_connection = grown / count
    # 64 KiB (the largest handshake frame) plus bookkeeping.
    assert per_connection <= 100 * 1024, (
        f"each unidentified connection costs the peer {per_connection / 1024:.0f} KiB of RSS "
        f"({count} connections: +{grown / MiB:.0f} MiB)"
    )


def test_shm_descriptors_before_handshake_are_bounded(peer):
    """File descriptors passed over the shared-memory socket before the handshake
    must not pile up in the peer: every count read from the wire is bounded."""
    base = peer.open_fds()
    memfd = os.memfd_create("fuzz-flood")
    s = fw.connect_shm(peer.shm)
    try:
        header = fw.hello()[:23]  # never completes a header
        fds = array.array("i", [memfd] * 64)
        peak = base
        for i in range(len(header)):
            try:
                s.sendmsg([header[i : i + 1]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
            except (BrokenPipeError, ConnectionResetError):
                break  # the peer hung up on us: that is a fine answer
            time.sleep(0.01)
            peak = max(peak, peer.open_fds())
        time.sleep(0.2)
        peak = max(peak, peer.open_fds())
    finally:
        s.close()
        os.close(memfd)
    assert peer.alive()
    assert peak - base <= 256, (
        f"an unauthenticated shm connection made the peer hold {peak - base} extra descriptors "
        f"(sent {64 * len(header)} with {len(header)} bytes of an unfinished header)"
    )


def _shm_handshake_and_map(
    peer: fw.PeerProcess, size: int, seal: bool
) -> tuple[socket.socket, int, bytes, bool]:
    """Identifies over shm and calls "echo" on a pickle that lives in a memfd of ``size``
    bytes, passed along as a shared segment of the frame.

    With ``seal`` the memfd cannot shrink or grow, as a careful sender's would be.
    Returns (socket, memfd, pickle, whether the receiver accepted the segment): a
    receiver may refuse memory it cannot trust (e.g. unsealed), which is fine.
    """
    s = fw.connect_shm(peer.shm)
    _handshake(s, "raw-shm")
    memfd = os.memfd_create("fuzz-seg", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(memfd, size)
    payload = pickle.dumps((("shared",), {}), protocol=5)
    os.pwrite(memfd, payload, 0)
    if seal:
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    meta = fw.u64(1) + fw.wstr("echo")
    desc = fw.desc(len(payload), fw.KIND_SHARED, 0, 0)
    first = fw.header(fw.REQUEST, 1, len(meta)) + desc + meta
    s.sendmsg([first], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]))])
    accepted = False
    with contextlib.suppress(fw.Closed):
        f = fw.read_frame_skipping_keepalives(s)
        if f.type == fw.RESPONSE and fw.MetaReader(f.meta).take(9)[8] == 0:
            assert pickle.loads(f.segments[0]) == "shared"
            accepted = True
    return s, memfd, payload, accepted


def test_shm_segment_shrunk_by_sender_does_not_crash_receiver(peer):
    """An identified shm peer truncates its memfd after the receiver mapped it, then
    references the mapped range again: reading it must not SIGBUS the receiver (a
    receiver would insist on F_SEAL_SHRINK, or otherwise guard the access)."""
    s, memfd, payload, accepted = _shm_handshake_and_map(peer, MiB, seal=False)
    try:
        if accepted:
            os.ftruncate(memfd, 0)
            meta = fw.u64(2) + fw.wstr("echo")
            desc = fw.desc(len(payload), fw.KIND_SHARED, 0, 0)
            fw.send_all_ignoring_reset(s, fw.header(fw.REQUEST, 1, len(meta)) + desc + meta)
            with contextlib.suppress(fw.Closed, TimeoutError):
                fw.read_frame_skipping_keepalives(s, 5)
            time.sleep(0.3)
    finally:
        s.close()
        os.close(memfd)
    assert peer.alive(), f"the peer died with status {peer.proc.returncode} (-7 is SIGBUS)"
    client = GoodClient(peer)
    try:
        client.call_once()
        assert not client.errors
    finally:
        client.close()


def test_shm_segment_reference_does_not_populate_the_whole_memfd(peer):
    """A small reference into a large sparse (sealed) memfd must not make the receiver
    allocate the whole memfd: the frame only claimed a few dozen bytes."""
    rss_before = peer.rss_bytes()
    s, memfd, payload, accepted = _shm_handshake_and_map(peer, 256 * MiB, seal=True)
    try:
        time.sleep(0.2)
        grown = peer.rss_bytes() - rss_before
    finally:
        s.close()
        os.close(memfd)
    assert peer.alive()
    assert grown < 64 * MiB, (
        f"the peer's RSS grew by {grown / MiB:.0f} MiB for a {len(payload)}-byte shared segment "
        f"(accepted: {accepted})"
    )


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_accept_survives_descriptor_exhaustion(peer):
    """When the peer runs out of descriptors, pending connections must not make it
    spin on accept() (nor flood its log); once descriptors free up it serves again.

    Anyone who can connect can exhaust them: unidentified connections are not
    limited in number (and see the shm descriptor test above)."""
    limit = peer.open_fds() + 24
    resource.prlimit(peer.pid, resource.RLIMIT_NOFILE, (limit, limit))
    socks = []
    try:
        for _ in range(40):  # more than the peer can accept
            socks.append(socket.create_connection(fw.tcp_host_port(peer.tcp), timeout=10))
        fw.wait_until(lambda: peer.open_fds() >= limit - 1, 5)
        lines_before = len(peer.stderr().splitlines())
        cpu_before = _cpu_seconds(peer.pid)
        time.sleep(2.0)
        cpu = _cpu_seconds(peer.pid) - cpu_before
        lines = len(peer.stderr().splitlines()) - lines_before
    finally:
        for s in socks:
            fw.abort(s)
    assert peer.alive()
    assert cpu < 0.5 and lines < 200, (
        f"with descriptors exhausted the peer used {cpu:.2f} s of CPU in 2 s "
        f"and logged {lines} lines"
    )
    assert fw.wait_until(lambda: peer.open_fds() < limit - 16, 30)
    client = GoodClient(peer)
    try:
        client.call_once()
        assert not client.errors
    finally:
        client.close()
