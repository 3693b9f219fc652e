"""The installed project: one namespace. Installing the wheel adds `remat` (the library) and
`remat_lm` (the models, trainer and benchmarks) and no other top-level name."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _site_packages(venv: Path) -> Path:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def test_the_wheel_adds_only_remat_and_remat_lm(tmp_path):
    src = tmp_path / "src"  # build from a copy: the build writes build/ and *.egg-info beside the sources
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("remat", "remat_lm"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)],
                   check=True, capture_output=True)
    wheel, = (tmp_path / "dist").glob("*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = _site_packages(venv)
    before = set(os.listdir(site))
    subprocess.run(pip + ["--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps", "--no-index",
                          str(wheel)], check=True, capture_output=True)
    added = set(os.listdir(site)) - before
    top = {n for n in added if not n.endswith((".dist-info", ".pth")) and n != "__pycache__"}
    assert top == {"remat", "remat_lm"}, f"installing the project added top-level names {sorted(top)}"
    # the models, trainer and benchmarks are inside the application package, not beside it
    for module in ("remat/checkpoint.py", "remat_lm/models/gpt2.py", "remat_lm/training/run.py",
                   "remat_lm/bench/policies.py"):
        assert (site / module).is_file(), f"{module} is not in the wheel"
    # the programs come along as console scripts (python train.py / python -m ... keep working in a checkout)
    scripts = {p.name for p in (venv / "bin").iterdir()}
    assert {"remat-train", "remat-sample", "remat-llmc"} <= scripts, sorted(scripts)

