"""Compile the train step ahead of time (cached per process), and the planner hook for
`--recompute_method auto` (`plan_memory`).

Example:
    >>> setup = prepare(TrainConfig(preset="tiny", num_iterations=3))
    >>> compiled = compile_train_step(setup)           # setup.mcfg's train step
    >>> compiled.memory_analysis().temp_size_in_bytes
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp

import remat
import remat.planning.planner
import remat.planning.tagplan
import remat.planning.targets
from tqdm import tqdm
from remat_lm.argtypes import config_label
from remat_lm.training import sharding as sh
from remat_lm.training.checks import is_oom
from remat_lm.training import target as run_target
from remat_lm.training.config import UsageError
from remat_lm.models import family
from remat_lm.training.optim import make_optimizer, optimizer_settings
from remat_lm.training.step import init_state, make_train_step

# NOTE: compiled programs are cached per process, keyed by everything they depend on, so that
# runs in one process (notebooks, tests, a resume after a run) share compilations. A training
# run from the CLI compiles each program once either way.

@functools.lru_cache(maxsize=16)
def optimizer(settings: tuple):
    """(optax transform, schedule) for `optimizer_settings(cfg)` (cached)."""
    return make_optimizer(*settings)


def init_config(mcfg):
    """The model config with everything that does not change the initial parameters reset."""
    return dataclasses.replace(mcfg, recompute=type(mcfg.recompute)(), dropout=0.0, dtype="float32", loss_chunk=0)


# The optimizer state's structure and initial values do not depend on the hyperparameters.
_INIT_OPTIMIZER = (1.0, 0, 1, 0.0, 0.0, 1.0)


@functools.lru_cache(maxsize=8)
def init_jit(fam_name: str, init_mcfg, mesh):
    fam, (tx, _) = family.get(fam_name), optimizer(_INIT_OPTIMIZER)
    fn = lambda seed: init_state(fam, init_mcfg, tx, seed)
    abstract = jax.eval_shape(fn, 0)
    return jax.jit(fn, out_shardings=sh.state_shardings(mesh, abstract))


_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_MAX = 8


def compile_train_step(setup, mcfg=None):
    """AOT-compile the train step for the run's shapes and shardings (cached per process), built for
    the run's devices (`--target`: its compiler). A program the target's compiler refuses for lack of
    memory (XLA:TPU does) raises `remat_lm.training.target.Refused`, a MemoryError."""
    return _compiled(setup, mcfg)[0]


def step_stats(setup, mcfg=None) -> remat.memory.CompiledMemory:
    """XLA's memory analysis of the train step and the matmul FLOPs of its optimized program per
    device, every loop iteration counted (`remat.memory.compiled_stats`). The planner's cost."""
    return remat.memory.compiled_stats(_compiled(setup, mcfg)[0])


def _compiled(setup, mcfg=None):
    """(compiled train step, its traced jaxpr), cached per process."""
    cfg = setup.cfg
    mcfg = sh.model_sharding(setup.mcfg if mcfg is None else mcfg, setup.mesh, cfg.sequence_parallel)
    platform = setup.target.platform if setup.deviceless else None  # the host's (the same on the target itself)
    key = (setup.fam.name, mcfg, optimizer_settings(cfg), cfg.dropout, setup.mesh, cfg.grad_accum_steps,
           cfg.batch_size, cfg.sequence_length, platform)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    with run_target.building(setup):
        traced = _trace(setup, mcfg)
        lowered = traced.lower()
    try:
        compiled = lowered.compile()
    except Exception as e:
        if setup.deviceless and is_oom(e):
            flops = remat.planning.targets.matmul_flops(traced.jaxpr) / setup.mesh.size  # the planner's cost of it
            raise run_target.refused(setup.target, e, flops) from e
        raise
    _COMPILED[key] = (compiled, traced.jaxpr)
    while len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return _COMPILED[key]


def _trace(setup, mcfg):
    """The traced train step (`jax.stages.Traced`) for a model config already sharded for the mesh;
    call under `run_target.building(setup)`: the mesh (the model's tensor/sequence-parallel
    constraints are PartitionSpecs) and the target's platform (its attention core and other choices)."""
    fn = make_train_step(setup.fam, mcfg, setup.tx, setup.schedule, setup.cfg.dropout)
    jitted = jax.jit(fn, in_shardings=(setup.state_sharding, setup.x_sharding, setup.x_sharding),
                     out_shardings=(setup.state_sharding, sh.replicated(setup.mesh)), donate_argnums=(0,))
    b = batch_struct(setup)
    return jitted.trace(abstract_with_sharding(setup.abstract_state, setup.state_sharding), b, b)


