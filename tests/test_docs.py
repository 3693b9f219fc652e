"""The README and docs/*.md as a user reads them: every documented command of this project starts
(`--help`), every flag a documented command passes is one its program accepts, every relative link
and `#anchor` resolves, every `docs/BENCHMARKS.md, "Section"` citation in the tree names a heading
that exists, and the README's Python examples run.

The commands are found in code (fenced blocks and inline spans): `python -m MODULE ...` for the
project's own modules (`remat`, `remat_lm`, `examples`) and `python train.py ...`. All of them
answer `--help` in one subprocess (one JAX import, each module run with `runpy` as `python -m`
would), so the whole check costs a few seconds. A module with sub-commands (`llmc verify`) is
asked for each sub-command's help too. The examples take no flags and are only looked up (they run
whole in tests/test_examples.py). What the documented commands print is checked by
tests/test_doc_figures.py.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "notebooks" / "README.md"]
OWN = ("remat", "remat_lm", "examples")

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"(`+)(.+?)\1", re.S)
_COMMAND = re.compile(r"python3?\s+(?:-m\s+([\w.]+)|(train\.py))([^\n#;|&`]*)")
_FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def _code(text: str) -> list[str]:
    """The fenced blocks (continuation lines joined) and the inline code spans of a markdown text."""
    blocks = [b.replace("\\\n", " ") for b in _FENCE.findall(text)]
    prose = _FENCE.sub("", text)
    return blocks + [m.group(2) for m in _INLINE.finditer(prose)]


def commands() -> list[tuple[str, str, tuple[str, ...]]]:
    """(doc, program, flags) for every documented command of this project, in order, deduplicated.
    The program is a module name or `train.py`."""
    seen, out = set(), []
    for path in DOCS:
        for code in _code(path.read_text()):
            for m in _COMMAND.finditer(code):
                program = m.group(1) or m.group(2)
                if program.endswith(".") or program.split(".")[0] not in OWN + ("train",):
                    continue  # a template (`examples.<name>`) or another project's module (pytest, pip)
                key = (path.relative_to(ROOT).as_posix(), program, tuple(_FLAG.findall(m.group(3))))
                if key not in seen:
                    seen.add(key)
                    out.append(key)
    return out


# NOTE: one subprocess answers every program's `--help` (and each sub-command's): importing JAX
# and the models once is most of the cost, and `runpy` runs a module exactly as `python -m` does.
# A sub-command is a word in braces in the usage line's positionals, argparse's `{verify}`.
_PROBE = r"""
import contextlib, io, json, re, runpy, sys
out = {}
def ask(program, argv):
    buf = io.StringIO()
    sys.argv = [program] + argv
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            if program.endswith(".py"):
                runpy.run_path(program, run_name="__main__")
            else:
                runpy.run_module(program, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            code, _ = 1, buf.write(f"{type(e).__name__}: {e}")
    return code, buf.getvalue()
for program in json.loads(sys.argv[1]):
    if program.startswith("examples."):  # no flags; run whole by tests/test_examples.py
        import importlib.util
        out[program] = (0 if importlib.util.find_spec(program) else 1, "")
        continue
    code, text = ask(program, ["--help"])
    usage = re.sub(r"-[\w-]+\s+\{[^}]*\}", "", text.split("\n\n", 1)[0])  # options' choices
    for sub in re.findall(r"\{([\w,-]+)\}", usage):
        for word in sub.split(","):
            code2, text2 = ask(program, [word, "--help"])
            code, text = max(code, code2), text + "\n" + text2
    out[program] = (code, text)
print("\n@@PROBE@@" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, tuple[int, str]]:
    programs = sorted({p for _, p, _ in commands()})
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(programs)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "@@PROBE@@" in r.stdout, r.stderr[-3000:]
    return {k: tuple(v) for k, v in json.loads(r.stdout.split("@@PROBE@@", 1)[1]).items()}


def test_the_docs_document_commands():
    """The extractor finds the commands a user copies (so the checks below cannot pass empty)."""
    programs = {p for _, p, _ in commands()}
    assert {"train.py", "remat_lm.bench.policies", "remat_lm.bench.attention"} <= programs, programs


def test_every_documented_program_answers_help(helps):
    bad = {p: text[-400:] for p, (code, text) in helps.items() if code != 0}
    assert not bad, f"these documented programs fail `--help`: {bad}"


@pytest.mark.parametrize("doc,program,flags", commands(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_documented_flags_exist(helps, doc, program, flags):
    code, text = helps[program]
    missing = [f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]
    assert not missing, f"{doc}: `{program}` documents {missing}, which its --help does not list"


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _FENCE.sub("", path.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            s = _slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def _headings(path: pathlib.Path) -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.*)$", _FENCE.sub("", path.read_text()), re.M)}


def test_relative_links_and_anchors_resolve():
    bad = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", _FENCE.sub("", path.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{path.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{path.name}: {target} (no such heading)")
    assert not bad, bad


def test_benchmark_citations_name_sections():
    """`docs/BENCHMARKS.md, "Attention cores"` in a comment or a doc names a heading of that file."""
    headings = _headings(ROOT / "docs" / "BENCHMARKS.md")
    files = [*DOCS, *ROOT.glob("remat/*.py"), *ROOT.glob("remat_lm/**/*.py"), ROOT / "train.py"]
    cited = {(f.relative_to(ROOT).as_posix(), s) for f in files
             for s in re.findall(r'BENCHMARKS\.md,\s+"([^"]+)"', f.read_text())}
    assert cited, "no citation found: the pattern does not match how the tree cites the benchmarks"
    missing = [(f, s) for f, s in cited if not any(h == s or h.startswith(s + " ") for h in headings)]
    assert not missing, f"cited sections that docs/BENCHMARKS.md lacks: {missing}"


def test_readme_python_examples_run():
    """The README's ```python blocks, in order, in one namespace (a later block may use an
    earlier block's names), run as written."""
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert blocks
    ns: dict = {}
    shown = []
    for block in blocks:
        exec(compile(block, "README.md", "exec"), ns)
        # `print(expr)  # what it prints`: the comment is checked against the value, right after its block
        # (a comment that reads as a value: a tuple, list, number or string; prose comments are prose)
        shown += [(expr, said, str(eval(expr, ns)))
                  for expr, said in re.findall(r"^print\((.*)\)\s+#\s+([(\['\"0-9].*)$", block, re.M)]
    assert shown, "no `print(...)  # output` line found in the README's examples"
    wrong = [(expr, said, got) for expr, said, got in shown if said != got]
    assert not wrong, f"README comments that do not say what the line prints: {wrong}"


# Names of design notes that live outside this repository; nothing tracked may point at them.
_OUTSIDE = re.compile(r"(?:MEASUREMENTS|FORMATS|STYLE)[.]md|shared[/]design|[.][.][/]shared")


def test_no_tracked_file_cites_a_document_outside_the_repository():
    """Every tracked file stands on its own: what the project relies on is written in docs/."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")  # an sdist: nothing to scan against
    bad = []
    for name in tracked.stdout.split():
        path = ROOT / name
        if not path.is_file() or path.suffix in (".bin", ".png", ".npz", ".npy"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        bad += [f"{name}:{i}" for i, line in enumerate(text.splitlines(), 1)
                if _OUTSIDE.search(line)]
    assert not bad, f"citations of documents outside the repository: {bad}"


def test_readme_states_no_measured_time():
    """Measured times go stale with every commit: they live in docs/BENCHMARKS.md, dated."""
    text = (ROOT / "README.md").read_text()
    times = re.findall(r"\b\d+(?:\.\d+)?\s*(?:min|ms|s)\b(?![\w-])|\b\d+ min \d+ s\b", text)
    assert not times, f"README states measured times {times}; move them to docs/BENCHMARKS.md"


_POINTER = re.compile(r"(?<![\w/.-])((?:remat|remat_lm|examples|notebooks|tests|docs|bench)/[\w/.-]+?\.(?:py|md|ipynb|sh|png|svg))")


def test_paths_the_tree_points_at_exist():
    """A file of this repository named anywhere in it (docs, docstrings, comments) exists; a path
    in another project's tree is named with its owner first ("JAX's tests/api_test.py")."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    dead = []
    for name in tracked.stdout.split():
        path = ROOT / name
        if path.suffix not in (".py", ".md", ".ipynb", ".sh", ".toml", ".cfg") and name not in ("Makefile",):
            continue
        text = path.read_text()
        for m in _POINTER.finditer(text):
            if re.search(r"(JAX|Flax|llm\.c|PyTorch|torchtitan|MaxText)'s\s+(\S+\s+){0,2}$", text[max(0, m.start() - 40):m.start()]):
                continue  # another project's file
            if not (ROOT / m.group(1)).exists():
                dead.append(f"{name}: {m.group(1)}")
    assert not dead, f"pointers to files that do not exist: {sorted(set(dead))}"
