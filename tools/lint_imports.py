"""Checks of the import structure that import-linter's contracts do not express.

``python tools/lint_imports.py mpitrain benchmarks`` reports, and exits 1 on:

* an import cycle between modules (a package counts as its ``__init__``; imports
  inside functions count too, since they run too);
* a name starting with ``_`` used outside the module that defines it: imported
  from another module (``from .x import _helper``), or read as an attribute
  (``obj._helper``) in a module that defines no such name. A private *module*
  (``_builds.py``) may be used anywhere inside the package that holds it.

The layers themselves are import-linter's ``layers`` contract in ``pyproject.toml``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ALLOWED_ATTRIBUTES = {"_exit", "_rendezvous_handlers"}
"""Private-looking attributes that are public API elsewhere (``os._exit``), or the one
private name of another library that a module needs, with why: torch has no public way
to extend its ``env://`` rendezvous, which ``mpitrain.torch.distributed`` makes fall
back on MPI when ``MASTER_ADDR`` is unset (``torch.distributed.rendezvous``'s handler
table; without it, ``init_method="mpitrain://"`` is needed)."""


@dataclass
class Module:
    """One source file of a package."""

    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    imports: set[str] = field(default_factory=set)

    @property
    def package(self) -> str:
        """The package that relative imports start from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def load(roots: list[str]) -> dict[str, Module]:
    """Every ``.py`` module under the given package directories, by dotted name."""
    modules: dict[str, Module] = {}
    for root in roots:
        base = Path(root).resolve()
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base.parent).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            name = ".".join(parts)
            modules[name] = Module(name, path, is_package, ast.parse(path.read_text()))
    return modules


def defined_names(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes, assigned names and attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def resolve(module: Module, node: ast.ImportFrom) -> str:
    """The absolute name of the module an ``import from`` reads."""
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private(name: str) -> bool:
    """True for ``_name`` (not for dunders)."""
    return name.startswith("_") and not name.startswith("__")


def within(importer: str, package: str | None, module: str) -> bool:
    """May ``importer`` use a private name of ``module``? Only ``module`` itself may, or,
    for a private module, any module inside ``package``, the package that holds it."""
    if importer == module:
        return True
    return package is not None and (importer == package or importer.startswith(package + "."))


def check(modules: dict[str, Module]) -> list[str]:
    """Collect the import graph and return every violation found."""
    problems: list[str] = []
    package_names = {name: defined_names(m.tree) for name, m in modules.items() if m.is_package}
    for m in modules.values():
        own = defined_names(m.tree)
        for node in ast.walk(m.tree):
            where = f"{m.path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        m.imports.add(alias.name)
            elif isinstance(node, ast.ImportFrom):
                source = resolve(m, node)
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in modules:
                        m.imports.add(target)
                    elif source in modules and (not modules[source].is_package
                                                or alias.name in package_names[source]):
                        m.imports.add(source)
                    if private(alias.name) and source in modules:
                        is_module = target in modules or (
                            modules[source].is_package
                            and alias.name not in package_names.get(source, ()))
                        if not within(m.name, source if is_module else None, source):
                            problems.append(f"{where}: {m.name} imports the private name "
                                            f"{alias.name} of {source}")
                parts = source.split(".")
                for i, part in enumerate(parts):
                    owner = ".".join(parts[:i])
                    if private(part) and not within(m.name, owner, source):
                        problems.append(f"{where}: {m.name} imports the private module {source}")
            elif isinstance(node, ast.Attribute) and private(node.attr):
                value = node.value
                if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                    continue
                if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                        and value.func.id == "super":
                    if node.attr not in own:
                        problems.append(f"{where}: {m.name} overrides the private "
                                        f"{ast.unparse(node)} of a base class it does not own")
                    continue
                if node.attr not in own and node.attr not in ALLOWED_ATTRIBUTES:
                    problems.append(f"{where}: {m.name} reads {ast.unparse(node)}, a private "
                                    "name it does not define")
    problems += cycles(modules)
    return problems


def cycles(modules: dict[str, Module]) -> list[str]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[str] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(modules[v].imports):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append("import cycle: " + " <-> ".join(sorted(group)))

    sys.setrecursionlimit(10_000)
    for name in sorted(modules):
        if name not in index:
            visit(name)
    return found


def main(argv: list[str]) -> int:
    """Check the packages named in ``argv``; print problems; 1 if any."""
    problems = check(load(argv or ["mpitrain", "benchmarks"]))
    for line in problems:
        print(line)
    print(f"lint_imports: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
