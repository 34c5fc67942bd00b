"""Setting the course up in a notebook: a ``plan`` that leaves the runtime consistent (pure: Colab's published runtimes
are tested against it), then pip, shown. ``helpers.chips`` finds a TPU in sysfs: this module imports no torch, which it
may replace. Publishing (badges, set-up cells) is ``tools/publish.py``."""

import collections
import dataclasses
import importlib
import importlib.metadata
import os
import pathlib
import re
import subprocess
import sys
import tempfile

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from ..chips import tpu_chips

ROOT = pathlib.Path(__file__).resolve().parents[2]
# What the notebooks import; the test tools sit in requirements.txt only, and are never installed here.
REQUIREMENTS = ROOT / "requirements-notebooks.txt"
# The versions CI's xla job runs beside torch 2.9.0.
XLA_REQUIREMENTS = ROOT / "requirements-xla.txt"
# TorchTPU 0.2.0 declares torch >=2.11.0,<=2.15.0 and libtpu >=0.0.50 with no upper bound: pin libtpu.
TORCH_TPU = {"torch_tpu": "0.2.0", "libtpu": "0.0.52"}
TORCH_TPU_TORCH = SpecifierSet(">=2.11.0,<=2.15.0")
TORCH_TPU_PYTHON = SpecifierSet(">=3.11,<3.15")  # the wheels it has (cp311 to cp314)
# PyPI's Linux torch is a CUDA build (~3-4 GB); a TPU needs the CPU build, from this extra index.
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Built against one torch: removed when torch moves (transformers imports torchvision if present).
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# PyTorch/XLA registers the same TPU a second way and pins its own torch: not beside TorchTPU.
CLASHES_WITH_TORCH_TPU = ("torch_xla",)
# The runtime's version will do (Colab imports the first three at start: replacing them needs a restart).
RUNTIME_VERSION_WILL_DO = {"matplotlib": ">=3.5", "ipywidgets": ">=7.6", "tqdm": ">=4.60", "filelock": ">=3.0"}
# compressed-tensors >= 0.16 needs torch >= 2.10: beside an older torch, CI's xla job's version.
NEEDS_TORCH_2_10 = ("compressed-tensors",)
_TORCH_STACK = {"torch", "torch-tpu", "libtpu", "torch-xla", *TORCH_COMPANIONS}


class SetupError(RuntimeError):
    """An install that cannot go on; the message says what pip said, or what to do."""


class RestartNeeded(RuntimeError):
    """An install replaced something already imported: no later cell may run on the stale copy."""


@dataclasses.dataclass
class Plan:
    """``uninstall``, then ``torch`` (from the CPU index), then ``install``; ``constraints`` hold on every pip call."""

    torch: str | None = None
    install: list[str] = dataclasses.field(default_factory=list)
    uninstall: list[str] = dataclasses.field(default_factory=list)
    constraints: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.torch or self.install or self.uninstall)

    def describe(self) -> str:
        installs = [r for r in (self.torch, *self.install) if r]
        parts = [f"remove {' '.join(self.uninstall)}"] if self.uninstall else []
        return "; ".join(parts + ([f"install {' '.join(installs)}"] if installs else []))

    def changed(self) -> list[str]:
        return [_norm(Requirement(r).name) for r in (*self.uninstall, self.torch, *self.install) if r]


def import_names() -> dict[str, set[str]]:
    """Each installed distribution's top-level import names (pyzmq: ``zmq``, PyYAML: ``yaml``)."""
    names = collections.defaultdict(set)
    for module, distributions in importlib.metadata.packages_distributions().items():
        for distribution in distributions:
            names[_norm(distribution)].add(module)
    return dict(names)


def stale_imports(changed: set[str], modules, names: dict[str, set[str]]) -> list[str]:
    """The distributions among ``changed`` that a Python which imported ``modules`` has in memory;
    also torch if imported and the torch stack moves (TorchTPU registers itself on torch's import)."""
    imported = {m.split(".")[0] for m in modules}
    stale = sorted(n for n in changed if names.get(n, set()) & imported)
    if "torch" in imported and "torch" not in stale and _TORCH_STACK & changed:
        stale.append("torch")
    return stale


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _release(version: str) -> Version:
    return Version(Version(version).public)  # "2.13.0+cpu" is torch 2.13.0


