"""Setting the course up: the TPU chips on this machine (read from sysfs, without a TPU client or torch, so asking is
cheap and safe anywhere), the notebooks' install step (a plan that leaves the runtime consistent, then pip, shown;
``plan`` is pure, so Colab's published runtimes are tested against it), and where the course is published: the one
place that names its repository and the branch the notebooks fetch. The README's Colab badges, every notebook's set-up
cell and its links to the glossary (``docs/glossary.md``) are written from it. Imports no torch (it may replace it).

    python -m helpers.course.setup           # rewrite badges and set-up cells (a fork does this once)
    python -m helpers.course.setup --check   # list where they disagree with this file; exit 1 if any
    python -m helpers.course.setup --facts runs/tour  # store the fact cells' outputs from a tour's run

At run time the set-up cell also takes ``COURSE_REPO`` (a URL or a local folder),
``COURSE_REF`` and ``COURSE_DIR`` (default ``/content/course``) from the environment.
"""

from __future__ import annotations

import argparse
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
    """An install replaced something already imported: no later cell may run on the stale copy.
    A notebook shows its message alone."""


@dataclasses.dataclass
class Plan:
    """``uninstall``, then ``torch`` (from the CPU index), then ``install``; ``constraints`` (tested
    ranges) hold on every pip call."""

    torch: str | None = None
    install: list[str] = dataclasses.field(default_factory=list)
    uninstall: list[str] = dataclasses.field(default_factory=list)
    constraints: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.torch or self.install or self.uninstall)

    def describe(self) -> str:
        parts = [f"remove {' '.join(self.uninstall)}"] if self.uninstall else []
        parts += [f"install {' '.join(([self.torch] if self.torch else []) + self.install)}"]
        return "; ".join(parts) if self.torch or self.install else parts[0]

    def changed(self) -> list[str]:
        return [
            _norm(Requirement(r).name) for r in self.uninstall + ([self.torch] if self.torch else []) + self.install
        ]

    def stale(self, modules, names: dict[str, set[str]]) -> list[str]:
        """What this plan changes that a Python which imported ``modules`` has in memory."""
        return stale_imports(set(self.changed()), modules, names)


def import_names() -> dict[str, set[str]]:
    """Each installed distribution's top-level import names (pyzmq: ``zmq``, PyYAML: ``yaml``,
    setuptools also ``_distutils_hack``)."""
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
    out = {}
    for req in _requirements(path):
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            out[req.name] = exact[0]
    return out


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
        if have is None:
            out.install.append(f"{name}=={version}")
        elif colab and name in RUNTIME_VERSION_WILL_DO:
            if not SpecifierSet(RUNTIME_VERSION_WILL_DO[name]).contains(_release(have)):
                out.install.append(f"{name}=={version}")
        elif colab and _release(have) != _release(version):
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
    for name in sorted(before.keys() | after.keys()):
        if name in named or before.get(name) == after.get(name):
            continue
        if name not in after:
            out.append(f"-{name}")
        elif name not in before:
            out.append(f"+{name} {after[name]}")
        else:
            out.append(f"{name} {before[name]} -> {after[name]}")
    return out


def unmatched_extras(changed: set[str]) -> list[str]:
    """Extras that no longer match a changed package (``pip check`` skips extras: jax's ``tpu``
    extra pins its libtpu)."""
    versions, out = installed_versions(), []
    for dist in importlib.metadata.distributions():
        for line in dist.requires or []:
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            name = _norm(req.name)
            extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)", str(req.marker or ""))
            if not extra or name not in changed or name not in versions:
                continue
            if not req.specifier.contains(_release(versions[name]), prereleases=True):
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


GITHUB = "OWNER/gemma4-on-tpu"  # owner/name on GitHub: a fork sets its own here
REF = "main"  # the branch or tag the notebooks fetch

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
README = ROOT / "README.md"
_FIRST_LINE = "# Set up, the same cell in every notebook (written by helpers.course.setup): fetch the course"
_BADGE = re.compile(
    r"https://colab\.research\.google\.com/github/[^/\s]+/[^/\s]+/blob/[^/\s]+/(notebooks/[^)\s]+\.ipynb)"
)


