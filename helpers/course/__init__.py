"""The course's bookkeeping, above the lessons, which never import it, in 12 modules by role: setup, sources, report,
audits, e2b, offline (the twin, its assistant, the synthetic checkpoint), hub, verdict, series, measure, steps, tour.
Modules load on first use."""

import importlib

_MODULES = set("audits e2b hub measure offline report series setup sources steps tour verdict".split())


def __getattr__(name):
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_MODULES)
