"""How the course shows what it measured: the run folder's ``results.json``, text tables, charts and ipywidgets."""

import html
import json
import os
import pathlib
from typing import Callable

import numpy as np

from ..backend import V5E_BYTES_PER_S
from ..chat import Chat
from ..generate import StepStreamer


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain-text table of dict rows (columns: every key seen, in order of first use)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [columns] + [[_fmt(r.get(c)) for c in columns] for r in rows]  # the header first
    widths = [max(map(len, column)) for column in zip(*cells)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def fmt_bytes(n: int | None) -> str:
    """Bytes for a reader: 1,321,205,760 B -> '1.32 GB' (decimal units, as the source uses)."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


RUN_DIR_VAR = "HELPERS_RUN_DIR"
# the run folder on Google Drive once mounted at Colab's usual place (drive.mount("/content/drive"))
DRIVE_RUNS = "/content/drive/MyDrive/gemma4-on-tpu/runs"


def run_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The run folder: ``$HELPERS_RUN_DIR``, else ``DRIVE_RUNS`` if mounted (fresh Colab runtimes), else runs/latest."""
    drive = pathlib.Path(DRIVE_RUNS)
    default = drive if drive.parent.parent.is_dir() else pathlib.Path("runs/latest")
    folder = pathlib.Path(path or os.environ.get(RUN_DIR_VAR) or default)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def update_json(path: pathlib.Path, change: Callable, empty=dict):
    """``change`` a run's JSON file, locked (notebooks run side by side), swapped in whole (no half file if killed)."""
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        value = change(json.loads(path.read_text()) if path.exists() else empty())
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value, indent=1))
        tmp.replace(path)
    return value


class Results:
    """The series' results table: a row per (step, label) in ``results.json``; a rerun replaces its row."""

    def __init__(self, folder: str | os.PathLike | None = None):
        self.path = run_dir(folder) / "results.json"

    def rows(self) -> list[dict]:
        return json.loads(self.path.read_text()) if self.path.exists() else []

    def add(self, step: str, label: str, **values) -> dict:
        row = {"step": step, "label": label, **values}

        def replace_row(rows: list[dict]) -> list[dict]:
            rows = [r for r in rows if (r["step"], r["label"]) != (step, label)]
            return sorted([*rows, row], key=lambda r: r["step"])

        update_json(self.path, replace_row, empty=list)
        return row

    def table(self, columns: list[str] | None = None) -> str:
        return table(self.rows(), columns)

    def chart(self, value: str, title: str, source: str | None = None, step: str | None = None, log: bool = False):
        """A bar chart of ``value`` (of one ``step`` if given); the ``source`` column is drawn beside only
        if every row is E2B on a TPU: a twin's or a CPU's figures beside it would compare nothing."""
        rows = [r for r in self.rows() if r.get(value) is not None and step in (None, r["step"])]
        beside = bool(source and rows and all(r.get("real_model") and r["backend"] == "tpu" for r in rows))
        models = ", ".join(sorted({str(r.get("model", "?")) for r in rows}))
        backends = ", ".join(sorted({r["backend"] for r in rows}))
        fig, ax = _subplots(figsize=(max(4, 1.6 * len(rows)), 3.8))
        xs, width = np.arange(len(rows)), 0.4 if beside else 0.8
        shift = width / 2 if beside else 0
        ax.bar(xs - shift, [r[value] for r in rows], width, label="this run")
        if beside:
            ax.bar(xs + shift, [r.get(source) or 0 for r in rows], width, label="source (TPU v5e-1)", color="tab:gray")
            ax.legend()
        ax.set_xticks(xs, [f"{r['step']}\n{r['label']}" for r in rows], fontsize=8)
        ax.set(ylabel=value, yscale="log" if log else "linear")
        apart = "" if beside or not source else "; the source's TPU figures are in the table, not beside these"
        ax.set_title(f"{title}\n{models} on {backends}, run {self.path.parent.name}{apart}", fontsize=9)
        fig.tight_layout()
        fig.savefig(self.path.parent / f"{value}{'_' + step.split()[0] if step else ''}.png", dpi=100)
        return fig


