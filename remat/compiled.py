"""What XLA compiled: the memory analysis, matrix-product FLOPs and identity of a compiled program
(`CompiledMemory`, `hlo_matmul_flops`, `hlo_fingerprint`), and the bytes formatter.

Example:
    >>> import jax.numpy as jnp
    >>> format_bytes(compiled_stats(jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(2 ** 18)).compile()).output)
    '1.00 MiB'
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import re

import jax

__all__ = ["CompiledMemory", "GiB", "MiB", "compiled_stats", "format_bytes", "hlo_fingerprint", "hlo_matmul_flops"]


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory analysis of one compiled function (bytes) and its matrix-product FLOPs
    (`hlo_matmul_flops`: every loop iteration counted, per device)."""
    temp: int
    argument: int
    output: int
    alias: int
    generated_code: int
    host_temp: int
    flops: float | None  # None: no optimized program to read
    host_argument: int = 0
    host_output: int = 0
    flops_source: str = "optimized HLO matmuls"  # hlo_matmul_flops; or "jaxpr matmuls" (planning.targets.matmul_flops)
    fingerprint: str | None = dataclasses.field(default=None, compare=False, repr=False)  # hlo_fingerprint; None: no text

    @property
    def peak_estimate(self) -> int:
        """argument + output + temp - alias: what the program needs live at once, at most."""
        return self.argument + self.output + self.temp - self.alias


def compiled_stats(compiled) -> CompiledMemory:
    """XLA's memory analysis of a `jax.stages.Compiled` (`memory_analysis()`) and the matrix-product
    FLOPs of its optimized program (`hlo_matmul_flops`); a `CompiledMemory` is returned as is.

    Raises ValueError when the backend gives no memory analysis.
    Example:
      >>> import jax.numpy as jnp
      >>> stats = compiled_stats(jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(1024)).compile())
      >>> stats.argument, stats.output
      (4096, 4096)
    """
    if isinstance(compiled, CompiledMemory):
        return compiled
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError(f"XLA gave no memory analysis for this program on {jax.default_backend()}")
    try:
        text = compiled.as_text()
    except Exception:  # pragma: no cover - a backend that gives no program text
        text = None
    flops = None if text is None else hlo_matmul_flops(text)
    loops, counted = len(re.findall(r" while\(", text or "")), len(_TRIP.findall(text or ""))
    g = lambda k: int(getattr(ma, k, 0) or 0)
    return CompiledMemory(temp=g("temp_size_in_bytes"), argument=g("argument_size_in_bytes"),
                          output=g("output_size_in_bytes"), alias=g("alias_size_in_bytes"),
                          generated_code=g("generated_code_size_in_bytes"),
                          host_temp=g("host_temp_size_in_bytes"),
                          host_argument=g("host_argument_size_in_bytes"), host_output=g("host_output_size_in_bytes"),
                          flops=flops, flops_source=_SOURCE if loops <= counted else _SOURCE + _ONCE,
                          fingerprint=None if text is None else hlo_fingerprint(text))


