"""tools/typecheck.py: the package-dir mapping laid out as links mypy can follow."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("typecheck", ROOT / "tools" / "typecheck.py")
assert _spec is not None and _spec.loader is not None
typecheck = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(typecheck)


def test_the_repository_mapping_is_one_link_per_top_level_package() -> None:
    top = typecheck.links(typecheck.package_dirs(ROOT / "pyproject.toml"))
    assert top == {
        "bench": "bench",
        "cli": "cli",
        "client": "client",
        "config": "config",
        "daemon": "daemon",
        "engine": "engine",
        "ipc": "ipc",
        "kernels": "kernels",
        "launch": "launch",
    }


def test_a_nested_package_outside_its_parents_folder_is_refused_by_name() -> None:
    with pytest.raises(SystemExit, match=r"'kvtier.daemon.pool' = 'pool': expected 'daemon/pool'"):
        typecheck.links({"kvtier.daemon": "daemon", "kvtier.daemon.pool": "pool"})
    with pytest.raises(SystemExit, match=r"'other.x'"):
        typecheck.links({"other.x": "x"})


def test_the_tree_links_each_package_and_drops_links_of_packages_gone(tmp_path: Path) -> None:
    (tmp_path / "src" / "ipc").mkdir(parents=True)
    (tmp_path / "src" / "ipc" / "protocol.py").write_text("X = 1\n")
    tree = tmp_path / "tree"
    (tree / "kvtier").mkdir(parents=True)
    (tree / "kvtier" / "gone").symlink_to(tmp_path / "src")
    typecheck.lay_tree({"ipc": "src/ipc"}, tree=tree, root=tmp_path)
    assert sorted(p.name for p in (tree / "kvtier").iterdir()) == ["ipc"]
    assert (tree / "kvtier" / "ipc" / "protocol.py").read_text() == "X = 1\n"
    typecheck.lay_tree({"ipc": "src/ipc"}, tree=tree, root=tmp_path)  # again: nothing changes
    (tree / "kvtier" / "stray").mkdir()
    with pytest.raises(SystemExit, match="not a link this script made"):
        typecheck.lay_tree({"ipc": "src/ipc"}, tree=tree, root=tmp_path)
