"""A small process pool whose tasks can time out or crash without stopping the run.

`concurrent.futures` cannot kill a hung task; here each worker is a process of its own with its
own pipe: a task past its deadline has its worker killed and replaced, and a worker that dies (a
segfault in a kernel) reports the task as crashed. Workers are never forked from the caller:
TVM's thread pool does not survive fork. They are spawned (a fresh interpreter), or, with
`preload`, forked from a server process that imported TVM and kernorch's measuring code once and
never ran a kernel (`multiprocessing`'s forkserver, `start_server`): a spawned worker imports TVM
itself, about 1.3 s of a core each (Xeon model 167), a forked one starts in some 15 ms.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any, Callable, Iterable, Iterator

log = logging.getLogger(__name__)


@dataclass
class TaskResult:
    index: int
    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this worker when its parent dies (a killed `optimize` must not
    leave workers compiling for minutes; a forked worker's parent is the server, which ends when
    the process it serves does); elsewhere the pipe's EOF ends an idle worker."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker_main(conn, parent: int | None = None, env: dict[str, str] | None = None) -> None:
    """Serve tasks until EOF or None. A spawned worker started in its environment; a forked one
    (`env` given) takes it here, the caller's as it was when the worker started plus the pool's,
    before anything it runs starts TVM's thread pool (which reads its thread count then)."""
    if parent is not None:
        _die_with_parent(parent)
    if env is not None:
        _leave_server()
        os.environ.clear()
        os.environ.update(env)
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        index, fn, args = msg
        t0 = time.perf_counter()
        try:
            value = fn(*args)
            conn.send((index, True, value, "", time.perf_counter() - t0))
        except BaseException as e:  # report everything; the parent decides
            tb = traceback.format_exc(limit=4)
            log.debug("task %s failed: %s", index, tb)
            conn.send((index, False, None, f"{type(e).__name__}: {e}"[:2000], time.perf_counter() - t0))


@contextlib.contextmanager
def _main_not_rerun():
    """Start children without re-running the user's `__main__`.

    A spawned child normally re-imports the parent's main script (to find functions defined
    there); a script that calls `kernorch.optimize` at top level, without an
    `if __name__ == "__main__":` guard, would then run again in every worker and crash it. Workers
    only run kernorch's own functions, so the main module's name and path are hidden from
    multiprocessing while a child starts."""
    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if main is not None and k in main.__dict__}
    try:
        if main is not None:
            main.__dict__.pop("__file__", None)
            main.__spec__ = None
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)
            if "__spec__" not in saved:
                main.__dict__.pop("__spec__", None)


