"""End-to-end training throughput of moolib-run, beside its limits, in one run.

    python bench/train.py [--seconds 90] [--warmup 30] [--device cpu]
    python bench/train.py --cases --apex-loops 1 2 4 [--apex-seconds 45] [--apex-replay 2000]

For V-trace on Breakout (the deep IMPALA network; actor batch 32 x 2 on 2 env
processes, learner batch 8, unroll 20, as in the original moolib's example) and
A2C on CartPole (conf/tuning/a2c_cartpole.yaml), prints, per case, in one run on
the same machine (each limit measured right after the runs):

- moolib-run's end-to-end SPS (env steps learned from per second, from its
  logs.tsv after a warm-up), its actors' env steps/s over the same rows, and
  the cores its own process and its env workers kept busy meanwhile (CPU
  seconds per second, from /proc);
- the EnvPool limit: the ``moolib.EnvPool`` moolib-run builds for that config
  (``agents/runtime/base.py``'s ``make_envs``: the same env factory and options,
  ``num_actor_cpus`` worker processes, ``num_actor_batches`` batches of
  ``actor_batch_size`` envs), stepped double-buffered (a batch steps while the
  other is in flight) with random actions and nothing else, in env steps/s;
  and the run's SPS as a ratio to it;
- the loop's limit: the same moolib-run with a network that costs almost
  nothing (``--tiny``, by default ``agent.network=tiny agent.hidden_size=16``,
  one layer on the frames subsampled to 8x8), its SPS and its ratio to the EnvPool limit
  (issue 39's bar on Atari: >= 0.8);
- the learner's compute limit: forward + backward + optimizer step on learner
  batches of the same shape, in a loop on the same device, in env steps per
  second (unroll_length * batch_size per learner batch), and the compute limit
  of acting and learning together (adding the actors' forward passes per env
  step), each with the run's SPS as a ratio to it;
- the original moolib's published figure on these machines where there is one
  (~63 SPS for V-trace on Breakout on CPU).

``--torch-threads auto N ...`` runs each case once per setting of moolib-run's
``torch_threads`` (``N`` = this machine's core count is torch's own default;
the limits once per case, the tiny-network run with the first setting), and
``--busy-cores K`` keeps K other processes spinning meanwhile (a busy
neighbour), so the two can be compared in one run.

``--baseline-python PATH`` runs each case again right after ours with another
venv's interpreter, i.e. another version of moolib (the starting commit of a
change, installed in a second venv), and prints its SPS and ours as a ratio to it.
``--device cuda`` adds the GPU's utilisation over the timed run (``nvidia-smi``,
sampled every second).

``--apex-loops 1 2 4`` (``--cases`` with no names skips the cases above) runs
Ape-X on Breakout (``agent=apex env=breakout``, the real ALE, scaling=single:
the learner and ``agent.actor_loops`` actor loops as threads of one process)
once per loop count, with a replay of ``--apex-replay`` transitions that the
learner starts sampling only when it is full (``min_replay_size`` = capacity)
and learner batches of ``--apex-batch``. From each run's logs.tsv, over the
rows after the learner's first update (all with the replay full), it prints:

- the actors' env steps/s while the learner runs, beside the EnvPool limit
  (one ``moolib.EnvPool`` per loop, as the actor loops build them, each stepped
  double-buffered with random actions and nothing else by a thread of this
  process, all at once, measured in the same run) and beside the acting limit
  (Ape-X's acting step, the network's batched forward and the n-step
  bookkeeping, on recorded frames, no env, with the run's torch threads);
- the learner's updates/s and sampled items/s beside its compute limit
  (loss, backward, clipping and the optimizer step on one fixed batch of the
  same shape already on ``--device``, no replay, with the learner's torch
  threads; on a GPU the steps queue back to back).

Targets (issue 16): actors >= 0.8 of the EnvPool limit, learner >= 0.8 of
its compute limit.
"""

from __future__ import annotations

import argparse
import csv
import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from moolib.agents import vtrace
from moolib.agents.nets.models import create_model
from moolib.conf.schema.run_config import RunConfig

ORIGINAL_MOOLIB_VTRACE_BREAKOUT_CPU_SPS = 63.0

