"""P/D capacity planning by token throughput (not by time share), from a cost model.

Prefill demand is rate x mean prompt tokens, decode demand rate x mean output tokens. An
instance's capacity is the throughput at the largest step that still meets the SLO: X for a
prefill instance (prompt tokens/s whose TTFT fits), Y for a decode instance (tokens/s of the
largest batch whose step fits the ITL SLO and whose KV fits). Instances run at a target
utilisation u (default 0.75): at 75% load a batched queue waits about one to two steps
(M/D/1: rho / (2(1 - rho)) = 1.5 service times); past ~85% bursts make the wait unbounded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from tandem.sim.cost_model import BatchShape, CostModel, prefill_shape

CHUNKS = tuple(2**k for k in range(4, 15))  # prefill tokens per step tried: 16 .. 16384
MAX_DECODE_BATCH = 4096


@dataclass(slots=True, frozen=True)
class Traffic:
    rate: float  # requests/s
    prompt_mean: float
    output_mean: float
    ttft_prompt: float | None = None  # prompt length the TTFT SLO is judged at (default: the mean)


@dataclass(slots=True, frozen=True)
class SLO:
    ttft: float = 1.0  # seconds
    itl: float = 0.05  # seconds
    utilization: float = 0.75

    def __post_init__(self) -> None:
        if self.ttft <= 0 or self.itl <= 0:
            raise ValueError("the TTFT and ITL SLOs must be positive seconds")
        if not 0 < self.utilization <= 1:
            raise ValueError(f"target utilisation must be in (0, 1], got {self.utilization}")


@dataclass(slots=True, frozen=True)
class Point:
    """An operating point: step size (prefill tokens or decode batch), its time, its yield."""

    size: int
    step: float  # seconds (prefill: a step of mean-length prompts)
    throughput: float  # tokens/s
    latency: float  # TTFT (of the prompt it is judged at) or ITL at this point
    limit: str  # what kept the step from growing


def _ceil(x: float) -> int:
    """ceil, blind to float dust (2.0000000001 instances is 2)."""
    return math.ceil(round(x, 9))


def _largest(step_at: Callable[[int], float], itl: float, hi: int) -> int:
    """The largest batch n in [0, hi] with step_at(n) <= itl, for step_at growing with n."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if step_at(mid) <= itl else (lo, mid - 1)
    return lo


def prefill_point(cm: CostModel, prompt_mean: float, ttft_prompt: float, ttft: float) -> Point:
    """The step size for a prefill instance: among chunks whose TTFT for `ttft_prompt` - the
    step in flight plus the prompt's own ceil(prompt / chunk) steps - fits `ttft`, the smallest
    within 5% of the best tokens/s on prompts of `prompt_mean` (bigger steps would buy little
    throughput for much latency)."""
    points: list[Point | str] = []  # a Point where the chunk fits, else why it does not
    for tokens in CHUNKS:
        step = cm.step_time(prefill_shape(tokens, max(int(prompt_mean), 1)))
        wait = cm.step_time(prefill_shape(tokens, max(int(ttft_prompt), 1))) * (
            1 + math.ceil(ttft_prompt / tokens)
        )
        points.append(Point(tokens, step, tokens / step, wait, "") if wait <= ttft else "TTFT SLO")
    feasible = [q for q in points if isinstance(q, Point)]
    if not feasible:
        raise ValueError(
            f"no prefill step meets the TTFT SLO ({ttft:.3f} s) for a "
            f"{ttft_prompt:.0f}-token prompt"
        )
    top = max(q.throughput for q in feasible)
    i = next(j for j, q in enumerate(points) if isinstance(q, Point) and q.throughput >= 0.95 * top)
    nxt = points[i + 1] if i + 1 < len(points) else f"largest chunk tried ({CHUNKS[-1]})"
    q = points[i]
    return Point(
        q.size,
        q.step,
        q.throughput,
        q.latency,
        "bigger steps add < 5%" if isinstance(nxt, Point) else nxt,
    )


