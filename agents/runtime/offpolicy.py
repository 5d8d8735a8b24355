"""The off-policy runtime (Ape-X, R2D2): actors feeding one learner's prioritized replay.

Roles (docs/architecture.md, "The off-policy runtime", draws them):

- The **learner** (``Learner``, peer rank 0) owns the ``moolib.Replay`` in its
  process and serves it over its ``Rpc`` under ``replay``; it samples as fast as
  the replay's rate limiter lets it, takes the agent's loss with a target
  network, writes the new priorities back, copies the online net to the target
  every ``target_update`` steps, and publishes its weights
  (``moolib.Publisher``, ``weights``) every ``publish_interval`` steps. Actors
  report their env steps and episodes to it (``actor_report``); its answer tells
  them when the run is over. It writes logs.tsv, the progress line, wandb and
  the checkpoints (model, target, optimizer, and the replay if ``save_replay``).
- **Actors** (``ActorLoop``): each loop steps ``num_actor_batches`` batches of
  ``actor_batch_size`` envs in a ``moolib.EnvPool`` and runs one batched forward
  of the agent's network per step; each env has its own epsilon from Ape-X's
  schedule over every env of the run. Replay items go to the learner in batches
  through a ``moolib.ReplayClient`` with the actor's own initial priorities;
  weights come from a ``moolib.Subscriber`` every ``weight_sync`` env steps.
  Actors never wait for the learner to learn (only on the replay's rate limiter,
  when ``samples_per_insert`` sets one).

Actors find the learner by name (``moolib-run/<group>/learner``) through the
broker, so a killed actor or a new one changes nothing on the learner's side.
With ``scaling=single`` the actor loops are threads of the learner's process;
with ``scaling=local`` and ``scaling=slurm`` they are ``scaling.actors``
processes (SLURM: jobs of an array) of ``actor_loops`` threads each. A learner
that restarts (a requeued SLURM job) resumes from its checkpoint; its actors
see its new uid in the answer to their reports and fetch its weights again.
Loops in one process run their models concurrently: torch releases the GIL
inside its ops, and each process uses one intra-op thread per loop.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from moolib.conf.schema.run_config import RunConfig
from moolib.envs.actions import ActionSpace
from torch import nn

import moolib
from moolib._cpus import task_cores

from ..math.apex import epsilon_schedule
from ..math.offpolicy import importance_weights
from ..registry import ProcessGroup, QConfig, Runtime, get_agent, register_runtime
from .base import (
    GroupLostError,
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
from .host_results import HostResults
from .logger import EVAL_COLUMNS, Clock

log = logging.getLogger("moolib.agents")

# Columns of an off-policy run's logs.tsv. Episode returns are split by the acting
# env's epsilon: the greedy actors' returns show what the policy has learned.
COLUMNS = (
    "step",
    "sps",
    "env_sps",
    "mean_episode_return",
    "mean_episode_length",
    "episodes",
    "return_eps_lt_0.01",
    "return_eps_lt_0.1",
    "return_eps_ge_0.1",
    "total_loss",
    "mean_abs_td",
    "grad_norm",
    "learning_rate",
    "updates",
    "updates_per_s",
    "samples_per_s",
    "inserts_per_s",
    "sample_insert_ratio",
    "replay_size",
    "actors",
    "model_version",
    "param_sum",
    *EVAL_COLUMNS,
    "time",
)
EPS_BUCKETS = ((0.01, "return_eps_lt_0.01"), (0.1, "return_eps_lt_0.1"))
# Seconds between an actor's reports to the learner.
REPORT_INTERVAL = 1.0
# An actor that has not reported for this long no longer counts as one.
ACTOR_STALE = 15.0
REPLAY_FILE = "replay.bin"
# Episodes seen with an empty replay before R2D2 says that none is long enough.
SHORT_EPISODES = 200


def learner_name(group: str) -> str:
    """The Rpc name of an experiment's learner (actors address it by this)."""
    return f"moolib-run/{group}/learner"


