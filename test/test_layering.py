"""Imports point down the floors of the package (docs/architecture.md, "Floors").

A module may import its own package and any package on a lower floor, never one on its own floor
or above. That holds for every import a module runs (at the top or inside a function) and for
imports made only for type checking, with the few type-only exceptions named below. Programs
(``__main__.py``, the top-level shims) sit above everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "pdserve"
KERNELS = Path(__file__).resolve().parents[1] / "kernels"

# Lowest floor first. assets is data (model presets); obs and config are leaves; transfer is the
# ground floor of KV movement (P/D and the Mooncake Store tier build on it); constrained (grammar
# backends, compiling, token bitmasks) knows no requests or scheduler; engine knows no P/D;
# disagg is the P/D feature; web is HTTP plumbing under both HTTP programs; parsers reads model
# output text (tool calls, reasoning) for the OpenAI routes, beside web; entrypoints composes
# everything (the CLI, the servers, the scheduler process that wires a mode into a scheduler).
FLOORS: tuple[tuple[str, ...], ...] = (
    ("assets", "obs", "transfer"),
    ("config",),
    ("distributed", "mem", "constrained"),
    ("layers",),
    ("models",),
    ("engine",),
    ("disagg",),
    ("web", "parsers"),
    ("bench", "router"),
    ("entrypoints",),
)
FLOOR = {package: i for i, floor in enumerate(FLOORS) for package in floor}
# A program is not a layer: nothing imports it (`python -m pdserve.router` reaches the one command line);
# the package's own __init__ only names the version and a lazy Engine.
PROGRAMS = {"__main__.py", "__init__.py", "launch_server.py", "bench_serving.py"}
# Type-only imports that may point up: a leaf may name the config object it is handed.
TYPE_ONLY_UP = {("obs", "pdserve.config")}


def imported_modules(source: str, package: str) -> list[tuple[str, bool]]:
    """``(absolute module name, type_only)`` for every import in ``source``; relative imports are
    resolved against ``package``; ``type_only`` for those under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    type_only = {id(node) for branch in ast.walk(tree)
                 if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                 for node in ast.walk(branch)}
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, id(node) in type_only) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.module, node.level)
            names += [(name, id(node) in type_only)
                      for name in (base, *(f"{base}.{alias.name}" for alias in node.names))]
    return names


def _package_of(path: Path, root: Path = PACKAGE) -> str:
    return ".".join(path.relative_to(root.parent).with_suffix("").parts[:-1])


def _resolve(package: str, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    parts = package.split(".")[: len(package.split(".")) - (level - 1)]
    return ".".join(parts + ([module] if module else []))


def violations(root: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if path.name in PROGRAMS and (len(parts) == 1 or path.name == "__main__.py"):
            continue
        own = parts[0].removesuffix(".py")  # config.py is a floor of its own
        for name, type_only in imported_modules(path.read_text(), _package_of(path, root)):
            target = name.split(".")
            if target[0] != "pdserve" or len(target) < 2 or target[1] in (own, "__version__"):
                continue
            if (type_only and any(own == o and (name == t or name.startswith(t + "."))
                                  for o, t in TYPE_ONLY_UP)):
                continue
            if FLOOR.get(target[1], len(FLOORS)) >= FLOOR[own]:
                found.append(f"{path.relative_to(root)} imports {name}{' (type only)' if type_only else ''}")
    return sorted(set(found))


def test_every_package_has_a_floor() -> None:
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PACKAGE.glob("*.py") if p.name not in PROGRAMS}
    assert packages | modules == set(FLOOR)


def test_imports_point_down_the_floors() -> None:
    assert violations() == []


@pytest.mark.parametrize("layer, banned", [
    ("transfer", "pdserve.mem"), ("mem", "pdserve.engine"), ("mem", "pdserve.disagg"),
    ("engine", "pdserve.disagg"), ("router", "pdserve.entrypoints"), ("web", "pdserve.router"),
    ("config", "pdserve.engine"), ("obs", "pdserve.mem"),
])
def test_a_banned_import_is_found(tmp_path: Path, layer: str, banned: str) -> None:
    """The check fails when a banned import appears (at the top, inside a function, or relative)."""
    root = tmp_path / "pdserve"
    for package in FLOOR:
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / layer / "late.py").write_text(f"def f():\n    import {banned}.x\n")
    assert violations(root) == [f"{layer}/late.py imports {banned}.x"]


def test_a_banned_relative_import_in_config_is_found(tmp_path: Path) -> None:
    root = tmp_path / "pdserve"
    root.mkdir()
    (root / "config.py").write_text("from .engine import scheduler\n")
    assert violations(root) == ["config.py imports pdserve.engine", "config.py imports pdserve.engine.scheduler"]


def test_the_check_sees_relative_and_absolute_imports() -> None:
    source = ("from ..entrypoints import cli\nimport pdserve.entrypoints.up\nfrom . import policy\n"
              "if TYPE_CHECKING:\n    from pdserve.engine import request\n")
    names = dict(imported_modules(source, "pdserve.router"))
    assert {"pdserve.entrypoints.cli", "pdserve.entrypoints.up", "pdserve.router.policy"} <= set(names)
    assert names["pdserve.engine.request"] is True and names["pdserve.entrypoints.up"] is False


def test_the_kernels_package_imports_no_pdserve() -> None:
    """kernels/ sits below everything: the device kernels and their torch twins."""
    imports = [name for path in sorted(KERNELS.rglob("*.py"))
               for name, _ in imported_modules(path.read_text(), "pdserve_kernels")]
    assert [name for name in imports if name.split(".")[0] == "pdserve"] == []
