"""optimize(): the stages in order, each a function from one frozen value to the next.

    verify.loadable(model, threads)                                   # ONNX Runtime can load it (checked last)
    loaded   = load(model, options)                                   # Loaded: ONNX graph + prim graph
    options  = model_options(loaded.graph, options, machine)          # where its weights are, lengths' weights
    cands    = enumerate_candidates(loaded.graph, options)            # candidates.Enumeration
    measured = measure_candidates(loaded.graph, cands, db, options, machine)   # Measured
    plan     = orchestrate(loaded.graph, cands, measured, options, meta)       # plan.Plan
    (plan, measured, tuning) = tune.tune_loop(..., solve)             # only with a budget
    compiled = emit(loaded.graph, plan, options, machine)             # runtime.CompiledModel
    (compiled, planned) = executed.measured_*(compiled, planned, ...)  # over a range: changes kept where
                                                                      # the executable runs faster (executed.py)
    check    = verify.verify(compiled, model, options)                # outputs vs ONNX Runtime
    timing   = peers.time_against(compiled, model, ...)               # each system in its own process

The CLI stops after any stage (inspect, candidates, plan); `Clock` records the seconds per stage.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from . import candidates as cands
from . import costmodel as cm
from . import fission as fis
from . import footprint
from . import masks
from . import measure as meas
from . import primitives
from .backends import registry
from .database import Measurement, ProfileDB
from .frontend import onnx as frontend
from .ir import Graph, KernorchError, SymDim, kernel_graph, structural_key
from .kernels import LengthSwitch, Tile, Winograd, blocked, has_blocked_variant, prim_tiles, split
from .kernels.tiles import SMALL_ROWS, curve_ns, fit_copies, passes
from .kernels.variants import CONVERSIONS
from .layouts import candidate_io, conversion, conversion_key, conversions, kernel_io
from .options import Machine, Options
from .orchestrate import NoPlan
from .plan import Plan
from .rewrite import rewrite

log = logging.getLogger(__name__)


class Clock:
    """Seconds spent per stage (accumulated)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class Loaded:
    source: str
    onnx: Any            # frontend.onnx.OnnxGraph (after the algebraic rewrites)
    graph: Graph
    rewrites: Any = None  # kernorch.rewrite.Rewritten (None: rewrites off)


@dataclass(frozen=True)
class Measured:
    """Every measurement of every (key, impl, schedule) the solver may use or the report shows, and
    the jobs not measured yet with their optimistic estimates (see kernorch.estimate)."""

    measurements: Mapping[tuple[str, str, str], Measurement]
    stats: meas.MeasureStats
    tiles: Mapping[str, str] = field(default_factory=dict)   # contraction prim -> its fastest tile
    direct: Mapping[tuple, str] = field(default_factory=dict)  # (contraction, class) -> fastest non-Winograd tile
    pending: Mapping[tuple[str, str, str], meas.KernelJob] = field(default_factory=dict)
    estimates: Mapping[tuple[str, str, str], int] = field(default_factory=dict)
    members_ns: Mapping[tuple[str, str, str], float] = field(default_factory=dict)  # its members alone, summed
    bounds: Mapping[tuple[str, str, str], int] = field(default_factory=dict)        # kernorch.estimate's bound
    predicted: Mapping[tuple[str, str, str], float] = field(default_factory=dict)  # learned cost model, ns
    sigma: float = 0.0                      # the learned model's spread (log space)
    residual: cm.Residual = field(default_factory=cm.Residual)  # this run's correction of the model
    model: Any = None                       # the learned model (kernorch.costmodel.CostModel) in use
    # pending jobs' features: a row per length of `at` (a static shape: one)
    rows: Mapping[tuple[str, str, str], tuple[cm.Row, ...]] = field(default_factory=dict)
    seen: tuple[cm.Row, ...] = ()           # the fusions this run measured, a row per length, with their times
    fitted: int = 0                         # how many of `seen` the estimates in use were made with
    state: str = ""                         # where the run's last estimates are kept (`_state_key`)
    # the lengths the learned model sees a kernel at, with their weights: over a range its samples
    # (kernorch.dynamic.samples; a kernel's time is their weighted sum), a static shape (0, 1.0)
    at: tuple[tuple[int, float], ...] = ((0, 1.0),)
    # per schedule, the least ratio of measured time to bound among the fusions the learned model
    # does not estimate (`_learnable`) that this run measured in it (none yet: absent). A fused
    # attention took 2-3x its bound; kept at their bounds, each of the 29 attentions of a transformer
    # block over seq=1..512 was wanted in turn and measured in all 4 tiles (116 builds, 68 s of
    # builders). Its tiles stay apart: over seq=1..512 (Xeon model 207) t14x32r took 1.20-1.42x the
    # fastest tile of each of 19 attentions measured in every tile, t8x32r 1.07-1.54x, t6x64r and
    # t4x64r 1.00-1.13x; raised by the least ratio of all, the slow tiles of every attention were
    # still wanted (82 attention builds, 94 s of builders)
    unlearned: Mapping[str, float] = field(default_factory=dict)
    # the fusions around one contraction this run measured: ident -> ((the contraction, schedule),
    # their bound at each length of `at`, their weighted bound under 0; their prims), the others of
    # the same contraction and schedule raised by them (`_raised_bounds`)
    around: Mapping[tuple[str, str, str], tuple[tuple[str, str], Mapping[int, int], frozenset]] = \
        field(default_factory=dict)
    # over a range, each pending job's bound and learned prediction at each length of `at` (`bounds`
    # and `predicted` are their weighted sums): a plan for one sample length solves on these (`at_sample`)
    bounds_at: Mapping[tuple[str, str, str], tuple[int, ...]] = field(default_factory=dict)
    predicted_at: Mapping[tuple[str, str, str], tuple[float, ...]] = field(default_factory=dict)

    def with_measurement(self, m: Measurement) -> "Measured":
        """A copy where `m` replaces the earlier measurements of its (key, impl)."""
        kept = {k: v for k, v in self.measurements.items() if not (k[0] == m.key and k[1] == m.impl)}
        kept[(m.key, m.impl, m.schedule)] = m
        return replace(self, measurements=kept)


def load(model, options: Options, clock: Clock | None = None) -> Loaded:
    """Frontend, algebraic rewrites (kernorch.rewrite, unless options.rewrites is off), fission."""
    clock = clock or Clock()
    with clock("load"):
        og = frontend.load(model, options.shape_dict)
        # over a range the rewrites run on each probe's bound graph (kernorch.dynamic.generic_graph)
        rewritten = rewrite(og) if options.rewrites and not options.ranges else None
        og = rewritten.graph if rewritten else og
    with clock("fission"):
        if options.ranges:  # one graph over the range of a symbolic dimension (kernorch.dynamic)
            from .dynamic import Range, generic_graph
            graph = generic_graph(model, [Range(*r) for r in options.ranges], options.shape_dict, options.rewrites)
        else:
            graph = fis.fission(og)
        graph = masks.annotate(graph)
    return Loaded(og.source, og, graph, rewritten)


def model_options(graph: Graph, options: Options, machine: Machine, source: str = "") -> Options:
    """What the model tells the measurements: where its kernels find their weights (in the
    last-level cache when they all fit there, as the calibration measured it: `measure.weights_fit`),
    and over a range, the weight of each length timed, relative to the model's floor there
    (`dynamic.relative_weights`). First, a model whose largest tensor is too large to measure on
    this host (at the top of its range) is refused (`footprint.check`; `source` names it)."""
    from .calibrate import calibrate
    footprint.check(graph, options.ranges, source or graph.name)
    cal = calibrate(options.threads)
    options = options.with_(weights_cached=meas.weights_fit(graph, machine, cal.get("last_level_kib")))
    if options.ranges and not options.sample_weights:
        from .dynamic import relative_weights
        from .estimate import kernel_floor_ns
        options = options.with_(sample_weights=relative_weights(
            graph, options.ranges, options.lengths,
            lambda g: kernel_floor_ns(g, cal["peak_gflops"], cal["bandwidth_gbs"]), options.sample_count))
    return options


def enum_options(options: Options) -> cands.EnumOptions:
    return cands.EnumOptions(max_size=options.max_kernel_size, max_pointwise=options.max_pointwise,
                             max_per_partition=options.max_candidates, max_outputs=options.max_outputs)


def enumerate_candidates(graph: Graph, options: Options) -> cands.Enumeration:
    """The candidates; a graph over symbols is cut where the fewest bytes cross at their largest values."""
    return cands.enumerate_all(graph, enum_options(options), options.max_partition,
                               {n: hi for n, _, hi in options.ranges})


# ------------------------------------------------------------------------------------------------
# measurement: micro-kernel tiles first, then every candidate in its schedule
# ------------------------------------------------------------------------------------------------

def _job(graph: Graph, c, impl: str, schedule: str) -> meas.KernelJob:
    kg = kernel_graph(graph, c.members, c.inputs, c.outputs)
    return meas.KernelJob(c.key, impl, schedule, kg, c.inputs, c.outputs)


def _variant_classes(graph: Graph, c, options: Options, machine: Machine) -> list[int | None]:
    """The layout classes a candidate is measured in: plain (None), and blocked by the machine's
    lanes when it has a blocked variant (see kernels.variants.has_blocked_variant)."""
    if options.layouts and has_blocked_variant(graph, c.members, c.inputs, c.outputs, machine.lanes):
        return [None, machine.lanes]
    return [None]


def in_class(cls: int | None, inner: str) -> str:
    return inner if cls is None else blocked(cls, inner)


def tile_jobs(graph: Graph, candidates, options: Options, machine: Machine) -> dict[tuple, list[meas.KernelJob]]:
    """Per contraction prim and layout class: its kernel alone in every micro-kernel tile (the tile
    that wins alone is the one its fused candidates use: epilogues do not change the register tile)."""
    out: dict[tuple, list[meas.KernelJob]] = {}
    at = graph
    if options.ranges:  # over a range: tiles sized at its longest length, where the work is (their 2-row
        # copy serves the shortest; sized at the middle, a bucket 1..8 raced only 3-row tiles: three
        # passes at 7 rows); attention over a symbolic length pads its seq columns to the tile and
        # reads a symbolic depth guarded, and the default schedule races its tiles
        from .dynamic import bind
        at = bind(graph, {name: hi for name, _, hi in options.ranges})
    for c in candidates:
        if len(c.members) == 1 and c.linear:
            prim = graph.by_name[c.linear]
            symbolic = bool(options.ranges) and not (isinstance(prim.type.shape[-1], int)
                                                     and isinstance(graph.type_of(prim.inputs[0]).shape[-1], int))
            for cls in _variant_classes(graph, c, options, machine):
                if (c.linear, cls) in out:
                    continue
                prim = at.by_name[c.linear]
                tiles = prim_tiles(machine, at, prim, blocked_layout=cls is not None)
                if tiles:
                    # a tile over symbolic rows is also timed between the samples: where a longer
                    # row count wins there, the kernel runs it there (`row_copies`)
                    seen = _row_probes(graph.by_name[c.linear], options) if _rows_only_symbolic(
                        graph, graph.by_name[c.linear]) else ()
                    out[(c.linear, cls)] = [replace(_job(graph, c, "tvm", in_class(cls, t.name)), probes=seen)
                                            for t in tiles]
                    if cls is None and (prim.op == "conv" or symbolic):  # new tiles: the default competes
                        out[(c.linear, cls)].append(_job(graph, c, "tvm", "default"))
    return out


def register_tiles(measurements, jobs_by_prim: Mapping[tuple, list[meas.KernelJob]]) -> dict[tuple, tuple[str, ...]]:
    """Per (contraction prim, layout class): every register tile it was measured in, fastest first."""
    out = {}
    for prim, jobs in jobs_by_prim.items():
        ok = sorted((measurements[j.ident].median_ns, j.schedule) for j in jobs
                    if j.ident in measurements and measurements[j.ident].ok and Tile.parse(split(j.schedule)[1]))
        if ok:
            out[prim] = tuple(sched for _, sched in ok)
    return out


def fastest_schedules(measurements, jobs_by_prim: Mapping[tuple, list[meas.KernelJob]],
                      direct: bool = False, rows_outer: bool = False) -> dict[tuple, str]:
    """Per (contraction prim, layout class): the schedule of its fastest successfully measured tile
    (`direct`: of its register tiles and default schedule, leaving out the Winograd variants;
    `rows_outer`: of its tiles with rows outside the column tiles)."""
    out = {}
    for prim, jobs in jobs_by_prim.items():
        ok = [(measurements[j.ident].median_ns, j.schedule) for j in jobs
              if j.ident in measurements and measurements[j.ident].ok
              and not (direct and Winograd.parse(split(j.schedule)[1]))
              and not (rows_outer and not _rows_outside(j.schedule))]
        if ok:
            out[prim] = min(ok)[1]
    return out


