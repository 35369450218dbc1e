"""The layers import downwards only: ``events/`` and ``kernels/`` know nothing of the engine, and the engine
(``ksana/``) knows nothing of ``perf/`` and ``simulator/``, which are built on it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _absolute_imports(path: Path) -> list[tuple[int, str]]:
    """The modules a file imports by absolute name (relative imports stay inside the file's own package)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _violations(repo: Path, folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(repo)}:{line} imports {name}"
            for path in sorted((repo / folder).rglob("*.py"))
            for line, name in _absolute_imports(path)
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize("folder", ["events", "kernels"])
def test_lower_layers_import_nothing_of_the_engine(folder):
    """Not even their own installed name (``ksana.events``): importing it would run ``ksana/__init__.py``. Inside
    the folder, modules reach each other by relative imports."""
    assert _violations(REPO, folder, ("ksana", "events", "kernels", "perf", "simulator")) == []


def test_the_engine_does_not_import_the_layers_built_on_it():
    assert _violations(REPO, "ksana", ("ksana.perf", "ksana.simulator", "perf", "simulator")) == []


def test_the_check_reports_a_forbidden_import(tmp_path):
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "bad.py").write_text("from . import loop\nimport trio\nfrom ksana.request import X\n")
    assert _violations(tmp_path, "events", ("ksana",)) == ["events/bad.py:3 imports ksana.request"]
