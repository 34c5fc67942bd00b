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
