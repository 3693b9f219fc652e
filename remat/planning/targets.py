"""Targets: compile a function for an accelerator this machine does not have, and read what its
compiler allocated.

A target is named the way it is bought: `h100`, `h200`, `a100-80g`, `b200` (NVIDIA GPUs, XLA:GPU),
`v5e`, `v5p`, `v6e` (TPUs, XLA:TPU) and `cpu` (this host, XLA:CPU). A count asks for a mesh:
`h200x8` is eight H200s, `v5e:2x4` an 8-chip v5e slice in libtpu's topology words (`v5e` alone
is one chip). `get(name)` gives a `Target`; `compile(fn, *args, target=...)` traces, lowers and
compiles `fn` for it with no device present, `compiled_memory(fn, *args, target=...)` (also
`remat.memory.compiled_memory`) reads XLA's answer. `SPECS` is the hardware table: the figures the planner's cost model, train.py's MFU
and its preflight read, each Spec naming its `source`.

Example:
    >>> import jax, jax.numpy as jnp, remat
    >>> t = remat.planning.targets.get("h200")
    >>> t.platform, t.count, remat.memory.format_bytes(t.memory)
    ('cuda', 1, '141.00 GiB')
    >>> x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    >>> remat.memory.compiled_memory(lambda x: jnp.sin(x @ x).sum(), x, target="h200").argument
    2097152

The compilers come with `pip install 'remat[targets]'` (`jax-cuda12-pjrt`, `libtpu`); on a host
without a GPU `import remat` gives JAX the CPU platform first (`remat.prepare_host`), and the CUDA
plugin registers its compiler.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import importlib.util
import math
import os
import re
from typing import Any, Mapping

import jax
import jax.extend
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from remat.compiled import CompiledMemory, GiB, compiled_stats, format_bytes
from remat import _compat
from remat.platform import building_for, host_platform

__all__ = ["EXTRA", "GPU_MEM_FRACTION", "SPECS", "Spec", "Target", "TargetUnavailable", "available",
           "compile", "compiled_memory", "get", "host_memory_available", "lower", "matmul_flops", "mem_fraction", "names", "place",
           "spec_of", "table_markdown"]

GB = 10 ** 9
EXTRA = "pip install 'remat[targets]'  (in a checkout: pip install -e '.[targets]')"


@dataclasses.dataclass(frozen=True)
class Spec:
    """One accelerator as a user buys it: what the compiler needs to build for it, the figures a
    cost model and MFU need, and where those figures come from (`source`; docs/targets.md)."""
    kind: str                   # registry name: "h200"
    platform: str               # "cuda" | "tpu" | "cpu"
    title: str                  # "NVIDIA H200 141GB HBM3e"
    memory: int                 # device memory per device, bytes
    memory_bandwidth: float     # bytes/s
    peak_flops: Mapping[str, float] = dataclasses.field(hash=False)  # dense matrix FLOP/s per dtype name
    host_link: float | None = None  # host <-> device bytes/s, one direction (None: not stated)
    gpu: Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)  # GpuTargetConfigProto fields
    tpu: str | None = None      # libtpu's chip name ("v5e")
    device_kinds: tuple = ()    # a TPU's `device.device_kind` as JAX reports it, lower case
    source: str = ""

    def is_device(self, device) -> bool:
        """True when `device` (a `jax.Device`) is this accelerator: its platform, and its
        `device_kind` (`NVIDIA H200`, `TPU v5 lite`): a TPU's is one of `device_kinds`, a GPU's
        holds each word of `kind` (`a100-80g` in `NVIDIA A100-SXM4-80GB`, not `h200` in `GH200`)."""
        if device.platform not in ({"cuda": "gpu"}.get(self.platform, self.platform), self.platform):
            return False
        kind = str(getattr(device, "device_kind", "")).lower()
        if self.platform == "cpu":
            return True
        if self.platform == "tpu":
            return kind in self.device_kinds
        return all(re.search(rf"\b{re.escape(part)}", kind) for part in self.kind.split("-"))


def _nvidia(kind, title, memory, bandwidth, bf16, tf32, pcie_gen, cc, sms, fpus, l2, clock):
    # float32 at JAX's default precision runs on the TF32 tensor cores (`jax.lax.Precision.DEFAULT`)
    gpu = dict(cc=cc, sms=sms, fpus=fpus, smem_core=233472 if cc[0] >= 9 else 167936,
               smem_optin=232448 if cc[0] >= 9 else 166912, bandwidth=int(bandwidth), l2=l2, clock=clock,
               memory=memory, dnn=(9, 8))
    return Spec(kind, "cuda", title, memory, bandwidth, {"bfloat16": bf16, "float16": bf16, "float32": tf32},
                {5: 64, 4: 32}[pcie_gen] * GB, gpu=gpu,
                source=f"NVIDIA {kind.split('-')[0].upper()} data sheet: dense (no sparsity) tensor-core FLOP/s of "
                       f"the SXM part, bf16 and TF32; HBM bandwidth; PCIe Gen{pcie_gen} x16 host link. Device "
                       f"description: XLA's gpu_device_info")


def _tpu(kind, title, memory, bandwidth, bf16, device_kinds):
    # float32 at JAX's default precision runs as one bfloat16 pass (`jax.lax.Precision.DEFAULT`)
    return Spec(kind, "tpu", title, memory, bandwidth, {"bfloat16": bf16, "float32": bf16}, None, tpu=kind,
                device_kinds=device_kinds,
                source=f"Google Cloud TPU {kind} documentation: bf16 FLOP/s, HBM capacity and bandwidth per chip")


# The GPU descriptions are XLA's own (the `gpu_device_info` it records from a real device: SM
# count, shared memory, L2, clocks and `device_memory_size`, CUDA's totalGlobalMem).
SPECS: dict[str, Spec] = {s.kind: s for s in (
    _nvidia("h100", "NVIDIA H100 80GB HBM3", 84_942_979_072, 3.35232e12, 989e12, 494e12, 5,
            (9, 0), 132, 128, 52428800, 1.98),
    _nvidia("h200", "NVIDIA H200 141GB HBM3e", 151_397_597_184, 4.8e12, 989e12, 494e12, 5,
            (9, 0), 132, 128, 52428800, 1.98),
    _nvidia("a100-80g", "NVIDIA A100-SXM4-80GB", 85_100_068_864, 2.03904e12, 312e12, 156e12, 4,
            (8, 0), 108, 64, 41943040, 1.41),
    _nvidia("b200", "NVIDIA B200", 191_514_411_008, 7.67232e12, 2250e12, 1100e12, 5,
            (10, 0), 148, 128, 132644864, 1.965),
    _tpu("v5e", "TPU v5e", 16 * GiB, 8.19e11, 197e12, ("tpu v5 lite", "tpu v5e")),
    _tpu("v5p", "TPU v5p", 95 * GiB, 2.765e12, 459e12, ("tpu v5p", "tpu v5")),
    _tpu("v6e", "TPU v6e", 32 * GiB, 1.64e12, 918e12, ("tpu v6 lite", "tpu v6e")),
)}

# JAX's GPU allocator takes this fraction of device memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says
# otherwise (JAX's documented default; XLA_PYTHON_CLIENT_ALLOCATOR=platform lifts the limit).
GPU_MEM_FRACTION = 0.75


@dataclasses.dataclass(frozen=True)
class Target:
    """A spec times a count, with a topology: what `compile` builds for.

    Attributes: name (canonical, "h200x8"), spec, count (devices), topology (the GPU `AxBxC` or
    libtpu topology string; "" for the host CPU).
    """
    name: str
    spec: Spec
    count: int
    topology: str

    @property
    def platform(self) -> str:
        return self.spec.platform

    @property
    def memory(self) -> int:
        """Device memory per device, in bytes (what the compiler is told the device has)."""
        return self.spec.memory

    @property
    def memory_limit(self) -> int:
        """What a JAX program may allocate per device: on a GPU the allocator's share of the device
        memory (XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75; the whole memory with
        XLA_PYTHON_CLIENT_ALLOCATOR=platform), elsewhere the device memory. The default budget."""
        if self.platform != "cuda":
            return self.memory
        if os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
            return self.memory
        return int(self.memory * mem_fraction())

    @property
    def compiler(self) -> str:
        """"XLA:GPU", "XLA:TPU" or "XLA:CPU": the compiler whose figures this target gives."""
        return {"cuda": "XLA:GPU", "tpu": "XLA:TPU", "cpu": "XLA:CPU"}[self.platform]

    def hardware(self) -> str:
        """`8 x NVIDIA H200 141GB HBM3e` (or one device's title)."""
        return f"{self.count} x {self.spec.title}" if self.count > 1 else self.spec.title

    def devices(self) -> list:
        """The target's devices: compile-only ones for an accelerator, this host's CPUs for `cpu`."""
        if self.platform == "cpu":
            return list(jax.devices("cpu"))[: self.count]
        return list(_topology_devices(self.name, self.platform, self.topology, _gpu_config(self.spec)))

    def mesh(self, shape: Mapping[str, int] | None = None) -> Mesh:
        """A Mesh over the target's devices: `shape` {axis: size} (sizes whose product is the device
        count; missing: one axis "devices" over all of them).

        Example:
          >>> dict(get("h200x8").mesh({"data": 2, "fsdp": 4}).shape)
          {'data': 2, 'fsdp': 4}
        """
        devs = self.devices()
        shape = dict(shape or {"devices": len(devs)})
        n = math.prod(shape.values())
        if n != len(devs):
            raise ValueError(f"a mesh of {shape} spans {n} devices but {self.name} has {len(devs)}; "
                             f"use axis sizes whose product is {len(devs)} (or a target with {n} devices, "
                             f"e.g. {self.spec.kind}{'x' if self.platform == 'cuda' else ':'}{n})")
        return Mesh(np.array(devs).reshape(tuple(shape.values())), tuple(shape))


def table_markdown() -> str:
    """The targets as a Markdown table (docs/targets.md holds it; `python -m remat.planning.targets` prints it)."""
    rows = ["| name | compiler | device | memory per device | memory bandwidth | dense bf16 | host link |",
            "|---|---|---|---|---|---|---|"]
    for s in SPECS.values():
        link = f"{s.host_link / GB:.0f} GB/s" if s.host_link else "not stated"
        rows.append(f"| `{s.kind}` | {'XLA:GPU' if s.platform == 'cuda' else 'XLA:TPU'} | {s.title} | "
                    f"{format_bytes(s.memory)} | {s.memory_bandwidth / 1e12:.2f} TB/s | "
                    f"{s.peak_flops['bfloat16'] / 1e12:.0f} TFLOP/s | {link} |")
    rows.append("| `cpu` | XLA:CPU | this host's CPU (its devices, `jax.devices('cpu')`) | available RAM | | | |")
    return "\n".join(rows)


def spec_of(device) -> Spec | None:
    """The accelerator of `device` (a `jax.Device`) among `SPECS`, None for a CPU or one not listed.

    Example:
      >>> import types
      >>> spec_of(types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")).kind
      'h200'
    """
    return next((s for s in SPECS.values() if s.is_device(device)), None)


def mem_fraction() -> float:
    """JAX's GPU allocator fraction: XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75; ValueError naming the
    variable for a value that is not a fraction in (0, 1]."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if text is None:
        return GPU_MEM_FRACTION
    try:
        f = float(text)
    except ValueError:
        f = math.nan
    if not 0 < f <= 1:
        raise ValueError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={text}: not a fraction in (0, 1] (the share of a GPU's "
                         f"memory JAX may take, e.g. .90); unset it for JAX's default {GPU_MEM_FRACTION}")
    return f


_NAME = re.compile(r"^(?P<kind>[a-z0-9-]+?)(?:x(?P<count>\d+)|:(?P<topo>\d+(?:x\d+){1,2}))?$", re.ASCII)


def names() -> tuple[str, ...]:
    """The accelerator names `get` takes (without a count), and `cpu`."""
    return (*SPECS, "cpu")


def get(name: str | Target) -> Target:
    """The target named `name`: `h200`, `h200x8`, `a100-80g`, `v5e`, `v5e:2x4`, `v5p:2x2x1`, `cpu`.

    Raises ValueError naming the valid forms for anything else.
    Example:
      >>> get("h200x8").count, get("v5e:2x4").count, get("v5e:2x4").topology
      (8, 8, 'v5e:2x4')
    """
    if isinstance(name, Target):
        return name
    return _parse(str(name).strip().lower())


@functools.lru_cache(maxsize=None)
def _parse(name: str) -> Target:
    text = name
    m = _NAME.match(text)
    kind = m.group("kind") if m else None
    if text == "cpu" or (m and kind == "cpu" and m.group("count")):
        n = int(m.group("count")) if m and m.group("count") else len(jax.devices("cpu"))
        host = len(jax.devices("cpu"))
        if not 1 <= n <= host:
            raise ValueError(f"target {name!r}: this host has {host} CPU device(s); use cpu or cpux1..cpux{host} "
                             f"(more CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
        spec = Spec("cpu", "cpu", "this host's CPU", host_memory_available() or 0, 0.0, {}, None)
        return Target("cpu" if n == host else f"cpux{n}", spec, n, "")
    if kind not in SPECS:
        raise ValueError(f"target {name!r} is not known; use one of {', '.join(names())}, with a count for "
                         f"several devices: h200x8 (GPUs), v5e:2x4 (a TPU slice in libtpu's words)")
    spec = SPECS[kind]
    if spec.platform == "cuda":
        if m.group("topo"):
            raise ValueError(f"target {name!r}: a GPU count is written {kind}xN (e.g. {kind}x8)")
        n = int(m.group("count") or 1)
        if not 1 <= n <= 4096:
            raise ValueError(f"target {name!r}: the GPU count must be 1..4096")
        return Target(kind if n == 1 else f"{kind}x{n}", spec, n, f"1x1x{n}")
    if m.group("count"):
        raise ValueError(f"target {name!r}: a TPU slice is written in libtpu's topology words, e.g. {kind}:2x4 "
                         f"(8 chips){' or ' + kind + ':2x2x2' if kind == 'v5p' else ''}")
    dims = m.group("topo") or ("1x1x1" if kind == "v5p" else "1x1")
    n = math.prod(int(d) for d in dims.split("x"))
    if n < 1:
        raise ValueError(f"target {name!r}: every topology size must be at least 1")
    return Target(kind if n == 1 and not m.group("topo") else f"{kind}:{dims}", spec, n, f"{spec.tpu}:{dims}")


def host_memory_available() -> int | None:
    """This host's available RAM in bytes (/proc/meminfo's MemAvailable), the `cpu` target's memory;
    None where it cannot be read.

    Example:
      >>> (host_memory_available() or 1) > 0
      True
    """
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _gpu_config(spec: Spec) -> str | None:
    """The GpuTargetConfigProto text XLA:GPU takes for `spec` (None for a TPU or the CPU)."""
    g = spec.gpu
    if g is None:
        return None
    return "\n".join([
        "gpu_device_info {",
        "  threads_per_block_limit: 1024", "  threads_per_warp: 32", "  shared_memory_per_block: 49152",
        f"  shared_memory_per_core: {g['smem_core']}", "  threads_per_core_limit: 2048",
        f"  core_count: {g['sms']}", f"  fpus_per_core: {g['fpus']}",
        "  block_dim_limit_x: 2147483647", "  block_dim_limit_y: 65535", "  block_dim_limit_z: 65535",
        f"  memory_bandwidth: {g['bandwidth']}", f"  l2_cache_size: {g['l2']}", f"  clock_rate_ghz: {g['clock']}",
        f"  device_memory_size: {g['memory']}", f"  shared_memory_per_block_optin: {g['smem_optin']}",
        f"  cuda_compute_capability {{ major: {g['cc'][0]} minor: {g['cc'][1]} }}",
        "  registers_per_core_limit: 65536", "  registers_per_block_limit: 65536",
        "}", 'platform_name: "CUDA"',
        f"dnn_version_info {{ major: {g['dnn'][0]} minor: {g['dnn'][1]} }}",
        f'device_description_str: "{spec.title}"', ""])


class TargetUnavailable(RuntimeError):
    """The target's compiler is not installed, or JAX did not register it in this process."""


