"""The envpool library's C++ Atari as a second backend, behind moolib.EnvPool's
interface (``step(batch_index, action) -> future``).

envpool is optional (``pip install 'moolib[envpool]'``): it is imported when an
``EnvpoolAtari`` is made, not when ``moolib.envs`` is imported.
"""

from __future__ import annotations

import concurrent.futures
import functools
import secrets
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
from ale_py.registration import rom_id_to_name

from moolib._cpus import task_cores
from moolib._extras import import_extra

from .atari import (
    ATARI_GAMES,
    ATARI_OPTIONS,
    DEFAULT_MAX_EPISODE_FRAMES,
    DEFAULT_NOOP_MAX,
    DEFAULT_REPEAT_ACTION_PROBABILITY,
    FRAME_SKIP,
    FRAME_STACK,
    SCREEN_SIZE,
    atari_game,
    check_atari_options,
    unknown_name_message,
)
from .registry import EnvOption

if TYPE_CHECKING:
    import torch

_MAX_SEED = 2**31 - 1


def import_envpool() -> ModuleType:
    """The envpool module, or an ImportError that names the extra to install."""
    return import_extra("envpool", "envpool", "env.backend=envpool")


@functools.cache
def _envpool_task_ids() -> frozenset[str]:
    return frozenset(import_envpool().list_all_envs())


def envpool_task_id(name: str) -> str:
    """The envpool task id (e.g. ``"Breakout-v5"``) of an Atari short name or
    ALE id. Raises ValueError for unknown names and games envpool lacks."""
    game = atari_game(name)
    if game is None:
        raise ValueError(unknown_name_message(name, ATARI_GAMES))
    task = f"{rom_id_to_name(game)}-v5"
    if task not in _envpool_task_ids():
        raise ValueError(
            f"{name!r} ({task}) is an ALE game that envpool does not provide; "
            "use the gymnasium backend (moolib.envs.create_env) for it"
        )
    return task


# The options of EnvpoolAtari after its sizes, in its order: the env registry's schema
# of env.options on the envpool backend (its threads are the run's num_actor_cpus).
ENVPOOL_OPTIONS: tuple[EnvOption, ...] = (
    EnvOption("num_threads"),
    *ATARI_OPTIONS,
)


class EnvpoolFuture:
    """The pending result of ``EnvpoolAtari.step``: ``result()`` waits for it."""

    __slots__ = ("_owner", "_batch", "_future")

    def __init__(self, owner: EnvpoolAtari, batch: int, future: concurrent.futures.Future) -> None:
        self._owner = owner
        self._batch = batch
        self._future = future

    def result(self, timeout: float | None = None) -> dict[str, torch.Tensor]:
        """The batch as a dict of tensors ("state", "reward", "done",
        "episode_return", "episode_length"); TimeoutError on timeout (the step
        stays in flight; call ``result()`` again)."""
        try:
            out = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"EnvpoolAtari: batch {self._batch} not stepped within {timeout} s"
            ) from None
        finally:
            if self._future.done():
                self._owner._collected(self._batch, self._future)
        return dict(out)

    def done(self) -> bool:
        """True when ``result()`` would not block."""
        return self._future.done()