def hlo_fingerprint(text: str) -> str:
    """A hash of an optimized HLO module (`compiled.as_text()`) without its debug information (source
    locations, op names): two compiles of one program give the same, two programs differ.

    Example:
      >>> import jax.numpy as jnp
      >>> a, b = (jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(8)).compile().as_text() for _ in range(2))
      >>> hlo_fingerprint(a) == hlo_fingerprint(b) != hlo_fingerprint(a.replace("f32", "s32"))
      True
    """
    blocks = [b for b in text.split("\n\n")
              if b.strip().split("\n", 1)[0].strip() not in ("FileNames", "FunctionNames", "FileLocations",
                                                            "StackFrames")]
    return hashlib.sha1(re.sub(r",? metadata=\{[^}]*\}", "", "\n\n".join(blocks)).encode()).hexdigest()


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(r"^(?:ROOT )?%([\w.\-]+) = (\([^=]*?\)|[a-z]\w*\[[\d,]*\](?:\{[^}]*\})?) ([\w\-$]+)\((.*)")
_SHAPE = re.compile(r"[a-z]\w*\[([\d,]*)\]")
_CALLED = re.compile(r"\b(calls|to_apply|body|branch_computations|true_computation|false_computation)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SOURCE = "optimized HLO matmuls"
_ONCE = " (a loop of unknown trip count counted once)"
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


def _dims(shape: str) -> tuple:
    m = _SHAPE.search(shape)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def hlo_matmul_flops(text: str) -> float:
    """Matrix-product FLOPs of an optimized HLO module (`compiled.as_text()`), 2·M·N·K per `dot`,
    cuBLAS GEMM call or `convolution` (XLA:TPU's dots), each `while` body times its trip count (XLA's `known_trip_count`; once where
    unknown), a conditional its costliest branch. XLA's own cost analysis counts a loop body once
    and XLA:GPU without a device gives none; this reads the program either compiler built. The
    shapes of a partitioned program are one device's, so are the FLOPs.

    Example:
      >>> import jax.numpy as jnp
      >>> scan = lambda n: jax.jit(lambda c: jax.lax.scan(lambda c, _: (c @ c, None), c, None, length=n)[0])
      >>> [hlo_matmul_flops(scan(n).lower(jnp.ones((64, 64))).compile().as_text()) for n in (1, 8)]
      [524288.0, 4194304.0]
    """
    comps, entry, name, shapes = {}, None, None, {}
    for line in text.splitlines():
        line = line.strip()
        m = _COMPUTATION.match(line)
        if m:
            name, shapes = m.group(1), {}
            comps[name] = ([], [])  # (own FLOPs per instruction, [(multiplier kind, called names, trip)])
            entry = name if line.startswith("ENTRY") else entry
            continue
        m = name and _INSTRUCTION.match(line)
        if not m:
            continue
        var, shape, op, rest = m.groups()
        shapes[var] = shape
        own, calls = comps[name]
        if op == "dot":
            lhs = _dims(shapes.get(rest.split(",")[0].strip().lstrip("%"), ""))
            lc = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
            k = math.prod(lhs[int(d)] for d in lc.group(1).split(",") if d) if lc and lhs else 1
            own.append(2.0 * math.prod(_dims(shape)) * k)
        elif op == "convolution":  # XLA:TPU's form of a dot: K = the kernel's input features x its window
            operands = [o.strip().lstrip("%") for o in rest.split(")")[0].split(",")]
            rhs = _dims(shapes.get(operands[1], "")) if len(operands) > 1 else ()
            labels = re.search(r"dim_labels=\w+_(\w+)->\w+", rest)
            groups = re.search(r"feature_group_count=(\d+)", rest)
            if rhs and labels and len(labels.group(1)) == len(rhs):
                k = math.prod(d for d, c in zip(rhs, labels.group(1)) if c != "o") // (int(groups.group(1)) if groups else 1)
                own.append(2.0 * math.prod(_dims(shape)) * k)
        elif op == "custom-call" and any(f'custom_call_target="{g}"' in rest for g in _GEMMS):
            lhs = _dims(shapes.get(rest.split(",")[0].strip().lstrip("%"), ""))
            cfg = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
            k = math.prod(lhs[int(d)] for d in json.loads(f"[{cfg.group(1)}]")) if cfg and lhs else 1
            own.append(2.0 * math.prod(_dims(shape)) * k)  # a tuple's first shape is the product
        for kind, names in _CALLED.findall(rest):
            called = [n.strip().lstrip("%") for n in names.strip("{}").split(",") if n.strip()]
            trip = _TRIP.search(rest)
            calls.append((op, kind, called, int(trip.group(1)) if trip else 1))

    @functools.lru_cache(maxsize=None)
    def total(c: str) -> float:
        own, calls = comps.get(c, ([], []))
        out = sum(own)
        for op, kind, called, trip in calls:
            sub = [total(n) for n in called]
            if kind == "body":
                out += trip * sum(sub)
            elif kind in ("branch_computations", "true_computation", "false_computation"):
                out += max(sub, default=0.0)
            else:
                out += sum(sub)
        return out

    return total(entry) if entry else 0.0


MiB, GiB = 2 ** 20, 2 ** 30


def format_bytes(n: float | None, up: bool = False) -> str:
    """Bytes in GiB/MiB/KiB, whichever reads best, for messages and reports ("n/a" for None).
    `up` rounds up (a minimum stays a minimum).

    Example:
      >>> format_bytes(3 * 2**30), format_bytes(1536 * 2**10), format_bytes(1000), format_bytes(1025, up=True)
      ('3.00 GiB', '1.50 MiB', '1000 B', '1.1 KiB')
    """
    if n is None:
        return "n/a"
    a = abs(n)
    for unit, scale, digits in (("GiB", GiB, 2), ("MiB", MiB, 2), ("KiB", 2 ** 10, 1)):
        if a >= scale:
            v = n / scale
            if up:
                v = math.ceil(v * 10**digits) / 10**digits
            return f"{v:.{digits}f} {unit}"
    return f"{int(n)} B"
