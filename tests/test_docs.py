"""The README stays a front door and the documents stay true: links and named files exist, the
layer rules name the tests that check them, the two commands are the Makefile's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short_and_its_table_cells_are_one_line():
    lines = README.read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines: move detail to docs/ (at most ~120)"
    table = [line for line in lines if line.startswith("| `")]
    assert len(table) >= 8, "README.md lost its 'where things live' table"
    for row in table:
        assert len(row) <= 120, f"a README table cell runs long (move the detail to docs/REFERENCE.md): {row}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_named_package_files_exist(doc):
    text = doc.read_text()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"
    for path in set(re.findall(r"`(flexpack/[\w/]+(?:\.py)?)`", text)):
        assert (ROOT / path).exists(), f"{doc.relative_to(ROOT)} names {path}, which does not exist"


def test_architecture_names_only_layer_tests_that_exist():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`(test_\w+?)(?:\.\.\.)?`", text))
    tree = ast.parse((ROOT / "tests" / "test_layers.py").read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert named, "docs/ARCHITECTURE.md no longer names the tests that keep the layer rules"
    for name in named:
        assert any(d.startswith(name) for d in defined), \
            f"docs/ARCHITECTURE.md names {name}, not in tests/test_layers.py"


def test_the_readme_commands_are_the_makefile_targets():
    make = (ROOT / "Makefile").read_text()
    readme = README.read_text()
    for target, marker in (("demo", None), ("test", '-m "not slow"'), ("test-slow", "-m slow")):
        assert f"make {target}" in readme
        body = make.split(f"\n{target}:", 1)[1].split("\n\n", 1)[0]
        if marker:
            assert marker in body, (target, body)
        if target == "test":  # lint first: `make test` fails on a ruff finding before any test runs
            assert 0 <= body.find("ruff check .") < body.find("pytest"), body
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci.index("make test") < ci.index("make test-slow")  # CI runs the fast tests first, then the slow ones
