"""Lower the train step for a GPU or TPU from any host, and say what the program holds.

    python -m remat_lm.bench.lower --platform tpu --model llama3
    python -m remat_lm.bench.lower --platform cuda --model gpt2 --dtype bfloat16 --cpu_checkpointing

Lowering only (no compile, no device): the program XLA would get on that platform, as StableHLO.
It prints the attention core's kernel calls (cuDNN `__cudnn$fmha*` on cuda, Pallas
`tpu_custom_call` on tpu), the host-memory placements (offload policies, `--cpu_checkpointing`),
and whether every copy back to the device of an offloaded value waits for the backward's cotangent.
tests/test_lowering.py runs the same functions over the recompute settings.
"""
from __future__ import annotations

import dataclasses
import re
import sys
from collections import defaultdict

import jax
import jax.numpy as jnp

from remat import RecomputeConfig
from remat_lm.argtypes import Parser, integer
from remat_lm.models import family
from remat_lm.training import flags as remat_flags
from remat.memory import PLATFORMS, building_for, lowered_for

CUDNN = "__cudnn$fmha"  # prefix of cuDNN's fused attention calls (forward and backward)
PALLAS_TPU = "tpu_custom_call"  # a Pallas TPU kernel


def model_config(model: str = "gpt2", *, preset: str = "tiny", recompute: RecomputeConfig | None = None,
                 **overrides):
    """The model config of `preset` with `recompute` and other fields (dtype, attention, scan_layers,
    loss_chunk, ...)."""
    return family.get(model).config(preset, recompute=recompute or RecomputeConfig(), **overrides)


def _state_and_batch(fam, mcfg, tx, batch: int, seq: int):
    params = jax.eval_shape(lambda: fam.init_params(mcfg, jax.random.key(0)))
    state = {"params": params, "opt_state": jax.eval_shape(tx.init, params),
             "step": jax.ShapeDtypeStruct((), jnp.int32), "rng": jax.eval_shape(lambda: jax.random.key(0))}
    return state, jax.ShapeDtypeStruct((1, batch, seq), jnp.int32)


def lower_train_step(mcfg, platform: str, *, batch: int = 2, seq: int | None = None, tensor: int = 1):
    """The train step (remat_lm.training.step.make_train_step, AdamW) of `mcfg` lowered for `platform`.

    `tensor` > 1 lowers it on a data × tensor mesh of this host's devices (tensor parallelism, the
    model's sharding constraints), as `remat_lm.training.compile` does.
    """
    from remat_lm.training.optim import make_optimizer
    fam = family.of(mcfg)
    seq = seq or mcfg.block_size
    tx, schedule = make_optimizer(1e-3, 1, 10, 0.1, 0.1, 1.0)
    with building_for(platform):  # the parameter shapes too: a core that runs only there is traced
        return _lower_train_step(fam, mcfg, tx, schedule, platform, batch, seq, tensor)


def _lower_train_step(fam, mcfg, tx, schedule, platform, batch, seq, tensor):
    from remat_lm.training import sharding as sh
    from remat_lm.training.step import make_train_step
    if tensor <= 1:
        state, xb = _state_and_batch(fam, mcfg, tx, batch, seq)
        return lowered_for(make_train_step(fam, mcfg, tx, schedule, 0.0), platform, state, xb, xb)
    mesh = sh.make_mesh({"tensor": tensor})
    state, xb = _state_and_batch(fam, mcfg, tx, batch, seq)  # the parameters do not depend on sharding
    mcfg = sh.model_sharding(mcfg, mesh)
    state_sharding = sh.state_shardings(mesh, state)
    x_sharding = sh.batch_sharding(mesh, 3, 1)
    jitted = jax.jit(make_train_step(fam, mcfg, tx, schedule, 0.0), in_shardings=(state_sharding, x_sharding, x_sharding))
    with jax.set_mesh(mesh):
        return lowered_for(jitted, platform, state, xb, xb)


def lower_seeded_grad(mcfg, platform: str, *, batch: int = 2, seq: int | None = None):
    """`jax.grad` of `c · loss(params)` lowered for `platform`, `c` its first argument (`%arg0`).

    Every cotangent of the backward is a multiple of `c`, and nothing in the forward reads it, so
    "depends on %arg0" in the program means "waits for the backward" (`copy_backs`).
    """
    fam = family.of(mcfg)
    seq = seq or mcfg.block_size
    with building_for(platform):
        params = jax.eval_shape(lambda: fam.init_params(mcfg, jax.random.key(0)))
    x = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    grad = jax.grad(lambda c, p, x, y: c * fam.loss_fn(p, mcfg, x, y, None), argnums=1)
    return lowered_for(grad, platform, jax.ShapeDtypeStruct((), jnp.float32), params, x, x)


# ------------------------------------------------------------------------------------------------
# Reading the lowered program (StableHLO text).

def custom_calls(text: str) -> dict[str, int]:
    """{custom call target: count} in a lowered program."""
    counts: dict[str, int] = defaultdict(int)
    for target in re.findall(r"custom_call @([\w$.]+)", text):
        counts[target] += 1
    return dict(counts)


