"""Playing a run's policy for whole episodes, apart from training: what ``moolib-eval``
reports for a savedir's checkpoint (``evaluate_savedir``), what moolib-run logs every
``eval_interval`` steps (``PeriodicEval``), and ``moolib.agents.offpolicy_run.evaluate``
(``evaluate``).

``play`` runs N episodes as one batch of N envs of the run's env (up to
``MAX_BATCH`` at once), made in this process (env i reset with seed ``seed + i``),
on the CPU, and picks every step's actions with the agent's policy
(``AgentSpec.policy``: the agent's own acting, as its actors feed its network),
greedily or sampled with a seeded generator: the same arguments play the same
episodes. It reads the savedir and writes nothing there but, with videos, the
folder ``videos/`` it creates: no lock, log or checkpoint of a run that trains
meanwhile is touched.

Videos are MP4s, one per episode, written frame by frame as the episode plays
(imageio-ffmpeg, the ``video`` extra), from the frames the env draws
(``render_mode="rgb_array"``).
"""

from __future__ import annotations

import copy
import logging
import os
import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from moolib.conf.checks import ConfigError
from moolib.conf.schema import run_config
from moolib.conf.schema.run_config import RunConfig
from torch import nn

from moolib._extras import MissingExtraError, import_extra

from ..acting import ActionChoice
from ..registry import get_agent
from . import checkpoint
from .logger import EVAL_COLUMNS
from .normalization import ScaledObservations

__all__ = [
    "Checkpointed",
    "EvalError",
    "Episodes",
    "PeriodicEval",
    "evaluate",
    "evaluate_savedir",
    "load_checkpointed",
    "network",
    "play",
    "video_folder",
]

log = logging.getLogger("moolib.agents")

VIDEO_DIR = "videos"
# Envs made at once: more episodes play in batches of this many (an Atari env holds
# a few MB, and a batch's steps are one forward pass however many envs it has).
MAX_BATCH = 32
VIDEO_EXTRA = "video"


class EvalError(Exception):
    """What cannot be evaluated (not a savedir, no checkpoint, an env that draws no
    frames), in one line."""


class _Stopped(Exception):
    """An evaluation stopped before its episodes ended (``play``'s ``stop``)."""


@dataclass
class Episodes:
    """What ``play`` played: each episode's return and length (env steps), in the order
    of their seeds, and the videos it wrote (none without ``video_dir``)."""

    returns: list[float]
    lengths: list[int]
    videos: list[Path] = field(default_factory=list)

    @property
    def mean_return(self) -> float:
        """The mean return."""
        return statistics.fmean(self.returns)

    @property
    def return_std(self) -> float:
        """The spread of the returns: their standard deviation (0 for one episode)."""
        return statistics.pstdev(self.returns)

    @property
    def mean_length(self) -> float:
        """The mean length, in env steps."""
        return statistics.fmean(self.lengths)

    def columns(self, step: int) -> dict[str, float]:
        """The log row's ``logger.EVAL_COLUMNS`` for the weights of ``step``."""
        values = (step, self.mean_return, self.return_std, self.mean_length)
        return dict(zip(EVAL_COLUMNS, values, strict=True))


