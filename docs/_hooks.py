"""MkDocs hook: lay out the package as it installs, for the API reference.

The components live at the repository root (``datasets/``, ``pipeline/``, ``trainer/``,
``evolve/``) and install as ``dasktrain.*`` through setuptools' package-dir mapping, which
static analysis does not follow. Before the pages are read, a tree of links under
``build/docs-src`` shows them where Python sees them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

COMPONENTS = ("datasets", "pipeline", "trainer", "evolve")


def lay_out(root: Path) -> None:
    """The link tree under ``root/build/docs-src``, made anew."""
    tree = root / "build" / "docs-src" / "dasktrain"
    if tree.parent.exists():
        shutil.rmtree(tree.parent)
    _link_files(root / "dasktrain", tree)
    for component in COMPONENTS:
        _link_files(root / component, tree / component)


def on_config(config: Any) -> Any:
    lay_out(Path(config.config_file_path).resolve().parent)
    return config


def _link_files(source: Path, target: Path) -> None:
    """Real folders of links to the ``.py`` files (the loader does not walk linked folders)."""
    for path in source.rglob("*.py"):
        if "__pycache__" in path.parts:
            continue
        link = target / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(path)


# Docstrings cross-reference in the reST style of the scientific Python stack
# (:class:`~dasktrain.Trainer`), which the Markdown renderer shows as written: keep the name,
# shortened after a ``~`` as reST does, and drop the role.
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([^<]*)</code>")


def _name(match: re.Match) -> str:
    shortened, name = match.group(1), match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if shortened else name}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_name, html)


# mkdocstrings keeps only the search paths that exist when it reads its configuration,
# before any hook's on_config runs: the tree must exist as soon as MkDocs loads this file.
lay_out(Path(__file__).resolve().parent.parent)

