"""The shape of the package, read from its source with `ast` (nothing is imported): no import circles anywhere in
src/ (imports inside functions count too), options.py at the bottom, the environment read only where a location or
a launcher's setting comes from, and no environment read in the C++ kernels. The checker is shown to find a circle
in a package made to have one."""
from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
# where the environment may be read, and why: locations and launchers, never how to compute (that is dspark.Options)
ENVIRONMENT_READERS = {
    "dspark/cache.py": "the cache folder ($DSPARK_CACHE, $XDG_CACHE_HOME)",
    "dspark/kernels/skinny.py": "the C++ compiler that builds the kernels ($CXX)",
    "dspark/train/prompts.py": "the default data folder of the training commands ($DSPARK_DATA)",
    "dspark/train/trainer.py": "torchrun's WORLD_SIZE",
}


def module_graph(src: Path) -> dict[str, set[str]]:
    """module -> the modules of the same tree it imports (at any depth of its code)."""
    def name_of(path: Path) -> str:
        parts = path.relative_to(src).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(p): p for p in src.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                found |= {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_in_src():
    assert circles(module_graph(SRC)) == []


def test_the_check_finds_a_circle(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "a.py").write_text("from .sub import b\n")
    (package / "sub" / "b.py").write_text("def f():\n    from ..c import g\n")
    (package / "c.py").write_text("from . import a\n")
    assert circles(module_graph(tmp_path)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]


def test_options_sit_at_the_bottom():
    assert module_graph(SRC)["dspark.options"] == set()


def reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for m in graph[todo.pop()] - seen:
            seen.add(m)
            todo.append(m)
    return seen


# each layer and what it must never reach: the kernels know nothing of models; the step's shared types know nothing
# at all; the schedulers see costs and confidences only (profiling, which runs the engine, lives with the engine)
LAYERS = {"dspark.kernels": ("dspark.target", "dspark.layers", "dspark.draft", "dspark.engine", "dspark.schedule"),
          "dspark.layers": ("dspark.target", "dspark.draft", "dspark.engine"),
          "dspark.proposal": ("dspark.",),
          "dspark.schedule": ("dspark.engine", "dspark.target", "dspark.draft", "dspark.kernels"),
          "dspark.target": ("dspark.draft", "dspark.engine", "dspark.schedule", "dspark.serve", "dspark.train")}


def test_each_layer_reaches_only_what_is_below_it():
    graph = module_graph(SRC)
    for layer, forbidden in LAYERS.items():
        for module in (m for m in graph if m == layer or m.startswith(layer + ".")):
            bad = sorted(m for m in reaches(graph, module) if m.startswith(forbidden))
            assert not bad, f"{module} reaches {bad}"


def test_the_environment_is_read_only_for_locations():
    readers = set()
    for path in SRC.rglob("*.py"):
        if re.search(r"os\.environ|getenv\(", path.read_text()):
            readers.add(str(path.relative_to(SRC)))
    assert readers <= set(ENVIRONMENT_READERS), readers - set(ENVIRONMENT_READERS)
    for path in [*SRC.rglob("*.cpp"), *SRC.rglob("*.h")]:
        assert "getenv" not in path.read_text(), path
