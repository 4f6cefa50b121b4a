"""This machine's ceilings, measured: peak fp32 GEMM rate and memory bandwidth, and a model's roofline.

The peak is measured with kernorch's own micro-kernel (a packed-weight GEMM, every register tile the
machine allows, the fastest kept), not with numpy's BLAS: the BLAS that numpy runs depends on the
environment (with OPENBLAS_CORETYPE=Haswell, OpenBLAS runs its AVX2 kernel at half speed on an
AVX-512 CPU), and the generated kernels are what kernorch runs.

The calibration takes a few seconds and is cached per machine fingerprint (CPU, ISA, cores,
threads) as JSON in the user's cache directory.

    cal = calibrate(threads=2)            # {"peak_gflops": ..., "bandwidth_gbs": ..., ...}
    rf = roofline(graph, cal)             # {"flops": ..., "bytes": ..., "floor_ms": ..., "bound": ...}
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

CALIBRATION_VERSION = 5  # 5: the last level's capacity, measured (`measure_last_level`)
# M, K, N of the peak measurement: square, and panels that fit the L2 of every machine seen
GEMM_SHAPES = ((1024, 1024, 1024), (256, 512, 512), (512, 256, 1024))
COPY_MIB = 64
COPY_REPEATS = 8


def cache_path() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernorch")) / "calibration.json"


def fingerprint(threads: int) -> str:
    """What makes a calibration transferable: the machine, as the profile DB keys it."""
    import hashlib
    from .options import Machine
    blob = json.dumps([Machine.host().fingerprint(threads), CALIBRATION_VERSION])
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def _gemm_rates(threads: int, shapes) -> dict[str, float]:
    """GFLOP/s of kernorch's packed micro-kernel per (shape, tile) (runs in a process of its own,
    whose TVM pool starts with `threads` threads)."""
    from .backends import tvm as tb
    from .ir import Graph, TensorType, make_prim
    from .kernels import contraction_tiles, pack_args
    from .options import Machine
    rates = {}
    target = tb.make_target(threads)
    rng = np.random.default_rng(0)
    for m, k, n in shapes:
        w = rng.standard_normal((k, n), dtype=np.float32)
        x = rng.standard_normal((m, k), dtype=np.float32)
        g = Graph((("x", TensorType((m, k))),), ("y",), (make_prim("y", "matmul", ["x", "w"], TensorType((m, n))),),
                  {"w": w})
        for tile in contraction_tiles(Machine.host(), m, n, k, pack=True):
            kernel = tb.build(tb.schedule(tb.lower(g, g.prims, ["x", "w"], ["y"], tile.name), target, tile.name), target)
            secs = kernel.time(*pack_args(g, ["x", "w"], tile.name, [x, w]), number=3, repeat=5)
            rates[f"{m}x{k}x{n} {tile.name}"] = 2.0 * m * n * k / min(secs) / 1e9
    return rates


def measure_gemm(threads: int, shapes=GEMM_SHAPES) -> dict:
    """The best fp32 GEMM rate of kernorch's packed micro-kernel over a few shapes and every register
    tile the machine allows, measured in a fresh process with `threads` TVM threads."""
    from .backends.tvm import thread_env
    from .workers import WorkerPool
    with WorkerPool(1, thread_env(threads)) as pool:
        r = pool.call(_gemm_rates, (threads, shapes), 600)
    if not r.ok:
        raise RuntimeError(f"measuring the GEMM peak failed: {r.error}")
    best = max(r.value, key=r.value.get)
    return {"peak_gflops": r.value[best], "peak_kernel": best, "gemm_gflops_by_tile": r.value}


# A chain of BOUNDARY_CHAIN small kernels, BOUNDARY_FLOATS floats each (in L1), measures a kernel
# boundary: what a kernel costs inside the executable beyond its time measured alone.
BOUNDARY_CHAIN = 21
BOUNDARY_FLOATS = 4096


def chain_model(n: int, size: int):
    """A graph of `n` elementwise steps (x * 1.0001 + 0.5 on `size` floats) and its plan of one
    kernel per step, in order: what a kernel boundary costs, measured end to end."""
    from .ir import Graph, TensorType, make_prim
    from .plan import Kernel, Plan, SolverStats
    t = TensorType((size,))
    prims, prev = [], "x"
    for i in range(n):
        m, a = f"m{i}", f"a{i}"
        prims += [make_prim(m, "mul", [prev, "c"], t), make_prim(a, "add", [m, "d"], t)]
        prev = a
    consts = {"c": np.full((1,), 1.0001, np.float32), "d": np.full((1,), 0.5, np.float32)}
    g = Graph((("x", t),), (prev,), tuple(prims), consts)
    kernels = []
    for i in range(n):
        members = (prims[2 * i].name, prims[2 * i + 1].name)
        ins = tuple(dict.fromkeys(x for m in members for x in g.by_name[m].inputs if x not in members))
        kernels.append(Kernel(f"k{i}", f"key{i}", "tvm", members, ins, (members[-1],), 0, (), "default"))
    return g, Plan(tuple(kernels), (), (prev,), SolverStats("optimal", 0, 0, 0.0, 0.0, 0))


def time_chain(n: int, size: int, threads: int, repeats: int = 7, min_repeat_s: float = 0.002) -> float:
    """Seconds per end-to-end call of the executable of `chain_model(n, size)` (median of `repeats`
    repeats of at least `min_repeat_s`, after 100 untimed calls; from Python as CompiledModel
    calls it)."""
    from .backends.tvm import relax as rx
    from .timing import time_repeats
    g, plan = chain_model(n, size)
    x = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    call = rx.build_executable(g, plan, threads).bind({"x": x})
    for _ in range(100):
        call()
    return float(np.median(time_repeats(call, repeats, min_repeat_s)))


def _boundary_seconds(threads: int, n: int, size: int) -> dict:
    """A kernel boundary: the chain's time per kernel, less one step's kernel timed alone as the
    profile database times a kernel without weights (runs in a process of its own)."""
    from .backends import tvm as tb
    from .options import Options
    g, plan = chain_model(1, size)
    target = tb.make_target(threads)
    step = tb.build(tb.schedule(tb.lower(g, g.prims, ["x", "c", "d"], list(g.outputs), "default"), target, "default"),
                    target)
    x = np.random.default_rng(0).standard_normal(size).astype(np.float32)
    alone = float(np.median(step.time(x, g.constants["c"], g.constants["d"], number=1, repeat=Options.repeats,
                                      min_repeat_ms=int(Options.min_repeat_ms))))
    per_kernel = (time_chain(n, size, threads) - time_chain(1, size, threads)) / (n - 1)
    return {"boundary_ns": max(0.0, per_kernel - alone) * 1e9, "boundary_step_alone_ns": alone * 1e9,
            "boundary_step_in_chain_ns": per_kernel * 1e9}


def measure_boundary(threads: int, n: int = BOUNDARY_CHAIN, size: int = BOUNDARY_FLOATS) -> dict:
    """What a kernel costs inside the executable beyond its time alone, measured in a fresh process
    with `threads` TVM threads: the VM's call and its bookkeeping (the chain's kernels are serial;
    a parallel kernel's launch is paid when it is timed alone as well). The orchestration program
    adds it to every kernel: a plan's prediction then counts its kernel boundaries."""
    from .backends.tvm import thread_env
    from .workers import WorkerPool
    with WorkerPool(1, thread_env(threads)) as pool:
        r = pool.call(_boundary_seconds, (threads, n, size), 600)
    if not r.ok:
        raise RuntimeError(f"measuring the kernel boundary failed: {r.error}")
    return r.value


