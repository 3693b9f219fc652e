"""The error of a bad recompute setting, naming the field at fault, and the integer check.

Example:
    >>> import remat
    >>> try:
    ...     remat.every(0)
    ... except RecomputeConfigError as e:
    ...     (str(e), e.field, e.value)
    ('every: must be an integer >= 1 (got 0): every k-th layer is a region', 'every', 0)
"""
from __future__ import annotations

__all__ = ["RecomputeConfigError", "is_int", "show"]


def is_int(v) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def show(value) -> str:
    """A setting's value as a message shows it: (start, stop) pairs as `0-3,3-5`, a policy callable
    (also inside a tuple) as the JAX expression that builds it (`remat.policies.describe`), anything
    else as repr.

    Example:
      >>> show(((0, 3), (3, 5))), show("mlp")
      ('0-3,3-5', "'mlp'")
    """
    if isinstance(value, tuple) and value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return ",".join(f"{a}-{b}" for a, b in value)
    if isinstance(value, tuple):
        return "(" + ", ".join(map(show, value)) + ("," if len(value) == 1 else "") + ")"
    if callable(value):
        from remat import policies  # imported here: policies is heavier than this module
        return policies.describe(value)
    return repr(value)


class RecomputeConfigError(ValueError):
    """A bad recompute setting; `str(e)` is `"field: message"`.

    Args:
      field: the setting at fault: a `RecomputeConfig` field, or the value of a region spec
        (`every`, `segments`, `regions`, `num_layers`, `layer_policies`).
      message: what is wrong and the fix, in the library's words.
      value: the value given.
      also: the other settings it conflicts with (dropping one of them fixes it), the granularity
        aside (the message names it).
    Attributes:
      field, value, message; `fields`: `field` then `also`.
    Example:
      >>> e = RecomputeConfigError("num_layers", "must be >= 1 (got 0)", 0)
      >>> str(e), e.fields
      ('num_layers: must be >= 1 (got 0)', ('num_layers',))
    """

    def __init__(self, field: str, message: str, value=None, also: tuple = ()):
        super().__init__(f"{field}: {message}")
        self.field, self.message, self.value = field, message, value
        self.fields = (field, *also)
