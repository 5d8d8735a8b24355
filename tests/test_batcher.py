"""moolib.Batcher: stack/cat checked against torch.stack/torch.cat on random nests,
overflow across batches, blocking get from other threads, asyncio, error paths."""

import asyncio
import collections
import random
import threading

import numpy as np
import pytest
import torch

import moolib
from moolib import nest

Point = collections.namedtuple("Point", ["x", "y"])

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]

# Generous: the machine may be loaded; nothing here asserts on timing.
DEADLINE = 60.0


def make_structure(rng, depth=0):
    """A random nest of placeholder ints (leaves), including namedtuples."""
    if depth >= 3 or rng.random() < 0.3:
        return 0
    kind = rng.choice(["dict", "list", "tuple", "point"])
    if kind == "point":
        return Point(make_structure(rng, depth + 1), make_structure(rng, depth + 1))
    n = rng.randint(1, 3)
    children = [make_structure(rng, depth + 1) for _ in range(n)]
    if kind == "dict":
        keys = rng.sample(["b", "a", "obs", "z", "done"], n)
        return dict(zip(keys, children, strict=True))
    return children if kind == "list" else tuple(children)


def random_tensor(rng, shape, dtype):
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def leaf_specs(rng, structure, min_rank):
    """Per leaf: None (a None leaf) or (shape, dtype), with rank >= min_rank."""
    specs = []
    for _ in nest.flatten(structure):
        if rng.random() < 0.1:
            specs.append(None)
            continue
        rank = rng.randint(min_rank, min_rank + 3)
        shape = tuple(rng.randint(1, 4) for _ in range(rank))
        specs.append((shape, rng.choice(DTYPES)))
    if all(spec is None for spec in specs):  # at least one tensor, so cat has a length
        specs[0] = ((2,) * max(min_rank, 1), torch.float32)
    return specs


def make_item(rng, structure, specs, batch_dim=None, length=None):
    """An item shaped by ``specs``; with ``batch_dim``, leaves get ``length`` there."""
    leaves = []
    for spec in specs:
        if spec is None:
            leaves.append(None)
            continue
        shape, dtype = spec
        if batch_dim is not None:
            shape = list(shape)
            shape[batch_dim if batch_dim >= 0 else len(shape) + batch_dim] = length
        leaves.append(random_tensor(rng, tuple(shape), dtype))
    return nest.pack_as(structure, leaves)


def assert_nest_equal(actual, expected):
    """Same containers (types, dict key order), same leaves (dtype, shape, values)."""
    assert type(actual) is type(expected)
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_nest_equal(actual[k], expected[k])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_nest_equal(a, e)
    elif expected is None:
        assert actual is None
    else:
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        assert actual.device.type == "cpu"
        assert torch.equal(actual, expected)


def torch_stack(items, dim):
    return nest.map_structure(lambda *xs: None if xs[0] is None else torch.stack(xs, dim), *items)


def torch_cat(items, dim):
    return nest.map_structure(lambda *xs: None if xs[0] is None else torch.cat(xs, dim), *items)


def torch_narrow(batch, dim, start, length):
    return nest.map_structure(
        lambda x: (
            None if x is None else x.narrow(dim if dim >= 0 else x.dim() + dim, start, length)
        ),
        batch,
    )


def drain(batcher):
    out = []
    while not batcher.empty():
        out.append(batcher.get())
    return out


# -- stack -------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_stack_matches_torch_stack(seed):
    rng = random.Random(seed)
    size = rng.randint(1, 5)
    dim = rng.randint(-3, 2)
    structure = make_structure(rng)
    # torch.stack accepts dims -(rank+1)..rank.
    specs = leaf_specs(rng, structure, min_rank=dim if dim >= 0 else -dim - 1)
    batcher = moolib.Batcher(size, dim=dim)
    assert batcher.size() == size
    nbatches = rng.randint(1, 3)
    items = [make_item(rng, structure, specs) for _ in range(size * nbatches)]
    for i, item in enumerate(items):
        assert batcher.empty() == (i < size)  # the first batch stays until taken
        batcher.stack(item)
    batches = drain(batcher)
    assert len(batches) == nbatches
    for k, batch in enumerate(batches):
        assert_nest_equal(batch, torch_stack(items[k * size : (k + 1) * size], dim))


