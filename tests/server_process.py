"""A real `kiln serve` process on 127.0.0.1, started by a test, as a user would run it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')  # name="value" in a sample's braces


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_answers(url: str, process: subprocess.Popen, timeout: float) -> None:
    """Until GET `url` answers 200; AssertionError if `process` exits or the time runs out first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert process.poll() is None, f"{process.args[0]} exited with {process.returncode}"
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer in {timeout}s")


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli.main", "serve", *args, "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
        )

    def wait_ready(self, timeout: float = 300) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"kiln serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"kiln serve was not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def metric(self, name: str, default: float | None = None) -> float:
        """A sample's value: `name` alone, or with labels as Prometheus prints them
        (`kiln_model_steps_total{kind="decode"}`); labels not given (model_name) may be anything."""
        base, _, given = name.partition("{")
        wanted = set(_LABEL.findall(given))
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            sample, _, value = line.rpartition(" ")
            sample_name, _, labels = sample.partition("{")
            if sample_name == base and wanted <= set(_LABEL.findall(labels)):
                return float(value)
        if default is None:
            raise KeyError(name)
        return default

    def wait_metric(self, name: str, value: float, timeout: float = 5.0) -> float:
        deadline = time.monotonic() + timeout
        while (current := self.metric(name)) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return current

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode
