"""A small process pool whose tasks can time out or crash without stopping the run.

`concurrent.futures` cannot kill a hung task; here each worker is a spawned process with its own
pipe: a task past its deadline has its worker killed and replaced, and a worker that dies (a
segfault in a kernel) reports the task as crashed. Workers are spawned (not forked) because TVM's
thread pool does not survive fork.
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
    leave workers compiling for minutes); elsewhere the pipe's EOF ends an idle worker."""
    try:
        import ctypes
        import signal
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _worker_main(conn, parent: int | None = None) -> None:
    """Serve tasks until EOF or None. The environment was set before the process started."""
    if parent is not None:
        _die_with_parent(parent)
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


class _Worker:
    def __init__(self, ctx, env):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, os.getpid()), daemon=True)
        # the child must start with `env`: libraries read their variables when first imported
        # (TVM its thread count), which happens before the worker's own code runs
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            with _main_not_rerun():
                self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
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
    """Run `fn(*args)` tasks in `n` spawned processes with a per-task timeout."""

    def __init__(self, n: int, env: dict[str, str] | None = None):
        self.ctx = mp.get_context("spawn")
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
