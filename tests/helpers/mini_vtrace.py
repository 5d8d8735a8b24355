"""The original moolib's V-trace example (examples/vtrace/experiment.py) in miniature.

A program written against the original moolib API, in the shape of its example
agent: an EnvPool of two double-buffered actor batches, per-batch time Batchers
that cut unrolls, a learner Batcher that concatenates them along dim 1, an
Accumulator driven by the example's loop (state hand-over, gradients, optimizer
step), and global stats summed through ``Group.all_reduce`` with a custom op.
The env is tests/helpers/toy_envs.ToyEnv and the model a small MLP.

Usage: mini_vtrace.py --connect BROKER_ADDRESS [--project NAME] [--seed S]

Prints one JSON object a line (``event``: state_sent, state_loaded, step) with
the model version and a hash of the parameters. Runs until its stdin closes.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import sys
import threading
import time

import torch
from toy_envs import ToyEnv

import moolib

NUM_ACTIONS = 7


def emit(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def params_hash(model: torch.nn.Module) -> str:
    h = hashlib.sha1()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class Net(torch.nn.Module):
    """Policy and baseline over the toy env's grid, position and previous action."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(3 * 5 + 2 + NUM_ACTIONS, 32),
            torch.nn.ReLU(),
        )
        self.policy = torch.nn.Linear(32, NUM_ACTIONS)
        self.baseline = torch.nn.Linear(32, 1)

    def forward(self, inputs: dict) -> dict:
        # inputs: [T, B, ...] like the original's models.
        grid = inputs["grid"]
        T, B = grid.shape[:2]
        x = torch.cat(
            [
                grid.reshape(T, B, -1).float() / 255.0,
                inputs["pos"].float(),
                torch.nn.functional.one_hot(inputs["prev_action"], NUM_ACTIONS).float(),
            ],
            dim=-1,
        )
        h = self.body(x)
        logits = self.policy(h)
        action = torch.multinomial(torch.softmax(logits.reshape(T * B, -1), -1), 1)
        return {
            "policy_logits": logits,
            "baseline": self.baseline(h).squeeze(-1),
            "action": action.view(T, B),
        }


class EnvBatchState:
    """One actor batch: its pending step, previous action and time batcher."""

    def __init__(self, flags: argparse.Namespace) -> None:
        self.prev_action = torch.zeros(flags.actor_batch_size, dtype=torch.long)
        self.future = None
        self.running_reward = torch.zeros(flags.actor_batch_size)
        self.step_count = torch.zeros(flags.actor_batch_size)
        self.time_batcher = moolib.Batcher(flags.unroll_length + 1, flags.device)

    def update(self, env_outputs: dict, action: torch.Tensor, stats: dict) -> None:
        self.prev_action = action
        self.running_reward += env_outputs["reward"]
        self.step_count += 1
        done = env_outputs["done"]
        stats["episodes_done"] += int(done.sum().item())
        self.running_reward *= ~done
        self.step_count *= ~done


def create_env(flags: argparse.Namespace) -> ToyEnv:
    env = ToyEnv()
    env.flags = flags  # the original's factory configures the env from FLAGS
    return env


def vtrace_loss(flags: argparse.Namespace, model: Net, batch: dict) -> torch.Tensor:
    env, actor = batch["env"], batch["actor"]
    out = model(env)
    # Step t's env output holds the reward of the action chosen at step t - 1.
    actions = actor["action"][:-1]
    rewards = env["reward"][1:]
    discounts = (~env["done"][1:]).float() * flags.discounting
    target_logp = torch.log_softmax(out["policy_logits"][:-1], -1)
    behaviour_logp = torch.log_softmax(actor["policy_logits"][:-1], -1)
    taken = target_logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    log_rhos = taken.detach() - behaviour_logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1)
    rhos = torch.exp(log_rhos).clamp(max=1.0)
    values = out["baseline"][:-1]
    bootstrap = out["baseline"][-1].detach()
    with torch.no_grad():
        next_values = torch.cat([values[1:], bootstrap.unsqueeze(0)])
        deltas = rhos * (rewards + discounts * next_values - values)
        acc = torch.zeros_like(bootstrap)
        corrections = []
        for t in reversed(range(deltas.shape[0])):
            acc = deltas[t] + discounts[t] * rhos[t] * acc
            corrections.append(acc)
        vs = torch.stack(corrections[::-1]) + values
        next_vs = torch.cat([vs[1:], bootstrap.unsqueeze(0)])
        advantages = rhos * (rewards + discounts * next_vs - values)
    pg_loss = -(taken * advantages).mean()
    baseline_loss = 0.5 * ((vs - values) ** 2).mean()
    entropy = -(
        torch.softmax(out["policy_logits"], -1) * torch.log_softmax(out["policy_logits"], -1)
    )
    return pg_loss + flags.baseline_cost * baseline_loss - flags.entropy_cost * entropy.mean()