def _requirements(path: pathlib.Path) -> list[Requirement]:
    lines = (raw.split("#")[0].strip() for raw in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]  # not "-r other.txt"


def pins(path: pathlib.Path = REQUIREMENTS) -> dict[str, str]:
    """``name: version`` for every ``name==version`` line of the requirements file."""
    return {r.name: s.version for r in _requirements(path) for s in r.specifier if s.operator == "=="}


def ranges(path: pathlib.Path = REQUIREMENTS) -> dict[str, str]:
    """``name: specifier`` for every tested range, not one version (``setuptools>=77.0.3,<82``)."""
    return {r.name: str(r.specifier) for r in _requirements(path) if not any(s.operator == "==" for s in r.specifier)}


def plan(
    installed: dict[str, str],
    pinned: dict[str, str],
    tpu: bool,
    colab: bool,
    python: tuple[int, int] | None = None,
    ranged: dict[str, str] | None = None,
) -> Plan:
    """What to install and remove so the notebooks run: what is missing; in Colab other versions too (not its torch); on
    a TPU, TorchTPU and a CPU torch it supports."""
    python = python or sys.version_info[:2]
    installed = {_norm(n): v for n, v in installed.items()}
    ranged = ranged or {}
    out = Plan(constraints=[f"{name}{spec}" for name, spec in ranged.items()])
    out.install += [f"{name}{spec}" for name, spec in ranged.items() if _norm(name) not in installed]
    if tpu:
        if not TORCH_TPU_PYTHON.contains(f"{python[0]}.{python[1]}"):
            raise SetupError(
                f"TorchTPU {TORCH_TPU['torch_tpu']} has wheels for Python 3.11 to 3.14; this runtime runs "
                f"Python {python[0]}.{python[1]}. Pick another runtime version (Runtime > Change runtime type)."
            )
        torch = installed.get("torch")
        if torch is None or not TORCH_TPU_TORCH.contains(_release(torch), prereleases=True):
            out.torch = f"torch=={pinned['torch']}+cpu"
            out.uninstall += [c for c in TORCH_COMPANIONS if _norm(c) in installed]
        out.uninstall += [c for c in CLASHES_WITH_TORCH_TPU if _norm(c) in installed]
    torch_after = out.torch.split("==")[1] if out.torch else installed.get("torch", pinned["torch"])
    for name, version in pinned.items():
        if name == "torch":
            continue  # the runtime's own build, or the one above for TorchTPU
        if name in NEEDS_TORCH_2_10 and _release(torch_after) < Version("2.10"):
            version = pins(XLA_REQUIREMENTS)[name]
        have = installed.get(_norm(name))
        will_do = SpecifierSet(RUNTIME_VERSION_WILL_DO.get(name, f"=={_release(version)}"))
        if have is None or (colab and not will_do.contains(_release(have))):
            out.install.append(f"{name}=={version}")
    if tpu:
        for name, version in TORCH_TPU.items():
            have = installed.get(_norm(name))
            if have is None or _release(have) != _release(version):
                out.install.append(f"{name}=={version}")
    return out


def installed_versions() -> dict[str, str]:
    """Every installed distribution's version, by its normalised name."""
    importlib.invalidate_caches()  # read anew after pip has run in this process's lifetime
    return {_norm(d.metadata["Name"]): d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}


