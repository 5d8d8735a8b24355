"""EnvPool: Python environments stepped in worker processes, batched through
shared memory.

Each worker process owns a contiguous slice of every batch's envs. A step sends
each worker a few bytes on its control socket; the worker steps its envs and
writes observations, rewards and done flags straight into one shared region,
whose size comes from the first observation. The result tensors are views of
that region: a batch's tensors stay valid until the next step of that batch.

Workers are fresh interpreters (not forks), so a pool works in a process that
already runs an Rpc's threads; the env factory reaches them through cloudpickle.
"""

from __future__ import annotations

import logging
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from . import _envpool_shared as shared
from . import _signals
from ._core import ShmRegion

__all__ = ["EnvPool", "EnvStepperFuture"]

_log = logging.getLogger("moolib.envpool")
_NONFINITE_MODES = ("raise", "count")


def _torch() -> Any:
    import torch

    return torch


def _describe_exit(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=2.0)
    except subprocess.TimeoutExpired:
        return "closed its socket"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop_workers(procs: list[subprocess.Popen], socks: list[socket.socket]) -> None:
    """Closes the control sockets (workers exit on EOF), then reaps; kills stragglers."""
    for sock in socks:
        try:
            sock.close()
        except OSError:
            pass
    for proc in procs:
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2, 5"``."""
    parts: list[str] = []
    start = prev = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(parts)


def _report(b: int, errors: list[tuple[int, list[int], str]]) -> str:
    """The failures of a step of batch ``b`` (worker, its envs, what happened),
    each distinct one once, naming every env (and worker) it happened to."""
    where: dict[str, list[tuple[int, list[int]]]] = {}
    for w, envs, text in errors:
        where.setdefault(text, []).append((w, envs))
    lines = []
    for text, places in where.items():
        who = "; ".join(
            f"worker {w}" + (f", env{'s' * (len(envs) > 1)} {_ranges(envs)}" if envs else "")
            for w, envs in places
        )
        lines.append(f"{who} of batch {b}{text}")
    return "\n".join(lines)


class EnvStepperFuture:
    """The pending result of ``EnvPool.step``: ``result()`` waits for it."""

    __slots__ = ("_pool", "_batch", "_serial")

    def __init__(self, pool: EnvPool, batch: int, serial: int) -> None:
        self._pool = pool
        self._batch = batch
        self._serial = serial

    def result(self, timeout: float | None = None) -> dict:
        """The batch as a dict of tensors (observation keys, "reward", "done",
        "episode_return", "episode_length"). Raises RuntimeError naming the
        worker and env if an env raised (with its traceback) or returned what
        the pool cannot store, or if a worker died; TimeoutError on timeout."""
        return self._pool._result(self._batch, self._serial, timeout)

    def done(self) -> bool:
        """True when ``result()`` would not block."""
        return self._pool._poll(self._batch, self._serial)