class GlobalStatsAccumulator:
    """Sums stats across the group as the original example does: an all-reduce
    with a custom op, one in flight at a time, resent after a failure."""

    def __init__(self, group: moolib.Group, global_stats: dict) -> None:
        self.group = group
        self.global_stats = global_stats
        self.reduce_future = None
        self.sent = None
        self.prev_stats: dict | None = None
        self.queued: dict | None = None

    @staticmethod
    def add_stats(dst: dict, src: dict) -> dict:
        for k, v in src.items():
            dst[k] = dst.get(k, 0) + v
        return dst

    def reduce(self, stats: dict) -> None:
        if self.reduce_future is not None and self.reduce_future.done():
            if self.reduce_future.exception() is not None:
                self.queued = self.add_stats(self.queued or {}, self.sent)
            else:
                self.add_stats(self.global_stats, self.reduce_future.result())
            self.reduce_future = None
        diff = {k: v - (self.prev_stats or {}).get(k, 0) for k, v in stats.items()}
        self.prev_stats = copy.deepcopy(stats)
        self.queued = self.add_stats(self.queued or {}, diff)
        if self.reduce_future is None:
            self.sent, self.queued = self.queued, None
            self.reduce_future = self.group.all_reduce("global stats", self.sent, op=self.add_stats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--connect", required=True)
    parser.add_argument("--project", default="mini_vtrace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--actor_batch_size", type=int, default=4)
    parser.add_argument("--num_actor_batches", type=int, default=2)
    parser.add_argument("--num_actor_processes", type=int, default=1)
    parser.add_argument("--unroll_length", type=int, default=6)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--virtual_batch_size", type=int, default=8)
    parser.add_argument("--discounting", type=float, default=0.9)
    parser.add_argument("--baseline_cost", type=float, default=0.5)
    parser.add_argument("--entropy_cost", type=float, default=0.01)
    FLAGS = parser.parse_args()  # noqa: N806 - the original's name

    # Never outlive the test: exit when stdin closes.
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    torch.set_num_threads(1)
    torch.manual_seed(FLAGS.seed)  # peers start different: the leader's state wins

    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    rpc = moolib.Rpc()
    rpc.set_name(moolib.create_uid())
    rpc.connect(FLAGS.connect)
    rpc_group = moolib.Group(rpc, name=FLAGS.project)
    accumulator = moolib.Accumulator(
        group=rpc_group,
        name="model",
        parameters=model.parameters(),
        buffers=model.buffers(),
    )
    accumulator.set_virtual_batch_size(FLAGS.virtual_batch_size)

    learn_batcher = moolib.Batcher(FLAGS.batch_size, FLAGS.device, dim=1)
    stats = {"env_train_steps": 0, "episodes_done": 0}
    global_stats: dict = {}
    global_stats_accumulator = GlobalStatsAccumulator(rpc_group, global_stats)

    envs = moolib.EnvPool(
        lambda: create_env(FLAGS),
        num_processes=FLAGS.num_actor_processes,
        batch_size=FLAGS.actor_batch_size,
        num_batches=FLAGS.num_actor_batches,
    )
    env_states = [EnvBatchState(FLAGS) for _ in range(FLAGS.num_actor_batches)]
    for i, env_state in enumerate(env_states):
        env_state.future = envs.step(i, env_state.prev_action)

    def act() -> None:
        for i, env_state in enumerate(env_states):
            cpu_env_outputs = env_state.future.result()
            env_outputs = {k: v.to(FLAGS.device, copy=True) for k, v in cpu_env_outputs.items()}
            env_outputs["prev_action"] = env_state.prev_action
            model.eval()
            with torch.no_grad():
                actor_outputs = model({k: v.unsqueeze(0) for k, v in env_outputs.items()})
            actor_outputs = {k: v.squeeze(0) for k, v in actor_outputs.items()}
            action = actor_outputs["action"]
            env_state.update(cpu_env_outputs, action, stats)
            # envs.step invalidates cpu_env_outputs (a view of shared memory).
            del cpu_env_outputs
            env_state.future = envs.step(i, action)
            stats["env_train_steps"] += FLAGS.actor_batch_size

            env_state.time_batcher.stack({"env": env_outputs, "actor": actor_outputs})
            if not env_state.time_batcher.empty():
                unroll = env_state.time_batcher.get()
                learn_batcher.cat(unroll)
                # The last step of this unroll is the first of the next.
                env_state.time_batcher.stack(
                    {k: {kk: vv[-1] for kk, vv in v.items()} for k, v in unroll.items()}
                )

    while True:
        accumulator.update()
        if accumulator.wants_state():
            accumulator.set_state(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            )
            emit(event="state_sent", version=accumulator.model_version())
        if accumulator.has_new_state():
            state = accumulator.state()
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            emit(
                event="state_loaded",
                version=accumulator.model_version(),
                hash=params_hash(model),
            )
        if not accumulator.connected():
            time.sleep(0.05)
            continue

        global_stats_accumulator.reduce(stats)

        if accumulator.has_gradients():
            gradient_stats = accumulator.get_gradient_stats()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 40.0)
            optimizer.step()
            accumulator.zero_gradients()
            emit(
                event="step",
                version=accumulator.model_version(),
                hash=params_hash(model),
                leader=accumulator.is_leader(),
                batch_size=gradient_stats["batch_size"],
                num_gradients=gradient_stats["num_gradients"],
                local_steps=stats["env_train_steps"],
                global_steps=global_stats.get("env_train_steps", 0),
            )
        elif not learn_batcher.empty() and accumulator.wants_gradients():
            model.train()
            loss = vtrace_loss(FLAGS, model, learn_batcher.get())
            loss.backward()
            accumulator.reduce_gradients(FLAGS.batch_size)
        else:
            act()


if __name__ == "__main__":
    main()
