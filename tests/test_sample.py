"""KV-cached generation (remat_lm/models/sample.py, the models' decode path) against the full forward, sampling,
and the sample CLI (remat_lm/sample.py)."""
import dataclasses
import functools
import io
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import train
from remat_lm import sample as sample_cli
from remat_lm.models import gpt2, llama3, llmc, sample
from remat_lm.models import tokenizer as tk
from remat_lm.models.llmc_io import write_tokens
from remat_lm.training import TrainConfig, run
from remat_lm.training import data as data_lib
from remat_lm.training.samples import make_sampler
from remat_lm.training.data import default_corpus
from trainhelp import ours

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# GPT-2 with a padded vocabulary (250 → 256 columns) whose padding columns are made to win the
# argmax, so a decode that forgot to exclude them would emit ids >= 250.
GPT2_CFG = gpt2.GPT2Config.preset("tiny", block_size=16, vocab_size=250)
LLAMA_CFG = llama3.Llama3Config.preset("tiny", block_size=16)
MODELS = {"gpt2": (gpt2, gpt2.GPT2, GPT2_CFG), "llama3": (llama3, llama3.Llama3, LLAMA_CFG)}


@functools.cache
def _model(name):
    """(config, loop-layout params, scan-layout params): the same weights in both layouts."""
    mod, _, cfg = MODELS[name]
    params = jax.jit(mod.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
    if name == "gpt2":
        pad = jax.random.normal(jax.random.PRNGKey(1), (cfg.padded_vocab_size - cfg.vocab_size, cfg.n_embd))
        params = {**params, "wte": params["wte"].at[cfg.vocab_size:].set(pad)}
    layers = [params["blocks"][f"h_{i}"] for i in range(cfg.n_layer)]
    scan = {**params, "blocks": {"h": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}}
    return cfg, params, scan


def _params(name, scan=False):
    cfg, loop, stacked = _model(name)
    return (dataclasses.replace(cfg, scan_layers=True), stacked) if scan else (cfg, loop)


@functools.cache
def _full_logits_fn(name, scan=False):
    """Jitted full forward of the Flax model (GPT2/Llama3.apply): the reference."""
    model = MODELS[name][1](_params(name, scan)[0])
    return jax.jit(lambda p, idx: model.apply({"params": p}, idx)[0])


def _reference_next_logits(full, params, cfg, seq):
    """Logits (B, Vp) for the token after `seq` (B, n): the full forward on its last block_size tokens
    (right-padded with zeros: causal, so the padding never reaches position n-1)."""
    T = cfg.block_size
    window = seq[:, -T:]
    n = window.shape[1]
    padded = np.zeros((seq.shape[0], T), np.int32)
    padded[:, :n] = window
    return np.asarray(full(params, jnp.asarray(padded)))[:, n - 1]


@pytest.mark.parametrize("name,scan", [("gpt2", False), pytest.param("llama3", False, marks=pytest.mark.slow),
                                       pytest.param("llama3", True, marks=pytest.mark.slow),
                                       pytest.param("gpt2", True, marks=pytest.mark.slow)],  # same layout code
                         ids=["gpt2-loop", "llama3-loop", "llama3-scan", "gpt2-scan"])
def test_cached_logits_equal_full_forward_at_every_position(name, scan):
    cfg, params = _params(name, scan)
    T = cfg.block_size
    idx = jax.random.randint(jax.random.PRNGKey(2), (2, T), 0, cfg.vocab_size)
    ref = np.asarray(_full_logits_fn(name, scan)(params, idx))  # (B, T, Vp), the Flax model in this layout
    step = jax.jit(lambda p, tok, cache, pos: sample.forward(p, cfg, tok, cache, pos))
    cache = sample.init_cache(cfg, 2, T)
    chunks = [(0, 5), (5, 10)] + [(t, t + 1) for t in range(10, T)]  # two 5-token chunks, then single tokens
    got = []
    for a, b in chunks:
        logits, cache = step(params, idx[:, a:b], cache, a)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    assert got.shape == ref.shape
    # float32, same operations in the same order up to the masked (zero-weight) keys: rounding only.
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref)), np.max(np.abs(got - ref))


