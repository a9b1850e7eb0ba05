"""The package layout: imports point down the stages, and no module imports itself back through others.

Every `import`/`from ... import` of a `dspark_hf` module counts, at module level or inside a function (a
function-level import that hides an upward arrow is still an upward arrow). The stages, bottom first:

    _version, _paths, _threads,
    _transformers,                    helpers that import nothing of ours
    extras
    model/                            the draft model, its formats and Hub helpers
    kernels/                          the target's CPU backend (kernel modes, exact kernels, packing): it swaps
                                      the draft's layers too, so it sits above model/
    scheduling/, default_model        policies/SPS/calibration; the offline default target and shipped drafts
    decoding/                         the draft round, the generate() adapter, the engine
    train/, evaluation/               on top of the model and decoding
    demo; the root (public API)       the Gradio app; `dspark_hf/__init__.py`
    commands/                         the `dspark` subcommands, on top of the public API
    cli                               the `dspark` entry point
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "dspark_hf"

STAGE = {
    "_version": 0,
    "_paths": 0,
    "_threads": 0,
    "_transformers": 0,
    "extras": 0,
    "model": 1,
    "kernels": 2,  # the target's CPU backend; it recognises the draft's layers by type, so it sits above model/
    "scheduling": 3,
    "default_model": 3,
    "decoding": 4,
    "train": 5,
    "evaluation": 5,
    "demo": 6,
    "serve": 6,  # the HTTP server: an app on the engine, like the demo
    "": 7,  # dspark_hf/__init__.py: the public API imports every stage below it
    "commands": 8,  # `dspark ...` subcommands may use the public API
    "cli": 9,  # the entry point, on top of its subcommands
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        parts = importer.split(".")
        if not is_package:
            parts.pop()
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    # `from . import x` may name a module: count both the base and base.x
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module → the `dspark_hf` modules it imports (resolved to modules that exist)."""
    files = {_module_name(p): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                candidates = _resolve(name, path.name == "__init__.py", node)
            else:
                continue
            targets.update(c for c in candidates if c in files and c != name)
        graph[name] = targets
    return graph


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Edges that cross units and do not point to a strictly lower stage."""
    bad = []
    for src, targets in graph.items():
        for dst in targets:
            a, b = _unit(src), _unit(dst)
            if a == b:
                continue
            if a not in STAGE or b not in STAGE:
                bad.append(f"{src} -> {dst} (unit without a stage: add it to STAGE)")
            elif STAGE[b] >= STAGE[a]:
                bad.append(f"{src} (stage {STAGE[a]}) -> {dst} (stage {STAGE[b]})")
    return sorted(bad)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_graph_sees_the_package():
    graph = import_graph()
    assert "dspark_hf.decoding.generation" in graph
    # function-level imports count too
    assert "dspark_hf.model.modeling" in graph["dspark_hf.default_model"]
    assert "dspark_hf.model.modeling" in graph["dspark_hf"]


def test_no_import_cycle():
    assert import_cycles(import_graph()) == []


def test_imports_point_down_the_stages():
    assert upward_imports(import_graph()) == []


def test_every_unit_has_a_stage():
    units = {_unit(m) for m in import_graph()}
    assert units <= set(STAGE), f"units without a stage: {sorted(units - set(STAGE))}"


@pytest.mark.parametrize(
    ("extra_edge", "kind"),
    [
        (("dspark_hf.model.modeling", "dspark_hf.default_model"), "upward"),  # model reaching into an app helper
        (("dspark_hf.scheduling.sps", "dspark_hf.decoding.engine"), "upward"),
        (("dspark_hf.model.modeling", "dspark_hf.kernels.ops"), "upward"),  # the draft's math reaching the kernels
        (("dspark_hf.model.formats", "dspark_hf.model.modeling"), "cycle"),  # the old modeling <-> convert tie
    ],
)
def test_checks_have_power(extra_edge, kind):
    """Negative control: putting back one bad arrow makes the checks fail."""
    graph = {k: set(v) for k, v in import_graph().items()}
    src, dst = extra_edge
    graph[src].add(dst)
    if kind == "upward":
        assert any(line.startswith(src) for line in upward_imports(graph))
    else:
        assert any(src in c and dst in c for c in import_cycles(graph))


#: the test folders, one per stage of the package (plus the apps on top and the project-wide checks)
TEST_FOLDERS = ("model", "kernels", "scheduling", "decoding", "evaluation", "train", "serve", "apps", "project")


def test_tests_are_grouped_by_stage():
    """Every test file sits in a stage folder, named for the part of the package it tests; `tests/` itself holds
    only the shared set-up (`conftest.py` and the helper modules the stage folders import)."""
    tests = PACKAGE.parents[1] / "tests"
    loose = sorted(p.name for p in tests.glob("test_*.py"))
    assert not loose, f"test files outside a stage folder: {loose}; move each into one of {TEST_FOLDERS}"
    folders = sorted(p.name for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    assert folders == sorted(TEST_FOLDERS), folders
