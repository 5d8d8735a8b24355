"""EnvPool: real worker processes and shared memory, checked against envs stepped by hand."""

from __future__ import annotations

import functools
import gc
import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from helpers import toy_envs
from helpers.util import wait_for

import moolib


class HandStepped:
    """The reference: one env per (batch, index) stepped the way EnvPool promises."""

    def __init__(self, make, batch_size: int, num_batches: int) -> None:
        self.envs = [[make() for _ in range(batch_size)] for _ in range(num_batches)]
        self.first = [True] * num_batches
        self.ret = np.zeros((num_batches, batch_size))
        self.len = np.zeros((num_batches, batch_size), dtype=np.int64)

    @staticmethod
    def _reset(env):
        out = env.reset()
        return out[0] if isinstance(out, tuple) else out

    def step(self, b: int, actions) -> list[dict]:
        rows = []
        for i, env in enumerate(self.envs[b]):
            row = {"episode_return": 0.0, "episode_length": 0}
            if self.first[b]:
                obs, reward, done = self._reset(env), 0.0, False
                self.ret[b, i], self.len[b, i] = 0, 0
            else:
                out = env.step(int(actions[i]))
                obs, reward = out[0], out[1]
                done = bool(out[2]) or (len(out) == 5 and bool(out[3]))
                self.ret[b, i] += np.float32(reward)
                self.len[b, i] += 1
                if done:
                    row = {"episode_return": self.ret[b, i], "episode_length": self.len[b, i]}
                    obs = self._reset(env)
                    self.ret[b, i], self.len[b, i] = 0, 0
            row.update(obs if isinstance(obs, dict) else {"state": obs})
            row["reward"], row["done"] = reward, done
            rows.append(row)
        self.first[b] = False
        return rows


def assert_matches(result: dict, rows: list[dict], where: str) -> None:
    assert set(result) == set(rows[0]), where
    for key, tensor in result.items():
        expected = np.stack([np.asarray(r[key]) for r in rows])
        got = tensor.numpy()
        assert got.shape == expected.shape, f"{where} {key}: shape {got.shape} != {expected.shape}"
        np.testing.assert_allclose(got, expected.astype(got.dtype), err_msg=f"{where} {key}")


@pytest.mark.parametrize(
    "make,num_processes,batch_size,num_batches",
    [
        (toy_envs.ToyEnv, 2, 5, 2),
        (toy_envs.OldGymEnv, 3, 7, 3),
        (toy_envs.ThreeTupleEnv, 1, 4, 1),
        (toy_envs.ToyEnv, 4, 4, 2),
    ],
    ids=["gymnasium", "gym-4-tuple", "gym-3-tuple", "one-env-per-process"],
)
def test_matches_envs_stepped_by_hand(make, num_processes, batch_size, num_batches):
    rng = np.random.default_rng(1234)
    reference = HandStepped(make, batch_size, num_batches)
    episodes_seen = 0
    with moolib.EnvPool(make, num_processes, batch_size, num_batches) as pool:
        assert pool.action_spec == (np.dtype(np.int64).str, ())
        for step in range(300):
            # Every batch in flight at once, collected in a shuffled order.
            actions = [torch.from_numpy(rng.integers(0, 7, batch_size)) for _ in range(num_batches)]
            futures = [pool.step(b, actions[b]) for b in range(num_batches)]
            for b in rng.permutation(num_batches):
                result = futures[b].result()
                rows = reference.step(b, actions[b].numpy())
                assert_matches(result, rows, f"step {step} batch {b}")
                assert result["reward"].dtype == torch.float32
                assert result["done"].dtype == torch.bool
                episodes_seen += int(result["done"].sum())
    assert episodes_seen > 50  # resets were exercised many times


