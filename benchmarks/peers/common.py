"""What every peer engine needs: its own virtualenv in Kiln's cache, the shared CPU lock,
running a script in that venv for one JSON result, and waiting for a server.

Peers never go into Kiln's own environment: each gets `<cache>/peers/<name>`, made once
and remade only when its pinned requirement list changes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

PYTHON = "python3.11"
HEAVY_LOCK = Path("/tmp/kiln-heavy.lock")
_HELD_ENV = "KILN_HEAVY_LOCK_HELD"


def peers_dir() -> Path:
    """`<cache>/peers`: $KILN_CACHE_DIR/peers, else ~/.cache/kiln/peers."""
    from kiln.models import cache

    return cache.peers_dir()


def _lock_inherited() -> bool:
    """True when this process already holds the heavy lock: an ancestor took it in-process
    (and said so in the environment), or we run under `flock /tmp/kiln-heavy.lock ...`,
    whose descriptor we inherited. Taking it again would then wait for ourselves."""
    if os.environ.get(_HELD_ENV) == "1":
        return True
    try:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{fd}") == str(HEAVY_LOCK):
                    return True
    except OSError:
        pass
    return False


@contextlib.contextmanager
def heavy_lock():
    """Hold the machine-wide lock for CPU-heavy work (builds, conversions, timings), so
    that concurrent sessions do not measure each other. Re-entrant across processes."""
    if _lock_inherited():
        yield
        return
    with open(HEAVY_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        os.environ[_HELD_ENV] = "1"  # children we start inherit the right to skip it
        try:
            yield
        finally:
            os.environ.pop(_HELD_ENV, None)
            fcntl.flock(f, fcntl.LOCK_UN)


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


def make_venv(name: str, requirements: list[str], env: dict[str, str] | None = None,
              builds: bool = False) -> Path:
    """Create (once) the venv `<peers>/<name>` with `requirements` pip-installed, and return
    its python. A marker holding the requirement list makes a rerun a no-op; entries may be
    pip options (`--find-links=DIR`). `env` adds variables for the install (CMAKE_ARGS);
    `builds` says it compiles from source, so it takes the heavy lock."""
    venv = peers_dir() / name
    python = venv / "bin" / "python"
    marker = venv / ".kiln-requirements"
    wanted = "\n".join(requirements) + "\n"
    if python.exists() and marker.exists() and marker.read_text() == wanted:
        return python
    venv.parent.mkdir(parents=True, exist_ok=True)
    if not python.exists():
        subprocess.run([PYTHON, "-m", "venv", str(venv)], check=True)
    log(f"installing into {venv}: {' '.join(requirements)}")
    with heavy_lock() if builds else contextlib.nullcontext():
        start = time.monotonic()  # not counting the wait for the lock
        subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements],
                       check=True, env={**os.environ, **(env or {})})
    log(f"{name}: installed in {time.monotonic() - start:.0f} s")
    marker.write_text(wanted)
    return python


def run_json(python: Path | str, args: list[str], env: dict[str, str] | None = None,
             timeout: float | None = None) -> dict:
    """Run `python *args` and return the JSON object it prints last on stdout (stderr
    passes through, so progress stays visible)."""
    out = subprocess.run([str(python), *args], stdout=subprocess.PIPE, text=True, check=True,
                         env={**os.environ, **(env or {})}, timeout=timeout).stdout
    for line in reversed(out.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    raise RuntimeError(f"{args[0]} printed no JSON object; stdout was:\n{out[-2000:]}")


def _busy_jiffies() -> int:
    """CPU time (clock ticks) the whole machine has spent busy since boot."""
    with open("/proc/stat") as f:
        user, nice, system, idle, iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return user + nice + system + irq + softirq + steal


@contextlib.contextmanager
def others_cpu(report: dict):
    """Measure how busy the machine was with *other* processes (not us, not our waited-for
    children) while the block ran; sets report["others_cpu_pct"] (of all cores). The heavy
    lock only helps against those who take it: this shows when someone did not."""
    tick, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    t0, busy0, wall0 = os.times(), _busy_jiffies(), time.monotonic()
    try:
        yield report
    finally:
        t1, busy1, wall = os.times(), _busy_jiffies(), time.monotonic() - wall0
        ours = sum(t1[:4]) - sum(t0[:4])  # user, system, children's user and system (s)
        others = max(0.0, (busy1 - busy0) / tick - ours)
        report["others_cpu_pct"] = round(100 * others / (wall * ncpu), 1)
        if report["others_cpu_pct"] > 5:
            log(f"warning: other processes used {report['others_cpu_pct']}% of the CPUs "
                "during the measurement; figures may be low")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200; fail early if `proc` (the server) exits."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f} s")
        time.sleep(0.5)


def stop_process(proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds: servers get to drain, never to hang us."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
