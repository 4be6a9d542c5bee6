"""/dashboard in headless Chromium (Debian's `chromium`) against live servers under load: the
page renders, its charts fill and keep updating, for `tandem serve` and for the router of a
P/D cluster; with an API key the page asks for it and the data endpoint serves nothing
without it. Skipped, with the reason, where no chromium is installed (`apt-get install
chromium`). TANDEM_DASHBOARD_SCREENSHOTS=DIR also writes a screenshot of each page there."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
from cluster_fixture import tiny_cluster
from server_fixture import running_server

from tandem.config import EngineConfig
from tandem.server.api_server import ServerConfig

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)"
)
SERVER_CHARTS = ("requests", "kv", "prefix", "latency", "itl", "throughput", "preemptions")


def chromium(url: str, budget_ms: int = 5000, screenshot: str | None = None) -> str:
    """Load `url` in headless Chromium, let its timers run `budget_ms` of virtual time, and
    return the DOM then (or write a screenshot)."""
    out = f"--screenshot={screenshot}" if screenshot else "--dump-dom"
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--window-size=1400,1150",
        f"--virtual-time-budget={budget_ms}",
        out,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


def points(dom: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r'id="chart-(\w+)"[^>]*data-points="(\d+)"', dom)}


def updates(dom: str) -> int:
    m = re.search(r'id="status" data-updates="(\d+)"', dom)
    return int(m[1]) if m else 0


@contextmanager
def load(url: str, prompt_of, stop_after: float = 60.0):
    """Requests sent back to back from two threads (a shared prefix, so the cache hits) while the
    block runs."""
    done, sent = threading.Event(), []

    def client(k: int) -> None:
        with httpx.Client(timeout=30) as c:
            t0 = time.time()
            while not done.is_set() and time.time() - t0 < stop_after:
                r = c.post(
                    url + "/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": prompt_of(len(sent) + k),
                        "max_tokens": 24,
                        "ignore_eos": True,
                    },
                )
                sent.append(r.status_code)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    try:
        while len(sent) < 4:
            time.sleep(0.05)
        yield sent
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)


def watch(url: str, seconds: float = 3.0, headers: dict | None = None) -> None:
    """Poll /dashboard/data in real time, as an open page does (Chromium's virtual time runs
    the page's own timers much faster than the server's clock, whose samples it rate-limits)."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        assert httpx.get(url + "/dashboard/data", headers=headers or {}).status_code == 200
        time.sleep(0.6)


def screenshot(url: str, name: str) -> None:
    folder = os.environ.get("TANDEM_DASHBOARD_SCREENSHOTS")
    if folder:
        chromium(url, 6000, os.path.join(folder, name))


def shared_prefix(i: int) -> list[int]:
    return list(range(1, 97)) + [100 + i % 50, 7, 8]


@pytest.mark.slow  # a browser watching a server under load: ~13 s
@needs_chromium
def test_server_dashboard_charts_fill_under_load(tiny_model_dirs):
    engine = EngineConfig.from_kwargs(
        model=tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 22, num_threads=1
    )
    with (
        running_server(engine, ServerConfig(model_name="tiny")) as (url, _),
        load(url, shared_prefix) as sent,
    ):
        watch(url)
        first = chromium(url + "/dashboard")
        watch(url)
        second = chromium(url + "/dashboard")
        screenshot(url + "/dashboard", "dashboard_server.png")
    assert all(s == 200 for s in sent)
    p1, p2 = points(first), points(second)
    assert set(SERVER_CHARTS) <= p1.keys() and "transfers" not in p1
    assert all(p1[c] > 0 for c in SERVER_CHARTS), p1
    assert (
        updates(first) >= 2
    )  # it polls, and the charts grow: the second page sees the first page's points too
    assert all(p2[c] > p1[c] for c in ("requests", "kv", "latency", "throughput")), (p1, p2)
    tiles = dict((v, k) for k, v in re.findall(r"<b>([^<]*)</b><span>([^<]*)</span>", second))
    ttft = next(v for k, v in tiles.items() if k.startswith("TTFT p50 / p99 ms (last "))
    hit = next(v for k, v in tiles.items() if k.startswith("prefix hit (last "))
    assert ttft != "- / -" and hit not in ("-", "0.0%")


