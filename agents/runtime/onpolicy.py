"""One peer of a training run: acting, batching and data-parallel learning.

The loop, shared by every agent (the agent contributes its loss), runs on two
threads (docs/architecture.md, section 6 draws it):

- the acting thread: an ``EnvPool`` steps ``num_actor_batches`` batches of
  ``actor_batch_size`` envs in ``num_actor_cpus`` processes; while one batch
  steps, the model acts on another (double buffering), with the newest version
  the learner published to ``PolicySlots``. Each actor batch keeps an unroll of
  ``unroll_length + 1`` steps (the last step of an unroll is the first of the
  next, for bootstrapping) with the LSTM core state at its start; full unrolls
  go to a ``Batcher`` that cuts learner batches of ``batch_size`` unrolls on the
  learning device;
- the learner thread: the gradients the agent takes from each learner batch (its
  ``updates``: the whole batch once for V-trace and A2C, epochs of minibatches for
  PPO) go one at a time to the ``Accumulator``, which sums them across the peers of
  the group until ``virtual_batch_size`` unrolls and writes the average back into
  ``.grad`` on every peer; then each peer clips and takes the same optimizer step,
  so models stay identical, and publishes the new version to the actors. The
  leader (the peer with the highest model version) writes checkpoints and hands
  its state to joining peers.

``steps`` counts env steps learned from across the whole group (unrolls in each
applied update times ``unroll_length``, over the agent's ``passes()`` when each
unroll is learned from more than once), so every peer agrees on it, the
learning-rate schedule and ``total_steps``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from moolib.conf.schema.run_config import RunConfig

import moolib
from moolib._cpus import task_cores

from ..nets.models import actor_step, resolve_network
from ..registry import ProcessGroup, Runtime, Update, register_runtime
from .base import (
    LostContact,
    PeerInfo,
    RunLog,
    Runner,
    learning_rate,
    make_envs,
    make_optimizer,
    mean_of,
    param_sum,
)
from .evaluation import PeriodicEval
from .logger import Clock, EpisodeStats
from .normalization import ObservationScaler, ReturnScaler, ScaledObservations
from .policy_slots import PolicySlots

log = logging.getLogger("moolib.agents")

# How long a thread may hold the GIL while another waits for it (Python's default is
# 5 ms), while the loop runs. The acting thread gives up the GIL at every env
# hand-off (a socket send or receive per worker) and must take it back from the
# learner thread: at 5 ms a turn, on a loop whose Python work is small (A2C on
# CartPole), those waits cost up to a third of the acting thread's steps.
_SWITCH_INTERVAL = 0.0005

# Keys of an unroll step: the env's output and what the actor did with it.
_ENV_KEYS = ("state", "reward", "done", "prev_action")
_ACTOR_KEYS = ("action", "policy_logits", "baseline")


# Networks whose learner step is mostly Python (a few hundred small torch calls, each
# holding the GIL): on a CPU, a learner thread would pass the GIL back and forth with
# the acting thread at every call rather than compute beside it.
_PYTHON_BOUND_NETWORKS = ("mlp", "tiny")


def learner_mode(agent: Any, device: torch.device, observation_shape: tuple[int, ...]) -> str:
    """Where the on-policy loop learns: ``thread`` (a learner thread beside the acting
    thread) or ``inline`` (the acting thread learns between its steps), from
    ``agent.learner``; ``auto`` is ``thread`` on CUDA and for networks whose learner
    step is mostly compute, ``inline`` on a CPU for the MLP and tiny networks
    (docs/architecture.md, section 6, has the figures)."""
    if agent.learner != "auto":
        return agent.learner
    network = resolve_network(agent.network, observation_shape)
    if device.type == "cpu" and network in _PYTHON_BOUND_NETWORKS:
        return "inline"
    return "thread"


def torch_threads(cfg: RunConfig) -> int:
    """Torch's intra-op threads for one peer: ``cfg.torch_threads``, or with ``auto``
    the cores this peer may use (its share of the machine, or its SLURM task's
    CPUs) less one per env worker process, at least 1. Torch's default of a
    thread per core makes its threads wait on each other whenever another process
    (an env worker, a neighbour's job) holds a core: many times slower."""
    if cfg.torch_threads != "auto":
        return int(cfg.torch_threads)
    cores = task_cores()
    if cfg.scaling.on_this_machine:  # the peers share its cores
        cores //= max(1, cfg.scaling.peers)
    return max(1, cores - cfg.agent.num_actor_cpus)


class Unroll:
    """The steps of one actor batch since its last full unroll."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.rows: dict[str, torch.Tensor] | None = None
        self.t = 0
        self.core_at_start: tuple = ()
        self.core_at_last: tuple = ()

    def add(self, step: dict[str, torch.Tensor], core_before: tuple) -> dict | None:
        """Adds one step (acted on with ``core_before``); returns a full unroll
        (to be consumed before the next add) when there is one."""
        if self.rows is None:
            self.rows = {
                k: torch.empty((self.length + 1, *v.shape), dtype=v.dtype, device=v.device)
                for k, v in step.items()
            }
            self.core_at_start = core_before
        # One call (see make_optimizer: each torch call may hand the GIL over).
        torch._foreach_copy_([self.rows[k][self.t] for k in step], list(step.values()))
        if self.t == self.length:
            self.core_at_last = core_before
        self.t += 1
        if self.t <= self.length:
            return None
        full = {"batch": self.rows, "core": self.core_at_start}
        return full

    def roll(self) -> None:
        """Starts the next unroll with the last step of the previous one."""
        assert self.rows is not None
        torch._foreach_copy_(
            [v[0] for v in self.rows.values()], [v[-1] for v in self.rows.values()]
        )
        self.core_at_start = self.core_at_last
        self.t = 1


@register_runtime
class OnPolicyRuntime(Runtime):
    """Actors and a data-parallel learner in every peer (``Trainer``), ``scaling.peers``
    of them: the actor-critic agents' runtime, and the default."""

    name = "onpolicy"
    processes = "peers"
    processes_described = "peers"
    training_logs = "{savedir}/peer<rank>/logs.tsv"

    @classmethod
    def process_groups(cls, cfg: RunConfig) -> tuple[ProcessGroup, ...]:
        """``scaling.peers`` alike peers; one that crashes is started again and rejoins."""
        peers = ProcessGroup("peer", 0, cfg.scaling.peers, "peers", False, "crashed", True)
        return (peers,)

    @classmethod
    def logdir(cls, savedir: Path, rank: int, cfg: RunConfig) -> Path:
        """A lone peer logs into the savedir; each of several into ``peer<rank>/``."""
        return savedir if cfg.scaling.peers == 1 else savedir / f"peer{rank}"

    @classmethod
    def make_runner(cls, cfg: RunConfig, rank: int, broker: str) -> Trainer:
        """The Trainer of peer ``rank``."""
        return Trainer(cfg, PeerInfo.of(cls, cfg, rank, broker))


class Trainer(Runner):
    """One peer's training loop (see the module doc)."""

    def __init__(self, cfg: RunConfig, peer: PeerInfo) -> None:
        super().__init__(cfg, peer)
        self.agent = cfg.agent
        torch.set_num_threads(torch_threads(cfg))
        self._announce()

        self.envs, obs_shape, self.actions = make_envs(cfg)
        try:
            self._start(obs_shape)
        except BaseException:
            # A Trainer that fails to start (a savedir with no intact checkpoint, a
            # model that does not fit the device) leaves nothing running: its env
            # workers, and its accumulator's Rpc reaching for the broker.
            if hasattr(self, "accumulator"):
                self.accumulator.close()
            self.envs.close()
            raise

    def _start(self, obs_shape: tuple[int, ...]) -> None:
        """Builds the model, optimizer, accumulator and batcher, and restores the
        experiment's newest checkpoint."""
        cfg, peer = self.cfg, self.peer
        self.model = self.spec.make_network(self.agent, obs_shape, self.actions).to(self.device)
        self.optimizer = make_optimizer(self.agent.optimizer, self.model.parameters())

        self.accumulator = moolib.Accumulator(
            f"moolib-run/{cfg.group}", self.model.parameters(), self.model.buffers()
        )
        self.accumulator.set_virtual_batch_size(self.agent.virtual_batch_size)
        self.accumulator.group.set_timeout(float(cfg.group_timeout))
        self.accumulator.connect(peer.broker)

        self.batcher = moolib.Batcher(self.agent.batch_size, self.device, dim=1)
        # Unrolls (in envs) handed to the batcher, not yet learned from; the actors wait
        # while there are this many (the learner is behind), bounding the policy lag.
        self.backlog = 0
        self.max_backlog = 2 * max(self.agent.batch_size, self.agent.actor_batch_size)
        self._room = threading.Condition()  # guards backlog
        self.env_steps = 0  # env steps the actors took, this process
        # Env steps of this process's gradients offered to the group: what the group did
        # not apply of them (rounds a membership change failed) is counted, not lost.
        self.offered_steps = 0
        # self.steps: env steps learned from, group-wide. An update's unrolls times
        # unroll_length not yet counted as a whole step (< passes), as every peer
        # has it: kept in the state, so a joining or resumed peer counts as the others.
        self.step_remainder = 0
        self._passes = self.agent.passes()
        # The gradients still to take from the learner batch in hand (see _next_update).
        self._updates: Iterator[Update] = iter(())
        self.total_steps = int(cfg.total_steps)
        # agent.observation_scaling, agent.reward_scaling: the statistics are the peer's,
        # kept in its checkpoints.
        self.observation_scaler = (
            ObservationScaler(obs_shape) if self.agent.observation_scaling else None
        )
        self.reward_scaler = (
            ReturnScaler(
                self.agent.num_actor_batches * self.agent.actor_batch_size,
                float(self.agent.discounting),
            )
            if self.agent.reward_scaling
            else None
        )
        self._restore()
        # Between the threads of the loop (see run).
        self.policy = PolicySlots(self.model, self.accumulator.model_version())
        self.actor_version = self.accumulator.model_version()
        self._connected = False  # the learner's accumulator is in the group
        self._learner_done = threading.Event()
        self._learner_error: BaseException | None = None
        self.learner = learner_mode(self.agent, self.device, tuple(obs_shape))
        self._checkpoint_interval = float(cfg.checkpoint_interval)
        # Where the acting thread's CUDA work (and the Batcher's copies) is queued.
        self._act_stream = (
            torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        )

    # -- setup -------------------------------------------------------------

    def connect(self, broker: str) -> None:
        """Joins the group through the broker at ``broker`` (one that moved)."""
        self.accumulator.connect(broker)

    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "step_remainder": self.step_remainder,
            "model_version": self.accumulator.model_version(),
            "param_sum": param_sum(self.model),
            "elapsed": self.elapsed,
            **self._scaling_state(),
        }

    def _scaling_state(self) -> dict:
        scalers = {
            "observation_scaling": self.observation_scaler,
            "reward_scaling": self.reward_scaler,
        }
        return {k: v.state_dict() for k, v in scalers.items() if v is not None}

    def evaluated_model(self) -> torch.nn.Module:
        """What an evaluation plays: the model, fed observations scaled as the actors scale
        them now (``agent.observation_scaling``)."""
        if self.observation_scaler is None:
            return self.model
        stats = self.observation_scaler.state_dict()
        return ScaledObservations(self.model, stats["mean"], stats["var"])

    def _load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        # Checkpoints written before it had none: every agent then learned once a batch.
        self.step_remainder = int(state.get("step_remainder", 0))
        if self.observation_scaler is not None and "observation_scaling" in state:
            self.observation_scaler.load_state_dict(state["observation_scaling"])
        if self.reward_scaler is not None and "reward_scaling" in state:
            self.reward_scaler.load_state_dict(state["reward_scaling"])

    def _resume(self, state: dict) -> None:
        self._load(state)
        self.accumulator.set_model_version(int(state["model_version"]))

    def _may_write(self) -> bool:
        # Only the leader of the group as it is now: not a peer that is out of it, nor
        # one that was paused and does not know yet that another leads.
        return self.accumulator.is_leader() and self.accumulator.connected()

    def _save(self, final: bool = False) -> bool:
        """Writes a checkpoint if this peer leads a connected group; returns whether it
        did. A write that fails (full disk, I/O error) is logged and training goes on:
        the previous checkpoint stays and the next interval tries again; the
        ``final`` one raises ``checkpoint.FinalWriteError`` instead."""
        if not self._may_write():
            log.info(
                "step %d: not writing a checkpoint: this peer is not the leader of a "
                "connected group",
                self.steps,
            )
            return False
        # Writing a large checkpoint to a slow filesystem may outlast the group timeout.
        with self.accumulator.group.keepalive():
            state = self._checkpoint_state()
            state["lineage"] = self.accumulator.lineage()
            return self._save_checkpoint(state, final, may_write=self._may_write)

    def _save_final(self) -> None:
        """The end-of-run checkpoint: written by the leader alone. A group that is
        re-forming (a peer that finished first left it) gets up to group_timeout
        seconds to settle, so that the leader is connected when it decides."""
        deadline = time.monotonic() + float(self.cfg.group_timeout)
        while not self.accumulator.connected() and time.monotonic() < deadline:
            self.accumulator.update()
            time.sleep(0.01)
        self._save(final=True)

    def _leave_with_the_group(self) -> None:
        """Waits, up to ``group_timeout`` seconds, until every member of the group has
        finished too. The members reach ``total_steps`` on the same update, but its
        sum reaches some of them before others: one that left at once would fail that
        round on a member still waiting for it, which would then drop the update and
        train on alone, ending on another model than the rest."""
        group = self.accumulator.group
        if not self.accumulator.connected():
            return
        with group.keepalive():
            finished = group.all_reduce(f"moolib-run/{self.cfg.group}/finished", 1)
            # A member that does not come (stuck, or still training because its last
            # round failed for another reason) fails it, or the wait ends: leave anyway.
            finished.wait(float(self.cfg.group_timeout))

    # -- the loop ------------------------------------------------------------
    #
    # Two threads (docs/architecture.md, section 6). The acting thread (the caller of
    # ``run``) steps the envs, acts on the front slot of ``PolicySlots`` and hands
    # full unrolls to the Batcher. The learner thread owns the model, the optimizer,
    # the accumulator, the log rows and the checkpoints: it learns from the
    # Batcher's batches and publishes each update to the slots.

    def _act(
        self,
        policy: torch.nn.Module,
        env_out: dict,
        core: tuple,
        prev_action: torch.Tensor,
        envs: slice,
    ) -> tuple[dict, Any]:
        # One step of each env (of ``envs``, of all the actors' envs): what the unroll
        # keeps, and the network's [T=1, B] input.
        step = actor_step(env_out, prev_action, self.device)
        if self.observation_scaler is not None:
            step["state"] = self.observation_scaler(step["state"])
        if self.reward_scaler is not None:
            step["reward"] = self.reward_scaler(step["reward"], step["done"], envs).to(
                step["reward"].device
            )
        with torch.no_grad():
            out, core = policy({k: v[None] for k, v in step.items()}, core)
        for k in _ACTOR_KEYS:
            step[k] = out[k][0]
        return step, core

    def _next_update(self, wait: bool) -> Update | None:
        """The next gradient to take: the next of the learner batch in hand, else the
        first of a ready learner batch (with ``wait``, waiting a little for one); None
        when there is none."""
        update = next(self._updates, None)
        if update is not None:
            return update
        try:
            # Blocks, without the GIL, until the actors hand over a batch: a learner
            # that polled would take the GIL from the acting thread at every poll.
            item = self.batcher.get(timeout=0.05 if wait else 0)
        except TimeoutError:
            return None
        with self._room:
            self.backlog -= self.agent.batch_size
            self._room.notify_all()
        batch = self._on_learner_stream(item["batch"])
        core = self._on_learner_stream(tuple(item["core"]))
        self.offered_steps += self.agent.batch_size * self.agent.unroll_length
        self._updates = iter(self.spec.updates(self.agent, batch, core))
        return next(self._updates, None)

    def _learn(self, stats: dict, wait: bool = True) -> bool:
        """Offers the accumulator the next gradient of a learner batch (with ``wait``,
        waiting a little for a batch) and applies summed gradients; returns whether
        there was anything to do."""
        acc = self.accumulator
        worked = False
        if acc.wants_gradients():
            update = self._next_update(wait)
            if update is not None:
                worked = True
                self.model.zero_grad(set_to_none=True)
                outputs, _ = self.model({k: update.batch[k] for k in _ENV_KEYS}, update.core)
                loss, loss_stats = self.loss_fn(self.agent, outputs, update.batch)
                loss.backward()
                acc.reduce_gradients(update.size)
                for k, v in loss_stats.items():
                    stats.setdefault(k, []).append(v)
        acc.update()
        if acc.has_gradients():
            worked = True
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.agent.grad_norm_clipping, foreach=True
            )
            summed = acc.get_gradient_stats()
            learned = summed["batch_size"] * self.agent.unroll_length + self.step_remainder
            self.steps += learned // self._passes
            self.step_remainder = learned % self._passes
            lr = learning_rate(self.agent.optimizer, self.steps, self.total_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            acc.zero_gradients()
            self.policy.publish(self.model, acc.model_version())
            stats.setdefault("grad_norm", []).append(float(grad_norm))
            stats["learning_rate"] = [lr]
            stats["virtual_batch_size"] = [summed["batch_size"]]
            stats["num_gradients"] = [summed["num_gradients"]]
        return worked

    def _on_learner_stream(self, tensors: Any) -> Any:
        """On CUDA: makes the learner's stream wait for the acting stream's copies into
        ``tensors`` (the Batcher fills batches there), and keeps the allocator from
        handing their memory back to the acting stream while the learner reads it."""
        if self._act_stream is None:
            return tensors
        stream = torch.cuda.current_stream(self.device)
        stream.wait_stream(self._act_stream)
        for t in moolib.nest.flatten(tensors):
            t.record_stream(stream)
        return tensors

    def _learner_loop(self, halt: threading.Event, rows: _Rows) -> None:
        """The learner thread: learns until ``total_steps`` or ``halt``; writes the log
        rows and periodic checkpoints. An exception ends it and is kept in
        ``self._learner_error`` for the acting thread to raise."""
        stream = torch.cuda.Stream(self.device) if self._act_stream is not None else None
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while self.steps < self.total_steps and not halt.is_set():
                    self._learner_step(rows, wait=True)
                if stream is not None:
                    stream.synchronize()
        except BaseException as e:
            self._learner_error = e
        finally:
            self._learner_done.set()
            with self._room:
                self._room.notify_all()

    def _learner_step(self, rows: _Rows, wait: bool) -> None:
        """One turn of the learner: the group, a learner batch if one is ready (with
        ``wait``, waits a little for one), a log row and a checkpoint when due. Sets
        ``_learner_done`` at ``total_steps``."""
        acc = self.accumulator
        acc.update()
        if acc.group.active():
            self._in_group.heard()
        else:
            self._in_group.check(
                f"peer {self.peer.rank} has been out of its group for "
                f"{self._in_group.timeout:g} s (lost_group_timeout): the broker at "
                f"{self.peer.broker} is gone or unreachable; stopping"
            )
        if acc.wants_state():
            acc.set_state(self._state())
        if acc.has_new_state():
            self._load(acc.state())
            self.policy.publish(self.model, acc.model_version())
        self._connected = acc.connected()
        worked = self._connected and self._learn(rows.stats, wait)
        rows.maybe_write()
        if (
            time.monotonic() - self._checkpoint_time >= self._checkpoint_interval
            and acc.is_leader()
        ):
            self.elapsed = rows.clock()
            self._save()
            self._checkpoint_time = time.monotonic()
        if self.steps >= self.total_steps:
            self._learner_done.set()
        elif wait and not worked and not (self._connected and acc.wants_gradients()):
            # Waiting for the group's sum of gradients (or to join the group).
            if not acc.wait_gradients(0.05):
                time.sleep(0.001)

    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        """Trains until ``total_steps`` (or ``stop`` is set); returns the last log row.
        An exception of the learner thread ends the run and is raised here."""
        agent = self.agent
        stop = stop or threading.Event()
        rows = _Rows(self, Clock(self.elapsed))

        nb = agent.num_actor_batches
        unrolls = [Unroll(agent.unroll_length) for _ in range(nb)]
        cores = [
            tuple(s.to(self.device) for s in self.model.initial_state(agent.actor_batch_size))
            for _ in range(nb)
        ]
        prev_actions = [self.actions.zeros(agent.actor_batch_size, self.device) for _ in range(nb)]
        size = agent.actor_batch_size
        batch_envs = [slice(b * size, (b + 1) * size) for b in range(nb)]
        halt = threading.Event()
        switch_interval = sys.getswitchinterval()
        learner = threading.Thread(
            target=self._learner_loop, args=(halt, rows), name="moolib-learner", daemon=True
        )
        b = 0
        try:
            noop = self.actions.zeros(agent.actor_batch_size)
            futures = [self.envs.step(b, noop) for b in range(nb)]
            rows.start()
            sys.setswitchinterval(_SWITCH_INTERVAL)
            # The learner's clocks: of its checkpoints, and of its group last seen active.
            self._checkpoint_time = time.monotonic()
            self._in_group = LostContact(float(self.cfg.lost_group_timeout))
            inline = self.learner == "inline"
            if inline:
                # While the actors wait for room, the acting thread learns.
                learn: Callable[[], None] | None = functools.partial(
                    self._learner_step, rows, wait=True
                )
            else:
                learn = None
                learner.start()
            while not stop.is_set() and not self._learner_done.is_set():
                env_out = futures[b].result()
                done = env_out["done"]
                if bool(done.any()):
                    with rows.lock:
                        # A stop that came with a row (set while it was written) ends
                        # the run with that row: no episode after it.
                        if stop.is_set():
                            break
                        rows.episodes.add(
                            env_out["episode_return"][done].tolist(),
                            env_out["episode_length"][done].tolist(),
                        )
                core_before = cores[b]
                with self.policy.acting() as (policy, version):
                    step, cores[b] = self._act(
                        policy, env_out, cores[b], prev_actions[b], batch_envs[b]
                    )
                self.actor_version = version
                prev_actions[b] = step["action"]
                # The env's output is a view of shared memory that the next step
                # of this batch overwrites: copy it into the unroll first.
                full = unrolls[b].add(step, core_before)
                futures[b] = self.envs.step(b, self.actions.clip(step["action"].cpu()))
                self.env_steps += agent.actor_batch_size
                if full is not None:
                    # Unrolls the learner cannot take (not in the group yet) are
                    # dropped; when it is behind, the actors wait for it.
                    if self._connected and self._wait_for_room(stop, learn):
                        self.batcher.cat(full)
                    unrolls[b].roll()
                b = (b + 1) % nb
                if inline:
                    self._learner_step(rows, wait=False)
            halt.set()
            if not inline:
                learner.join()
            if self._learner_error is not None:
                raise self._learner_error
            self.elapsed = rows.final()
            self._save_final()
            if self.steps >= self.total_steps:
                self._leave_with_the_group()
        finally:
            halt.set()
            if learner.is_alive():
                learner.join()
            sys.setswitchinterval(switch_interval)
            rows.close()
            self.envs.close()
            # Its Rpc and group: left open, they would reach for this run's broker
            # until collected (another point of a sweep runs in this process).
            self.accumulator.close()
        return rows.last

    def _wait_for_room(
        self, stop: threading.Event, learn: Callable[[], None] | None = None
    ) -> bool:
        """Waits until the learner's backlog has room for an unroll (or the run ends:
        then False), and counts the unroll in. With ``learn`` (inline learning) the
        wait is spent in turns of the learner instead."""
        width = self.agent.actor_batch_size
        with self._room:  # reentrant: a learner turn takes it too
            while self.backlog + width > self.max_backlog:
                if stop.is_set() or self._learner_done.is_set():
                    return False
                if learn is not None:
                    learn()
                else:
                    self._room.wait(0.1)
            self.backlog += width
        return True


class _Rows:
    """The run's log rows, to logs.tsv, the progress line and wandb: one every
    ``log_interval`` seconds, written by the learner thread, and a last one at the
    end. The acting thread adds finished episodes to ``episodes`` under ``lock``,
    which a row holds from taking them until it is written."""

    def __init__(self, trainer: Trainer, clock: Clock) -> None:
        self.trainer = trainer
        self.clock = clock
        self.interval = float(trainer.cfg.log_interval)
        self.log = RunLog(trainer, f"peer {trainer.peer.rank}")
        # The peers hold the same weights: the first evaluates them.
        self.evals = PeriodicEval(trainer.cfg, trainer.steps, enabled=trainer.peer.rank == 0)
        self.episodes = EpisodeStats()
        self.lock = threading.Lock()
        self.stats: dict[str, list] = {}  # the learner's, since the last row
        self.last: dict[str, Any] = {}
        self._time, self._steps, self._env_steps = clock(), trainer.steps, trainer.env_steps

    def start(self) -> None:
        self.log.start(self._time, self._steps)

    def maybe_write(self) -> None:
        """Writes a row if ``log_interval`` has passed since the last one."""
        now = self.clock()
        if now - self._time >= self.interval:
            self._write(now)

    def final(self) -> float:
        """The last row, for what the run did since the previous one; none when it
        learned nothing and no episode ended (stopped right after a row): a row at that
        row's step would take its place in moolib-plot and the summary, with no return.
        Returns the run's elapsed time."""
        now = self.clock()
        if not self.last or self.trainer.steps != self._steps or len(self.episodes):
            self._write(now)
        return now

    def _write(self, now: float) -> None:
        t = self.trainer
        interval = max(1e-9, now - self._time)
        row: dict[str, Any] = {
            "step": t.steps,
            "sps": (t.steps - self._steps) / interval,
            "env_sps": (t.env_steps - self._env_steps) / interval,
            "model_version": t.accumulator.model_version(),
            # The version the actors acted with last: behind model_version by the
            # updates the learner made since they took the front slot.
            "actor_model_version": t.actor_version,
            "param_sum": param_sum(t.model),
            "peers": len(t.accumulator.group.members()) if t.accumulator.connected() else 0,
            # This process's totals: env steps acted, and those offered as gradients.
            "env_steps": t.env_steps,
            "offered_steps": t.offered_steps,
            "time": now,
        }
        for k, values in self.stats.items():
            row[k] = mean_of(values)
        # A row at total_steps is the run's last: it waits for the evaluation under way.
        row.update(self.evals.columns(t.steps, t.evaluated_model, final=t.steps >= t.total_steps))
        with self.lock:
            row.update(self.episodes.take())
            self.log.write(row)
            self.last = row
        self.stats = {}
        self._time, self._steps, self._env_steps = now, t.steps, t.env_steps

    def close(self) -> None:
        self.evals.close()
        self.log.close()
