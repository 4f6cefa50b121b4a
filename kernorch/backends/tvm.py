"""The TVM backend: the only module of kernorch that imports TVM (0.27).

Pipeline for one candidate kernel (a convex set of prims of a `Graph`):

    mod = lower(graph, members, inputs, outputs)    # one PrimFunc "main"(inputs..., outputs...)
    mod = schedule(mod, make_target(2))              # default CPU schedule, no tuning
    k = build(mod, make_target(2))                   # BuiltKernel: k(*arrays), k.time(...), k.export(p)

Using a scheduled PrimFunc from a Relax program (the emitter's job)::

    bb = relax.BlockBuilder()
    with bb.function("main", params):
        gv = bb.add_func(relax_func(mod, "k0"), "k0")  # returns a GlobalVar; renames global_symbol
        with bb.dataflow():
            y = bb.emit(relax.call_tir(gv, relax.Tuple([x, w]), out_ty=relax.TensorType(shape, "float32")))
            ...
    # a library kernel: register_packed(lib_kernel.run_dps, "kernorch.lib.k1") then
    #   relax.call_dps_packed("kernorch.lib.k1", relax.Tuple([...]), out_ty=...)

`schedule()` marks its result with the attribute "tirx.is_scheduled", so dlight passes run later
on the Relax module leave it alone. A kernel with several outputs needs `out_ty=[t1, t2]` in
call_tir (it returns a tuple).

Threads: TVM's pool defaults to ONE thread on this 2-core box, and the count is fixed at the first
parallel call. Call `set_threads(n)` before building or running anything.
"""
from __future__ import annotations

import json
import logging
import os
import types
from typing import Callable, Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import te, tirx
from tvm import s_tir

from .. import primitives
from ..ir import Graph, KernorchError, Prim

log = logging.getLogger(__name__)

#: The TVM namespace handed to the primitive table's TE computes (they never import tvm).
T = types.SimpleNamespace(te=te, tir=tirx)

_NUM_INPUTS_ATTR = "kernorch.num_inputs"
_DATA_PAR, _COMM_REDUCE = 0, 2  # tirx.IterVar kinds
_MIN_ROWS = 4  # the row rule needs this many rows to share among threads

# ------------------------------------------------------------------------------------------------
# target, threads, versions
# ------------------------------------------------------------------------------------------------


def make_target(threads: int) -> tvm.target.Target:
    """An llvm target for this host CPU (mcpu detected, so AVX-512 is used where present).

    "num-cores" is required by MetaSchedule and documents the thread count the kernels are built for;
    it does NOT set the runtime thread count (see `set_threads`).
    """
    host = dict(tvm.target.Target.from_device(tvm.cpu()).export())
    config = {"kind": "llvm", "num-cores": int(threads)}
    for key in ("mtriple", "mcpu", "mattr"):
        if host.get(key):
            config[key] = host[key]
    return tvm.target.Target(config)


