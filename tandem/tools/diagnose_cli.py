"""`tandem diagnose`: a run's records -> the three layers of tail latency (queueing, step
time, transfers) and the fragmentation verdict, each with its figures (workload/diagnose.py).

Reads a request log (`tandem serve --request-log`), a step trace (`--step-trace`) and/or a
`tandem bench serve --save-result` result; a file that is empty, truncated or of another kind is an
error naming the file and the line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.bench.steps import read_steps
from tandem.workload.diagnose import Layer, diagnose, two_clusters
from tandem.workload.traces import read_request_log


def request_splits(path: Path) -> list[tuple[float, float]]:
    """(queue, e2e) seconds per request of a server request log."""
    if not path.is_file():
        raise FileNotFoundError(f"request log {path} not found")
    rows, bad = read_request_log(path)
    if bad:
        raise ValueError(
            f"{path}:{bad[0]['line']}: {bad[0]['error']}; "
            "is this a `tandem serve --request-log` file?"
        )
    if not rows:
        raise ValueError(f"{path}: holds no requests (empty)")
    missing = next((r.line for r in rows if r.queue_time is None or r.e2e is None), None)
    if missing is not None:
        raise ValueError(f"{path}:{missing}: no queue_time / e2e_latency: not a tandem request log")
    return [(r.queue_time, r.e2e) for r in rows]


def bench_run(path: Path) -> tuple[list[tuple[float, float]], dict | None]:
    """(queue, e2e) per successful request with a server latency split, and the server's
    counters."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg}); a truncated file?") from None
    reqs = data.get("results", {}).get("requests") if isinstance(data, dict) else None
    if not isinstance(reqs, list):
        raise ValueError(
            f"{path}:1: not a `tandem bench serve --save-result` result (no results.requests)"
        )
    splits = [
        (r["metrics"]["queue_time"], r["e2e"])
        for r in reqs
        if r.get("success")
        and isinstance(r.get("metrics"), dict)
        and r["metrics"].get("queue_time") is not None
    ]
    return splits, data["results"].get("server_counters")


def _figures(figs: dict) -> str:
    parts = []
    for k, v in figs.items():
        if isinstance(v, float):
            v = f"{v:.1%}" if "share" in k else f"{v:,.2f}"
        elif isinstance(v, list):
            v = "; ".join(
                ", ".join(
                    f"{a} {b:.3g}" if isinstance(b, float) else f"{a} {b}" for a, b in c.items()
                )
                for c in v
            )
        parts.append(f"{k} {v}")
    return ", ".join(parts)


def write_plots(folder: Path, splits: list[tuple[float, float]], steps: list[dict]) -> list[str]:
    """queue_share.png (per-request queue share), step_times.png (histogram, log scale, the
    cluster threshold), kv_free_waiting.png (free KV and waiting requests over the run)."""
    from tandem.workload.plots import pyplot, save_figure

    plt = pyplot()
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    if splits:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist([q / e for q, e in splits if e > 0], bins=40, range=(0, 1))
        ax.axvline(0.4, color="red", ls="--", label="40%: scheduling problem")
        ax.set(
            xlabel="queue time / end-to-end latency",
            ylabel="requests",
            title="Queueing share per request",
        )
        ax.legend()
        paths.append(folder / "queue_share.png")
        save_figure(fig, paths[-1], 90)
    if steps:
        import numpy as np

        ms = np.array([s["seconds"] * 1e3 for s in steps])
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.hist(ms, bins=np.geomspace(max(ms.min(), 1e-3), ms.max() * 1.01 + 1e-3, 50))
        ax.axvline(two_clusters(list(ms))[0], color="red", ls="--", label="cluster threshold")
        ax.set(
            xscale="log", xlabel="step time (ms)", ylabel="steps", title="Step-time distribution"
        )
        ax.legend()
        paths.append(folder / "step_times.png")
        save_figure(fig, paths[-1], 90)
        if "kv_free_blocks" in steps[0]:
            t0 = steps[0]["start"]
            t = [s["start"] - t0 for s in steps]
            fig, ax = plt.subplots(figsize=(7, 3.5))
            ax.plot(
                t,
                [s["kv_free_blocks"] / s["kv_total_blocks"] for s in steps],
                label="KV free (share)",
            )
            ax.set(
                xlabel="seconds",
                ylabel="KV free",
                ylim=(0, 1),
                title="Free KV and waiting requests",
            )
            ax2 = ax.twinx()
            ax2.plot(t, [s["waiting"] for s in steps], color="tab:orange", label="waiting")
            ax2.set_ylabel("waiting requests")
            fig.legend(loc="upper right")
            paths.append(folder / "kv_free_waiting.png")
            save_figure(fig, paths[-1], 90)
    return [str(p) for p in paths]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--requests", type=Path, default=None, help="a `tandem serve --request-log` file"
    )
    p.add_argument("--steps", type=Path, default=None, help="a `tandem serve --step-trace` file")
    p.add_argument(
        "--bench", type=Path, default=None, help="a `tandem bench serve --save-result` result"
    )
    p.add_argument(
        "--plot", dest="plot_dir", type=Path, default=None, help="write the figures (PNG) here"
    )
    p.add_argument(
        "--json", dest="json_path", default=None, help="write the layers and figures here"
    )


def main(args: argparse.Namespace) -> list[Layer]:
    if not (args.requests or args.steps or args.bench):
        raise ValueError("give at least one of --requests LOG, --steps TRACE, --bench JSON")
    splits = request_splits(args.requests) if args.requests else []
    counters = None
    if args.bench:
        bench_splits, counters = bench_run(args.bench)
        splits = (
            splits or bench_splits
        )  # the server's log has every request; the bench JSON, its own
    steps = read_steps(args.steps) if args.steps else []
    layers = diagnose(splits, steps, counters)
    for i, layer in enumerate(layers, 1):
        print(f"{i}. {layer.name}: {layer.verdict}")
        if layer.figures:
            print(f"   {_figures(layer.figures)}")
    out = {
        "layers": [
            {"name": x.name, "verdict": x.verdict, "flagged": x.flagged, "figures": x.figures}
            for x in layers
        ]
    }
    if args.plot_dir:
        out["plots"] = write_plots(args.plot_dir, splits, steps)
        print("plots: " + ", ".join(out["plots"]))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(out, indent=1))
    return layers
