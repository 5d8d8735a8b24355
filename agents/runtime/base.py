"""What the two runtimes' learning processes share, written once.

The on-policy ``Trainer`` (every peer) and the off-policy ``Learner`` are both a
``Runner``: it prints the start banner, resumes from the experiment's newest
checkpoint (``_resume`` loads the runtime's own part of it), writes checkpoints
(a failed write is logged and training goes on; the final one raises), and keeps
the wandb runs' ids in them. ``RunLog`` is a runner's log outputs: logs.tsv, the
progress line and progress.log, wandb, TensorBoard. ``LostContact`` raises
``GroupLostError`` when a process has been cut off from its group (a peer) or its
learner (an actor) for ``lost_group_timeout`` seconds. And the helpers both runtimes
use: the actors' envs, the optimizer and its learning rate, the banner's env detail.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from moolib.conf.schema.run_config import RunConfig

from ..registry import Runtime, get_agent
from . import checkpoint
from .logger import COLUMNS, Progress, TsvLog, Wandb, guard_log_handlers, start_banner
from .tensorboard_log import TensorBoardLog

log = logging.getLogger("moolib.agents")


class GroupLostError(RuntimeError):
    """The peer was out of its group (no broker, or not a member) for too long."""


@dataclass
class PeerInfo:
    """Where a runner stands in its experiment."""

    rank: int
    savedir: Path  # the experiment's folder (checkpoints, config)
    logdir: Path  # this peer's logs
    broker: str  # address of the broker

    @classmethod
    def of(cls, runtime: type[Runtime], cfg: RunConfig, rank: int, broker: str) -> PeerInfo:
        """Where process ``rank`` of the run ``cfg`` describes stands, logging where
        ``runtime`` puts that rank's logs."""
        savedir = Path(cfg.savedir)
        return cls(rank, savedir, runtime.logdir(savedir, rank, cfg), broker)


