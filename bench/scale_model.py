"""A model of a moolib group past what one machine holds (256 and 1,024 peers),
fitted to bench/scale.py's 8 and 16 peer rows and checked against its 32 and 64.

Usage: python bench/scale_model.py [--json PATH] [--code old|new|log] [--report PATH]
       [--link-gbit 10] [--latency-us 50] [--churn-per-peer-hour 1]

--json     a scale.py result (``--json`` there); default /tmp/scale-new.json, else
           /tmp/scale-full.json.
--code     which collective code measured it, when the file does not say
           (``settings.code`` there wins): ``old`` (direct sums among <= 32
           members, before 4a1f2e1), ``new`` (direct among <= 8, recursive
           doubling above: 4a1f2e1 on; the shared-memory rounds and the
           all-gather send to every member) or ``log`` (as ``new``, and past 8
           members the shared-memory rounds and the all-gather go by
           dissemination / Bruck: ceil(log2 N) rounds).
--report   also write the fit, the check and the predictions as JSON here.

The model's structure is the algorithms' message and byte counts
(moolib/core/collectives/collective.cc, doubling.h, broker.cc); only their unit costs are
fitted, from the 8 and 16 peer rows of each layout, never from 32 or 64.

Assumptions (printed with the results):

A1 One machine (the measured layouts): all N peers share C cores (the file's
   settings.cores). A message costs c_msg + c_byte x its bytes of CPU (its
   reply included), so an all-reduce's messages cost (c_msg x messages +
   c_byte x bytes) / C of the cores' time. Each of its hops (the sequential
   steps of its critical path) costs h, plus the wait for the receiver's turn
   on a core: the peers busy-poll, so about N/C are runnable per core and a
   hop waits for the N/C - 1 ahead of it, s each: hop = h + s (N/C - 1).
   c_msg, c_byte, h and s are fitted per layout by non-negative least squares
   in relative error over the three sizes (16 B, 1 MiB, 6 MiB) of the 8 and
   16 peer rows: 6 figures, 4 unknowns.
A2 Counts per all-reduce of S bytes among N (whole group), one function per
   algorithm (*_counts below), each message's size as sent:
   direct     N(N-1) messages of S, 1 hop, partners all N-1;
   doubling   P log2 P + 2(N-P) messages of S (P: largest power of two <= N),
              log2 P hops (+2 where N > P), partners log2 P (+1);
   ring       2(N-1) x ceil(S/N / 256 KiB) messages a member (chunks of
              kChunkBytes = 256 KiB at most, collective.cc), 2(N-1) S bytes,
              2(N-1) + chunks - 1 hops, partners 2;
   shm        3 rounds (ready, reduced, done; done is not waited for) of tiny
              messages, 3 S bytes copied a member: code old/new N(N-1) a round,
              2 hops, partners N-1; code log past 8 members N ceil(log2 N) a
              round (dissemination), 2 ceil(log2 N) hops, partners i +- 2^k;
   all-gather (the Accumulator's election) code old/new N(N-1) messages,
              1 hop, partners N-1; code log past 8 members N ceil(log2 N)
              messages (Bruck), ceil(log2 N) hops, partners i +- 2^k.
A3 Join: every member sees all N at the join window (one ping interval) plus
   a cost linear in N (the members' pings through the broker and their
   replies on C cores): join = w + a N, fitted from 8 and 16. The kill's next
   step likewise: w + a N (w: the grace before the dead member's drop).
A4 Broker: a fixed cost b0 (its own threads and timers) plus every member's
   ping once an interval I = min(timeout/8, 1 s): b0 + N/I x c_ping CPU s/s,
   fitted by NNLS from the idle figures at 8 and 16. scale.py reads CPU in
   clock ticks (1/100 s, Linux's USER_HZ) over its idle window (3 s with
   --quick, else 6 s): a reading is good to one tick over the window, its
   resolution r. The fit's inputs carry that error into its predictions (the
   band: what moving each input by r moves the prediction). A figure whose
   measured and predicted values differ by less than r + band agrees only
   within the measure's resolution: so marked, and counted apart from the
   figures within 1.5x. A membership change answers every held ping with
   the member list: N x c_ping CPU s plus N^2 x 40 bytes (a name and a
   shared-memory key a member a reply) at the TCP fit's c_byte.
A5 Descriptors and memory per peer: f0 + f_link x links, r0 + r_link x links,
   links: the distinct members a peer exchanged with over the run's
   all-reduces (links are dialed lazily); fitted from 8 and 16. Threads: constant.
   A row whose all-reduces failed never opened the links nor held the
   buffers the model counts: its descriptors and memory are excluded.
A6 Deployment (the 256 and 1,024 figures): one peer per host, its cores its
   own, links of --link-gbit, one-way latency --latency-us, the broker on a
   host of its own. What carries over from this machine: c_msg, c_byte, c_ping
   (CPU seconds of the same code; fitted under this machine's load, so likely
   high) and f_link, r_link (per link, from netns: TCP as between hosts).
   What does not: h and s (the wait for a core among N processes on C cores
   here) and the machine-wide CPU bound; a hop costs the latency plus one
   message's c_msg, a peer's bytes go over its own link at the link rate (max
   of the wire and its CPU per byte), and a peer's collective work runs on one
   thread. Peers run the Accumulator, so the election's all-gather links a
   peer to its partners there (all N-1 with code old/new). Churn: every peer
   leaves and rejoins --churn-per-peer-hour times an hour (2 changes each).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SIZES = (16, 1 << 20, 6 << 20)
SIZE_NAMES = {16: "16 B", 1 << 20: "1 MiB", 6 << 20: "6 MiB"}
SMALL_MAX = 64 << 10  # collective.cc kDirectMaxBytes
CHUNK = 256 << 10  # collective.cc kChunkBytes
REPLY_BYTES_PER_MEMBER = 40
ELECTION_SEGMENT_BYTES = 256
FIT_N = (8, 16)
CHECK_N = (32, 64)
PREDICT_N = (256, 1024)
TOLERANCE = 1.5
FD_LIMIT = 1024
USER_HZ = 100  # /proc/PID/stat's clock ticks a second (Linux's USER_HZ)
DEFAULT_JSON = ("/tmp/scale-new.json", "/tmp/scale-full.json")


@dataclass(frozen=True)
class Code:
    """What the collective code that measured a file does (--code, A2)."""

    direct_max: int  # collective.cc kDirectMaxMembers
    doubling: bool  # small sums past direct_max by recursive doubling (else the ring)
    log_rounds: bool  # shm rounds and all-gather by dissemination / Bruck past 8 members


CODES = {
    "old": Code(direct_max=32, doubling=False, log_rounds=False),
    "new": Code(direct_max=8, doubling=True, log_rounds=False),
    "log": Code(direct_max=8, doubling=True, log_rounds=True),
}
LOG_ROUNDS_PAST = 8  # members: the log-round schemes apply above this


@dataclass(frozen=True)
class Counts:
    """One collective among N: the group's messages and bytes, its critical path (hops),
    member 0's partners (the members it exchanges with)."""

    algo: str
    messages: float
    bytes: float
    hops: float
    partners: frozenset[int]

    @property
    def links(self) -> int:
        return len(self.partners)