def placements(text: str) -> dict[str, int]:
    """{memory placement: count} of the `annotate_device_placement` calls (device_put between
    memories): "pinned_host" for a move to host memory, "device" for a copy back."""
    counts: dict[str, int] = defaultdict(int)
    for line in text.splitlines():
        if "annotate_device_placement" in line:
            m = re.search(r'_xla_buffer_placement = "(\w+)"', line)
            counts[m.group(1) if m else "?"] += 1
    return dict(counts)


_FUNC = re.compile(r"^\s*func\.func \w+ @([\w$.-]+)\((.*)$")
_DEF = re.compile(r"^\s*(%[\w]+)(?::\d+)?\s*=\s*(.*)$")
_NAME = re.compile(r"%[\w]+")
_CALL = re.compile(r"\bcall @([\w$.-]+)\(([^)]*)\)")


def _functions(text: str):
    """{function: (number of arguments, {value: names it reads}, [(callee, operands)])}."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = m.group(1)
            funcs[cur] = (len(re.findall(r"%arg\d+:", m.group(2))), {}, [])
            continue
        if cur is None:
            continue
        d = _DEF.match(line)
        if d:
            rhs = d.group(2).split(" loc(")[0]
            funcs[cur][1][d.group(1)] = [n.split("#")[0] for n in _NAME.findall(rhs)]
            c = _CALL.search(rhs)
            if c:
                funcs[cur][2].append((c.group(1), [n.strip().split("#")[0] for n in c.group(2).split(",") if n.strip()]))
    return funcs


def _depends_on_arg(funcs, func: str, value: str, arg: int, seen=None) -> bool:
    """Whether `value` of `func` reads (transitively, through calls into `func`) `main`'s %arg`arg`."""
    seen = set() if seen is None else seen
    stack = [(func, value)]
    while stack:
        f, v = stack.pop()
        if (f, v) in seen:
            continue
        seen.add((f, v))
        n_args, defs, _ = funcs[f]
        m = re.fullmatch(r"%arg(\d+)", v)
        if m and int(m.group(1)) < n_args and v not in defs:
            k = int(m.group(1))
            if f == "main":
                if k == arg:
                    return True
                continue
            for caller, (_, _, calls) in funcs.items():  # every call site of f passes its k-th operand
                for callee, ops in calls:
                    if callee == f and k < len(ops):
                        stack.append((caller, ops[k]))
            continue
        stack.extend((f, d) for d in defs.get(v, ()))
    return False


def copy_backs(text: str, seed_arg: int = 0) -> list[bool]:
    """For each copy back to the device (`annotate_device_placement` to "device"), whether its input
    depends on `main`'s argument `seed_arg` (the cotangent seed of `lower_seeded_grad`)."""
    funcs = _functions(text)
    out, cur = [], None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            cur = m.group(1)
            continue
        if cur and "annotate_device_placement" in line and '_xla_buffer_placement = "device"' in line:
            operand = re.search(r"annotate_device_placement\((%[\w]+)", line).group(1)
            out.append(_depends_on_arg(funcs, cur, operand, seed_arg))
    return out


def report(mcfg, platform: str, *, tensor: int = 1) -> dict:
    """What the lowered train step of `mcfg` holds on `platform`: custom calls, placements, and the
    copy backs of offloaded values that wait for the cotangent."""
    text = lower_train_step(mcfg, platform, tensor=tensor).as_text()
    res = {"platform": platform, "custom_calls": custom_calls(text), "placements": placements(text)}
    if res["placements"].get("device"):
        waits = copy_backs(lower_seeded_grad(mcfg, platform).as_text())
        res["copy_backs_waiting"] = f"{sum(waits)}/{len(waits)}"
    return res


def main(argv=None) -> int:
    p = Parser(prog="python -m remat_lm.bench.lower", description=__doc__.split("\n\n")[0])
    p.add_argument("--platform", default="tpu", choices=PLATFORMS)
    p.add_argument("--model", default="gpt2", choices=family.NAMES)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--attention", default="auto")
    p.add_argument("--loss_chunk", type=integer(0), default=0)
    p.add_argument("--seq", type=integer(1), default=128, help="sequence length T (the Pallas kernel needs a multiple of 128)")
    p.add_argument("--tensor", type=integer(1), default=1, help="tensor-parallel mesh axis (host devices)")
    remat_flags.add_arguments(p, train=False)
    a = p.parse_args(argv)
    try:
        (_, rc), *_ = remat_flags.from_flags(vars(a))
        mcfg = model_config(a.model, preset=a.preset, recompute=rc, dtype=a.dtype, attention=a.attention,
                            scan_layers=bool(a.scan_layers), loss_chunk=a.loss_chunk, block_size=a.seq)
        res = report(mcfg, a.platform, tensor=a.tensor)
    except ValueError as e:  # a setting that cannot be built (also training's UsageError)
        raise SystemExit(str(e)) from None
    for k, v in res.items():
        print(f"{k:20s} {v}")
    return 0


if __name__ == "__main__":
    from remat_lm.bench.common import cli
    sys.exit(cli(main, "lower"))
