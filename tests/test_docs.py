"""The documentation site builds with warnings as errors, and its API reference documents
every public name of ``dasktrain``."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dasktrain as dt

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"


def _documented() -> dict[str, object]:
    """Each ``::: dotted.path`` of the API pages, imported: path -> object."""
    found = {}
    for page in sorted(API.glob("*.md")):
        for path in re.findall(r"^::: *([\w.]+)", page.read_text(), flags=re.MULTILINE):
            module, _, name = path.rpartition(".")
            try:
                found[path] = getattr(importlib.import_module(module), name)
            except (ImportError, AttributeError):
                found[path] = importlib.import_module(path)
    return found


def test_every_public_name_is_in_the_api_reference():
    documented = _documented()
    objects = {id(obj) for obj in documented.values()}
    public = [name for name in dt.__all__ if name != "__version__"]
    missing = [name for name in public if id(getattr(dt, name)) not in objects]
    assert not missing, f"public names with no entry in docs/api/*.md: {missing}"


@pytest.mark.slow
def test_the_docs_build_with_warnings_as_errors(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    # As on a fresh clone: the hook must lay the package out before mkdocstrings looks.
    shutil.rmtree(ROOT / "build" / "docs-src", ignore_errors=True)
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                             "--site-dir", str(site)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # Every entry was rendered: its anchor is in the built page.
    pages = "".join(p.read_text() for p in (site / "api").rglob("*.html"))
    for path in _documented():
        assert f'id="{path}"' in pages, path


def test_dir_lists_the_lazily_imported_names_for_tab_completion():
    names = dir(dt)
    assert {"Trainer", "Pipeline", "optim", "TrainingDiverged"} <= set(names)
    assert set(dt.__all__) <= set(names)


def test_every_error_has_the_common_base_and_keeps_its_older_one():
    from dasktrain.cli.train_config import ConfigError

    for error, older in ((dt.DatasetError, ValueError), (dt.SourceError, ValueError),
                         (dt.PipelineError, RuntimeError), (dt.TrainerError, RuntimeError),
                         (dt.TrainingDiverged, RuntimeError), (dt.HolderLost, RuntimeError),
                         (dt.WorkersPaused, RuntimeError), (ConfigError, ValueError),
                         (dt.EvolutionError, RuntimeError), (dt.InvalidFitness, ValueError)):
        assert issubclass(error, dt.DasktrainError) and issubclass(error, older), error
    # A real one, raised by the library and caught by the base.
    with pytest.raises(dt.DasktrainError, match="no dataset at"):
        dt.open_dataset("/nonexistent/nothing.zarr")


@pytest.mark.slow
def test_the_readmes_example_runs_as_written(tmp_path):
    """The README's twenty lines, run as a script (its own embedded cluster), one epoch."""
    text = (ROOT / "README.md").read_text()
    found = re.search(r"## Twenty lines\n\n```python\n(.*?)```", text, re.S)
    assert found, "the README lost its example"
    code = found.group(1).replace("epochs=5", "epochs=1")
    assert len(code.splitlines()) <= 24
    script = tmp_path / "example.py"
    script.write_text("import torch\ntorch.set_num_threads(1)\n" + code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "'accuracy'" in result.stdout and "'loss'" in result.stdout, result.stdout
    assert (tmp_path / "runs" / "digits" / "report" / "index.html").is_file()