def log2_ceil(n: int) -> int:
    return max(0, (n - 1).bit_length())


def everyone(n: int) -> frozenset[int]:
    return frozenset(range(1, n))


def power_partners(n: int) -> frozenset[int]:
    """Member 0's partners in a dissemination or Bruck scheme: 0 +- 2^k mod N."""
    return frozenset(p for k in range(log2_ceil(n)) for p in ((1 << k) % n, -(1 << k) % n)) - {0}


def direct_counts(n: int, size: int) -> Counts:
    """Every member sends its buffer to every other: N(N-1) messages of S, 1 hop."""
    return Counts("direct", n * (n - 1), n * (n - 1) * size, 1, everyone(n))


def doubling_counts(n: int, size: int) -> Counts:
    """Recursive doubling: P log2 P exchanges among P = 2^floor(log2 N), the N - P others
    folded in before and out after (2 messages, 2 hops each way)."""
    p = 1 << (n.bit_length() - 1)
    k = p.bit_length() - 1
    extra = n - p
    messages = p * k + 2 * extra
    partners = {1 << j for j in range(k)} | ({p} if extra else set())
    return Counts("doubling", messages, messages * size, k + (2 if extra else 0),
                  frozenset(partners))  # fmt: skip


def ring_counts(n: int, size: int) -> Counts:
    """Reduce-scatter then all-gather round the ring: 2(N-1) steps a member, each a segment
    of S/N in chunks of CHUNK at most; the chunks pipeline behind the first."""
    chunks = max(1, math.ceil(size / n / CHUNK))
    partners = frozenset({1 % n, (n - 1) % n}) - {0}
    return Counts("ring", n * 2 * (n - 1) * chunks, 2 * (n - 1) * size,
                  2 * (n - 1) + chunks - 1, partners)  # fmt: skip