def _row_symbol(prim) -> str | None:
    """The one symbol a contraction's rows are (seq), or None (static rows, or a product of symbols)."""
    rows = prim.type.shape[-2] if len(prim.type.shape) >= 2 else None
    return rows.name if isinstance(rows, SymDim) and len(rows.names) == 1 else None


def _row_probes(prim, options: Options) -> tuple:
    """The bindings a tile of contraction `prim` over symbolic rows is timed at beyond the samples,
    along its rows' symbol (kernorch.dynamic.probe_points): for its row copies' curves."""
    from .dynamic import probe_points
    name = _row_symbol(prim)
    if name is None:
        return ()
    return tuple(tuple(sorted(b.items()))
                 for b in probe_points(options.ranges, options.lengths, options.sample_count, along=name))


def _rows_only_symbolic(graph: Graph, prim) -> bool:
    """A contraction whose rows alone are symbolic (a weight GEMM over seq rows): columns and depth static."""
    out, a = prim.type.shape, graph.type_of(prim.inputs[0]).shape
    return (len(out) >= 2 and not isinstance(out[-2], int) and isinstance(out[-1], int)
            and isinstance(a[-1], int))


def row_copies(measurements, jobs_by_prim: Mapping[tuple, list[meas.KernelJob]],
               tiles: Mapping[tuple, str], ranges) -> dict[tuple, str]:
    """`tiles` with fitted row copies (kernorch.kernels.Tile.copies) for contractions over symbolic
    rows (their tiles timed between the samples too). Per packing and loop order (a family), each
    row count of its tiles and their SMALL_ROWS copies gets the cost curve of the lengths it ran at
    (kernorch.kernels.tiles.fit_copies); the family's kernel holds the copies that are the
    cheapest at some length of its rows' range (of `ranges`, (name, lo, hi) triples; with several
    symbols, timed with the others at their lowest values) and runs the cheapest at each. Where
    that runs the same copies as the family's fastest tile everywhere, that tile stays. The family
    kept is the one closest to the best family at every length timed (`_relative_score`).
    Micro-kernels tuned once, chosen by the length at run time by their measured cost (HAOTuner).
    A seq x 384 x 1536 GEMM, weights cold, Xeon family 6 model 207: the 14-row tile alone ran its
    2-row copy at 7 and 16 rows (137 and 193 us), the 8-row one 125 and 133; the 8-row tile took
    199 us at 28 rows, the 14-row one 164."""
    out = dict(tiles)
    for prim, sched in tiles.items():
        block, inner = split(sched)
        kept = _families(measurements, jobs_by_prim, prim, block, ranges) if Tile.parse(inner) else {}
        if kept:
            out[prim] = in_class(block, _relative_score(kept))
    return out


def family_copies(measurements, jobs_by_prim: Mapping[tuple, list[meas.KernelJob]],
                  tiles: Mapping[tuple, str], ranges) -> dict[tuple, tuple[str, ...]]:
    """Per contraction over symbolic rows, the kernel with fitted row copies of each of its
    families (`row_copies` keeps one for the fusions around it): the contraction alone is timed in
    each, since the solver sees a kernel only at the samples (seq=1, 8, 64, 512), where a family's
    tile without copies runs much as its copies do, and between them (7 and 32 rows: a 6-row tile
    computes 12 and 36) it does not (`superseded`)."""
    out = {}
    for prim, sched in tiles.items():
        block = split(sched)[0]
        fitted = tuple(in_class(block, s) for s in _families(measurements, jobs_by_prim, prim, block, ranges)
                       if Tile.parse(s).copies)
        if fitted:
            out[prim] = fitted
    return out


def _families(measurements, jobs_by_prim, prim, block, ranges) -> dict[str, dict[int, int]]:
    """Per family (packing and loop order) of the tiles `prim` was timed in over symbolic rows (in
    layout class `block`): the tile with fitted row copies, or its fastest tile where that runs the
    same copies everywhere in its rows' range (of `ranges`); each with its time (measured or read
    off its curves) at every length timed (with several symbols, the others at their lowest
    values: `dynamic.along`). Empty: not a contraction over symbolic rows alone."""
    from .dynamic import along
    probes = next((j.probes for j in jobs_by_prim.get(prim, ()) if j.probes), None)
    if probes is None:  # rows alone symbolic, timed between the samples
        return {}
    # (the symbol probed: the others are at their lowest values, a range's end, which is a sample)
    lows = {n: lo for n, lo, _ in ranges}
    name = next(n for n, v in probes[0] if len(ranges) == 1 or v != lows[n])
    lengths = next(range(lo, hi + 1) for n, lo, hi in ranges if n == name)
    families: dict[Tile, dict[Tile, object]] = {}   # family -> {tile: its measurement}
    for j in jobs_by_prim[prim]:
        b, i = split(j.schedule)
        t = Tile.parse(i)
        m = measurements.get(j.ident)
        if t is not None and b == block and m is not None and m.ok and m.samples_ns:
            families.setdefault(replace(t, mr=1), {})[t] = m
    kept: dict[str, dict[int, int]] = {}
    for fam in families.values():
        fastest = min(fam, key=lambda t: fam[t].median_ns)
        fitted = replace(fastest, copies=fit_copies({t.mr: along(m.samples_ns, ranges, name) for t, m in fam.items()}))
        used = {fitted.pick(n) for n in lengths}
        fitted = replace(fitted, copies=tuple(c for c in fitted.copies if c[0] in used))
        timed = along(fam[fastest].samples_ns, ranges, name)
        if len(fitted.copies) > 1 and any(fitted.pick(n) != fastest.pick(n) for n in lengths):
            kept[fitted.name] = {n: min(curve_ns(pts, passes(mr, n)) for mr, pts in fitted.copies) for n in timed}
        else:
            kept[fastest.name] = timed
    return kept


def superseded(measurements) -> set[tuple[str, str, str]]:
    """The measurements of tiles without row copies whose family's kernel with fitted copies was
    measured for the same key (`family_copies`): the solver is offered the latter only. It runs
    each length in the copy its curves say is cheapest there, the tile's own row count among them,
    so it is the tile or better at every length; at the samples the two time alike, and the solver
    took the tile by a few percent of noise (a seq x 1536 x 384 GEMM: t6x64p, 12 rows at seq=7,
    where its copies run 8)."""
    def family(ident):
        block, inner = split(ident[2])
        t = Tile.parse(inner)
        return None if t is None else (ident[0], ident[1], block, replace(t, mr=1, copies=()))
    fitted = {family(i) for i, m in measurements.items() if m.ok and family(i) and Tile.parse(split(i[2])[1]).copies}
    return {i for i in measurements if family(i) in fitted and not Tile.parse(split(i[2])[1]).copies}


def _relative_score(times: Mapping[str, Mapping[int, int]]) -> str:
    """Of schedules timed at lengths ({schedule: {length: ns}}), the one of least mean ratio to the
    best at each length, the lengths weighted by the trapezoid rule over log(length) (each octave
    counts the same, as `kernorch.dynamic.samples` weighs the samples; here at the probes too)."""
    common = sorted(set.intersection(*(set(t) for t in times.values())))
    x = [math.log(n) for n in common]
    q = [((x[min(i + 1, len(x) - 1)] - x[max(i - 1, 0)]) / 2) if len(x) > 1 else 1.0 for i in range(len(x))]
    best = {n: max(1, min(t[n] for t in times.values())) for n in common}
    return min(times, key=lambda s: (sum(w * times[s][n] / best[n] for w, n in zip(q, common)), s))


def conversion_jobs(graph: Graph, jobs: Sequence[meas.KernelJob], machine: Machine) -> list[meas.KernelJob]:
    """The layout conversions of every tensor some blocked kernel reads or writes blocked."""
    tensors: dict[str, None] = {}
    for j in jobs:
        if split(j.schedule)[0] is None:
            continue
        io = candidate_io(graph, [p.name for p in j.graph.prims], j.inputs, j.outputs, j.schedule)
        for t, q in zip(io.inputs + io.outputs, io.reads + io.writes):
            if "@" in q:
                tensors.setdefault(t)
    out: dict[tuple, meas.KernelJob] = {}
    for t in tensors:
        key = conversion_key(graph, t)
        for sched in conversions(graph, t, machine.lanes):
            io = conversion(graph, t, sched)
            out.setdefault((key, sched), meas.KernelJob(key, "tvm", sched, io.graph, io.inputs, io.outputs))
    return list(out.values())


def _rows_outside(schedule: str) -> bool:
    tile = Tile.parse(split(schedule)[1])
    return tile is not None and tile.rows_outer


def _row_wise(graph: Graph, c) -> bool:
    """A candidate whose contraction is followed by a reduction over its last axis (a softmax, a
    LayerNorm): its rows-outside tile computes that epilogue per row tile, in cache. (An attention
    kernel runs row tile by row tile in every tile.)"""
    if not c.linear or sum(primitives.kind(graph.by_name[m].op) == "linear" for m in c.members) > 1:
        return False
    return any(cands.reduces_last_axis(graph, graph.by_name[m]) for m in c.members)


def candidate_jobs(graph: Graph, candidates, options: Options, machine: Machine,
                   tiles: Mapping[tuple, str], row_tiles: Mapping[tuple, str] | None = None,
                   attention_tiles: Mapping[tuple, Sequence[str]] | None = None,
                   families: Mapping[tuple, Sequence[str]] | None = None) -> list[meas.KernelJob]:
    """Every distinct (key, implementation, schedule) the solver may choose, in each layout class;
    untuned TVM for a few, for comparison. A candidate around a contraction uses its contraction's
    fastest tile in that class; one with a row-wise epilogue also its fastest rows-outside tile
    (`row_tiles`: the one that runs the epilogue in cache, which the contraction alone cannot show).
    An attention is timed in its scores' fastest register tile (`attention_tiles`, see
    `register_tiles`), even where the default schedule ran the scores alone faster (over a symbolic
    length; the default schedule computes an attention whole matrix by whole matrix); over a
    symbolic length in every one of them, since the row count also sets how many query rows share
    the softmax and the values' contraction, which the scores alone cannot show (the scores'
    fastest tile, t8x32r, ran a transformer block's attention at seq=512 in 3.5 ms, t4x64r in 2.8).
    (Over a static shape in one: more would lengthen a cold optimize of segformer_b0, at its limit.)
    A contraction alone over symbolic rows is also timed with the row copies of each of its tile
    families (`families`, see `family_copies`)."""
    jobs: dict[tuple, meas.KernelJob] = {}
    untuned = 0
    impls = registry.measured(options)
    for c in candidates:
        kg = kernel_graph(graph, c.members, c.inputs, c.outputs)
        for impl in impls:
            if impl.supports(kg, kg.prims, c.inputs, c.outputs) is not None:
                continue
            classes = _variant_classes(graph, c, options, machine) if impl.native else [None]
            for cls in classes:
                schedule = tiles.get((c.linear, cls), in_class(cls, "default")) if impl.native else "-"
                schedules = [schedule]
                if impl.native and attention_tiles and (c.linear, cls) in attention_tiles and cands.attention_parts(
                        graph, c.members) is not None:
                    every = attention_tiles[(c.linear, cls)]
                    schedules = list(every) if not graph.by_name[c.linear].type.static else [every[0]]
                if impl.native and row_tiles and (c.linear, cls) in row_tiles and _row_wise(graph, c):
                    schedules.append(row_tiles[(c.linear, cls)])
                if impl.native and families and list(c.members) == [c.linear]:  # the contraction alone
                    schedules += [s for s in families.get((c.linear, cls), ()) if s not in schedules]
                for s in schedules:
                    jobs.setdefault((c.key, impl.name, s), meas.KernelJob(c.key, impl.name, s, kg, c.inputs, c.outputs))
        if (untuned < options.compare_untuned and len(c.members) > 1 and (c.key, "tvm", "none") not in jobs
                and registry.get("tvm").supports(kg, kg.prims, c.inputs, c.outputs) is None):
            jobs[(c.key, "tvm", "none")] = meas.KernelJob(c.key, "tvm", "none", kg, c.inputs, c.outputs)
            untuned += 1
    out = list(jobs.values())
    return out + conversion_jobs(graph, out, machine)


