"""The command-line kit of every program (train.py, `python -m remat_lm.sample`, `python -m
remat_lm.llmc verify`, `python -m remat_lm.bench.*`): one parser class, one usage-error convention,
one label for a recompute setting, and the value types.

- Usage errors are one line on stderr, `prog: error: message`, exit status 2, no traceback and no
  usage block: `Parser` (argparse's own errors), `usage_error` / `usage_exit` (bad input found
  after parsing) and `run` (a `main()` whose `SystemExit("message")` is such an error).
- `config_label(rc)`: a short name of a RecomputeConfig (`full/uniform/2`, `selective
  core_attn`), for memory-report columns, run summaries and benchmark rows.
- Numbers: ASCII digits only (`int()` also reads '٣'), checked bounds, and an error that argparse
  prefixes with the flag (`argument --steps: expected an integer >= 1, got '0'`).

Example:
    >>> p = Parser(prog="python -m remat_lm.bench.x")
    >>> _ = p.add_argument("--steps", type=integer(1), default=3)
    >>> _ = p.add_argument("--fractions", type=real_list(0, 1), default="0.5,1")
    >>> p.parse_args(["--steps", "5"])
    Namespace(steps=5, fractions=(0.5, 1.0))
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from typing import Callable, NoReturn

__all__ = ["Parser", "UsageError", "ascii_digits", "config_label", "foreign_digit", "int_list", "integer", "parse_int",
           "parse_size", "real", "real_list", "run", "usage_error", "usage_exit"]

_INT = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, `prog: error: message (see --help)`, exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see --help)\n")


def _one_line(message) -> str:
    return " ".join(str(message).split())


class UsageError(ValueError):
    """Bad input a program reports as a usage error: its one-line message, exit 2 (train.py raises it
    for a bad flag value or input file, found while parsing or preparing)."""


def usage_error(prog: str, message) -> int:
    """Print `prog: error: message` as one line on stderr; return 2 (the usage-error status).

    Example:
      >>> import contextlib, io
      >>> err = io.StringIO()
      >>> with contextlib.redirect_stderr(err):
      ...     status = usage_error("python -m remat_lm.llmc verify", "model.bin: not an llm.c model file")
      >>> status, err.getvalue().strip()
      (2, 'python -m remat_lm.llmc verify: error: model.bin: not an llm.c model file')
    """
    print(f"{prog}: error: {_one_line(message)}", file=sys.stderr)
    return 2


def usage_exit(prog: str, message) -> NoReturn:
    """`usage_error`, then exit with its status 2."""
    raise SystemExit(usage_error(prog, message))


def run(main: Callable[[], int], prog: str) -> int:
    """Run a program's `main()`: a `UsageError`, or a `SystemExit` carrying a message (bad input
    found after argument parsing), becomes a usage error, `prog: error: message` and status 2, like
    argparse's own.

    Example:
      >>> if __name__ == "__main__":
      ...     sys.exit(run(main, "python -m remat_lm.bench.policies"))
    """
    try:
        return main()
    except UsageError as e:  # bad input a check found after parsing (a target, a mesh, a plan)
        return usage_error(prog, str(e))
    except SystemExit as e:
        if isinstance(e.code, str):
            return usage_error(prog, e.code)
        raise


def config_label(rc) -> str:
    """The short name of a `remat.RecomputeConfig`: granularity, then what picks the regions, then
    the policy and where region inputs are kept.

    Examples: `none`; `selective core_attn+mlp`; `full/none` (every layer a region);
    `full/uniform/2`; `full/segments/0-3,3-5`; `full/every/2`; `full/regions/4`; `full/per-layer`
    (`per_layer`), read from `rc.layers`; then `+offload_inputs` (offload_inputs), `+shard_inputs` (shard_inputs) and
    ` policy=dots`.

    Example:
      >>> from remat import RecomputeConfig
      >>> config_label(RecomputeConfig(granularity="full", method="uniform", num_layers=2, policy="dots"))
      'full/uniform/2 policy=dots'
      >>> config_label(RecomputeConfig(granularity="selective")), config_label(RecomputeConfig())
      ('selective core_attn', 'none')
    """
    if rc.granularity == "none":
        return "none"
    if rc.granularity == "selective":  # a policy replaces the modules' preset
        label = "selective" + ("" if rc.policy else " " + "+".join(rc.modules))
    else:
        label = "full/" + _layers_label(rc.layers)
    label += "+offload_inputs" if rc.offload_inputs else ""
    label += "+shard_inputs" if rc.shard_inputs is not None else ""
    return label + (f" policy={rc.policy}" if rc.policy else "")


def _layers_label(layers) -> str:
    """`none` (each layer a region), `uniform/2`, `segments/0-3,3-5`, `every/2`, `regions/4`,
    `per-layer`, from the `remat.regions` spec's field and value (the kit imports no project code)."""
    if layers is None:
        return "none"
    kind, value = type(layers).__name__.lower(), layers.value()
    if layers.field == "layer_policies":
        return "per-layer"
    if layers.field == "segments":
        return "segments/" + ",".join(f"{a}-{b}" for a, b in value)
    return f"{ {'count': 'regions'}.get(kind, kind)}/{value}"


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """A memory size (`--memory_budget`): '12GiB' / '512MiB' / '1.5GB' / '1000000' → bytes (KiB/MiB/GiB binary, KB/MB/GB decimal).

    Example:
      >>> parse_size("512MiB")
      536870912
    """
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"memory size {text!r} is not valid; write a number of bytes or a number with a unit, "
                         f"e.g. 12GiB, 512MiB, 1.5GB (KiB/MiB/GiB are powers of 2, KB/MB/GB of 10)")
    n = float(m.group(1)) * _UNITS[unit]
    if not math.isfinite(n) or n <= 0:
        raise ValueError(f"memory size {text!r} must be positive")
    return int(n)


