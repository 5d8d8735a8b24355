"""docs/library.md's Accumulator loop, to model version ``--steps``, for tests/test_accumulator.py.

Usage: docs_acc_loop.py --broker ADDR --seed S --transport shm|tcp --out PATH [--steps N]

The model starts from ``torch.manual_seed(S)`` (peers with different seeds
start different, as unseeded scripts do). The peer imports and builds
everything first, prints ``ready`` and waits for a line on stdin before it
connects, so that peers the test starts together reach the broker together
(not a Python import apart). At model version ``--steps`` it prints ``done`` and
leaves at the next line on stdin. At the end it writes a JSON object to ``--out``:
the exact bytes of its final state dict as hex, those of its initial one, and
the accumulator events it saw (``sent``: wants_state() and set_state();
``loaded``: has_new_state() and state()).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import moolib


def state_hex(model: torch.nn.Module) -> str:
    return b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()).hex()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--transport", choices=["shm", "tcp"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    # From here on, the loop of docs/library.md (bar the transport and the events).
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    initial = state_hex(model)
    acc = moolib.Accumulator("model", model.parameters(), model.buffers())
    acc.rpc.set_transports([args.transport])
    acc.set_virtual_batch_size(64)
    print("ready", flush=True)
    sys.stdin.readline()
    acc.connect(args.broker)
    events = []
    while acc.model_version() < args.steps:
        acc.update()
        if acc.wants_state():
            events.append("sent")
            acc.set_state({"model": model.state_dict(), "opt": opt.state_dict()})
        if acc.has_new_state():
            events.append("loaded")
            state = acc.state()
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        if not acc.connected():
            time.sleep(0.01)
            continue
        if acc.has_gradients():
            opt.step()
            acc.zero_gradients()
        elif acc.wants_gradients():
            opt.zero_grad()
            x = torch.randn(16, 4)
            model(x).pow(2).mean().backward()
            acc.reduce_gradients(16)
    with open(args.out, "w") as f:
        json.dump({"initial": initial, "final": state_hex(model), "events": events}, f)
    # Leaves once every peer is done: a peer leaving while another still finishes
    # the last round makes that one drop it and step alone (docs/library.md).
    print("done", flush=True)
    sys.stdin.readline()
    acc.close()


if __name__ == "__main__":
    main()
