"""The module map (docs/modules.md) matches the package: every module listed once, in an order where
each imports only modules above it, with the helpers modules it really imports (read from the
source); no helpers import inside a function, no cycle among the top-level imports."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
LESSONS = {p.stem for p in (ROOT / "helpers").glob("*.py")}
BOOKKEEPING = {p.stem for p in (ROOT / "helpers" / "course").glob("*.py")} - {"__init__"}
MODULES = LESSONS | BOOKKEEPING | {"course"}  # "course": the subpackage's own __init__


def _path(module: str) -> pathlib.Path:
    if module == "course":
        return ROOT / "helpers" / "course" / "__init__.py"
    return ROOT / "helpers" / ("course/" if module in BOOKKEEPING else "") / f"{module}.py"


def _imports(module: str) -> set[str]:
    """The package's modules that ``module`` imports: ``..x`` and ``.x`` read from where it sits."""
    in_course = module in BOOKKEEPING or module == "course"
    found = set()
    for node in ast.walk(ast.parse(_path(module).read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            lessons = node.level == 2 or not in_course  # the lessons' folder, or the course's own
            if node.module:  # from .x import y: the module x
                found.add(node.module)
            else:  # from . import x: a module, or a name of the package itself
                pool = LESSONS if lessons else BOOKKEEPING
                found |= {a.name if a.name in pool else ("__init__" if lessons else "course") for a in node.names}
    return found - {module}


def _module_map() -> dict[str, set[str]]:
    section = (ROOT / "docs" / "modules.md").read_text()
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            listed = set(re.findall(r"`([a-z_0-9]+)`", cells[3]))
            rows[cells[0].strip("`")] = listed
    return rows


def test_the_module_map_lists_every_module_with_its_imports_each_from_above():
    rows = _module_map()
    assert set(rows) == MODULES
    above = set()
    for module, listed in rows.items():  # in the map's order: the layers, top to bottom
        assert _imports(module) == listed, module
        assert listed <= above, f"{module} imports {sorted(listed - above)}, listed below it"
        above.add(module)


def test_a_lesson_imports_only_lessons_of_its_notebook_or_earlier_ones():
    """A reader at notebook N needs only what notebooks 01..N opened: read from the map's "opened in" column."""
    section = (ROOT / "docs" / "modules.md").read_text().split("## The lessons", 1)[1].split("\n## ", 1)[0]
    opened = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            opened[cells[0].strip("`")] = int(cells[2])
    assert set(opened) == LESSONS - {"__init__"}
    later = {m: sorted(i for i in _imports(m) if opened[i] > opened[m]) for m in opened}
    assert not any(later.values()), {m: i for m, i in later.items() if i}


def _inner_relative_imports(module: str) -> list[int]:
    tree = ast.parse(_path(module).read_text())
    return [
        node.lineno
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
        if isinstance(node, ast.ImportFrom) and node.level >= 1
    ]


def test_no_helpers_import_inside_a_function_and_no_cycle():
    inner = {m: lines for m in MODULES if (lines := _inner_relative_imports(m))}
    assert inner == {}, f"imports of helpers modules inside functions (module: lines): {inner}"
    graph = {m: _imports(m) for m in MODULES}
    done, path = set(), []

    def visit(module):  # depth first: a module met again on the current path closes a cycle
        if module in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(module) :] + [module])}")
        if module in done:
            return
        path.append(module)
        for imported in graph[module]:
            visit(imported)
        path.pop()
        done.add(module)

    for module in sorted(MODULES):
        visit(module)


def test_the_checks_catch_an_inner_import_and_a_cycle(tmp_path, monkeypatch):
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "a.py").write_text("from .b import x\n")
    (tmp_path / "helpers" / "b.py").write_text("def f():\n    from .a import y\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    monkeypatch.setattr(__import__(__name__), "MODULES", {"a", "b"})
    assert _inner_relative_imports("b") == [2] and _imports("a") == {"b"}
    (tmp_path / "helpers" / "b.py").write_text("from .a import y\n")
    with pytest.raises(AssertionError, match="import cycle: a -> b -> a"):
        test_no_helpers_import_inside_a_function_and_no_cycle()


def test_the_readme_is_a_front_page_and_its_links_and_the_docs_lead_somewhere():
    """At most 150 lines: the two commands, the notebooks, where they run, what each step shows; details in docs/."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    for page in ("full-size", "xla-programs", "modules", "browser-chat", "glossary"):
        assert f"](docs/{page}.md)" in text, page
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for link in re.findall(r"\]\(([\w./-]+\.(?:md|ipynb|py))\)", page.read_text()):
            assert (page.parent / link).exists(), f"{page.name}: {link}"


def test_the_module_map_draws_every_module_in_its_layer():
    text = (ROOT / "docs" / "modules.md").read_text()
    drawn = text.split("```mermaid", 1)[1].split("```", 1)[0]
    assert set(re.findall(r"\bl_(\w+)\[", drawn)) == LESSONS - {"__init__"}
    assert set(re.findall(r"\bc_(\w+)\[", drawn)) == BOOKKEEPING
