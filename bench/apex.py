"""Ape-X's actors and learner on Breakout-shaped data, each beside its limit, in one run.

    python bench/apex.py [--seconds 10] [--loops 1 2 4] [--batch-size 64]

Prints two tables:

- **Actor loops in one process.** Each loop runs Ape-X's acting step
  (``ApexActing.step``: one batched forward of the agent's network on 32
  observations of 4x84x84 frames, epsilon-greedy, n-step transitions and their
  initial priorities) as fast as it can, on recorded observations (no env, so
  the figure is the model's side alone). N loops as threads of one process
  (how ``agent.actor_loops`` runs them) beside N loops as processes (no GIL to
  share: the limit on the same cores). A ratio near 1 says the threads do not
  serialise on the GIL.
- **The learner on a full replay.** Learner steps per second sampling
  prioritized batches from a full ``moolib.Replay`` (frames stored once,
  ``dedup``), with importance weights, the loss, backward, clipping, the
  optimizer step and the priority update, beside the compute limit: the same
  loss, backward and step on one fixed batch of the same shape (no replay).

Both use one torch thread per loop (as actor processes do) and the network
``agent=apex env=breakout`` builds (the deep IMPALA torso, hidden 512).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import time

import torch

BATCH = 32  # envs per actor batch (conf/agent/apex.yaml)
OBS = (4, 84, 84)
ACTIONS = 4


def _config(hidden: int):
    from moolib.agents.apex import ApexConfig
    from moolib.agents.registry import OptimizerConfig

    return ApexConfig(
        name="apex",
        network="auto",
        use_lstm=False,
        hidden_size=hidden,
        actor_batch_size=BATCH,
        num_actor_batches=2,
        num_actor_cpus=2,
        batch_size=64,
        discounting=0.99,
        reward_clip=1.0,
        grad_norm_clipping=40.0,
        optimizer=OptimizerConfig(
            "rmsprop", 6.25e-5, 0.9, 0.999, 1.5e-7, 0.95, 0.0, "constant", True
        ),
        actor_loops=1,
        epsilon=0.4,
        epsilon_alpha=7.0,
        weight_sync=100,
        publish_interval=1,
        n_step=3,
        target_update=2500,
        replay_capacity=100_000,
        priority_exponent=0.6,
        importance_sampling_exponent=0.4,
        min_replay_size=1,
        samples_per_insert=0.0,
        save_replay=False,
        actor_buffer_size=50,
    )


def _acting_loop(
    hidden: int, seconds: float, start: float, out: object, torch_threads: int = 1
) -> None:
    """One actor loop: acts on recorded observations until ``start + seconds``."""
    from moolib.agents.apex import ApexActing
    from moolib.agents.math.apex import epsilon_schedule
    from moolib.agents.runtime.offpolicy import make_qnet

    torch.set_num_threads(torch_threads)
    cfg = _config(hidden)
    model = make_qnet(cfg, OBS, ACTIONS).eval()
    acting = ApexActing(cfg, epsilon_schedule(BATCH, dtype=torch.float32))
    g = torch.Generator().manual_seed(0)
    frames = [
        torch.randint(0, 256, (BATCH, *OBS), dtype=torch.uint8, generator=g) for _ in range(4)
    ]
    step = {"reward": torch.zeros(BATCH), "done": torch.zeros(BATCH, dtype=torch.bool)}
    while time.time() < start:
        time.sleep(0.001)
    steps, i = 0, 0
    while time.time() < start + seconds:
        step["state"] = frames[i % 4]
        acting.step(step, model)
        steps += BATCH
        i += 1
    out.put(steps)  # type: ignore[attr-defined]


def actor_loops(
    loops: int, hidden: int, seconds: float, threads: bool, torch_threads: int = 1
) -> float:
    """Env steps per second of ``loops`` actor loops, as threads or as processes, each
    process with ``torch_threads`` intra-op threads."""
    import queue
    import threading

    start = time.time() + (2.0 if threads else 8.0)  # processes take longer to start
    if threads:
        out: object = queue.Queue()
        workers = [
            threading.Thread(target=_acting_loop, args=(hidden, seconds, start, out, torch_threads))
            for _ in range(loops)
        ]
    else:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        workers = [
            ctx.Process(target=_acting_loop, args=(hidden, seconds, start, out, torch_threads))
            for _ in range(loops)
        ]
    for w in workers:
        w.start()
    total = sum(out.get() for _ in workers)  # type: ignore[attr-defined]
    for w in workers:
        w.join()
    return total / seconds


def _learner_step(hidden: int, device: str = "cpu") -> object:
    """Ape-X's learner step without the replay: ``step(items, weights) -> priorities``
    (loss, backward, clipping, centered RMSProp), on the network ``agent=apex
    env=breakout`` builds, on ``device``."""
    from moolib.agents.math import apex
    from moolib.agents.runtime.offpolicy import make_qnet

    cfg = _config(hidden)
    model = make_qnet(cfg, OBS, ACTIONS).to(device)
    target = copy.deepcopy(model)
    opt = torch.optim.RMSprop(model.parameters(), lr=6.25e-5, alpha=0.95, eps=1.5e-7, centered=True)

    def step(items: dict, weights: torch.Tensor) -> torch.Tensor:
        out = apex.loss(model, target, items, weights)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 40.0)
        opt.step()
        return out.priorities

    return step


def _transitions(n: int, g: torch.Generator) -> dict:
    """``n`` Breakout-shaped transitions whose stacked frames overlap, as Atari's do."""
    frames = torch.randint(0, 256, (n + 8, *OBS[1:]), dtype=torch.uint8, generator=g)
    idx = torch.arange(n)[:, None] + torch.arange(4)[None, :]
    return {
        "state": frames[idx],
        "action": torch.randint(0, ACTIONS, (n,), generator=g),
        "return": torch.rand(n, generator=g),
        "discount": torch.full((n,), 0.99**3),
        "next_state": frames[idx + 3],
    }