_GLOSSARY = re.compile(r"https://github\.com/[^/\s]+/[^/\s]+/blob/[^/\s#]+/docs/glossary\.md#([a-z-]+)")
GLOSSARY = ROOT / "docs" / "glossary.md"


def repo_url() -> str:
    return f"https://github.com/{GITHUB}"


def glossary_url(anchor: str) -> str:
    """The published glossary's entry ``anchor`` (a notebook links the first use of a term to it:
    Colab shows the notebook alone, so the link is the repository's page, not a relative path)."""
    return f"{repo_url()}/blob/{REF}/docs/glossary.md#{anchor}"


def setup_cell() -> str:
    """The set-up cell's source. It runs before ``helpers`` exists, so it is plain Python:
    clone the course unless the course's ``helpers`` is importable (once: a rerun after a
    restart finds the folder), never prompting for credentials; check that the ``helpers``
    imported is the course's (a stray ``helpers.py`` is a common name), name its folder, then
    install what the runtime lacks."""
    repo, ref = repo_url(), REF
    return f'''{_FIRST_LINE}
# where `helpers` is not importable (Colab), then install what this runtime lacks. Safe to rerun.
import importlib.util
import os
import subprocess
import sys

COURSE_REPO = os.environ.get("COURSE_REPO", "{repo}")  # a URL or a folder
COURSE_REF = os.environ.get("COURSE_REF", "{ref}")  # the branch or tag these notebooks go with
COURSE_DIR = os.environ.get("COURSE_DIR", "/content/course")


def is_course(folder):  # the course's helpers is a package with its course/ beside its __init__
    return folder is not None and os.path.isfile(os.path.join(folder, "course", "setup.py"))


spec = importlib.util.find_spec("helpers")
if not is_course(spec and spec.submodule_search_locations and spec.submodule_search_locations[0]):
    if not os.path.isdir(os.path.join(COURSE_DIR, "helpers")):
        fetch = subprocess.run(
            ["git", "clone", "-q", "--depth", "1", "--branch", COURSE_REF, COURSE_REPO, COURSE_DIR],
            capture_output=True,
            text=True,
            env={{**os.environ, "GIT_TERMINAL_PROMPT": "0"}},
        )
        if fetch.returncode:
            raise SystemExit(
                f"could not fetch the course from {{COURSE_REPO}} ({{COURSE_REF}}): {{fetch.stderr.strip()}}\\n"
                "Set COURSE_REPO to your copy, a URL or a folder: os.environ['COURSE_REPO'] = '...', then rerun."
            )
        print(f"fetched {{COURSE_REPO}} ({{COURSE_REF}}) into {{COURSE_DIR}}")
    sys.path.insert(0, COURSE_DIR)
    sys.modules.pop("helpers", None)  # a stray module of that name imported earlier
import helpers

if not is_course(os.path.dirname(helpers.__file__ or "")):
    raise SystemExit(f"`helpers` came from {{helpers.__file__}}, not the course: rename that file, then rerun.")
print("the course:", os.path.dirname(os.path.dirname(helpers.__file__)))
helpers.install_missing()'''


FACT = "# NBVAL_CHECK_OUTPUT"  # a cell whose output is a fact of E2B or of the course: stored, and checked by nbval


def is_fact(cell) -> bool:
    return cell.cell_type == "code" and FACT in cell.source.splitlines()


def store_facts(executed: pathlib.Path) -> None:
    """Copy the fact cells' outputs from the notebooks a run saved in ``executed`` (the tour's run folder) into the
    committed .ipynb, and no other cell's: GitHub shows those facts before anyone runs a notebook, and
    ``pytest --nbval-lax`` checks that a run prints them again."""
    import nbformat

    for path in NOTEBOOKS:
        twin, ran = path.with_suffix(".ipynb"), nbformat.read(executed / path.with_suffix(".ipynb").name, as_version=4)
        committed = nbformat.read(twin, as_version=4)
        if [c.source for c in ran.cells] != [c.source for c in committed.cells]:
            raise ValueError(f"{executed / twin.name} ran other cells than {twin.name}: run the tour again")
        for cell, run in zip(committed.cells, ran.cells):
            if (
                cell.cell_type == "code"
            ):  # a fact keeps its run's count: nbval refuses stored outputs of a cell never run
                fact = is_fact(cell)
                cell.outputs, cell.execution_count = (run.outputs, run.execution_count) if fact else ([], None)
        nbformat.write(committed, twin)


