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