def step_jaxpr(setup, mcfg=None):
    """The jaxpr of the train step (traced, not compiled): what the planner's time model reads."""
    mcfg = sh.model_sharding(setup.mcfg if mcfg is None else mcfg, setup.mesh, setup.cfg.sequence_parallel)
    with run_target.building(setup):
        return _trace(setup, mcfg).jaxpr


def batch_struct(setup):
    c = setup.cfg
    return jax.ShapeDtypeStruct((c.grad_accum_steps, c.batch_size, c.sequence_length), jnp.int32,
                                sharding=setup.x_sharding)


def abstract_with_sharding(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def plan_memory(setup, out=None):
    """--recompute_method auto: ask the planner (`remat.plan_for_budget` on the real train step) for a
    setting per layer that fits the request's budget, print the plan, and return
    `(setup with that model config, BudgetPlan)`. A budget below what full remat needs is a
    UsageError stating the minimum. With --target the plan is made per tag and priced on the target
    (`remat.plan_for_budget(target=...)`: save, offload or recompute each tagged activation; the
    step time from the traced program's roofline), every plan compiled by its compiler; without
    --memory_budget the budget is its memory (`TrainConfig.target_budget`)."""
    from remat_lm.models.memory_model import activation_bytes

    cfg, base, request = setup.cfg, setup.base_mcfg, setup.auto
    if cfg.memory_budget is not None:
        what = f"--memory_budget {cfg.memory_budget}"
        flag = f"--memory_budget {cfg.memory_budget}"
    else:
        what = (f"{remat.memory.format_bytes(request.budget)}, the memory of --target {setup.target.name} "
                f"({run_target.limit_words(setup.target)})")
        flag = f"--target {setup.target.name}'s memory of {remat.memory.format_bytes(request.budget)}"
    built = f" by {run_target.words(setup.target)}" if setup.target is not None else ""
    print(f"planner  fitting the train step into {what} per device (compiling candidate settings{built})",
          file=out)

    # one bar step per compile, named by the plan compiled; the total is the usual count (no remat,
    # the calibration, one plan), exceeded when a plan needs another round
    bar = tqdm(total=6 if setup.target is not None else 2 * len(remat.planning.planner.DEFAULT_CANDIDATES) + 1,
               desc="planner", unit="compile", file=sys.stderr, disable=not cfg.progress, leave=False)
    spent, started = [], time.perf_counter()

    def measure(rc):
        lp = remat.planning.tagplan.config_policies(rc, base.n_layer)
        bar.set_postfix_str(remat.planning.tagplan.format_plan(lp) if lp else config_label(rc), refresh=True)
        t0 = time.perf_counter()
        try:
            return step_stats(setup, dataclasses.replace(base, recompute=rc))
        except run_target.Refused as e:
            # NOTE: refused by the target's compiler (XLA:TPU, too large for its memory): to the
            # planner a program that does not fit, so its peak is the compiler's figure, and never
            # below the budget (the refusal is the verdict, whatever the figure).
            need = max(e.needed or 0, request.budget + 1)
            return remat.memory.CompiledMemory(temp=need, argument=0, output=0, alias=0, generated_code=0,
                                               host_temp=0, flops=e.flops, flops_source="jaxpr matmuls")
        finally:
            spent.append(time.perf_counter() - t0)
            bar.update()
    try:
        if setup.target is not None:   # per tag, priced on the target (remat.planning.tagplan), every plan compiled
            trace = lambda rc: step_jaxpr(setup, dataclasses.replace(base, recompute=rc))
            plan = remat.plan_for_budget(measure, base.n_layer, request.budget, target=setup.target,
                                         trace_step=trace)
        else:
            plan = remat.plan_for_budget(measure, base.n_layer, request.budget,
                                         layer_bytes=activation_bytes(base, cfg.batch_size, cfg.sequence_length)[0])
    except ValueError as e:
        raise UsageError(f"{flag}: {e}") from None
    finally:
        bar.close()
    took = time.perf_counter() - started
    plan = dataclasses.replace(plan, scan=bool(cfg.scan_layers))  # its text names the layout it was planned for
    print(plan.table(), file=out)
    print(f"planner  planned in {took:.1f} s: {len(spent)} compile(s) of the train step, "
          f"{took / spent[0]:.1f}x the first one ({spent[0]:.1f} s, no remat)", file=out)
    planned = dataclasses.replace(base, recompute=plan.recompute_config())
    return dataclasses.replace(setup, mcfgs=(("auto", planned),)), plan
