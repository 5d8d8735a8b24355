"""``scaling=single``: the run's one peer in this process, beside a broker of its own."""

from __future__ import annotations

from pathlib import Path

from moolib.conf.schema.run_config import RunConfig
from moolib.conf.schema.scaling import ScalingConfig, register_scaling

from ..peer import StopSignal


@register_scaling("single", ScalingConfig)
def start(cfg: RunConfig, config_path: Path, stop: StopSignal) -> int:
    """Trains in this process (an off-policy run's actors as threads of it)."""
    from ..local import run_single

    run_single(cfg, stop)
    return 0
