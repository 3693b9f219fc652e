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
# alone at the end. The longest files (summed `--durations=0` of the fast set) start first; every
# other file keeps its place after them, and the order inside a file is unchanged.
LONG_FIRST = ("test_models.py", "test_train_faults.py", "test_stacks.py", "test_train_cli.py",
              "test_train_run.py", "test_host_start.py", "test_checkpoint.py", "test_hf_style.py",
              "test_target_cli.py", "test_bench.py", "test_attention.py", "test_sample.py",
              "test_lowering.py", "test_flag_to_program.py", "test_linen_remat.py", "test_targets.py",
              "test_loss_chunk.py", "test_target_peaks.py", "test_planner.py", "test_untagged_plan.py",
              "test_train_config.py", "test_offload_targets.py", "test_jax_remat_cases.py",
              "test_checkpoint_conformance.py", "test_llmc.py", "test_memory_model.py",
              "test_stack_side_outputs.py", "test_outside_models.py", "test_tensor_parallel.py",
              "test_bf16_policy.py", "test_nnx_stack_state.py", "test_equinox_recipe.py",
              "test_train_paths.py", "test_doctests.py", "test_nnx_stack_scan.py", "test_policies.py")


# NOTE: heavy cases whose property a fast sibling of the same test asserts run with the slow set
# (make test-all), so that make test stays within 10 minutes on 2 cores; each entry: a node-id
# prefix -> the sibling that stays in the fast run.
SLOW_SIBLINGS = {
    "test_nnx_stack_state.py::test_scan_over_layers_equals_flax_nnx_scan_with_nnx_remat[none-": "[full-*]",
    "test_nnx_stack_state.py::test_scan_over_layers_equals_flax_nnx_scan_with_nnx_remat[uniform2-": "[full-*]",
    "test_nnx_stack_state.py::test_loop_layout_equals_a_loop_of_nnx_remat_layers[none]": "[full]",
    "test_nnx_stack_state.py::test_loop_layout_equals_a_loop_of_nnx_remat_layers[uniform2]": "[full]",
    "test_nnx_stack_state.py::test_batch_statistics_are_written_back_when_the_stack_owns_the_randomness[scan]":
        "[loop]; the scan layout's write-back: test_scan_over_layers_equals_flax_nnx_scan_with_nnx_remat",
    "test_stack_side_outputs.py::test_linen_side_outputs_equal_a_plain_loop[none-": "[full-*], [uniform2-*]",
    "test_stack_side_outputs.py::test_nnx_side_outputs_equal_a_plain_loop[none-": "[full-*], [uniform2-*]",
    "test_equinox_recipe.py::test_equinox_model_adopts_remat[block save_names": "[block full], [grouped uniform 2]",
    "test_llmc.py::test_verify_passes_for_every_recompute_setting[llama3---activation_recompute": "[gpt2-...]",
    "test_sample.py::test_greedy_equals_repeated_argmax_of_the_full_forward[gpt2-20]": "[gpt2-5]",
    "test_sample.py::test_greedy_equals_repeated_argmax_of_the_full_forward[llama3-5]": "[gpt2-5] (shared decode code)",
    "test_attention.py::test_tiled_matches_xla_core_with_dropout[T%tile-float32]": "[K<H-float32]",
    "test_train_run.py::test_acceptance_command_runs_with_finite_losses[llama3-selective]": "[gpt2-uniform]",
    "test_models.py::test_recompute_matches_no_remat[llama3-selective-core_attn-loop]":
        "[gpt2-selective-core_attn-loop] (the shared Block)",
    "test_stacks.py::test_plain_functions[full-none1-custom:": "the other policies of test_plain_functions",
    "test_checkpoint.py::test_gradients_equal_for_every_policy[offload_names:": "[offload_names:...] of test_stacks",
    "test_checkpoint.py::test_dropout_inside_a_region_uses_the_same_mask[True]": "[False]",
    "test_lowering.py::test_train_step_lowers_for_gpu_and_tpu[llama3-none]": "[gpt2-none], [llama3-tensor2]",
    "test_lowering.py::test_train_step_lowers_for_gpu_and_tpu[llama3-bf16]": "[gpt2-bf16], [llama3-tensor2]",
    "test_models.py::test_recompute_matches_no_remat[gpt2-full-uniform2-L3-scan]":
        "[gpt2-full-block2-L3-scan] (a remainder under scan), [gpt2-full-uniform2-L3-loop]",
    "test_host_start.py::test_bad_input_is_one_line_with_no_traceback[planner-mesh]": "[planner-target]",
    "test_host_start.py::test_bad_input_is_one_line_with_no_traceback[planner-local-mesh]": "[planner-target]",
    "test_stacks.py::test_linen_stack_scan[none-none1-default]": "[full-none1-default]",
    "test_equinox_recipe.py::test_equinox_model_adopts_remat[block full]": "[grouped uniform 2]",
    "test_flag_to_program.py::test_compiled_temp_is_the_settings[uniform2]": "[full], [none]",
    "test_stack_side_outputs.py::test_linen_side_outputs_equal_a_plain_loop[full-": "[uniform2-loop], [uniform2-scan]",
    "test_target_peaks.py::test_full_remat_cuts_temp_on_tpu_without_vmem":
        "test_full_remat_cuts_compiled_temp_on_gpu; docs/targets.md's no-VMEM block (test_doc_figures)",
    "test_planner.py::test_hand_settings_compile_like_their_per_layer_form[block 2]":
        "none fast: the legacy bench's cache assumption, two XLA:GPU compiles; [selective mlp+norm] slow too",
}


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        node = f"{item.path.name}::{item.name}"
        if any(node.startswith(prefix) for prefix in SLOW_SIBLINGS):
            item.add_marker(pytest.mark.slow)
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