def shm_counts(n: int, size: int, code: Code) -> Counts:
    """Shared memory: a member copies its buffer into its region, sums its slice of
    everyone's, copies the sums out (3 S bytes); three rounds of tiny messages (ready,
    reduced, done), the first two waited for. A round is every member to every other
    (N(N-1) messages, 1 hop) or, with code.log_rounds past 8 members, a dissemination
    barrier (N ceil(log2 N) messages, ceil(log2 N) hops)."""
    if code.log_rounds and n > LOG_ROUNDS_PAST:
        per_round, hops, partners = n * log2_ceil(n), log2_ceil(n), power_partners(n)
    else:
        per_round, hops, partners = n * (n - 1), 1, everyone(n)
    return Counts("shm", 3 * per_round, 3 * n * size, 2 * hops, partners)


def gather_counts(n: int, size: int, code: Code) -> Counts:
    """All-gather of one segment of ``size`` a member (the Accumulator's election): every
    member to every other (N(N-1) messages, 1 hop) or, with code.log_rounds past 8
    members, Bruck's (N ceil(log2 N) messages, ceil(log2 N) hops); N(N-1) segments
    sent either way."""
    if code.log_rounds and n > LOG_ROUNDS_PAST:
        k = log2_ceil(n)
        return Counts("bruck", n * k, n * (n - 1) * size, k, power_partners(n))
    return Counts("all-gather", n * (n - 1), n * (n - 1) * size, 1, everyone(n))


def allreduce_counts(n: int, size: int, layout: str, code: Code) -> Counts:
    """What a sum all-reduce of ``size`` bytes among ``n`` costs (assumption A2), by the
    algorithm collective.cc picks."""
    if n <= 1:
        return Counts("none", 0, 0, 0, frozenset())
    if size <= SMALL_MAX and n <= code.direct_max:
        return direct_counts(n, size)
    if size <= SMALL_MAX and code.doubling:
        return doubling_counts(n, size)
    if layout == "shm":
        return shm_counts(n, size, code)
    return ring_counts(n, size)


def run_links(n: int, layout: str, code: Code) -> int:
    """A peer's links after scale.py's all-reduces (16 B, 1 MiB, 6 MiB): their partners'
    union."""
    return len(frozenset().union(*(allreduce_counts(n, s, layout, code).partners for s in SIZES)))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with x >= 0, by trying every set of free unknowns (a few here)."""
    best, best_err = np.zeros(a.shape[1]), float(np.sum(b**2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x_sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(a.shape[1])
            x[list(cols)] = x_sub
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err - 1e-15:
                best, best_err = x, err
    return best


def line_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = w + a x through the points, a >= 0 and w >= 0 (A3, A4, A5)."""
    a = np.array([[1.0, x] for x in xs])
    w, slope = nnls(a, np.array(ys, dtype=float))
    return float(w), float(slope)


