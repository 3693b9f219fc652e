"""On a machine without a GPU, with the `targets` extra installed and `JAX_PLATFORMS` unset (a user's
shell; CI sets nothing either), every command starts JAX with no plugin traceback: `import remat`
gives JAX the CPU platform there (`remat.prepare_host`). Each case is a real process with the
variable removed from its environment."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from remat._host import has_accelerator

ROOT = pathlib.Path(__file__).resolve().parents[1]
# what the GPU and TPU plugins print when they start on a host without their device
NOISE = ("Traceback", "INVALID_ARGUMENT", "AssertionError")

pytestmark = pytest.mark.skipif(has_accelerator(), reason="this host has an accelerator: JAX starts it")


def _run(args, timeout=300, **kw):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, **kw)


def _clean(p, rc):
    noise = [line for line in p.stderr.splitlines() if any(n in line for n in NOISE)]
    assert p.returncode == rc and not noise, (p.returncode, p.stderr[-3000:])


def test_import_jax_then_remat_then_devices():
    p = _run(["-c", "import jax, remat; print(jax.devices()[0].platform)"])
    _clean(p, 0)
    assert p.stdout.strip() == "cpu"


def test_the_readme_will_it_fit_block_as_written():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"### Will it fit\?.*?```bash\n(.*?)```", readme, re.S).group(1)
    commands = [c for c in block.replace("\\\n", " ").splitlines() if c.startswith("python ")]
    assert commands, block
    for command in commands:
        args = command.split("#")[0].split()[1:]
        p = _run(args)
        _clean(p, 0)
        assert "fits on" in p.stdout, p.stdout


@pytest.mark.parametrize("args,says", [
    (["train.py", "--data", "/nonexistent"], "train.py: error: --data /nonexistent: no such file"),
    (["-m", "remat_lm.llmc", "verify", "TRUNC", "TRUNC"], "python -m remat_lm.llmc verify: error: "),
    (["-m", "remat_lm.sample", "/nonexistent"], "python -m remat_lm.sample: error: /nonexistent"),
    (["-m", "remat_lm.bench.selective", "--models", "zz"], "python -m remat_lm.bench.selective: error: --models"),
    (["-m", "remat_lm.bench.planner", "--target", "zz"], "python -m remat_lm.bench.planner: error: --target 'zz'"),
    (["-m", "remat_lm.bench.planner", "--model", "gpt2", "--target", "h200x8", "--mesh", "fsdp=3"],
     "python -m remat_lm.bench.planner: error: --mesh fsdp=3 spans 3 devices"),
    (["-m", "remat_lm.bench.planner", "--target", "cpu", "--mesh", "fsdp=2"],
     "python -m remat_lm.bench.planner: error: --mesh fsdp=2 shards train.py's step for a compile-only target"),
    (["train.py", "--dry_run", "--recompute_plan", "full x" + "9" * 30],
     "train.py: error: --recompute_plan: recompute plan 'full x999"),
], ids=["train", "llmc", "sample", "bench", "planner-target", "planner-mesh", "planner-local-mesh", "plan-count"])
def test_bad_input_is_one_line_with_no_traceback(args, says, tmp_path):
    trunc = tmp_path / "model.bin"
    trunc.write_bytes(b"\0" * 1000)  # a real truncated llm.c file: shorter than its header
    p = _run([str(trunc) if a == "TRUNC" else a for a in args])
    _clean(p, 2)
    assert p.stderr.strip().splitlines()[-1].startswith(says), p.stderr  # the one line, last


@pytest.mark.slow  # 10-40 s each
@pytest.mark.parametrize("example", ["jax_gpt", "linen_lm", "nnx_gemma"])
def test_examples_print_no_traceback(example):
    _clean(_run(["-m", f"examples.{example}"], timeout=900), 0)
