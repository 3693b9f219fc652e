"""Readers and writers for llm.c's binary files (NumPy; no JAX at import).

Covers GPT-2 and LLaMA-3 model checkpoints, their debug-state files and token
shards (GPT-2: uint16 tokens, magic 20240520; LLaMA-3: uint32 tokens, magic 20240801,
as llm.c's ``dev/data/data_common.py`` writes them), byte for byte as described in
docs/llmc-format.md: a 256 x int32 little-endian header (1024 bytes),
then the payload back to back.
Model and debug-state files are read and written from the family's format
description, its :class:`Header` subclass (``remat_lm.models.gpt2.GPT2Header``,
``remat_lm.models.llama3.Llama3Header``: magics, header slots, tensor table); nothing
here knows a family by name. A file's magic is matched against the families of
``remat_lm.models.family`` (importing the model files, hence JAX, on first use);
token shards (``TOKEN_FORMATS``) need no model.

Every reader validates the header and the exact file size before it reads a
tensor and raises :class:`LlmcFormatError` (a one-line message naming the file,
the problem and the fix) instead of ever returning a partial result. Every
writer validates its inputs first and then writes atomically (a temporary file
in the target directory, then ``os.replace``).

Example:
    >>> kind, header, tensors, dtype = read_model("model.bin")   # e.g. llm.c's gpt2_124M.bin
    >>> write_model("copy.bin", kind, header, tensors, dtype="bfloat16")
    >>> read_model("copy.bin")[3]
    'bfloat16'
"""

from __future__ import annotations

import abc
import dataclasses
import math
import os
import secrets
import stat
from contextlib import contextmanager
from typing import BinaryIO, ClassVar, Iterator

import numpy as np

from remat_lm.models import family

__all__ = [
    "LlmcFormatError",
    "Header",
    "read_model",
    "write_model",
    "read_state",
    "write_state",
    "TokenFormat",
    "TOKEN_FORMATS",
    "token_format",
    "read_tokens",
    "write_tokens",
    "float32_to_bfloat16_bits",
    "bfloat16_bits_to_float32",
]

HEADER_INTS = 256
HEADER_BYTES = 4 * HEADER_INTS

TOKENS_MAGIC = 20240520
TOKENS_VERSION = 1
LLAMA3_TOKENS_MAGIC = 20240801  # llm.c's uint32 LLaMA-3 shards
LLAMA3_TOKENS_VERSION = 7

VERSION_FLOAT32 = 3
VERSION_BFLOAT16 = 5
_VERSIONS = {VERSION_FLOAT32: "float32", VERSION_BFLOAT16: "bfloat16"}
_DTYPE_VERSIONS = {v: k for k, v in _VERSIONS.items()}


class LlmcFormatError(ValueError):
    """An llm.c file (or data destined for one) is malformed; the message is one line.

    Example:
        >>> try:
        ...     read_model("tokens.bin")
        ... except LlmcFormatError as e:
        ...     print(e)   # "path: problem; fix"
        tokens.bin: magic 20240520 is a GPT-2 (uint16) token shard, not a model file; known model magics: ...
    """


def _fail(path: str, problem: str, fix: str) -> LlmcFormatError:
    return LlmcFormatError(f"{path}: {problem}; {fix}")


# ---------------------------------------------------------------------------
# headers: the format description a model family gives


class Header(abc.ABC):
    """An llm.c model file header, and the description of its family's file format.

    A family's header is a frozen dataclass subclass in its model file (``remat_lm.models.gpt2.GPT2Header``,
    ``remat_lm.models.llama3.Llama3Header``); everything this module reads and writes comes from it:

    - its fields, in order, are header slots 2, 3, ...: an int32 each, except the fields named in
      ``float_ranges`` (float32 bit patterns, checked against a plausible (low, high] range and
      replaceable by ``read_model`` overrides), ``flags`` (0/1) and ``counts`` (ints that may be 0;
      the other ints must be positive); ``trailer`` ints follow them;
    - ``kind``, ``title``, ``model_magic``, ``state_magic`` and ``state_version`` (None: the debug
      state header is magic, B, T; else magic, version, B, T);
    - ``tensor_shapes()``: ``[(name, shape), ...]`` in file order, linear weights (out, in);
    - ``padded``: ``(tensor, rows field, padded rows field)`` for a tensor written with zero rows
      past ``rows`` (GPT-2's wte), or None; ``logit_widths()``: the widths a debug state's
      logits may have;
    - ``problem()``: the first broken rule between fields (None when fine); the per-field checks
      above run first;
    - the words of messages: ``exporter`` (the llm.c script that writes the files),
      ``retired_versions`` / ``retired`` (older versions and what they are), ``truncation``
      / ``float_fix`` (float slots that hold truncated ints, and what to do).

    Example:
        >>> from remat_lm.models.gpt2 import GPT2Header
        >>> h = GPT2Header(1024, 50257, 12, 12, 768, 50304)
        >>> h.kind, h.model_magic, h.n_params()
        ('gpt2', 20240326, 124475904)
    """

    kind: ClassVar[str]
    title: ClassVar[str]
    model_magic: ClassVar[int]
    state_magic: ClassVar[int]
    state_version: ClassVar[int | None] = None
    trailer: ClassVar[tuple[int, ...]] = ()
    float_ranges: ClassVar[dict[str, tuple[float, float]]] = {}
    flags: ClassVar[tuple[str, ...]] = ()
    counts: ClassVar[tuple[str, ...]] = ()
    padded: ClassVar[tuple[str, str, str] | None] = None
    exporter: ClassVar[str] = "llm.c script"
    retired_versions: ClassVar[tuple[int, ...]] = ()
    retired: ClassVar[str] = ""
    truncation: ClassVar[str] = ""
    float_fix: ClassVar[str] = ""

    @abc.abstractmethod
    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """[(name, shape)] of the model file's tensors, in file order."""

    def problem(self) -> str | None:
        return None

    def logit_widths(self) -> list[int]:
        return [self.vocab_size]

    def n_params(self) -> int:
        """Total number of parameters stored in the file."""
        return sum(math.prod(shape) for _, shape in self.tensor_shapes())


