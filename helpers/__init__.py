"""The course's toolbox: each notebook opens one drawer of it.

Importing this package is cheap and safe on any machine: it imports no torch, torch_tpu or
torch_xla by itself; names are loaded from their modules on first use.
"""

import importlib
import importlib.util
import os

from .chips import TPU_PCI_DEVICES, tpu_chips, tpu_scan  # noqa: F401  (cheap: no torch)

if not tpu_chips():
    # Without a TPU, a libtpu client would query the cloud metadata server for minutes, and
    # an installed torch_tpu would be loaded by `import torch` itself: switch both off.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if importlib.util.find_spec("torch_tpu") is not None:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def add_to_class(cls):
    """Add the decorated function to ``cls`` as a method (d2l's ``add_to_class``): a notebook writes a class over
    several short cells, and its module holds the class whole."""

    def add(function):  # a function, or a property (named by its getter)
        setattr(cls, getattr(function, "fget", function).__name__, function)
        return function

    return add


_EXPORTS = {
    "install_missing": "course.setup",
    "BackendError": "backend",
    "get_backend": "backend",
    "op_stack": "modes",
    "compare_modes": "modes",
    "shape_demo": "modes",
    "time_fn": "timing",
    "Results": "course.report",
    "run_dir": "course.report",
    "choose_checkpoint": "course.hub",
    "build_tiny_twin": "course.offline",
}


_MODULES = {
    "backend",
    "chat",
    "checkpoint",
    "chips",
    "course",
    "decode",
    "draft",
    "fused",
    "generate",
    "int4",
    "modes",
    "packed",
    "qlinear",
    "qtable",
    "ring",
    "roofline",
    "sampling",
    "timing",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS.keys() | _MODULES | {"add_to_class", "tpu_chips", "tpu_scan"})