def test_non_dict_observation_is_state_and_no_action_space_means_int64():
    reference = HandStepped(toy_envs.ArrayEnv, 3, 1)
    with moolib.EnvPool(toy_envs.ArrayEnv, 2, 3, 1) as pool:
        for step in range(20):
            action = torch.tensor([step % 3, 1, 2])
            result = pool.step(0, action).result()
            assert result["state"].dtype == torch.float64
            assert_matches(result, reference.step(0, action.numpy()), f"step {step}")


def test_large_rgb_observations():
    with moolib.EnvPool(toy_envs.BigImageEnv, 2, 4, 2) as pool:
        assert pool.observation_spec["state"] == (np.dtype(np.uint8).str, (480, 640, 3))
        for b in range(2):
            first = pool.step(b, torch.zeros(4, dtype=torch.int64)).result()
            assert first["state"].shape == (4, 480, 640, 3)
            assert int(first["state"].sum()) == 0
        for t in range(1, 4):
            for b in range(2):
                action = torch.tensor([0, 1, 2, t % 3])
                obs = pool.step(b, action).result()["state"]
                for i in range(4):
                    assert torch.all(obs[i, t, :, int(action[i])] == 200)
                    assert int(obs[i, -1, -1, 0]) == t
                    assert int(obs[i].sum()) == 200 * 640 + 3 * t


def test_box_actions_reach_the_envs():
    with moolib.EnvPool(toy_envs.BoxActionEnv, 2, 3, 1) as pool:
        assert pool.action_spec == (np.dtype(np.float32).str, (2,))
        pool.step(0, torch.zeros(3, 2)).result()
        action = torch.tensor([[0.5, -0.25], [1.0, 0.0], [-1.0, 0.75]])
        result = pool.step(0, action).result()
        assert torch.equal(result["state"], action * 2)
        assert torch.allclose(result["reward"], action.sum(1))
        with pytest.raises(RuntimeError, match=r"shape must be \[3, 2\]"):
            pool.step(0, torch.zeros(3))


def test_numpy_actions_are_accepted():
    with moolib.EnvPool(toy_envs.ToyEnv, 1, 2, 1) as pool:
        pool.step(0, np.zeros(2, dtype=np.int64)).result()
        result = pool.step(0, np.array([3, 4])).result()
        assert result["t"].tolist() == [1, 1]


