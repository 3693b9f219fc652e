"""RecomputeConfigError: a bad recompute setting, with what is wrong in structured fields."""
from __future__ import annotations

import ast
import string
from typing import Callable

# NOTE: one message, two vocabularies. The library words a setting as `every=0`; a command line as
# `--recompute_every 0`. So an error keeps its message as a template whose settings are
# placeholders, and each front end renders it with its own words (`render`), reading the fields
# instead of rewriting the text. Placeholders:
#   {every}             the setting with its value as given (`settings["every"]`)
#   {granularity=full}  the setting with the value written after `=` (a suggestion)
#   {policy!n}          the setting's name alone ("drop policy")
# A field name may start with "recompute " or "recompute_": library wording only, which a front
# end leaves out ("recompute every=0" reads "--recompute_every 0" on a command line).
_LIBRARY_PREFIXES = ("recompute ", "recompute_")


def is_int(v) -> bool:
    """An int that is not a bool (the one integer check of remat/ and remat_lm/)."""
    return isinstance(v, int) and not isinstance(v, bool)


def lit(text) -> str:
    """`text` as literal template text (braces escaped)."""
    return str(text).replace("{", "{{").replace("}", "}}")


def show(value) -> str:
    """A setting's value in library words: (start, stop) pairs as `0-3,3-5`, a policy callable as the
    JAX expression that builds it (`remat.policies.describe`), anything else as repr."""
    if isinstance(value, tuple) and value and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        return ",".join(f"{a}-{b}" for a, b in value)
    return show_policy(value)


def show_policy(value) -> str:
    """repr(value), with policy callables (also inside a tuple) as the JAX expression that builds them."""
    if isinstance(value, tuple):
        return "(" + ", ".join(map(show_policy, value)) + ("," if len(value) == 1 else "") + ")"
    if callable(value):
        from remat import policies  # policies imports nothing of errors; imported here to keep errors light
        return policies.describe(value)
    return repr(value)


def library_word(name: str, value, with_value: bool) -> str:
    """How the library names a setting: `name=value` (or the name alone)."""
    return f"{name}={show(value)}" if with_value else name


class RecomputeConfigError(ValueError):
    """A bad recompute setting. Its fields say what is wrong, so a front end (train.py's flags) can
    word the message in its own vocabulary (`render`) without validating again or parsing the text.

    Args:
      fields: the RecomputeConfig field(s) at fault, the main one first.
      message: the message (library words).
      settings: {field: value given} of the settings the message names (default: `fields`, no value).
      valid: what would be valid: a tuple of choices or a short phrase (None: see the message).
      template: the message with its settings as placeholders (see `refuse`); None: plain text.
    Attributes:
      field, value: the setting at fault and its value; `fields`, `settings`, `valid`, `template`.
    """

    def __init__(self, fields, message: str, *, settings: dict | None = None, valid=None,
                 template: str | None = None):
        super().__init__(message)
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)
        self.settings = dict(settings) if settings is not None else {f: None for f in self.fields}
        self.field = self.fields[0]
        self.value = self.settings.get(self.field)
        self.valid = valid
        self.template = template

    def render(self, word: Callable[[str, object, bool], str]) -> str:
        """The message with every setting worded by `word(name, value, with_value)`; a plain
        message (no template) comes back unchanged.

        Example:
          >>> e = refuse("{recompute every} must be an integer >= 1", every=0, valid="an integer >= 1")
          >>> str(e), e.field, e.value, e.valid
          ('recompute every=0 must be an integer >= 1', 'every', 0, 'an integer >= 1')
          >>> e.render(lambda name, value, with_value: f"--{name}" + (f" {value}" if with_value else ""))
          '--every 0 must be an integer >= 1'
        """
        if self.template is None:
            return str(self)
        return render(self.template, self.settings, word, library=False)


def render(template: str, settings: dict, word: Callable, *, library: bool = True) -> str:
    """Fill `template`'s placeholders (see the NOTE above) with `word`; `library`: keep the
    library-only prefixes ("recompute ")."""
    out = []
    for text, name, _spec, conversion in string.Formatter().parse(template):
        out.append(text)
        if name is None:
            continue
        prefix = next((p for p in _LIBRARY_PREFIXES if name.startswith(p)), "")
        name, eq, given = name[len(prefix):].partition("=")
        value = _literal(given) if eq else settings.get(name)
        out.append((prefix if library else "") + word(name, value, conversion != "n"))
    return "".join(out)


def refuse(template: str, *, valid=None, **settings) -> RecomputeConfigError:
    """A RecomputeConfigError from a template and the settings it names (the one at fault first).

    Example:
      >>> str(refuse("{recompute granularity} is not valid; use {granularity=full}", granularity="most"))
      "recompute granularity='most' is not valid; use granularity='full'"
    """
    message = render(template, settings, library_word)
    return RecomputeConfigError(tuple(settings), message, settings=settings, valid=valid, template=template)


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
