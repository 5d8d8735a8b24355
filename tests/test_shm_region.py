"""moolib._core.ShmRegion: the one shared-memory region type (moolib/core/shm/shm_region.h).

Made, received as an fd, or opened from another process through /proc; viewed
by numpy and torch with no copy; alive while any view is; nothing in /dev/shm.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from helpers.util import DEADLINE

from moolib._core import ShmRegion


def mapped_memfds(name: str) -> int:
    """How many of this process's mappings are of memfds named ``name``."""
    with open("/proc/self/maps") as f:
        return sum(f"/memfd:{name} " in line for line in f)


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_a_created_region_is_a_named_close_on_exec_memfd_that_numpy_and_torch_view_in_place():
    before = dev_shm()
    r = ShmRegion.create("moolib-test-create", 10_000)
    assert r.size == len(r) == 10_000 and r.writable and r.fd >= 0
    assert os.readlink(f"/proc/self/fd/{r.fd}").startswith("/memfd:moolib-test-create")
    assert fcntl.fcntl(r.fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
    a = np.frombuffer(r, dtype=np.uint8)
    t = torch.frombuffer(r, dtype=torch.uint8)
    assert a.flags.writeable and a.size == 10_000
    a[:4] = [1, 2, 3, 4]
    assert t[:4].tolist() == [1, 2, 3, 4]  # the same memory, no copy
    assert a.ctypes.data == t.data_ptr()
    assert os.pread(r.fd, 4, 0) == b"\x01\x02\x03\x04"  # and the memfd's
    assert dev_shm() == before


def test_a_view_keeps_the_mapping_after_close_and_the_region_object_are_gone():
    r = ShmRegion.create("moolib-test-life", 4096)
    a = np.frombuffer(r, dtype=np.uint8)
    a[:] = 7
    r.close()
    assert r.fd == -1 and r.size == 4096
    del r
    gc.collect()
    assert mapped_memfds("moolib-test-life") == 1 and int(a.sum()) == 7 * 4096
    del a
    gc.collect()
    assert mapped_memfds("moolib-test-life") == 0


def test_sealed_regions_cannot_change_size():
    r = ShmRegion.create("moolib-test-sealed", 8192, sealed=True)
    with pytest.raises(PermissionError):
        os.ftruncate(r.fd, 4096)
    plain = ShmRegion.create("moolib-test-plain", 8192)
    os.ftruncate(plain.fd, 8192)  # unsealed: allowed


def test_from_fd_maps_a_received_memfd_and_leaves_the_fd_to_its_caller():
    fd = os.memfd_create("moolib-test-received", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8192)
        os.pwrite(fd, b"hello", 100)
        r = ShmRegion.from_fd(fd, 8192)
        assert r.fd == -1 and r.size == 8192
        assert bytes(memoryview(r)[100:105]) == b"hello"
        np.frombuffer(r, dtype=np.uint8)[0] = 9
        assert os.pread(fd, 1, 0) == b"\x09"
        whole = ShmRegion.from_fd(fd)  # size 0: the whole file
        assert whole.size == 8192
        ro = ShmRegion.from_fd(fd, 4096, writable=False)
        assert not ro.writable and not np.frombuffer(ro, dtype=np.uint8).flags.writeable
        with pytest.raises(TypeError):
            memoryview(ro)[0] = 1
        with pytest.raises(OSError, match="smaller than the 16384 to map"):
            ShmRegion.from_fd(fd, 16384)
    finally:
        os.close(fd)
    assert bytes(memoryview(r)[100:105]) == b"hello"


def test_refusals_name_their_reason():
    with pytest.raises(OSError, match="at least one byte"):
        ShmRegion.create("moolib-test-empty", 0)
    with pytest.raises(OSError) as bad_fd:
        ShmRegion.from_fd(987654, 10)
    assert bad_fd.value.errno == errno.EBADF and "Bad file descriptor" in str(bad_fd.value)
    empty = os.memfd_create("moolib-test-empty")
    try:
        with pytest.raises(OSError, match="empty shared region"):
            ShmRegion.from_fd(empty)
    finally:
        os.close(empty)


def test_open_peer_maps_only_a_sealed_memfd_of_the_name_it_expects():
    r = ShmRegion.create("moolib-test-peer", 8192, sealed=True)
    np.frombuffer(r, dtype=np.uint8)[:3] = [5, 6, 7]
    pid = os.getpid()
    peer = ShmRegion.open_peer(pid, r.fd, "moolib-test-peer", 4096)
    assert peer.fd == -1 and peer.size == 4096 and not peer.writable
    assert bytes(memoryview(peer)[:3]) == b"\x05\x06\x07"
    rw = ShmRegion.open_peer(pid, r.fd, "moolib-test-peer", 8192, writable=True)
    np.frombuffer(rw, dtype=np.uint8)[3] = 8
    assert bytes(memoryview(r)[:4]) == b"\x05\x06\x07\x08"
    # Another name, a prefix of it, or not a memfd at all: refused, naming what it is.
    with pytest.raises(OSError, match="not a memfd named 'moolib-replay'"):
        ShmRegion.open_peer(pid, r.fd, "moolib-replay", 4096)
    with pytest.raises(OSError, match="not a memfd named 'moolib-test-pee'"):
        ShmRegion.open_peer(pid, r.fd, "moolib-test-pee", 4096)
    with open(__file__, "rb") as f, pytest.raises(OSError, match="test_shm_region.py"):
        ShmRegion.open_peer(pid, f.fileno(), "moolib-test-peer", 1)
    with pytest.raises(OSError, match="is 8192 bytes, smaller than the 8193 announced"):
        ShmRegion.open_peer(pid, r.fd, "moolib-test-peer", 8193)
    # One that its owner could shrink under the mapping (a fault here, SIGBUS): refused.
    unsealed = ShmRegion.create("moolib-test-peer", 8192)
    with pytest.raises(OSError, match=r"can shrink \(not sealed with F_SEAL_SHRINK\)"):
        ShmRegion.open_peer(pid, unsealed.fd, "moolib-test-peer", 4096)
    # No such fd here (a pid of another host, a closed fd).
    with pytest.raises(FileNotFoundError, match=f"/proc/{pid}/fd/987654"):
        ShmRegion.open_peer(pid, 987654, "moolib-test-peer", 4096)


def test_another_process_opens_a_region_through_proc_and_writes_into_it():
    r = ShmRegion.create("moolib-test-child", 4096, sealed=True)
    child = textwrap.dedent(
        f"""
        import numpy as np
        from moolib._core import ShmRegion
        r = ShmRegion.open_peer({os.getpid()}, {r.fd}, "moolib-test-child", 4096, writable=True)
        np.frombuffer(r, dtype=np.uint8)[:2] = [42, 43]
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=DEADLINE)
    assert bytes(memoryview(r)[:2]) == b"\x2a\x2b"
