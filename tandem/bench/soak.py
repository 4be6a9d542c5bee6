"""`tandem bench soak`: mixed traffic with faults for --duration seconds against a server it
starts (a KV pool small enough that requests are preempted) or one on loopback (--url). A
share of clients leave mid-stream and mid-response, a share send malformed bodies, prompts
share prefixes drawn from a pool that keeps moving (prefix-cache churn). At the end, once
idle, it checks: every request answered or refused (none lost: each got a status or an error
event it can see; none hung; a 5xx or an error event only just after the fault), KV free
blocks back to the total, RSS, open FDs and threads of the server's processes at the end
within 5% of the warm-up's (minute 2, or a quarter into a shorter run), and reports ITL p99 of
the first and last minute. JSON on stdout; exit 1 if a check fails."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.bench.fuzz import hostile_raw
from tandem.bench.soak_target import Target, add_target_arguments, start_target

WORDS = "the a of river stone light market winter garden letter engine number silver quiet".split()
HUNG_S = 120.0  # a request not answered within this long counts as hung
FAULT_WINDOW_S = 30.0  # errors a client sees this long after the fault are the fault's


@dataclass
class Outcomes:
    sent: int = 0
    answered: int = 0
    refused: int = 0  # 4xx (malformed bodies, 429 under load) and 503 (no room: retry later)
    left: int = 0  # the client went away on purpose
    errors: list = field(default_factory=list)  # (seconds since start, what): a 5xx, an error event
    lost: list = field(
        default_factory=list
    )  # no answer the client can see: a dropped connection, a cut stream
    hung: int = 0
    itl: list = field(default_factory=list)  # (seconds since start, gap)
    fault_at: float | None = None  # seconds since start
    resources: list = field(default_factory=list)  # (seconds since start, resources()) each minute


def prompt(rng: random.Random, elapsed: float) -> str:
    """A prefix from a pool that moves with time (cache churn), then a fresh tail."""
    pool = int(elapsed // 10)
    prefix = rng.randrange(pool, pool + 8)
    head = " ".join(WORDS[(prefix * 7 + i) % len(WORDS)] for i in range(40 + prefix % 30))
    return f"{head} {prefix} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 20)))


async def one(
    client: httpx.AsyncClient, url: str, rng: random.Random, t0: float, tally: Outcomes, args
) -> None:
    tally.sent += 1
    kind = rng.random()
    body = {
        "prompt": prompt(rng, time.monotonic() - t0),
        "max_tokens": rng.randint(8, 64),
        "ignore_eos": True,
        "temperature": rng.choice([0.0, 0.8]),
    }
    try:
        if kind < args.malformed_share:
            content, ctype = hostile_raw(["prompt", "max_tokens", "n", "stop", "messages"], rng)
            r = await client.post(
                url + "/v1/completions", content=content, headers={"content-type": ctype}
            )
            return count(tally, r.status_code, r.text, time.monotonic() - t0)
        if kind < args.malformed_share + args.disconnect_share / 2:  # leaves mid-response
            try:
                r = await client.post(
                    url + "/v1/completions", json=body, timeout=rng.uniform(0.05, 0.5)
                )
                count(tally, r.status_code, r.text, time.monotonic() - t0)
            except httpx.TimeoutException:
                tally.left += 1
            return
        await stream(
            client,
            url,
            body,
            rng,
            t0,
            tally,
            leave=kind < args.malformed_share + args.disconnect_share,
        )
    except httpx.TimeoutException:
        tally.hung += 1
    except httpx.HTTPError as e:
        tally.lost.append(repr(e)[:200])


async def stream(client, url, body, rng, t0, tally: Outcomes, leave: bool) -> None:
    """A streamed completion; `leave`: close it after a few chunks."""
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            return count(
                tally,
                r.status_code,
                (await r.aread()).decode(errors="replace"),
                time.monotonic() - t0,
            )
        last, chunks, done = None, 0, False
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            if '"error"' in line:
                tally.errors.append((time.monotonic() - t0, line[:200]))
                return
            now = time.monotonic()
            if last is not None:
                tally.itl.append((now - t0, now - last))
            last, chunks = now, chunks + 1
            if leave and chunks >= rng.randint(1, 4):
                tally.left += 1
                return
        if done:
            tally.answered += 1
        else:
            tally.lost.append("stream ended without [DONE]")


def count(tally: Outcomes, status: int, text: str, elapsed: float) -> None:
    """2xx answered; 4xx, and 503 (overloaded: no room, retry later), refused; any other 5xx an
    error (the client sees it: not lost, but a check that it came from the fault)."""
    if status < 300:
        tally.answered += 1
    elif status < 500 or status == 503:
        tally.refused += 1
    else:
        tally.errors.append((elapsed, f"{status}: {text[:200]}"))


def resources(pids: list[int]) -> dict | None:
    """RSS (bytes), open FDs and threads, summed over the server's processes; and the RSS of
    each (the server, then its children: where growth is)."""
    import psutil

    total = {"rss": 0, "fds": 0, "threads": 0, "rss_by_process": []}
    try:
        for pid in pids:
            p = psutil.Process(pid)
            for proc in [p, *p.children(recursive=True)]:
                rss = proc.memory_info().rss
                total["rss"] += rss
                total["rss_by_process"].append(rss)
                total["fds"] += proc.num_fds()
                total["threads"] += proc.num_threads()
    except psutil.Error:
        return None
    return total


async def drive(target: Target, args, tally: Outcomes) -> dict:
    """The traffic for args.duration seconds (with the target's fault halfway); the resources
    at warm-up."""
    url, t0, rng = target.url, time.monotonic(), random.Random(args.seed)
    warm_at, warm = min(120.0, args.duration / 4), {}
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=HUNG_S, limits=limits, trust_env=False) as client:

        async def worker(i: int) -> None:
            wrng = random.Random(rng.random())
            while time.monotonic() - t0 < args.duration:
                await one(client, url, wrng, t0, tally, args)

        tasks = [asyncio.ensure_future(worker(i)) for i in range(args.concurrency)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - t0
            if not warm and elapsed >= warm_at:
                warm = resources(target.pids) or {}
            if elapsed >= 60 * len(tally.resources):
                tally.resources.append((round(elapsed), resources(target.pids)))
            if (
                elapsed >= args.duration / 2
                and not target.faults
                and await asyncio.to_thread(target.fault)
            ):
                tally.fault_at = elapsed
            progress(elapsed, args.duration, tally)
        await asyncio.gather(*tasks)
    sys.stderr.write("\n")
    return warm


def progress(elapsed: float, duration: float, tally: Outcomes) -> None:
    done = min(elapsed / duration, 1.0)
    bar = "#" * int(done * 30)
    sys.stderr.write(
        f"\r[{bar:<30}] {done:4.0%} sent {tally.sent} answered {tally.answered} refused "
        f"{tally.refused} left {tally.left} errors {len(tally.errors)} lost {len(tally.lost)} "
        f"hung {tally.hung}"
    )
    sys.stderr.flush()


def read_metrics(url: str) -> dict[str, float] | None:
    """Every sample of /metrics summed over its labels (instances, models, levels)."""
    try:
        r = httpx.get(url + "/metrics", timeout=10, trust_env=False)
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for sample in fam.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def wait_idle(url: str, timeout: float = 60.0) -> dict | None:
    """The server's metrics once nothing runs or waits and the KV pool is whole again (or the
    last ones read when that does not happen within `timeout`)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = read_metrics(url)
        if (
            last
            and not last.get("tandem:num_requests_running")
            and not last.get("tandem:num_requests_waiting")
            and last.get("tandem:kv_cache_free_blocks") == last.get("tandem:kv_cache_total_blocks")
        ):
            return last
        time.sleep(0.5)
    return last


