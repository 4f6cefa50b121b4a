"""This machine's ceilings, measured: peak fp32 GEMM rate and memory bandwidth, and a model's roofline.

Why measure rather than trust `Machine`'s nominal 430 GFLOP/s: the BLAS kernel that actually runs
depends on the environment (machine-notes: with OPENBLAS_CORETYPE=Haswell numpy's OpenBLAS runs
its AVX2 kernel at ~223 GFLOP/s instead of ~430), and a shared box may give less. So the
calibration records *which* OpenBLAS core type ran; a floor computed from a Haswell-kernel peak is
an honest floor for numpy on this box, not for the CPU (the result says so in "note").

The calibration takes a few seconds and is cached per machine fingerprint (CPU, ISA, cores,
threads, BLAS core type) as JSON in the user's cache directory.

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

CALIBRATION_VERSION = 1
GEMM_SIZES = ((1024, 5), (2048, 3), (3072, 2))   # (n, repeats); best rate over all
COPY_MIB = 64
COPY_REPEATS = 8
_ENV_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "TVM_NUM_THREADS")


def cache_path() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernorch")) / "calibration.json"


def blas_info() -> dict:
    """The BLAS numpy uses (threadpoolctl): library, version, core type ('SkylakeX', 'Haswell', ...)."""
    import threadpoolctl
    for lib in threadpoolctl.threadpool_info():
        if lib.get("user_api") == "blas":
            return {k: lib.get(k) for k in ("internal_api", "version", "architecture", "threading_layer", "num_threads")}
    return {}


def fingerprint(threads: int) -> str:
    """What makes a calibration transferable: the machine (as the profile DB keys it) and the BLAS kernel."""
    import hashlib
    from .options import Machine
    b = blas_info()
    blob = json.dumps([Machine.host().fingerprint(threads), b.get("internal_api"), b.get("version"),
                       b.get("architecture"), CALIBRATION_VERSION])
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def measure_gemm(threads: int) -> dict:
    """Best fp32 matmul rate over a few square sizes with exactly `threads` BLAS threads."""
    import threadpoolctl
    rng = np.random.default_rng(0)
    per_size = {}
    with threadpoolctl.threadpool_limits(limits=threads, user_api="blas"):
        for n, reps in GEMM_SIZES:
            a = rng.standard_normal((n, n), dtype=np.float32)
            b = rng.standard_normal((n, n), dtype=np.float32)
            c = np.empty((n, n), np.float32)
            np.matmul(a, b, out=c)  # warm-up: page faults, BLAS thread start
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                np.matmul(a, b, out=c)
                best = min(best, time.perf_counter() - t0)
            per_size[str(n)] = 2.0 * n ** 3 / best / 1e9
    return {"peak_gflops": max(per_size.values()), "gemm_gflops_by_size": per_size}


def measure_bandwidth() -> dict:
    """np.copyto of 64 MiB, best of a few; bandwidth counts bytes read plus bytes written."""
    n = COPY_MIB * 2 ** 20 // 4
    src = np.ones(n, np.float32)
    dst = np.zeros(n, np.float32)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(COPY_REPEATS):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return {"bandwidth_gbs": 2.0 * src.nbytes / best / 1e9, "copy_mib": COPY_MIB}


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
    blas = blas_info()
    result = {"version": CALIBRATION_VERSION, "fingerprint": key, "threads": threads, "blas": blas,
              "env": {v: os.environ[v] for v in _ENV_VARS if v in os.environ},
              "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result.update(measure_gemm(threads))
    result.update(measure_bandwidth())
    result["seconds"] = time.perf_counter() - t0
    result["load_average"] = _loadavg()
    result["cpu_pressure_avg10"] = cpu_pressure()
    result["loaded"] = machine_busy()
    if old and not force:
        # a ceiling only drops under load: keep the best of this and the cached (loaded) measurement
        for k in ("peak_gflops", "bandwidth_gbs"):
            result[k] = max(result[k], old.get(k, 0.0))
        result["loaded"] = result["loaded"] and old.get("loaded", True)
    if blas.get("architecture") == "Haswell" and "avx512f" in _cpu_flags():
        result["note"] = ("numpy's OpenBLAS ran its AVX2 (Haswell) kernel on an AVX-512 CPU (OPENBLAS_CORETYPE?): "
                          "the peak understates the CPU by about 2x")
    log.info("calibration (%d threads, BLAS %s): %.0f GFLOP/s, %.1f GB/s in %.1f s", threads,
             blas.get("architecture"), result["peak_gflops"], result["bandwidth_gbs"], result["seconds"])
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


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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
    # the nominal ceilings (machine-notes, quiet box, AVX-512 OpenBLAS) bound a loaded calibration from below
    from .options import Machine
    m = Machine.host()
    nominal_ms = max(flops / (m.peak_gflops * 1e9), nbytes / (m.bandwidth_gbs * 1e9)) * 1e3
    return {"flops": flops, "gflops": flops / 1e9, "bytes": nbytes, "compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": max(compute_ms, memory_ms), "bound": "compute" if compute_ms >= memory_ms else "memory",
            "peak_gflops": cal["peak_gflops"], "bandwidth_gbs": cal["bandwidth_gbs"],
            "blas_core": (cal.get("blas") or {}).get("architecture"), "calibrated_under_load": bool(cal.get("loaded")),
            "nominal_floor_ms": nominal_ms, "nominal_peak_gflops": m.peak_gflops}
