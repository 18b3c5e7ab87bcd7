"""The package's map (docs/development.md, "Layout"): which part may import which, and no
import cycle between modules except through imports made for type checking only."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dataparallel"

#: Each part of the package and the parts it may import (besides itself). The order is the
#: layering, lowest first: a part imports only parts above it in this list.
ALLOWED: dict[str, set[str]] = {
    "version": set(),
    "errors": set(),
    "control": {"errors"},
    "transports": {"errors", "control"},
    "config": {"errors", "control"},
    "connect": {"errors", "control", "config"},
    "train": {"errors", "control", "config", "connect"},
    "launching": {"errors", "control", "config", "connect", "version"},
    "testing": {"errors", "control", "config", "connect", "train", "launching", "transports", "api"},
    "api": {"version", "errors", "control", "config", "connect", "train", "launching"},  # dataparallel/__init__.py
    "tools": {
        "version",
        "errors",
        "control",
        "config",
        "connect",
        "train",
        "launching",
        "transports",
        "testing",
        "api",
    },
}
#: Imports allowed under ``if TYPE_CHECKING:`` only, on top of the above (they never run).
TYPE_ONLY: dict[str, set[str]] = {"control": {"config"}}
TOOLS = {"cli", "reference", "__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str:
    """The part of the package a module belongs to (``dataparallel.control.wire`` -> control)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    head = parts[1]
    if head in TOOLS:
        return "tools"
    return head


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "v1" not in p.parts or p.name == "__init__.py"}


def imports_of(module: str) -> list[tuple[str, bool, int]]:
    """Every ``dataparallel`` module ``module`` imports: (name, under TYPE_CHECKING, line);
    imports inside functions included."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                visit(child, True)
            for child in node.orelse:
                visit(child, typing_only)
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, typing_only, node.lineno) for a in node.names if a.name.startswith("dataparallel"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("dataparallel"):
                for alias in node.names:  # ``from . import wire``: the module itself
                    sub = f"{target}.{alias.name}"
                    found.append((sub if sub in MODULES else target, typing_only, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, typing_only)

    visit(tree, False)
    return found


def test_every_module_belongs_to_a_part_of_the_map():
    parts = {part_of(m) for m in MODULES}
    assert parts <= set(ALLOWED), f"modules outside the map: {sorted(parts - set(ALLOWED))}"
    assert {"control", "transports", "config", "train", "launching", "testing"} <= parts


DOCS = PACKAGE.parent / "docs" / "development.md"


def documented_map() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The map as docs/development.md's "Layout" table states it: each part's imports, and
    those it may make for type checking only (a "(PART for type checking only)" note)."""
    text = DOCS.read_text().split("## Layout", 1)[1].split("Around the package", 1)[0]
    allowed: dict[str, set[str]] = {}
    typing: dict[str, set[str]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`dataparallel/"):
            continue
        first = cells[0].split("`")[1]  # dataparallel/control/, dataparallel/errors.py, ...
        name = first.removeprefix("dataparallel/").removesuffix("/").removesuffix(".py")
        part = "api" if name == "__init__" else part_of(f"dataparallel.{name}")
        column = cells[2]
        for note in re.findall(r"\(([^)]*) for type checking only\)", column):
            typing[part] = {t.strip() for t in note.split(",")}
        column = re.sub(r"\([^)]*\)", "", column)
        allowed[part] = {t.strip() for t in column.split(",") if t.strip() not in ("", "—")}
    return allowed, typing


def test_the_documented_map_is_the_one_checked():
    allowed, typing = documented_map()
    assert allowed == ALLOWED, "docs/development.md's Layout table and ALLOWED here differ"
    assert typing == TYPE_ONLY, "docs/development.md's type-checking-only imports and TYPE_ONLY here differ"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_map(module):
    mine = part_of(module)
    wrong = []
    for target, typing_only, line in imports_of(module):
        theirs = part_of(target)
        if theirs == mine or theirs in ALLOWED[mine]:
            continue
        if typing_only and theirs in TYPE_ONLY.get(mine, set()):
            continue
        wrong.append(f"line {line}: {target} ({theirs}{', type checking only' if typing_only else ''})")
    assert not wrong, f"{module} ({mine}) may import {sorted(ALLOWED[mine])}, not: {'; '.join(wrong)}"


def test_no_import_cycle_between_modules():
    """Runtime imports only (a function's own imports included): a cycle there means a module
    that works only when imported in the right order."""
    graph = {
        m: {t for t, typing_only, _ in imports_of(m) if not typing_only and t in MODULES and t != m} for m in MODULES
    }
    # A package's __init__ runs before its modules: importing a.b imports a too. Modules
    # importing their own package's __init__ (``from . import x``) are resolved to x above.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_map_catches_a_forbidden_import(tmp_path, monkeypatch):
    """The checks above can fail: a control module importing the launcher is refused."""
    fake = PACKAGE / "control" / "channel.py"
    source = fake.read_text() + "\nfrom ..launching import launcher\n"
    monkeypatch.setitem(MODULES, "dataparallel.control.channel", tmp_path / "channel.py")
    (tmp_path / "channel.py").write_text(source)
    with pytest.raises(AssertionError, match="launch"):
        test_imports_follow_the_map("dataparallel.control.channel")