def num_actor_processes(cfg: RunConfig) -> int:
    """Actor processes of the run: ``scaling.actors`` beside the learner, or none when the
    actors are threads of the learner's process (``scaling=single``)."""
    return cfg.scaling.actor_processes


def _typed(cfg: RunConfig) -> QConfig:
    """The run's agent settings; only the off-policy agents run here."""
    agent = cfg.agent
    if not isinstance(agent, QConfig):
        raise TypeError(f"agent {agent.name} is not an off-policy agent")
    return agent


def make_qnet(cfg: QConfig, obs_shape: Sequence[int], num_actions: int | ActionSpace) -> nn.Module:
    """The agent's Q-network, as its spec builds it: the one definition the learner
    and every actor build."""
    return get_agent(cfg.name).make_network(cfg, obs_shape, num_actions)


def make_acting(cfg: QConfig, epsilons: torch.Tensor, model: nn.Module) -> Any:
    """The acting state of one actor batch of the agent ``cfg`` describes (its spec's)."""
    acting = get_agent(cfg.name).acting
    assert acting is not None, f"{cfg.name} does not act off-policy"
    return acting(cfg, epsilons, model)


def _env_factory(cfg: RunConfig) -> tuple[Any, tuple[int, ...], int]:
    from moolib.envs import env_factory

    return env_factory(cfg.env.name, cfg.env.option_values())


# -- actors ------------------------------------------------------------------------------------


