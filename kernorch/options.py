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


def _cache_kib() -> dict[str, int]:
    """Per-core data cache sizes from sysfs: {"l1d": KiB, "l2": KiB, "l3": KiB} (what is readable)."""
    out: dict[str, int] = {}
    for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level = (d / "level").read_text().strip()
            kind = (d / "type").read_text().strip()
            size = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        scale = 1024 if size.endswith("M") else 1
        try:
            kib = int(size.rstrip("KM")) * scale
        except ValueError:
            continue
        out["l1d" if level == "1" else f"l{level}"] = kib
    return out


#: ISA extensions a kernel compiled for this host may use; a saved model records the ones its host
#: had, and refuses to load where one is missing.
ISA_PREFIXES = ("avx", "fma", "sse4", "amx", "f16c", "bmi", "vnni")


@dataclass(frozen=True)
class Machine:
    """A CPU target as data, read from the host: ISA, vector width, register file and caches.

    The micro-kernel templates size their register tiles and cache blocks from it (never assume
    AVX-512: AVX2-only parts are among the machines this runs on), and `fingerprint` keys the
    profile database so measurements never leak between machines or thread counts.
    """

    name: str
    isa: tuple[str, ...]
    cores: int
    simd_bits: int
    l1d_kib: int = 32
    l2_kib: int = 512
    l3_kib: int = 8192
    kind: str = "llvm"
    #: vendor, family, model and stepping ("AuthenticAMD 25/1/1"): VMs name different CPUs alike
    #: ("AMD EPYC" for a Zen 1 and a Zen 3, the same AVX2 flags), and their measurements must not mix.
    cpu: str = ""

    @staticmethod
    def host() -> "Machine":
        info = _cpuinfo()
        flags = set(info.get("flags", "").split())
        isa = tuple(sorted(f for f in flags if f.startswith(ISA_PREFIXES)))
        simd = 512 if "avx512f" in flags else 256 if "avx2" in flags else 128
        caches = _cache_kib()
        cpu = " ".join(filter(None, [info.get("vendor_id", ""), "/".join(
            info[k] for k in ("cpu family", "model", "stepping") if info.get(k))]))
        return Machine(name=info.get("model name", platform.processor() or platform.machine()), isa=isa,
                       cores=physical_cores(), simd_bits=simd, l1d_kib=caches.get("l1d", 32),
                       l2_kib=caches.get("l2", 512), l3_kib=caches.get("l3", 8192), cpu=cpu)

    @property
    def lanes(self) -> int:
        """float32 lanes of one vector register."""
        return self.simd_bits // 32

    @property
    def vector_registers(self) -> int:
        """Architectural vector registers: 32 with AVX-512 (zmm0-31), 16 with AVX2/SSE."""
        return 32 if "avx512f" in self.isa else 16

    def fingerprint(self, threads: int) -> str:
        """CPU model (name, family/model/stepping, caches), ISA, cores and threads: what makes a
        measurement transferable."""
        blob = json.dumps([self.kind, self.name, self.cpu, self.isa, self.cores, self.l1d_kib, self.l2_kib,
                           self.l3_kib, threads], sort_keys=True)
        return hashlib.sha1(blob.encode()).hexdigest()[:12]

    def same_cpu(self, other: "Machine") -> bool:
        """The same CPU and ISA; `cpu` compared only where both know it (descriptions saved before
        it was read have none: their caches tell the CPUs apart)."""
        return replace(self, cpu=self.cpu or other.cpu) == replace(other, cpu=other.cpu or self.cpu)

    def to_json(self) -> dict:
        return asdict(self) | {"lanes": self.lanes, "vector_registers": self.vector_registers}

    @staticmethod
    def from_json(d: dict) -> "Machine":
        return Machine(d["name"], tuple(d["isa"]), int(d["cores"]), int(d["simd_bits"]), int(d.get("l1d_kib", 32)),
                       int(d.get("l2_kib", 512)), int(d.get("l3_kib", 8192)), d.get("kind", "llvm"), d.get("cpu", ""))


def default_db_path() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernorch")) / "profiles.sqlite"


