"""A module's functions traced by several processes at once.

torch.export traces in Python, one function at a time on one core: SmolLM2's default build spent
two of its four minutes there (benchmarks/NOTES.md, "Build time"). Each function is traced by a
process forked for it from the exporting one, once the model is built and its weights are in the
parameter archive, so each starts with the model as it is (its tensors are views of the archive's
pages, which the processes share and never copy); as many run at once as there are CPUs, the
costliest first. Each imports its function to a module of its own, writes it to a file and
ends, taking with it what the trace left in its heap. The modules are then merged into one: every
function, and one copy of what they have in common (the parameters' globals, the CPU kernels'
declarations, matched by name and definition).

A forked process runs only tracing and the MLIR import, and says nothing on the streams it
shares with its parent: its progress lines come back through a pipe, its error through a file.
MLIR's contexts share one thread pool per process, whose threads a forked process does not have
(work handed to it would wait forever, once the parent has used it): the forked process's import
runs on its own thread.
"""

from __future__ import annotations

import gc
import os
import selectors
import signal
from pathlib import Path
from typing import Callable, Sequence, TypeVar

from kiln.runtime.errors import ExportError

Planned = TypeVar("Planned")


def tracing_processes(function_count: int) -> int:
    """How many processes trace at once: one per CPU this process may run on (KILN_TRACE_JOBS
    sets another number), never more than there are functions."""
    configured = os.environ.get("KILN_TRACE_JOBS", "").strip()
    if configured:
        try:
            jobs = int(configured)
        except ValueError:
            raise ExportError(f"KILN_TRACE_JOBS must be a whole number of processes, got {configured!r}") from None
    else:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(jobs, function_count))


def _single_threaded_import() -> None:
    """Make turbine's export, which creates its own MLIR context, create one that does its work on
    the calling thread."""
    from iree.compiler import ir
    from iree.turbine.aot import exporter

    def single_threaded_context() -> ir.Context:
        context = ir.Context()
        context.enable_multithreading(False)
        return context

    exporter.Context = single_threaded_context


def _trace_in_child(trace_share, share, error_path: Path, progress_fd: int) -> None:
    """The forked process's whole life: trace (writing the modules), leave without running
    anything of the parent's (its atexit handlers, its `finally` blocks)."""
    status = 1
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        _single_threaded_import()

        def log(line: str) -> None:
            os.write(progress_fd, (line + "\n").encode())

        trace_share(share, log)
        status = 0
    except BaseException as error:  # noqa: BLE001 - reported to the parent, which raises it
        try:
            error_path.write_text(f"{type(error).__name__}: {error}")
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(status)


class _Progress:
    """The children's progress lines, all written to one pipe (each line in one write, which a
    pipe keeps whole), passed to `log` by the exporting process's own thread as they come."""

    def __init__(self, log):
        self.log = log
        self.read_fd, self.write_fd = os.pipe()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.read_fd, selectors.EVENT_READ)
        self._pending = b""

    def relay(self, timeout: float) -> None:
        """Pass on what has come, waiting up to `timeout` seconds for something."""
        for _ in self._selector.select(timeout):
            chunk = os.read(self.read_fd, 65536)
            if not chunk:
                return
            *lines, self._pending = (self._pending + chunk).split(b"\n")
            for line in lines:
                self.log(line.decode(errors="replace"))

    def close(self) -> None:
        """Pass on the rest, once every child that could write has ended."""
        os.close(self.write_fd)
        while chunk := os.read(self.read_fd, 65536):
            self._pending += chunk
        for line in self._pending.decode(errors="replace").splitlines():
            self.log(line)
        self._selector.close()
        os.close(self.read_fd)


def _ended(pid: int, error_path: Path) -> tuple[bool, str | None]:
    """(whether child `pid` has ended, what went wrong in it: None when it wrote its module)."""
    ended, status = os.waitpid(pid, os.WNOHANG)
    if not ended:
        return False, None
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return True, None
    if error_path.is_file():
        return True, error_path.read_text()
    if os.WIFSIGNALED(status):
        return True, (f"the process was killed (signal {os.WTERMSIG(status)}; the system ends a process that runs "
                      "out of memory: set KILN_TRACE_JOBS=1 to trace one function at a time)")
    return True, f"the process exited with status {os.WEXITSTATUS(status)}"