def badge_url(notebook: str) -> str:
    """Colab's address for ``notebooks/<name>.ipynb`` of the published repository."""
    return f"https://colab.research.google.com/github/{GITHUB}/blob/{REF}/notebooks/{notebook}"


def _cells(text: str) -> list[str]:
    return re.split(r"^# %%.*\n", text, flags=re.M)


def notebook_setup_cell(source: str) -> str | None:
    """The set-up cell of a py:percent notebook source, or None if it has none."""
    for cell in _cells(source):
        if cell.startswith(_FIRST_LINE):
            return cell.strip("\n")
    return None


def mismatches() -> list[str]:
    """Where the README's badges, a notebook's set-up cell (source and .ipynb) or its glossary
    links disagree with this file (or name no entry of the glossary); empty when all agree."""
    import jupytext

    found = []
    for path in NOTEBOOKS:
        if notebook_setup_cell(path.read_text()) != setup_cell():
            found.append(f"{path.name}: set-up cell differs")
        twin = jupytext.read(path.with_suffix(".ipynb"))
        if setup_cell() not in [c.source for c in twin.cells if c.cell_type == "code"]:
            found.append(f"{path.with_suffix('.ipynb').name}: set-up cell differs")
    anchors = set(re.findall(r"^## (.+)$", GLOSSARY.read_text(), flags=re.M))
    anchors = {re.sub(r"[^a-z0-9 -]", "", a.lower()).replace(" ", "-") for a in anchors}
    for path in NOTEBOOKS:
        for link in _GLOSSARY.finditer(path.read_text()):
            if link.group(0) != glossary_url(link.group(1)) or link.group(1) not in anchors:
                found.append(f"{path.name}: glossary link {link.group(0)}")
    readme = README.read_text()
    for url in _BADGE.finditer(readme):
        if url.group(0) != badge_url(url.group(1).split("/", 1)[1]):
            found.append(f"README.md: {url.group(0)}")
    badged = {m.group(1) for m in _BADGE.finditer(readme)}
    found += [f"README.md: no badge for {p.stem}" for p in NOTEBOOKS if f"notebooks/{p.stem}.ipynb" not in badged]
    return found


def write() -> None:
    """Rewrite the README's badges, every notebook's set-up cell and glossary links from this
    file, then sync the .ipynb twins (jupytext)."""
    import jupytext.cli

    README.write_text(_BADGE.sub(lambda m: badge_url(m.group(1).split("/", 1)[1]), README.read_text()))
    for path in NOTEBOOKS:
        text, cell = path.read_text(), notebook_setup_cell(path.read_text())
        if cell is None:
            raise ValueError(f"{path.name} has no set-up cell (a code cell starting {_FIRST_LINE!r})")
        text = _GLOSSARY.sub(lambda m: glossary_url(m.group(1)), text.replace(cell, setup_cell(), 1))
        path.write_text(text)
        jupytext.cli.jupytext(["--sync", "--quiet", str(path)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m helpers.course.setup", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only list disagreements; exit 1 if any")
    parser.add_argument("--facts", type=pathlib.Path, metavar="RUN_DIR", help="store the fact cells' outputs from here")
    args = parser.parse_args(argv)
    if args.facts:
        store_facts(args.facts)
        print(f"the outputs of the cells marked {FACT} stored from {args.facts} in {len(NOTEBOOKS)} notebooks")
        return
    if args.check:
        problems = mismatches()
        print("\n".join(problems) or f"badges and set-up cells agree with {repo_url()} ({REF})")
        sys.exit(1 if problems else 0)
    write()
    print(f"README badges and {len(NOTEBOOKS)} set-up cells written for {repo_url()} ({REF})")


if __name__ == "__main__":
    main()
