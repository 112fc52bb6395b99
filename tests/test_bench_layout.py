"""bench/*.py are thin entry points: each calls its ``flatgrad.bench`` module's ``main()`` and nothing else.

A bench's code lives in ``flatgrad/bench/<name>.py`` (see "Measuring" in docs/design.md). An entry point imports no
other script and touches no ``sys.path``, and stays a few lines long; every one still answers ``--help``.
"""

from __future__ import annotations

import ast
import pathlib
import runpy
import sys

import pytest

import flatgrad.bench

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
PACKAGE = pathlib.Path(flatgrad.bench.__file__).resolve().parent
MAX_LINES = 12
ENTRY_POINTS = sorted(BENCH.glob("*.py"))


def layout_problems(path: pathlib.Path) -> list[str]:
    """What keeps ``path`` from being a thin entry point of ``flatgrad.bench.<its stem>`` (empty: nothing)."""
    text = path.read_text()
    problems = []
    lines = len(text.splitlines())
    if lines > MAX_LINES:
        problems.append(f"{lines} lines, more than {MAX_LINES}: its code belongs in flatgrad/bench/{path.name}")
    if "sys.path" in text or "importlib" in text:
        problems.append("touches sys.path or imports by name")
    siblings = {p.stem for p in path.parent.glob("*.py")}
    expected = f"flatgrad.bench.{path.stem}"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                problems.append(f"a relative import (line {node.lineno})")
                continue
            names = [node.module or ""]
        else:
            continue
        for name in names:
            if name.split(".")[0] in siblings:
                problems.append(f"imports the sibling script {name} (line {node.lineno})")
            elif name not in (expected, "__future__"):
                problems.append(f"imports {name} (line {node.lineno}); only {expected} is expected")
    if f"from {expected} import main" not in text:
        problems.append(f"does not call {expected}.main()")
    return problems


def test_there_are_entry_points_and_each_has_its_module():
    assert len(ENTRY_POINTS) >= 10
    missing = [p.name for p in ENTRY_POINTS if not (PACKAGE / p.name).is_file()]
    assert missing == [], f"bench/ scripts without a flatgrad/bench module: {missing}"


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: p.name)
def test_entry_point_is_thin(path: pathlib.Path):
    assert layout_problems(path) == []


@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: p.name)
def test_entry_point_answers_help(path: pathlib.Path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: ")


def test_the_checker_sees_a_sibling_import_sys_path_and_length(tmp_path: pathlib.Path):
    (tmp_path / "other.py").write_text("")
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nsys.path.insert(0, '.')\nimport other\n" + "\n" * MAX_LINES)
    found = "\n".join(layout_problems(bad))
    assert "lines, more than" in found and "sys.path" in found and "sibling script other" in found
    assert "does not call flatgrad.bench.bad.main()" in found
    good = tmp_path / "good.py"
    good.write_text('"""Doc."""\n\nfrom flatgrad.bench.good import main\n\nif __name__ == "__main__":\n    raise SystemExit(main())\n')
    assert layout_problems(good) == []