class _Video:
    """One episode's MP4, written as its frames come: nothing is held in memory."""

    def __init__(self, path: Path, fps: float) -> None:
        self.path = path
        self.fps = fps
        self._writer: Any = None

    def add(self, frame: Any) -> None:
        """Appends ``frame``, an RGB image ``[H, W, 3]`` of uint8."""
        frame = np.ascontiguousarray(frame, dtype=np.uint8)
        if self._writer is None:
            ffmpeg = import_extra("imageio_ffmpeg", VIDEO_EXTRA, "video=true")
            height, width = frame.shape[:2]
            # Even sizes are what H.264 in yuv420p takes; an odd one is padded by a pixel.
            self._writer = ffmpeg.write_frames(
                str(self.path), (width, height), fps=self.fps, macro_block_size=2
            )
            self._writer.send(None)
        self._writer.send(frame)

    def close(self) -> None:
        """Finishes the file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _first_frame(env: gymnasium.Env, name: str) -> Any:
    """Has ``env`` draw RGB frames and returns its first (after a reset). Raises EvalError
    for an env that draws none, MissingExtraError for a drawing library not installed."""
    base = env.unwrapped
    modes = list(base.metadata.get("render_modes", []))
    if "rgb_array" not in modes:
        raise EvalError(
            f"env {name} cannot draw its frames for video=true (its render modes: "
            f"{', '.join(modes) or 'none'}); evaluate it without video"
        )
    # The envs are made without a render mode (training draws nothing); one that lists
    # rgb_array draws its frames once its mode says so.
    base.render_mode = "rgb_array"
    # Frames are drawn off screen: SDL (pygame's, CartPole's) would otherwise look for
    # a display and, on a machine without one, print an error line.
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    try:
        frame = env.render()
    except gymnasium.error.DependencyNotInstalled as e:
        cause = e.__cause__
        package = getattr(cause, "name", None) or "package"
        raise MissingExtraError(
            f"the {package} package (to draw {name}'s frames, for video=true) is not "
            f'installed: pip install "moolib[{VIDEO_EXTRA}]"'
        ) from e
    shape = getattr(frame, "shape", ())
    if len(shape) != 3 or shape[-1] != 3:
        raise EvalError(f"env {name} drew no RGB frame for video=true (got {shape or frame!r})")
    return frame


def _make_envs(cfg: RunConfig, count: int) -> list[gymnasium.Env]:
    """``count`` envs of the run's env (its gymnasium env, whatever its backend)."""
    from moolib.envs import create_env

    envs: list[gymnasium.Env] = []
    try:
        for _ in range(count):
            envs.append(create_env(cfg.env.name, **cfg.env.option_values()))
    except BaseException:
        for env in envs:
            env.close()
        raise
    return envs


def play(
    cfg: RunConfig,
    model: nn.Module,
    episodes: int,
    choice: ActionChoice,
    seed: int = 0,
    video_dir: Path | None = None,
    stop: threading.Event | None = None,
) -> Episodes:
    """Plays ``episodes`` episodes of the run ``cfg`` describes with ``model`` (its
    agent's network, on the CPU), acting as ``choice`` says, as batches of up to
    ``MAX_BATCH`` envs (see the module doc). With ``video_dir``, writes each
    episode's MP4 there as ``episode-<i>.mp4``. ``stop``: when set, the episodes
    end early (_Stopped)."""
    played = Episodes([], [])
    for first in range(0, episodes, MAX_BATCH):
        count = min(MAX_BATCH, episodes - first)
        part = _play_batch(cfg, model, range(first, first + count), choice, seed, video_dir, stop)
        played.returns += part.returns
        played.lengths += part.lengths
        played.videos += part.videos
    return played


@torch.no_grad()
def _play_batch(
    cfg: RunConfig,
    model: nn.Module,
    numbers: range,
    choice: ActionChoice,
    seed: int,
    video_dir: Path | None,
    stop: threading.Event | None,
) -> Episodes:
    """Plays the episodes ``numbers`` (episode i from seed ``seed + i``) as one batch."""
    n = len(numbers)
    envs = _make_envs(cfg, n)
    videos: list[_Video] = []
    try:
        observations = [env.reset(seed=seed + i)[0] for i, env in zip(numbers, envs, strict=True)]
        if video_dir is not None:
            video_dir.mkdir(parents=True, exist_ok=True)
            fps = float(envs[0].metadata.get("render_fps") or 30)
            for i, env in zip(numbers, envs, strict=True):
                videos.append(_Video(video_dir / f"episode-{i}.mp4", fps))
                videos[-1].add(_first_frame(env, cfg.env.name))
        state = torch.as_tensor(np.stack(observations))
        # An episode's first observation comes with done and no reward, as EnvPool's do.
        reward = torch.zeros(n)
        done = torch.ones(n, dtype=torch.bool)
        policy = get_agent(cfg.agent.name).policy(cfg.agent, model, n)
        returns = [0.0] * n
        lengths = [0] * n
        playing = list(range(n))
        while playing:
            if stop is not None and stop.is_set():
                raise _Stopped
            # Envs whose episode is over stay in the batch (their actions unused), so
            # that every step draws as many samples: the draws stay seeded.
            actions = policy.act({"state": state, "reward": reward, "done": done}, choice)
            sent = policy.env_actions(actions)
            done = torch.zeros(n, dtype=torch.bool)
            going = []
            for b in playing:
                action = sent[b].numpy() if sent.dim() > 1 else int(sent[b])
                obs, r, terminated, truncated, _ = envs[b].step(action)
                returns[b] += float(r)
                lengths[b] += 1
                state[b] = torch.as_tensor(obs)
                reward[b] = float(r)
                if videos:
                    videos[b].add(envs[b].render())
                if terminated or truncated:
                    if videos:
                        videos[b].close()
                else:
                    going.append(b)
            playing = going
    finally:
        for video in videos:
            video.close()
        for env in envs:
            env.close()
    return Episodes(returns, lengths, [v.path for v in videos])