# what the server imports once for the workers forked from it (`start_server`): TVM and the tasks
# of the measuring workers
PRELOAD = ("kernorch.backends.tvm", "kernorch.measure")
# the server's environment as it starts: the libraries it loads read their thread counts then (a
# forked worker runs NumPy's BLAS on one thread; TVM's pool starts later, in the worker, with its own)
SERVER_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """os.environ with `env` while the block runs (a process started in it inherits it)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def start_server():
    """Start the server the preloaded workers are forked from, if it does not run yet, and return
    its context. It starts in the background (its imports overlap whatever the caller does next;
    the first worker waits for them); it ends when this process does. POSIX only: elsewhere None
    (workers are spawned)."""
    if "forkserver" not in mp.get_all_start_methods():
        return None
    ctx = mp.get_context("forkserver")
    from multiprocessing import forkserver
    with _environment(SERVER_ENV), _main_not_rerun():
        ctx.set_forkserver_preload(list(PRELOAD))
        forkserver.ensure_running()
    return ctx


def _server():
    """This process's handle on multiprocessing's forkserver (private to CPython: the one place
    kernorch reads it), or None."""
    from multiprocessing import forkserver
    return getattr(forkserver, "_forkserver", None)


def _leave_server() -> None:
    """In a forked worker: close the write end of the server's "alive" pipe that every process it
    forks inherits. The server ends when no process holds it, and its workers with it (their
    parent-death signal); held by a worker busy compiling, a killed caller's server and workers
    lived on until the task ended."""
    server = _server()
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _server_pid() -> int | None:
    return getattr(_server(), "_forkserver_pid", None)


class _Worker:
    def __init__(self, ctx, env):
        self.conn, child = ctx.Pipe()
        forked = ctx.get_start_method() == "forkserver"
        parent = _server_pid() if forked else os.getpid()
        self.proc = ctx.Process(target=_worker_main, args=(child, parent, {**os.environ, **env} if forked else None),
                                daemon=True)
        # a spawned child must start with `env`: libraries read their variables when first
        # imported, which happens before the worker's own code runs
        with _environment({} if forked else env), _main_not_rerun():
            self.proc.start()
        child.close()
        self.task: int | None = None
        self.deadline = 0.0
        self.started = 0.0

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.join(5)
        except Exception:
            pass
        self.conn.close()


class WorkerPool:
    """Run `fn(*args)` tasks in `n` worker processes with a per-task timeout: spawned, or with
    `preload` forked from the server that imported TVM (`start_server`). A process timing another
    runtime (ONNX Runtime, OpenVINO) is spawned: it must hold nothing but that runtime."""

    def __init__(self, n: int, env: dict[str, str] | None = None, preload: bool = False):
        self.ctx = (start_server() if preload else None) or mp.get_context("spawn")
        self.env = dict(env or {})
        self.workers = [_Worker(self.ctx, self.env) for _ in range(max(1, n))]

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except Exception:
                pass
        for w in self.workers:
            w.proc.join(2)
            if w.proc.is_alive():
                w.kill()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        """The worker processes' ids."""
        return [w.proc.pid for w in self.workers]

    def call(self, fn: Callable, args: tuple, timeout: float) -> TaskResult:
        """Run one task to completion (the pool stays ready for the next)."""
        (result,) = list(self.run(fn, [args], timeout))
        return result

    def run(self, fn: Callable, tasks: Iterable[tuple], timeout: float) -> Iterator[TaskResult]:
        """Yield results as tasks finish (in completion order)."""
        pending = list(enumerate(tasks))
        pending.reverse()
        busy: dict[int, _Worker] = {}
        while pending or busy:
            for i, w in enumerate(self.workers):
                if w.task is None and pending:
                    index, args = pending.pop()
                    try:
                        w.conn.send((index, fn, args))
                    except (BrokenPipeError, OSError):
                        w.kill()
                        self.workers[i] = w = _Worker(self.ctx, self.env)
                        w.conn.send((index, fn, args))
                    w.task, w.started, w.deadline = index, time.perf_counter(), time.perf_counter() + timeout
                    busy[index] = w
            now = time.perf_counter()
            ready = wait([w.conn for w in busy.values()], timeout=max(0.01, min(w.deadline for w in busy.values()) - now)
                         if busy else 0.01)
            for conn in ready:
                w = next(w for w in busy.values() if w.conn is conn)
                index = w.task
                try:
                    got = conn.recv()
                    yield TaskResult(got[0], got[1], got[2], got[3], got[4])
                except (EOFError, OSError):
                    code = w.proc.exitcode if not w.proc.is_alive() else None
                    w.kill()
                    self._replace(w)
                    yield TaskResult(index, False, None, f"worker crashed (exit code {code})",
                                     time.perf_counter() - w.started)
                busy.pop(index, None)
                w.task = None
            now = time.perf_counter()
            for index, w in list(busy.items()):
                if now > w.deadline:
                    w.kill()
                    self._replace(w)
                    busy.pop(index)
                    yield TaskResult(index, False, None, f"timed out after {timeout:.0f} s", now - w.started)

    def _replace(self, dead: _Worker) -> None:
        i = self.workers.index(dead)
        self.workers[i] = _Worker(self.ctx, self.env)
