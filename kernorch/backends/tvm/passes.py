"""The TIR pipeline kernorch compiles every kernel with: TVM's default, plus small local buffers
kept on the stack.

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


def _expr(e, bufs: _Buffers):
    """`e` with its loads of `bufs`' keys loading from their values (the same object when none)."""
    if isinstance(e, (tirx.IntImm, tirx.FloatImm, tvm.ir.expr.Var, tvm.ir.expr.StringImm)):
        return e
    if isinstance(e, tvm.ir.expr.TensorLoad):
        idx = [_expr(i, bufs) for i in e.indices]
        src = bufs.get(e.source)
        if src is None and all(a.same_as(b) for a, b in zip(idx, e.indices)):
            return e
        return tirx.BufferLoad(src if src is not None else e.source, idx)
    if isinstance(e, tvm.ir.expr.Call):
        args = [_expr(a, bufs) for a in e.args]
        if all(a.same_as(b) for a, b in zip(args, e.args)):
            return e
        return tvm.ir.expr.Call(e.op, args, e.attrs, list(e.ty_args), None, e.ty)
    if isinstance(e, tirx.Select):
        parts = [_expr(x, bufs) for x in (e.condition, e.true_value, e.false_value)]
        same = all(a.same_as(b) for a, b in zip(parts, (e.condition, e.true_value, e.false_value)))
        return e if same else tirx.Select(*parts)
    if isinstance(e, tirx.Cast):
        v = _expr(e.value, bufs)
        return e if v.same_as(e.value) else tirx.Cast(e.ty, v)
    if isinstance(e, tirx.Not):
        a = _expr(e.a, bufs)
        return e if a.same_as(e.a) else tirx.Not(a)
    if isinstance(e, tirx.Ramp):
        base, stride = _expr(e.base, bufs), _expr(e.stride, bufs)
        return e if base.same_as(e.base) and stride.same_as(e.stride) else tirx.Ramp(base, stride, e.lanes)
    if isinstance(e, tirx.Broadcast):
        v = _expr(e.value, bufs)
        return e if v.same_as(e.value) else tirx.Broadcast(v, e.lanes)
    if hasattr(e, "a") and hasattr(e, "b"):  # the binary arithmetic, comparison and logical nodes
        a, b = _expr(e.a, bufs), _expr(e.b, bufs)
        return e if a.same_as(e.a) and b.same_as(e.b) else type(e)(a, b)
    raise TypeError(f"no buffer substitution through {type(e).__name__}")


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

    def region(r):
        new = bufs.get(r.source)
        return r if new is None else tirx.BufferRegion(new, r.region)

    def visit(st):
        if isinstance(st, tirx.BufferStore):
            new = bufs.get(st.buffer)
            value, idx = _expr(st.value, bufs), [_expr(i, bufs) for i in st.indices]
            return tirx.BufferStore(new if new is not None else st.buffer, value, idx)
        if isinstance(st, tirx.For):
            return tirx.For(st.loop_var, _expr(st.min, bufs), _expr(st.extent, bufs), st.kind,
                            rewrite(st.body, visit), st.thread_binding, st.annotations)
        if isinstance(st, tirx.IfThenElse):
            other = rewrite(st.else_case, visit) if st.else_case is not None else None
            return tirx.IfThenElse(_expr(st.condition, bufs), rewrite(st.then_case, visit), other)
        if isinstance(st, s_tir.stmt.SBlockRealize):
            b = st.block
            if b.match_buffers:
                raise TypeError(f"no buffer substitution through block {b.name_hint}'s match buffers")
            block = s_tir.stmt.SBlock(
                b.iter_vars, [region(r) for r in b.reads], [region(r) for r in b.writes], b.name_hint,
                rewrite(b.body, visit), rewrite(b.init, visit) if b.init is not None else None,
                [bufs.get(a) or a for a in b.alloc_buffers], b.match_buffers, b.annotations)
            return s_tir.stmt.SBlockRealize([_expr(v, bufs) for v in st.iter_values], _expr(st.predicate, bufs),
                                            block)
        if isinstance(st, (tirx.SeqStmt, tirx.AttrStmt)):
            return None
        if isinstance(st, tirx.Evaluate):
            return tirx.Evaluate(_expr(st.value, bufs))
        raise TypeError(f"no buffer substitution through {type(st).__name__}")
    return rewrite(stmt, visit)


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
    `stack_small_buffers` before the host finalization (LowerTVMBuiltin, LowerIntrin)."""
    lowering, host, device = tirx.compilation_pipeline.get_tir_pipeline("default")

    def finalize_host():
        return tvm.ir.transform.Sequential([stack_small_buffers, host()])
    return lowering, finalize_host, device


tirx.compilation_pipeline.register_tir_pipeline(PIPELINE, _pipeline)
