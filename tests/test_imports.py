"""The project's import graph, read from the source with `ast`: imports point one way and go round no circle.

Every .py file of broker/, worker/, client/ and cuda_state/ is parsed; every import counts, absolute or relative,
at module level, inside functions and under `if TYPE_CHECKING:` (`from X import Y` is an import of the module X.Y
when there is one, else of X). Library code is everything but the bench/ subpackages and the demos (on_top): those sit on top
and may import any package's library.

    client       -> client, broker.common (the protocol, keys, logs, ...)
    worker       -> worker, broker.common, cuda_state
    cuda_state   -> cuda_state
    broker       -> broker (broker.common among it)
    broker.common -> broker.common

Library code never imports a module ON_TOP, and library modules import one another in no circle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("broker", "worker", "client", "cuda_state")
# Who may import whom: the most specific prefix of a module names its layer.
ALLOWED: Mapping[str, tuple[str, ...]] = {
    "broker.common": ("broker.common",),
    "broker": ("broker",),
    "client": ("client", "broker.common"),
    "worker": ("worker", "broker.common", "cuda_state"),
    "cuda_state": ("cuda_state",),
}
DEMOS = frozenset({"client.demo", "worker.demo"})
# Worker-internal circles being removed by the worker rewrite on another branch (flip the xfail when merged).
@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module
    where: str  # path:line of the import statement

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}"


# -- the graph ----------------------------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file of the packages."""
    return {module_name(path, root): path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))}


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[tuple[str, list[str], int]]:
    """(module imported from, names imported from it, line) for every import statement, relative ones resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            yield base, [alias.name for alias in node.names], node.lineno


def imports(root: Path) -> list[Import]:
    """Every import of a project module by a project module."""
    files = project_files(root)
    found = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for base, names, line in imported_names(tree, module, path.name == "__init__.py"):
            if base.split(".")[0] not in PACKAGES:
                continue
            where = f"{path.relative_to(root)}:{line}"
            targets = {f"{base}.{name}" if f"{base}.{name}" in files else base for name in names} or {base}
            found += [Import(module, target, where) for target in sorted(targets)]
    return found


def is_bench(module: str) -> bool:
    return "bench" in module.split(".")[1:]


def on_top(module: str) -> bool:
    """Benchmarks and tools, and demos: not library code."""
    return is_bench(module) or module in DEMOS


def layer(module: str) -> str:
    return max((prefix for prefix in ALLOWED if within(module, prefix)), key=len)


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# -- the rules ------------------------------------------------------------------------------------------------


def missing(edges: Iterable[Import], modules: Iterable[str]) -> list[str]:
    known = set(modules)
    return sorted(f"{edge}, which is no module of the project" for edge in edges if edge.target not in known)


def wrong_way(edges: Iterable[Import]) -> list[str]:
    """Library imports against ALLOWED."""
    problems = []
    for edge in edges:
        if on_top(edge.source):
            continue
        allowed = ALLOWED[layer(edge.source)]
        if not any(within(edge.target, prefix) for prefix in allowed):
            problems.append(f"{edge}: {layer(edge.source)} may import only {', '.join(allowed)}")
    return sorted(problems)


def library_on_top(edges: Iterable[Import]) -> list[str]:
    """Library code that imports a bench module or a demo."""
    return sorted(f"{edge}: library code never imports a bench module or a demo"
                  for edge in edges if not on_top(edge.source) and on_top(edge.target))


def cycles(edges: Iterable[Import]) -> list[str]:
    """One circle (the shortest through its first module) per strongly connected set of library modules."""
    graph: dict[str, dict[str, Import]] = {}
    for edge in edges:
        if not on_top(edge.source) and not on_top(edge.target):
            graph.setdefault(edge.source, {}).setdefault(edge.target, edge)
    found = []
    for members in strongly_connected(graph):
        start = min(members)
        loop = shortest_loop(graph, start, members)
        if loop is None:
            continue
        links = [graph[a][b] for a, b in zip(loop, loop[1:], strict=False)]
        found.append(f"import cycle: {' -> '.join(loop)} ({', '.join(link.where for link in links)})")
    return sorted(found)


def strongly_connected(graph: Mapping[str, Mapping[str, Import]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                components.append(component)
    return components


def shortest_loop(graph: Mapping[str, Mapping[str, Import]], start: str, members: set[str]) -> list[str] | None:
    """start -> ... -> start within `members` (breadth first), or None when there is none (a lone module)."""
    paths = {start: [start]}
    queue = [start]
    for node in queue:
        for child in sorted(graph.get(node, {})):
            if child == start:
                return [*paths[node], start]
            if child in members and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    return None


# -- the project ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def edges() -> list[Import]:
    return imports(ROOT)


def test_every_import_of_the_project_finds_its_module(edges: list[Import]) -> None:
    assert missing(edges, project_files(ROOT)) == []


def test_library_imports_point_one_way(edges: list[Import]) -> None:
    assert wrong_way(edges) == []


def test_library_code_never_imports_a_bench_module_or_a_demo(edges: list[Import]) -> None:
    assert library_on_top(edges) == []


def test_no_import_cycles_outside_worker(edges: list[Import]) -> None:
    assert [c for c in cycles(edges) if not c.startswith("import cycle: worker.")] == []


def test_no_import_cycles_inside_worker(edges: list[Import]) -> None:
    assert [c for c in cycles(edges) if c.startswith("import cycle: worker.")] == []


# -- the rules themselves, on a made-up project ---------------------------------------------------------------


def write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


MADE_UP = {
    "broker/__init__.py": "",
    "broker/common/__init__.py": "",
    "broker/common/protocol.py": "from broker.common import fields\n",
    "broker/common/fields.py": "from broker import router  # wrong way\n",
    "broker/router.py": "from .metrics import Counters\n",
    "broker/metrics.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from broker.router import Router\n",
    "client/__init__.py": "from client.sync import Client\n",
    "client/sync.py": "from broker.common import protocol\n\ndef late():\n    from .bench import gpu\n",
    "client/bench/__init__.py": "",
    "client/bench/gpu.py": "import worker.engine\nfrom ..sync import Client\n",
    "cuda_state/__init__.py": "import worker.nothing\n",
    "worker/__init__.py": "",
    "worker/engine.py": "from cuda_state import SessionTable\nfrom client import Client\n",
}


@pytest.fixture
def made_up(tmp_path: Path) -> list[Import]:
    write(tmp_path, MADE_UP)
    return imports(tmp_path)


def test_imports_are_read_absolute_relative_and_inside_functions(made_up: list[Import]) -> None:
    assert sorted(str(e) for e in made_up if e.source.startswith("client.")) == [
        "client/bench/gpu.py:1: client.bench.gpu imports worker.engine",
        "client/bench/gpu.py:2: client.bench.gpu imports client.sync",
        "client/sync.py:1: client.sync imports broker.common.protocol",
        "client/sync.py:4: client.sync imports client.bench.gpu",
    ]


def test_each_rule_names_the_offending_import(made_up: list[Import], tmp_path: Path) -> None:
    assert missing(made_up, project_files(tmp_path)) == [
        "cuda_state/__init__.py:1: cuda_state imports worker.nothing, which is no module of the project",
    ]
    assert wrong_way(made_up) == [
        "broker/common/fields.py:1: broker.common.fields imports broker.router: broker.common may import only broker.common",
        "cuda_state/__init__.py:1: cuda_state imports worker.nothing: cuda_state may import only cuda_state",
        "worker/engine.py:2: worker.engine imports client: worker may import only worker, broker.common, cuda_state",
    ]
    assert library_on_top(made_up) == [
        "client/sync.py:4: client.sync imports client.bench.gpu: library code never imports a bench module or a demo",
    ]
    assert cycles(made_up) == [  # under TYPE_CHECKING too
        "import cycle: broker.metrics -> broker.router -> broker.metrics (broker/metrics.py:3, broker/router.py:1)",
    ]