def runnable_per_core(n: int, cores: int) -> float:
    """The others ahead of a hop's receiver in its core's queue (A1)."""
    return max(0.0, n / cores - 1)


@dataclass
class LayoutFit:
    """The unit costs of one layout, from its 8 and 16 peer rows."""

    layout: str
    cores: int
    c_msg: float = 0.0
    c_byte: float = 0.0
    hop: float = 0.0
    wait: float = 0.0
    join: tuple[float, float] = (0.0, 0.0)
    kill: tuple[float, float] = (0.0, 0.0)
    broker: tuple[float, float] = (0.0, 0.0)  # b0 CPU s/s, c_ping CPU s a ping
    fds: tuple[float, float] = (0.0, 0.0)
    rss: tuple[float, float] = (0.0, 0.0)
    threads: float = 0.0
    fitted_from: list[int] = field(default_factory=list)

    def allreduce_s(self, n: int, size: int, code: Code) -> float:
        c = allreduce_counts(n, size, self.layout, code)
        hop = self.hop + self.wait * runnable_per_core(n, self.cores)
        return (self.c_msg * c.messages + self.c_byte * c.bytes) / self.cores + hop * c.hops


def reduce_median(row: dict, size: int) -> float | None:
    fig = row.get("reduce", {}).get(str(size), {})
    return fig.get("median_s")


def light(row: dict, key: str) -> float | None:
    return row.get("light", {}).get(key, {}).get("median")


def broker_fit(ns: list[float], cpu: list[float], interval: float) -> tuple[float, float]:
    """A4: cpu = b0 + N/I x c_ping."""
    b0, per_member = line_fit(ns, cpu)
    return b0, per_member * interval


def fit_layout(rows: list[dict], layout: str, cores: int, code: Code, interval: float) -> LayoutFit:
    """Fits A1, A3, A4, A5 from the rows of N = 8 and 16 (others are ignored)."""
    fit = LayoutFit(layout, cores)
    rows = [r for r in rows if r["peers"] in FIT_N]
    fit.fitted_from = sorted(r["peers"] for r in rows)
    if len(rows) < 2:
        raise ValueError(f"needs rows at N = 8 and 16, has {fit.fitted_from}")
    eqs, rhs = [], []
    for r in rows:
        n = r["peers"]
        for size in SIZES:
            t = reduce_median(r, size)
            if t is None or t <= 0:
                continue
            c = allreduce_counts(n, size, layout, code)
            # Relative error: each figure counts alike, 3 ms or 300 ms.
            wait_hops = c.hops * runnable_per_core(n, cores)
            eqs.append([c.messages / cores / t, c.bytes / cores / t, c.hops / t, wait_hops / t])
            rhs.append(1.0)
    if len(eqs) < 4:
        raise ValueError("too few all-reduce figures at N = 8, 16 to fit")
    # Scaled unknowns keep the least squares well conditioned (ms, ns/B, ms, ms).
    scale = np.array([1e-3, 1e-9, 1e-3, 1e-3])
    x = nnls(np.array(eqs) * scale, np.array(rhs)) * scale
    fit.c_msg, fit.c_byte, fit.hop, fit.wait = (float(v) for v in x)

    def pairs(get: Any) -> tuple[list[float], list[float]]:
        got = [(float(r["peers"]), get(r)) for r in rows]
        got = [(n, y) for n, y in got if y is not None]
        return [n for n, _ in got], [float(y) for _, y in got]

    fit.join = line_fit(*pairs(lambda r: r.get("join_s")))
    fit.kill = line_fit(*pairs(lambda r: r.get("kill", {}).get("next_step_s")))
    fit.broker = broker_fit(*pairs(lambda r: r.get("broker_cpu_idle")), interval)
    links = {r["peers"]: run_links(r["peers"], layout, code) for r in rows}
    for key in ("fds", "rss"):
        n_got, got = pairs(lambda r, k=key: light(r, "fds" if k == "fds" else "rss_mib"))
        setattr(fit, key, line_fit([links[int(n)] for n in n_got], got) if got else (0.0, 0.0))
    threads = [light(r, "threads") for r in rows]
    fit.threads = float(np.mean([t for t in threads if t is not None] or [0.0]))
    return fit


