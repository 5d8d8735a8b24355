import dataclasses
import gc
import math
import os
import pickle
import subprocess
import sys
import warnings
import weakref

import numpy as np
import pytest
import torch
from helpers.util import OPTIONAL_DTYPE_NAMES, all_dtypes

from moolib import serialization
from moolib.serialization import INBAND_THRESHOLD, dumps, loads

ALL_DTYPES = all_dtypes(OPTIONAL_DTYPE_NAMES)
SHAPES = [(), (0,), (3, 0, 2), (7,), (2, 3, 4), (64, 67)]

# How a receiver might hand buffers back: the core gives writable blocks, but
# anything supporting the buffer protocol must work.
BUFFER_KINDS = {
    "bytearray": bytearray,
    "bytes": bytes,
    "memoryview": lambda b: memoryview(bytearray(b)),
    "readonly_memoryview": lambda b: memoryview(bytes(b)),
}


def random_tensor(dtype, shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    numel = math.prod(shape)
    # Random bytes cover every bit pattern, including NaNs, infinities and
    # denormals, which is what a bitwise round-trip must preserve.
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def bits(t):
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensor(a, b):
    assert type(a) is type(b)
    assert a.dtype == b.dtype
    assert a.shape == b.shape
    assert a.device.type == b.device.type
    assert a.requires_grad == b.requires_grad
    assert torch.equal(bits(a), bits(b))


def roundtrip(obj, kind="bytearray"):
    data, buffers = dumps(obj)
    assert isinstance(data, bytes)
    for b in buffers:
        assert isinstance(b, memoryview)
        assert b.format == "B" and b.ndim == 1 and b.c_contiguous
    return loads(data, [BUFFER_KINDS[kind](b) for b in buffers]), buffers


def address(buffer):
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtype_roundtrip_bitwise(dtype, shape):
    t = random_tensor(dtype, shape)
    out, buffers = roundtrip(t)
    assert_same_tensor(out, t)
    assert len(buffers) == (1 if t.nbytes >= INBAND_THRESHOLD else 0)


@pytest.mark.parametrize("kind", BUFFER_KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.complex128, torch.bool], ids=str)
def test_buffer_kinds(kind, dtype):
    t = random_tensor(dtype, (100, 50))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, buffers = roundtrip(t, kind)
    assert len(buffers) == 1
    assert_same_tensor(out, t)
    # Whatever the buffer kind, the result must be usable as a normal tensor.
    out.view(torch.uint8).reshape(-1)[0] = 0


def test_nan_values_survive():
    t = torch.tensor([float("nan"), -float("nan"), float("inf"), -0.0, 1.0] * 2000)
    out, _ = roundtrip(t)
    assert torch.equal(bits(out), bits(t))
    assert torch.equal(out.isnan(), t.isnan())


def test_zero_copy_send():
    t = torch.rand(256 * 1024)  # 1 MiB of float32
    data, buffers = dumps(t)
    assert len(buffers) == 1
    assert buffers[0].nbytes == t.nbytes == 1 << 20
    assert address(buffers[0]) == t.data_ptr()
    assert len(data) < 256


def test_zero_copy_send_of_contiguous_slice():
    base = torch.arange(100_000, dtype=torch.int64)
    t = base[1000:3000]
    _, buffers = dumps(t)
    assert len(buffers) == 1
    assert buffers[0].nbytes == t.nbytes
    assert address(buffers[0]) == t.data_ptr()


def test_received_tensor_shares_writable_buffer():
    t = torch.rand(10_000)
    data, buffers = dumps(t)
    received = bytearray(buffers[0])
    out = loads(data, [received])
    assert out.data_ptr() == address(received)
    out[0] = 123.0
    assert np.frombuffer(received, dtype=np.float32)[0] == 123.0
    received[4:8] = np.float32(7.0).tobytes()
    assert out[1].item() == 7.0


