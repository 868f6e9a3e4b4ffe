"""README.md starts with the two commands a newcomer pastes, and CI runs the same test command."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```bash\n(.*?)\n```", text, re.S)[:2]


def test_readme_opens_with_install_and_test_commands() -> None:
    run_cmd, test_cmd = _first_commands()
    assert "pip install ." in run_cmd and run_cmd.endswith("zbpp demo")
    assert 'pip install ".[test]"' in test_cmd and "pytest" in test_cmd


def test_ci_runs_both_readme_commands_in_order() -> None:
    run_cmd, test_cmd = _first_commands()
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert run_cmd in lines, "README's install-and-demo command and .ci/run have drifted apart"
    assert test_cmd in lines, "README's test command and .ci/run have drifted apart"
    assert lines.index(run_cmd) < lines.index(test_cmd), "CI must run the demo on the venv without extras first"


def _documented_names() -> set[str]:
    """Every dotted zbpp name the user docs cite, and every name their code imports from zbpp."""
    names: set[str] = set()
    for doc in ("README.md", "docs/DESIGN.md", "docs/benchmarks.md"):
        text = (ROOT / doc).read_text()
        names |= set(re.findall(r"`(zbpp(?:\.\w+)+)", text))
        for module, imported in re.findall(r"^\s*from (zbpp(?:\.\w+)*) import ([\w, ]+)", text, re.M):
            names |= {f"{module}.{n.strip()}" for n in imported.split(",") if n.strip()}
    return names


def _resolve(dotted: str) -> object:
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def test_every_documented_name_imports_from_where_the_docs_say() -> None:
    names = _documented_names()
    assert "zbpp.modules.fp8.fused_path_counts" in names  # the check reads the docs at all
    missing = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    assert not missing, "documented but not importable there: " + "; ".join(missing)


def test_every_link_in_the_docs_exists() -> None:
    for doc in ("README.md", "docs/benchmarks.md", "docs/DESIGN.md"):
        path = ROOT / doc
        text = path.read_text()
        targets = set(re.findall(r"\]\(([^)#:]+)\)", text))  # markdown links and images, no URLs
        targets |= set(re.findall(r"`((?:docs|benchmarks|examples|tests|zbpp)/[\w./-]+\.\w+)`", text))
        gone = [t for t in sorted(targets) if not (path.parent / t).exists() and not (ROOT / t).exists()]
        assert not gone, f"{doc} cites files that do not exist: {gone}"
