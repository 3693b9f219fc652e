"""Every figure the README and docs/*.md show inside a checked block is what its command prints today.

A checked block is the doc's way of saying "this is output":

    <!-- checked -->
    ```
    $ python -m remat_lm.bench.selective --target h200 --rows 'none;full'
    ```
    | row | temp MiB | ... |
    <!-- /checked -->

Its command is the `$ ` line of its first fenced block (lines ending in `\\` continue it); every other
line of the block, a table row or a line of a fenced block, must be a line the command prints, in
any order (a block may show a subset). Figures a rerun cannot reproduce are masked on both sides
before comparing: table columns measured in time (a header with `ms`, `s)`, `compile`, `time`, `step` or `load`,
a column of durations, and a ratio column right after one) and, in text lines, durations, dates and
load averages.
Prose is not allowed inside a block: a figure in prose would not be checked.

The fast tests parse every block (the commands are this project's, found by tests/test_docs.py's
`--help` check as any documented command); running each command is a slow case, one per block.
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_BLOCK = re.compile(r"^<!-- checked -->\n(.*?)^<!-- /checked -->", re.S | re.M)
_TIME_HEADER = re.compile(r"\bms\b|\bs\)|\bs$|compile|time|step|load", re.I)
_VOLATILE = [(re.compile(p), r) for p, r in (
    (r"\d{4}-\d\d-\d\d([ T]\d\d:\d\d(:\d\d)?( UTC)?)?", "<date>"),
    (r"\b\d+(\.\d+)?\s?(ms|s|min|minutes?|seconds?)\b", "<time>"),
    (r"load( average)? [\d.?]+", "load <n>"),
)]


def blocks() -> list[tuple[str, str, list[str]]]:
    """(doc, command, expected lines) for every checked block of the docs, in order."""
    out = []
    for path in DOCS:
        for m in _BLOCK.finditer(path.read_text()):
            out.append((path.relative_to(ROOT).as_posix(), *_parse(m.group(1))))
    return out


def _parse(body: str) -> tuple[str, list[str]]:
    command, expected, fenced = None, [], False
    lines = body.replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line.startswith("$ ") and command is None:
            command = line[2:].strip()
        elif fenced or line.startswith("|"):
            if line.strip():
                expected.append(line.rstrip())
        elif line.strip():
            raise ValueError(f"prose inside a checked block (its figures would not be checked): {line!r}")
    if command is None:
        raise ValueError(f"a checked block without a `$ command` line: {body[:200]!r}")
    return command, expected


def _mask_text(line: str) -> str:
    for pattern, repl in _VOLATILE:
        line = pattern.sub(repl, line)
    return line


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


_DURATION = re.compile(r"[\d,.]+\s?(ms|s|min)")
_RULE = re.compile(r"\s*\|[-:| ]+\|\s*")


def _masked_columns(table: list[list[str]]) -> set[int]:
    """The columns of a table (header first) that a rerun cannot reproduce: a header naming a time,
    a column of durations, and a ratio column (`× ...`, `a / b`) right after one of those."""
    header, body = table[0], table[1:]
    out = set()
    for j, name in enumerate(header):
        cells = [r[j] for r in body if j < len(r)]
        if _TIME_HEADER.search(name) or (cells and all(_DURATION.fullmatch(c) for c in cells)):
            out.add(j)
        elif (name.startswith("×") or " / " in name) and j - 1 in out:
            out.add(j)
    return out


def normalize(lines: list[str]) -> list[str]:
    """`lines` with what a rerun cannot reproduce masked: in a table (a header row, its rule, the rows
    below), the columns `_masked_columns` names; in other lines, durations, dates and load averages."""
    out, i = [], 0
    while i < len(lines):
        if not (lines[i].lstrip().startswith("|") and i + 1 < len(lines) and _RULE.fullmatch(lines[i + 1])):
            out.append(_mask_text(lines[i]).rstrip())
            i += 1
            continue
        j = i + 2
        while j < len(lines) and lines[j].lstrip().startswith("|"):
            j += 1
        rows = [_cells(lines[i])] + [_cells(l) for l in lines[i + 2:j]]
        masked = _masked_columns(rows)
        out.append("| " + " | ".join(rows[0]) + " |")
        out.append(lines[i + 1].strip())
        out += ["| " + " | ".join("<t>" if k in masked else c for k, c in enumerate(r)) + " |" for r in rows[1:]]
        i = j
    return out


def test_blocks_parse_and_name_this_projects_commands():
    found = blocks()
    assert found, "no checked block in the docs"
    for doc, command, expected in found:
        assert re.match(r"(\S+=\S+ )*python3? (-m (remat|remat_lm|examples)\.|train\.py)", command), (doc, command)
        assert expected, f"{doc}: the block of `{command}` shows nothing to check"


def test_masking_keeps_memory_and_hides_time():
    table = ["| setting | temp MiB | × none | step ms | × none |", "|---|---|---|---|---|",
             "| full | 72.0 | 0.15 | 872 | 1.12 |"]
    assert normalize(table)[2] == "| full | 72.0 | 0.15 | <t> | <t> |"
    sample = ["| model | first call | KV cache | no cache | no cache / KV cache |", "|---|---|---|---|---|",
              "| gpt2 tiny | 1.42 s | 42 ms | 92 ms | 2.2x |"]
    assert normalize(sample)[2] == "| gpt2 tiny | <t> | <t> | <t> | <t> |"
    assert normalize(["2026-12-03 20:20 UTC, load average 0.61, 2 min 35 s"]) == ["<date>, load <n>, <time> <time>"]
    with pytest.raises(ValueError, match="prose"):
        _parse("```\n$ python -m remat_lm.bench.sample\n```\nfull remat is 0.15x\n")


@pytest.mark.slow  # each block runs its command: seconds to minutes of compiles
@pytest.mark.parametrize("doc,command,expected", blocks(), ids=lambda v: v if isinstance(v, str) and len(v) < 80 else None)
def test_block_is_what_its_command_prints(doc, command, expected):
    words = shlex.split(command)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    while "=" in words[0]:  # VAR=value before the program
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    words[0] = sys.executable
    r = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"{doc}: `{command}` exited {r.returncode}:\n{r.stderr[-3000:]}"
    printed = set(normalize((r.stdout + "\n" + r.stderr).splitlines()))
    missing = [line for line in normalize(expected) if line not in printed]
    assert not missing, f"{doc}: `{command}` no longer prints:\n" + "\n".join(missing) + "\n--- it printed:\n" + r.stdout[-6000:]


def test_the_readme_why_table_states_checked_figures():
    """Each figure of the README's "Why remat" table is one that a checked block of the docs prints."""
    checked = "\n".join("\n".join(lines) for _, _, lines in blocks())
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Why remat"):].split("\n\n")[2]
    rows = [_cells(l) for l in table.splitlines()[2:]]
    figures = {f for r in rows for f in re.findall(r"\d+\.\d+|\d+%", r[3])}
    assert figures, "the README's Why remat table lost its figures"
    unchecked = sorted(f for f in figures if not re.search(rf"(?<![\d.]){re.escape(f)}(?![\d])", checked))
    assert not unchecked, f"README figures no checked block prints: {unchecked}"