def test_received_tensor_shares_memoryview_slice():
    t = torch.rand(10_000, dtype=torch.float64)
    data, buffers = dumps(t)
    block = bytearray(64 + t.nbytes)
    view = memoryview(block)[64:]
    view[:] = buffers[0]
    out = loads(data, [view])
    assert out.data_ptr() == address(block) + 64
    assert_same_tensor(out, t)


def test_readonly_buffer_is_copied_without_warning():
    t = torch.rand(10_000)
    data, buffers = dumps(t)
    frozen = bytes(buffers[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = loads(data, [frozen])
    assert out.data_ptr() != address(frozen)
    out.fill_(0)
    assert frozen == bytes(buffers[0])


def test_misaligned_buffer():
    t = torch.rand(10_000, dtype=torch.float64)
    data, buffers = dumps(t)
    block = bytearray(t.nbytes + 1)
    view = memoryview(block)[1:]
    view[:] = buffers[0]
    out = loads(data, [view])
    assert out.data_ptr() % 8 == 0
    assert_same_tensor(out, t)


def test_received_tensor_keeps_buffer_alive():
    t = torch.rand(10_000)
    data, buffers = dumps(t)
    # numpy arrays support weak references, unlike bytearray.
    block = np.frombuffer(bytearray(buffers[0]), dtype=np.uint8)
    ref = weakref.ref(block)
    out = loads(data, [block])
    del block
    gc.collect()
    assert ref() is not None
    assert_same_tensor(out, t)
    del out
    gc.collect()
    assert ref() is None


class Payload:
    pass


def test_dumps_does_not_retain_objects():
    obj = Payload()
    ref = weakref.ref(obj)
    gc.disable()
    try:
        dumps({"o": obj, "t": torch.rand(5000)})
        del obj
        # Without relying on the cyclic GC, nothing may keep the payload alive.
        assert ref() is None
    finally:
        gc.enable()


def test_sender_buffers_keep_tensor_memory_alive():
    data, buffers = dumps(torch.full((10_000,), 3.0))
    gc.collect()
    out = loads(data, [bytearray(b) for b in buffers])
    assert torch.equal(out, torch.full((10_000,), 3.0))


def test_inband_threshold_boundary():
    below = torch.zeros(INBAND_THRESHOLD - 1, dtype=torch.uint8)
    at = torch.ones(INBAND_THRESHOLD, dtype=torch.uint8)
    _, buffers = dumps(below)
    assert buffers == []
    out, buffers = roundtrip([below, at])
    assert len(buffers) == 1 and buffers[0].nbytes == INBAND_THRESHOLD
    assert_same_tensor(out[0], below)
    assert_same_tensor(out[1], at)


def test_inband_tensor_is_writable():
    t = torch.arange(10, dtype=torch.int32)
    data, buffers = dumps(t)
    assert buffers == []
    out = loads(data, [])
    out[0] = 5
    assert out[0].item() == 5


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.rand(300, 200).t(),
        lambda: torch.rand(5000)[::3],
        lambda: torch.rand(40, 50, 60)[:, 5:45:2, ::7],
        lambda: torch.rand(100, 1).expand(100, 300),
        lambda: torch.rand(2, 3, 64, 64).to(memory_format=torch.channels_last),
        lambda: random_tensor(torch.bfloat16, (128, 64)).t(),
        lambda: random_tensor(torch.bool, (200, 100))[::2, 1::3],
        lambda: torch.randn(3000, dtype=torch.complex64).conj(),
        lambda: torch.rand(20, 30).t(),  # small: in-band
    ],
)
def test_non_contiguous(make):
    t = make()
    out, buffers = roundtrip(t)
    assert out.is_contiguous()
    assert len(buffers) == (1 if t.nbytes >= INBAND_THRESHOLD else 0)
    assert torch.equal(bits(out.resolve_conj()), bits(t.resolve_conj()))
    assert out.dtype == t.dtype and out.shape == t.shape


