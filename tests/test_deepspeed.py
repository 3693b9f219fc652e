"""--recompute_segments, --recompute_every, --cpu_checkpointing and --deepspeed_config: parsing, bad
input (exit 2, one line, nothing written), and the join: each flag changes what the compiled train
step keeps (saved residuals of the model built from the parsed TrainConfig)."""
import json
import os

import jax
import jax.numpy as jnp
import pytest

import train
import remat
from remat import RecomputeConfig, memory
from remat_lm.training import deepspeed
from remat_lm.training.flags import recompute_configs
from remat_lm.training import UsageError, config_from_args
from remat_lm.models.family import get as family

N_LAYER = 4


def _ds(tmp_path, block, name="ds.json", **top):
    path = tmp_path / name
    path.write_text(json.dumps({**top, "activation_checkpointing": block}))
    return str(path)


def _saved(argv):
    """What the backward keeps for the tiny GPT-2 (4 layers) configured by these train.py flags."""
    cfg = config_from_args(["--n_layer", str(N_LAYER)] + argv)
    fam = family(cfg.model)
    mcfg = fam.config(cfg.preset, n_layer=N_LAYER, recompute=cfg.recompute)
    params = fam.init_params(mcfg, jax.random.PRNGKey(0))
    idx = jnp.zeros((2, 32), jnp.int32)
    return memory.saved_residuals(lambda p: fam.loss_fn(p, mcfg, idx, idx), params)


def test_flags_change_what_the_train_step_keeps(tmp_path):
    none, full = _saved([]), _saved(["--activation_recompute"])
    seg = _saved(["--activation_recompute", "--recompute_segments", "0-2,2-4"])
    gap = _saved(["--activation_recompute", "--recompute_segments", "0-2"])
    every = _saved(["--activation_recompute", "--recompute_every", "2"])
    uniform = _saved(["--activation_recompute", "--recompute_method", "uniform", "--recompute_num_layers", "2"])
    ds = _saved(["--deepspeed_config", _ds(tmp_path, {"number_checkpoints": 2})])
    assert seg.total < full.total < every.total < none.total
    assert full.total < gap.total < none.total  # layers 2 and 3 are not rematerialized
    assert seg.total == uniform.total == ds.total  # 2 regions of 2 layers, however they are asked for
    for r in (none, full, seg, every, ds):
        assert r.offloaded == 0
    # cpu_checkpointing: the region inputs (one (B, T, C) float32 per region) wait in host memory
    off = _saved(["--activation_recompute", "--cpu_checkpointing"])
    ds_off = _saved(["--deepspeed_config", _ds(tmp_path, {"cpu_checkpointing": True, "number_checkpoints": 2},
                                               "off.json")])
    region_input = 2 * 32 * 32 * 4
    assert off.offloaded == N_LAYER * region_input and ds_off.offloaded == 2 * region_input
    assert off.total == full.total  # the same values are kept, only where differs
    reentrant = _saved(["--activation_recompute", "--use_reentrant", "--cpu_checkpointing"])
    assert reentrant.offloaded == N_LAYER * region_input
    assert "moves nothing" in off.table()  # on CPU host and device memory are one: said plainly


def test_cpu_checkpointing_puts_region_inputs_in_host_memory_in_the_traced_step():
    cfg = config_from_args(["--activation_recompute", "--cpu_checkpointing"])
    assert cfg.recompute.offload_inputs and cfg.recompute_configs()[0][0] == "full/none+offload_inputs"
    fam = family("gpt2")
    mcfg = fam.config("tiny", recompute=cfg.recompute)
    params = fam.init_params(mcfg, jax.random.PRNGKey(0))
    idx = jnp.zeros((2, 16), jnp.int32)
    text = str(jax.make_jaxpr(jax.grad(lambda p: fam.loss_fn(p, mcfg, idx, idx)))(params))
    assert "<host>" in text and "MemorySpace.Host" in text


def test_deepspeed_block_maps_and_reports_every_key(tmp_path):
    path = _ds(tmp_path, {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 3,
                          "contiguous_memory_optimization": True, "synchronize_checkpoint_boundary": True,
                          "profile": True}, train_batch_size=8, zero_optimization={"stage": 1})
    cfg = config_from_args(["--deepspeed_config", path])
    rc = cfg.recompute
    assert (rc.granularity, rc.layers, rc.offload_inputs, rc.shard_inputs) == ("full", remat.count(3), True, None)
    notes = "\n".join(cfg.deepspeed_notes())
    for key in deepspeed.KEYS:
        assert key in notes
    assert "no tensor-parallel axis" in notes  # partition_activations: why it does nothing here
    assert "not read (only activation_checkpointing is): train_batch_size, zero_optimization" in notes
    # with a tensor axis (the library's own mapping): distributed saved activations
    ds = deepspeed.load(path)
    assert RecomputeConfig(granularity="full", **{**ds.recompute_kwargs("tensor"), "offload_inputs": False}
                           ).shard_inputs == "tensor"