def available(platform: str) -> bool:
    """True when this process can compile for `platform` ("cuda", "tpu", "cpu") without a device."""
    if platform == "cpu":
        return True
    try:
        _topology_devices(f"probe-{platform}", platform, "1x1x1" if platform == "cuda" else "v5e:1x1",
                          _gpu_config(SPECS["h100"]) if platform == "cuda" else None)
        return True
    except TargetUnavailable:
        return False


@functools.lru_cache(maxsize=None)
def _topology_devices(name: str, platform: str, topology: str, config: str | None) -> tuple:
    from jax.experimental import topologies

    module, wheel = (("jax_plugins.xla_cuda12", "jax-cuda12-pjrt") if platform == "cuda" else ("libtpu", "libtpu"))
    if platform == "cuda":
        try:
            mem_fraction()  # the CUDA plugin parses it as it builds the topology, with a traceback
        except ValueError as e:
            raise TargetUnavailable(str(e)) from None
    try:
        installed = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        installed = False
    compiler = "XLA:GPU" if platform == "cuda" else "XLA:TPU"
    if not installed:
        raise TargetUnavailable(f"compiling for {name} needs {compiler}'s compiler ({wheel}), which is not "
                                f"installed: {EXTRA}")
    try:
        if platform == "cuda":
            topo = topologies.get_topology_desc(platform="cuda", topology_name="", target_config=config,
                                                topology=topology)
        else:
            dims = topology.split(":")[1].split("x")
            per_host = tuple(int(d) for d in dims) + (1,) * (3 - len(dims)) if math.prod(map(int, dims)) < 4 else None
            kw = {"chips_per_host_bounds": per_host} if per_host else {}
            with _no_libtpu_lock():
                topo = topologies.get_topology_desc(topology, "tpu", **kw)
    except NotImplementedError as e:
        raise TargetUnavailable(
            f"compiling for {name}: {compiler}'s compiler is installed but JAX did not register it in this process "
            f"({e}); on a machine without that accelerator start Python with JAX_PLATFORMS=cpu (or "
            f"JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 for a GPU target)") from None
    except Exception as e:  # noqa: BLE001 - libtpu/XLA raise their own types; name the target in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetUnavailable(f"compiling for {name}: {compiler} refused the topology {topology!r}: {first}") from None
    return tuple(topo.devices)


