"""The systems a user could pick instead of kernorch, and timing that is fair to each of them.

Runtimes that own thread pools (ONNX Runtime, OpenVINO, TVM, PyTorch) slow each other down in one
process: ONNX Runtime on one CNN went from 6.3 ms alone to 26 ms with kernorch's pools loaded
beside it. So every system here is prepared and timed **alone in its own process** (a spawned
worker that keeps the prepared system between calls), the processes take turns in blocks of runs
(round-robin, the starting system rotated each round), every system gets the same inputs and the
same explicit thread count, and the medians come with their run counts and the machine's load.

    PEERS["ort"], PEERS["openvino"], ...         # name -> Peer(prepare, summary)
    with Timer(threads) as t:                     # one process per system
        t.add("ort", model_bytes, feeds)
        t.add("kernorch", saved_dir, feeds)
        results = t.rounds(rounds=10, block=3)    # {name: [seconds per run]}

A system that is not installed is skipped with the reason; one that fails is reported with its
error and never stops the others.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .ir import KernorchError
from .timing import time_calls

log = logging.getLogger(__name__)


class Skip(Exception):
    """The system cannot run here for a reason that is not a bug (a package is not installed)."""


@dataclass(frozen=True)
class Peer:
    name: str
    summary: str
    # prepare(model, feeds, threads, **extra) -> (call, outputs, info), run inside the system's process
    prepare: Callable[..., tuple[Callable[[], Any], Callable[[], list[np.ndarray]], dict]]


def _input_names(proto) -> list[str]:
    inits = {i.name for i in proto.graph.initializer}
    return [i.name for i in proto.graph.input if i.name not in inits]


def _proto(model):
    import onnx
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))


def _ort(level: str):
    def prepare(model, feeds, threads, **_):
        import onnxruntime as ort
        from .executor import ort_session
        sess = ort_session(_proto(model).SerializeToString(), threads, level, spinning=True)
        names = [o.name for o in sess.get_outputs()]
        mine = {i.name: feeds[i.name] for i in sess.get_inputs()}
        return (lambda: sess.run(names, mine)), (lambda: [np.asarray(o) for o in sess.run(names, mine)]), \
            {"onnxruntime": ort.__version__, "graph_optimization_level": level, "spinning": "ORT's default"}
    return prepare


def _openvino(model, feeds, threads, **_):
    """OpenVINO on the CPU: f32 inference precision, the LATENCY hint, `threads` inference threads."""
    try:
        import openvino as ov
    except ImportError:
        raise Skip("OpenVINO is not installed (pip install openvino)") from None
    core = ov.Core()
    proto = _proto(model)
    m = core.read_model(proto.SerializeToString(), b"")
    compiled = core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32", "PERFORMANCE_HINT": "LATENCY",
                                             "INFERENCE_NUM_THREADS": int(threads), "NUM_STREAMS": 1})
    req = compiled.create_infer_request()
    names = _input_names(proto)
    order = [o.get_any_name() for o in compiled.outputs]
    mine = {n: np.ascontiguousarray(feeds[n]) for n in names}

    def outputs() -> list[np.ndarray]:
        res = req.infer(mine)
        by_name = {k.get_any_name(): np.asarray(v) for k, v in res.items()}
        return [by_name[n] for n in order]

    return (lambda: req.infer(mine)), outputs, {"openvino": ov.__version__, "precision": "f32", "hint": "LATENCY"}


def _tvm(model, feeds, threads, budget_trials: int = 0, tune_dir: str | None = None, **_):
    from .backends.tvm import peer
    proto = _proto(model)
    return peer.prepare(proto, feeds, _input_names(proto), threads, budget_trials,
                        Path(tune_dir) if tune_dir else None)


def _torch(model, feeds, threads, **_):
    try:
        import torch
    except ImportError:
        raise Skip("PyTorch is not installed") from None
    try:
        import onnx2torch
    except ImportError:
        raise Skip("no ONNX→PyTorch converter installed (onnx2torch)") from None
    torch.set_num_threads(threads)
    proto = _proto(model)
    net = torch.compile(onnx2torch.convert(proto).eval())
    args = [torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in _input_names(proto)]

    def call():
        with torch.inference_mode():
            return net(*args)

    def outputs() -> list[np.ndarray]:
        res = call()
        return [r.detach().numpy() for r in (res if isinstance(res, (tuple, list)) else [res])]

    return call, outputs, {"torch": torch.__version__, "converter": "onnx2torch", "compiled": "torch.compile"}


def _kernorch(model, feeds, threads, **_):
    """A saved kernorch model directory, loaded (not re-optimized) in this process."""
    from .runtime import load
    compiled = load(model, threads)
    return compiled.bind(feeds), (lambda: [compiled.run(feeds)[n] for n in compiled.output_names]), \
        {"kernels": len(compiled.plan.kernels), "predicted_ms": compiled.plan.predicted_ns / 1e6}


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("kernorch", "kernorch's saved executable", _kernorch),
    Peer("ort", "ONNX Runtime, all graph optimizations", _ort("ORT_ENABLE_ALL")),
    Peer("ort-basic", "ONNX Runtime, basic graph optimizations", _ort("ORT_ENABLE_BASIC")),
    Peer("openvino", "OpenVINO CPU, f32, LATENCY hint", _openvino),
    Peer("tvm", "TVM Relax: default fusion + dlight CPU rules (MetaSchedule with a budget)", _tvm),
    Peer("torch", "torch.compile of the model converted by onnx2torch", _torch),
)}


# ------------------------------------------------------------------------------------------------
# inside a system's own process
# ------------------------------------------------------------------------------------------------

_PREPARED: dict[str, tuple] = {}


def _prepare_task(name: str, model, feeds: dict, threads: int, extra: dict, peer: str | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        call, outputs, info = PEERS[peer or name].prepare(model, feeds, threads, **extra)
    except Skip as e:
        return {"status": "skipped", "note": str(e)}
    _PREPARED[name] = (call, outputs)
    call()  # first call: page faults, thread pools started
    return {"status": "ok", "setup_seconds": time.perf_counter() - t0, **info}


def _outputs_task(name: str) -> list[np.ndarray]:
    return [np.asarray(o) for o in _PREPARED[name][1]()]


def _time_task(name: str, runs: int, warmup: int) -> list[float]:
    return _warm_then_time(_PREPARED[name][0], runs, warmup)


WARMUP_S = 0.05  # each turn's untimed calls last at least this long


def _warm_then_time(call: Callable[[], Any], runs: int, warmup: int) -> list[float]:
    """`runs` timed calls after untimed ones: at least `warmup` of them and at least WARMUP_S, so
    that every system is timed in the state a loop of calls keeps it in (its threads awake, its
    data in cache), however short one call is, and not in the state the other systems' turns and
    the wait for them to go quiet left it in."""
    t0 = time.perf_counter()
    done = 0
    while done < warmup or time.perf_counter() - t0 < WARMUP_S:
        call()
        done += 1
    return time_calls(call, runs, 0)


# ------------------------------------------------------------------------------------------------
# the parent: one process per system, blocks of runs in turn
# ------------------------------------------------------------------------------------------------

def load_state() -> dict:
    """CPU pressure (/proc/pressure/cpu "some" averages, %) and the load average, now."""
    out: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                kv = dict(f.split("=") for f in line.split()[1:])
                out["cpu_pressure"] = {k: float(kv[k]) for k in ("avg10", "avg60", "avg300") if k in kv}
    except (OSError, ValueError):
        pass
    try:
        out["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    return out


def busy(state: dict) -> bool:
    p = state.get("cpu_pressure", {}).get("avg10")
    if p is not None:
        return p > 10.0
    la = state.get("loadavg")
    return bool(la) and la[0] > 0.5


def cpu_ticks(pid: int) -> int:
    """CPU time (clock ticks, user + system) every thread of process `pid` has used so far."""
    return _threads(pid)[0]


def _threads(pid: int) -> tuple[int, int]:
    """(CPU ticks every thread of process `pid` has used so far, how many of its threads other than
    the caller are running or waiting for a core)."""
    total = runnable = 0
    me = threading.get_native_id()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        total += int(fields[11]) + int(fields[12])
        runnable += fields[0] == "R" and int(task.name) != me
    return total, runnable


QUIET_WINDOW_S = 0.02  # a process that used no CPU over this long has its threads asleep
QUIET_MAX_S = 1.0      # and no system is waited for longer than this


class Timer:
    """Systems each in a process of their own, timed in turns. `local` systems (a callable timed in
    this process, e.g. the executable `optimize` just built) take their turns the same way.

    After each turn the next system waits until the last one's process has gone quiet: thread
    pools that spin after a run (TVM's did for 100-200 ms with its default spin count) would
    otherwise take a core from whatever is timed next."""

    def __init__(self, threads: int, timeout: float = 900.0):
        self.threads, self.timeout = threads, timeout
        self.pools: dict[str, Any] = {}
        self.local: dict[str, Callable[[], Any]] = {}
        self.info: dict[str, dict] = {}

    def __enter__(self) -> "Timer":
        return self

    def __exit__(self, *exc) -> None:
        for p in self.pools.values():
            p.close()

    def _call(self, name: str, fn, *args):
        r = self.pools[name].call(fn, args, self.timeout)
        if not r.ok:
            raise KernorchError(f"{name}: {r.error}")
        return r.value

    def add(self, name: str, model, feeds: Mapping[str, np.ndarray], peer: str | None = None, **extra) -> dict:
        """Prepare system `name` in a new process; returns its info (status ok/skipped/failed).
        `peer`: which system of PEERS it is, when `name` is only its label (two kernorch
        executables timed side by side: "kernorch-dynamic", "kernorch-static")."""
        from .workers import WorkerPool
        from .backends.tvm import thread_env
        self.pools[name] = WorkerPool(1, thread_env(self.threads))
        try:
            info = self._call(name, _prepare_task, name, model, dict(feeds), self.threads, extra, peer)
        except KernorchError as e:
            info = {"status": "failed", "error": str(e)[:2000]}
        if info["status"] != "ok":
            self.pools.pop(name).close()
        self.info[name] = info
        return info

    def add_local(self, name: str, call: Callable[[], Any], info: dict | None = None) -> None:
        self.local[name] = call
        self.info[name] = {"status": "ok", **(info or {})}

    @property
    def systems(self) -> list[str]:
        return [n for n in self.info if self.info[n]["status"] == "ok"]

    def outputs(self, name: str) -> list[np.ndarray]:
        return self._call(name, _outputs_task, name)

    def _block(self, name: str, runs: int, warmup: int) -> list[float]:
        if name in self.local:
            return _warm_then_time(self.local[name], runs, warmup)
        return self._call(name, _time_task, name, runs, warmup)

    def _quiet(self, name: str) -> float:
        """Wait until system `name`'s process uses no CPU (at most QUIET_MAX_S); the seconds waited."""
        pid = os.getpid() if name in self.local else self.pools[name].pids()[0]
        t0 = time.monotonic()
        try:
            last = cpu_ticks(pid)
            while time.monotonic() - t0 < QUIET_MAX_S:
                time.sleep(QUIET_WINDOW_S)
                now, runnable = _threads(pid)
                if now == last and not runnable:  # (a thread starved of cores uses no CPU but is not asleep)
                    break
                last = now
        except OSError:  # no /proc (or the process is gone): nothing to wait for
            pass
        return time.monotonic() - t0

    def block_lasting(self, seconds: float, least: int = 3) -> int:
        """Timed runs per turn (`rounds`' block) that make the fastest system's turn last about
        `seconds`, never fewer than `least`: each system's call timed once, after its warm-up. A
        turn of 3 calls of 0.7 ms is at the mercy of one interruption: two kernorch executables of
        gpt_like at seq=7, each in its own process, their 15 round ratios spread 0.91-1.77 in turns
        of 3 calls and 0.98-1.11 in turns of 30 (medians 1.057 and 1.061; Xeon model 167)."""
        once = []
        for name in self.systems:
            try:
                once.append(min(self._block(name, 1, 1)))
            except KernorchError:  # (a system that fails here fails again in `rounds`, which reports it)
                continue
        return max(least, math.ceil(seconds / max(min(once), 1e-6))) if once else least

    def rounds(self, rounds: int, block: int = 3, warmup: int = 1, max_seconds: float = 120.0) -> dict[str, list[float]]:
        """`rounds` turns of `block` timed runs per system (after `warmup` untimed ones lasting at
        least WARMUP_S), starting system rotated each round; a system slower than `max_seconds` in
        all stops after 3 runs."""
        times: dict[str, list[float]] = {n: [] for n in self.systems}
        active = list(times)
        for r in range(rounds):
            if not active:
                break
            k = r % len(active)
            for name in active[k:] + active[:k]:
                try:
                    times[name].extend(self._block(name, block, warmup))
                except KernorchError as e:
                    self.info[name].update(status="failed", error=f"timing: {e}"[:2000])
                    active.remove(name)
                    continue
                waited = self._quiet(name)
                self.info[name]["quiet_wait_s"] = max(self.info[name].get("quiet_wait_s", 0.0), round(waited, 3))
            for name in list(active):
                if sum(times[name]) > max_seconds and len(times[name]) >= 3:
                    log.warning("%s: stopping after %d runs (%.0f s)", name, len(times[name]), sum(times[name]))
                    self.info[name]["stopped_early"] = True
                    active.remove(name)
        return times


def round_ratios(times: dict[str, list[float]], num: str, den: str, block: int) -> list[float]:
    """Per round of `Timer.rounds` (`block` runs of each system in turn): the median of `num`'s
    runs over the median of `den`'s. Two systems timed in one round ran seconds apart; rounds run
    minutes apart. On the 2-core VMs this project is measured on, the machine spends seconds to a
    minute at a time running compute 1.5x slower (timed in turns for a minute: the same GEMM
    1877 or 2809 us depending on the phase), so medians taken over all rounds compare systems
    that met different phases; the median of these ratios compares them in the same one."""
    a, b = times.get(num, []), times.get(den, [])
    n = min(len(a), len(b)) // block
    return [float(np.median(a[i * block:(i + 1) * block]) / np.median(b[i * block:(i + 1) * block]))
            for i in range(n)]


REPLICA = "#"  # a system timed in several processes: "name#0", "name#1", ... (`median_replicas`)


def median_replicas(times: dict[str, list[float]], block: int) -> dict[str, list[float]]:
    """`times` of systems each timed in several processes of its own (labels "name#k"), as one
    system per name: in each round, the runs of the replica whose median is the median of the
    replicas' (the lower middle of an even count); other labels pass through. Rounds some replica
    lacks are dropped. Why: at short lengths a process keeps its own speed for its lifetime, and
    one in a few runs every call 5-14 % slower than copies of itself (the transformer block's
    executable at seq=1, three or four processes of the same files timed in turns, Xeon model 167):
    one process per system puts that luck into every ratio."""
    groups: dict[str, list[list[float]]] = {}
    out: dict[str, list[float]] = {}
    for label, runs in times.items():
        name, sep, _ = label.rpartition(REPLICA)
        if sep:
            groups.setdefault(name, []).append(runs)
        else:
            out[label] = list(runs)
    for name, reps in groups.items():
        merged: list[float] = []
        for i in range(min(len(r) for r in reps) // block):
            blocks = sorted((r[i * block:(i + 1) * block] for r in reps), key=lambda b: float(np.median(b)))
            merged += blocks[(len(blocks) - 1) // 2]
        out[name] = merged
    return out


def paired_ratio(times: dict[str, list[float]], num: str, den: str, block: int) -> float:
    """`num`'s time over `den`'s: the median of their `round_ratios`, or without a whole round, the
    ratio of their medians."""
    r = round_ratios(times, num, den, block)
    return float(np.median(r)) if r else float(np.median(times[num]) / np.median(times[den]))


def stats(times_s) -> dict:
    ms = np.asarray(times_s) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()), "runs": int(ms.size)}


def time_against_ort(compiled, model, threads: int, runs: int = 20, seed: int = 0) -> dict:
    """The executable just built (timed in this process) against ONNX Runtime in a process of its
    own, in alternating blocks: medians, runs, threads and the load, for `optimize`'s summary (its
    speedup compared round by round, `round_ratios`)."""
    from . import executor
    feeds = executor.random_feeds(compiled.example_graph, seed)
    block = 2
    with Timer(threads) as t:
        t.add_local("kernorch", compiled.bind(feeds))
        info = t.add("ort", model if isinstance(model, (str, Path)) else _proto(model).SerializeToString(), feeds)
        if info["status"] != "ok":
            raise KernorchError(f"ONNX Runtime could not run the model for the comparison: {info.get('error')}")
        before = load_state()
        times = t.rounds(max(1, runs // block), block)
    k_ms, o_ms = (float(np.median(times[n])) * 1e3 for n in ("kernorch", "ort"))
    return {"runs": len(times["kernorch"]), "threads": threads, "kernorch_ms": k_ms, "ort_ms": o_ms,
            "speedup": paired_ratio(times, "ort", "kernorch", block),
            "method": f"ONNX Runtime alone in its own process, blocks of {block} runs in turn; the speedup is "
                      "the median of the per-round ratios",
            "kernorch_runs_ms": [x * 1e3 for x in times["kernorch"]], "ort_runs_ms": [x * 1e3 for x in times["ort"]],
            "load_before": before, "load_after": load_state()}
