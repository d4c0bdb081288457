"""`pip install .` gives the same program as `pip install -e .`: the wheel holds every module.

The wheel is built (with this interpreter's setuptools, no build isolation, so nothing is
downloaded) from a copy of the checkout's source files, so the build neither writes into the
working tree nor picks up a stale build/ folder. It is installed, without its dependencies, into
a fresh virtualenv whose only other path is this interpreter's site-packages (added by a .pth
line, which adds the directory without running the .pth files inside it, so the editable
install's import hook stays out). Every module of the installed package is imported there, and
the console script answers --help.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("cli", "export", "models", "runtime", "server")
DEPENDENCIES_PTH = "kiln_test_dependencies.pth"

pytestmark = pytest.mark.wheel

IMPORT_ALL = """
import importlib, pkgutil, sys
import kiln
root = list(kiln.__path__)
assert root and all(path.startswith(sys.prefix) for path in root), root
names = sorted(m.name for m in pkgutil.walk_packages(kiln.__path__, "kiln."))
for name in names:
    module = importlib.import_module(name)
    assert module.__file__.startswith(sys.prefix), (name, module.__file__)
editable = sorted(m for m in sys.modules if m.startswith("__editable__"))
assert not editable, editable
print(len(names), " ".join(names))
"""


def _copy_source(dst: Path) -> None:
    """The files a commit of this working tree would hold: tracked and not-ignored untracked ones."""
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], check=True, capture_output=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: copy all but build state
        shutil.copytree(REPO, dst, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache"))
        return
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is left out
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dst / name)


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory) -> Path:
    scratch = tmp_path_factory.mktemp("wheel")
    _copy_source(scratch / "src")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(scratch / "dist"), str(scratch / "src")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [wheel] = (scratch / "dist").glob("kiln-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel_env(wheel_path, tmp_path_factory) -> Path:
    env = tmp_path_factory.mktemp("env")
    venv.EnvBuilder(with_pip=False).create(env)
    python = env / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    (site / DEPENDENCIES_PTH).write_text(sysconfig.get_paths()["purelib"] + "\n")
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                           "--no-index", "-q", str(wheel_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    installed = {path.name for path in site.iterdir()} - {"__pycache__"}
    assert installed == {"kiln", "kiln-0.1.0.dist-info", DEPENDENCIES_PTH}, installed
    return env


def test_the_wheel_holds_only_the_package(wheel_path):
    names = zipfile.ZipFile(wheel_path).namelist()
    outside = [name for name in names if not name.startswith(("kiln/", "kiln-0.1.0.dist-info/"))]
    assert not outside, outside
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)
    assert {name.split("/")[1] for name in names if name.startswith("kiln/")} == set(FOLDERS)
    # The export compiles them where it runs: the AVX-512 build or the AVX2 one, and what they share.
    assert {"kiln/export/cpu_kernels.c", "kiln/export/cpu_kernels_avx2.c", "kiln/export/cpu_kernels.h"} <= set(names)


def test_the_wheel_holds_and_imports_every_module(wheel_env):
    done = subprocess.run([str(wheel_env / "bin" / "python"), "-c", IMPORT_ALL], capture_output=True, text=True,
                          timeout=300, cwd=wheel_env)
    assert done.returncode == 0, done.stderr[-3000:]
    count, names = done.stdout.split(" ", 1)
    in_repo = {".".join(("kiln", *path.relative_to(REPO).with_suffix("").parts)).removesuffix(".__init__")
               for folder in FOLDERS for path in (REPO / folder).rglob("*.py")}
    assert set(names.split()) == in_repo
    assert "kiln.runtime.kvcache.trie_cache" in names.split()


@pytest.mark.parametrize("args, expected", [(["--help"], "serve"), (["serve", "--help"], "--port")])
def test_the_console_script_runs(wheel_env, args, expected):
    done = subprocess.run([str(wheel_env / "bin" / "kiln"), *args], capture_output=True, text=True, timeout=120,
                          cwd=wheel_env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert expected in done.stdout
