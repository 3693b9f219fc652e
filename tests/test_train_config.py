"""train.py flags → TrainConfig, and every bad input: exit 2, one line on stderr, nothing written.

All in-process (`train.main(argv)`), and none of these compiles a train step: every check runs in
`TrainConfig.__post_init__` or `remat_lm.training.prepare`, before anything is built or written.
"""
import dataclasses
import os

import numpy as np
import pytest

import train
from remat_lm.models import gpt2
from remat_lm.models.llmc import save as save_llmc
from remat_lm.models.llmc_io import write_tokens
from remat import policies
from remat_lm.training import TrainConfig, UsageError, build_parser, config_from_args
from remat_lm.training.config import MODELS, parse_mesh
from remat_lm.training.data import default_corpus


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """A few KB of Python source: enough for tiny windows."""
    path = tmp_path_factory.mktemp("data") / "code.txt"
    path.write_bytes(open(default_corpus()[0], "rb").read()[:20000])
    return str(path)


def _exit2(argv, capsys, tmp_path):
    """Run train.main(argv) with an output dir and a log file under tmp_path; return the error line."""
    before = sorted(os.listdir(tmp_path))
    argv = list(argv) + ["--log_jsonl", str(tmp_path / "out" / "log.jsonl"), "--no-progress"]
    if "--checkpoint_dir" not in argv:
        argv += ["--checkpoint_dir", str(tmp_path / "ck")]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("train.py: error: ") and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == before, "a usage error must write nothing"
    return lines[0]


# ------------------------------------------------------------------------------------------------
# Flags generated from the fields


def test_every_field_is_a_documented_flag():
    text = build_parser().format_help()
    for f in dataclasses.fields(TrainConfig):
        assert f"--{f.name}" in text
        assert f.metadata["help"]


def test_help_exits_0_and_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--activation_recompute" in out and "python train.py --model gpt2 --preset tiny" in out
    for name in policies.names():  # --remat_policy's help lists the registry
        assert name in " ".join(out.split())


def test_docstring_starts_with_commands():
    body = train.__doc__.split("\n\n", 1)[1]
    assert body.lstrip().startswith("python train.py")


def test_flag_types_and_defaults():
    cfg = config_from_args(["--model", "llama3", "--preset", "tiny", "--batch_size", "4", "--learning_rate", "1e-3",
                            "--data", "a.txt", "b.txt", "--activation_recompute", "--scan_layers"])
    assert (cfg.model, cfg.batch_size, cfg.learning_rate, cfg.data) == ("llama3", 4, 1e-3, ("a.txt", "b.txt"))
    assert cfg.activation_recompute is True and cfg.scan_layers is True
    assert config_from_args([]) == TrainConfig()


@pytest.mark.parametrize("argv,granularity,method", [
    ([], "none", "none"),
    (["--activation_recompute"], "full", "none"),
    (["--activation_recompute", "--recompute_method", "uniform", "--recompute_num_layers", "2"], "full", "uniform"),
    (["--activation_recompute", "--recompute_granularity", "selective"], "selective", "none"),
    (["--recompute_granularity", "full", "--recompute_method", "block"], "full", "block"),
    (["--recompute_granularity", "selective", "--recompute_modules", "core_attn,mlp"], "selective", "none"),
])
def test_recompute_flag_mapping(argv, granularity, method):
    rc = config_from_args(argv).recompute
    assert (rc.granularity, rc.method) == (granularity, method)


def test_recompute_flags_reach_the_config():
    cfg = config_from_args(["--activation_recompute", "--recompute_method", "block", "--recompute_num_layers", "2",
                            "--remat_policy", "save_names:qkv", "--use_reentrant", "--no-use_reentrant"])
    rc = cfg.recompute
    assert (rc.num_layers, rc.policy, rc.use_reentrant) == (2, "save_names:qkv", False)
    assert config_from_args(["--recompute_granularity", "selective", "--recompute_modules",
                             "core_attn,mlp"]).recompute.modules == ("core_attn", "mlp")


@pytest.mark.parametrize("policy", policies.examples())
def test_every_registry_policy_is_accepted(policy):
    assert config_from_args(["--activation_recompute", "--remat_policy", policy]).recompute.policy == policy


