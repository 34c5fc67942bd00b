"""Every jupytext source has its .ipynb twin, with the same cells (Colab opens the .ipynb)."""

import pathlib

import jupytext
import pytest

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def test_there_are_notebooks():
    assert SOURCES


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_ipynb_matches_its_py_percent_source(source):
    twin = source.with_suffix(".ipynb")
    assert twin.exists(), f"{twin.name} missing: run jupytext --sync {source.name}"

    def cells(nb):
        return [(c.cell_type, c.source) for c in nb.cells]

    assert cells(jupytext.read(twin)) == cells(jupytext.read(source)), f"run: jupytext --sync notebooks/{source.name}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_notebook_source_is_valid_python(source):
    compile(source.read_text(), str(source), "exec")  # what python -m py_compile checks


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_every_exercise_has_its_solution_collapsed_under_it_and_runs_with_the_notebook(source):
    """A question in markdown, then its solution: a code cell Colab shows as a collapsed form and
    Jupyter as a hidden input, tagged ``solution``, which runs whenever the notebook runs (the tour,
    so CI), at the size the runtime has. Hints stay in the solution, not in the question."""
    cells = jupytext.read(source).cells
    start = next(i for i, c in enumerate(cells) if c.cell_type == "markdown" and c.source.startswith("## Exercises"))
    rest = cells[start + 1 :]
    questions = [i for i, c in enumerate(rest) if c.cell_type == "markdown"]
    assert questions and len(rest) == 2 * len(questions)
    for n, i in enumerate(questions, 1):
        assert rest[i].source.startswith(f"**{n}.** "), rest[i].source
        solution = rest[i + 1]
        assert solution.cell_type == "code" and solution.metadata.get("tags") == ["solution"]
        assert solution.metadata.get("cellView") == "form" and solution.metadata["jupyter"]["source_hidden"]
        assert solution.source.startswith(f"# @title Solution {n} (open it after you predicted)")


GLOSSARY_TERMS = {  # the glossary's entries (docs/glossary.md), as the notebooks write them
    "guard": r"\bguards?\b",
    "graph-break": r"\bgraph breaks?\b",
    "functionalized": r"\bfunctionali[sz]ed\b",
    "aliased-donated": r"\b(aliased|donated|donation|donor)\b",
    "hlo": r"\bHLO\b",
    "teacher-forced": r"\bteacher[- ]forc(ed|ing)\b",
    "ulp": r"\bulps?\b",
    "gumbel-max": r"\bGumbel-max\b",
    "ridge-point": r"\bridge point\b",
}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_the_first_use_of_each_glossary_term_links_to_its_entry(source):
    import re

    from helpers.course import publish

    text = "\n".join(c.source for c in jupytext.read(source).cells if c.cell_type == "markdown")
    for anchor, pattern in GLOSSARY_TERMS.items():
        first = re.search(pattern, text, 0 if anchor == "hlo" else re.I)
        if first is not None:
            assert text[first.end() : first.end() + 2] == "](" and text[first.start() - 1] == "[", (anchor, source.name)
            assert text[first.end() + 2 :].startswith(publish.glossary_url(anchor) + ")"), (anchor, source.name)
    assert publish.GLOSSARY.exists()
