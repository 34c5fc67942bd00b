"""The course's toolbox: each notebook opens one drawer of it.

Importing this package is cheap and safe on any machine: it imports no torch, torch_tpu or
torch_xla by itself; names are loaded from their modules on first use.
"""

import glob
import importlib
import importlib.util
import os

GOOGLE_PCI_VENDOR = "0x1ae0"
# TPU chips by PCI device id (as Google's tpu-info reads them). The vendor id alone is not a
# TPU: Google's gVNIC network card (device 0x0042) reports it too.
TPU_PCI_DEVICES = {
    "0x0027": "v2/v3",
    "0x0056": "v4 lite",
    "0x005e": "v4",
    "0x0062": "v5p",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0076": "7x",
}


def tpu_chips(root: str = "/sys/bus/pci/devices") -> list[str]:
    """The TPU chips on this machine's PCI bus, by kind (``["v5e"]`` on a Colab v5e-1), read
    from sysfs without touching any TPU client."""
    chips = []
    for device in sorted(glob.glob(os.path.join(root, "*"))):
        try:
            with open(os.path.join(device, "vendor")) as v, open(os.path.join(device, "device")) as d:
                vendor, device_id = v.read().strip(), d.read().strip()
        except OSError:
            continue
        if vendor == GOOGLE_PCI_VENDOR and device_id in TPU_PCI_DEVICES:
            chips.append(TPU_PCI_DEVICES[device_id])
    return chips


if not tpu_chips():
    # Without a TPU, a libtpu client would query the cloud metadata server for minutes, and
    # an installed torch_tpu would be loaded by `import torch` itself: switch both off.
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    if importlib.util.find_spec("torch_tpu") is not None:
        os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")


def show(*functions) -> None:
    """Print the source of each function or class: the lines a lesson teaches, read from the
    module that runs them (so what is on screen is the code, not a copy of it)."""
    import inspect

    print("\n".join(inspect.getsource(f) for f in functions))


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
    "choose_checkpoint": "hub",
    "build_tiny_twin": "twin",
}


_MODULES = {
    "backend",
    "bench",
    "chat",
    "checkpoint",
    "course",
    "decode",
    "e2b",
    "fused",
    "generate",
    "hub",
    "modes",
    "packed",
    "qlinear",
    "qtable",
    "ring",
    "roofline",
    "sampling",
    "series",
    "setup",
    "tour",
    "twin",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    if name in _MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS.keys() | _MODULES | {"show", "tpu_chips"})
