"""Walking and rebuilding TIR from Python. TVM 0.27 exposes no statement or expression mutator to
Python (and `s_tir.renew_defs` renews every buffer it meets, the parameters too), so kernorch's
rewrites of scheduled kernels (kernorch.backends.tvm.schedule) and its TIR passes
(kernorch.backends.tvm.passes) rebuild nodes here: statements through `rewrite`, expressions
through `map_expr` (variables through `substitute`), buffers through `substitute_buffers`.
"""
from __future__ import annotations

import tvm
from tvm import s_tir, tirx


def operands(e) -> list:
    """The direct sub-expressions of a TIR expression (a load's indices, a call's arguments, an
    op's operands; none for a leaf)."""
    out = []
    for name in _fields(e):
        x = getattr(e, name)
        if name in _LISTS:
            out.extend(x)
        else:
            out.append(x)
    return out


_LISTS = ("indices", "args")


def _fields_of(e) -> tuple[str, ...]:
    """The fields that hold a TIR expression's operands, by its type (looked up once per type in
    `_FIELDS`: isinstance against TVM's abstract classes, and a missing attribute, which raises,
    cost most of a walk of a kernel)."""
    if isinstance(e, tvm.ir.expr.TensorLoad):
        return ("indices",)
    if isinstance(e, tvm.ir.expr.Call):
        return ("args",)
    if isinstance(e, tirx.Select):
        return ("condition", "true_value", "false_value")
    if isinstance(e, tirx.Let):
        return ("value", "body")
    return tuple(n for n in ("a", "b", "value", "base", "stride") if isinstance(getattr(e, n, None), tvm.ir.expr.Expr))


_FIELDS: dict[type, tuple[str, ...]] = {}  # per expression type, the fields of its operands (`_fields_of`)


def _fields(e) -> tuple[str, ...]:
    fields = _FIELDS.get(type(e))
    if fields is None:
        fields = _FIELDS[type(e)] = _fields_of(e)
    return fields


def is_load(e) -> bool:
    """Is `e` a buffer load (by its type, looked up once)?"""
    return _fields(e) == ("indices",)


def is_call(e, name: str) -> bool:
    """Is `e` a call of the intrinsic `name` ("if_then_else": TVM 0.27 names it prim.if_then_else)?"""
    return _fields(e) == ("args",) and str(getattr(e.op, "name", "")).endswith(name)


def loads(e):
    """Every buffer load in an expression, each time it occurs."""
    if is_load(e):
        yield e
    for sub in operands(e):
        yield from loads(sub)


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


def found(stmt, pred) -> list:
    """Every statement under `stmt` (itself included) for which `pred` holds, top-down through what
    `rewrite` walks."""
    out: list = []
    rewrite(stmt, lambda s: out.append(s) if pred(s) else None)
    return out


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
    if is_load(e):
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


def substitute(e, pairs):
    """`e` with every variable that is the first of one of `pairs` (by identity) replaced by the
    second, an expression."""
    return map_expr(e, lambda x: next((v for k, v in pairs if x.same_as(k)), None))


def substitute_buffers(stmt, pairs):
    """`stmt` with every use of the first buffer of each of `pairs` (stores, loads, blocks' read,
    write and allocated buffers) made a use of the second. (TVM 0.27 gives Python no buffer
    substitution; s_tir.renew_defs renews every buffer it meets, parameters too.)"""
    return _map_buffers(stmt, _Buffers(pairs))


def buffers_in(stmt) -> list:
    """Every buffer `stmt` stores to, loads from, or whose blocks read, write or allocate, each once
    (a walk that builds nothing: rebuilding the kernel through `substitute_buffers` to record them
    took most of a range kernel's scheduling)."""
    seen: dict = {}   # the object's address -> the buffer (a TVM object's Python wrapper is not unique)

    def add(buf) -> None:
        seen.setdefault(buf.__chandle__(), buf)

    def expr(e) -> None:
        if is_load(e):
            add(e.source)
        for sub in operands(e):
            expr(sub)

    def visit(st) -> None:
        if isinstance(st, tirx.SeqStmt):
            for s in st.seq:
                visit(s)
        elif isinstance(st, tirx.BufferStore):
            add(st.buffer)
            expr(st.value)
            for i in st.indices:
                expr(i)
        elif isinstance(st, tirx.For):
            expr(st.min)
            expr(st.extent)
            visit(st.body)
        elif isinstance(st, tirx.IfThenElse):
            expr(st.condition)
            visit(st.then_case)
            if st.else_case is not None:
                visit(st.else_case)
        elif isinstance(st, s_tir.stmt.SBlockRealize):
            b = st.block
            for r in (*b.reads, *b.writes):
                add(r.source)
            for v in (*st.iter_values, st.predicate):
                expr(v)
            visit(b.body)
            if b.init is not None:
                visit(b.init)
            for a in b.alloc_buffers:
                add(a)
        elif isinstance(st, tirx.AttrStmt):
            visit(st.body)
        elif isinstance(st, tirx.Evaluate):
            expr(st.value)
        else:
            raise TypeError(f"no buffer walk through {type(st).__name__}")
    visit(stmt)
    return list(seen.values())


