"""Every notebook in notebooks/ runs top to bottom on small data; a failing cell fails its test.

The notebooks run side by side, each in its own kernel and workdir, one more at a time than there are cores: a
notebook spends part of its time waiting (its kernel starting, its server starting and stopping)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def _execute(path: Path, workdir: Path) -> None:
    """Run every cell of the notebook ``path`` on 20,000 rows under ``workdir``; raises on a failing cell."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=dict(os.environ, PIPELINE_NOTEBOOK_ROWS="20000", PIPELINE_WORKDIR=str(workdir)))


@pytest.fixture(scope="module")
def executions(request, tmp_path_factory):
    """The run of each notebook whose test is selected, all started at once."""
    chosen = [item.callspec.params["path"] for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec")]
    pool = ThreadPoolExecutor(max_workers=(os.cpu_count() or 1) + 1)
    runs = {path: pool.submit(_execute, path, tmp_path_factory.mktemp(path.stem)) for path in chosen}
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path, executions):
    executions[path].result()
