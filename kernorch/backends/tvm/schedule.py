"""Schedules without tuning: micro-kernel tiles for contractions, rules for everything else.

    mod = schedule(lower(...), target, "default")    # the rule chain
    mod = schedule(lower(..., "t14x32p"), target, "t14x32p")   # one micro-kernel variant

`schedule()` marks its result with the attribute "tirx.is_scheduled", so dlight passes run later
on a Relax module leave it alone.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import replace
from typing import Callable, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import tirx
from tvm import s_tir

from ...ir import KernorchError
from ...kernels import LengthSwitch, Tile, Winograd, blocked, split
from ...kernels.tiles import NARROW_KEYS, PADDED_ROWS, SERIAL_MAX_MACS, SMALL_ROWS, ran_copy, row_tile
from ...kernels.variants import CONVERSIONS
from .lower import (AT_LENGTH_FUNC, AT_LENGTH_WHEN, BOUNDS_ATTR, CAUSAL_ATTR, DERIVED_ATTR, NARROW_KEYS_FUNC,
                    NARROW_KEYS_WHEN, OPERAND_PADDED, QUERIES_PADDED, ROWS_OUT, SWITCH_FIRST, UNPACK, VIEW, bounds_of,
                    derived_bounds, divisible, num_inputs, symbol_vars)
from .passes import LAUNCH
from .tirwalk import (buffers_in, found, is_call, loads, map_expr, operands, rewrite, shift_indices, substitute,
                      substitute_buffers, unmerge_rows, with_body)
from .target import vector_bits

log = logging.getLogger(__name__)

#: Bumped whenever a rule or template generates other code: measurements of older schedules are
#: then not reused (the profile database keys every measurement by it, see measure.versions).
#: 50: a masked attention over a range lowers (it was refused), and kernels refused for inputs
#: that sent an index out of range are built: those stored refusals must not stand. 51: version 50
#: also judged a branch only at the lengths that reach it, which passed kernels measured over the
#: whole range that fail the check at a bucket's end (seq=108) when the executable is built.
#: 52: a static row extent the tile does not divide runs its last tile in a reduction loop of its
#: own, unguarded (`_peeled_tail`): tiles of 14 and 6 rows measured slow for it before; a masked
#: pass over a symbolic length runs whole vectors unmasked (`_whole_vectors_unmasked`). 53: a
#: padding copy's vector across a symbolic length is loaded masked (`_masked_loads`). 54: the
#: copies feeding a parallel contraction run in its parallel launch (`ONE_LAUNCH`). 55: where a
#: whole vector of keys is inside the length, a mask added to the padded attention's scores is read
#: by the key unguarded (`_inside`). 56: over symbolic rows a panel's first tiles prefetch the next
#: one, a share each (`PREFETCH_SPREAD`), not its last tile alone. 57: a one-row tile prefetches nothing.
#: 58: over symbolic rows a panel's last tile runs the fetching loop too (its exact row copies).
#: 59: the run-time choice among row copies counts a copy's padded rows against it (`_copy_cost`).
#: 60: a contraction's operands are told apart by buffer, not name (`_loaded_buffers`).
#: 61: a panel's last tile over symbolic rows fetches the shares of the tiles its panel lacks.
#: 62: a padded attention copies its queries tile by tile, inside its row tiles' loop.
#: 63: over static keys a padded attention's mask or bias copy stays a stage (`_inline_pass`).
#: 64: a causal attention's row tiles skip the keys past their last row (`_skip_masked_keys`).
#: 65: a transpose over a symbolic innermost axis padded to the vectors is tiled (`_tile_transpose`).
#: 66: a GEMM over a batch of sequences sharing its weights runs their rows as one (`_over_flat_rows`).
#: 67: a row tile's reductions accumulate its rows' lane partials chunk by chunk (`_partials_by_chunk`).
#: 68: the accumulators of a static row tail padded to whole tiles (`_accumulators_padded`).
#: 69: a static kernel's first PREFETCH_SPREAD tiles of a panel fetch the next, a power of two steps apart.
SCHEDULES_VERSION = 69

_DATA_PAR, _COMM_REDUCE = 0, 2  # tirx.IterVar kinds
_MIN_ROWS = 4  # the row rule needs this many rows to share among threads

class _NotApplicable(Exception):
    """A schedule rule does not fit this PrimFunc (not an error)."""


def _without_type_checks(cls) -> int:
    """TVM checks the arguments of every schedule primitive against its annotations, in Python, on
    each call (s_tir.schedule._type_checker): 16-30 % of scheduling a kernel over seq (0.32 -> 0.22
    s for a LayerNorm + GEMM in three row tiles, 0.30 -> 0.25 s for attention scores; the same
    schedules, structurally equal; Zen 3). The primitives are called unchecked instead (a wrong
    argument then fails in TVM's C++). Returns how many were unwrapped."""
    n = 0
    for name, attr in list(vars(cls).items()):
        code = getattr(attr, "__code__", None)
        if code is not None and code.co_name == "wrap" and code.co_filename.endswith("_type_checker.py"):
            setattr(cls, name, attr.__wrapped__)
            n += 1
    return n


_without_type_checks(s_tir.Schedule)

PADDED_ATTR = "kernorch.padded_columns"  # a static contraction whose columns were padded to its tile
# iterations x work each below which a loop (or the row rule's row loop) stays serial. A parallel
# launch cost about 3 us on a 2-core Zen 4 VM (1.4 us on another day): transformer_block's 64-wide
# row mean over 32 rows took 3.0 us in parallel and 0.2 serial, its 32x64 LayerNorm 1.2 and 0.6,
# its 32x256 GELU 5.6 and 3.7, its 4x32x32 softmax 5.7 and 5.5 (each with 2 threads, alone)
PARALLEL_MIN_WORK = 16384
# ... and for a loop holding a contraction, the multiply-adds below which it stays serial (its
# innermost iterations are one each, a lane of a vector FMA): about what one core does in a launch's
# time (kernorch.kernels.tiles.SERIAL_MAX_MACS, half of it)
PARALLEL_MACS = SERIAL_MAX_MACS // 2
# ... and for a loop writing what a parallel contraction after it reads (`_serial_when_small`)
FEEDING_MIN_WORK = PARALLEL_MIN_WORK // 4


def schedule(mod: tvm.IRModule, target: tvm.target.Target, mode: str = "default",
             bounds: dict[str, int] | None = None, at: Sequence[int] | None = None) -> tvm.IRModule:
    """Schedule `mod["main"]` for the CPU without tuning.

    `bounds` ({"seq": 8}): the largest value of each symbol the kernel serves (kernorch.dynamic; a
    bucket's upper end). A loop over a symbolic extent stays serial when even that largest value
    is too little work to share among threads (a parallel launch costs ~2 us, a row of work less).
    `at` (one symbol): the only lengths this build will run at, a measurement's samples; a tile's
    copies that none of them picks are not scheduled (`_tile_over_rows`, `_with_narrow_keys`) and
    branches none of them takes are dropped (`_without_dead_branches`), so what is compiled is what
    the executable runs at those lengths, without the code for the others.

    mode "none": return `mod` unchanged (naive single-threaded loops: the measurement baseline).
    mode "default": inline injective stages, then the first rule that applies and does not throw:
      contraction (matmul/conv register tiling + epilogue), row fusion (softmax/layernorm-like
      chains under one parallel row loop, rfactor-vectorized reductions), per-block generic
      (parallel outer + vectorized inner; reductions rfactor-vectorized); and finally the generic
      rule block by block on the un-inlined function. Every rule works on a fresh Schedule, so a
      failing rule leaves nothing behind.

    dlight's CPU rules are deliberately not in the chain (measured here): dl.cpu.GEMV on a
    1024x1024 GEMV took 21.6 s to build (128-lane vectors + unroll pragmas) and ran slower than
    untuned (1.44 vs 1.13 ms; generic rule: 0.07 ms, 0.1 s build). dl.cpu.Reduction computes
    reductions under the last stage's fused spatial loop, which recomputes keepdims reductions
    per element; the row rule checks for recomputation and vectorizes the reductions.
    `_rule_dlight_gemv` stays available for experiments.
    """
    if mode == "none":
        return mod
    def bounded(func):
        every = derived_bounds(func, bounds)
        return func.with_attr(BOUNDS_ATTR, {k: int(v) for k, v in every.items()}) if every else func
    func = bounded(mod["main"])
    lanes = max(vector_bits(target) // 32, 4)
    threads = int(target.attrs.get("num-cores", 1))
    inner = split(mode)[1]
    wino = Winograd.parse(inner)
    if wino is not None:  # a Winograd variant: its template, or a refusal
        try:
            sch = _rule_winograd(func, lanes, wino)
        except Exception as e:  # noqa: BLE001 - the variant does not apply to this kernel
            raise KernorchError(f"winograd {mode} does not apply: {type(e).__name__}: {_first_line(e)}") from None
        return _scheduled(sch, f"winograd {mode}")
    switch = LengthSwitch.parse(inner)
    if switch is not None:
        return _length_switch(mod, target, mode, switch, bounds, at)
    tile = Tile.parse(inner)
    if tile is not None:  # a micro-kernel variant: exactly this tile, or a refusal (never another rule)
        statics = {n: f for n, f in _at_length_copies(mod).items() if at is None or n in at}
        out = _tile_over_rows(func, lanes, tile, mode, threads, at, tuple(statics))
        if any(gv.name_hint == NARROW_KEYS_FUNC for gv in mod.get_global_vars()):
            narrow = mod[NARROW_KEYS_FUNC]
            out = _with_narrow_keys(out["main"], bounded(narrow), narrow.attrs[NARROW_KEYS_WHEN], lanes,
                                    replace(tile, nb=NARROW_KEYS), mode, threads, at, tuple(statics))
        out = _with_static_lengths(out["main"], statics, target)
        return tvm.IRModule({"main": _without_dead_branches(out, at)})
    if inner not in ("default", *CONVERSIONS):
        raise KernorchError(f"unknown schedule mode {mode!r} (expected 'none', 'default', a tile like 't14x32p', "
                            "optionally after a layout like 'b16/')")
    try:
        base = _inline_pass(_pad_to_tile(func, lanes, None))
    except Exception as e:  # noqa: BLE001 - inlining is an optimisation only
        log.debug("inline pass failed: %s", e)
        base = func
    rules: list[tuple[str, Callable[[], s_tir.Schedule | None]]] = [
        ("contraction", lambda: _rule_contraction(base, lanes)),
        ("row", lambda: _rule_row(base, lanes)),
        ("generic", lambda: _rule_generic(base, lanes)),
        ("generic-noinline", lambda: _rule_generic(func, lanes, careful=True)),
    ]
    for name, rule in rules:
        try:
            sch = rule()
        except _NotApplicable as e:
            log.debug("rule %s not applicable: %s", name, e)
            continue
        except Exception as e:  # noqa: BLE001 - any failing rule falls back to a simpler one
            log.debug("rule %s failed: %s: %s", name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            continue
        if sch is None:
            continue
        log.debug("scheduled with rule %s", name)
        return _scheduled(sch, name)
    log.warning("no schedule rule applied; the kernel stays untuned")
    return mod


def scheduled_for_lengths(mode: str) -> bool:
    """Whether `schedule`'s `at` can change what `mode` schedules (a micro-kernel tile's copies and
    branches, a length switch's tiles; no other mode reads it)."""
    inner = split(mode)[1]
    return Tile.parse(inner) is not None or LengthSwitch.parse(inner) is not None


def _length_switch(mod: tvm.IRModule, target, mode: str, switch: LengthSwitch, bounds: dict[str, int] | None,
                   at: Sequence[int] | None) -> tvm.IRModule:
    """A kernel over one symbolic length in two tiles (kernels.LengthSwitch; lower.lower gave each
    tile's functions, the first's named with SWITCH_FIRST): each scheduled for the lengths it serves
    of those the build runs at (`at`, or every length up to the bound), so that neither holds the
    copies and branches only the other's lengths reach, and joined under a test of the length."""
    if not bounds or len(bounds) != 1:
        raise KernorchError(f"length switch {mode}: one symbolic length with its bound expected")
    (name, hi), = bounds.items()
    layout = split(mode)[0]
    lengths = list(at) if at is not None else list(range(1, int(hi) + 1))

    def part(is_first: bool, tile: str, served: list[int]) -> tirx.PrimFunc | None:
        if not served:
            return None
        funcs = {gv.name_hint[len(SWITCH_FIRST):] if is_first else gv.name_hint: mod[gv]
                 for gv in mod.get_global_vars() if gv.name_hint.startswith(SWITCH_FIRST) == is_first}
        return schedule(tvm.IRModule(funcs), target, tile if layout is None else blocked(layout, tile), bounds,
                        served)["main"]
    first = part(True, switch.first, [n for n in lengths if n <= switch.until])
    then = part(False, switch.then, [n for n in lengths if n > switch.until])
    if first is None or then is None:
        return tvm.IRModule({"main": first if then is None else then})
    length = symbol_vars(then)[name]
    return tvm.IRModule({"main": _either(length <= tirx.IntImm(length.ty.dtype, switch.until), first, then)
                         .with_attr("kernorch.rule", f"contraction {mode}")})


def _tile_over_rows(func, lanes: int, tile: Tile, mode: str, threads: int = 1,
                    at: Sequence[int] | None = None, static: Sequence[int] = ()) -> tvm.IRModule:
    """The micro-kernel `tile` on `func` (a GEMM over a batch of sequences: over their rows as one,
    `_over_flat_rows`); over a symbolic row extent, a copy per row count of
    `tile.copies` picked at run time by their fitted costs at the length (`_cheapest`), or without
    copies the tile and a copy of each SMALL_ROWS row count below its own for those lengths
    (`_by_rows`). `at` (the only lengths the build runs at): only the copies they pick are
    scheduled, and among those the same one runs at each of them (the cheapest of a set is the
    cheapest of any subset holding it; the tile itself always stays). A GEMM's copy runs its last
    row tile exact at the lengths that reach it (`_exact_tail`). `static`: lengths a static copy of
    the kernel serves (`_with_static_lengths`): no row copy is scheduled for them alone. (The
    attention's scores and softmax over 1..512, Zen 4: scheduled for a measurement at 1, 23 and 512
    in 0.10-0.13 s with a one-row copy no length ran, 0.06-0.08 without; for an executable in
    0.16-0.22 and 0.07-0.09 s; the code compiled the same.)"""
    def copy(t: Tile) -> tirx.PrimFunc:
        small = rows is not None and t.mr in SMALL_ROWS and t.mr < base.mr
        over = _few_rows_over_batch(func, rows, t.mr, lanes, base, mode, threads) if small else None
        if over is not None and t.mr == 1:
            return over[0]
        # (a small copy runs at up to its own rows: the batch goes inside its weight panels)
        out = _scheduled(_tiled(func, lanes, t, mode, threads, small), f"contraction {mode}")["main"]
        if over is not None:  # (from BATCH_ROWS_FROM on: a pass per position of seq, the batch as rows)
            return _either(over[1] >= tirx.IntImm(over[1].ty.dtype, BATCH_ROWS_FROM), over[0], out)
        if t.mr > 1 and rows is None:
            return _peeled_tail(out, t.mr)
        return _exact_tail(out, rows, t.mr, [n for n in lengths if runs(n) == t.mr]) if gemm and t.mr > 1 else out

    def runs(n: int) -> int:  # the copy that runs at n rows
        return tile.pick(n) if tile.copies else ran_copy(tile.mr, n)

    rows = _symbolic_rows(func)
    flat = _over_flat_rows(func, rows, lanes, tile, mode, threads)
    if flat is not None:
        return tvm.IRModule({"main": flat})

    base = replace(tile, copies=())
    bounds = list(bounds_of(func).values())
    gemm = rows is not None and _count_contractions(func) == 1 and len(bounds) == 1
    lengths = (at if at is not None else range(1, bounds[0] + 1)) if gemm else ()
    try:
        if tile.copies and rows is None:
            raise _NotApplicable("row copies need one symbolic row extent")
        if tile.copies:
            picked = {tile.pick(n) for n in at} if at is not None else {m for m, _ in tile.copies}
            copies = [c for c in tile.copies if c[0] in picked]
            return tvm.IRModule({"main": _cheapest([(c, copy(replace(base, mr=c[0]))) for c in copies], rows)})
        out = copy(base)
    except Exception as e:  # noqa: BLE001 - the variant does not apply to this kernel
        raise KernorchError(f"tile {mode} does not apply: {type(e).__name__}: {_first_line(e)}") from None
    if rows is not None:
        small = []
        ran = {ran_copy(base.mr, n) for n in (at if at is not None else SMALL_ROWS) if n not in static}
        for mr in (m for m in SMALL_ROWS if m < base.mr and m in ran):
            try:
                small.append((mr, copy(replace(base, mr=mr))))
            except Exception as e:  # noqa: BLE001 - the tile alone serves these lengths
                log.debug("no %d-row tile for %s: %s", mr, mode, _first_line(e))
        out = _by_rows(out, small, rows)
    return tvm.IRModule({"main": out})


# a batch of two-row sequences runs a pass over the weights per position of seq, the batch as rows, from this
# many sequences on (384 x 1536, weights cold, Zen 2: batch=3 178 us against 202-220 for the two passes, 4: 229
# against 208-222, 8: 456 against 316-324); below, the two-row copy with the batch inside each weight panel
BATCH_ROWS_FROM = 4


def _few_rows_over_batch(func, rows, m: int, lanes: int, tile: Tile, mode: str,
                         threads: int) -> tuple[tirx.PrimFunc, object] | None:
    """The copy a GEMM over seq rows under a batch runs at `m` (SMALL_ROWS) rows: `func` at seq=1,
    where the batch is its rows, in `tile` over them (with its own small copies for one and two
    batch rows), run for each position of seq in turn (it serves seq <= m); its parameters
    `func`'s. None where there is no such batch, the weights differ along it, or a parameter has
    seq on two axes. One or two rows per batch element are a chain of two or four multiply-adds
    per step: a 384 x 1536 GEMM at batch=8 x seq=1 took 4x its time at 1x1 (Zen 2, weights cold).
    Returns (the copy, the batch's size)."""
    batch = _shared_batch(func)
    if not isinstance(rows, tirx.Var) or batch is None:
        return None
    axes = {}
    for p in func.params:
        at = [k for k, d in enumerate(p.shape) if d.same_as(rows)]
        if len(at) > 1:
            return None
        if at:
            axes[p] = at[0]
    one = func.specialize({p: tirx.decl_buffer([_at_one(d, rows) for d in p.shape], p.dtype, p.name) for p in axes})
    if _symbolic_rows(one) is None:
        return None
    try:
        done = _tile_over_rows(one, lanes, tile, mode, threads)["main"]
    except KernorchError as e:
        log.debug("no %d-row copy over the batch for %s: %s", m, mode, e)
        return None
    body = substitute_buffers(done.body.block.body, list(zip(done.params, func.params)))
    if m > 1:  # (at every length up to m: each position of seq in turn)
        j = tirx.Var("seq_at", rows.ty.dtype)
        body = tirx.For(j, tirx.IntImm(rows.ty.dtype, 0), rows, tirx.ForKind.SERIAL,
                        shift_indices(body, [(p, axis, j) for p, axis in axes.items()]))
    return _with_root_body(tirx.PrimFunc(func.params, done.body, func.ret_type, done.attrs), body), batch


def _at_one(dim, var):
    return tirx.IntImm(var.ty.dtype, 1) if dim.same_as(var) else dim


def _shared_batch(func):
    """The size (an expression) of the symbolic batch (`_symbolic_batch`) of `func`'s one
    contraction when its vectorized operand (the weights) does not index it, else None."""
    found = _single_contraction(func)
    if found is None:
        return None
    sch, blk, loops, nsp = found
    stmt = sch.get(blk)
    operands = _contraction_operands(stmt)
    if operands is None:
        return None
    batch = _symbolic_batch([_extent(sch, lp) for lp in loops], nsp)
    ivs = list(stmt.iter_vars)
    column = ivs[nsp - 1].var.name
    weights = next((o for o in operands if column in _var_names(o)), None)
    if not batch or weights is None or any(ivs[i].var.name in _var_names(weights) for i in batch):
        return None
    size = None
    for i in sorted(batch):
        size = sch.get(loops[i]).extent if size is None else size * sch.get(loops[i]).extent
    return size


# a GEMM over batch x seq rows runs them in passes of at most this many (each pass over every weight panel): 384 x
# 1536 and 1536 x 384, weights cold, Zen 2: one pass over 512 rows took as long as two of 256, over 1024 rows 12 %
# longer than two of 512 (384 x 1536; the same for 1536 x 384), over 4096 10-25 % longer than eight of 512
FLAT_ROWS_PASS = 512


def _over_flat_rows(func, rows, lanes: int, tile: Tile, mode: str, threads: int) -> tirx.PrimFunc | None:
    """`tile` on a GEMM over a batch of sequences sharing its weights, run as a GEMM of batch x seq
    rows (`rows`: its `_symbolic_rows`): `func` with the batch and its rows merged into one symbol, scheduled over that symbol
    with its row copies, and run in passes of FLAT_ROWS_PASS rows at most (the copy of each pass
    picked by its rows). A parameter with the batch right before the rows is read as one axis of
    them (a view: the same memory); an output with the two apart (a projection transposed to
    heads, [batch, heads, seq, 64]) is written at row i's batch i // seq and position i % seq
    (`tirwalk.unmerge_rows`). None where an input has them apart, a parameter has one without
    the other, or a block is not row by row (`_row_wise`). Each weight panel is then fetched once
    a pass, where the batch outside the row tiles fetched it once per sequence and padded each one
    to the tile: a 384 x 1536 GEMM, weights cold, Zen 2: 8x2 310 -> 213 us, 2x7 270 -> 209."""
    bounds = bounds_of(func)
    if len(bounds) != 2 or (func.attrs is not None and DERIVED_ATTR in func.attrs):
        return None
    batch = _shared_batch(func) if isinstance(rows, tirx.Var) else None
    if not isinstance(batch, tirx.Var) or set(bounds) != {batch.name, rows.name}:
        return None
    inputs = num_inputs(func)
    axes = {}  # parameter name -> (its batch axis, its rows axis)
    for k, p in enumerate(func.params):
        kb = [a for a, d in enumerate(p.shape) if d.same_as(batch)]
        kr = [a for a, d in enumerate(p.shape) if d.same_as(rows)]
        if not kb and not kr:
            continue
        if len(kb) != 1 or len(kr) != 1 or (kr[0] != kb[0] + 1 and k < inputs):
            return None
        axes[p.name] = (kb[0], kr[0])
    dt = rows.ty.dtype
    flat = tirx.Var(f"{batch.name}_{rows.name}", dt)

    def rows_as(buf, extent, name=None):  # `buf` with its batch of one and its rows `extent` (one axis if merged)
        kb, kr = axes[buf.name]
        unit = tirx.IntImm(dt, 1)
        shape = ([*buf.shape[:kb], unit, extent, *buf.shape[kb + 2:]] if kr == kb + 1 else
                 [unit if a == kb else extent if a == kr else d for a, d in enumerate(buf.shape)])
        return tirx.decl_buffer(shape, buf.dtype, name or buf.name)
    most = min(FLAT_ROWS_PASS, bounds[batch.name] * bounds[rows.name])
    one = func.specialize({p: rows_as(p, flat) for p in func.params if p.name in axes})
    one = one.with_attr(BOUNDS_ATTR, {flat.name: most})
    if not _row_wise(one, flat):
        return None
    try:
        done = _tile_over_rows(one, lanes, tile, mode, threads)["main"]
    except KernorchError as e:
        log.debug("no copy over batch x seq rows for %s: %s", mode, e)
        return None
    total, j = batch * rows, tirx.Var("pass_at", dt)
    start = j * tirx.IntImm(dt, most)
    # one pass: the merged symbol its rows (loop extents, copy tests; written so that TVM's analyzer sees them in
    # 1..most, as it sees a parameter's length asserted: passes.bound_symbols), the buffers sized by them as
    # large as the longest pass's
    n = tirx.min(tirx.IntImm(dt, most), tirx.max(tirx.IntImm(dt, 1), total - start))
    ours = [q for q in done.params if q.name in axes]
    spec = done.specialize({q: rows_as(q, n) for q in ours})
    longest = done.specialize({q: rows_as(q, tirx.IntImm(dt, most)) for q in ours}).body.block.alloc_buffers
    merged = [p for p in func.params if p.name in axes and axes[p.name][1] == axes[p.name][0] + 1]
    views = {p.name: rows_as(p, total, f"{p.name}_rows") for p in merged}
    apart = {p.name: p for p in func.params if p.name in axes and p.name not in views}
    body, allocs = spec.body.block.body, spec.body.block.alloc_buffers
    # (specialize gave the body buffers of its own for the parameters': found by their names)
    own = [b for b in buffers_in(body) if b.name in axes and not any(b.same_as(a) for a in allocs)]
    body = substitute_buffers(body, [*((b, views[b.name]) for b in own if b.name in views), *zip(allocs, longest)])
    body = shift_indices(body, [(v, axes[name][1], start) for name, v in views.items()])
    body = unmerge_rows(body, [(b, apart[b.name], *axes[b.name], start, rows) for b in own if b.name in apart])
    passes = tirx.For(j, tirx.IntImm(dt, 0), (total + tirx.IntImm(dt, most - 1)) // tirx.IntImm(dt, most),
                      tirx.ForKind.SERIAL, body)
    decls = [tirx.DeclBuffer(views[p.name], data=p.data) for p in merged]
    out = tirx.PrimFunc(func.params, spec.body, func.ret_type, done.attrs).with_attr(BOUNDS_ATTR, bounds)
    return _with_root_body(out, tirx.SeqStmt([*decls, passes]), list(longest))


def _row_wise(func, rows) -> bool:
    """Whether each block of `func` computes row i of `rows` (a symbol) from row i alone: every
    access to a buffer with `rows` on an axis (one at most) indexes it there by a spatial iteration
    variable over `rows`, and that variable indexes nothing else (no reduction over the rows, no
    row read at an offset, no constant indexed by the position)."""
    sch = s_tir.Schedule(func)
    for name in _root_blocks(sch):
        blk = sch.get(sch.get_sblock(name))
        over = [iv for iv in blk.iter_vars if iv.dom.extent.same_as(rows)]
        if any(int(iv.iter_type) != _DATA_PAR for iv in over):
            return False
        row_vars = [iv.var for iv in over]
        stores = [blk.body] + ([blk.init] if blk.init is not None else [])
        if not all(isinstance(st, tirx.BufferStore) for st in stores):
            return False
        for st in stores:
            for buf, indices in [(st.buffer, st.indices), *((ld.source, ld.indices) for ld in loads(st.value))]:
                if sum(d.same_as(rows) for d in buf.shape) > 1:
                    return False
                for axis, i in enumerate(indices):
                    on_rows = buf.shape[axis].same_as(rows)
                    if on_rows != any(i.same_as(v) for v in row_vars) or \
                            (not on_rows and any(_uses(i, v) for v in row_vars)):
                        return False
    return True


def _with_narrow_keys(wide: tirx.PrimFunc, narrow: tirx.PrimFunc, when, lanes: int, tile: Tile, mode: str,
                      threads: int, at: Sequence[int] | None = None, static: Sequence[int] = ()) -> tvm.IRModule:
    """One kernel of an attention over a symbolic length scheduled twice: `wide` (scheduled) in
    its own key tile, `narrow` (lowered with its keys padded to the narrow tile's columns) in
    `tile`; the narrow copy runs where `when` (an expression of `wide`'s length) holds
    (lower.NARROW_KEYS_FUNC). The two were lowered apart, so the narrow copy's
    parameters are rebound to the wide one's buffers (and its length to the wide one's).
    `at`: the only lengths the build runs at; where `when` holds at none, no narrow copy."""
    if at is not None and not _holds_at(when, narrow, at):
        return tvm.IRModule({"main": wide})
    try:
        n = _tile_over_rows(narrow, lanes, tile, mode, threads, at, static)["main"]
    except KernorchError as e:
        log.debug("no narrow-key copy for %s: %s", mode, e)
        return tvm.IRModule({"main": wide})
    return tvm.IRModule({"main": _either(when, n, wide).with_attr("kernorch.narrow_keys", tile.nb)})


def _at_length_copies(mod: tvm.IRModule) -> dict[int, tirx.PrimFunc]:
    """The static copies of its kernel `mod` holds, by length (lower.AT_LENGTH_FUNC: an attention or
    its scores at the lengths of SMALL_ROWS)."""
    return {int(gv.name_hint[len(AT_LENGTH_FUNC):]): mod[gv] for gv in mod.get_global_vars()
            if gv.name_hint.startswith(AT_LENGTH_FUNC)}


def _with_static_lengths(func: tirx.PrimFunc, statics: dict[int, tirx.PrimFunc], target) -> tirx.PrimFunc:
    """`func` (scheduled over a symbolic length) behind its static copies (`_at_length_copies`; a
    build's own: those at lengths it runs), each scheduled by the default rule and run where its
    condition on `func`'s length holds, the shortest length's test outermost. A copy's parameters
    have the static shapes of its length: its body is made to use `func`'s buffers (the same layout
    at that length)."""
    for n, static in sorted(statics.items(), reverse=True):
        when = static.attrs[AT_LENGTH_WHEN]
        done = schedule(tvm.IRModule({"main": static.without_attr(AT_LENGTH_WHEN)}), target, "default")["main"]
        body = substitute_buffers(done.body, list(zip(done.params, func.params)))
        func = _either(when, tirx.PrimFunc(func.params, body, func.ret_type, func.attrs), func)
    return func


def _holds_at(cond, func, at: Sequence[int]) -> bool:
    """Whether `cond` (an expression of `func`'s one symbol) holds at some length of `at`; True
    where that cannot be told."""
    bounds = bounds_of(func)
    if len(bounds) != 1:
        return True
    try:
        return bool(np.any(_at_lengths(cond, next(iter(bounds)), np.asarray(at, np.int64))))
    except _NotApplicable:
        return True


def _tiled(func, lanes: int, tile: Tile, mode: str, threads: int = 1, few_rows: bool = False) -> s_tir.Schedule:
    """The micro-kernel `tile` on `func`: a convolution's tile in a blocked variant is the conv
    micro-kernel (output channels as vectors); an attention's, its scores' tile and query-row
    tile; otherwise the GEMM (in the plain layout a conv's GEMM over output channels x output
    width; `few_rows`: see `_rule_contraction`)."""
    base = _inline_pass(_pad_to_tile(func, lanes, tile))
    if _count_contractions(base) == 2:  # an attention (kernorch.candidates._attention)
        return _rule_attention(base, lanes, tile)
    conv_kernel = _contraction_name(base).startswith("conv") and split(mode)[0] is not None
    if conv_kernel:
        return _rule_conv(base, lanes, tile)
    return _rule_contraction(base, lanes, tile, threads, few_rows)


def _count_contractions(func) -> int:
    return len(_contraction_blocks(s_tir.Schedule(func)))


def _contraction_blocks(sch) -> list[str]:
    """The names of the root blocks that are contractions (matmul/conv), in order."""
    return [n for n in _root_blocks(sch) if _contraction_operands(sch.get(sch.get_sblock(n))) is not None]


def _single_contraction(func):
    """(a fresh Schedule of `func`, its one contraction block, the block's loops, how many of them
    are spatial), or None: no contraction or several, or loops that are not the
    block's own iteration variables."""
    sch = s_tir.Schedule(func)
    names = _contraction_blocks(sch)
    if len(names) != 1:
        return None
    blk = sch.get_sblock(names[0])
    stmt = sch.get(blk)
    loops = list(sch.get_loops(blk))
    if len(loops) != len(stmt.iter_vars):
        return None
    return sch, blk, loops, sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == _DATA_PAR)


def _symbolic_rows(func):
    """The symbolic row extent a contraction's tile pads (kernorch.dynamic: seq rows), or None: the
    func has one contraction with exactly one symbolic spatial axis before the column axis."""
    found = _single_contraction(func)
    if found is None:
        return None
    sch, _, loops, nsp = found
    ext = _batch_read_static([_extent(sch, lp) for lp in loops], nsp)  # (a symbolic batch is no rows)
    rows = [sch.get(lp).extent for lp, e in zip(loops[:nsp - 1], ext) if e is None]
    return rows[0] if len(rows) == 1 else None


# what a rule reads a symbolic batch axis's extent as (`_symbolic_batch`): any number larger than one
BATCH_EXTENT = 1024


def _symbolic_batch(ext: list, nsp: int) -> set[int]:
    """The symbolic spatial axes (None in a contraction's loop extents `ext`, its first `nsp`
    spatial) that are a batch outside its rows, not its rows: a static axis of more than one, or
    another symbolic one, comes after it before the columns (--shape batch=1..8 over 32-token
    rows, or over seq=1..512 rows). The tile runs over the rows (whole, or padded when symbolic)
    and the batch is one more loop outside the tiles: never padded, no row copy and no exact tail
    for its values (tiled as rows, the batch's padding and its copies were cut by the token rows'
    tile index, and the kernels ran wrong at batch=3, 5, 6, 7; over batch and seq both padded to a
    6-row tile, a 384 x 1536 GEMM took 7x and 5.6x the time of seq alone at 1x1 and 1x512)."""
    return {i for i in range(nsp - 1) if ext[i] is None
            and any(e is None or e > 1 for e in ext[i + 1:nsp - 1])}


def _batch_read_static(ext: list, nsp: int) -> list:
    """`ext` with each symbolic batch axis (`_symbolic_batch`) read as BATCH_EXTENT."""
    batch = _symbolic_batch(ext, nsp)
    return [BATCH_EXTENT if i in batch else e for i, e in enumerate(ext)]


# a length's last row tile runs in the rows it holds where the padded rows are at least 1/TAIL_SAVES of
# the multiply-adds (7 rows in 4-row tiles: 1 of 8); below that its copy of the reduction loop costs
# more compilation than it saves (23 rows in 6-row tiles: 1 of 24)
TAIL_SAVES = 20


def _tail_max(mr: int, r):
    """The most rows at which a last tile of `r` of `mr` rows runs exact (`TAIL_SAVES`): its
    `mr - r` padded rows are at least 1/TAIL_SAVES of ceil(rows / mr) * mr. (`r` an int, or the
    kernel's expression of the rows its tile holds.)"""
    return (TAIL_SAVES - 1) * (mr - r)


def _tail_pays(rows: int, mr: int) -> bool:
    return rows % mr != 0 and rows <= _tail_max(mr, rows % mr)


def _is_update(s) -> bool:
    return isinstance(s, s_tir.stmt.SBlockRealize) and s.block.name_hint.endswith("_update")


def _row_tail(loop, mr: int):
    """Of a reduction loop `loop` around a micro-kernel of `mr` unrolled rows: (the row loop's
    variable, the update block, its first row: the update's row index at row 0 of the tile), or
    None where `loop` is not that (not a serial loop, not one update and one such row loop under
    it, or a loop the update does not reduce over)."""
    if not isinstance(loop, tirx.For) or loop.kind != tirx.ForKind.SERIAL:
        return None
    updates = found(loop, _is_update)
    unrolled = found(loop, lambda s: isinstance(s, tirx.For) and s.kind == tirx.ForKind.UNROLLED
                     and isinstance(s.extent, tirx.IntImm) and int(s.extent) == mr)
    if len(updates) != 1 or len(unrolled) != 1:
        return None
    u, r = updates[0], unrolled[0].loop_var
    reduce_vars = {v for iv, e in zip(u.block.iter_vars, u.iter_values) if int(iv.iter_type) == _COMM_REDUCE
                   for v in tirx.analysis.undefined_vars(e)}
    if not any(v.same_as(loop.loop_var) for v in reduce_vars):
        return None
    row_bindings = [e for e in u.iter_values if _uses(e, r)]
    if len(row_bindings) != 1:
        return None
    return r, u, map_expr(row_bindings[0], lambda e: tirx.const(0, _dtype(r)) if e.same_as(r) else None)


def _cut_rows(loop, var, n: int):
    """`loop` with the unrolled row loop of variable `var` over its first `n` rows only."""
    def visit(s):
        if isinstance(s, tirx.For) and s.loop_var.same_as(var):
            return tirx.For(s.loop_var, s.min, tirx.const(n, _dtype(s.loop_var)), s.kind, s.body,
                            s.thread_binding, s.annotations)
        return None
    return rewrite(loop, visit)


def _exact_tail(func: tirx.PrimFunc, rows, mr: int, lengths: Sequence[int]) -> tirx.PrimFunc:
    """A contraction tiled in `mr` rows over the symbolic extent `rows` (padded to the tile, see
    `_pad_to_tile`) with its last row tile run in as many rows as are left, at lengths where that
    pays (`_tail_pays`; elsewhere it runs the whole tile, as every other tile does): the reduction
    loop is copied once per row count below `mr`, its unrolled row loop cut to that count. The
    padded rows were multiply-adds thrown away (weights in the last-level cache, Zen 4, 2 threads,
    a seq x 1536 x 384 GEMM with a GELU prologue: in 4-row tiles seq=7 47.5 us padded, 42.8 exact,
    seq=5 45.7 and 36.6, seq=8 and seq=1 unchanged; in 14-row tiles seq=7 77 and 42, seq=3 76 and
    20). The rows left cannot be run as passes of 4, 2 and 1 rows from a start known at run time
    only: the accumulators then live in memory, not registers (seq=7 in 4-row tiles: 119 us).
    The accumulators of the rows not computed keep their zeros and are not copied out (rows past
    the length never are). `lengths`: the lengths this copy runs at (those a measurement's build
    runs at, or the whole range): only the row counts their last tiles hold get a copy. `func`
    unchanged where it holds no such loop."""
    counts = sorted({n % mr for n in lengths if _tail_pays(n, mr)})
    if not counts:
        return func
    kind = _dtype(rows)

    def c(v: int):
        return tirx.const(v, kind)

    def visit(s):
        if (isinstance(s, tirx.IfThenElse) and s.else_case is not None and _fetches(s.then_case)
                and _row_tail(s.then_case, mr) is not None):
            # a panel's last tile, the one a length leaves short, runs a reduction loop of its own
            # (`_prefetch_next_panel`): the other tiles' loops stay as they are
            return tirx.IfThenElse(s.condition, rewrite(s.then_case, visit), s.else_case)
        tail = _row_tail(s, mr)
        if tail is None:
            return None
        var, _, first = tail
        left = rows - (first if _dtype(first) == kind else tirx.Cast(kind, first))
        out = s
        for n in reversed(counts):
            out = tirx.IfThenElse(left == c(n), _cut_rows(s, var, n), out)
        return tirx.IfThenElse(tirx.Or(left >= c(mr), rows > _tail_max(mr, left)), s, out)

    return _rewritten(func, visit)


def _fetches(stmt) -> bool:
    """Whether `stmt` holds a prefetch (`_prefetch_next_panel`)."""
    return bool(found(stmt, lambda x: isinstance(x, tirx.Evaluate) and is_call(x.value, "prefetch")))


def _peeled_tail(func: tirx.PrimFunc, mr: int) -> tirx.PrimFunc:
    """A contraction tiled in `mr` rows over a static row extent `mr` does not divide (512 rows in
    14-row tiles) with its reduction loop copied: one for whole tiles, one whose unrolled row loop
    runs the last tile's rows only, neither guarded. The split leaves a guard on every row of the
    update (`row < 512`) inside the reduction loop, which LLVM neither hoists nor proves, and
    around it spills the accumulators to the stack at every step (Xeon family 6 model 167, 2
    threads, hot: 512 x 384 x 384 in 14 x 32 tiles 273 GFLOP/s against 374 at 504 rows, which 14
    divides; 6 x 64 tiles 199 and 370). `func` unchanged where no update is guarded so."""
    def guarded_rows(u):  # the row count the update's guard `row < n` holds its tile's rows to, or None
        p = u.predicate
        if not isinstance(p, tirx.LT) or not isinstance(p.b, tirx.IntImm):
            return None
        return int(p.b) if any(tvm_ffi.structural_equal(e, p.a) for e in u.iter_values) else None

    def unguarded(loop):
        return rewrite(loop, lambda s: s_tir.stmt.SBlockRealize(s.iter_values, True, s.block)
                       if _is_update(s) else None)

    padded: list = []  # (the accumulators, their row axis, rows) of each tail peeled

    def visit(s):
        tail = _row_tail(s, mr)
        if tail is None:
            return None
        var, update, first = tail
        rows = guarded_rows(update)
        if rows is None or rows % mr == 0:
            return None
        axis = _row_axis(update)
        if axis is not None:
            padded.append((update.block.writes[0].source, axis, rows))
        whole = first + tirx.const(mr, _dtype(first)) <= tirx.const(rows, _dtype(first))
        return tirx.IfThenElse(whole, unguarded(s), unguarded(_cut_rows(s, var, rows % mr)))

    out = _rewritten(func, visit)
    for acc, axis, rows in padded:
        out = _accumulators_padded(out, acc, axis, -(-rows // mr) * mr)
    return out


def _row_axis(update) -> int | None:
    """The axis of the local accumulators an update guarded by `row < n` (its predicate) stores its
    row at, or None (not a local buffer, or no single such axis)."""
    acc = update.block.writes[0].source
    if acc.scope() != "local" or not isinstance(update.block.body, tirx.BufferStore):
        return None
    row_var = next((iv.var for iv, e in zip(update.block.iter_vars, update.iter_values)
                    if tvm_ffi.structural_equal(e, update.predicate.a)), None)
    axes = [i for i, e in enumerate(update.block.body.indices) if row_var is not None and _uses(e, row_var)]
    return axes[0] if len(axes) == 1 else None


def _accumulators_padded(func: tirx.PrimFunc, acc, axis: int, padded: int) -> tirx.PrimFunc:
    """`func` with the local accumulators `acc` declared `padded` long on their row axis `axis`
    and their init unguarded (it zeroes the whole tile, past the last row too). Guarded by
    `row < n` as the write-back is, TVM's CompactBufferAllocation sized them by the union of the
    two guards' regions over the whole fused loop: 516 x 16 floats a tile for 512 rows in 6 x 16
    tiles, allocated as a workspace at every tile of the parallel loop (33 KB, 16,512 times a call)
    where a tile's 6 x 16 fit in registers. An attention's scores (6 heads, 512 x 64 x 512,
    t6x16r, 2 threads, Zen 2) took 1.30 ms that way, 1.02 ms padded (a 384 x 1536 GEMM at 512 rows,
    t6x16p: 3.23 -> 3.07 ms)."""
    shape = list(acc.shape)
    shape[axis] = tirx.IntImm(_dtype(shape[axis]), padded)
    wide = tirx.decl_buffer(shape, acc.dtype, acc.name, scope="local")

    def init(s):
        if (isinstance(s, s_tir.stmt.SBlockRealize) and s.block.name_hint.endswith("_init") and not s.block.reads
                and len(s.block.writes) == 1 and s.block.writes[0].source.same_as(acc)):
            return s_tir.stmt.SBlockRealize(s.iter_values, True, s.block)
        return None
    body = substitute_buffers(rewrite(func.body, init), [(acc, wide)])
    return func.with_body(body)


def _rewritten(func: tirx.PrimFunc, visit) -> tirx.PrimFunc:
    """`func` with its body rewritten by `visit` (tirwalk.rewrite), its variables made unique again
    (a loop copied keeps its variables); `func` itself where nothing changed."""
    body = rewrite(func.body, visit)
    if body.same_as(func.body):
        return func
    return s_tir.transform.ConvertSSA()(tvm.IRModule({"main": func.with_body(body)}))["main"]


def _padded(rows, m: int):
    return (rows + (m - 1)) // m * m


def _by_rows(large: tirx.PrimFunc, small: list, rows) -> tirx.PrimFunc:
    """One kernel of schedules of the same contraction over a symbolic row extent `rows`, chosen
    at run time by the actual length: rows are padded to the tile, so a short length pays for a
    whole tile (seq=1 in a 6-row tile: 6 rows); each small copy ((mr, func) pairs, SMALL_ROWS)
    runs at up to its own rows, the least first (kernorch.kernels.tiles.ran_copy)."""
    out = _small_first(large, small, rows)
    return out.with_attr("kernorch.small_rows", [mr for mr, _ in sorted(small)]) if small else out


def _small_first(out: tirx.PrimFunc, small: list, rows) -> tirx.PrimFunc:
    """`out` behind the small row copies ((mr, func) pairs): each runs at up to its own rows, the
    least copy's test outermost."""
    for mr, func in sorted(small, reverse=True):
        out = _either(rows <= tirx.const(mr, "int64"), func, out)
    return out


def _cheapest(copies: list, rows) -> tirx.PrimFunc:
    """One kernel of several schedules of the same contraction over a symbolic row extent `rows`
    (`copies`: ((mr, cost curve), func) pairs): at up to max(SMALL_ROWS) rows the least SMALL_ROWS
    copy that holds them, else the copy whose curve is least at ceil(rows / mr) passes, its padded
    rows counted against it, the first of equal ones (kernorch.kernels.Tile.pick, tiles.copy_cost)."""
    small = [(mr, f) for (mr, _), f in copies if mr in SMALL_ROWS]
    others = [c for c in copies if c[0][0] not in SMALL_ROWS]
    if not others:  # (more rows than the largest small copy holds: that copy, in passes)
        out = max(small)[1]
    else:
        costs = [_copy_cost(points, mr, rows) for (mr, points), _ in others]
        out = others[-1][1]
        for i in range(len(others) - 2, -1, -1):  # the first copy's test outermost
            cond = costs[i] <= costs[i + 1]
            for later in costs[i + 2:]:
                cond = tirx.And(cond, costs[i] <= later)
            out = _either(_as_intervals(cond, bounds_of(others[i][1])), others[i][1], out)
    out = _small_first(out, sorted(small)[:None if others else -1], rows)
    return out.with_attr("kernorch.row_copies", [c[0] for c, _ in copies])


INTERVALS_MAX = 16  # a condition holding on more separate runs of lengths keeps its own expression


def _as_intervals(cond, bounds: dict[str, int]):
    """`cond` (a test of one symbol, over lengths 1..its bound in `bounds`) as the runs of lengths
    where it holds: `n <= 2 or 7 <= n and n <= 8`, equal to it at every length the kernel serves.
    The copies' cost curves compared as expressions are nested Selects that TVM's simplifiers walk
    in every pass: a 384 x 1536 GEMM over seq=1..512 in three row copies compiled in 0.26 s with
    them, 0.08 with a trivial test (Zen 2). `cond` itself where it is not such a test or holds on
    more than INTERVALS_MAX runs."""
    var: list = []
    map_expr(cond, lambda e: var.append(e) if isinstance(e, tirx.Var) else None)
    if len({v.name for v in var}) != 1 or var[0].name not in bounds:  # (with several symbols: rows' one)
        return cond
    n, bound = var[0], bounds[var[0].name]
    lengths = np.arange(1, int(bound) + 1, dtype=np.int64)
    try:
        holds = np.broadcast_to(np.asarray(_at_lengths(cond, n.name, lengths), bool), lengths.shape)
    except _NotApplicable:
        return cond
    edges = np.flatnonzero(np.diff(np.concatenate(([False], holds, [False])).astype(np.int8)))
    runs = [(int(lengths[a]), int(lengths[b - 1])) for a, b in zip(edges[::2], edges[1::2])]
    if not runs or len(runs) > INTERVALS_MAX:
        return cond if runs else tirx.const(False, "bool")
    out = None
    for lo, hi in runs:
        test = None
        if lo > 1:
            test = tirx.IntImm(n.ty.dtype, lo) <= n
        if hi < bound:
            upper = n <= tirx.IntImm(n.ty.dtype, hi)
            test = upper if test is None else tirx.And(test, upper)
        test = tirx.const(True, "bool") if test is None else test
        out = test if out is None else tirx.Or(out, test)
    return out


def _copy_cost(points, mr: int, rows):
    """kernorch.kernels.tiles.copy_cost as an expression of `rows` (int64)."""
    num, den = PADDED_ROWS
    p = _padded(rows, mr) // mr
    t = _curve(points, p)
    computed = p * tirx.const(mr, "int64")
    return t + tirx.floordiv(t * (computed - rows) * tirx.const(num, "int64"), computed * tirx.const(den, "int64"))


def _curve(points, p):
    """kernorch.kernels.tiles.curve_ns as an expression of `p` passes (int64)."""
    def i64(v: int):
        return tirx.const(v, "int64")

    def between(a, b):
        (p1, t1), (p2, t2) = a, b
        return i64(t1) + tirx.floordiv((p - i64(p1)) * i64(t2 - t1), i64(p2 - p1))

    (p0, t0) = points[0]
    out = tirx.floordiv(i64(t0) * p, i64(p0)) if len(points) == 1 else between(*points[-2:])
    for a, b in reversed(list(zip(points, points[1:]))):
        out = tirx.Select(p <= i64(b[0]), between(a, b), out)
    return tirx.Select(p <= i64(p0), i64(t0), out)


def _either(cond, then: tirx.PrimFunc, other: tirx.PrimFunc) -> tirx.PrimFunc:
    """`then`'s body where `cond` holds, else `other`'s, in `other`'s signature: two schedules of one
    kernel (the same parameters), or of two lowerings of it (parameters of the same shapes, each
    with its own buffers and symbols: `then`'s are bound to `other`'s)."""
    a, b = other.body.block, then.body.block
    allocs = list(a.alloc_buffers)  # (an intermediate both copies keep is one buffer: only one copy runs)
    allocs += [buf for buf in b.alloc_buffers if not any(buf.same_as(x) for x in allocs)]
    body, flag = _opaque_branch(cond, b.body, a.body)
    if all(p.same_as(q) for p, q in zip(then.params, other.params)):
        return _with_root_body(other, body, allocs + [flag])
    # both signatures, then `then`'s parameters specialized to `other`'s: a parameter specialized
    # to another of the same function becomes its alias everywhere (buffer, data and shape symbols)
    joint = tirx.PrimFunc([*other.params, *then.params], other.body, other.ret_type, other.attrs)
    joint = _with_root_body(joint, body, allocs + [flag])
    return joint.specialize(dict(zip(then.params, other.params)))


def _opaque_branch(cond, then, other) -> tuple:
    """(`if cond: then else: other` with `cond` stored in a one-element local buffer first and the
    branch testing its load, that buffer). Both branches compute the same result for every length
    (two schedules of one kernel); TVM's CompactBufferAllocation, though, narrows every access
    under a branch by its condition, and over a symbolic extent that search grows with the
    condition: a fused LayerNorm + GEMM + GELU kernel with three row copies picked by their cost
    curves spent 1.84 of its 2.30 s of compilation there (Xeon model 207), 0.07 with the condition
    behind the buffer. The flag lives on the stack (kernorch.backends.tvm.passes)."""
    flag = tirx.decl_buffer((1,), "int32", "branch", scope="local")
    at = [tirx.const(0, "int32")]
    store = tirx.BufferStore(flag, tirx.Select(cond, tirx.const(1, "int32"), tirx.const(0, "int32")), at)
    test = tirx.BufferLoad(flag, at) != tirx.const(0, "int32")
    return tirx.SeqStmt([store, tirx.IfThenElse(test, then, other)]), flag


def _without_dead_branches(func: tirx.PrimFunc, at: Sequence[int] | None = None) -> tirx.PrimFunc:
    """A kernel over one symbolic length, assembled from copies picked at run time (row copies,
    a small-row copy, narrow keys: `_opaque_branch`) each with loops in a parallel and a serial copy
    picked by their work (`_serial_when_small`, which only knew the length to lie in 1..its bound),
    without the copies no length reaching them can run: each branch's condition is evaluated at
    every length that reaches it. The 2-row copy of an attention's scores (seq <= 2) no longer
    holds parallel loops (threads from 43 rows on), nor a row copy for long lengths serial ones:
    the scores over seq=1..512 (t6x16r, Zen 3) in 466 lines of TIR instead of 672, compiled in 0.56
    s instead of 0.68 and emitted in 0.28 instead of 0.44; the code that runs is the same.
    Conditions over anything but the length are kept. `at`: only these lengths reach the kernel
    (a measurement's samples), not every one up to the bound. Over seq=1..512, timed at 1, 23 and
    512, a fused GEMM's build kept 2-3 of its 4 row copies and an attention most of its branches
    (Zen 4, builds of 0.42-0.52 s took 0.28-0.40, attentions 0.54-0.65 took 0.44-0.53; the
    kernels timed within noise of the whole ones at those lengths)."""
    bounds = bounds_of(func)
    root = func.body.block if isinstance(func.body, s_tir.stmt.SBlockRealize) else None
    if len(bounds) != 1 or root is None:
        return func
    (name, bound), = bounds.items()

    def split_at(stmts, i, lengths):
        """What the branch at i (a flag's store and its test) leaves at `lengths`, or None: none there."""
        store, branch = stmts[i], stmts[i + 1]
        if not (isinstance(store, tirx.BufferStore) and isinstance(branch, tirx.IfThenElse)
                and isinstance(store.value, tirx.Select)
                and [load.source.same_as(store.buffer) for load in loads(branch.condition)] == [True]):
            return None
        try:
            holds = np.broadcast_to(np.asarray(_at_lengths(store.value.condition, name, lengths), bool), lengths.shape)
        except _NotApplicable:
            return None
        other = branch.else_case
        if holds.all():
            return [visit(branch.then_case, lengths)]
        if not holds.any():
            return [visit(other, lengths)] if other is not None else []
        return [store, tirx.IfThenElse(branch.condition, visit(branch.then_case, lengths[holds]),
                                       visit(other, lengths[~holds]) if other is not None else None)]

    def visit(stmt, lengths):  # (each opaque branch is a flag's store and a test of it in a SeqStmt)
        stmts = list(stmt.seq) if isinstance(stmt, tirx.SeqStmt) else [stmt]
        out, i = [], 0
        while i < len(stmts):
            kept = split_at(stmts, i, lengths) if i + 1 < len(stmts) else None
            if kept is None:
                out.append(stmts[i])
                i += 1
            else:
                out += kept
                i += 2
        if len(out) == len(stmts) and all(a.same_as(b) for a, b in zip(out, stmts)):
            return stmt
        if not out:
            return tirx.Evaluate(tirx.const(0, "int32"))
        return tirx.SeqStmt(out) if len(out) > 1 else out[0]

    lengths = np.arange(1, int(bound) + 1, dtype=np.int64) if at is None else np.unique(np.asarray(at, np.int64))
    body = visit(root.body, lengths)
    if body.same_as(root.body):
        return func
    used = buffers_in(body)
    allocs = [b for b in root.alloc_buffers if any(b.same_as(u) for u in used)]
    new = with_body(root, body, allocs)
    return func.with_body(s_tir.stmt.SBlockRealize(func.body.iter_values, func.body.predicate, new))


_AT_LENGTHS = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "FloorDiv": np.floor_divide,
               "FloorMod": np.mod, "Min": np.minimum, "Max": np.maximum, "LT": np.less, "LE": np.less_equal,
               "GT": np.greater, "GE": np.greater_equal, "EQ": np.equal, "NE": np.not_equal,
               "And": np.logical_and, "Or": np.logical_or}


def _at_lengths(expr, name: str, lengths: np.ndarray):
    """`expr` (integer arithmetic over the symbol `name`) at each of `lengths`, as numpy computes
    it; _NotApplicable for anything else."""
    kind = type(expr).__name__
    if kind == "IntImm":
        return np.int64(expr.value)
    if kind == "Var" and expr.name == name:
        return lengths
    if kind in _AT_LENGTHS:
        return _AT_LENGTHS[kind](_at_lengths(expr.a, name, lengths), _at_lengths(expr.b, name, lengths))
    if kind == "Not":
        return np.logical_not(_at_lengths(expr.a, name, lengths))
    if kind == "Select":
        return np.where(_at_lengths(expr.condition, name, lengths), _at_lengths(expr.true_value, name, lengths),
                        _at_lengths(expr.false_value, name, lengths))
    raise _NotApplicable(f"not a function of {name}: {kind}")


def _with_root_body(func: tirx.PrimFunc, body, allocs=None) -> tirx.PrimFunc:
    """`func` with its root block's body (and buffers, `allocs`) replaced by code that holds two
    copies of some loops (one run or the other): SSA gives each copy its own variables."""
    new = with_body(func.body.block, body, allocs)
    func = func.with_body(s_tir.stmt.SBlockRealize(func.body.iter_values, func.body.predicate, new))
    return s_tir.transform.ConvertSSA()(tvm.IRModule({"main": func}))["main"]


def _scheduled(sch: s_tir.Schedule, rule: str) -> tvm.IRModule:
    func = _whole_vectors_unguarded(_serial_when_small(sch.mod["main"]))
    return tvm.IRModule({"main": func.with_attr("tirx.is_scheduled", True).with_attr("kernorch.rule", rule)})


def _iterations(stmt) -> object:
    """How many times the innermost statements under `stmt` run (a PrimExpr over a range)."""
    if isinstance(stmt, tirx.For):  # (a loop over the keys a row tile skips: at most all of them)
        skips = KEYS_OF in stmt.annotations and isinstance(stmt.extent, tirx.Min)
        return (stmt.extent.a if skips else stmt.extent) * _iterations(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        return sum((_iterations(s) for s in stmt.seq), 0)
    if isinstance(stmt, s_tir.stmt.SBlockRealize):
        return _iterations(stmt.block.body)
    if isinstance(stmt, tirx.IfThenElse):
        return _iterations(stmt.then_case)
    body = getattr(stmt, "body", None)
    return 1 if body is None else _iterations(body)


def _serial_when_small(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A kernel over a range (kernorch.dynamic): each outermost parallel loop whose work depends on
    the length is decided at run time, `if work >= PARALLEL_MIN_WORK: parallel loop else: the same
    loop serial`, so one kernel launches threads at seq=512 and none at seq=1 (a launch costs more
    than a short row). Static work was decided when the loop was scheduled.

    A loop that writes what a later contraction loop of the kernel reads (the padded attention's
    copies of its queries, keys and values) is also parallel wherever that contraction is: copied
    by one thread, half of them was then read by the other core from the first one's caches (the
    attention over seq=1..512 at seq=32, 6 heads of 64, t6x64r, 2 threads, Xeon model 167: 29 us
    with the copies serial, 16 parallel, 11 without copies). Where such loops come right before
    the contraction, they run in its parallel launch when it runs parallel (`ONE_LAUNCH`: 17.5 ->
    12.7 us at 32) and keep their own decision (from FEEDING_MIN_WORK) when it runs serial."""
    root = func.body
    if not isinstance(root, s_tir.stmt.SBlockRealize):
        return func
    blk = root.block
    stmts = list(blk.body.seq) if isinstance(blk.body, tirx.SeqStmt) else [blk.body]
    from tvm.sym.analyzer import Analyzer
    ana = Analyzer()
    bounds = bounds_of(func)
    used: list = []   # each root statement's buffers, walked only once a loop is duplicated (never for static work)

    def buffers(i: int) -> list:
        if not used:
            used.extend(buffers_in(st) for st in stmts)
        return used[i]

    def only(buf, i: int) -> bool:  # a buffer of the root that only statement i touches
        return all(any(buf.same_as(b) for b in buffers(j)) == (j == i) for j in range(len(stmts)))

    loops = [isinstance(st, tirx.For) and st.kind == tirx.ForKind.PARALLEL for st in stmts]  # the root parallel loops
    contracts = [loop and _holds_contraction(st) for loop, st in zip(loops, stmts)]  # ... holding a contraction

    def parallel(i: int):  # (the work of root loop i, the least work it is parallel for) or None
        if not loops[i]:
            return None
        work = stmts[i].extent * _iterations(stmts[i].body)
        _bind_symbols(ana, work, bounds)
        return ana.simplify(work), PARALLEL_MACS if contracts[i] else PARALLEL_MIN_WORK

    works = [parallel(i) for i in range(len(stmts))]

    @functools.cache
    def feeds(i: int):  # a later parallel contraction loop sharing a buffer of the root with loop i (its copy), or None
        mine = [b for b in blk.alloc_buffers if any(b.same_as(x) for x in buffers(i))]
        return next((j for j in range(i + 1, len(stmts)) if contracts[j]
                     and any(b.same_as(x) for b in mine for x in buffers(j))), None)

    branches, allocs = list(stmts), []   # each root statement, decided (a parallel and a serial twin)
    conds: dict = {}   # the root loops so decided: their condition for running parallel, their serial twin
    for i, st in enumerate(stmts):
        if works[i] is not None:
            work, least = works[i]
            # (work that is enough at the shortest length stays parallel: the serial branch would be dead)
            if not isinstance(work, tirx.IntImm) and ana.const_int_bound(work).min_value < least:
                cond = work >= tirx.const(least, "int64")
                j = feeds(i) if least == PARALLEL_MIN_WORK else None
                if j is not None:
                    consumer, at_least = works[j]
                    cond = tirx.Or(cond, tirx.And(work >= tirx.const(FEEDING_MIN_WORK, "int64"),
                                                  consumer >= tirx.const(at_least, "int64")))
                serial, own = _with_own_buffers(st, [b for b in blk.alloc_buffers if only(b, i)])
                serial = tirx.For(serial.loop_var, serial.min, serial.extent, tirx.ForKind.SERIAL, serial.body,
                                  serial.thread_binding, serial.annotations)
                conds[i] = (cond, serial)
                branches[i], flag = _opaque_branch(cond, st, serial)
                allocs += [*own, flag]
    if not allocs:
        return func
    out, i = [], 0
    while i < len(stmts):  # the loops feeding a parallel contraction right after them run in its launch
        j = feeds(i) if ONE_LAUNCH and works[i] is not None else None
        run = list(range(i, j + 1)) if j is not None and all(works[k] is not None and feeds(k) == j
                                                              for k in range(i, j)) else [i]
        if len(run) == 1:
            out.append(branches[i])
        else:
            launch = tirx.SeqStmt([_in_launch(stmts[k], j) for k in run])
            if j in conds:
                cond, serial = conds[j]
                launch, flag = _opaque_branch(cond, launch, tirx.SeqStmt([*(branches[k] for k in run[:-1]), serial]))
                allocs.append(flag)
            out.append(launch)
        i = run[-1] + 1
    return _with_root_body(func, tirx.SeqStmt(out) if len(out) > 1 else out[0], list(blk.alloc_buffers) + allocs)


# Loops writing what a parallel contraction of the kernel reads next (the padded attention's copies
# of its queries, keys and values) run in that contraction's parallel launch, each task its share of
# each loop, with a barrier before the contraction (`passes.one_launch`), instead of a launch each
ONE_LAUNCH = True


def _in_launch(loop, group: int):
    """`loop` (parallel) marked to share one parallel launch with the loops of its `group`."""
    return tirx.For(loop.loop_var, loop.min, loop.extent, tirx.ForKind.PARALLEL, loop.body, loop.thread_binding,
                    {**loop.annotations, LAUNCH: group})


def _holds_contraction(stmt) -> bool:
    """Whether a multiply-add of two operands (a matmul's or a conv's update) runs under `stmt`."""
    return bool(found(stmt, lambda s: isinstance(s, s_tir.stmt.SBlockRealize)
                      and _contraction_operands(s.block) is not None))


def _with_own_buffers(stmt, buffers) -> tuple:
    """(a copy of `stmt` with fresh copies of `buffers`, the copies): loops that run instead of
    their twin get buffers of their own, so TVM allocates each where its own accesses meet and
    shrinks it to the region they touch. A buffer the twins shared stayed at the root in full:
    the attention's 2-row register tile kept its accumulators in seq x seq floats of memory, and
    narrowing the shared buffer over both copies' accesses took much of the kernel's compilation."""
    if not buffers:
        return stmt, []
    fresh = [tirx.decl_buffer(b.shape, b.dtype, b.name, strides=b.strides, elem_offset=b.elem_offset,
                              scope=b.scope(), data_alignment=b.data_alignment, offset_factor=b.offset_factor)
             for b in buffers]
    try:
        return substitute_buffers(stmt, list(zip(buffers, fresh))), fresh
    except TypeError as e:  # a node the substitution does not rebuild: the twins share the buffers
        log.debug("twin loops share their buffers: %s", e)
        return stmt, []


def _whole_vectors_unguarded(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """A vectorized store guarded lane by lane against a symbolic length (`if_then_else(i < seq,
    x, 0)`: a copy of the keys padded to the tile's columns, kernorch.backends.tvm.lower) runs as
    whole vectors where it can: the vector with every lane inside the length without the guard
    (and without the index clamp that kept the guarded read in bounds), the vector with every
    lane past it as the other value, and the vector across the length as a blend of reads clamped
    into bounds (lane by lane, as it was, where the read has no index to clamp). TVM computes an
    `if_then_else` under a vectorized loop one lane at a time, a branch each (its operand may only
    be read where the condition holds). The scores of an attention over seq=1..512 (6 heads of
    64, keys padded to 16, t4x16r, alone, hot; Zen 3, AVX2, two alternations) took 5.1-5.3 us
    at seq=1 with the copy lane by lane, 4.0 now; 5.3-11.8 and 4.4-4.5 at 7; 16.8-30.8 and
    11.8-13.2 at 32. Static kernels are left as they are. A store predicated lane by lane (a padded
    tile's copy-out) is split by `_whole_vectors_unpredicated`."""
    from tvm.sym.analyzer import Analyzer

    def split_lanes(loop):
        realize = loop.body
        if not isinstance(realize, s_tir.stmt.SBlockRealize):
            return None
        store = realize.block.body
        if not (isinstance(store, tirx.BufferStore) and is_call(store.value, "if_then_else")):
            return None
        cond, then, other = store.value.args
        span = _lane_span(loop, cond)
        if span is None:
            return None
        first, last, length = span
        lane = loop.loop_var
        inside, clamped = then, None
        if _is(then, "TensorLoad"):  # (a BufferLoad) x[min(i, seq - 1)] -> x[i] where i < seq, and the other way
            last_in = cond.b - tirx.const(1, _dtype(cond.b))

            def is_clamp(i):
                return _is(i, "Min") and tvm_ffi.structural_equal(i.a, cond.a) and Analyzer().can_prove(i.b == last_in)
            guarded = [is_clamp(i) or tvm_ffi.structural_equal(i, cond.a) for i in then.indices]
            inside = tirx.BufferLoad(then.source, [i.a if is_clamp(i) else i for i in then.indices])
            if any(guarded):
                clamped = tirx.BufferLoad(then.source, [tirx.min(cond.a, last_in) if g else i
                                                        for g, i in zip(guarded, inside.indices)])

        def with_value(value):
            block = with_body(realize.block, tirx.BufferStore(store.buffer, value, store.indices))
            body = s_tir.stmt.SBlockRealize(realize.iter_values, realize.predicate, block)
            return tirx.For(lane, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations)

        # across the length: masked loads of the lanes inside it, or every lane read in bounds
        # (clamped) and a blend picking, or lane by lane
        across = _masked_loads(loop, inside, first, length) if clamped is not None and _is_zero(other) else None
        if across is None:
            across = with_value(tirx.Select(cond, clamped, other)) if clamped is not None else tirx.For(
                lane, loop.min, loop.extent, tirx.ForKind.SERIAL, realize, loop.thread_binding, loop.annotations)
        return tirx.IfThenElse(last < length, with_value(inside),
                               tirx.IfThenElse(length <= first, with_value(other), across))

    def visit(stmt):
        if not (isinstance(stmt, tirx.For) and stmt.kind == tirx.ForKind.VECTORIZED):
            return None
        return split_lanes(stmt) or _whole_vectors_unpredicated(stmt) or _whole_vectors_unmasked(stmt)

    return _rewritten(func, visit)


# AVX's masked load of 8 float lanes: the lanes masked off read nothing (no fault past the buffer's end)
MASKED_LOAD = "llvm.x86.avx.maskload.ps.256"
MASKED_LANES = 8


def _masked_loads(loop, load, first, length):
    """The store of vectorized `loop` (a copy of `load`'s row into a zero-padded one) at the vector
    across the symbolic `length`, as masked loads of MASKED_LANES lanes (the lanes at `first` on,
    past the length zeros) stored whole; None where it is not such a copy. A loop of 8 or 16 lanes
    exists only where the target has AVX (the schedules' vectors are its width). Blended, each
    lane's read was clamped into bounds, and the vector became a gather of sixteen scalar loads and
    inserts: at seq=8 every row of the attention's keys is such a vector, and they took about half
    of the fused attention's samples (perf; 6 heads of 64 over seq=1..512, t6x64r, 2 threads, Xeon
    model 167). Timed in a cold optimize of the transformer block over that range, the scores alone
    took 2.0-4.1 us at seq=8 against 4.8-5.9, the fused attention 7.8 (t8x32r) against 12.3."""
    realize, store = loop.body, loop.body.block.body
    extent = loop.extent
    if not (isinstance(extent, tirx.IntImm) and int(extent) % MASKED_LANES == 0) or _dtype(store.value) != "float32" \
            or any(list(b.strides) for b in (store.buffer, load.source)):
        return None
    bound = [(iv.var, v) for iv, v in zip(realize.block.iter_vars, realize.iter_values)]
    lane = loop.loop_var
    from tvm.sym.analyzer import Analyzer
    ana = Analyzer()

    def at(indices, value):  # the indices in the loops' variables, the lane at `value`
        return [ana.simplify(substitute(substitute(i, bound), [(lane, value)])) for i in indices]
    for indices in (store.indices, load.indices):  # the lane moves the innermost index, one by one
        i0, i1 = at(indices, loop.min), at(indices, loop.min + 1)
        if not all(ana.can_prove(b - a == (1 if k == len(indices) - 1 else 0))
                   for k, (a, b) in enumerate(zip(i0, i1))):
            return None
    out = []
    for c in range(0, int(extent), MASKED_LANES):
        inside = tirx.Ramp(first + c, 1, MASKED_LANES) < tirx.Broadcast(length, MASKED_LANES)
        mask = tirx.Select(inside, tirx.Broadcast(tirx.const(-1, "int32"), MASKED_LANES),
                           tirx.Broadcast(tirx.const(0, "int32"), MASKED_LANES))
        src = tirx.BufferLoad(load.source, at(load.indices, loop.min + c))
        value = tirx.call_llvm_pure_intrin(f"float32x{MASKED_LANES}", MASKED_LOAD, tirx.address_of(src), mask)
        dst = at(store.indices, loop.min + c)
        dst = [*dst[:-1], tirx.Ramp(dst[-1], 1, MASKED_LANES)]
        zeros = tirx.BufferStore(store.buffer, tirx.Broadcast(tirx.const(0.0, "float32"), MASKED_LANES), dst)
        # (a part past the length stores zeros: its address may be past the source's end)
        out.append(tirx.BufferStore(store.buffer, value, dst) if c == 0 else
                   tirx.IfThenElse(first + c < length, tirx.BufferStore(store.buffer, value, dst), zeros))
    return tirx.SeqStmt(out) if len(out) > 1 else out[0]


def _is_zero(expr) -> bool:
    return isinstance(expr, tirx.FloatImm) and float(expr.value) == 0.0


def _lane_span(loop, cond):
    """For a vectorized `loop` over one block and a condition `index < length` of that block, with a
    symbolic length and an index that grows one by one with the lane: (the index at the loop's
    first lane, at its last, the length), the block's variables bound; None for any other condition."""
    from tvm.sym.analyzer import Analyzer
    if not isinstance(cond, tirx.LT) or isinstance(Analyzer().simplify(cond.b), tirx.IntImm):
        return None
    realize, lane = loop.body, loop.loop_var
    ana = Analyzer()
    for iv, v in zip(realize.block.iter_vars, realize.iter_values):
        ana.bind(iv.var, v)
    index, length = ana.simplify(cond.a), ana.simplify(cond.b)
    if _uses(Analyzer().simplify(index - lane), lane) or _uses(length, lane):
        return None

    def at(value):
        a = Analyzer()
        a.bind(lane, value)
        return a.simplify(index)
    return at(loop.min), at(loop.min + loop.extent - 1), length


def _whole_vectors_unmasked(loop):
    """A vectorized block whose value blends by its lane's index against a symbolic length
    (`Select(j * 16 + lane < seq, x, identity)`: the padded attention's reductions over the keys
    and its probabilities, kernorch.backends.tvm.lower._PaddedAttention) as whole vectors: `x`
    where every lane is inside the length, `identity` where none is, the blend only for the vector
    across it. LLVM built each vector's mask from sixteen 64-bit lane indices (two compares, a
    permute and a merge of masks per vector): the attention over seq=1..512 at 512 (6 heads of 64,
    t4x64r, 2 threads, Xeon model 167) took 1.93 ms with its three masked passes and 1.55 without
    them. None where the value holds no such Select (or Selects on more than one condition)."""
    realize = loop.body
    if not isinstance(realize, s_tir.stmt.SBlockRealize) or not isinstance(realize.block.body, tirx.BufferStore):
        return None
    store = realize.block.body
    conds: list = []
    map_expr(store.value, lambda e: conds.append(e.condition) if isinstance(e, tirx.Select) else None)
    if not conds or not all(tvm_ffi.structural_equal(c, conds[0]) for c in conds):
        return None
    span = _lane_span(loop, conds[0])
    if span is None:
        return None
    first, last, length = span

    def picked(branch):  # the block with its value rewritten: every Select replaced by one of its values
        value = branch(store.value)
        block = with_body(realize.block, tirx.BufferStore(store.buffer, value, store.indices))
        body = s_tir.stmt.SBlockRealize(realize.iter_values, realize.predicate, block)
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, loop.annotations)
    return tirx.IfThenElse(last < length, picked(_inside(conds[0])),
                           tirx.IfThenElse(length <= first, picked(lambda v: map_expr(
                               v, lambda e: e.false_value if isinstance(e, tirx.Select) else None)), loop))


def _inside(cond):
    """For the value of a block where `cond` (`index < length`, the Select's) holds at every lane: a
    Select on it its true value, and the guards of an operand read over the padded domain on it
    (`if_then_else(cond, x[..., min(index, length - 1)], 0)`: a mask added to the attention's
    scores, as gpt_like's causal mask) their value, the index unclamped. Left guarded, the read was
    evaluated lane by lane: the attention over seq=1..512 with its mask (6 heads of 64, t8x32r, 2
    threads, Xeon model 167) took 4.26 ms at 512 against 1.48 for its static copy."""
    from tvm.sym.analyzer import Analyzer
    index, last, ana = cond.a, cond.b - 1, Analyzer()

    def visit(e):
        if isinstance(e, tirx.Select) and tvm_ffi.structural_equal(e.condition, cond):
            return map_expr(e.true_value, visit)
        if is_call(e, "if_then_else") and tvm_ffi.structural_equal(e.args[0], cond):
            return map_expr(e.args[1], visit)
        if isinstance(e, tirx.Min) and tvm_ffi.structural_equal(e.a, index) and ana.can_prove_equal(e.b, last):
            return index
        return None
    return lambda e: map_expr(e, visit)


def _whole_vectors_unpredicated(loop):
    """A vectorized loop whose block is predicated lane by lane against a length (the copy-out of a
    tile padded over seq columns, `T.where(... and j * 16 + lane < seq)`, or over static columns no
    tile divides, `j * 16 + lane < 300`) as two
    loops: where the predicate holds at its first and its last lane, the block without it (whole
    vector stores), else as it was. TVM stores a predicated block under a vectorized loop one lane
    at a time, each behind a branch. Only predicates whose truth at both ends implies it at every
    lane between (`_holds_between`); None otherwise."""
    from tvm.sym.analyzer import Analyzer
    realize = loop.body
    if not isinstance(realize, s_tir.stmt.SBlockRealize) or not isinstance(realize.block.body, tirx.BufferStore):
        return None
    pred, lane = realize.predicate, loop.loop_var
    if isinstance(pred, tirx.IntImm) or not _uses(pred, lane) or not _holds_between(pred, lane):
        return None
    if isinstance(loop.extent, tirx.IntImm) and int(loop.extent) < 2:
        return None

    terms = _conjuncts(pred)
    rest = [t for t in terms if not _uses(t, lane)]   # the same at every lane: kept as the block's predicate
    moving = [t for t in terms if _uses(t, lane)]

    def at(value):  # the lane's terms at one lane
        ana = Analyzer()
        ana.bind(lane, value)
        return ana.simplify(_all(moving))
    whole = s_tir.stmt.SBlockRealize(realize.iter_values, _all(rest), realize.block)
    fast = tirx.For(lane, loop.min, loop.extent, loop.kind, whole, loop.thread_binding, loop.annotations)
    return tirx.IfThenElse(tirx.And(at(loop.min), at(loop.min + loop.extent - 1)), fast, loop)


def _conjuncts(pred) -> list:
    return [*_conjuncts(pred.a), *_conjuncts(pred.b)] if isinstance(pred, tirx.And) else [pred]


def _all(terms):
    out = tirx.const(True, "bool")
    for t in terms:
        out = t if isinstance(out, tirx.IntImm) else tirx.And(out, t)
    return out


def _holds_between(pred, lane) -> bool:
    """Does `pred` holding at two lanes imply it at every lane between them? True for conjunctions
    of: terms without the lane; bounds `lane + x < y`, `lane + x <= y` and their mirrors (an
    interval of lanes); equalities with the lane (true at one lane at most, so never at both ends);
    disjunctions of one of these with a term without the lane (TVM writes `t < n or t * 16 + lane
    == 0` for a tile index `t`)."""
    from tvm.sym.analyzer import Analyzer
    if not _uses(pred, lane):
        return True
    if isinstance(pred, tirx.And):
        return _holds_between(pred.a, lane) and _holds_between(pred.b, lane)
    if isinstance(pred, tirx.Or):
        return ((not _uses(pred.a, lane) and _holds_between(pred.b, lane))
                or (not _uses(pred.b, lane) and _holds_between(pred.a, lane)))
    if isinstance(pred, (tirx.LT, tirx.LE, tirx.GT, tirx.GE, tirx.EQ)):
        step = Analyzer().simplify(pred.a - pred.b - lane)  # one side grows with the lane by exactly one
        back = Analyzer().simplify(pred.b - pred.a - lane)
        return not _uses(step, lane) or not _uses(back, lane)
    return False


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


# -- analysis helpers ----------------------------------------------------------------------------

def _root_blocks(sch: s_tir.Schedule) -> list[str]:
    root = sch.get_sblock("root")
    return [sch.get(b).name_hint for b in sch.get_child_blocks(root)]


def _upstream(sch: s_tir.Schedule, name: str) -> set[str]:
    """Names of the blocks whose results reach block `name`."""
    seen: set[str] = set()
    todo = [sch.get_sblock(name)]
    while todo:
        for p in sch.get_producers(todo.pop()):
            n = sch.get(p).name_hint
            if n not in seen:
                seen.add(n)
                todo.append(p)
    return seen


def _is_reduction(stmt) -> bool:
    return any(int(iv.iter_type) == _COMM_REDUCE for iv in stmt.iter_vars)


def _dtype(expr) -> str:
    """An expression's dtype (0.27 keeps it in the expression's type; a constant has it too)."""
    return expr.ty.dtype if _is(expr, "Var") or not hasattr(expr, "dtype") else expr.dtype


def _uses(expr, var) -> bool:
    return any(v.same_as(var) for v in tirx.analysis.undefined_vars(expr))


def _var_names(expr) -> set[str]:
    return {v.name for v in tirx.analysis.undefined_vars(expr)}


def _is_param(buf, func) -> bool:
    """Is `buf` one of the function's parameters? By identity: names are not unique (the stages of a
    GELU are all "mul", like the output they end in, and by name each of them wrote the output, so
    none was inlined and the epilogue ran as nine passes over the result)."""
    return any(buf.same_as(b) for b in func.params)  # 0.27: PrimFunc params are the buffers


def _writes_output(stmt, func) -> bool:
    return any(_is_param(w.source, func) for w in stmt.writes)  # 0.27: regions have .source


def _contraction_operands(stmt):
    """(a, b) if the block is `acc += a * b` with both factors reading reduction vars (matmul, conv)."""
    if not _is_reduction(stmt) or not isinstance(stmt.body, tirx.BufferStore):
        return None
    store = stmt.body
    value = store.value
    if not isinstance(value, tirx.Add):
        return None
    rnames = {iv.var.name for iv in stmt.iter_vars if int(iv.iter_type) == _COMM_REDUCE}
    for acc, rhs in ((value.a, value.b), (value.b, value.a)):
        if isinstance(acc, tvm.ir.expr.TensorLoad) and acc.source.same_as(store.buffer):  # 0.27 BufferLoad
            while isinstance(rhs, tirx.Cast):
                rhs = rhs.value
            if isinstance(rhs, tirx.Mul) and _var_names(rhs.a) & rnames and _var_names(rhs.b) & rnames:
                ba, bb = _loaded_buffers(rhs.a), _loaded_buffers(rhs.b)
                if ba and bb and ba != bb:  # (x-mu)*(x-mu) in a variance is not a contraction
                    return rhs.a, rhs.b
    return None


def _loaded_buffers(expr) -> frozenset[int]:
    """The buffers an expression loads from, by object address as `tirwalk.buffers_in` keys them
    (not by name: two stages of one op, a query's scaling and a key's, both write buffers named
    "mul"; compared by name, the scores of such an attention were no contraction, its values'
    columns were padded to a tile of 64 as a lone matmul's are, and the attention rule wrote the
    padded columns past its output: segformer_b0's attentions in t4x64r crashed their workers with
    heap corruption)."""
    return frozenset(load.source.__chandle__() for load in loads(expr))


def _is_expensive(stmt) -> bool:
    """Does the block compute a math function (exp, tanh, ... or their polynomial versions, whose
    blocks topi and the primitive table name "*fast_*")? Such stages are not recomputed."""
    text = str(stmt.body)
    return "fast_" in stmt.name_hint or any(f"T.{f}(" in text for f in ("exp", "log", "log1p", "tanh", "erf",
                                                                          "sigmoid", "sqrt", "pow", "sin", "cos"))


def _extent(sch, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def _span(sch, loop) -> int:
    """A loop's extent; a symbolic one (kernorch.dynamic) counts as its largest value under the
    function's bounds, or as plenty of work when it has none."""
    ext = _extent(sch, loop)
    if ext is None:
        ext = _upper_bound(sch, sch.get(loop).extent)
    return PARALLEL_MIN_WORK if ext is None else max(ext, 1)  # (a loop empty at every length: no work)


def _work(sch, block) -> int:
    n = 1
    for lp in sch.get_loops(block):
        n *= _span(sch, lp)
    return n


# -- inline pass ---------------------------------------------------------------------------------

def _inline_pass(func) -> tirx.PrimFunc:
    """compute_inline injective intermediate stages, except into contractions (a pad stays a
    separate stage rather than a Select in the conv inner loop) and except expensive stages (a
    math function, or a stage one was inlined into) that would be computed more than once: read
    by several consumers (softmax's exp stays materialised instead of being computed twice) or
    several times by one (the polynomial exp, erf, tanh and sigmoid read their input 2-4 times
    each: a chain of them inlined copied the first that many times per step, exp, sigmoid, erf,
    neg, floor, abs, ceil and tanh in one kernel made 21 MB of TIR and a 127 s build)."""
    sch = s_tir.Schedule(func)
    for name in _root_blocks(sch):  # packed-weight and padding views: index arithmetic, inlined everywhere
        if name.startswith((UNPACK, VIEW)):
            sch.compute_inline(sch.get_sblock(name))
    expensive = {n for n in _root_blocks(sch) if _is_expensive(sch.get(sch.get_sblock(n)))}
    static = not bounds_of(func)
    changed = True
    while changed:
        changed = False
        for name in _root_blocks(sch):
            blk = sch.get_sblock(name)
            stmt = sch.get(blk)
            if _is_reduction(stmt) or _writes_output(stmt, func) or name.startswith(ROWS_OUT):
                continue  # (a padded attention's copy-out tells its rule that the rows were padded)
            if static and name.startswith(OPERAND_PADDED):
                # over static keys the simplifier drops the clamp of an inlined padded mask's reads
                # under the masked chain's Select (it knows the key inside the length there), and
                # the Select loads past the mask: kept a copy, the chain reads it in bounds
                continue
            consumers = sch.get_consumers(blk)
            if not consumers:
                continue
            if any(_contraction_operands(sch.get(c)) is not None for c in consumers):
                continue
            if name in expensive and (len(consumers) > 1 or _reads(sch.get(consumers[0]), stmt) > 1):
                continue
            into = sch.get(consumers[0]).name_hint
            try:
                sch.compute_inline(blk)
                changed = True
            except Exception:  # noqa: BLE001 - illegal inline: keep the stage
                continue
            if name in expensive:
                expensive.add(into)
    return sch.mod["main"]


def _reads(consumer, producer) -> int:
    """How many loads of `producer`'s output the block `consumer` makes per iteration."""
    buf = producer.writes[0].source
    return sum(load.source.same_as(buf) for load in loads(consumer.body))


# -- building blocks -----------------------------------------------------------------------------

def _parallel(sch, loops, min_work: int = 0, serial: bool = False) -> object | None:
    """Fuse `loops` (adjacent, outermost first) and parallelise them (not when `serial`); returns
    the fused loop."""
    if not loops:
        return None
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    if serial:
        return fused
    ext = _extent(sch, fused)
    if ext is None:  # a symbolic extent (kernorch.dynamic): large, unless bounded small
        ext = _upper_bound(sch, sch.get(fused).extent)
        if ext is None:
            sch.parallel(fused)
            return fused
    if ext > 1 and (min_work <= 0 or ext * min_work >= PARALLEL_MIN_WORK):
        sch.parallel(fused)
    return fused


def _upper_bound(sch, expr) -> int | None:
    """The largest value of a symbolic extent under the function's BOUNDS_ATTR (None: unbounded)."""
    bounds = bounds_of(sch.mod["main"])
    if not bounds:
        return None
    from tvm.sym.analyzer import Analyzer
    ana = Analyzer()
    if not _bind_symbols(ana, expr, bounds):
        return None
    top = ana.const_int_bound(expr).max_value
    return int(top) if top < 2 ** 62 else None


def _bind_symbols(ana, expr, bounds) -> bool:
    """Bind each symbol of `expr` (kernorch.dynamic: seq) in `ana` to 1..its bound in `bounds`
    (1..2**31 without one); returns whether every one had a bound."""
    known = True
    for v in tirx.analysis.undefined_vars(expr):
        known = known and v.name in bounds
        ana.bind(v, tvm.ir.Range.from_min_extent(1, int(bounds[v.name]) if v.name in bounds else 2 ** 31))
    return known


def _vectorize_inner(sch, block, lanes: int, skip_outer: int = 0):
    """Vectorize the innermost loop of `block` (split by `lanes` if long); returns the loops outside it.
    A symbolic one (a row over seq keys) is split by `lanes` under a guard, which `_scheduled` turns
    into whole vectors unguarded and the one across the length predicated. Left scalar, a softmax's
    exp over seq keys (the block's scaled scores, max and exp, 4 heads, alone, hot, Zen 2, 2
    threads) took 1.4 us at seq=7 and 2.6 at 13, 0.7 and 1.8 vectorized (1.19 -> 1.16 ms at 512)."""
    loops = list(sch.get_loops(block))[skip_outer:]
    if not loops:
        return []
    inner = loops[-1]
    ext = _extent(sch, inner)
    if ext is None:
        outer_l, vec = _split(sch, inner, lanes)
        sch.vectorize(vec)
        return loops[:-1] + [outer_l]
    if ext < 2:
        return loops
    if ext > lanes:
        factor = lanes if ext % lanes == 0 else _best_divisor(ext, lanes) or lanes
        outer_l, vec = sch.split(inner, factors=[None, factor])
        sch.vectorize(vec)
        return loops[:-1] + [outer_l]
    sch.vectorize(inner)
    return loops[:-1]


def _best_divisor(n: int, lanes: int) -> int | None:
    for d in (lanes, lanes // 2, lanes // 4):
        if d >= 4 and n % d == 0:
            return d
    return None


# -- rule: contraction (matmul, conv) ------------------------------------------------------------

def _rule_contraction(func, lanes: int, tile: Tile | None = None, threads: int = 1,
                      few_rows: bool = False) -> s_tir.Schedule:
    """Register-tile the (single) matmul/conv block: outer spatial tiles in parallel, all reduction
    loops, then an unrolled row tile x a vectorized column tile accumulated in a local cache;
    the elementwise epilogue is inlined into the cache write-back.

    `tile` (a micro-kernel variant, kernorch.kernels.tiles) fixes the row tile `mr`, the column tile
    `nb` (which must divide the columns: no guarded vector tail) and the order of the parallel tiles;
    without it a rule picks them (power-of-two column tiles, rows dividing the extent).

    Rows outside (`tile.rows_outer`), the parallel loop walks `threads` groups of column tiles (a
    static number of them that divides among the threads; no batch axes), then the row tiles, then
    the group's column tiles: the runtime gives each thread a contiguous share
    of the iterations, so each thread streams only its group's share of the weights (rows outermost,
    two row tiles on two threads had each thread stream every weight: a 7 x 384 x 384 projection
    took 35 us against 13 us at 6 rows, one row tile).

    A batch whose elements share the weights is a loop outside the tiles; with `few_rows` (the copy
    a kernel over seq rows runs at one or two rows) it runs inside the column panels instead, so
    each panel is fetched once for the whole batch: at batch=8 x seq=2, a 384 x 1536 GEMM over
    batch=1..8 x seq=1..512 took 534 us with the weights fetched per batch element, 455 this way
    (Zen 2, weights cold). Not for longer rows: at 8x512 the batch's activations then stream past
    every panel (54 -> 62 ms)."""
    sch = s_tir.Schedule(func)
    names = _root_blocks(sch)
    contractions = _contraction_blocks(sch)
    if len(contractions) != 1:
        raise _NotApplicable(f"{len(contractions)} contraction blocks")
    cname = contractions[0]
    blk = sch.get_sblock(cname)
    stmt = sch.get(blk)
    a, b = _contraction_operands(stmt)
    ivs = list(stmt.iter_vars)
    loops = list(sch.get_loops(blk))
    kinds = [int(iv.iter_type) for iv in ivs]
    nsp = kinds.count(_DATA_PAR)
    if len(loops) != len(ivs) or kinds != [_DATA_PAR] * nsp + [_COMM_REDUCE] * (len(ivs) - nsp) or nsp < 1:
        raise _NotApplicable("unexpected loop structure")
    ext = _batch_read_static([_extent(sch, lp) for lp in loops], nsp)  # (a symbolic batch: a loop outside)
    rows_whole = _rows_whole(ext, nsp, tile)
    padded = (None in ext and not rows_whole) or (func.attrs is not None and PADDED_ATTR in func.attrs)
    if rows_whole:  # read as ints: any number of rows is a whole number of tiles
        ext = [e if e is not None else 1024 for e in ext]
    if padded:  # a symbolic extent or ragged columns, padded to the tile before inlining (see _pad_to_tile)
        factors = _pad_factors(ext, nsp, lanes, tile)
        one_row = _one_row(ext, nsp, tile)  # (symbolic rows left unpadded)
        if any(e is None and f == 1 and i < nsp and not (one_row and i < nsp - 1)
               for i, (e, f) in enumerate(zip(ext, factors))):
            raise _NotApplicable("a symbolic spatial extent that is not padded")
        # the rule reads extents as ints: a padded symbolic extent counts as its tile times a large
        # number (it only has to be divisible by the tile and larger than it)
        ext = [e if e is not None else f * 1024 for e, f in zip(ext, factors)]
    v = nsp - 1
    if ext[v] < 4:
        raise _NotApplicable("innermost spatial extent too small to vectorize")
    vname = ivs[v].var.name
    vec_operand = a if vname in _var_names(a) else b
    vec_vars = _var_names(vec_operand)
    cand = [i for i in range(v) if ext[i] > 1]
    row = next((i for i in reversed(cand) if ivs[i].var.name not in vec_vars), cand[-1] if cand else None)
    if tile is not None:
        if ext[v] % tile.nb:
            raise _NotApplicable(f"column tile {tile.nb} does not divide the {ext[v]} columns")
        vt = tile.nb
        r = min(tile.mr, ext[row]) if row is not None else 1
    else:
        vt = _pick_vec_tile(ext[v], lanes)
        vregs = -(-vt // lanes)
        rmax = max(1, 24 // vregs)
        r = 1
        if row is not None:
            r = next((d for d in (16, 12, 8, 6, 4, 3, 2, 1) if d <= rmax and ext[row] % d == 0), 1)
    ro = ri = None
    if row is not None:
        ro, ri = sch.split(loops[row], factors=[None, r])
        row_tiles = sch.get(ro).extent  # (over padded symbolic rows a run-time value)
    if vt < ext[v]:
        vo, vi = sch.split(loops[v], factors=[None, vt])
    else:
        vo, vi = None, loops[v]
    outer = [loops[i] for i in range(nsp) if i not in (row, v)]
    # (unpadded symbolic rows outside: a run-time extent inside the fused loop is a division by it)
    tiles_order = (ro, vo) if tile is None or tile.rows_outer or rows_whole else (vo, ro)
    # a row-wise epilogue (a softmax over the columns): the parallel loop walks row tiles, each
    # computes its whole rows column tile by column tile, and the epilogue runs on them in cache
    row_wise = (_row_epilogue(sch, cname, names) if tile is not None and tile.rows_outer and not padded
                and ro is not None and vo is not None else [])
    if (not row_wise and not rows_whole and tile is not None and tile.rows_outer and not tile.serial and threads > 1
            and ro is not None and vo is not None and _extent(sch, vo) is not None and (ext[v] // vt) % threads == 0
            and all(ext[i] == 1 for i in range(nsp) if i not in (row, v))):
        vg, vo = sch.split(vo, factors=[threads, None])
        tiles_order = (vg, ro, vo)
    inside = 1  # the iterations of the fused loop a weight panel is reused over, beside its row tiles
    batch = [i for i in range(v) if i != row]
    if (few_rows and vo is not None and any(ext[i] > 1 for i in batch)
            and all(ivs[i].var.name not in vec_vars for i in batch)):
        for lp in outer:
            inside = inside * sch.get(lp).extent
        outer = [vo, *outer]
        tiles_order = tuple(x for x in tiles_order if x is not vo)
    outer += [x for x in tiles_order if x is not None]
    if not outer:
        raise _NotApplicable("nothing to parallelise")
    red = loops[nsp:]
    inner = [x for x in (ri, vi) if x is not None]
    sch.reorder(*outer, *red, *inner)
    par = _parallel(sch, outer[:-1] if row_wise else outer, serial=tile is not None and tile.serial)
    # vectorize before decompose_reduction: afterwards the update block is no longer a "local
    # reduction block" under vi and vectorize() refuses it
    sch.vectorize(vi)
    if ri is not None and r > 1:
        sch.unroll(ri)
    # accumulate in a local tile, written back (with the epilogue) once per tile
    wb = sch.cache_write(blk, 0, "local")
    if not padded:  # a padded domain: the copy-out keeps its own guarded loop (inlined, it would write the padding)
        _reverse_inline_chain(sch, wb, func)
        # an elementwise head of the row-wise epilogue (a bias, a relu) is now in the write-back
        left = set(_root_blocks(sch))
        row_wise = [n for n in row_wise if n in left]
    sch.reverse_compute_at(wb, vo if row_wise else par, preserve_unit_loops=True)
    moved: set[str] = set()
    if padded:
        sch, moved = _copy_out_per_tile(sch, wb, par)
    if row_wise:
        moved = _epilogue_per_row_tile(sch, row_wise, par, lanes)
    wb_loops = sch.get_loops(wb)
    if len(wb_loops) > 1:
        sch.vectorize(wb_loops[-1])
    init = sch.decompose_reduction(blk, red[0])
    init_loops = sch.get_loops(init)
    sch.vectorize(init_loops[-1])
    # everything else (producers like pad, epilogues that could not be inlined, the padding blocks
    # of a symbolic extent): the blocks at the root apart from the contraction
    _schedule_rest(sch, set(names) - {cname} - moved, lanes)
    # over symbolic rows the number of row tiles per panel is known at run time only (padded: the
    # row tile loop's extent, e.g. (seq + 3) // 4)
    # (a one-row tile, a matrix-vector product, fetches nothing: two multiply-adds a step leave the
    # fetches nothing to hide behind. seq x 1536 x 384 and seq x 384 x 1536 at seq=1, t8x32p, Xeon
    # model 167, 2 threads: 51 -> 41 and 43 -> 41 us with the weights in L3 (as this model's run),
    # 121 -> 122 and 114 -> 114 flushed; at two rows the fetches still pay with the weights flushed)
    if (tile is not None and tile.pack and not tile.rows_outer and tile.mr > 1 and par is not None
            and vo is not None and (row is None or ext[row] % r == 0)):
        # (not where the tile leaves a short last tile: with it in a reduction loop of its own
        # (`_peeled_tail`) and the fetches in both, LLVM stored the accumulators to memory at every
        # step: 512 x 384 x 1536 in 14 x 32 tiles, weights in L3, Xeon model 167: 168 GFLOP/s
        # against 342 without the fetches; 154-159 with the fetches in the whole tiles' loop only,
        # its write-back unrolled or not)
        weight = _packed_weight(stmt, lambda s: len(s) == 3 and s[2] == vt and s[0] * vt == ext[v])
        if weight is not None:
            # (unpadded symbolic rows: the one-row copy runs at one row, seq=1, one tile a panel)
            tiles = 1 if row is None or rows_whole else (row_tiles if padded else ext[row] // r)
            tiles = tiles if isinstance(inside, int) and inside == 1 else inside * tiles
            _prefetch_next_panel(sch, par, red[0], weight, ext[v] // vt, tiles)
    return sch


def _row_epilogue(sch, cname: str, names: list[str]) -> list[str]:
    """The blocks after contraction `cname` (in order) when they form a row-wise epilogue, such as
    a softmax or a LayerNorm over the columns: at least one reduction, and every reduction runs over
    the last axis (the contraction's columns) of the intermediates it reads. [] otherwise."""
    after = [n for n in names if n != cname and cname in _upstream(sch, n)]
    inside = {b.name for n in [cname, *after] for b in (sch.get(sch.get_sblock(n)).writes[0].source,)}
    reductions = 0
    for n in after:
        stmt = sch.get(sch.get_sblock(n))
        red = [iv.var for iv in stmt.iter_vars if int(iv.iter_type) == _COMM_REDUCE]
        if not red:
            continue
        reductions += 1
        if len(red) != 1:
            return []
        for region in stmt.reads:
            if region.source.name not in inside:
                continue
            *lead, last = [r.min for r in region.region]
            uses = [red[0].name in _var_names(e) for e in lead]
            if any(uses) or red[0].name not in _var_names(last):
                return []
    return after if reductions else []


def _epilogue_per_row_tile(sch, blocks: list[str], par, lanes: int) -> set[str]:
    """Each block of a row-wise epilogue computed under `par` (a row tile) on the tile's rows:
    elementwise blocks vectorized along the row; a reduction along it first rfactored by vector
    lanes (lane partials, vectorized, then the lanes combined)."""
    order = _rfactor_by_lanes(sch, blocks, lanes)
    for blk in order:
        sch.reverse_compute_at(blk, par, preserve_unit_loops=True)
    _vectorize_rows(sch, order, lanes)
    return set(blocks)


def _rfactor_by_lanes(sch, blocks: list[str], lanes: int) -> list:
    """The blocks (at the root) in order, each reduction over a long enough last axis preceded by
    its rfactor block over `lanes` lane partials (rfactor needs the block's own loops, so before
    any compute_at)."""
    order = []
    for name in blocks:
        rf = _rfactor_lanes(sch, sch.get_sblock(name), lanes, min_vectors=2)
        if rf is not None:
            order.append(rf)
        order.append(sch.get_sblock(name))
    return order


# a row tile's lane partials of a reduction are accumulated all rows at a time (`_vectorize_rows`)
# up to this many rows (one vector register each)
ROWS_AT_A_TIME = 16


def _vectorize_rows(sch, blocks: list, lanes: int) -> None:
    """Blocks moved under a row tile's loop: an rfactor block's lane axis innermost and vectorized;
    an elementwise block's row vectorized by `lanes`; other reductions stay scalar (a few lanes).

    An rfactor block walks its chunks of the row outside the tile's rows, the rows unrolled
    (`_partials_by_chunk`): each row's lane partials are then a register of their own and the rows'
    chains interleave, where a row at a time had each chunk load and store its partials, one
    dependent chain per row."""
    for blk in blocks:
        stmt = sch.get(blk)
        loops = sch.get_loops(blk)
        inner = loops[len(loops) - len(stmt.iter_vars):]
        if stmt.name_hint.endswith("_rf"):
            lane = next(lp for lp, iv in zip(inner, stmt.iter_vars)
                        if int(iv.iter_type) == _DATA_PAR and _extent(sch, lp) == lanes)
            if not _partials_by_chunk(sch, blk, inner, stmt, lane):
                sch.reorder(*[lp for lp in inner if not lp.same_as(lane)], lane)
                sch.vectorize(lane)
        elif not _is_reduction(stmt):
            if divisible(sch.get(loops[-1]).extent, lanes):
                _, li = _split(sch, loops[-1], lanes)
                sch.vectorize(li)


def _partials_by_chunk(sch, blk, inner: list, stmt, lane) -> bool:
    """An rfactor block under a row tile (`inner`: its own loops, `lane` its lane axis) as
    (chunk, rows unrolled, lanes vectorized), its init hoisted out of the chunk loop; False (left
    alone) when it has other reduction loops than one over the chunks, or its rows are symbolic or
    more than ROWS_AT_A_TIME. The softmax after an attention's scores, 6 rows x 512 keys a tile
    (6 heads of 64, 2 threads, Zen 2): the scores and softmax in one kernel took 2.51 ms at seq=512
    with a row at a time, 1.61 ms this way (the scores alone 1.30); the whole attention over a
    symbolic length 3.09 -> 2.76 ms at 512, 1.07 -> 0.98 at 300."""
    kinds = [int(iv.iter_type) for iv in stmt.iter_vars]
    red = [lp for lp, k in zip(inner, kinds) if k == _COMM_REDUCE]
    rows = [lp for lp, k in zip(inner, kinds) if k == _DATA_PAR and not lp.same_as(lane)]
    extents = [_extent(sch, lp) for lp in rows]
    if len(red) != 1 or any(e is None for e in extents) or math.prod(extents) > ROWS_AT_A_TIME:
        return False
    sch.reorder(red[0], *rows, lane)
    for lp, e in zip(rows, extents):
        if e > 1:
            sch.unroll(lp)
    sch.vectorize(lane)
    init = sch.decompose_reduction(blk, red[0])  # (after vectorize, which refuses a decomposed block)
    sch.vectorize(sch.get_loops(init)[-1])
    return True


def _rule_attention(func, lanes: int, tile: Tile) -> s_tir.Schedule:
    """Two contractions in the shape of attention (kernorch.candidates._attention): scores S = Q K,
    a row-wise chain over S's columns (a softmax: reductions and elementwise), O = P V.

    The parallel loop walks tiles of `mr` query rows (O's batch axes and row tiles, fused). In each,
    the tile's scores are computed a column tile of `nb` at a time (the micro-kernel: `mr` rows
    unrolled x `nb` columns vectorized, accumulated over Q's depth in a local cache), the chain
    runs on the tile's rows (reductions rfactored by vector lanes), and O's `mr` rows are
    accumulated over the keys (rows unrolled x V's columns vectorized) and written back with their
    epilogue: the scores and probabilities never leave a row tile's buffers."""
    sch = s_tir.Schedule(func)
    names = _root_blocks(sch)
    cons = _contraction_blocks(sch)
    if len(cons) != 2:
        raise _NotApplicable(f"{len(cons)} contraction blocks")
    c1, c2 = cons
    chain = [n for n in names if n not in cons and c1 in _upstream(sch, n) and n in _upstream(sch, c2)]
    b2 = sch.get_sblock(c2)
    stmt2 = sch.get(b2)
    loops2 = list(sch.get_loops(b2))
    kinds = [int(iv.iter_type) for iv in stmt2.iter_vars]
    nsp = kinds.count(_DATA_PAR)
    if len(loops2) != len(kinds) or kinds != [_DATA_PAR] * nsp + [_COMM_REDUCE] or nsp < 2:
        raise _NotApplicable("the second contraction is not a batched matmul")
    ext2 = [_extent(sch, lp) for lp in loops2]
    depth = ext2[nsp - 1]  # V's columns
    if depth is None:
        raise _NotApplicable("a symbolic value extent")
    # (a symbolic batch: a loop outside the row tiles, in the parallel loop below)
    if depth % lanes:
        raise _NotApplicable(f"{depth} value columns are no multiple of the lanes")
    # over a symbolic length (lower._PaddedAttention) the rows are padded to the tile's rows
    rows = ext2[nsp - 2]
    r = row_tile(tile.mr, rows) if rows is not None else tile.mr
    if rows is None and not divisible(sch.get(loops2[nsp - 2]).extent, r):
        raise _NotApplicable("the symbolic rows are not padded to the row tile")
    order = _rfactor_by_lanes(sch, chain, lanes)
    io, ii = _split(sch, loops2[nsp - 2], r)
    red = loops2[nsp:]
    # the output's rows in register tiles: rows x V's columns (or a column tile of them) accumulators
    r2, vectors = values_tile(r, depth // lanes, 32 if lanes >= 16 else 16, 4 * lanes)  # AVX-512: 32 registers
    i2o, i2i = sch.split(ii, factors=[None, r2])
    cols2 = [loops2[nsp - 1]] if vectors * lanes == depth else list(sch.split(loops2[nsp - 1],
                                                                              factors=[None, vectors * lanes]))
    sch.reorder(*loops2[:nsp - 2], io, i2o, *cols2[:-1], *red, i2i, cols2[-1])
    par = _parallel(sch, [*loops2[:nsp - 2], io], serial=tile.serial)
    sch.vectorize(cols2[-1])
    sch.unroll(i2i)
    wb2 = sch.cache_write(b2, 0, "local")
    padded = any(n.startswith(ROWS_OUT) for n in names)  # (lower._PaddedAttention padded the rows)
    if not padded:  # (padded rows: the copy-out keeps its guard, it follows each row tile below)
        _reverse_inline_chain(sch, wb2, func)
    sch.reverse_compute_at(wb2, ([i2o] + cols2)[-2], preserve_unit_loops=True)
    wl = sch.get_loops(wb2)
    sch.vectorize(wl[-1])
    # rows unrolled: indexed by a loop variable, the accumulator tile stays in memory and every FMA
    # loads and stores its accumulator (seq=512 over a symbolic length, 6 heads of 64, one thread,
    # Xeon family 6 model 207: 7.2 -> 5.4 ms; the static kernel 4.3 -> 4.0)
    sch.unroll(wl[-2])
    init2 = sch.decompose_reduction(b2, red[0])
    sch.vectorize(sch.get_loops(init2)[-1])
    moved: set[str] = set()
    if padded:
        sch, moved = _copy_out_per_tile(sch, wb2, par)
    # the chain and the scores under the row tile, consumers first
    for blk in reversed(order):
        sch.compute_at(blk, par, preserve_unit_loops=True)
    b1 = sch.get_sblock(c1)
    sch.compute_at(b1, par, preserve_unit_loops=True)
    _vectorize_rows(sch, order, lanes)
    # the scores' micro-kernel: rows x a column tile, over Q's depth
    stmt1 = sch.get(b1)
    loops1 = list(sch.get_loops(b1))[-len(stmt1.iter_vars):]
    n1 = sum(1 for iv in stmt1.iter_vars if int(iv.iter_type) == _DATA_PAR)
    rows1, cols1, red1 = loops1[n1 - 2], loops1[n1 - 1], loops1[n1:]
    cols = sch.get(cols1).extent
    nb = tile.nb if divisible(cols, tile.nb) else lanes
    if not divisible(cols, nb):
        raise _NotApplicable("the score columns are no multiple of the lanes")
    jo, ji = _split(sch, cols1, nb)
    sch.reorder(jo, *red1, rows1, ji)
    sch.vectorize(ji)
    sch.unroll(rows1)
    wb1 = sch.cache_write(b1, 0, "local")
    sch.reverse_compute_at(wb1, jo, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(wb1)[-1])
    init1 = sch.decompose_reduction(b1, red1[0])
    sch.vectorize(sch.get_loops(init1)[-1])
    # the padded queries copied tile by tile, each row tile's rows right before its scores read them
    # (from L1), not all of them in a pass of their own before (written to and read back from
    # L2 or beyond). gpt_like's attention over seq (6 heads of 64), caches evicted, Xeon model 167,
    # 2 threads, medians of three processes: t4x64r 17.7 -> 15.7 us at seq=32, 738 -> 722 at 300,
    # 1780 -> 1704 at 512; t8x32r 16.2 -> 14.8, 739 -> 758, 1734 -> 1772 (its runs spread +-50 us)
    for n in names:
        if n.startswith(QUERIES_PADDED):
            q = sch.get_sblock(n)
            sch.compute_at(q, par, preserve_unit_loops=True)
            sch.vectorize(sch.get_loops(q)[-1])
            moved = moved | {n}
    rest = set(names) - set(cons) - set(chain) - moved
    _schedule_rest(sch, rest, lanes)
    if func.attrs is not None and func.attrs.get(CAUSAL_ATTR) is not None:
        if not _skip_masked_keys(sch, par, [c1, *chain], stmt1.writes[0].source.shape[-2:]):
            log.warning("a causal attention (%s) computes every key: its loops over the keys are not all "
                        "bounded by its row tile", tile.name)
    return sch


def values_tile(rows: int, vectors: int, registers: int, vector_bytes: int) -> tuple[int, int]:
    """The register tile of an attention's values contraction (O = P V: per key, a row of V's
    column vectors loaded and one probability broadcast per row): (rows, column vectors), the rows
    dividing the query row tile `rows`. All of V's `vectors` while they leave room for two rows'
    accumulators (AVX-512's 32 registers and 64 columns); else the tile of most multiply-adds per
    cycle by `values_cycles`, the tallest of equals. With AVX2's 16 registers and 64 value columns
    (8 vectors) there was room for one row: 8 multiply-adds per 9 loads, and a transformer block's
    attention at seq=512 took 4.0 ms in one kernel against 2.9-3.0 for its scores, softmax and
    values apart (Zen 2, 2 threads)."""
    def rows_of(v: int) -> int:
        fit = (registers - v - 1) // v
        return next(x for x in range(min(rows, fit), 0, -1) if rows % x == 0) if fit >= 1 else 0
    if rows_of(vectors) >= min(2, rows):
        return rows_of(vectors), vectors
    tiles = [(rows_of(v), v) for v in range(vectors, 0, -1) if vectors % v == 0 and rows_of(v)]
    return max(tiles, key=lambda t: (t[0] * t[1] / values_cycles(*t, vector_bytes), t[0]))


# what V's rows stream at from L2 into a values tile, bytes a cycle: about half the port's 32 (a
# modelled figure; V of 512 keys x 64 columns is 128 KiB, past L1)
L2_BYTES_PER_CYCLE = 16


def values_cycles(rows: int, vectors: int, vector_bytes: int) -> float:
    """Cycles per key of a values tile of `rows` x `vectors`: two FMAs and two loads a cycle, and
    V's row of the tile read from L2 at L2_BYTES_PER_CYCLE."""
    return max(rows * vectors / 2, (rows + vectors) / 2, vectors * vector_bytes / L2_BYTES_PER_CYCLE)


KEYS_OF = "kernorch.keys_of"  # a loop over keys bounded by its row tile (`_skip_masked_keys`): min(its keys, the tile's)


def _skip_masked_keys(sch, par, stages: Sequence[str], shape) -> bool:
    """An attention with a causal mask (lower.causal_attention: the keys past a query are masked,
    their probabilities exactly zero, kernorch.masks) computes, in each row tile of the parallel
    loop `par`, its scores, softmax and values only over the keys up to the tile's last row.

    The buffers along the keys are those the blocks of `stages` (the scores, the chain; their
    init, update, cache and rfactor blocks) write with the scores' `shape` in their two last axes.
    Every block inside `par` that reads or writes one indexes its key axis as `C * L + r`, `L` a
    serial loop inside `par` and `0 <= r < C` from loops inside `L`; that loop `L` then runs
    min(extent, ceil((last row + 1) / C)) times, the last row read off the same access's row index
    at its loops' largest values. A block whose keys are all in vector or unrolled loops computes
    them all. All or nothing otherwise: a block reading keys their writer skipped would read
    garbage, so where an access does not fit, nothing changes and False is returned. (The
    loops share the body's blocks: no schedule primitive may look one up after this.)"""
    from tvm.sym import IntervalSet, detect_linear_equation
    from tvm.sym.analyzer import Analyzer
    loop = sch.get(par)
    ana = Analyzer()
    suffixes = ("", "_init", "_update", "_local", "_rf")
    names = {s + x for s in stages for x in suffixes}
    realizes = found(loop.body, lambda s: isinstance(s, s_tir.stmt.SBlockRealize))
    loops = found(loop.body, lambda s: isinstance(s, tirx.For))
    once = [(f.loop_var, f.min) for f in loops if _is_const(f.extent, 1)]   # (their variable is their start)
    fors = [f for f in loops if not _is_const(f.extent, 1)]

    def along(buf) -> bool:
        return len(buf.shape) >= 2 and all(ana.can_prove_equal(a, b) for a, b in zip(buf.shape[-2:], shape))
    keyed = [w.source for r in realizes if r.block.name_hint in names for w in r.block.writes if along(w.source)]

    def is_keyed(buf) -> bool:
        return any(buf.same_as(k) for k in keyed)

    needs: list = []      # (the loop, the iterations it needs)
    users: list = []      # (the loop, a block bounded by it)
    whole: list = []      # blocks that compute every key
    steps: list = []      # (a buffer along the keys, the keys a bounded loop's step covers, written there)
    for r in realizes:
        regions = [a for a in [*r.block.reads, *r.block.writes] if is_keyed(a.source)]
        if not regions:
            continue
        pairs = [(iv.var, v) for iv, v in zip(r.block.iter_vars, r.iter_values)]
        for a in regions:
            if not all(isinstance(x.extent, tirx.IntImm) and int(x.extent) == 1 for x in a.region[-2:]):
                return False
            row, col = (ana.simplify(substitute(substitute(x.min, pairs), once)) for x in a.region[-2:])
            inner = [f for f in fors if _uses(col, f.loop_var)]
            coefs = []
            for f in inner:
                lin = detect_linear_equation(col, [f.loop_var])
                if len(lin) != 2 or not isinstance(lin[0], tirx.IntImm) or int(lin[0]) <= 0 or not _is_const(f.min, 0):
                    return False
                coefs.append(int(lin[0]))
            if not inner:
                return False
            if all(f.kind != tirx.ForKind.SERIAL for f in inner):
                whole.append(r.block)  # (its keys in one vector or unrolled loop: it computes them all)
                continue
            k = max(range(len(inner)), key=lambda i: coefs[i])
            outer, c = inner[k], coefs[k]
            if any(not isinstance(f.extent, tirx.IntImm) for i, f in enumerate(inner) if i != k):
                return False
            rest = sum(coefs[i] * (int(inner[i].extent) - 1) for i in range(len(inner)) if i != k)
            base = ana.simplify(substitute(col, [(f.loop_var, tirx.const(0, _dtype(f.loop_var))) for f in inner]))
            if rest >= c or not _is_const(base, 0) or outer.kind != tirx.ForKind.SERIAL:
                return False
            dom = {f.loop_var: IntervalSet(f.min, f.min + f.extent - 1) for f in fors if _uses(row, f.loop_var)}
            last = ana.int_set(row, dom).max_value
            if any(_uses(last, f.loop_var) for f in fors):
                return False
            needs.append((outer, tirx.floordiv(last + c, c)))
            users.append((outer, r.block))
            steps.append((a.source, c, any(w.source.same_as(a.source) for w in r.block.writes)))
    if not needs:
        return False
    for buf, c, _ in steps:  # a bounded reader covers no key past its bounded writers' (whose steps it divides)
        if any(w and b.same_as(buf) and d % c for b, d, w in steps):
            return False
    for b in whole:  # a block computing every key reads none that a bounded block writes
        for a in b.reads:
            if is_keyed(a.source) and any(w.source.same_as(a.source) and not any(x.same_as(r.block) for x in whole)
                                          for r in realizes for w in r.block.writes):
                return False
    bounded: list = []    # (the loop, its new extent)
    for f, need in needs:
        at = next((i for i, (g, _) in enumerate(bounded) if g.same_as(f)), None)
        need = tirx.Cast(_dtype(f.extent), need) if _dtype(need) != _dtype(f.extent) else need
        if at is None:
            bounded.append((f, need))
        elif not tvm_ffi.structural_equal(bounded[at][1], need):
            bounded[at] = (f, tirx.max(bounded[at][1], need))
    for f, _ in bounded:  # every block under a bounded loop is one bounded by it
        inside = found(f.body, lambda s: isinstance(s, s_tir.stmt.SBlockRealize))
        if not all(any(g.same_as(f) and b.same_as(x.block) for g, b in users) for x in inside):
            return False

    def visit(s):
        if not isinstance(s, tirx.For):
            return None
        ext = next((e for g, e in bounded if g.same_as(s)), None)
        if ext is None:
            return None
        notes = {**{k: v for k, v in s.annotations.items()}, KEYS_OF: 1}
        return tirx.For(s.loop_var, s.min, tirx.Min(s.extent, ana.simplify(ext)), s.kind, rewrite(s.body, visit),
                        s.thread_binding, notes)
    new = tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, rewrite(loop.body, visit), loop.thread_binding,
                   loop.annotations)
    sch.state.replace(sch.get_sref(par), new)
    return True


def _is_const(e, value: int) -> bool:
    return isinstance(e, tirx.IntImm) and int(e) == value


# -- software prefetch of the next weight panel ----------------------------------------------------

CACHE_LINE = 64  # bytes


def _packed_weight(stmt, fits):
    """The buffer a contraction block reads whose static shape `fits` (a list of ints), or None."""
    for region in stmt.reads:
        buf = region.source
        if all(isinstance(d, tirx.IntImm) for d in buf.shape) and fits([int(d) for d in buf.shape]):
            return buf
    return None


# over symbolic rows, the first tiles of a panel that fetch the next one, a share each, spread over
# their steps as a static kernel's tiles do (32 rows in 8-row tiles: the static kernel's fetches).
# Weights in L3, 2 threads, Xeon model 167, against the panel fetched by its last tile alone, two
# lines a step: seq x 384 x 1536 t8x32p 111 us at seq=32 against 127 (the static kernel 110), 443
# against 466 at 128, 1810 against 1871 at 512; seq x 1536 x 384 t8x32p 120 against 136 at 32 (static
# 121), 46 against 52 at 4; over 3 or 8 tiles 127-133 us at 32. A panel of fewer tiles (seq < 32
# here) has its last tile fetch the shares of the tiles it lacks too: with only their own shares
# fetched, gpt_like (weights 30 MB, timed flushed) ran its fused LayerNorm + seq x 384 x 1536 +
# GELU t8x32p at seq=7 in 171 us against 132 with the whole panel fetched (the static kernel 133),
# and the one-plan executable 1.07x as long at seq=7, 1.08x at 16, the same from 32 on within
# noise; the transformer block (weights in L3) 1.07x and 1.08x (each executable alone in its own
# process, 5 turns each). The last tile's loop of its own costs a copy
# of the reduction loop: a fused GEMM's whole-range kernel compiled 1.4x as long, its measured
# builds 1.0-1.15x.
PREFETCH_SPREAD = 4


def _prefetch_next_panel(sch, par, red_loop, weight, panels: int, tiles) -> bool:
    """While the tiles of one weight panel run, bring the next panel into L2 (prefetcht1).

    A packed weight `[P, ...]` is read one panel (its first axis: the K x nb columns of a GEMM
    column tile, the C x kh x kw x nb of a conv output-channel tile) at a time, and each panel is
    reused by the `tiles` row tiles the fused parallel loop `par` walks inside it (panel index
    `f // tiles % panels`, tile `f % tiles`). The panel's first PREFETCH_SPREAD tiles (or all,
    when it has fewer) each prefetch their share of the next panel's cache lines, spread over the
    iterations of their outermost reduction loop `red_loop` (of K steps: a line every
    `_every_power_of_two` steps, or with more lines than steps ceil(share/K) lines per step); the
    other tiles run the loop without prefetch code. The panel arrives from L3 or memory while the
    FMAs run, a line every few steps, instead of stalling the first tile of every panel on it.

    Spread, not issued as one burst before the reduction loop: a burst of 48-192 prefetches holds
    the core's line-fill buffers while the tile's own loads wait (128x1536 x 1536x384 t8x32p,
    weights cold, Xeon model 207: 609 us with the burst, 529 spread, 601 with none; hot all about
    450-470). LLVM keeps the accumulators in registers around a prefetch only because the tile is
    on the stack (passes.stack_small_buffers); in TVM's workspace it stored them to memory around
    every prefetch. `tiles` is an int, or over padded symbolic rows an expression of the length
    (then the panel's first PREFETCH_SPREAD tiles fetch it, see below).
    Returns False (nothing changed) if `par`'s body is not the sequence it expects."""
    loop = sch.get(par)
    body = loop.body
    red = sch.get(red_loop)
    seq = list(body.seq) if isinstance(body, tirx.SeqStmt) else [body]
    at = next((i for i, s in enumerate(seq) if s.same_as(red)), None)
    static = isinstance(tiles, int)
    if at is None or panels < 2 or (static and tiles < 1) or not isinstance(red.extent, tirx.IntImm):
        return False  # (one panel: nothing to fetch ahead)
    shape = [int(d) for d in weight.shape]
    elem = tvm.DataType(weight.dtype).bits // 8
    per_panel = int(np.prod(shape[1:]))
    lines = -(-per_panel * elem // CACHE_LINE)
    steps = int(red.extent)
    f = loop.loop_var
    k = red.loop_var - red.min
    if not static:
        tiles = tirx.Cast(f.ty.dtype, tiles)
    panel = tirx.floormod(tirx.floordiv(f, tiles) + 1, panels)

    def fetch_line(line):  # line `line` of the next panel
        offset = line * (CACHE_LINE // elem)
        index = []
        for d in reversed(shape[1:]):
            index.append(tirx.floormod(offset, d))
            offset = tirx.floordiv(offset, d)
        addr = tirx.address_of(tirx.BufferLoad(weight, [panel, *reversed(index)]))
        return tirx.Evaluate(tirx.call_intrin("void", "tirx.prefetch", addr, 0, 2, 1))

    def spread(t, share, also=()):  # tile t's `share` lines of the next panel (from line t*share, clamped
        # to its last), spread; `also`: (condition, q) pairs, the shares q it fetches besides where their condition holds
        def prefetch(j):
            first = fetch_line(tirx.min(t * share + j, lines - 1))
            return tirx.SeqStmt([first, *(tirx.IfThenElse(cond, fetch_line(tirx.min(q * share + j, lines - 1)), None)
                                          for cond, q in also)]) if also else first
        if share <= steps:  # at most a line per step: every `every`-th step fetches one, a power of two
            # apart (`_every_power_of_two`), while the share lasts
            every = _every_power_of_two(steps, share)
            first = tirx.floordiv(k, every) if every > 1 else k
            tests = ([tirx.floormod(k, every) == 0] if every > 1 else []) + ([first < share] if every * share < steps
                                                                            else [])
            if not tests:
                return prefetch(first)
            return tirx.IfThenElse(functools.reduce(tirx.And, tests), prefetch(first), None)
        per = -(-share // steps)  # several lines a step (a conv's reduction over channel blocks): `per`, in order
        i = tirx.Var("pf", k.ty.dtype)
        return tirx.For(i, 0, per, tirx.ForKind.SERIAL, prefetch(tirx.min(k * per + i, share - 1)))

    def fetching(fetch):  # the reduction loop with `fetch` at the start of each step
        return tirx.For(red.loop_var, red.min, red.extent, red.kind, tirx.SeqStmt([fetch, red.body]),
                        red.thread_binding, red.annotations)

    # the panel's first PREFETCH_SPREAD tiles (all, when it has fewer) fetch it, a share each, spread
    # over their steps; the other tiles run the reduction loop as it was, without prefetch code
    # (static, every tile fetching a share under its test took 1.16x as long: 300 x 1536 x 384,
    # t6x16p, 50 tiles a panel, Zen 2, 2 threads, weights cold, 1.99 ms against 1.72)
    t = tirx.floormod(f, tiles)
    fetchers = min(tiles, PREFETCH_SPREAD) if static else PREFETCH_SPREAD
    share = -(-lines // fetchers)
    fetches = fetching(spread(t, share))
    if static:
        body = fetches if fetchers == tiles else tirx.IfThenElse(t < fetchers, fetches, red)
    else:  # the number of tiles per panel is known at run time only. The panel's last tile, the
        # one a length leaves short, runs a fetching loop of its own (whose exact copies
        # `_exact_tail` makes): its share (its lines clamped to the panel's last: one line already
        # there) and, where the panel has fewer than PREFETCH_SPREAD tiles, the shares past its own
        # (the tiles the panel lacks), each under a test of its index only. One loop for all, the fetch under its condition on k,
        # took 1.3x as long hot on a Zen 3 (AVX2; a seq x 384 x 384 t6x16p GEMM at seq=512: 1260
        # against 960 us) where only one tile in 86 fetched; a share computed at run time made LLVM
        # spill the accumulators (2.3x slower); the extra shares tested in the first tiles' loop
        # too cost 2-5 % at seq=32-128 hot.
        last = fetching(spread(t, share, [(t < q, q) for q in range(1, PREFETCH_SPREAD)]))
        body = tirx.IfThenElse(t == tiles - 1, last, tirx.IfThenElse(t < fetchers, fetches, red))
    # (the loops share the body's blocks: no schedule primitive may look one up after this)
    seq[at] = body
    new = tirx.For(f, loop.min, loop.extent, loop.kind, tirx.SeqStmt(seq), loop.thread_binding, loop.annotations)
    sch.state.replace(sch.get_sref(par), new)
    return True


def _every_power_of_two(steps: int, share: int) -> int:
    """How many reduction steps apart a tile's `share` prefetches go over `steps`: the largest power
    of two that fits them all in. Spread evenly instead (step k fetching when `k * share % steps <
    share`), the test cost a division by a constant at every step, most of them fetching nothing:
    a 300 x 1536 x 384 GEMM (t6x16p, 50 row tiles a panel, 31 lines each over 1536 steps, Zen 2,
    2 threads, weights cold) took 2.14 ms that way, 1.99 with every tile fetching a power of two
    steps apart, 1.72 with only the panel's first PREFETCH_SPREAD tiles fetching (1.75 without
    prefetch; the same GEMM over a symbolic length, whose shares were a power of two apart, 1.72)."""
    every = 1
    while every * 2 * share <= steps:
        every *= 2
    return every


SYMBOLIC_ROWS = 8  # the row tile of a contraction over a symbolic row extent, without a tile variant


def _one_row(ext: list, nsp: int, tile: Tile | None) -> bool:
    """Whether `tile` leaves a contraction's symbolic rows unpadded: a tile of one row
    (kernorch.kernels.tiles.SMALL_ROWS) runs any number of them as a whole number of tiles. Not
    over a symbolic depth (None in `ext` past its `nsp` spatial loops): the operand there, a
    softmax's division, read in place would be recomputed in every multiply-add, where padded rows
    read it through a clamped row copy."""
    return tile is not None and tile.mr == 1 and None not in ext[nsp:]


def _rows_whole(ext: list, nsp: int, tile: Tile | None) -> bool:
    """Whether a contraction's symbolic extents (None in `ext`) are all rows that `tile` leaves
    unpadded (`_one_row`): then it needs neither padding nor a guarded copy-out."""
    symbolic = [i for i, e in enumerate(ext) if e is None]
    return bool(symbolic) and all(i < nsp - 1 for i in symbolic) and _one_row(ext, nsp, tile)


def _pad_factors(ext: list, nsp: int, lanes: int, tile: Tile | None) -> list[int]:
    """Per loop of a contraction: the multiple its symbolic spatial extent is padded to (rows to
    the row tile, columns to the column tile; 1 elsewhere)."""
    rows = tile.mr if tile is not None else SYMBOLIC_ROWS
    cols = tile.nb if tile is not None else 2 * lanes
    return [(cols if i == nsp - 1 else rows) if e is None and i < nsp else 1 for i, e in enumerate(ext)]


def _pad_to_tile(func, lanes: int, tile: Tile | None):
    """A contraction over a symbolic extent (kernorch.dynamic: e.g. seq rows), or a matmul whose
    static columns its tile does not divide, gets its iteration domain padded to a multiple of the
    tile on each such spatial axis (`pad_einsum`), before
    the injective stages are inlined (a packed weight's view is no einsum operand), so the tile body
    runs without a guard at any length: the operands are copied into padded buffers (or read
    through guarded loads when the depth is symbolic too), the result copied out of a padded
    buffer. A symbolic reduction extent stays a plain loop. Returns `func`
    unchanged when it has no contraction over a symbolic spatial extent."""
    found = _single_contraction(func)
    if found is None:
        return func
    sch, blk, loops, nsp = found
    ext = _batch_read_static([_extent(sch, lp) for lp in loops], nsp)
    # static columns no tile divides (kernorch.kernels.tiles.contraction_tiles `pad_cols`): a matmul's
    # are padded to the tile too (not a packed operand's), its domain marked PADDED_ATTR so the rule
    # copies its tiles out guarded
    ragged = (tile is not None and not tile.pack and ext[nsp - 1] is not None and ext[nsp - 1] % tile.nb != 0
              and _contraction_name(func).startswith("matmul"))
    if (not any(e is None for e in ext[:nsp]) or _rows_whole(ext, nsp, tile)) and not ragged:
        return func
    name = sch.get(blk).name_hint
    factors = _pad_factors(ext, nsp, lanes, tile)
    if ragged:
        factors[nsp - 1] = tile.nb
    sch.pad_einsum(blk, factors)
    if ragged:
        sch = _marked_padded(sch)
    pads = {sch.get(p).name_hint for p in sch.get_producers(sch.get_sblock(name))}
    sch = _read_rows_clamped(sch, sch.get_sblock(name))
    if any(e is None for e in ext[nsp:]):
        # a symbolic depth too: a padding copy that is no clamped read (its rows are the tile's
        # columns) costs more than a guarded load in the tile (probabilities x V over seq=300: 4.6 ms
        # copied, 0.65 ms guarded; a weight GEMM with a static depth is 1.4x slower guarded, so it
        # keeps the copy). Only the padding copies: a stage that computes the operand (a softmax's
        # division) stays a pass of its own, not recomputed for every column tile.
        for producer in sch.get_producers(sch.get_sblock(name)):
            if sch.get(producer).name_hint not in pads:
                continue
            try:
                sch.compute_inline(producer)
            except Exception:  # noqa: BLE001 - a producer that cannot be inlined stays a copy
                pass
    return sch.mod["main"]


def _marked_padded(sch) -> s_tir.Schedule:
    """`sch` on its function marked PADDED_ATTR (static columns padded to the tile)."""
    return s_tir.Schedule(sch.mod["main"].with_attr(PADDED_ATTR, True))


def _read_rows_clamped(sch, blk) -> s_tir.Schedule:
    """The padding copies of a contraction's operands over symbolic rows (`pad_einsum`: a pass of
    their own that writes zeros past the length) become reads of the operand itself, its row index
    clamped to the last row: the rows past the length compute on a copy of the last row, and their
    results are never copied out. Each tile reads its rows in place (the index is the same for the
    whole depth loop), and the kernel makes no pass over its input first. A padding block that is
    not a plain copy of one operand row stays as it is. Returns the schedule with the changes."""
    for producer in sch.get_producers(blk):
        stmt = sch.get(producer)
        store = stmt.body
        if not _is(store, "BufferStore") or not is_call(store.value, "if_then_else"):
            continue
        cond, then, _ = store.value.args
        if not (_is(cond, "LT") and _is(cond.a, "Var") and _is(then, "TensorLoad")):
            continue
        row, length = cond.a, cond.b
        if sum(i.same_as(row) for i in then.indices) != 1 or _read_by_columns(sch.get(blk), store, row):
            continue
        index = [tirx.Min(i, length - 1) if i.same_as(row) else i for i in then.indices]
        body = tirx.BufferStore(store.buffer, tirx.BufferLoad(then.source, index), store.indices)
        new = with_body(stmt, body)
        trial = sch.copy()
        try:
            trial.state.replace(trial.get_sref(producer), new, {stmt: new})
            trial.compute_inline(producer)
        except Exception as e:  # noqa: BLE001 - the copy stays
            log.debug("padding copy %s stays: %s", stmt.name_hint, _first_line(e))
            continue
        sch = trial
    return sch


def _read_by_columns(stmt, pad_store, var) -> bool:
    """The contraction `stmt` reads the padded buffer `pad_store` writes, along its axis `var`, with
    its column variable, the one its tile vectorizes: a clamp there would turn each vector load into
    a gather (the seq x seq attention scores, t4x64r at seq=512: 10.6 ms clamped, 2.9 ms with the padding
    copy). Such a padding copy stays."""
    pos = next((i for i, x in enumerate(pad_store.indices) if x.same_as(var)), None)
    if pos is None:
        return False
    cols = [iv.var for iv in stmt.iter_vars if int(iv.iter_type) == _DATA_PAR][-1]

    def pad_loads(e):
        if _is(e, "TensorLoad") and e.source.same_as(pad_store.buffer):
            yield e
        for sub in operands(e):
            yield from pad_loads(sub)
    return any(cols.name in _var_names(ld.indices[pos]) for ld in pad_loads(stmt.body.value))


def _is(node, kind: str) -> bool:
    """`node` is a TIR node of this kind (by class name: some of tvm.tirx's names are constructors)."""
    return type(node).__name__ == kind


def _contraction_name(func) -> str:
    sch = s_tir.Schedule(func)
    names = _contraction_blocks(sch)
    if len(names) != 1:
        raise _NotApplicable(f"{len(names)} contraction blocks")
    return names[0]


def _block_of_buffer(buf) -> int | None:
    """The channel block of a blocked activation buffer [N, C/b, H, W, b] (None for others)."""
    return int(buf.shape[-1]) if len(buf.shape) == 5 else None


def _rule_conv(func, lanes: int, tile: Tile) -> s_tir.Schedule:
    """A convolution as a register micro-kernel over (output columns x output channels).

    Loops: (image, output-channel tile, output row, output-column tile) fused and parallel (with
    `tile.rows_outer`: image, row, column tile, channel tile, so an input row stays in cache); the
    reduction over input-channel blocks, kh, kw and the channels of one block; then `mr` output
    columns (unrolled) x `nb` output channels (vectors of `lanes`, unrolled over the vectors)
    accumulated in a local cache and written back once with the epilogue (bias, activation,
    residual) and the output's blocked layout. The weight is packed OIHW>O{nb}, so each step loads
    `nb` contiguous output channels; a blocked input (nChw{b}c) gives contiguous broadcasts over the
    `b` channels of a block. A padded blocked input is materialised once per kernel in its layout;
    a padded plain input (an image) row by row inside the parallel loop (`_pad_per_row`).
    """
    sch = s_tir.Schedule(func)
    names = _root_blocks(sch)
    cname = _contraction_name(func)
    blk = sch.get_sblock(cname)
    stmt = sch.get(blk)
    ivs = list(stmt.iter_vars)
    kinds = [int(iv.iter_type) for iv in ivs]
    loops = list(sch.get_loops(blk))
    if kinds != [_DATA_PAR] * 4 + [_COMM_REDUCE] * 3 or len(loops) != 7:
        raise _NotApplicable("not a 2-D convolution block")
    ext = [_extent(sch, lp) for lp in loops]
    if ext[1] % tile.nb:
        raise _NotApplicable(f"output-channel tile {tile.nb} does not divide {ext[1]} channels")
    n, oc, oh, ow, rc, rkh, rkw = loops
    # the input activation: through the padding stage if there is one
    pad = next((nm for nm in names if nm.startswith("conv_pad")), None)
    src = sch.get(sch.get_sblock(pad)) if pad else stmt
    in_block = next((b for r in src.reads if (b := _block_of_buffer(r.source)) is not None), None)
    oco, oci = sch.split(oc, factors=[None, tile.nb])
    oci_o, oci_i = sch.split(oci, factors=[None, lanes]) if tile.nb > lanes else (None, oci)
    owo, owi = sch.split(ow, factors=[None, row_tile(tile.mr, ext[3])])
    rco, rci = sch.split(rc, factors=[None, in_block]) if in_block and ext[4] % in_block == 0 else (None, rc)
    red = [x for x in (rco, rkh, rkw, rci) if x is not None]
    outer = [n, oh, owo, oco] if tile.rows_outer else [n, oco, oh, owo]
    sch.reorder(*outer, *red, owi, *[x for x in (oci_o,) if x is not None], oci_i)
    # a padded plain-layout input (an image's channels) is padded row by row where it is read: the
    # parallel loop stops at the output row, and each of its iterations first pads (in cache) the
    # input rows its output row reads, instead of a pass over the whole padded image beforehand
    pad_rows = (pad is not None and in_block is None
                and _pad_copy_share(sch, pad, ext, tile) <= PAD_ROWS_MAX_COPY)
    par = _parallel(sch, outer[:2] if (pad_rows and tile.rows_outer) else outer[:3] if pad_rows else outer)
    sch.vectorize(oci_i)
    sch.unroll(owi)
    if oci_o is not None:
        sch.unroll(oci_o)
    wb = sch.cache_write(blk, 0, "local")
    # the accumulators with the output channels innermost, so a vector of them is contiguous
    sch.transform_layout(blk, ("write", 0), lambda n_, c_, h_, w_: (n_, h_, w_, c_))
    _reverse_inline_chain(sch, wb, func)
    # (with the padding per row, the parallel loop is a row: a tile's accumulators are written back
    # after its column tile, so they stay one tile)
    sch.reverse_compute_at(wb, (oco if tile.rows_outer else owo) if pad_rows else par, preserve_unit_loops=True)
    # write back column by column, a vector of output channels at a time (the blocked output's
    # contiguous dimension), not along the columns of the logical layout
    w_n, w_oc, w_oh, w_ow = sch.get_loops(wb)[-4:]
    w_o, w_i = sch.split(w_oc, factors=[None, lanes])
    sch.reorder(w_n, w_oh, w_ow, w_o, w_i)
    sch.vectorize(w_i)
    init = sch.decompose_reduction(blk, red[0])
    sch.vectorize(sch.get_loops(init)[-1])
    if pad_rows:
        _pad_per_row(sch, pad, par)
    elif pad is not None:
        _schedule_pad(sch, pad, in_block, lanes)
    _schedule_rest(sch, set(names) - {cname, pad}, lanes)
    rows = row_tile(tile.mr, ext[3])
    if tile.pack and not tile.rows_outer and par is not None and ext[3] % rows == 0 and not pad_rows:
        weight = _packed_weight(stmt, lambda s: len(s) == 5 and s[0] * s[4] == ext[1] and s[4] == tile.nb
                                and s[1:4] == [ext[4], ext[5], ext[6]])
        if weight is not None:
            _prefetch_next_panel(sch, par, red[0], weight, ext[1] // tile.nb, ext[2] * (ext[3] // rows))
    return sch


def _rule_winograd(func, lanes: int, wino: Winograd) -> s_tir.Schedule:
    """A Winograd convolution (kernels.winograd) one row of output tiles at a time.

    The output block (the output transform with the epilogue and the blocked layout inlined into
    it) loops over (image, row of tiles) fused and parallel, then output-channel blocks, the tiles
    of the row, and the m x m pixels of a tile (unrolled, so every transform coefficient is a
    constant) x a vector of output channels. Inside each (image, row of tiles) iteration, first the
    input transform of the row's tiles (a vector of the input's channel block at a time, the
    (m+2)^2 outputs unrolled), then the (m+2)^2 GEMMs of the row: `mr` tiles (unrolled) x `nb`
    output channels (vectorized) accumulated over the input channels in a local cache, the
    transformed weight packed for `nb`. V and M of one row stay in L2 while the row is finished
    (cutting long rows into chunks that fit half of L2 measured no faster: 128->64 channels on
    112x112, 3.17 ms whole rows, 3.48 in chunks of 14 tiles, 2 threads).

    Refused when a gather (a reflect pad's index lookup) comes before the input transform: inlined
    into the (m+2)^2 unrolled sums of every transformed pixel it did not build in 120 s on Zen 1."""
    pre = s_tir.Schedule(func)
    if "wino_V" in _root_blocks(pre) and any(n.startswith("gather") for n in _upstream(pre, "wino_V")):
        raise _NotApplicable("a gather before the input transform (inlined into it, the kernel takes minutes to build)")
    sch = s_tir.Schedule(_inline_pass(func))
    names = _root_blocks(sch)
    if "wino_V" not in names or "wino_M" not in names:
        raise _NotApplicable("no Winograd stages")
    rest = [nm for nm in names if nm not in ("wino_V", "wino_M")]
    if len(rest) != 1:
        raise _NotApplicable(f"{len(rest)} blocks after the GEMMs; the output transform and its epilogue must be one")
    out = sch.get_sblock(rest[0])
    loops = list(sch.get_loops(out))
    if len(loops) != 5 or _extent(sch, loops[4]) != lanes:
        raise _NotApplicable("the output is not blocked by the vector lanes")
    n, ob, h, w, oc = loops
    th, hi = sch.split(h, factors=[None, wino.m])
    tw, wi = sch.split(w, factors=[None, wino.m])
    sch.reorder(n, th, ob, tw, hi, wi, oc)
    par = _parallel(sch, [n, th])
    sch.unroll(hi)
    sch.unroll(wi)
    sch.vectorize(oc)
    gemm, vin = sch.get_sblock("wino_M"), sch.get_sblock("wino_V")
    sch.compute_at(gemm, par, preserve_unit_loops=True)
    sch.compute_at(vin, par, preserve_unit_loops=True)
    ea, eb, _, _, t, o, rc = sch.get_loops(gemm)[-7:]
    to, ti = sch.split(t, factors=[None, row_tile(wino.mr, _extent(sch, t))])
    oo, oi = sch.split(o, factors=[None, wino.nb])
    sch.reorder(ea, eb, oo, to, rc, ti, oi)
    sch.vectorize(oi)
    sch.unroll(ti)
    wb = sch.cache_write(gemm, 0, "local")
    sch.reverse_compute_at(wb, to)
    sch.vectorize(sch.get_loops(wb)[-1])
    init = sch.decompose_reduction(gemm, rc)
    sch.vectorize(sch.get_loops(init)[-1])
    ea, eb, _, _, t, c = sch.get_loops(vin)[-6:]
    block = next((b for r in sch.get(vin).reads if (b := _block_of_buffer(r.source)) is not None), lanes)
    co, ci = sch.split(c, factors=[None, block])
    sch.reorder(t, co, ea, eb, ci)
    sch.unroll(ea)
    sch.unroll(eb)
    sch.vectorize(ci)
    return sch


# measured on a 2-core Zen 4, 2 threads, the 7x7 stride-4 convolution of segformer_b0's 3-channel
# 512x512 image (blocked output): 0.72-0.87x the time of the whole-image pad pass in three
# alternated runs; 3x3 convolutions over blocked inputs showed no difference beyond the noise
# between two processes (+-20 %), so they keep the pass
PAD_ROWS_MAX_COPY = 1 / 16


def _pad_copy_share(sch, pad: str, ext: list, tile: Tile) -> float:
    """Elements padded per multiply-add when every output row pads the input rows it reads (its
    rows overlap the next row's when the stride is below the kernel: those are padded twice)."""
    loops = sch.get_loops(sch.get_sblock(pad))
    channels, width = _extent(sch, loops[1]), _extent(sch, loops[3])
    oc, ow, per_group, kw = ext[1], ext[3], ext[4], ext[6]
    if None in (channels, width, oc, ow, per_group, kw):
        return float("inf")
    groups = channels // per_group
    if tile.rows_outer:  # one copy per row for every output channel
        return channels * width / (oc * ow * per_group * kw)
    read = per_group * max(1, tile.nb // max(1, oc // groups))  # the input channels of one output-channel tile
    return read * width / (tile.nb * ow * per_group * kw)


def _pad_per_row(sch, name: str, par) -> None:
    """The padding of a plain-layout input computed under the parallel loop `par` (an output row):
    only the input rows that row reads, each vectorized along its width."""
    blk = sch.get_sblock(name)
    sch.compute_at(blk, par, preserve_unit_loops=True)
    sch.vectorize(sch.get_loops(blk)[-1])


def _schedule_pad(sch, name: str, block: int | None, lanes: int) -> None:
    """The padded input of a convolution, materialised in the input's layout (blocked when the input
    is), parallel over channel blocks and rows, vectorized over the block's channels."""
    blk = sch.get_sblock(name)
    if block is not None:
        sch.transform_layout(blk, ("write", 0), lambda n, c, h, w: (n, c // block, h, w, c % block))
        n, c, h, w = sch.get_loops(blk)
        co, ci = sch.split(c, factors=[None, block])
        sch.reorder(n, co, h, w, ci)
        _parallel(sch, [n, co, h])
        sch.vectorize(ci)
    else:
        _schedule_block(sch, blk, lanes)


def _pick_vec_tile(ev: int, lanes: int) -> int:
    """Column tile of a contraction: a power-of-two multiple/fraction of the vector lanes that
    divides the extent. Measured on conv 56x56: tiles of 56 (odd-width vectors) or 16 with a
    remainder guard were 2.5-10x slower than an exact 8."""
    for c in (2 * lanes, lanes, lanes // 2, lanes // 4):
        if c >= 4 and ev % c == 0:
            return c
    return ev if ev <= lanes else lanes


def _copy_out_per_tile(sch, producer, par) -> tuple[s_tir.Schedule, set[str]]:
    """A contraction over a padded symbolic extent: the elementwise chain that copies the padded
    result out (bias, activation included) runs per tile right after the tile's write-back, its
    rows past the length guarded, while the tile is in L1 (as a pass of its own after the whole
    contraction it read and wrote the output once more). A stage whose tile region is not a static
    box (a reshape that splits the symbolic rows) stays a pass of its own. Returns the schedule and
    the names of the blocks moved into the tile loop."""
    moved: set[str] = set()
    while True:
        consumers = sch.get_consumers(producer)
        if len(consumers) != 1 or _is_reduction(sch.get(consumers[0])):
            return sch, moved
        trial = sch.copy()
        c = consumers[0]
        try:
            trial.reverse_compute_at(c, par, preserve_unit_loops=True)
        except Exception:  # noqa: BLE001 - the stage cannot follow the tile
            return sch, moved
        loops = list(trial.get_loops(c))
        at = next((i for i, lp in enumerate(loops) if trial.get(lp).same_as(trial.get(par))), len(loops))
        inner = loops[at + 1:]
        if not inner or any(_extent(trial, lp) is None for lp in inner):
            return sch, moved
        trial.vectorize(inner[-1])
        sch = trial
        moved.add(sch.get(c).name_hint)
        producer = c


def _reverse_inline_chain(sch, producer, func) -> None:
    """Inline the single-consumer elementwise chain after `producer` into it (bias, relu, ...)."""
    while True:
        consumers = sch.get_consumers(producer)
        if len(consumers) != 1:
            return
        c = consumers[0]
        if _is_reduction(sch.get(c)):
            return
        try:
            sch.reverse_compute_inline(c)
        except Exception:  # noqa: BLE001 - e.g. the producer's buffer is itself a kernel output
            return


def _schedule_rest(sch, todo: set[str], lanes: int) -> None:
    """Per-block schedule for the blocks of `todo` still at the root (a rule may have inlined them)."""
    for name in _root_blocks(sch):
        if name in todo:
            _schedule_block(sch, sch.get_sblock(name), lanes)


def _schedule_block(sch, blk, lanes: int) -> None:
    stmt = sch.get(blk)
    loops = list(sch.get_loops(blk))
    if not loops:
        return
    if _is_reduction(stmt):
        nsp = sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == _DATA_PAR)
        if len(loops) != len(stmt.iter_vars):
            return
        red_work = 1
        for lp in loops[nsp:]:
            red_work *= _span(sch, lp)
        if _vectorize_across_outputs(sch, blk, lanes, nsp, red_work):
            return
        try:
            rf_blk = _rfactor_lanes(sch, blk, lanes)
        except Exception:  # noqa: BLE001 - keep the serial reduction
            rf_blk = None
        if rf_blk is not None:
            sch.vectorize(sch.get_loops(rf_blk)[-1])
            # rfactor left two blocks; parallelise the spatial loops of both
            for b in (rf_blk, blk):
                bl = sch.get_loops(b)
                _parallel(sch, list(bl[:nsp]), min_work=red_work)
            _init_every_lane(sch, rf_blk, sch.get_loops(rf_blk)[-2])
            return
        _parallel(sch, loops[:nsp], min_work=red_work)
        _init_outside(sch, blk)
        return
    if _extent(sch, loops[-1]) is None:
        # a symbolic innermost loop in vectors: whole ones where its extent is padded to them (an
        # attention's keys copied into zero columns; tiled where that copy is a transpose), else
        # whole ones unguarded and the one across the length lane by lane
        # (`_whole_vectors_unguarded`); the loop of vectors stays a plain loop inside the parallel
        # ones (alone, it is the parallel one)
        if _tile_transpose(sch, blk, lanes):
            return
        lo, li = _split(sch, loops[-1], lanes)
        sch.vectorize(li)
        _parallel(sch, loops[:-1] or [lo], min_work=_span(sch, lo) * lanes if len(loops) > 1 else lanes)
        return
    if _tile_transpose(sch, blk, lanes):
        return
    _parallel(sch, _vectorize_inner(sch, blk, lanes), min_work=lanes)


def _tile_transpose(sch, blk, lanes: int) -> bool:
    """An injective block that reads some input across its innermost output loop (a transpose:
    out[.., a, b] = x[.., b, a]) walks that input with a stride, and row by row each cache line of
    it is fetched `lanes` times (a [16384, 128] -> [128, 16384] copy ran at 3 GB/s). Tiled by
    `lanes` on both axes (.., a_outer, b_outer, a_inner, b_inner vectorized) every line is used
    whole while it is in L1 (the shorter axis's tiles innermost). Returns False (and changes
    nothing) when no read is strided that way.

    Over a symbolic length the innermost axis may be symbolic where it is padded to `lanes` (an
    attention's keys copied transposed into zero columns): its tiles then go outermost. Walked key
    by key instead, each a gather of 16 loads 1.5 KB apart, gpt_like's keys copy took 142 us of
    its t8x32r attention at seq=512 (perf samples over the kernel's 1349 us), the static kernel's
    tiled transpose 33 us of 967."""
    stmt = sch.get(blk)
    loops = list(sch.get_loops(blk))
    ivs = list(stmt.iter_vars)
    if len(loops) != len(ivs) or len(loops) < 2:
        return False
    names = [iv.var.name for iv in ivs]
    inner = names[-1]
    a = None
    for r in stmt.reads:
        used = _var_names(r.region[-1].min) if r.region else set()
        if inner in used or not used:
            continue
        cand = [i for i, nm in enumerate(names[:-1]) if nm in used]
        if len(cand) == 1:
            a = cand[0]
            break
    if a is None:
        return False
    ea, eb = _extent(sch, loops[a]), _extent(sch, loops[-1])
    whole_b = divisible(sch.get(loops[-1]).extent, lanes) if eb is None else eb >= lanes and eb % lanes == 0
    if ea is None or ea < lanes or ea % lanes or not whole_b:
        return False
    ao, ai = sch.split(loops[a], factors=[None, lanes])
    bo, bi = _split(sch, loops[-1], lanes)
    # the shorter axis innermost among the tiles: one outer step then covers `lanes` whole short
    # rows of both tensors (measured on [16384, 128] <-> [128, 16384]: 456 and 682 us; the other
    # order 1487 and 1150 us, the untiled copy 5674 and 990); a symbolic one counts as the longer
    b_longer = eb is None or eb >= ea
    outer = [lp for i, lp in enumerate(loops[:-1]) if i != a] + ([bo, ao] if b_longer else [ao, bo])
    sch.reorder(*outer, ai, bi)
    sch.vectorize(bi)
    _parallel(sch, outer, min_work=lanes * lanes)
    return True


def _vectorize_across_outputs(sch, blk, lanes: int, nsp: int, red_work: int) -> bool:
    """A reduction whose inputs are contiguous along one output axis (the channels of a blocked
    layout: pooling and spatial means in nChw16c) is vectorized across outputs: the reduction loops
    move outside that axis, so each step loads one vector of the block's channels. Returns False
    (and changes nothing) when no blocked input is read along an output axis."""
    stmt = sch.get(blk)
    block = None
    axis = None
    spatial = [iv.var.name for iv in stmt.iter_vars if int(iv.iter_type) == _DATA_PAR]
    for r in stmt.reads:
        if len(r.source.shape) != 5:
            continue
        last = r.region[-1].min
        if isinstance(last, tirx.FloorMod):
            used = [v for v in spatial if v in _var_names(last)]
            if len(used) == 1:
                block, axis = int(r.source.shape[-1]), spatial.index(used[0])
                break
    if block is None or block % lanes and lanes % block:
        return False
    loops = list(sch.get_loops(blk))
    ext = _extent(sch, loops[axis])
    if ext is None or ext % block:
        return False
    out = stmt.writes[0].source
    if len(out.shape) == nsp and not _is_param(out, sch.mod["main"]):
        # the accumulators (an intermediate) blocked like the input, so a vector of them is contiguous
        def blocked(*idx):
            return (*idx[:axis], idx[axis] // block, *idx[axis + 1:], idx[axis] % block)
        sch.transform_layout(blk, ("write", 0), blocked)
    co, ci = sch.split(loops[axis], factors=[None, block])
    outer = [lp for i, lp in enumerate(loops[:nsp]) if i != axis] + [co]
    sch.reorder(*outer, *loops[nsp:], ci)
    sch.vectorize(ci)
    _parallel(sch, [lp for lp in outer if (_extent(sch, lp) or 2) > 1][:3] or outer[:1], min_work=red_work * block)
    return True


# -- rule: dlight GEMV ---------------------------------------------------------------------------

def _rule_dlight_gemv(func, target) -> s_tir.Schedule | None:
    from tvm.s_tir import dlight as dl

    sch = dl.cpu.GEMV().apply(func, target, False)
    if sch is None:
        raise _NotApplicable("not a GEMV")
    return sch


# -- rule: row fusion (softmax, layernorm, ...) --------------------------------------------------

def _rule_row(func, lanes: int) -> s_tir.Schedule:
    """All stages under one loop over the leading (non-reduced) axes of the last stage, parallel when
    the stage holds PARALLEL_MIN_WORK elements or more:
    each row's reductions and elementwise stages run back to back while the row is in cache."""
    sch = s_tir.Schedule(func)
    names = _root_blocks(sch)
    if len(names) < 2:
        raise _NotApplicable("single block")
    stmts = {n: sch.get(sch.get_sblock(n)) for n in names}
    last = names[-1]
    if _is_reduction(stmts[last]) or not any(_is_reduction(stmts[n]) for n in names[:-1]):
        raise _NotApplicable("needs reductions followed by an injective last stage")
    if any(_contraction_operands(s) is not None for s in stmts.values()):
        raise _NotApplicable("contains a contraction")
    last_blk = sch.get_sblock(last)
    last_loops = list(sch.get_loops(last_blk))
    ext = [_extent(sch, lp) for lp in last_loops]
    n = len(last_loops)
    for name in names[:-1]:
        s = stmts[name]
        if not _is_reduction(s):
            continue
        # (a symbolic extent, kernorch.dynamic, is a row axis: never the reduced one)
        shape = [int(x) if isinstance(x, tirx.IntImm) else None for x in s.writes[0].source.shape]
        if len(shape) == len(ext):
            first = next((i for i, (a, b) in enumerate(zip(shape, ext)) if a == 1 and (b or 2) > 1), len(ext))
            n = min(n, first)
        else:
            n = min(n, 1)
    if n == 0:
        raise _NotApplicable("the reduction covers the leading axis")
    if int(np.prod([e or _MIN_ROWS for e in ext[:n]])) < _MIN_ROWS:  # (a symbolic extent counts as enough)
        # e.g. a LayerNorm whose output is reshaped to (1, H, W, C): the "rows" are one row
        raise _NotApplicable("too few rows to run in parallel")
    # vectorize the reductions by rfactor *before* compute_at (rfactor needs the block to be the
    # first child of its loop, which it no longer is once the stages share the row loop)
    rf_names = set()
    for name in names[:-1]:
        if _is_reduction(stmts[name]):
            try:
                rf = _rfactor_lanes(sch, sch.get_sblock(name), lanes)
            except Exception as e:  # noqa: BLE001 - stay a serial reduction
                log.debug("rfactor of %s failed: %s", name, str(e).splitlines()[0] if str(e) else e)
                rf = None
            if rf is not None:
                rf_names.add(sch.get(rf).name_hint)
    names = _root_blocks(sch)
    last_loops = list(sch.get_loops(sch.get_sblock(last)))
    before = {name: _work(sch, sch.get_sblock(name)) for name in names}
    row = sch.fuse(*last_loops[:n]) if n > 1 else last_loops[0]
    for name in reversed(names[:-1]):
        sch.compute_at(sch.get_sblock(name), row, preserve_unit_loops=True)
    for name in names:
        if _work(sch, sch.get_sblock(name)) > 1.01 * before[name]:
            raise _NotApplicable(f"compute_at would recompute {name}")
    lane_inits, serial_reductions = [], []
    for name in names:
        blk = sch.get_sblock(name)
        stmt = sch.get(blk)
        if name in rf_names:
            # loops under the row follow the block's iter vars; put the lane loop innermost
            loops = list(sch.get_loops(blk))[1:]
            kinds = [int(iv.iter_type) for iv in stmt.iter_vars]
            if len(loops) == len(kinds):
                lane = max((i for i, k in enumerate(kinds) if k == _DATA_PAR), key=lambda i: (_extent(sch, loops[i]) or 0, i))
                if (_extent(sch, loops[lane]) or 0) > 4 * lanes:  # not the rfactor lane: LLVM chokes on huge vectors
                    raise _NotApplicable("the row does not cover the reduction's spatial axes")
                red = [lp for lp, k in zip(loops, kinds) if k == _COMM_REDUCE]
                sch.reorder(*red, loops[lane])
                sch.vectorize(loops[lane])
                lane_inits.append((blk, red[0]))
            continue
        if _is_reduction(stmt):
            serial_reductions.append(blk)
            continue  # short or non-divisible reductions stay serial inside the row
        _vectorize_inner(sch, blk, lanes, skip_outer=1)
    # the work of a row: its largest stage (a chain that ends in a reduction writes one value a row)
    per_row = max(_work(sch, sch.get_sblock(n)) for n in names) // _span(sch, row)
    _parallel(sch, [row], min_work=per_row)
    for blk, red in lane_inits:
        _init_every_lane(sch, blk, red)
    for blk in serial_reductions:
        _init_outside(sch, blk)
    return sch


def _init_outside(sch, blk) -> None:
    """A reduction over a symbolic extent (kernorch.dynamic) may run no iteration at some length
    (the chunks of a short row); its init, inside the reduction loops, would then never run: it
    moves out of them. Call it last (vectorize and parallel refuse a decomposed block)."""
    red = _reduction_loops(sch, blk)
    if red and any(_extent(sch, lp) is None for lp in red):
        sch.decompose_reduction(blk, red[0])


def _reduction_loops(sch, blk) -> list:
    """The loops a block's reduction iter vars are bound to, outermost first: the innermost ones,
    as many as its reduction vars, unless a split made more (a chunk loop of symbolic extent split
    by the lanes: its static inner loop alone looked like the whole reduction, and the init stayed
    inside the chunks, never run on a row of no whole chunk)."""
    stmt = sch.get(blk)
    loops = list(sch.get_loops(blk))
    realize = sch.get(loops[-1]).body if loops else None
    if isinstance(realize, s_tir.stmt.SBlockRealize) and realize.block.same_as(stmt):
        used = set()
        for iv, value in zip(stmt.iter_vars, realize.iter_values):
            if int(iv.iter_type) == _COMM_REDUCE:
                used |= _var_names(value)
        return [lp for lp in loops if sch.get(lp).loop_var.name in used]
    nred = sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == _COMM_REDUCE)
    return loops[-nred:] if nred and len(loops) >= nred else []


def _split(sch, loop, factor: int) -> list:
    """`loop` split by `factor`, without TVM's guard where `divisible` proves the extent whole (a
    reduction's whole chunks over a symbolic length, which TVM's analyzer cannot prove)."""
    return sch.split(loop, factors=[None, factor], disable_predication=divisible(sch.get(loop).extent, factor))


def _rfactor_lanes(sch, block, lanes: int, min_vectors: int = 4):
    """Split the innermost reduction loop by `lanes` and rfactor the lane loop; returns the rf
    block (lane partials, a spatial lane axis) or None if the loop is shorter than `min_vectors`
    vectors or not divisible."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if len(loops) != len(stmt.iter_vars) or int(stmt.iter_vars[-1].iter_type) != _COMM_REDUCE:
        return None
    ext = _extent(sch, loops[-1])
    if ext is not None and (ext < min_vectors * lanes or ext % lanes):
        return None
    _, li = _split(sch, loops[-1], lanes)
    nsp = sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == _DATA_PAR)
    return sch.rfactor(li, factor_axis=nsp)


def _init_every_lane(sch, rf_blk, red_loop) -> None:
    """A reduction over a symbolic extent (kernorch.dynamic) was split by the lanes under a guard
    (`lo * lanes + li < n`); the rf block's init sits under the same guard and would leave the lanes
    past a short row (n < lanes) uninitialised. Its init moves out of the reduction loop
    `red_loop` (the outermost reduction loop of the rf block), for every lane. Call it last:
    vectorize and parallel refuse a block whose init was decomposed."""
    if all(_extent(sch, lp) is not None for lp in sch.get_loops(rf_blk)):
        return
    init = sch.decompose_reduction(rf_blk, red_loop)
    init_loops = sch.get_loops(init)
    if _extent(sch, init_loops[-1]) is not None:
        sch.vectorize(init_loops[-1])


# -- rule: generic per block ---------------------------------------------------------------------

def _rule_generic(func, lanes: int, careful: bool = False) -> s_tir.Schedule:
    """Each root block separately: parallel outer loops + vectorized inner loop (injective), or
    parallel spatial loops with an (rfactor-vectorized) inner reduction. `careful` wraps every
    block in its own try, so one bad block only stays unscheduled."""
    sch = s_tir.Schedule(func)
    for name in _root_blocks(sch):
        if not careful:
            _schedule_block(sch, sch.get_sblock(name), lanes)
            continue
        saved = sch.copy()
        try:
            _schedule_block(sch, sch.get_sblock(name), lanes)
        except Exception as e:  # noqa: BLE001
            log.debug("block %s left unscheduled: %s", name, e)
            sch = saved
    return sch