def test_requires_grad():
    leaf = torch.rand(3000, requires_grad=True)
    non_leaf = leaf * 2
    plain = torch.rand(3000)
    out, _ = roundtrip({"leaf": leaf, "non_leaf": non_leaf, "plain": plain})
    assert out["leaf"].requires_grad and out["leaf"].is_leaf
    assert out["non_leaf"].requires_grad and out["non_leaf"].is_leaf
    assert not out["plain"].requires_grad
    assert torch.equal(out["non_leaf"].detach(), non_leaf.detach())
    out["non_leaf"].sum().backward()
    assert torch.equal(out["non_leaf"].grad, torch.ones(3000))


def test_parameter_type_preserved():
    p = torch.nn.Parameter(torch.rand(64, 64))
    frozen = torch.nn.Parameter(torch.rand(2), requires_grad=False)
    out, _ = roundtrip([p, frozen])
    assert_same_tensor(out[0], p)
    assert_same_tensor(out[1], frozen)


def test_shared_tensor_identity():
    t = torch.rand(5000)
    out, buffers = roundtrip({"a": t, "b": [t, t]})
    assert len(buffers) == 1
    assert out["a"] is out["b"][0] is out["b"][1]


@dataclasses.dataclass
class Sample:
    name: str
    obs: torch.Tensor
    extra: dict


def test_arbitrary_objects_and_nests():
    obj = {
        "none": None,
        "bytes": b"\x00\xffhello",
        "bytearray": bytearray(b"abc"),
        "set": {1, 2, 3},
        "frozenset": frozenset({"a"}),
        "big_int": 2**100,
        "nan": float("nan"),
        "complex": 1 + 2j,
        "str": "ünïcode",
        "tuple": (1, (2, [3, {"x": torch.arange(3)}])),
        "sample": Sample("s", torch.rand(30, 40), {"arr": np.arange(2000.0)}),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "size": torch.Size([1, 2]),
        "np_scalar": np.float32(1.5),
        ("tuple", "key"): [torch.rand(2000, dtype=torch.float64), np.ones((3, 3), np.int16)],
    }
    out, buffers = roundtrip(obj)
    assert len(buffers) == 3
    assert set(out) == set(obj)
    for key in ("none", "bytes", "bytearray", "set", "frozenset", "big_int", "complex", "str"):
        assert out[key] == obj[key] and type(out[key]) is type(obj[key])
    assert math.isnan(out["nan"])
    assert out["dtype"] is torch.float16
    assert out["device"] == torch.device("cpu")
    assert out["size"] == torch.Size([1, 2])
    assert out["np_scalar"] == np.float32(1.5) and out["np_scalar"].dtype == np.float32
    assert out["tuple"][:1] == (1,)
    assert_same_tensor(out["tuple"][1][1][1]["x"], torch.arange(3))
    sample = out["sample"]
    assert isinstance(sample, Sample) and sample.name == "s"
    assert_same_tensor(sample.obs, obj["sample"].obs)
    np.testing.assert_array_equal(sample.extra["arr"], obj["sample"].extra["arr"])
    pair = out[("tuple", "key")]
    assert_same_tensor(pair[0], obj[("tuple", "key")][0])
    assert pair[1].dtype == np.int16
    np.testing.assert_array_equal(pair[1], obj[("tuple", "key")][1])


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(100_000, dtype=np.float32),
        lambda: np.arange(100_000, dtype=np.int64).reshape(100, 1000),
        lambda: np.asfortranarray(np.random.rand(300, 200)),
        lambda: np.random.rand(300, 200)[::2, ::3],
        lambda: np.random.rand(300, 200).T[::-1],
        lambda: np.arange(30_000, dtype=np.uint16)[::-2],
        lambda: np.random.rand(4, 5)[:, ::2],  # small: in-band
        lambda: np.array(3.25),
        lambda: np.zeros((0, 7), dtype=np.complex64),
        lambda: np.random.rand(100, 100) > 0.5,
        lambda: np.zeros(5000, dtype=[("a", np.int32), ("b", np.float64)]),
    ],
)
def test_numpy_roundtrip(make):
    a = make()
    out, buffers = roundtrip(a)
    assert type(out) is np.ndarray
    assert out.dtype == a.dtype and out.shape == a.shape
    np.testing.assert_array_equal(out, a)
    assert len(buffers) == (1 if a.nbytes >= INBAND_THRESHOLD else 0)


