"""Trust at the edges: what train.py reads and writes.

- every model-config flag reaches the model built from an `--init_from FILE.bin`, as it reaches the
  preset's (`--attention`, `--attention_tile` and `--loss_chunk` included);
- an output path (log, checkpoints, profile) that is, or lies inside, an input is refused before
  anything is written (`--log_jsonl` naming `--data` would truncate it; a memory-mapped shard would die by SIGBUS);
- inputs that cannot be read (another user's file), text too large to read into memory (a 64 GiB
  sparse file), a step too large for JAX to count, and a full disk under `--log_jsonl` each end
  with one line.
The bad-input sweep over every path flag (empty, special files, output = input) is in
tests/test_train_faults.py.
"""
import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from remat_lm.models import gpt2, llama3
from remat_lm.models import llmc
from remat_lm.models.llmc_io import write_tokens
from remat_lm.training import TrainConfig, UsageError, config_from_args, prepare
from remat_lm.training.compile import abstract_with_sharding
from remat_lm.training.prepare import flag_fields
from remat_lm.training.step import make_train_step
from trainhelp import ROOT, _env, _one_line, text_file  # noqa: F401 (text_file is a fixture)

QUIET = ["--val_every", "0", "--no-progress", "--num_iterations", "2"]
# T=32 with two tiles of 16 (or four of 8) keeps every flag's program different and small.
BASE = ["--preset", "tiny", "--sequence_length", "32", "--batch_size", "2", "--no-preflight"] + QUIET


# ------------------------------------------------------------------------------------------------
# every model-config flag reaches the model built from --init_from FILE.bin

# Two values of each model-config flag that is not a shape (the header fixes those).
FLAG_VALUES = {
    "attention": ("xla", "tiled"),
    "attention_tile": ("8", "16"),
    "loss_chunk": ("0", "8"),
    "dropout": ("0", "0.1"),
    "dtype": ("float32", "bfloat16"),
    "scan_layers": (False, True),
}
SHAPES = ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")


def test_every_model_config_flag_is_covered():
    """The model-config fields that are also flags: the shape flags, and the ones `flag_fields` sets
    (and this file tests), whatever the family. A new such flag must join FLAG_VALUES."""
    train = {f.name for f in dataclasses.fields(TrainConfig)}
    for cfg_cls in (gpt2.GPT2Config, llama3.Llama3Config):
        shared = {f.name for f in dataclasses.fields(cfg_cls)} & train
        assert shared - set(SHAPES) == set(flag_fields(TrainConfig())) == set(FLAG_VALUES), cfg_cls


def _argv(flag, value):
    if flag == "attention":  # T=32 fits one default tile, where the tiled core is the xla core: tile by 8
        return ["--attention", value, "--attention_tile", "8"]
    return [f"--{flag}" if value is True else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", value]


def _program(setup) -> str:
    """The train step's lowered program (StableHLO text) for the prepared run."""
    cfg = setup.cfg
    step = make_train_step(setup.fam, setup.mcfg, setup.tx, setup.schedule, cfg.dropout)
    b = jax.ShapeDtypeStruct((cfg.grad_accum_steps, cfg.batch_size, cfg.sequence_length), jnp.int32,
                             sharding=setup.x_sharding)
    state = abstract_with_sharding(setup.abstract_state, setup.state_sharding)
    return jax.jit(step).lower(state, b, b).as_text()


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, text_file):
    """An llm.c .bin of the shape the preset run has (written by the project's writer)."""
    setup = prepare(config_from_args(BASE + ["--data", text_file]))
    cfg = setup.base_mcfg
    path = tmp_path_factory.mktemp("model") / "tiny.bin"
    llmc.save(str(path), cfg, gpt2.init_params(cfg, jax.random.PRNGKey(0)))
    return str(path)


# dropout, dtype and scan_layers take the same join as the other flags, so they run with the slow set.
@pytest.mark.parametrize("flag", [pytest.param(f, marks=pytest.mark.slow if f in ("dropout", "dtype", "scan_layers")
                                               else ()) for f in FLAG_VALUES])
def test_model_config_flag_reaches_the_model_from_a_file(flag, text_file, model_file):
    """Each flag changes the compiled program, with --init_from FILE.bin as without it: the model built
    from the file is the preset's model, field for field, and lowers to the same program (a model that
    kept the defaults would give one program for both values)."""
    programs = {}
    for i, value in enumerate(FLAG_VALUES[flag]):
        base = BASE + ["--data", text_file] + _argv(flag, value)
        preset = prepare(config_from_args(base))
        from_file = prepare(config_from_args(base + ["--init_from", model_file]))
        assert from_file.init_params is not None
        assert from_file.mcfg == preset.mcfg, (flag, value)
        programs[value] = _program(from_file)
        if i == 0:  # equal configs lower alike; once per flag shows the two paths build one program
            assert programs[value] == _program(preset), (flag, value)
    a, b = FLAG_VALUES[flag]
    assert programs[a] != programs[b], flag


