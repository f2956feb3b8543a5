"""The imports between the HTTP layers run one way: entrypoints/ -> router/ -> web/.

``pdserve up`` (entrypoints/) starts a router, so router/ must not reach back up into
entrypoints/; what both need lives in web/, which imports neither.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "python" / "pdserve"

# A __main__ is a program, not a layer: nothing imports it, and `python -m pdserve.router`
# must reach the one command line (argparse lives only in entrypoints/).
PROGRAMS = {"__main__.py"}


def imported_modules(source: str, package: str) -> list[str]:
    """Absolute names of every module ``source`` imports, relative imports resolved against ``package``."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.module, node.level)
            names += [base, *(f"{base}.{alias.name}" for alias in node.names)]
    return names


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])


def _resolve(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def _violations(layer: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        if path.name in PROGRAMS:
            continue
        for name in imported_modules(path.read_text(), _package_of(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


@pytest.mark.parametrize("layer, forbidden", [
    ("router", ("pdserve.entrypoints",)),
    ("web", ("pdserve.entrypoints", "pdserve.router")),
])
def test_no_import_runs_back_up(layer: str, forbidden: tuple[str, ...]) -> None:
    assert (PACKAGE / layer).is_dir()
    assert _violations(layer, forbidden) == []


def test_the_check_sees_relative_and_absolute_imports() -> None:
    source = "from ..entrypoints import cli\nimport pdserve.entrypoints.up\nfrom . import policy\n"
    names = imported_modules(source, "pdserve.router")
    assert {"pdserve.entrypoints.cli", "pdserve.entrypoints.up", "pdserve.router.policy"} <= set(names)
