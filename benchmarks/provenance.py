"""Which code a benchmark ran: the git commit and a fingerprint of the zbpp sources.

A benchmark run on another machine may see a copied working tree whose ``.git`` is older than its
files (the commit then names the wrong code), so every benchmark JSON also carries
``zbpp_sha256``: a hash of the package's Python sources that depends on their content only. To
find the commit a figure belongs to, compare it with this script's output on a checkout::

    python benchmarks/provenance.py            # {"commit": ..., "dirty": ..., "zbpp_sha256": ...}
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_fingerprint() -> str:
    """The first 12 hex digits of the SHA-256 of every ``zbpp/**/*.py`` (path and content, in
    sorted path order)."""
    digest = hashlib.sha256()
    package = ROOT / "zbpp"
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()[:12]


def code_identity() -> dict[str, object]:
    """``{"commit", "dirty", "zbpp_sha256"}``: git's short HEAD (None outside git), whether zbpp/
    differs from it (None outside git), and `source_fingerprint`."""
    commit = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain", "--", "zbpp")
    return {"commit": commit, "dirty": None if status is None else bool(status),
            "zbpp_sha256": source_fingerprint()}


def write_report(report: dict, out: Path | None) -> None:
    """Write a benchmark's `report` as indented JSON to `out` (folders made), if `out` is given."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    print(json.dumps(code_identity()))
