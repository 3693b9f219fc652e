"""The memory explorer notebook runs top to bottom in a fresh kernel and writes its three plots, to
out/notebooks by default, leaving the committed figures in docs/img as they were.

Executed with nbclient on the tiny shape (REMAT_NB_SHAPE=tiny, about 2 min on 2 CPU cores, most of
it section 3's train steps compiled for XLA:GPU, the default REMAT_NB_TARGET); the kernel is
the `python3` kernelspec of the interpreter running the tests (jupyter_client starts it with
`sys.executable`), so it sees this virtualenv and conftest.py's environment, with no JAX_PLATFORMS: JAX starts as in a user's kernel.
"""
import hashlib
import os
import pathlib
import time

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "memory_explorer.ipynb"
DOCS_IMG = ROOT / "docs" / "img"
DEFAULT_OUT = ROOT / "out" / "notebooks"
PLOTS = ("saved_by_tag.png", "pareto.png", "batch_fit.png")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _snapshot(folder: pathlib.Path) -> dict:
    """{name: (sha256, mtime_ns)} of every file in `folder`."""
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.slow  # ~2 min each; test_docs_img_is_written_only_on_request runs its settings cell fast
@pytest.mark.parametrize("model", ["gpt2", "llama3"])
def test_memory_explorer_runs_and_writes_plots(model, tmp_path, monkeypatch):
    """gpt2 with the default output folder (out/notebooks), llama3 with REMAT_NB_OUT: either way the
    README's figures in docs/img are not touched."""
    monkeypatch.setenv("REMAT_NB_SHAPE", "tiny")
    monkeypatch.setenv("REMAT_NB_MODEL", model)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.delenv("REMAT_WRITE_DOCS_IMG", raising=False)
    monkeypatch.delenv("REMAT_NB_TARGET", raising=False)  # the default: XLA:GPU for an H200
    if model == "gpt2":
        monkeypatch.delenv("REMAT_NB_OUT", raising=False)
        out = DEFAULT_OUT
    else:
        monkeypatch.setenv("REMAT_NB_OUT", str(tmp_path))
        out = tmp_path
    docs_before = _snapshot(DOCS_IMG)
    assert set(PLOTS) <= set(docs_before)
    started = time.time_ns()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError, with the traceback, on the first failing cell

    errors = [out for cell in nb.cells if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, errors
    # the kernel starts JAX as a user's would (no JAX_PLATFORMS here): no plugin traceback on a CPU host
    stderr = "".join(out.get("text", "") for cell in nb.cells if cell.cell_type == "code"
                     for out in cell.get("outputs", []) if out.get("name") == "stderr")
    assert not any(n in stderr for n in ("Traceback", "INVALID_ARGUMENT")), stderr
    assert all(cell.get("execution_count") for cell in nb.cells if cell.cell_type == "code")
    for name in PLOTS:
        path = out / name
        assert path.is_file() and path.stat().st_mtime_ns >= started, f"the notebook did not write {name}"
        data = path.read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 1000, f"{name} is not a non-empty PNG"
    assert _snapshot(DOCS_IMG) == docs_before, "running the notebook rewrote docs/img"


def _first_cell(monkeypatch, **env) -> dict:
    """Run the notebook's first code cell (imports and settings: no model work) with `env`; its globals."""
    for k in ("REMAT_NB_OUT", "REMAT_WRITE_DOCS_IMG", "REMAT_NB_TARGET"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(NOTEBOOK.parent)  # where nbclient runs it: the repository is found from here
    cell = next(c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code")
    scope = {}
    exec(compile(cell.source, "memory_explorer.ipynb[1]", "exec"), scope)
    return scope


def _first_cell_out(monkeypatch, **env) -> pathlib.Path:
    return _first_cell(monkeypatch, **env)["OUT"]


def test_docs_img_is_written_only_on_request(monkeypatch, capsys):
    """REMAT_WRITE_DOCS_IMG=1 chooses docs/img; REMAT_NB_OUT pointing there without it is refused."""
    assert _first_cell_out(monkeypatch) == DEFAULT_OUT
    assert _first_cell_out(monkeypatch, REMAT_WRITE_DOCS_IMG="1") == DOCS_IMG
    with pytest.raises(ValueError, match="REMAT_WRITE_DOCS_IMG=1"):
        _first_cell_out(monkeypatch, REMAT_NB_OUT=os.path.relpath(DOCS_IMG, NOTEBOOK.parent))


def test_target_is_read(monkeypatch, capsys):
    """Section 3 compiles for REMAT_NB_TARGET (default h200); a name that is no target is refused."""
    assert _first_cell(monkeypatch)["TARGET"].name == "h200"
    assert _first_cell(monkeypatch, REMAT_NB_TARGET="v5e")["TARGET"].compiler == "XLA:TPU"
    with pytest.raises(ValueError, match="not known"):
        _first_cell(monkeypatch, REMAT_NB_TARGET="h999")