def broker_idle(fit: LayoutFit, n: int, interval: float) -> float:
    return fit.broker[0] + n / interval * fit.broker[1]


def broker_band(rows: list[dict], fit: LayoutFit, n: int, interval: float, r: float) -> float:
    """How far the prediction at ``n`` moves when each fitted reading moves by its
    resolution ``r`` (A4): the prediction's own resolution."""
    got = [(float(x["peers"]), x.get("broker_cpu_idle")) for x in rows if x["peers"] in FIT_N]
    got = [(m, y) for m, y in got if y is not None]
    p = broker_idle(fit, n, interval)
    band = 0.0
    # Every corner of the box: the fit clamps at zero, so one input at a time misses some.
    for moves in itertools.product((-r, r), repeat=len(got)):
        ys = [y + d for (_, y), d in zip(got, moves, strict=True)]
        b0, c_ping = broker_fit([m for m, _ in got], ys, interval)
        band = max(band, abs(b0 + n / interval * c_ping - p))
    return band


def predict_row(fit: LayoutFit, n: int, code: Code, interval: float) -> dict[str, float]:
    """The model's figures for N peers on the measured machine (same keys as measured_row)."""
    links = run_links(n, fit.layout, code)
    out = {f"ar {SIZE_NAMES[s]} s": fit.allreduce_s(n, s, code) for s in SIZES}
    out["join s"] = fit.join[0] + fit.join[1] * n
    out["kill next step s"] = fit.kill[0] + fit.kill[1] * n
    out["broker cpu idle"] = broker_idle(fit, n, interval)
    out["peer fds"] = fit.fds[0] + fit.fds[1] * links
    out["peer rss MiB"] = fit.rss[0] + fit.rss[1] * links
    out["peer threads"] = fit.threads
    return out


def measured_row(row: dict) -> dict[str, float | None]:
    out: dict[str, float | None] = {f"ar {SIZE_NAMES[s]} s": reduce_median(row, s) for s in SIZES}
    out["join s"] = row.get("join_s")
    out["kill next step s"] = row.get("kill", {}).get("next_step_s")
    out["broker cpu idle"] = row.get("broker_cpu_idle")
    out["peer fds"] = light(row, "fds")
    out["peer rss MiB"] = light(row, "rss_mib")
    out["peer threads"] = light(row, "threads")
    return out


def exclusion(row: dict, key: str, measured: float | None) -> str | None:
    """Why a figure cannot be checked, or None."""
    if key.startswith("ar ") and measured is None:
        size = next(s for s in SIZES if key == f"ar {SIZE_NAMES[s]} s")
        err = row.get("reduce", {}).get(str(size), {}).get("error", "")
        return "measurement failed" + (f": {err[:90]}" if err else "")
    if measured is None:
        return "not measured"
    if row.get("errors") and key in ("peer fds", "peer rss MiB"):
        return "measured after all-reduces that failed: their links and buffers never held (A5)"
    return None


PASS, RESOLUTION, FAIL, EXCLUDED = "pass", "agrees within resolution", "FAIL", "excluded"