def _subplots(*args, **kwargs):
    """``plt.subplots``: matplotlib is imported when a chart is drawn, not with the course."""
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def stacked_bars(bars: dict[str, dict[str, float]], title: str, ylabel: str = "GB", scale: float = 1e9):
    """One stacked bar per label, one segment per component: where the bytes go."""
    fig, ax = _subplots(figsize=(max(4, 1.8 * len(bars)), 3.5))
    bottoms = [0.0] * len(bars)
    for component in dict.fromkeys(c for parts in bars.values() for c in parts):  # in order of first use
        heights = [parts.get(component, 0) / scale for parts in bars.values()]
        ax.bar(list(bars), heights, bottom=bottoms, label=component)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    return fig


def step_plot(series: dict[str, list[float]], title: str, counts: dict[str, list[int]] | None = None):
    """Seconds per step, a line per series (log scale: compiles dwarf warm steps); below, what each step compiled."""
    rows = 2 if counts else 1
    fig, axes = _subplots(rows, 1, figsize=(7, 3 * rows), sharex=True, squeeze=False)
    for label, seconds in series.items():
        axes[0, 0].plot(range(len(seconds)), seconds, marker="o", label=label)
    axes[0, 0].set(yscale="log", ylabel="seconds per step", title=title)
    axes[0, 0].legend(fontsize=8)
    if counts:
        width = 0.8 / len(counts)
        for i, (label, values) in enumerate(counts.items()):
            axes[1, 0].bar([x + i * width for x in range(len(values))], values, width, label=label)
        axes[1, 0].set_ylabel("programs compiled")
        axes[1, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("step (0 = prefill)")
    fig.tight_layout()
    return fig


def ceiling_chart(figures: list[dict], measured: dict[str, float], peer: tuple[str, float]):
    """Computed ceiling tok/s by step, the source's measured tok/s beside, and a peer's figure as a line."""
    fig, ax = _subplots(figsize=(8, 3.8))
    ys = range(len(figures))
    ceiling = f"ceiling at {V5E_BYTES_PER_S / 1e9:.0f} GB/s (computed)"
    ax.barh(list(ys), [f["ceiling_tok_s"] for f in figures], 0.4, label=ceiling)
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
    fig, axes = _subplots(1, 2, figsize=(10, 3.6))
    for ax, key, unit in ((axes[0], "decode_tok_s", "decode tokens/s"), (axes[1], "pct_of_bw", "% of read bandwidth")):
        ax.barh([r["variant"] for r in rows], [r[key] for r in rows])
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
    fig, axes = _subplots(1, 2, figsize=(9, 3.5))
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
        ax.set(xlabel="prompt length (tokens)" if what == "prefill s" else "context (tokens)", ylabel=unit)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def text_widget():
    """An ipywidgets HTML box, shown in the notebook, for ``StepStreamer`` to write into."""
    import ipywidgets  # a notebook's: the rest of the report imports no widget toolkit
    from IPython.display import display

    widget = ipywidgets.HTML()
    display(widget)
    return widget


def chat_widget(chat: Chat):
    """An ipywidgets chat on ``chat``: replies stream at live tok/s, then context and cache bytes
    (``.submit(text)`` sends as the button does, for scripts)."""
    import ipywidgets as w
    from IPython.display import display

    log, live = w.HTML(), w.HTML()
    box = w.Text(placeholder="a message, then Enter", continuous_update=False, layout=w.Layout(width="70%"))
    send = w.Button(description="Send")

    def submit(text: str) -> None:
        text = text.strip()
        if not text:
            return
        box.disabled = send.disabled = True
        try:
            streamer = StepStreamer(chat.tokenizer, chat.decoder.backend, widget=live)
            reply = chat.say(text, streamer)
            status = chat.status()
            rate = f"{streamer.tok_s:.1f} tok/s · " if streamer.tok_s else ""
            log.value += (
                f"<p><b>you:</b> {html.escape(text)}<br><b>model:</b> {html.escape(reply)}<br><small>{rate}"
                f"context {status['context']} of {status['max_len']} positions · cache "
                f"{fmt_bytes(status['cache_bytes'])}</small></p>"
            )
            live.value = ""
        except ValueError as err:  # the conversation would pass the cache: said, not raised into the widget
            live.value = f"<b>{html.escape(str(err))}</b>"
        finally:
            box.disabled = send.disabled = False

    def on_enter(change):
        if change["new"]:
            box.value = ""  # fires again with "", which submit ignores
            submit(change["new"])

    box.observe(on_enter, "value")
    send.on_click(lambda _: on_enter({"new": box.value}))
    ui = w.VBox([log, live, w.HBox([box, send])])
    ui.submit = submit
    display(ui)
    return ui
