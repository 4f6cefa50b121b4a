"""Frozen options, and the hardware target described as data.

A `Machine` says what the optimizer may assume about the hardware (cores, SIMD width, caches,
peak rates); its `fingerprint` keys the profile database so measurements never leak between
machines or thread counts.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def physical_cores() -> int:
    try:
        import psutil
        n = psutil.cpu_count(logical=False)
        if n:
            return int(n)
    except Exception:
        pass
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Machine:
    """A CPU target as data. Peak rates are nominal until `kernorch.calibrate` measures them."""

    name: str
    isa: tuple[str, ...]
    cores: int
    simd_bits: int
    l1d_kib: int = 48
    l2_kib: int = 1024
    l3_kib: int = 32768
    peak_gflops: float = 430.0      # fp32, all cores (machine-notes: OpenBLAS AVX-512 on this CPU)
    bandwidth_gbs: float = 40.0     # bytes read + written per second
    kind: str = "llvm"

    @staticmethod
    def host() -> "Machine":
        info = _cpuinfo()
        flags = set(info.get("flags", "").split())
        isa = tuple(sorted(f for f in flags if f.startswith(("avx", "fma", "sse4", "amx"))))
        simd = 512 if "avx512f" in flags else 256 if "avx2" in flags else 128
        return Machine(name=info.get("model name", platform.processor() or platform.machine()), isa=isa,
                       cores=physical_cores(), simd_bits=simd)

    def fingerprint(self, threads: int) -> str:
        """CPU model, ISA, cores and threads: what makes a measurement transferable."""
        blob = json.dumps([self.kind, self.name, self.isa, self.cores, threads], sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def to_json(self) -> dict:
        return asdict(self)


def default_db_path() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernorch")) / "profiles.sqlite"


@dataclass(frozen=True)
class Options:
    """Everything a run may be told. Frozen: derive variants with `with_(...)`."""

    threads: int = field(default_factory=physical_cores)
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    db_path: str | None = None          # None: the user's cache directory
    max_partition: int = 48             # prims per partition (automatic cuts)
    max_kernel_size: int = 8            # prims per candidate kernel (a LayerNorm is 9, a softmax 5)
    max_candidates: int = 1500          # per partition
    max_outputs: int = 2                # outputs per candidate kernel
    workers: int = 2                    # build processes
    build_timeout: float = 120.0        # seconds per kernel build
    run_timeout: float = 60.0           # seconds per kernel timing
    repeats: int = 5                    # timing repeats (median taken)
    min_repeat_ms: float = 10.0
    solver_time_limit: float = 60.0
    library: bool = True                # offer BLAS/im2col implementations
    select: bool = True                 # emit a plan per runtime mix, keep the fastest end to end
    select_runs: int = 7                # interleaved timed runs per mix when selecting
    context: bool = True                # learn how each implementation runs inside the executable (refine)
    remeasure: bool = False             # time every kernel again (measure.REMEASURE_TRIES); the fastest counts
    compare_untuned: int = 8            # also time this many kernels untuned, for the report
    verify: bool = True
    seed: int = 0
    budget: str | None = None           # MetaSchedule tuning: trials "200t" or time "20m"; None: no tuning
    tune_dir: str | None = None         # tuning databases (one per target); None: the user's cache directory

    def with_(self, **kw) -> "Options":
        return replace(self, **kw)

    @property
    def shape_dict(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes)

    def resolved_db(self) -> Path:
        return Path(self.db_path) if self.db_path else default_db_path()