class EnvpoolAtari:
    """``batch_size * num_batches`` Atari envs run by envpool's C++ threads,
    preprocessed like ``moolib.envs.create_env`` (see ``moolib.envs.atari``):
    up to ``noop_max`` no-op starts, frame skip 4 with max-pooling of the last
    two frames, 84x84 grayscale, a stack of 4 frames (newest last), sticky
    actions, unclipped rewards, episodes truncated after
    ``max_episode_frames // 4`` agent steps, optional ``episodic_life``.

    Same interface as ``moolib.EnvPool``: ``step(batch_index, action)`` sends
    an ``int64`` action tensor (or array) of shape ``(batch_size,)`` to batch
    ``batch_index`` and returns at once with a future whose ``result()`` waits
    for a dict of fresh (never reused) CPU tensors:

    - ``"state"``: ``uint8`` ``(batch_size, 4, 84, 84)``,
    - ``"reward"``: ``float32`` ``(batch_size,)``,
    - ``"done"``: ``bool`` ``(batch_size,)``, terminated or truncated,
    - ``"episode_return"`` (``float32``) and ``"episode_length"`` (``int64``,
      in agent steps): those of the episode that ended at this step where
      ``done`` is True, 0 elsewhere.

    Each batch is one envpool instance of ``batch_size`` envs driven through
    envpool's async API (``async_reset``/``send``, then ``recv`` on a helper
    thread), so the batches step concurrently. At most one step per batch may
    be in flight: a second ``step`` on a batch before ``result()`` raises
    RuntimeError, as do a wrong action shape or dtype and an action outside
    ``[0, num_actions)``.

    Resets, exactly as a caller sees them (envpool resets on the step after
    an episode's end; ``done`` follows ``moolib.EnvPool``'s meaning: this
    observation starts a new episode):

    - The first ``step`` of each batch resets its envs and ignores the
      action: the first observation of each env's episode, reward 0,
      done False.
    - When an env's episode ends at step t, result t holds that episode's
      *last* observation and last reward, with ``done=False``.
    - Step t+1 of that env is the reset step: its action is ignored, it
      returns the first observation of the next episode with reward 0,
      ``done=True`` and the ended episode's ``episode_return`` and
      ``episode_length`` (which count steps up to t).

    So compared with ``moolib.EnvPool`` (which returns the reset observation
    with the last reward and ``done=True`` at step t), an agent sees one
    extra transition per episode: from the last observation, with reward 0,
    into the new episode. Since ``done`` cuts the discounting there, that
    last observation learns a value of 0 (an absorbing terminal state) and
    the returns of the episode are unchanged. With ``episodic_life`` the
    same holds at every lost life, and the reset step continues the game
    rather than starting a new one.

    Other differences from the gymnasium backend: ``noop_max=0`` takes one
    no-op frame (envpool cannot take none); and with ``episodic_life`` the
    observation of the reset step after a lost life is envpool's own (the
    gymnasium backend takes one no-op step and refills the frame stack with
    its frame), so the two backends part ways at the first lost life.

    ``seed``: env ``i`` of batch ``b`` is seeded with
    ``seed + b * batch_size + i``; without a seed a random base is drawn.
    ``num_threads``: envpool threads per batch (default
    ``min(batch_size, the cores this process may run on)``).
    """

    def __init__(
        self,
        name: str,
        batch_size: int,
        num_batches: int,
        num_threads: int | None = None,
        seed: int | None = None,
        *,
        noop_max: int = DEFAULT_NOOP_MAX,
        repeat_action_probability: float = DEFAULT_REPEAT_ACTION_PROBABILITY,
        full_action_space: bool = False,
        max_episode_frames: int = DEFAULT_MAX_EPISODE_FRAMES,
        episodic_life: bool = False,
    ) -> None:
        for arg, value in (("batch_size", batch_size), ("num_batches", num_batches)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EnvpoolAtari: {arg} must be a positive int, got {value!r}")
        if num_threads is None:
            # The cores this process may use (its SLURM task's, or those taskset,
            # cgroups or SLURM's binding leave it), not the machine's: more
            # threads than those only wait.
            num_threads = min(batch_size, task_cores())
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(
                f"EnvpoolAtari: num_threads must be a positive int, got {num_threads!r}"
            )
        num_envs = batch_size * num_batches
        if seed is None:
            seed = secrets.randbelow(_MAX_SEED - num_envs)
        elif not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED - num_envs:
            raise ValueError(
                f"EnvpoolAtari: seed must be an int in [0, {_MAX_SEED - num_envs}], got {seed!r}"
            )
        check_atari_options(
            noop_max,
            repeat_action_probability,
            max_episode_frames,
            full_action_space,
            episodic_life,
        )
        task = envpool_task_id(name)
        envpool = import_envpool()
        import torch

        self._torch = torch
        self.name = name
        self.task_id = task
        self.batch_size = batch_size
        self.num_batches = num_batches
        self._closed = False
        self._envs: list[Any] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        try:
            for b in range(num_batches):
                self._envs.append(
                    envpool.make(
                        task,
                        env_type="gymnasium",
                        num_envs=batch_size,
                        batch_size=batch_size,
                        num_threads=num_threads,
                        seed=seed + b * batch_size,
                        max_episode_steps=max_episode_frames // FRAME_SKIP,
                        # envpool draws 1..noop_max no-op frames, like
                        # gymnasium, but crashes on 0.
                        noop_max=max(noop_max, 1),
                        frame_skip=FRAME_SKIP,
                        stack_num=FRAME_STACK,
                        img_height=SCREEN_SIZE,
                        img_width=SCREEN_SIZE,
                        gray_scale=True,
                        use_inter_area_resize=True,
                        reward_clip=False,
                        episodic_life=episodic_life,
                        zero_discount_on_life_loss=False,
                        use_fire_reset=False,
                        repeat_action_probability=float(repeat_action_probability),
                        full_action_space=full_action_space,
                    )
                )
        except BaseException:
            self.close()
            raise
        self.action_space = self._envs[0].action_space
        self.observation_space = self._envs[0].observation_space
        self.num_actions = int(self.action_space.n)
        self._env_ids = np.arange(batch_size, dtype=np.int32)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_batches, thread_name_prefix="envpool-recv"
        )
        self._pending: list[concurrent.futures.Future | None] = [None] * num_batches
        self._started = [False] * num_batches
        # Running return and length of each env's current episode, and whether
        # its last step ended an episode (so this step is envpool's reset step).
        self._return = [np.zeros(batch_size, np.float64) for _ in range(num_batches)]
        self._length = [np.zeros(batch_size, np.int64) for _ in range(num_batches)]
        self._ended = [np.zeros(batch_size, bool) for _ in range(num_batches)]

    def step(self, batch_index: int, action: Any) -> EnvpoolFuture:
        """Steps batch ``batch_index`` with ``action`` (``int64``, shape
        ``(batch_size,)``). Returns at once; ``result()`` on the future waits."""
        if self._closed:
            raise RuntimeError("EnvpoolAtari is closed")
        if not isinstance(batch_index, int) or not 0 <= batch_index < self.num_batches:
            raise IndexError(
                f"EnvpoolAtari.step: batch_index {batch_index!r} out of range "
                f"[0, {self.num_batches})"
            )
        if self._pending[batch_index] is not None:
            raise RuntimeError(
                f"EnvpoolAtari.step: batch {batch_index} already has a step in flight; "
                "call result() on its future first"
            )
        actions = self._check_action(action)
        env = self._envs[batch_index]
        first = not self._started[batch_index]
        if first:
            env.async_reset()
            self._started[batch_index] = True
        else:
            env.send(actions, self._env_ids)
        assert self._executor is not None
        future = self._executor.submit(self._receive, batch_index, first)
        self._pending[batch_index] = future
        return EnvpoolFuture(self, batch_index, future)

    def _check_action(self, action: Any) -> np.ndarray:
        torch = self._torch
        if isinstance(action, np.ndarray):
            if action.dtype != np.int64:
                raise RuntimeError(
                    f"EnvpoolAtari.step: action dtype must be torch.int64, got numpy {action.dtype}"
                )
            action = torch.from_numpy(action)
        if not isinstance(action, torch.Tensor):
            raise RuntimeError(
                "EnvpoolAtari.step: action must be a torch.Tensor or numpy array, "
                f"got {type(action).__name__}"
            )
        if action.dtype != torch.int64:
            raise RuntimeError(
                f"EnvpoolAtari.step: action dtype must be torch.int64, got {action.dtype}"
            )
        if tuple(action.shape) != (self.batch_size,):
            raise RuntimeError(
                f"EnvpoolAtari.step: action shape must be [{self.batch_size}] (batch_size), "
                f"got {list(action.shape)}"
            )
        actions = action.detach().cpu().numpy()
        if actions.size and (actions.min() < 0 or actions.max() >= self.num_actions):
            raise RuntimeError(
                f"EnvpoolAtari.step: actions must be in [0, {self.num_actions}), got "
                f"values from {actions.min()} to {actions.max()}"
            )
        return actions.astype(np.int32)

    def _receive(self, b: int, first: bool) -> dict[str, torch.Tensor]:
        """Runs on the helper thread: waits for batch b, orders it by env id and
        keeps the episode statistics."""
        obs, reward, terminated, truncated, info = self._envs[b].recv()
        order = np.argsort(info["env_id"])
        obs = np.ascontiguousarray(obs[order])  # a copy: never shared with envpool
        reward = np.asarray(reward, np.float32)[order]
        done = (np.asarray(terminated, bool) | np.asarray(truncated, bool))[order]
        ret, length, ended = self._return[b], self._length[b], self._ended[b]
        # Envs whose episode ended at the previous step are reset at this one:
        # that is where done is reported (as moolib.EnvPool does, it marks the
        # first observation of a new episode), with the ended episode's numbers.
        restarted = np.zeros_like(done) if first else ended.copy()
        episode_return = np.where(restarted, ret, 0.0).astype(np.float32)
        episode_length = np.where(restarted, length, 0).astype(np.int64)
        if first:
            reward[:] = 0.0
            ret[:] = 0.0
            length[:] = 0
        else:
            ret[restarted] = 0.0
            length[restarted] = 0
            stepped = ~restarted
            ret[stepped] += reward[stepped]
            length[stepped] += 1
        ended[:] = done
        done = restarted
        torch = self._torch
        return {
            "state": torch.from_numpy(obs),
            "reward": torch.from_numpy(reward),
            "done": torch.from_numpy(done),
            "episode_return": torch.from_numpy(episode_return),
            "episode_length": torch.from_numpy(episode_length),
        }

    def _collected(self, b: int, future: concurrent.futures.Future) -> None:
        if self._pending[b] is future:
            self._pending[b] = None

    def close(self) -> None:
        """Waits for steps in flight, then frees the envs. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        for env in self._envs:
            try:
                env.close()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass
        self._envs = []

    def __enter__(self) -> EnvpoolAtari:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at collection
            pass
