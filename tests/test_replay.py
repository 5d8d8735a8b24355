"""The replay table (moolib.Replay), local API: against a plain Python reference.

Sampling is seeded, so every statistical check here is deterministic: it
passes or fails the same way on every run.
"""

from __future__ import annotations

import hashlib
import math
import random
import struct
import threading
import time
from collections import OrderedDict

import numpy as np
import pytest
import torch
from helpers.util import REPO, run_script, wait_for

import moolib

REPO_DATA = REPO / "tests" / "data"


class Reference:
    """What the table should hold: key -> priority, oldest first."""

    def __init__(self, capacity: int, alpha: float) -> None:
        self.capacity = capacity
        self.alpha = alpha
        self.items: OrderedDict[int, float] = OrderedDict()
        self.next_key = 0

    def insert(self, priorities: list[float]) -> list[int]:
        keys = []
        for p in priorities:
            if len(self.items) == self.capacity:
                self.items.popitem(last=False)
            self.items[self.next_key] = p
            keys.append(self.next_key)
            self.next_key += 1
        return keys

    def update(self, keys: list[int], priorities: list[float]) -> int:
        n = 0
        for k, p in zip(keys, priorities, strict=True):
            if k in self.items:
                self.items[k] = p
                n += 1
        return n

    def probability(self, key: int) -> float:
        total = sum(p**self.alpha for p in self.items.values())
        return self.items[key] ** self.alpha / total


def item_of(keys: list[int]) -> dict:
    """Items whose bytes say which insert they came from."""
    k = torch.tensor(keys, dtype=torch.int64)
    return {"id": k, "obs": (k.float()[:, None] * 10 + torch.arange(3)).float()}


def present_keys(replay: moolib.Replay, ref: Reference, candidates: range) -> set[int]:
    """The keys the table still holds, probed with updates that change nothing."""
    present = set()
    for k in candidates:
        p = ref.items.get(k, 1.0)
        if replay.update_priorities([k], [p]) == 1:
            present.add(k)
    return present


def test_random_sequences_match_the_reference():
    rng = random.Random(7)
    for alpha in (0.6, 1.0):
        replay = moolib.Replay(50, selector="prioritized", alpha=alpha, seed=3)
        ref = Reference(50, alpha)
        for _step in range(200):
            op = rng.random()
            if op < 0.4:
                # Now and then a batch wraps the ring, or exceeds the capacity.
                n = rng.randint(1, 12) if rng.random() < 0.9 else rng.randint(30, 120)
                prios = [rng.choice([0.0, rng.uniform(0.01, 5.0)]) for _ in range(n)]
                expected = ref.insert(prios)
                keys = replay.insert(item_of(expected), torch.tensor(prios, dtype=torch.float64))
                assert keys.tolist() == expected
            elif op < 0.7 and any(p > 0 for p in ref.items.values()):
                s = replay.sample(rng.randint(1, 16))
                assert s.size == len(ref.items)
                for k, p, ident, obs in zip(
                    s.keys.tolist(),
                    s.probabilities.tolist(),
                    s.items["id"],
                    s.items["obs"],
                    strict=True,
                ):
                    assert k in ref.items
                    assert p == pytest.approx(ref.probability(k), rel=1e-9)
                    assert ident.item() == k
                    assert obs.tolist() == [k * 10.0, k * 10.0 + 1, k * 10.0 + 2]
            else:
                keys = [rng.randrange(max(1, ref.next_key)) for _ in range(rng.randint(1, 8))]
                prios = [rng.uniform(0.0, 3.0) for _ in keys]
                # A key may appear twice in one update: the last value wins in both.
                assert replay.update_priorities(keys, prios) == ref.update(keys, prios)
            assert replay.size() == len(ref.items)
            mass = sum(p**alpha for p in ref.items.values())
            assert replay.info()["priority_mass"] == pytest.approx(mass, rel=1e-9, abs=1e-12)
        # Eviction is oldest first: exactly the reference's keys are left.
        assert present_keys(replay, ref, range(ref.next_key)) == set(ref.items)


def test_prioritized_frequencies_follow_priorities_deterministically():
    priorities = [1.0, 2.0, 3.0, 4.0, 10.0, 0.0, 5.0]
    counts = np.zeros(len(priorities))
    draws = []
    for _attempt in range(2):
        replay = moolib.Replay(100, alpha=0.5, seed=1234)
        replay.insert({"x": torch.arange(len(priorities))}, priorities)
        keys = torch.cat([replay.sample(1000).keys for _ in range(100)])
        draws.append(keys)
    # The same seed and calls give the same draws.
    assert torch.equal(draws[0], draws[1])
    counts = np.bincount(draws[0].numpy(), minlength=len(priorities))
    weights = np.array(priorities) ** 0.5
    expected = weights / weights.sum() * len(draws[0])
    assert counts[5] == 0  # priority 0 is never drawn
    live = expected > 0
    chi2 = (((counts - expected) ** 2)[live] / expected[live]).sum()
    # 5 degrees of freedom: the 0.999 quantile is 20.5. The seed is fixed, so
    # this is not a flaky check: it fails only if the sampler is biased.
    assert chi2 < 20.5, (counts, expected)


