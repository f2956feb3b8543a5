"""What ``docker build -f docker/Dockerfile.X .`` sends to the builder, and the wheel built from it.

The build context is the files on disk under the repository root that ``docker/Dockerfile.X.dockerignore``
keeps (BuildKit reads ``<Dockerfile>.dockerignore`` before a root ``.dockerignore``). The rules are
Docker's (moby/patternmatcher, as the Dockerfile reference describes ``.dockerignore``), which differ
from ``.gitignore`` in three ways this module relies on:

- every pattern is anchored at the context root (``foo`` is ``/foo``, never ``a/foo``); a leading
  ``/`` and a trailing ``/`` are dropped (Go's ``filepath.Clean``), so ``python/`` is ``python``;
- a pattern matches a path when it matches the path itself or any of its parent directories
  (``*`` matches ``python``, hence everything under it);
- the last pattern that matches decides, and a ``!`` exception re-includes a path even when a
  parent directory was excluded (git cannot re-include below an excluded directory).

Each pattern's glob (``*``, ``?``, ``[...]``, ``**``) is compiled by ``pathspec``'s gitignore pattern
class, anchored with a leading ``/``: for a pattern with a ``/`` in it the glob syntax of git and of
Go's ``filepath.Match`` plus Docker's ``**`` agree. The evaluation (anchoring, parents, last match)
is done here, not by ``pathspec.GitIgnoreSpec``, whose git semantics would differ on all three.
"""

from __future__ import annotations

import fnmatch
import functools
import os
import posixpath
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pathspec.util

_GLOB = pathspec.util.lookup_pattern("gitignore")


@dataclass(frozen=True)
class IgnoreRule:
    """One ``.dockerignore`` line: the cleaned pattern and whether it is a ``!`` exception."""

    pattern: str
    exception: bool

    @functools.cached_property
    def regex(self) -> re.Pattern:
        return _GLOB("/" + self.pattern).regex

    def matches(self, path: str) -> bool:
        """The pattern matches ``path`` (relative, ``/``-separated) or one of its parents."""
        parts = path.split("/")
        return any(self.regex.match("/".join(parts[:i])) for i in range(1, len(parts) + 1))


def parse_dockerignore(text: str) -> list[IgnoreRule]:
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = posixpath.normpath(line[1:].strip() if exception else line).lstrip("/")
        if not pattern or pattern == ".":
            raise ValueError(f".dockerignore: {line!r} names no path")
        rules.append(IgnoreRule(pattern, exception))
    return rules


def excluded(rules: list[IgnoreRule], path: str) -> bool:
    """Docker's verdict on ``path``: the last rule that matches it decides; none matching keeps it."""
    verdict = False
    for rule in rules:
        if rule.matches(path):
            verdict = not rule.exception
    return verdict


def _may_reinclude_below(rules: list[IgnoreRule], directory: str) -> bool:
    """Whether an exception could keep something under an excluded ``directory`` (then the walk
    descends; whatever it finds is still judged file by file, so erring towards True is safe)."""
    parts = directory.split("/")
    for rule in (r for r in rules if r.exception):
        pattern = rule.pattern.split("/")
        if "**" in pattern[:len(parts)]:
            return True
        if all(fnmatch.fnmatchcase(d, p) for d, p in zip(parts, pattern)):
            return True
    return False


def context_files(root: Path, dockerignore: Path) -> list[str]:
    """The files of the build context, relative to ``root``, as Docker would send them."""
    rules = parse_dockerignore(dockerignore.read_text())
    out = []
    for top, dirs, files in os.walk(root):
        rel_top = os.path.relpath(top, root)
        rel = "" if rel_top == "." else rel_top.replace(os.sep, "/") + "/"
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(top, d))
                         and (not excluded(rules, rel + d) or _may_reinclude_below(rules, rel + d)))
        out += [rel + f for f in sorted(files) if not excluded(rules, rel + f)]
    return out


def copy_context(root: Path, dockerignore: Path, dest: Path) -> list[str]:
    files = context_files(root, dockerignore)
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel, follow_symlinks=True)
    return files


# --------------------------------------------------------------- the wheel
def build_wheel(context: Path, out: Path) -> Path:
    """``pip wheel`` of the context with this environment's setuptools: no build isolation, no
    index, no dependencies, so nothing is downloaded."""
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "--wheel-dir", str(out), str(context)], cwd=context)
    (wheel,) = out.glob("pdserve-*.whl")
    return wheel


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def fresh_venv(wheel: Path, venv: Path) -> Path:
    """A new venv holding the wheel alone; its dependencies come from this environment's
    site-packages through a ``.pth`` line (a path line, which ``site`` adds to ``sys.path`` without
    running the ``.pth`` files found there: the editable install's finder stays off). Returns its python."""
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    # pip of this environment installs into the new one: the wheel is in before the dependencies'
    # path is, so pip sees no other pdserve to replace.
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "--quiet",
         str(wheel)])
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    env=isolated_env(venv)).strip())
    (site / "_pdserve_test_dependencies.pth").write_text("".join(d + "\n" for d in dependency_paths()))
    return python


def dependency_paths() -> list[str]:
    """This environment's site-packages, which the fresh venv borrows for pdserve's dependencies. When
    the environment lives in the checkout (CI's ``.venv``), these are the only paths under it allowed on
    the fresh venv's ``sys.path``."""
    return sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def isolated_env(venv: Path) -> dict[str, str]:
    """The environment of a process of the fresh venv: its bin first on PATH (as the image's
    ``ENV PATH``), and no PYTHONPATH, which in tests points at this checkout's sources."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run(argv: list[str], **kw) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, **kw)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} exited {out.returncode}:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return out.stdout