def _rate(fn: object, seconds: float, sync: object = None) -> float:
    """Calls of ``fn`` per second, after one warm-up call; ``sync()`` (if given) waits
    for the work the calls queued, before each clock reading."""
    wait = sync or (lambda: None)
    fn()  # type: ignore[operator]
    wait()  # type: ignore[operator]
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()  # type: ignore[operator]
        n += 1
    wait()  # type: ignore[operator]
    return n / (time.perf_counter() - t0)


def compute_limit(
    hidden: int, batch_size: int, seconds: float, threads: int = 1, device: str = "cpu"
) -> float:
    """Learner steps/s of the learner's compute alone: loss, backward, clipping and the
    optimizer step on one fixed batch of ``batch_size`` transitions (no replay), with
    ``threads`` torch threads, on ``device``. The batch is already on the device and
    nothing waits for a step's priorities: on a GPU the steps queue back to back."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    try:
        step = _learner_step(hidden, device)
        fixed = {
            k: v.to(dev)
            for k, v in _transitions(batch_size, torch.Generator().manual_seed(0)).items()
        }
        ones = torch.ones(batch_size, device=dev)
        return _rate(lambda: step(fixed, ones), seconds, sync)
    finally:
        torch.set_num_threads(previous)


def learner(hidden: int, batch_size: int, seconds: float, capacity: int) -> tuple[float, float]:
    """(learner steps/s on a full replay, learner steps/s on one fixed batch)."""
    from moolib.agents.math.offpolicy import importance_weights

    import moolib

    torch.set_num_threads(1)
    step = _learner_step(hidden)
    replay = moolib.Replay(capacity, alpha=0.6, dedup=("state", "next_state"), seed=0)
    g = torch.Generator().manual_seed(0)
    chunk = 1000
    for first in range(0, capacity, chunk):
        n = min(chunk, capacity - first)
        replay.insert(_transitions(n, g), torch.rand(n, generator=g) + 0.1)

    def from_replay() -> None:
        sample = replay.sample(batch_size)
        weights = importance_weights(sample.probabilities, sample.size, 0.4).float()
        priorities = step(sample.items, weights)  # type: ignore[operator]
        replay.update_priorities(sample.keys, priorities.double())

    fixed = replay.sample(batch_size).items
    ones = torch.ones(batch_size)

    def compute_only() -> None:
        step(fixed, ones)  # type: ignore[operator]

    # Alternate to share the machine's ups and downs between the two.
    with_replay, alone = [], []
    for _ in range(2):
        with_replay.append(_rate(from_replay, seconds))
        alone.append(_rate(compute_only, seconds))
    replay.close()
    return max(with_replay), max(alone)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--loops", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=64, help="learner batch (paper: 512)")
    parser.add_argument("--capacity", type=int, default=50_000, help="replay items")
    args = parser.parse_args()

    print(f"Actor loops in one process (Ape-X acting, batch {BATCH} of {OBS} frames)")
    print(f"{'loops':>5} {'threads steps/s':>16} {'processes steps/s':>18} {'ratio':>6}")
    for loops in args.loops:
        threads = actor_loops(loops, args.hidden, args.seconds, threads=True)
        procs = actor_loops(loops, args.hidden, args.seconds, threads=False)
        print(f"{loops:>5} {threads:>16,.0f} {procs:>18,.0f} {threads / procs:>6.2f}")

    print()
    print(f"Learner (batch {args.batch_size}, replay of {args.capacity:,} transitions, full)")
    with_replay, alone = learner(args.hidden, args.batch_size, args.seconds, args.capacity)
    items = with_replay * args.batch_size
    print(f"  on the replay  {with_replay:8.2f} steps/s  ({items:,.0f} items/s)")
    print(f"  compute limit  {alone:8.2f} steps/s")
    print(f"  ratio          {with_replay / alone:8.2f}")


if __name__ == "__main__":
    main()