@needs_chromium
def test_dashboard_with_an_api_key_asks_for_it_and_serves_nothing_without(tiny_model_dirs):
    engine = EngineConfig.from_kwargs(
        model=tiny_model_dirs["llama"], dtype="float32", kv_cache_memory=1 << 22, num_threads=1
    )
    with running_server(engine, ServerConfig(model_name="tiny", api_key="sesame")) as (url, _):
        r = httpx.get(url + "/dashboard/data")
        assert r.status_code == 401 and "tandem:" not in r.text and "kv_usage" not in r.text
        assert (
            httpx.get(
                url + "/dashboard/data", headers={"Authorization": "Bearer wrong"}
            ).status_code
            == 401
        )
        assert (
            httpx.get(
                url + "/dashboard/data", headers={"Authorization": "Bearer sesame"}
            ).status_code
            == 200
        )
        locked = chromium(url + "/dashboard", budget_ms=2000)
        watch(url, 1.5, {"Authorization": "Bearer sesame"})
        opened = chromium(url + "/dashboard#key=sesame", budget_ms=3000)
    assert (
        '<form id="auth">' in locked and '<main id="main" hidden="">' in locked
    )  # the form shows, the figures do not
    assert "API key needed" in locked and not points(locked) and '<div class="tile">' not in locked
    assert updates(opened) >= 1 and points(opened)["kv"] > 0


@needs_chromium
def test_router_dashboard_shows_instances_and_pd_transfers(tiny_model_dirs):
    with (
        tiny_cluster(tiny_model_dirs["llama"], roles=["prefill", "decode"]) as (url, _, _insts),
        load(url, lambda i: list(range(1, 300)) + [300 + i]) as sent,
    ):  # over 256 tokens: a P/D handoff each
        watch(url)
        dom = chromium(url + "/dashboard", budget_ms=6000)
        screenshot(url + "/dashboard", "dashboard_router.png")
    assert sent and all(s == 200 for s in sent)
    p = points(dom)
    assert p["transfers"] > 0 and p["requests"] > 0 and p["latency"] > 0, p
    table = re.search(r'<table id="instances">(.*?)</table>', dom, re.S)[1]
    assert table.count("<tr>") == 3 and ">prefill<" in table and ">decode<" in table
    rows = re.search(r'<table id="models">(.*?)</table>', dom, re.S)[
        1
    ]  # one row per model, with its figures
    assert rows.count("<tr>") == 2 and "<td>tiny</td>" in rows
    tiles = dict((v, k) for k, v in re.findall(r"<b>([^<]*)</b><span>([^<]*)</span>", dom))
    assert not tiles["P/D KV transfers"].startswith("0,")


def test_quantile_interpolates_within_buckets_as_promql_does():
    from tandem.server.dashboard_data import quantile

    buckets = {0.1: 5.0, 0.2: 10.0, float("inf"): 10.0}
    assert quantile(0.5, buckets) == 0.1 and abs(quantile(0.75, buckets) - 0.15) < 1e-12
    assert (
        quantile(0.99, {0.1: 0.0, 0.2: 1.0, float("inf"): 4.0}) == 0.2
    )  # past the last bound: that bound
    assert quantile(0.5, {0.1: 0.0, float("inf"): 0.0}) is None


def test_series_percentiles_and_rates_cover_the_window_only():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from tandem.server.dashboard_data import DashboardSeries

    reg = CollectorRegistry()
    ttft = Histogram(
        "tandem:time_to_first_token_seconds", "", ["level"], buckets=(0.1, 1.0, 10.0), registry=reg
    )
    tokens = Counter("tandem:generation_tokens", "", registry=reg)
    series = DashboardSeries()
    for _ in range(10):
        ttft.labels("L1").observe(5.0)  # slow, long ago
    series.add(generate_latest(reg).decode(), now=0.0)
    assert (
        series.add(generate_latest(reg).decode(), now=0.2) is series.points[-1]
    )  # too soon: the same point
    for _ in range(10):
        ttft.labels("L2").observe(0.05)  # fast, within the last minute
    tokens.inc(300)
    series.add(generate_latest(reg).decode(), now=70.0)
    tokens.inc(100)
    p = series.add(generate_latest(reg).decode(), now=80.0)
    # the window starts at the newest sample at least a minute old (t=0): only the fast ones count
    assert p["window_s"] == 80.0 and p["ttft_p99_ms"] < 100
    assert (
        abs(p["output_tok_s"] - 100 / 10) < 1e-9
    )  # over the last RATE_S (from the sample at t=70)
    assert len(series.series()["t"]) == 3