# Skip libtpu's multi-process lock for one topology-only load on a host without TPU chips
# (docs/architecture.md, Design notes: `targets.py` `_no_libtpu_lock`).
@contextlib.contextmanager
def _no_libtpu_lock():
    key = "ALLOW_MULTIPLE_LIBTPU_LOAD"
    if glob.glob("/dev/accel*") or os.path.exists("/dev/vfio") or key in os.environ:
        yield
        return
    os.environ[key] = "1"
    try:
        yield
    finally:
        os.environ.pop(key, None)


def _struct(x, sharding):
    if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
    return x  # a Python value: passed as is (traced as a weak-typed scalar, as jit does)


def place(args, mesh: Mesh, specs=None):
    """`args` (arrays, ShapeDtypeStructs, pytrees of them) as ShapeDtypeStructs placed on `mesh`:
    `specs` is a PartitionSpec, or a pytree prefix of `args` with PartitionSpec leaves (None:
    replicated). Example: `place((w, x), mesh, (P(None, "fsdp"), P("fsdp")))`."""
    if specs is None:
        specs = jax.tree.map(lambda _: P(), args)
    elif isinstance(specs, P):
        specs = jax.tree.map(lambda _: specs, args)
    is_spec = lambda s: isinstance(s, P) or s is None  # noqa: E731
    flat_specs, tree = jax.tree.flatten(specs, is_leaf=is_spec)
    subtrees = tree.flatten_up_to(args)
    out = [jax.tree.map(lambda x, s=s: _struct(x, NamedSharding(mesh, s if s is not None else P())), a)
           for a, s in zip(subtrees, flat_specs)]
    return jax.tree.unflatten(tree, out)


