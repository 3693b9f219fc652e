"""Value types for the command lines (train.py, `python -m models.*`, `python -m bench.*`).

One place for how a number on a command line is read: ASCII digits only, checked bounds, and an
error that argparse prefixes with the flag (`argument --steps: expected an integer >= 1, got '0'`).
`Parser` is argparse with that error on one line (`prog: error: ...`, exit 2, no usage block).

# NOTE: why not `type=int`. Python's int() and float() accept every Unicode decimal digit
# (int('٣') == 3) and str.isdigit() is true for superscripts that int() then rejects ('²'), so a
# flag parsed with int() took some non-ASCII numbers and failed on others with a message naming no
# flag. Here a number is `[+-]?[0-9]+` (or a decimal/exponent form for reals), nothing else.

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
from typing import Callable

_INT = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr, `prog: error: message`, exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


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


def usage_error(prog: str, message: str) -> int:
    """Print `prog: error: message` as one line on stderr; return 2 (the usage-error status)."""
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    return 2