def _best_seconds(fn, repeats: int) -> float:
    """The least wall time of `repeats` calls of `fn`, after one call that brings its data in."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth() -> dict:
    """np.copyto of 64 MiB, best of a few; bandwidth counts bytes read plus bytes written."""
    n = COPY_MIB * 2 ** 20 // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)
    best = _best_seconds(lambda: np.copyto(dst, src), COPY_REPEATS)
    return {"bandwidth_gbs": 2.0 * src.nbytes / best / 1e9, "copy_mib": COPY_MIB}


# the sweep of `measure_last_level`: buffers from LAST_LEVEL_FROM times L2 up to LAST_LEVEL_TO MiB,
# each 1.5x or 4/3 the one before (4x, 6x, 8x, 12x L2, ...), read LAST_LEVEL_READS times after one
# read that brings it in
LAST_LEVEL_FROM = 4
LAST_LEVEL_TO = 512
LAST_LEVEL_READS = 4


def last_level_sizes(l2_kib: int, top_mib: int = LAST_LEVEL_TO) -> list[int]:
    """The buffer sizes (KiB) the last level is swept with: 4x L2, 6x, 8x, 12x, ... up to `top_mib`."""
    sizes, k = [], LAST_LEVEL_FROM * l2_kib
    while k <= top_mib * 1024:
        sizes.append(k)
        k = k * 3 // 2 if len(sizes) % 2 else k * 4 // 3
    return sizes


def knee_kib(sizes_kib, gbs) -> int | None:
    """The largest buffer read at least halfway between the smallest one's bandwidth (in the last
    level) and the largest one's (from memory): the last level's capacity as a stream of reads finds
    it. None where the largest is read at more than 4/5 of the smallest's rate (no level to see)."""
    first, last = gbs[0], gbs[-1]
    if last > 0.8 * first:
        return None
    mid = (first + last) / 2
    held = [k for k, g in zip(sizes_kib, gbs) if g >= mid]
    return max(held) if held else None