@dataclass
class Checkpointed:
    """A run's config (on the CPU) and one of its checkpoints, read for evaluation."""

    cfg: RunConfig
    state: dict
    path: Path
    # One line per newer checkpoint passed over as damaged (``checkpoint.load_latest``).
    skipped: list[str]

    @property
    def steps(self) -> int:
        """The step the checkpoint was written at."""
        return int(self.state["steps"])


def load_checkpointed(savedir: Path, checkpoint_path: Path | None = None) -> Checkpointed:
    """The config of the run in ``savedir`` and its newest intact checkpoint (or the one
    at ``checkpoint_path``), read only. Raises EvalError for a folder that holds no
    run, a config that does not load, and no usable checkpoint."""
    savedir = Path(savedir)
    config = savedir / run_config.CONFIG_FILE
    if not savedir.is_dir():
        raise EvalError(f"savedir={savedir} is not a folder")
    if not config.is_file():
        raise EvalError(
            f"savedir={savedir} holds no run (no {run_config.CONFIG_FILE}); give the folder "
            "moolib-run trained in (a sweep's: one of its numbered points)"
        )
    try:
        cfg = run_config.load(config, device="cpu")
    except ConfigError as e:
        raise EvalError(f"{config}: {e}") from None
    try:
        if checkpoint_path is not None:
            path = Path(checkpoint_path)
            return Checkpointed(cfg, checkpoint.load(path), path, [])
        loaded = checkpoint.load_latest(savedir)
    except checkpoint.CheckpointError as e:
        raise EvalError(str(e)) from None
    if loaded is None:
        raise EvalError(
            f"savedir={savedir} holds no checkpoint yet (a run writes one every "
            f"checkpoint_interval={cfg.checkpoint_interval:g} s and at its end)"
        )
    return Checkpointed(cfg, loaded.state, loaded.path, loaded.skipped)


def network(cfg: RunConfig, state: dict) -> nn.Module:
    """The agent's network for the run ``cfg`` on the CPU, with the checkpoint
    ``state``'s weights, in eval mode, fed observations scaled by the checkpoint's
    statistics where it has them (``agent.observation_scaling``). Raises EvalError when
    the weights do not fit it."""
    from moolib.envs import DEFAULT_BACKEND, probe_env

    # play's envs are the env's gymnasium ones, whatever backend the run trained on.
    obs_shape, actions = probe_env(cfg.env.name, DEFAULT_BACKEND, cfg.env.option_values())
    model = get_agent(cfg.agent.name).make_network(cfg.agent, obs_shape, actions)
    try:
        model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as e:
        raise EvalError(
            f"the checkpoint's model does not fit {cfg.agent.name}'s network on {cfg.env.name} "
            f"(observations {tuple(obs_shape)}, {actions} actions): {str(e).splitlines()[0]}"
        ) from None
    scaling = state.get("observation_scaling")
    if scaling is not None:
        # agent.observation_scaling: the observations scaled as training last scaled them.
        model = ScaledObservations(model, scaling["mean"], scaling["var"])
    return model.eval()


def video_folder(savedir: Path, steps: int, choice: ActionChoice, seed: int) -> Path:
    """Where the videos of an evaluation of ``savedir``'s checkpoint at ``steps`` go."""
    how = "greedy" if choice.greedy else "sampled"
    return Path(savedir) / VIDEO_DIR / f"step{steps}-{how}-seed{seed}"