class _Shift:
    """Indices moved by `offset` along `axis`."""

    def __init__(self, axis: int, offset):
        self.axis, self.offset = axis, offset

    def indices(self, indices):
        return [i + self.offset if k == self.axis else i for k, i in enumerate(indices)]

    def region(self, ranges):
        return [tvm.ir.Range.from_min_extent(x.min + self.offset, x.extent) if k == self.axis else x
                for k, x in enumerate(ranges)]


class _Unmerged:
    """Row i (plus `offset`) of a buffer whose axis `rows` holds `batch` x `length` rows, on a buffer
    with them on two axes: `batch` at (i + offset) // length and `rows` at (i + offset) % length
    (the index on `batch` was 0: an axis of one)."""

    def __init__(self, batch: int, rows: int, offset, length, extents):
        self.batch, self.rows, self.offset, self.length, self.extents = batch, rows, offset, length, extents

    def indices(self, indices):
        at = indices[self.rows] + self.offset
        out = list(indices)
        out[self.batch], out[self.rows] = tirx.floordiv(at, self.length), tirx.floormod(at, self.length)
        return out

    def region(self, ranges):  # (the whole of both axes: a block's region may hold more than it reads)
        return [tvm.ir.Range.from_min_extent(tirx.const(0, self.extents[k].ty.dtype), self.extents[k])
                if k in (self.batch, self.rows) else x for k, x in enumerate(ranges)]


def shift_indices(stmt, shifts):
    """`stmt` with every access to the buffer of each (buffer, axis, offset) of `shifts` moved by
    `offset` along `axis` (loads, stores and blocks' regions): the same code on the next slice."""
    return _map_buffers(stmt, _Buffers([]), _Buffers([(b, _Shift(axis, off)) for b, axis, off in shifts]))


def unmerge_rows(stmt, unmerged):
    """`stmt` with each access to the first buffer of each (buffer, other, batch axis, rows axis,
    offset, length) of `unmerged` made to `other`, row i (its index on the rows axis, plus
    `offset`) at (i + offset) // length on the batch axis and (i + offset) % length on the rows
    axis: code written for a batch's rows as one axis (its batch axis of one) on a buffer with the
    batch and its rows apart."""
    return _map_buffers(stmt, _Buffers([(b, o) for b, o, *_ in unmerged]),
                        _Buffers([(b, _Unmerged(kb, kr, off, n, list(o.shape))) for b, o, kb, kr, off, n in unmerged]))


def _map_buffers(stmt, bufs: _Buffers, moves: _Buffers | None = None):
    """`stmt` rebuilt with each buffer it uses passed through `bufs.get` (None: kept), and its
    indices and blocks' regions moved where `moves.get` gives a move for the buffer (`_Shift`,
    `_Unmerged`)."""
    def moved(buf, indices):
        move = moves.get(buf) if moves is not None else None
        return indices if move is None else move.indices(indices)

    def load(e):
        if is_load(e):
            new = bufs.get(e.source)
            return tirx.BufferLoad(new if new is not None else e.source,
                                   moved(e.source, [expr(i) for i in e.indices]))
        return None

    def expr(e):
        return map_expr(e, load)

    def region(r):
        new = bufs.get(r.source)
        move = moves.get(r.source) if moves is not None else None
        if new is None and move is None:
            return r
        return tirx.BufferRegion(new if new is not None else r.source,
                                 list(r.region) if move is None else move.region(list(r.region)))

    def visit(st):
        if isinstance(st, tirx.BufferStore):
            new = bufs.get(st.buffer)
            return tirx.BufferStore(new if new is not None else st.buffer, expr(st.value),
                                    moved(st.buffer, [expr(i) for i in st.indices]))
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
                [a if bufs.get(a) is None else bufs.get(a) for a in b.alloc_buffers], b.match_buffers, b.annotations)
            return s_tir.stmt.SBlockRealize([expr(v) for v in st.iter_values], expr(st.predicate), block)
        if isinstance(st, (tirx.SeqStmt, tirx.AttrStmt)):
            return None
        if isinstance(st, tirx.Evaluate):
            return tirx.Evaluate(expr(st.value))
        raise TypeError(f"no buffer substitution through {type(st).__name__}")
    return rewrite(stmt, visit)
