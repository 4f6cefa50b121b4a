"""The TIR pipeline kernorch compiles every kernel with: TVM's default for the CPU (`_lowering`: the
GPU passes and two that changed no code left out), plus small buffers kept on the stack,
repeated subexpressions bound once before lowering (`let_repeated`), the buffers a kernel's root
block keeps in memory hidden from TVM's buffer compaction (`hide_root_buffers`), which cannot
shrink them and spent most of a kernel's build analysing them, and a kernel over a range
asserting its lengths first (`bound_symbols`), so that TVM's passes know them positive and
bounded.

TVM lowers a local buffer of 1024 bytes or more (`kMaxStackAlloca`, strictly less stays on the
stack) to a `TVMBackendAllocWorkspace` call and a free, and LLVM then clears it with a memset and
keeps it in memory. A micro-kernel's accumulator tile is such a buffer: 8 x 32 or 4 x 64 floats are
exactly 1024 bytes, 14 x 32 are 1792. It is allocated inside the parallel loop, so every register
tile of a GEMM or a convolution paid an allocation, a memset, a free, and a store and a reload of
its accumulators (768 times per call for a 128 x 384 x 1536 GEMM in 8 x 32 tiles). On the stack,
LLVM promotes the tile to registers and writes it back once.

The same holds for a buffer in global memory that compaction shrank to a tile: over a symbolic
length a tile writes its padded result to one (1024 bytes for 4 x 64 floats) and copies the rows and
columns inside the length out of it, and the attention's scores at seq=512 (6 heads, Zen 4, 2
threads) took 1.35 ms with it in the workspace, 1.00 on the stack, 0.90 in the static kernel.

`stack_small_buffers` marks every buffer of constant size up to `STACK_BYTES` with TVM's own
`disable_lower_builtin` annotation, which LowerTVMBuiltin honours by leaving the allocation to
the code generator (an `alloca` in the function's entry block, so no growth per iteration; a
parallel loop's body is a function of its own, so each thread has its own). It runs just before
LowerTVMBuiltin, after TVM's lowering has fixed the buffers' final shapes.
"""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

from .lower import bounds_of
from .tirwalk import is_call, is_load, map_expr, operands, rewrite, with_body

# a register tile and its neighbours: the largest micro-kernel tile is the register file
# (32 x 64 bytes with AVX-512); well inside a worker thread's stack
STACK_BYTES = 4096
PIPELINE = "kernorch"  # the name tvm.compile's `tir_pipeline` takes


def _bytes(buf) -> int | None:
    if not all(isinstance(d, tirx.IntImm) for d in buf.shape):
        return None
    dt = tvm.DataType(buf.dtype)
    return int(np.prod([int(d) for d in buf.shape], dtype=np.int64)) * dt.bits // 8 * dt.lanes


def _map_funcs(mod: tvm.IRModule, fn) -> tvm.IRModule:
    """`mod` with each PrimFunc replaced by `fn(func)`."""
    return tvm.IRModule({gv: fn(f) if isinstance(f, tirx.PrimFunc) else f for gv, f in mod.functions.items()},
                        attrs=mod.attrs)


def _rewrite_funcs(mod: tvm.IRModule, visit) -> tvm.IRModule:
    """`mod` with the body of each PrimFunc rewritten by `visit` (tirwalk.rewrite)."""
    def body_of(func):
        body = rewrite(func.body, visit)
        return func if body.same_as(func.body) else func.with_body(body)
    return _map_funcs(mod, body_of)


# a stored value of more nodes than this has its repeated subexpressions bound once (`let_repeated`)
LET_MIN_NODES = 64


def _nodes(e) -> int:
    return 1 + sum(_nodes(x) for x in operands(e))


def _let_bound(value):
    """`value` with each subexpression that occurs more than once and loads a buffer computed once,
    in a Let, largest first (each smaller one bound outside the larger ones that contain it). Only
    occurrences that are always evaluated count: a load inside an `if_then_else`'s branch may be
    out of bounds where its guard is false, and a Let would evaluate it there."""
    if _nodes(value) < LET_MIN_NODES:
        return value
    bound: list = []   # (var, expression), outermost first
    body = value
    while True:
        seen: dict = {}   # structural hash -> [count, node, size]

        def count(e, always: bool = True) -> tuple[int, bool]:   # (nodes, loads a buffer)
            guarded = is_call(e, "if_then_else")  # (only its condition is always evaluated)
            parts = [count(x, always and (not guarded or i == 0)) for i, x in enumerate(operands(e))]
            size = 1 + sum(n for n, _ in parts)
            loads = is_load(e) or any(ld for _, ld in parts)
            if always and loads and parts and str(e.ty) == "float32":
                h = tvm_ffi.structural_hash(e)
                if h in seen and tvm_ffi.structural_equal(seen[h][1], e):
                    seen[h][0] += 1
                else:
                    seen.setdefault(h, [1, e, size])
            return size, loads
        count(body)
        for _, x in bound:
            count(x)
        repeated = [(size, node) for n, node, size in seen.values() if n > 1]
        if not repeated:
            break
        _, node = max(repeated, key=lambda t: t[0])
        var = tirx.Var(f"cse{len(bound)}", "float32")

        def swap(e, node=node, var=var):
            return var if tvm_ffi.structural_equal(e, node) else None
        body = map_expr(body, swap)
        bound = [(var, node)] + [(v, map_expr(x, swap)) for v, x in bound]
    for var, x in reversed(bound):
        body = tirx.Let(var, x, body)
    return body