def test_stack_single_tensor_and_scalars():
    batcher = moolib.Batcher(3)
    for i in range(3):
        batcher.stack(torch.tensor(float(i)))
    assert_nest_equal(batcher.get(), torch.tensor([0.0, 1.0, 2.0]))

    # Numbers and numpy arrays are leaves too (arrays become tensors).
    batcher = moolib.Batcher(2, dim=-1)
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3) + i for i in range(2)]
    for i, a in enumerate(arrays):
        batcher.stack({"reward": float(i), "done": bool(i), "step": i, "obs": a})
    batch = batcher.get()
    assert_nest_equal(
        batch,
        {
            "reward": torch.tensor([0.0, 1.0]),
            "done": torch.tensor([False, True]),
            "step": torch.tensor([0, 1]),
            "obs": torch.stack([torch.from_numpy(a) for a in arrays], -1),
        },
    )


def test_stack_keeps_containers_and_key_order():
    batcher = moolib.Batcher(2)
    batcher.stack({"z": Point(torch.zeros(1), [torch.ones(2)]), "a": (torch.zeros(()),)})
    # Same keys, other insertion order: matched by key.
    batcher.stack({"a": (torch.ones(()),), "z": Point(torch.ones(1), [torch.zeros(2)])})
    batch = batcher.get()
    assert list(batch) == ["z", "a"]
    assert isinstance(batch["z"], Point) and isinstance(batch["z"].y, list)
    assert isinstance(batch["a"], tuple)
    assert torch.equal(batch["z"].x, torch.tensor([[0.0], [1.0]]))
    assert torch.equal(batch["z"].y[0], torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert torch.equal(batch["a"][0], torch.tensor([0.0, 1.0]))


def test_size_one_batches_are_ready_at_once():
    batcher = moolib.Batcher(1, dim=1)
    batcher.stack(torch.arange(3))
    assert not batcher.empty()
    assert torch.equal(batcher.get(), torch.arange(3).unsqueeze(1))
    assert batcher.empty()


# -- cat ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_cat_matches_torch_cat_with_overflow(seed):
    rng = random.Random(1000 + seed)
    size = rng.randint(1, 7)
    dim = rng.randint(-3, 2)
    structure = make_structure(rng)
    specs = leaf_specs(rng, structure, min_rank=dim + 1 if dim >= 0 else -dim)
    batcher = moolib.Batcher(size, dim=dim)
    items = []
    total = 0
    for _ in range(rng.randint(1, 8)):
        length = rng.choice([0, 1, 2, 3, size, size + 1, 2 * size + rng.randint(0, size)])
        items.append(make_item(rng, structure, specs, batch_dim=dim, length=length))
        batcher.cat(items[-1])
        total += length
        # A batch is ready as soon as an item completes it (none is taken yet).
        assert batcher.empty() == (total < size)
    batches = drain(batcher)
    assert len(batches) == total // size
    everything = torch_cat(items, dim)
    for k, batch in enumerate(batches):
        assert_nest_equal(batch, torch_narrow(everything, dim, k * size, size))
    # The overflow is carried: completing the batch yields exactly the rest, then the filler.
    rest = total % size
    filler = make_item(rng, structure, specs, batch_dim=dim, length=size - rest)
    batcher.cat(filler)
    assert_nest_equal(
        batcher.get(timeout=0),
        torch_cat([torch_narrow(everything, dim, total - rest, rest), filler], dim),
    )
    assert batcher.empty()


def test_cat_carries_overflow_into_the_next_batch():
    batcher = moolib.Batcher(4)
    batcher.cat(torch.arange(3))
    assert batcher.empty()
    batcher.cat(torch.arange(3, 6))  # 6 in: one batch, 2 carried
    assert torch.equal(batcher.get(), torch.arange(4))
    assert batcher.empty()
    batcher.cat(torch.arange(6, 8))
    assert torch.equal(batcher.get(), torch.arange(4, 8))
    assert batcher.empty()


def test_cat_item_spanning_several_batches():
    batcher = moolib.Batcher(4, dim=1)
    data = {"x": torch.arange(2 * 15).reshape(2, 15), "y": [torch.arange(15.0)[None].repeat(3, 1)]}
    batcher.cat(data)
    batches = drain(batcher)
    assert len(batches) == 3  # 12 of 15; 3 carried
    for k, batch in enumerate(batches):
        assert torch.equal(batch["x"], data["x"][:, 4 * k : 4 * k + 4])
        assert torch.equal(batch["y"][0], data["y"][0][:, 4 * k : 4 * k + 4])
    batcher.cat({"x": torch.full((2, 1), -1), "y": [torch.full((3, 1), -1.0)]})
    batch = batcher.get(timeout=0)
    assert torch.equal(batch["x"], torch.cat([data["x"][:, 12:], torch.full((2, 1), -1)], 1))
    assert torch.equal(
        batch["y"][0], torch.cat([data["y"][0][:, 12:], torch.full((3, 1), -1.0)], 1)
    )


def test_cat_exact_multiple_leaves_nothing_behind():
    batcher = moolib.Batcher(3)
    batcher.cat(torch.arange(9))
    assert [b.tolist() for b in drain(batcher)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    # Nothing carried: the next batch may even be a stack batch.
    for i in range(3):
        batcher.stack(torch.tensor(i))
    assert batcher.get().tolist() == [0, 1, 2]


# -- batches are independent ----------------------------------------------------------


@pytest.mark.parametrize("op", ["stack", "cat"])
def test_returned_batch_is_not_overwritten(op):
    batcher = moolib.Batcher(2)
    add = getattr(batcher, op)
    shape = (3,) if op == "stack" else (1, 3)
    item = torch.zeros(shape)
    add(item)
    add(item + 1)
    first = batcher.get()
    kept = first.clone()
    item.fill_(7)  # items are copied, not referenced
    for value in range(5, 11):
        add(torch.full(shape, float(value)))
    later = drain(batcher)
    assert len(later) == 3
    assert torch.equal(first, kept)
    ptrs = {first.data_ptr()} | {b.data_ptr() for b in later}
    assert len(ptrs) == 4


def test_batches_are_detached():
    batcher = moolib.Batcher(2)
    w = torch.ones(3, requires_grad=True)
    batcher.stack(w * 2)
    batcher.stack(w * 3)
    batch = batcher.get()
    assert not batch.requires_grad and batch.grad_fn is None
    assert torch.equal(batch, torch.tensor([[2.0] * 3, [3.0] * 3]))


# -- consumers: threads and asyncio ------------------------------------------------------


def test_get_blocks_until_another_thread_completes_a_batch(watchdog):
    batcher = moolib.Batcher(3)
    got = []
    started = threading.Event()

    def consumer():
        started.set()
        got.append(batcher.get())

    t = threading.Thread(target=consumer)
    t.start()
    assert started.wait(DEADLINE)
    for i in range(3):
        batcher.stack(torch.tensor(i))
    t.join(DEADLINE)
    assert not t.is_alive()
    assert got[0].tolist() == [0, 1, 2]
    assert batcher.empty()


def test_producer_and_consumer_threads_keep_order(watchdog):
    batcher = moolib.Batcher(5)
    n_batches = 200
    errors = []

    def producer():
        try:
            for k in range(n_batches):
                values = torch.arange(5 * k, 5 * k + 5)
                if k % 2:  # a stack batch
                    for v in values:
                        batcher.stack(v)
                else:  # a cat batch, in two pieces
                    batcher.cat(values[:2])
                    batcher.cat(values[2:])
        except Exception as e:  # reported below
            errors.append(e)

    t = threading.Thread(target=producer)
    t.start()
    seen = []
    for _ in range(n_batches):
        seen.extend(batcher.get(timeout=DEADLINE).tolist())
    t.join(DEADLINE)
    assert not errors
    assert seen == list(range(n_batches * 5))


def test_many_consumer_threads_each_get_distinct_batches(watchdog):
    batcher = moolib.Batcher(2)
    n_threads, per_thread = 4, 25
    results = [[] for _ in range(n_threads)]

    def consumer(k):
        for _ in range(per_thread):
            results[k].append(batcher.get(timeout=DEADLINE))

    threads = [threading.Thread(target=consumer, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    batcher.cat(torch.arange(2 * n_threads * per_thread))
    for t in threads:
        t.join(DEADLINE)
        assert not t.is_alive()
    values = sorted(v for r in results for b in r for v in b.tolist())
    assert values == list(range(2 * n_threads * per_thread))
    assert batcher.empty()


def test_get_timeout():
    batcher = moolib.Batcher(2)
    with pytest.raises(TimeoutError):
        batcher.get(timeout=0)
    with pytest.raises(TimeoutError):
        batcher.get(timeout=0.05)
    # The timed-out waiter left the line: the next batch is ready for anyone.
    batcher.cat(torch.arange(2))
    assert not batcher.empty()
    assert batcher.get(timeout=0).tolist() == [0, 1]


def test_await_from_asyncio(watchdog):
    async def main():
        batcher = moolib.Batcher(2)
        # Completed from another thread while the loop waits.
        timer = threading.Timer(0.05, lambda: batcher.cat(torch.arange(4)))
        timer.start()
        first = await asyncio.wait_for(batcher, DEADLINE)
        second = await batcher  # already ready
        timer.join()

        # Completed from a task on the same loop: the loop is not blocked.
        async def produce():
            await asyncio.sleep(0.01)
            batcher.stack(torch.tensor(10))
            await asyncio.sleep(0.01)
            batcher.stack(torch.tensor(11))

        task = asyncio.create_task(produce())
        third = await asyncio.wait_for(batcher, DEADLINE)
        await task
        return first, second, third

    first, second, third = asyncio.run(main())
    assert first.tolist() == [0, 1]
    assert second.tolist() == [2, 3]
    assert third.tolist() == [10, 11]


def test_cancelled_await_loses_no_batch(watchdog):
    async def main():
        batcher = moolib.Batcher(1)
        task = asyncio.create_task(_await(batcher))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        batcher.stack(torch.tensor(5))
        return batcher

    async def _await(b):
        return await b

    batcher = asyncio.run(main())
    assert batcher.get(timeout=0).tolist() == [5]


@pytest.mark.parametrize("resolved_first", [False, True])
def test_await_cancelled_as_its_batch_arrives_gives_it_back(resolved_first, watchdog):
    async def main():
        batcher = moolib.Batcher(1)
        task = asyncio.create_task(_await(batcher))
        await asyncio.sleep(0.01)  # the task is in line
        batcher.stack(torch.tensor(1))  # handed to the task, delivered on the loop
        if resolved_first:
            await asyncio.sleep(0)  # the delivery runs; the task has not resumed yet
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)
        assert task.cancelled()
        return batcher

    async def _await(b):
        return await b

    batcher = asyncio.run(main())
    assert batcher.get(timeout=0).tolist() == [1]


def test_waiters_are_served_in_order_across_get_and_await(watchdog):
    batcher = moolib.Batcher(1)
    got = {}
    waiting = threading.Event()

    def thread_consumer():
        waiting.set()
        got["thread"] = batcher.get(timeout=DEADLINE)

    async def main():
        t = threading.Thread(target=thread_consumer)
        t.start()
        assert waiting.wait(DEADLINE)
        # Make sure the thread is in line before the coroutine.
        loop = asyncio.get_running_loop()
        for _ in range(1000):
            with batcher._lock:
                if batcher._waiters:
                    break
            await asyncio.sleep(0.005)
        fut = asyncio.ensure_future(_await(batcher))
        await asyncio.sleep(0.01)
        await loop.run_in_executor(None, batcher.cat, torch.arange(2))
        got["await"] = await asyncio.wait_for(fut, DEADLINE)
        t.join(DEADLINE)

    async def _await(b):
        return await b

    asyncio.run(main())
    assert got["thread"].tolist() == [0]
    assert got["await"].tolist() == [1]


# -- devices -------------------------------------------------------------------------


def test_device_arguments():
    for device in ["cpu", torch.device("cpu")]:
        batcher = moolib.Batcher(1, device=device)
        batcher.stack(torch.ones(2))
        assert batcher.get().device.type == "cpu"
    with pytest.raises(ValueError, match="invalid device"):
        moolib.Batcher(2, device="nonsense")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_requested_but_absent(device):
    with pytest.raises(ValueError, match="CUDA is not available"):
        moolib.Batcher(2, device=device)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches():
    batcher = moolib.Batcher(3, device="cuda", dim=-1)
    items = [{"a": torch.randn(2, 5), "b": torch.randn(4).cuda()} for _ in range(3)]
    for item in items:
        batcher.stack(item)
    batch = batcher.get()
    assert batch["a"].is_cuda and batch["b"].is_cuda
    assert torch.equal(batch["a"].cpu(), torch.stack([i["a"] for i in items], -1))
    assert torch.equal(batch["b"].cpu(), torch.stack([i["b"].cpu() for i in items], -1))
    batcher = moolib.Batcher(4, device=torch.device("cuda"))
    batcher.cat(torch.arange(10))
    assert [b.cpu().tolist() for b in drain(batcher)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    count = torch.cuda.device_count()
    with pytest.raises(ValueError, match="CUDA device"):
        moolib.Batcher(2, device=f"cuda:{count}")


# -- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, -1])
def test_bad_size_value(size):
    with pytest.raises(ValueError, match="size must be at least 1"):
        moolib.Batcher(size)


@pytest.mark.parametrize("value", ["3", 2.0, None, True])
def test_bad_size_and_dim_types(value):
    with pytest.raises(TypeError, match="size must be an int"):
        moolib.Batcher(value)
    with pytest.raises(TypeError, match="dim must be an int"):
        moolib.Batcher(2, dim=value)


def test_numpy_ints_are_accepted_as_size_and_dim():
    batcher = moolib.Batcher(np.int64(2), dim=np.int32(-1))
    assert batcher.size() == 2 and isinstance(batcher.size(), int)


def check_still_usable(batcher, op, good_items, expected):
    """After a rejected item, the batch in progress completes with the good items."""
    for item in good_items:
        getattr(batcher, op)(item)
    assert_nest_equal(batcher.get(timeout=0), expected)
    assert batcher.empty()


def test_stack_dim_out_of_range():
    batcher = moolib.Batcher(2, dim=2)
    with pytest.raises(ValueError, match=r"dim 2 is out of range for the 0-d leaf at item\['a'\]"):
        batcher.stack({"a": torch.tensor(1.0), "b": torch.zeros(2, 2)})
    batcher = moolib.Batcher(2, dim=-3)
    with pytest.raises(ValueError, match=r"dim -3 .* 1-d leaf at item\[1\]"):
        batcher.stack([torch.zeros(2, 2), torch.zeros(2)])
    # Nothing was started: a valid item starts the batch.
    items = [[torch.zeros(2, 2), torch.zeros(2, 3)], [torch.ones(2, 2), torch.ones(2, 3)]]
    check_still_usable(batcher, "stack", items, torch_stack(items, -3))


def test_cat_dim_out_of_range_and_0d():
    batcher = moolib.Batcher(2, dim=1)
    with pytest.raises(ValueError, match=r"dim 1 is out of range for the 1-d leaf at item"):
        batcher.cat(torch.zeros(3))
    with pytest.raises(ValueError, match=r"0-d .*use stack"):
        moolib.Batcher(2, dim=-1).cat({"x": torch.tensor(3)})


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"b": torch.zeros(3), "c": [torch.zeros(2)]}, r"missing: 'a'; extra: 'b'"),
        ({"a": torch.zeros(3), "c": torch.zeros(2)}, r"at item\['c'\]: nest 0 has a list"),
        ({"a": torch.zeros(3), "c": [torch.zeros(2), torch.zeros(2)]}, r"item\['c'\].*1 elem"),
        ({"a": torch.zeros(4), "c": [torch.zeros(2)]}, r"item\['a'\] has shape \[4\]"),
        ({"a": torch.zeros(3, 1), "c": [torch.zeros(2)]}, r"item\['a'\] has shape \[3, 1\]"),
        (
            {"a": torch.zeros(3), "c": [torch.zeros(2, dtype=torch.int64)]},
            r"item\['c'\]\[0\].*int64",
        ),
        ({"a": None, "c": [torch.zeros(2)]}, r"item\['a'\] is None but a tensor"),
        ([torch.zeros(3), [torch.zeros(2)]], r"nest 0 has a dict, nest 1 has a list"),
    ],
)
def test_stack_mismatch_names_the_leaf_and_keeps_the_batch(bad, message):
    batcher = moolib.Batcher(3)
    good = [{"a": torch.full((3,), float(i)), "c": [torch.full((2,), -float(i))]} for i in range(3)]
    batcher.stack(good[0])
    with pytest.raises(ValueError, match=message):
        batcher.stack(bad)
    check_still_usable(batcher, "stack", good[1:], torch_stack(good, 0))