def test_uniform_draws_each_live_item_equally():
    replay = moolib.Replay(8, selector="uniform", seed=5)
    replay.insert({"x": torch.arange(12)})  # keys 0..3 are evicted
    s = replay.sample(40_000)
    assert s.probabilities.eq(1 / 8).all()
    assert s.size == 8
    counts = np.bincount(s.keys.numpy(), minlength=12)
    assert counts[:4].sum() == 0
    assert torch.equal(s.items["x"], s.keys)
    chi2 = ((counts[4:] - 5000) ** 2 / 5000).sum()
    assert chi2 < 24.3  # 7 degrees of freedom, 0.999 quantile


def test_fifo_returns_the_oldest_items_in_order():
    replay = moolib.Replay(5, selector="fifo")
    replay.insert({"x": torch.arange(3)})
    s = replay.sample(7)
    assert s.keys.tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert s.items["x"].tolist() == [0, 1, 2, 0, 1, 2, 0]
    assert s.probabilities.eq(1.0).all()
    replay.insert({"x": torch.arange(3, 7)})  # 0 and 1 are evicted
    assert replay.sample(replay.size()).items["x"].tolist() == [2, 3, 4, 5, 6]


def test_items_keep_every_dtype_and_shape():
    replay = moolib.Replay(10, selector="fifo")
    items = {
        "obs": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        "done": torch.tensor([True, False]),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "nested": (torch.tensor([[1, 2], [3, 4]], dtype=torch.int16), [torch.tensor([7, 8])]),
    }
    replay.insert(items)
    got = replay.sample(2).items
    assert list(got) == ["obs", "done", "half", "nested"]
    assert torch.equal(got["obs"], torch.from_numpy(items["obs"]))
    assert got["done"].dtype == torch.bool and got["done"].tolist() == [True, False]
    assert got["half"].dtype == torch.bfloat16 and got["half"].tolist() == [1.5, -2.0]
    assert isinstance(got["nested"], tuple) and isinstance(got["nested"][1], list)
    assert got["nested"][0].tolist() == [[1, 2], [3, 4]]
    assert got["nested"][1][0].tolist() == [7, 8]
    # A non-contiguous view goes in as its values.
    view = torch.arange(24, dtype=torch.float32).reshape(2, 4, 3).transpose(1, 2)
    assert not view.is_contiguous()
    replay.insert({**items, "obs": view})
    assert torch.equal(replay.sample(4).items["obs"][2:], view)
    assert replay.size() == 4


# Rate limiting.


def sampler_thread(replay, n, **kwargs):
    out = {}

    def run():
        try:
            out["sample"] = replay.sample(n, **kwargs)
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_sampling_waits_for_min_size_and_an_insert_releases_it():
    replay = moolib.Replay(100, selector="fifo", min_size=5, timeout=120)
    t, out = sampler_thread(replay, 3)
    wait_for(lambda: replay.info()["waiting_samplers"] == 1, what="the sampler waiting")
    replay.insert({"x": torch.arange(4)})
    time.sleep(0.2)
    assert t.is_alive() and replay.info()["samples"] == 0
    replay.insert({"x": torch.tensor([4])})
    t.join(60)
    assert not t.is_alive()
    assert out["sample"].items["x"].tolist() == [0, 1, 2]


def test_a_sample_timeout_says_what_it_waited_for():
    replay = moolib.Replay(100, min_size=10)
    replay.insert({"x": torch.arange(3)})
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"sample of 4 waited 0\.3 s .*3 items in the table, "
                       r"min_size 10"):  # fmt: skip
        replay.sample(4, timeout=0.3)
    assert time.monotonic() - start >= 0.29
    assert replay.info()["samples"] == 0


def limiter_allows(inserts, samples, size, spi, eb, min_size):
    """Reverb's conditions, written out: (may insert one, may sample one)."""
    diff = inserts * spi - samples
    min_diff, max_diff = spi * min_size - eb, spi * min_size + eb
    return size < min_size or diff + spi <= max_diff, size >= min_size and diff - 1 >= min_diff


