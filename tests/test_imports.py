"""Imports run one way: entry points → remat_lm.training → remat_lm.models → remat, with no circles.

The tree's imports are read with `ast` (nothing is imported): every `import X` and `from X import Y`,
at module level or inside a function, in remat/, remat_lm/ and train.py. `from P import Y` is an
edge to the module P.Y when Y is a module of the tree, else to P itself (a package's __init__).

# NOTE: the edges are what the source names; Python also runs every parent package's __init__
# before a module, which is not drawn as an edge here. The package __init__ files that re-export
# (remat/__init__.py, remat_lm/training/__init__.py) are modules like any other: their own edges
# are checked, and nothing inside their package imports the bare package name (that would close a
# circle through the __init__, and the cycle check would report it).
"""
from __future__ import annotations

import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The layers, lowest first; an import may go down or stay within a layer, never up.
# `remat_lm.argtypes` is the command-line kit: the trainer and the programs use it, models do not.
LAYERS = (
    ("library", ("remat",)),
    ("models", ("remat_lm.models",)),
    ("training", ("remat_lm.training", "remat_lm.argtypes")),
    ("programs", ("train", "remat_lm.train", "remat_lm.sample", "remat_lm.llmc", "remat_lm.bench")),
)
# What the library may import from outside the tree: JAX, Flax, NumPy, SciPy (jaxlib's own dependency:
# the planner's exact solver, scipy.optimize.milp) and the standard library, minus what belongs to a
# program (flags) or an application (optimizers, checkpoints).
LIBRARY_MAY_IMPORT = {"jax", "jaxlib", "flax", "numpy", "scipy"}
LIBRARY_MAY_NOT_IMPORT = {"argparse"}

# NOTE: known edges still to remove, each to be deleted with its fix; the tests fail on any edge
# not listed here (and on a listed edge that is gone, so the list cannot go stale).
PENDING: set = set()  # (importer, imported) edges still to fix; empty: none


def _modules() -> dict[str, str]:
    """{module name: path} of every .py file in remat/, remat_lm/ and train.py."""
    out = {"train": os.path.join(ROOT, "train.py")}
    for top in ("remat", "remat_lm"):
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(x for x in dirs if not x.startswith((".", "__")))
            for f in sorted(files):
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].split(os.sep)
                    out[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = os.path.join(d, f)
    return out


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
    """The dotted names `name` imports: modules of the tree (resolved) and outside ones (as written)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level-1 packages
                parts = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in MODULES else base)
    return out


def _edges() -> dict[str, set[str]]:
    """{module: the modules of the tree it imports}; outside imports left out."""
    edges = {}
    for name, path in MODULES.items():
        targets = set()
        for t in _imports(name, path):
            while t and t not in MODULES:  # `import remat.memory` names a module; `jax.numpy` is outside
                t = t.rpartition(".")[0]
            if t and t != name:
                targets.add(t)
        edges[name] = targets
    return edges


EDGES = _edges()


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    if module == "remat_lm":  # the application package's own __init__ (a docstring)
        return 0
    raise AssertionError(f"{module} belongs to no layer; add it to LAYERS in tests/test_imports.py")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _without_pending(edges):
    return {a: {b for b in bs if (a, b) not in PENDING} for a, bs in edges.items()}


def test_the_scan_sees_top_level_function_level_and_from_imports():
    # a function-level import, a `from package import module` and a `from module import name`
    assert "remat_lm.models.family" in EDGES["remat_lm.models.memory_model"]
    assert "remat_lm.models.family" in EDGES["remat_lm.bench.common"]  # inside reference_config()
    assert {"remat.names", "remat.memory", "remat.config"} <= EDGES["remat"]
    assert "remat_lm.training.config" in EDGES["remat_lm.training"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    cycles = _cycles(_without_pending(EDGES))
    assert not cycles, "import circles (each a set of modules that reach each other): " + "; ".join(
        " ↔ ".join(c) for c in cycles)


def test_imports_run_one_way():
    """Programs → training (and the CLI kit) → models → the library; never up a layer."""
    up = sorted((a, b) for a, bs in _without_pending(EDGES).items() for b in bs if _layer(b) > _layer(a))
    assert not up, "imports up a layer (" + " → ".join(n for n, _ in reversed(LAYERS)) + "): " + ", ".join(
        f"{a} imports {b}" for a, b in up)


def test_pending_exceptions_are_still_there():
    """Each PENDING edge exists; delete it from the list when its fix lands."""
    gone = sorted(e for e in PENDING if e[1] not in EDGES.get(e[0], ()))
    assert not gone, f"fixed: remove {gone} from PENDING in tests/test_imports.py"


def test_the_library_imports_only_jax_flax_numpy_scipy_and_the_standard_library():
    allowed = LIBRARY_MAY_IMPORT | (set(sys.stdlib_module_names) - LIBRARY_MAY_NOT_IMPORT) | {"__future__"}
    bad = sorted((name, t) for name, path in MODULES.items() if _layer(name) == 0 and name != "remat_lm"
                 for t in _imports(name, path) if t.split(".")[0] not in allowed | {"remat"})
    assert not bad, "remat/ imports outside jax, flax, numpy, scipy and the standard library: " + ", ".join(
        f"{a} imports {b}" for a, b in bad)
    assert not any(t.startswith("remat_lm") for name, path in MODULES.items() if name.split(".")[0] == "remat"
                   for t in _imports(name, path))