def _fallback_schedule(job: meas.KernelJob, direct: Mapping[tuple, str]) -> str:
    """What a fused kernel that refused its contraction's tile is timed with: after a Winograd
    variant (it takes one output block after its GEMMs), the contraction's fastest direct tile in
    that class; after a tile, the default schedule."""
    cls, inner = split(job.schedule)
    if Winograd.parse(inner) is not None:
        conv = next((p.name for p in job.graph.prims if p.op == "conv"), None)
        if (conv, cls) in direct:
            return direct[(conv, cls)]
    return in_class(cls, "default")


def _measure_with_fallback(jobs, db: ProfileDB, options: Options, machine: Machine, label: str,
                           workers: meas.Workers | None = None, direct: Mapping[tuple, str] | None = None):
    """Measure `jobs`; a fused kernel whose contraction's tile does not apply to it is timed with
    its fallback (`_fallback_schedule`; `direct`: each contraction's fastest direct tile per class)."""
    results, stats = meas.measure(jobs, db, options, machine, label=label, workers=workers)
    todo = jobs
    while True:
        refused = [replace(j, schedule=_fallback_schedule(j, direct or {})) for j in todo
                   if split(j.schedule)[1] not in ("default", *CONVERSIONS) and registry.native(j.impl)
                   and not results[j.ident].ok]
        if not refused:
            return results, stats
        log.info("%d fused kernels refused their contraction's tile; timing them with a direct tile or the "
                 "default schedule", len(refused))
        fallback, s2 = meas.measure(refused, db, options, machine, label="fallback", workers=workers)
        results.update(fallback)
        stats = stats.merged(s2)
        todo = refused


def _deferrable(job: meas.KernelJob) -> bool:
    """Fused generated kernels wait for the solver to want them; single prims, conversions and
    the untuned comparisons are always measured."""
    return len(job.graph.prims) > 1 and registry.native(job.impl) and job.schedule != "none"


def measure_candidates(graph: Graph, enumeration, db: ProfileDB, options: Options, machine: Machine,
                       workers: meas.Workers | None = None) -> Measured:
    """Time the micro-kernel tiles of every contraction, then every candidate in each layout class
    (its contraction's fastest tile, or the default schedule) and the layout conversions.

    With `options.prune`, a fused candidate that the profile database does not hold yet is not
    timed here: it gets an optimistic estimate, and `refine` measures it only when the solver
    wants it."""
    by_prim = tile_jobs(graph, enumeration.candidates, options, machine)
    results, stats = meas.measure([j for js in by_prim.values() for j in js], db, options, machine, label="tiles",
                                  workers=workers)
    tiles = fastest_schedules(results, by_prim)
    families: dict = {}
    if options.ranges:  # (row copies: fitted over the lengths of a contraction's rows)
        families = family_copies(results, by_prim, tiles, options.ranges)
        tiles = row_copies(results, by_prim, tiles, options.ranges)
    direct = fastest_schedules(results, by_prim, direct=True)
    jobs = candidate_jobs(graph, enumeration.candidates, options, machine, tiles,
                          fastest_schedules(results, by_prim, rows_outer=True),
                          register_tiles(results, by_prim), families)
    pending: dict = {}
    known: list = []
    # the run's state is named by every fused job it could defer, whatever the database holds of
    # them: a fusion refused in one run (its tile did not fit) is neither pending nor known in the
    # next, and naming the state by those two left the next run without the estimates the first kept
    # (segformer_b0, Zen 4: a re-optimize after a cold one measured again for 14 rounds, 4.9 min)
    deferred = [j.ident for j in jobs if _deferrable(j)]
    if options.prune:
        have = meas.stored(jobs, db, options, machine)
        pending = {j.ident: j for j in jobs if j.ident not in have and _deferrable(j)}
        known = [j for j in jobs if j.ident in have and have[j.ident].ok and _deferrable(j)]
        jobs = [j for j in jobs if j.ident not in pending]
    more, s2 = _measure_with_fallback(jobs, db, options, machine, "measure", workers, direct)
    results.update(more)
    for ident in superseded(results):
        del results[ident]
    measured = Measured(results, stats.merged(s2), {f"{p}@{cls}" if cls else p: s for (p, cls), s in tiles.items()},
                        direct)
    measured = _with_pending(measured, pending, options, machine, known)
    return _resumed(measured, _state_key(deferred, options, machine), db) if pending else measured


ESTIMATES_VERSION = 2  # how estimates are made (2: at each length of a range; attentions by their bound)


def _state_key(idents, options: Options, machine: Machine) -> str:
    """Where a run over these deferred jobs keeps its last estimates: the jobs, the machine, the
    tools that measure and the cost model that estimates, and how estimates are made."""
    model = cm.SHIPPED.read_bytes() if options.cost_model == "learned" and cm.SHIPPED.exists() else b""
    text = json.dumps([ESTIMATES_VERSION, meas.target_of(machine, options), meas.versions("tvm"), options.cost_model,
                       hashlib.sha256(model).hexdigest(), sorted(map(list, idents))])
    return hashlib.sha256(text.encode()).hexdigest()


def _resumed(measured: Measured, key: str, db: ProfileDB) -> Measured:
    """`measured` with the estimates the last run over the same jobs ended with, where it has
    one: the learned model's correction and spread moved during that run in ways a new run cannot
    rebuild from the measurements alone, and without them a second optimize of segformer_b0 (Zen
    4) measured 692 more fusions in 24 rounds (6.5 min); with them it starts where the first ended,
    with its plan, and finds the blocks of its program solved (kernorch.blocks)."""
    last = db.estimates(key)
    if last:
        measured = replace(measured, estimates={i: last.get(i, e) for i, e in measured.estimates.items()})
    return replace(measured, state=key)


def _keep_estimates(measured: Measured, db: ProfileDB) -> None:
    """At the end of a run: the estimates of the jobs it never measured, for the next run."""
    if measured.state:
        db.keep_estimates(measured.state, measured.estimates)


# the learned prediction counts lowered by this many of its sigmas (the run's spread). Replayed on a
# Xeon (benchmarks/pruning.py, 2026-11-25), 1.0 measured 43-93 % of the fusions of five models for
# plans within 0.0-0.8 % of measuring all; 2.0 measured 89-100 %.
CONFIDENCE = 1.0
CORRECT_AFTER = 30  # fusions measured in a run before the learned model is corrected by them
# ... and again each time the run has measured this many times as many: in between, the estimates of
# the fusions still pending stay as they are, so a round's solve finds every block of the program
# that no measurement touched already solved (kernorch.blocks), instead of solving all of them again
# for estimates that moved by a few percent
REFIT_GROWTH = 1.25


def _with_pending(measured: Measured, pending: Mapping, options: Options, machine: Machine,
                  known: Sequence = ()) -> Measured:
    """`measured` with `pending` jobs and their estimates, from the singletons measured so far.

    An estimate is the optimistic bound of kernorch.estimate, raised to the learned cost model's
    prediction (kernorch.costmodel) lowered by CONFIDENCE sigmas when that is higher: the bound keeps
    every fusion that may win in the solver's sight, the model takes out the ones it is confident
    will not (a fusion that recomputes a convolution per pooling window). `cost_model="analytic"`,
    or no model shipped, leaves the bound alone.

    `known`: the model's fused jobs the database already held (an earlier run measured them). The
    model's errors on them start the run's residual and, from CORRECT_AFTER of them, correct the
    model before the first solve, its spread then that of the corrected model on the fusions it was
    not corrected with (`CostModel.held_out_errors`), not the shipped model's errors on them. This
    does not rebuild where the earlier run ended (its correction and spread followed the order of
    its measurements: segformer_b0 on a Zen 4 still measured 669 more fusions in 24 rounds); the
    estimates that run kept do (`_resumed`, applied after this)."""
    # over a range each estimate is the weighted sum of estimates at the lengths the kernels are
    # timed at, each made from the times there (bound, features, the model's labels): made at the
    # middle length and scaled as the members' times scale over the range, a fused attention over
    # seq=1..512 was estimated at twice its time (its keys padded to its tile cost it more at short
    # lengths than its members, less at long ones), so it was never measured. The stages after the
    # plan read those lengths too, with nothing pending as well (`--measure-all` over seq=1..512 timed
    # its executables at seq=0 and stopped there: `measured_loop_order`)
    at = _lengths_at(options)
    if not pending:
        return replace(measured, pending={}, estimates={}, bounds={}, members_ns={}, predicted={}, bounds_at={},
                       predicted_at={}, at=tuple((length, w) for length, w, _ in at))
    from .calibrate import calibrate
    from .estimate import fused_estimate_ns
    cal = calibrate(options.threads)
    graphs = [j.graph for j in (*pending.values(), *known)]
    alone, cheapest = cm.alone_times(measured.measurements)
    prim_alone = cm.prims_alone(graphs, alone)
    members_ns = {i: float(max(1, sum(prim_alone.get(p.name, 0) for p in j.graph.prims))) for i, j in pending.items()}
    model = cm.shipped() if options.cost_model == "learned" else None
    learned = [i for i, j in pending.items() if _learnable(j.graph)]
    bounds_at: dict = {i: [] for i in pending}
    rows_at, seen = [], []
    for length, weight, binding in at:
        seen_at = {k: at_length(m, length) for k, m in measured.measurements.items()} if length \
            else measured.measurements
        alone, cheapest = cm.alone_times(seen_at)
        prim_alone = cm.prims_alone(graphs, alone)
        sized = {i: j.at(binding) for i, j in pending.items()} if length else pending
        for i, j in sized.items():
            bounds_at[i].append(fused_estimate_ns(j.graph, cal["peak_gflops"], cal["bandwidth_gbs"], prim_alone,
                                                  cheapest))
        if model is not None:
            rows_at.append(cm.rows_for([sized[i] for i in learned], prim_alone, cheapest, machine, cal,
                                       options.threads))
            known_sized = [j.at(binding) if length else j for j in known if _learnable(j.graph)]
            times = {j.ident: at_length(measured.measurements[j.ident], length) for j in known
                     if j.ident in measured.measurements}
            seen += [r for r in cm.rows_for(known_sized, prim_alone, cheapest, machine, cal, options.threads, times)
                     if r.measured_ns]
    bounds = {i: int(sum(w * b for (_, w, _), b in zip(at, bs))) for i, bs in bounds_at.items()}
    predicted: dict = {}
    predicted_at: dict = {}
    if model is not None:
        rows = {i: tuple(rs[n] for rs in rows_at) for n, i in enumerate(learned)}
        seen = tuple(sorted(seen, key=lambda r: r.ident))
        residual = cm.Residual().add(zip(model.predict_ns(list(seen)), (r.measured_ns for r in seen))) if seen \
            else cm.Residual()
        fitted = model
        if len(seen) >= CORRECT_AFTER * len(at):  # the spread: the corrected model's errors on fusions it did not see
            fitted, residual = model.corrected(seen), cm.Residual(earlier=model.held_out_errors(seen))
        predicted_at = _predictions_at(fitted, rows)
        predicted = _weighted(predicted_at, [w for _, w, _ in at])
        measured = replace(measured, sigma=model.sigma, model=model, rows=rows, seen=seen,
                           residual=residual, fitted=len(seen))
    out = replace(measured, pending=dict(pending), bounds=bounds, members_ns=members_ns, predicted=predicted,
                  at=tuple((length, w) for length, w, _ in at), predicted_at=predicted_at,
                  bounds_at={i: tuple(bs) for i, bs in bounds_at.items()})
    return replace(out, estimates=_estimates(out))


def _learnable(kg: Graph) -> bool:
    """Whether the learned model estimates this fusion: not an attention (two contractions, the
    scores never written; kernorch.candidates.attention_parts). Its training holds few of them,
    from before the attention kernel was fast, and it predicted twice their time: a fused attention
    over seq=1..512 estimated at 68-88 us (weighted over the range) took 36-39 us (Xeon model
    207): in three optimizes none was measured, and the split attention their plans kept took
    3.1 ms at seq=512 against 2.3. Such a fusion keeps its optimistic bound, and does not correct
    the model either."""
    return sum(primitives.kind(p.op) == "linear" for p in kg.prims) < 2


def _lengths_at(options: Options) -> list[tuple[int, float, dict]]:
    """(length, weight, binding) of each sample a kernel over the range of `options` is timed at
    (kernorch.dynamic.samples); a static shape: [(0, 1.0, {})]."""
    if not options.ranges:
        return [(0, 1.0, {})]
    from .dynamic import sample_key, samples_of
    return [(sample_key(b), w, dict(b)) for b, w in samples_of(options) if w > 0]


