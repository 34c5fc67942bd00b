"""The series' results table (one row per step and label, kept in the run folder's
``results.json``) and the run folder itself."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Callable

from .tables import table

RUN_DIR_VAR = "HELPERS_RUN_DIR"
# the run folder on Google Drive once mounted at Colab's usual place (drive.mount("/content/drive"))
DRIVE_RUNS = "/content/drive/MyDrive/gemma4-on-tpu/runs"


def run_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder a run's notebooks share: ``$HELPERS_RUN_DIR``, else ``DRIVE_RUNS`` where Drive is
    mounted (Colab gives each notebook a fresh runtime), else ``runs/latest``."""
    drive = pathlib.Path(DRIVE_RUNS)
    default = drive if drive.parent.parent.is_dir() else pathlib.Path("runs/latest")
    folder = pathlib.Path(path or os.environ.get(RUN_DIR_VAR) or default)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def update_json(path: pathlib.Path, change: Callable, empty=dict):
    """``change`` a run folder's JSON file under a lock (notebooks run side by side), replaced in one
    step (a kernel killed mid-write leaves no half file). Returns what was written."""
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
