"""Measure what each distinct candidate kernel costs on this machine.

Discipline: the profile database first (nothing measured twice); then builds in parallel worker
processes (lower + schedule or micro-kernel tile + compile + check against the numpy reference of
the kernel's primitives); then timing, one kernel at a time in one worker process so builds never
disturb timings (warm-up, `repeats` repeats, median; threads set explicitly). A kernel variant
whose constant operand is packed (kernorch.kernels) is built, checked and timed with the packed
array, exactly as the executable will call it. A kernel that fails its build or its check, crashes
or hangs is recorded as refused, with the reason, and never chosen.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import shutil
import socket
import tempfile
import time
import zlib
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from . import __version__, masks, primitives, progress
from .database import Measurement, ProfileDB
from .database import best as best_of
from .timing import time_repeats
from .ir import Graph, KernorchError, structural_key
from .options import Machine, Options
from .workers import WorkerPool, start_server
from .backends import registry
from .kernels import pack_args, unpack_outputs, variant_out_packs

log = logging.getLogger(__name__)

DOMINATED = 4.0  # a generated kernel this many times slower than the key's best is timed once
# --remeasure: every kernel is timed again until it has REMEASURE_TRIES measurements, and the
# fastest counts. Disturbed timings are not always visible in their repeats: on this shared 2-core
# machine a 128x384x1536 GEMM was stored at 2021 us by a run under load, repeats within 10 %, and
# measured 856 us on a quiet machine (ONNX Runtime's: 711 and 908 us).
REMEASURE_TRIES = 3
RTOL, ATOL_SCALE = 1e-3, 1e-4
TIMING_PROTOCOL = "cold-weights-big-outputs-half-l2-unpinned-spin10k-same-tensors-evict-always"  # in the versions: how a kernel was timed (see _timed; threads: thread_env)
# the count of samples a range's namespace does not name (what ranges were timed at before
# Options.samples): without observed lengths or weights, only other counts name their lengths
UNNAMED_SAMPLES = 3
COLD_MAX_CALLS = 200  # calls of a kernel timed with its weights or large outputs flushed (one call per repeat)


@dataclass(frozen=True)
class KernelJob:
    """One (kernel, implementation, schedule) to measure. `graph` is the kernel alone: its prims,
    its non-constant inputs as graph inputs, the weights it reads as constants."""

    key: str
    impl: str
    schedule: str
    graph: Graph
    inputs: tuple[str, ...]   # parameter order: every tensor read from outside, weights included
    outputs: tuple[str, ...]
    # a kernel over a symbolic dimension (kernorch.dynamic): the (binding, weight) pairs it is
    # checked and timed at; its time is the weighted sum
    samples: tuple[tuple[tuple[tuple[str, int], ...], float], ...] = ()
    bounds: tuple[tuple[str, int], ...] = ()   # and the largest value of each symbol it serves
    # more bindings to time it at, with weight 0 (seen in its Measurement.samples_ns, not counted)
    probes: tuple[tuple[tuple[str, int], ...], ...] = ()

    def at(self, binding) -> "KernelJob":
        """This kernel's static instance at `binding`."""
        from .dynamic import bind
        return replace(self, graph=bind(self.graph, dict(binding)), samples=(), bounds=())

    @property
    def ident(self) -> tuple[str, str, str]:
        return (self.key, self.impl, self.schedule)

    @property
    def lengths(self) -> tuple[int, ...] | None:
        """The values of its one symbol it is checked and timed at (None: static, or several symbols):
        the only lengths its measured build runs at (kernorch.backends.tvm.schedule's `at`)."""
        if len(self.bounds) != 1 or not self.samples:
            return None
        return tuple(sorted({v for binding, _ in self.samples for _, v in binding}))

    @property
    def description(self) -> str:
        return describe(self.graph.prims)


def describe(prims) -> str:
    return "+".join(p.op for p in prims)


@functools.lru_cache(maxsize=None)
def versions(impl: str) -> str:
    """The versions that make a measurement reusable."""
    import importlib.metadata as md
    if not registry.native(impl):  # the reference evaluator
        return f"kernorch-{__version__};onnx-{md.version('onnx')};numpy-{np.__version__}"
    from .backends.tvm.schedule import SCHEDULES_VERSION
    try:
        tvm_v = md.version("apache-tvm")
    except md.PackageNotFoundError:
        tvm_v = "?"
    return f"kernorch-{__version__};tvm-{tvm_v};schedules-{SCHEDULES_VERSION};timing-{TIMING_PROTOCOL}"


# ---------------------------------------------------------------------------------------------
# inputs and the reference check (run inside workers)
# ---------------------------------------------------------------------------------------------

_NOISE = np.empty(0, np.float32)
NOISE_SPAN = 1 << 20  # offsets into the noise buffer


def _noise(n: int) -> np.ndarray:
    """At least `n` + NOISE_SPAN read-only uniform values in [0.1, 1), drawn once per process and
    grown when a larger tensor asks: the same seed, so the values at a position never change."""
    global _NOISE
    if _NOISE.size < n + NOISE_SPAN:
        size = max(n + NOISE_SPAN, 2 * _NOISE.size)
        x = np.random.default_rng(0).random(size, dtype=np.float32)
        x *= 0.9
        x += 0.1
        x.setflags(write=False)
        _NOISE = x
    return _NOISE