def test_method_comma_list_gives_one_config_per_method():
    cfg = TrainConfig(activation_recompute=True, recompute_method="none,uniform,block", recompute_num_layers=2,
                      memory_report=True)
    assert [rc.method for _, rc in cfg.recompute_configs()] == ["none", "uniform", "block"]


def test_parse_mesh():
    assert parse_mesh("data=2,fsdp=4") == {"data": 2, "fsdp": 4, "tensor": 1}
    assert parse_mesh("fsdp=8") == {"data": 1, "fsdp": 8, "tensor": 1}
    assert parse_mesh("data=2,fsdp=2,tensor=2") == {"data": 2, "fsdp": 2, "tensor": 2}
    for bad in ("data=0", "x=2", "data=2,data=2", "data", "data=two", "tensor=0"):
        with pytest.raises(ValueError, match="--mesh"):
            parse_mesh(bad)


@pytest.mark.parametrize("model", MODELS)
def test_every_preset_is_a_valid_choice(model):
    from remat_lm.training.config import model_presets
    for p in model_presets(model):
        TrainConfig(model=model, preset=p)


# ------------------------------------------------------------------------------------------------
# Bad input: each exits 2 with one line and writes nothing


@pytest.mark.parametrize("argv,match", [
    (["--dtype", "float16"], "invalid choice"),
    (["--model", "gpt3"], "invalid choice"),
    (["--recompute_granularity", "most"], "invalid choice"),
    (["--recompute_method", "sometimes", "--activation_recompute"], "--recompute_method: 'sometimes' is not valid"),
    (["--preset", "d99"], "not a gpt2 preset"),
    (["--remat_policy", "nothing_at_all", "--activation_recompute"], "unknown policy"),
    (["--remat_policy", "nothing_saveable", "--activation_recompute"], "--remat_policy: unknown policy 'nothing_saveable'"),
    (["--recompute_modules", "attention", "--recompute_granularity", "selective"], "valid modules"),
    (["--batch_size", "0"], "--batch_size 0 must be"),
    (["--batch_size", "four"], "argument --batch_size: expected an integer, got 'four'"),
    (["--learning_rate", "nan"], "--learning_rate"),
    (["--no_such_flag"], "unrecognized arguments"),
    (["--mesh", "data=2;fsdp=4"], "--mesh"),
    (["--attention", "pallas", "--sequence_length", "128"],
     "--attention pallas cannot run: it needs a TPU and the program is built for cpu; use --attention tiled"),
])
def test_unknown_flag_values(argv, match, capsys, tmp_path, text_file):
    assert match in _exit2(argv + ["--data", text_file], capsys, tmp_path)


@pytest.mark.parametrize("argv,match", [
    # --recompute_num_layers larger than the model's layers, or < 1 with uniform/block
    (["--activation_recompute", "--recompute_method", "uniform", "--recompute_num_layers", "3"],
     "--recompute_num_layers: 3 exceeds n_layer=2; use 1..2"),
    (["--activation_recompute", "--recompute_method", "block", "--recompute_num_layers", "0"],
     "--recompute_num_layers: must be >= 1 (got 0)"),
    (["--model", "llama3", "--activation_recompute", "--recompute_method", "block", "--recompute_num_layers", "9"],
     "exceeds n_layer=2"),
    # selective with --use_reentrant
    (["--recompute_granularity", "selective", "--use_reentrant"], "--use_reentrant: cannot be combined"),
    (["--activation_recompute", "--recompute_granularity", "selective", "--use_reentrant"], "cannot be combined"),
    # --recompute_method without --activation_recompute: says how to fix
    (["--recompute_method", "uniform", "--recompute_num_layers", "2"], "add --activation_recompute"),
    (["--recompute_method", "block"], "add --activation_recompute"),
    # other inconsistent recompute flags
    (["--activation_recompute", "--recompute_granularity", "none"], "contradicts"),
    (["--recompute_granularity", "selective", "--recompute_method", "uniform"],
     "--recompute_method: uniform applies to granularity full"),
    (["--remat_policy", "dots"], "--remat_policy: has no effect with recompute off; add --activation_recompute"),
    (["--use_reentrant"], "--use_reentrant: has no effect with recompute off"),
    (["--activation_recompute", "--recompute_modules", "mlp"],
     "--recompute_modules: mlp applies to granularity selective only"),
    (["--activation_recompute", "--use_reentrant", "--remat_policy", "dots"],
     "--use_reentrant and --remat_policy: the reentrant path saves only the inputs, so policy 'dots' has no effect"),
    (["--activation_recompute", "--recompute_method", "uniform,block"], "needs --memory_report"),
])
def test_inconsistent_recompute_flags(argv, match, capsys, tmp_path, text_file):
    assert match in _exit2(argv + ["--data", text_file], capsys, tmp_path)


