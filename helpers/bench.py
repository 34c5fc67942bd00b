"""Honest timing (device synced, warmed up, median of repeats) and the series' results table."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import statistics
import time
from collections.abc import Mapping
from typing import Callable

from tqdm.auto import tqdm

RUN_DIR_VAR = "HELPERS_RUN_DIR"
# the run folder on Google Drive once mounted at Colab's usual place (drive.mount("/content/drive"))
DRIVE_RUNS = "/content/drive/MyDrive/gemma4-on-tpu/runs"


@dataclasses.dataclass
class Timing:
    """Seconds per call over the timed repeats, and the last call's output."""

    times: list[float]
    last: object = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    def __str__(self) -> str:
        return f"{self.median * 1e3:.3f} ms (min {self.min * 1e3:.3f}, max {self.max * 1e3:.3f}, n={len(self.times)})"


def host_read(out) -> None:
    """Bring one number of ``out`` (its first tensor's last element; a list of ints is on the host
    already) to the host. A timed call ends only when its result is there: a device's synchronize
    alone may return before compiled work ran (TorchTPU's did, before torch_tpu#2494: a compiled
    op timed at 0.1 ms against 89 ms, pytorch/helion#3155), and a lazy backend computes nothing
    that is never read."""
    if isinstance(out, Mapping):  # a model's output: its logits
        out = list(out.values())
    if isinstance(out, (list, tuple)):  # a step's (token, position): the token
        out = next((o for o in out if hasattr(o, "tolist")), None)
    if hasattr(out, "tolist"):
        out.reshape(-1)[-1:].tolist()


def time_fn(
    fn: Callable, *args, sync: Callable[[], None], warmup: int = 2, repeats: int = 10, desc: str | None = None, **kwargs
) -> Timing:
    """Time ``fn(*args, **kwargs)``: ``warmup`` untimed calls, then ``repeats`` timed ones, each
    ending on a host read of its output (``host_read``) and ``sync``, which waits for the rest of
    the device's queue (``backend.sync``): an asynchronous device returns before the work is done."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        out = fn(*args, **kwargs)
        host_read(out)
        sync()
    times = []
    for _ in tqdm(range(repeats), desc=desc, disable=desc is None, leave=False):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        host_read(out)
        sync()
        times.append(time.perf_counter() - start)
    return Timing(times, out)


def time_fed(step: Callable, state: tuple, *, sync: Callable[[], None], repeats: int, warmup: int = 0) -> Timing:
    """``time_fn`` for a step fed its own output, as a decode step is fed its last token and
    position: each call is ``state = step(*state)``."""
    box = [state]

    def fed():
        box[0] = step(*box[0])
        return box[0]

    return time_fn(fed, sync=sync, warmup=warmup, repeats=repeats)


def host_peak_bytes() -> int | None:
    """This process's peak resident host memory since it started or since the last
    ``reset_host_peak()``: Linux's VmHWM (None elsewhere). It counts the pages of a memory-mapped
    checkpoint the process touched, as the kernel does."""
    try:
        status = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return None
    kb = next((line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return kb and int(kb) * 1024


def reset_host_peak() -> None:
    """Start a new peak for ``host_peak_bytes`` from the memory in use now (Linux only): a peak
    per phase, not per process."""
    with contextlib.suppress(OSError):
        pathlib.Path("/proc/self/clear_refs").write_text("5")


def run_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder a run's results, reference tokens and charts go to (made if missing).

    Notebooks of one run share it, so a later notebook can read what an earlier one wrote:
    ``$HELPERS_RUN_DIR`` if set; else, where Google Drive is mounted (Colab gives each notebook
    a fresh runtime and ``/content``), ``DRIVE_RUNS`` on it, so the results table and notebook
    03's tokens carry from one notebook to the next; else ``runs/latest`` beside the notebooks'
    working folder.
    """
    drive = pathlib.Path(DRIVE_RUNS)
    default = drive if drive.parent.parent.is_dir() else pathlib.Path("runs/latest")
    folder = pathlib.Path(path or os.environ.get(RUN_DIR_VAR) or default)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def update_json(path: pathlib.Path, change: Callable, empty=dict):
    """Read a run folder's JSON file, ``change`` it and write it back, under a lock and in one
    step: notebooks run side by side (parallel test workers, two Colab tabs) share the folder,
    and a kernel killed mid-write must not leave half a file. Returns what was written."""
    from filelock import FileLock

    with FileLock(f"{path}.lock"):
        value = change(json.loads(path.read_text()) if path.exists() else empty())
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(value, indent=1))
        tmp.replace(path)
    return value


class Results:
    """The series' results table: one row per (step, label), kept in ``results.json``.

    A rerun of a step replaces its row; rows of other steps are kept.
    """

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
        """A bar chart of ``value`` for every row that has it (of one ``step`` if given), its
        title naming the model, the device and the run (this run folder). ``source`` names a
        column holding the source's own figure (E2B on a TPU v5e-1), drawn beside ours, labelled
        as the source's, only where every row is Google's E2B on a TPU: a twin's or a CPU's
        figures on one axis with the source's would compare nothing. Saved as ``<value>.png`` in
        the run folder."""
        import matplotlib.pyplot as plt

        rows = [r for r in self.rows() if r.get(value) is not None and step in (None, r["step"])]
        labels = [f"{r['step']}\n{r['label']}" for r in rows]
        beside = bool(source and rows and all(r.get("real_model") and r["backend"] == "tpu" for r in rows))
        models = ", ".join(sorted({str(r.get("model", "?")) for r in rows}))
        backends = ", ".join(sorted({r["backend"] for r in rows}))
        fig, ax = plt.subplots(figsize=(max(4, 1.6 * len(rows)), 3.8))
        xs = range(len(rows))
        width = 0.4 if beside else 0.8
        ax.bar([x - width / 2 if beside else x for x in xs], [r[value] for r in rows], width, label="this run")
        if beside:
            ax.bar(
                [x + width / 2 for x in xs],
                [r.get(source) or 0 for r in rows],
                width,
                label="source (TPU v5e-1)",
                color="tab:gray",
            )
            ax.legend()
        ax.set_xticks(list(xs), labels, fontsize=8)
        ax.set_ylabel(value)
        if log:
            ax.set_yscale("log")
        apart = "" if beside or not source else "; the source's TPU figures are in the table, not beside these"
        ax.set_title(f"{title}\n{models} on {backends}, run {self.path.parent.name}{apart}", fontsize=9)
        fig.tight_layout()
        fig.savefig(self.path.parent / f"{value}{'_' + step.split()[0] if step else ''}.png", dpi=100)
        return fig


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    """A plain-text table of dict rows (columns: every key seen, in order of first use)."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def fmt_bytes(n: int | None) -> str:
    """Bytes for a reader: 1,321,205,760 B -> '1.32 GB' (decimal units, as the source uses)."""
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


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
    """Seconds per step against step index, one line per series (log scale: compile spikes
    and warm steps differ by orders of magnitude); below it, what each step compiled."""
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
    """Ceiling tok/s by step (computed), the source's measured tok/s beside the steps it
    measured, and a peer's figure as a line, each labelled with where it comes from."""
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
    """The series' closing charts: decode tok/s of every step beside the source's figures, the
    bytes of weights and cache on the device, and each step's % of the read bandwidth."""
    return (
        results.chart("decode_tok_s", "decode tokens/s, all steps", source="source_tok_s"),
        results.chart("device_bytes", "weights + KV cache on the device (bytes, from the tensors)"),
        results.chart("pct_of_bw", "% of this device's read bandwidth (bytes per token x tok/s)"),
    )