def _formats() -> list[type[Header]]:
    """The header classes of every registered family (importing the model files: JAX)."""
    return [fam.header_cls for fam in family.families()]


def _check_kind(kind: str, header: Header) -> None:
    if kind not in family.NAMES:
        raise ValueError(f"kind must be one of {', '.join(map(repr, family.NAMES))}, got {kind!r}")
    if not isinstance(header, Header) or header.kind != kind:
        raise ValueError(f"kind {kind!r} does not match header type {type(header).__name__}")


def _header_problem(header: Header) -> str | None:
    """Return a description of the first nonsensical header value, or None."""
    for field in dataclasses.fields(header):
        name, value = field.name, getattr(header, field.name)
        if name in header.float_ranges:
            if not _plausible_float(header, name, value):
                return f"{name} = {value!r} is outside its plausible range {header.float_ranges[name]}"
        elif name in header.flags:
            if not isinstance(value, (bool, np.bool_)) and value not in (0, 1):
                return f"{name} = {value!r} is not 0/1"
        elif name in header.counts:
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                return f"{name} = {value!r} must be an integer >= 0"
        elif not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
            return f"{name} = {value!r} must be a positive integer"
    return header.problem()


def _plausible_float(header: Header | type[Header], name: str, value: float) -> bool:
    lo, hi = header.float_ranges[name]
    try:
        v = float(value)
    except (TypeError, ValueError):
        return False
    return math.isfinite(v) and lo < v <= hi


def _f32_bits_to_float(bits: int) -> float:
    """Decode int32 bits as float32; return the shortest decimal that round-trips it."""
    f = np.array([bits], dtype="<i4").view("<f4")[0]
    return float(str(f))  # NumPy prints the shortest string that round-trips the float32


def _float_to_f32_bits(value: float) -> int:
    return int(np.array([value], dtype="<f4").view("<i4")[0])


def _header_ints(header: Header, version: int) -> np.ndarray:
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    slots = [header.model_magic, version]
    for field in dataclasses.fields(header):
        value = getattr(header, field.name)
        slots.append(_float_to_f32_bits(value) if field.name in header.float_ranges
                     else int(bool(value)) if field.name in header.flags else value)
    slots += header.trailer
    ints[:len(slots)] = slots
    return ints


