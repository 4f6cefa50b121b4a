"""The stages that time the executable itself, after `pipeline.emit`: what a plan's measured kernels
predict is checked where the kernels run together, each change kept only where the whole executable
runs faster, timed in turns against the plan's in this process (`alternated`).

    planned  = screen_samples(planned, options)                       # before emit: own plans of samples
    compiled, planned = measured_dispatch(compiled, planned, options)  # own plans over their buckets
    compiled, planned = measured_loop_order(compiled, planned, options)   # packed tiles turned
    compiled, planned = measured_long_tiles(compiled, planned, options)   # the last bucket re-tiled

`pipeline.optimize` runs them in this order; each returns the executable and the `Planned` it runs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

from . import measure as meas
from .database import ProfileDB
from .ir import Graph, KernorchError, structural_key
from .kernels import LengthSwitch, Tile, split
from .kernels.tiles import SMALL_ROWS
from .options import Options
from .pipeline import Planned, at_length, bucketed, dispatch_plan, emit, in_class, joined_samples, kernels_of, slices
from .plan import Plan

log = logging.getLogger(__name__)


def screen_samples(planned: Planned, options: Options) -> Planned:
    """Over a range, before anything is built whole: keep a sample length's own plan (`sample_choices`)
    only where an executable of it runs at least DISPATCH_GAIN faster at that length than one of the
    one plan, both linking the objects their kernels' measurements kept (built for the samples
    alone: `build_executable`'s `at`) and timed in turns there (`alternated`), SCREEN_TIMINGS times
    (each after the last found it faster; the least favourable ratio counts); elsewhere the one
    plan serves. `measured_dispatch` then times the own plans kept over their buckets, each built
    whole. Without this, every own plan's kernels were built whole for the dispatch's executables
    and most plans were dropped there: gpt_like over seq=1..512 (Zen 2) built 27 kernels whole in
    11.7 s for the own plans of 1, 64 and 512, and kept only 512's, which ran 0.95x the one plan's
    time at 512; 1's ran 1.08x at 1 and 64's 1.00x at 64."""
    if len(options.ranges) > 1:  # (several symbols: its executables serve one symbol's samples, `at`;
        return planned            # `measured_dispatch` alone checks the own plans, built whole)
    from . import executor
    from .dynamic import bind
    graph, one, name = planned.loaded.graph, planned.one, options.ranges[0][0]
    lengths = [length for length, _ in planned.measured.at]
    choices, checked = list(planned.choices), dict(planned.dispatch)
    screened = [k for k, c in enumerate(choices) if kernels_of(c) != kernels_of(one)]
    # (the one plan's executable serves every length screened: built once, for those lengths)
    ours = emit(graph, one, options, planned.machine, at=tuple(lengths[k] for k in screened)) if screened else None
    for k in screened:
        n = lengths[k]
        mine = emit(graph, choices[k], options, planned.machine, at=(n,))
        feeds = executor.random_feeds(bind(graph, {name: n}), options.seed)
        ratios = []
        for turn in range(SCREEN_TIMINGS):
            ratio, t_mine, t_ours = compared(mine, ours, feeds, {name: n}, options, turn=turn)
            ratios.append(ratio)
            log.info("%s=%d: its own plan %.1f us against the one plan's %.1f (built for it alone)", name, n,
                     t_mine * 1e6, t_ours * 1e6)
            if ratio > 1.0 - DISPATCH_GAIN:
                break
        checked[n] = max(ratios)
        if checked[n] > 1.0 - DISPATCH_GAIN:
            choices[k] = one
    plan = joined_samples(choices, one, planned.measured, options, planned.plan.meta)
    return replace(planned, plan=plan, choices=tuple(choices), dispatch=checked, one=None if plan is one else one)


# `screen_samples` times an own plan against the one plan this many times (the next only after the last
# found it faster). At seq=1 gpt_like streams its weights from DRAM, and the same pairs timed in turns in
# one process moved by +-5 % from one timing to the next (Zen 2: the own plan of 1 against the one plan,
# 0.960, 0.988 and 1.011). Timed once, an own plan that the dispatch then dropped (after its kernels were
# built whole) passed the screen in each of three cold gpt_like optimizes: seq=1's twice, seq=8's once
SCREEN_TIMINGS = 2
# an own plan of a sample length stays where the executable runs it this much faster than the one
# plan's (two executables running the same code at a length differed by up to 2 % timed so: a
# decision at the threshold is noise; the losses this is for were 3-4 %)
DISPATCH_GAIN = 0.01


def measured_dispatch(compiled, planned: Planned, options: Options, workers: meas.Workers | None = None):
    """Over a range, keep a sample length's own plan only where the executable runs it at least
    DISPATCH_GAIN faster over its bucket than the one plan's executable: both timed in this process
    in turns (`alternated`) at the sample, the ends and the middle of its bucket (`dispatch_probes`),
    the ratios' geometric mean; elsewhere the one plan serves. Where the shortest length keeps its own
    plan, the one plan runs the other buckets as a function call (only the first bucket is inline):
    if that shows (a bucket the one plan serves is DISPATCH_GAIN slower than in the one plan's
    executable at its first length: `_dispatch_timed`), the shortest length's own plan goes too.
    Re-joined, emitted (its kernels' objects are compiled already) and, while the shortest length
    keeps its own plan (the one plan then runs as a call where it was inline), timed again until
    nothing changes: the buckets whose plan changed. The own plans are chosen by their predicted
    times, and at short lengths those mislead: the transformer block over seq=1..512 (Xeon model
    167), its own plans of seq=1 and 8 predicted 9.5 % and 10 % faster than the one plan there, ran
    1-3 % faster and 3-4 % slower (measured before its kernels of activations alone were timed
    evicted and a kernel's timed calls ran on the tensors of its sizing call: see measure._timed).
    A bucket is timed at its ends too since a plan made for one length can serve the rest of its
    bucket much better or worse than it serves that length: gpt_like's own
    plan of seq=64, 0.99x the one plan's time at 64, was dropped, and at 32 (its bucket is 23..181)
    the one plan, made mostly for 1 and 8, ran its attention in a 14-row tile (22 us a layer against
    10 in the static plan of 32) and took 1.12x the static plan's time. (The middle: the last bucket's
    sample is its end, and timed at 182 and 512 alone, gpt_like's own plan of 512, 0.97x the one
    plan's time at 512 and 1.02x at 182, was dropped; the one plan took 1.11x the static plan's time
    at 512 and 1.04x at 300.) Returns (compiled, planned), `planned.dispatch` the last times against
    the one plan's at every length timed."""
    from . import executor, progress
    from .dynamic import bind, middle
    graph, one = planned.loaded.graph, planned.one
    rng, values, index, choices = slices(planned.choices, [key for key, _ in planned.measured.at], options.ranges)
    name = rng[0]  # (several symbols: the one dispatching; the others at their middles)
    single = emit(graph, one, options, planned.machine, workers)
    probes = dispatch_probes(rng, values)
    feeds = {n: executor.random_feeds(bind(graph, {**middle(options.ranges), name: n}), options.seed)
             for ns in probes for n in ns}
    plan, checked = planned.plan, dict(planned.dispatch)
    own = [k for k, c in enumerate(choices) if kernels_of(c) != kernels_of(one)]  # buckets with their own plan
    todo = list(_dispatch_timed(probes, own))  # the buckets timed (again: those whose plan changed since)
    for _ in probes:
        timed = _dispatch_timed(probes, own)
        lengths = [n for k in todo for n in timed[k]]
        with progress.bar("dispatch: time in turns", len(lengths)) as bar:
            for n in lengths:
                checked[n], mine, ours = compared(compiled, single, feeds[n], {**middle(options.ranges), name: n},
                                                  options)
                log.info("%s=%d: %.1f us in the dispatching executable against %.1f in the one plan's", name, n,
                         mine * 1e6, ours * 1e6)
                bar.advance()
        over = {k: statistics.geometric_mean(checked[n] for n in ns) for k, ns in timed.items()}
        kept = [k for k in own if over[k] <= 1.0 - DISPATCH_GAIN]
        called = [k for k in timed if k not in own]
        if 0 in kept and any(over[k] > 1.0 + DISPATCH_GAIN for k in called):
            kept.remove(0)
        if kept == own:
            break
        todo = [k for k in own if k not in kept]
        choices = [c if k in kept else one for k, c in enumerate(choices)]
        plan = joined_samples([choices[j] for j in index], one, planned.measured, options, planned.plan.meta)
        log.info("own plans kept at %s", ", ".join(f"{name}={probes[k][0]}..{probes[k][-1]}" for k in kept)
                 or "no length")
        if plan is one:
            compiled = single
            break
        compiled = emit(graph, plan, options, planned.machine, workers)
        if 0 not in kept:  # the one plan runs the first bucket inline, as in its own executable, and
            break          # every own plan kept runs as it was timed: nothing to time again
        own = kept
    return compiled, replace(planned, plan=plan, choices=tuple(choices[j] for j in index), dispatch=checked)


# a kernel of the plan over a range runs its weight panels outside its row tiles only where that is
# this much faster inside the executable over the lengths timed (`measured_loop_order`)
LOOP_ORDER_GAIN = 0.01


def columns_outside(schedule: str) -> str | None:
    """The schedule of a packed tile with its row tiles outside the column panels (`Tile.rows_outer`)
    with the loop order turned: the column panels outside, the same tile, packing and row copies.
    None for any other schedule."""
    block, inner = split(schedule)
    tile = Tile.parse(inner)
    if tile is None or not tile.pack or not tile.rows_outer:
        return None
    return in_class(block, replace(tile, rows_outer=False).name)


def measured_loop_order(compiled, planned: Planned, options: Options, workers: meas.Workers | None = None):
    """Over a range: the kernels of the plan in packed tiles with their row tiles outside the column
    panels, run with the column panels outside where the executable runs faster so. The plan's
    executable and the one with those kernels turned are timed in turns (`alternated`) at
    `loop_order_points` (one symbol: each power of two and each bucket's ends); a bucket keeps its
    kernels turned where its points ran LOOP_ORDER_GAIN faster (the ratios' geometric mean), or
    else, over one symbol, turned above the two-row copies only (a LengthSwitch between the two
    orders of the same tile and packing) where that mean, with the lengths up to them unchanged, is
    LOOP_ORDER_GAIN below 1 (`_turned_where`).

    Timed at the lengths `measured_dispatch` times (1-3, 8, 22-23, 64 and 181 in the bucket 1..181)
    and always in the same order (`alternated` before it alternated the order), the stage kept the
    transformer block's rows-outside projections in that bucket in six of eight cold optimizes (its
    ratios there 0.97-1.04), where the two executables timed in a process of their own ran
    0.946-0.988x with them turned over those lengths (four plans; Xeon model 167).

    The family of a contraction over symbolic rows is chosen by its tiles timed alone
    (`row_copies`), and alone, at a few rows, the two orders rank otherwise than inside the model:
    the transformer block's 384 x 384 projections over seq=1..512 (Xeon model 167) timed 1.5 us
    faster at 2-8 rows with their rows outside (12.0 against 13.5 at 8) and 10 % slower from 23 rows
    on, and the rows-outside family was kept. With its 28 such kernels turned, gpt_like's one plan
    ran 3 % faster at 8, 3-6 % at 16-64, 2-4 % at 128, the same at 1; the block's (4 kernels) 1-5 %
    faster at 8-16, 0-2 % at 22-64 (each pair of executables in turns in one process, three times).
    (Their profiles inside the executables put the kernels' own gains higher, 8-13 % for some: the
    calls timed one by one.)
    Returns (compiled, planned); the plan names the kernels turned (`meta["columns_outside"]`, "c4>2"
    for one turned above length 2), `planned.loop_order` holds every ratio timed."""
    from .dynamic import DISPATCH_ON, bucket_of, plan_buckets
    plan = planned.plan
    turned = {i: t for i, k in enumerate(plan.kernels) if (t := columns_outside(k.schedule)) is not None}
    if not turned:
        return compiled, planned
    graph = planned.loaded.graph

    def with_turned(which: Mapping[int, int]) -> Plan:
        """`plan` with kernel i turned above length which[i] (0: everywhere; else a LengthSwitch)."""
        def schedule(i: int, k) -> str:
            if i not in which:
                return k.schedule
            if not which[i]:
                return turned[i]
            layout, inner = split(k.schedule)
            return in_class(layout, LengthSwitch(inner, which[i], split(turned[i])[1]).name)
        out = replace(plan, kernels=tuple(replace(k, schedule=schedule(i, k)) for i, k in enumerate(plan.kernels)))
        return replace(out, meta={**out.meta, "columns_outside": ",".join(
            plan.kernels[i].id + (f">{which[i]}" if which[i] else "") for i in sorted(which))})
    every = with_turned({i: 0 for i in turned})
    try:
        other = emit(graph, every, options, planned.machine, workers)
    except KernorchError as e:  # (a tile the turned order does not apply to: the plan stays)
        log.info("loop order: the kernels with columns outside did not build (%s)", e)
        return compiled, planned
    parts, on = plan_buckets(plan.meta), plan.meta.get(DISPATCH_ON, options.ranges[0][0])

    def bucket(point: Mapping[str, int]) -> int:
        return bucket_of(parts, point[on]) if parts else 0
    buckets = {plan.kernels[i].bucket for i in turned}
    points = [p for p in loop_order_points(options.ranges, [key for key, _ in planned.measured.at], parts)
              if bucket(p) in buckets]
    over, timed = _timed_at(other, compiled, graph, points, options, "loop order")
    log.info("loop order: %d kernels with columns outside, the executable's time against the plan's: %s",
             len(turned), ", ".join(f"{k} {r:.3f}" for k, r in timed.items()))
    planned = replace(planned, loop_order=timed)
    served: dict[int, list[tuple[int, float]]] = {}
    for p, r in zip(points, over):
        served.setdefault(bucket(p), []).append((p[on], r))
    way = {b: w for b, rs in served.items() if (w := _turned_where(rs, len(options.ranges) == 1)) is not None}
    kept = {i: way[plan.kernels[i].bucket] for i in turned if plan.kernels[i].bucket in way}
    if not kept:
        return compiled, planned
    if kept == {i: 0 for i in turned}:
        return other, replace(planned, plan=every)
    mixed = with_turned(kept)
    return emit(graph, mixed, options, planned.machine, workers), replace(planned, plan=mixed)


# the rounds `_timed_at` shares among a stage's points (each point at least MIN_ROUNDS, at most
# `alternated`'s default): the stage keeps a change by the ratios' geometric mean over its points, whose
# spread falls with the rounds timed at all of them. The rounds' ratios spread by 1.3 % (one standard
# deviation) at seq=1-32, 2.5 % at 128, 3-5 % at 512 (two executables of the transformer block, Xeon
# model 167): at 4 rounds each, the mean over the loop order's 12 points of seq=1..512 errs by some
# 0.4 % (0.3 at 8), against the 1 % (LOOP_ORDER_GAIN) it is judged by; in 8 rounds each, its timing
# took about 3.4 s of the block's cold optimize of 41 s (sixty-ninth session)
STAGE_ROUNDS = 32
MIN_ROUNDS = 4


def stage_rounds(points: int) -> int:
    """The rounds of `alternated` each of a stage's `points` is timed in (STAGE_ROUNDS shared)."""
    return max(MIN_ROUNDS, min(ROUNDS, math.ceil(STAGE_ROUNDS / max(points, 1))))


def _timed_at(changed, compiled, graph: Graph, points: Sequence[Mapping[str, int]], options: Options,
              stage: str = "executable") -> tuple[list[float], dict[str, float]]:
    """`changed`'s time over `compiled`'s at each binding of `points`, in turns (`alternated`, in
    `stage_rounds` rounds each), as a list and by the bindings' key text (for the report); a
    progress bar named for `stage` counts the points."""
    from . import executor, progress
    from .dynamic import bind, key_text, sample_key
    rounds = stage_rounds(len(points))
    over = []
    with progress.bar(f"{stage}: time in turns", len(points)) as bar:
        for p in points:
            over.append(compared(changed, compiled, executor.random_feeds(bind(graph, p), options.seed), p, options,
                                 rounds=rounds)[0])
            bar.advance()
    return over, {key_text(options.ranges, sample_key(p)): r for p, r in zip(points, over)}


def _turned_where(timed: Sequence[tuple[int, float]], one_symbol: bool) -> int | None:
    """Where a bucket keeps its kernels turned, from the turned executable's time over the plan's at
    each length timed in it (`timed`: (length, ratio)): 0 at every length, where the ratios' geometric
    mean is LOOP_ORDER_GAIN below 1; else, over one symbol, `max(SMALL_ROWS)` (a length switch: the
    plan's loop order up to it, turned above) where that mean, counting the lengths up to it as
    unchanged, is; None nowhere. Up to two rows a GEMM runs its one- and two-row copies, where the
    two orders differ least (the transformer block over seq=1..512, Xeon model 167, its bucket
    1..22 turned: 1.014 and 1.025 at 1 and 2, 0.958 and 0.969 at 4 and 8; 0.994 in all, which kept
    it as it was; 0.988 with the lengths up to two unchanged, a switch now). A switch is not
    preferred where turning whole passes too: its kernels are built whole once more (a cold
    optimize of the block whose bucket 1..181 passed both ways, 0.989 and 0.988, took 11.4 s in
    this stage for its switches against 5-7)."""
    def mean(rs) -> float:
        return statistics.geometric_mean(rs) if rs else 1.0
    if mean([r for _, r in timed]) <= 1 - LOOP_ORDER_GAIN:
        return 0
    small = max(SMALL_ROWS)
    switches = one_symbol and any(n <= small for n, _ in timed) and any(n > small for n, _ in timed)
    if switches and mean([r if n > small else 1.0 for n, r in timed]) <= 1 - LOOP_ORDER_GAIN:
        return small
    return None


def loop_order_points(ranges, keys: Sequence, parts: Sequence[tuple[int, int]] = ()) -> list[dict[str, int]]:
    """The bindings `measured_loop_order` times, given the sample `keys` (`Measured.at`'s) and the
    plan's buckets `parts` ((lo, hi) of the symbol it dispatches on). Over one symbol: each power of
    two in the range (every octave once, as the range's weighting counts them), its ends, the
    buckets' ends and the samples. (The lengths `measured_dispatch` times, the ends of the samples'
    buckets, were 1-3, 22-23 and 181 of 1..181, where the turn gains least: the block's
    projections gained 3-7 % at 16, 32 and 128 rows, 1-4 % at 2-8.) Over several symbols, every
    sample (each symbol's ends and middle in every combination: the long pairs, where a weight
    panel's rows stream longest, among them)."""
    if len(ranges) == 1:
        name, lo, hi = ranges[0]
        octaves = {1 << i for i in range(hi.bit_length()) if lo <= 1 << i <= hi}
        return [{name: n} for n in sorted({lo, hi, *octaves, *(e for part in parts for e in part), *keys})]
    names = sorted(n for n, _, _ in ranges)  # (a key holds their values in this order: dynamic.sample_key)
    return [dict(zip(names, k)) for k in sorted(keys)]


# a packed GEMM of the last bucket is offered another tile family (`long_tiles`) where its contraction
# alone ran this much faster in it at the bucket's longest sample
LONG_TILE_GAIN = 0.03


def long_tiles(planned: Planned, bucket: int, span: tuple[int, int], along: int | None = None) -> dict[int, str]:
    """Per kernel of the plan's bucket `bucket` (its lengths `span` of the symbol it dispatches on:
    over several, the `along`-th of a sample key's values) in a packed register tile (a GEMM with
    its weight packed, maybe its epilogue fused): the packed tile of another family (columns per
    tile, loop order) its contraction alone ran LONG_TILE_GAIN faster in at the bucket's sample of
    the most rows (the product of its values) than in any tile of the kernel's family, where one
    did (in the kernel's layout class; the fastest there, the tile with row copies fitted for it
    where it was measured so). The range's weights choose one family for the fusions around a
    contraction, mostly by the short lengths: the transformer block's projections over seq=1..512
    ran 14 x 32 tiles where 6 x 64 ones take 7 % less at 512 rows alone, its 384 x 1536 GEMM 12 %
    less (Xeon model 167)."""
    plan, measured, graph = planned.plan, planned.measured, planned.loaded.graph
    inside = [n for n, _ in measured.at if n and span[0] <= _along(n, along) <= span[1]]
    if not inside:
        return {}
    longest = max(inside, key=lambda n: math.prod(n) if isinstance(n, tuple) else n)

    def family(t: Tile) -> tuple:
        return t.nb, t.rows_outer, t.serial
    out = {}
    for i, k in enumerate(plan.kernels):
        tile = retileable(k, graph, bucket)
        if tile is None:
            continue
        layout = split(k.schedule)[0]
        lin = [graph.by_name[m] for m in k.members if m in graph.by_name and graph.by_name[m].op == "matmul"]
        key = structural_key(lin, graph, [lin[0].name])
        timed = [(t, other, at_length(m, longest).median_ns) for (kk, _, sched), m in measured.measurements.items()
                 if kk == key and m.ok and split(sched)[0] == layout
                 and (other := Tile.parse(t := split(sched)[1])) is not None and other.pack]
        ours = [ns for _, other, ns in timed if family(other) == family(tile)]
        theirs = [(ns, not other.copies, t) for t, other, ns in timed if family(other) != family(tile)]
        if ours and theirs:
            ns, _, best = min(theirs)
            if ns <= (1 - LONG_TILE_GAIN) * min(ours):
                out[i] = in_class(layout, best)
    return out


def retileable(k, graph: Graph, bucket: int) -> Tile | None:
    """The packed register tile of plan kernel `k` where `long_tiles` may re-tile it: a kernel of
    `bucket` around one matmul (a GEMM with its weight packed, maybe its epilogue fused); else None."""
    tile = Tile.parse(split(k.schedule)[1])
    if k.bucket != bucket or tile is None or not tile.pack:
        return None
    return tile if sum(graph.by_name[m].op == "matmul" for m in k.members if m in graph.by_name) == 1 else None


def _along(key, i: int | None) -> int:
    """A sample key's value of one symbol: the key itself over one, its `i`-th value over several."""
    return key if i is None else key[i]


def measured_long_tiles(compiled, planned: Planned, options: Options, workers: meas.Workers | None = None):
    """Over a range, the packed GEMMs of the plan's last bucket along the symbol it dispatches on
    (of a plan that serves the range alone: the bucket of its last sample, `dynamic.sample_edges`,
    made a bucket of its own, along the symbol of the widest range; of a last bucket that serves
    more than its last sample's lengths, those lengths cut off as a bucket of their own: gpt_like's
    own plan of seq=5..512 over batch x seq, its GEMMs re-tiled, ran 0.96-0.98x at 3x512 and 8x512
    and 1.01-1.04x at 1x5 and 3x5, and was not kept) in the tiles `long_tiles`
    finds, where the executable runs faster so: the plan's executable and the one with them
    re-tiled timed in turns (`alternated`) at the bucket's points (`long_tile_points`); kept where
    the ratios' geometric mean is LOOP_ORDER_GAIN below 1. Their weights are then packed for both
    families where the other buckets keep the first. The transformer block over seq=1..512 (Xeon
    model 167), its bucket 182..512's three projections and its 384 x 1536 GEMM so re-tiled to 6 x
    64 by hand: 0.95-0.98x the plan's time at 200-300, 0.97-0.99x at 512 (three timings each, in one
    process). Over batch=1..8 x seq=1..512 the one plan ran 1.07-1.11x its static plans at 8x128,
    3x300 and 8x512 (sixty-sixth session), its FFN's second GEMM in t14x32p 12-15 % slower there
    than the static plan's t6x64p inside the executables (7 % alone, at 8x512). Over the whole
    range's measurements only (not buckets planned apart). Returns (compiled, planned); the plan
    names the kernels re-tiled (`meta["long_tiles"]`), `planned.long_tiles` holds every ratio timed."""
    from .dynamic import BUCKET_BOUNDS, DISPATCH_ON, cut, plan_buckets, sample_edges
    plan, graph = planned.plan, planned.loaded.graph
    parts = plan_buckets(plan.meta)
    if parts and plan.meta.get(BUCKET_BOUNDS) != "range":
        return compiled, planned  # (buckets planned over their own lengths (--buckets): measured apart)
    on = plan.meta.get(DISPATCH_ON) or max(options.ranges, key=lambda r: r[2] / r[1])[0]
    rng, names = next(r for r in options.ranges if r[0] == on), sorted(n for n, _, _ in options.ranges)
    along = names.index(on) if len(names) > 1 else None
    keys = [key for key, _ in planned.measured.at]
    values = sorted({_along(key, along) for key in keys})
    edge = sample_edges(rng, values)[-1] if len(values) > 1 else None
    if not parts and edge is None:
        return compiled, planned
    if not parts:  # (the one plan as a plan of one bucket, cut below; each kernel's id then names its bucket)
        turned = {"columns_outside": ",".join(f"b0.{t}" for t in plan.meta["columns_outside"].split(","))
                  } if plan.meta.get("columns_outside") else {}
        dispatched = {DISPATCH_ON: on} if along is not None else {}
        plan = dispatch_plan([plan], cut(rng, []), options,
                             {**plan.meta, **turned, BUCKET_BOUNDS: "range", **dispatched})
        parts = plan_buckets(plan.meta)
    if edge is not None and edge >= parts[-1][0]:  # (the last bucket serves more than its last sample's
        plan = _split_last(plan, rng, parts, edge, options)  # lengths: those get a bucket of their own)
        parts = plan_buckets(plan.meta)
    last, span = len(parts) - 1, parts[-1]
    retiled = long_tiles(replace(planned, plan=plan), last, span, along)
    if not retiled:
        return compiled, planned
    other = replace(plan, kernels=tuple(replace(k, schedule=retiled.get(i, k.schedule))
                                        for i, k in enumerate(plan.kernels)))
    other = replace(other, meta={**other.meta, "long_tiles": ",".join(other.kernels[i].id for i in sorted(retiled))})
    try:
        ran = emit(graph, other, options, planned.machine, workers)
    except KernorchError as e:  # (a fusion the other tile does not apply to: the plan stays)
        log.info("long tiles: the re-tiled kernels did not build (%s)", e)
        return compiled, planned
    points = long_tile_points(options.ranges, keys, plan_buckets(other.meta), on, span)
    over, timed = _timed_at(ran, compiled, graph, points, options, "long tiles")
    log.info("long tiles: %d kernels of the bucket %s=%d..%d re-tiled, the executable's time against the plan's: %s",
             len(retiled), on, span[0], span[1], ", ".join(f"{k} {r:.3f}" for k, r in timed.items()))
    planned = replace(planned, long_tiles=timed)
    if not over or statistics.geometric_mean(over) > 1 - LOOP_ORDER_GAIN:
        return compiled, planned
    return ran, replace(planned, plan=other)


def _split_last(plan: Plan, rng: tuple[str, int, int], parts: Sequence[tuple[int, int]], edge: int,
                options: Options) -> Plan:
    """`plan` (with buckets along `rng`'s symbol, `parts`) with its last bucket cut after `edge`, the
    same kernels on both sides (`Plan.split_last`); the kernels turned in the last are named turned
    in both (meta["columns_outside"])."""
    from .dynamic import cut
    last, name = len(parts) - 1, rng[0]
    weights, named = bucketed([*((name, lo, hi) for lo, hi in parts[:-1]), *cut((name, *parts[-1]), [edge])],
                              options)
    turned = [t for t in plan.meta.get("columns_outside", "").split(",") if t]
    turned += [f"b{last + 1}.{t.removeprefix(f'b{last}.')}" for t in turned if t.startswith(f"b{last}.")]
    return plan.split_last(weights, {**plan.meta, **named, **({"columns_outside": ",".join(turned)} if turned else {})})


def long_tile_points(ranges, keys: Sequence, parts: Sequence[tuple[int, int]], on: str,
                     span: tuple[int, int]) -> list[dict[str, int]]:
    """The bindings `measured_long_tiles` times its bucket `span` of the symbol `on` at: over one
    symbol, the bucket's `loop_order_points` (its ends, the octaves and samples in it); over
    several, each sample in the bucket and each with `on` at the bucket's first value (the fewest
    rows it serves: the samples of batch x seq=1..512 in seq=109..512 are all at seq=512)."""
    points = [p for p in loop_order_points(ranges, keys, parts) if span[0] <= p[on] <= span[1]]
    if len(ranges) == 1:
        return points
    firsts = [{**p, on: span[0]} for p in points]
    return sorted({tuple(sorted(p.items())): p for p in [*points, *firsts]}.values(), key=lambda p: sorted(p.items()))


def _dispatch_timed(probes: Sequence[tuple[int, ...]], own: Sequence[int]) -> dict[int, tuple[int, ...]]:
    """The lengths `measured_dispatch` times, per bucket: a bucket with its own plan (`own`) at every
    one of its `probes`; while the first bucket has its own plan (the one plan then runs as a called
    function), each other bucket at its first length, where a call's fixed cost weighs the most
    (gpt_like, Zen 2: seq=181..512 took 6 of the stage's 9 s, its 55 ms runs against a call's
    15 us); otherwise the one plan runs as in its own executable and is not timed."""
    return {k: ns if k in own else ns[:1] for k, ns in enumerate(probes) if k in own or (k > 0 and 0 in own)}


def dispatch_probes(rng: tuple[str, int, int], lengths: Sequence[int]) -> list[tuple[int, ...]]:
    """Per sample length of `lengths` (ascending, in the range `rng`): the lengths its bucket is
    timed at by `measured_dispatch`: its first, its geometric middle, the sample and its last
    (dynamic.sample_edges; the middle is the sample but at the ends of the range)."""
    from .dynamic import cut, sample_edges
    return [tuple(sorted({a, math.isqrt(a * b), n, b}))
            for (_, a, b), n in zip(cut(rng, sample_edges(rng, lengths)), lengths)]


def compared(a, b, feeds, binding: Mapping[str, int], options: Options, rounds: int | None = None,
             turn: int = 0) -> tuple[float, float, float]:
    """`alternated(a, b, feeds)` (`feeds` of the shape `binding` gives), kept in the profile database
    under both executables' libraries (what each runs: `relax.executable_key`), the binding, the
    machine and `turn` (a pair timed again in one stage: `screen_samples`): a second optimize with
    the same database finds its executables timed, takes the decisions the first took, and builds
    nothing those did not (the transformer block over seq=1..512 re-optimized warm, Xeon model 167:
    18.5 s, 12 of them timing and building for the stages of this module, its executable taking
    other turns than the first's; with them kept, 5.6 s and the same plan in three runs). With
    `options.remeasure`, timed again; an executable not kept as a library is timed every time."""
    key = _comparison_key(a, b, binding, options, turn)
    if key is None:
        return alternated(a, b, feeds, rounds=rounds or ROUNDS)
    with ProfileDB(options.resolved_db()) as db:
        kept = None if options.remeasure else db.comparison(key)
        if kept is not None:
            return kept
        out = alternated(a, b, feeds, rounds=rounds or ROUNDS)
        db.keep_comparison(key, out)
    return out


def _comparison_key(a, b, binding: Mapping[str, int], options: Options, turn: int) -> str | None:
    """What `compared`'s timing depends on, or None where an executable is not kept as a library."""
    libraries = [getattr(getattr(x, "executable", None), "library", None) for x in (a, b)]
    if None in libraries:
        return None
    text = json.dumps([COMPARISON_VERSION, *(Path(p).stem for p in libraries), sorted(binding.items()),
                       meas.target_of(a.machine, options), options.threads, options.seed, turn])
    return hashlib.sha256(text.encode()).hexdigest()


COMPARISON_VERSION = 1  # how `compared` times (`alternated`): a new way keeps nothing timed the old way
ROUNDS = 7  # `alternated`'s rounds, at most (made even)


def alternated(a, b, feeds, rounds: int = ROUNDS, round_s: float = 0.02, budget_s: float = 0.5,
               ) -> tuple[float, float, float]:
    """Executables `a` and `b` on `feeds`, timed in turns: up to `rounds` rounds (at least 3, made
    even: each order as often) of as many calls as take about `round_s` each (at least one), the
    rounds cut to about `budget_s` of calls in all where the calls are long (gpt_like at seq=512,
    Zen 2: 7 rounds of 3 calls of 57 ms took 3.3 s a length; the ratio of two 57 ms calls varies by
    about 1 %). Returns a's time over b's as the median of the rounds' ratios (`peers.paired_ratio`:
    two timings seconds apart, in the same phase of the host), and each one's median seconds per
    call."""
    import numpy as np
    from .peers import paired_ratio
    once = max(max(min(x.time(feeds, runs=2, warmup=1)) for x in (a, b)), 1e-6)
    calls = max(1, int(round_s / once))
    rounds = min(rounds, max(3, int(budget_s / (2 * calls * once))))
    rounds += rounds % 2  # (as many rounds in each order)
    times: dict[str, list[float]] = {"a": [], "b": []}
    for r in range(rounds):
        # each round in the other order: timed first in every round (and loaded first), of two
        # executables of the same plan the one ran 1.1-1.4 % slower (geometric means at 1-128; the
        # transformer block over seq=1..512, in an optimize's process, Xeon model 167; the orders
        # alternated, in a process of their own, 1.002-1.010)
        for x, name in ((a, "a"), (b, "b"))[::1 if r % 2 == 0 else -1]:
            times[name] += x.time(feeds, runs=calls, warmup=0)
    return paired_ratio(times, "a", "b", calls), float(np.median(times["a"])), float(np.median(times["b"]))
