"""The README stays short and starts with the set-up commands; the docs name nothing outside
the repository. (The config reference is checked in test_config.py; links and API pages by
`make docs`, mkdocs build --strict.)"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = {".git", "site", "runs", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
TEXT = {".md", ".py", ".toml", ".yaml", ".yml", ".sh", ".cfg", ".txt"}


def _repository_text_files():
    for path in ROOT.rglob("*"):
        parts = path.relative_to(ROOT).parts
        if any(p in SKIP or p.startswith(".venv") or p.endswith(".egg-info") for p in parts):
            continue
        if path.is_file() and (path.suffix in TEXT or path.name in {"Makefile", "run"}):
            yield path


def test_readme_starts_with_the_two_commands_and_stays_short():
    readme = (ROOT / "README.md").read_text().splitlines()
    first_block = readme[readme.index("```bash") + 1 : readme.index("```bash") + 3]
    assert [line.split()[:2] for line in first_block] == [["make", "run"], ["make", "test"]]
    assert len(readme) <= 250, f"README.md has {len(readme)} lines: move text into docs/"


def test_every_docs_page_is_in_the_site_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert pages and [p for p in pages if p not in nav] == []


def test_nothing_names_a_path_outside_the_repository():
    # Built from parts, so that this file does not name them itself.
    outside = re.compile(
        "|".join([r"/" + "work/", r"\.\./" + "shared", "this project's " + "machine"])
    )
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _repository_text_files()
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if outside.search(line)
    ]
    assert found == []
