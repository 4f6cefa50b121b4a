"""The TIR pipeline kernorch compiles every kernel with: TVM's default, plus small local buffers
kept on the stack and repeated subexpressions bound once before lowering (`let_repeated`).

TVM lowers a local buffer of 1024 bytes or more (`kMaxStackAlloca`, strictly less stays on the
stack) to a `TVMBackendAllocWorkspace` call and a free, and LLVM then clears it with a memset and
keeps it in memory. A micro-kernel's accumulator tile is such a buffer: 8 x 32 or 4 x 64 floats are
exactly 1024 bytes, 14 x 32 are 1792. It is allocated inside the parallel loop, so every register
tile of a GEMM or a convolution paid an allocation, a memset, a free, and a store and a reload of
its accumulators (768 times per call for a 128 x 384 x 1536 GEMM in 8 x 32 tiles). On the stack,
LLVM promotes the tile to registers and writes it back once.

`stack_small_buffers` marks every local buffer of constant size up to `STACK_BYTES` with TVM's own
`disable_lower_builtin` annotation, which LowerTVMBuiltin honours by leaving the allocation to
the code generator (an `alloca` in the function's entry block, so no growth per iteration). It runs
just before LowerTVMBuiltin, after TVM's lowering has fixed the buffers' final shapes.
"""
from __future__ import annotations

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir, tirx

# a register tile and its neighbours: the largest micro-kernel tile is the register file
# (32 x 64 bytes with AVX-512); well inside a worker thread's stack
STACK_BYTES = 4096
PIPELINE = "kernorch"  # the name tvm.compile's `tir_pipeline` takes


def _bytes(buf) -> int | None:
    if not all(isinstance(d, tirx.IntImm) for d in buf.shape):
        return None
    dt = tvm.DataType(buf.dtype)
    return int(np.prod([int(d) for d in buf.shape], dtype=np.int64)) * dt.bits // 8 * dt.lanes


def rewrite(stmt, visit):
    """`stmt` with `visit` applied from the top: where it returns a statement, that replaces the
    node (and is not descended into); where it returns None, the node's children are rewritten
    (through sequences, loops, attributes, branches and blocks). The same object where nothing
    changed. (TVM 0.27 exposes no statement mutator to Python.)"""
    new = visit(stmt)
    if new is not None:
        return new
    if isinstance(stmt, tirx.SeqStmt):
        seq = [rewrite(s, visit) for s in stmt.seq]
        return stmt if all(a.same_as(b) for a, b in zip(seq, stmt.seq)) else tirx.SeqStmt(seq)
    if isinstance(stmt, tirx.For):
        body = rewrite(stmt.body, visit)
        return stmt if body.same_as(stmt.body) else tirx.For(
            stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding, stmt.annotations)
    if isinstance(stmt, tirx.AttrStmt):
        body = rewrite(stmt.body, visit)
        return stmt if body.same_as(stmt.body) else tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, body)
    if isinstance(stmt, tirx.IfThenElse):
        then = rewrite(stmt.then_case, visit)
        other = rewrite(stmt.else_case, visit) if stmt.else_case is not None else None
        if then.same_as(stmt.then_case) and (other is None or other.same_as(stmt.else_case)):
            return stmt
        return tirx.IfThenElse(stmt.condition, then, other)
    if isinstance(stmt, s_tir.stmt.SBlockRealize):
        b = stmt.block
        body = rewrite(b.body, visit)
        if body.same_as(b.body):
            return stmt
        return s_tir.stmt.SBlockRealize(stmt.iter_values, stmt.predicate, with_body(b, body))
    return stmt


def with_body(block, body, allocs=None):
    """`block` with another body (and buffers, `allocs`), everything else kept."""
    return s_tir.stmt.SBlock(block.iter_vars, block.reads, block.writes, block.name_hint, body, block.init,
                             block.alloc_buffers if allocs is None else allocs, block.match_buffers,
                             block.annotations)