def make_inputs(job: KernelJob, seed: int = 0) -> list[np.ndarray]:
    """Random inputs in a safe domain (positive floats: sqrt/log/pow/div stay finite), real weights.

    A float input is a read-only view of one process-wide buffer of random values, at an offset
    drawn from the kernel's key: drawing them afresh cost 26 ms of a segformer_b0 kernel's 0.25 s
    (its kernels read 6.6 M elements on average), twice (the check and the timing)."""
    rng = np.random.default_rng(seed + zlib.crc32(job.key.encode()))
    out = []
    types = dict(job.graph.inputs)
    causal = masks.causal_inputs(job.graph)  # (a causal mask the kernel skips keys by: kernorch.masks)
    for t in job.inputs:
        if t in job.graph.constants:
            out.append(np.asarray(job.graph.constants[t], order="C"))
            continue
        ty = types[t]
        shape = tuple(int(d) for d in ty.shape)
        if ty.dtype.startswith("float"):
            n = math.prod(shape)
            at = int(rng.integers(0, NOISE_SPAN))
            x = _noise(n)[at:at + n].reshape(shape).astype(ty.dtype, copy=False)
            out.append(masks.impose(x) if t in causal else x)
        elif ty.dtype == "bool":
            out.append(rng.random(shape) < 0.5)
        else:
            out.append(np.zeros(shape, dtype=ty.dtype))
    return _consistent(job, out)