def lower(fn, *args, target: str | Target, mesh: Mesh | Mapping[str, int] | None = None, specs=None,
          static_argnums=(), donate_argnums=(), **kwargs) -> jax.stages.Lowered:
    """`fn(*args, **kwargs)` traced and lowered for `target` (arguments as `compiled_memory` takes them)."""
    t = get(target)
    if not isinstance(mesh, Mesh):
        mesh = t.mesh(mesh)
    structs = place(args, mesh, specs)
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn, static_argnums=static_argnums, donate_argnums=donate_argnums)
    with building_for(t.platform), jax.set_mesh(mesh):
        return jitted.trace(*structs, **kwargs).lower()


@contextlib.contextmanager
def _without_persistent_cache():
    # JAX decides once per process, at its first compile, whether the persistent cache is used: reset
    # that decision so the compile inside sees the cache off, and again after it for the next compile.
    from jax.experimental.compilation_cache import compilation_cache

    compilation_cache.reset_cache()
    try:
        with _compat.enable_compilation_cache(False):
            yield
    finally:
        compilation_cache.reset_cache()


def compile(fn, *args, target: str | Target, mesh=None, specs=None, static_argnums=(), donate_argnums=(),
            **kwargs) -> jax.stages.Compiled:
    """`fn(*args, **kwargs)` compiled by `target`'s compiler with no device present.

    Raises TargetUnavailable (one line naming the install) when that compiler is missing, and
    MemoryError when the compiler itself refuses the program for lack of memory (XLA:TPU does).
    The persistent compilation cache is not used for a device that is not here (its entries could
    not be loaded without it).
    """
    lowered = lower(fn, *args, target=target, mesh=mesh, specs=specs, static_argnums=static_argnums,
                    donate_argnums=donate_argnums, **kwargs)
    absent = get(target).platform != host_platform()
    try:
        with _without_persistent_cache() if absent else contextlib.nullcontext():
            return lowered.compile()
    except Exception as e:  # noqa: BLE001
        if "RESOURCE_EXHAUSTED" in str(e):  # XLA's status for a program that does not fit
            t = get(target)
            first = str(e).strip().splitlines()[0]
            raise MemoryError(f"{t.compiler} cannot fit the program on {t.hardware()}: {first}") from e
        raise


