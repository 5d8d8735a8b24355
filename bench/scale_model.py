"""A model of a moolib group past what one machine holds (256 and 1,024 peers),
fitted to bench/scale.py's 8 and 16 peer rows and checked against its 32 and 64.

Usage: python bench/scale_model.py [--json PATH] [--code new|old] [--report PATH]
       [--link-gbit 10] [--latency-us 50] [--churn-per-peer-hour 1]

--json     a scale.py result (``--json`` there); default /tmp/scale-new.json, else
           /tmp/scale-full.json.
--code     which collective code measured it: ``new`` (direct sums among <= 8
           members, recursive doubling above: commit 4a1f2e1 on) or ``old``
           (direct among <= 32, then the large-buffer path: shared memory or the ring).
--report   also write the fit, the check and the predictions as JSON here.

The model's structure is the algorithms' message and byte counts
(moolib/core/collective.h, doubling.h, broker.cc); only their unit costs are
fitted, from the 8 and 16 peer rows of each layout, never from 32 or 64.

Assumptions (printed with the results):

A1 One machine (the measured layouts): all N peers share C cores, so an
   all-reduce takes (c_msg x messages + c_byte x bytes) / C, the group's CPU
   work spread over the cores, plus h x hops, its critical path of message hops.
   c_msg, c_byte (CPU seconds) and h (seconds) are fitted per layout by
   non-negative least squares in relative error over the three sizes (16 B,
   1 MiB, 6 MiB) of the 8 and 16 peer rows: 6 figures, 3 unknowns.
A2 Counts per all-reduce of S bytes among N (whole group):
   direct     N(N-1) messages of S, 1 hop, links N-1 a peer;
   doubling   P log2 P + 2(N-P) messages (P: largest power of two <= N),
              log2 P hops (+2 where N > P), links log2 P (+1);
   ring       2(N-1) x ceil(S/N / 256 KiB) messages a member, 2(N-1) S bytes,
              2(N-1) + chunks - 1 hops, links 2;
   shm        3 rounds of N(N-1) tiny messages, 3 S bytes copied a member,
              3 hops, links N-1;
   all-gather (the Accumulator's election) N(N-1) messages, 1 hop, links N-1.
A3 Join: every member sees all N at the join window (one ping interval) plus
   a cost linear in N (the members' pings through the broker and their
   replies on C cores): join = w + a N, fitted from 8 and 16. The kill's next
   step likewise: w + a N (w: the group timeout before the dead-member drop,
   the grace after it).
A4 Broker: every member pings once an interval I = min(timeout/8, 1 s); an
   answer encodes the whole member list, so the broker's CPU is
   N/I x (c_ping + c_name N) CPU s/s, fitted by NNLS from the idle figures at 8
   and 16. A membership change answers every held ping: N (c_ping + c_name N)
   CPU s and N^2 x 40 bytes (a name and a shared-memory key a member a reply).
   scale.py reads CPU in clock ticks (10 ms over a 3-6 s window): its broker
   figures are only good to about +-0.002 CPU s/s.
A5 Descriptors and memory per peer: f0 + f_link x links, r0 + r_link x links,
   links: the distinct members a peer exchanged with over the run's
   all-reduces (links are dialed lazily); fitted from 8 and 16. Threads: constant.
A6 Deployment (the 256 and 1,024 figures): one peer per host, its cores its
   own, links of --link-gbit, one-way latency --latency-us, the broker on a
   host of its own. What carries over from this machine: c_msg, c_byte, c_ping,
   c_name (CPU seconds of the same code; fitted under this machine's load, so
   likely high) and f_link, r_link (per link, from netns: TCP as between hosts).
   What does not: h (the wait for a core among N processes on C cores here) and
   the machine-wide CPU bound; a hop costs the latency plus one message's
   c_msg, a peer's bytes go over its own link at the link rate (max of the
   wire and its CPU per byte), and a peer's collective work runs on one thread.
   Peers run the Accumulator, so the election's all-gather links every pair:
   links = N-1. Churn: every peer leaves and rejoins --churn-per-peer-hour times
   an hour (2 changes each).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

SIZES = (16, 1 << 20, 6 << 20)
SIZE_NAMES = {16: "16 B", 1 << 20: "1 MiB", 6 << 20: "6 MiB"}
SMALL_MAX = 64 << 10  # collective.cc kDirectMaxBytes
CHUNK = 256 << 10  # collective.cc kChunkBytes
DIRECT_MAX = {"new": 8, "old": 32}  # collective.cc kDirectMaxMembers, now and before 4a1f2e1
REPLY_BYTES_PER_MEMBER = 40
ELECTION_SEGMENT_BYTES = 256
FIT_N = (8, 16)
CHECK_N = (32, 64)
PREDICT_N = (256, 1024)
TOLERANCE = 1.5
FD_LIMIT = 1024
DEFAULT_JSON = ("/tmp/scale-new.json", "/tmp/scale-full.json")


@dataclass(frozen=True)
class Counts:
    """One collective among N: the group's messages and bytes, its critical path, a peer's links."""

    algo: str
    messages: float
    bytes: float
    hops: float
    links: int


def doubling_counts(n: int, size: int) -> Counts:
    p = 1 << (n.bit_length() - 1)
    k = p.bit_length() - 1
    extra = n - p
    messages = p * k + 2 * extra
    return Counts("doubling", messages, messages * size, k + (2 if extra else 0), k + bool(extra))


def ring_counts(n: int, size: int) -> Counts:
    chunks = max(1, math.ceil(size / n / CHUNK))
    return Counts("ring", n * 2 * (n - 1) * chunks, 2 * (n - 1) * size, 2 * (n - 1) + chunks - 1, 2)


def gather_counts(n: int, size: int) -> Counts:
    return Counts("all-gather", n * (n - 1), n * (n - 1) * size, 1, n - 1)


def allreduce_counts(n: int, size: int, layout: str, code: str) -> Counts:
    """What a sum all-reduce of ``size`` bytes among ``n`` costs (assumption A2)."""
    if n <= 1:
        return Counts("none", 0, 0, 0, 0)
    if size <= SMALL_MAX and n <= DIRECT_MAX[code]:
        return Counts("direct", n * (n - 1), n * (n - 1) * size, 1, n - 1)
    if size <= SMALL_MAX and code == "new":
        return doubling_counts(n, size)
    if layout == "shm":
        return Counts("shm", 3 * n * (n - 1), 3 * n * size, 3, n - 1)
    return ring_counts(n, size)


def run_links(n: int, layout: str, code: str) -> int:
    """A peer's links after scale.py's all-reduces (16 B, 1 MiB, 6 MiB): their union."""
    counts = [allreduce_counts(n, s, layout, code) for s in SIZES]
    return n - 1 if any(c.links == n - 1 for c in counts) else max(c.links for c in counts)


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
    """y = w + a x through the points, a >= 0 and w >= 0 (A3, A5)."""
    a = np.array([[1.0, x] for x in xs])
    w, slope = nnls(a, np.array(ys, dtype=float))
    return float(w), float(slope)


@dataclass
class LayoutFit:
    """The unit costs of one layout, from its 8 and 16 peer rows."""

    layout: str
    cores: int
    c_msg: float = 0.0
    c_byte: float = 0.0
    hop: float = 0.0
    join: tuple[float, float] = (0.0, 0.0)
    kill: tuple[float, float] = (0.0, 0.0)
    c_ping: float = 0.0
    c_name: float = 0.0
    fds: tuple[float, float] = (0.0, 0.0)
    rss: tuple[float, float] = (0.0, 0.0)
    threads: float = 0.0
    fitted_from: list[int] = field(default_factory=list)

    def allreduce_s(self, n: int, size: int, code: str) -> float:
        c = allreduce_counts(n, size, self.layout, code)
        return (self.c_msg * c.messages + self.c_byte * c.bytes) / self.cores + self.hop * c.hops


def reduce_median(row: dict, size: int) -> float | None:
    fig = row.get("reduce", {}).get(str(size), {})
    return fig.get("median_s")


def light(row: dict, key: str) -> float | None:
    return row.get("light", {}).get(key, {}).get("median")


def fit_layout(rows: list[dict], layout: str, cores: int, code: str, interval: float) -> LayoutFit:
    """Fits A1, A3, A4, A5 from the rows of N = 8 and 16 (others are ignored)."""
    fit = LayoutFit(layout, cores)
    rows = [r for r in rows if r["peers"] in FIT_N]
    fit.fitted_from = sorted(r["peers"] for r in rows)
    if len(rows) < 2:
        raise ValueError(f"needs rows at N = 8 and 16, has {fit.fitted_from}")
    eqs, rhs = [], []
    for r in rows:
        for size in SIZES:
            t = reduce_median(r, size)
            if t is None or t <= 0:
                continue
            c = allreduce_counts(r["peers"], size, layout, code)
            # Relative error: each figure counts alike, 3 ms or 300 ms.
            eqs.append([c.messages / cores / t, c.bytes / cores / t, c.hops / t])
            rhs.append(1.0)
    if len(eqs) < 3:
        raise ValueError("too few all-reduce figures at N = 8, 16 to fit")
    # Scaled unknowns keep the least squares well conditioned (ms, ns/B, ms).
    scale = np.array([1e-3, 1e-9, 1e-3])
    x = nnls(np.array(eqs) * scale, np.array(rhs)) * scale
    fit.c_msg, fit.c_byte, fit.hop = (float(v) for v in x)

    def pairs(get: Any) -> tuple[list[float], list[float]]:
        got = [(float(r["peers"]), get(r)) for r in rows]
        got = [(n, y) for n, y in got if y is not None]
        return [n for n, _ in got], [float(y) for _, y in got]

    fit.join = line_fit(*pairs(lambda r: r.get("join_s")))
    fit.kill = line_fit(*pairs(lambda r: r.get("kill", {}).get("next_step_s")))
    # A4: cpu = N/I (c_ping + c_name N).
    ns, cpu = pairs(lambda r: r.get("broker_cpu_idle"))
    a = np.array([[n / interval, n * n / interval] for n in ns])
    fit.c_ping, fit.c_name = (
        float(v) for v in nnls(a * [1e-4, 1e-6], np.array(cpu)) * [1e-4, 1e-6]
    )
    links = {r["peers"]: run_links(r["peers"], layout, code) for r in rows}
    for key in ("fds", "rss"):
        n_got, got = pairs(lambda r, k=key: light(r, "fds" if k == "fds" else "rss_mib"))
        setattr(fit, key, line_fit([links[int(n)] for n in n_got], got) if got else (0.0, 0.0))
    threads = [light(r, "threads") for r in rows]
    fit.threads = float(np.mean([t for t in threads if t is not None] or [0.0]))
    return fit


def predict_row(fit: LayoutFit, n: int, code: str, interval: float) -> dict[str, float]:
    """The model's figures for N peers on the measured machine (same keys as measured_row)."""
    links = run_links(n, fit.layout, code)
    out = {f"ar {SIZE_NAMES[s]} s": fit.allreduce_s(n, s, code) for s in SIZES}
    out["join s"] = fit.join[0] + fit.join[1] * n
    out["kill next step s"] = fit.kill[0] + fit.kill[1] * n
    out["broker cpu idle"] = n / interval * (fit.c_ping + fit.c_name * n)
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


