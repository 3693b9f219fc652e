"""Tests that compile for a GPU or TPU target (remat.planning.targets): `need(platform)` at the top of a test.

Where the target compilers are missing (the `targets` extra is not installed) a test skips, naming
the install; under CI (`CI=true`, as `.ci/run` sets) it fails instead: CI installs the extra, so a
missing compiler there is a broken set-up, never a reason to go green.
"""
import os

import pytest

from remat.planning import targets

GPU, TPU = "h200", "v5e"  # the targets the compiled-peak tests build for


def need(*platforms: str) -> None:
    for platform in platforms:
        if targets.available(platform):
            continue
        msg = f"no {platform} compiler in this environment: {targets.EXTRA}"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must compile for every target; {msg}")
        pytest.skip(msg)