def test_samples_per_insert_blocks_each_side_as_reverb_does():
    spi, eb, min_size = 2.0, 2.0, 2
    replay = moolib.Replay(100, selector="uniform", min_size=min_size, samples_per_insert=spi,
                           error_buffer=eb, seed=0)  # fmt: skip
    inserts = samples = 0
    rng = random.Random(1)
    for _ in range(300):
        may_insert, may_sample = limiter_allows(inserts, samples, inserts, spi, eb, min_size)
        if rng.random() < 0.5:
            if may_insert:
                replay.insert({"x": torch.tensor([inserts])}, timeout=5)
                inserts += 1
            else:
                with pytest.raises(TimeoutError, match="inserters are ahead of samplers"):
                    replay.insert({"x": torch.tensor([-1])}, timeout=0.01)
        else:
            if may_sample:
                replay.sample(1, timeout=5)
                samples += 1
            else:
                with pytest.raises(TimeoutError, match="min_size|samplers are ahead"):
                    replay.sample(1, timeout=0.01)
        info = replay.info()
        assert (info["inserts"], info["samples"], info["size"]) == (inserts, samples, inserts)
    assert inserts > 20 and samples > 40


def test_a_batch_larger_than_the_error_buffer_moves_item_by_item():
    replay = moolib.Replay(1000, selector="uniform", samples_per_insert=1.0, error_buffer=1.0,
                           seed=0, timeout=120)  # fmt: skip
    sampled = []
    t = threading.Thread(target=lambda: sampled.append(replay.sample(200)), daemon=True)
    t.start()
    keys = replay.insert({"x": torch.arange(200)})
    t.join(120)
    assert keys.tolist() == list(range(200)) and len(sampled[0].keys) == 200
    # A sample can only ever see items already inserted, at most 2 ahead.
    assert replay.info()["samples"] == 200


def test_an_insert_timeout_keeps_what_was_inserted_and_says_so():
    replay = moolib.Replay(100, samples_per_insert=1.0, error_buffer=1.0)
    with pytest.raises(TimeoutError, match=r"insert of 5 waited 0\.2 s \(2 inserted\)"):
        replay.insert({"x": torch.arange(5)}, timeout=0.2)
    # min_diff 0, max_diff 2: the first two fit, the third needs a sample.
    assert replay.size() == 2


def test_error_buffer_must_let_both_sides_move():
    with pytest.raises(ValueError, match="error_buffer 1 is too small for samples_per_insert 4"):
        moolib.Replay(100, samples_per_insert=4.0, error_buffer=1.0)
    with pytest.raises(ValueError, match="error_buffer needs samples_per_insert"):
        moolib.Replay(100, error_buffer=10.0)
    with pytest.raises(ValueError, match="samples_per_insert must be positive"):
        moolib.Replay(100, samples_per_insert=0.0)


def test_close_wakes_every_waiter():
    replay = moolib.Replay(100, min_size=10, samples_per_insert=1.0, error_buffer=1.0,
                           timeout=300)  # fmt: skip
    samplers = [sampler_thread(replay, 4) for _ in range(3)]
    wait_for(lambda: replay.info()["waiting_samplers"] == 3, what="3 waiting samplers")
    start = time.monotonic()
    replay.close()
    for t, out in samplers:
        t.join(60)
        assert isinstance(out["error"], RuntimeError)
        assert "closed" in str(out["error"])
    assert time.monotonic() - start < 60
    with pytest.raises(RuntimeError, match="closed"):
        replay.insert({"x": torch.arange(2)})


BLOCKED_HANDLERS = """
import torch, moolib
replay = moolib.Replay(100, selector="fifo", min_size=3, timeout=300)
server = moolib.Rpc(); server.set_name("server"); server.set_timeout(300)
address = server.listen("127.0.0.1:0")
server.define("sample", lambda n: replay.sample(n).items["x"].tolist())
server.define("insert", lambda x: replay.insert({"x": x}).tolist())
client = moolib.Rpc(); client.set_timeout(300); client.connect(address)
assert client.sync("server", "insert", torch.tensor([0])) == [0]
pending = [client.async_("server", "sample", 3) for _ in range(8)]
deadline = time.monotonic() + 60
while replay.info()["waiting_samplers"] < 2 and time.monotonic() < deadline:
    time.sleep(0.01)
insert = client.async_("server", "insert", torch.tensor([1, 2]))
print("insert done:", insert.wait(30), flush=True)
print("samples done:", all(f.wait(30) for f in pending), flush=True)
print("results:", insert.result(timeout=1), pending[0].result(timeout=1), flush=True)
replay.close(); client.close(); server.close()
"""


