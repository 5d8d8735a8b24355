"""End-to-end training throughput of moolib-run, beside its limit, in one run.

    python bench/train.py [--seconds 90] [--device cpu]

For V-trace on Breakout (the deep IMPALA network; actor batch 32 x 2, learner
batch 8, unroll 20, as in the original moolib's example) and A2C on CartPole
(conf/tuning/a2c_cartpole.yaml), prints:

- the learner's limit: forward + backward + optimizer step on learner batches
  of the same shape, in a loop on the same device, in env steps per second
  (unroll_length * batch_size per learner batch), and the compute limit of
  acting and learning together (adding the actors' forward passes per env
  step), measured right after the run on the same machine;
- moolib-run's end-to-end SPS (env steps learned from per second, from its
  logs.tsv after a warm-up), as a ratio to that limit;
- the original moolib's published figure on these machines where there is one
  (~63 SPS for V-trace on Breakout on CPU).

``--torch-threads auto N ...`` runs each case once per setting of moolib-run's
``torch_threads`` (``N`` = this machine's core count is torch's own default),
and ``--busy-cores K`` keeps K other processes spinning meanwhile (a busy
neighbour), so the two can be compared in one run.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from moolib.agents import impala
from moolib.agents.models import create_model

ORIGINAL_MOOLIB_VTRACE_BREAKOUT_CPU_SPS = 63.0

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
        loss, _ = impala.compute_loss(Cfg, outputs, batch)
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


def run_sps(
    case: dict, device: str, seconds: float, warmup: float, threads: str = "auto"
) -> tuple[float, str]:
    """moolib-run's SPS: steps learned per second between the first log row
    after ``warmup`` seconds and the last row, over ``seconds`` of training."""
    with tempfile.TemporaryDirectory() as savedir:
        cmd = [
            sys.executable,
            "-m",
            "moolib.launch.run",
            *case["overrides"],
            f"device={device}",
            f"torch_threads={threads}",
            f"savedir={savedir}",
            "total_steps=1000000000",
            "log_interval=2",
            "checkpoint_interval=1000000",
        ]
        env = dict(os.environ, WANDB_MODE="disabled")
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        try:
            time.sleep(warmup + seconds)
        finally:
            proc.send_signal(2)  # Ctrl-C: the run stops after its current step
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with open(Path(savedir) / "logs.tsv") as f:
            rows = [r for r in csv.DictReader(f, delimiter="\t")]
    timed = [r for r in rows if float(r["time"]) >= warmup and r["step"]]
    if len(timed) < 2:
        return float("nan"), " ".join(cmd[3:])
    first, last = timed[0], timed[-1]
    steps = int(last["step"]) - int(first["step"])
    return steps / (float(last["time"]) - float(first["time"])), " ".join(cmd[3:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90.0, help="timed training per case")
    parser.add_argument("--warmup", type=float, default=30.0, help="untimed start of each run")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--torch-threads", nargs="*", default=["auto"])
    parser.add_argument("--busy-cores", type=int, default=0, help="spinning processes meanwhile")
    args = parser.parse_args()
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_cores)
    ]
    try:
        report(args)
    finally:
        for b in burners:
            b.kill()
            b.wait()


def report(args: argparse.Namespace) -> None:
    print(
        f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs, device {args.device}, "
        f"torch's default threads {torch.get_num_threads()}, busy cores {args.busy_cores}"
    )
    print(
        f"{'case':18} {'threads':>7} {'moolib-run SPS':>15} {'learner limit':>14} {'ratio':>6} "
        f"{'act+learn limit':>16} {'ratio':>6} {'original':>9}"
    )
    for name in args.cases:
        case = CASES[name]
        learn = both = float("nan")
        for threads in args.torch_threads:
            sps, command = run_sps(case, args.device, args.seconds, args.warmup, threads)
            if learn != learn:  # the limits once per case, with torch's default threads
                learn, both = limits(case, args.device, min(20.0, args.seconds / 3))
            ref = case["reference"]
            ref_text = f"{ref:9.0f}" if ref else f"{'-':>9}"
            print(
                f"{name:18} {threads:>7} {sps:15.0f} {learn:14.0f} {sps / learn:6.2f} "
                f"{both:16.0f} {sps / both:6.2f} {ref_text}"
            )
            print(f"  command: {command}")


if __name__ == "__main__":
    main()