class _Buffers:
    """A map from buffers to buffers, by identity (a TVM object's Python wrapper is not unique)."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def get(self, buf):
        return next((new for old, new in self.pairs if old.same_as(buf)), None)


def map_expr(e, visit):
    """`e` rebuilt with `visit` applied from the top: where it returns an expression, that replaces
    the node (and is not descended into); where it returns None, the node's operands are mapped.
    The same object where nothing changed."""
    new = visit(e)
    if new is not None:
        return new
    if isinstance(e, (tirx.IntImm, tirx.FloatImm, tvm.ir.expr.Var, tvm.ir.expr.StringImm)):
        return e

    def same(a, b):
        return all(x.same_as(y) for x, y in zip(a, b))
    if isinstance(e, tvm.ir.expr.TensorLoad):
        idx = [map_expr(i, visit) for i in e.indices]
        return e if same(idx, e.indices) else tirx.BufferLoad(e.source, idx)
    if isinstance(e, tvm.ir.expr.Call):
        args = [map_expr(a, visit) for a in e.args]
        return e if same(args, e.args) else tvm.ir.expr.Call(e.op, args, e.attrs, list(e.ty_args), None, e.ty)
    if isinstance(e, tirx.Select):
        old = (e.condition, e.true_value, e.false_value)
        parts = [map_expr(x, visit) for x in old]
        return e if same(parts, old) else tirx.Select(*parts)
    if isinstance(e, tirx.Let):
        value, body = map_expr(e.value, visit), map_expr(e.body, visit)
        return e if same((value, body), (e.value, e.body)) else tirx.Let(e.var, value, body)
    if isinstance(e, tirx.Cast):
        v = map_expr(e.value, visit)
        return e if v.same_as(e.value) else tirx.Cast(e.ty, v)
    if isinstance(e, tirx.Not):
        a = map_expr(e.a, visit)
        return e if a.same_as(e.a) else tirx.Not(a)
    if isinstance(e, tirx.Ramp):
        base, stride = map_expr(e.base, visit), map_expr(e.stride, visit)
        return e if same((base, stride), (e.base, e.stride)) else tirx.Ramp(base, stride, e.lanes)
    if isinstance(e, tirx.Broadcast):
        v = map_expr(e.value, visit)
        return e if v.same_as(e.value) else tirx.Broadcast(v, e.lanes)
    if hasattr(e, "a") and hasattr(e, "b"):  # the binary arithmetic, comparison and logical nodes
        a, b = map_expr(e.a, visit), map_expr(e.b, visit)
        return e if same((a, b), (e.a, e.b)) else type(e)(a, b)
    raise TypeError(f"no expression mapping through {type(e).__name__}")


def substitute_buffers(stmt, pairs):
    """`stmt` with every use of the first buffer of each of `pairs` (stores, loads, blocks' read,
    write and allocated buffers) made a use of the second. (TVM 0.27 gives Python no buffer
    substitution; s_tir.renew_defs renews every buffer it meets, parameters too.)"""
    return _map_buffers(stmt, _Buffers(pairs))


def buffers_in(stmt) -> list:
    """Every buffer `stmt` stores to, loads from, or whose blocks read, write or allocate."""
    seen: list = []

    class Recorder(_Buffers):
        def get(self, buf):
            if not any(buf.same_as(b) for b in seen):
                seen.append(buf)
            return None
    _map_buffers(stmt, Recorder(()))
    return seen


def _map_buffers(stmt, bufs: _Buffers):
    """`stmt` rebuilt with each buffer it uses passed through `bufs.get` (None: kept)."""
    def load(e):
        if isinstance(e, tvm.ir.expr.TensorLoad):
            new = bufs.get(e.source)
            return tirx.BufferLoad(new if new is not None else e.source, [expr(i) for i in e.indices])
        return None

    def expr(e):
        return map_expr(e, load)

    def region(r):
        new = bufs.get(r.source)
        return r if new is None else tirx.BufferRegion(new, r.region)

    def visit(st):
        if isinstance(st, tirx.BufferStore):
            new = bufs.get(st.buffer)
            return tirx.BufferStore(new if new is not None else st.buffer, expr(st.value), [expr(i) for i in st.indices])
        if isinstance(st, tirx.For):
            return tirx.For(st.loop_var, expr(st.min), expr(st.extent), st.kind, rewrite(st.body, visit),
                            st.thread_binding, st.annotations)
        if isinstance(st, tirx.IfThenElse):
            other = rewrite(st.else_case, visit) if st.else_case is not None else None
            return tirx.IfThenElse(expr(st.condition), rewrite(st.then_case, visit), other)
        if isinstance(st, s_tir.stmt.SBlockRealize):
            b = st.block
            if b.match_buffers:
                raise TypeError(f"no buffer substitution through block {b.name_hint}'s match buffers")
            block = s_tir.stmt.SBlock(
                b.iter_vars, [region(r) for r in b.reads], [region(r) for r in b.writes], b.name_hint,
                rewrite(b.body, visit), rewrite(b.init, visit) if b.init is not None else None,
                [bufs.get(a) or a for a in b.alloc_buffers], b.match_buffers, b.annotations)
            return s_tir.stmt.SBlockRealize([expr(v) for v in st.iter_values], expr(st.predicate), block)
        if isinstance(st, (tirx.SeqStmt, tirx.AttrStmt)):
            return None
        if isinstance(st, tirx.Evaluate):
            return tirx.Evaluate(expr(st.value))
        raise TypeError(f"no buffer substitution through {type(st).__name__}")
    return rewrite(stmt, visit)


# a stored value of more nodes than this has its repeated subexpressions bound once (`let_repeated`)
LET_MIN_NODES = 64


def _subexpressions(e):
    """The operands of an expression node (none for a leaf)."""
    if isinstance(e, tvm.ir.expr.TensorLoad):
        return list(e.indices)
    if isinstance(e, tvm.ir.expr.Call):
        return list(e.args)
    if isinstance(e, tirx.Select):
        return [e.condition, e.true_value, e.false_value]
    if isinstance(e, tirx.Let):
        return [e.value, e.body]
    return [x for x in (getattr(e, n, None) for n in ("a", "b", "value", "base", "stride")) if isinstance(x, tvm.ir.expr.Expr)]


def _let_bound(value):
    """`value` with each subexpression that occurs more than once and loads a buffer computed once,
    in a Let, largest first (each smaller one bound outside the larger ones that contain it)."""
    bound: list = []   # (var, expression), outermost first
    body = value
    while True:
        seen: dict = {}   # structural hash -> [count, node, size]

        def count(e) -> tuple[int, bool]:   # (nodes, loads a buffer)
            parts = [count(x) for x in _subexpressions(e)]
            size = 1 + sum(n for n, _ in parts)
            loads = isinstance(e, tvm.ir.expr.TensorLoad) or any(ld for _, ld in parts)
            if loads and parts and str(e.ty) == "float32":
                h = tvm_ffi.structural_hash(e)
                if h in seen and tvm_ffi.structural_equal(seen[h][1], e):
                    seen[h][0] += 1
                else:
                    seen.setdefault(h, [1, e, size])
            return size, loads
        total = count(body)[0] + sum(count(x)[0] for _, x in bound)
        if total < LET_MIN_NODES and not bound:
            return value
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
    funcs = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            body = rewrite(func.body, _let_store)
            if not body.same_as(func.body):
                func = func.with_body(body)
        funcs[gv] = func
    return tvm.IRModule(funcs, attrs=mod.attrs)


def _on_stack(stmt):
    """A small local AllocBuffer annotated to stay on the stack (None: any other statement)."""
    if isinstance(stmt, tirx.AllocBuffer):
        size = _bytes(stmt.buffer)
        if stmt.buffer.scope() == "local" and size is not None and 0 < size <= STACK_BYTES:
            annotations = dict(stmt.annotations or {})
            annotations["disable_lower_builtin"] = tirx.IntImm("int32", 1)
            return tirx.AllocBuffer(stmt.buffer, annotations)
    return None


@tvm.transform.module_pass(opt_level=0, name="kernorch.StackSmallBuffers")
def stack_small_buffers(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    funcs = {}
    for gv, func in mod.functions.items():
        if isinstance(func, tirx.PrimFunc):
            body = rewrite(func.body, _on_stack)
            if not body.same_as(func.body):
                func = func.with_body(body)
        funcs[gv] = func
    return tvm.IRModule(funcs, attrs=mod.attrs)


def _pipeline():
    """TVM's default pipeline (lowering, host finalization, device finalization) with
    `let_repeated` before the lowering and `stack_small_buffers` before the host finalization
    (LowerTVMBuiltin, LowerIntrin)."""
    lowering, host, device = tirx.compilation_pipeline.get_tir_pipeline("default")

    def finalize_host():
        return tvm.ir.transform.Sequential([stack_small_buffers, host()])
    return tvm.ir.transform.Sequential([let_repeated, lowering]), finalize_host, device


tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)