def test_bad_actions_raise_and_the_pool_keeps_working():
    with moolib.EnvPool(toy_envs.ToyEnv, 2, 4, 1) as pool:
        good = torch.zeros(4, dtype=torch.int64)
        with pytest.raises(RuntimeError, match=r"dtype must be torch.int64, got torch.float32"):
            pool.step(0, torch.zeros(4))
        with pytest.raises(RuntimeError, match=r"shape must be \[4\].*got \[5\]"):
            pool.step(0, torch.zeros(5, dtype=torch.int64))
        with pytest.raises(RuntimeError, match=r"shape must be \[4\].*got \[4, 1\]"):
            pool.step(0, torch.zeros(4, 1, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="must be a torch.Tensor or numpy array"):
            pool.step(0, [0, 0, 0, 0])
        with pytest.raises(IndexError, match="batch_index 1 out of range"):
            pool.step(1, good)
        future = pool.step(0, good)
        with pytest.raises(RuntimeError, match="already has a step in flight"):
            pool.step(0, good)
        assert future.result()["t"].tolist() == [0, 0, 0, 0]
        assert pool.step(0, good + 1).result()["t"].tolist() == [1, 1, 1, 1]


@pytest.mark.parametrize(
    "args,message",
    [
        ((0, 4, 1), "num_processes must be a positive int"),
        ((2, 0, 1), "batch_size must be a positive int"),
        ((2, 4, 0), "num_batches must be a positive int"),
        ((5, 4, 1), r"num_processes \(5\) exceeds batch_size \(4\)"),
    ],
)
def test_bad_sizes(args, message):
    with pytest.raises(ValueError, match=message):
        moolib.EnvPool(toy_envs.ToyEnv, *args)


@pytest.mark.parametrize("factory", ["cartpole", toy_envs.ToyEnv()], ids=["name", "env"])
def test_a_factory_that_is_no_function_is_refused_before_any_worker_starts(factory):
    with pytest.raises(TypeError, match=r"create_env must be a function that makes one env"):
        moolib.EnvPool(factory, 1, 2, 1)


def test_env_exception_reaches_the_caller_with_its_traceback():
    with moolib.EnvPool(toy_envs.FailingEnv, 2, 4, 1) as pool:
        pool.step(0, torch.zeros(4, dtype=torch.int64)).result()
        pool.step(0, torch.ones(4, dtype=torch.int64)).result()
        with pytest.raises(RuntimeError) as info:
            pool.step(0, torch.tensor([1, 1, 6, 1])).result()
        text = str(info.value)
        assert "the toy env refuses action six" in text
        assert "KeyError" in text and "toy_envs.py" in text and "in step" in text
        # The rest runs on: the env that raised starts a new episode (done=True).
        result = pool.step(0, torch.ones(4, dtype=torch.int64)).result()
        assert result["done"].tolist() == [False, False, True, False]
        assert result["t"].tolist()[2] == 0
        assert pool.step(0, torch.ones(4, dtype=torch.int64)).result()["t"].tolist()[2] == 1


def test_a_bad_action_for_every_env_is_one_error_naming_the_envs():
    with moolib.EnvPool(toy_envs.FailingEnv, 2, 6, 1) as pool:
        pool.step(0, torch.zeros(6, dtype=torch.int64)).result()
        with pytest.raises(RuntimeError) as info:
            pool.step(0, torch.tensor([6, 6, 6, 1, 6, 6])).result()
        text = str(info.value)
        # One traceback, naming the envs that raised it (env 3 stepped).
        assert text.count("Traceback") == 1 and text.count("KeyError: 'the toy") == 1, text
        assert "worker 0, envs 0-2; worker 1, envs 4-5 of batch 0 raised:" in text, text
        assert pool.step(0, torch.ones(6, dtype=torch.int64)).result()["done"].tolist() == [
            True, True, True, False, True, True
        ]  # fmt: skip


def test_factory_exception_is_reported_at_construction():
    with pytest.raises(RuntimeError, match=r"(?s)creating the envs failed.*cannot create the toy"):
        moolib.EnvPool(toy_envs.broken_factory, 2, 2, 1)


def test_lambda_and_closure_factories_work():
    offset = 3

    class Local(toy_envs.ToyEnv):
        def reset(self, **kwargs):
            obs, info = super().reset()
            obs["t"] = np.int64(offset)
            return obs, info

    with moolib.EnvPool(lambda: Local(), 2, 2, 1) as pool:
        assert pool.step(0, torch.zeros(2, dtype=torch.int64)).result()["t"].tolist() == [3, 3]


def worker_pids(pool) -> list[int]:
    return [p.pid for p in pool._procs]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_killed_between_steps_is_reported_by_the_next_step():
    """The next step's send to a worker that died fails: the pool says which worker
    and how it ended (not a bare BrokenPipeError), although another batch's answer
    from it is still unread."""
    pool = moolib.EnvPool(toy_envs.ToyEnv, 2, 2, 2)
    try:
        pool.step(0, torch.zeros(2, dtype=torch.int64)).result()
        pending = pool.step(1, torch.zeros(2, dtype=torch.int64))
        pid = worker_pids(pool)[1]
        # Its answer to batch 1 is in the socket, unread, before it dies.
        wait_for(lambda: select.select([pool._socks[1]], [], [], 0)[0], what="the answer")
        os.kill(pid, signal.SIGKILL)
        # Reaped, not only a zombie: its leader shows "Z" while its other threads
        # (numpy's) still hold its socket open.
        pool._procs[1].wait(timeout=60)
        with pytest.raises(RuntimeError, match=r"worker 1 \(pid \d+\) was killed by SIGKILL"):
            pool.step(0, torch.zeros(2, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="killed by SIGKILL"):
            pending.result()
    finally:
        pool.close()


def test_dead_worker_is_reported_not_waited_on():
    pool = moolib.EnvPool(toy_envs.SlowEnv, 2, 2, 1)
    try:
        toy_envs.SlowEnv.delay = 0  # only in this process: workers keep their own class
        pool.step(0, torch.zeros(2, dtype=torch.int64)).result()
        future = pool.step(0, torch.zeros(2, dtype=torch.int64))
        os.kill(worker_pids(pool)[1], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"worker 1 \(pid \d+\) was killed by SIGKILL"):
            future.result()
        with pytest.raises(RuntimeError, match="killed by SIGKILL"):
            pool.step(0, torch.zeros(2, dtype=torch.int64))
    finally:
        toy_envs.SlowEnv.delay = 2.0
        pool.close()
    assert not any(alive(pid) for pid in worker_pids(pool))


def test_result_timeout_done_and_repeated_result():
    with moolib.EnvPool(toy_envs.SlowEnv, 1, 1, 1) as pool:
        first = pool.step(0, torch.zeros(1, dtype=torch.int64))
        assert first.result()["t"].tolist() == [0]
        assert first.done()
        future = pool.step(0, torch.ones(1, dtype=torch.int64))
        with pytest.raises(TimeoutError):
            future.result(timeout=0.01)
        wait_for(future.done, timeout=60)
        assert future.result()["t"].tolist() == [1]
        assert future.result()["t"].tolist() == [1]
        pool.step(0, torch.ones(1, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="overwritten"):
            future.result()


def test_close_leaves_no_process_and_closed_pool_refuses():
    pool = moolib.EnvPool(toy_envs.ToyEnv, 3, 3, 2)
    pids = worker_pids(pool)
    assert all(alive(pid) for pid in pids)
    pool.close()
    assert not any(alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="EnvPool is closed"):
        pool.step(0, torch.zeros(3, dtype=torch.int64))
    pool.close()  # idempotent


def envpool_memfds(pid: int) -> tuple[int, int]:
    """How many fds of process ``pid``, and how many of its mappings, are of
    moolib-envpool memfds."""
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:moolib-envpool")
        except OSError:
            pass  # closed meanwhile
    with open(f"/proc/{pid}/maps") as f:
        maps = sum("/memfd:moolib-envpool" in line for line in f)
    return fds, maps


def test_the_region_is_mapped_by_the_pool_and_every_worker_and_no_one_keeps_its_fd():
    before = set(os.listdir("/dev/shm"))
    gc.collect()  # the regions of pools gone before
    fds, maps = envpool_memfds(os.getpid())
    with moolib.EnvPool(toy_envs.ToyEnv, 2, 4, 2) as pool:
        pool.step(0, torch.zeros(4, dtype=torch.int64)).result()
        assert envpool_memfds(os.getpid()) == (fds, maps + 1)
        assert [envpool_memfds(pid) for pid in worker_pids(pool)] == [(0, 1)] * 2
    assert set(os.listdir("/dev/shm")) == before


def test_garbage_collected_pool_stops_its_workers():
    pool = moolib.EnvPool(toy_envs.ToyEnv, 2, 2, 1)
    pids = worker_pids(pool)
    del pool
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=60)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().split(") ")[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_waiting_workers_block_instead_of_spinning():
    with moolib.EnvPool(toy_envs.ToyEnv, 2, 2, 2) as pool:
        for b in range(2):
            pool.step(b, torch.zeros(2, dtype=torch.int64)).result()
        before = [cpu_seconds(pid) for pid in worker_pids(pool)]
        time.sleep(2.0)
        after = [cpu_seconds(pid) for pid in worker_pids(pool)]
        # A spinning worker burns about a CPU-second per second; a blocked one none.
        assert all(a - b < 0.5 for a, b in zip(after, before, strict=True)), (before, after)


def test_works_in_a_process_that_runs_an_rpc(make_rpc):
    server = make_rpc(name="envpool-server", listen=True)
    server.define("double", lambda x: 2 * x)
    client = make_rpc()
    client.connect(server.address)
    assert client.sync("envpool-server", "double", 21) == 42
    with moolib.EnvPool(toy_envs.ToyEnv, 2, 4, 2) as pool:
        for b in range(2):
            pool.step(b, torch.zeros(4, dtype=torch.int64)).result()
        assert pool.step(0, torch.ones(4, dtype=torch.int64)).result()["t"].tolist() == [1] * 4
        assert client.sync("envpool-server", "double", 4) == 8


SCRIPT = textwrap.dedent(
    """
    import os, sys, time, torch, moolib
    sys.path.insert(0, {helpers!r})
    from helpers import toy_envs
    rpc = moolib.Rpc()
    rpc.listen("127.0.0.1:0")
    pool = moolib.EnvPool(toy_envs.ToyEnv, 2, 2, 1)
    print(" ".join(str(p.pid) for p in pool._procs), flush=True)
    action = torch.zeros(2, dtype=torch.int64)
    mode = sys.argv[1]
    if mode == "exit":
        pool.step(0, action).result()
        sys.exit(0)
    if mode == "handle":  # stops cleanly on SIGTERM/SIGHUP, stepping the pool once more
        import signal
        stop = []
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, lambda *_: stop.append(1))
        while not stop:
            pool.step(0, action).result()
            time.sleep(0.001)
        pool.step(0, action).result()
        pool.close()
        sys.exit(0)
    while True:
        pool.step(0, action).result()
        time.sleep(0.001)
    """
)


@pytest.mark.parametrize("how", ["exit", "ctrl-c", "kill-9", "sigterm", "sighup"])
def test_no_worker_outlives_its_parent(how, tmp_path):
    """Also: a signal sent to the whole process group (SIGTERM from timeout,
    systemd or scancel; SIGHUP from a closed terminal) leaves the workers to the
    parent, which handles it here and steps its pool once more."""
    script = tmp_path / "pool_parent.py"
    script.write_text(SCRIPT.format(helpers=os.path.dirname(__file__)))
    mode = {"exit": "exit", "sigterm": "handle", "sighup": "handle"}.get(how, "loop")
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal would give it
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        if how == "ctrl-c":
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole group
        elif how == "kill-9":
            proc.kill()
        elif how in ("sigterm", "sighup"):
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGTERM if how == "sigterm" else signal.SIGHUP)
        proc.wait(timeout=60)
        wait_for(lambda: not any(alive(pid) for pid in pids), timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if how in ("exit", "sigterm", "sighup"):
        assert proc.returncode == 0
    if how == "ctrl-c":
        assert proc.returncode != 0  # KeyboardInterrupt ended it


STARTING = textwrap.dedent(
    """
    import signal, sys, torch, moolib
    sys.path.insert(0, {helpers!r})
    from helpers import toy_envs
    caught = []
    signal.signal(signal.SIGINT, lambda *_: caught.append(1))
    print("starting", flush=True)
    pool = moolib.EnvPool(toy_envs.ToyEnv, 2, 2, 1)
    pool.step(0, torch.zeros(2, dtype=torch.int64)).result()
    pool.step(0, torch.zeros(2, dtype=torch.int64)).result()
    pool.close()
    print("caught", len(caught), flush=True)
    """
)


def test_ctrl_c_while_the_workers_start_leaves_them_to_the_pool(tmp_path):
    """A Ctrl-C that comes while the worker interpreters still import (they are
    in the parent's process group) waits for them to ignore it: it does not kill
    them mid-import. The parent, which handles it, steps its pool."""
    script = tmp_path / "starting.py"
    script.write_text(STARTING.format(helpers=os.path.dirname(__file__)))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout.readline().strip() == "starting"
        time.sleep(0.2)  # the workers are spawned and importing
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    assert out.split() == ["caught", "1"]


# -- what EnvPool cannot store is refused, naming the env ---------------------

IMAGE = np.zeros((2, 3), dtype=np.uint8)
VECTOR = np.zeros(4, dtype=np.float32)
MIXED = {"img": IMAGE, "t": np.int64(0), "level": np.uint8(0)}
NORMAL = object()  # misbehaving(): the bad step returns a normal observation


def mixed(**changes) -> dict:
    obs = {"img": np.ones((2, 3), np.uint8), "t": np.int64(1), "level": np.uint8(1)}
    obs.update(changes)
    return obs


REFUSED = [
    # (example observation, bad observation, bad reward, what the message names)
    (VECTOR, np.ones(1, np.float32), 1.0, ["'state'", "float32 of shape (4,)", "(1,)"]),
    (VECTOR, np.ones((1, 4), np.float32), 1.0, ["'state'", "(4,)", "(1, 4)"]),
    (VECTOR, np.ones(4, np.complex64), 1.0, ["'state'", "float32 of shape (4,)", "complex64"]),
    (VECTOR, None, 1.0, ["'state'", "float32 of shape (4,)", "None"]),
    (VECTOR, ["a", "b", "c", "d"], 1.0, ["'state'", "float32 of shape (4,)", "<U1"]),
    (VECTOR, np.full(4, 1e39), 1.0, ["'state'", "float32", "1e+39"]),
    (IMAGE, np.full((2, 3), 300), 1.0, ["'state'", "uint8 of shape (2, 3)", "300"]),
    (IMAGE, [[1, 2, 3], [4, 5, -1]], 1.0, ["'state'", "uint8 of shape (2, 3)", "-1"]),
    (IMAGE, np.full((2, 3), 0.5, np.float32), 1.0, ["'state'", "uint8", "float32"]),
    (MIXED, mixed(img=np.full((2, 3), 300)), 1.0, ["'img'", "uint8 of shape (2, 3)", "300"]),
    (MIXED, mixed(level=300), 1.0, ["'level'", "uint8 of shape ()", "300"]),
    (MIXED, mixed(level=-1), 1.0, ["'level'", "uint8 of shape ()", "-1"]),
    (MIXED, mixed(t=1.5), 1.0, ["'t'", "int64 of shape ()", "float64", "1.5"]),
    (MIXED, mixed(t=None), 1.0, ["'t'", "int64 of shape ()", "None"]),
    (MIXED, mixed(t=np.arange(2)), 1.0, ["'t'", "int64 of shape ()", "(2,)"]),
    (MIXED, {"img": IMAGE, "t": 1}, 1.0, ["keys", "'level'"]),
    (MIXED, VECTOR, 1.0, ["dict", "ndarray"]),
    (VECTOR, NORMAL, float("nan"), ["reward nan", "not finite"]),
    (VECTOR, NORMAL, float("inf"), ["reward inf", "not finite"]),
    (VECTOR, NORMAL, -np.inf, ["reward -inf", "not finite"]),
    (VECTOR, NORMAL, np.float32("nan"), ["reward nan", "not finite"]),
    (VECTOR, NORMAL, 1e39, ["reward 1e+39", "float32"]),
    (VECTOR, NORMAL, None, ["reward", "NoneType"]),
    (VECTOR, NORMAL, "1.5", ["reward", "str"]),
    (VECTOR, NORMAL, np.ones(1), ["reward", "ndarray", "(1,)"]),
    (VECTOR, NORMAL, 1j, ["reward", "complex"]),
    (VECTOR, NORMAL, torch.ones(2), ["reward", "Tensor of shape (2,)"]),
    (VECTOR, NORMAL, torch.tensor(1 + 2j), ["reward", "Tensor", "complex"]),
]
REFUSED_IDS = [
    "shape-1-into-4",
    "shape-1x4-into-4",
    "complex-into-float32",
    "None-into-float32",
    "str-into-float32",
    "1e39-into-float32",
    "int-300-into-uint8",
    "list-with-minus-1-into-uint8",
    "float-into-uint8",
    "dict-int-300-into-uint8",
    "python-300-into-uint8-scalar",
    "python-minus-1-into-uint8-scalar",
    "1.5-into-int64",
    "None-into-int64",
    "array-into-scalar",
    "missing-key",
    "array-instead-of-dict",
    "reward-nan",
    "reward-inf",
    "reward-minus-inf",
    "reward-float32-nan",
    "reward-overflows-float32",
    "reward-None",
    "reward-str",
    "reward-array",
    "reward-complex",
    "reward-tensor-of-2",
    "reward-complex-tensor",
]


def misbehaving(example, bad_obs=NORMAL, bad_reward=1.0):
    kwargs = {"bad_reward": bad_reward}
    if bad_obs is not NORMAL:
        kwargs["bad_obs"] = bad_obs
    return functools.partial(toy_envs.MisbehavingEnv, example, **kwargs)


def rows_of(result: dict, key: str) -> list:
    return [result[key][i].tolist() for i in range(result[key].shape[0])]


@pytest.mark.parametrize("example,bad_obs,bad_reward,names", REFUSED, ids=REFUSED_IDS)
def test_unstorable_step_raises_naming_the_env_and_the_pool_goes_on(
    example, bad_obs, bad_reward, names
):
    key = "img" if isinstance(example, dict) else "state"
    zeros = torch.zeros(4, dtype=torch.int64)
    with moolib.EnvPool(misbehaving(example, bad_obs, bad_reward), 2, 4, 1) as pool:
        pool.step(0, zeros).result()
        pool.step(0, zeros).result()
        # Envs 1 (worker 0) and 2 (worker 1) misbehave; 0 and 3 step normally.
        with pytest.raises(RuntimeError) as info:
            pool.step(0, torch.tensor([0, 1, 1, 0])).result()
        text = str(info.value)
        for env, worker in ((1, 0), (2, 1)):
            assert f"worker {worker}, env {env}" in text, text
        for name in names:
            assert name in text, f"{name!r} not in {text}"
        assert "env 0 " not in text and "env 3 " not in text, text
        # The pool goes on: the two envs start new episodes (done=True), the
        # others took their step in the failed one and take the next now.
        for t in (3, 4):
            result = pool.step(0, zeros).result()
            want = [t, t - 3, t - 3, t]
            assert result["done"].tolist() == [False, t == 3, t == 3, False]
            assert result["reward"].tolist() == [1.0, float(t == 4), float(t == 4), 1.0]
            assert [np.unique(np.asarray(r)).tolist() for r in rows_of(result, key)] == [
                [w] for w in want
            ]


ACCEPTED = [
    # (example observation, value returned on action 1, its stored value)
    (VECTOR, np.full(4, 2.5), np.full(4, 2.5, np.float32)),  # float64: rounds to float32
    (VECTOR, [1, 2, 3, 4], np.arange(1, 5, dtype=np.float32)),
    (VECTOR, np.arange(4, dtype=np.int64), np.arange(4, dtype=np.float32)),
    (VECTOR, np.full(4, np.nan, np.float32), np.full(4, np.nan, np.float32)),
    (IMAGE, [[0, 1, 2], [253, 254, 255]], np.array([[0, 1, 2], [253, 254, 255]], np.uint8)),
    (IMAGE, np.full((2, 3), 255, np.int64), np.full((2, 3), 255, np.uint8)),
    (IMAGE, np.ones((2, 3), bool), np.ones((2, 3), np.uint8)),
    (MIXED, mixed(level=255, t=np.int32(-7)), mixed(level=np.uint8(255), t=np.int64(-7))),
    (MIXED, mixed(t=True), mixed(t=np.int64(1))),
]


@pytest.mark.parametrize("example,value,stored", ACCEPTED)
def test_values_the_dtype_holds_exactly_are_stored(example, value, stored):
    with moolib.EnvPool(misbehaving(example, value, 0.5), 2, 2, 1) as pool:
        pool.step(0, torch.zeros(2, dtype=torch.int64)).result()
        result = pool.step(0, torch.tensor([0, 1])).result()
        assert result["reward"].tolist() == [1.0, 0.5]
        for key, want in stored.items() if isinstance(stored, dict) else [("state", stored)]:
            got = result[key][1].numpy()
            assert got.dtype == np.asarray(want).dtype, key
            np.testing.assert_array_equal(got, want, err_msg=key)


@pytest.mark.parametrize(
    "reward,stored",
    [
        (np.float32(0.25), 0.25),
        (np.int64(3), 3.0),
        (True, 1.0),
        (np.array(-2.0), -2.0),
        (torch.tensor(0.5), 0.5),
        (torch.tensor(2), 2.0),
    ],
    ids=["float32", "int64", "bool", "0-d-array", "0-d-tensor", "0-d-int-tensor"],
)
def test_number_rewards_of_any_numeric_type_are_stored(reward, stored):
    with moolib.EnvPool(misbehaving(VECTOR, NORMAL, reward), 1, 2, 1) as pool:
        pool.step(0, torch.zeros(2, dtype=torch.int64)).result()
        result = pool.step(0, torch.tensor([1, 0])).result()
        assert result["reward"].tolist() == [stored, 1.0]


def test_nonfinite_rewards_can_be_counted_instead(caplog):
    make = misbehaving(VECTOR, NORMAL, float("nan"))
    with pytest.raises(ValueError, match="nonfinite_rewards must be 'raise' or 'count'"):
        moolib.EnvPool(make, 1, 2, 1, nonfinite_rewards="ignore")
    caplog.set_level(logging.WARNING, logger="moolib")
    with moolib.EnvPool(make, 2, 4, 1, nonfinite_rewards="count") as pool:
        zeros = torch.zeros(4, dtype=torch.int64)
        pool.step(0, zeros).result()
        assert pool.nonfinite_reward_count == 0
        result = pool.step(0, torch.tensor([0, 0, 1, 0])).result()
        reward = result["reward"].tolist()
        assert reward[:2] == [1.0, 1.0] and np.isnan(reward[2]) and reward[3] == 1.0
        assert result["done"].tolist() == [False] * 4
        assert pool.nonfinite_reward_count == 1
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        assert "env 2 of batch 0" in warnings[0] and "nan" in warnings[0], warnings
        result = pool.step(0, torch.tensor([1, 1, 0, 1])).result()
        assert np.isnan(result["reward"].numpy()[[0, 1, 3]]).all()
        assert pool.nonfinite_reward_count == 4
        # Episodes run on; the counted rewards are stored as they came.
        assert result["state"][:, 0].tolist() == [2.0, 2.0, 2.0, 2.0]
        assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize(
    "first,names",
    [
        ({"ok": np.zeros(2), "bad": np.array(None)}, ["'bad'", "object"]),
        ({"ok": np.zeros(2), "bad": np.array("text")}, ["'bad'", "<U4"]),
        (np.zeros(2, dtype=">f4"), ["'state'", ">f4"]),
    ],
    ids=["object", "str", "big-endian"],
)
def test_a_first_observation_that_cannot_be_stored_is_refused_at_construction(first, names):
    with pytest.raises(RuntimeError) as info:
        moolib.EnvPool(misbehaving(first), 1, 1, 1)
    for name in names:
        assert name in str(info.value), str(info.value)