class EnvPool:
    """Steps ``batch_size * num_batches`` envs made by ``create_env()`` in
    ``num_processes`` worker processes.

    ``step(batch_index, action)`` starts a step of one batch and returns an
    ``EnvStepperFuture``. The first step of each batch resets its envs (the
    action is ignored); a finished env is reset at once and its reset
    observation returned with ``done=True``, beside the finished episode's
    ``episode_return`` and ``episode_length`` (zero where ``done`` is False).
    Envs may follow the gymnasium API or the old gym API.

    Every observation must fit the first one's keys, shapes and dtypes. A
    value of another dtype is stored only if it fits without changing: ints
    must lie in the dtype's range (small Python ints into a uint8 image are
    fine, 300 or -1 are not), floats may round to the nearest float32 but not
    overflow, and nothing changes kind (no float into an int array, no None).
    Rewards must be real numbers that fit in float32 (Python or numpy
    numbers, or 0-d arrays and tensors, as the original moolib's test envs
    return). Anything else makes ``result()`` raise RuntimeError naming the
    worker, the env, the key and what was expected and got; that env is
    reset at its next step, and the batch's other envs take their steps as
    usual. A NaN or infinite reward
    raises too, unless ``nonfinite_rewards="count"``: then it is stored as it
    came (the episode's return follows it), counted in
    ``nonfinite_reward_count`` and the first one logged as a warning (logger
    "moolib.envpool").
    """

    def __init__(
        self,
        create_env: Callable[[], Any],
        num_processes: int,
        batch_size: int,
        num_batches: int,
        nonfinite_rewards: str = "raise",
    ) -> None:
        if not callable(create_env):
            # A name or an env object would otherwise fail in every worker.
            raise TypeError(
                "EnvPool: create_env must be a function that makes one env (each worker "
                "calls it once per env it steps), e.g. "
                "functools.partial(moolib.envs.create_env, 'cartpole'); "
                f"got {type(create_env).__name__} {create_env!r:.80}"
            )
        for name, value in (
            ("num_processes", num_processes),
            ("batch_size", batch_size),
            ("num_batches", num_batches),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EnvPool: {name} must be a positive int, got {value!r}")
        if nonfinite_rewards not in _NONFINITE_MODES:
            raise ValueError(
                f"EnvPool: nonfinite_rewards must be 'raise' or 'count', got {nonfinite_rewards!r}"
            )
        if num_processes > batch_size:
            raise ValueError(
                f"EnvPool: num_processes ({num_processes}) exceeds batch_size ({batch_size}); "
                "each process steps a slice of every batch"
            )
        import cloudpickle

        self.batch_size = batch_size
        self.num_batches = num_batches
        self.num_processes = num_processes
        self.nonfinite_rewards = nonfinite_rewards
        #: NaN or infinite rewards stored so far (with nonfinite_rewards="count"),
        #: as of the last result() that collected the workers' answers.
        self.nonfinite_reward_count = 0
        self._procs: list[subprocess.Popen] = []
        self._socks: list[socket.socket] = []
        self._closed = False
        self._broken: str | None = None
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._socks)
        factory = cloudpickle.dumps(create_env)
        try:
            self._start(factory)
        except BaseException:
            self.close()
            raise

    # -- start-up ---------------------------------------------------------

    def _start(self, factory: bytes) -> None:
        bounds = np.linspace(0, self.batch_size, self.num_processes + 1).round().astype(int)
        for w in range(self.num_processes):
            parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._socks.append(parent)
            try:
                with _signals.blocked():  # until the worker ignores them
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "moolib._envpool_worker", str(child.fileno())],
                        pass_fds=[child.fileno()],
                        stdin=subprocess.DEVNULL,
                    )
            finally:
                child.close()
            self._procs.append(proc)
            setup = {
                "sys_path": list(sys.path),
                "create_env": factory,
                "slice": (int(bounds[w]), int(bounds[w + 1])),
                "num_batches": self.num_batches,
                "worker": w,
                "nonfinite_rewards": self.nonfinite_rewards,
            }
            shared.send(parent, shared.INIT, -1, pickle.dumps(setup))

        specs = [pickle.loads(self._expect(w, shared.SPEC)) for w in range(self.num_processes)]
        obs_spec, action_spec = specs[0]
        for w, spec in enumerate(specs[1:], 1):
            if spec != specs[0]:
                raise RuntimeError(
                    f"EnvPool: worker {w}'s envs differ from worker 0's: observations/actions "
                    f"{spec} vs {specs[0]}"
                )
        clash = set(obs_spec) & (set(shared.STAT_KEYS) | {"action"})
        if clash:
            raise ValueError(f"EnvPool: observation keys {sorted(clash)} clash with result keys")
        for key, (dtype, shape) in obs_spec.items():
            if dtype not in shared.STORABLE:
                name = shared.dtype_name(np.dtype(dtype))
                raise RuntimeError(
                    f"EnvPool: the first observation's {key!r} ({name} "
                    f"of shape {shape}) cannot be stored: observations must be bool, int, "
                    "uint, float or complex arrays in native byte order"
                )
        self.observation_spec = obs_spec
        self.action_spec = action_spec
        placed, size = shared.layout(obs_spec, action_spec, self.batch_size, self.num_batches)

        self._region = ShmRegion.create("moolib-envpool", size)
        try:
            message = pickle.dumps((placed, size))
            header = shared._HEADER.pack(shared.LAYOUT, -1, len(message))
            for sock in self._socks:
                socket.send_fds(sock, [header + message], [self._region.fd])
        finally:
            # The workers map it from the fds they received; the memory lives
            # while any mapping does.
            self._region.close()
        for w in range(self.num_processes):
            self._expect(w, shared.READY)

        torch = _torch()
        self._results = []
        self._actions = []
        for b in range(self.num_batches):
            arrays = shared.views(self._region, placed, b)
            self._actions.append(torch.from_numpy(arrays.pop("action")))
            self._results.append({k: torch.from_numpy(v) for k, v in arrays.items()})
        self._action_dtype = self._actions[0].dtype
        self._action_shape = tuple(self._actions[0].shape)
        # Per batch: serial number of the last step started and of the last
        # one whose workers all answered; per worker: batches answered.
        self._started = [0] * self.num_batches
        self._finished = [0] * self.num_batches
        self._answered = [[0] * self.num_batches for _ in range(self.num_processes)]
        self._errors: list[list[str]] = [[] for _ in range(self.num_batches)]

    def _expect(self, w: int, kind: int) -> bytes:
        got, _, payload = self._receive(w)
        if got == shared.FAILED:
            raise RuntimeError(f"EnvPool worker {w}: {payload.decode('utf-8', 'replace')}")
        if got != kind:
            raise RuntimeError(f"EnvPool worker {w}: unexpected message kind {got}")
        return payload

    def _receive(self, w: int) -> tuple[int, int, bytes]:
        try:
            return shared.receive(self._socks[w])
        except (shared.WorkerGone, ConnectionResetError, OSError) as e:
            self._worker_gone(w, None if isinstance(e, shared.WorkerGone) else e)

    def _worker_gone(self, w: int, cause: BaseException | None) -> NoReturn:
        """Marks the pool broken by worker w's end, and raises RuntimeError saying how
        it ended."""
        proc = self._procs[w]
        self._broken = f"EnvPool worker {w} (pid {proc.pid}) {_describe_exit(proc)}"
        raise RuntimeError(self._broken) from cause

    # -- stepping ---------------------------------------------------------

    def step(self, batch_index: int, action: Any) -> EnvStepperFuture:
        """Steps batch ``batch_index`` with ``action`` (a tensor or array of shape
        (batch_size, ...) and the envs' action dtype: int64 for discrete actions).
        Returns at once; ``result()`` on the future waits."""
        self._check_usable()
        if not 0 <= batch_index < self.num_batches:
            raise IndexError(
                f"EnvPool.step: batch_index {batch_index} out of range [0, {self.num_batches})"
            )
        if self._started[batch_index] != self._finished[batch_index]:
            raise RuntimeError(
                f"EnvPool.step: batch {batch_index} already has a step in flight; "
                "call result() on its future first"
            )
        torch = _torch()
        if isinstance(action, np.ndarray):
            action = torch.from_numpy(action)
        if not isinstance(action, torch.Tensor):
            raise RuntimeError(
                f"EnvPool.step: action must be a torch.Tensor or numpy array, "
                f"got {type(action).__name__}"
            )
        if action.dtype != self._action_dtype:
            raise RuntimeError(
                f"EnvPool.step: action dtype must be {self._action_dtype}, got {action.dtype}"
            )
        if tuple(action.shape) != self._action_shape:
            raise RuntimeError(
                f"EnvPool.step: action shape must be {list(self._action_shape)} "
                f"(batch_size x action shape), got {list(action.shape)}"
            )
        self._actions[batch_index].copy_(action)
        header = shared._HEADER.pack(shared.STEP, batch_index, 0)
        for w, sock in enumerate(self._socks):
            try:
                sock.sendall(header)
            except OSError as e:
                # Not a read: answers to other batches may still be in the socket.
                self._worker_gone(w, e)
        self._started[batch_index] += 1
        return EnvStepperFuture(self, batch_index, self._started[batch_index])

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("EnvPool is closed")
        if self._broken:
            raise RuntimeError(self._broken)

    def _absorb(self, w: int) -> None:
        """Reads one answer from worker w."""
        kind, b, payload = self._receive(w)
        if kind == shared.FAILED:
            self._errors[b].extend((w, envs, text) for envs, text in pickle.loads(payload))
        elif kind == shared.STEPPED and payload:
            (count,) = shared.NONFINITE.unpack_from(payload)
            if not self.nonfinite_reward_count:
                first = payload[shared.NONFINITE.size :].decode("utf-8", "replace")
                _log.warning(
                    "EnvPool: worker %d: %s; non-finite rewards are stored as they come and "
                    "counted in EnvPool.nonfinite_reward_count (this is logged once)",
                    w,
                    first,
                )
            self.nonfinite_reward_count += count
        elif kind != shared.STEPPED:
            self._broken = f"EnvPool worker {w}: unexpected message kind {kind}"
            raise RuntimeError(self._broken)
        self._answered[w][b] += 1

    def _answered_all(self, b: int, serial: int, timeout: float | None) -> bool:
        """Reads answers until every worker answered step ``serial`` of batch b;
        False if ``timeout`` seconds (None: no limit) pass first."""
        self._check_usable()
        deadline = None if timeout is None else time.monotonic() + timeout
        for w, sock in enumerate(self._socks):
            while self._answered[w][b] < serial:
                if deadline is not None:
                    left = max(0.0, deadline - time.monotonic())
                    readable, _, _ = select.select([sock], [], [], left)
                    if not readable:
                        return False
                self._absorb(w)
        return True

    def _poll(self, b: int, serial: int) -> bool:
        return self._finished[b] >= serial or self._answered_all(b, serial, 0.0)

    def _result(self, b: int, serial: int, timeout: float | None) -> dict:
        if self._finished[b] >= serial:
            if self._finished[b] > serial or self._started[b] > serial:
                raise RuntimeError(f"EnvPool: this result of batch {b} was overwritten")
            return dict(self._results[b])
        if not self._answered_all(b, serial, timeout):
            raise TimeoutError(f"EnvPool: batch {b} not stepped within {timeout} s")
        self._finished[b] = serial
        errors, self._errors[b] = self._errors[b], []
        if errors:
            raise RuntimeError(
                f"EnvPool: stepping batch {b} failed for the envs below (each is reset at its "
                "next step; the batch's other envs took their step):\n" + _report(b, errors)
            )
        return dict(self._results[b])

    # -- shutdown ---------------------------------------------------------

    def close(self) -> None:
        """Stops the worker processes (waits up to a few seconds, then kills)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
