"""Test configuration: tests/ importable (tinyblocks, llmc_reference), 8 CPU devices; JAX's platform
is what `import remat` gives this host, as in a user's process (the CPU without an accelerator)."""
import os
import shutil
import sys
import tempfile

import pytest

# 8 CPU devices for the sharding tests; set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(__file__))

# NOTE: one persistent XLA compilation cache per test run for the train.py/bench subprocesses the
# tests start (they inherit this environment; the controller loads this file before it starts the
# xdist workers). Those processes compile the same tiny train steps again and again; a program
# compiled once is loaded by every later process that builds it (measured: the subprocess-heavy
# files ran 25-35% faster). The test processes themselves do not use it: their programs are mostly
# unique and writing them cost more than it saved. The cache is made empty for each run and
# removed at its end, so no result depends on an earlier run.
_OWN_CACHE = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _OWN_CACHE:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="remat-tests-xla-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402  (after the environment above is set)
import remat  # noqa: E402,F401  (the one call a user's script makes: remat.prepare_host)

jax.config.update("jax_enable_compilation_cache", False)


def pytest_sessionfinish(session, exitstatus):
    """Remove the compilation cache this process made (the controller's, or a lone run's)."""
    if _OWN_CACHE:
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


# NOTE: the two xdist workers take whole files (`--dist loadfile`) in collection order, each taking
# the next file when it finishes one, so a long file collected late can leave one worker running
# alone at the end. The longest files (summed `--durations=0` of the fast set, 2026-12-01) start
# first; every other file keeps its place after them, and the order inside a file is unchanged.
LONG_FIRST = ("test_train_run.py", "test_models.py", "test_stacks.py", "test_train_faults.py", "test_planner.py",
              "test_examples.py", "test_tensor_parallel.py", "test_lowering.py", "test_flag_to_program.py",
              "test_multiprocess.py", "test_bench.py", "test_resume_integrity.py", "test_llmc.py", "test_notebook.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order stays


@pytest.fixture(autouse=True)
def _untagged_warnings_fresh():
    """Each test sees the untagged-region warning afresh: the library says it once per region and
    program per process, and two tests may build the same program."""
    from remat import policies
    policies._SEEN.clear()
    policies._TAGS.clear()
    yield