def test_decode_without_a_cache_names_the_fix():
    """The model's decode path (decode_pos) refuses to run without the cache collection, rather
    than making one as long as its input."""
    cfg, params = _params("llama3")
    model = llama3.Llama3(cfg)
    with pytest.raises(ValueError, match="needs a key/value cache.*init_cache"):
        model.apply({"params": params}, jnp.zeros((1, 1), jnp.int32), decode_pos=0, mutable=["cache"])
    cache = sample.init_cache(cfg, 1, 4)
    assert jax.tree.structure(cache) == jax.tree.structure(
        {"blocks": {f"h_{i}": {"attn": {"k": 0, "v": 0}} for i in range(cfg.n_layer)}})
    assert cache["blocks"]["h_0"]["attn"]["k"].shape == (1, 4, cfg.n_kv_head, cfg.n_embd // cfg.n_head)
    with pytest.raises(ValueError, match="do not fit the cache of 4 positions"):
        sample.forward(params, cfg, jnp.zeros((1, 2), jnp.int32), cache, 3)


@pytest.mark.parametrize("name,prompt_len", [("gpt2", 5), ("gpt2", 20), ("llama3", 5)])
def test_greedy_equals_repeated_argmax_of_the_full_forward(name, prompt_len):
    """Through the cached phase and past block_size (16): 30 new tokens; a 20-token prompt is longer
    than the context and only its last 16 tokens are seen."""
    cfg, params = _params(name)
    full = _full_logits_fn(name)
    prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(3), (2, prompt_len), 0, cfg.vocab_size), np.int32)
    out = sample.generate(params, cfg, prompt, 30)
    assert out.shape == (2, prompt_len + 30) and (out[:, :prompt_len] == prompt).all()
    seq, padded_wins = prompt, 0
    for _ in range(30):
        logits = _reference_next_logits(full, params, cfg, seq)
        padded_wins += int((logits.argmax(-1) >= cfg.vocab_size).sum())
        seq = np.concatenate([seq, logits[:, :cfg.vocab_size].argmax(-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out, seq)
    if name == "gpt2":  # the padding columns really were the argmax somewhere, and were never emitted
        assert padded_wins > 0 and out.max() < cfg.vocab_size


def test_sampling_is_seeded_and_draws_only_from_the_top_k():
    cfg, params = _params("gpt2")
    full = _full_logits_fn("gpt2")
    prompt = np.tile(np.arange(1, 6, dtype=np.int32)[None], (2, 1))
    a = sample.generate(params, cfg, prompt, 30, temperature=1.0, top_k=3, seed=0)
    b = sample.generate(params, cfg, prompt, 30, temperature=1.0, top_k=3, seed=0)
    c = sample.generate(params, cfg, prompt, 30, temperature=1.0, top_k=3, seed=1)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert len(np.unique(a[:, 5:])) > 3  # it samples: the rows do not all follow one path
    ranks = []
    for t in range(5, a.shape[1]):
        logits = _reference_next_logits(full, params, cfg, a[:, :t])[:, :cfg.vocab_size]
        order = np.argsort(-logits, axis=-1)
        ranks += [int(np.where(order[r] == a[r, t])[0][0]) for r in range(a.shape[0])]
    assert max(ranks) <= 2 and min(ranks) == 0 and len(set(ranks)) == 3, ranks


@pytest.mark.parametrize("kw,match", [
    (dict(prompt=np.zeros((1, 0), np.int32)), "at least one token"),
    (dict(prompt=[[250]]), "outside|vocabulary is 0..249"),
    (dict(top_k=3), "needs temperature > 0"),
    (dict(temperature=-1.0), "temperature"),
    (dict(seed=2**64), r"seed=18446744073709551616 must be an integer in 0\.\.4294967295"),  # was OverflowError
    (dict(seed=-1), "seed=-1 must be"),
])
def test_generate_rejects_bad_arguments(kw, match):
    cfg, params = _params("gpt2")
    kw = {"prompt": [[1, 2]], **kw}
    with pytest.raises(ValueError, match=match):
        sample.generate(params, cfg, kw.pop("prompt"), 4, **kw)


# ------------------------------------------------------------------------------------------------
# The CLIs


@pytest.fixture(scope="module")
def model_bin(tmp_path_factory):
    cfg, params = _params("gpt2")
    path = tmp_path_factory.mktemp("m") / "tiny.bin"
    llmc.save(str(path), cfg, params)
    return str(path)


@pytest.fixture(scope="module")
def big_vocab_bin(tmp_path_factory):
    cfg, params = _params("gpt2")
    cfg = dataclasses.replace(cfg, vocab_size=300, padded_vocab_size=384)
    params = {**params, "wte": jnp.zeros((384, cfg.n_embd))}
    path = tmp_path_factory.mktemp("m") / "v300.bin"
    llmc.save(str(path), cfg, params)
    return str(path)


def _cli(argv, capsys):
    rc = sample_cli.main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_llmc_file_prints_the_generation(model_bin, capsys):
    rc, out, err = _cli([model_bin, "--prompt", "hello", "--sample_length", "30"], capsys)
    assert rc == 0, err
    cfg, params = llmc.load(model_bin)
    ids = sample.generate(params, cfg, [list(b"hello")], 30)[0]
    assert out == tk.ByteTokenizer().decode(ids) + "\n"
    assert "30 tokens after a 5-token prompt, greedy" in err


def _bad_tokenizer(tmp_path):
    path = tmp_path / "bad_tok.bin"
    tk.save(path, [bytes([i]) for i in range(256)], eot_token=0)
    data = bytearray(path.read_bytes())
    data[0:4] = np.int32(20240520).tobytes()  # a token shard's magic
    path.write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize("args,match", [
    (["{missing}", "--prompt", "a"], "no such file or directory"),
    (["{model}", "--prompt", "a", "--tokenizer", "{bad_tok}"], "magic 20240520 is not an llm.c tokenizer's"),
    (["{model}", "--prompt", "a", "--tokenizer", "{fifo}"], "not a regular file"),
    (["{big}", "--prompt", "a", "--tokenizer", "{small_tok}"], "has 256 tokens but the model's vocab_size is 300"),
    (["{big}", "--prompt", "a"], "pass --tokenizer"),
    (["{model}", "--prompt", "a", "--top_k", "3"], "needs temperature > 0"),
    (["{model}", "--prompt", "a", "--prompt_tokens", "1"], "not both"),
    (["{model}", "--prompt_tokens", "1,250"], "token id 250 is outside"),
    (["{model}"], "pass --prompt"),
    (["{model}", "--prompt", "a", "--step", "3"], "--step 3 selects a step of a checkpoint directory"),
    (["{model}", "--prompt", "a", "--num_samples", "0"], "argument --num_samples: expected an integer >= 1, got '0'"),
    (["{model}", "--prompt", "a", "--sample_length", "x"], "argument --sample_length: expected an integer in 1.."),
])
def test_cli_bad_input_exits_2_with_one_line(args, match, tmp_path, model_bin, big_vocab_bin, capsys):
    os.mkfifo(tmp_path / "fifo")
    tk.save(tmp_path / "small_tok.bin", [bytes([i]) for i in range(256)], eot_token=0)
    fill = dict(missing=str(tmp_path / "nope.bin"), model=model_bin, big=big_vocab_bin,
                bad_tok=_bad_tokenizer(tmp_path), fifo=str(tmp_path / "fifo"), small_tok=str(tmp_path / "small_tok.bin"))
    rc, out, err = _cli([a.format(**fill) for a in args], capsys)
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and out == "" and len(lines) == 1 and match in lines[0], err
    assert lines[0].startswith("python -m remat_lm.sample: error: ")


def test_cli_process_bad_tokenizer_exits_2_without_traceback(tmp_path, model_bin):
    p = subprocess.run([sys.executable, "-m", "remat_lm.sample", model_bin, "--prompt", "a", "--tokenizer",
                        _bad_tokenizer(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    lines = ours(p.stderr)
    assert p.returncode == 2 and len(lines) == 1 and "magic 20240520" in lines[0], p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""


# ------------------------------------------------------------------------------------------------
# train.py --sample_every


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "code.txt"
    path.write_bytes(b"".join(open(f, "rb").read() for f in default_corpus()[:3])[:30000])
    return str(path)


def _sample_blocks(log: str) -> dict:
    """{step: text} of the samples in a run's output."""
    out, step = {}, None
    for line in log.split("\n"):  # a sample may hold \r and other characters splitlines() splits at
        if line.startswith("sample   step "):
            step = int(line.split()[2].rstrip(":"))
            out[step] = []
        elif step is not None and line.startswith("  | "):
            out[step].append(line[4:])
        else:
            step = None
    return {s: "\n".join(v) for s, v in out.items()}


def test_sampler_decodes_byte_text_from_the_start_of_the_validation_data(text_file):
    cfg, params = _params("gpt2")
    ds = data_lib.load([text_file])
    sampler = make_sampler(TrainConfig(data=(text_file,), sample_every=2, sample_length=30), cfg, ds, ds)
    assert isinstance(sampler.decoder, tk.ByteTokenizer) and sampler.prompt.shape == (1, cfg.block_size)
    head, *lines = sampler.report(params, 2).split("\n")
    assert head.startswith("sample   step 2: 30 tokens after a 16-token prompt, greedy")
    text = "\n".join(l[4:] for l in lines)
    ids = sample.generate(params, cfg, sampler.prompt, 30)[0]
    assert text == bytes(ids.astype(np.uint8)).decode("utf-8", errors="replace")
    assert text.startswith(open(text_file, "rb").read()[:16].decode())  # the default prompt
    assert [sampler.due(n) for n in (1, 2, 3, 4)] == [False, True, False, True]


@pytest.mark.slow  # a training run and a CLI run, ~15 s
def test_train_samples_token_data_and_the_cli_continues_the_saved_run(tmp_path, capsys):
    """--sample_every 2 over 3 steps samples at steps 2 and 3 (the last); the text is decoded with
    --tokenizer and generated with --temperature/--top_k/--seed; `python -m remat_lm.sample` on the
    checkpoint (the tokenizer comes from the run's config) prints the same text."""
    rng = np.random.default_rng(0)
    tokens = [bytes([i]) for i in range(256)] + [bytes(rng.integers(97, 123, 3).astype(np.uint8)) for _ in range(44)]
    tok_path = tmp_path / "tok.bin"
    tk.save(tok_path, tokens, eot_token=299)
    shard = tmp_path / "shard.bin"
    write_tokens(shard, rng.integers(0, 300, 20000).astype(np.uint16))
    cfg = TrainConfig(preset="tiny", data=(str(shard),), vocab_size=300, num_iterations=3, batch_size=4,
                      val_every=0, progress=False, sample_every=2, sample_length=70, tokenizer=str(tok_path),
                      prompt="abc", temperature=0.8, top_k=5, seed=7, checkpoint_dir=str(tmp_path / "ck"),
                      checkpoint_every=2)
    buf = io.StringIO()
    result = run(cfg, out=buf)
    samples = _sample_blocks(buf.getvalue())
    assert sorted(samples) == [2, 3]
    assert "sample   step 3: 70 tokens after a 3-token prompt, temperature 0.8, top_k 5" in buf.getvalue()
    tok = tk.load(tok_path)
    prompt = [tok.encode("abc")]
    params, mcfg = result.state["params"], result.setup.mcfg
    gen = lambda seed: tok.decode(sample.generate(params, mcfg, prompt, 70, temperature=0.8, top_k=5, seed=seed)[0])
    assert samples[3] == gen(7) != gen(8)  # the flags reach the generation: the seed matters, so it samples
    flags = ["--prompt", "abc", "--sample_length", "70", "--temperature", "0.8", "--top_k", "5", "--seed", "7"]
    for step_flag, step in (([], 3), (["--step", "2"], 2)):  # the latest step, and an earlier one
        rc = sample_cli.main([str(tmp_path / "ck"), *flags, *step_flag])
        out, err = capsys.readouterr()
        assert rc == 0 and out == samples[step] + "\n", err
        assert f"gpt2 from step {step} of" in err
    assert samples[2] != samples[3]


@pytest.mark.parametrize("extra,match", [
    (["--tokenizer", "{bad_tok}"], "magic 20240520 is not an llm.c tokenizer's"),
    (["--tokenizer", "{fifo}"], "not a regular file"),
    (["--prompt", "x"], "--prompt sets up samples, which are off; add --sample_every"),
    (["--sample_every", "1", "--temperature", "0", "--top_k", "4"], "--top_k 4 samples among"),
])
def test_train_bad_sample_flags_exit_2(extra, match, tmp_path, capsys):
    shard = tmp_path / "shard.bin"
    write_tokens(shard, np.arange(3000, dtype=np.uint16) % 256)
    os.mkfifo(tmp_path / "fifo")
    fill = dict(bad_tok=_bad_tokenizer(tmp_path), fifo=str(tmp_path / "fifo"))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as e:
        train.main(["--data", str(shard), "--vocab_size", "256", "--checkpoint_dir", str(tmp_path / "ck")]
                   + [a.format(**fill) for a in extra])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.strip()]
    assert e.value.code == 2 and len(lines) == 1 and match in lines[0], err
    assert sorted(os.listdir(tmp_path)) == before


def test_train_tokenizer_on_byte_text_is_a_usage_error(tmp_path, text_file, capsys):
    tk.save(tmp_path / "tok.bin", [bytes([i]) for i in range(256)], eot_token=0)
    with pytest.raises(SystemExit) as e:
        train.main(["--data", text_file, "--tokenizer", str(tmp_path / "tok.bin"), "--sample_every", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "byte-level text" in err and len(err.strip().splitlines()) == 1
