"""An EnvPool worker process: steps its slice of every batch's envs and writes
the results straight into the shared region.

Started by moolib.EnvPool as ``python -m moolib._envpool_worker <fd>`` with one
end of a Unix socket pair as <fd>. It blocks on that socket between steps and
exits when the parent closes it (also when the parent dies).
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import sys
import traceback
from typing import Any

import numpy as np

from . import _envpool_shared as shared


def _action_spec(env: Any) -> tuple[str, tuple[int, ...]]:
    space = getattr(env, "action_space", None)
    if space is None or hasattr(space, "n") and not getattr(space, "shape", None):
        # Discrete (gymnasium or old gym), or no declared space: one index per env.
        return np.dtype(np.int64).str, ()
    dtype = np.dtype(getattr(space, "dtype", None) or np.float32)
    if dtype.kind in "iub":
        dtype = np.dtype(np.int64)
    return dtype.str, tuple(int(d) for d in space.shape)


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
        reward = float(reward)
        self.episode_return += reward
        self.episode_length += 1
        return obs, reward, done


class _Worker:
    def __init__(self, sock: socket.socket, setup: dict) -> None:
        self.sock = sock
        self.lo, self.hi = setup["slice"]
        self.num_batches = setup["num_batches"]
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
        self.region: mmap.mmap | None = None

    def map(self, fd: int, placed: dict, size: int) -> None:
        self.region = mmap.mmap(fd, size)
        os.close(fd)
        self.batches = [shared.views(self.region, placed, b) for b in range(self.num_batches)]
        self.obs_keys = list(self.obs_spec)

    def _write_obs(self, arrays: dict, i: int, obs: Any) -> None:
        if len(self.obs_keys) == 1 and self.obs_keys[0] == "state" and not isinstance(obs, dict):
            arrays["state"][i] = obs
            return
        got = shared.observation_arrays(obs)
        if got.keys() != set(self.obs_keys):
            raise RuntimeError(
                f"observation keys {sorted(got)} differ from the first observation's "
                f"{sorted(self.obs_keys)}"
            )
        for key in self.obs_keys:
            arrays[key][i] = got[key]

    def step(self, b: int) -> None:
        arrays = self.batches[b]
        reward, done = arrays["reward"], arrays["done"]
        ep_return, ep_length = arrays["episode_return"], arrays["episode_length"]
        actions = arrays["action"]
        first = self.first[b]
        scalar_action = actions.ndim == 1
        for j, env in enumerate(self.envs[b]):
            i = self.lo + j
            if first or env.needs_reset:
                # A batch's first step resets; so does an env whose last step
                # raised, and that ends its episode.
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
                env.needs_reset = True  # stays set if the step raises
                obs, r, d = env.step(action)
                if d:
                    ep_return[i] = env.episode_return
                    ep_length[i] = env.episode_length
                    obs = env.reset()
                else:
                    ep_return[i] = 0.0
                    ep_length[i] = 0
                    env.needs_reset = False
            self._write_obs(arrays, i, obs)
            reward[i] = r
            done[i] = d
        self.first[b] = False


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
            worker.step(b)
        except BaseException:  # noqa: BLE001 - an env's exception belongs to the caller
            text = traceback.format_exc()
            shared.send(sock, shared.FAILED, b, shared.clip_text(text))
            continue
        shared.send(sock, shared.STEPPED, b)


def main() -> None:
    """Runs a worker on the socket whose descriptor is ``sys.argv[1]``."""
    # Ctrl-C reaches the whole process group; the parent decides when workers
    # stop (by closing the socket), so an interrupt it catches loses nothing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