# ---------------------------------------------------------------------------
# bfloat16


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (nearest, ties to even) and return the raw uint16 words.

    NaN maps to the canonical quiet NaN 0x7FC0, as PyTorch does; overflow rounds to inf.

    Example:
        >>> float32_to_bfloat16_bits(np.array([1.0], np.float32))
        array([16256], dtype=uint16)
    """
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    bits = x32.view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    out = rounded.astype(np.uint16)
    nan = np.isnan(x32)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def bfloat16_bits_to_float32(words: np.ndarray) -> np.ndarray:
    """Widen raw bfloat16 words (uint16) to float32 exactly by shifting into the high half.

    Example:
        >>> bfloat16_bits_to_float32(np.array([0x3F80], np.uint16))
        array([1.], dtype=float32)
    """
    w = np.ascontiguousarray(words, dtype=np.uint16)
    return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---------------------------------------------------------------------------
# low-level file helpers


def _open_checked(path: str, what: str) -> tuple[BinaryIO, int, np.ndarray]:
    """Open ``path``, check it holds at least a header, return (file, size, header ints)."""
    # NOTE: a FIFO (or a character device) would block `open`/`read` forever: check the kind first.
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO (named pipe)" if stat.S_ISFIFO(mode)
                else "a character device" if stat.S_ISCHR(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a block device" if stat.S_ISBLK(mode) else "not a regular file")
        raise _fail(path, f"this is {kind}, not a regular file", f"pass the path of an llm.c {what} on disk")
    f = open(path, "rb")
    try:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER_BYTES:
            raise _fail(path, f"file is {size} bytes, shorter than the {HEADER_BYTES}-byte llm.c header",
                        f"this is not a complete llm.c {what} (empty or truncated); re-create it")
        ints = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4").astype(np.int64)
        return f, size, ints
    except BaseException:
        f.close()
        raise


def _magic_words(magic: int) -> str:
    """What a file with this magic is ("a GPT-2 model file"), or "" (token magics first: NumPy only)."""
    for fmt in TOKEN_FORMATS.values():
        if fmt.magic == magic:
            return f"a {fmt.title} ({np.dtype(fmt.dtype).name}) token shard"
    for h in _formats():
        if magic == h.model_magic:
            return f"a {h.title} model or debug state file" if h.state_magic == magic else f"a {h.title} model file"
        if magic == h.state_magic:
            return f"a {h.title} debug state file"
    return ""


def _check_size(path: str, size: int, expected: int, detail: str) -> None:
    if size == expected:
        return
    if size < expected:
        problem = f"file is {size} bytes but the header implies {expected} ({detail}): truncated by {expected - size} bytes"
    else:
        problem = f"file is {size} bytes but the header implies {expected} ({detail}): {size - expected} extra bytes"
    raise _fail(path, problem, "the file is incomplete or its header does not match its contents; re-export it")


def _read_array(f: BinaryIO, path: str, dtype: str, count: int) -> np.ndarray:
    arr = np.fromfile(f, dtype=dtype, count=count)
    if arr.size != count:
        raise _fail(path, f"read {arr.size} of {count} values, the file changed while it was being read",
                    "make sure nothing else writes the file and retry")
    return arr


@contextmanager
def _atomic_writer(path: str) -> Iterator[BinaryIO]:
    """Yield a file in path's directory that replaces ``path`` only if the block succeeds."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _write_array(f: BinaryIO, arr: np.ndarray) -> None:
    f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


# ---------------------------------------------------------------------------
# model files


def _parse_model_header(path: str, ints: np.ndarray, overrides: dict[str, float]) -> Header:
    magic, version = int(ints[0]), int(ints[1])
    formats = _formats()
    cls = next((h for h in formats if h.model_magic == magic), None)
    if cls is not None and version in cls.retired_versions:
        raise _fail(path, f"{cls.title} model file version {version} is {cls.retired}",
                    f"re-export with a current {cls.exporter} (version 3 float32 or 5 bfloat16)")
    if cls is None:
        what = _magic_words(magic)
        problem = f"magic {magic} is {what}, not a model file" if what else f"unknown magic {magic}"
        known = ", ".join(f"{h.model_magic} ({h.title})" for h in formats)
        raise _fail(path, problem, f"known model magics: {known}; "
                                   "pass an llm.c model checkpoint (read_state / read_tokens read the other kinds)")
    if version not in _VERSIONS:
        hint = f" (if this is a {cls.title} debug state file, use read_state)" if cls.state_magic == magic else ""
        raise _fail(path, f"unsupported {cls.kind} model file version {version}{hint}",
                    "known versions: 3 (float32), 5 (bfloat16); re-export with a current llm.c script")

    values: dict[str, object] = {}
    truncated, implausible = [], []
    for slot, field in enumerate(dataclasses.fields(cls), start=2):
        name, raw = field.name, int(ints[slot])
        if name in cls.flags:
            if raw not in (0, 1):
                raise _fail(path, f"nonsensical header: {name} (slot {slot}) = {raw}, expected 0 or 1",
                            f"the header is corrupt or not an llm.c {cls.title} header; re-export the checkpoint")
            values[name] = bool(raw)
        elif name in cls.float_ranges:
            value = _f32_bits_to_float(raw)
            if overrides.get(name) is not None:
                value = float(overrides[name])
                if not _plausible_float(cls, name, value):
                    raise _fail(path, f"override {name}={value!r} is outside its plausible range {cls.float_ranges[name]}",
                                f"pass a sensible --{name}")
            elif not _plausible_float(cls, name, value):
                # a non-negative int read as float32 bits is 0, a denormal or ~1e-38: llm.c master's int(value)
                if raw >= 0 and abs(value) < 1e-30:
                    truncated.append(f"slot {slot} {name} holds int {raw} (as float32 bits: {value:g})")
                else:
                    implausible.append(f"slot {slot} {name} = {value:g} is outside {cls.float_ranges[name]}")
            values[name] = value
        else:
            values[name] = raw
    if truncated:
        raise _fail(path, f"{cls.title} header float slots look like truncated integers, not float32 bit patterns "
                          f"({cls.truncation}): " + ", ".join(truncated + implausible), cls.float_fix)
    if implausible:
        flags = "/".join(f"--{name}" for name in cls.float_ranges)
        raise _fail(path, "nonsensical header: " + ", ".join(implausible),
                    f"the header is corrupt; pass the true values with {flags} or re-export the checkpoint")
    header = cls(**values)
    problem = _header_problem(header)
    if problem:
        raise _fail(path, f"nonsensical header: {problem}",
                    f"the header is corrupt or not an llm.c {cls.kind} header; re-export the checkpoint")
    return header