def _pip(*args: str) -> None:
    """pip, its output printed by this Python (a notebook does not show a subprocess's), less the
    "already satisfied" lines; raises with its last lines."""
    run = subprocess.Popen(
        [sys.executable, "-m", "pip", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PIP_PROGRESS_BAR": "off", "PIP_NO_INPUT": "1"},
    )
    tail = collections.deque(maxlen=30)
    for line in run.stdout:
        tail.append(line.rstrip())
        if not line.startswith("Requirement already satisfied"):
            print("  " + line, end="", flush=True)
    if run.wait():
        raise SetupError(f"pip {' '.join(args)} failed (exit {run.returncode}); its last lines:\n" + "\n".join(tail))


def moved(before: dict[str, str], after: dict[str, str], todo: Plan) -> list[str]:
    """What pip changed beyond what ``todo`` named: ``name old -> new``, ``+name new``, ``-name``."""
    named = set(todo.changed())
    out = []
    for name in sorted((before.keys() | after.keys()) - named):
        if name not in after:
            out.append(f"-{name}")
        elif name not in before:
            out.append(f"+{name} {after[name]}")
        elif before[name] != after[name]:
            out.append(f"{name} {before[name]} -> {after[name]}")
    return out


def unmatched_extras(changed: set[str]) -> list[str]:
    """Extras that no longer match a changed package (``pip check`` skips extras: jax's ``tpu`` extra pins libtpu)."""
    versions, out = installed_versions(), []
    present = changed & versions.keys()  # not one pip removed
    for dist in importlib.metadata.distributions():
        for line in dist.requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            name = _norm(req.name)
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", str(req.marker or ""))
            if extra and name in present and not req.specifier.contains(_release(versions[name]), prereleases=True):
                out.append(
                    f"{dist.metadata['Name']} {dist.version} [{extra.group(1)}] wants {req.name}{req.specifier}, "
                    f"now {versions[name]}"
                )
    return sorted(set(out))


def pip_check(changed: set[str]) -> tuple[list[str], int]:
    """``pip check``'s lines naming a changed package, and how many others (the runtime's own)."""
    run = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line and not line.startswith("No broken requirements")]
    ours = [line for line in lines if any(_norm(w) in changed for w in re.findall(r"[A-Za-z0-9_.\-]+", line))]
    return ours, len(lines) - len(ours)


def _one_line_in_ipython(error: type[BaseException]) -> None:
    """Have IPython show ``error`` as its message alone; the cell still fails, so Run all stops
    (a ``SystemExit`` would add IPython's "To exit" warning)."""
    try:
        from IPython import get_ipython  # only inside IPython: a script shows the usual traceback
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        shell.set_custom_exc((error,), lambda shell, etype, value, tb, tb_offset=None: print(value, file=sys.stderr))


def install_missing() -> None:
    """In Colab, carry out ``plan``, then say what else moved and what no longer matches; elsewhere
    say what is missing. Raises ``RestartNeeded`` when it replaced something already imported."""
    colab = "google.colab" in sys.modules
    todo = plan(installed_versions(), pins(), tpu=bool(tpu_chips()), colab=colab, ranged=ranges())
    if not todo:
        print("all requirements present")
        return
    if not colab:
        print("missing (install them, e.g. pip install -r requirements.txt):", todo.describe())
        return
    _one_line_in_ipython(RestartNeeded)
    print("setting up:", todo.describe(), flush=True)
    before, names = installed_versions(), import_names()  # read before pip: a removed package's files go
    constraints = pathlib.Path(tempfile.mkdtemp()) / "constraints.txt"
    constraints.write_text("\n".join(todo.constraints) + "\n")
    keep = ["-c", str(constraints)] if todo.constraints else []
    if todo.uninstall:
        _pip("uninstall", "-y", *todo.uninstall)
    if todo.torch:
        _pip("install", todo.torch, "--extra-index-url", TORCH_CPU_INDEX, *keep)
    if todo.install:  # torch is already at a version TorchTPU accepts: pip keeps it
        _pip("install", *todo.install, *keep)
    after = installed_versions()
    also = moved(before, after, todo)
    print("also moved (pip, for what was installed):", ", ".join(also) if also else "nothing")
    changed = set(todo.changed()) | {n for n in before.keys() | after.keys() if before.get(n) != after.get(n)}
    for name, modules in import_names().items():  # a package pip installed anew: its names now
        names[name] = names.get(name, set()) | modules
    stale = stale_imports(changed, sys.modules, names)
    broken, older = pip_check(changed)
    broken += unmatched_extras(changed)
    print(
        "no longer matches in this runtime:",
        "; ".join(broken) if broken else "nothing",
        f"({older} mismatch(es) the runtime had before, left as they were)" if older else "",
    )
    if stale:
        raise RestartNeeded(
            f"installed over what this runtime had already imported ({', '.join(stale)}): "
            "restart it (Runtime > Restart session), then run all cells again; nothing is reinstalled."
        )