def test_cudnn_from_a_file_is_checked_as_from_a_preset(text_file, model_file):
    """`--attention cudnn` where it cannot run is a usage error with --init_from too (it went unseen)."""
    flags = BASE + ["--data", text_file, "--attention", "cudnn"]
    with pytest.raises(UsageError, match="--attention cudnn") as preset:
        prepare(config_from_args(flags))
    with pytest.raises(UsageError, match="--attention cudnn") as from_file:
        prepare(config_from_args(flags + ["--init_from", model_file]))
    assert str(preset.value) == str(from_file.value)


# ------------------------------------------------------------------------------------------------
# outputs kept apart from inputs


def _bytes(*paths):
    return {p: pathlib.Path(p).read_bytes() for p in paths}


@pytest.fixture()
def files(tmp_path, text_file, model_file):
    """A text file, an llm.c shard, a model file, a DeepSpeed config and a checkpoint-like folder."""
    d = tmp_path / "in"
    d.mkdir()
    shutil.copy(text_file, d / "train.txt")
    shutil.copy(text_file, d / "val.txt")
    write_tokens(str(d / "shard.bin"), np.arange(4000, dtype=np.uint16) % 256)
    shutil.copy(model_file, d / "model.bin")
    (d / "ds.json").write_text('{"activation_checkpointing": {}}')
    return {k: str(d / v) for k, v in (("text", "train.txt"), ("val", "val.txt"), ("shard", "shard.bin"),
                                       ("model", "model.bin"), ("ds", "ds.json"))}


@pytest.mark.parametrize("argv, match", [
    (["--data", "{text}", "--log_jsonl", "{text}"], "--log_jsonl {text} is the same file as --data {text}"),
    (["--data", "{shard}", "--log_jsonl", "{shard}"], "--log_jsonl {shard} is the same file as --data {shard}"),
    (["--data", "{text}", "--val_data", "{val}", "--log_jsonl", "{val}"], "is the same file as --val_data"),
    (["--data", "{text}", "--init_from", "{model}", "--log_jsonl", "{model}"], "is the same file as --init_from"),
    (["--data", "{text}", "--deepspeed_config", "{ds}", "--log_jsonl", "{ds}"],
     "is the same file as --deepspeed_config"),
    (["--data", "{dir}/*.txt", "--log_jsonl", "{dir}/./val.txt"], r"--log_jsonl {dir}/./val.txt is the same file"),
    (["--data", "{text}", "--log_jsonl", "{link}"], "--log_jsonl {link} is the same file as --data"),
    (["--data", "{text}", "--log_jsonl", "{hard}"], "--log_jsonl {hard} is the same file as --data"),
    (["--data", "{text}", "--log_jsonl", "{tmp}/run", "--checkpoint_dir", "{tmp}/run"],
     "--log_jsonl {tmp}/run is the same file as --checkpoint_dir {tmp}/run"),
    (["--data", "{dir}/profile/t.txt", "--checkpoint_dir", "{dir}", "--profile_steps", "0:1"],
     "--data {dir}/profile/t.txt is inside --checkpoint_dir {dir}, in profile"),
    (["--data", "{dir}/3/t.txt", "--checkpoint_dir", "{dir}"], r"--data {dir}/3/t.txt is inside --checkpoint_dir "
                                                                 r"{dir}, in 3, which the run writes or deletes"),
    (["--data", "{text}", "--log_jsonl", "{dir}/3/log.jsonl", "--checkpoint_dir", "{dir}"],
     "--log_jsonl {dir}/3/log.jsonl is inside --checkpoint_dir"),
])
def test_output_that_is_an_input_is_refused(argv, match, files, tmp_path):
    d = os.path.dirname(files["text"])
    os.symlink(files["text"], tmp_path / "link.txt")
    os.link(files["text"], tmp_path / "hard.txt")
    for sub in ("3", "profile"):
        os.makedirs(f"{d}/{sub}")
        shutil.copy(files["text"], f"{d}/{sub}/t.txt")
    names = dict(files, dir=d, tmp=str(tmp_path), link=str(tmp_path / "link.txt"), hard=str(tmp_path / "hard.txt"))
    argv = [a.format(**names) for a in argv]
    before, listing = _bytes(*files.values()), sorted(os.walk(tmp_path))
    with pytest.raises(UsageError, match=match.format(**names)):
        prepare(config_from_args(BASE + argv))
    assert _bytes(*files.values()) == before and sorted(os.walk(tmp_path)) == listing


