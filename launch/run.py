"""``moolib-run``: the Hydra app that composes an agent, an env and a scaling mode.

    moolib-run agent=vtrace env=breakout
    moolib-run agent=a2c env=cartpole scaling=local scaling.peers=2
    moolib-run -m agent.optimizer.learning_rate=6e-4,3e-4
    moolib-run agent=vtrace env=breakout scaling=slurm scaling.peers=8

The composed config is checked (a bad value stops the run with a message that
names its key), resolved and written to ``<savedir>/config.yaml``; peers read it
from there. Reusing a savedir resumes from its latest checkpoint.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from . import config as config_lib
from . import local, report
from .peer import stop_on_signals, train

log = logging.getLogger("moolib.launch")


def _or_default(value: object, default: object) -> object:
    return default if value is None else value


@report.with_summary
def _run(cfg: DictConfig) -> int:
    savedir = Path(HydraConfig.get().runtime.output_dir)
    try:
        final = config_lib.prepare(cfg, savedir)
    except config_lib.ConfigError as e:
        print(f"moolib-run: error: {e}", file=sys.stderr)
        sys.exit(2)
    config_path = config_lib.save(final, savedir)
    stop = stop_on_signals()
    mode = final.scaling.name
    if mode == "local":
        code = local.run(final, config_path, stop)
        if code:
            sys.exit(code)
        return 0
    if mode == "slurm":
        from . import slurm  # submitit is only needed here

        try:
            launched = slurm.launch(final, config_path, stop)
        except (RuntimeError, TimeoutError) as e:
            print(f"moolib-run: error: {e}", file=sys.stderr)
            sys.exit(1)
        if final.scaling.wait:
            code = slurm.follow(launched, stop)
            if code:
                sys.exit(code)
        return 0
    if mode == "single":
        broker = None if final.broker else local.EmbeddedBroker()
        try:
            train(final, 0, final.broker or broker.address, stop)
        finally:
            if broker:
                broker.close()
        return 0
    print(
        f"moolib-run: error: scaling.name {mode!r} is not one of single, local, slurm",
        file=sys.stderr,
    )
    sys.exit(2)


def main() -> None:
    """Console entry point (Hydra parses the command line)."""
    if not OmegaConf.has_resolver("or_default"):
        OmegaConf.register_new_resolver("or_default", _or_default)
    report.register_resolvers()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    app = hydra.main(config_path="pkg://moolib.conf", config_name="config", version_base="1.3")
    app(_run)()


if __name__ == "__main__":
    main()