def _predictions_at(model, rows: Mapping) -> dict:
    """Each job's learned time at each length: its rows' predictions (one row per length)."""
    flat = [r for rs in rows.values() for r in rs]
    ns = iter(model.predict_ns(flat))
    return {i: tuple(next(ns) for _ in rs) for i, rs in rows.items()}


def _weighted(at: Mapping, weights: Sequence[float]) -> dict:
    """Each job's time over the range: its times at the lengths weighted as its measurement is."""
    return {i: sum(w * t for w, t in zip(weights, ts)) for i, ts in at.items()}


def at_sample(measured: Measured, k: int) -> Measured:
    """`measured` as seen at the k-th length of the range (`Measured.at`): every measurement at its
    time there, every pending job's estimate made from its bound and learned prediction there."""
    length = measured.at[k][0]
    view = replace(measured, measurements={i: at_length(m, length) for i, m in measured.measurements.items()},
                   bounds={i: b[k] for i, b in measured.bounds_at.items()},
                   predicted={i: p[k] for i, p in measured.predicted_at.items()}, at=((length, 1.0),))
    return replace(view, estimates=_estimates(view))


def at_length(m: Measurement, length: int) -> Measurement:
    """`m` with its time at `length` of the range it was timed over (itself when static or not timed there)."""
    ns = dict(m.samples_ns).get(length) if length else None
    return replace(m, median_ns=ns) if ns is not None else m


RUN_SPREAD = True  # the learned model's spread: this run's own errors (pulled toward the shipped sigma)


def _sigma(measured: Measured) -> float:
    """The spread the learned predictions are lowered by: the run's own (costmodel.Residual.spread),
    or the model's from its training when RUN_SPREAD is off."""
    return measured.residual.spread(measured.sigma) if RUN_SPREAD else measured.sigma


def _estimates(measured: Measured, bounds: Mapping | None = None) -> dict:
    """Each pending job's estimate: its bound, or the learned prediction corrected by this run's
    residual and lowered by CONFIDENCE of its sigmas (`_sigma`) when that is higher; the bound of a
    fusion around one contraction first raised by those measured around it (`_raised_bounds`). A
    fusion the learned model does not estimate (`_learnable`) while it estimates the others: its
    bound raised by the least ratio of time to bound among such fusions measured in this run in its
    schedule, or in any schedule when none was measured in its own yet (`Measured.unlearned`).
    `bounds`: those raised bounds, when the caller has them already."""
    factor = math.exp(measured.residual.shift - CONFIDENCE * _sigma(measured))
    least = min(measured.unlearned.values(), default=1.0)
    bounds = _raised_bounds(measured) if bounds is None else bounds

    def raise_by(ident) -> float:
        return max(measured.unlearned.get(ident[2], least), 1.0) if measured.model is not None else 1.0
    return {i: max(b, int(measured.predicted[i] * factor)) if i in measured.predicted else int(b * raise_by(i))
            for i, b in bounds.items()}


# A fusion around one contraction is bounded below by nine tenths of the contraction's time alone
# (kernorch.estimate.LINEAR_FACTOR), and every fusion around it gets that same bound: its epilogue
# and prologue members are smaller than the contraction. Once CONTRACTION_AFTER of them were
# measured in one schedule, the others in that schedule are raised by the least ratio of time to
# bound those took, at most to the contraction's time alone (1 / LINEAR_FACTOR). Kept at the bound,
# each fusion of a GEMM with its LayerNorm, bias and reshapes looked 10 % faster than the GEMM
# alone and was wanted in turn, one a round: the transformer block over seq=1..512 (Zen 4, cold)
# measured 456 such timings at 0.92-1.3x their contraction alone (1 % below 0.95), and its plan of
# measured kernels stayed the same for the last 12-14 rounds of its refine loop in two of four runs
CONTRACTION_AFTER = 3


def _contraction(ident, job: meas.KernelJob) -> tuple[str, str] | None:
    """(the contraction, schedule) the fusion `ident` is built around, when it holds exactly one."""
    names = [p.name for p in job.graph.prims if primitives.kind(p.op) == "linear"]
    return (names[0], ident[2]) if len(names) == 1 and len(job.graph.prims) > 1 else None


def _prims(job: meas.KernelJob) -> frozenset:
    return frozenset(p.name for p in job.graph.prims)


# ... and a fusion is at least SUBSET_FLOOR of the slowest fusion measured around its contraction in
# its schedule whose prims it holds (0: off): it computes all of that one's work and more. A floor,
# not a law: among every fusion of the transformer block over seq=1..512 measured once (Xeon, Sapphire
# Rapids class), the 324 holding a measured one took a median 0.97x the slowest such (weighted over
# the range), 28 % below 0.9x, since the timings of one family differ by their noise (10-20 %, some
# 2-28x in a slow phase) more than by their members. What it saves is the search among them: the
# family raise puts every pending fusion at the luckiest sibling's time, and the solver then asked
# for each LayerNorm-prologue and epilogue variant of a GEMM in turn. Replayed against that database
# (benchmarks/replay.py, 12 seeds of 5 % noise and 10 % slow phases) the plans cost the same at
# their true times (435.4 against 434.8 us) after 204 kernels instead of 245
SUBSET_FLOOR = 0.9


def _raised_bounds(measured: Measured) -> dict:
    """Each pending job's bound, raised as the fusions measured around its contraction allow
    (CONTRACTION_AFTER, SUBSET_FLOOR). In a view at one length of a range (`at_sample`) the ratios
    and times are those there."""
    from .estimate import LINEAR_FACTOR
    length = measured.at[0][0] if len(measured.at) == 1 else 0
    ratios: dict[tuple[str, str], list[float]] = {}
    timed: dict[tuple[str, str], list[tuple[frozenset, int]]] = {}
    for i, (around, bound_at, prims) in measured.around.items():
        m = measured.measurements.get(i)
        if m is not None and m.ok and m.median_ns and bound_at.get(length, 0) > 0:
            ratios.setdefault(around, []).append(m.median_ns / bound_at[length])
            timed.setdefault(around, []).append((prims, m.median_ns))
    raise_to = {c: min(max(min(rs), 1.0), 1.0 / LINEAR_FACTOR) for c, rs in ratios.items()
                if len(rs) >= CONTRACTION_AFTER}
    if not timed:
        return dict(measured.bounds)
    out = {}
    for i, b in measured.bounds.items():
        c = _contraction(i, measured.pending[i]) if i in measured.pending else None
        out[i] = int(b * raise_to[c]) if c in raise_to else b
        if SUBSET_FLOOR and c in timed:
            prims = _prims(measured.pending[i])
            inside = [ns for ps, ns in timed[c] if ps < prims]
            if inside:
                out[i] = max(out[i], int(SUBSET_FLOOR * max(inside)))
    return out


FILL_AGAINST_PLAN = True  # a round's fill-up weighs a fusion against the last plan (else its members alone)
FILL_NEAR = True          # ... and is taken from the partitions of the fusions the plan wants (else anywhere)


REFINE_GAP = 0.01   # solves between measurement rounds stop within 1 % of the optimum; the last is exact
# ... or, after the first round, this many seconds per block state of the program: on segformer_b0's
# decode head (root gap 9-15 %) a round's solve took 20-30 s, every round, since each measurement moves
# the estimates. The first solve is not capped: when its plan holds only measured kernels (a
# re-optimize), the exact solve that follows reuses every block it proved optimal. A capped state
# starts from its own last solution (kernorch.blocks), so 1 s only improves on it; replayed on
# segformer_b0 (Zen 4), rounds took 3 s instead of 7-8 s and the solves 474 s instead of 569 s for as
# many fusions measured (before those starts, 1 s had cost 21 more rounds than 3 s)
REFINE_BLOCK_SECONDS = 1.0

# The refine loop also ends, checked before every round, once the best plan of measured kernels alone
# costs within this fraction of the bound the solver proved on the program with every unmeasured
# fusion at its estimate (which errs low): measuring the rest could make the plan at most that much
# faster, as far as the estimates hold. Around a GEMM an epilogue saves 1-3 % of its time while the
# learned model estimates every fusion around one contraction at about the same time, 10-25 % below
# what they measure, and the solver asked for them one round at a time: the transformer block over
# seq=1..512 (Zen 4, cold) came within 3.3 % of the bound in 16 rounds, then took 13 more rounds of
# one or two kernels to reach 1.8 % (29 rounds, 320 kernels, 97 s). Stopping at 3 %: 14 rounds, 279
# kernels, 83 s; resumed on its database without the stop, the run measured 67 more kernels for a
# plan 0.1 % faster (202.5 against 202.7 us predicted). At 5 %, the spread of this VM's timings: a
# fusion timed here is 5 % off by chance (a slow phase 1.2-1.6x), and measuring on below that picks
# the kernels timed lucky rather than faster ones. Replayed against every fusion of that block
# measured once (benchmarks/replay.py, 16 seeds of such noise), 3 % ended with plans of 193.4 us
# at their true times after 204 kernels, 5 % with 192.9 us after 157 (without noise: 189.5 and
# 189.7 us, 226 and 163 kernels; the static block at seq=128 settles in one round either way).
# Checked before the first round too: a re-optimize resumes the estimates its last run ended with
# (`_resumed`), and a run that ended here ends here again without measuring (one solve more for a
# cold run, of its single kernels). At 8 % with SUBSET_FLOOR (which raises the bound): on a Xeon
# (Sapphire Rapids class, 2.0 GHz), where the learned model spreads 0.3 and the bound is looser, four
# cold range optimizes of that block at 5 % took 3-11 rounds, 149-260 kernels and 74-142 s, their
# plans' predictions within 1 %; replayed (12 seeds) 8 % with the floor measured 176 kernels in 4.3
# rounds for plans of 434.5 us at their true times, 5 % without it 245 in 9.8 for 434.8; two real
# runs took 63 and 71 s (143 and 168 kernels), their executables 0.83-1.04x the time of the
# 11-round run's at seq=1..512, alternated
SETTLE_WITHIN = 0.08
# a refine round's fill-up: at least this many pending fusions beside the wanted ones (more where a
# solve takes longer than measuring them). 4 was tried (replay-s45.md, Xeon SPR class): replayed
# against oracles of the transformer block (12 seeds) it measured 144 kernels against 167 over
# seq=1..512 and 111 against 136 at seq=128, for plans of the same true cost, and four cold range
# optimizes alternated took 0.75-1.01x the time; but two static optimizes at seq=512 each stopped at
# a plan predicted 12-17 % slower than 16's (16.2-16.4 ms against 13.8-14.5), so 16 stays
FILL_MIN = 16


def promising(measured: Measured, wanted, solve_s: float, plan=None, near: Mapping[str, int] | None = None) -> list:
    """What a refine round measures: the kernels the plan wants, then more pending fusions the
    solver would ask for in later rounds: as many as can be measured in about the time one solve
    takes (between FILL_MIN and 512), so neither the solves nor the measurements dominate the loop, and
    no more than FILL_PER_FAMILY of one family.

    With the learned model, first the fusions it expects to save against their members alone
    (within a sigma), best first; then those the solver may still want on their estimates: below
    what `plan` (the last solve's) spends on their members (each kernel's cost shared among its
    members), else below their members alone, most attractive first. Without the second kind the
    loop ends in a tail of rounds that each solve the whole program to measure the one fusion the
    solver asked for (yolox_tiny: 45 of its 67 rounds).

    `near` (prim -> partition): only fusions in the partitions of the wanted ones. Elsewhere the
    plan holds measured kernels that beat every estimate, and while the estimates stay put
    (REFIT_GROWTH) a measurement there would only make the solver solve that part again."""
    wanted = list(dict.fromkeys(wanted))
    s = measured.stats
    per_kernel = s.seconds / s.measured if s.measured else 1.0
    more = min(512, max(FILL_MIN, int(solve_s / max(per_kernel, 1e-3))))
    skip = set(wanted)
    rest = (i for i in measured.pending if i not in skip)
    if near is not None:
        def part(i) -> int:
            return near.get(measured.pending[i].graph.prims[0].name, -1)
        touched = {part(i) for i in wanted if i in measured.pending}
        rest = (i for i in rest if part(i) in touched)
    rest = sorted(rest, key=lambda i: (_promise(measured, i), i))
    if measured.predicted:
        within = math.exp(-_sigma(measured))  # the run's spread (its last errors): once, not per fusion
        # (a fusion the model does not estimate is likely only against the plan: measured against its
        # members alone, every attention of a transformer block beat them, and all 116 were measured)
        likely = [i for i in rest if i in measured.predicted and _promise(measured, i) * within < 1.0]
        if len(likely) < more:
            chosen = set(likely)
            kernels = plan.kernels if plan and FILL_AGAINST_PLAN else ()
            spent = {p: k.cost_ns / len(k.members) for k in kernels for p in k.members}

            def against(i) -> float:  # what the plan spends on the fusion's prims, or their time alone
                now = sum(spent.get(p.name, 0.0) for p in measured.pending[i].graph.prims) if spent else 0.0
                return measured.estimates[i] / (now or measured.members_ns[i])
            likely += sorted((i for i in rest if i not in chosen and against(i) < 1.0), key=lambda i: (against(i), i))
        rest = likely
    return wanted + _one_per_family(measured, rest)[:more]


