import collections
import random

import numpy as np
import pytest
import torch

from moolib import nest

Point = collections.namedtuple("Point", ["x", "y"])


def make_structure(rng, depth=0):
    """A random nest of placeholder ints, to be filled with tensors per test."""
    if depth >= 3 or rng.random() < 0.3:
        return 0
    kind = rng.choice(["dict", "list", "tuple"])
    n = rng.randint(1, 3)
    children = [make_structure(rng, depth + 1) for _ in range(n)]
    if kind == "dict":
        keys = rng.sample(["b", "a", "obs", "z", "done"], n)
        return dict(zip(keys, children, strict=True))
    return children if kind == "list" else tuple(children)


def fill(structure, make_leaf):
    return nest.pack_as(structure, [make_leaf(i) for i in range(len(nest.flatten(structure)))])


def test_flatten_and_pack_as():
    n = {"b": [1, (2, 3)], "a": None, "c": {"y": 4, "x": Point(5, 6)}, "d": []}
    flat = nest.flatten(n)
    # Dicts are visited in sorted key order, whatever their insertion order.
    assert flat == [None, 1, 2, 3, 5, 6, 4]
    packed = nest.pack_as(n, [str(v) for v in flat])
    assert packed == {
        "b": ["1", ("2", "3")],
        "a": "None",
        "c": {"y": "4", "x": Point("5", "6")},
        "d": [],
    }
    assert list(packed) == ["b", "a", "c", "d"]
    assert list(packed["c"]) == ["y", "x"]
    assert type(packed["c"]["x"]) is Point


def test_flatten_leaf_and_strings():
    assert nest.flatten(5) == [5]
    assert nest.flatten("abc") == ["abc"]
    assert nest.flatten(None) == [None]
    assert nest.pack_as(5, ["x"]) == "x"


def test_pack_as_preserves_dict_subclasses():
    d = collections.defaultdict(list, {"b": 1, "a": 2})
    o = collections.OrderedDict([("z", 1), ("y", 2)])
    out = nest.pack_as([d, o], [10, 20, 30, 40])
    assert type(out[0]) is collections.defaultdict and out[0].default_factory is list
    assert out[0] == {"a": 10, "b": 20}
    assert type(out[1]) is collections.OrderedDict and list(out[1].items()) == [
        ("z", 40),
        ("y", 30),
    ]


def test_pack_as_wrong_count():
    with pytest.raises(ValueError, match="3 leaves but 2"):
        nest.pack_as([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="3 leaves but 4"):
        nest.pack_as([1, 2, 3], [1, 2, 3, 4])


def test_unsortable_keys_use_insertion_order():
    d = {1: "a", "x": "b"}
    assert nest.flatten(d) == ["a", "b"]
    assert nest.map_structure(str.upper, d) == {1: "A", "x": "B"}


def test_map_structure():
    a = {"x": [1, 2], "y": (3, Point(4, 5))}
    b = {"y": (30, Point(40, 50)), "x": [10, 20]}
    out = nest.map_structure(lambda p, q: p + q, a, b)
    assert out == {"x": [11, 22], "y": (33, Point(44, 55))}
    assert type(out["y"][1]) is Point
    assert nest.map_structure(lambda v: v * 2, 3) == 6
    assert nest.map_structure(lambda *v: sum(v), [1], [2], [3]) == [6]


@pytest.mark.parametrize(
    "a, b, match",
    [
        ({"x": 1}, {"y": 1}, r"at nest: .*missing: 'x'; extra: 'y'"),
        ({"x": [1, 2]}, {"x": [1]}, r"at nest\['x'\]: nest 0 has 2 elements, nest 1 has 1"),
        ([1, (2,)], [1, [2]], r"at nest\[1\]: nest 0 has a tuple, nest 1 has a list"),
        ({"x": {"y": 1}}, {"x": {"y": [1]}}, r"at nest\['x'\]\['y'\]: .*leaf.*list"),
        (1, {"a": 1}, r"at nest: nest 0 has a leaf, nest 1 has a dict"),
    ],
)
def test_map_structure_mismatch(a, b, match):
    with pytest.raises(ValueError, match=match):
        nest.map_structure(lambda *v: v, a, b)


def test_map_structure_mismatch_names_which_nest():
    with pytest.raises(ValueError, match="nest 2"):
        nest.map_structure(lambda *v: v, [1], [1], [1, 2])


def assert_nest_equal(actual, expected):
    nest.map_structure(lambda *_: None, actual, expected)  # raises on structure mismatch
    for x, y in zip(nest.flatten(actual), nest.flatten(expected), strict=True):
        if isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor)
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y)
        else:
            assert x is y or x == y


