"""The package's import graph, read from the source with ``ast`` (nothing is imported): which modules import
which, the imports made inside functions, and the cycles. ``tests/test_architecture.py`` checks the layering
on it; ``python tests/import_graph.py`` prints the counts the architecture page quotes."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dbr_quant"


@dataclass(frozen=True)
class LocalImport:
    """An import of one of the package's own modules made inside a function."""

    module: str
    line: int
    target: str
    commented: bool  # a comment on the line or the line above says why


@dataclass
class ImportGraph:
    modules: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=dict)  # module -> modules it imports (any scope)
    local_imports: list[LocalImport] = field(default_factory=list)

    def top_level_modules(self) -> list[str]:
        return sorted(m for m, p in self.modules.items() if p.parent == PACKAGE and p.name != "__init__.py")

    def cycles(self) -> list[list[str]]:
        """Strongly connected groups of more than one module (a package ``__init__`` re-exporting its
        children is not a cycle)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        on_stack: set[str] = set()
        found: list[list[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            on_stack.add(v)
            for w in self.edges.get(v, ()):
                if self.modules[w].name == "__init__.py" or self.modules[v].name == "__init__.py":
                    continue
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
                    found.append(sorted(group))

        for m in sorted(self.modules):
            if m not in index:
                visit(m)
        return found


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """The package modules an import statement loads (``from pkg import mod`` names the module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            raise AssertionError("relative import: ruff's TID252 bans them")
        base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules:
            out.append(name)
    return out


def read_graph() -> ImportGraph:
    modules = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    graph = ImportGraph(modules)
    for name, path in modules.items():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                       for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        type_only = {id(n) for i in ast.walk(tree) if isinstance(i, ast.If) and "TYPE_CHECKING" in ast.unparse(i.test)
                     for n in ast.walk(i)}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)) or id(node) in type_only:
                continue
            targets = [t for t in _targets(node, modules) if t != name]
            if not targets:
                continue
            graph.edges.setdefault(name, set()).update(targets)
            if id(node) in in_function:
                above = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                commented = "#" in lines[node.lineno - 1] or above.startswith("#")
                graph.local_imports.append(LocalImport(name, node.lineno, targets[0], commented))
    return graph


if __name__ == "__main__":
    g = read_graph()
    print(f"modules directly under dbr_quant/: {len(g.top_level_modules())} {g.top_level_modules()}")
    print(f"imports of the package's own modules inside functions: {len(g.local_imports)}")
    for li in g.local_imports:
        print(f"    {li.module}:{li.line} -> {li.target}{'' if li.commented else '  (no comment says why)'}")
    print(f"import cycles: {len(g.cycles())}")
    for c in g.cycles():
        print("    " + " <-> ".join(c))
