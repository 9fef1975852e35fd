"""The import layers: no circles, every import goes down, and the light modules stay light.

The source files are read with ``ast`` (every import: inside functions, under
TYPE_CHECKING, and ``importlib.import_module`` of a literal ``gradequiv.`` name), so
the rules hold for imports that a test run never executes. Only the torch rule
imports anything, in a subprocess.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: source folder -> import name (setuptools package-dir in pyproject.toml)
PACKAGES = {"harness": "gradequiv.harness", "models": "gradequiv.models",
            "properties": "gradequiv.properties"}

#: The layers, bottom first, each by module-name prefix: a module may import its own
#: layer and those below it. The flow: cli -> commands -> properties -> reports -> engine
#: -> implementations -> models -> the foundation.
LAYERS: tuple[tuple[str, ...], ...] = (
    # models.kinds: the names of the model kinds, pure data that the options validate with.
    ("gradequiv.harness.errors", "gradequiv.harness.validate", "gradequiv.harness.options",
     "gradequiv.models.kinds", "gradequiv.harness.regime"),
    ("gradequiv.models",),
    ("gradequiv.harness.implementations",),
    ("gradequiv.harness.engine",),
    ("gradequiv.harness.reports",),
    ("gradequiv.properties",),
    ("gradequiv.harness.commands",),
    ("gradequiv.harness.cli", "gradequiv.harness.__main__", "gradequiv.harness.api"),
)
#: harness/__init__.py, the public API (names that load engine modules lazily): by exact
#: name only, and on the properties layer, so that properties/ and above may use it.
PUBLIC_API = "gradequiv.harness"
PUBLIC_API_LAYER = LAYERS.index(("gradequiv.properties",))

#: Known violations, (importer, imported) -> why it is allowed for now. Each must still
#: occur (a fixed one is taken off), so the list cannot go stale.
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {
    ("gradequiv.harness", "gradequiv.harness.api"):
        "the public API names check() lazily: loaded on first use, never by properties/",
}

#: Imported by every pytest run (the plugin) or before a command is chosen: no torch.
LIGHT_MODULES = ("gradequiv", "gradequiv.harness.errors", "gradequiv.harness.validate",
                 "gradequiv.harness.options", "gradequiv.models.kinds", "gradequiv.harness.cli",
                 "gradequiv.properties.plugin", "gradequiv.harness.regime",
                 # check's supervisor, and what it writes a report with after a crash
                 "gradequiv.harness.commands.supervise", "gradequiv.harness.reports.report",
                 "gradequiv.harness.reports.schema_check")


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    where: str  # path:line, relative to the root

    def __str__(self) -> str:
        return f"{self.where}: {self.importer} -> {self.target}"


def find_modules(root: Path) -> dict[str, Path]:
    """Every module of the package: import name -> source file."""
    found: dict[str, Path] = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _literal_prefix(node: ast.expr) -> str | None:
    """The constant start of a string or f-string argument, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.JoinedStr) and node.values
            and isinstance(node.values[0], ast.Constant)
            and isinstance(node.values[0].value, str)):
        return node.values[0].value
    return None


def _imported_names(tree: ast.Module, module: str, is_package: bool
                    ) -> Iterator[tuple[str, tuple[str, ...], int, bool]]:
    """(module named, names taken from it, line, whether by import_module) for every
    import in the tree."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno, False
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([base] if base else [])])
            yield base, tuple(alias.name for alias in node.names), node.lineno, False
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            prefix = _literal_prefix(node.args[0]) if name == "import_module" else None
            if prefix and prefix.startswith("gradequiv."):
                yield prefix.rstrip("."), (), node.lineno, True


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest known module that ``name`` is or lies in (an f-string's prefix)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def find_imports(root: Path) -> tuple[dict[str, Path], list[Import], list[Import]]:
    """The modules, the imports between them, and imports of gradequiv names that are no
    module. ``from pkg import name`` imports ``pkg.name`` when that is a module, else
    ``pkg``; the implicit import of a parent package's ``__init__`` is not counted."""
    modules = find_modules(root)
    edges: list[Import] = []
    unknown: list[Import] = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports = _imported_names(tree, module, path.name == "__init__.py")
        for base, names, line, dynamic in imports:
            if base != "gradequiv" and not base.startswith("gradequiv."):
                continue
            where = f"{path.relative_to(root)}:{line}"
            targets = [f"{base}.{n}" if f"{base}.{n}" in modules else base for n in names]
            for target in dict.fromkeys(targets or [base]):
                if target == "gradequiv":  # the namespace package: no code of its own
                    continue
                # import_module(f"gradequiv.pkg.{name}"): the package its literal names.
                known = _resolve(target, modules) if dynamic else target
                if known not in modules:
                    unknown.append(Import(module, target, where))
                elif known != module:
                    edges.append(Import(module, known, where))
    return modules, edges, unknown


def layer_of(module: str) -> int | None:
    """The module's layer: the public API by exact name, else the longest prefix."""
    if module == PUBLIC_API:
        return PUBLIC_API_LAYER
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank)
    return None if best is None else best[1]


def layer_violations(edges: list[Import]) -> list[Import]:
    """Imports of a module in a higher layer than the importer's."""
    bad = []
    for edge in edges:
        mine, theirs = layer_of(edge.importer), layer_of(edge.target)
        if mine is not None and theirs is not None and theirs > mine:
            bad.append(edge)
    return bad