def read_model(path: str | os.PathLike, **overrides: float | None) -> tuple[str, Header, dict[str, np.ndarray], str]:
    """Read an llm.c model checkpoint of any registered family (the magic names it).

    The header and exact file size are validated before any tensor is read. bfloat16
    files (version 5) are widened to float32 exactly. A padded tensor (GPT-2's ``wte``)
    keeps its padded rows.

    Args:
        path: the ``.bin`` checkpoint.
        overrides: values for the header's float slots, None for "as stored" (LLaMA-3's
            ``norm_eps``, ``rope_theta``, ``ffn_dim_multiplier``: llm.c master files store them
            truncated to integers).

    Returns:
        ``(kind, header, tensors, file_dtype)``: the family's name (``"gpt2"``/``"llama3"``),
        its :class:`Header`, ``{name: float32 array}`` in file order, and ``"float32"``/``"bfloat16"``.

    Example:
        >>> kind, header, tensors, file_dtype = read_model("model.bin")  # GPT-2 tiny: L=2, C=32
        >>> kind, file_dtype, tensors["attn.c_attn.w"].shape
        ('gpt2', 'float32', (2, 96, 32))
    """
    path = os.fspath(path)
    f, size, ints = _open_checked(path, "model file")
    with f:
        header = _parse_model_header(path, ints, overrides)
        file_dtype = _VERSIONS[int(ints[1])]
        given = [k for k, v in overrides.items() if v is not None]
        if any(k not in header.float_ranges for k in given):
            owners = [h.title for h in _formats() if all(k in h.float_ranges for k in given)]
            if not owners:
                known = sorted({k for h in _formats() for k in h.float_ranges})
                raise ValueError(f"{path}: no llm.c header has the float field(s) {', '.join(given)}; "
                                 f"overrides name one of {', '.join(known)}")
            raise ValueError(f"{path}: {'/'.join(given)} overrides apply to {' and '.join(owners)} files only")
        itemsize = 4 if file_dtype == "float32" else 2
        n = header.n_params()
        _check_size(path, size, HEADER_BYTES + n * itemsize,
                    f"{HEADER_BYTES}-byte header + {n} {file_dtype} parameters")
        tensors: dict[str, np.ndarray] = {}
        for name, shape in header.tensor_shapes():
            count = math.prod(shape)
            if file_dtype == "float32":
                arr = _read_array(f, path, "<f4", count).astype(np.float32, copy=False)
            else:
                arr = bfloat16_bits_to_float32(_read_array(f, path, "<u2", count))
            tensors[name] = arr.reshape(shape)
    return header.kind, header, tensors, file_dtype


def _prepare_tensors(
    path: str, kind: str, header: Header, tensors: dict[str, np.ndarray], what: str
) -> list[np.ndarray]:
    """Validate and convert ``tensors`` to float32 arrays in file order (a padded tensor padded with zeros)."""
    shapes = header.tensor_shapes()
    expected = {name for name, _ in shapes}
    missing = [name for name, _ in shapes if name not in tensors]
    extra = sorted(set(tensors) - expected)
    if missing or extra:
        raise _fail(path, f"{what} names do not match the {kind} layout (missing {missing}, unexpected {extra})",
                    f"pass exactly: {', '.join(n for n, _ in shapes)}")
    out = []
    for name, shape in shapes:
        arr = np.asarray(tensors[name])
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise _fail(path, f"{what} {name} has dtype {arr.dtype}", "pass real-valued arrays")
        arr = arr.astype(np.float32)
        if header.padded is not None and name == header.padded[0]:
            V, Vp = getattr(header, header.padded[1]), getattr(header, header.padded[2])
            rest = shape[1:]
            if arr.shape not in ((V, *rest), (Vp, *rest)):
                raise _fail(path, f"{what} {name} has shape {arr.shape}, expected {(Vp, *rest)} or {(V, *rest)}",
                            f"pass the (padded) {name}")
            padded = np.zeros((Vp, *rest), dtype=np.float32)
            padded[:V] = arr[:V]  # rows V..Vp-1 are always written as zeros, as llm.c does
            arr = padded
        elif arr.shape != shape:
            raise _fail(path, f"{what} {name} has shape {arr.shape}, expected {shape}",
                        "the arrays do not match the header")
        out.append(arr)
    return out


