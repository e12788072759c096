"""weight_sync.reload has no import circles, counting imports made only for type checking."""

from __future__ import annotations

import ast
from pathlib import Path

import weight_sync.reload

PACKAGE = "weight_sync.reload"


def _imports(path: Path) -> set[str]:
    """Modules of the package that ``path`` imports (anywhere in the file, lazy and TYPE_CHECKING too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE + "."):
            out.add(node.module.removeprefix(PACKAGE + ".").split(".")[0])
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_reload_modules_import_each_other_without_circles() -> None:
    root = Path(weight_sync.reload.__file__).parent
    graph = {f.stem: _imports(f) for f in root.glob("*.py") if f.stem != "__init__"}
    assert "session" in graph and "state" in graph
    assert _cycle(graph) is None, f"import circle: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