# a round's fill-up takes at most this many fusions of each family (`_family`): their outcomes go
# together (one measured moves the learned estimates of the others), and their builds do not. Over
# seq=1..512 (transformer block, Zen 4, cold, two optimizes each) the fill-up took every variant of
# the attention's scores (a bias, a reshape or transposes before, each step of the softmax after:
# 52-173 kernels in the 32-column tile, about 0.7 s of builders each): 139 and 101 s, 392 and 347
# kernels measured; one per family 88 and 93 s, 312 and 297 kernels, in 25-27 rounds instead of
# 12-15, the plans' predicted times the same (0.212-0.217 ms; two per family 114 and 98 s, and
# counting the wanted fusions against the cap 91 and 104 s, in 50 rounds). A cold range optimize
# varies by half from run to run (which tiles its attention races to decides what its fusions cost
# to build): three more with one per family took 85, 109 and 125 s
FILL_PER_FAMILY = 1


def _family(kg: Graph) -> tuple[str, ...]:
    """The prims a fusion is built around: its contractions, else its reductions, else its first prim."""
    for kind in ("linear", "reduce"):
        names = tuple(sorted(p.name for p in kg.prims if primitives.kind(p.op) == kind))
        if names:
            return names
    return (kg.prims[0].name,)


def _one_per_family(measured: Measured, idents) -> list:
    """`idents` in order, without those past FILL_PER_FAMILY of their family (`_family`)."""
    taken: dict[tuple, int] = {}
    out = []
    for i in idents:
        f = _family(measured.pending[i].graph)
        if taken.get(f, 0) < FILL_PER_FAMILY:
            taken[f] = taken.get(f, 0) + 1
            out.append(i)
    return out


def _promise(measured: Measured, ident) -> float:
    """A pending fusion's expected time over its members' alone: the learned prediction corrected
    by the run's residual, else the estimate."""
    if ident in measured.predicted:
        return measured.predicted[ident] * math.exp(measured.residual.shift) / measured.members_ns[ident]
    return measured.estimates[ident] / measured.members_ns[ident]


def refine(measured: Measured, idents, db: ProfileDB, options: Options, machine: Machine,
           workers: meas.Workers | None = None) -> Measured:
    """Measure the pending jobs `idents` (the solver chose them on their estimates). The bounds of
    the jobs still pending stay as they are (they depend only on the single primitives measured
    alone, and every pending job is a fusion); the learned predictions move with the residual of
    the fusions measured so far, and once CORRECT_AFTER of them are measured, the model corrected
    by them (`CostModel.corrected`: what this machine does differently reorders the predictions,
    which a residual cannot) predicts the rest again, each time the measured fusions grew by
    REFIT_GROWTH; in between, the estimates of the jobs still pending stay as they were."""
    jobs = [measured.pending[i] for i in idents if i in measured.pending]
    results, stats = _measure_with_fallback(jobs, db, options, machine, "refine", workers, measured.direct)
    if workers is not None:
        workers.time_later(suspects(results, measured.members_ns))
        measured = _with_retimed(measured, workers.take_retimed())
    left = {i: j for i, j in measured.pending.items() if i not in results}
    residual = measured.residual.add((measured.predicted[i], m.median_ns) for i, m in results.items()
                                     if m.ok and i in measured.predicted)
    seen = measured.seen + tuple(replace(row, measured_ns=at_length(m, length).median_ns)
                                 for i, m in results.items() if m.ok and i in measured.rows
                                 for row, (length, _) in zip(measured.rows[i], measured.at))
    rows = {i: measured.rows[i] for i in left if i in measured.rows}
    predicted = {i: measured.predicted[i] for i in left if i in measured.predicted}
    predicted_at = {i: measured.predicted_at[i] for i in left if i in measured.predicted_at}
    correct_after = CORRECT_AFTER * len(measured.at)  # rows: one per length a fusion is timed at
    refit = bool(measured.model is not None and len(seen) >= max(correct_after, REFIT_GROWTH * measured.fitted)
                 and len(seen) > len(measured.seen) and rows)
    if refit:
        predicted_at = _predictions_at(measured.model.corrected(seen), rows)
        predicted = _weighted(predicted_at, [w for _, w in measured.at])
        residual = residual.corrected()  # the correction took the mean error in
    unlearned = dict(measured.unlearned)
    for i, m in results.items():  # (without the model every fusion keeps its bound)
        if measured.model is not None and m.ok and measured.bounds.get(i, 0) > 0 and i not in measured.predicted:
            ratio = m.median_ns / measured.bounds[i]
            unlearned[i[2]] = min(unlearned.get(i[2], ratio), ratio)
    around = dict(measured.around)
    for i in results:
        c = _contraction(i, measured.pending[i]) if i in measured.pending and i in measured.bounds else None
        if c is not None:
            at = zip((length for length, _ in measured.at), measured.bounds_at.get(i, ()))
            around[i] = (c, {**dict(at), 0: measured.bounds[i]}, _prims(measured.pending[i]))
    out = replace(measured, measurements={**measured.measurements, **results}, stats=measured.stats.merged(stats),
                  pending=left, residual=residual, bounds={i: measured.bounds[i] for i in left},
                  bounds_at={i: measured.bounds_at[i] for i in left if i in measured.bounds_at},
                  predicted=predicted, predicted_at=predicted_at, rows=rows, seen=seen,
                  members_ns={i: measured.members_ns[i] for i in left},
                  fitted=len(seen) if refit else measured.fitted, unlearned=unlearned, around=around)
    raised = _raised_bounds(out)
    estimates = _estimates(out, raised)
    if not refit and len(seen) >= correct_after:  # not corrected this round: the learned estimates are kept
        # (but not below what the fusions measured around a contraction say)
        return replace(out, estimates={i: max(measured.estimates[i], raised[i]) if i in predicted else e
                                       for i, e in estimates.items()})
    return replace(out, estimates=estimates)


# A fusion timed this much slower than its members alone is timed again later in the run (the faster
# timing counts): fusing a bias or a residual into a GEMM's epilogue does not double it, a slow phase
# of this VM does (memory- and launch-bound code 1.3-2x slower for seconds to a minute; Zen 5, a seq x
# 1536 x 384 GEMM with its bias and residual stored at [1: 33.7, 23: 124 us] over seq=1..512 where the
# GEMM alone took [14.2, 60.2]). 10 % of the fusions measured on that machine were above it; timed
# again, 53 and 89 of two range optimizes' kernels came out faster.
SUSPECT_ABOVE = 1.2


def suspects(results: Mapping, members_ns: Mapping) -> dict:
    """The fusions of `results` timed more than SUSPECT_ABOVE times their members alone."""
    return {i: m for i, m in results.items() if m.ok and i in members_ns and m.median_ns > SUSPECT_ABOVE * members_ns[i]}


def _with_retimed(measured: Measured, retimed: Mapping) -> Measured:
    """`measured` with the kernels timed again since (`meas.time_again`: the faster timing of
    each), where it holds them (a tile superseded by its row copies stays out)."""
    kept = {i: m for i, m in retimed.items() if m.ok and measured.measurements.get(i, m) != m}
    return replace(measured, measurements={**measured.measurements, **kept}) if kept else measured


def settled(measured: Measured, db: ProfileDB, options: Options, machine: Machine,
            workers: meas.Workers | None) -> Measured:
    """`measured` once every kernel the run queued for a second timing (`suspects`) is timed
    again, each at the faster of its timings: before a plan is final. The same object when no time
    changed."""
    if workers is None:
        return measured
    again = {**workers.take_retimed(), **meas.time_again(db, options, machine, workers, label="settle")}
    return _with_retimed(measured, again)


# ------------------------------------------------------------------------------------------------
# orchestration
# ------------------------------------------------------------------------------------------------

def best_costs(measurements) -> dict[tuple, Measurement]:
    """Per (key, impl, layout class): the fastest schedule's measurement (untuned TVM is only for
    comparison; conversions are looked up by their own schedule)."""
    out: dict[tuple, Measurement] = {}
    for (key, impl, schedule), m in measurements.items():
        if m.ok and schedule != "none" and split(schedule)[1] not in CONVERSIONS:
            k = (key, impl, split(schedule)[0])
            cur = out.get(k)
            if cur is None or m.median_ns < cur.median_ns:
                out[k] = m
    return out


@dataclass(frozen=True)
class Spec:
    """What a choice's plan kernel computes: members (none for a conversion) and its parameters."""

    members: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ident: tuple[str, str, str] = ("", "", "")   # its measurement (key, impl, schedule)


def _estimated(measured: Measured) -> dict:
    """The pending jobs as measurements holding their estimates (reason "estimate")."""
    return {i: Measurement("", j.key, j.impl, j.schedule, "", "ok", measured.estimates[i], (), "estimate")
            for i, j in measured.pending.items()}


def problem_for(graph: Graph, candidates, measurements, options: Options, machine: Machine | None = None,
                estimates: Mapping | None = None, boundary_ns: int = 0):
    """The orchestration problem: one choice per (candidate, allowed implementation, layout class)
    with a measured cost (or, not measured yet, its estimate), and a conversion choice per direction
    for every tensor some choice reads or writes blocked. Every choice's cost is its kernel's time
    alone plus `boundary_ns`, what a kernel costs inside the executable beyond that (the VM's call;
    calibrate.measure_boundary): the plan's prediction counts its kernel boundaries. Returns the
    problem and a map from choice id to its Spec."""
    from . import orchestrate as orch
    costs = best_costs(measurements)
    for k, m in best_costs(estimates or {}).items():
        costs.setdefault(k, m)  # a measured variant of the class counts; the estimate fills the gap
    choices, by_id = [], {}
    qualified_tensors: dict[str, None] = {}
    lanes = (machine or Machine.host()).lanes
    for i, c in enumerate(candidates):
        for impl in registry.allowed(options):
            for cls in (None, lanes):
                m = costs.get((c.key, impl.name, cls))
                if m is None:
                    continue
                io = candidate_io(graph, c.members, c.inputs, c.outputs, m.schedule)
                # prim outputs always; a graph input only when read blocked (it needs a conversion)
                reads = frozenset(q for t, q in zip(io.inputs, io.reads) if t in c.deps or "@" in q)
                cid = f"c{i}.{impl.name}" + (f".b{cls}" if cls else "")
                choices.append(orch.Choice(cid, c.key, impl.name, frozenset(c.members), reads, frozenset(io.writes),
                                           int(m.median_ns) + boundary_ns, tuple(c.members), m.schedule))
                by_id[cid] = Spec(tuple(c.members), tuple(c.inputs), tuple(c.outputs), (c.key, impl.name, m.schedule))
                for q in (*reads, *io.writes):
                    if "@" in q:
                        qualified_tensors.setdefault(q)
    sources = frozenset(n for n, _ in graph.inputs)
    for q in qualified_tensors:
        t = orch.base(q)
        key = conversion_key(graph, t)
        for sched in conversions(graph, t, lanes):
            m = measurements.get((key, "tvm", sched))
            if m is None or not m.ok:
                continue
            io = conversion(graph, t, sched)
            if q not in (*io.reads, *io.writes):
                continue  # another block size than this conversion writes
            if t in sources and split(sched)[1] == "unblock":
                continue  # a graph input is plain already
            reads = frozenset(r for r in io.reads if r != t or t not in sources)  # sources are not tracked
            cid = f"{split(sched)[1]}:{t}"
            choices.append(orch.Choice(cid, key, "tvm", frozenset(), reads, frozenset(io.writes),
                                       int(m.median_ns) + boundary_ns, (), sched))
            by_id[cid] = Spec((), (t,), (t,), (key, "tvm", sched))
    deps = {p.name: tuple(t for t in dict.fromkeys(p.inputs) if t in graph.by_name) for p in graph.prims}
    problem = orch.Problem(tuple(p.name for p in graph.prims), deps, tuple(graph.outputs), tuple(choices),
                           {p.name: primitives.kind(p.op) for p in graph.prims}, sources)
    return problem, by_id