def _let_store(stmt):
    if isinstance(stmt, tirx.BufferStore):
        value = _let_bound(stmt.value)
        return stmt if value.same_as(stmt.value) else tirx.BufferStore(stmt.buffer, value, stmt.indices)
    if isinstance(stmt, s_tir.stmt.SBlockRealize) and stmt.block.init is not None:
        b = stmt.block
        block = s_tir.stmt.SBlock(b.iter_vars, b.reads, b.writes, b.name_hint, rewrite(b.body, _let_store),
                                  rewrite(b.init, _let_store), b.alloc_buffers, b.match_buffers, b.annotations)
        return s_tir.stmt.SBlockRealize(stmt.iter_values, stmt.predicate, block)
    return None


@tvm.transform.module_pass(opt_level=0, name="kernorch.LetRepeated")
def let_repeated(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each stored value's repeated subexpressions that load buffers bound once in a Let, before
    TVM's lowering. The polynomial exp repeats its clamped input about twenty times; inlined into
    it, a softmax's `scores / c - max` brought four loads each time, and narrowing and flattening
    those eighty loads over a symbolic length took most of an attention kernel's compilation."""
    return _rewrite_funcs(mod, _let_store)


def _on_stack(stmt):
    """A small AllocBuffer (local or global memory) annotated to stay on the stack (None: any other
    statement)."""
    if isinstance(stmt, tirx.AllocBuffer):
        size = _bytes(stmt.buffer)
        if stmt.buffer.scope() in ("local", "global") and size is not None and 0 < size <= STACK_BYTES:
            annotations = dict(stmt.annotations or {})
            annotations["disable_lower_builtin"] = tirx.IntImm("int32", 1)
            return tirx.AllocBuffer(stmt.buffer, annotations)
    return None


@tvm.transform.module_pass(opt_level=0, name="kernorch.StackSmallBuffers")
def stack_small_buffers(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    return _rewrite_funcs(mod, _on_stack)


HIDDEN_ATTR = "kernorch.hidden_buffers"  # how many trailing params are root buffers hidden from compaction


def _root_block(func):
    body = func.body
    return body.block if isinstance(body, s_tir.stmt.SBlockRealize) else None


def _with_root(func, params, allocs, body=None):
    """`func` with these params and its root block allocating `allocs` (and running `body`)."""
    root = func.body
    block = with_body(root.block, root.block.body if body is None else body, allocs)
    return tirx.PrimFunc(params, s_tir.stmt.SBlockRealize(root.iter_values, root.predicate, block), func.ret_type,
                         func.attrs, func.span)


def _hide(func):
    root = _root_block(func)
    hidden = [b for b in root.alloc_buffers if b.scope() == "global"] if root is not None else []
    if not hidden:
        return func
    kept = [b for b in root.alloc_buffers if b.scope() != "global"]
    return _with_root(func, list(func.params) + hidden, kept).with_attr(HIDDEN_ATTR, len(hidden))


def _restore(func):
    if func.attrs is None or HIDDEN_ATTR not in func.attrs:
        return func
    n = int(func.attrs[HIDDEN_ATTR])
    params = list(func.params)
    return _with_root(func, params[:-n], params[-n:] + list(_root_block(func).alloc_buffers)).without_attr(HIDDEN_ATTR)


@tvm.transform.module_pass(opt_level=0, name="kernorch.HideRootBuffers")
def hide_root_buffers(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Each function's root-block buffers in memory (after PlanAndUpdateBufferAllocationLocation
    left them at the root: more than one loop nest uses them) passed as extra params for the one pass
    that follows, CompactBufferAllocation, which leaves params alone (`restore_root_buffers` takes
    them back). Such a buffer spans its whole shape, so compaction cannot shrink it; but TVM relaxed
    every access to it over every enclosing loop, under every enclosing condition, with the
    iteration-map analysis, and over a symbolic length (fused loops divided by products of padded
    lengths) that was most of the pass: an attention + softmax kernel over seq spent 1.0-1.3 s in it
    for 13 such buffers, 0.07 s with them hidden (Zen 3), its code and time otherwise the same."""
    return _map_funcs(mod, _hide)


@tvm.transform.module_pass(opt_level=0, name="kernorch.RestoreRootBuffers")
def restore_root_buffers(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    return _map_funcs(mod, _restore)


def _symbols(func) -> dict:
    """The symbolic lengths of `func`'s parameter shapes (and its scalar parameters), by name."""
    out = {}
    for p in func.params:
        try:
            dims = list(p.shape)
        except AttributeError:  # a scalar parameter (a length the executable passes by value)
            dims = [p]
        out.update((v.name, v) for d in dims for v in tirx.analysis.undefined_vars(d))
    return out


def _bounded(func):
    root = _root_block(func)
    bounds = bounds_of(func)
    syms = {n: v for n, v in _symbols(func).items() if n in bounds}
    if root is None or not syms:
        return func
    cond = None
    for name, var in sorted(syms.items()):
        c = tirx.And(var >= 1, var <= int(bounds[name]))  # (in the variable's own type)
        cond = c if cond is None else tirx.And(cond, c)
    ranges = ", ".join(f"{n}=1..{int(bounds[n])}" for n in sorted(syms))
    check = tirx.AssertStmt(cond, tvm.ir.expr.StringImm("ValueError"),
                            [tvm.ir.expr.StringImm(f"kernorch: a length outside this kernel's range {ranges}")])
    return _with_root(func, list(func.params), list(root.alloc_buffers), tirx.SeqStmt([check, root.body]))


@tvm.transform.module_pass(opt_level=0, name="kernorch.BoundSymbols")
def bound_symbols(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """A kernel over a range (lower.BOUNDS_ATTR) starts by asserting that each symbolic length lies in
    1..its bound. TVM's passes that simplify with an analyzer take an assertion as a fact for the
    statements after it, so they know a length is positive and bounded: LowerIntrin turns
    `i // seq` into one division instead of a division corrected for signs it could not decide, and
    the simplifications it enables left less code. An attention's scores over seq (t6x16r, Zen 3)
    compiled in 0.73-0.85 s instead of 1.4-1.6 s (code generation 0.26 instead of 0.88 s). A length
    outside the range (never passed by the executable, which checks its inputs) fails with the
    assertion's message instead of running out of bounds."""
    return _map_funcs(mod, _bounded)


# a loop annotation (kernorch.backends.tvm.schedule._in_launch): consecutive parallel loops with the
# same value run in one parallel launch (`one_launch`)
LAUNCH = "kernorch.launch"


def _launched(seq: list) -> list:
    """The statements of a sequence with each run of parallel loops marked LAUNCH alike (and the
    buffer declarations among them, moved before it) in one parallel launch: TVM's
    `pragma_parallel_launch_point` runs its body on every task, each parallel loop in it split
    among them as a parallel loop of its own is, and `pragma_parallel_barrier_when_finish` waits
    for every task at the end of each loop but the last."""
    out, i = [], 0
    while i < len(seq):
        group = seq[i].annotations.get(LAUNCH) if isinstance(seq[i], tirx.For) else None
        if group is None:
            out.append(seq[i])
            i += 1
            continue
        loops, decls, j = [], [], i
        while j < len(seq):
            st = seq[j]
            if isinstance(st, (tirx.AllocBuffer, tirx.DeclBuffer)):
                decls.append(st)
            elif isinstance(st, tirx.For) and st.kind == tirx.ForKind.PARALLEL and st.annotations.get(LAUNCH) == group:
                loops.append(st)
            else:
                break
            j += 1
        # (a declaration after the run's last loop stays where it was)
        while j > i and not isinstance(seq[j - 1], tirx.For):
            decls.pop()
            j -= 1
        if len(loops) > 1:
            node = tvm.ir.expr.StringImm(LAUNCH)  # (the code generator reads only the key)
            body = [tirx.AttrStmt(node, "pragma_parallel_barrier_when_finish", 1, loop) for loop in loops[:-1]]
            out += [*decls, tirx.AttrStmt(node, "pragma_parallel_launch_point", 1, tirx.SeqStmt([*body, loops[-1]]))]
        else:
            out += seq[i:j]
        i = j
    return out


@tvm.transform.module_pass(opt_level=0, name="kernorch.OneLaunch")
def one_launch(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Loops marked LAUNCH alike in one parallel launch (`_launched`), after LowerOpaqueBlock: the
    buffers they share were placed at the root, before the first of them."""
    def visit(stmt):
        if isinstance(stmt, tirx.SeqStmt) and any(isinstance(s, tirx.For) and LAUNCH in s.annotations
                                                  for s in stmt.seq):
            seq = _launched([rewrite(s, visit) for s in stmt.seq])
            return seq[0] if len(seq) == 1 else tirx.SeqStmt(seq)
        return None
    return _rewrite_funcs(mod, visit)


def _compaction() -> list:
    """The lowering's passes up to the buffers' compaction (where each buffer is allocated, and how
    large).

    The compaction is not strict: TVM's strict compaction (its default) also proves each compacted
    shape no larger than the buffer's own, and over a symbolic length that proof is expensive. Our
    kernels' accesses never reach past their buffers (the lowered modules were identical both ways
    for 120 range kernels of the transformer block, 150 of it at seq=128 and 132 of candy's, Xeon
    model 167); the 120 range kernels lowered in 22.1 s against 23.5 (-6 %), the static ones alike."""
    st = s_tir.transform
    return [bound_symbols, let_repeated, st.CanonicalizeLoop(), st.LowerInitBlock(),
            st.PlanAndUpdateBufferAllocationLocation(), st.ConvertBlocksToOpaque(),
            hide_root_buffers, st.CompactBufferAllocation(is_strict=False), restore_root_buffers]


def compacted(mod: tvm.IRModule) -> tvm.IRModule:
    """A scheduled kernel module as the lowering leaves it after compacting its buffers (for tests
    and inspection: each allocation where it will be made, at the size it will have)."""
    return tvm.ir.transform.Sequential(_compaction())(mod)


def _lowering():
    """TVM 0.27's default lowering (tvm.s_tir.pipeline.default_s_tir_pipeline: its passes in its
    order, read from the same configuration) with `bound_symbols` and `let_repeated` first and the
    root buffers hidden from CompactBufferAllocation (`hide_root_buffers`), which is not strict
    (`_compaction`), for the CPU only.

    Left out: the passes that only act on GPU code (thread bindings, virtual threads, shared and
    warp memory, tensor core fragments, software pipelines, Hexagon's VTCM), HoistIfThenElse and
    the last RemoveNoOp (LLVM moves invariant tests out of loops and drops empty statements by
    itself). The code is the same without them: the disassembly of whole executables (the
    transformer block over seq=1..512 and at 512, segformer_b0) matched but for three kernels of
    each model, where without HoistIfThenElse the registers and order of some index computations
    differ (58 more instructions of 23,600 in the block's, no slower end to end; 6 fewer of 168,400
    in segformer's). Over a symbolic length the last two spent 40 % of the lowering (0.14 and 0.12
    s of 0.62 s for a LayerNorm fused before a 384 x 1536 GEMM in three row copies, Zen 3), proving
    conditions on index expressions of the length. With `build.check_bounds`' first look, ten
    kernels of the transformer block over seq built in 6.3 s instead of 7.9 (medians of 5
    alternated runs; the same kernels at seq=128 in 1.9-2.3 s, before and after)."""

    @tvm.transform.module_pass(opt_level=0, name="kernorch.Lowering")
    def lowering(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        config = tvm.transform.PassContext.current().config
        st, tx = s_tir.transform, tirx.transform
        passes = [*_compaction(),
                  st.LowerMatchBuffer(), st.StmtSimplify(), st.AnnotateIrregularLoop(), st.LowerOpaqueBlock(),
                  one_launch, tx.FlattenBuffer(), tx.BF16ComputeLegalize(), tx.NarrowDataType(32), st.LoopPartition(),
                  tx.VectorizeLoop(not bool(config.get("tirx.disable_vectorize", False)))]
        if not bool(config.get("tirx.disable_storage_rewrite", False)):
            passes.append(tx.StorageRewrite())
        passes += [tx.UnrollLoop(), st.RenormalizeSplitPattern(), tx.StmtSimplify(), st.RewriteUnsafeSelect()]
        if bool(config.get("tirx.instrument_bound_checkers", False)):
            passes.append(st.InstrumentBoundCheckers())
        if not bool(config.get("tirx.disable_cse_tir", False)):
            passes.append(tx.CommonSubexprElim())
        if bool(config.get("tirx.instrument_lwp", False)):
            passes.append(st.InstrumentProfileIntrinsics())
        passes += [tx.FP8ComputeLegalize(), tx.VerifyMemory(), tx.AnnotateEntryFunc(), tx.SplitHostDevice(),
                   tx.MakePackedAPI(), tx.FP8StorageLegalize(), tx.BF16StorageLegalize()]
        return tvm.ir.transform.Sequential(passes)(mod)
    return lowering


def _pipeline():
    """TVM's default pipeline (lowering, host finalization, device finalization) with `_lowering`
    in place of its lowering and `stack_small_buffers` before the host finalization (LowerTVMBuiltin,
    LowerIntrin)."""
    _, host, device = tirx.compilation_pipeline.get_tir_pipeline("default")

    def finalize_host():
        return tvm.ir.transform.Sequential([stack_small_buffers, host()])
    return _lowering(), finalize_host, device


tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)
