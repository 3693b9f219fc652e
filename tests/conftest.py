"""Test configuration: CPU only, tests/ importable (tinyblocks, llmc_reference)."""
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# 8 CPU devices for the sharding tests; set before JAX starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(__file__))