@pytest.mark.parametrize("seed", range(20))
def test_stack_matches_torch(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    structure = make_structure(rng)
    ndims = [rng.randint(0, 3) for _ in nest.flatten(structure)]
    shapes = [tuple(rng.randint(0, 4) for _ in range(d)) for d in ndims]
    count = rng.randint(1, 4)
    nests = [fill(structure, lambda i: torch.randn(shapes[i])) for _ in range(count)]
    # Every dim (negative ones included) that is valid for all leaves at once.
    lowest = min(ndims)
    for dim in range(-(lowest + 1), lowest + 1):
        out = nest.stack(nests, dim)
        expected = [
            torch.stack([nest.flatten(n)[i] for n in nests], dim) for i in range(len(ndims))
        ]
        assert_nest_equal(out, nest.pack_as(structure, expected))
    # Dims that are valid only for some leaves, checked leaf by leaf.
    for i, d in enumerate(ndims):
        leaves = [nest.flatten(n)[i] for n in nests]
        for dim in range(-(d + 1), d + 1):
            assert torch.equal(nest.stack(leaves, dim), torch.stack(leaves, dim))


@pytest.mark.parametrize("seed", range(20))
def test_cat_and_split_match_torch(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    structure = make_structure(rng)
    num_leaves = len(nest.flatten(structure))
    ndim = rng.randint(1, 4)
    dim = rng.randint(-ndim, ndim - 1)
    count = rng.randint(1, 4)
    sizes = [rng.randint(0, 3) for _ in range(count)]
    # Every leaf has its own shape except along the cat dimension.
    base_shapes = [[rng.randint(1, 3) for _ in range(ndim)] for _ in range(num_leaves)]

    def shape_for(i, size):
        s = list(base_shapes[i])
        s[dim] = size
        return s

    nests = [
        fill(structure, lambda i, size=size: torch.randn(shape_for(i, size))) for size in sizes
    ]
    out = nest.cat(nests, dim)
    expected = [torch.cat([nest.flatten(n)[i] for n in nests], dim) for i in range(num_leaves)]
    assert_nest_equal(out, nest.pack_as(structure, expected))

    pieces = nest.split(out, sizes, dim)
    assert len(pieces) == count
    for piece, original in zip(pieces, nests, strict=True):
        assert_nest_equal(piece, original)
    for i, whole in enumerate(nest.flatten(out)):
        for piece, ref in zip(pieces, torch.split(whole, sizes, dim), strict=True):
            got = nest.flatten(piece)[i]
            assert torch.equal(got, ref)
            # Pieces are views into the batch, as with torch.split.
            assert got.numel() == 0 or got.data_ptr() == ref.data_ptr()


@pytest.mark.parametrize("seed", range(10))
def test_unstack_inverts_stack(seed):
    rng = random.Random(seed)
    structure = make_structure(rng)
    num_leaves = len(nest.flatten(structure))
    shapes = [tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2))) for _ in range(num_leaves)]
    n = rng.randint(1, 4)
    dim = rng.choice([0, -1])
    nests = [fill(structure, lambda i: torch.randn(shapes[i])) for _ in range(n)]
    stacked = nest.stack(nests, dim)
    parts = nest.unstack(stacked, n, dim)
    assert len(parts) == n
    for part, original in zip(parts, nests, strict=True):
        assert_nest_equal(part, original)
    for i in range(num_leaves):
        refs = torch.unbind(nest.flatten(stacked)[i], dim)
        for part, ref in zip(parts, refs, strict=True):
            assert torch.equal(nest.flatten(part)[i], ref)


def test_stack_numbers_numpy_and_none():
    nests = [
        {"r": 1.5, "d": True, "i": 3, "a": np.full((2,), k, np.int16), "none": None, "c": 1j}
        for k in range(3)
    ]
    out = nest.stack(nests)
    assert out["none"] is None
    assert out["r"].dtype == torch.float32 and out["r"].tolist() == [1.5] * 3
    assert out["d"].dtype == torch.bool and out["d"].tolist() == [True] * 3
    assert out["i"].dtype == torch.int64 and out["i"].tolist() == [3] * 3
    assert out["c"].dtype == torch.complex64
    assert out["a"].dtype == torch.int16
    assert torch.equal(out["a"], torch.tensor([[0, 0], [1, 1], [2, 2]], dtype=torch.int16))
    mixed = nest.stack([1, 2.5, np.float64(4.0)])
    assert torch.equal(mixed, torch.tensor([1.0, 2.5, 4.0]))