def _exit2(argv, capsys, tmp_path):
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as e:
        train.main(list(argv) + ["--checkpoint_dir", str(tmp_path / "ck"), "--no-progress"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: ") and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == before, "a usage error must write nothing"
    return lines[0]


BAD_BLOCKS = [
    ({"number_checkpoint": 2}, "unknown activation_checkpointing key(s) 'number_checkpoint'; valid keys: "),
    ({"cpu_checkpointing": "yes"}, 'activation_checkpointing.cpu_checkpointing = "yes" must be true or false'),
    ({"number_checkpoints": 0}, "number_checkpoints = 0 must be a positive integer"),
    ({"number_checkpoints": True}, "number_checkpoints = true must be a positive integer"),
    ({"number_checkpoints": 9}, "--deepspeed_config number_checkpoints: 9 exceeds n_layer=2; use 1..2"),
    ({"contiguous_memory_optimization": True}, "contiguous_memory_optimization needs partition_activations"),
    ([1, 2], "\"activation_checkpointing\" must be an object"),
]


@pytest.mark.parametrize("block,needle", BAD_BLOCKS, ids=[str(i) for i in range(len(BAD_BLOCKS))])
def test_bad_deepspeed_blocks_exit_2(block, needle, capsys, tmp_path):
    cfg_dir = tmp_path / "cfg"
    cfg_dir.mkdir()
    line = _exit2(["--deepspeed_config", _ds(cfg_dir, block)], capsys, tmp_path)
    assert needle in line and "--deepspeed_config" in line


@pytest.mark.parametrize("text,needle", [
    ("{not json", "not valid JSON (line 1"), ('{"train_batch_size": 8}', "no \"activation_checkpointing\" block"),
    (None, "no such file")])
def test_bad_deepspeed_files_exit_2(text, needle, capsys, tmp_path):
    path = tmp_path / "cfg" / "ds.json"
    if text is not None:
        path.parent.mkdir()
        path.write_text(text)
    assert needle in _exit2(["--deepspeed_config", str(path)], capsys, tmp_path)


@pytest.mark.parametrize("argv,needle", [
    (["--recompute_granularity", "none", "--recompute_segments", "0-1"],
     "--recompute_segments: has no effect with recompute off; add --recompute_granularity full (not none)"),
    (["--recompute_granularity", "none", "--recompute_every", "2"],
     "--recompute_every: has no effect with recompute off"),
    (["--cpu_checkpointing"], "--cpu_checkpointing: has no effect with recompute off"),
    (["--activation_recompute", "--recompute_segments", "0-2,1-2"], "--recompute_segments: (1, 2) is not valid"),
    (["--activation_recompute", "--recompute_segments", "0-5"],
     "--recompute_segments: 0-5 reaches layer 5 but n_layer=2"),
    (["--activation_recompute", "--recompute_segments", "a-b"], "'a-b' is not START-STOP"),
    (["--activation_recompute", "--recompute_every", "0"], "--recompute_every: must be an integer >= 1 (got 0)"),
    (["--activation_recompute", "--recompute_every", "3"], "--recompute_every: 3 exceeds n_layer=2; use 1..2"),
    (["--activation_recompute", "--recompute_every", "2", "--recompute_segments", "0-1"], "pass only one"),
    (["--activation_recompute", "--recompute_every", "2", "--recompute_method", "uniform"],
     "--recompute_every and --recompute_method: every(2) and method uniform each say which "
     "layers are regions; pass only one"),
    (["--recompute_granularity", "selective", "--recompute_every", "2"],
     "--recompute_every: every(2) applies to granularity full only"),
    (["--recompute_method", "auto", "--memory_budget", "1GiB", "--cpu_checkpointing"],
     "auto cannot be combined with --cpu_checkpointing"),
])
def test_bad_recompute_flags_exit_2(argv, needle, capsys, tmp_path):
    assert needle in _exit2(argv, capsys, tmp_path)


def test_deepspeed_with_conflicting_flags(tmp_path):
    path = _ds(tmp_path, {"number_checkpoints": 2})
    for argv, needle in ((["--recompute_every", "2"], "--recompute_every and --deepspeed_config number_checkpoints"),
                         (["--recompute_granularity", "selective"], "granularity full")):
        with pytest.raises(UsageError, match=needle):
            config_from_args(["--deepspeed_config", path] + argv)


def test_library_flags_function_labels():
    ds = deepspeed.parse({"activation_checkpointing": {"number_checkpoints": 2}})
    labels = [recompute_configs(activation_recompute=True, segments="0-3,3-5")[0][0],
              recompute_configs(activation_recompute=True, every=2, cpu_checkpointing=True)[0][0],
              recompute_configs(deepspeed=ds)[0][0]]
    assert labels == ["full/segments/0-3,3-5", "full/every/2+offload_inputs", "full/regions/2"]
