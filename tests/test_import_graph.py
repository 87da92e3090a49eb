"""The packages' import graph has no circles, and imports inside functions say why.

A module-level import is the default. An import inside a function is kept
only where it keeps `--help` instant or an optional dependency lazy, and it
says so in a comment that contains "lazy" (on its line or on the comment
lines right above its block of imports), e.g. `# lazy: --help stays instant`.

The graph counts every import of an `mg` module, inside functions too (a
function-level import does not break a circle, it hides one), except those
under `if TYPE_CHECKING:`. `from pkg import name` is an edge to `pkg.name`
when that is a module and to `pkg` (its `__init__`) otherwise, and importing
`a.b.c` is an edge to the packages `a.b` and `a` too (their `__init__` runs
first). Read from the AST: nothing is imported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files() -> dict[str, Path]:
    """Every `mg.*` module of the workspace, by its dotted name."""
    modules = {}
    for path in sorted(ROOT.glob("packages/*/src/mg/**/*.py")):
        src = next(p for p in path.parents if p.name == "src")
        parts = path.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _under_type_checking(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def _in_function(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return True
    return False


def _imports(
    name: str, path: Path
) -> Iterator[tuple[ast.Import | ast.ImportFrom, list[str], bool]]:
    """(node, imported module names, inside a function) for each import statement."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if _under_type_checking(node, parents):
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        yield node, targets, _in_function(node, parents)


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node, targets, _ in _imports(name, path):
            for target in targets:
                # `from pkg import a, b`: the package itself only when a name is no module
                names = targets[:-1]
                from_modules = isinstance(node, ast.ImportFrom) and names
                if from_modules and target == targets[-1] and all(t in modules for t in names):
                    continue
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
                # importing a.b.c runs a/__init__ and a/b/__init__ first, unless the
                # importer is inside them (then they are already being imported)
                parent = target.rpartition(".")[0]
                while parent:
                    if parent in modules and not name.startswith(parent + "."):
                        graph[name].add(parent)
                    parent = parent.rpartition(".")[0]
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unexplained_function_imports() -> list[str]:
    """`file:line` of each import inside a function with no "lazy" comment."""
    missing = []
    for name, path in module_files().items():
        lines = path.read_text().splitlines()
        found = list(_imports(name, path))
        starts = {
            row: node.lineno
            for node, _, _ in found
            for row in range(node.lineno, (node.end_lineno or node.lineno) + 1)
        }
        for node, _, in_function in found:
            if not in_function:
                continue
            explained = "# lazy" in lines[node.lineno - 1]
            above = node.lineno - 1  # 1-based number of the line above
            while not explained and above >= 1:
                text = lines[above - 1].strip()
                if text.startswith("#"):
                    explained = "lazy" in text
                    above -= 1
                elif above in starts:  # another import of the block (maybe several lines)
                    explained = "# lazy" in lines[starts[above] - 1]
                    above = starts[above] - 1
                else:
                    break
            if not explained:
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return missing


def test_no_import_circles() -> None:
    found = cycles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_imports_inside_functions_say_why() -> None:
    missing = unexplained_function_imports()
    assert not missing, (
        "imports inside functions without a '# lazy: why' comment "
        "(move them to the top of the module, or say why they wait):\n" + "\n".join(missing)
    )