def test_stack_numbers_along_non_leading_dim():
    with pytest.raises(IndexError, match="at nest"):
        nest.stack([1, 2], dim=1)


def test_stack_and_cat_convert_awkward_numpy_arrays():
    readonly = np.arange(6.0).reshape(2, 3)
    readonly.flags.writeable = False
    reversed_ = np.arange(6.0).reshape(2, 3)[::-1]
    out = nest.cat([readonly, reversed_, torch.zeros(1, 3, dtype=torch.float64)])
    expected = torch.cat(
        [
            torch.tensor(readonly),
            torch.tensor(reversed_.copy()),
            torch.zeros(1, 3, dtype=torch.float64),
        ]
    )
    assert torch.equal(out, expected)
    out = nest.stack([readonly, reversed_], dim=-1)
    assert torch.equal(
        out, torch.stack([torch.tensor(readonly), torch.tensor(reversed_.copy())], -1)
    )


def test_stack_cat_errors_name_the_path():
    with pytest.raises(TypeError, match=r"leaf at nest\['x'\]\[1\] .*got str"):
        nest.stack([{"x": [1, "a"]}, {"x": [2, "b"]}])
    with pytest.raises(TypeError, match=r"cat: leaf at nest\['n'\] .*tensors or arrays"):
        nest.cat([{"n": 1}, {"n": 2}])
    with pytest.raises(TypeError, match=r"got NoneType"):
        nest.stack([[torch.zeros(1)], [None]])
    with pytest.raises(RuntimeError, match=r"stack: at nest\[0\]"):
        nest.stack([[torch.zeros(2)], [torch.zeros(3)]])
    with pytest.raises(RuntimeError, match=r"cat: at nest\['t'\]"):
        nest.cat([{"t": torch.zeros(2, 2)}, {"t": torch.zeros(2, 3)}])
    with pytest.raises(ValueError, match="structure mismatch"):
        nest.stack([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(ValueError, match="at least one"):
        nest.stack([])
    with pytest.raises(ValueError, match="at least one"):
        nest.cat([])


def test_split_replicates_non_tensor_leaves_and_splits_numpy():
    marker = object()
    batch = {"t": torch.arange(10).reshape(5, 2), "a": np.arange(5), "m": marker, "n": None}
    parts = nest.split(batch, [2, 0, 3])
    assert [p["t"].shape[0] for p in parts] == [2, 0, 3]
    assert all(p["m"] is marker and p["n"] is None for p in parts)
    assert [p["a"].tolist() for p in parts] == [[0, 1], [], [2, 3, 4]]
    assert all(isinstance(p["a"], np.ndarray) for p in parts)
    assert torch.equal(parts[2]["t"], torch.tensor([[4, 5], [6, 7], [8, 9]]))


def test_split_numpy_negative_dim():
    a = np.arange(24).reshape(2, 3, 4)
    parts = nest.split([a], [1, 3], dim=-1)
    np.testing.assert_array_equal(parts[0][0], a[:, :, :1])
    np.testing.assert_array_equal(parts[1][0], a[:, :, 1:])


def test_split_errors():
    with pytest.raises(ValueError, match=r"leaf at nest\['x'\] has size 5 along dim 0, .*sum to 4"):
        nest.split({"x": torch.zeros(5)}, [2, 2])
    with pytest.raises(ValueError, match="0-d"):
        nest.split([torch.tensor(1.0)], [1])
    with pytest.raises(IndexError, match="dim 2 out of range"):
        nest.split([torch.zeros(3, 3)], [3], dim=2)


def test_unstack_numbers_come_back_as_tensors_and_errors():
    scalars = nest.unstack(nest.stack([{"r": 1.0}, {"r": 2.0}]), 2)
    assert [type(p["r"]) for p in scalars] == [torch.Tensor] * 2
    assert [p["r"].item() for p in scalars] == [1.0, 2.0]
    batch = {"r": torch.tensor([1.0, 2.0]), "s": "keep", "a": np.arange(6).reshape(2, 3)}
    parts = nest.unstack(batch, 2)
    assert parts[1]["r"].ndim == 0 and parts[1]["r"].item() == 2.0
    assert parts[0]["s"] == "keep"
    np.testing.assert_array_equal(parts[1]["a"], [3, 4, 5])
    cols = nest.unstack(batch["a"], 3, dim=-1)
    np.testing.assert_array_equal(cols[2], [2, 5])
    with pytest.raises(ValueError, match=r"unstack: leaf at nest\['a'\] has size 2 .*expected 3"):
        nest.unstack(batch, 3)
