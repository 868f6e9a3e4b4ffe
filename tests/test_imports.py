"""No import cycle inside zbpp: every module's imports (top-level and inside functions alike) form an
acyclic graph, and the layers point one way (docs/DESIGN.md, "Layout and dependencies")."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "zbpp"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def import_graph() -> nx.DiGraph:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module) if node.level else (node.module or "")
                # "from .pkg import sub" names a module when sub is one, else an attribute of pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                while t and t not in modules:  # "import zbpp.schedules.ir as x" -> the module itself
                    t = t.rpartition(".")[0]
                if t and t != name and t.startswith("zbpp"):
                    g.add_edge(name, t)
    return g


def test_no_import_cycle() -> None:
    g = import_graph()
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles in zbpp: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_layers_point_one_way() -> None:
    g = import_graph()
    forbidden = {
        "zbpp.schedules": ("zbpp.runtime", "zbpp.modules", "zbpp.viz", "zbpp.cli", "zbpp.testing", "zbpp.models"),
        "zbpp.modules": ("zbpp.runtime", "zbpp.schedules", "zbpp.viz", "zbpp.cli", "zbpp.models"),
        "zbpp.viz": ("zbpp.runtime", "zbpp.modules", "zbpp.cli", "zbpp.models"),
        "zbpp.runtime": ("zbpp.viz", "zbpp.cli", "zbpp.models"),
        "zbpp.testing": ("zbpp.models",),
        # models -> schedules, modules, runtime; only the command line (and examples/) import models
        "zbpp.models": ("zbpp.viz", "zbpp.cli", "zbpp.testing"),
    }
    bad = [(a, b) for a, b in g.edges for layer, banned in forbidden.items()
           if (a == layer or a.startswith(layer + ".")) and any(b == x or b.startswith(x + ".") for x in banned)]
    assert not bad, f"imports against the layering: {bad}"


def test_the_check_sees_a_cycle(tmp_path) -> None:
    g = nx.DiGraph([("zbpp.a", "zbpp.b"), ("zbpp.b", "zbpp.a")])
    assert list(nx.simple_cycles(g))


def _private_torch_calls(source: str) -> list[str]:
    """``torch.<...>._name`` references in code (comments and strings left out)."""
    import io
    import re
    import tokenize

    code = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING):
            code.append(tok.string)
    text = "".join(t if t in (".",) else f" {t} " for t in code).replace(" . ", ".").replace(" .", ".").replace(". ", ".")
    return (re.findall(r"\b(?:torch|dist|distributed_c10d)(?:\.\w+)*\._[a-z]\w*", text)
            + re.findall(r"\bfrom\s+torch[\w.]*\s+import\s+_\w+", text))


def test_private_torch_apis_live_in_the_compat_module() -> None:
    bad = {}
    for path in ROOT.rglob("*.py"):
        if path.name == "_compat.py" and path.parent == ROOT:
            continue
        found = _private_torch_calls(path.read_text())
        if found:
            bad[str(path.relative_to(ROOT.parent))] = sorted(set(found))
    assert not bad, f"private torch APIs outside zbpp/_compat.py: {bad}"
    assert _private_torch_calls("x = torch._scaled_mm(a, b)  # ok")  # the check sees them
    assert _private_torch_calls("from torch.autograd.graph import _engine_run_backward")