def test_numpy_zero_copy_send():
    a = np.random.rand(1 << 17)
    _, buffers = dumps(a)
    assert len(buffers) == 1
    assert address(buffers[0]) == a.ctypes.data


def test_numpy_object_array():
    a = np.empty(3, dtype=object)
    a[:] = [torch.rand(2000), "x", None]
    out, buffers = roundtrip(a[::-1])
    assert len(buffers) == 1
    assert out[0] is None and out[1] == "x"
    assert_same_tensor(out[2], a[0])


# Quantized tensors are deprecated and torch's own pickling warns about storages.
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.quantize_per_tensor(torch.rand(100), 0.1, 10, torch.quint8),
        lambda: torch.rand(50, 50).to_sparse(),
    ],
)
def test_special_tensors_fall_back_to_torch_pickling(make):
    t = make()
    out, _ = roundtrip(t)
    assert out.layout == t.layout and out.dtype == t.dtype
    if t.is_quantized:
        assert torch.equal(out.int_repr(), t.int_repr())
    else:
        assert torch.equal(out.to_dense(), t.to_dense())


def test_loads_accepts_bytes_like_data():
    obj = {"t": torch.rand(5000), "n": 3}
    data, buffers = dumps(obj)
    for wrapped in (bytearray(data), memoryview(data)):
        out = loads(wrapped, [bytearray(b) for b in buffers])
        assert_same_tensor(out["t"], obj["t"]) and out["n"] == 3


def test_no_torch_copy_fallback():
    t = torch.arange(1000, dtype=torch.int32)[100:200]
    copied = serialization._tensor_bytes_copy(t.view(torch.uint8))
    assert isinstance(copied, bytearray)
    assert bytes(copied) == t.numpy().tobytes()


def test_cuda_device_falls_back_to_cpu_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    raw = bytearray(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    out = serialization._rebuild_tensor_v1(raw, "float32", (2, 2), True, "cuda:3", False)
    assert out.device.type == "cpu" and out.requires_grad
    assert torch.equal(out.detach(), torch.arange(4.0).reshape(2, 2))


def test_import_does_not_import_torch_or_numpy():
    path = os.path.join(os.path.dirname(__file__), "..", "moolib", "serialization.py")
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ser', {os.path.abspath(path)!r})\n"
        "ser = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(ser)\n"
        "data, bufs = ser.dumps({'a': [1, 2.0, b'x' * 10000]})\n"
        "assert ser.loads(data, bufs) == {'a': [1, 2.0, b'x' * 10000]}\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pickle_stream_is_plain_protocol_5():
    data, buffers = dumps(torch.rand(5000))
    assert data[:2] == b"\x80\x05"
    # Standard pickle can load it: no custom unpickler is required on the receiver.
    out = pickle.loads(data, buffers=buffers)
    assert out.shape == (5000,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_cuda_roundtrip(dtype):
    t = random_tensor(dtype, (33, 65)).cuda()
    out, buffers = roundtrip({"t": t, "nc": t.t()})
    assert out["t"].device == t.device
    assert_same_tensor(out["t"], t)
    assert torch.equal(bits(out["nc"]), bits(t.t()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA not available")
def test_cuda_missing_index_maps_to_device_zero():
    raw = bytearray(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    out = serialization._rebuild_tensor_v1(raw, "float32", (4,), False, "cuda:9999", False)
    assert out.device == torch.device("cuda", 0)
    assert torch.equal(out.cpu(), torch.arange(4.0))