def write_model(
    path: str | os.PathLike,
    kind: str,
    header: Header,
    tensors: dict[str, np.ndarray],
    dtype: str = "float32",
) -> None:
    """Write an llm.c checkpoint byte-exactly, atomically (temp file + ``os.replace``).

    A padded tensor (GPT-2 ``wte``) may be given as (Vp, C) or (V, C); rows V..Vp-1 are always
    written as zeros, whatever the caller passes there. bfloat16 rounds to nearest-even. Float
    header slots (LLaMA-3's) are written as float32 bit patterns (InfiniTrain's convention).

    Args:
        path: destination file.
        kind: ``"gpt2"`` or ``"llama3"`` (must match the header type).
        header: the family's :class:`Header` (``GPT2Header``, ``Llama3Header``).
        tensors: ``{name: array}`` with exactly the names of ``header.tensor_shapes()``.
        dtype: ``"float32"`` (version 3) or ``"bfloat16"`` (version 5).

    Example:
        >>> kind, header, tensors, _ = read_model("model.bin")
        >>> write_model("out.bin", "gpt2", header, tensors, dtype="bfloat16")
    """
    path = os.fspath(path)
    _check_kind(kind, header)
    if dtype not in _DTYPE_VERSIONS:
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    problem = _header_problem(header)
    if problem:
        raise _fail(path, f"refusing to write a nonsensical header: {problem}", "fix the header values")
    arrays = _prepare_tensors(path, kind, header, tensors, "tensor")
    ints = _header_ints(header, _DTYPE_VERSIONS[dtype])
    with _atomic_writer(path) as f:
        _write_array(f, ints)
        for arr in arrays:
            _write_array(f, arr.astype("<f4") if dtype == "float32" else float32_to_bfloat16_bits(arr).astype("<u2"))


# ---------------------------------------------------------------------------
# debug-state files


def read_state(path: str | os.PathLike, kind: str, header: Header) -> dict:
    """Read an llm.c debug state file (inputs, logits, loss and float32 gradients).

    The logits width is taken from the file size, among ``header.logit_widths()`` (V; for GPT-2 also Vp).

    Args:
        path: the state file (``gpt2_124M_debug_state.bin`` style).
        kind: ``"gpt2"`` or ``"llama3"``.
        header: the model header the state belongs to.

    Returns:
        ``dict(x=(B,T) int32, y=(B,T) int32, logits=(B,T,V or Vp) float32, loss=float,
        grads={name: float32 array in model file order})``.

    Example:
        >>> header = read_model("model.bin")[1]
        >>> state = read_state("state.bin", "gpt2", header)   # e.g. gpt2_124M_debug_state.bin
        >>> state["x"].shape, state["grads"]["wte"].shape
        ((2, 8), (256, 32))
    """
    path = os.fspath(path)
    _check_kind(kind, header)
    f, size, ints = _open_checked(path, "debug state file")
    with f:
        magic = int(ints[0])
        want = header.state_magic
        if magic != want:
            what = _magic_words(magic)
            problem = f"magic {magic} ({what or 'unknown'}) is not a {kind} debug state file (magic {want})"
            raise _fail(path, problem, "pass the debug state file written by the matching train script "
                                       "(read_model / read_tokens read the other kinds)")
        if header.state_version is not None:
            if int(ints[1]) != header.state_version:
                raise _fail(path, f"{header.title} debug state version {int(ints[1])} is not supported "
                                  f"(expected {header.state_version})", f"regenerate it with a current {header.exporter}")
            B, T = int(ints[2]), int(ints[3])
        else:
            B, T = int(ints[1]), int(ints[2])
        if B <= 0 or T <= 0:
            raise _fail(path, f"nonsensical state header: B={B}, T={T}",
                        "the file is corrupt or a model file (use read_model)")
        if T > header.block_size:
            raise _fail(path, f"sequence length T={T} exceeds the model's block_size {header.block_size}",
                        "pass the header of the model this state was made for")
        n = header.n_params()
        fixed = HEADER_BYTES + 2 * 4 * B * T + 4 + 4 * n
        widths = header.logit_widths()
        W = next((w for w in widths if fixed + 4 * B * T * w == size), None)
        if W is None:
            options = " or ".join(f"{fixed + 4 * B * T * w} (logits over {w})" for w in widths)
            raise _fail(path, f"file is {size} bytes but B={B}, T={T} and the model imply {options}",
                        "the file is truncated or belongs to a different model (logits' vocab does not fit)")
        x = _read_array(f, path, "<i4", B * T).astype(np.int32).reshape(B, T)
        y = _read_array(f, path, "<i4", B * T).astype(np.int32).reshape(B, T)
        for label, tok in (("x", x), ("y", y)):
            if tok.min() < 0 or tok.max() >= header.vocab_size:
                raise _fail(path, f"{label} holds token ids in [{tok.min()}, {tok.max()}], outside the vocab "
                                  f"[0, {header.vocab_size})", "pass the header of the model this state was made for")
        logits = _read_array(f, path, "<f4", B * T * W).astype(np.float32).reshape(B, T, W)
        loss = float(_read_array(f, path, "<f4", 1)[0])
        grads = {}
        for name, shape in header.tensor_shapes():
            grads[name] = _read_array(f, path, "<f4", math.prod(shape)).astype(np.float32).reshape(shape)
    return dict(x=x, y=y, logits=logits, loss=loss, grads=grads)


