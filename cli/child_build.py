"""A model built in a spawned process, which the server can stop.

Building imports torch, which the server must not keep, so it runs in a process of its own. That
process leads a process group of its own, holding everything the build starts (its tracing
processes, iree-compile), so that `cancel()` ends all of it at once: a server told to stop while
it builds stops then, not minutes later when iree-compile is done.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

from kiln.runtime.errors import ModelLoadError


def _build_in_group(build, args, results) -> None:
    """The spawned process's work: lead a process group, build, send back the outcome."""
    os.setpgrp()
    try:
        outcome = ("built", build(args))
    except BaseException as error:  # noqa: BLE001 - raised again in the parent
        outcome = ("failed", error)
    try:
        results.send(outcome)
    except Exception:  # an exception that does not pickle: its words
        results.send(("failed", ModelLoadError(f"{type(outcome[1]).__name__}: {outcome[1]}")))


class ChildBuild:
    """`build(args)` in a spawned process: calling it waits for the result (or raises the build's
    error); `cancel()`, from any thread, ends the process and what it started."""

    def __init__(self, build, args, model: str):
        self.build, self.args, self.model = build, args, model
        self._lock = threading.Lock()
        self._process = None
        self._cancelled = False

    def __call__(self):
        context = multiprocessing.get_context("spawn")
        receiving, sending = context.Pipe(duplex=False)
        process = context.Process(target=_build_in_group, args=(self.build, self.args, sending),
                                  name="kiln-build")
        with self._lock:
            if self._cancelled:
                raise ModelLoadError(f"building {self.model} was stopped")
            process.start()
            self._process = process
        sending.close()
        try:
            try:
                outcome = receiving.recv()
            except EOFError:  # the process ended without a word
                outcome = None
            process.join()
        except BaseException:  # interrupted while waiting: the build goes too
            self.cancel()
            raise
        finally:
            receiving.close()
        with self._lock:  # over: nothing left for cancel() to end (its pid may be reused)
            self._process = None
        if outcome is None:
            self._end_group(process)  # what it started outlives it otherwise (an iree-compile)
            if self._cancelled:
                raise ModelLoadError(f"building {self.model} was stopped")
            raise ModelLoadError(
                f"building {self.model} stopped: its process was killed (the system ends a process that runs out "
                "of memory, and tracing holds more of the model for every function it builds). Build fewer "
                "functions with `kiln build --model MODEL --bs-decode 1,4 --decode-buckets none "
                "--no-prefill-last --max-seq-len 4096 --output-dir DIR` (and `--cpu-kernels` on a CPU with "
                "AVX-512, as kiln serve builds), then `kiln serve --artifacts DIR`")
        kind, value = outcome
        if kind == "failed":
            raise value
        return value

    def cancel(self) -> None:
        """End the build's process group (nothing happens once it is over)."""
        with self._lock:
            self._cancelled = True
            process = self._process
        if process is not None and process.pid is not None:
            self._end_group(process)

    @staticmethod
    def _end_group(process) -> None:
        try:  # the group, once the process leads one; the process itself, in case it does not yet
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.kill()