def test_stack_none_leaf_mismatch():
    batcher = moolib.Batcher(2)
    batcher.stack({"a": None, "b": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"item\['a'\] is a tensor but None"):
        batcher.stack({"a": torch.zeros(1), "b": torch.zeros(1)})
    batcher.stack({"a": None, "b": torch.ones(1)})
    assert_nest_equal(batcher.get(), {"a": None, "b": torch.tensor([[0.0], [1.0]])})


@pytest.mark.parametrize(
    "bad, message",
    [
        (
            {"a": torch.zeros(2, 4), "b": torch.zeros(2)},
            r"item\['a'\] has shape \[2, 4\].*\['\*', 3\]",
        ),
        ({"a": torch.zeros(2, 3), "b": torch.zeros(2, 1)}, r"item\['b'\] has shape \[2, 1\]"),
        ({"a": torch.zeros(2, 3, dtype=torch.float64), "b": torch.zeros(2)}, r"float64"),
        (
            {"a": torch.zeros(2, 3), "b": torch.zeros(5)},
            r"same length .*\['a'\] has 2, .*\['b'\] has 5",
        ),
        ({"a": torch.zeros(2, 3)}, r"missing: 'b'"),
    ],
)
def test_cat_mismatch_names_the_leaf_and_keeps_the_batch(bad, message):
    batcher = moolib.Batcher(5)
    good = [{"a": torch.randn(n, 3), "b": torch.randn(n)} for n in (2, 3)]
    batcher.cat(good[0])
    with pytest.raises(ValueError, match=message):
        batcher.cat(bad)
    check_still_usable(batcher, "cat", good[1:], torch_cat(good, 0))


def test_cat_lengths_must_agree_within_the_first_item():
    batcher = moolib.Batcher(4)
    with pytest.raises(ValueError, match="same length"):
        batcher.cat([torch.zeros(2), torch.zeros(3)])
    assert batcher.empty()
    batcher.cat([torch.zeros(4), torch.ones(4)])
    assert_nest_equal(batcher.get(), [torch.zeros(4), torch.ones(4)])


def test_mixing_stack_and_cat_in_one_batch():
    batcher = moolib.Batcher(3)
    batcher.stack(torch.zeros(2))
    with pytest.raises(RuntimeError, match="cannot mix cat and stack"):
        batcher.cat(torch.zeros(1, 2))
    batcher.stack(torch.ones(2))
    batcher.stack(torch.ones(2) * 2)
    assert batcher.get().tolist() == [[0, 0], [1, 1], [2, 2]]

    batcher.cat(torch.zeros(1, 2))
    with pytest.raises(RuntimeError, match="cannot mix cat and stack"):
        batcher.stack(torch.zeros(2))
    batcher.cat(torch.ones(2, 2))
    assert batcher.get().tolist() == [[0, 0], [1, 1], [1, 1]]


def test_bad_leaf_types():
    batcher = moolib.Batcher(2)
    with pytest.raises(TypeError, match=r"leaf at item\['x'\] must be a tensor.*got str"):
        batcher.stack({"x": "text"})
    with pytest.raises(
        TypeError, match=r"leaf at item\[0\] must be a tensor, array or None.*float"
    ):
        batcher.cat([1.0])
    with pytest.raises(ValueError, match="no tensor to concatenate"):
        batcher.cat({"x": None})
    assert batcher.empty()


def test_concurrent_producers_never_tear_items(watchdog):
    batcher = moolib.Batcher(10)
    n_threads, per_thread = 4, 50
    errors = []

    def producer(k):
        try:
            for i in range(per_thread):
                v = float(k * per_thread + i)
                batcher.stack({"row": torch.full((64,), v), "id": torch.tensor(v)})
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=producer, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    batches = [batcher.get(timeout=DEADLINE) for _ in range(n_threads * per_thread // 10)]
    for t in threads:
        t.join(DEADLINE)
    assert not errors
    ids = []
    for batch in batches:
        # Each slot holds one whole item.
        assert torch.equal(batch["row"], batch["id"][:, None].expand(10, 64))
        ids.extend(batch["id"].tolist())
    assert sorted(ids) == [float(v) for v in range(n_threads * per_thread)]
    assert batcher.empty()


def test_exported():
    assert "Batcher" in moolib.__all__
    assert moolib.Batcher is moolib.batcher.Batcher
