"""``scaling=local``: a broker and the run's processes on this machine."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from moolib.conf.checks import ConfigError
from moolib.conf.schema.run_config import RunConfig
from moolib.conf.schema.scaling import ProcessScalingConfig, register_scaling

from ..peer import StopSignal


def check_peer_prefix(value: object) -> None:
    """Raises ConfigError unless ``value`` (``scaling.peer_prefix``) is a string a shell
    would split into words (quotes closed)."""
    if not isinstance(value, str):
        raise ConfigError(f"scaling.peer_prefix must be a string of words, got {value!r}")
    try:
        shlex.split(value)
    except ValueError as e:
        raise ConfigError(f"scaling.peer_prefix {value!r} cannot be split into words: {e}") from e


@dataclass(frozen=True)
class LocalScalingConfig(ProcessScalingConfig):
    """``scaling=local``: a broker and the peer processes on this machine."""

    # Words put before each peer's command, {rank} replaced by its rank (e.g.
    # "ip netns exec ns{rank}", "taskset -c {rank}"); "" for none. A savedir's
    # config.yaml from before this key has none: "".
    peer_prefix: str = field(default="", kw_only=True)

    def check(self, run: RunConfig) -> None:
        """The process counts, and ``peer_prefix`` splits into words."""
        super().check(run)
        check_peer_prefix(self.peer_prefix)


@register_scaling("local", LocalScalingConfig)
def start(cfg: RunConfig, config_path: Path, stop: StopSignal) -> int:
    """Runs the processes here until the run ends (``moolib.launch.local.run``)."""
    from ..local import run

    return run(cfg, config_path, stop)
