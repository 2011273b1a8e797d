"""memfit's modules keep the shape the style asks for: at most 400 lines, a one-line docstring first."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("memfit", "flows", "tasks")
MAX_LINES = 400


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (REPO / package).rglob("*.py"))


def shape_problems(path: Path, root: Path = REPO) -> list[str]:
    """What is off with one module: too long, no docstring, a docstring over one line."""
    source = path.read_text()
    name = path.relative_to(root)
    problems = []
    if (n := len(source.splitlines())) > MAX_LINES:
        problems.append(f"{name}: {n} lines (at most {MAX_LINES}: split it by what its parts do)")
    doc = ast.get_docstring(ast.parse(source), clean=False)
    if not doc:
        problems.append(f"{name}: no module docstring (one line that says what the module does)")
    elif "\n" in doc.strip():
        lines = len(doc.strip().splitlines())
        problems.append(f"{name}: a docstring of {lines} lines (one line; the rest as comments)")
    return problems


def test_every_module_is_at_most_400_lines_with_a_one_line_docstring():
    found = modules()
    assert len(found) > 100, "the module walk found too few files: wrong root?"
    problems = [p for path in found for p in shape_problems(path)]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(("text", "expected"), [
    ('"""One line."""\nx = 1\n', []),
    ('"""Two\nlines."""\n', ["a docstring of 2 lines"]),
    ("x = 1\n", ["no module docstring"]),
    ('"""One."""\n' + "x = 1\n" * 400, ["401 lines"]),
])
def test_the_check_names_what_is_off(tmp_path: Path, text: str, expected: list[str]):
    path = tmp_path / "memfit" / "probe.py"
    path.parent.mkdir()
    path.write_text(text)
    problems = shape_problems(path, tmp_path)
    assert len(problems) == len(expected)
    for problem, part in zip(problems, expected, strict=True):
        assert part in problem and problem.startswith("memfit/probe.py: ")