def check(
    results: list[dict],
    fits: dict[str, LayoutFit],
    code: Code,
    interval: float,
    ns: tuple[int, ...],
    tick: float,
) -> list[dict[str, Any]]:
    """Measured beside predicted for every figure of the rows at ``ns``, each with its
    status: pass (within TOLERANCE), agrees within resolution (A4: the broker's CPU, read
    in ``tick`` steps), FAIL, or excluded (with the reason)."""
    out = []
    for r in results:
        fit = fits.get(r["layout"])
        if fit is None or r["peers"] not in ns:
            continue
        n = r["peers"]
        pred = predict_row(fit, n, code, interval)
        same = [x for x in results if x["layout"] == r["layout"]]
        for key, m in measured_row(r).items():
            p = pred[key]
            ratio = m / p if m is not None and p > 0 else None
            note, status = "", PASS
            if (why := exclusion(r, key, m)) is not None:
                status, note = EXCLUDED, why
            elif ratio is None or not 1 / TOLERANCE <= ratio <= TOLERANCE:
                status = FAIL
                if key == "broker cpu idle" and m is not None:
                    band = broker_band(same, fit, n, interval, tick)
                    if abs(m - p) <= tick + band:
                        status = RESOLUTION
                        note = (f"|m - p| {abs(m - p):.4f} <= tick {tick:.4f} + fit band "
                                f"{band:.4f} (A4)")  # fmt: skip
            if key.startswith("ar "):
                size = next(s for s in SIZES if key == f"ar {SIZE_NAMES[s]} s")
                algo = allreduce_counts(n, size, r["layout"], code).algo
                note = f"{algo}; {note}" if note else algo
            out.append({"layout": r["layout"], "peers": n, "figure": key, "measured": m,
                        "predicted": p, "ratio": ratio, "status": status,
                        "note": note})  # fmt: skip
    return out


def verdict(rows: list[dict[str, Any]]) -> str:
    """The check's summary line: how many figures pass, agree only within resolution, fail,
    and are excluded; PASS only when none fails."""
    count = {s: sum(c["status"] == s for c in rows) for s in (PASS, RESOLUTION, FAIL, EXCLUDED)}
    checked = count[PASS] + count[RESOLUTION] + count[FAIL]
    return (
        f"check: {count[PASS]} of {checked} figures at N = {', '.join(map(str, CHECK_N))} "
        f"within {TOLERANCE}x, {count[RESOLUTION]} agree only within the measure's resolution, "
        f"{count[FAIL]} fail; {count[EXCLUDED]} excluded. Verdict: "
        + ("PASS" if count[FAIL] == 0 and checked else "FAIL")
    )


@dataclass(frozen=True)
class Deployment:
    """The hypothetical hosts of A6."""

    link_Bps: float = 10e9 / 8
    latency_s: float = 50e-6
    churn_per_peer_hour: float = 1.0


def deploy_collective(fit: LayoutFit, dep: Deployment, c: Counts, n: int) -> tuple[float, float]:
    """A6: (the hops' and messages' seconds, the bytes' seconds) of one collective: a peer's
    share of the messages on one thread, every hop the latency plus one message's handling,
    a peer's bytes on its link (or its CPU per byte, whichever is slower)."""
    if c.messages == 0:
        return 0.0, 0.0
    per_peer_bytes = c.bytes / n
    bytes_s = max(per_peer_bytes / dep.link_Bps, fit.c_byte * per_peer_bytes)
    return fit.c_msg * c.messages / n + c.hops * (dep.latency_s + fit.c_msg), bytes_s


def deploy(
    fit: LayoutFit, dep: Deployment, n: int, interval: float, code: Code
) -> dict[str, float]:
    """The figures of N peers on the deployment of A6, from a TCP (netns) fit."""
    per_change_bytes = n * n * REPLY_BYTES_PER_MEMBER
    per_change_cpu = n * fit.broker[1] + per_change_bytes * fit.c_byte
    change_s = per_change_cpu + per_change_bytes / dep.link_Bps + 2 * dep.latency_s
    g = gather_counts(n, ELECTION_SEGMENT_BYTES, code)
    election = sum(deploy_collective(fit, dep, g, n))
    idle = broker_idle(fit, n, interval)
    changes_per_s = 2 * n * dep.churn_per_peer_hour / 3600
    partners = g.partners.union(*(allreduce_counts(n, s, "netns", code).partners for s in SIZES))
    links = len(partners)
    hops6, bytes6 = deploy_collective(fit, dep, allreduce_counts(n, 6 << 20, "netns", code), n)
    ar6 = hops6 + bytes6
    return {
        "join s": interval + change_s,
        "dead member: next step s": fit.kill[0] + change_s + election,
        "broker cpu idle (CPU s/s)": idle,
        "broker cpu per change (CPU s)": per_change_cpu,
        "broker bytes per change": per_change_bytes,
        "broker cpu at churn (CPU s/s)": idle + changes_per_s * per_change_cpu,
        "election messages": g.messages,
        "election s": election,
        "ar 16 B s": sum(deploy_collective(fit, dep, allreduce_counts(n, 16, "netns", code), n)),
        "ar 6 MiB s": ar6,
        "ar 6 MiB: hops and messages s": hops6,
        "ar 6 MiB ring bound s": 2 * (n - 1) / n * (6 << 20) / dep.link_Bps,
        "steps/s 1.6M": 1 / ar6 if ar6 > 0 else float("inf"),
        "peer links": links,
        "peer fds": fit.fds[0] + fit.fds[1] * links,
        "peer rss MiB": fit.rss[0] + fit.rss[1] * links,
    }