class ActorLoop:
    """One actor loop: its envs, its copy of the network, its replay client.

    ``index`` numbers the loop among all loops of the run (``num_loops``), which
    places its envs in the run's epsilon schedule."""

    def __init__(
        self,
        cfg: RunConfig,
        agent: QConfig,
        rpc: moolib.Rpc,
        index: int,
        num_loops: int,
        seed: int | None,
    ) -> None:
        self.cfg = cfg
        self.agent = agent
        self.rpc = rpc
        self.index = index
        self.learner = learner_name(str(cfg.group))
        agent = self.agent
        if seed is not None:
            torch.manual_seed(seed)
        self.envs, obs_shape, num_actions = make_envs(cfg)
        self.model = make_qnet(agent, obs_shape, num_actions)
        self.model.eval()
        per_loop = agent.num_actor_batches * agent.actor_batch_size
        schedule = epsilon_schedule(
            num_loops * per_loop, agent.epsilon, agent.epsilon_alpha, dtype=torch.float32
        )
        mine = schedule[index * per_loop : (index + 1) * per_loop]
        self.epsilons = mine.view(agent.num_actor_batches, agent.actor_batch_size)
        self.acting = [make_acting(agent, eps, self.model) for eps in self.epsilons]
        timeout = float(cfg.lost_group_timeout)
        self.replay = moolib.ReplayClient(rpc, (self.learner, "replay"), timeout=timeout)
        self.weights = moolib.Subscriber(rpc, self.learner, "weights")
        self.env_steps = 0
        self.inserted = 0
        self.learner_uid: str | None = None  # the learner process heard from last

    def _report(self, steps: int, episodes: list) -> bool:
        """Tells the learner what this loop did; returns whether the run is over."""
        answer = self.rpc.sync(
            self.learner, "actor_report", self.rpc.get_name(), self.index, steps, episodes
        )
        uid = answer.get("learner")
        if self.learner_uid is not None and uid != self.learner_uid:
            # A new learner process (a requeued SLURM job, resumed from its checkpoint):
            # its weight versions start again below those this loop holds, which a
            # Subscriber would wait to see exceeded; a new one takes the next version.
            log.info("actor loop %d: the learner restarted: fetching its weights", self.index)
            self.weights = moolib.Subscriber(self.rpc, self.learner, "weights")
            self.weights.fetch_into(self.model)
        self.learner_uid = uid
        return bool(answer["stop"])

    def _wait_for_learner(self, stop: threading.Event) -> bool:
        """Waits until the learner has published weights (and so serves the replay);
        False if stopped or the learner stayed unreachable for lost_group_timeout."""
        contact = LostContact(float(self.cfg.lost_group_timeout))
        while not stop.is_set():
            try:
                if self.weights.fetch_into(self.model):
                    return True
            except moolib.RpcError:
                pass
            contact.check(
                f"actor loop {self.index}: the learner {self.learner} did not answer in "
                f"{self.cfg.lost_group_timeout} s (lost_group_timeout); stopping"
            )
            stop.wait(0.2)
        return False

    def run(self, stop: threading.Event) -> None:
        """Acts until the learner says the run is over or ``stop`` is set."""
        agent = self.agent
        nb = agent.num_actor_batches
        try:
            if not self._wait_for_learner(stop):
                return
            log.info(
                "actor loop %d: acting on %d envs (epsilon %.2g..%.2g) for %s",
                self.index,
                self.epsilons.numel(),
                float(self.epsilons.max()),
                float(self.epsilons.min()),
                self.learner,
            )
            noop = torch.zeros(agent.actor_batch_size, dtype=torch.int64)
            futures = [self.envs.step(b, noop) for b in range(nb)]
            since_sync = 0
            unreported = 0
            episodes: list[tuple[float, float, int]] = []
            last_report = time.monotonic()
            contact = LostContact(float(self.cfg.lost_group_timeout))
            b = 0
            while not stop.is_set():
                env_out = futures[b].result()
                done = env_out["done"]
                if bool(done.any()):
                    eps = self.epsilons[b][done].tolist()
                    returns = env_out["episode_return"][done].tolist()
                    lengths = env_out["episode_length"][done].tolist()
                    episodes.extend(zip(eps, returns, lengths, strict=True))
                # The step copies what it keeps of env_out before the next env step
                # overwrites that shared memory.
                action, out = self.acting[b].step(env_out, self.model)
                futures[b] = self.envs.step(b, action)
                unreported += agent.actor_batch_size
                since_sync += agent.actor_batch_size
                if out is not None:
                    items, priorities = out
                    try:
                        self.replay.insert(items, priorities)
                        self.inserted += len(priorities)
                    except (moolib.ReplayError, moolib.RpcError, TimeoutError) as e:
                        # The learner is ending (its replay closed), gone or stalled.
                        try:
                            if self._report(0, []):
                                return
                        except moolib.RpcError:
                            pass
                        log.warning("actor loop %d: insert failed: %s", self.index, e)
                        last_report = 0.0
                # Every env of the loop has taken weight_sync steps since the last fetch.
                if since_sync >= agent.weight_sync * nb * agent.actor_batch_size:
                    since_sync = 0
                    try:
                        self.weights.fetch_into(self.model)
                    except moolib.RpcError as e:
                        log.warning("actor loop %d: weight fetch failed: %s", self.index, e)
                now = time.monotonic()
                if now - last_report >= REPORT_INTERVAL:
                    try:
                        if self._report(unreported, episodes):
                            return
                        contact.heard()
                        unreported, episodes = 0, []
                    except moolib.RpcError as e:
                        contact.check(
                            f"actor loop {self.index}: the learner {self.learner} is "
                            f"gone ({e}); stopping"
                        )
                    last_report = now
                b = (b + 1) % nb
        finally:
            self.envs.close()


def make_actor_loops(cfg: RunConfig, rpc: moolib.Rpc, first: int, count: int) -> list[ActorLoop]:
    """``count`` actor loops (global indices ``first..first+count-1``), their env
    workers started from this thread (so they inherit its signal mask: a SLURM
    job blocks USR2 there, which is for its main process only)."""
    agent = _typed(cfg)
    num_loops = max(1, num_actor_processes(cfg)) * agent.actor_loops
    seed = cfg.seed
    loops: list[ActorLoop] = []
    try:
        for index in range(first, first + count):
            loops.append(
                ActorLoop(cfg, agent, rpc, index, num_loops, None if seed is None else seed + index)
            )
    except BaseException:
        for loop in loops:
            loop.envs.close()
        raise
    return loops