def foreign_digit(text: str) -> str | None:
    """The first non-ASCII digit-like character of `text` ('²', '٣', '½'), or None."""
    return next((c for c in str(text) if c.isnumeric() and not c.isascii()), None)


def _digits_hint(text: str) -> str:
    c = foreign_digit(text)
    return "" if c is None else f" (write numbers with the digits 0-9, not {c!r})"


def parse_int(text: str) -> int:
    """`[+-]?[0-9]+` → int; ValueError otherwise (no Unicode digits, underscores or spaces)."""
    if not _INT.fullmatch(str(text)):
        raise ValueError(f"{str(text)!r} is not an integer written with the digits 0-9")
    return int(text)


def _bounds(lo, hi, above=None) -> str:
    if above is not None:
        return f"> {above:g}" + (f" and <= {hi:g}" if hi is not None else "")
    if lo is not None and hi is not None:
        return f"in {lo}..{hi}"
    return f">= {lo}" if lo is not None else (f"<= {hi}" if hi is not None else "")


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an ASCII integer in [lo, hi] (either bound may be None).

    Example:
      >>> integer(1)("3")
      3
    """
    want = " ".join(["an integer", _bounds(lo, hi)]).strip()

    def parse(text: str) -> int:
        try:
            v = parse_int(text)
        except ValueError:
            v = None
        if v is None or (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}{_digits_hint(text)}")
        return v

    parse.__name__ = "integer"
    return parse


def real(lo: float | None = None, hi: float | None = None, *, above: float | None = None) -> Callable[[str], float]:
    """An argparse type: a finite ASCII decimal number >= lo (or > above) and <= hi.

    Example:
      >>> real(above=0)("1e-5")
      1e-05
    """
    want = " ".join(["a finite number", _bounds(lo, hi, above)]).strip()

    def parse(text: str) -> float:
        v = float(text) if _REAL.fullmatch(str(text)) else math.nan
        if (not math.isfinite(v) or (lo is not None and v < lo) or (above is not None and v <= above)
                or (hi is not None and v > hi)):
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}{_digits_hint(text)}")
        return v

    parse.__name__ = "real"
    return parse


def _listed(item: Callable[[str], object], what: str, sep: str, example: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(item(p.strip()) for p in str(text).split(sep))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"expected {what} separated by {sep!r}, e.g. {example}; "
                                             f"got {text!r}") from None

    parse.__name__ = "list"
    return parse


def int_list(lo: int | None = 1, hi: int | None = None, *, sep: str = ",", example: str = "128,256"):
    """An argparse type: '128,256' → (128, 256), each an ASCII integer in [lo, hi].

    Example:
      >>> int_list(1)("128,256")
      (128, 256)
    """
    return _listed(integer(lo, hi), " ".join(["integers", _bounds(lo, hi)]).strip(), sep, example)


def real_list(lo: float | None = None, hi: float | None = None, *, above: float | None = None, sep: str = ",",
              example: str = "0.25,0.5"):
    """An argparse type: '0.25,0.5' → (0.25, 0.5), each a finite ASCII number in range.

    Example:
      >>> real_list(above=0, hi=1)("0.25,0.5")
      (0.25, 0.5)
    """
    return _listed(real(lo, hi, above=above), " ".join(["numbers", _bounds(lo, hi, above)]).strip(), sep, example)


def ascii_digits(example: str) -> Callable[[str], str]:
    """An argparse type for a text flag holding numbers (layer ranges, 'A:B'): the text unchanged,
    unless it has a non-ASCII digit ('²-3'), which later int() parsing would misread or reject.

    Example:
      >>> ascii_digits("0-3,3-5")("0-3")
      '0-3'
    """
    def parse(text: str) -> str:
        c = foreign_digit(text)
        if c is not None:
            raise argparse.ArgumentTypeError(f"{text!r} has the non-ASCII digit {c!r}; write numbers with the "
                                             f"digits 0-9, e.g. {example}")
        return text

    parse.__name__ = "text"
    return parse