def test_missing_data_file(capsys, tmp_path):
    assert "no such file" in _exit2(["--data", str(tmp_path / "nope.txt")], capsys, tmp_path)


def test_missing_glob(capsys, tmp_path):
    assert "matches no file" in _exit2(["--data", str(tmp_path / "shard_*.bin")], capsys, tmp_path)


def test_empty_data_file(capsys, tmp_path_factory, tmp_path):
    empty = tmp_path_factory.mktemp("d") / "empty.txt"
    empty.write_bytes(b"")
    assert "is empty" in _exit2(["--data", str(empty)], capsys, tmp_path)


def test_empty_token_shard(capsys, tmp_path_factory, tmp_path):
    shard = tmp_path_factory.mktemp("d") / "empty.bin"
    header = np.zeros(256, "<i4")
    header[:3] = [20240520, 1, 0]
    shard.write_bytes(header.tobytes())
    assert "empty shard" in _exit2(["--data", str(shard)], capsys, tmp_path)


def test_too_short_data(capsys, tmp_path_factory, tmp_path):
    short = tmp_path_factory.mktemp("d") / "short.txt"
    short.write_bytes(b"x = 1\n")
    assert "needs at least 65" in _exit2(["--data", str(short), "--val_every", "0"], capsys, tmp_path)


def test_shard_with_wrong_magic(capsys, tmp_path_factory, tmp_path):
    shard = tmp_path_factory.mktemp("d") / "bad.bin"
    header = np.zeros(256, "<i4")
    header[:3] = [12345, 1, 100]
    shard.write_bytes(header.tobytes() + np.arange(100, dtype="<u2").tobytes())
    line = _exit2(["--data", str(shard)], capsys, tmp_path)
    assert "--data" in line and "unknown magic 12345" in line


def test_val_shard_with_wrong_magic(capsys, tmp_path_factory, tmp_path, text_file):
    d = tmp_path_factory.mktemp("d")
    write_tokens(d / "train.bin", np.arange(5000) % 256)
    bad = d / "val.bin"
    bad.write_bytes(b"\0" * 2048)
    assert "--val_data" in _exit2(["--data", str(d / "train.bin"), "--val_data", str(bad)], capsys, tmp_path)


def test_shard_token_ids_beyond_vocab(capsys, tmp_path_factory, tmp_path):
    shard = tmp_path_factory.mktemp("d") / "gpt2_tokens.bin"
    write_tokens(shard, np.arange(5000) % 300)  # ids up to 299, tiny's vocab is 256
    line = _exit2(["--data", str(shard)], capsys, tmp_path)
    assert "token ids up to 299" in line and "vocab_size is 256" in line


def test_mixed_shards_and_text(capsys, tmp_path_factory, tmp_path, text_file):
    shard = tmp_path_factory.mktemp("d") / "t.bin"
    write_tokens(shard, np.arange(500) % 256)
    assert "mixes token shards" in _exit2(["--data", str(shard), text_file], capsys, tmp_path)


def _llmc_file(directory, **overrides):
    import jax
    cfg = gpt2.GPT2Config.preset("tiny", **overrides)
    path = directory / f"model_{'_'.join(f'{k}{v}' for k, v in overrides.items()) or 'tiny'}.bin"
    save_llmc(str(path), cfg, gpt2.init_params(cfg, jax.random.PRNGKey(0)))
    return str(path)


@pytest.mark.parametrize("overrides", [dict(n_layer=3), dict(n_embd=64), dict(vocab_size=300)])
def test_init_from_flags_that_disagree_with_the_header(overrides, capsys, tmp_path_factory, tmp_path, text_file):
    """The shape comes from the file's header; a flag that says otherwise exits 2 naming both."""
    (k, v), = overrides.items()
    path = _llmc_file(tmp_path_factory.mktemp("m"), **overrides)
    flag = {"n_layer": "2", "n_embd": "32", "vocab_size": "256"}[k]
    line = _exit2(["--init_from", path, "--data", text_file, f"--{k}", flag], capsys, tmp_path)
    assert f"--{k} {flag} but the file has {k} {v}" in line


