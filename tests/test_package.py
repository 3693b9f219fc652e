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



def test_console_scripts_name_the_command_as_typed(monkeypatch, capsys, tmp_path):
    """`remat-llmc` / `remat-sample` / `remat-train` say their own name in errors, not `python -m ...`."""
    import signal

    import remat_lm.llmc
    import remat_lm.sample
    import remat_lm.train
    cases = [(remat_lm.llmc, ["remat-llmc", "verify", str(tmp_path / "none.bin"), str(tmp_path / "s.bin")],
              "remat-llmc verify: error: "),
             (remat_lm.sample, ["remat-sample", str(tmp_path), "--seed", "-1"], "remat-sample: error: "),
             (remat_lm.train, ["remat-train", "--bogus"], "remat-train: error: ")]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}  # remat-train installs its own
    for module, argv, prefix in cases:
        monkeypatch.setattr(module, "PROG", module.PROG)  # restored after the test
        monkeypatch.setattr(sys, "argv", argv)
        try:
            code = module.entry()
        except SystemExit as e:  # argparse's exit
            code = e.code
        finally:
            for s, h in handlers.items():
                signal.signal(s, h)
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(prefix) and err.count("\n") == 1, (argv, code, err)
