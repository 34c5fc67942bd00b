"""The notebooks' install cell: pip-install only what is missing, TorchTPU on a TPU runtime.

Imports no torch: it may install one, and a torch imported before that would be stale.
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

from . import _tpu_on_pci

REQUIREMENTS = pathlib.Path(__file__).resolve().parent.parent / "requirements.txt"
TORCH_TPU = "torch_tpu==0.2.0"  # pulls libtpu; supports torch 2.11 to 2.15
_TORCH_TPU_TORCH = ((2, 11), (2, 15))
# Kept as the runtime has them: its own torch build, and tools only CI needs.
_NOT_FOR_NOTEBOOKS = {"torch", "jupytext", "nbval", "ipykernel", "pytest", "hypothesis"}


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _pins() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def missing(colab: bool) -> list[str]:
    """The pip requirements this runtime lacks: in Colab, also those at another version."""
    pins = _pins()
    wanted = [f"{n}=={v}" for n, v in pins.items()
              if n not in _NOT_FOR_NOTEBOOKS and (_installed(n) != v if colab else _installed(n) is None)]
    if _tpu_on_pci():
        torch_version = _installed("torch")
        major_minor = tuple(int(p) for p in torch_version.split(".")[:2]) if torch_version else None
        if major_minor is None or not (_TORCH_TPU_TORCH[0] <= major_minor <= _TORCH_TPU_TORCH[1]):
            wanted.insert(0, f"torch=={pins['torch']}")  # before torch_tpu, so pip keeps this torch
        if _installed("torch_tpu") is None:
            wanted.append(TORCH_TPU)
    return wanted


def install_missing() -> None:
    """In Colab, install what ``missing()`` lists; elsewhere only say what is missing (an
    environment of your own, PyTorch/XLA's say, keeps its own pins). One or two lines."""
    colab = "google.colab" in sys.modules
    wanted = missing(colab)
    if not wanted:
        print("all requirements present")
        return
    if not colab:
        print("missing (install them, e.g. pip install -r requirements.txt):", " ".join(wanted))
        return
    print("installing:", " ".join(wanted))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted], check=True)
    if any(w.startswith("torch==") for w in wanted) and "torch" in sys.modules:
        print("torch was replaced after it was imported: restart the runtime, then run all cells.")