class LostContact:
    """When a process last heard from its group (a peer) or its learner (an actor):
    past ``timeout`` seconds (``lost_group_timeout``) it is lost, and acting with
    nobody to learn with wastes the machine."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.heard()

    def heard(self) -> None:
        """Contact, now."""
        self.last = time.monotonic()

    def check(self, why: str) -> None:
        """Raises GroupLostError saying ``why`` if the last contact is more than
        ``timeout`` seconds ago."""
        if time.monotonic() - self.last > self.timeout:
            raise GroupLostError(why) from None


def param_sum(model: torch.nn.Module) -> float:
    """The sum of ``model``'s parameters: equal on peers that hold identical parameters
    at equal versions (logged, and kept in checkpoints)."""
    return math.fsum(float(p.detach().double().sum()) for p in model.parameters())


def mean_of(values: list) -> float:
    """The mean of a log column's values: numbers, or a step's 0-d tensors (on the
    learner's device, averaged there); NaN for none."""
    if not values:
        return math.nan
    if isinstance(values[0], torch.Tensor):
        return float(torch.stack(values).double().mean())
    return sum(values) / len(values)


def env_detail(cfg: RunConfig) -> str:
    """What steps the env, for the start banner: ALE's version, say, which moolib-run prints
    there once instead of ALE's own banner in every env process."""
    from importlib import metadata

    from moolib.envs import find_env_spec
    from moolib.envs.registry import find_backend

    backend = find_backend(cfg.env.backend)
    spec = find_env_spec(cfg.env.name)
    if backend is not None:
        distribution, shown = backend.library
    elif spec is not None and spec.library is not None:
        distribution, shown = spec.library
    else:
        return cfg.env.backend
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        version = "?"
    return f"{shown} {version}"


def make_envs(cfg: RunConfig) -> tuple[Any, tuple[int, ...], int]:
    """The actors' env pool, the observation shape and the number of actions. Its envs
    are made afresh at every start and resume, and decorrelated then
    (``env.decorrelate_steps``)."""
    from moolib.envs import DEFAULT_BACKEND, actor_pool

    agent = cfg.agent
    if cfg.env.decorrelate_steps and cfg.env.backend != DEFAULT_BACKEND:
        log.info(
            "env.backend=%s steps its envs in its own code: they start without "
            "env.decorrelate_steps' random actions",
            cfg.env.backend,
        )
    return actor_pool(
        cfg.env.name,
        cfg.env.backend,
        cfg.env.option_values(),
        batch_size=agent.actor_batch_size,
        num_batches=agent.num_actor_batches,
        num_workers=agent.num_actor_cpus,
        decorrelate_steps=cfg.env.decorrelate_steps,
    )


def make_optimizer(opt: Any, params: Any) -> torch.optim.Optimizer:
    """The optimizer an agent's ``optimizer`` settings name (adam or rmsprop) over ``params``.

    Both step all parameters in a few ``torch._foreach_*`` calls (torch picks that only
    on CUDA by default): every torch call gives up the GIL, and with the learner on
    its own thread a call per parameter and per operation hands it to the acting
    thread and back each time (a third of A2C's CartPole steps, on two cores)."""
    if opt.name == "adam":
        return torch.optim.Adam(
            params,
            lr=opt.learning_rate,
            betas=(opt.beta1, opt.beta2),
            eps=opt.epsilon,
            foreach=True,
        )
    if opt.name == "rmsprop":
        return torch.optim.RMSprop(
            params,
            lr=opt.learning_rate,
            alpha=opt.alpha,
            momentum=opt.momentum,
            eps=opt.epsilon,
            centered=opt.centered,
            foreach=True,
        )
    raise ValueError(f"agent.optimizer.name must be adam or rmsprop, got {opt.name!r}")


def learning_rate(opt: Any, steps: int, total_steps: int) -> float:
    """The learning rate after ``steps`` of ``total_steps``: ``opt.learning_rate``, decayed
    linearly to 0 unless ``opt.schedule`` is constant (as Ape-X and R2D2 keep it)."""
    if opt.schedule == "constant":
        return float(opt.learning_rate)
    return opt.learning_rate * max(0.0, 1.0 - steps / total_steps)


class Runner:
    """A runtime's learning process: what ``Runtime.make_runner`` makes for the
    ranks that learn. A subclass sets ``agent`` and its model, and gives
    ``_state()`` (what a checkpoint and a joining peer get), ``_resume(state)`` (what it
    loads of a checkpoint) and ``run(stop)``."""

    def __init__(self, cfg: RunConfig, peer: PeerInfo) -> None:
        self.cfg = cfg
        self.peer = peer
        self.device = cfg.torch_device()
        self.spec = get_agent(cfg.agent.name)
        self.loss_fn = self.spec.compute_loss
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed + peer.rank)
        self.banner = ""
        self.steps = 0  # env steps (learned from on-policy; taken by the actors off-policy)
        self.elapsed = 0.0  # seconds trained, over every start and resume
        self.wandb_id: str | None = None
        # wandb run ids by peer rank, as the checkpoint keeps them.
        self.wandb_ids: dict[str, str] = {}

    def _announce(self, peers: int | None = None, more: str = "") -> None:
        """Prints the start banner (``peers``: as ``start_banner`` takes it; ``more``:
        lines the runtime adds) and keeps it for the progress log."""
        cfg, peer = self.cfg, self.peer
        self.banner = (
            start_banner(
                cfg,
                peers=peers,
                rank=peer.rank,
                device=self.device,
                savedir=peer.savedir,
                broker=peer.broker,
                env_detail=env_detail(cfg),
            )
            + more
        )
        print(self.banner, flush=True)

    def _state(self) -> dict:
        raise NotImplementedError

    def _resume(self, state: dict) -> None:
        raise NotImplementedError

    def _restore(self) -> None:
        """Resumes from the experiment's newest intact checkpoint, if any."""
        # A damaged checkpoint.pt falls back to the newest intact history entry; when
        # none is intact this raises rather than train from scratch over them.
        loaded = checkpoint.load_latest(self.peer.savedir)
        if loaded is None:
            return
        if loaded.skipped:
            log.warning("%s", checkpoint.describe_fallback(loaded))
        state = loaded.state
        self._resume(state)
        self.elapsed = float(state.get("elapsed", 0.0))
        self.wandb_ids = dict(state.get("wandb_ids", {}))
        self.wandb_id = self.wandb_ids.get(str(self.peer.rank))
        log.info("resumed from %s at step %d", loaded.path, self.steps)

    def _checkpoint_state(self) -> dict:
        """What a checkpoint holds: ``_state()`` and the wandb runs' ids."""
        state = self._state()
        if self.wandb_id:
            self.wandb_ids[str(self.peer.rank)] = self.wandb_id
        state["wandb_ids"] = dict(self.wandb_ids)
        return state

    def _write_beside_checkpoint(self) -> None:
        """Writes what the checkpoint about to be written names (none here)."""

    def _save_checkpoint(
        self, state: dict, final: bool, may_write: Callable[[], bool] | None = None
    ) -> bool:
        """Writes ``state`` as the checkpoint at ``steps`` (``_write_beside_checkpoint``
        first; ``may_write`` as ``checkpoint.save`` takes it); returns whether it did.
        A write that fails (full disk, I/O error) is logged and training goes on: the
        previous checkpoint stays and the next interval tries again; the ``final``
        one raises ``checkpoint.FinalWriteError`` instead."""
        try:
            self._write_beside_checkpoint()
            path = checkpoint.save(
                self.peer.savedir,
                state,
                self.steps,
                history=self.cfg.checkpoint_history,
                may_write=may_write,
            )
        except checkpoint.StaleWriteError as e:
            log.warning("skipped a stale checkpoint write at step %d: %s", self.steps, e)
            return False
        except checkpoint.NotAllowedError:
            log.info("step %d: not writing a checkpoint: no longer the leader", self.steps)
            return False
        except OSError as e:
            message = checkpoint.write_failure(self.peer.savedir, self.steps, e, final)
            if final:
                raise checkpoint.FinalWriteError(message) from None
            log.error("%s", message)
            return False
        log.info("checkpoint at step %d: %s", self.steps, path)
        return True