def test_output_into_an_init_from_directory_is_refused(tmp_path, text_file):
    """Checked before the directory is read as a checkpoint: any directory will do."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "kept.txt").write_text("x")
    for flag, path in (("--checkpoint_dir", ck), ("--checkpoint_dir", ck / "finetune"),
                       ("--log_jsonl", ck / "log.jsonl")):
        with pytest.raises(UsageError, match=f"{flag} {path} is (the same file as|inside) --init_from {ck}"):
            prepare(config_from_args(BASE + ["--data", text_file, "--init_from", str(ck), flag, str(path)]))


def test_input_beside_the_checkpoints_is_allowed(files, tmp_path):
    """A file in --checkpoint_dir that the run never writes (not a step folder) stays usable as input."""
    d = os.path.dirname(files["text"])
    setup = prepare(config_from_args(BASE + ["--data", files["text"], "--checkpoint_dir", d,
                                             "--log_jsonl", os.path.join(d, "log.jsonl")]))
    assert setup.train_ds.n_tokens > 0


# ------------------------------------------------------------------------------------------------
# inputs that cannot be read, or are too large; absurd sizes; a full disk


@pytest.mark.slow  # ~7 s; the other unreadable-input cases stay fast
def test_data_unreadable_by_the_user_exits_2(request, text_file):
    """chmod 000, run as nobody (as root every file is readable): one line, not a PermissionError traceback."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="remat-nobody-", dir="/tmp"))  # pytest's tmp is root's alone
    request.addfinalizer(lambda: shutil.rmtree(d))
    os.chmod(d, 0o755)
    good, bad = d / "ok.txt", d / "secret.txt"
    shutil.copy(text_file, good)
    shutil.copy(text_file, bad)
    os.chmod(bad, 0)
    home = d / "home"
    home.mkdir()
    os.chown(home, 65534, 65534)
    cases = (["--data", str(bad)], ["--data", str(good), "--val_data", str(bad)])
    for flags in cases:
        p = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable,
                            os.path.join(ROOT, "train.py"), *BASE, *flags], cwd=str(home),
                           env=_env(HOME=str(home)), capture_output=True, text=True, timeout=300)
        line = _one_line(p.stderr)
        assert p.returncode == 2 and f"{flags[-2]} {bad}: cannot read it (Permission denied)" in line, line
    assert os.listdir(home) == []


def test_huge_sparse_text_file_is_refused_before_reading(tmp_path):
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(64 << 30)  # a real 64 GiB sparse file: reading it would exhaust memory
    with pytest.raises(UsageError, match=rf"--data {big}: the text data is 64.00 GiB, too large to read into memory "
                                         r".*tokenize it into llm.c token shards"):
        prepare(config_from_args(BASE + ["--data", str(big)]))


@pytest.mark.parametrize("flags", [["--batch_size", str(2**62)], ["--batch_size", str(10**20)],
                                   ["--batch_size", "1", "--grad_accum_steps", str(2**62)]])
def test_batch_too_large_to_count_is_a_usage_error(flags, text_file):
    """--batch_size 2^62 raised OverflowError while tracing (the element count passed int64): each count
    is bounded by what JAX indexes (int32), named in the message."""
    with pytest.raises(UsageError, match=r"is out of range; use an integer in 1\.\.2147483647 \(JAX counts and indexes in int32\)"):
        prepare(config_from_args(BASE + ["--data", text_file] + flags))


def test_prompt_with_bytes_that_are_not_utf8_exits_2(text_file):
    """argv bytes that are not UTF-8 arrive as lone surrogates: encoding the prompt raised."""
    p = subprocess.run([sys.executable.encode(), os.path.join(ROOT, "train.py").encode(), b"--data",
                        text_file.encode(), b"--sample_every", b"1", b"--prompt", b"ab\xff"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--prompt holds bytes that are not UTF-8 (at character 2); pass UTF-8 text" in \
        _one_line(p.stderr)


FULL_DISK = r"""
mount -t tmpfs -o size=64k tmpfs {mnt} && (head -c 1m /dev/zero > {mnt}/filler 2>/dev/null; true) &&
exec {python} {root}/train.py --data {data} --num_iterations 3 --log_jsonl {mnt}/log.jsonl \
    --preset tiny --sequence_length 32 --batch_size 2 --no-progress --val_every 0
"""


@pytest.mark.slow  # ~10 s (a real tmpfs filled)
def test_log_on_a_full_disk_exits_1_with_one_line(tmp_path, text_file):
    """A real full tmpfs (mounted in a user namespace): the first log write fails with ENOSPC: one
    line, not an OSError traceback."""
    mnt = tmp_path / "full"
    mnt.mkdir()
    data = tmp_path / "data.txt"
    shutil.copy(text_file, data)
    before = data.read_bytes()
    cmd = FULL_DISK.format(mnt=mnt, python=sys.executable, root=ROOT, data=data)
    p = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], cwd=ROOT, env=_env(), capture_output=True, text=True,
                       timeout=300)
    line = _one_line(p.stderr)
    assert p.returncode == 1, p.stderr[-3000:]
    assert (f"train.py: error: writing --log_jsonl {mnt}/log.jsonl failed at step 1: No space left on device; "
            f"free space there or pass --log_jsonl on another disk") == line, line
    assert data.read_bytes() == before and "step 1/3" not in p.stdout