def breaks(fit: LayoutFit, dep: Deployment, interval: float, code: Code) -> list[dict[str, Any]]:
    """The smallest N at which each limit is crossed on the deployment, first first."""
    limits: list[tuple[str, Callable[[dict[str, float]], bool]]] = [
        ("peer fds > 1,024 (the common soft ulimit)", lambda d: d["peer fds"] > FD_LIMIT),
        ("broker > 1 core at the stated churn", lambda d: d["broker cpu at churn (CPU s/s)"] > 1),
        ("a membership change > 1 s of broker CPU",
         lambda d: d["broker cpu per change (CPU s)"] > 1),
        ("election > 1 s", lambda d: d["election s"] > 1),
        ("ar 6 MiB bound by the ring's hops, not its bytes",
         lambda d: d["ar 6 MiB: hops and messages s"] > d["ar 6 MiB s"] / 2),
        ("ar 16 B > 10 ms", lambda d: d["ar 16 B s"] > 0.01),
    ]  # fmt: skip
    found: dict[str, int | None] = {name: None for name, _ in limits}
    n = 2
    while n <= 1 << 20 and any(v is None for v in found.values()):
        d = deploy(fit, dep, n, interval, code)
        for name, crossed in limits:
            if found[name] is None and crossed(d):
                found[name] = n
        n = n + 1 if n < 4096 else n * 2
    out = [{"limit": name, "first_n": v} for name, v in found.items()]
    return sorted(out, key=lambda x: (x["first_n"] is None, x["first_n"] or 0))


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def load(path: str | None) -> tuple[str, dict]:
    for p in [path] if path else DEFAULT_JSON:
        if p and os.path.exists(p):
            with open(p) as f:
                return p, json.load(f)
    raise SystemExit(f"no scale.py JSON at {path or ' or '.join(DEFAULT_JSON)}")


