"""What XLA compiled: the memory and cost analysis of a compiled program (`CompiledMemory`), and
the bytes formatter.

Example:
    >>> import jax.numpy as jnp
    >>> format_bytes(compiled_stats(jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(2 ** 18)).compile()).output)
    '1.00 MiB'
"""
from __future__ import annotations

import dataclasses
import math

import jax

__all__ = ["CompiledMemory", "GiB", "MiB", "compiled_stats", "format_bytes"]


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """XLA's memory analysis and cost analysis of one compiled function (bytes, FLOPs)."""
    temp: int
    argument: int
    output: int
    alias: int
    generated_code: int
    host_temp: int
    flops: float | None  # None: the compiler gave no cost analysis
    host_argument: int = 0
    host_output: int = 0
    flops_source: str = "compiler"  # or "jaxpr matmuls" (remat.planning.targets.matmul_flops)

    @property
    def peak_estimate(self) -> int:
        """argument + output + temp - alias: what the program needs live at once, at most."""
        return self.argument + self.output + self.temp - self.alias


def compiled_stats(compiled) -> CompiledMemory:
    """XLA's memory and cost analysis of a `jax.stages.Compiled` (`memory_analysis()`,
    `cost_analysis()`); a `CompiledMemory` is returned as is.

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
        ca = compiled.cost_analysis()
    except Exception:  # pragma: no cover - backends without a cost model
        ca = None
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    g = lambda k: int(getattr(ma, k, 0) or 0)
    return CompiledMemory(temp=g("temp_size_in_bytes"), argument=g("argument_size_in_bytes"),
                          output=g("output_size_in_bytes"), alias=g("alias_size_in_bytes"),
                          generated_code=g("generated_code_size_in_bytes"),
                          host_temp=g("host_temp_size_in_bytes"),
                          host_argument=g("host_argument_size_in_bytes"), host_output=g("host_output_size_in_bytes"),
                          flops=float(ca["flops"]) if ca and "flops" in ca else None)


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
