"""The notebooks' install step: a plan that leaves the runtime consistent, then pip.

Imports no torch: it may replace it, and a torch imported before that would be stale.
``plan`` is a pure function of what is installed, so Colab-like runtimes are tested here.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import pathlib
import re
import subprocess
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from . import tpu_chips

REQUIREMENTS = pathlib.Path(__file__).resolve().parent.parent / "requirements.txt"
# TorchTPU 0.2.0 declares torch >=2.11.0,<=2.15.0 and libtpu >=0.0.50 with no upper bound: pin libtpu.
TORCH_TPU = {"torch_tpu": "0.2.0", "libtpu": "0.0.52"}
TORCH_TPU_TORCH = SpecifierSet(">=2.11.0,<=2.15.0")
# PyPI's Linux torch is a CUDA build (~3-4 GB); a TPU needs only the CPU build.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Each is built against one torch: when torch moves they would fail to load (and transformers
# imports torchvision if present), so they are removed; the course uses neither.
TORCH_COMPANIONS = ("torchvision", "torchaudio")
# PyTorch/XLA registers the same TPU a second way and pins its own torch: not beside TorchTPU.
CLASHES_WITH_TORCH_TPU = ("torch_xla",)
# The runtime's own version will do: Colab imports these at start, so replacing them would
# ask for a restart.
RUNTIME_VERSION_WILL_DO = {"matplotlib": ">=3.5", "ipywidgets": ">=7.6", "tqdm": ">=4.60"}
# Kept as the runtime has them: its own torch build, and tools only tests and CI need.
NOT_FOR_NOTEBOOKS = {"torch", "jupytext", "nbval", "ipykernel", "pytest", "hypothesis", "ruff"}
_TORCH_STACK = {"torch", "torch-tpu", "libtpu", "torch-xla", *TORCH_COMPANIONS}


class RestartNeeded(SystemExit):
    """Raised after an install that replaced something this Python had already imported:
    no later cell may run on the stale copy. A SystemExit, so a notebook shows one line."""


@dataclasses.dataclass
class Plan:
    """What to change: ``uninstall`` first, then ``torch`` (from the CPU index), then ``install``."""

    torch: str | None = None
    install: list[str] = dataclasses.field(default_factory=list)
    uninstall: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.torch or self.install or self.uninstall)

    def describe(self) -> str:
        parts = [f"remove {' '.join(self.uninstall)}"] if self.uninstall else []
        parts += [f"install {' '.join(([self.torch] if self.torch else []) + self.install)}"]
        return "; ".join(parts) if self.torch or self.install else parts[0]

    def changed(self) -> list[str]:
        return [_norm(r.split("==")[0]) for r in self.uninstall + ([self.torch] if self.torch else []) + self.install]

    def stale(self, modules) -> list[str]:
        """What this plan changes under a Python that imported ``modules``: every changed
        distribution it imported, and torch itself if it imported torch and the torch stack moves."""
        stale = [n for n in self.changed() if n.replace("-", "_") in modules]
        if "torch" in modules and "torch" not in stale and _TORCH_STACK & set(self.changed()):
            stale.append("torch")
        return stale


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> Version:
    return Version(Version(version).public)  # "2.13.0+cpu" is torch 2.13.0


def pins(path: pathlib.Path = REQUIREMENTS) -> dict[str, str]:
    """``name: version`` for every ``name==version`` line of the requirements file."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            out[name.strip()] = version.strip()
    return out


def plan(installed: dict[str, str], pinned: dict[str, str], tpu: bool, colab: bool) -> Plan:
    """What to install and remove so that the notebooks run, given ``installed`` (name: version).

    Outside Colab only what is missing (an environment of your own keeps its versions). In
    Colab also what is at another version, except the runtime's own torch and the packages
    whose runtime version will do. On a TPU machine, TorchTPU and a torch it supports: if torch
    must move, its companions are removed with it; PyTorch/XLA is removed beside TorchTPU.
    """
    installed = {_norm(n): v for n, v in installed.items()}
    out = Plan()
    for name, version in pinned.items():
        have = installed.get(_norm(name))
        if name in NOT_FOR_NOTEBOOKS:
            continue
        if have is None:
            out.install.append(f"{name}=={version}")
        elif colab and name in RUNTIME_VERSION_WILL_DO:
            if not SpecifierSet(RUNTIME_VERSION_WILL_DO[name]).contains(_release(have)):
                out.install.append(f"{name}=={version}")
        elif colab and _release(have) != _release(version):
            out.install.append(f"{name}=={version}")
    if not tpu:
        return out
    torch = installed.get("torch")
    if torch is None or not TORCH_TPU_TORCH.contains(_release(torch), prereleases=True):
        out.torch = f"torch=={pinned['torch']}"
        out.uninstall += [c for c in TORCH_COMPANIONS if _norm(c) in installed]
    out.uninstall += [c for c in CLASHES_WITH_TORCH_TPU if _norm(c) in installed]
    for name, version in TORCH_TPU.items():
        have = installed.get(_norm(name))
        if have is None or _release(have) != _release(version):
            out.install.append(f"{name}=={version}")
    return out


def installed_versions() -> dict[str, str]:
    """Every installed distribution's version, by its normalised name."""
    return {_norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def install_missing() -> Plan:
    """In Colab, carry out ``plan`` for this runtime; elsewhere only say what is missing.
    Raises ``RestartNeeded`` when it replaced something already imported."""
    colab = "google.colab" in sys.modules
    todo = plan(installed_versions(), pins(), tpu=bool(tpu_chips()), colab=colab)
    if not todo:
        print("all requirements present")
        return todo
    if not colab:
        print("missing (install them, e.g. pip install -r requirements.txt):", todo.describe())
        return todo
    print("setting up:", todo.describe())
    stale = todo.stale(sys.modules)
    if todo.uninstall:
        _pip("uninstall", "-q", "-y", *todo.uninstall)
    if todo.torch:
        _pip("install", "-q", todo.torch, "--index-url", TORCH_CPU_INDEX)
    if todo.install:  # torch is already at a version TorchTPU accepts: pip keeps it
        _pip("install", "-q", *todo.install)
    if stale:
        raise RestartNeeded(
            f"installed over what this runtime had already imported ({', '.join(stale)}): "
            "restart it (Runtime > Restart session), then run all cells again; nothing is reinstalled."
        )
    return todo
