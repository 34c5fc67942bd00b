"""The course's bookkeeping, above the lessons: the series and its rows, the tour, charts,
sources, the install plan, the Hub policy, the twin and synthetic builders, the verdict and the
audits. It imports the lessons; no lesson imports it. Modules load on first use."""

import importlib

_MODULES = {
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
    "tour",
    "tpu",
    "twin",
    "verdict",
}


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_MODULES)
