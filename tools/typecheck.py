"""Type-check kvtier as the package it is installed as: ``kvtier.*``, not its folders.

The package maps ``kvtier.config``, ``kvtier.ipc`` ... to the repository's top-level folders
(setuptools' ``package-dir`` in ``pyproject.toml``). mypy knows no such mapping: run on the
folders, it checks them as packages named ``config``, ``ipc`` ..., and each ``import
kvtier.x`` inside them resolves to the installed package, which it cannot read through the
editable install's import hook, so every one is ``Any`` and nothing across modules is checked.

This script lays the mapping out as a tree of symbolic links, ``build/typecheck/kvtier/<name>``
→ ``<folder>``, read from ``pyproject.toml`` so that a new package needs no edit here, and runs
mypy on ``-p kvtier`` with that tree as its search path (``mypy_path`` and the other settings
are in ``[tool.mypy]``). mypy's messages name the real files (``ipc/protocol.py``, not
``build/typecheck/kvtier/ipc/protocol.py``), so editors and terminals link to them.

Usage: ``python tools/typecheck.py [mypy options]`` from anywhere; ``make lint`` runs it.
Exit status: mypy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
PACKAGE = "kvtier"


def package_dirs(pyproject: Path) -> dict[str, str]:
    """The ``package-dir`` mapping of ``pyproject``: dotted package name → folder."""
    with pyproject.open("rb") as f:
        data = tomllib.load(f)
    mapping = data["tool"]["setuptools"]["package-dir"]
    if not isinstance(mapping, dict) or not mapping:
        raise SystemExit(f"{pyproject}: [tool.setuptools.package-dir] is empty")
    return {str(k): str(v) for k, v in mapping.items()}


def links(mapping: dict[str, str]) -> dict[str, str]:
    """The links to lay under ``kvtier/``: top-level package name → folder.

    A nested package (``kvtier.daemon.pool``) needs no link when its folder is its parent's
    folder joined with its last name (``daemon/pool``); one that is not cannot be laid out
    as links and is refused, naming the entry.
    """
    top: dict[str, str] = {}
    for name, folder in sorted(mapping.items()):
        parts = name.split(".")
        if parts[0] != PACKAGE or len(parts) < 2:
            raise SystemExit(f"package-dir entry {name!r}: not a {PACKAGE}.* package")
        if len(parts) == 2:
            top[parts[1]] = folder
            continue
        parent = ".".join(parts[:-1])
        expected = Path(mapping.get(parent, "")) / parts[-1]
        if parent not in mapping or Path(folder) != expected:
            raise SystemExit(
                f"package-dir entry {name!r} = {folder!r}: expected "
                f"{str(expected)!r} (its parent's folder and its name)"
            )
    return top


def lay_tree(top: dict[str, str], tree: Path = TREE, root: Path = ROOT) -> None:
    """Make ``build/typecheck/kvtier/<name>`` → ``<folder>`` for each entry, and nothing
    else there (a link left from a package since removed goes)."""
    pkg = tree / PACKAGE
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in pkg.iterdir():
        if entry.name not in top:
            if not entry.is_symlink():
                raise SystemExit(f"{entry}: not a link this script made; remove it by hand")
            entry.unlink()
    for name, folder in top.items():
        link = pkg / name
        target = os.path.relpath(root / folder, pkg)
        if link.is_symlink() and os.readlink(link) == target:
            continue
        if link.is_symlink():
            link.unlink()
        link.symlink_to(target, target_is_directory=True)


def main(argv: list[str]) -> int:
    """Lay the tree, run mypy on it, and print its messages with the real paths."""
    top = links(package_dirs(ROOT / "pyproject.toml"))
    lay_tree(top)
    prefix = f"{TREE.relative_to(ROOT)}/{PACKAGE}/"
    cmd = [
        sys.executable,
        "-m",
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        "-p",
        PACKAGE,
        *argv,
    ]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        if line.startswith(prefix):
            name, _, rest = line[len(prefix) :].partition("/")
            line = f"{top[name]}/{rest}" if name in top else line
        sys.stdout.write(line)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
