"""One training peer: ``python -m moolib.launch.peer --config <savedir>/config.yaml
--rank N --broker host:port``. Started by moolib-run's local and SLURM modes.

The first SIGINT or SIGTERM stops the peer after its current step (the leader
writes a checkpoint first); a second SIGINT interrupts at once.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from . import config as config_lib


def logdir_for(savedir: Path, rank: int, peers: int) -> Path:
    """A lone peer logs into the savedir; each of several into ``peer<rank>/``."""
    return savedir if peers == 1 else savedir / f"peer{rank}"


def stop_on_signals() -> threading.Event:
    """An event set by the first SIGINT/SIGTERM; a second SIGINT raises KeyboardInterrupt."""
    stop = threading.Event()

    def handle(signum: int, frame: Any) -> None:
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)
    return stop


def make_trainer(cfg: Any, rank: int, broker: str) -> Any:
    """The Trainer of peer ``rank`` of the experiment described by ``cfg``."""
    from moolib.agents.training import PeerInfo, Trainer

    savedir = Path(cfg.savedir)
    peer = PeerInfo(
        rank=rank,
        savedir=savedir,
        logdir=logdir_for(savedir, rank, cfg.scaling.peers),
        broker=broker,
    )
    return Trainer(cfg, peer)


def train(cfg: Any, rank: int, broker: str, stop: threading.Event) -> dict:
    """Runs one peer of the experiment described by ``cfg`` until done or stopped."""
    return make_trainer(cfg, rank, broker).run(stop)


def main(argv: list[str] | None = None) -> int:
    """Entry point of a peer process."""
    parser = argparse.ArgumentParser(prog="python -m moolib.launch.peer")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--broker", required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[peer {args.rank}] %(message)s")
    cfg = config_lib.load(args.config)
    train(cfg, args.rank, args.broker, stop_on_signals())
    # Done: a late SIGTERM from the launcher (sent after Ctrl-C reached the
    # whole process group) must not kill the interpreter's clean exit.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
