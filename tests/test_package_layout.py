"""Layer 1: the layout of ``distcomm``, read from its sources (parsed, never imported: milliseconds).

Its modules import one another in one direction, and the compiled path imports the eager modules, never the
other way (Note [Import direction of the compiled path] in distcomm/_dispatch.py). Every import statement
counts, at module level or inside a function: a function-level import that closes a circle still ties the
modules into one knot; it only postpones the import.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "distcomm"
COMPILED = "distcomm._compile"

# The one import allowed to point back. The eager public functions reach the compiled path through
# distcomm._dispatch.compiled_path(), which imports it inside the function, on the first compile: importing it
# at the top would load torch._dynamo (seconds) on `import distcomm`. This late-binding point is the only
# edge that closes a circle (compiled path -> eager modules -> _dispatch -> compiled path).
LATE_BINDING = {("distcomm._dispatch", "distcomm._compile.path")}


def _modules() -> dict[str, Path]:
    """Dotted name -> source file of every module of the package (a package is named by its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool, modules) -> list[str]:
    """The modules of the package that one import statement of module ``name`` imports."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in modules]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = name.split(".") if is_package else name.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    out = []
    for alias in node.names:
        submodule = f"{base}.{alias.name}"
        if submodule in modules:
            out.append(submodule)
        elif base in modules:  # a name defined in the module (or package) ``base``
            out.append(base)
    return out


def _edges() -> dict[tuple[str, str], set[bool]]:
    """(importer, imported) -> {whether at module level} over every import statement inside ``distcomm``.

    Importing a submodule also runs its packages' ``__init__``; those implicit edges are left out (a
    package re-exporting its submodules is no circle)."""
    modules = _modules()
    edges: dict[tuple[str, str], set[bool]] = {}

    def visit(node: ast.AST, name: str, is_package: bool, top: bool) -> None:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in _targets(node, name, is_package, modules):
                edges.setdefault((name, target), set()).add(top)
        inside = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, name, is_package, top and not inside)

    for name, path in modules.items():
        visit(ast.parse(path.read_text(), filename=str(path)), name, path.name == "__init__.py", True)
    return edges


def _cycles(edges) -> list[list[str]]:
    """One shortest circle a -> ... -> a through every module that lies on one, each circle listed once."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found, seen = [], set()
    for start in sorted(graph):
        paths, visited = [[start]], {start}
        while paths:  # breadth first: the shortest way back to ``start``
            path = paths.pop(0)
            nxt = sorted(graph.get(path[-1], ()))
            if start in nxt:
                cycle = [*path, start]
                if frozenset(path) not in seen:
                    seen.add(frozenset(path))
                    found.append(cycle)
                break
            for b in nxt:
                if b not in visited:
                    visited.add(b)
                    paths.append([*path, b])
    return found


def test_distcomm_has_no_import_cycles():
    """No module of distcomm reaches itself through imports (the late-binding point aside): a circle makes
    import order matter and hides which layer depends on which."""
    edges = _edges()
    assert ("distcomm._compile.ops", "distcomm._all_gather") in edges  # the parser sees the package's imports
    cycles = _cycles({e for e in edges if e not in LATE_BINDING})
    assert not cycles, "import circles in distcomm:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_only_the_late_binding_point_imports_the_compiled_path():
    """Outside distcomm._compile only distcomm._dispatch.compiled_path() imports the compiled path, and only
    inside the function: `import distcomm` must not load torch._dynamo."""
    edges = _edges()
    reaching = {
        (a, b): levels
        for (a, b), levels in edges.items()
        if (b == COMPILED or b.startswith(COMPILED + ".")) and not (a == COMPILED or a.startswith(COMPILED + "."))
    }
    assert set(reaching) == LATE_BINDING, f"eager code imports the compiled path: {sorted(reaching)}"
    assert all(levels == {False} for levels in reaching.values()), "the late-binding import must be in a function"


def test_the_compiled_path_imports_the_eager_modules_at_its_top():
    """The compiled path's imports of the package are all at module level (the direction is plain to read),
    and its custom ops import the eager modules whose raw collectives they run."""
    edges = _edges()
    inside = {(a, b) for (a, b), levels in edges.items() if a.startswith(COMPILED) and False in levels}
    assert not inside, f"function-level imports in the compiled path: {sorted(inside)}"
    for eager in ("_all_gather", "_all_to_all", "_gather_scatter", "ring"):
        assert edges.get(("distcomm._compile.ops", f"distcomm.{eager}")) == {True}
