"""Assemble the ``tapml`` package as it installs, out of symlinks, for import-linter.

pyproject.toml maps top-level folders into the one package (``carving/`` is
``tapml.carving``...), so the source tree alone does not show grimp (import-linter's graph
builder) the modules ``tapml.carving`` and the others. This builds ``DIR/tapml`` from the
``[tool.setuptools] package-dir`` table with one symlink per entry (nothing is built or copied,
so nothing is left in the repository): ``PYTHONPATH=DIR lint-imports`` then sees the package
that users import.

Usage: ``python scripts/layer_tree.py DIR`` (DIR is created; it must not hold a ``tapml``).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def assemble(dest: Path) -> Path:
    """Create ``dest/tapml`` as the installed package's layout; returns it."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = dest / "tapml"
    top.mkdir(parents=True)
    for entry in (ROOT / package_dir["tapml"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    # Subpackages whose folder is not already inside their parent's folder (tapml.carving = carving/).
    for name, folder in sorted(package_dir.items()):
        parent, _, leaf = name.rpartition(".")
        if not parent:
            continue
        if (ROOT / folder).resolve().parent == (ROOT / package_dir.get(parent, "")).resolve():
            continue  # reached through its parent's symlink (tapml.platforms.wgsl = platforms/wgsl)
        link = dest / Path(*name.split("."))
        if not link.exists():
            link.symlink_to(ROOT / folder)
    return top


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/layer_tree.py DIR")
    print(assemble(Path(sys.argv[1])))