def compiled_memory(fn, *args, target=None, mesh=None, specs=None, static_argnums=(), donate_argnums=(),
                    **kwargs) -> CompiledMemory:
    """XLA's memory analysis and the matmul FLOPs of `fn(*args, **kwargs)`, per device: compiled with `jax.jit`
    on this host, or with `target` by that accelerator's compiler with no device present.
    `remat.memory.compiled_memory` is this function.

    Args:
      fn: a function (or a `jax.jit` of one) of arrays/pytrees.
      *args: arrays or `jax.ShapeDtypeStruct`s (pytrees of them); only shapes and dtypes are used.
      target: None (this host), or a name (`h200`, `h200x8`, `v5e:2x2`, `cpu`) or a `Target`.
      mesh: with `target`, a Mesh over its devices, or {axis: size} to make one (default: one axis
        "devices" over all of them).
      specs: with `target`, where each argument lives: a PartitionSpec for all, or a pytree prefix
        of `args` with PartitionSpec leaves; default replicated.
      static_argnums, donate_argnums, **kwargs: as for `jax.jit` and the call.
    Returns:
      `CompiledMemory`: temp, argument, output, alias and host bytes; `flops`, the matrix-product
      FLOPs of the optimized program per device, every loop iteration counted
      (`remat.compiled.hlo_matmul_flops`).
    Example:
      >>> compiled_memory(lambda x: jax.numpy.sin(x) * 2, jax.numpy.ones(1024)).output
      4096
    """
    if target is None:
        jitted = fn if hasattr(fn, "trace") else jax.jit(fn, static_argnums=static_argnums,
                                                          donate_argnums=donate_argnums)
        return compiled_stats(jitted.trace(*args, **kwargs).lower().compile())
    t = get(target)
    mesh = mesh if isinstance(mesh, Mesh) else t.mesh(mesh)
    return compiled_stats(compile(fn, *args, target=t, mesh=mesh, specs=specs, static_argnums=static_argnums,
                                  donate_argnums=donate_argnums, **kwargs))