def test_samples_blocked_in_rpc_handlers_do_not_starve_the_insert(tmp_path):
    """The waits run in the core's pool: handlers blocked in sample() must not
    hold every worker while the insert they wait for sits in the queue."""
    out = run_script("import time\n" + BLOCKED_HANDLERS, tmp_path, env={"MOOLIB_MAX_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:]
    assert "insert done: True" in out.stdout, out.stdout[-3000:]
    assert "samples done: True" in out.stdout
    assert "results: [1, 2] [0, 1, 2]" in out.stdout


# Checkpoints.


def make_atari_like(steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Consecutive stacked frames of a synthetic episode: a moving ball and
    paddle over a fixed background, (obs, next_obs) sharing 3 of 4 frames."""
    rng = np.random.default_rng(seed)
    background = rng.integers(0, 40, size=(84, 84), dtype=np.uint8)
    frames = []
    x, y, dx, dy, paddle = 40, 20, 2, 3, 30
    for _ in range(steps + 4):
        f = background.copy()
        x, y = x + dx, y + dy
        if not 2 <= x <= 80:
            dx = -dx
        if not 2 <= y <= 80:
            dy = -dy
        paddle = int(np.clip(paddle + rng.integers(-3, 4), 0, 76))
        f[y : y + 2, x : x + 2] = 200
        f[78:80, paddle : paddle + 8] = 150
        frames.append(f)
    frames = np.stack(frames)
    obs = np.stack([frames[t : t + 4] for t in range(steps)])
    next_obs = np.stack([frames[t + 1 : t + 5] for t in range(steps)])
    return obs, next_obs


def atari_items(obs, next_obs, start: int) -> dict:
    n = len(obs)
    return {
        "obs": obs,
        "next_obs": next_obs,
        "action": torch.arange(start, start + n) % 4,
        "reward": torch.arange(start, start + n, dtype=torch.float32),
        "done": torch.arange(start, start + n) % 7 == 0,
    }


@pytest.mark.parametrize("dedup", [("obs", "next_obs"), ()])
def test_checkpoint_round_trip(tmp_path, dedup):
    obs, next_obs = make_atari_like(300)
    replay = moolib.Replay(200, alpha=0.7, min_size=5, samples_per_insert=0.5, error_buffer=1000.0,
                           dedup=dedup, seed=11)  # fmt: skip
    rng = np.random.default_rng(0)
    for start in range(0, 300, 50):
        replay.insert(atari_items(obs[start : start + 50], next_obs[start : start + 50], start),
                      rng.uniform(0.1, 2, 50))  # fmt: skip
        s = replay.sample(30)
        replay.update_priorities(s.keys, rng.uniform(0, 3, 30))
    path = tmp_path / "replay.ckpt"
    replay.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["replay.ckpt"]  # no temp file left
    raw = 200 * (2 * 4 * 84 * 84 + 8 + 4 + 1)
    if dedup:
        assert path.stat().st_size < raw / 5  # frames stay shared in the file
    else:
        assert path.stat().st_size > raw
    loaded = moolib.Replay.load(path)
    a, b = replay.info(), loaded.info()
    for k in ("size", "capacity", "inserts", "samples", "evictions", "frames", "stored_bytes"):
        assert a[k] == b[k], k
    assert b["priority_mass"] == pytest.approx(a["priority_mass"], rel=1e-12)
    # The same sampler state: the same draws, items and probabilities after.
    for _ in range(3):
        x, y = replay.sample(64), loaded.sample(64)
        assert torch.equal(x.keys, y.keys)
        assert torch.equal(x.probabilities, y.probabilities)
        for k in x.items:
            assert torch.equal(x.items[k], y.items[k])
        for i, key in enumerate(y.keys.tolist()):
            assert torch.equal(y.items["obs"][i], torch.from_numpy(obs[key]))
            assert torch.equal(y.items["next_obs"][i], torch.from_numpy(next_obs[key]))
            assert y.items["reward"][i].item() == key
    # The loaded table goes on: inserts continue the counter, under the next
    # incarnation (the keys' bits above the counter); the limiter counters hold.
    keys = loaded.insert(atari_items(obs[:2], next_obs[:2], 0))
    assert keys.tolist() == [1 << 40 | 300, 1 << 40 | 301]
    assert loaded.info()["incarnation"] == 1
    # Overrides: a new seed draws differently, settings change.
    other = moolib.Replay.load(path, seed=99, alpha=1.0, timeout=5.0)
    assert other.info()["alpha"] == 1.0
    with pytest.raises(TypeError, match="cannot override capacity"):
        moolib.Replay.load(path, capacity=10)


def test_load_overrides_of_a_table_without_rate_limiting(tmp_path):
    replay = moolib.Replay(10, selector="uniform", seed=0)
    replay.insert({"x": torch.arange(4)})
    path = tmp_path / "unlimited"
    replay.save(path)
    for overrides in ({"alpha": 0.3}, {"min_size": 2}, {"seed": 5}, {"timeout": 3.0},
                      {"alpha": 1.0, "min_size": 3, "seed": 1, "timeout": 2.0}):  # fmt: skip
        loaded = moolib.Replay.load(path, **overrides)
        info = loaded.info()
        assert info["samples_per_insert"] is None and info["error_buffer"] is None, overrides
        for k in ("alpha", "min_size"):
            assert info[k] == overrides.get(k, replay.info()[k]), overrides
        # Still unlimited: samples without inserts never wait.
        for _ in range(5):
            assert loaded.sample(100, timeout=0).size == 4
    # A rate on a table saved without one: Reverb's default buffer, max(1, SPI).
    info = moolib.Replay.load(path, samples_per_insert=2.0).info()
    assert info["samples_per_insert"] == 2.0 and info["error_buffer"] == 2.0
    info = moolib.Replay.load(path, samples_per_insert=2.0, error_buffer=8.0).info()
    assert info["samples_per_insert"] == 2.0 and info["error_buffer"] == 8.0
    # A buffer without a rate: refused, saying what to pass.
    with pytest.raises(ValueError, match="error_buffer needs samples_per_insert.*without rate"):
        moolib.Replay.load(path, error_buffer=5.0)
    # A rate-limited table keeps its rate under other overrides, and loses it on request.
    limited = moolib.Replay(10, samples_per_insert=3.0, error_buffer=9.0, seed=0)
    limited.insert({"x": torch.arange(4)})
    limited.save(tmp_path / "limited")
    info = moolib.Replay.load(tmp_path / "limited", alpha=0.5).info()
    assert (info["samples_per_insert"], info["error_buffer"], info["alpha"]) == (3.0, 9.0, 0.5)
    info = moolib.Replay.load(tmp_path / "limited", error_buffer=12.0).info()
    assert (info["samples_per_insert"], info["error_buffer"]) == (3.0, 12.0)
    info = moolib.Replay.load(tmp_path / "limited", samples_per_insert=None).info()
    assert info["samples_per_insert"] is None and info["error_buffer"] is None


def test_a_loaded_table_keeps_the_items_key_order(tmp_path):
    replay = moolib.Replay(10, seed=0)
    replay.insert({"b": torch.zeros(2), "a": {"y": torch.ones(2), "x": (torch.ones(2),)}})
    items = replay.sample(1).items
    assert list(items) == ["b", "a"] and list(items["a"]) == ["y", "x"]
    replay.save(tmp_path / "r")
    loaded = moolib.Replay.load(tmp_path / "r")
    for table in (loaded, moolib.Replay.load(tmp_path / "r", seed=3)):
        items = table.sample(1).items
        assert list(items) == ["b", "a"] and list(items["a"]) == ["y", "x"]
        assert isinstance(items["a"]["x"], tuple)
    # Saved again after loading, the order survives a second round trip.
    loaded.insert({"b": torch.zeros(1), "a": {"y": torch.ones(1), "x": (torch.ones(1),)}})
    loaded.save(tmp_path / "again")
    items = moolib.Replay.load(tmp_path / "again").sample(1).items
    assert list(items) == ["b", "a"] and list(items["a"]) == ["y", "x"]
    # A layout written before the order was kept loads with sorted keys; an
    # order that does not match the layout is refused.
    layout = loaded.schema.to_json()
    older = moolib.replay.schema.Schema.from_json({k: v for k, v in layout.items() if k != "order"})
    assert list(older.structure) == ["a", "b"]
    with pytest.raises(ValueError, match="key order does not match its layout"):
        moolib.replay.schema.Schema.from_json({**layout, "order": {"d": [["b", None]]}})


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    replay = moolib.Replay(100, dedup=("obs",), seed=1)
    replay.insert({"obs": torch.arange(2 * 3 * 8, dtype=torch.uint8).reshape(2, 3, 8)})
    path = tmp_path / "r.ckpt"
    replay.save(path)
    data = path.read_bytes()
    for name, damaged in [
        ("truncated", data[: len(data) // 2]),
        ("flipped", data[:100] + bytes([data[100] ^ 1]) + data[101:]),
        ("empty", b""),
        ("tail", data[:-1]),
    ]:
        bad = tmp_path / f"{name}.ckpt"
        bad.write_bytes(damaged)
        with pytest.raises(ValueError, match=f"replay checkpoint .*{name}.ckpt"):
            moolib.Replay.load(bad)
    (tmp_path / "other").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="not a moolib replay checkpoint"):
        moolib.Replay.load(tmp_path / "other")
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        moolib.Replay.load(tmp_path / "missing.ckpt")
    assert moolib.Replay.load(path).size() == 2


def with_digest(payload: bytes) -> bytes:
    return payload + hashlib.sha256(payload).digest()


def test_forged_checkpoints_with_valid_checksums_are_refused_not_trusted(tmp_path):
    """The checksum catches accidents; a file forged with a valid one must
    still be bounds-checked everywhere: refused with an error, never a crash
    or an allocation of what it claims."""
    replay = moolib.Replay(16, selector="uniform", dedup=("obs",), seed=1)
    replay.insert(
        {"obs": torch.arange(4 * 2 * 8, dtype=torch.uint8).reshape(4, 2, 8), "r": torch.ones(4)}
    )
    path = tmp_path / "good.ckpt"
    replay.save(path)
    payload = path.read_bytes()[:-32]
    header = 100  # magic, version, config and counters: checked field by field below
    rng = random.Random(0)
    outcomes = {"refused": 0, "loaded": 0}
    bad = tmp_path / "forged.ckpt"
    for i in range(300):
        data = bytearray(payload)
        if i % 3 == 0:
            data = data[: rng.randrange(header, len(data))]
        else:
            pos = rng.randrange(header, len(data))
            data[pos] = rng.choice([0, 1, 0x7F, 0xFF, data[pos] ^ (1 << rng.randrange(8))])
        bad.write_bytes(with_digest(bytes(data)))
        try:
            loaded = moolib.Replay.load(bad)
        except ValueError as e:
            assert "forged.ckpt" in str(e)
            outcomes["refused"] += 1
            continue
        outcomes["loaded"] += 1  # a changed byte of an item or the random state
        if loaded.size():
            assert len(loaded.sample(3, timeout=1).keys) == 3
    assert outcomes["refused"] > 100, outcomes

    def forged_header(fmt_offset: int, value: int, fmt: str = "<q") -> bytes:
        data = bytearray(payload)
        struct.pack_into(fmt, data, fmt_offset, value)
        return with_digest(bytes(data))

    for offset, value, fmt, message in [
        (16, 1 << 50, "<q", "capacity"),  # capacity
        (16, 0, "<q", "capacity must be positive"),
        (24, 7, "<i", "unknown selector"),
        (60, 5, "<q", "bad item range"),  # head past tail
        (68, 1 << 40, "<q", "bad item range"),  # tail
    ]:
        bad.write_bytes(forged_header(offset, value, fmt))
        with pytest.raises(ValueError, match=f"forged.ckpt is corrupt: .*{message}"):
            moolib.Replay.load(bad)


def test_an_empty_table_round_trips(tmp_path):
    replay = moolib.Replay(10, selector="uniform", dedup=("obs",), timeout=7.0)
    replay.save(tmp_path / "e")
    loaded = moolib.Replay.load(tmp_path / "e")
    assert loaded.size() == 0 and loaded.info()["dedup"] == ["obs"]
    loaded.insert({"obs": torch.zeros(3, 2, 4)})
    assert loaded.info()["frames"] == 1


def _table_of_a_fixed_history(selector: str, dedup: tuple[str, ...], seed: int) -> moolib.Replay:
    """The table tests/data/replay-format2-*.ckpt were saved from (2026-12-03, before
    the core's replay was split into parts): inserts, samples and priority updates."""
    replay = moolib.Replay(
        64,
        selector=selector,
        alpha=0.7,
        min_size=3,
        samples_per_insert=0.5,
        error_buffer=1000.0,
        dedup=dedup,
        seed=seed,
    )
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 255, size=(40, 8, 8), dtype=np.uint8)
    for start in range(0, 150, 10):
        index = np.arange(start, start + 10) % 37
        obs = torch.from_numpy(np.stack([frames[index + k] for k in range(2)], 1))
        next_obs = torch.from_numpy(np.stack([frames[index + k + 1] for k in range(2)], 1))
        reward = torch.arange(start, start + 10).float()
        replay.insert({"obs": obs, "next_obs": next_obs, "reward": reward}, rng.uniform(0.1, 2, 10))
        sample = replay.sample(7)
        replay.update_priorities(sample.keys, rng.uniform(0, 3, 7))
    return replay


@pytest.mark.parametrize(
    "name, selector, dedup, seed, sampled",
    [
        (
            "prioritized-dedup",
            "prioritized",
            ("obs", "next_obs"),
            5,
            "9a7d69dad55d3abbbc827892872171c20b75e5699fce8451084d4d86dae3f572",
        ),
        (
            "fifo-dense",
            "fifo",
            (),
            10,
            "a1830f33ebb75223c8bfc53f3b49a11eb483b0c49937e7e48975139adc20ae30",
        ),
    ],
)
def test_checkpoints_of_format_2_load_and_are_written_byte_for_byte(
    tmp_path, name, selector, dedup, seed, sampled
):
    """A user's saved tables outlive the code that wrote them: a file written by an
    earlier build loads, and samples the same items with the same probabilities, and
    the same history saved now gives the same bytes (a change of format bumps the
    version, and these files must still load)."""
    old = tmp_path / "old.ckpt"
    old.write_bytes((REPO_DATA / f"replay-format2-{name}.ckpt").read_bytes())
    _table_of_a_fixed_history(selector, dedup, seed).save(tmp_path / "new.ckpt")
    assert (tmp_path / "new.ckpt").read_bytes() == old.read_bytes()
    loaded = moolib.Replay.load(old)
    info = loaded.info()
    assert (info["size"], info["inserts"], info["samples"], info["evictions"]) == (64, 150, 105, 86)
    assert info["incarnation"] == 1 and info["dedup"] == list(dedup)
    sample = loaded.sample(20)
    digest = hashlib.sha256(
        sample.keys.numpy().tobytes()
        + sample.probabilities.numpy().tobytes()
        + b"".join(v.numpy().tobytes() for v in sample.items.values())
    )
    assert digest.hexdigest() == sampled


# Errors: precise, and nothing changes.


def test_errors_name_what_is_wrong_and_change_nothing():
    replay = moolib.Replay(10)
    good = {"obs": torch.zeros(4, 3), "action": torch.zeros(4, dtype=torch.int64)}
    replay.insert(good)
    before = replay.info()
    bad_items = [
        ({"obs": torch.zeros(4, 3)}, r"table's: missing leaves \['action'\] \(the table"),
        ({**good, "extra": torch.zeros(4)}, r"table's: unexpected leaves \['extra'\] \(the"),
        ({**good, "obs": torch.zeros(4, 3, dtype=torch.float64)},
         r"leaf obs has dtype torch.float64; the table stores torch.float32"),
        ({**good, "obs": torch.zeros(4, 5)},
         r"leaf obs has item shape \(5,\); the table stores \(3,\)"),
        ({**good, "action": torch.zeros(3, dtype=torch.int64)},
         r"leaf obs has batch size 4; leaf action has 3"),
        ({**good, "obs": 1.0}, r"leaf obs is a float"),
        ({"obs": torch.zeros(0, 3), "action": torch.zeros(0, dtype=torch.int64)},
         r"insert of 0 items"),
    ]  # fmt: skip
    for items, message in bad_items:
        with pytest.raises((ValueError, TypeError), match=message):
            replay.insert(items)
    for bad, shown in [(float("nan"), "nan"), (-1.0, "-1"), (float("inf"), "inf")]:
        with pytest.raises(ValueError, match=f"priority at batch index 2 is {shown}"):
            replay.insert(good, [1.0, 1.0, bad, 1.0])
        with pytest.raises(ValueError, match=f"priority for key 0 is {shown}"):
            replay.update_priorities([1, 0], [2.0, bad])
    pairs = moolib.Replay(10)
    pairs.insert({"a": (torch.zeros(2),)})
    with pytest.raises(
        ValueError, match=r"other containers.*\{'a': \(\*,\)\}, given \{'a': \[\*\]\}"
    ):
        pairs.insert({"a": [torch.zeros(2)]})
    with pytest.raises(ValueError, match="3 priorities for a batch of 4"):
        replay.insert(good, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="batch_size must be positive"):
        replay.sample(0)
    assert replay.info() == before
    assert replay.sample(100).probabilities.eq(0.25).all()  # priorities untouched

    for kwargs, message in [
        ({"capacity": 0}, "capacity must be positive"),
        ({"capacity": 10, "selector": "lifo"}, "unknown replay selector 'lifo'"),
        ({"capacity": 10, "alpha": -1.0}, "alpha must be finite and >= 0"),
        ({"capacity": 10, "min_size": 11}, "min_size 11 exceeds the capacity 10"),
        ({"capacity": 10, "min_size": 0}, "min_size must be at least 1"),
        ({"capacity": 10, "timeout": 0}, "timeout must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            moolib.Replay(**kwargs)
    with pytest.raises(ValueError, match="dedup names 'pixels', not leaves"):
        moolib.Replay(10, dedup=("pixels",)).insert(good)
    with pytest.raises(ValueError, match="dedup leaf action has item shape"):
        moolib.Replay(10, dedup=("action",)).insert(good)
    zero = moolib.Replay(10)
    zero.insert(good, [0.0] * 4)
    with pytest.raises(ValueError, match="every item has priority 0"):
        zero.sample(1)


# Memory.


def breakout_transitions(steps: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Consecutive stacked frames of real Breakout (ale-py, standard preprocessing)."""
    try:
        import ale_py
        import gymnasium as gym
        from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation
    except ImportError:
        return None
    gym.register_envs(ale_py)
    env = gym.make("ALE/Breakout-v5", frameskip=1, repeat_action_probability=0.0)
    env = FrameStackObservation(AtariPreprocessing(env, noop_max=0), 4)
    rng = np.random.default_rng(0)
    obs, _ = env.reset(seed=0)
    out_obs, out_next = [], []
    for _ in range(steps):
        next_obs, _, term, trunc, _ = env.step(int(rng.integers(4)))
        out_obs.append(obs)
        out_next.append(next_obs)
        obs = env.reset()[0] if term or trunc else next_obs
    env.close()
    return np.stack(out_obs), np.stack(out_next)


@pytest.mark.parametrize("source", ["breakout", "synthetic"])
def test_dedup_stores_about_one_frame_per_transition(source):
    steps, capacity = 1500, 1000
    data = breakout_transitions(steps) if source == "breakout" else make_atari_like(steps)
    if data is None:
        pytest.skip("ale-py or gymnasium is not installed")
    obs, next_obs = data
    assert obs.shape == (steps, 4, 84, 84) and obs.dtype == np.uint8
    replay = moolib.Replay(capacity, selector="fifo", dedup=("obs", "next_obs"))
    plain = moolib.Replay(capacity, selector="fifo")
    for start in range(0, steps, 100):
        chunk = atari_items(obs[start : start + 100], next_obs[start : start + 100], start)
        replay.insert(chunk)
        plain.insert(chunk)
    info = replay.info()
    frame = 84 * 84
    # One new frame per transition, plus the frames' bookkeeping and ids.
    assert info["bytes_per_item"] < 1.15 * frame, info
    assert info["frames"] <= capacity * 1.05 + 4
    # 1M transitions fit in 8 GiB.
    assert info["bytes_per_item"] * 1_000_000 < 8 * 2**30
    # The plain path stores every byte of every item.
    item_bytes = 2 * 4 * frame + 8 + 4 + 1
    assert plain.info()["item_bytes"] == item_bytes
    assert item_bytes <= plain.info()["bytes_per_item"] <= item_bytes + 64
    assert plain.info()["frames"] == 0
    # Both give back exactly what went in (oldest first).
    a, b = replay.sample(capacity), plain.sample(capacity)
    assert torch.equal(a.keys, torch.arange(steps - capacity, steps))
    for k in ("obs", "next_obs", "action", "reward", "done"):
        assert torch.equal(a.items[k], b.items[k]), k
    assert torch.equal(a.items["obs"], torch.from_numpy(obs[steps - capacity :]))


def test_frames_are_freed_with_the_items_that_held_them():
    replay = moolib.Replay(3, selector="fifo", dedup=("x",))
    frames = torch.arange(10, dtype=torch.uint8)[:, None, None].expand(10, 2, 16).contiguous()
    # Item i holds frames i and i+1.
    items = torch.stack([frames[i : i + 2, 0] for i in range(8)])  # (8, 2, 16)
    replay.insert({"x": items[:3]})
    assert replay.info()["frames"] == 4
    replay.insert({"x": items[3:]})  # evicts 5 items
    info = replay.info()
    assert info["size"] == 3 and info["frames"] == 4 and info["frame_bytes"] == 4 * 16
    assert torch.equal(replay.sample(3).items["x"], items[5:])


# Concurrency.


@pytest.mark.parametrize("selector", ["fifo", "prioritized"])
def test_concurrent_inserts_samples_and_updates_lose_and_duplicate_nothing(selector):
    writers, batches, batch = 4, 40, 25
    total = writers * batches * batch
    replay = moolib.Replay(total, selector=selector, seed=0, timeout=120)
    inserted: dict[int, int] = {}
    lock = threading.Lock()
    errors = []
    stop = threading.Event()

    def write(w):
        try:
            for b in range(batches):
                ids = torch.arange(batch) + (w * batches + b) * batch
                keys = replay.insert({"id": ids, "copy": ids.double()}, torch.rand(batch) + 0.1)
                with lock:
                    for k, i in zip(keys.tolist(), ids.tolist(), strict=True):
                        assert k not in inserted
                        inserted[k] = i
        except Exception as e:
            errors.append(e)

    def read():
        try:
            while not stop.is_set():
                s = replay.sample(32)
                # An item is never torn: both leaves come from the same insert.
                assert torch.equal(s.items["id"].double(), s.items["copy"])
                replay.update_priorities(s.keys, torch.rand(len(s.keys)) + 0.1)
        except Exception as e:
            errors.append(e)

    replay.insert({"id": torch.tensor([-1]), "copy": torch.tensor([-1.0], dtype=torch.float64)})
    readers = [threading.Thread(target=read) for _ in range(2)]
    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in readers + threads:
        t.start()
    for t in threads:
        t.join(300)
    stop.set()
    for t in readers:
        t.join(300)
    assert not errors, errors
    assert len(inserted) == total and sorted(inserted.values()) == list(range(total))
    assert replay.size() == total  # the first item was evicted, nothing else
    if selector == "fifo":
        got = replay.sample(total)
        assert sorted(got.items["id"].tolist()) == list(range(total))
        assert all(
            inserted[k] == i
            for k, i in zip(got.keys.tolist(), got.items["id"].tolist(), strict=True)
        )
    else:
        keys = torch.tensor(sorted(inserted))
        assert replay.update_priorities(keys, torch.ones(total)) == total
    assert replay.info()["inserts"] == total + 1


def test_keys_stay_below_the_shard_bits():
    # The RPC client puts a shard index in the top 16 bits of a key.
    replay = moolib.Replay(4, selector="uniform")
    keys = replay.insert({"x": torch.zeros(10)})
    assert keys.max().item() < 2**48 and keys.dtype == torch.int64
    assert math.isclose(replay.priority_mass(), 4.0)