def measure_last_level(l2_kib: int, l3_kib: int) -> dict:
    """The last-level cache as a model's weights find it: one thread reads buffers of growing size
    over and over (np.dot of a buffer with itself, best of LAST_LEVEL_READS), and the capacity is
    where the rate falls from the cache's towards memory's (`knee_kib`). A VM's sysfs reports the
    host's whole L3 (Xeon family 6 model 167: 480 MiB) where its neighbours share it: there the
    rate fell from 26-29 GB/s at up to 48 MiB to 21 at 64 and 16 (memory) at 96, in another run
    from 29 at 32 MiB to 18.5 at 48 (`measure.weights_fit` takes a share of it). The sweep stops at
    twice the reported size (at most LAST_LEVEL_TO MiB); without a knee, the reported size."""
    top = min(LAST_LEVEL_TO, max(2 * l3_kib // 1024, 4 * LAST_LEVEL_FROM * l2_kib // 1024))
    sizes = last_level_sizes(l2_kib, top)
    gbs = []
    for k in sizes:
        a = np.ones(k * 1024 // 4, np.float32)
        gbs.append(a.nbytes / _best_seconds(lambda: np.dot(a, a), LAST_LEVEL_READS) / 1e9)
        del a
    knee = knee_kib(sizes, gbs) if len(sizes) >= 3 else None
    return {"last_level_kib": min(l3_kib, knee) if knee else l3_kib,
            "last_level_sweep": [[k, round(g, 1)] for k, g in zip(sizes, gbs)]}


def _load_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def calibrate(threads: int = 2, force: bool = False, path: Path | None = None) -> dict:
    """Peak GEMM rate and bandwidth of this machine for `threads` threads (cached unless `force`)."""
    path = path or cache_path()
    key = fingerprint(threads)
    cache = _load_cache(path)
    old = cache.get(key)
    if old and not force and not (old.get("loaded") and not machine_busy()):
        return old
    t0 = time.perf_counter()
    result = {"version": CALIBRATION_VERSION, "fingerprint": key, "threads": threads,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result.update(measure_gemm(threads))
    result.update(measure_bandwidth())
    result.update(measure_boundary(threads))
    from .options import Machine
    host = Machine.host()
    result.update(measure_last_level(host.l2_kib, host.l3_kib))
    result["seconds"] = time.perf_counter() - t0
    result["load_average"] = _loadavg()
    result["cpu_pressure_avg10"] = cpu_pressure()
    result["loaded"] = machine_busy()
    if old and not force:
        # a ceiling only drops under load: keep the best of this and the cached (loaded) measurement
        for k in ("peak_gflops", "bandwidth_gbs"):
            result[k] = max(result[k], old.get(k, 0.0))
        # the boundary enters every kernel's cost: the first one measured stays, so that plans (and
        # the block solutions the database keeps for them) do not move with a re-calibration
        result["boundary_ns"] = old.get("boundary_ns", result["boundary_ns"])
        # so does the last level: it decides how a model's kernels are timed, and their namespace
        result["last_level_kib"] = old.get("last_level_kib", result["last_level_kib"])
        result["loaded"] = result["loaded"] and old.get("loaded", True)
    log.info("calibration (%d threads): %.0f GFLOP/s (%s), %.1f GB/s, kernel boundary %.2f us, last level %d MiB "
             "in %.1f s", threads, result["peak_gflops"], result["peak_kernel"], result["bandwidth_gbs"],
             result["boundary_ns"] / 1e3, result["last_level_kib"] // 1024, result["seconds"])
    cache[key] = result
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError as e:  # a read-only cache dir must not break a benchmark
        log.warning("cannot cache the calibration in %s: %s", path, e)
    return result


def cpu_pressure() -> float | None:
    """/proc/pressure/cpu "some avg10": % of the last 10 s some task waited for a CPU (None if unavailable)."""
    try:
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                return float(dict(f.split("=") for f in line.split()[1:])["avg10"])
    except (OSError, KeyError, ValueError):
        pass
    return None


def machine_busy(threshold_pct: float = 10.0) -> bool:
    """Were other tasks waiting for a CPU just now? Then measured ceilings are too low to keep for good."""
    p = cpu_pressure()
    if p is not None:
        return p > threshold_pct
    la = _loadavg()
    return la is not None and la > 0.5


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def graph_flops(graph) -> float:
    """Sum of every primitive's FLOPs (the primitive table's own count; opaque ops count one per output)."""
    from . import primitives
    total = 0.0
    for p in graph.prims:
        ins = [graph.type_of(t) for t in p.inputs]
        total += float(primitives.get(p.op).flops(ins, p.type, p.a))
    return total


def min_traffic_bytes(graph) -> int:
    """The unavoidable memory traffic: read every graph input and weight once, write every output once."""
    seen = set()
    total = 0
    for n, t in graph.inputs:
        seen.add(n)
        total += t.nbytes
    for n, c in graph.constants.items():
        if n not in seen:
            seen.add(n)
            total += int(np.asarray(c).nbytes)
    for o in dict.fromkeys(graph.outputs):
        total += graph.type_of(o).nbytes
    return total


def roofline(graph, calibration: dict | None = None, threads: int = 2) -> dict:
    """The roofline floor of a primitive graph: max(FLOPs / peak, bytes / bandwidth), and which bound it is."""
    cal = calibration or calibrate(threads)
    flops = graph_flops(graph)
    nbytes = min_traffic_bytes(graph)
    compute_ms = flops / (cal["peak_gflops"] * 1e9) * 1e3
    memory_ms = nbytes / (cal["bandwidth_gbs"] * 1e9) * 1e3
    return {"flops": flops, "gflops": flops / 1e9, "bytes": nbytes, "compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms), "bound": "compute" if compute_ms >= memory_ms else "memory",
            "peak_gflops": cal["peak_gflops"], "bandwidth_gbs": cal["bandwidth_gbs"],
            "peak_kernel": cal.get("peak_kernel"), "calibrated_under_load": bool(cal.get("loaded"))}
