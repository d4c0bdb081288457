"""A module's functions traced by several processes at once.

torch.export traces in Python, one function at a time on one core: SmolLM2's default build spent
two of its four minutes there (benchmarks/NOTES.md, "Build time"). The tracing processes are
forked from the exporting one once the model is built and its weights are in the parameter
archive, so each starts with the model as it is (its tensors are views of the archive's pages,
which the processes share and never copy). Each traces its share of the functions, the
exporting process the first share, each function imported to a module of its own and written to
a file (one traced program alive at a time). The modules are then merged into one: every
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
import threading
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


def share_out(functions: Sequence[Planned], cost: Callable[[Planned], float], jobs: int) -> list[list[Planned]]:
    """`functions` in `jobs` shares of about equal cost (the costliest first, each onto the share
    that holds least so far); each share keeps the functions' order."""
    shares: list[list[int]] = [[] for _ in range(jobs)]
    loads = [0.0] * jobs
    for index in sorted(range(len(functions)), key=lambda i: -cost(functions[i])):
        least = loads.index(min(loads))
        shares[least].append(index)
        loads[least] += cost(functions[index])
    return [[functions[i] for i in sorted(share)] for share in shares if share]


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


def _relay_progress(read_fds: list[int], log) -> threading.Thread:
    """A thread passing the children's progress lines to `log` as they come, until each pipe closes."""

    def relay() -> None:
        selector = selectors.DefaultSelector()
        pending = {}
        for fd in read_fds:
            selector.register(fd, selectors.EVENT_READ)
            pending[fd] = b""
        while pending:
            for key, _ in selector.select():
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    os.close(key.fd)
                    if rest := pending.pop(key.fd):
                        log(rest.decode(errors="replace"))
                    continue
                *lines, pending[key.fd] = (pending[key.fd] + chunk).split(b"\n")
                for line in lines:
                    log(line.decode(errors="replace"))
        selector.close()

    thread = threading.Thread(target=relay, name="kiln-trace-progress", daemon=True)
    thread.start()
    return thread


def _wait_for(pid: int, error_path: Path) -> str | None:
    """What went wrong in child `pid`, or None when it wrote its module."""
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return None
    if error_path.is_file():
        return error_path.read_text()
    if os.WIFSIGNALED(status):
        return (f"the process was killed (signal {os.WTERMSIG(status)}; the system ends a process that runs out "
                "of memory: set KILN_TRACE_JOBS=1 to trace in one process)")
    return f"the process exited with status {os.WEXITSTATUS(status)}"


def trace_in_processes(trace_share, functions: Sequence[Planned], cost: Callable[[Planned], float], jobs: int,
                       scratch: Path, log) -> None:
    """`trace_share(functions, log)` (which writes each function's module) over `jobs` shares of
    `functions` at once, the first in this process; returns when every share is done."""
    shares = share_out(functions, cost, jobs)
    children = []  # (pid, error path)
    read_fds = []
    # Nothing of the parent's for a child's collector to finalize (an object left in a reference
    # cycle may hold a runtime whose teardown waits on threads the child does not have).
    gc.collect()
    gc.freeze()
    try:
        for index, share in enumerate(shares[1:], start=1):
            error_path = scratch / f"share-{index}.error"
            error_path.unlink(missing_ok=True)
            read_fd, write_fd = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_fd)
                _trace_in_child(trace_share, share, error_path, write_fd)
            os.close(write_fd)
            read_fds.append(read_fd)
            children.append((pid, error_path))
        gc.unfreeze()
        relay = _relay_progress(read_fds, log)
        trace_share(shares[0], log)
    except BaseException:
        gc.unfreeze()
        for pid, _ in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid, _ in children:
            os.waitpid(pid, 0)
        raise
    problems = [(problem, share) for (pid, error_path), share in zip(children, shares[1:])
                if (problem := _wait_for(pid, error_path))]
    relay.join()
    if problems:
        problem, share = problems[0]
        names = ", ".join(getattr(planned, "name", str(planned)) for planned in share)
        raise ExportError(f"tracing {names}: {problem}")


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
