"""PNG plots of an analyzer report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a clear error when the plot extra is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install 'tandem[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def write_plots(
    report: dict,
    prompts: np.ndarray,
    outputs: np.ndarray,
    out_dir: Path,
    prefix: str,
    dpi: int = 80,
) -> list[Path]:
    """<prefix>lengths.png, <prefix>rps.png and <prefix>in_flight.png under out_dir."""
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{prefix}{name}.png" for name in ("lengths", "rps", "in_flight")]

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, values, key in zip(axes, (prompts, outputs), ("prompt_tokens", "output_tokens")):
        bins = np.logspace(0, np.log10(max(values.max(), 1) + 1), 50)
        ax.hist(np.maximum(values, 1), bins=bins, color="tab:blue")
        ax.set_xscale("log")
        for q, style in (("p50", "-"), ("p95", "--"), ("p99", ":")):
            ax.axvline(
                report[key][q], color="tab:red", linestyle=style, label=f"{q} {report[key][q]:.0f}"
            )
        ax.set(title=key.replace("_", " "), xlabel="tokens (log)", ylabel="requests")
        ax.legend(fontsize=8)
    save_figure(fig, paths[0], dpi)

    rate = report["rate"]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    edges = np.arange(len(rate["curve_rps"]) + 1) * rate["bin_seconds"] / 60
    ax.stairs(rate["curve_rps"], edges, color="tab:blue")
    ax.axhline(
        rate["peak_rps"], color="tab:red", linestyle="--", label=f"peak {rate['peak_rps']:.2f}"
    )
    ax.axhline(
        rate["trough_rps"],
        color="tab:green",
        linestyle="--",
        label=f"trough {rate['trough_rps']:.2f}",
    )
    ax.set(title=f"requests/s per {rate['bin_seconds']:g} s", xlabel="minutes", ylabel="requests/s")
    ax.legend(fontsize=8)
    save_figure(fig, paths[1], dpi)

    flight = report["in_flight"]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    ax.plot(
        np.arange(len(flight["curve_tokens"])) / 60,
        flight["curve_tokens"],
        color="tab:blue",
        lw=0.8,
    )
    ax.set(
        title=f"tokens in flight (peak {flight['peak_tokens']:,}; KV for {flight['model']})",
        xlabel="minutes",
        ylabel="tokens",
    )
    kv_gib = flight["kv_bytes_per_token"] / 2**30
    right = ax.secondary_yaxis("right", functions=(lambda t: t * kv_gib, lambda g: g / kv_gib))
    right.set_ylabel("KV GiB")
    save_figure(fig, paths[2], dpi)
    return paths