def set_threads(n: int) -> None:
    """Use `n` threads in TVM kernels and in BLAS (numpy/OpenBLAS library kernels).

    Caveats (tvm-0.27-guide.md §2): TVM reads TVM_NUM_THREADS when its thread pool starts, i.e. at
    the first parallel call; later changes of the variable are ignored. If the pool already runs
    with another count we reconfigure it with `runtime.config_threadpool(-3, n, cpus)`, which the
    guide found to change `num_threads()` (its speed effect was not confirmed). On a loaded 2-core
    machine 2 threads can be slower and noisier than 1. MetaSchedule workers inherit the variable.
    """
    n = int(n)
    os.environ["TVM_NUM_THREADS"] = str(n)
    try:
        import threadpoolctl

        threadpoolctl.threadpool_limits(limits=n, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl is a declared dependency
        log.warning("threadpoolctl missing: BLAS thread count left unchanged")
    current = tvm.runtime.num_threads()  # starts the pool if needed (with the variable set above)
    if current != n:
        log.warning("TVM thread pool already started with %d threads; reconfiguring to %d", current, n)
        tvm.get_global_func("runtime.config_threadpool")(-3, n, [str(i) for i in range(n)])


def versions() -> dict:
    """Versions that change generated code: part of the profile database key."""
    return {"tvm": tvm.__version__, "tvm-ffi": tvm_ffi.__version__}


# ------------------------------------------------------------------------------------------------
# lowering
# ------------------------------------------------------------------------------------------------


def lower(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]) -> tvm.IRModule:
    """Compose the members' TE computes into one PrimFunc `main(*inputs, *outputs)`.

    `members` must be in topological order; every input of a member is another member or a name in
    `inputs` (graph inputs, constants/weights and other kernels' results are all plain params here).
    """
    env: dict[str, te.Tensor] = {}
    params: list[te.Tensor] = []
    for i, name in enumerate(inputs):
        t = graph.type_of(name)
        if not t.static:
            raise KernorchError(f"kernel input {name!r} has a symbolic shape {t}; bind the shape first")
        ph = te.placeholder(tuple(t.shape), t.dtype, name=f"in{i}_{_ident(name)}")
        env[name] = ph
        params.append(ph)
    member_names = {p.name for p in members}
    for p in members:
        d = primitives.get(p.op)
        if d.te is None:
            raise KernorchError(f"prim {p.name} ({p.op}, from {p.origin or '?'}) has no TE compute; "
                                "it must run as an opaque kernel, not inside a TIR kernel")
        missing = [t for t in p.inputs if t not in env]
        if missing:
            kind = "a later member" if any(m in member_names for m in missing) else "neither a member nor an input"
            raise KernorchError(f"prim {p.name} ({p.op}) reads {missing} which is {kind} of the kernel")
        out = d.te(T, [env[t] for t in p.inputs], p.a, p.type)
        if tuple(int(s) for s in out.shape) != tuple(p.type.shape) or out.dtype != p.type.dtype:
            raise KernorchError(f"TE compute of {p.op} ({p.name}) gave {out.dtype}{list(out.shape)}, "
                                f"expected {p.type}")
        env[p.name] = out
    for o in outputs:
        if o not in member_names:
            raise KernorchError(f"kernel output {o!r} is not computed by a member")
    func = te.create_prim_func(params + [env[o] for o in outputs])
    func = func.with_attr(_NUM_INPUTS_ATTR, len(inputs))
    return tvm.IRModule({"main": func})


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)[:40]


# ------------------------------------------------------------------------------------------------
# default schedule
# ------------------------------------------------------------------------------------------------

_LANES_BITS = 512  # fallback; replaced by the target's vector width


class _NotApplicable(Exception):
    """A schedule rule does not fit this PrimFunc (not an error)."""