def import_cycles(edges: list[Import]) -> list[list[Import]]:
    """One circle of imports for each strongly connected group of modules (Tarjan)."""
    graph: dict[str, dict[str, Import]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, {}).setdefault(edge.target, edge)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_circle(graph, group) for group in groups]


def _circle(graph: Mapping[str, Mapping[str, Import]], group: set[str]) -> list[Import]:
    """A path from the group's first module back to itself, inside the group (BFS)."""
    start = min(group)
    came: dict[str, Import] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt, edge in sorted(graph.get(node, {}).items()):
                if nxt not in group or nxt in came:
                    continue
                came[nxt] = edge
                following.append(nxt)
        frontier = following
        if start in came:
            break
    circle = [came[start]]
    while circle[-1].importer != start:
        circle.append(came[circle[-1].importer])
    return circle[::-1]


def _known(edges: list[Import]) -> list[Import]:
    return [e for e in edges if (e.importer, e.target) not in KNOWN_VIOLATIONS]


def _lines(imports: list[Import]) -> str:
    return "\n".join(f"  {i}" for i in imports)


# -- the package ---------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    """A new module must be placed in LAYERS (or the rules would skip it)."""
    modules = find_modules(ROOT)
    assert "gradequiv.harness.engine.runner" in modules
    assert [m for m in modules if layer_of(m) is None] == []


def test_imports_name_modules_that_exist() -> None:
    """Every gradequiv import names a module of the package (or a name in one)."""
    _, _, unknown = find_imports(ROOT)
    assert unknown == [], "imports of no gradequiv module:\n" + _lines(unknown)


def test_no_import_circles() -> None:
    """No two modules import each other, directly or round a longer circle."""
    _, edges, _ = find_imports(ROOT)
    circles = import_cycles(_known(edges))
    assert circles == [], "import circles:\n" + "\n\n".join(_lines(c) for c in circles)


def test_imports_go_down_the_layers() -> None:
    """Every import points to the same or a lower layer (the public API: properties up)."""
    _, edges, _ = find_imports(ROOT)
    violations = layer_violations(edges)
    assert _known(violations) == [], "imports up the layers:\n" + _lines(_known(violations))
    found = {(e.importer, e.target) for e in violations} | {
        (e.importer, e.target) for c in import_cycles(edges) for e in c}
    assert [k for k in KNOWN_VIOLATIONS if k not in found] == [], "fixed: take them off"


def test_light_modules_import_no_torch() -> None:
    """Importing the CLI, the plugin and the foundation does not import torch (for real)."""
    script = textwrap.dedent(f"""
        import importlib, sys
        for name in {LIGHT_MODULES!r}:
            importlib.import_module(name)
            if "torch" in sys.modules:
                sys.exit(f"importing {{name}} imported torch")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr


# -- the checker itself, on a made-up tree ----------------------------------------------------


def _tree(root: Path, files: Mapping[str, str]) -> None:
    for folder in PACKAGES:
        (root / folder).mkdir()
        (root / folder / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


def test_checker_finds_circles_upward_imports_and_unknown_names(tmp_path: Path) -> None:
    """The rules fire: an engine module that imports the CLI in a function, reports using
    the public API under TYPE_CHECKING, a circle, and a module that does not exist."""
    _tree(tmp_path, {
        "harness/errors.py": "",
        "harness/cli.py": """
            import importlib
            from gradequiv.harness.engine import verify
            importlib.import_module(f"gradequiv.harness.commands.{'check'}")
        """,
        "harness/commands/__init__.py": "",
        "harness/commands/check.py": "from ...harness import errors\n",
        "harness/engine/__init__.py": "",
        "harness/engine/verify.py": """
            from gradequiv.harness.errors import InvalidArgument
            def run() -> None:
                from gradequiv.harness.cli import main
        """,
        "harness/reports/report.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from gradequiv.harness import Verdict
            import gradequiv.harness.engine.nowhere
        """,
    })
    modules, edges, unknown = find_imports(tmp_path)
    pairs = {(e.importer, e.target) for e in edges}
    assert ("gradequiv.harness.commands.check", "gradequiv.harness.errors") in pairs
    assert ("gradequiv.harness.cli", "gradequiv.harness.commands") in pairs
    assert {(e.importer, e.target) for e in layer_violations(edges)} == {
        ("gradequiv.harness.engine.verify", "gradequiv.harness.cli"),
        ("gradequiv.harness.reports.report", "gradequiv.harness"),
    }
    [circle] = import_cycles(edges)
    assert {e.importer for e in circle} == {"gradequiv.harness.cli",
                                            "gradequiv.harness.engine.verify"}
    assert [(i.target, i.where) for i in unknown] == [
        ("gradequiv.harness.engine.nowhere", "harness/reports/report.py:5")]


def test_a_pytest_run_that_is_not_the_suite_imports_no_torch(tmp_path: Path) -> None:
    """The plugin loads into every pytest run where gradequiv is installed: a user's own,
    unrelated tests must not pay for torch."""
    (tmp_path / "test_plain.py").write_text(
        "import sys\n\n\ndef test_no_torch():\n    assert 'torch' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GRADEQUIV_") and k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_plain.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, check=False, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gradequiv" in subprocess.run(  # the plugin was loaded: the test proves something
        [sys.executable, "-m", "pytest", "--help"], cwd=tmp_path, capture_output=True,
        text=True, timeout=120, check=False, env=env).stdout
