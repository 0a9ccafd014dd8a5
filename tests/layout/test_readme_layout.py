"""The README's layout table against the tree (as tests/e2e/test_examples.py checks the examples):
for both services, config_fields, the tools and the benchmarks, a row per package names every
module and subpackage in it (`name`, `name/`, or a `prefix_*` pattern) and nothing that is not
there; every top-level folder has a row."""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("scheduler_service", "model_service", "config_fields", "tools", "bench")


def _rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout") :].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \| (.*) \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def _named(what: str) -> set[str]:
    """The module-like names in a row: `name`, `name/`, `prefix_*` (not files with a suffix)."""
    return {n for n in re.findall(r"`([^`]+)`", what) if re.fullmatch(r"[A-Za-z_][\w*]*/?", n)}


def _present(folder: Path) -> set[str]:
    """Modules (without .py) and subpackages (with /) of a package folder."""
    present = set()
    for path in folder.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            present.add(path.name + "/")
        elif path.suffix == ".py" and path.name not in ("__init__.py", "__main__.py"):
            present.add(path.stem)
    return present


def test_every_top_level_folder_has_a_row():
    rows = _rows()
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    folders = {p.split("/")[0] for p in tracked if "/" in p and not p.startswith(".")}
    missing = {f for f in folders if not any(r.split("/")[0] == f for r in rows)}
    assert missing == set()


def test_each_package_row_names_what_is_in_it():
    rows = _rows()
    packages = [
        folder
        for top in CHECKED
        for folder in [ROOT / top, *sorted((ROOT / top).rglob("*/"))]
        if (folder / "__init__.py").exists()
        and "__pycache__" not in folder.parts
        # not hidden scratch folders (bench/peers/.work holds the peers' own venvs, git-ignored)
        and not any(part.startswith(".") for part in folder.relative_to(ROOT).parts)
    ]
    problems = {}
    for folder in packages:
        key = str(folder.relative_to(ROOT)) + "/"
        if key not in rows:
            problems[key] = "no row"
            continue
        named, present = _named(rows[key]), _present(folder)
        patterns = {n for n in named if "*" in n}
        unnamed = {m for m in present - named if not any(fnmatch.fnmatch(m, p) for p in patterns)}
        missing = {n for n in named - patterns - present if not (folder / n).exists()}
        if unnamed or missing:
            problems[key] = {
                "not in the README": sorted(unnamed),
                "not in the tree": sorted(missing),
            }
    assert problems == {}
