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
import zlib

import jax

__all__ = ["CompiledMemory", "GiB", "MiB", "attention_flops", "compiled_stats", "format_bytes", "hlo_fingerprint", "hlo_kernels",
           "hlo_matmul_flops"]


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
    program: bytes | None = dataclasses.field(default=None, compare=False, repr=False)  # the optimized HLO, zlib'd

    @functools.cached_property
    def kernels(self) -> tuple:
        """`hlo_kernels` of the optimized program (read on first use); () without one."""
        return () if self.program is None else hlo_kernels(zlib.decompress(self.program).decode())

    @functools.cached_property
    def fingerprint(self) -> str | None:
        """`hlo_fingerprint` of the optimized program (read on first use); None without one."""
        return None if self.program is None else hlo_fingerprint(zlib.decompress(self.program).decode())

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
                          program=None if text is None else zlib.compress(text.encode(), 1))


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
_COMMENT = re.compile(r"/\*.*?\*/")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_SOURCE = "optimized HLO matmuls"
_ONCE = " (a loop of unknown trip count counted once)"
_GEMMS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


def _dims(shape: str) -> tuple:
    m = _SHAPE.search(shape)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


@dataclasses.dataclass(frozen=True)
class _Instr:
    var: str
    shape: str
    op: str
    rest: str
    operands: tuple
    called: tuple    # ((kind, (names...)), ...)
    trip: int


def _parse(text: str) -> tuple:
    """({computation: [_Instr, ...]}, entry name) of an optimized HLO module's text."""
    comps, entry, name = {}, None, None
    for line in text.splitlines():
        line = _COMMENT.sub("", line.strip())   # a long tuple's /*index=5*/ markers
        m = _COMPUTATION.match(line)
        if m:
            name = m.group(1)
            comps[name] = []
            entry = name if line.startswith("ENTRY") else entry
            continue
        m = name and _INSTRUCTION.match(line)
        if not m:
            continue
        var, shape, op, rest = m.groups()
        operands = tuple(re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0]))
        called = tuple((kind, tuple(n.strip().lstrip("%") for n in names.strip("{}").split(",") if n.strip()))
                       for kind, names in _CALLED.findall(rest))
        trip = _TRIP.search(rest)
        comps[name].append(_Instr(var, shape, op, rest, operands, called, int(trip.group(1)) if trip else 1))
    return comps, entry


