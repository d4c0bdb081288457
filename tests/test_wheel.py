"""`pip install .` gives the same program as `pip install -e .`: the wheel holds every module.

The wheel is built from this checkout and installed, without its dependencies, into a
fresh virtualenv whose only other path is this interpreter's site-packages (added by a
.pth line, which adds the directory without running the .pth files inside it, so the
editable install's import hook stays out). Every module of the installed package is
imported there, and the console script answers --help.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.wheel

IMPORT_ALL = """
import importlib, pkgutil, sys
import kiln
root = kiln.__path__
assert all(path.startswith(sys.prefix) for path in root), root
names = sorted(m.name for m in pkgutil.walk_packages(root, "kiln."))
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(sys.prefix), (name, module.__file__)
print(len(names), " ".join(names))
"""


@pytest.fixture(scope="module")
def wheel_env(tmp_path_factory) -> Path:
    scratch = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(scratch / "dist"), str(REPO)], check=True, capture_output=True, timeout=300)
    [wheel] = (scratch / "dist").glob("kiln-*.whl")
    env = scratch / "env"
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / "kiln_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                    "-q", str(wheel)], check=True, capture_output=True, timeout=300)
    return env


def test_the_wheel_holds_and_imports_every_module(wheel_env):
    done = subprocess.run([str(wheel_env / "bin" / "python"), "-c", IMPORT_ALL], capture_output=True, text=True,
                          timeout=300, cwd=wheel_env)
    assert done.returncode == 0, done.stderr[-3000:]
    count, names = done.stdout.split(" ", 1)
    in_repo = {".".join(("kiln", *path.relative_to(REPO).with_suffix("").parts)).removesuffix(".__init__")
               for folder in ("cli", "export", "models", "runtime", "server") for path in (REPO / folder).rglob("*.py")}
    assert set(names.split()) == in_repo - {"kiln"}
    assert "kiln.runtime.kvcache.trie_cache" in names.split()


@pytest.mark.parametrize("args, expected", [(["--help"], "serve"), (["serve", "--help"], "--port")])
def test_the_console_script_runs(wheel_env, args, expected):
    done = subprocess.run([str(wheel_env / "bin" / "kiln"), *args], capture_output=True, text=True, timeout=120,
                          cwd=wheel_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout
