"""``moolib-eval``: plays a run's policy for a number of episodes and prints the mean and
spread of their returns; optionally writes a video of each.

    moolib-eval savedir=outputs/cartpole
    moolib-eval savedir=outputs/cartpole episodes=20 policy=sampled seed=3
    moolib-eval savedir=outputs/cartpole video=true          # MP4s in <savedir>/videos/
    moolib-eval savedir=outputs/apex checkpoint=outputs/apex/checkpoints/checkpoint_51200.pt

Any agent's savedir, finished or still training (its newest intact checkpoint, read
only: the run's lock, logs and checkpoints stay as they are). The episodes play on
this machine's CPU, as one batch of envs, through the agent's own acting
(``moolib.agents.runtime.evaluation``). Its arguments are key=value, as moolib-run's
are; they are not a run's settings, so they are parsed here rather than composed by
Hydra. A mistake (an unknown key, a bad value, a folder that holds no run or no
checkpoint, an env that cannot draw its frames, the video extra missing) is one
``moolib-eval: error: ...`` line, exit 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from moolib._extras import MissingExtraError

from . import output
from .resume import nearest_key

EXIT_ERROR = 2

# Each key, its default and what it means: what --help prints.
KEYS = {
    "savedir": ("(required)", "the run's folder: the one moolib-run trained (or trains) in"),
    "episodes": ("10", "episodes to play, as one batch of envs"),
    "policy": (
        "greedy",
        "greedy: the action the agent rates highest; sampled: drawn from its policy "
        "(a Q-learner's: epsilon-greedy)",
    ),
    "epsilon": ("0.01", "a Q-learner's (apex, r2d2) random actions with policy=sampled"),
    "seed": ("0", "episode i starts from seed + i, and seeds the sampled actions"),
    "video": ("false", "true: an MP4 of each episode in <savedir>/videos/ (the video extra)"),
    "checkpoint": ("(newest)", "a checkpoint file to play instead of the newest intact one"),
}
USAGE = "usage: moolib-eval savedir=DIR [key=value ...]"


class UsageError(Exception):
    """A command line moolib-eval cannot take."""


@dataclass(frozen=True)
class EvalArgs:
    """moolib-eval's command line, checked."""

    savedir: Path
    episodes: int = 10
    greedy: bool = True
    epsilon: float = 0.01
    seed: int = 0
    video: bool = False
    checkpoint: Path | None = None


def _integer(key: str, text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise UsageError(f"{key} must be {kind}, got {text!r}")
    return value


def _flag(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "false"):
        raise UsageError(f"{key} must be true or false, got {text!r}")
    return value == "true"


def _fraction(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise UsageError(f"{key} must be a number in [0, 1], got {text!r}")
    return value


def parse(argv: Sequence[str]) -> EvalArgs:
    """The checked arguments of ``argv`` (``key=value`` each). Raises UsageError naming
    the argument, and the nearest known key for an unknown one."""
    given: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise UsageError(f"arguments are key=value (savedir=DIR, ...), got {arg!r}")
        if key not in KEYS:
            raise UsageError(
                f"unknown key {key}; nearest known key: {nearest_key(key, list(KEYS))} "
                "(moolib-eval --help lists every key)"
            )
        if key in given:
            raise UsageError(f"{key} is given twice")
        given[key] = value
    if not given.get("savedir"):
        raise UsageError("savedir=DIR is missing: the folder of the run to evaluate")
    policy = given.get("policy", "greedy")
    if policy not in ("greedy", "sampled"):
        raise UsageError(f"policy must be greedy or sampled, got {policy!r}")
    checkpoint = given.get("checkpoint")
    return EvalArgs(
        savedir=Path(given["savedir"]),
        episodes=_integer("episodes", given.get("episodes", "10"), 1),
        greedy=policy == "greedy",
        epsilon=_fraction("epsilon", given.get("epsilon", "0.01")),
        seed=_integer("seed", given.get("seed", "0"), 0),
        video=_flag("video", given.get("video", "false")),
        checkpoint=Path(checkpoint) if checkpoint else None,
    )


def _help() -> str:
    width = max(map(len, KEYS))
    lines = [USAGE, "", "Plays a run's policy and prints the mean and spread of its returns.", ""]
    lines += [f"  {k:<{width}}  {what} (default: {default})" for k, (default, what) in KEYS.items()]
    lines += ["", "docs/toolkit.md, 'moolib-eval', says more."]
    return "\n".join(lines)


def _fail(message: str) -> NoReturn:
    print(f"moolib-eval: error: {message}", file=sys.stderr, flush=True)
    sys.exit(EXIT_ERROR)


def run(args: EvalArgs) -> None:
    """Evaluates as ``args`` says and prints what it played."""
    import torch
    from moolib.agents.acting import ActionChoice
    from moolib.agents.registry import get_agent
    from moolib.agents.runtime import checkpoint, evaluation

    choice = ActionChoice(
        greedy=args.greedy,
        epsilon=args.epsilon,
        generator=torch.Generator().manual_seed(args.seed),
    )
    loaded, played = evaluation.evaluate_savedir(
        args.savedir, args.episodes, choice, args.seed, args.checkpoint, args.video
    )
    if loaded.skipped:
        fallback = checkpoint.Loaded(loaded.state, loaded.path, loaded.skipped)
        print(f"moolib-eval: note: {checkpoint.describe_fallback(fallback)}", flush=True)
    cfg = loaded.cfg
    how = get_agent(cfg.agent.name).policy.described(choice)
    n = args.episodes
    seeds = f"seed {args.seed}" if n == 1 else f"seeds {args.seed}-{args.seed + n - 1}"
    returns = played.returns
    lines = [
        f"moolib-eval: {cfg.agent.name} on {cfg.env.name}, the checkpoint at step "
        f"{loaded.steps:,} ({loaded.path})",
        f"  episodes  {n}, {how}, {seeds}, on the CPU",
        f"  return    mean {played.mean_return:.2f}, std {played.return_std:.2f}, "
        f"min {min(returns):g}, max {max(returns):g}",
        f"  length    mean {played.mean_length:.2f} steps",
    ]
    if played.videos:
        folder = played.videos[0].parent
        lines.append(f"  videos    {folder} ({len(played.videos)} MP4s, episode-0.mp4 ...)")
    print("\n".join(lines), flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point (``moolib-eval``)."""
    output.quiet_when_closed()
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help", "help") for a in argv):
        print(_help())
        return
    try:
        args = parse(argv)
    except UsageError as e:
        _fail(str(e))
    # Only now torch and the envs: a mistake on the command line is told at once.
    from moolib.agents.runtime.evaluation import EvalError

    try:
        run(args)
    except (EvalError, MissingExtraError) as e:
        _fail(str(e))
    except KeyboardInterrupt:
        print("moolib-eval: interrupted", file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
