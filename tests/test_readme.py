"""The README's module map matches the package: every module listed once, with the helpers
modules it really imports (read from the source, lazy imports inside functions included)."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODULES = {p.stem for p in (ROOT / "helpers").glob("*.py")}


def _imports(module: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse((ROOT / "helpers" / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module)
            else:  # from . import x: a module, or a name of the package itself
                found |= {a.name if a.name in MODULES else "__init__" for a in node.names}
    return found - {module}


def _module_map() -> dict[str, set[str]]:
    section = (ROOT / "README.md").read_text().split("## Module map", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`"):
            listed = set(re.findall(r"`([a-z_0-9]+)`", cells[3]))
            rows[cells[0].strip("`")] = (
                MODULES - {"tour"} - {cells[0].strip("`")} if "all of the above" in cells[3] else listed
            )
    return rows


def test_the_module_map_lists_every_module_with_its_imports():
    rows = _module_map()
    assert set(rows) == MODULES
    for module, listed in rows.items():
        if module == "tour":
            assert _imports(module) <= listed, module
        else:
            assert _imports(module) == listed, module