class RunLog:
    """A runner's log outputs, named after its ``role`` (``peer 0``, ``learner``):
    logs.tsv (``columns``), the progress line (``[peer 0] ...``) and progress.log,
    which starts with the banner, the wandb run (``<name>-peer0``), whose id the
    runner keeps for its checkpoints, and the TensorBoard event file beside logs.tsv,
    with logs.tsv's columns."""

    def __init__(self, runner: Runner, role: str, columns: tuple[str, ...] = COLUMNS) -> None:
        cfg, logdir = runner.cfg, runner.peer.logdir
        guard_log_handlers()
        self.tsv = TsvLog(logdir / "logs.tsv", columns=columns)
        self.progress = Progress(
            int(cfg.total_steps), prefix=f"[{role}] ", log_path=logdir / "progress.log"
        )
        self.progress.record(runner.banner)
        # The runner has resumed (its steps are the checkpoint's) before its log opens.
        self.tensorboard = TensorBoardLog.for_run(cfg, logdir, self.tsv.columns, runner.steps)
        # A wandb run's name has no spaces.
        name = f"{cfg.name}-{role.replace(' ', '')}"
        self.wandb = Wandb.for_run(cfg, name, logdir, runner.wandb_id)
        if self.wandb is not None:
            runner.wandb_id = self.wandb.run_id

    def start(self, now: float, steps: int) -> None:
        """Starts the progress line at ``now`` (the run's clock) and ``steps``."""
        self.progress.start(now, steps)

    def write(self, row: dict[str, Any], note: str = "") -> None:
        """Writes ``row`` to every output; ``note``: the progress line's, if any."""
        self.tsv.write(row)
        self.progress.update(row, note)
        if self.wandb:
            self.wandb.log(row)
        if self.tensorboard:
            self.tensorboard.write(row)

    def close(self) -> None:
        """Flushes and closes every output."""
        self.progress.close()
        self.tsv.close()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            self.wandb.close()