def _consistent(job: KernelJob, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """`inputs` with their random conditions (bool inputs) made all false, or else all true, where the
    random ones send an index out of range. A Gather's fission normalizes a negative index,
    where(index < 0, index + n, index): a kernel that takes `index < 0` as an input drew it at random
    beside zero indices, gathered row n of n, and was refused as broken (gpt_like's token
    embedding, every fusion of where and gather: 9 kernels over seq=1..512, 6 at seq=7). Random
    conditions stay wherever they are valid (an attention's mask must keep some keys); constant ones
    are the kernel's own."""
    drawn = [a.dtype == np.bool_ and t not in job.graph.constants for t, a in zip(job.inputs, inputs)]
    if not any(drawn) or _reference_runs(job, inputs):
        return inputs
    for fill in (False, True):
        alt = [np.full(a.shape, fill) if d else a for a, d in zip(inputs, drawn)]
        if _reference_runs(job, alt):
            return alt
    return inputs


def _reference_runs(job: KernelJob, inputs: Sequence[np.ndarray]) -> bool:
    try:
        reference(job, inputs)
    except IndexError:
        return False
    return True


def kernel_args(job: KernelJob, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The arrays the kernel variant takes: `inputs` with packed operands in their packed layout."""
    return pack_args(job.graph, job.inputs, job.schedule, inputs)


def written_shapes(graph, outputs: Sequence[str], schedule: str) -> list[tuple[int, ...]]:
    """The shapes of the arrays a kernel variant of static `graph` writes: each output in its layout
    (an activation blocked nChw{b}c in its packed shape). What a kernel built over a symbol is given
    to write into when it runs at one of its values."""
    packs = variant_out_packs(graph, outputs, schedule)
    return [tuple(packs[i].packed_shape) if i in packs else tuple(graph.type_of(o).shape)
            for i, o in enumerate(outputs)]


def reference(job: KernelJob, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    vals = dict(zip(job.inputs, inputs))
    for p in job.graph.prims:
        vals[p.name] = primitives.run(p, [vals[i] for i in p.inputs])
    return [vals[o] for o in job.outputs]


def check(job: KernelJob, got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> float:
    """Max error relative to each output's scale; raises if beyond tolerance."""
    worst = 0.0
    for name, g, w in zip(job.outputs, got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            raise KernorchError(f"output {name}: shape {g.shape}, reference {w.shape}")
        if w.dtype == bool or not np.issubdtype(w.dtype, np.floating):
            bad = int(np.sum(g != w))
            if bad:
                raise KernorchError(f"output {name}: {bad} elements differ from the reference")
            continue
        finite = np.isfinite(w)
        if not finite.all():  # compared where the reference is finite
            g, w = g[finite], w[finite]
        if not w.size:
            continue
        # in float32 at least, not float64 (copies of segformer_b0's outputs cost 20 ms a kernel):
        # the tolerance is far above float32's rounding of the difference; in place, few passes
        dt = np.promote_types(w.dtype, np.float32)
        g, w = g.astype(dt, copy=False), w.astype(dt, copy=False)
        err = np.subtract(g, w)
        np.abs(err, out=err)
        allowed = np.abs(w)
        scale = float(np.max(allowed))
        allowed *= RTOL
        allowed += ATOL_SCALE * max(scale, 1e-6)
        if not np.all(err <= allowed):  # a NaN or infinity in the output fails here too
            if not np.isfinite(g).all():
                raise KernorchError(f"output {name}: non-finite values where the reference is finite")
            raise KernorchError(f"output {name}: max error {float(np.max(err)):.3g} "
                                f"(output scale {scale:.3g}) exceeds tolerance")
        worst = max(worst, float(np.max(err)) / max(scale, 1e-30))
    return worst


# ---------------------------------------------------------------------------------------------
# worker tasks
# ---------------------------------------------------------------------------------------------

def _build_task(job: KernelJob, threads: int, out_dir: str, verify: bool, tune_dir: str | None = None,
                objects: str | None = None) -> dict:
    """Build, export and check one kernel; with `objects`, keep its object file there for the
    executable to link (kernorch.backends.tvm.objects)."""
    from .backends import tvm as tb
    t0 = time.perf_counter()
    target = tb.make_target(threads)
    if job.impl == "tvm-tuned":  # MetaSchedule's best record of the kernel (kernorch.tune)
        from .backends.tvm import metaschedule as tt
        mod = tt.best_module(tt.open_db(tune_dir), tb.lower(job.graph, job.graph.prims, job.inputs, job.outputs),
                             target) if tune_dir else None
        if mod is None:
            raise KernorchError(f"no valid tuning record in {tune_dir}")
        lowered = None
    else:
        lowered = tb.lower(job.graph, job.graph.prims, job.inputs, job.outputs, job.schedule)
        mod = tb.schedule(lowered, target, job.schedule, dict(job.bounds), job.lengths)
    path = str(Path(out_dir) / f"{job.key}-{job.schedule.replace('/', '_')}.so")
    keep = tb.object_path(objects, mod, target) if objects else None
    # checked as the timer will load it: no second (just-in-time) code generation
    tb.build(mod, target).export(path, keep)
    # named by what it was scheduled from too; if built for its sample lengths only, with them (the
    # executable needs the whole kernel: kernorch.backends.tvm.objects)
    if keep is not None and lowered is not None:
        sampled = job.lengths if job.lengths is not None and tb.scheduled_for_lengths(job.schedule) else None
        tb.remember_object(objects, lowered, job.schedule, dict(job.bounds), target, keep, sampled)
    kernel = tb.load(path) if verify else None
    build_s = time.perf_counter() - t0
    err = None
    if verify and job.samples:  # one build serves every length: checked at each sample
        err = 0.0
        for binding, _ in job.samples:
            bj = job.at(binding)
            inputs = make_inputs(bj)
            got = kernel(*kernel_args(bj, inputs), out_shapes=written_shapes(bj.graph, bj.outputs, bj.schedule))
            got = unpack_outputs(bj.graph, bj.outputs, bj.schedule, got)
            err = max(err, check(bj, got, reference(bj, inputs)))
    elif verify:
        inputs = make_inputs(job)
        got = unpack_outputs(job.graph, job.outputs, job.schedule, kernel(*kernel_args(job, inputs)))
        err = check(job, got, reference(job, inputs))
    return {"path": path, "build_s": build_s, "error": err}


def _time_task(job: KernelJob, path: str | None, repeats: int, min_repeat_ms: float, verify: bool,
               cutoff_s: float | None = None, big_bytes: int | None = None, evict: int = 0,
               cached: bool = False) -> dict:
    """Time one kernel. `cutoff_s`: when one call already takes longer, that single run is the
    measurement (the kernel is dominated by another implementation of the same key). `big_bytes`:
    outputs larger than this are flushed before each call too (`cold_args`). `cached`: the model's
    weights fit in the last-level cache (`weights_fit`), so they are not flushed. `evict`: each
    thread reads this many bytes (`evict_bytes`) before each call of every kernel, of weights
    flushed or not, those of activations alone too, evicting what the kernel touched from the
    cores' own caches: a kernel finds its activations in the last level,
    written by the kernel before it on other cores or pushed out by the kernels between (one of
    activations alone, timed hot, ran 2-10x that inside the model: the scores of the transformer
    block's attention at seq=8 took 2.2 us hot, 5.8 in the model, 5.4 evicted). With the same
    tensors timed throughout (`_timed`), plans of kernels all timed so ran the transformer block
    over seq=1..512 in 0.95-0.99x the time of plans whose kernels of activations alone were timed
    hot (Xeon model 167, one cold optimize each, 8 lengths in turns: 0.953 at 32, 0.965 at 1, 0.983
    at 512; 14 kernels against 17), gpt_like in 0.97-0.99x at 1-32 and the same at 128 and 512
    (53 kernels against 68)."""
    inputs = make_inputs(job) if not job.samples else []
    if not registry.native(job.impl):
        kernel = registry.python_kernel(job.impl, job.graph, job.graph.prims, job.inputs, job.outputs)
        err = check(job, kernel(*inputs), reference(job, inputs)) if verify else None
        outs = [np.empty(tuple(int(d) for d in job.graph.type_of(o).shape), job.graph.type_of(o).dtype)
                for o in job.outputs]  # preallocated, as the VM passes them
        runs = time_repeats(lambda: kernel.run_dps(*inputs, *outs), repeats, min_repeat_ms / 1e3)
        return {"runs": runs, "error": err}
    from .backends import tvm as tb
    kernel = tb.load(path)
    if job.samples:
        # per sample (binding, weight): the static instance's arguments, flushed parameters, output shapes
        at_samples = [(binding, weight, kernel_args(bj, make_inputs(bj)), cold_args(bj, big_bytes, cached=cached),
                       written_shapes(bj.graph, bj.outputs, bj.schedule))
                      for binding, weight in job.samples for bj in [job.at(binding)]]
        from .dynamic import sample_key
        length = [sample_key(binding) for binding, *_ in at_samples]
        if cutoff_s is not None:  # one call at each sample: their weighted sum against the cutoff
            firsts = [kernel.time(*args, number=1, repeat=1, cold=cold, evict=evict, out_shapes=shapes)[0]
                      for _, _, args, cold, shapes in at_samples]
            once = sum(w * t for (_, w, *_), t in zip(at_samples, firsts))
            if once > cutoff_s:
                return {"runs": [float(once)], "error": None, "cut": True,
                        "at": [(n, float(t)) for n, t in zip(length, firsts)]}
        # the weighted sum over the samples, repeat by repeat
        per_sample, at = [], []
        for n, (_, weight, args, cold, shapes) in zip(length, at_samples):
            # the timing a static kernel gets, shared among the samples (their weighted sum averages them)
            runs = _timed(kernel, args, repeats, min_repeat_ms / len(job.samples), cold, evict,
                          max_calls=COLD_MAX_CALLS // len(job.samples), out_shapes=shapes)
            per_sample.append(weight * np.array(runs))
            at.append((n, float(np.median(runs))))
        n = min(len(r) for r in per_sample)
        return {"runs": [float(r) for r in sum(r[:n] for r in per_sample)], "error": None, "at": at}
    inputs = kernel_args(job, inputs)
    cold = cold_args(job, big_bytes, cached=cached)
    if cutoff_s is not None:
        first = kernel.time(*inputs, number=1, repeat=1, cold=cold, evict=evict)
        if first[0] > cutoff_s:
            return {"runs": [float(first[0])], "error": None, "cut": True}
    return {"runs": [float(r) for r in _timed(kernel, inputs, repeats, min_repeat_ms, cold, evict)], "error": None}


def _measurement(target: str, j: KernelJob, value: dict, build_s: float) -> Measurement:
    """A successful timing (`_time_task`'s result) as the database stores it."""
    runs = [int(round(x * 1e9)) for x in value["runs"]]
    at = tuple((v, max(1, int(round(x * 1e9)))) for v, x in value.get("at", ()))
    return Measurement(target, j.key, j.impl, j.schedule, versions(j.impl), "ok", max(1, int(np.median(runs))),
                       tuple(runs), "", build_s, j.description, at)


def _faster(first: Measurement, second: Measurement) -> Measurement:
    """Two timings of one kernel: the runs of the faster, and over a range at each length the
    faster one."""
    again = dict(second.samples_ns)
    runs = min(first, second, key=lambda m: m.median_ns)
    return replace(runs, samples_ns=tuple((v, min(t, again.get(v, t))) for v, t in first.samples_ns))


def cold_args(job: KernelJob, big_bytes: int | None = None, cached: bool = False) -> list[int]:
    """The kernel's parameters (by position: inputs, then outputs) flushed from the caches before
    every timed call (see `_timed`), as the model finds them: its weights (constants), which arrive
    from memory unless the model's weights all fit in the last-level cache (`cached`, see
    `weights_fit`), and its outputs larger than `big_bytes` (`big_output_bytes`: more than the caches
    of the cores writing them hold, so in the model their lines are not in any cache and every
    store first reads its line from memory). Measured on a Xeon (family 6 model 207, 2 threads):
    segformer_b0's 16384x32 x 32x256 attention scores (16 MB) took 1.08 ms timed with the output
    warm, 2.08 ms inside the model, 1.94 ms with the output flushed."""
    weights = [] if cached else _weights(job)
    if big_bytes is None:
        return weights
    types = [job.graph.type_of(o) for o in job.outputs]
    return weights + [len(job.inputs) + i for i, t in enumerate(types) if t.static and t.nbytes > big_bytes]


def _weights(job: KernelJob) -> list[int]:
    """The positions of the kernel's weights (constants) among its parameters."""
    return [i for i, t in enumerate(job.inputs) if t in job.graph.constants]


# of the L2 of the cores writing an output, the most it may take and still be cached when the model
# writes it (the kernel's inputs and weights pass through the same caches)
OUTPUT_L2_SHARE = 0.5


def big_output_bytes(machine: Machine, threads: int) -> int:
    """The size above which a kernel's output cannot still be cached when the model writes it: half
    the L2 of the cores that write it (OUTPUT_L2_SHARE). (The last level is shared with the rest of
    the model and, on a VM, with its neighbours: the measurement above found the output as slow as
    flushed.) With the whole L2 as the limit, gpt_like's 512 x 1536 GELU (a 3 MB output, 2 threads,
    Xeon model 167, 2 x 2 MiB L2) was timed alone at 122 us warm, 214 flushed, and took 225 inside
    the model, so its plan of seq=512 kept it apart from its GEMM (1.67 + 0.12 ms timed, against
    1.87 fused; inside the model 1.98 + 0.23 against 1.84). With half: the static plans at 512 of
    gpt_like, bert_like and the transformer block ran 0.972x, 0.983x and 0.972x as long (each
    executable alone in its own process, 5 turns)."""
    return int(machine.l2_kib * 1024 * max(1, min(threads, machine.cores)) * OUTPUT_L2_SHARE)


# of the last level (as `calibrate.measure_last_level` finds it) the model's weights may take and
# still be found there from one inference to the next: the rest for its activations and, on a VM,
# the neighbours. Xeon family 6 model 167, last level measured 32-48 MiB: segformer_b0 (14 MB of
# weights) timed flushed ran 1.056x the time of its plan timed in the last level; gpt_like (30 MB)
# ran flushed-timed static plans in 0.87-1.01x the time (one cold optimize each, alternated)
LAST_LEVEL_SHARE = 0.5


def weights_fit(graph: Graph, machine: Machine, last_level_kib: int | None = None) -> bool:
    """Whether a model's weights (all its constants) stay in the last-level cache from one
    inference to the next: at most LAST_LEVEL_SHARE of it, as measured (`last_level_kib`, from the
    calibration) where that is less than the machine reports. Then its kernels find their weights
    there, not in memory, and are timed so (`evict_bytes`).

    Measured on a Xeon (family 6 model 207, 2 threads, 260 MB L3): a transformer block (7 MB of
    weights) at 7 tokens ran its kernels in the model as timed with the weights in the last level
    (its 7x1536x384 GEMM 60.5 us, timed so 62.4), not as timed flushed (159 us): the plan's kernels
    summed to 202 us so against 212 in the model, 369 flushed. On a Xeon of family 6 model 167
    (a VM: sysfs says 480 MiB, the last level measured 32-48 MiB), gpt_like (4 such layers, 30 MB
    of weights) ran its seq x 384 x 384 GEMMs at 32 rows as timed with the weights flushed: on one
    thread the tile with rows outside the column panels took 98 us in the model, 61 timed in the
    last level, 102 flushed; the one with column panels outside 62, 62 and 69 (two threads: 50, 35,
    57 and 35-39, 34.5, 42). Timed in the last level the two tied, and the range plan took the first
    (1.17x the static plan at seq=32)."""
    nbytes = sum(graph.type_of(c).nbytes for c in graph.constants)
    capacity = min(machine.l3_kib, last_level_kib) if last_level_kib else machine.l3_kib
    return nbytes <= LAST_LEVEL_SHARE * capacity * 1024


def evict_bytes(machine: Machine) -> int:
    """What each timing thread reads before a call so that the lines the kernel touched leave its
    core's own caches (twice its L1 and L2: their replacement is not exact LRU) for the last level."""
    return 2 * (machine.l1d_kib + machine.l2_kib) * 1024


def _timed(kernel, inputs, repeats: int, min_repeat_ms: float, cold: Sequence[int], evict: int = 0,
           out_shapes=None, max_calls: int = COLD_MAX_CALLS) -> list[float]:
    """Seconds per call of a built kernel, as it runs inside the model: its weights and its large
    outputs (`cold`, see `cold_args`) flushed from the caches before each call, or its weights
    evicted to the last level when the model's fit there (`evict` bytes read by each thread first,
    see `weights_fit`), its activations and smaller outputs warm (they were just written by the
    kernel before, or are buffers the executable reuses; evicting takes them to the last level
    too). Each call is one repeat, as many as `repeats` repeats of `min_repeat_ms` of wall time
    would hold, the flush included (at most `max_calls`): flushing a written 16 MB output takes
    longer than the call, and counting only the call made segformer_b0's cold optimize 2.2x
    longer. A kernel with nothing to flush or evict is timed hot, `repeats` repeats of at least
    `min_repeat_ms` each.

    Measured on gpt2_mini (2 threads, an earlier Xeon): the sum of its 86 kernels timed with the
    weights flushed, 7.43 ms, end to end 7.47 ms; timed hot, 5.9 ms. The protocol also ranks the
    tiles as the model does: the guarded 14-row tile of its 128-row GEMMs was as fast as the
    8-row one hot, and slower in the model.

    The first call and the timed ones run on the same device tensors (`BuiltKernel.tensors`): on
    tensors made afresh for the timed calls, with the caches evicted before each, the first 30 or
    so calls ran up to 1.8x slower than the rest (seq=8 x 384 x 1536, t8x32p, Xeon model 167: 84
    us falling to 44), and a kernel over a range, timed at each of its 8 lengths with an eighth
    of the calls, kept mostly those: 68-85 us stored at seq=8 where the kernel takes 47 (46-48
    timed on the same tensors; 50 inside the model with its GELU), and the optimizer took
    other tiles for it."""
    if not cold and not evict:
        return kernel.time(*inputs, number=1, repeat=repeats, min_repeat_ms=int(min_repeat_ms), out_shapes=out_shapes)
    tensors = kernel.tensors(*inputs, out_shapes=out_shapes)
    start = time.perf_counter()
    one = kernel.time(repeat=1, cold=cold, evict=evict, tensors=tensors)[0]
    per_call = time.perf_counter() - start - one  # less the warm-up call: a flush and a call
    calls = int(min(max_calls, max(repeats, repeats * min_repeat_ms / 1e3 / max(one, per_call, 1e-7))))
    return kernel.time(repeat=calls, cold=cold, evict=evict, tensors=tensors, warmup=0)


# ---------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------

@dataclass
class MeasureStats:
    jobs: int = 0
    cached: int = 0
    measured: int = 0
    refused: int = 0
    remeasured: int = 0     # of `measured`: taken again (--remeasure)
    seconds: float = 0.0
    estimated: int = 0      # fused kernels never measured: the solver never wanted them (pipeline.refine)
    rounds: int = 0         # solve-and-measure rounds until the plan held only measured kernels
    build_seconds: float = 0.0  # of `seconds`: wall time building (in parallel builders)
    time_seconds: float = 0.0   # of `seconds`: wall time timing (one timer at a time)

    def merged(self, other: "MeasureStats") -> "MeasureStats":
        return MeasureStats(*(a + b for a, b in zip(astuple(self), astuple(other))))


def worker_env(threads: int) -> dict[str, str]:
    """Workers start with TVM's thread count set (TVM reads it when its pool starts)."""
    from .backends.tvm import thread_env
    return thread_env(threads)


@dataclass(frozen=True)
class _Timed:
    """A kernel this run built and timed: what timing it again takes, and its measurement so far."""
    job: KernelJob
    path: str | None
    first: Measurement


class Workers:
    """The build and timing worker processes of a series of `measure` calls, started once (forked
    from the server that imported TVM: kernorch.workers.start_server) and closed with the context;
    with them the run's directory of built kernels, the kernels it timed (`timed`) and those to
    time once more (`again`, queued by `time_later`): the next `measure` call times them after its
    builds, or `time_again` does."""

    def __init__(self, options: Options):
        self.options = options
        start_server()  # (in the background: its imports overlap the caller's loading of the model)
        self._builders: WorkerPool | None = None
        self._timer: WorkerPool | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self._runs = 0  # runs ended (`end_run`): the current one builds into its own directory
        self.timed: dict[tuple[str, str, str], tuple[KernelJob, str | None]] = {}
        self.again: dict[tuple[str, str, str], _Timed] = {}
        self.retimed: dict[tuple[str, str, str], Measurement] = {}  # timed again by a later `measure` call

    def build_dir(self) -> str:
        """The run's directory of built kernels (removed with the workers; one a killed run left
        behind is removed by the next run on the host, `sweep_build_dirs`). Each run of the same
        workers builds into a directory of its own: a library is named by its kernel and schedule,
        and a process that loaded one path gets that library again from dlopen, whatever was
        written there since (another bucket's build of the kernel, for other bounds)."""
        if self._dir is None:
            sweep_build_dirs()
            self._dir = tempfile.TemporaryDirectory(prefix=f"{_host_build_dirs()}{os.getpid()}-",
                                                    ignore_cleanup_errors=True)
        run = Path(self._dir.name) / f"run{self._runs}"
        run.mkdir(exist_ok=True)
        return str(run)

    def time_later(self, measurements: dict) -> None:
        """Time these kernels (ident -> their measurement so far) once more, later in the run
        (those it timed since the last call); the libraries of the others are removed."""
        for i, (job, path) in self.timed.items():
            if i in measurements:
                self.again.setdefault(i, _Timed(job, path, measurements[i]))
            elif path is not None and i not in self.again:
                for f in (path, path + ".json"):
                    Path(f).unlink(missing_ok=True)
        self.timed = {}

    def take_retimed(self) -> dict[tuple[str, str, str], Measurement]:
        """The measurements of the kernels a later `measure` call timed again (the faster timing
        of each), once: the run folds them into what it knows."""
        out, self.retimed = self.retimed, {}
        return out

    def builders(self) -> WorkerPool:
        if self._builders is None:
            # one thread each: a builder only runs a kernel to check it, and two builders whose TVM
            # pools spin 2 threads each on 2 cores took 35-45 % longer (segformer_b0, Zen 4)
            self._builders = WorkerPool(self.options.workers, worker_env(1), preload=True)
        return self._builders

    def timer(self) -> WorkerPool:
        if self._timer is None:
            self._timer = WorkerPool(1, worker_env(self.options.threads), preload=True)
        return self._timer

    def end_run(self) -> None:
        """Forget what the run queued to time again (as closing does): the processes stay for the
        next user (another bucket's run, or the emitter's builds), which times none of it."""
        self.timed.clear()
        self.again.clear()
        self.retimed.clear()
        self._runs += 1

    def close(self) -> None:
        for p in (self._builders, self._timer):
            if p is not None:
                p.close()
        self._builders = self._timer = None
        if self._dir is not None:  # (after the workers: an interrupted builder may still be writing into it)
            self._dir.cleanup()
            self._dir = None
        self.end_run()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


BUILD_DIR = "kernorch-build-"  # a run's temporary directory of built kernels: + host digest + pid


@contextlib.contextmanager
def run_workers(options: Options, workers: Workers | None = None):
    """The workers of one measuring run: `workers`, left open for the caller with the run's queue
    dropped at its end (`Workers.end_run`), or the run's own, closed at its end."""
    if workers is None:
        with Workers(options) as own:
            yield own
        return
    try:
        yield workers
    finally:
        workers.end_run()


def _host_build_dirs() -> str:
    """The prefix of this host's build directories (a digest of its name: containers sharing /tmp
    have process ids of their own); the owner's process id follows."""
    return f"{BUILD_DIR}{zlib.crc32(socket.gethostname().encode()):08x}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def sweep_build_dirs(root: str | None = None) -> list[Path]:
    """Remove the build directories of this host's runs that are gone (killed outright: SIGKILL, a
    crash, a power cut leave theirs behind; an interrupted or terminated run removes its own);
    returns them. A directory another host's run or a live process owns, or named otherwise, stays."""
    host = _host_build_dirs()
    removed = []
    for d in Path(root or tempfile.gettempdir()).glob(host + "*"):
        pid = d.name[len(host):].split("-")[0]
        if d.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        log.info("removed %d build directories of runs that were killed", len(removed))
    return removed


def transient(error: str) -> bool:
    """A failure of the process, not of the kernel: its worker crashed (segfault, killed, out of
    memory) or hit the deadline (a loaded machine slows builds and runs down)."""
    return error.startswith(("worker crashed", "timed out"))


def _run_with_retry(pool: WorkerPool, fn, jobs: list[KernelJob], args, timeout: float):
    """Run `fn(*args(job))` for every job; a job whose worker crashed or timed out gets one more try
    in a fresh worker. Yields (job, TaskResult) once per job, in completion order."""
    group = list(jobs)
    for attempt in (0, 1):
        retry = []
        for r in pool.run(fn, [args(j) for j in group], timeout):
            j = group[r.index]
            if not r.ok and attempt == 0 and transient(r.error):
                retry.append(j)
                continue
            yield j, r
        if not retry:
            return
        log.warning("%d kernels crashed or timed out in their worker; trying them once more in a fresh one", len(retry))
        group = retry


def _history(jobs: Iterable[KernelJob], db: ProfileDB, target: str) -> dict[tuple[str, str, str], list[Measurement]]:
    """Every stored measurement of each job on `target`, at the job's implementation versions."""
    by_version: dict[str, list[KernelJob]] = {}
    for j in jobs:
        by_version.setdefault(versions(j.impl), []).append(j)
    out: dict[tuple[str, str, str], list[Measurement]] = {}
    for ver, js in by_version.items():
        hist = db.history(target, ver, [j.ident for j in js])
        for j in js:
            out[j.ident] = list(hist.get(j.ident) or [])
    return out


def target_of(machine: Machine, options: Options) -> str:
    """The database namespace of a run's measurements: the machine and threads, and the range of a
    symbolic dimension (a kernel over seq=1..512 costs its weighted time over that range), with
    the sampled lengths and their weights when observed lengths or the model chose them."""
    fp = machine.fingerprint(options.threads) + ("|weights-cached" if options.weights_cached else "")
    if not options.ranges:
        return fp
    from .dynamic import samples_of
    at = ",".join(f"{dict(b)}:{w:g}" for b, w in samples_of(options)) \
        if options.lengths or options.sample_weights or options.sample_count != UNNAMED_SAMPLES else ""
    return fp + "".join(f"|{n}={lo}..{hi}" for n, lo, hi in options.ranges) + (f"@{at}" if at else "")


def stored(jobs: Iterable[KernelJob], db: ProfileDB, options: Options, machine: Machine) -> dict:
    """The measurements the database already holds for `jobs` (ok or refused; transient failures
    are not verdicts): what `measure` would serve without running anything."""
    out = {}
    for ident, ms in _history(jobs, db, target_of(machine, options)).items():
        ms = [m for m in ms if m.status != "failed"]
        if ms:
            out[ident] = best_of(ms)
    return out


def _likely_slower(job: KernelJob) -> bool:
    """Timing order within a kernel's variants: the variant likely to be faster first, so the slower
    one is cut after one call (DOMINATED). Convolutions are fast blocked, the rest plain."""
    conv = any(p.op == "conv" for p in job.graph.prims)
    return job.schedule.startswith("b") != conv


def measure(jobs: Iterable[KernelJob], db: ProfileDB, options: Options, machine: Machine | None = None,
            label: str = "measure", workers: Workers | None = None
            ) -> tuple[dict[tuple[str, str, str], Measurement], MeasureStats]:
    """Measure every job not already in the database; return the measurement of every job.

    A kernel over a range timed between its samples too (`KernelJob.probes`: a contraction's tile,
    whose times become its row copies' cost curves) is timed once more after all the others, and
    keeps the faster timing at each length (`_faster`): a disturbance of the machine can last a
    whole job (a 1536 x 384 GEMM's 8-row tile stored at 252-1463 us where it takes 49-108, all five
    lengths, Xeon model 207); noise only ever slows. With the run's `workers`, a kernel the caller
    queued with `Workers.time_later` is timed again by the next call, after its builds and before
    its own kernels (seconds after its first timing: a slow phase of this VM lasts seconds to a
    minute), its measurement kept in `workers.retimed` for the run to take; `time_again` times
    what is left.

    Verdicts: a kernel whose build raises, or whose result differs from the reference, is refused
    (a property of the kernel, stored and never retried unless `db clear --refused`). A kernel whose
    worker crashes or times out is tried once more in a fresh worker; failing again, it is stored
    as "failed", which no later run takes as a verdict (it is measured again), unless it had failed
    that way in an earlier run too while other kernels of this run measured fine (a healthy
    environment): then it is refused.
    """
    t_start = time.perf_counter()
    machine = machine or Machine.host()
    target = target_of(machine, options)
    jobs = list({j.ident: j for j in jobs}.values())
    if options.ranges:
        from .dynamic import samples_of, symbols
        at = samples_of(options)
        bounds = tuple((n, hi) for n, _, hi in options.ranges)
        jobs = [replace(j, samples=at + tuple((b, 0.0) for b in j.probes if b not in dict(at)), bounds=bounds)
                if symbols(j.graph) else j for j in jobs]
    stats = MeasureStats(jobs=len(jobs))
    results: dict[tuple[str, str, str], Measurement] = {}
    todo: list[KernelJob] = []
    previous: dict[tuple[str, str, str], Measurement] = {}  # best stored measurement of each kernel timed again
    failed_before: set[tuple[str, str, str]] = set()        # kernels an earlier run saw crash or time out
    hist = _history(jobs, db, target)
    for j in jobs:
        ms = hist[j.ident]
        if any(m.status == "failed" for m in ms):
            failed_before.add(j.ident)
        ms = [m for m in ms if m.status != "failed"]
        if not ms:
            todo.append(j)
            continue
        b = best_of(ms)
        if options.remeasure and b.ok and sum(m.ok for m in ms) < REMEASURE_TRIES:
            previous[j.ident] = b
            todo.append(j)
        else:
            results[j.ident] = b
    stats.cached = len(results)
    stats.remeasured = len(previous)
    if not todo:
        stats.seconds = time.perf_counter() - t_start
        return results, stats

    def record(j: KernelJob, status: str, reason: str, build_s: float = 0.0) -> None:
        m = Measurement(target, j.key, j.impl, j.schedule, versions(j.impl), status, None, (), reason, build_s,
                        j.description)
        db.add(m)
        results[j.ident] = m
        stats.refused += 1

    pending: list[tuple[KernelJob, str, float]] = []  # transient failures, judged once the run is over

    def fail(j: KernelJob, what: str, r) -> None:
        reason = f"{what}: {r.error}"
        if transient(r.error):
            pending.append((j, reason, r.seconds))
        else:
            record(j, "refused", reason, r.seconds)

    own = workers is None
    workers = workers or Workers(options)
    with contextlib.ExitStack() as stack:
        if own:
            stack.callback(workers.close)
        tmp = workers.build_dir()
        built: dict[tuple[str, str, str], dict] = {}
        tvm_jobs = [j for j in todo if registry.native(j.impl)]
        t_build = time.perf_counter()
        if tvm_jobs:
            pool = workers.builders()
            with progress.bar(f"{label}: build", len(tvm_jobs)) as bar:
                tune_dir = options.tune_dir if any(j.impl == "tvm-tuned" for j in tvm_jobs) else None
                for j, r in _run_with_retry(pool, _build_task, tvm_jobs,
                                            lambda j: (j, options.threads, tmp, options.verify, tune_dir,
                                                       str(options.object_cache())),
                                            options.build_timeout):
                    if r.ok:
                        built[j.ident] = r.value
                    else:
                        fail(j, "build/check failed", r)
                    bar.advance()
        stats.build_seconds = time.perf_counter() - t_build
        t_time = time.perf_counter()
        # Python kernels first: their times let a generated kernel that is far slower for the
        # same key stop after one call (DOMINATED), instead of repeats of seconds each
        timed = [j for j in todo if not registry.native(j.impl) or j.ident in built]
        best: dict[str, int] = {}
        for (key, _, sched), m in results.items():
            if m.ok and sched != "none":
                best[key] = min(best.get(key, m.median_ns), m.median_ns)

        # each fused kernel's members alone, as measured so far (the plan can always run those)
        members = {j.ident: [structural_key([p], j.graph, [p.name]) for p in j.graph.prims]
                   for j in timed if registry.native(j.impl) and len(j.graph.prims) > 1}
        alone = db.fastest(target, {k for ks in members.values() for k in ks},
                           functools.lru_cache(None)(versions)) if members else {}

        def cutoff(j: KernelJob) -> float | None:
            """DOMINATED times the best time of its key, or of its members each alone (a fused
            fallback in the default schedule, candy's conv with its instance norm over batch=1..4,
            took 0.5-0.7 s a call and 300 s to time fully)."""
            if not registry.native(j.impl):
                return None
            b = best.get(j.key)
            parts = [best.get(k, alone.get(k)) for k in members.get(j.ident, ())]
            if parts and None not in parts:
                b = min(b, sum(parts)) if b is not None else sum(parts)
            return DOMINATED * b / 1e9 if b is not None else None

        if workers.again:  # queued by the run earlier, this call's builds apart from their first timing
            workers.retimed.update(time_again(db, options, machine, workers, label=label))
        with progress.bar(f"{label}: time", len(timed)) as bar:
            groups = ([j for j in timed if not registry.native(j.impl)],
                      sorted((j for j in timed if registry.native(j.impl)), key=_likely_slower))
            for group in groups:  # the cutoffs of the second group come from the first
                for j, r in _run_with_retry(workers.timer(), _time_task, group,
                                            lambda j: _timing_args(j, built.get(j.ident, {}).get("path"), options,
                                                                   machine, cutoff(j)), options.run_timeout):
                    if not r.ok:
                        fail(j, "run failed", r)
                    else:
                        m = _measurement(target, j, r.value, built.get(j.ident, {}).get("build_s", 0.0))
                        db.add(m)
                        results[j.ident] = m
                        stats.measured += 1
                        if j.schedule != "none":
                            best[j.key] = min(best.get(j.key, m.median_ns), m.median_ns)
                        if not r.value.get("cut"):  # (a kernel cut after one call is dominated: once is enough)
                            workers.timed[j.ident] = (j, built.get(j.ident, {}).get("path"))
                    bar.advance()
        healthy = stats.measured > 0
        for j, reason, secs in pending:
            if healthy and j.ident in failed_before:
                record(j, "refused", f"{reason} (again: it failed this way in an earlier run too)", secs)
            else:
                record(j, "failed", reason, secs)
        for ident, old in previous.items():  # the fastest measurement counts (see database.best)
            results[ident] = best_of([old, results[ident]])
        over_range = [_Timed(*workers.timed[j.ident], results[j.ident]) for j in timed
                      if j.probes and j.ident in workers.timed]
        results.update(_timed_again(over_range, db, options, machine, workers, label))
        stats.time_seconds = time.perf_counter() - t_time
    stats.seconds = time.perf_counter() - t_start
    log.info("%s: built %d kernels in %.1f s, timed %d in %.1f s", label, len(tvm_jobs), stats.build_seconds,
             len(timed), stats.time_seconds)
    return results, stats


def build_objects(jobs: Sequence[KernelJob], options: Options, workers: Workers) -> None:
    """Build `jobs` whole (over every length up to their bounds; nothing checked or timed) in the
    run's builders, each kept as an object named by its lowered module
    (kernorch.backends.tvm.objects) for an executable to link. A kernel that fails here is left to
    the emitter, which compiles it itself and names the error."""
    if not jobs:
        return
    tmp = workers.build_dir()
    t0 = time.perf_counter()
    with progress.bar("objects: build", len(jobs)) as bar:
        for j, r in _run_with_retry(workers.builders(), _build_task, list(jobs),
                                    lambda j: (j, options.threads, tmp, False, None, str(options.object_cache())),
                                    options.build_timeout):
            if not r.ok:
                log.info("building %s (%s) whole failed here: %s", j.description, j.schedule, r.error)
            bar.advance()
    log.info("objects: built %d kernels whole in %.1f s", len(jobs), time.perf_counter() - t0)


def _timing_args(job: KernelJob, path: str | None, options: Options, machine: Machine,
                 cutoff_s: float | None = None) -> tuple:
    """`_time_task`'s arguments."""
    return (job, path, options.repeats, options.min_repeat_ms, options.verify, cutoff_s,
            big_output_bytes(machine, options.threads), evict_bytes(machine), options.weights_cached)


def time_again(db: ProfileDB, options: Options, machine: Machine, workers: Workers,
               label: str = "measure") -> dict[tuple[str, str, str], Measurement]:
    """Time once more the kernels waiting in `workers.again` (see `_timed_again`)."""
    todo, workers.again = list(workers.again.values()), {}
    return _timed_again(todo, db, options, machine, workers, label)


def _timed_again(todo: Sequence[_Timed], db: ProfileDB, options: Options, machine: Machine, workers: Workers,
                 label: str) -> dict[tuple[str, str, str], Measurement]:
    """Time these kernels once more, latest first, so that a kernel's timings are as far apart as
    the run allows; each keeps the faster (`_faster`: noise only ever slows), which is stored where
    it is. Returns their measurements; a kernel whose second timing fails keeps its first."""
    if not todo:
        return {}
    target = target_of(machine, options)
    by_ident = {t.job.ident: t for t in todo}
    out: dict[tuple[str, str, str], Measurement] = {}
    with progress.bar(f"{label}: time again", len(todo)) as bar:
        for j, r in _run_with_retry(workers.timer(), _time_task, [t.job for t in reversed(todo)],
                                    lambda j: _timing_args(j, by_ident[j.ident].path, options, machine),
                                    options.run_timeout):
            first = by_ident[j.ident].first
            m = first
            if r.ok:
                m = _faster(first, _measurement(target, j, r.value, first.build_s))
                if m != first:
                    db.add(m)
            out[j.ident] = m
            bar.advance()
    return out