def check(
    results: list[dict],
    fits: dict[str, LayoutFit],
    code: str,
    interval: float,
    ns: tuple[int, ...],
    tick: float,
) -> list[dict[str, Any]]:
    """Measured beside predicted for every figure of the rows at ``ns``; the broker's CPU
    also passes within ``tick``, the resolution of scale.py's reading of it (A4)."""
    rows = []
    for r in results:
        fit = fits.get(r["layout"])
        if fit is None or r["peers"] not in ns:
            continue
        pred = predict_row(fit, r["peers"], code, interval)
        for key, m in measured_row(r).items():
            p = pred[key]
            ratio = m / p if m and p > 0 else None
            ok = ratio is not None and 1 / TOLERANCE <= ratio <= TOLERANCE
            note = ""
            if m is None:
                note = "not measured (failed)"
            elif r.get("errors") and not key.startswith("ar "):
                note = "the row's all-reduces failed"
            elif key == "broker cpu idle" and abs(m - p) <= tick:
                note = "within the tick resolution (A4)"
                ok = True
            if key.startswith("ar "):
                size = next(s for s in SIZES if key == f"ar {SIZE_NAMES[s]} s")
                note = (note + " " if note else "") + allreduce_counts(
                    r["peers"], size, r["layout"], code
                ).algo
            rows.append(
                {
                    "layout": r["layout"],
                    "peers": r["peers"],
                    "figure": key,
                    "measured": m,
                    "predicted": p,
                    "ratio": ratio,
                    "ok": ok if m is not None else None,
                    "note": note,
                }
            )
    return rows


