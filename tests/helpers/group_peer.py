"""A moolib group member in its own process, for the Group and all-reduce tests.

Usage: group_peer.py --name NAME --broker ADDR [--tcp-name NAME2]

Has an Rpc named NAME (every transport) connected to the broker at ADDR and,
with --tcp-name, a second one named NAME2 restricted to TCP (its all-reduces go
through sockets although every member is on this host). Prints ``READY NAME``,
then answers JSON commands, one a line on stdin, with one JSON line each on
stdout: ``{"ok": true, ...}`` or ``{"ok": false, "type": ..., "error": ...}``.
Exits when stdin closes (so it never outlives the test that started it).

Commands (see tests/helpers/group_util.py for the client side):
  join   {group, rpc: "default" (or "shm")|"tcp", group_timeout, sort?, broker_name?}
  sort   {group, order}
  status {group} -> {members, sync_id, active, name, timeout}
  update {group} -> {changed}
  start  {group, key, name, case, seed, op?, when_members?}: starts an all-reduce
         of case_data(case, seed) (op: null for the sum, "add", "max" or "sub"),
         once the group has when_members members if given
  result {key, wait, out?} -> waits up to wait seconds; pickles the result to out
  close  {group}
  ping   {token} -> {token}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import sys
import threading
import time
import traceback

import torch
from group_util import case_data

import moolib

OPS = {
    None: None,
    "add": lambda a, b: a + b,
    "max": torch.maximum,
    # Not commutative: shows the fold order (member order).
    "sub": lambda a, b: a - b,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--broker", required=True)
    parser.add_argument("--tcp-name", default=None)
    args = parser.parse_args()

    rpcs = {}
    rpc = moolib.Rpc()
    rpc.set_name(args.name)
    rpc.connect(args.broker)
    rpcs["default"] = rpcs["shm"] = rpc
    if args.tcp_name:
        tcp = moolib.Rpc()
        tcp.set_name(args.tcp_name)
        tcp.set_transports(["tcp"])
        tcp.connect(args.broker)
        rpcs["tcp"] = tcp

    groups: dict[str, moolib.Group] = {}
    holds: dict[str, contextlib.ExitStack] = {}
    handles: dict[str, moolib.AllReduce] = {}

    def run(cmd):
        c = cmd["cmd"]
        if c == "join":
            r = rpcs[cmd.get("rpc", "default")]
            g = moolib.Group(r, cmd["group"])
            g.set_timeout(cmd.get("group_timeout", 10.0))
            if "sort" in cmd:
                g.set_sort_order(cmd["sort"])
            if cmd.get("broker_name"):
                g.set_broker_name(cmd["broker_name"])
            g.update()  # joins
            # This program calls update() only when a test says so: it keeps
            # its membership explicitly instead (see Group.keepalive).
            holds[cmd["group"]] = contextlib.ExitStack()
            holds[cmd["group"]].enter_context(g.keepalive())
            groups[cmd["group"]] = g
            return {}
        if c == "sort":
            groups[cmd["group"]].set_sort_order(cmd["order"])
            return {}
        if c == "status":
            g = groups[cmd["group"]]
            return {
                "members": g.members(),
                "sync_id": g.sync_id(),
                "active": g.active(),
                "name": g.name(),
                "timeout": g.get_timeout(),
            }
        if c == "update":
            return {"changed": groups[cmd["group"]].update()}
        if c == "start":
            g = groups[cmd["group"]]
            if cmd.get("when_members"):  # start as soon as this many members are seen
                deadline = time.monotonic() + 60
                while not (g.active() and len(g.members()) == cmd["when_members"]):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"never saw {cmd['when_members']} members")
                    time.sleep(0.002)
            data = case_data(cmd["case"], cmd["seed"], g.rpc.get_name())
            handles[cmd["key"]] = g.all_reduce(cmd["name"], data, op=OPS[cmd.get("op")])
            return {}
        if c == "result":
            h = handles.pop(cmd["key"])
            value = h.result(timeout=cmd["wait"])
            if cmd.get("out"):
                with open(cmd["out"], "wb") as f:
                    pickle.dump(value, f)
            return {"path": cmd.get("out")}
        if c == "ping":
            return {"token": cmd["token"]}
        if c == "close":
            holds.pop(cmd["group"]).close()
            groups.pop(cmd["group"]).close()
            return {}
        raise ValueError(f"unknown command {c!r}")

    print(f"READY {args.name}", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            reply = {"ok": True, **run(cmd)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            reply = {
                "ok": False,
                "type": type(e).__name__,
                "error": str(e),
                "traceback": traceback.format_exc(),
            }
        reply["cmd"] = cmd["cmd"]
        print(json.dumps(reply), flush=True)
    os._exit(0)


if __name__ == "__main__":
    threading.current_thread().name = "group-peer-main"
    main()