def test_init_from_wrong_model_kind(capsys, tmp_path_factory, tmp_path, text_file):
    path = _llmc_file(tmp_path_factory.mktemp("m"))
    line = _exit2(["--model", "llama3", "--init_from", path, "--data", text_file], capsys, tmp_path)
    assert "is an llm.c gpt2 model" in line


def test_init_from_not_a_model(capsys, tmp_path_factory, tmp_path, text_file):
    shard = tmp_path_factory.mktemp("d") / "tokens.bin"
    write_tokens(shard, np.arange(500) % 256)
    assert "not a model file" in _exit2(["--init_from", str(shard), "--data", text_file], capsys, tmp_path)


def test_init_from_missing(capsys, tmp_path, text_file):
    assert "no such file" in _exit2(["--init_from", str(tmp_path / "x.bin"), "--data", text_file], capsys, tmp_path)


def test_resume_with_empty_directory(capsys, tmp_path_factory, tmp_path, text_file):
    d = tmp_path_factory.mktemp("empty_ck")
    line = _exit2(["--resume", "--checkpoint_dir", str(d), "--data", text_file], capsys, tmp_path)
    assert "holds no complete checkpoint" in line and os.listdir(d) == []


def test_resume_with_missing_directory(capsys, tmp_path, text_file):
    line = _exit2(["--resume", "--checkpoint_dir", str(tmp_path / "none"), "--data", text_file], capsys, tmp_path)
    assert "holds no complete checkpoint" in line and not (tmp_path / "none").exists()


def test_resume_with_foreign_directory(capsys, tmp_path_factory, tmp_path, text_file):
    d = tmp_path_factory.mktemp("foreign_ck")
    (d / "7").mkdir()
    (d / "7" / "weights.npz").write_bytes(b"not ours")
    line = _exit2(["--resume", "--checkpoint_dir", str(d), "--data", text_file], capsys, tmp_path)
    assert "not a checkpoint written by train.py" in line


def test_resume_without_checkpoint_dir(capsys, tmp_path, text_file):
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", "--data", text_file])
    assert e.value.code == 2 and "--resume needs --checkpoint_dir" in capsys.readouterr().err


@pytest.mark.parametrize("mesh", ["data=3", "fsdp=5", "data=2,fsdp=3"])
def test_mesh_not_dividing_the_device_count(mesh, capsys, tmp_path, text_file):
    import jax
    # tests/conftest.py gives 8 host devices; none of these meshes divides 8
    assert jax.device_count() % int(np.prod(list(parse_mesh(mesh).values()))) != 0
    assert "does not divide the" in _exit2(["--mesh", mesh, "--data", text_file], capsys, tmp_path)
    # the batch case needs several devices: tests/test_train_cli.py runs it on 8 host devices


def test_usage_error_is_a_value_error():
    assert issubclass(UsageError, ValueError)
    with pytest.raises(UsageError, match="--grad_accum_steps"):
        TrainConfig(grad_accum_steps=0)


# ------------------------------------------------------------------------------------------------
# Values past what int32 can count or index: one line naming the limit, exit 2, from the real CLIs.

@pytest.mark.parametrize("argv,needle", [
    (["train.py", "--batch_size", "1099511627776", "--dry_run"],
     "--batch_size 1099511627776 is out of range; use an integer in 1..2147483647"),
    (["-m", "remat_lm.sample", "run", "--sample_length", "2147483648"],
     "--sample_length: expected an integer in 1..2147483646, got '2147483648'"),
])
def test_a_value_past_int32_exits_2_with_one_line(argv, needle):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, *argv], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0], p.stderr


def test_a_micro_batch_past_int32_tokens_names_the_product():
    with pytest.raises(UsageError, match=r"--batch_size 33554432 x --sequence_length 64 = 2147483648 tokens per "
                                         r"micro-batch exceeds 2147483647"):
        TrainConfig(batch_size=2**25, sequence_length=64)
