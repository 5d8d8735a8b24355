"""An EnvPool worker process: steps its slice of every batch's envs and writes
the results straight into the shared region.

Started by moolib.EnvPool as ``python -m moolib._envpool_worker <fd>`` with one
end of a Unix socket pair as <fd>. It blocks on that socket between steps and
exits when the parent closes it (also when the parent dies).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import traceback
from typing import Any

import numpy as np

from . import _envpool_shared as shared
from . import _signals
from ._core import ShmRegion


def _action_spec(env: Any) -> tuple[str, tuple[int, ...]]:
    space = getattr(env, "action_space", None)
    if space is None or hasattr(space, "n") and not getattr(space, "shape", None):
        # Discrete (gymnasium or old gym), or no declared space: one index per env.
        return np.dtype(np.int64).str, ()
    dtype = np.dtype(getattr(space, "dtype", None) or np.float32)
    if dtype.kind in "iub":
        dtype = np.dtype(np.int64)
    return dtype.str, tuple(int(d) for d in space.shape)


class Refused(Exception):
    """An env returned something the shared region cannot hold as it is."""


# Largest finite float32: rewards are stored as float32.
_F32_MAX = float(np.finfo(np.float32).max)
_ndarray = np.ndarray
_generic = np.generic
# Reward types float() converts exactly and at once (the hot path).
_REAL_SCALARS = frozenset(
    {np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8, np.uint8}
)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _reward_number(reward: Any) -> float:
    """A reward that is not a Python float as one, if it is a real number."""
    if isinstance(reward, int):  # bool included
        try:
            return float(reward)
        except OverflowError:
            raise Refused(f"reward {_short(reward)} does not fit in float32") from None
    if isinstance(reward, _generic) and reward.dtype.kind in "biuf":
        return float(reward)
    if isinstance(reward, float):  # a subclass of float
        return float(reward)
    if hasattr(reward, "__array__"):  # an array or tensor (the original's test envs give 0-d ones)
        name = type(reward).__name__
        try:
            arr = np.asarray(reward)
        except (TypeError, ValueError, RuntimeError) as e:  # a CUDA tensor, say
            raise Refused(f"reward must be a real number, got {name} ({e})") from None
        if arr.shape == () and arr.dtype.kind in "biuf":
            return float(arr)
        raise Refused(
            f"reward must be a real number, got {name} of shape {arr.shape} ({arr.dtype})"
        )
    raise Refused(f"reward must be a real number, got {type(reward).__name__} {_short(reward)}")


def _refused(
    key: str, value: Any, arr: np.ndarray | None, dtype: np.dtype, shape: tuple, why: str = ""
) -> Refused:
    got = (
        "" if isinstance(value, (_ndarray, _generic)) else f"{type(value).__name__} {_short(value)}"
    )
    if arr is not None:
        as_array = f"{shared.dtype_name(arr.dtype)} of shape {arr.shape}"
        got = f"{got}, as an array {as_array}" if got else as_array
    return Refused(
        f"observation {key!r}: expected {shared.dtype_name(dtype)} of shape {shape}, got {got}{why}"
    )


def _checked(key: str, value: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """``value`` as an array that observation ``key`` (``dtype``, ``shape``) holds
    exactly, or Refused. The slow path: arrays of the right dtype and shape only
    come here if their dtype is an equal but distinct object."""
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise _refused(key, value, None, dtype, shape, f", which is no array ({e})") from None
    src = arr.dtype
    if arr.shape != shape or src.kind not in "biufc":
        raise _refused(key, value, arr, dtype, shape)
    if src == dtype or np.can_cast(src, dtype, "safe") and dtype.kind in "iub":
        return arr
    if src.kind in "iub" and dtype.kind in "iu":
        # Signed into unsigned is no 'same_kind' cast to numpy, yet a list of
        # small Python ints (int64) into a uint8 image is fine: check the range.
        if not arr.size:
            return arr
        info = np.iinfo(dtype)
        low, high = int(arr.min()), int(arr.max())
        bad = low if low < info.min else high if high > info.max else None
        if bad is not None:
            why = f" holding {bad}, which {shared.dtype_name(dtype)} cannot hold"
            raise _refused(key, value, arr, dtype, shape, why)
        return arr
    if not np.can_cast(src, dtype, "same_kind"):
        raise _refused(key, value, arr, dtype, shape)
    # Into float or complex: rounding to the nearest value is accepted, but no
    # finite value may become infinite, and no integer may change.
    with np.errstate(over="ignore", invalid="ignore"):
        cast = arr.astype(dtype)
    lost = np.isfinite(arr) & ~np.isfinite(cast)
    if src.kind in "iu":
        exact = 2 ** (np.finfo(dtype).nmant + 1)
        big = (arr > exact) | (arr < -exact)
        if big.any():
            pairs = zip(cast[big].real.tolist(), arr[big].tolist(), strict=True)
            lost[big] = [int(f) != v for f, v in pairs]
    if lost.any():
        why = f" holding {arr[lost].flat[0].item()!r}, which {shared.dtype_name(dtype)} cannot hold"
        raise _refused(key, value, arr, dtype, shape, why)
    return cast


class _Env:
    """One env and its episode bookkeeping, speaking either gym API."""

    __slots__ = ("env", "episode_return", "episode_length", "needs_reset")

    def __init__(self, env: Any) -> None:
        self.env = env
        self.episode_return = 0.0
        self.episode_length = 0
        self.needs_reset = True

    def reset(self) -> Any:
        out = self.env.reset()
        self.needs_reset = False
        self.episode_return = 0.0
        self.episode_length = 0
        # gymnasium: (obs, info); old gym: obs.
        if type(out) is tuple and len(out) == 2 and isinstance(out[1], dict):
            return out[0]
        return out

    def step(self, action: Any) -> tuple[Any, float, bool]:
        out = self.env.step(action)
        if len(out) == 5:
            obs, reward, terminated, truncated, _ = out
            done = bool(terminated) or bool(truncated)
        elif len(out) in (3, 4):
            obs, reward, done = out[0], out[1], bool(out[2])
        else:
            raise RuntimeError(
                f"env.step returned a {len(out)}-tuple; expected (obs, reward, terminated, "
                "truncated, info), (obs, reward, done, info) or (obs, reward, done)"
            )
        if type(reward) is not float:
            reward = float(reward) if type(reward) in _REAL_SCALARS else _reward_number(reward)
        return obs, reward, done


class _Worker:
    def __init__(self, sock: socket.socket, setup: dict) -> None:
        self.sock = sock
        self.lo, self.hi = setup["slice"]
        self.num_batches = setup["num_batches"]
        self.count_nonfinite = setup["nonfinite_rewards"] == "count"
        # Non-finite rewards counted since the last STEPPED message, and the
        # first of them, described.
        self.nonfinite = 0
        self.nonfinite_first = ""
        create_env = pickle.loads(setup["create_env"])
        n = self.hi - self.lo
        self.envs = [[_Env(create_env()) for _ in range(n)] for _ in range(self.num_batches)]
        self.first = [True] * self.num_batches
        # The first env's first observation sizes the region; it is kept for
        # that env's first step instead of resetting it twice.
        first_env = self.envs[0][0]
        self.pending_obs = first_env.reset()
        self.obs_spec = shared.array_spec(shared.observation_arrays(self.pending_obs))
        self.action_spec = _action_spec(first_env.env)
        self.batches: list[dict] = []
        self.region: ShmRegion | None = None

    def map(self, fd: int, placed: dict, size: int) -> None:
        try:
            self.region = ShmRegion.from_fd(fd, size)
        finally:
            os.close(fd)
        self.batches = [shared.views(self.region, placed, b) for b in range(self.num_batches)]
        self.obs_keys = frozenset(self.obs_spec)
        self.obs_fields = [
            (key, np.dtype(dtype), tuple(shape)) for key, (dtype, shape) in self.obs_spec.items()
        ]
        # A first observation that was no dict (or a dict of "state" alone)
        # takes a single array; anything else is checked key by key.
        self.plain = self.obs_fields[0] if list(self.obs_spec) == ["state"] else None

    def _write_obs(self, arrays: dict, i: int, obs: Any) -> None:
        # The hot path is an array of the right dtype and shape: a type test
        # and two comparisons (numpy shares the dtype object of each builtin
        # dtype), then the copy. Anything else is checked.
        plain = self.plain
        if plain is not None:
            _, dtype, shape = plain
            if type(obs) is _ndarray and obs.dtype is dtype and obs.shape == shape:
                arrays["state"][i] = obs
                return
            if not isinstance(obs, dict):
                arrays["state"][i] = _checked("state", obs, dtype, shape)
                return
        if not isinstance(obs, dict):
            raise Refused(
                f"observation is a {type(obs).__name__}; the first one was a dict with keys "
                f"{sorted(self.obs_keys)}"
            )
        if obs.keys() != self.obs_keys:
            obs = {str(k): v for k, v in obs.items()}
            if obs.keys() != self.obs_keys:
                raise Refused(
                    f"observation keys {sorted(obs)} differ from the first observation's "
                    f"{sorted(self.obs_keys)}"
                )
        for key, dtype, shape in self.obs_fields:
            value = obs[key]
            if (type(value) is _ndarray or isinstance(value, _generic)) and (
                value.dtype is dtype and value.shape == shape
            ):
                arrays[key][i] = value
            else:
                arrays[key][i] = _checked(key, value, dtype, shape)

    def _odd_reward(self, b: int, i: int, r: float) -> None:
        """A reward outside float32's finite range: refused, or counted if it
        is NaN or infinite and the pool counts those."""
        if r == r and abs(r) != float("inf"):
            raise Refused(f"reward {r!r} does not fit in float32")
        if not self.count_nonfinite:
            raise Refused(
                f"reward {r!r} is not finite (EnvPool(nonfinite_rewards='count') counts "
                "such rewards instead)"
            )
        if not self.nonfinite:
            self.nonfinite_first = f"env {i} of batch {b} returned reward {r!r}"
        self.nonfinite += 1

    def step(self, b: int) -> list[tuple[list[int], str]]:
        """Steps batch b's envs in this worker's slice; returns what went wrong
        for the envs that raised or returned what cannot be stored (each such
        env is reset at its next step; the others have taken their step): each
        distinct failure once, with the envs that had it."""
        arrays = self.batches[b]
        reward, done = arrays["reward"], arrays["done"]
        ep_return, ep_length = arrays["episode_return"], arrays["episode_length"]
        actions = arrays["action"]
        first = self.first[b]
        scalar_action = actions.ndim == 1
        # What went wrong -> the envs it happened to: a bad action for the
        # whole batch fails every env the same way, and is told once.
        failures: dict[str, list[int]] = {}
        high = _F32_MAX
        for j, env in enumerate(self.envs[b]):
            i = self.lo + j
            try:
                if first or env.needs_reset:
                    # A batch's first step resets; so does an env whose last
                    # step failed, and that ends its episode.
                    d = not first
                    ep_return[i] = env.episode_return if d else 0.0
                    ep_length[i] = env.episode_length if d else 0
                    r = 0.0
                    if self.pending_obs is not None and b == 0 and j == 0:
                        obs, self.pending_obs = self.pending_obs, None
                    else:
                        obs = env.reset()
                else:
                    action = actions[i].item() if scalar_action else actions[i].copy()
                    obs, r, d = env.step(action)
                    if not -high <= r <= high:
                        self._odd_reward(b, i, r)
                    env.episode_return += r
                    env.episode_length += 1
                    if d:
                        ep_return[i] = env.episode_return
                        ep_length[i] = env.episode_length
                        obs = env.reset()
                    else:
                        ep_return[i] = 0.0
                        ep_length[i] = 0
                self._write_obs(arrays, i, obs)
                reward[i] = r
                done[i] = d
            except Refused as e:
                env.needs_reset = True
                failures.setdefault(f": {e}", []).append(i)
            except BaseException:  # noqa: BLE001 - an env's exception belongs to the caller
                env.needs_reset = True
                failures.setdefault(f" raised:\n{traceback.format_exc()}", []).append(i)
        self.first[b] = False
        return [(envs, text) for text, envs in failures.items()]


def _serve(sock: socket.socket) -> None:
    kind, _, payload = shared.receive(sock)
    if kind != shared.INIT:
        raise RuntimeError(f"EnvPool worker: expected INIT, got message kind {kind}")
    setup = pickle.loads(payload)
    # The factory may live in a module only the parent's path can find.
    sys.path[:] = setup["sys_path"]
    try:
        worker = _Worker(sock, setup)
    except BaseException:  # noqa: BLE001 - the parent reports it with the traceback
        text = "creating the envs failed:\n" + traceback.format_exc()
        shared.send(sock, shared.FAILED, -1, shared.clip_text(text))
        return
    shared.send(sock, shared.SPEC, -1, pickle.dumps((worker.obs_spec, worker.action_spec)))

    msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
    kind, _, length = shared._HEADER.unpack(msg[: shared._HEADER.size])
    if kind != shared.LAYOUT or len(fds) != 1:
        return  # the parent gave up (e.g. the workers' specs differ)
    placed, size = pickle.loads(msg[shared._HEADER.size : shared._HEADER.size + length])
    worker.map(fds[0], placed, size)
    shared.send(sock, shared.READY)

    while True:
        kind, b, _ = shared.receive(sock)
        if kind != shared.STEP:
            return
        try:
            failures = worker.step(b)
        except BaseException:  # noqa: BLE001 - the caller reports it
            failures = [([], f" failed while stepping:\n{traceback.format_exc()}")]
        if failures:
            clipped = [
                (envs, shared.clip_text(text).decode("utf-8", "replace")) for envs, text in failures
            ]
            shared.send(sock, shared.FAILED, b, pickle.dumps(clipped))
        elif worker.nonfinite:
            note = shared.NONFINITE.pack(worker.nonfinite) + worker.nonfinite_first.encode()
            worker.nonfinite = 0
            shared.send(sock, shared.STEPPED, b, note)
        else:
            shared.send(sock, shared.STEPPED, b)


def main() -> None:
    """Runs a worker on the socket whose descriptor is ``sys.argv[1]``."""
    # Ctrl-C, a terminal's hang-up and a SIGTERM sent to the whole process group
    # (timeout, systemd, SLURM's scancel) reach the workers too. The parent
    # decides when they stop (by closing the socket; it dies, they see EOF), so
    # a parent that handles the signal, as moolib-run does to stop cleanly with
    # a checkpoint, can still step the pool while it winds down.
    for signum in _signals.STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    _signals.unblock()  # blocked by the pool while this interpreter started
    sock = socket.socket(fileno=int(sys.argv[1]))
    try:
        _serve(sock)
    except shared.WorkerGone:
        pass
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        sock.close()
        # Skip interpreter teardown: envs' destructors may block, and nothing
        # is left to flush but stdio.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
