"""Imports point down: no cycles between modules of ``fulcrum``, and no package imports one above it.

Every import is read with ``ast``, including those inside functions (a deferred import is still a
dependency: it only hides the cycle from the interpreter)."""

from __future__ import annotations

import ast
from pathlib import Path

import fulcrum

SRC = Path(fulcrum.__file__).parent

# DESIGN.md: entrypoints -> engine -> scheduler / worker -> model -> attention / quant -> kernels
# -> kv_cache, config, the shared request and message types. A module may import its own rank or
# lower; the rank table names every top-level package and module of ``fulcrum``.
RANKS: dict[str, int] = {
    "entrypoints": 6,
    "bench": 6,
    "analyze": 6,
    "router": 6,
    "ray": 6,
    "engine": 5,
    "scheduler": 4,
    "worker": 4,
    "spec_decode": 4,
    "structured": 4,
    "model": 3,
    "lora": 3,
    "distributed": 3,
    "attention": 2,
    "quant": 2,
    "kernels": 1,
    "kv_cache": 0,
    "config": 0,
    "envs": 0,
    "request": 0,
    "protocol": 0,
    "sampling_params": 0,
    "tokenizer": 0,
}
# ``fulcrum`` itself is the public Python API (``LLM``, ``SamplingParams``): the entrypoints' rank.
TOP_RANK = 6


def _module_name(path: Path) -> str:
    parts = ["fulcrum", *path.relative_to(SRC).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The ``fulcrum`` modules ``path`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import name`` imports the module ``pkg.name`` if there is one, else
            # ``name`` from ``pkg`` itself
            targets = [
                f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules)
    found.discard(name)
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(paths)
    return {name: _imports(p, name, modules) for name, p in paths.items()}


def _rank(module: str) -> int:
    parts = module.split(".")
    return TOP_RANK if len(parts) == 1 else RANKS[parts[1]]


def test_every_package_has_a_rank():
    graph = _graph()
    missing = {m.split(".")[1] for m in graph if "." in m} - set(RANKS)
    assert not missing, f"give these a rank in RANKS: {sorted(missing)}"


def test_no_package_imports_one_above_it():
    graph = _graph()
    upward = sorted(
        f"{m} ({_rank(m)}) imports {d} ({_rank(d)})"
        for m, deps in graph.items()
        for d in deps
        if _rank(d) > _rank(m)
    )
    assert not upward, "\n".join(upward)


def test_the_analyzer_does_not_import_the_server_or_the_benchmarks():
    graph = _graph()
    wrong = sorted(
        f"{m} imports {d}"
        for m, deps in graph.items()
        if m.startswith("fulcrum.analyze")
        for d in deps
        if d.startswith(("fulcrum.entrypoints", "fulcrum.bench"))
    )
    assert not wrong, "\n".join(wrong)


def test_the_runner_never_sees_a_request():
    """The scheduler's output carries what the runner needs; ``Request`` stays the scheduler's."""
    graph = _graph()
    users = sorted(m for m, deps in graph.items() if any(d.endswith(".request") for d in deps))
    assert users and all(m.startswith("fulcrum.scheduler") for m in users), users


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_a_cycle_and_an_upward_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _rank("fulcrum.kernels.gemv") < _rank("fulcrum.model.llama")