def run_actor_loops(loops: list[ActorLoop], stop: threading.Event) -> list[BaseException]:
    """Runs the actor loops, one thread each, until they end; returns the errors they raised."""
    errors: list[BaseException] = []

    def one(loop: ActorLoop) -> None:
        try:
            loop.run(stop)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)
            stop.set()

    threads = [
        threading.Thread(target=one, args=(loop,), name=f"moolib-actor-{loop.index}")
        for loop in loops
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


class Actor:
    """An actor process of ``scaling=local``/``slurm``: ``actor_loops`` loops sharing one Rpc."""

    def __init__(self, cfg: RunConfig, index: int, broker: str) -> None:
        self.cfg = cfg
        self.index = index
        count = _typed(cfg).actor_loops
        # One intra-op thread per loop: the loops are the parallelism.
        torch.set_num_threads(1)
        self.rpc = moolib.Rpc()
        self.rpc.set_name(f"{learner_name(str(cfg.group))}-actor{index}-{os.getpid()}")
        self.rpc.set_timeout(30)
        self.rpc.connect(broker)
        try:
            self.loops = make_actor_loops(cfg, self.rpc, index * count, count)
        except BaseException:
            self.rpc.close()
            raise

    def connect(self, broker: str) -> None:
        """Finds the learner through the broker at ``broker`` too (one that moved)."""
        self.rpc.connect(broker)

    def run(self, stop: threading.Event) -> dict:
        """Acts until the learner ends the run, ``stop`` is set, or the learner is lost."""
        try:
            errors = run_actor_loops(self.loops, stop)
        finally:
            self.rpc.close()
        if errors:
            raise errors[0]
        return {}


# -- the learner -------------------------------------------------------------------------------


class _Reports:
    """What the actors told the learner since the last log row (filled on Rpc threads)."""

    def __init__(self) -> None:
        # Tells the actors when the learner they report to is another process.
        self.uid = moolib.create_uid()
        self.lock = threading.Lock()
        self.env_steps = 0
        self.episodes: list[tuple[float, float, int]] = []
        # Per actor loop (its index in the run): when it last reported, and from where.
        self.seen: dict[int, tuple[float, str]] = {}
        self.stop = False
        self.told: set[int] = set()  # loops answered that the run is over

    def add(self, actor: str, index: int, steps: int, episodes: list) -> dict:
        with self.lock:
            self.env_steps += int(steps)
            self.episodes.extend(episodes)
            # Keyed by the loop's index, not by its process's Rpc name (which holds the
            # pid): a restarted actor takes over its predecessor's entry rather than
            # counting beside it until that one goes stale. Loops of one process
            # share its name and have their own indices: loops are counted.
            loop = int(index)
            self.seen[loop] = (time.monotonic(), actor)
            if self.stop:
                self.told.add(loop)
            return {"stop": self.stop, "learner": self.uid}

    def all_told(self) -> bool:
        """Whether every loop heard from lately has been told that the run is over."""
        with self.lock:
            now = time.monotonic()
            return all(k in self.told for k, (t, _) in self.seen.items() if now - t < ACTOR_STALE)

    def pending(self) -> tuple[int, int]:
        """Env steps and episodes reported since they were last taken (left there)."""
        with self.lock:
            return self.env_steps, len(self.episodes)

    def take_steps(self) -> int:
        """Env steps reported since the last call."""
        with self.lock:
            steps, self.env_steps = self.env_steps, 0
        return steps

    def take(self) -> tuple[list, int]:
        """The episodes reported since the last call, and the actors heard from lately."""
        with self.lock:
            episodes, self.episodes = self.episodes, []
            now = time.monotonic()
            live = sum(1 for t, _ in self.seen.values() if now - t < ACTOR_STALE)
        return episodes, live


def _episode_columns(episodes: list) -> dict[str, Any]:
    row: dict[str, Any] = {"episodes": len(episodes)}
    returns = [r for _, r, _ in episodes]
    lengths = [n for _, _, n in episodes]
    row["mean_episode_return"] = sum(returns) / len(returns) if returns else math.nan
    row["mean_episode_length"] = sum(lengths) / len(lengths) if lengths else math.nan
    for limit, column in EPS_BUCKETS:
        picked = [r for e, r, _ in episodes if e < limit]
        row[column] = sum(picked) / len(picked) if picked else math.nan
    high = [r for e, r, _ in episodes if e >= EPS_BUCKETS[-1][0]]
    row["return_eps_ge_0.1"] = sum(high) / len(high) if high else math.nan
    return row


class Learner(Runner):
    """The learner of an off-policy run (see the module doc)."""

    def __init__(self, cfg: RunConfig, peer: PeerInfo) -> None:
        super().__init__(cfg, peer)
        self.agent = _typed(cfg)
        agent = self.agent
        # The new priorities and published weights of a step, read one step later on
        # a GPU so that the host never waits for the step it just queued.
        self.host = HostResults(self.device)
        cores = task_cores()
        if cfg.torch_threads != "auto":
            threads = int(cfg.torch_threads)
        elif num_actor_processes(cfg) == 0:
            # The actor loops and their env workers share this process's cores.
            threads = max(1, cores - agent.num_actor_cpus - agent.actor_loops)
        else:
            threads = max(1, cores // 2)
        torch.set_num_threads(threads)
        actors = num_actor_processes(cfg)
        where = f"{actors} actor processes" if actors else "threads of the learner's process"
        self._announce(
            peers=1,  # the learner; the actors are on the next line
            more=f"\n  actors   {agent.actor_loops} loop(s) of {agent.num_actor_batches}x"
            f"{agent.actor_batch_size} envs, {where}",
        )
        _, obs_shape, num_actions = _env_factory(cfg)
        self.model = make_qnet(agent, obs_shape, num_actions).to(self.device)
        self.target = copy.deepcopy(self.model)
        for p in self.target.parameters():
            p.requires_grad_(False)
        self.optimizer = make_optimizer(self.agent.optimizer, self.model.parameters())
        # self.steps: env steps the actors took, all of them.
        self.updates = 0  # learner steps
        # R2D2's episodes reported while its replay is empty (_warn_if_no_sequence_fits).
        self.longest_episode = 0
        self.episodes_seen = 0
        self.warned_short = False
        self.replay: moolib.Replay | None = None
        self._restore()
        self.evals = PeriodicEval(cfg, self.steps)
        if self.replay is None:
            self.replay = moolib.Replay(
                agent.replay_capacity,
                alpha=agent.priority_exponent,
                min_size=agent.min_replay_size,
                samples_per_insert=agent.samples_per_insert or None,
                dedup=agent.replay_dedup(obs_shape),
                seed=cfg.seed,
            )
        self.reports = _Reports()
        self.rpc = moolib.Rpc()
        self.rpc.set_name(learner_name(str(cfg.group)))
        self.rpc.listen(cfg.scaling.listen_address)
        self.rpc.connect(peer.broker)
        self.replay.serve(self.rpc, "replay")
        self.publisher = moolib.Publisher(self.rpc, "weights")
        self.rpc.define("actor_report", self.reports.add)
        self._publish()
        self.host.hand_over()

    # -- setup -------------------------------------------------------------

    def connect(self, broker: str) -> None:
        """Stays findable by the actors through the broker at ``broker`` too (one that moved)."""
        self.rpc.connect(broker)

    def _publish(self) -> None:
        version = self.updates

        def publish(weights: dict[str, torch.Tensor]) -> None:
            self.publisher.publish(weights, version=version)

        self.host.add(self.model.state_dict(), publish)

    def _on_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``t`` on the learner's device; from pinned memory without waiting on a GPU
        (a copy from pageable memory would wait for the step in flight)."""
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, dtype, non_blocking=True)

    def _state(self) -> dict:
        return {
            "model": self.model.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "steps": self.steps,
            "updates": self.updates,
            "model_version": self.updates,
            "param_sum": param_sum(self.model),
            "elapsed": self.elapsed,
            "replay": REPLAY_FILE if self.agent.save_replay else None,
        }

    def _resume(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.target.load_state_dict(state.get("target", state["model"]))
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])
        self.updates = int(state.get("updates", state["model_version"]))
        replay_path = self.peer.savedir / REPLAY_FILE
        agent = self.agent
        if agent.save_replay and state.get("replay") and replay_path.exists():
            self.replay = moolib.Replay.load(
                replay_path,
                alpha=agent.priority_exponent,
                min_size=agent.min_replay_size,
                samples_per_insert=agent.samples_per_insert or None,
            )
            log.info("replay restored from %s: %d items", replay_path, self.replay.size())

    def _save(self, final: bool = False) -> None:
        """Writes a checkpoint (and the replay first, if configured); a failed write
        is logged and training goes on, but the ``final`` one raises
        ``checkpoint.FinalWriteError``."""
        self.host.hand_over()  # the last step's priorities, into the replay saved
        self._save_checkpoint(self._checkpoint_state(), final)

    def _write_beside_checkpoint(self) -> None:
        """The replay, which the checkpoint names (with ``save_replay``)."""
        if self.agent.save_replay and self.replay is not None:
            self.replay.save(self.peer.savedir / REPLAY_FILE)

    # -- the loop ------------------------------------------------------------

    def _update(self, stats: dict[str, list]) -> bool:
        """One learner step, if the replay lets it sample; returns whether it did."""
        agent, replay = self.agent, self.replay
        assert replay is not None
        try:
            sample = replay.sample(agent.batch_size, timeout=0.2)
        except TimeoutError:
            self.host.hand_over()
            return False
        items = moolib.nest.map_structure(self._on_device, sample.items)
        weights = self._on_device(
            importance_weights(
                sample.probabilities, sample.size, agent.importance_sampling_exponent
            ),
            torch.float32,
        )
        self.model.train()
        loss, loss_stats = self.loss_fn(
            agent,
            {"online": self.model, "target": self.target},
            {"items": items, "weights": weights},
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), agent.grad_norm_clipping
        )
        lr = learning_rate(agent.optimizer, self.steps, int(self.cfg.total_steps))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        # This step is queued: the last one's results can be waited for now.
        self.host.hand_over()
        keys = sample.keys
        self.host.add(
            {"priorities": loss_stats.pop("priorities")},
            lambda host: replay.update_priorities(keys, host["priorities"].double()),
        )
        self.updates += 1
        if self.updates % agent.target_update == 0:
            self.target.load_state_dict(self.model.state_dict())
        if self.updates % agent.publish_interval == 0:
            self._publish()
        # Tensors, averaged at the next log row: a float() here would wait for the step.
        for k, v in loss_stats.items():
            stats.setdefault(k, []).append(v)
        stats.setdefault("grad_norm", []).append(grad_norm.detach())
        stats["learning_rate"] = [lr]
        return True

    def run(self, stop: threading.Event | None = None) -> dict[str, Any]:
        """Learns until the actors took ``total_steps`` env steps (or ``stop`` is set);
        returns the last log row."""
        cfg = self.cfg
        stop = stop or threading.Event()
        run_log = RunLog(self, "learner", columns=COLUMNS)

        # scaling=single: the actors are threads of this process.
        actor_stop = threading.Event()
        actor_errors: list[BaseException] = []
        actor_thread = None
        actor_rpc = None
        if num_actor_processes(cfg) == 0:
            actor_rpc = moolib.Rpc()
            actor_rpc.set_timeout(30)
            actor_rpc.connect(self.peer.broker)
            try:
                loops = make_actor_loops(cfg, actor_rpc, 0, self.agent.actor_loops)
            except BaseException:
                actor_rpc.close()
                raise

            def act() -> None:
                actor_errors.extend(run_actor_loops(loops, actor_stop))

            actor_thread = threading.Thread(target=act, name="moolib-actors", daemon=True)
            actor_thread.start()

        clock = Clock(self.elapsed)
        info = self.replay.info() if self.replay else {}
        last = {
            "time": clock(),
            "steps": self.steps,
            "updates": self.updates,
            "inserts": info.get("inserts", 0),
            "samples": info.get("samples", 0),
        }
        last_checkpoint = time.monotonic()
        stats: dict[str, list] = {}
        row: dict[str, Any] = {}
        ended = False  # trained to total_steps, or stopped: the actors may end too
        try:
            run_log.start(last["time"], self.steps)
            while self.steps < int(cfg.total_steps) and not stop.is_set():
                if actor_errors:
                    raise actor_errors[0]
                self._update(stats)
                self.steps += self.reports.take_steps()
                if clock() - last["time"] >= float(cfg.log_interval):
                    row = self._log_row(stats, last, clock())
                    run_log.write(row, self._filling(row))
                    stats = {}
                if time.monotonic() - last_checkpoint >= float(cfg.checkpoint_interval):
                    self.elapsed = clock()
                    self._save()
                    last_checkpoint = time.monotonic()
            # A last row for what the run did since the previous one; none when the actors
            # took no step and ended no episode (stopped right after a row, a learner step
            # or two since): a row at that row's step would take its place in moolib-plot
            # and the summary, with no return.
            steps, episodes = self.reports.pending()
            if not row or self.steps + steps != last["steps"] or episodes:
                row = self._log_row(stats, last, clock())
                run_log.write(row, self._filling(row))
            self.elapsed = clock()
            ended = True  # even if the final checkpoint fails: the actors stop
            self._save(final=True)
        except SystemExit:
            # submitit's handler of a preemption or time-out (USR2), which has requeued
            # this job: the requeued learner resumes from here. The actors wait for it.
            self.elapsed = clock()
            self._save()
            raise
        finally:
            # Actors asking from now on hear that the run is over (not when this
            # learner crashed or was preempted: a restarted one goes on with them).
            self.reports.stop = ended
            actor_stop.set()
            # Inserts waiting on the rate limiter fail now, and their actors ask.
            if self.replay is not None:
                self.replay.close()
            if actor_thread is not None:
                actor_thread.join(timeout=60)
            if actor_rpc is not None:
                actor_rpc.close()
            self.evals.close()
            run_log.close()
            if ended:
                self._linger_for_actors()
            self.publisher.close()
            self.rpc.close()
        if actor_errors and not isinstance(actor_errors[0], GroupLostError):
            raise actor_errors[0]
        return row

    def _linger_for_actors(self) -> None:
        """Serves until every actor loop heard from lately has heard that the run is
        over (at its next report), so actor processes end themselves: on SLURM no
        launcher stops them. Bounded by ACTOR_STALE seconds (a stalled actor)."""
        if num_actor_processes(self.cfg) == 0:
            return
        deadline = time.monotonic() + ACTOR_STALE
        while time.monotonic() < deadline and not self.reports.all_told():
            time.sleep(0.2)

    def _log_row(self, stats: dict[str, list], last: dict, now: float) -> dict[str, Any]:
        self.steps += self.reports.take_steps()
        episodes, live = self.reports.take()
        assert self.replay is not None
        info = self.replay.info()
        interval = max(1e-9, now - last["time"])
        inserts = info["inserts"] - last["inserts"]
        samples = info["samples"] - last["samples"]
        row: dict[str, Any] = {
            "step": self.steps,
            "sps": (self.steps - last["steps"]) / interval,
            "env_sps": (self.steps - last["steps"]) / interval,
            "updates": self.updates,
            "updates_per_s": (self.updates - last["updates"]) / interval,
            "samples_per_s": samples / interval,
            "inserts_per_s": inserts / interval,
            "sample_insert_ratio": samples / inserts if inserts else math.nan,
            "replay_size": info["size"],
            "actors": live,
            "model_version": self.updates,
            "param_sum": param_sum(self.model),
            "time": now,
        }
        row.update(_episode_columns(episodes))
        self._warn_if_no_sequence_fits(episodes, info["inserts"])
        for k, values in stats.items():
            row[k] = mean_of(values)
        # A row at total_steps is the run's last: it waits for the evaluation under way.
        done = self.steps >= int(self.cfg.total_steps)
        row.update(self.evals.columns(self.steps, lambda: self.model, final=done))
        last.update(
            time=now,
            steps=self.steps,
            updates=self.updates,
            inserts=info["inserts"],
            samples=info["samples"],
        )
        return row

    def _filling(self, row: dict[str, Any]) -> str:
        """The progress line's note while the replay fills before the first update."""
        need = self.agent.min_replay_size
        if self.updates or row["replay_size"] >= need:
            return ""
        return f"replay {int(row['replay_size']):,}/{need:,} before learning"

    def _warn_if_no_sequence_fits(self, episodes: list, inserts: int) -> None:
        """R2D2 stores no sequence of an episode shorter than its burn-in and a
        transition (``r2d2.SequenceSplitter``): with episodes that short the replay
        stays empty and the learner waits forever, so say why, once."""
        if inserts or self.warned_short:
            return
        self.episodes_seen += len(episodes)
        self.longest_episode = max([self.longest_episode, *(n for _, _, n in episodes)])
        if self.episodes_seen >= SHORT_EPISODES:
            why = self.agent.episodes_too_short(self.longest_episode, self.episodes_seen)
            if why is not None:
                self.warned_short = True
                log.warning("%s", why)


@register_runtime
class OffPolicyRuntime(Runtime):
    """One learner (rank 0, serving the replay) and ``scaling.actors`` actor processes
    (ranks 1..) feeding it: the Q-learning agents' runtime."""

    name = "offpolicy"
    processes = "actors"
    processes_described = "actor processes beside its learner"
    training_logs = "{savedir}/logs.tsv (the learner's); actors' output in the SLURM logs"

    @classmethod
    def process_groups(cls, cfg: RunConfig) -> tuple[ProcessGroup, ...]:
        """The learner (rank 0: the run ends with it, on the run's device) and
        ``scaling.actors`` actor processes on CPUs, each started again whenever it fails."""
        learner = ProcessGroup("learner", 0, 1, None, True, "never", True)
        actors = ProcessGroup("actor", 1, cfg.scaling.actors, "actors", False, "failed", False)
        return (learner, actors)

    @classmethod
    def logdir(cls, savedir: Path, rank: int, cfg: RunConfig) -> Path:
        """The learner logs into the savedir, actor process ``i`` (rank i + 1) into
        ``actor<i>/``."""
        return savedir if rank == 0 else actor_logdir(savedir, rank - 1)

    @classmethod
    def make_runner(cls, cfg: RunConfig, rank: int, broker: str) -> Learner | Actor:
        """Rank 0 is the learner, ranks 1.. the actor processes (actor ``rank - 1``)."""
        if rank == 0:
            return Learner(cfg, PeerInfo.of(cls, cfg, rank, broker))
        return Actor(cfg, rank - 1, broker)


def actor_logdir(savedir: Path, index: int) -> Path:
    """Where actor process ``index`` writes its output."""
    return savedir / f"actor{index}"