def matmul_flops(jaxpr) -> float:
    """FLOPs of the matrix products of a (closed) jaxpr (a program no compiler built, e.g. one the
    target refused; a compiled one: `remat.compiled.hlo_matmul_flops`), every nested program included: 2·M·N·K per
    `dot_general`, a fused attention call's two products (`remat.compiled.attention_flops`), `scan`
    bodies times their length, `cond` its costliest branch, a `while` body
    once (its trip count is not static). Forward, recomputation and backward all count when the
    jaxpr is a gradient's.

    Example:
      >>> import jax.numpy as jnp
      >>> matmul_flops(jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 8)), jnp.ones((8, 16))))
      1024.0
    """
    from remat.compiled import attention_flops

    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        att = attention_flops(eqn)
        if att is not None:   # a fused attention call (cuDNN's): its two products
            total += att
            continue
        if name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in lc)
            continue
        subs = [v for v in eqn.params.values() if _is_jaxpr(v)]
        subs += [j for v in eqn.params.values() if isinstance(v, (tuple, list)) for j in v if _is_jaxpr(j)]
        if not subs:
            continue
        if name == "scan":
            total += eqn.params["length"] * sum(matmul_flops(s) for s in subs)
        elif name == "cond":
            total += max(matmul_flops(s) for s in subs)
        elif name == "while":
            total += matmul_flops(eqn.params["body_jaxpr"])
        else:
            total += sum(matmul_flops(s) for s in subs)
    return total


def _is_jaxpr(v) -> bool:
    return isinstance(v, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))


if __name__ == "__main__":
    print(table_markdown())