def uncovered(graph: Graph, enumeration, problem, measurements, options: Options) -> str | None:
    """Why a prim has no measured kernel at all (None if every prim has one): the first such prim,
    with the refusal reasons of the candidate kernels that would have computed it."""
    covered = {m for c in problem.choices for m in c.members}
    p = next((p for p in graph.prims if p.name not in covered), None)
    if p is None:
        return None
    if p.op == "opaque" and not options.python_kernels:
        return (f"node {p.origin or p.name!r} ({p.attr('onnx_op')}) has no compiled kernel in kernorch; "
                "pass --allow-python-kernels (python_kernels=True) to run it through onnx's reference evaluator "
                "as a Python callback")
    keys = {c.key for c in enumeration.candidates if p.name in c.members}
    reasons = sorted({m.reason for (k, _, _), m in measurements.items() if k in keys and not m.ok})
    return (f"prim {p.name} ({p.op}, from node {p.origin or '?'}) is computed by no measured kernel"
            + (f"; refusals: {'; '.join(reasons[:3])}" if reasons else ""))


def orchestrate(graph: Graph, enumeration, measured: Measured, options: Options,
                meta: Mapping[str, str] | None = None, previous=None, rel_gap: float = 0.0,
                block_time_limit: float | None = None, db: ProfileDB | None = None, or_none: bool = False):
    """Solve the binary linear program over every measured candidate and make the plan (the proven
    solutions of its blocks kept in `db`, where a later run finds them). Every kernel is charged
    the kernel boundary `meta` names (`plan_meta`). A prim no kernel computes, or kernels that cover
    every prim but make no plan (`orchestrate.NoPlan`), is an error, or with `or_none` gives None (a
    plan of the measured kernels alone while a prim waits for a pending one: bert_like over seq,
    Zen 2, its position ids' `where` refused alone and measured only in fusions with the embeddings'
    sum, which each took the other gather's result from inside the other)."""
    from .plan import make_plan
    problem, by_id = problem_for(graph, enumeration.candidates, measured.measurements, options,
                                 estimates=_estimated(measured), boundary_ns=int((meta or {}).get("boundary_ns", 0)))
    why = uncovered(graph, enumeration, problem, measured.measurements, options)
    if why and or_none:
        return None
    if why:
        raise KernorchError(why)
    try:
        plan = make_plan(problem, options.solver_time_limit, previous, rel_gap, block_time_limit,
                         baselines=rel_gap == 0.0, store=db)
    except NoPlan:
        if or_none:
            return None
        raise
    # the plan's kernels take every tensor they read, in the order the lowering numbers them
    kernels = tuple(replace(k, inputs=by_id[k.id].inputs, outputs=by_id[k.id].outputs) for k in plan.kernels)
    wanted = [by_id[k.id].ident for k in plan.kernels if by_id[k.id].ident in measured.pending]
    wanted += [by_id[a.id].ident for k in plan.kernels for a in k.alternatives
               if by_id[a.id].ident in measured.pending and a.cost_ns < k.cost_ns]
    return replace(plan, kernels=kernels, meta=dict(meta or {}), estimated=tuple(dict.fromkeys(wanted)))


def plan_meta(source: str, machine: Machine, options: Options) -> dict[str, str]:
    """What a plan records of its run; with the machine's kernel boundary (from the calibration,
    rounded to 10 ns), which `orchestrate` charges every kernel: looked up once per plan."""
    from .calibrate import calibrate
    meta = {"model": source, "machine": machine.name, "threads": str(options.threads),
            "boundary_ns": str(int(round(calibrate(options.threads)["boundary_ns"], -1))),
            "weights": "cached" if options.weights_cached else "memory"}  # where its kernels were timed to find them
    if options.ranges:  # the emitter bounds the symbol, the runtime checks it
        meta["ranges"] = ",".join(f"{n}={lo}..{hi}" for n, lo, hi in options.ranges)
        if options.sample_weights:
            from .dynamic import samples_of
            meta["samples"] = ",".join(f"{'/'.join(f'{n}={v}' for n, v in b)}:{w:g}" for b, w in samples_of(options))
    if options.budget:  # where the emitter finds the schedules of "tvm-tuned" kernels
        from .tune import tune_dir
        meta["tune_dir"] = str(tune_dir(options, machine))
    return meta


@dataclass(frozen=True)
class Planned:
    """Everything up to the plan (what `kernorch plan` and `candidates` show)."""

    loaded: Loaded
    enumeration: Any
    measured: Measured
    plan: Any
    tuning: dict | None
    seconds: Mapping[str, float]
    machine: Machine
    # over a range, where `plan` dispatches among the sample lengths' own plans chosen by their
    # predicted gain (`sample_plans`): the one plan and each sample's choice, for `optimize` to keep
    # an own plan only where the executable runs it measurably faster (`executed.measured_dispatch`)
    one: Any = None
    choices: tuple = ()
    dispatch: Mapping[int, float] = field(default_factory=dict)   # per sample checked: own / one plan's time
    # over a range, per length `executed.measured_loop_order` timed (its key text): the executable
    # with the plan's packed rows-outside kernels turned against the plan's, whatever was kept
    loop_order: Mapping[str, float] = field(default_factory=dict)
    # over a range, per length `executed.measured_long_tiles` timed: the executable with the last
    # bucket's packed GEMMs in another tile family against the plan's, whatever was kept
    long_tiles: Mapping[str, float] = field(default_factory=dict)


def plan_model(model, options: Options, db: ProfileDB | None = None, machine: Machine | None = None,
               clock: Clock | None = None, workers: meas.Workers | None = None) -> Planned:
    """load → enumerate → measure → orchestrate (→ tune within the budget). With buckets over a
    symbolic range (`options.bucket_edges`): a plan per bucket, joined into one that dispatches.
    `workers`: the build and timing processes to measure with (else the run starts its own)."""
    machine = machine or Machine.host()
    clock = clock or Clock()
    own = db is None
    db = db or ProfileDB(options.resolved_db())
    if len(options.ranges) > 1 and (options.bucket_edges or options.lengths):
        raise KernorchError(f"buckets with edges and observed lengths serve one symbol; "
                            f"{len(options.ranges)} vary ({', '.join(n for n, _, _ in options.ranges)})")
    try:
        if options.ranges and options.bucket_edges:
            return _plan_buckets(model, options, db, machine, clock, workers)
        return _plan_range(model, options, db, machine, clock, workers)
    finally:
        if own:
            db.close()


def _plan_buckets(model, options: Options, db: ProfileDB, machine: Machine, clock: Clock,
                  workers: meas.Workers | None = None) -> Planned:
    """Each bucket of the range planned over its own lengths (its kernels measured there, in its own
    database namespace); the plans joined, each bucket weighted by its share of the range."""
    from .dynamic import bucket_of, buckets, example_bucket
    parts = buckets(options.ranges[0], options.bucket_edges)
    planned = []
    for i, part in enumerate(parts):
        log.info("bucket %d of %d: %s=%d..%d", i + 1, len(parts), *part)
        lengths = tuple(v for v in options.lengths if bucket_of(parts, v) == i)  # none inside: its ends and middle
        planned.append(_plan_range(model, options.with_(ranges=(part,), lengths=lengths, bucket_edges=(),
                                                        sample_gain=0.0), db, machine, clock, workers))
    plan = dispatch_plan([p.plan for p in planned], parts, options, plan_meta(planned[0].loaded.source, machine, options))
    # what the report shows of measurements: the bucket that serves the middle length (a kernel
    # measured in several buckets has a time in each); the counts of every bucket
    shown = planned[example_bucket(plan.meta)]
    stats = planned[0].measured.stats
    for p in planned[1:]:
        stats = stats.merged(p.measured.stats)
    return Planned(shown.loaded, shown.enumeration, replace(shown.measured, stats=stats), plan, None, clock.seconds,
                   machine)


def _plan_range(model, options: Options, db: ProfileDB, machine: Machine, clock: Clock,
                workers: meas.Workers | None = None) -> Planned:
    """One plan over the range (or the static shapes) of `options`. Over a range, its lengths are
    weighted relative to the model's floor at each (dynamic.relative_weights)."""
    loaded = load(model, options, clock)
    options = model_options(loaded.graph, options, machine, loaded.source)
    with clock("enumerate"):
        enumeration = enumerate_candidates(loaded.graph, options)
    meta = plan_meta(loaded.source, machine, options)
    near = {p: part.index for part in enumeration.partitions for p in part.prims} if FILL_NEAR else None
    with meas.run_workers(options, workers) as workers:
        with clock("measure"):
            measured = measure_candidates(loaded.graph, enumeration, db, options, machine, workers)

        def solve(m: Measured, previous=None) -> tuple:
            """Solve; while the plan holds kernels known only by their estimates, measure them
            (and the most promising others) and solve again, within REFINE_GAP of the optimum,
            until it holds only measured kernels or the plan of measured kernels is within
            SETTLE_WITHIN of the bound; the last solve is exact. Returns (plan, measured)."""
            def finished(plan, m: Measured) -> tuple:
                _keep_estimates(m, db)
                return plan, replace(m, stats=replace(m.stats, estimated=len(m.pending)))

            gap = REFINE_GAP if m.pending else 0.0
            while True:
                t0 = time.perf_counter()
                with clock("orchestrate"):
                    plan = orchestrate(loaded.graph, enumeration, m, options, meta, previous, gap,
                                       REFINE_BLOCK_SECONDS if gap and m.stats.rounds else None, db)
                solve_s = time.perf_counter() - t0
                previous = plan
                if not plan.estimated:
                    with clock("measure"):
                        again = settled(m, db, options, machine, workers)
                    if again is not m:  # faster second timings: solve again
                        m = again
                        continue
                    if gap == 0.0:
                        return finished(plan, m)
                    gap = 0.0  # every kernel of the plan is measured: prove it optimal
                    continue
                above = math.inf  # how far the plan of measured kernels is above the bound (none yet)
                if SETTLE_WITHIN:
                    with clock("orchestrate"):
                        best = orchestrate(loaded.graph, enumeration, measured_only(m), options, meta, None,
                                           REFINE_GAP, REFINE_BLOCK_SECONDS, db, or_none=True)
                    # (None: a prim is computed only by fusions not measured yet, its own kernel refused,
                    # or the measured ones make no plan)
                    if best is not None:
                        above = best.stats.objective_ns / max(1, plan.stats.bound_ns) - 1
                    if above <= SETTLE_WITHIN:
                        with clock("measure"):
                            again = settled(m, db, options, machine, workers)
                        if again is not m:
                            m = again
                            continue
                        log.info("refine: the plan of measured kernels is within %.1f %% of the bound (%d ns "
                                 "against %d); %d fusions left unmeasured", 100 * SETTLE_WITHIN,
                                 best.stats.objective_ns, plan.stats.bound_ns, len(m.pending))
                        with clock("orchestrate"):
                            plan = orchestrate(loaded.graph, enumeration, measured_only(m), options, meta, best,
                                               0.0, None, db)
                        return finished(plan, m)
                rounds = m.stats.rounds + 1
                batch = promising(m, plan.estimated, solve_s, plan, near)
                log.info("refine %d: measuring %d kernels the plan wants and %d promising ones (%d unmeasured%s%s)",
                         rounds, len(plan.estimated), len(batch) - len(plan.estimated), len(m.pending),
                         f"; learned model spread {_sigma(m):.2f}" if m.predicted else "",
                         f"; the measured kernels' plan {above:.1%} above the bound" if math.isfinite(above) else "")
                with clock("measure"):
                    m = refine(m, batch, db, options, machine, workers)
                m = replace(m, stats=replace(m.stats, rounds=rounds))
                gap = REFINE_GAP if m.pending else 0.0

        plan, measured = solve(measured)
        tuning = None
        if options.budget:
            from . import tune
            with clock("tune"):
                plan, measured, tuning = tune.tune_loop(loaded.graph, enumeration, measured, plan, db, options,
                                                        machine, solve)
        if options.ranges:
            with clock("measure"):
                measured, more = measure_attention_tiles(measured, db, options, machine, workers, plan)
            if more:  # the one plan again, over the kernels measured: it was solved before these
                with clock("orchestrate"):
                    plan = orchestrate(loaded.graph, enumeration, measured_only(measured), options, meta, plan, 0.0,
                                       None, db)
        if options.ranges and options.sample_plans:
            measured = refine_samples(loaded.graph, enumeration, measured, options, meta, db, machine, workers, clock)
    one, choices = None, ()
    if options.ranges and (options.sample_plans or options.sample_gain):
        with clock("orchestrate"):
            gain = 0.0 if options.sample_plans else options.sample_gain
            choices = sample_choices(loaded.graph, enumeration, measured, options, meta, plan, db, gain)
            joined = joined_samples(choices, plan, measured, options, meta)
        if gain and joined is not plan:
            one = plan
        plan = joined
    return Planned(loaded, enumeration, measured, plan, tuning, clock.seconds, machine, one, tuple(choices))


