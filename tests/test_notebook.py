"""The memory explorer notebook runs top to bottom in a fresh kernel and writes its three plots.

Executed with nbclient on the tiny shape (REMAT_NB_SHAPE=tiny, ~30 s on 2 CPU cores); the kernel is
the `python3` kernelspec of the interpreter running the tests (jupyter_client starts it with
`sys.executable`), so it sees this virtualenv and the environment set in conftest.py.
"""
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "memory_explorer.ipynb"
PLOTS = ("saved_by_tag.png", "pareto.png", "batch_fit.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("model", ["gpt2", pytest.param("llama3", marks=pytest.mark.slow)])
def test_memory_explorer_runs_and_writes_plots(model, tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_NB_SHAPE", "tiny")
    monkeypatch.setenv("REMAT_NB_MODEL", model)
    monkeypatch.setenv("REMAT_NB_OUT", str(tmp_path))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError, with the traceback, on the first failing cell

    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
    assert all(cell.get("execution_count") for cell in nb.cells if cell.cell_type == "code")
    for name in PLOTS:
        path = tmp_path / name
        assert path.is_file(), f"the notebook did not write {name}"
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000, f"{name} is not a non-empty PNG"