def trace_in_processes(trace_share, functions: Sequence[Planned], cost: Callable[[Planned], float], jobs: int,
                       scratch: Path, log) -> None:
    """`trace_share([function], log)` (which writes the function's module) for each of `functions`
    in a forked process of its own, `jobs` at once, the costliest first; returns when every one is
    done, or raises the first failure (the others stopped). A process per function: what a trace
    leaves in the heap (a prefill's ~130 MiB for SmolLM2, which the allocator keeps for the
    process's life) ends with it, so the build holds the model and at most `jobs` traces at any
    time, and the exporting process, which traces nothing, stays as it was for what follows."""
    waiting = sorted(functions, key=cost, reverse=True)
    running: dict[int, tuple[Planned, Path]] = {}
    progress = _Progress(log)
    problem = None
    # Nothing of the parent's for a child's collector to finalize (an object left in a reference
    # cycle may hold a runtime whose teardown waits on threads the child does not have).
    gc.collect()
    try:
        while (waiting and problem is None) or running:
            while waiting and problem is None and len(running) < jobs:
                function = waiting.pop(0)
                error_path = scratch / f"trace-{len(waiting)}.error"
                error_path.unlink(missing_ok=True)
                gc.freeze()
                pid = os.fork()
                if pid == 0:
                    os.close(progress.read_fd)
                    _trace_in_child(trace_share, [function], error_path, progress.write_fd)
                gc.unfreeze()
                running[pid] = (function, error_path)
            progress.relay(0.05)
            for pid, (function, error_path) in list(running.items()):
                ended, failure = _ended(pid, error_path)
                if ended:
                    del running[pid]
                if failure:
                    problem = f"tracing {getattr(function, 'name', function)}: {failure}"
                    _stop(running)
                    break
    except BaseException:
        _stop(running)
        raise
    finally:
        progress.close()
    if problem:
        raise ExportError(problem)


def _stop(running: dict[int, tuple]) -> None:
    """End the children still running, and wait for them."""
    for pid in running:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in running:
        os.waitpid(pid, 0)
    running.clear()


def _symbol(operation) -> str | None:
    attributes = operation.attributes
    return attributes["sym_name"].value if "sym_name" in attributes else None


def _definition(operation) -> tuple:
    """What a top-level operation defines, to compare with another of its name. One without
    regions (a global) by its attributes: printed on its own, an operation that is not isolated
    from the module names the values of the whole module first (a tenth of a second each, for
    a model's module and each of its hundreds of globals)."""
    operation = operation.operation
    if len(operation.regions):
        return operation.name, operation.get_asm(use_local_scope=True)
    return operation.name, sorted((name, str(operation.attributes[name])) for name in operation.attributes)


def write_merged_module(paths: list[Path], output: Path) -> None:
    """The modules in `paths` merged (merge_modules) into one, written to `output` as text."""
    from iree.compiler import ir

    with ir.Context():
        module = ir.Module.parse(paths[0].read_text()).operation
        merge_modules(module, paths[1:])
        with open(output, "wb") as written:
            module.print(file=written, binary=True)


def merge_modules(module, paths: list[Path]) -> None:
    """Move every top-level operation of the modules in `paths` into `module` (an MLIR module
    operation). A symbol `module` already defines is dropped where its text is the same (a
    parameter's global, a kernel's declaration); a different one of the same name is renamed
    in its own module first, so that each function keeps calling what it called."""
    from iree.compiler import ir

    body = module.regions[0].blocks[0]
    defined = {name: operation for operation in body.operations if (name := _symbol(operation.operation))}
    with module.context:
        for path in paths:
            part = ir.Module.parse(path.read_text())
            for operation in list(part.body.operations):
                name = _symbol(operation.operation)
                if name in defined:
                    if _definition(operation) == _definition(defined[name]):
                        continue
                    part_name = path.stem.replace("-", "_")
                    renamed, suffix = f"{name}_{part_name}", 0
                    while renamed in defined:
                        suffix += 1
                        renamed = f"{name}_{part_name}_{suffix}"
                    ir.SymbolTable.replace_all_symbol_uses(name, renamed, part.operation)
                    ir.SymbolTable.set_symbol_name(operation, renamed)
                    name = renamed
                ir.InsertionPoint(body).insert(operation.detach_from_parent())
                if name:
                    defined[name] = operation