def measured_only(measured: Measured) -> Measured:
    """`measured` without its pending fusions: the program over the kernels measured."""
    return replace(measured, pending={}, estimates={}, bounds={}, bounds_at={}, predicted_at={})


def refine_samples(graph: Graph, enumeration, measured: Measured, options: Options, meta: Mapping[str, str],
                   db: ProfileDB, machine: Machine, workers: meas.Workers | None = None,
                   clock: Clock | None = None) -> Measured:
    """Over a range, after the one plan's refine loop: the loop again at each length the range is
    timed at (`at_sample`: every kernel at its time there, every pending fusion estimated there),
    measuring what that length's plan wants until it holds only measured kernels, so that
    `sample_plans` chooses among the kernels each length would have asked for. The one plan weighs
    each length by its time relative to the model's floor there, and seq=512 weighed 0.005 of it
    over 1..512: the fusions only long lengths want were never measured (measuring every candidate
    of the transformer block, Zen 4, the plan at 512 came out 3.7 % faster than the one plan
    there, the one at 23 2 % and at 1 2.5 %). Every kernel measured is timed over the whole range."""
    from .dynamic import key_text
    clock = clock or Clock()
    while measured.pending:  # until a pass over every length wants nothing unmeasured: a round at one
        # length moves the learned estimates every other length was solved with (residual, correction)
        grew = False
        for k, (length, _) in enumerate(measured.at):
            previous = None
            while measured.pending:
                with clock("orchestrate"):
                    plan = refine_solve(graph, enumeration, measured, k, options, meta, db, previous)
                previous = plan
                if not plan.estimated:
                    break
                log.info("refine at %s: measuring %d kernels its plan wants (%d unmeasured)",
                         key_text(options.ranges, length), len(plan.estimated), len(measured.pending))
                with clock("measure"):
                    measured = refine(measured, plan.estimated, db, options, machine, workers)
                measured = replace(measured, stats=replace(measured.stats, rounds=measured.stats.rounds + 1))
                grew = True
        if not grew:
            break
    with clock("measure"):
        measured = settled(measured, db, options, machine, workers)
    return replace(measured, stats=replace(measured.stats, estimated=len(measured.pending)))


def measure_attention_tiles(measured: Measured, db: ProfileDB, options: Options, machine: Machine,
                            workers: meas.Workers | None = None, plan=None) -> tuple[Measured, bool]:
    """Over a range, before the sample lengths' plans are chosen: the other register tiles of the
    attention fusions measured in one (`candidate_jobs` times an attention over a symbolic length in
    every tile of its scores), so that each length's plan chooses among them. The refine loop
    measures what the one plan wants, and it weighs the long lengths little: over seq=1..512 (Xeon
    model 167) the transformer block's attention was measured in t14x32r alone (1.88 ms at 512),
    the plan of 512 ran it split in two kernels (1.55 + 0.57 ms alone), and its executable took
    1.11x the static plan's time there, whose attention is one t4x64r kernel (1.71 ms in the model).
    From that run's database, the three other tiles measured (4 s): the plan of 512 fused it in
    t4x64r and was kept, 0.95x the executable's time at 512, the same at 128 and 300.

    The fusions that hold the same attention (`attention_groups`) rank its tiles alike: one of them
    is measured in every tile (`attention_representatives`), the others in the tiles that were the
    fastest of it at some length (`attention_siblings`). gpt_like over seq=1..512 (Xeon model 167)
    held six fusions of one attention (with and without its reshapes and transposes), each measured
    in all four tiles: 24 kernels of about 1.1 s to build each, a third of the measuring's builds;
    the same tile was the fastest of five of them, 0.7 % behind the fastest in the sixth.

    Then each attention fusion of `plan` (the one plan) whose fastest tile changes with the length
    is measured as one kernel in two tiles, switched by the length (`length_switches`). Returns
    (measured, whether it measured anything): the one plan, solved before, is solved again. (It
    chose among the tiles its refine loop had measured: a gpt_like one plan ran its attention in
    t14x32r, 21-22 us a layer at seq=32 against 10 in the static plan's t8x32r.)"""
    groups = attention_groups(measured)
    jobs = {i[0]: measured.pending[i] for g in groups for idents in g.values() for i in idents}
    batches = 0
    for pick, what in ((attention_representatives, "every register tile of one fusion per attention"),
                       (attention_siblings, "the other fusions of each attention in its fastest tiles")):
        batch = pick(measured, groups)
        if batch:
            log.info("measuring %d kernels: %s", len(batch), what)
            measured = refine(measured, batch, db, options, machine, workers)
            batches += 1
    measured = settled(measured, db, options, machine, workers) if batches else measured
    keys = [k.key for k in plan.kernels] if plan is not None and len(options.ranges) == 1 else []  # (one symbol's)
    switches = [replace(jobs[key], schedule=in_class(split(jobs[key].schedule)[0], s.name))
                for key, s in length_switches(measured, [k for k in dict.fromkeys(keys) if k in jobs],
                                              options.ranges[0]).items()]
    if not switches:
        return measured, batches > 0
    log.info("measuring %d attentions in two tiles, switched by the length", len(switches))
    results, stats = meas.measure(switches, db, options, machine, label="switch", workers=workers)
    measured = replace(measured, measurements={**measured.measurements, **results},
                       stats=measured.stats.merged(stats))
    return measured, True


# a fusion is measured switching tiles with the length (`length_switches`) where at some sample length
# the switch is predicted this much faster than the fusion's tile fastest over the range
SWITCH_GAIN = 0.03


def length_switches(measured: Measured, keys: Sequence[str], rng: tuple[str, int, int]) -> dict[str, LengthSwitch]:
    """Per attention fusion of `keys` measured in several register tiles whose fastest changes
    with the length: the switch (kernels.LengthSwitch) that runs the tile fastest at the shortest
    sample up to the edge before the first sample another is fastest at (dynamic.sample_edges),
    above it the tile fastest relative to the others over the samples from there on; where at some
    sample it is SWITCH_GAIN faster than the fusion's tile fastest over the range (its tiles' times
    there). The samples of SMALL_ROWS do not count: every tile runs its static copy there."""
    from .dynamic import sample_edges
    if not keys:
        return {}
    lengths = [n for n, _ in measured.at if n]
    tiled = [k for k, n in enumerate(lengths) if n > max(SMALL_ROWS)]
    if len(tiled) < 2:
        return {}
    edges = sample_edges(rng, lengths)
    out = {}
    for key in keys:
        times = _tile_times(measured, key, [*lengths, 0])  # (0: over the range)
        if len(times) < 2:
            continue
        at = {t: {k: ns[k] for k in tiled} for t, ns in times.items()}
        best = {k: min(at, key=lambda t: at[t][k]) for k in tiled}
        j = next((k for k in tiled if best[k] != best[tiled[0]]), None)
        if j is None:
            continue
        first = best[tiled[0]]
        then = min(at, key=lambda t: (sum(at[t][k] / at[best[k]][k] for k in tiled if k >= j), t))
        overall = min(times, key=lambda t: (times[t][-1], t))
        switched = {k: at[first if k < j else then][k] for k in tiled}
        if then != first and any(at[overall][k] >= (1 + SWITCH_GAIN) * switched[k] for k in tiled):
            out[key] = LengthSwitch(first, edges[j - 1], then)
    return out


def attention_groups(measured: Measured) -> list[dict[str, list]]:
    """The pending register tiles of the attention fusions (`candidates.attention_parts`) measured
    in some tile, grouped by the attention they hold (its scores, the members between and its
    values, whichever layout members the fusion took in beside them): per group, {fusion key: its
    pending idents}. Neither an attention no plan wanted (nothing measured of it) nor a fusion with
    one contraction."""
    pending_keys = {i[0] for i in measured.pending}
    measured_keys = {i[0] for i, m in measured.measurements.items() if m.ok and i[0] in pending_keys}
    groups: dict[str, dict[str, list]] = {}
    for i, j in measured.pending.items():
        if i[0] in measured_keys:
            parts = cands.attention_parts(j.graph, [p.name for p in j.graph.prims])
            if parts is not None:
                scores, between, values = parts
                core = structural_key([j.graph.by_name[n] for n in (scores, *between, values)], j.graph)
                groups.setdefault(core, {}).setdefault(i[0], []).append(i)
    return [groups[c] for c in sorted(groups)]


def attention_representatives(measured: Measured, groups: Sequence[Mapping[str, list]]) -> list:
    """Per attention group: the pending tiles of the fusion measured the fastest in its tile."""
    def fastest(key: str) -> tuple:
        return min(m.median_ns for i, m in measured.measurements.items() if i[0] == key and m.ok), key
    return [i for g in groups for i in g[min(g, key=fastest)]]


def attention_siblings(measured: Measured, groups: Sequence[Mapping[str, list]]) -> list:
    """Per attention group, once a fusion of it is measured in every tile: the other fusions'
    pending tiles among those fastest of it at some length it was timed at (`_fastest_tiles`)."""
    out = []
    for g in groups:
        whole = [k for k, idents in g.items() if not any(i in measured.pending for i in idents)]
        fastest = {t for k in whole for t in _fastest_tiles(measured, k)}
        out += [i for k, idents in g.items() if k not in whole for i in idents
                if i in measured.pending and split(i[2])[1] in fastest]
    return out


def _fastest_tiles(measured: Measured, key: str) -> set[str]:
    """The tiles of fusion `key` fastest at some length of the range it was timed at
    (`Measured.at`), or over the whole range."""
    lengths = [length for length, _ in measured.at if length] + [0]
    times = _tile_times(measured, key, lengths)
    return {min(times, key=lambda t: (times[t][k], t)) for k in range(len(lengths))} if times else set()


def _tile_times(measured: Measured, key: str, lengths: Sequence[int]) -> dict[str, list[int]]:
    """Per register tile (inner schedule) fusion `key` was measured in: its time at each of
    `lengths` (0: over the range, its measurement's weighted time)."""
    return {split(i[2])[1]: [at_length(m, n).median_ns for n in lengths]
            for i, m in sorted((i, m) for i, m in measured.measurements.items() if i[0] == key)
            if m.ok and Tile.parse(split(i[2])[1]) is not None}


def refine_solve(graph: Graph, enumeration, measured: Measured, k: int, options: Options, meta: Mapping[str, str],
                 db: ProfileDB | None = None, previous=None):
    """A refine round's plan at the `k`-th sample length (`refine_samples`): within REFINE_GAP of
    the optimum there, its kernels each measured or estimated (`Plan.estimated`)."""
    return orchestrate(graph, enumeration, at_sample(measured, k), options, meta, previous, REFINE_GAP,
                       REFINE_BLOCK_SECONDS, db)


def sample_plans(graph: Graph, enumeration, measured: Measured, options: Options, meta: Mapping[str, str],
                 plan, db: ProfileDB | None = None, gain: float = 0.0):
    """Over a range, a plan per length its kernels were timed at (`Measured.at`: 1, 8, 64 and 512 over
    1..512), each the optimum there among the kernels measured (their times at that length): no
    kernel is measured again, and each is at least as fast there as `plan`, the one plan over
    the range, whose kernels are among them. With `gain`, a length keeps its own plan only where
    that is predicted at least `gain` faster there than `plan` (both priced as the solver prices
    them: each kernel's time there plus the kernel boundary); elsewhere `plan` serves it. Each
    length of the range runs the plan of the sample nearest it on a log scale
    (dynamic.sample_edges); neighbours whose plans came out the same share a bucket. Returns
    `plan` when every sample's plan is the same (then it is the one plan), else one plan that
    dispatches on the length (Plan.dispatch, as with `bucket_edges`), each bucket's kernels built
    for the whole range, as they were measured (dynamic.BUCKET_BOUNDS). (`sample_choices`, then
    `joined_samples`.)"""
    return joined_samples(sample_choices(graph, enumeration, measured, options, meta, plan, db, gain), plan,
                          measured, options, meta)


