"""The PNG plots of `tandem bench serve` runs, one line per run on each."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def write_plots(folder: Path, runs: list[dict]) -> list[str]:
    """TTFT CDF, ITL CDF, output tokens/s over time, requests in flight over time
    (one line per run)."""
    from tandem.workload.plots import pyplot, save_figure

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(name: str, title: str, xlabel: str, ylabel: str, draw) -> None:
        fig, ax = plt.subplots(figsize=(7, 4))
        for i, run in enumerate(runs):
            draw(
                ax,
                [r for r in run["_raw"] if r["success"]],
                {**run, "label": f"{i + 1}: {run['base_url']}"},
            )
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, folder / name, 100)
        paths.append(str(folder / name))

    def cdf(values):
        return lambda ax, ok, run: ax.plot(
            np.sort(values(ok)) * 1000, np.linspace(0, 1, len(values(ok))), label=run["label"]
        )

    def throughput(ax, ok, run):
        dur = run["summary"]["duration_s"]
        width = max(0.05, dur / 60)
        times = [r["start"] + t for r in ok for t in r["chunk_times"]]
        weights = [r["output_tokens"] / r["num_chunks"] for r in ok for _ in r["chunk_times"]]
        hist, edges = np.histogram(
            times, bins=max(1, math.ceil(dur / width)), range=(0, max(dur, width)), weights=weights
        )
        ax.step(edges[:-1], hist / (edges[1] - edges[0]), where="post", label=run["label"])

    def inflight(ax, ok, run):
        events = sorted(
            [(r["start"], 1) for r in run["_raw"]] + [(r["end"], -1) for r in run["_raw"]]
        )
        ax.step(
            [0.0] + [t for t, _ in events],
            np.cumsum([0] + [d for _, d in events]),
            where="post",
            label=run["label"],
        )

    save(
        "ttft_cdf.png",
        "TTFT CDF",
        "TTFT (ms)",
        "fraction of requests",
        cdf(lambda ok: [r["ttft"] for r in ok]),
    )
    save(
        "itl_cdf.png",
        "ITL CDF",
        "inter-token latency (ms)",
        "fraction of gaps",
        cdf(lambda ok: [g for r in ok for g in r["itl"]]),
    )
    save("throughput.png", "output throughput", "time (s)", "output tokens/s", throughput)
    save("inflight.png", "requests in flight", "time (s)", "requests", inflight)
    return paths