def _own_flops(ins: _Instr, shapes: dict) -> float:
    """2·M·N·K of a dot, a convolution (XLA:TPU's dots) or a cuBLAS GEMM call; 0 for anything else."""
    if ins.op == "dot":
        lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else ()
        lc = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.rest)
        k = math.prod(lhs[int(d)] for d in lc.group(1).split(",") if d) if lc and lhs else 1
        return 2.0 * math.prod(_dims(ins.shape)) * k
    if ins.op == "convolution":  # K = the kernel's input features x its window
        rhs = _dims(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else ()
        labels = re.search(r"dim_labels=\w+_(\w+)->\w+", ins.rest)
        groups = re.search(r"feature_group_count=(\d+)", ins.rest)
        if rhs and labels and len(labels.group(1)) == len(rhs):
            k = math.prod(d for d, c in zip(rhs, labels.group(1)) if c != "o") // (int(groups.group(1)) if groups else 1)
            return 2.0 * math.prod(_dims(ins.shape)) * k
        return 0.0
    if ins.op == "custom-call" and 'custom_call_target="__cudnn$fmha' in ins.rest:   # cuDNN's fused attention
        scores = re.search(r'"intermediate_tensor_shape":\s*\{"element_type":\s*"\w+",\s*"dimensions":\s*\[([^\]]*)\]',
                           ins.rest)
        q = _dims(shapes.get(ins.operands[0], "")) if ins.operands else ()
        if not scores or not q:
            return 0.0
        bhts = [int(d) for d in json.loads(f"[{scores.group(1)}]")]
        f = 4.0 * math.prod(bhts) * (math.prod(q) // max(1, math.prod(bhts[:-1])))   # two products: 2·2·B·H·T·S·D
        f /= 2 if '"CAUSAL"' in ins.rest else 1
        return f * (2.5 if "Backward" in ins.rest.split('custom_call_target="', 1)[1].split('"', 1)[0] else 1.0)
    if ins.op == "custom-call" and any(f'custom_call_target="{g}"' in ins.rest for g in _GEMMS):
        lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else ()
        cfg = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.rest)
        k = math.prod(lhs[int(d)] for d in json.loads(f"[{cfg.group(1)}]")) if cfg and lhs else 1
        return 2.0 * math.prod(_dims(ins.shape)) * k  # a tuple's first shape is the product
    return 0.0


def hlo_matmul_flops(text: str) -> float:
    """Matrix-product FLOPs of an optimized HLO module (`compiled.as_text()`), 2·M·N·K per `dot`,
    cuBLAS GEMM call or `convolution` (XLA:TPU's dots), the two products of a cuDNN fused attention, each `while` body times its trip count (XLA's `known_trip_count`; once where
    unknown), a conditional its costliest branch. XLA's own cost analysis counts a loop body once
    and XLA:GPU without a device gives none; this reads the program either compiler built. The
    shapes of a partitioned program are one device's, so are the FLOPs.

    Example:
      >>> import jax.numpy as jnp
      >>> scan = lambda n: jax.jit(lambda c: jax.lax.scan(lambda c, _: (c @ c, None), c, None, length=n)[0])
      >>> [hlo_matmul_flops(scan(n).lower(jnp.ones((64, 64))).compile().as_text()) for n in (1, 8)]
      [524288.0, 4194304.0]
    """
    comps, entry = _parse(text)

    @functools.lru_cache(maxsize=None)
    def total(c: str) -> float:
        ins_list = comps.get(c, [])
        shapes = {i.var: i.shape for i in ins_list}
        out = 0.0
        for ins in ins_list:
            out += _own_flops(ins, shapes)
            for kind, called in ins.called:
                sub = [total(n) for n in called]
                if kind == "body":
                    out += ins.trip * sum(sub)
                elif kind in ("branch_computations", "true_computation", "false_computation"):
                    out += max(sub, default=0.0)
                else:
                    out += sum(sub)
        return out

    return total(entry) if entry else 0.0


_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s4": 1, "u4": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
# instructions that launch no kernel of their own (views, bookkeeping, control flow read through)
_NO_KERNEL = frozenset({"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "partition-id",
                        "replica-id", "opt-barrier", "domain", "add-dependency", "while", "conditional", "call",
                        "copy-done", "send-done", "recv-done", "all-reduce-done", "all-gather-done",
                        "collective-permute-done", "async-done", "async-update"})


def _nbytes(shape: str) -> int:
    return sum(_ITEMSIZE.get(t, 1 if t.startswith("f8") else 0) * math.prod(int(d) for d in dims.split(",") if d)
               for t, dims in re.findall(r"\b([a-z]\w*)\[([\d,]*)\]", shape))


def _dtype(shape: str) -> str:
    m = re.match(r"\(?\s*([a-z]\w*)\[", shape)
    return {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}.get(m.group(1), m.group(1)) if m else ""


def hlo_kernels(text: str) -> tuple:
    """The kernels of an optimized HLO module, for a roofline: `((flops, bytes, count, dtype), ...)`,
    one entry per distinct kind. A kernel is a fusion, a matrix product or GEMM call, a copy or
    any other instruction of the entry or of a loop body that does work; `count` counts every
    loop iteration (`known_trip_count`) and a conditional's costliest branch. Bytes are what the
    kernel reads and writes: its operands and result, a slice where the fused program reads one
    (`dynamic-slice`) and the update where it writes one in place (`dynamic-update-slice`).
    `dtype` is a matrix product's operand type ("" for the rest).

    Example:
      >>> import jax.numpy as jnp
      >>> ks = hlo_kernels(jax.jit(lambda a: a @ a).lower(jnp.ones((64, 64))).compile().as_text())
      >>> sum(f * n for f, _, n, _ in ks)
      524288.0
    """
    comps, entry = _parse(text)
    out: dict = {}

    def fused_bytes(ins: _Instr, shapes: dict) -> int:
        body = ins.called[0][1][0] if ins.called and ins.called[0][0] == "calls" else None
        fused = comps.get(body, [])
        if not fused:
            return sum(_nbytes(shapes.get(o, "")) for o in ins.operands) + _nbytes(ins.shape)
        params = {int(re.match(r"(\d+)", i.rest).group(1)): i.var for i in fused if i.op == "parameter"}
        uses: dict = {}
        for i in fused:
            for k, o in enumerate(i.operands):
                uses.setdefault(o, []).append((i, k))
        total, in_place = 0, set()
        for i in fused:
            if i.op == "dynamic-update-slice" and i.operands:
                in_place.add(i.operands[0])
        for n, o in enumerate(ins.operands):
            p = params.get(n)
            u = uses.get(p, [])
            if p in in_place:
                continue                      # a buffer updated in place: only the update moves
            if u and all(i.op == "dynamic-slice" and k == 0 for i, k in u):
                total += sum(_nbytes(i.shape) for i, _ in u)
            else:
                total += _nbytes(shapes.get(o, ""))
        root = fused[-1]
        roots = [next((i for i in fused if i.var == r), None) for r in root.operands] if root.op == "tuple" else [root]
        for r in roots:
            if r is not None and r.op == "dynamic-update-slice" and len(r.operands) > 1:
                upd = next((i for i in fused if i.var == r.operands[1]), None)
                total += _nbytes(upd.shape) if upd is not None else 0
            elif r is not None:
                total += _nbytes(r.shape)
        return total

    @functools.lru_cache(maxsize=None)   # a fused computation is called by many kernels: read it once
    def dot_dtype(c: str) -> str:
        """The operand type of the first matrix product in computation c (its fused program)."""
        ins_list = comps.get(c, [])
        shapes = {i.var: i.shape for i in ins_list}
        for i in ins_list:
            if _own_flops(i, shapes) and i.operands:
                return _dtype(shapes.get(i.operands[0], i.shape))
        return next((d for i in ins_list for k, ns in i.called if k == "calls" for n in ns if (d := dot_dtype(n))), "")

    @functools.lru_cache(maxsize=None)
    def flops_of(c: str) -> float:
        ins_list = comps.get(c, [])
        shapes = {i.var: i.shape for i in ins_list}
        return sum(_own_flops(i, shapes) + sum(flops_of(n) for k, ns in i.called if k == "calls" for n in ns)
                   for i in ins_list)

    def walk(c: str, times: int, depth: int = 0) -> None:
        if depth > 64:
            return
        ins_list = comps.get(c, [])
        shapes = {i.var: i.shape for i in ins_list}
        for ins in ins_list:
            if ins.op in ("while", "call", "conditional", "async-start"):
                for kind, called in ins.called:
                    if kind == "body":
                        for n in called:
                            walk(n, times * ins.trip, depth + 1)
                    elif kind in ("branch_computations", "true_computation", "false_computation"):
                        best = max(called, key=lambda n: flops_of(n), default=None)
                        if best:
                            walk(best, times, depth + 1)
                    elif kind in ("calls", "to_apply") and ins.op in ("call", "async-start"):
                        for n in called:
                            walk(n, times, depth + 1)
                    elif kind == "condition":
                        pass
                continue
            if ins.op in _NO_KERNEL:
                continue
            f = _own_flops(ins, shapes)
            dtype = _dtype(shapes.get(ins.operands[0], ins.shape)) if f and ins.operands else ""
            if ins.op == "fusion":
                fused = [n for k, ns in ins.called if k == "calls" for n in ns]
                f += sum(flops_of(n) for n in fused)
                dtype = dtype or (next((d for n in fused if (d := dot_dtype(n))), "") if f else "")
                b = fused_bytes(ins, shapes)
            else:
                b = sum(_nbytes(shapes.get(o, "")) for o in ins.operands) + _nbytes(ins.shape)
            key = (f, b, dtype if f else "")
            out[key] = out.get(key, 0) + times

    if entry:
        walk(entry, 1)
    return tuple((f, b, n, d) for (f, b, d), n in sorted(out.items()))


def attention_flops(eqn) -> float | None:
    """FLOPs of a jaxpr equation that is a fused attention call (cuDNN's, as traced): 4·B·T·S·H·D
    forward (half of it causal), 2.5 times that backward; None for any other equation. The
    compiled program's count (`hlo_matmul_flops`) reads the same from cuDNN's custom call.

    Example:
      >>> import jax.numpy as jnp
      >>> eqn = jax.make_jaxpr(lambda a: a @ a)(jnp.ones((2, 2))).eqns[0]
      >>> attention_flops(eqn) is None
      True
    """
    name = eqn.primitive.name
    if "attention" not in name:
        return None
    q, k = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if len(q) != 4 or len(k) != 4:
        return None
    f = 4.0 * math.prod(q) * k[1]
    if "CAUSAL" in str(eqn.params.get("mask_type", "")).upper():
        f /= 2
    return f * (2.5 if "bwd" in name else 1.0)


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
