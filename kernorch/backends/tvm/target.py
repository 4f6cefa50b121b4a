"""Targets and threads: the LLVM target for a machine, TVM's thread pool, the versions that key
measurements."""
from __future__ import annotations

import logging
import os

import tvm
import tvm_ffi

from ...options import Machine

log = logging.getLogger(__name__)



#: LLVM's optimization level for every kernel and executable. Over 37 kernels of the transformer
#: block over seq=1..512 (GEMMs with row copies, attentions, LayerNorms; Zen 4, 2 threads, the two
#: builds alternated in one process) level 2 ran within noise of level 3 (geomean 0.995, 0.998 and
#: 0.994 of its time at seq=7, 128 and 512) and compiled and emitted them in 16.3 s against 18.0:
#: TVM schedules the vectors and unrolling itself, and level 3 adds little more than build time.
LLVM_OPT_LEVEL = 2

#: LLVM CPUs for a machine that is not this host, by its widest vector ISA (cross-compiling, tests)
_MCPU_BY_ISA = (("avx512f", "skylake-avx512"), ("avx2", "haswell"), ("avx", "sandybridge"))


def make_target(threads: int, machine=None) -> tvm.target.Target:
    """An llvm target for `machine` (default: this host, mcpu detected by LLVM, so AVX-512 is used
    where present). Another machine gets the LLVM CPU of its widest vector ISA.

    "num-cores" is required by MetaSchedule and documents the thread count the kernels are built for;
    it does NOT set the runtime thread count (see `set_threads`).
    """
    host = dict(tvm.target.Target.from_device(tvm.cpu()).export())
    config = {"kind": "llvm", "num-cores": int(threads), "opt-level": LLVM_OPT_LEVEL}
    for key in ("mtriple", "mcpu", "mattr"):
        if host.get(key):
            config[key] = host[key]
    if machine is not None and machine != Machine.host():
        config.pop("mattr", None)
        config["mcpu"] = next((cpu for flag, cpu in _MCPU_BY_ISA if flag in machine.isa), "x86-64")
    return tvm.target.Target(config)



def set_threads(n: int) -> None:
    """Run TVM kernels on `n` threads: the one place kernorch sets a thread count.

    TVM reads TVM_NUM_THREADS when its pool starts (at the first parallel call; it defaults to ONE
    thread on a 2-core x86 VM) and ignores later changes, so the variable is set first; a pool that
    already runs with another count is reconfigured with `runtime.config_threadpool(-3, n, cpus)`.
    The pool's workers spin between kernels (a sleeping pool cost 22 us per kernel boundary where a
    spinning one cost 1.4 us) and sleep soon after a run, and are not pinned to cores (see `thread_env`).
    Spawned processes inherit the variables.
    """
    n = int(n)
    os.environ.update(thread_env(n))
    current = tvm.runtime.num_threads()  # starts the pool if needed (with the variable set above)
    if current != n:
        log.info("TVM thread pool already started with %d threads; reconfiguring to %d", current, n)
        tvm.get_global_func("runtime.config_threadpool")(-3, n, [str(i) for i in range(n)])


# how many times an idle worker of TVM's pool looks for work (a sched_yield each, about 0.5 us on
# the 2-core Zen 4 VM) before it sleeps. TVM's default, 300000, kept a worker spinning a whole core
# for 100-200 ms after every run; 10000 keeps it hot between the kernels of a run and lets it sleep
# within about 5 ms after (a chain of 51 parallel kernels: 3.6-3.8 us per boundary at 300000 and
# 20000, 4.2-4.4 at 2000 and 20, 19.8 at 0)
SPIN_COUNT = 10000


def thread_env(n: int) -> dict[str, str]:
    """The environment a new process needs to run TVM kernels on `n` threads (TVM reads it when its
    pool starts, before any of the process's own code could set it), and `n` for OpenMP users.

    TVM_BIND_THREADS=0: TVM pins worker i to core i and leaves the calling thread, which runs the
    first share of every parallel loop, free to run on any core; Linux then often left it on the
    pinned worker's core, the two taking turns there (about 250 involuntary switches each in 30
    runs). On the 2-core Zen 4 VM, 8 fresh processes in turns ran transformer_block at 0.074 ms in
    4 of them and 0.040 in the others when pinned, and at 0.040-0.043 in all 8 unpinned.

    TVM_THREAD_POOL_SPIN_COUNT (SPIN_COUNT): the pool spins between kernels, and stops soon after a
    run: with TVM's default a worker burned a core for 100-200 ms after the executable returned,
    taken from whatever the user's process (or the next system a benchmark timed) ran next."""
    return {"TVM_NUM_THREADS": str(int(n)), "OMP_NUM_THREADS": str(int(n)), "TVM_BIND_THREADS": "0",
            "TVM_THREAD_POOL_SPIN_COUNT": str(SPIN_COUNT)}


def versions() -> dict:
    """Versions that change generated code: part of the profile database key."""
    return {"tvm": tvm.__version__, "tvm-ffi": tvm_ffi.__version__}


def vector_bits(target: tvm.target.Target) -> int:
    """The widest vector registers of `target`'s CPU: 512 bits with AVX-512F, 256 with AVX, else 128.

    Asked of LLVM by feature (`llvm_cpu_has_features` on the target's mcpu and mattr). TVM 0.27's
    `llvm_get_vector_width` answers 512 for every x86 CPU (znver1 and haswell included), which
    scheduled 16-lane micro-kernels on AVX2 machines whose blocked layouts hold 8 channels."""
    from tvm.target.codegen import llvm_cpu_has_features

    for feature, bits in (("avx512f", 512), ("avx", 256)):
        if llvm_cpu_has_features([feature], target):
            return bits
    return 128
