"""No module of tokenmill imports itself through others, not even from inside a function.

The layer contracts (test_layers.py) let modules of one layer import each other freely, and a
circle there still ties its modules into one piece that loads, tests and changes together; a
lazy import only hides it from Python's import order. grimp, import-linter's graph library, reads
every import statement (those inside functions too) of the package as assembled in a temporary
directory (test_layers.assemble), and each strongly connected component of that graph is a circle.
Modules loaded by name (importlib.import_module: bench scenarios, engine backends) are not seen.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from test_layers import assemble

# A circle that cannot be cut yet, as its sorted modules, and why. An entry whose circle is gone
# fails the test too, so that it leaves the list.
ALLOWED: dict[tuple[str, ...], str] = {}

GRAPH = (
    "import json, grimp\n"
    "g = grimp.build_graph('tokenmill', include_external_packages=False, cache_dir=None)\n"
    "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in sorted(g.modules)}))\n"
)


def import_graph(root: Path) -> dict[str, list[str]]:
    """Each module of the package under ``root`` and the modules it imports (in a subprocess, so that
    the assembled copy, not the repository's links, is the tokenmill imported)."""
    result = subprocess.run(
        [sys.executable, "-c", GRAPH],
        cwd=root,
        env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def cycles(graph: dict[str, list[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's, iterative: no recursion
    limit), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        path = [(start, iter(graph[start]))]
        while path:
            node, successors = path[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    path.append((nxt, iter(graph.get(nxt, ()))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:  # every successor done
                path.pop()
                if path:
                    low[path[-1][0]] = min(low[path[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(tuple(sorted(component)))
    return sorted(found)


def describe(graph: dict[str, list[str]], cycle: tuple[str, ...]) -> str:
    """The circle's modules and the imports between them, one a line."""
    inside = set(cycle)
    arrows = [f"    {m} -> {n}" for m in cycle for n in graph[m] if n in inside]
    return f"{len(cycle)} modules: {', '.join(cycle)}\n" + "\n".join(arrows)


def test_no_import_cycles(tmp_path):
    graph = import_graph(assemble(tmp_path))
    assert len(graph) > 100, sorted(graph)  # the mapped folders were found
    found = cycles(graph)
    new = [c for c in found if c not in ALLOWED]
    assert not new, "import cycles:\n" + "\n".join(describe(graph, c) for c in new)
    gone = [c for c in ALLOWED if c not in found]
    assert not gone, f"allowed cycles that no longer exist, to remove from ALLOWED: {gone}"


def test_an_import_inside_a_function_closing_a_circle_is_found(tmp_path):
    root = assemble(tmp_path)
    protocol = root / "tokenmill" / "scheduler_client" / "protocol.py"  # client.py imports it
    protocol.write_text(
        protocol.read_text() + "\n\ndef _circle():\n    from tokenmill.scheduler_client import client\n"
    )
    graph = import_graph(root)
    assert ("tokenmill.scheduler_client.client", "tokenmill.scheduler_client.protocol") in cycles(graph)
    assert "tokenmill.scheduler_client.protocol -> tokenmill.scheduler_client.client" in describe(
        graph, ("tokenmill.scheduler_client.client", "tokenmill.scheduler_client.protocol")
    )


def test_cycles_finds_each_component():
    graph = {"a": ["b"], "b": ["c"], "c": ["a", "d"], "d": ["e"], "e": ["d"], "f": ["a"], "g": []}
    assert cycles(graph) == [("a", "b", "c"), ("d", "e")]
