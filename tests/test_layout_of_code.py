"""Floors, not circles (DESIGN.md, principle 11), read off the source with `ast`.

Every import of a fivecut module counts, at the top of a file or inside a function: an import
deferred into a function still ties the two files. No file may reach itself through imports. An
import inside a function is allowed only in a torch-free entry point (the CLI, and `checks`, which
the CLI imports at its top), and only of a module that loads torch or matplotlib, which is the one
reason to defer it; outside the CLI (whose docstring says so for all of them) it says why in a comment.
"""

import ast
import functools
import subprocess
import sys
from pathlib import Path

import fivecut

PACKAGE = Path(fivecut.__file__).parent
HEAVY = ("torch", "matplotlib")  # what a torch-free entry point must not load when imported
ENTRY_POINTS = ("fivecut.cli", "fivecut.checks")  # torch-free when imported; they defer what loads torch


def module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def with_packages(name: str) -> set[str]:
    """`fivecut.a.b` and the packages importing it runs first (`fivecut.a`, `fivecut`)."""
    parts = name.split(".")
    return {".".join(parts[: i + 1]) for i in range(len(parts))}


def imported(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The modules an import statement loads (absolute imports; fivecut has no relative ones)."""
    assert not getattr(node, "level", 0), f"relative import at line {node.lineno}"
    if isinstance(node, ast.Import):
        names = {alias.name for alias in node.names}
    else:  # `from fivecut.x import y` loads fivecut.x and, where y is a submodule, fivecut.x.y
        names = {node.module} | {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
    return set().union(*(with_packages(n) for n in names))


@functools.cache
def imports(module: str) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement of `module`, with whether it sits inside a function."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return  # never executed
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append((node, in_function))
        inside = in_function or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(ast.parse(MODULES[module].read_text()), False)
    return found


def edges(module: str, at_import: bool = False) -> set[str]:
    """The modules `module` imports (`at_import`: only those loaded when it is imported, no function's)."""
    out = set()
    for node, in_function in imports(module):
        if not (at_import and in_function):
            out |= imported(node)
    return out - {module}


def reachable(start: str, graph: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += graph.get(name, ())
    return seen


def circles(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Each module that reaches itself, with the modules it imports that lead back to it."""
    out = {}
    for module in graph:
        back = sorted(n for n in graph[module] if module in reachable(n, graph) | {n})
        if back:
            out[module] = back
    return out


@functools.cache
def loads_heavy(module: str) -> bool:
    """Whether importing `module` loads torch or matplotlib (itself, or any module it imports at import)."""
    graph = {m: edges(m, at_import=True) for m in MODULES}
    return any(name.split(".")[0] in HEAVY for name in reachable(module, graph))


def test_no_import_circle():
    graph = {m: {n for n in edges(m) if n in MODULES} for m in MODULES}
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(f"{m} -> {', '.join(ns)}" for m, ns in found.items())


def test_function_level_imports_only_keep_an_entry_point_free_of_torch():
    wrong = []
    for module in MODULES:
        lines = MODULES[module].read_text().splitlines()
        for node, in_function in imports(module):
            ours = sorted(n for n in imported(node) if n in MODULES and n != "fivecut")
            if not in_function or not ours:
                continue
            where = f"{MODULES[module].relative_to(PACKAGE.parent)}:{node.lineno} ({ast.unparse(node)})"
            if module not in ENTRY_POINTS:
                wrong.append(f"{where}: inside a function outside a torch-free entry point; import it at the top")
            elif not any(loads_heavy(n) for n in ours):
                wrong.append(f"{where}: loads neither torch nor matplotlib; import it at the top")
            elif module != "fivecut.cli" and "#" not in lines[node.lineno - 1]:
                wrong.append(f"{where}: say in a comment why it is imported inside the function")
    assert not wrong, "\n".join(wrong)


def test_entry_points_load_no_torch_when_imported():
    for module in ENTRY_POINTS:
        assert not loads_heavy(module), f"{module} loads torch or matplotlib when imported"
    code = "import sys, fivecut.cli; print(sorted(m for m in ('torch', 'matplotlib') if m in sys.modules))"
    run = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "[]", run.stdout + run.stderr
