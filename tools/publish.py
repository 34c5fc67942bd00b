"""Where the course is published, for its maintainers (a reader's run never imports this): the one place that names
its repository and the branch the notebooks fetch. The README's Colab badges, every notebook's set-up cell and its
links to the glossary (``docs/glossary.md``) are written from it, and the fact cells' outputs are stored from a run.

    python tools/publish.py                  # rewrite badges and set-up cells (a fork does this once)
    python tools/publish.py --check          # list where they disagree with this file; exit 1 if any
    python tools/publish.py --facts runs/tour  # store the fact cells' outputs from a tour's run

At run time the set-up cell also takes ``COURSE_REPO`` (a URL or a local folder), ``COURSE_REF`` and ``COURSE_DIR``
(default ``/content/course``) from the environment.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

GITHUB = "OWNER/gemma4-on-tpu"  # owner/name on GitHub: a fork sets its own here
REF = "main"  # the branch or tag the notebooks fetch

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
README = ROOT / "README.md"
_FIRST_LINE = "# Set up, the same cell in every notebook (written by tools/publish.py): fetch the course"
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
                cell.outputs, cell.execution_count = (run.outputs, run.execution_count) if is_fact(cell) else ([], None)
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
    parser = argparse.ArgumentParser(prog="python tools/publish.py", description=__doc__.splitlines()[0])
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