def itl_p99(samples: list, start: float, end: float) -> float | None:
    gaps = sorted(g for t, g in samples if start <= t < end)
    return round(gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 4) if gaps else None


def hit_share(metrics: dict) -> float | None:
    queries = metrics.get("tandem:prefix_cache_queries_total")
    return round(metrics["tandem:prefix_cache_hits_total"] / queries, 3) if queries else None


def second_half_growth(samples: list, end: dict | None, duration: float) -> float | None:
    """RSS growth from the first minute sample of the run's second half to the end (how it
    moves once the first half's warm-up is behind it)."""
    mid = next((r for t, r in samples if t >= duration / 2 and r), None)
    return round(end["rss"] / mid["rss"] - 1, 4) if mid and end else None


def report(
    tally: Outcomes, warm: dict, end: dict | None, idle: dict | None, duration: float
) -> dict:
    window = min(60.0, duration / 4)
    growth = (
        {k: round(end[k] / warm[k] - 1, 4) for k in ("rss", "fds", "threads")}
        if warm and end
        else None
    )
    idle = idle or {}
    at = tally.fault_at
    checks = {
        "none_lost": not tally.lost,
        "none_hung": tally.hung == 0,
        "errors_only_at_fault": all(
            at is not None and at <= t <= at + FAULT_WINDOW_S for t, _ in tally.errors
        ),
        "all_accounted": tally.sent
        == tally.answered
        + tally.refused
        + tally.left
        + len(tally.errors)
        + len(tally.lost)
        + tally.hung,
        "kv_free_at_idle": bool(idle)
        and idle.get("tandem:kv_cache_free_blocks") == idle.get("tandem:kv_cache_total_blocks"),
        "resources_flat": growth is not None and all(g <= 0.05 for g in growth.values()),
    }
    return {
        "duration_s": duration,
        "sent": tally.sent,
        "answered": tally.answered,
        "refused": tally.refused,
        "left_on_purpose": tally.left,
        "errors": len(tally.errors),
        "lost": len(tally.lost),
        "hung": tally.hung,
        "error_examples": tally.errors[:5],
        "lost_examples": tally.lost[:5],
        "fault_at_s": at,
        "kv_free_blocks_idle": idle.get("tandem:kv_cache_free_blocks"),
        "kv_total_blocks": idle.get("tandem:kv_cache_total_blocks"),
        "preemptions": idle.get("tandem:num_preemptions_total"),
        "prefix_cache_hit_share": hit_share(idle),
        "resources_warm": warm,
        "resources_end": end,
        "growth": growth,
        "rss_growth_second_half": second_half_growth(tally.resources, end, duration),
        "resources_by_minute": tally.resources,
        "itl_p99_first_s": itl_p99(tally.itl, 0, window),
        "itl_p99_last_s": itl_p99(tally.itl, duration - window, duration + HUNG_S),
        "checks": checks,
        "ok": all(checks.values()),
    }


def run_soak(args) -> dict:
    target = start_target(args)
    try:
        tally = Outcomes()
        warm = asyncio.run(drive(target, args, tally))
        idle = wait_idle(target.url)
        out = report(tally, warm, resources(target.pids), idle, args.duration)
        out["faults"] = target.faults
        return out
    finally:
        target.stop()


def main(args: argparse.Namespace) -> None:
    out = run_soak(args)
    text = json.dumps(out, indent=2)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    print(text)
    sys.exit(0 if out["ok"] else 1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--duration", type=float, default=1200.0, help="seconds of traffic (default 1200)"
    )
    add_target_arguments(p)
    p.add_argument("--concurrency", type=int, default=16, help="clients at once (default 16)")
    p.add_argument(
        "--disconnect-share",
        type=float,
        default=0.15,
        help="share of requests whose client leaves mid-stream or mid-response (default 0.15)",
    )
    p.add_argument(
        "--malformed-share",
        type=float,
        default=0.1,
        help="share of malformed requests (default 0.1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic mix (default 0)")
    p.add_argument("--output", default=None, help="also write the JSON report here")
