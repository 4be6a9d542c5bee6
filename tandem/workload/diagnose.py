"""Tail-latency diagnosis in three layers (queueing, step time, bandwidth), then
fragmentation, from a run's records: per-request latency splits (request log or `bench serve
--save-result`), the step trace (`--step-trace`) and the server's counters over the run. Pure
arithmetic on plain records, so each verdict is tested on records built to show it.

1. queueing: over QUEUE_LIMIT of the latency spent waiting for a first schedule is a
   scheduling problem (too little capacity for the load, or a policy holding work back);
2. step time: the step-time distribution split in two clusters (2-means on log time); a slow
   cluster JUMP_RATIO times the fast one is a jump, explained by what its steps carried;
3. transfers: P/D KV handoff time and time in steps that swap, as shares of the latency and
   of the busy time;
4. fragmentation: KV free (FREE_KV_SHARE of the pool or more) while requests wait, and the
   limit that held them: the seat cap, the token budget, a level's share, the host tier."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

QUEUE_LIMIT = 0.40
JUMP_RATIO = 2.0
TRANSFER_LIMIT = 0.20
FREE_KV_SHARE = 0.20
SYMPTOM_SHARE = 0.05  # of steps, before fragmentation is called


@dataclass(slots=True)
class Layer:
    name: str
    verdict: str
    flagged: bool
    figures: dict = field(default_factory=dict)


def _pct(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(p / 100 * len(v)))]


def queueing(splits: list[tuple[float, float]]) -> Layer:
    """(queue seconds, end-to-end seconds) per request."""
    splits = [(q, e) for q, e in splits if e > 0]
    if not splits:
        return Layer("queueing", "no request latencies in the records", False)
    share = sum(q for q, _ in splits) / sum(e for _, e in splits)
    per = [q / e for q, e in splits]
    figs = {
        "requests": len(splits),
        "queue_share": share,
        "queue_share_p90": _pct(per, 90),
        "queue_ms_p50": _pct([q for q, _ in splits], 50) * 1e3,
        "queue_ms_p99": _pct([q for q, _ in splits], 99) * 1e3,
    }
    if share > QUEUE_LIMIT:
        return Layer(
            "queueing",
            f"scheduling problem: requests spent {share:.0%} of their latency queued "
            f"(over {QUEUE_LIMIT:.0%}); add capacity or let short work ahead (multilevel)",
            True,
            figs,
        )
    return Layer(
        "queueing",
        f"queueing is {share:.0%} of latency (under {QUEUE_LIMIT:.0%}): not a scheduling problem",
        False,
        figs,
    )


def two_clusters(values: list[float]) -> tuple[float, list[int]]:
    """1-D 2-means on log values: (threshold between the clusters, indices of the upper one)."""
    logs = [math.log(max(v, 1e-9)) for v in values]
    lo, hi = min(logs), max(logs)
    for _ in range(50):
        cut = (lo + hi) / 2
        low, high = [x for x in logs if x <= cut], [x for x in logs if x > cut]
        if not low or not high:
            break
        new = statistics.fmean(low), statistics.fmean(high)
        if new == (lo, hi):
            break
        lo, hi = new
    cut = (lo + hi) / 2
    return math.exp(cut), [i for i, x in enumerate(logs) if x > cut]


def _median(steps: list[dict], key: str) -> float:
    return statistics.median(s.get(key, 0) for s in steps) if steps else 0.0


def _share(steps: list[dict], pred) -> float:
    return sum(1 for s in steps if pred(s)) / len(steps) if steps else 0.0


def _swaps(s: dict) -> bool:
    return bool(s.get("swap_out_blocks") or s.get("swap_in_blocks"))


def step_times(steps: list[dict]) -> Layer:
    if len(steps) < 10:
        return Layer("step time", f"too few steps ({len(steps)}) to find a jump", False)
    secs = [s["seconds"] for s in steps]
    cut, upper = two_clusters(secs)
    upper_set = set(upper)
    slow = [steps[i] for i in upper]
    fast = [s for i, s in enumerate(steps) if i not in upper_set]
    figs = {
        "steps": len(steps),
        "p50_ms": _pct(secs, 50) * 1e3,
        "p90_ms": _pct(secs, 90) * 1e3,
        "p99_ms": _pct(secs, 99) * 1e3,
        "clusters": [
            {
                "steps": len(g),
                "median_ms": _median(g, "seconds") * 1e3,
                "prefill_tokens_p50": _median(g, "prefill_tokens"),
                "decodes_p50": _median(g, "decodes"),
                "swap_share": _share(g, _swaps),
            }
            for g in (fast, slow)
            if g
        ],
    }
    ratio = _median(slow, "seconds") / max(_median(fast, "seconds"), 1e-9) if slow and fast else 1.0
    figs["jump_ratio"] = ratio
    if ratio < JUMP_RATIO or len(slow) < max(3, 0.01 * len(steps)):
        return Layer(
            "step time",
            f"no jump: step time p50 {figs['p50_ms']:.1f} ms, p99 {figs['p99_ms']:.1f} ms",
            False,
            figs,
        )
    causes = []
    if _median(slow, "prefill_tokens") > 2 * _median(fast, "prefill_tokens") + 16:
        causes.append(
            f"long prefill chunks ({_median(slow, 'prefill_tokens'):.0f} prompt tokens per slow "
            f"step, {_median(fast, 'prefill_tokens'):.0f} per fast one)"
        )
    if _share(slow, _swaps) > _share(fast, _swaps) + 0.2:
        causes.append(
            f"swaps ({_share(slow, _swaps):.0%} of slow steps copy KV to or from the host, "
            f"{_share(fast, _swaps):.0%} of fast ones)"
        )
    if _median(slow, "decodes") > 1.5 * max(_median(fast, "decodes"), 1):
        causes.append(
            f"many decodes ({_median(slow, 'decodes'):.0f} per slow step, "
            f"{_median(fast, 'decodes'):.0f} per fast one)"
        )
    why = (
        "; ".join(causes)
        or "nothing the step trace records (look at KV paging or remote KV reads, or the host)"
    )
    return Layer(
        "step time",
        f"step-time jump: {len(slow)} steps ({len(slow) / len(steps):.0%}) take "
        f"{_median(slow, 'seconds') * 1e3:.0f} ms against {_median(fast, 'seconds') * 1e3:.0f} ms "
        f"({ratio:.1f}x); they carry {why}",
        True,
        figs,
    )


def transfers(steps: list[dict], counters: dict | None, e2e_total: float) -> Layer:
    """P/D KV handoffs (the server's counters over the run) and swap traffic (the step trace)."""
    c = counters or {}
    busy = sum(s["seconds"] for s in steps)
    swap_s = sum(s["seconds"] for s in steps if _swaps(s))
    kv_s, n = c.get("kv_transfer_seconds", 0.0), c.get("kv_transfers", 0.0)
    figs = {
        "kv_transfers": n,
        "kv_transfer_seconds": kv_s,
        "kv_transfer_mb": c.get("kv_transfer_bytes", 0.0) / 1e6,
        "kv_transfer_share_of_latency": kv_s / e2e_total if e2e_total > 0 else None,
        "swap_steps": sum(1 for s in steps if _swaps(s)),
        "swap_step_share_of_busy": swap_s / busy if busy else None,
        "swap_blocks": sum(s.get("swap_out_blocks", 0) + s.get("swap_in_blocks", 0) for s in steps),
    }
    found = []
    if (
        figs["kv_transfer_share_of_latency"]
        and figs["kv_transfer_share_of_latency"] > TRANSFER_LIMIT
    ):
        found.append(
            f"P/D KV handoffs take {figs['kv_transfer_share_of_latency']:.0%} of the requests' "
            f"latency ({n:.0f} transfers, {kv_s / max(n, 1) * 1e3:.0f} ms each, "
            f"{figs['kv_transfer_mb']:.0f} MB)"
        )
    if figs["swap_step_share_of_busy"] and figs["swap_step_share_of_busy"] > TRANSFER_LIMIT:
        found.append(
            f"steps that swap KV take {figs['swap_step_share_of_busy']:.0%} of the busy time "
            f"({figs['swap_blocks']} blocks moved)"
        )
    if found:
        return Layer("transfers", "transfer-bound: " + "; ".join(found), True, figs)
    if not counters and not steps:
        return Layer(
            "transfers", "no transfer figures in the records (give --bench or --steps)", False, figs
        )
    return Layer(
        "transfers",
        f"transfers are not the bottleneck (under {TRANSFER_LIMIT:.0%} of latency and busy time)",
        False,
        figs,
    )


def _held_by(s: dict) -> str:
    if s.get("max_num_seqs") and s["running"] >= s["max_num_seqs"]:
        return f"the sequence cap (max_num_seqs {s['max_num_seqs']})"
    if s.get("token_budget") and s["tokens"] >= s["token_budget"]:
        return f"the token budget (max_num_batched_tokens {s['token_budget']})"
    if s.get("throttled_prefill_tokens") and s.get("throttle", 0) < s.get("token_budget", 0):
        return (
            f"a level's share (lower levels held to {s['throttle']} prompt tokens a step "
            "while L1 runs)"
        )
    if s.get("swapped") and s.get("host_total_blocks") and not s.get("host_free_blocks"):
        return "the host tier full (swapped requests cannot leave room)"
    return "nothing the step trace records (a waiting prompt larger than the free KV?)"


def fragmentation(steps: list[dict]) -> Layer:
    """Free KV while requests wait, and what held them."""
    if not steps or "kv_free_blocks" not in steps[0]:
        return Layer(
            "fragmentation",
            "the step trace records no KV figures (written before they were added)",
            False,
        )
    stuck = [
        s
        for s in steps
        if s["waiting"] and s["kv_free_blocks"] >= FREE_KV_SHARE * s["kv_total_blocks"]
    ]
    share = len(stuck) / len(steps)
    reasons: dict[str, int] = {}
    for s in stuck:
        reasons[_held_by(s)] = reasons.get(_held_by(s), 0) + 1
    figs = {
        "steps": len(steps),
        "stuck_steps": len(stuck),
        "stuck_share": share,
        "held_by": reasons,
        "free_kv_share_p50": _pct([s["kv_free_blocks"] / s["kv_total_blocks"] for s in stuck], 50)
        if stuck
        else None,
        "waiting_p50": _pct([s["waiting"] for s in stuck], 50) if stuck else None,
    }
    if share < SYMPTOM_SHARE:
        return Layer(
            "fragmentation",
            f"no fragmentation: requests waited with KV free in {share:.0%} of steps",
            False,
            figs,
        )
    top = max(reasons, key=reasons.get)
    return Layer(
        "fragmentation",
        f"free memory, yet concurrency cannot rise: in {share:.0%} of steps "
        f"{figs['waiting_p50']} requests waited with {figs['free_kv_share_p50']:.0%} of KV free; "
        f"held by {top} in {reasons[top] / len(stuck):.0%} of them",
        True,
        figs,
    )


def diagnose(
    splits: list[tuple[float, float]], steps: list[dict], counters: dict | None
) -> list[Layer]:
    e2e_total = sum(e for _, e in splits)
    layers = [queueing(splits)] if splits else []
    if steps:
        layers.append(step_times(steps))
    if steps or counters:
        layers.append(transfers(steps, counters, e2e_total))
    if steps:
        layers.append(fragmentation(steps))
    return layers
