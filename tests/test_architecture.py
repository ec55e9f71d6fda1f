"""The package's shape, checked from its source: layers, import cycles, file sizes, and tests on public names only.

The layers follow the data path (docs/design.md, "Module layout"). A module may
import from lower layers and from its own subpackage; nothing imports upwards
and the import graph (function-level imports included) has no cycle.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dualkv_compile"

# Lowest first. A module of layer i may import modules of layers < i and of its own subpackage.
LAYERS = [
    {"layout", "report"},  # the packed layout (segments: the kernels' ABI) and the per-graph report
    {"kernels"},  # math only
    {"ops"},  # the dualkv:: torch.library ops over the kernels
    {"config"},  # validates attention_backend against ops.attention.BACKENDS
    {"graph"},  # the graph vocabulary: Refusal, node meta behind accessors, copying, matchers
    {"normalize"},  # passes that put a Dynamo graph into the form the analysis expects
    {"analysis"},
    {"rewrite"},
    {"plan"},  # compile-time work finished before the runner: layout inputs, padding reads, outputs, compile route
    {"runtime"},  # per-call work only
    {"distributed"},
    {"backend"},
    {"policy_loss", "explain", "shared_batch", "schedule"},  # user-facing entry points; schedule: step schedules
    {"integrations"},  # one-line ways into trainers, over backend and config
    {"__init__"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _import_module_target(name: str, is_package: bool, node: ast.AST) -> str | None:
    """The module an ``importlib.import_module("x")`` / ``import_module(".x", __package__)`` call loads, else None."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    target = node.args[0].value
    if called != "import_module" or not isinstance(target, str):
        return None
    level = len(target) - len(target.lstrip("."))
    return _resolve(name, is_package, level, target[level:] or None) if level else target


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """Package modules ``name`` imports anywhere in its source (function-level imports and ``importlib`` calls
    with a literal name included: a registry that loads its rule modules by name is an import too)."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        loaded = _import_module_target(name, path.name == "__init__.py", node)
        if loaded is not None:
            targets = [loaded]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path.name == "__init__.py", node.level, node.module)
            # `from pkg import sub` names a module when pkg.sub is one.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def _layer_key(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer():
    missing = sorted({_layer_key(m) for m in _modules()} - set(RANK))
    assert not missing, f"add these to LAYERS: {missing}"


def test_graph_passes_follow_the_data_path():
    """normalize -> analysis -> rewrite -> plan -> runtime (docs/design.md, "Architecture"): each may import the ones
    before it only."""
    path = ["layout", "graph", "normalize", "analysis", "rewrite", "plan", "runtime"]
    assert all(part in RANK for part in path), f"missing from LAYERS: {[p for p in path if p not in RANK]}"
    assert [RANK[part] for part in path] == sorted({RANK[part] for part in path}), [RANK[part] for part in path]


def test_runtime_reads_at_most_two_analysis_modules():
    """runtime/ does per-call work: what it needs from the analysis (the padding reads, side graphs, token inputs)
    is finished at compile time in plan/, so the runtime imports at most two ``analysis`` modules."""
    graph = _graph()
    read = {}
    for importer, targets in graph.items():
        if _layer_key(importer) == "runtime":
            for target in targets:
                if _layer_key(target) == "analysis":
                    read.setdefault(target, []).append(importer)
    assert len(read) <= 2, "runtime imports these analysis modules (move the compile-time part to plan/):\n" + "\n".join(
        f"{target} <- {', '.join(sorted(importers))}" for target, importers in sorted(read.items())
    )


def test_no_import_from_a_lower_layer_to_a_higher_one():
    bad = []
    for importer, targets in _graph().items():
        for target in targets:
            a, b = _layer_key(importer), _layer_key(target)
            if a != b and RANK[b] >= RANK[a]:
                bad.append(f"{importer} -> {target}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in graph[node]:
            if node.startswith(nxt + "."):
                continue  # a module reading its own package's __init__, which re-exports its submodules

            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])
    return cycles


def test_no_import_cycles():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


KERNEL_BACKENDS = ("flex", "triton", "gluon", "common")


def test_kernel_backends_share_through_common_only():
    """``kernels/<backend>/`` import no other backend's package; what the Triton and Gluon kernels share lives in
    ``kernels/common``, which imports none of them."""
    bad = []
    for importer, targets in _graph().items():
        parts = importer.split(".")
        if len(parts) < 3 or parts[1] != "kernels" or parts[2] not in KERNEL_BACKENDS:
            continue
        for target in targets:
            tparts = target.split(".")
            if len(tparts) > 2 and tparts[1] == "kernels" and tparts[2] in KERNEL_BACKENDS and tparts[2] != parts[2] \
                    and tparts[2] != "common":
                bad.append(f"{importer} -> {target}")
    assert not bad, "kernel backends importing each other (move what they share to kernels/common):\n" + "\n".join(bad)


def test_a_cycle_through_importlib_is_seen():
    """The checker on a deliberately cyclic fixture: ``a`` loads ``b`` with ``importlib.import_module(".b",
    __package__)``, ``b`` imports ``a`` back (the shape the rule registry had)."""
    root = ROOT / "tests" / "fixtures" / "cyclic_pkg"
    modules = {"cyclic_pkg": root / "__init__.py", "cyclic_pkg.a": root / "a.py", "cyclic_pkg.b": root / "b.py"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph["cyclic_pkg.a"] == {"cyclic_pkg.b"} and graph["cyclic_pkg.b"] == {"cyclic_pkg.a"}
    assert _cycles(graph) == [["cyclic_pkg.a", "cyclic_pkg.b", "cyclic_pkg.a"]]


def test_file_sizes():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert sizes["dualkv_compile/backend.py"] < 200, "backend.py is the pipeline only"
    big = {p: n for p, n in sizes.items() if n > 450}
    assert not big, f"files over 450 lines: {big}"


def _test_files():
    return sorted((ROOT / "tests").rglob("*.py"))


@pytest.mark.parametrize("path", _test_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_tests_use_public_names_only(path):
    """No ``from dualkv_compile... import _x`` and no ``module._x`` on a module of the package."""
    modules = _modules()
    tree = ast.parse(path.read_text())
    aliases = set()
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("dualkv_compile"):
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dualkv_compile"):
            for a in node.names:
                if a.name.startswith("_"):
                    bad.append(f"line {node.lineno}: from {node.module} import {a.name}")
                if f"{node.module}.{a.name}" in modules:
                    aliases.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                bad.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not bad, "private names of the package used by a test:\n" + "\n".join(bad)


def test_node_meta_is_read_and_written_in_one_module():
    """Every node-meta key is defined in ``graph/meta.py`` and reached through its accessors: no ``x.meta`` elsewhere."""
    bad = []
    for name, path in _modules().items():
        if name == "dualkv_compile.graph.meta":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "meta":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "node meta outside dualkv_compile/graph/meta.py (add an accessor there):\n" + "\n".join(bad)
