"""The course's toolbox: each notebook opens one drawer of it.

Importing this package is cheap and safe on any machine: it imports no torch, torch_tpu or
torch_xla by itself; names are loaded from their modules on first use.
"""

import glob
import importlib
import importlib.util
import os


def _tpu_on_pci() -> bool:
    # Google's PCI vendor id: how libtpu itself finds a TPU chip, without touching any client.
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with open(path) as f:
            if f.read().strip() == "0x1ae0":
                return True
    return False


if not _tpu_on_pci():
    # Without a TPU, a libtpu client would query the cloud metadata server for minutes, and
    # an installed torch_tpu would be loaded by `import torch` itself: switch both off.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if importlib.util.find_spec("torch_tpu") is not None:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

_EXPORTS = {
    "install_missing": "setup",
    "BackendError": "backend",
    "get_backend": "backend",
    "op_stack": "modes",
    "compare_modes": "modes",
    "shape_demo": "modes",
    "time_fn": "bench",
    "Results": "bench",
    "run_dir": "bench",
    "choose_checkpoint": "checkpoint",
    "build_tiny_twin": "twin",
}


_MODULES = {"backend", "bench", "checkpoint", "decode", "generate", "modes", "qtable", "ring", "setup", "tour", "twin"}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS.keys() | _MODULES)