# The loop-limit run's overrides: the tiny network (agents/nets/models.py: one layer of width
# 16 on frames subsampled to 8x8 cells), whose forward and backward cost almost nothing
# beside the env step. (An MLP of width 16 on whole 84x84x4 frames does not: its
# 451k multiply-adds per frame, forward and backward, cost about a quarter of a core at
# the EnvPool limit of this machine's Breakout.)
TINY_NETWORK = ("agent.network=tiny", "agent.hidden_size=16")

CASES = {
    "vtrace-breakout": {
        "overrides": ["agent=vtrace", "env=breakout"],
        "obs": (4, 84, 84),
        "actions": 4,
        "network": "impala_deep",
        "batch_size": 8,
        "unroll_length": 20,
        "hidden": 256,
        "reference": ORIGINAL_MOOLIB_VTRACE_BREAKOUT_CPU_SPS,
    },
    "a2c-cartpole": {
        "overrides": ["agent=a2c", "env=cartpole"],
        "obs": (4,),
        "actions": 2,
        "network": "mlp",
        "batch_size": 16,
        "unroll_length": 16,
        "hidden": 64,
        "reference": None,
    },
}


def _timed(fn: object, seconds: float) -> float:
    """Seconds per call of ``fn`` (after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return (time.perf_counter() - start) / n


def limits(case: dict, device: str, seconds: float) -> tuple[float, float]:
    """Env steps/s of (1) the learner alone: forward + backward + optimizer step
    on learner batches with the V-trace loss, and (2) the model's compute for
    acting and learning together: per env step, the actor's forward pass on an
    actor batch (T=1) plus the learner's share; no envs, no moolib."""
    torch.manual_seed(0)
    model = create_model(
        case["obs"], case["actions"], network=case["network"], hidden_size=case["hidden"]
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    t, b = case["unroll_length"] + 1, case["batch_size"]
    if len(case["obs"]) == 3:
        state = torch.randint(0, 255, (t, b, *case["obs"]), dtype=torch.uint8)
    else:
        state = torch.randn(t, b, *case["obs"])
    batch = {
        "state": state.to(device),
        "reward": torch.randn(t, b, device=device),
        "done": torch.rand(t, b, device=device) < 0.05,
        "prev_action": torch.randint(0, case["actions"], (t, b), device=device),
        "action": torch.randint(0, case["actions"], (t, b), device=device),
        "policy_logits": torch.randn(t, b, case["actions"], device=device),
        "baseline": torch.randn(t, b, device=device),
    }

    class Cfg:
        reward_clip = 1.0
        discounting = 0.99
        clip_rho_threshold = 1.0
        clip_pg_rho_threshold = 1.0
        baseline_cost = 0.5
        entropy_cost = 0.01

    def one() -> None:
        opt.zero_grad()
        inputs = {k: batch[k] for k in ("state", "reward", "done", "prev_action")}
        outputs, _ = model(inputs, ())
        loss, _ = vtrace.compute_loss(Cfg, outputs, batch)
        loss.backward()
        opt.step()

    actor_batch = 32 if len(case["obs"]) == 3 else 16
    act_inputs = {
        k: batch[k][:1, :1].expand(1, actor_batch, *batch[k].shape[2:]).contiguous()
        for k in ("state", "reward", "done", "prev_action")
    }

    def act() -> None:
        with torch.no_grad():
            model(act_inputs, ())

    def synced(fn: object) -> object:
        def call() -> None:
            fn()
            if device.startswith("cuda"):
                torch.cuda.synchronize()

        return call

    learn_per_step = _timed(synced(one), seconds / 2) / (case["unroll_length"] * b)
    act_per_step = _timed(synced(act), seconds / 2) / actor_batch
    return 1.0 / learn_per_step, 1.0 / (learn_per_step + act_per_step)


def _run_command(overrides: list[str], savedir: str, python: str = sys.executable) -> list[str]:
    """A moolib-run (by ``python``) that runs until interrupted, logging every 2 s, no
    checkpoint before the end."""
    return [
        python,
        "-m",
        "moolib.launch.run",
        *overrides,
        f"savedir={savedir}",
        "total_steps=1000000000",
        "log_interval=2",
        "checkpoint_interval=1000000",
    ]


def _interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C: the run stops after its current step (killed if it takes 2 minutes)."""
    proc.send_signal(2)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by process ``pid``, and by its
    descendants alive now (the env workers) together, from /proc; nan where /proc
    cannot tell."""
    tick = os.sysconf("SC_CLK_TCK")

    def used(p: int) -> float:
        with open(f"/proc/{p}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / tick  # utime, stime

    def children(p: int) -> list[int]:
        kids = []
        for task in os.listdir(f"/proc/{p}/task"):
            with open(f"/proc/{p}/task/{task}/children") as f:
                kids += [int(k) for k in f.read().split()]
        return kids

    try:
        own, rest, todo = used(pid), 0.0, children(pid)
    except OSError:
        return float("nan"), float("nan")
    while todo:
        child = todo.pop()
        try:
            rest += used(child)
            todo += children(child)
        except OSError:  # gone meanwhile
            pass
    return own, rest


class GpuBusy:
    """The mean of ``nvidia-smi``'s GPU utilisation (percent of time a kernel ran),
    sampled every second on a thread between ``start`` and ``stop``; nan without
    nvidia-smi."""

    def __init__(self) -> None:
        import threading

        self.samples: list[float] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(1.0):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
                self.samples.append(float(out.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float:
        self._done.set()
        self._thread.join()
        return sum(self.samples) / len(self.samples) if self.samples else float("nan")


def run_sps(
    case: dict,
    device: str,
    seconds: float,
    warmup: float,
    threads: str = "auto",
    extra: tuple[str, ...] = (),
    python: str = sys.executable,
) -> dict:
    """One moolib-run of ``case`` (``extra`` overrides after the case's own) by the
    interpreter ``python`` (another venv's: another version of moolib), for ``warmup``
    + ``seconds``, then Ctrl-C. Returns its SPS (steps learned per second between the
    first log row after ``warmup`` seconds and the last row), its actors' env steps per
    second over the same rows, the cores the run's own process and its env workers kept
    busy over the timed ``seconds`` (CPU seconds per second), the GPU's utilisation
    meanwhile (on CUDA), and the command's overrides."""
    with tempfile.TemporaryDirectory() as savedir, tempfile.TemporaryFile() as err:
        cmd = _run_command(
            [*case["overrides"], *extra, f"device={device}", f"torch_threads={threads}"],
            savedir,
            python,
        )
        env = dict(os.environ, WANDB_MODE="disabled")
        # stderr to a file: a pipe nobody reads would stall the run once full.
        # cwd: not this checkout, whose moolib/ another venv's interpreter would import.
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=savedir)
        gpu = GpuBusy()
        try:
            time.sleep(warmup)
            before, since = _cpu_seconds(proc.pid), time.monotonic()
            if device.startswith("cuda"):
                gpu.start()
            time.sleep(seconds)
            after, span = _cpu_seconds(proc.pid), time.monotonic() - since
        finally:
            gpu_busy = gpu.stop() if device.startswith("cuda") else float("nan")
            _interrupt(proc)
        with open(Path(savedir) / "logs.tsv") as f:
            rows = [r for r in csv.DictReader(f, delimiter="\t")]
        err.seek(0)
        stderr = err.read().decode(errors="replace")
    result = {
        "sps": float("nan"),
        "env_sps": float("nan"),
        "run_cores": (after[0] - before[0]) / span,
        "worker_cores": (after[1] - before[1]) / span,
        "gpu_busy": gpu_busy,
        "command": " ".join(cmd[3:]),
    }
    timed = [r for r in rows if float(r["time"]) >= warmup and r["step"]]
    if len(timed) < 2:
        print(f"  no timed rows from {result['command']}:\n{stderr[-2000:]}", file=sys.stderr)
        return result
    first, last = timed[0], timed[-1]
    span = float(last["time"]) - float(first["time"])
    result["sps"] = (int(last["step"]) - int(first["step"])) / span
    # Each row's env_sps is over the interval since the row before it.
    result["env_sps"] = (
        sum(
            _num(r, "env_sps") * (float(r["time"]) - float(prev["time"]))
            for prev, r in zip(timed[:-1], timed[1:], strict=True)
        )
        / span
    )
    return result


# -- Ape-X on Breakout ---------------------------------------------------------------------

APEX_OVERRIDES = ["agent=apex", "env=breakout", "scaling=single"]


def _config(overrides: list[str]) -> RunConfig:
    """moolib-run's composed, checked and typed config for ``overrides`` (for the limits'
    pools)."""
    from hydra import compose, initialize_config_module
    from moolib.launch import config as config_lib

    with initialize_config_module(config_module="moolib.conf", version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    return config_lib.validate(cfg)


def _apex_config(loops: int, batch: int, replay: int) -> RunConfig:
    """The composed and checked config the Ape-X runs use (for the limits' pools)."""
    return _config(_apex_overrides(loops, batch, replay))


def _apex_overrides(loops: int, batch: int, replay: int) -> list[str]:
    return [
        *APEX_OVERRIDES,
        f"agent.actor_loops={loops}",
        f"agent.batch_size={batch}",
        f"agent.replay_capacity={replay}",
        f"agent.min_replay_size={replay}",
    ]


def _read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    if len(lines) < 2:
        return []
    header = lines[0].split("\t")
    rows = []
    for line in lines[1:]:
        values = line.split("\t")
        if len(values) == len(header):
            rows.append(dict(zip(header, values, strict=True)))
    return rows


def _num(row: dict, key: str) -> float:
    value = row.get(key, "")
    return float(value) if value not in ("", None) else float("nan")


def apex_run(
    loops: int, device: str, seconds: float, batch: int, replay: int, start_timeout: float
) -> dict:
    """One moolib-run of Ape-X on Breakout: runs until the learner has updated for
    ``seconds`` (after its first update, with the replay full), then Ctrl-C.
    Returns the actors' env steps/s while the learner ran and while it waited for
    the replay to fill, the learner's updates/s and samples/s, and the command."""
    with tempfile.TemporaryDirectory() as savedir:
        cmd = _run_command([*_apex_overrides(loops, batch, replay), f"device={device}"], savedir)
        env = dict(os.environ, WANDB_MODE="disabled")
        logs = Path(savedir) / "logs.tsv"
        with open(Path(savedir).parent / f"apex-bench-{os.getpid()}.log", "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + start_timeout
            learning_since = None
            while proc.poll() is None and time.monotonic() < deadline:
                rows = _read_rows(logs)
                if learning_since is None and any(_num(r, "updates") > 0 for r in rows):
                    learning_since = time.monotonic()
                    deadline = learning_since + seconds + 2 * 2  # two more log rows
                time.sleep(0.5)
        finally:
            _interrupt(proc)
        rows = _read_rows(logs)
    result = {
        "command": " ".join(cmd[3:]),
        "env_sps": float("nan"),
        "fill_env_sps": float("nan"),
        "updates_per_s": float("nan"),
        "samples_per_s": float("nan"),
        "replay_size": float("nan"),
        "rows": len(rows),
    }
    learning = [i for i, r in enumerate(rows) if _num(r, "updates") > 0]
    filling = rows[: learning[0]] if learning else rows
    # The first rows hold the start-up (envs, the network, the first fetch).
    filling = [r for r in filling[1:] if _num(r, "sps") > 0]
    if len(filling) >= 2:
        a, b = filling[0], filling[-1]
        result["fill_env_sps"] = (_num(b, "step") - _num(a, "step")) / (
            _num(b, "time") - _num(a, "time")
        )
    if len(learning) >= 2:
        # From the row of the first update (its updates started in the row's interval).
        a, b = rows[learning[0]], rows[-1]
        span = _num(b, "time") - _num(a, "time")
        result["env_sps"] = (_num(b, "step") - _num(a, "step")) / span
        result["updates_per_s"] = (_num(b, "updates") - _num(a, "updates")) / span
        result["samples_per_s"] = result["updates_per_s"] * batch
        result["replay_size"] = min(_num(r, "replay_size") for r in rows[learning[0] :])
    return result


def _pool_maker(cfg: RunConfig) -> object:
    """What builds the env pool moolib-run builds for ``cfg`` (on-policy peers and
    off-policy actor loops alike): ``agents/runtime/base.py``'s ``make_envs``."""
    from moolib.agents.runtime.base import make_envs

    return lambda: make_envs(cfg)


def envpool_limit(cfg: RunConfig, seconds: float, loops: int = 1) -> float:
    """Env steps/s of the pools moolib-run builds for ``cfg`` (same env and options,
    batches, worker processes), ``loops`` of them (as many Ape-X actor loops build),
    each stepped double-buffered with random actions and nothing else, by a thread
    of its own, all at once."""
    import threading

    make = _pool_maker(cfg)
    agent = cfg.agent
    nb, bs = int(agent.num_actor_batches), int(agent.actor_batch_size)
    made: list = []
    counts = [0] * loops

    def step(i: int) -> None:
        pool, _, space = made[i]
        g = torch.Generator().manual_seed(i)

        def actions() -> torch.Tensor:
            return space.sample(bs, g)

        futures = [pool.step(b, actions()) for b in range(nb)]
        b = 0
        while True:
            futures[b].result()
            now = time.perf_counter()
            if now >= start + seconds:
                break
            if now >= start:
                counts[i] += bs
            futures[b] = pool.step(b, actions())
            b = (b + 1) % nb
        for f in futures:
            f.result()

    try:
        # Inside the try: a pool that fails to start closes those made before it.
        for _ in range(loops):
            made.append(make())
        start = time.perf_counter() + 2.0  # a warm-up, the same for every pool
        errors: list[BaseException] = []

        def run(i: int) -> None:
            try:
                step(i)
            except BaseException as e:  # re-raised below: a failed loop is no 0 steps/s
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(loops)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return sum(counts) / seconds
    finally:
        for pool, _, _ in made:
            pool.close()


def acting_limit(loops: int, hidden: int, seconds: float, torch_threads: int) -> float:
    """Env steps/s of ``loops`` Ape-X acting steps as threads of this process, on
    recorded frames (no env), with the run's torch threads: the actors' compute alone
    (bench/apex.py)."""
    return _bench_apex().actor_loops(loops, hidden, seconds, True, torch_threads)


@functools.cache
def _bench_apex() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_apex", Path(__file__).with_name("apex.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report_apex(args: argparse.Namespace) -> None:
    """Ape-X on Breakout: per loop count, one run, then right after it (so that the
    machine's load from elsewhere is alike) the limits on the same cores."""
    cfg = _apex_config(args.apex_loops[0], args.apex_batch, args.apex_replay)
    agent = cfg.agent
    hidden = int(agent.hidden_size)
    # The learner's torch threads with scaling=single: the cores less the env workers
    # and the actor loops (runtime.offpolicy.Learner).
    cores = len(os.sched_getaffinity(0))
    limit_seconds = min(15.0, args.apex_seconds / 3)
    print(
        f"Ape-X on Breakout (scaling=single, learner batch {args.apex_batch}, replay of "
        f"{args.apex_replay:,} transitions, full while the learner runs; each loop: EnvPool "
        f"{agent.num_actor_batches}x{agent.actor_batch_size} envs on {agent.num_actor_cpus} "
        f"processes), {cores} cores, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'loops':>5} {'actors steps/s':>15} {'EnvPool limit':>14} {'ratio':>6} "
        f"{'acting limit':>13} {'ratio':>6} {'(filling)':>10} {'updates/s':>10} "
        f"{'samples/s':>10} {'compute limit':>14} {'ratio':>6}"
    )
    for loops in args.apex_loops:
        run = apex_run(
            loops,
            args.device,
            args.apex_seconds,
            args.apex_batch,
            args.apex_replay,
            args.apex_start_timeout,
        )
        pool = envpool_limit(cfg, limit_seconds, loops)
        # The learner's torch threads, which the actor loops of its process share.
        threads = max(1, cores - int(agent.num_actor_cpus) - loops)
        act = acting_limit(loops, hidden, limit_seconds, threads)
        limit = _bench_apex().compute_limit(
            hidden, args.apex_batch, limit_seconds, threads, args.device
        )
        print(
            f"{loops:>5} {run['env_sps']:>15,.0f} {pool:>14,.0f} {run['env_sps'] / pool:>6.3f} "
            f"{act:>13,.0f} {run['env_sps'] / act:>6.2f} {run['fill_env_sps']:>10,.0f} "
            f"{run['updates_per_s']:>10.3f} {run['samples_per_s']:>10,.1f} "
            f"{limit:>14.3f} {run['updates_per_s'] / limit:>6.2f}"
        )
        print(
            f"  command: {run['command']} (learner torch threads {threads}; replay size while "
            f"learning >= {run['replay_size']:,.0f}; load average {os.getloadavg()[0]:.2f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="timed training per case")
    parser.add_argument("--warmup", type=float, default=30.0, help="untimed start of each run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--torch-threads", nargs="*", default=["auto"])
    parser.add_argument("--busy-cores", type=int, default=0, help="spinning processes meanwhile")
    parser.add_argument(
        "--tiny",
        nargs="*",
        default=list(TINY_NETWORK),
        help="overrides of the loop-limit run (a network that costs almost nothing)",
    )
    parser.add_argument(
        "--baseline-python",
        default=None,
        help="the interpreter of another venv (e.g. the starting commit's): its moolib-run "
        "runs each case too, right after ours, for the ratio",
    )
    parser.add_argument(
        "--envpool-seconds", type=float, default=15.0, help="timed stepping of the EnvPool limit"
    )
    parser.add_argument(
        "--apex-loops", type=int, nargs="*", default=[], help="Ape-X on Breakout: actor loops"
    )
    parser.add_argument("--apex-seconds", type=float, default=60.0, help="timed learning per run")
    parser.add_argument("--apex-batch", type=int, default=64, help="learner batch (paper: 512)")
    parser.add_argument("--apex-replay", type=int, default=4000, help="replay capacity")
    parser.add_argument(
        "--apex-start-timeout",
        type=float,
        default=300.0,
        help="seconds for the replay to fill (4 loops: 256 envs x 53 steps before a first insert)",
    )
    args = parser.parse_args()
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_cores)
    ]
    try:
        if args.cases:
            report(args)
        if args.apex_loops:
            report_apex(args)
    finally:
        for b in burners:
            b.kill()
            b.wait()


def report(args: argparse.Namespace) -> None:
    print(
        f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, device {args.device}, "
        f"torch's default threads {torch.get_num_threads()}, busy cores {args.busy_cores}"
    )
    base = args.baseline_python
    if base:
        print(f"baseline: moolib-run by {base} (its moolib), run right after each of ours")
    print(
        f"{'case':16} {'threads':>7} {'moolib-run SPS':>14} {'EnvPool limit':>13} {'ratio':>6} "
        f"{'tiny-net SPS':>12} {'ratio':>6} {'learner limit':>13} {'ratio':>6} "
        f"{'act+learn limit':>15} {'ratio':>6} {'original':>8}"
        + (f" {'baseline SPS':>12} {'ratio':>6}" if base else "")
        + (f" {'GPU busy':>8}" if args.device.startswith("cuda") else "")
    )

    def detail(label: str, run: dict) -> str:
        return (
            f"  {label}: {run['command']} (actors {run['env_sps']:,.0f} env steps/s; "
            f"busy cores: the run's process {run['run_cores']:.2f}, "
            f"its env workers {run['worker_cores']:.2f})"
        )

    nan = {"sps": float("nan")}
    for name in args.cases:
        case = CASES[name]
        learn = both = pool = float("nan")
        tiny: dict = nan
        for threads in args.torch_threads:
            run = run_sps(case, args.device, args.seconds, args.warmup, threads)
            base_run = (
                run_sps(case, args.device, args.seconds, args.warmup, threads, python=base)
                if base
                else nan
            )
            if learn != learn:
                # Once per case, right after its first run: the loop's limit (with this
                # run's torch threads), the EnvPool limit, the compute limits (with
                # torch's default threads).
                tiny = run_sps(
                    case, args.device, args.seconds, args.warmup, threads, tuple(args.tiny)
                )
                pool = envpool_limit(_config(case["overrides"]), args.envpool_seconds)
                learn, both = limits(case, args.device, min(20.0, args.seconds / 3))
            sps = run["sps"]
            ref = case["reference"]
            ref_text = f"{ref:8.0f}" if ref else f"{'-':>8}"
            line = (
                f"{name:16} {threads:>7} {sps:14,.0f} {pool:13,.0f} {sps / pool:6.3f} "
                f"{tiny['sps']:12,.0f} {tiny['sps'] / pool:6.3f} {learn:13,.0f} "
                f"{sps / learn:6.2f} {both:15,.0f} {sps / both:6.2f} {ref_text}"
            )
            if base:
                line += f" {base_run['sps']:12,.0f} {sps / base_run['sps']:6.2f}"
            if args.device.startswith("cuda"):
                line += f" {run['gpu_busy']:7.0f}%"
            print(line)
            print(detail("command", run))
            if base:
                print(detail("baseline", base_run))
        if "command" in tiny:
            print(detail("tiny-net", tiny))
        print(f"  load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
