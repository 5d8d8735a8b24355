"""A peer that trains a small model through moolib.Accumulator, for tests/test_accumulator.py.

Usage: acc_trainer.py --broker ADDR --index I [--batch B] [--virtual-batch V]
                      [--parallel P] [--timeout S] [--model-version N] [--init-seed S]
                      [--start-members N] [--skip-first-round] [--save-at K --out PATH]
                      [--step-sleep S] [--stop-at N] [--order NAME]

The model (Linear -> BatchNorm1d -> ReLU -> Linear) starts from ``--init-seed``
(default: ``1000 + index``, so peers start different and must adopt the
leader's state). Each gradient round uses a batch seeded by (index, model
version, round within the step): see ``batch()``, which the test's reference
training uses too. Training starts once this peer's accumulator is connected in
a group of ``--start-members`` members; after that the peer trains with whoever
is there.

Prints one JSON object a line on stdout (``event``: hello, sync (the group's
membership changed), connected, disconnected, state_loaded, state_sent, step,
saved) with the model version, leader, group sync id and size, gradient stats
and a hash of the parameters; steps also carry hashes of the gradients applied
and of the optimizer's momentum. At ``--save-at`` model version it writes its
parameters, buffers and starting parameters to ``--out`` (torch.save). Runs
until its stdin closes or it is killed; ``--order`` picks the order of the
accumulator calls in its loop (see ORDERS); ``stop_at N`` on stdin (or
``--stop-at N``) makes it compute no gradients from model version N on;
``pause`` stops its loop (no accumulator call at all) until ``resume``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time

import torch

import moolib

IN_FEATURES = 4
HIDDEN = 8
OUT_FEATURES = 2


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN),
        torch.nn.BatchNorm1d(HIDDEN),
        torch.nn.ReLU(),
        torch.nn.Linear(HIDDEN, OUT_FEATURES),
    )


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def batch(index: int, version: int, sub: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic batch of peer ``index`` at ``version``, round ``sub`` of the step."""
    g = torch.Generator().manual_seed(1_000_003 * (index + 1) + 7919 * version + 31 * sub)
    x = torch.randn(size, IN_FEATURES, generator=g)
    y = torch.randn(size, OUT_FEATURES, generator=g)
    return x, y


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def tensors_hash(tensors) -> str:
    """A short hash of the exact bytes of ``tensors`` (equal hashes: identical values)."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def param_hash(model: torch.nn.Module) -> str:
    return tensors_hash(model.parameters())


# Orders of the calls after update() in one loop iteration: docs/library.md's,
# the original moolib example's (skip while not connected first), and one that
# handles gradients before the state.
ORDERS = {
    "readme": ("send", "load", "connected", "gradients"),
    "connected_first": ("connected", "send", "load", "gradients"),
    "gradients_first": ("connected", "gradients", "load", "send"),
}


def emit(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--broker", required=True)
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--virtual-batch", type=int, default=1)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--model-version", type=int, default=None)
    parser.add_argument("--init-seed", type=int, default=None)
    parser.add_argument("--start-members", type=int, default=1)
    parser.add_argument("--skip-first-round", action="store_true")
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--order", choices=sorted(ORDERS), default="readme")
    args = parser.parse_args()

    torch.set_num_threads(1)
    control = {"stop_at": args.stop_at, "paused": False}

    def read_commands() -> None:
        # "stop_at N": compute no gradients from model version N on ("stop_at
        # none": no limit). Never outlive the test: exit when stdin closes.
        for line in sys.stdin:
            words = line.split()
            if len(words) == 2 and words[0] == "stop_at":
                control["stop_at"] = None if words[1] == "none" else int(words[1])
            elif words in (["pause"], ["resume"]):
                control["paused"] = words[0] == "pause"
        os._exit(0)

    threading.Thread(target=read_commands, daemon=True).start()

    seed = args.init_seed if args.init_seed is not None else 1000 + args.index
    model = make_model(seed)
    model.train()
    opt = make_optimizer(model)

    acc = moolib.Accumulator("acc_test", model.parameters(), model.buffers())
    acc.group.set_timeout(args.timeout)
    acc.set_virtual_batch_size(args.virtual_batch)
    acc.set_parallel_gradients(args.parallel)
    if args.model_version is not None:
        acc.set_model_version(args.model_version)
    name = acc.rpc.get_name()
    emit(event="hello", name=name, index=args.index, hash=param_hash(model), pid=os.getpid())
    acc.connect(args.broker)

    started = False  # set once the group had --start-members members
    was_connected = False
    connected_in = None  # the membership (sync id) this peer was last connected in
    start_params = None  # parameters when first connected (after any state load)
    sub = 0  # gradient rounds started since the last step / state load
    saved = False
    sync_id = None
    settled = False

    def status(event: str, **extra) -> None:
        emit(
            event=event,
            name=name,
            index=args.index,
            version=acc.model_version(),
            leader=acc.get_leader(),
            is_leader=acc.is_leader(),
            members=len(acc.group.members()),
            sync=acc.group.sync_id(),
            # The membership the accumulator elected its leader in (white box;
            # the group's when unknown): the one its gradient rounds go to.
            acc_sync=getattr(acc, "_sync_id", None) or acc.group.sync_id(),
            stats=acc.get_gradient_stats(),
            hash=param_hash(model),
            **extra,
        )

    # The parts of one loop iteration after update(), run in the order
    # --order gives; each returns False to end the iteration early.

    def send_state() -> bool:
        if acc.wants_state():
            acc.set_state({"model": model.state_dict(), "optimizer": opt.state_dict()})
            status("state_sent")
        return True

    def load_state() -> bool:
        nonlocal sub
        if acc.has_new_state():
            st = acc.state()
            model.load_state_dict(st["model"])
            opt.load_state_dict(st["optimizer"])
            sub = 0
            status("state_loaded")
        return True

    def check_connected() -> bool:
        nonlocal was_connected, connected_in, sub, start_params, started
        connected = acc.connected()
        # A re-election can finish within one update(): the peer is then
        # connected again, in a new membership, without ever reading False.
        elected_in = getattr(acc, "_sync_id", None) if connected else None
        # Connected with the leader's state not loaded yet (a loop that checks
        # connected() first): the event waits until the model is the leader's.
        if (connected != was_connected or elected_in != connected_in) and not (
            connected and acc.has_new_state()
        ):
            was_connected, connected_in = connected, elected_in
            sub = 0  # rounds in flight were dropped
            status("connected" if connected else "disconnected")
        if not connected:
            time.sleep(0.01)
            return False
        if acc.has_new_state():
            return True
        if start_params is None:
            start_params = [p.detach().clone() for p in model.parameters()]
        if not started:
            # Start with everyone there, so that every round has every peer:
            # the test's reference training relies on it.
            if not settled or len(acc.group.members()) < args.start_members:
                time.sleep(0.01)
                return False
            started = True
        return True

    def gradients() -> bool:
        nonlocal sub, saved
        if not started:
            return True
        if acc.has_gradients():
            grad_hash = tensors_hash(p.grad for p in model.parameters())
            opt.step()
            acc.zero_gradients()
            sub = 0
            momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
            status("step", grad_hash=grad_hash, momentum_hash=tensors_hash(momentum))
            if args.save_at is not None and not saved and acc.model_version() >= args.save_at:
                saved = True
                torch.save(
                    {
                        "name": name,
                        "version": acc.model_version(),
                        "params": [p.detach().clone() for p in model.parameters()],
                        "buffers": [b.detach().clone() for b in model.buffers()],
                        "start": start_params,
                        "leader": acc.get_leader(),
                    },
                    args.out,
                )
                status("saved", path=args.out)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        elif acc.wants_gradients() and (
            control["stop_at"] is None or acc.model_version() < control["stop_at"]
        ):
            if args.skip_first_round and sub == 0:
                acc.skip_gradients()
            else:
                opt.zero_grad()
                x, y = batch(args.index, acc.model_version(), sub, args.batch)
                loss_fn(model, x, y).backward()
                acc.reduce_gradients(args.batch)
            sub += 1
        else:
            time.sleep(0.001)
        return True

    parts = {"send": send_state, "load": load_state, "connected": check_connected}
    parts["gradients"] = gradients
    order = [parts[p] for p in ORDERS[args.order]]

    while True:
        if control["paused"]:
            # A hung loop: the process and its core threads live on, but
            # nothing calls the accumulator.
            emit(event="paused", name=name, index=args.index)
            while control["paused"]:
                time.sleep(0.01)
        sync_before = acc.group.sync_id()
        acc.update()
        # The accumulator elected in the membership seen now (unless it changed
        # during update()): gradient rounds go to exactly this membership.
        settled = acc.group.sync_id() == sync_before
        if acc.group.sync_id() != sync_id:
            sync_id = acc.group.sync_id()
            status("sync", member_names=acc.group.members())
        for part in order:
            if not part():
                break


if __name__ == "__main__":
    main()