def write_state(
    path: str | os.PathLike,
    kind: str,
    header: Header,
    x: np.ndarray,
    y: np.ndarray,
    logits: np.ndarray,
    loss: float,
    grads: dict[str, np.ndarray],
) -> None:
    """Write an llm.c debug state file atomically; everything is stored as float32/int32.

    Args:
        path: destination file.
        kind, header: the model the state belongs to.
        x, y: (B, T) integer token ids in [0, V).
        logits: (B, T, W) with W = V (llm.c's own files) or, for GPT-2, Vp.
        loss: the mean cross-entropy.
        grads: ``{name: array}`` like a model's tensors (GPT-2 wte grad (V,C) or (Vp,C),
            padded rows written as zeros).

    Example:
        >>> header = read_model("model.bin")[1]
        >>> s = read_state("state.bin", "gpt2", header)
        >>> write_state("state_copy.bin", "gpt2", header, s["x"], s["y"], s["logits"], s["loss"], s["grads"])
    """
    path = os.fspath(path)
    _check_kind(kind, header)
    x, y, logits = np.asarray(x), np.asarray(y), np.asarray(logits)
    if x.ndim != 2 or x.shape != y.shape or x.size == 0:
        raise _fail(path, f"x {x.shape} and y {y.shape} must be equal non-empty (B, T) arrays", "fix the inputs")
    B, T = x.shape
    for label, tok in (("x", x), ("y", y)):
        if not np.issubdtype(tok.dtype, np.integer) or tok.min() < 0 or tok.max() >= header.vocab_size:
            raise _fail(path, f"{label} must hold integer token ids in [0, {header.vocab_size})", "fix the inputs")
    if T > header.block_size:
        raise _fail(path, f"T={T} exceeds block_size {header.block_size}", "fix the inputs")
    widths = header.logit_widths()
    if logits.shape[:2] != (B, T) or logits.ndim != 3 or logits.shape[2] not in widths:
        raise _fail(path, f"logits have shape {logits.shape}, expected ({B}, {T}, one of {widths})", "fix the inputs")
    grad_arrays = _prepare_tensors(path, kind, header, grads, "gradient")
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    slots = [header.state_magic, *([] if header.state_version is None else [header.state_version]), B, T]
    ints[:len(slots)] = slots
    with _atomic_writer(path) as f:
        _write_array(f, ints)
        _write_array(f, x.astype("<i4"))
        _write_array(f, y.astype("<i4"))
        _write_array(f, logits.astype("<f4"))
        _write_array(f, np.array([loss], dtype="<f4"))
        for arr in grad_arrays:
            _write_array(f, arr.astype("<f4"))


# ---------------------------------------------------------------------------
# token shards


@dataclasses.dataclass(frozen=True)
class TokenFormat:
    """One llm.c token shard format (``dev/data/data_common.py``'s ``HEADERS_INFO``).

    Example:
        >>> TOKEN_FORMATS["llama3"].words()
        'llm.c LLaMA-3 shard (uint32, magic 20240801)'
    """

    kind: str     # "gpt2" / "llama3": llm.c's model_desc "gpt-2" / "llama-3"
    title: str    # for messages
    magic: int
    version: int
    dtype: str    # little-endian NumPy dtype of one token

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    def words(self) -> str:
        """``llm.c GPT-2 shard (uint16, magic 20240520)``: the words messages use."""
        return f"llm.c {self.title} shard ({np.dtype(self.dtype).name}, magic {self.magic})"


TOKEN_FORMATS = {f.kind: f for f in (
    TokenFormat("gpt2", "GPT-2", TOKENS_MAGIC, TOKENS_VERSION, "<u2"),
    TokenFormat("llama3", "LLaMA-3", LLAMA3_TOKENS_MAGIC, LLAMA3_TOKENS_VERSION, "<u4"),
)}
_TOKEN_MAGICS = {f.magic: f for f in TOKEN_FORMATS.values()}


def token_format(path: str | os.PathLike) -> tuple[TokenFormat, int]:
    """Check a token shard's header and size without reading its tokens: ``(format, token count)``.

    Example:
        >>> fmt, n = token_format("tokens.bin")
        >>> fmt.kind, n
        ('gpt2', 8)
    """
    path = os.fspath(path)
    f, size, ints = _open_checked(path, "token shard")
    with f:
        return _token_header(path, size, ints)