def decode_point(cm: CostModel, context: float, itl: float) -> Point:
    """The largest decode batch whose step fits `itl` and whose KV (batch x context) fits."""

    def step_at(b: int) -> float:
        return cm.step_time(BatchShape(num_decode_seqs=b, decode_context=int(b * context)))

    if step_at(1) > itl:
        raise ValueError(
            f"ITL SLO {itl} s is below one decode step ({step_at(1):.4f} s at batch 1)"
        )
    kv_cap = min(MAX_DECODE_BATCH, int(cm.kv_capacity_tokens // max(context, 1)))
    if kv_cap < 1:
        raise ValueError(
            f"one request's KV ({context:.0f} tokens) exceeds the pool "
            f"({cm.kv_capacity_tokens} tokens)"
        )
    b = _largest(step_at, itl, kv_cap)
    limit = (
        "ITL SLO" if b < kv_cap else ("KV capacity" if kv_cap < MAX_DECODE_BATCH else "max batch")
    )
    return Point(b, step_at(b), b / step_at(b), step_at(b), limit)


@dataclass(slots=True, frozen=True)
class Mixed:
    """A co-located instance's step: T prompt tokens (chunked prefill) riding with B decodes."""

    prefill_tokens: int
    decode_batch: int
    step: float
    rate: float  # requests/s one instance serves: min(T / prompt, B / output) / step
    ttft: float
    decode_only_step: float  # the same B decodes without the chunk


def colocated_point(cm: CostModel, t: Traffic, slo: SLO) -> Mixed | None:
    """The mixed step serving the most requests/s while every decode in it meets the ITL SLO
    (the chunk lengthens the step each decode waits on: that is the interference) and the
    prompt's chunks meet TTFT. None if no step meets both."""
    prompt, out = max(t.prompt_mean, 1.0), max(t.output_mean, 1.0)
    ttft_prompt, context = t.ttft_prompt or prompt, prompt + out / 2
    kv_cap = min(MAX_DECODE_BATCH, int(cm.kv_capacity_tokens // context))

    def mixed_step(pre: BatchShape, b: int) -> float:
        """A step of the prompt chunk `pre` and b decodes."""
        return cm.step_time(replace(pre, num_decode_seqs=b, decode_context=int(b * context)))

    best = None
    for tokens in range(16, CHUNKS[-1] + 1, 16):
        step_at = partial(mixed_step, prefill_shape(tokens, int(prompt)))
        if step_at(0) > slo.itl:
            break
        b = _largest(step_at, slo.itl, min(kv_cap, math.ceil(tokens * out / prompt)))
        step = step_at(b)
        ttft = step * (1 + math.ceil(ttft_prompt / tokens))
        rate = min(tokens / prompt, b / out) / step
        if ttft <= slo.ttft and (best is None or rate > best.rate):
            only = cm.step_time(BatchShape(num_decode_seqs=b, decode_context=int(b * context)))
            best = Mixed(tokens, b, step, rate, ttft, only)
    return best


@dataclass(slots=True)
class Plan:
    traffic: Traffic
    slo: SLO
    prefill_demand: float  # prompt tokens/s
    decode_demand: float  # output tokens/s
    prefill: Point  # a prefill instance (X)
    decode: Point  # a decode instance (Y)
    num_prefill: int
    num_decode: int
    kv_transfer: float  # seconds to move the KV of the prompt TTFT is judged at from P to D
    colocated: Mixed | None  # a co-located instance's step; None: no step meets both SLOs
    colocated_busy: (
        tuple[float, float] | None
    )  # instance-seconds per second of traffic: prefill, decode
    num_colocated: int | None
    recommendation: str = ""


def plan(cm: CostModel, traffic: Traffic, slo: SLO) -> Plan:
    """Prefill and decode instance counts for disaggregated serving, and the co-located count."""
    u, t = slo.utilization, traffic
    ttft_prompt = t.ttft_prompt or t.prompt_mean
    context = t.prompt_mean + t.output_mean / 2  # a decoding request's mean KV
    dp, dd = t.rate * t.prompt_mean, t.rate * t.output_mean
    transfer = cm.kv_transfer_time(int(ttft_prompt))
    pre = prefill_point(cm, t.prompt_mean, ttft_prompt, slo.ttft - transfer)
    dec = decode_point(cm, context, slo.itl)
    co = colocated_point(cm, t, slo)
    busy = None
    if (
        co is not None
    ):  # steps per second of traffic, each split into its chunk's share and the decodes'
        steps = t.rate / (co.rate * co.step)
        busy = (steps * (co.step - co.decode_only_step), steps * co.decode_only_step)
    p = Plan(
        t,
        slo,
        dp,
        dd,
        pre,
        dec,
        _ceil(dp / (pre.throughput * u)),
        _ceil(dd / (dec.throughput * u)),
        transfer,
        co,
        busy,
        None if busy is None else _ceil(sum(busy) / u),
    )
    split = p.num_prefill + p.num_decode
    p.recommendation = (
        "disaggregate: no co-located step meets both SLOs"
        if p.num_colocated is None
        else f"co-locate: {p.num_colocated} instance(s) against {split} split, and no KV transfer"
        if p.num_colocated <= split
        else f"disaggregate: {split} instances split P:D against {p.num_colocated} co-located"
    )
    return p


@dataclass(slots=True)
class Elastic:
    bucket_seconds: float
    buckets: list[
        dict
    ]  # start, rate, prompt_mean, output_mean, P, D (None and an error: SLOs unmet)
    total: int  # instances the busiest bucket needs (of those that can meet the SLOs)
    fixed_prefill: int  # prefill in every bucket
    fixed_decode: int
    elastic: int  # instances that switch roles
    switches: list[dict]  # start, P and D before and after


def elastic(
    cm: CostModel, buckets: list[tuple[float, Traffic]], slo: SLO, bucket_seconds: float
) -> Elastic:
    """Per time bucket the P:D split; elastic instances move where the split changes."""
    rows = []
    for start, t in buckets:
        row = {
            "start": start,
            "rate": t.rate,
            "prompt_mean": t.prompt_mean,
            "output_mean": t.output_mean,
            "P": 0,
            "D": 0,
        }
        if t.rate > 0:
            try:
                p = plan(cm, t, slo)
                row.update(P=p.num_prefill, D=p.num_decode)
            except (
                ValueError
            ) as e:  # this bucket's lengths cannot meet the SLOs: say so, plan the rest
                row.update(P=None, D=None, error=str(e))
        rows.append(row)
    ok = [r for r in rows if r["P"] is not None]
    if not ok:
        raise ValueError(
            "no time bucket can meet the SLOs" + (f": {rows[0]['error']}" if rows else "")
        )
    total = max(r["P"] + r["D"] for r in ok)
    fp, fd = min(r["P"] for r in ok), min(r["D"] for r in ok)
    switches = [
        {"start": b["start"], "P": (a["P"], b["P"]), "D": (a["D"], b["D"])}
        for a, b in zip(ok, ok[1:])
        if (a["P"], a["D"]) != (b["P"], b["D"])
    ]
    return Elastic(bucket_seconds, rows, total, fp, fd, total - fp - fd, switches)