@dataclass(frozen=True)
class Deployment:
    """The hypothetical hosts of A6."""

    link_Bps: float = 10e9 / 8
    latency_s: float = 50e-6
    churn_per_peer_hour: float = 1.0


def deploy_allreduce(fit: LayoutFit, dep: Deployment, n: int, size: int) -> tuple[float, float]:
    """A6: (the hops' and messages' seconds, the bytes' seconds) of one all-reduce: a peer's
    share of the messages on one thread, every hop the latency plus one message's handling,
    a peer's bytes on its link (or its CPU per byte, whichever is slower)."""
    c = allreduce_counts(n, size, "netns", "new")
    if c.messages == 0:
        return 0.0, 0.0
    per_peer_bytes = c.bytes / n
    bytes_s = max(per_peer_bytes / dep.link_Bps, fit.c_byte * per_peer_bytes)
    return fit.c_msg * c.messages / n + c.hops * (dep.latency_s + fit.c_msg), bytes_s


def deploy(fit: LayoutFit, dep: Deployment, n: int, interval: float) -> dict[str, float]:
    """The figures of N peers on the deployment of A6, from a TCP (netns) fit."""
    per_change_cpu = n * (fit.c_ping + fit.c_name * n)
    per_change_bytes = n * n * REPLY_BYTES_PER_MEMBER
    change_s = per_change_cpu + per_change_bytes / dep.link_Bps + 2 * dep.latency_s
    g = gather_counts(n, ELECTION_SEGMENT_BYTES)
    election = (
        fit.c_msg * 2 * (n - 1)  # a peer sends and takes N-1 segments
        + g.bytes / n / dep.link_Bps
        + dep.latency_s
    )
    idle = n / interval * (fit.c_ping + fit.c_name * n)
    changes_per_s = 2 * n * dep.churn_per_peer_hour / 3600
    links = n - 1  # the election's all-gather links every pair (A6)
    hops6, bytes6 = deploy_allreduce(fit, dep, n, 6 << 20)
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
        "ar 16 B s": sum(deploy_allreduce(fit, dep, n, 16)),
        "ar 6 MiB s": ar6,
        "ar 6 MiB: hops and messages s": hops6,
        "ar 6 MiB ring bound s": 2 * (n - 1) / n * (6 << 20) / dep.link_Bps,
        "steps/s 1.6M": 1 / ar6 if ar6 > 0 else float("inf"),
        "peer links": links,
        "peer fds": fit.fds[0] + fit.fds[1] * links,
        "peer rss MiB": fit.rss[0] + fit.rss[1] * links,
    }


