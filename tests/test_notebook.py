"""The quick-start notebook runs top to bottom on a real Jupyter kernel, as a user runs it."""

from __future__ import annotations

import json

import nbformat
import pytest
from nbclient import NotebookClient

from tests.common.builders import REPO

NOTEBOOK = REPO / "examples" / "quickstart.ipynb"


def test_the_notebook_is_stored_without_outputs():
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)


@pytest.mark.slow
def test_quickstart_notebook_runs_on_a_kernel(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Any error in any cell raises here (CellExecutionError names the cell).
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    text = "".join(o.get("text", "") for o in outputs)
    assert "started a local Dask cluster" in text and "dashboard: http://127.0.0.1:" in text
    assert text.count("started a local Dask cluster") == 1  # one cluster for every call
    assert "reloaded model gives the same outputs: True" in text
    figures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(figures) >= 3  # the samples, the comparison and one run's plot
    assert (tmp_path / "runs" / "quickstart" / "model.pt").exists()