def schedule(mod: tvm.IRModule, target: tvm.target.Target, mode: str = "default") -> tvm.IRModule:
    """Schedule `mod["main"]` for the CPU without tuning.

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
    if mode != "default":
        raise KernorchError(f"unknown schedule mode {mode!r} (expected 'none' or 'default')")
    func = mod["main"]
    lanes = max(_vector_bits(target) // 32, 4)
    try:
        base = _inline_pass(func)
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
        out = sch.mod["main"].with_attr("tirx.is_scheduled", True).with_attr("kernorch.rule", name)
        return tvm.IRModule({"main": out})
    log.warning("no schedule rule applied; the kernel stays untuned")
    return mod


def _vector_bits(target: tvm.target.Target) -> int:
    try:
        from tvm.target.codegen import llvm_get_vector_width

        bits = int(llvm_get_vector_width(target))
        return bits if bits > 0 else _LANES_BITS
    except Exception:  # noqa: BLE001
        return _LANES_BITS


# -- analysis helpers ----------------------------------------------------------------------------

def _root_blocks(sch: s_tir.Schedule) -> list[str]:
    root = sch.get_sblock("root")
    return [sch.get(b).name_hint for b in sch.get_child_blocks(root)]


def _is_reduction(stmt) -> bool:
    return any(int(iv.iter_type) == _COMM_REDUCE for iv in stmt.iter_vars)


def _var_names(expr) -> set[str]:
    return {v.name for v in tirx.analysis.undefined_vars(expr)}


def _output_buffers(func) -> set[str]:
    return {b.name for b in func.params}  # 0.27: PrimFunc params are the buffers


def _writes_output(stmt, func) -> bool:
    outs = _output_buffers(func)
    return any(w.source.name in outs for w in stmt.writes)  # 0.27: regions have .source


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


def _subexprs(e):
    """The direct sub-expressions of a TIR expression (a load's indices, an op's operands)."""
    if isinstance(e, tvm.ir.expr.TensorLoad):
        yield from e.indices
        return
    for attr in ("a", "b", "value", "condition", "true_value", "false_value", "base", "stride"):
        sub = getattr(e, attr, None)
        if sub is not None and not isinstance(sub, (int, float, str)):
            yield sub
    yield from getattr(e, "args", None) or ()


def _loaded_buffers(expr) -> set[str]:
    """Names of the buffers an expression loads from."""
    found: set[str] = set()

    def walk(e):
        if isinstance(e, tvm.ir.expr.TensorLoad):
            found.add(e.source.name)
        for sub in _subexprs(e):
            walk(sub)

    walk(expr)
    return found


def _is_expensive(stmt) -> bool:
    """Does the block call a math function (exp, tanh, ...)? Such stages are not recomputed."""
    text = str(stmt.body)
    return any(f"T.{f}(" in text for f in ("exp", "log", "log1p", "tanh", "erf", "sigmoid", "sqrt", "pow", "sin", "cos"))


def _extent(sch, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def _work(sch, block) -> int:
    n = 1
    for lp in sch.get_loops(block):
        n *= _extent(sch, lp) or 1
    return n


# -- inline pass ---------------------------------------------------------------------------------

def _inline_pass(func) -> tirx.PrimFunc:
    """compute_inline injective intermediate stages, except into contractions (a pad stays a
    separate stage rather than a Select in the conv inner loop) and except expensive stages with
    several consumers (softmax's exp stays materialised instead of being computed twice)."""
    sch = s_tir.Schedule(func)
    changed = True
    while changed:
        changed = False
        for name in _root_blocks(sch):
            blk = sch.get_sblock(name)
            stmt = sch.get(blk)
            if _is_reduction(stmt) or _writes_output(stmt, func):
                continue
            consumers = sch.get_consumers(blk)
            if not consumers:
                continue
            if any(_contraction_operands(sch.get(c)) is not None for c in consumers):
                continue
            if len(consumers) > 1 and _is_expensive(stmt):
                continue
            try:
                sch.compute_inline(blk)
                changed = True
            except Exception:  # noqa: BLE001 - illegal inline: keep the stage
                continue
    return sch.mod["main"]


# -- building blocks -----------------------------------------------------------------------------

def _parallel(sch, loops, min_work: int = 0) -> object | None:
    """Fuse `loops` (adjacent, outermost first) and parallelise them; returns the fused loop."""
    if not loops:
        return None
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    ext = _extent(sch, fused)
    if ext is None or ext > 1:
        if min_work <= 0 or (ext or 0) * min_work >= 2048:
            sch.parallel(fused)
    return fused


def _vectorize_inner(sch, block, lanes: int, skip_outer: int = 0):
    """Vectorize the innermost loop of `block` (split by `lanes` if long); returns the loops outside it."""
    loops = list(sch.get_loops(block))[skip_outer:]
    if not loops:
        return []
    inner = loops[-1]
    ext = _extent(sch, inner)
    if ext is None or ext < 2:
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

def _rule_contraction(func, lanes: int) -> s_tir.Schedule:
    """Register-tile the (single) matmul/conv block: outer spatial tiles in parallel, all reduction
    loops, then an unrolled row tile x a vectorized column tile accumulated in a local cache;
    the elementwise epilogue is inlined into the cache write-back."""
    sch = s_tir.Schedule(func)
    names = _root_blocks(sch)
    contractions = [n for n in names if _contraction_operands(sch.get(sch.get_sblock(n))) is not None]
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
    ext = [_extent(sch, lp) for lp in loops]
    if any(e is None for e in ext):
        raise _NotApplicable("symbolic extents")
    v = nsp - 1
    if ext[v] < 4:
        raise _NotApplicable("innermost spatial extent too small to vectorize")
    vname = ivs[v].var.name
    vec_operand = a if vname in _var_names(a) else b
    vec_vars = _var_names(vec_operand)
    cand = [i for i in range(v) if ext[i] > 1]
    row = next((i for i in reversed(cand) if ivs[i].var.name not in vec_vars), cand[-1] if cand else None)
    vt = _pick_vec_tile(ext[v], lanes)
    vregs = -(-vt // lanes)
    rmax = max(1, 24 // vregs)
    r = 1
    if row is not None:
        r = next((d for d in (16, 12, 8, 6, 4, 3, 2, 1) if d <= rmax and ext[row] % d == 0), 1)
    ro = ri = None
    if row is not None:
        ro, ri = sch.split(loops[row], factors=[None, r])
    if vt < ext[v]:
        vo, vi = sch.split(loops[v], factors=[None, vt])
    else:
        vo, vi = None, loops[v]
    outer = [loops[i] for i in range(nsp) if i not in (row, v)]
    outer += [x for x in (ro, vo) if x is not None]
    if not outer:
        raise _NotApplicable("nothing to parallelise")
    red = loops[nsp:]
    inner = [x for x in (ri, vi) if x is not None]
    sch.reorder(*outer, *red, *inner)
    par = _parallel(sch, outer)
    # vectorize before decompose_reduction: afterwards the update block is no longer a "local
    # reduction block" under vi and vectorize() refuses it
    sch.vectorize(vi)
    if ri is not None and r > 1:
        sch.unroll(ri)
    # accumulate in a local tile, written back (with the epilogue) once per tile
    wb = sch.cache_write(blk, 0, "local")
    _reverse_inline_chain(sch, wb, func)
    sch.reverse_compute_at(wb, par, preserve_unit_loops=True)
    wb_loops = sch.get_loops(wb)
    if len(wb_loops) > 1:
        sch.vectorize(wb_loops[-1])
    init = sch.decompose_reduction(blk, red[0])
    init_loops = sch.get_loops(init)
    sch.vectorize(init_loops[-1])
    # everything else (producers like pad, epilogues that could not be inlined)
    done = {cname, sch.get(wb).name_hint, sch.get(init).name_hint}
    _schedule_rest(sch, done, lanes)
    return sch


def _pick_vec_tile(ev: int, lanes: int) -> int:
    """Column tile of a contraction: a power-of-two multiple/fraction of the vector lanes that
    divides the extent. Measured on conv 56x56: tiles of 56 (odd-width vectors) or 16 with a
    remainder guard were 2.5-10x slower than an exact 8."""
    for c in (2 * lanes, lanes, lanes // 2, lanes // 4):
        if c >= 4 and ev % c == 0:
            return c
    return ev if ev <= lanes else lanes


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


def _schedule_rest(sch, done: set[str], lanes: int) -> None:
    """Per-block schedule for the blocks still at the root and not handled by a rule."""
    for name in _root_blocks(sch):
        if name not in done:
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
            red_work *= _extent(sch, lp) or 1
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
            return
        _parallel(sch, loops[:nsp], min_work=red_work)
        return
    outer = _vectorize_inner(sch, blk, lanes)
    _parallel(sch, outer, min_work=lanes)


# -- rule: dlight GEMV ---------------------------------------------------------------------------

def _rule_dlight_gemv(func, target) -> s_tir.Schedule | None:
    from tvm.s_tir import dlight as dl

    sch = dl.cpu.GEMV().apply(func, target, False)
    if sch is None:
        raise _NotApplicable("not a GEMV")
    return sch


# -- rule: row fusion (softmax, layernorm, ...) --------------------------------------------------

def _rule_row(func, lanes: int) -> s_tir.Schedule:
    """All stages under one parallel loop over the leading (non-reduced) axes of the last stage:
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
        shape = [int(x) for x in s.writes[0].source.shape]
        if len(shape) == len(ext):
            first = next((i for i, (a, b) in enumerate(zip(shape, ext)) if a == 1 and (b or 2) > 1), len(ext))
            n = min(n, first)
        else:
            n = min(n, 1)
    if n == 0:
        raise _NotApplicable("the reduction covers the leading axis")
    if int(np.prod([e or 1 for e in ext[:n]])) < _MIN_ROWS:
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
            continue
        if _is_reduction(stmt):
            continue  # short or non-divisible reductions stay serial inside the row
        _vectorize_inner(sch, blk, lanes, skip_outer=1)
    sch.parallel(row)
    return sch


def _rfactor_lanes(sch, block, lanes: int):
    """Split the innermost reduction loop by `lanes` and rfactor the lane loop; returns the rf
    block (lane partials, a spatial lane axis) or None if the loop is short or not divisible."""
    stmt = sch.get(block)
    loops = sch.get_loops(block)
    if len(loops) != len(stmt.iter_vars) or int(stmt.iter_vars[-1].iter_type) != _COMM_REDUCE:
        return None
    ext = _extent(sch, loops[-1])
    if ext is None or ext < 4 * lanes or ext % lanes:
        return None
    _, li = sch.split(loops[-1], factors=[None, lanes])
    nsp = sum(1 for iv in stmt.iter_vars if int(iv.iter_type) == _DATA_PAR)
    return sch.rfactor(li, factor_axis=nsp)


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


# ------------------------------------------------------------------------------------------------
# build, run, time, export
# ------------------------------------------------------------------------------------------------


class BuiltKernel:
    """A compiled PrimFunc `main(*inputs, *outputs)` callable on numpy arrays."""

    def __init__(self, rt_mod, params: list[tuple[tuple[int, ...], str]], num_inputs: int, executable=None):
        self.rt_mod = rt_mod
        self.params = params
        self.num_inputs = num_inputs
        self._executable = executable
        self._fn = rt_mod["main"]
        self.dev = tvm.cpu()

    @property
    def input_types(self):
        return self.params[: self.num_inputs]

    @property
    def output_types(self):
        return self.params[self.num_inputs:]

    def _args(self, inputs: Sequence[np.ndarray]):
        if len(inputs) != self.num_inputs:
            raise KernorchError(f"kernel takes {self.num_inputs} inputs, got {len(inputs)}")
        args = []
        for x, (shape, dtype) in zip(inputs, self.input_types):
            x = np.asarray(x, dtype=dtype, order="C")  # (ascontiguousarray makes 0-d arrays 1-d)
            if x.shape != shape:
                raise KernorchError(f"input of shape {x.shape}, kernel expects {shape}")
            args.append(tvm.runtime.tensor(x, self.dev))
        outs = [tvm.runtime.empty(shape, dtype, self.dev) for shape, dtype in self.output_types]
        return args, outs

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        args, outs = self._args(inputs)
        self._fn(*args, *outs)
        return [o.numpy() for o in outs]

    def time(self, *inputs: np.ndarray, number: int = 10, repeat: int = 5, warmup: int = 1,
             min_repeat_ms: int = 0) -> list[float]:
        """Seconds per call, one value per repeat (each the mean of `number` calls), on
        preallocated tensors. Take the median yourself; never assert on it in tests."""
        args, outs = self._args(inputs)
        for _ in range(max(warmup, 0)):
            self._fn(*args, *outs)
        fe = self.rt_mod.time_evaluator("main", self.dev, number=number, repeat=repeat, min_repeat_ms=min_repeat_ms)
        return [float(x) for x in fe(*args, *outs).results]

    def export(self, path: str) -> None:
        """Write a shared library (g++ needed) and `path + '.json'` with the signature."""
        if self._executable is None:
            raise KernorchError("this kernel was loaded from a file; export the original")
        self._executable.export_library(path)
        with open(path + ".json", "w") as f:
            json.dump({"num_inputs": self.num_inputs, "params": [[list(s), d] for s, d in self.params],
                       "versions": versions()}, f)


def load(path: str) -> BuiltKernel:
    """Load a kernel written by `BuiltKernel.export`."""
    with open(path + ".json") as f:
        meta = json.load(f)
    if meta.get("versions") != versions():
        log.warning("kernel %s was built with %s, running %s", path, meta.get("versions"), versions())
    params = [(tuple(s), d) for s, d in meta["params"]]
    return BuiltKernel(tvm.runtime.load_module(path), params, int(meta["num_inputs"]))


def build(mod: tvm.IRModule, target: tvm.target.Target) -> BuiltKernel:
    """tvm.compile the PrimFunc module (about 0.05-0.5 s per kernel)."""
    func = mod["main"]
    params = []
    for buf in func.params:  # 0.27: params are Buffers (no buffer_map)
        params.append((tuple(int(s) for s in buf.shape), str(buf.dtype)))
    n_in = func.attrs[_NUM_INPUTS_ATTR] if func.attrs is not None and _NUM_INPUTS_ATTR in func.attrs else len(params) - 1
    check_bounds(mod)
    ex = tvm.compile(mod, target=target)
    return BuiltKernel(ex.jit(), params, int(n_in), ex)


def check_bounds(mod: tvm.IRModule) -> None:
    """Refuse a kernel with a load under a `Select` that may fall outside its buffer.

    `Select` evaluates both sides, and the simplifier uses its condition to drop index clamps, so
    such a load reads far outside the buffer (the concat segfaults of the first session). Guarded
    loads belong under `if_then_else`, which is lazy. TVM's OOBChecker is not used: it flags
    guarded loads as well (pool, pad, conv padding).
    """
    from tvm.sym.analyzer import Analyzer

    low = tvm.ir.transform.Sequential([s_tir.transform.LowerInitBlock(), s_tir.transform.ConvertBlocksToOpaque(),
                                       s_tir.transform.LowerOpaqueBlock()])(mod)
    ana = Analyzer()
    bad: list[str] = []

    def opaque(e) -> bool:
        """An index built from selects, loads or calls (reflect padding, gathered positions): its
        range is by construction, which interval analysis cannot follow; such loads are not judged."""
        if isinstance(e, (tirx.Select, tvm.ir.expr.TensorLoad)) or getattr(e, "args", None):
            return True
        return any(opaque(sub) for sub in _subexprs(e))

    def load_ok(e) -> bool:
        for idx, n in zip(e.indices, e.source.shape):
            if opaque(idx):
                continue
            b = ana.const_int_bound(idx)
            if b.min_value < 0 or b.max_value >= int(n):
                return False
        return True

    def expr(e, in_select: bool) -> None:
        if isinstance(e, tvm.ir.expr.TensorLoad) and in_select and not load_ok(e):
            bad.append(f"{e.source.name}[{', '.join(str(i) for i in e.indices)}]")
        if isinstance(e, tirx.Select):
            expr(e.condition, in_select)
            expr(e.true_value, True)
            expr(e.false_value, True)
            return
        for sub in _subexprs(e):
            expr(sub, in_select)

    def stmt(st) -> None:
        if isinstance(st, tirx.For):
            ana.bind(st.loop_var, tvm.ir.Range.from_min_extent(st.min, st.extent))
            stmt(st.body)
        elif isinstance(st, tirx.SeqStmt):
            for x in st.seq:
                stmt(x)
        elif isinstance(st, tirx.BufferStore):
            expr(st.value, False)
        elif isinstance(st, tirx.IfThenElse):  # e.g. the tail guard of a non-dividing split
            with ana.constraint_scope(st.condition):
                stmt(st.then_case)
            if st.else_case is not None:
                with ana.constraint_scope(tirx.Not(st.condition)):
                    stmt(st.else_case)
        elif isinstance(st, (tirx.LetStmt, tirx.Bind)):
            ana.bind(st.var, st.value)
            expr(st.value, False)
            if hasattr(st, "body"):
                stmt(st.body)
        elif isinstance(st, tirx.Evaluate):
            expr(st.value, False)
        elif hasattr(st, "body"):
            stmt(st.body)

    for _, func in low.functions.items():
        if isinstance(func, tirx.PrimFunc):
            stmt(func.body)
    if bad:
        raise KernorchError(f"kernel may read out of bounds under a Select: {', '.join(bad[:3])}")


def relax_func(mod: tvm.IRModule, name: str) -> tirx.PrimFunc:
    """The kernel's PrimFunc renamed for `bb.add_func(relax_func(mod, name), name)`.

    Every kernel is called "main" with global_symbol "main"; two of them (or one beside Relax's
    own main) in one Relax module fail with "IRModule contains duplicate global symbol: main".
    """
    return mod["main"].with_attr("global_symbol", name)


# ------------------------------------------------------------------------------------------------
# packed functions (library kernels callable from Relax)
# ------------------------------------------------------------------------------------------------


def register_packed(fn_dps: Callable[..., None], name: str) -> None:
    """Register `fn_dps(*inputs, *outputs)` (numpy arrays, outputs written in place) as the global
    packed function `name`, for `relax.call_dps_packed(name, args, out_ty=...)`.

    The arguments arrive as tvm tensors and are viewed zero-copy with np.from_dlpack. That is safe
    from Relax call_dps_packed; do NOT call it through TIR `call_packed` (borrowed DLTensor views
    segfault in from_dlpack, guide §5). A process that loads an exported Relax library must register
    the same names again before running it.
    """

    def _call(*args):
        fn_dps(*[np.from_dlpack(a) for a in args])

    tvm_ffi.register_global_func(name, _call, override=True)