def _token_header(path: str, size: int, ints: np.ndarray) -> tuple[TokenFormat, int]:
    magic, version, n = int(ints[0]), int(ints[1]), int(ints[2])
    fmt = _TOKEN_MAGICS.get(magic)
    if fmt is None:
        what = _magic_words(magic)
        problem = f"magic {magic} is {what}, not a token shard" if what else f"unknown magic {magic}"
        known = ", ".join(f"{f.magic} ({f.title}, {np.dtype(f.dtype).name})" for f in TOKEN_FORMATS.values())
        raise _fail(path, problem, f"known token shard magics: {known}; pass a shard written by llm.c's "
                                   "dev/data scripts")
    if version != fmt.version:
        raise _fail(path, f"unsupported {fmt.title} token shard version {version} (expected {fmt.version} "
                          f"with magic {magic})", "re-tokenize with llm.c's dev/data scripts")
    if n <= 0:
        raise _fail(path, f"token shard header says it holds {n} tokens (empty shard)",
                    "re-create the shard or drop it from the dataset")
    _check_size(path, size, HEADER_BYTES + fmt.itemsize * n,
                f"{HEADER_BYTES}-byte header + {n} {np.dtype(fmt.dtype).name} tokens of an {fmt.words()}")
    return fmt, n


def read_tokens(path: str | os.PathLike, *, mmap: bool = False) -> np.ndarray:
    """Read an llm.c token shard as a 1-D array: GPT-2 (magic 20240520) uint16, LLaMA-3 (20240801) uint32.

    The header (magic, version, token count) and the exact file size are checked first.

    Args:
        path: the shard.
        mmap: return a read-only ``np.memmap`` of the tokens instead of reading them into memory.

    Example:
        >>> read_tokens("tokens.bin")[:4]   # e.g. fineweb_train_000001.bin
        array([50256,   464,  3290,   287], dtype=uint16)
    """
    path = os.fspath(path)
    f, size, ints = _open_checked(path, "token shard")
    with f:
        fmt, n = _token_header(path, size, ints)
        if mmap:
            return np.memmap(path, dtype=fmt.dtype, mode="r", offset=HEADER_BYTES, shape=(n,))
        return _read_array(f, path, fmt.dtype, n).astype(np.dtype(fmt.dtype).newbyteorder("="))


def write_tokens(path: str | os.PathLike, tokens: np.ndarray, kind: str = "gpt2") -> None:
    """Write an llm.c token shard atomically, as llm.c's ``write_datafile`` does.

    Args:
        path: destination file.
        tokens: non-empty 1-D integer token ids.
        kind: ``"gpt2"`` (magic 20240520, version 1, uint16 tokens) or ``"llama3"``
            (magic 20240801, version 7, uint32 tokens): llm.c's ``model_desc`` "gpt-2" / "llama-3".

    Example:
        >>> write_tokens("shard.bin", np.array([50256, 464], np.uint16))
        >>> read_tokens("shard.bin")
        array([50256,   464], dtype=uint16)
        >>> write_tokens("shard3.bin", np.array([128000, 9906]), kind="llama3")
        >>> read_tokens("shard3.bin")
        array([128000,   9906], dtype=uint32)
    """
    path = os.fspath(path)
    if kind not in TOKEN_FORMATS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, TOKEN_FORMATS))}, got {kind!r}")
    fmt = TOKEN_FORMATS[kind]
    tok = np.asarray(tokens)
    if tok.ndim != 1 or tok.size == 0:
        raise _fail(path, f"tokens must be a non-empty 1-D array, got shape {tok.shape}", "pass a flat token list")
    if not np.issubdtype(tok.dtype, np.integer):
        raise _fail(path, f"tokens have dtype {tok.dtype}", "pass integer token ids")
    top = int(np.iinfo(np.dtype(fmt.dtype)).max)
    if tok.min() < 0 or tok.max() > top:
        name = np.dtype(fmt.dtype).name
        wider = [w for w in TOKEN_FORMATS.values() if np.iinfo(np.dtype(w.dtype)).max > top]
        fix = (f"write kind={wider[0].kind!r} ({np.dtype(wider[0].dtype).name} tokens)" if wider
               else "check the token ids")
        raise _fail(path, f"token ids span [{tok.min()}, {tok.max()}], outside {name} ({fmt.words()})", fix)
    if tok.size >= 2**31:
        raise _fail(path, f"{tok.size} tokens do not fit the int32 count", "split the shard")
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    ints[:3] = [fmt.magic, fmt.version, tok.size]
    with _atomic_writer(path) as f:
        _write_array(f, ints)
        _write_array(f, tok.astype(fmt.dtype))


# ------------------------------------------------------------------------------------------------
# The tensor layout of the model files' `to_llmc` / `from_llmc`, the one mapping between llm.c's
# tensor names and the models' Flax parameters: llm.c stacks each per-layer parameter on a leading
# L axis (the layers' own layout is `remat.linen.LayerStack`'s, `stack_layers` / `unstack_layers`)
# and stores linear weights (out, in) as PyTorch does, where `nn.Dense` keeps its kernel (in, out).

