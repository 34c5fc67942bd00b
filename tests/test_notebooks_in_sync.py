"""Every jupytext source has its .ipynb twin, with the same cells (Colab opens the .ipynb)."""

import pathlib
import re

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

    from tools import publish

    text = "\n".join(c.source for c in jupytext.read(source).cells if c.cell_type == "markdown")
    for anchor, pattern in GLOSSARY_TERMS.items():
        first = re.search(pattern, text, 0 if anchor == "hlo" else re.I)
        if first is not None:
            assert text[first.end() : first.end() + 2] == "](" and text[first.start() - 1] == "[", (anchor, source.name)
            assert text[first.end() + 2 :].startswith(publish.glossary_url(anchor) + ")"), (anchor, source.name)
    assert publish.GLOSSARY.exists()


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_the_fact_cells_carry_their_outputs_and_no_other_cell_does(source):
    """What GitHub shows before anyone runs a notebook: the outputs of its fact cells (``# NBVAL_CHECK_OUTPUT``: facts
    of E2B or of the course's definitions, whatever the backend), which nbval checks a run prints again; no other
    cell's, since a run's timings, paths and machine are the reader's own. Stored by
    ``python tools/publish.py --facts runs/tour``."""
    import nbformat

    from tools import publish

    for cell in nbformat.read(source.with_suffix(".ipynb"), as_version=4).cells:
        if not publish.is_fact(cell):
            assert not cell.get("outputs"), (
                f"{source.stem}: a stored output in a cell that is not a fact:\n{cell.source}"
            )
            continue
        text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        assert text and not [o for o in cell.outputs if o.output_type == "error"], cell.source
        assert not re.search(r"/(root|home|tmp|content)/", text), text  # no machine's paths


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_cell_is_over_60_lines_and_none_calls_a_private_name_of_the_course(source):
    """Cells short enough to read (a class longer than that is written over several, ``helpers.add_to_class``), and
    no ``._name`` the course defines outside the lessons a notebook writes (``# @save``): what a notebook calls is what a
    reader may call."""
    import ast

    root = NOTEBOOKS.parent / "helpers"
    private = set()
    for module in root.rglob("*.py"):
        for node in ast.walk(ast.parse(module.read_text())):  # the names it defines: torch's and transformers' aside
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                private.add(node.name)
            elif isinstance(node, ast.Attribute | ast.Name) and isinstance(node.ctx, ast.Store):
                private.add(getattr(node, "attr", None) or node.id)
    from transformers.models.gemma4 import modeling_gemma4

    transformers_own = set(re.findall(r"def (_\w+)", pathlib.Path(modeling_gemma4.__file__).read_text()))
    # transformers' own names are not the course's: notebook 04 replaces one of them (its cut), as the lesson
    private = {n for n in private - transformers_own if n.startswith("_") and not n.startswith("__")}
    for cell in jupytext.read(source).cells:
        if cell.cell_type == "code":
            assert len(cell.source.splitlines()) <= 60, (
                f"{source.name}: a cell of {len(cell.source.splitlines())} lines"
            )
            lesson = cell.source.startswith("# @save ")  # a module's own code, written here: its names are its own
            used = set() if lesson else set(re.findall(r"\.(_[a-z]\w*)", cell.source)) & private
            assert not used, f"{source.name} calls {sorted(used)}"
