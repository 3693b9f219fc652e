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

import jax
import jax.numpy as jnp

import remat
from remat_lm.training import sharding as sh
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
    """AOT-compile the train step for the run's shapes and shardings (cached per process)."""
    cfg = setup.cfg
    mcfg = sh.model_sharding(setup.mcfg if mcfg is None else mcfg, setup.mesh, cfg.sequence_parallel)
    key = (setup.fam.name, mcfg, optimizer_settings(cfg), cfg.dropout, setup.mesh, cfg.grad_accum_steps,
           cfg.batch_size, cfg.sequence_length)
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    fn = make_train_step(setup.fam, mcfg, setup.tx, setup.schedule, cfg.dropout)
    jitted = jax.jit(fn, in_shardings=(setup.state_sharding, setup.x_sharding, setup.x_sharding),
                     out_shardings=(setup.state_sharding, sh.replicated(setup.mesh)), donate_argnums=(0,))
    b = batch_struct(setup)
    with jax.set_mesh(setup.mesh):  # the model's tensor/sequence-parallel constraints are PartitionSpecs
        compiled = jitted.lower(abstract_with_sharding(setup.abstract_state, setup.state_sharding), b, b).compile()
    _COMPILED[key] = compiled
    while len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return compiled


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
    UsageError stating the minimum."""
    from remat_lm.models.memory_model import activation_bytes

    cfg, base, request = setup.cfg, setup.base_mcfg, setup.auto
    print(f"planner  fitting the train step into --memory_budget {cfg.memory_budget} per device "
          f"(compiling candidate settings)", file=out)
    try:
        plan = remat.plan_for_budget(
            lambda rc: compile_train_step(setup, dataclasses.replace(base, recompute=rc)), base.n_layer,
            request.budget, layer_bytes=activation_bytes(base, cfg.batch_size, cfg.sequence_length)[0])
    except ValueError as e:
        raise UsageError(f"--memory_budget {cfg.memory_budget}: {e}") from None
    print(plan.table(), file=out)
    planned = dataclasses.replace(base, recompute=plan.recompute_config())
    return dataclasses.replace(setup, mcfgs=(("auto", planned),)), plan