BLOCK_MODULES = ("ln_1", "attn", "ln_2", "mlp")  # an llm.c name starting with one is per layer


def param_path(name: str) -> tuple[str, ...]:
    """The Flax parameter path of an llm.c tensor: `w` of a norm (`ln_*`) is its `scale`, of a
    linear layer its `kernel`, `b` is `bias`; per-layer tensors are inside `blocks`; `wte`, `wpe`
    are parameters of the model itself.

    Example:
      >>> param_path("attn.c_attn.w"), param_path("ln_f.b"), param_path("wte")
      (('blocks', 'attn', 'c_attn', 'kernel'), ('ln_f', 'bias'), ('wte',))
    """
    *mods, leaf = name.split(".")
    if not mods:
        return (leaf,)
    leaf = "bias" if leaf == "b" else "scale" if mods[-1].startswith("ln") else "kernel"
    return (("blocks",) if mods[0] in BLOCK_MODULES else ()) + tuple(mods) + (leaf,)


def _flax_layout(path, a):
    """llm.c's (..., out, in) ↔ a kernel's (..., in, out); everything else as it is (its own inverse)."""
    return np.swapaxes(a, -1, -2) if path[-1] == "kernel" else a


def to_llmc(params, shapes: dict) -> dict:
    """Parameters → {llm.c name: float32 np.ndarray} for every name of `shapes` (a family's
    `llmc_shapes`), in its order; per-layer tensors stacked on a leading layer axis.

    Example:
      >>> blocks = {"h_0": {"ln_1": {"scale": np.ones(4)}}, "h_1": {"ln_1": {"scale": np.zeros(4)}}}
      >>> to_llmc({"blocks": blocks}, {"ln_1.w": (2, 4)})["ln_1.w"].shape
      (2, 4)
    """
    from remat.linen import unstack_layers

    def get(tree, path):
        for k in path:
            tree = tree[k]
        return _flax_layout(path, np.asarray(tree, np.float32))
    layers = unstack_layers(params["blocks"])
    out = {}
    for name in shapes:
        path = param_path(name)
        out[name] = (np.stack([get(layer, path[1:]) for layer in layers]) if path[0] == "blocks"
                     else get(params, path))
    return out


def from_llmc(title: str, shapes: dict, tensors: dict, scan: bool) -> dict:
    """The inverse of `to_llmc`: {llm.c name: array} → parameters (float32 JAX arrays), the blocks in
    the loop or scan layout (`remat.linen.stack_layers`); ValueError naming the tensor unless the
    names and shapes are exactly `shapes` (`check_llmc_tensors`).

    Example:
      >>> params = from_llmc("GPT-2", {"ln_1.w": (2, 4)}, {"ln_1.w": np.ones((2, 4))}, scan=False)
      >>> sorted(params["blocks"]), params["blocks"]["h_1"]["ln_1"]["scale"].shape
      (['h_0', 'h_1'], (4,))
    """
    import jax.numpy as jnp
    from remat.linen import stack_layers

    check_llmc_tensors(title, shapes, tensors)

    def put(tree, path, a):
        for k in path[:-1]:
            tree = tree.setdefault(k, {})
        tree[path[-1]] = jnp.asarray(_flax_layout(path, np.asarray(a, np.float32)))
    out: dict = {}
    per_layer = [(param_path(n)[1:], np.asarray(tensors[n])) for n in shapes if param_path(n)[0] == "blocks"]
    for name in shapes:
        if param_path(name)[0] != "blocks":
            put(out, param_path(name), tensors[name])
    layers = [{} for _ in range(len(per_layer[0][1]))] if per_layer else []
    for path, stacked in per_layer:
        for i, layer in enumerate(layers):
            put(layer, path, stacked[i])
    return {**out, "blocks": stack_layers(layers, scan=scan)}


def check_llmc_tensors(model: str, shapes: dict, tensors) -> None:
    """Raise ValueError unless `tensors` has exactly the names and shapes of `shapes`.

    Example:
      >>> check_llmc_tensors("GPT-2", {"wte": (4, 2)}, {"wte": np.zeros((4, 3))})
      Traceback (most recent call last):
      ValueError: GPT-2 llm.c tensor 'wte' has shape (4, 3) but the config needs (4, 2); check the config against the file's header
    """
    missing = [k for k in shapes if k not in tensors]
    extra = [k for k in tensors if k not in shapes]
    if missing or extra:
        raise ValueError(f"{model} llm.c tensors: missing {missing}, unexpected {extra}; "
                         f"expected exactly {list(shapes)}")
    for k, s in shapes.items():
        if tuple(np.shape(tensors[k])) != s:
            raise ValueError(f"{model} llm.c tensor {k!r} has shape {tuple(np.shape(tensors[k]))} but the "
                             f"config needs {s}; check the config against the file's header")
