"""cli/child_build.py: a build in a spawned process returns its result or raises its error, and
`cancel()` ends it with everything it started; `kiln serve` told to stop while it builds stops
then, leaving no build process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kiln.cli.child_build import ChildBuild
from kiln.runtime.errors import ExportError, ModelLoadError

REPO = Path(__file__).resolve().parents[2]


def _doubled(value):
    return value * 2


def _failing(args):
    raise ExportError(f"no build for {args}")


def _waits_on_a_grandchild(pid_file):
    """A build that starts a process of its own (as a build starts iree-compile) and waits on it."""
    sleeper = subprocess.Popen(["sleep", "600"])
    Path(pid_file).write_text(str(sleeper.pid))
    sleeper.wait()


def _dies_leaving_a_grandchild(pid_file):
    """A build whose process the system kills while its iree-compile runs."""
    sleeper = subprocess.Popen(["sleep", "600"])
    Path(pid_file).write_text(str(sleeper.pid))
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A process that has ended but is not yet reaped is a zombie: gone for this purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_a_build_returns_its_result_or_raises_its_error():
    assert ChildBuild(_doubled, 21, "the model")() == 42
    with pytest.raises(ExportError, match="no build for tiny"):
        ChildBuild(_failing, "tiny", "the model")()


def test_a_cancelled_build_ends_with_what_it_started(tmp_path):
    pid_file = tmp_path / "sleeper"
    build = ChildBuild(_waits_on_a_grandchild, str(pid_file), "big.gguf")
    outcome = []
    waiting = threading.Thread(target=lambda: outcome.append(_outcome(build)))
    waiting.start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the build never started its process"
        time.sleep(0.1)
    sleeper = int(pid_file.read_text())
    build.cancel()
    waiting.join(30)
    assert not waiting.is_alive()
    assert isinstance(outcome[0], ModelLoadError) and "building big.gguf was stopped" in str(outcome[0])
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper)
    with pytest.raises(ModelLoadError, match="was stopped"):  # cancelled before it starts: never starts
        build()


def test_a_killed_build_takes_what_it_started_with_it(tmp_path):
    pid_file = tmp_path / "sleeper"
    with pytest.raises(ModelLoadError, match="its process was killed"):
        ChildBuild(_dies_leaving_a_grandchild, str(pid_file), "big.gguf")()
    sleeper = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(sleeper) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(sleeper)


def _outcome(build):
    try:
        return build()
    except Exception as error:  # noqa: BLE001 - the test reads it
        return error


def test_kiln_serve_stops_while_it_builds(tmp_path):
    """SIGTERM during a first-run build: the server exits in seconds, its build processes with it."""
    from tests.tiny_model import make_tiny_checkpoint, write_hf_directory

    write_hf_directory(make_tiny_checkpoint(seed=3), tmp_path / "tiny")
    env = os.environ | {"KILN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", "--model", str(tmp_path / "tiny"),
                               "--port", "0"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        for line in server.stdout:
            lines.append(line)
            if "tracing:" in line:
                break
        else:
            pytest.fail("the build never began tracing:\n" + "".join(lines))
        group = os.getpgid(server.pid)
        builders = _processes_below(server.pid)
        assert builders, "no build process under the server"
        server.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        server.wait(30)
        assert time.monotonic() - stopped < 15
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in builders) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in builders if _alive(pid)]
        # Stopped mid-trace: the export never finished (a build left running would have written it).
        assert not list((tmp_path / "cache").glob("artifacts/*/model.json"))
    finally:
        if server.poll() is None:
            os.killpg(group if "group" in locals() else server.pid, signal.SIGKILL)
            server.wait()
        for pid in locals().get("builders", []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _processes_below(pid: int) -> list[int]:
    """Every process below `pid`, whichever of its threads started it."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return [grand for child in children for grand in (child, *_processes_below(child))]
