"""The course's bookkeeping, above the lessons, which never import it: series, rows, tour, charts, sources, set-up,
Hub policy, twin, synthetic checkpoint, verdict, audits. Modules load on first use."""

import importlib

_MODULES = {
    "audits",
    "charts",
    "e2b",
    "hub",
    "measure",
    "programs",
    "publish",
    "results",
    "series",
    "setup",
    "sources",
    "steps",
    "synthetic",
    "tables",
    "tour",
    "tpu",
    "twin",
    "twin_assistant",
    "verdict",
    "widgets",
}


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_MODULES)