def breaks(fit: LayoutFit, dep: Deployment, interval: float) -> list[dict[str, Any]]:
    """The smallest N at which each limit is crossed on the deployment, first first."""
    limits = [
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
        d = deploy(fit, dep, n, interval)
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


def main(argv: list[str] | None = None) -> int:
    """Fits, checks and predicts, and prints it all (a figure off by > 1.5x is flagged there)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="a bench/scale.py --json result")
    parser.add_argument("--code", choices=sorted(DIRECT_MAX), default="new")
    parser.add_argument("--report", help="write the fit, check and predictions as JSON")
    parser.add_argument("--link-gbit", type=float, default=10.0)
    parser.add_argument("--latency-us", type=float, default=50.0)
    parser.add_argument("--churn-per-peer-hour", type=float, default=1.0)
    args = parser.parse_args(argv)
    path, data = load(args.json)
    settings, results = data["settings"], data["results"]
    cores = int(settings.get("cores") or 1)
    interval = min(float(settings.get("group_timeout", 10.0)) / 8, 1.0)
    tick = 0.01 / (3.0 if settings.get("quick") else 6.0)  # scale.py's idle window
    dep = Deployment(args.link_gbit * 1e9 / 8, args.latency_us * 1e-6, args.churn_per_peer_hour)

    print(f"scale model of {path} (code: {args.code}, direct sums among <= "
          f"{DIRECT_MAX[args.code]}), fitted on N = 8, 16; {cores} cores, ping interval "
          f"{interval:g} s")  # fmt: skip
    print("assumptions: " + __doc__.split("Assumptions (printed with the results):")[1].strip())
    layouts = sorted({r["layout"] for r in results})
    fits = {}
    for lay in layouts:
        try:
            rows = [r for r in results if r["layout"] == lay]
            fits[lay] = fit_layout(rows, lay, cores, args.code, interval)
        except ValueError as e:
            print(f"layout {lay}: not modelled: {e}")
    if not fits:
        raise SystemExit(f"{path}: no layout has the 8 and 16 peer rows the fit needs")
    print("\n## fit (unit costs per layout, from N = 8 and 16 only)")
    for f in fits.values():
        print(
            f"{f.layout}: c_msg {f.c_msg * 1e6:.1f} us CPU/message, c_byte "
            f"{f.c_byte * 1e9:.3f} ns CPU/byte, hop {f.hop * 1e3:.3f} ms; join "
            f"{f.join[0]:.3f} s + {f.join[1] * 1e3:.3f} ms x N; kill {f.kill[0]:.2f} s + "
            f"{f.kill[1] * 1e3:.2f} ms x N; broker {f.c_ping * 1e6:.1f} us/ping + "
            f"{f.c_name * 1e9:.1f} ns/name; fds {f.fds[0]:.1f} + {f.fds[1]:.2f}/link; rss "
            f"{f.rss[0]:.1f} + {f.rss[1]:.3f} MiB/link; threads {f.threads:g}"
        )

    sections: dict[str, list[dict[str, Any]]] = {}
    for title, ns in (("in-sample (the fit's own rows)", FIT_N), ("check", CHECK_N)):
        rows = check(results, fits, args.code, interval, ns, tick)
        sections[title] = rows
        print(f"\n## {title}: measured vs predicted (ratio; flagged outside "
              f"[1/{TOLERANCE}, {TOLERANCE}])")  # fmt: skip
        print("| layout | N | figure | measured | predicted | ratio | ok | note |")
        print("|---|---|---|---|---|---|---|---|")
        for c in rows:
            ok = "-" if c["ok"] is None else ("yes" if c["ok"] else "NO (off by > 1.5x)")
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
            print(f"| {c['layout']} | {c['peers']} | {c['figure']} | {fmt(c['measured'])} | "
                  f"{fmt(c['predicted'])} | {ratio} | {ok} | {c['note']} |")  # fmt: skip
    checked = [c for c in sections["check"] if c["ok"] is not None]
    off = [c for c in checked if not c["ok"]]
    print(f"\ncheck: {len(checked) - len(off)} of {len(checked)} figures at N = 32, 64 "
          f"within {TOLERANCE}x; {len(off)} off")  # fmt: skip

    base = fits.get("netns") or next(iter(fits.values()))
    print(f"\n## predictions at {', '.join(map(str, PREDICT_N))} peers (deployment, A6: one "
          f"peer per host, {args.link_gbit:g} Gbit/s, "
          f"{args.latency_us:g} us one way, churn {dep.churn_per_peer_hour:g}/peer/hour; "
          f"unit costs from the {base.layout} fit)")  # fmt: skip
    preds = {n: deploy(base, dep, n, interval) for n in PREDICT_N}
    print("| figure | " + " | ".join(f"N = {n}" for n in PREDICT_N) + " |")
    print("|---|" + "---|" * len(PREDICT_N))
    for key in preds[PREDICT_N[0]]:
        print(f"| {key} | " + " | ".join(fmt(preds[n][key]) for n in PREDICT_N) + " |")
    order = breaks(base, dep, interval)
    print("\n## what breaks first (smallest N at which each limit is crossed)")
    for i, b in enumerate(order, 1):
        where = f"N = {b['first_n']:,}" if b["first_n"] else "not below 2^20"
        print(f"{i}. {b['limit']}: {where}")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(
                {
                    "json": path,
                    "code": args.code,
                    "fits": {k: vars(v) for k, v in fits.items()},
                    "in_sample": sections["in-sample (the fit's own rows)"],
                    "check": sections["check"],
                    "predictions": {str(n): p for n, p in preds.items()},
                    "breaks": order,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