def evaluate_savedir(
    savedir: Path,
    episodes: int,
    choice: ActionChoice,
    seed: int = 0,
    checkpoint_path: Path | None = None,
    video: bool = False,
) -> tuple[Checkpointed, Episodes]:
    """Plays ``episodes`` episodes with the newest intact checkpoint of ``savedir`` (or
    the one at ``checkpoint_path``), on the CPU, acting as ``choice`` says, seeded
    with ``seed``; with ``video``, into ``video_folder``. Raises EvalError for what
    cannot be evaluated, MissingExtraError when video needs the ``video`` extra."""
    loaded = load_checkpointed(savedir, checkpoint_path)
    if video:
        import_extra("imageio_ffmpeg", VIDEO_EXTRA, "video=true")
    model = network(loaded.cfg, loaded.state)
    where = video_folder(savedir, loaded.steps, choice, seed) if video else None
    return loaded, play(loaded.cfg, model, episodes, choice, seed, where)


def evaluate(
    savedir: Path,
    episodes: int = 10,
    epsilon: float = 0.0,
    seed: int = 0,
    checkpoint_path: Path | None = None,
) -> list[float]:
    """The returns of ``episodes`` episodes played by the newest checkpoint of
    ``savedir`` (or the one at ``checkpoint_path``, e.g. one of
    ``checkpoint.list_history``), greedily (``epsilon`` 0), else sampled (a
    Q-learner epsilon-greedy with ``epsilon``), episode i seeded ``seed + i``; any
    agent's. Raises EvalError for what cannot be evaluated."""
    generator = torch.Generator().manual_seed(seed)
    choice = ActionChoice(greedy=epsilon == 0, epsilon=epsilon, generator=generator)
    return evaluate_savedir(Path(savedir), episodes, choice, seed, checkpoint_path)[1].returns


class PeriodicEval:
    """moolib-run's evaluations while it trains (``eval_interval``): at the first log row
    at or past each multiple of ``eval_interval`` env steps, a copy of the learner's
    weights plays ``eval_episodes`` greedy episodes (seeded with the run's seed, so
    every evaluation starts from the same states) on a thread of its own on the CPU,
    beside training; the row after it ends carries its ``logger.EVAL_COLUMNS``. One at a time:
    a multiple passed while one plays is skipped. None when ``eval_interval`` is 0 or
    not ``enabled`` (a peer other than the first: they hold the same weights)."""

    def __init__(self, cfg: RunConfig, steps: int, enabled: bool = True) -> None:
        self.cfg = cfg
        self.interval = int(cfg.eval_interval) if enabled else 0
        self.seed = cfg.seed or 0
        self.next_at = self._after(steps)
        self._model: nn.Module | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._result: dict[str, float] = {}

    def _after(self, steps: int) -> int:
        return (steps // self.interval + 1) * self.interval if self.interval else 0

    def columns(
        self, steps: int, model: Callable[[], nn.Module], final: bool = False
    ) -> dict[str, float]:
        """The eval columns of the log row at ``steps`` (those of an evaluation that ended
        since the last row, else none); when one is due, starts one of the weights of
        ``model()`` (called then only: what the run plays now). ``final``: the run's last
        row, which waits for an evaluation under way."""
        if not self.interval:
            return {}
        playing = self._thread is not None and self._thread.is_alive()
        if not playing and steps >= self.next_at:
            self._start(steps, model())
            playing = True
        if final and playing and self._thread is not None:
            self._thread.join()
        with self._lock:
            result, self._result = self._result, {}
        return result

    def _start(self, steps: int, model: nn.Module) -> None:
        self.next_at = self._after(steps)
        if self._model is None:
            # A copy rather than a new network: building one would draw its initial
            # weights from the RNG that training draws from.
            self._model = copy.deepcopy(model).to("cpu").eval()
        weights = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        self._thread = threading.Thread(
            target=self._play, args=(steps, weights), name="moolib-eval", daemon=True
        )
        self._thread.start()

    def _play(self, steps: int, weights: dict[str, torch.Tensor]) -> None:
        assert self._model is not None
        choice = ActionChoice(greedy=True, generator=torch.Generator().manual_seed(self.seed))
        try:
            self._model.load_state_dict(weights)
            played = play(
                self.cfg, self._model, self.cfg.eval_episodes, choice, self.seed, stop=self._stop
            )
        except _Stopped:
            return
        except Exception as e:  # noqa: BLE001 - an evaluation never ends the training
            log.warning("the evaluation at step %d failed, and no other follows: %s", steps, e)
            self.interval = 0
            return
        with self._lock:
            self._result = played.columns(steps)

    def close(self) -> None:
        """Ends an evaluation under way at its next step."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