def print_check(title: str, rows: list[dict[str, Any]]) -> None:
    print(f"\n## {title}: measured vs predicted (ratio measured / predicted; pass within "
          f"[1/{TOLERANCE}, {TOLERANCE}])")  # fmt: skip
    print("| layout | N | figure | measured | predicted | ratio | status | note |")
    print("|---|---|---|---|---|---|---|---|")
    for c in rows:
        ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
        print(f"| {c['layout']} | {c['peers']} | {c['figure']} | {fmt(c['measured'])} | "
              f"{fmt(c['predicted'])} | {ratio} | {c['status']} | {c['note']} |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Fits, checks and predicts, and prints it all (a figure off by > 1.5x is flagged there)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="a bench/scale.py --json result")
    parser.add_argument("--code", choices=sorted(CODES), default="new")
    parser.add_argument("--report", help="write the fit, check and predictions as JSON")
    parser.add_argument("--link-gbit", type=float, default=10.0)
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--churn-per-peer-hour", type=float, default=1.0)
    args = parser.parse_args(argv)
    path, data = load(args.json)
    settings, results = data["settings"], data["results"]
    code_name = settings.get("code") or args.code
    if code_name not in CODES:
        raise SystemExit(f"{path}: settings.code {code_name!r} is none of {sorted(CODES)}")
    code = CODES[code_name]
    cores = int(settings.get("cores") or 1)
    interval = min(float(settings.get("group_timeout", 10.0)) / 8, 1.0)
    tick = 1 / USER_HZ / (3.0 if settings.get("quick") else 6.0)  # scale.py's idle window
    dep = Deployment(args.link_gbit * 1e9 / 8, args.latency_us * 1e-6, args.churn_per_peer_hour)

    source = "the file's settings.code" if settings.get("code") else "--code"
    print(f"scale model of {path} (code {code_name}, from {source}: {code}), fitted on "
          f"N = 8, 16; {cores} cores, ping interval {interval:g} s, broker CPU resolution "
          f"{tick:.4f} CPU s/s")  # fmt: skip
    print("assumptions: " + __doc__.split("Assumptions (printed with the results):")[1].strip())
    layouts = sorted({r["layout"] for r in results})
    fits = {}
    for lay in layouts:
        try:
            rows = [r for r in results if r["layout"] == lay]
            fits[lay] = fit_layout(rows, lay, cores, code, interval)
        except ValueError as e:
            print(f"layout {lay}: not modelled: {e}")
    if not fits:
        raise SystemExit(f"{path}: no layout has the 8 and 16 peer rows the fit needs")
    print("\n## fit (unit costs per layout, from N = 8 and 16 only)")
    for f in fits.values():
        print(
            f"{f.layout}: c_msg {f.c_msg * 1e6:.1f} us CPU/message, c_byte "
            f"{f.c_byte * 1e9:.3f} ns CPU/byte, hop {f.hop * 1e3:.3f} ms + "
            f"{f.wait * 1e3:.4f} ms x (N/{f.cores} - 1); join {f.join[0]:.3f} s + "
            f"{f.join[1] * 1e3:.3f} ms x N; kill {f.kill[0]:.2f} s + "
            f"{f.kill[1] * 1e3:.2f} ms x N; "
            f"broker {f.broker[0]:.4f} CPU s/s + {f.broker[1] * 1e6:.1f} us/ping; fds "
            f"{f.fds[0]:.1f} + {f.fds[1]:.2f}/link; rss {f.rss[0]:.1f} + {f.rss[1]:.3f} "
            f"MiB/link; threads {f.threads:g}"
        )

    in_sample = check(results, fits, code, interval, FIT_N, tick)
    checked = check(results, fits, code, interval, CHECK_N, tick)
    print_check("in-sample (the fit's own rows)", in_sample)
    print_check("check", checked)
    summary = verdict(checked)
    print("\n" + summary)

    base = fits.get("netns") or next(iter(fits.values()))
    print(f"\n## predictions at {', '.join(map(str, PREDICT_N))} peers (deployment, A6: one "
          f"peer per host, {args.link_gbit:g} Gbit/s, "
          f"{args.latency_us:g} us one way, churn {dep.churn_per_peer_hour:g}/peer/hour; "
          f"unit costs from the {base.layout} fit, code {code_name})")  # fmt: skip
    preds = {n: deploy(base, dep, n, interval, code) for n in PREDICT_N}
    print("| figure | " + " | ".join(f"N = {n}" for n in PREDICT_N) + " |")
    print("|---|" + "---|" * len(PREDICT_N))
    for key in preds[PREDICT_N[0]]:
        print(f"| {key} | " + " | ".join(fmt(preds[n][key]) for n in PREDICT_N) + " |")
    order = breaks(base, dep, interval, code)
    print("\n## what breaks first (smallest N at which each limit is crossed)")
    for i, b in enumerate(order, 1):
        where = f"N = {b['first_n']:,}" if b["first_n"] else "not below 2^20"
        print(f"{i}. {b['limit']}: {where}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(
                {
                    "json": path,
                    "code": code_name,
                    "fits": {k: vars(v) for k, v in fits.items()},
                    "in_sample": in_sample,
                    "check": checked,
                    "verdict": summary,
                    "predictions": {str(n): p for n, p in preds.items()},
                    "breaks": order,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
