"""The series' charts: device bytes by component, per-step times, roofline ceilings beside what was
measured, notebook 06's context sweep, notebook 07's variants, and the results table's closing charts."""

from __future__ import annotations

import os

from .results import Results


def stacked_bars(
    bars: dict[str, dict[str, float]],
    title: str,
    ylabel: str = "GB",
    scale: float = 1e9,
    path: str | os.PathLike | None = None,
):
    """One stacked bar per label, one segment per component: where the bytes go."""
    import matplotlib.pyplot as plt

    components = list(dict.fromkeys(c for parts in bars.values() for c in parts))
    fig, ax = plt.subplots(figsize=(max(4, 1.8 * len(bars)), 3.5))
    bottoms = [0.0] * len(bars)
    for component in components:
        heights = [parts.get(component, 0) / scale for parts in bars.values()]
        ax.bar(list(bars), heights, bottom=bottoms, label=component)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def step_plot(
    series: dict[str, list[float]],
    title: str,
    counts: dict[str, list[int]] | None = None,
    path: str | os.PathLike | None = None,
):
    """Seconds per step, a line per series (log scale: compile spikes and warm steps differ by orders
    of magnitude); below it, what each step compiled."""
    import matplotlib.pyplot as plt

    rows = 2 if counts else 1
    fig, axes = plt.subplots(rows, 1, figsize=(7, 3 * rows), sharex=True, squeeze=False)
    for label, seconds in series.items():
        axes[0, 0].plot(range(len(seconds)), seconds, marker="o", label=label)
    axes[0, 0].set_yscale("log")
    axes[0, 0].set_ylabel("seconds per step")
    axes[0, 0].set_title(title)
    axes[0, 0].legend(fontsize=8)
    if counts:
        width = 0.8 / len(counts)
        for i, (label, values) in enumerate(counts.items()):
            axes[1, 0].bar([x + i * width for x in range(len(values))], values, width, label=label)
        axes[1, 0].set_ylabel("programs compiled")
        axes[1, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("step (0 = prefill)")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=100)
    return fig


def ceiling_chart(figures: list[dict], measured: dict[str, float], peer: tuple[str, float]):
    """Computed ceiling tok/s by step, the source's measured tok/s beside, and a peer's figure as a line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    ys = range(len(figures))
    ax.barh(list(ys), [f["ceiling_tok_s"] for f in figures], 0.4, label="ceiling at 819 GB/s (computed)")
    marked = [(y, measured[f["step"]]) for y, f in zip(ys, figures) if f["step"] in measured]
    ax.barh([y + 0.4 for y, _ in marked], [v for _, v in marked], 0.4, color="tab:gray", label="source, measured")
    ax.axvline(peer[1], color="tab:red", linestyle="--", label=f"{peer[0]}: {peer[1]} tok/s (its own figure)")
    ax.set_yticks([y + 0.2 for y in ys], [f["step"] for f in figures], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s, E2B on a TPU v5e-1")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def variant_chart(rows: list[dict], title: str):
    """Decode tok/s and % of the read bandwidth, side by side, one bar per variant."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    labels = [r["variant"] for r in rows]
    for ax, key, unit in ((axes[0], "decode_tok_s", "decode tokens/s"), (axes[1], "pct_of_bw", "% of read bandwidth")):
        ax.barh(labels, [r[key] for r in rows])
        ax.invert_yaxis()
        ax.set_xlabel(unit)
        ax.tick_params(axis="y", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def closing_charts(results: Results):
    """Decode tok/s beside the source's, device bytes, bytes read per token and % of read bandwidth, for every step."""
    return (
        results.chart("decode_tok_s", "decode tokens/s, all steps", source="source_tok_s"),
        results.chart("device_bytes", "weights + KV cache on the device (bytes, from the tensors)"),
        results.chart("bytes_per_token", "bytes read per token made (09: a call's reads over the tokens it keeps)"),
        results.chart("pct_of_bw", "% of this device's read bandwidth (bytes per token x tok/s)"),
    )


def plot_sweep(rows: list[dict], title: str):
    """Prefill time against prompt length and decode ms/token against context, a line per cache."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    x = [r["context"] for r in rows]
    labels = {
        "ring": "ring, one buffer length, compiled",
        "buckets": "ring, length buckets, compiled",
        "HF": "HF default cache, eager",
    }
    for ax, what, unit in ((axes[0], "prefill s", "prefill (s)"), (axes[1], "ms/token", "decode (ms per token)")):
        for cache, label in labels.items():
            if f"{cache} {what}" in rows[0]:
                ax.plot(x, [r[f"{cache} {what}"] for r in rows], "o-", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)" if what == "prefill s" else "context (tokens)")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