def sample_choices(graph: Graph, enumeration, measured: Measured, options: Options, meta: Mapping[str, str],
                   plan, db: ProfileDB | None = None, gain: float = 0.0) -> list:
    """The plan each sample length of `measured.at` runs, as `sample_plans` chooses it (several
    symbols: `_sliced_choices`)."""
    lengths = [length for length, _ in measured.at]
    done = measured_only(measured)
    boundary = int(meta.get("boundary_ns", 0))
    if len(options.ranges) > 1:
        own = [orchestrate(graph, enumeration, at_sample(done, k), options, meta, db=db) for k in range(len(lengths))]
        return _sliced_choices(own, plan, done, options.ranges, boundary, gain)
    at = []
    for k, length in enumerate(lengths):
        own = orchestrate(graph, enumeration, at_sample(done, k), options, meta, db=db)
        if gain:
            mine, ours = _cost_at(own, done, length, boundary), _cost_at(plan, done, length, boundary)
            if mine is None or ours is None or mine > (1.0 - gain) * ours:
                own = plan
            else:
                log.info("the plan of %s=%d: predicted %.1f %% faster there than the one plan (%d ns against %d)",
                         options.ranges[0][0], length, 100 * (1 - mine / ours), mine, ours)
        at.append(own)
    return at


def _sliced_choices(own: Sequence, plan, measured: Measured, ranges, boundary_ns: int, gain: float) -> list:
    """Over several symbols, the plan of each sample of `measured.at` (its own plans `own`) when one
    symbol dispatches: per value of that symbol, its slice of the samples (every value of the
    others) runs one plan, the own plan of one of them or the one plan `plan`, whichever the slice
    is predicted to take the least time in (its samples weighted as the range weighs them); an own
    plan only where it is predicted `gain` faster over the slice than the one plan. The symbol is
    the one whose slices' plans are predicted the fastest over the whole range. (The transformer
    block over batch=1..8 x seq=1..512, Zen 2: the one plan took 1.11-1.15x the static plans' time
    at 8x128 and 8x512, 1.03x and 1.09x ONNX Runtime's, while the static plans there led it.)"""
    from .dynamic import key_text
    keys, weights = [k for k, _ in measured.at], [w for _, w in measured.at]

    def cost(p, ks):  # the slice's weighted time in plan p (None: a kernel without a time there)
        ts = [_cost_at(p, measured, keys[k], boundary_ns) for k in ks]
        return None if None in ts else sum(weights[k] * t for k, t in zip(ks, ts))
    best, gains = None, []
    for i, name in enumerate(sorted(n for n, _, _ in ranges)):
        chosen, total = [plan] * len(keys), 0.0
        values, index = _values_along(keys, i)
        for j, v in enumerate(values):
            ks = [k for k in range(len(keys)) if index[k] == j]
            ours = cost(plan, ks)
            pick, least = None, ours   # (pick: the sample whose own plan the slice runs; None: the one plan)
            for k in ks:
                mine = cost(own[k], ks)
                if mine is not None and ours is not None and mine <= (1.0 - gain) * ours and mine < least:
                    pick, least = k, mine
            for k in ks:
                chosen[k] = plan if pick is None else own[pick]
            total += least if least is not None else math.inf
            if pick is not None:
                gains.append((name, v, keys[pick], 1.0 - least / ours))
        if best is None or total < best[0]:
            best = (total, name, chosen)
    _, name, chosen = best
    for n, v, key, saved in gains:
        if n == name:
            log.info("the plan of %s serves %s=%d: predicted %.1f %% faster there than the one plan", key_text(
                ranges, key), name, v, 100 * saved)
    return chosen


def slices(at: Sequence, keys: Sequence, ranges) -> tuple[tuple[str, int, int], list, list[int], list]:
    """The plans `at` of the samples `keys` (`Measured.at`) as one symbol dispatches them: (its
    range, its values at the samples ascending, each sample's index among those values, the plan of
    each value). One symbol: each sample its own value. Several: the symbol whose every value's
    samples run the same plan (`_sliced_choices` chose them so; where all run the same, the first)."""
    if len(ranges) == 1:
        return tuple(ranges[0]), list(keys), list(range(len(keys))), list(at)
    names = sorted(n for n, _, _ in ranges)
    for i, name in enumerate(names):
        values, index = _values_along(keys, i)
        per = {}
        if all(per.setdefault(index[k], kernels_of(p)) == kernels_of(p) for k, p in enumerate(at)):
            first = [next(p for k, p in enumerate(at) if index[k] == j) for j in range(len(values))]
            return next(tuple(r) for r in ranges if r[0] == name), values, index, first
    raise KernorchError("internal: the samples' plans differ along every symbol; one symbol dispatches")


def _values_along(keys: Sequence[tuple], i: int) -> tuple[list, list[int]]:
    """The values the i-th symbol of the sample `keys` takes, ascending, and each key's index among them."""
    values = sorted({key[i] for key in keys})
    return values, [values.index(key[i]) for key in keys]


def joined_samples(at: Sequence, plan, measured: Measured, options: Options, meta: Mapping[str, str]):
    """The plans `at` of the sample lengths of `measured.at` as one plan (`sample_plans`): `plan`
    where they are all the same, else the plan that dispatches among them (several symbols: along
    the one `slices` finds, named in meta[dynamic.DISPATCH_ON])."""
    from .dynamic import BUCKET_BOUNDS, DISPATCH_ON, cut, sample_edges
    rng, values, _, per = slices(at, [key for key, _ in measured.at], options.ranges)
    plans, edges = [per[0]], []
    for e, p in zip(sample_edges(rng, values), per[1:]):
        if kernels_of(p) != kernels_of(plans[-1]):
            plans.append(p)
            edges.append(e)
    if len(plans) == 1:
        return plan
    on = {DISPATCH_ON: rng[0]} if len(options.ranges) > 1 else {}
    return dispatch_plan(plans, cut(rng, edges), options, {**meta, BUCKET_BOUNDS: "range", **on})


def _cost_at(plan, measured: Measured, length: int, boundary_ns: int) -> int | None:
    """What `plan` is predicted to take at `length` of the range: each kernel's measured time there
    plus the kernel boundary (None: a kernel without a measurement)."""
    total = 0
    for k in plan.kernels:
        m = measured.measurements.get((k.key, k.impl, k.schedule))
        if m is None or not m.ok:
            return None
        total += at_length(m, length).median_ns + boundary_ns
    return total


def kernels_of(plan) -> tuple:
    return tuple((k.members, k.impl, k.schedule) for k in plan.kernels)


def bucketed(parts, options: Options) -> tuple[list[float], dict[str, str]]:
    """Each of the buckets `parts` ((name, lo, hi), as dynamic.cut gives them) weighted by its share
    of the range (of the observed lengths, when given), and the plan meta naming them ("buckets")."""
    from .dynamic import bucket_weights
    return bucket_weights(parts, options.lengths), {"buckets": ",".join(f"{lo}..{hi}" for _, lo, hi in parts)}


def dispatch_plan(plans: list, parts, options: Options, meta: Mapping[str, str]):
    """One plan of the per-bucket `plans` (buckets `parts`, as dynamic.buckets gives them), each
    weighted by its share of the range (`bucketed`); meta["buckets"] names them."""
    weights, named = bucketed(parts, options)
    return Plan.dispatch(plans, weights, {**meta, **named})


# ------------------------------------------------------------------------------------------------
# the whole pipeline
# ------------------------------------------------------------------------------------------------

def emit(graph: Graph, plan, options: Options, machine: Machine, workers: meas.Workers | None = None,
         at: Sequence[int] | None = None):
    """The plan as one compiled executable. A kernel that fails to build here is a bug (it was built,
    checked and timed alone): the error names it and nothing is silently replaced. Over a range,
    with the run's `workers`, its kernels without a named object (kernorch.backends.tvm.objects: the
    tiles measured built for their sample lengths only) are built whole in the builder processes
    first, side by side, where this process would schedule them one at a time. (A static plan's
    builders named every object; looking would only lower each kernel once more.) `at`: the only
    lengths it will run at, its kernels linking the objects built for the samples (nothing built
    whole; wrong at other lengths, never saved: `executed.screen_samples`)."""
    from .runtime import CompiledModel
    from .backends.tvm import relax as rx
    if workers is not None and options.ranges and at is None and rx.objects.available():
        todo = rx.unnamed_kernels(graph, plan, options.threads, options.object_cache(), machine)
        jobs = [meas.KernelJob(k.key, k.impl, k.schedule, io.graph, io.inputs, io.outputs,
                               bounds=tuple(sorted(bounds.items())))
                for k, bounds in todo for io in [kernel_io(graph, k)]]
        meas.build_objects(jobs, options, workers)
    executable = rx.build_executable(graph, plan, options.threads, machine, options.executable_cache(),
                                     options.object_cache(), options.workers, at)
    return CompiledModel(graph, plan, executable, options.threads, machine)


def optimize(model, options: Options, runs: int = 20):
    """The whole pipeline: a verified CompiledModel with its report; returns (compiled, planned)."""
    from . import executed, peers, verify
    clock = Clock()
    verify.loadable(model, options.threads)
    with meas.Workers(options) as workers:  # (one set of build and timing processes for the run)
        planned = plan_model(model, options, clock=clock, workers=workers)
        graph = planned.loaded.graph
        if planned.one is not None:
            with clock("screen"):
                planned = executed.screen_samples(planned, options)
        with clock("emit"):
            compiled = emit(graph, planned.plan, options, planned.machine, workers)
        if planned.one is not None:
            with clock("dispatch"):
                compiled, planned = executed.measured_dispatch(compiled, planned, options, workers)
        if options.ranges and options.loop_order:
            with clock("loop order"):
                compiled, planned = executed.measured_loop_order(compiled, planned, options, workers)
        if options.ranges and options.long_tiles:
            with clock("long tiles"):
                compiled, planned = executed.measured_long_tiles(compiled, planned, options, workers)
    with clock("verify"):
        check = verify.verify(compiled, model, options)
    timing = {}
    if runs:
        with clock("time"):
            timing = peers.time_against_ort(compiled, model, options.threads, runs, options.seed)
    with clock("profile"):
        profile = in_context(compiled, options.seed)
    compiled.report = report_dict(planned, check, timing, profile, options, clock.seconds)
    return compiled, planned



def in_context(compiled, seed: int = 0, runs: int = 5) -> dict:
    """Each plan kernel's time inside the executable (median over `runs`), beside its isolated cost:
    where the end-to-end time goes that the additive cost model does not see."""
    from . import executor
    feeds = executor.random_feeds(compiled.example_graph, seed)
    prof = compiled.profile(feeds, runs=runs)
    kernel_ms = [0.0] * len(compiled.plan.kernels)
    for p in prof:
        if p["kernel"] is not None:
            kernel_ms[p["kernel"]] += p["ms"]
    # the plan's costs: each kernel alone plus a boundary (with buckets: the bucket that ran)
    alone = sum(k.cost_ns for k in compiled.plan_for(feeds).kernels) / 1e6
    inside = sum(kernel_ms)
    return {"runs": runs, "kernel_ms": kernel_ms, "other_ms": sum(p["ms"] for p in prof if p["kernel"] is None),
            "alone_ms": alone, "in_model_ms": inside, "by_impl": _sum_by_impl(compiled.plan, kernel_ms)}


def _sum_by_impl(plan, kernel_ms) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for k, ms in zip(plan.kernels, kernel_ms):
        d = out.setdefault(k.impl, {"kernels": 0, "alone_ms": 0.0, "in_model_ms": 0.0})
        d["kernels"] += 1
        d["alone_ms"] += k.cost_ns / 1e6
        d["in_model_ms"] += ms
    return out


def report_dict(planned: Planned, check: dict, timing: dict, profile: dict | None, options: Options,
                seconds: Mapping[str, float]) -> dict:
    g, en, ms = planned.loaded.graph, planned.enumeration, planned.measured
    plan = planned.plan
    return {
        "model": planned.loaded.source, "machine": planned.machine.to_json(), "threads": options.threads,
        "primitives": len(g.prims), "partitions": len(en.partitions), "candidates": len(en.candidates),
        "distinct_keys": len({c.key for c in en.candidates}), "measure": ms.stats.__dict__,
        "tiles": dict(ms.tiles), "plan": plan.to_json(), "predicted_ms": plan.predicted_ns / 1e6,
        "verify": check, "timing": timing, "seconds": dict(seconds),
        **({"rewrites": planned.loaded.rewrites.to_json()} if planned.loaded.rewrites else {}),
        **({"tuning": planned.tuning} if planned.tuning else {}),
        **({"dispatch": {str(n): r for n, r in planned.dispatch.items()}} if planned.dispatch else {}),
        **({"loop_order": dict(planned.loop_order)} if planned.loop_order else {}),
        **({"long_tiles": dict(planned.long_tiles)} if planned.long_tiles else {}),
        **({"context": profile} if profile else {}),
    }
