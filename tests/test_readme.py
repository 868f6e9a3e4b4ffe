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


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def _close(got: object, shown: object) -> bool:
    """`got` printed to the precision the README shows it: `shown` 0.111 or 3.33 matches 0.1111..., 3.333...."""
    if isinstance(shown, (list, tuple)):
        return isinstance(got, (list, tuple)) and len(got) == len(shown) and all(map(_close, got, shown))
    if isinstance(shown, (int, float)) and isinstance(got, (int, float)):
        decimals = len(repr(shown).partition(".")[2]) if isinstance(shown, float) else 0
        return abs(got - shown) <= 0.5 * 10.0 ** -decimals + 1e-12  # the README rounds to what it prints
    return got == shown


def test_readme_schedules_example_prints_what_its_comments_say() -> None:
    """The Schedules section's example runs as pasted, and every `expr  # value` line's value is what
    `expr` gives (to the digits shown): the README's figures for p=4, m=8 come from the code."""
    import ast

    (block,) = [b for b in _blocks("python") if b.startswith("from zbpp.schedules import build")]
    env: dict = {}
    checked = 0
    for node in ast.parse(block).body:
        segment = ast.get_source_segment(block, node) or ""
        line = block.splitlines()[node.end_lineno - 1]
        if isinstance(node, ast.Expr) and "#" in line:
            shown = ast.literal_eval(line.partition("#")[2].strip())
            got = eval(compile(ast.Expression(node.value), "README", "eval"), env)
            assert _close(got, shown), f"README says {segment} is {shown!r}; it is {got!r}"
            checked += 1
        else:
            exec(compile(ast.Module([node], []), "README", "exec"), env)
    assert checked == 2  # sched.stages_on(2) and the simulated figures
    assert env["auto"].name == "zb-auto"


def test_readme_show_output_is_the_cli_s(capsys) -> None:
    """The console block is what `zbpp show zb-h1 -p 4 -m 8` prints (its "..." lines elided)."""
    from zbpp.cli import main

    (block,) = [b for b in _blocks("console") if b.startswith("$ zbpp show")]
    command, *shown = block.splitlines()
    assert main(command.split()[2:]) == 0
    printed = capsys.readouterr().out.splitlines()
    expected = [line for line in shown if line.strip() != "..."]
    missing = [line for line in expected if line not in printed]
    assert not missing, f"README shows lines `zbpp show` does not print: {missing}"
    assert [printed.index(line) for line in expected] == sorted(printed.index(line) for line in expected)


def test_schedule_table_bubbles_hold_where_it_says() -> None:
    """The table gives the papers' bubble formulas; they hold only for unit costs F = B = W, no
    message time and enough microbatches (ZB-H2's is -(p-1) at F=B=1, W=2, where no bubble is
    negative), and the README used to give them with no condition. Reference: the simulated
    longest span minus busiest rank's work, against each formula under the stated condition."""
    from zbpp.schedules import Costs, build, simulate

    text = (ROOT / "README.md").read_text()
    formulas = dict(re.findall(r"^\| `([\w-]+)` \|.*bubble (\(p-1\)\([FBW+\-2]+\))\*", text, re.M))
    assert formulas.keys() == {"1f1b", "zb-h1", "zb-h2"}
    note = re.search(r"^\\\* The papers' bubbles.*?(?=\n\n)", text, re.M | re.S)
    assert note, "the condition under which the table's bubble formulas hold"
    condition = " ".join(note.group(0).split())
    for said in ("unit costs F = B = W", "comm 0", "m >= p (ZB-H1)", "m >= 2p-1 (ZB-H2)"):
        assert said in condition, said
    least_m = {"1f1b": lambda p: 1, "zb-h1": lambda p: p, "zb-h2": lambda p: 2 * p - 1}
    for unit in (1.0, 2.5):  # any unit: F = B = W = unit
        for name, formula in formulas.items():
            for p in range(2, 6):
                for m in range(least_m[name](p), 3 * p + 1):
                    res = simulate(build(name, num_ranks=p, num_microbatches=m), Costs(unit, unit, unit))
                    expected = eval(formula.replace("F", "u").replace("B", "u").replace("W", "u")
                                    .replace(")(", ")*(").replace("2u", "2*u"), {"p": p, "u": unit})
                    # sums of a few dozen multiples of 0.5: exact in floats
                    assert res.cost - res.busy == expected, (name, p, m, unit)