@dataclass(frozen=True)
class Options:
    """Everything a run may be told. Frozen: derive variants with `with_(...)`."""

    threads: int = field(default_factory=physical_cores)
    shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    ranges: tuple[tuple[str, int, int], ...] = ()   # a symbolic dimension over a range: ("seq", 1, 512)
    lengths: tuple[int, ...] = ()                     # observed values of that dimension (weights the range)
    bucket_edges: tuple[int, ...] = ()                # cut the range after these values: a plan per bucket
    sample_plans: bool = False                        # a plan per sample length of the range, its kernels measured over it
    # over a range (without buckets), a sample length's own plan among the kernels measured serves the
    # lengths nearest it where it is predicted this much faster there than the one plan (pipeline.
    # sample_plans); 0: one plan. The transformer block over seq=1..512 (Xeon model 167, 2 threads):
    # the plan of 512, predicted 4.2 % faster there, ran 6.6 % faster at 512 and 2.9 % at 300; the
    # plans of 8 and 64, predicted 0.4-0.5 % faster, ran 5.6 % slower at 8 and 2.9 % at 32. At 3 % (the
    # same machine type, s64) the plan of 512 was predicted 3.2-3.3 % faster in two cold optimizes and
    # kept (4.3-4.5 % faster at 512), under 3 % in the benchmark's run (one plan: 1.10x the static plan
    # at 512); at 2 % two cold runs kept it, 1.00-1.02x the static plan there, optimize 0.44-0.46
    # against 0.41 (the screen and the dispatch time each own plan before it stays)
    sample_gain: float = 0.02
    # over a range: the packed tiles with rows outside also run with the columns outside and
    # kept where the executable runs them faster (executed.measured_loop_order)
    loop_order: bool = True
    # over a range, the last bucket's packed GEMMs in the tile family their contractions ran fastest
    # in there, kept where the executable runs faster so (executed.measured_long_tiles)
    long_tiles: bool = True
    # lengths a range is timed at (dynamic.points: 1, 8, 64, 512 over 1..512). Three (1, 23, 512) left
    # seq=7 to the plan of 23: a transformer block's one plan ran 1.21-1.30x the static plan there in
    # three builds, with four 1.08-1.15x in two (Zen 5, 2 threads), the other lengths alike. Per
    # symbol; None: 4, or 3 each when several symbols vary (their every combination is timed: gpt_like
    # over batch=1..8 x seq=1..512, Zen 2, cold, measured in 187 s at 16 samples, 99 s at 9)
    samples: int | None = None
    # the weights of the lengths a range is timed at (dynamic.samples), set by the pipeline from the
    # model: each length counts by its time relative to the model's floor there (dynamic.relative_weights)
    sample_weights: tuple[float, ...] = ()
    # set by the pipeline from the model (measure.weights_fit): its weights stay in the last-level
    # cache between inferences, so its kernels are timed with them there, not flushed to memory
    weights_cached: bool = False
    db_path: str | None = None          # None: the user's cache directory
    max_partition: int = 48             # prims per partition (automatic cuts)
    max_kernel_size: int = 8            # prims per candidate kernel (a softmax is 5), not counting...
    max_pointwise: int = 4              # ...elementwise prims computed from its own values: this many more
    max_candidates: int = 1500          # per partition
    max_outputs: int = 2                # outputs per candidate kernel
    workers: int = 2                    # build processes
    build_timeout: float = 120.0        # seconds per kernel build
    run_timeout: float = 60.0           # seconds per kernel timing
    repeats: int = 5                    # timing repeats (median taken)
    min_repeat_ms: float = 10.0
    # seconds per solve: the exact solve that ends a run must not stop at the heuristic start (segformer_b0,
    # Zen 4: a cold run's last solve stopped at 60 s with a plan 3.6 % above the optimum a later run proved)
    solver_time_limit: float = 300.0
    python_kernels: bool = False        # allow operators kept whole to run as Python callbacks (backends.registry)
    rewrites: bool = True               # algebraic rewrites that remove FLOPs before fission (kernorch.rewrite)
    layouts: bool = True                # offer blocked-layout (nChw16c) variants and conversions to the solver
    prune: bool = True                  # measure a fused kernel only when the solver wants it (estimate first)
    cost_model: str = "learned"         # pruning's estimates: "learned" (kernorch.costmodel) or "analytic" (kernorch.estimate)
    remeasure: bool = False             # time every kernel again (measure.REMEASURE_TRIES); the fastest counts
    compare_untuned: int = 8            # also time this many kernels untuned, for the report
    verify: bool = True
    seed: int = 0
    budget: str | None = None           # MetaSchedule tuning: trials "200t" or time "20m"; None: no tuning
    tune_dir: str | None = None         # tuning databases (one per target); None: the user's cache directory

    def with_(self, **kw) -> "Options":
        return replace(self, **kw)

    @property
    def sample_count(self) -> int:
        """The samples per symbol a range is timed at: `samples`, or 4, or 3 each with several symbols."""
        return self.samples if self.samples is not None else 3 if len(self.ranges) > 1 else 4

    @property
    def shape_dict(self) -> dict[str, tuple[int, ...]]:
        return dict(self.shapes)

    def resolved_db(self) -> Path:
        return Path(self.db_path) if self.db_path else default_db_path()

    def executable_cache(self) -> Path:
        """Where compiled executables are kept for a re-optimize (beside the profile database)."""
        db = self.resolved_db()
        return db.with_name(db.name + ".executables")

    def object_cache(self) -> Path:
        """Where the builders keep each kernel's object file for the executable to link."""
        return self.executable_cache() / "objects"
