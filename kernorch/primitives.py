"""The primitive table: every primitive defined once, in one record.

A record holds the primitive's kind, its shape/dtype rule, its numpy reference, its TE compute and
its cost features (flops). Tests iterate the table, so a new primitive is tested the moment it
exists. TE computes receive the backend's TVM namespace `T` (te, tir, topi) as their first argument, so
this module never imports TVM itself (TVM stays behind kernorch.backends.tvm).

Kinds: elementwise, reduce, broadcast, layout, linear, opaque.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .ir import KernorchError, Prim, TensorType

KINDS = ("elementwise", "reduce", "broadcast", "layout", "linear", "opaque")


@dataclass(frozen=True)
class PrimDef:
    name: str
    kind: str
    arity: int  # number of inputs; -1 = variadic
    infer: Callable[[Sequence[TensorType], dict], TensorType]
    ref: Callable[[Sequence[np.ndarray], dict], np.ndarray]
    te: Callable[..., Any] | None  # (T, inputs, attrs, out_type) -> te.Tensor
    flops: Callable[[Sequence[TensorType], TensorType, dict], float]
    # example: a function () -> (input types, attrs) used by the table-driven tests
    example: Callable[[], tuple[list[TensorType], dict]]


TABLE: dict[str, PrimDef] = {}


def register(d: PrimDef) -> PrimDef:
    assert d.kind in KINDS, d.kind
    TABLE[d.name] = d
    return d


def get(op: str) -> PrimDef:
    try:
        return TABLE[op]
    except KeyError:
        raise KernorchError(f"unknown primitive {op!r}") from None


def infer(op: str, in_types: Sequence[TensorType], attrs: dict) -> TensorType:
    return get(op).infer(in_types, attrs)


def kind(op: str) -> str:
    return get(op).kind


def run(prim: Prim, values: Sequence[np.ndarray]) -> np.ndarray:
    """Evaluate one prim with its numpy reference and check the result's type."""
    d = get(prim.op)
    out = np.asarray(d.ref(values, prim.a))
    out = out.astype(prim.type.dtype, copy=False)
    if out.shape != tuple(prim.type.shape):
        raise KernorchError(
            f"reference of {prim.op} ({prim.name}, from {prim.origin}) gave shape {out.shape}, expected {prim.type.shape}")
    return out


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise KernorchError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _size(t: TensorType) -> int:
    return t.size


def _dim(d):
    """A TE extent as a Python int when it is a constant, else the (symbolic) expression itself:
    kernels over a symbolic dimension (kernorch.dynamic) get TIR variables as extents."""
    try:
        return int(d)
    except TypeError:
        return d


def _bcast_index(T, x, out_idx):
    """Index into `x` for an output index under numpy broadcasting (a symbolic extent is never
    the broadcast one: the generic graph's types already agree at every value)."""
    shape = [_dim(d) for d in x.shape]
    off = len(out_idx) - len(shape)
    return [0 if isinstance(shape[i], int) and shape[i] == 1 else out_idx[off + i] for i in range(len(shape))]


def _same(types, attrs):
    return types[0]


def _ew_flops(per=1.0):
    return lambda ins, out, a: per * out.size


def _zero_flops(ins, out, a):
    return 0.0


def _f32(shape):
    return TensorType(tuple(shape), "float32")


# ---------------------------------------------------------------------------------------------
# elementwise: unary
# ---------------------------------------------------------------------------------------------

def _softplus_np(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def _unary(name, np_fn, te_fn, cost=1.0, dtype_in="float32", positive=False, fast=None):
    """`fast`: a vectorizable float32 version, (T, x tensor) -> tensor (LLVM has no vector exp, erf
    or tanh on x86 and calls libm once per element; polynomial versions vectorize)."""
    def te(T, ins, a, out):
        x = ins[0]
        if fast is not None and x.dtype == "float32":
            return fast(T, x)
        return T.te.compute(x.shape, lambda *i: te_fn(T, x(*i)), name=name)

    def example():
        return [TensorType((2, 3, 5), dtype_in)], {}

    register(PrimDef(name, "elementwise", 1, _same, lambda v, a: np_fn(v[0]), te, _ew_flops(cost), example))


def _dt(v) -> str:
    """dtype of a TE value: TVM 0.27 PrimExprs have no `.dtype`, only `.ty.dtype`."""
    return str(v.dtype) if hasattr(v, "dtype") else str(v.ty.dtype)


def _te_softplus(T, x):
    zero = T.tir.const(0, _dt(x))
    return T.tir.max(x, zero) + T.tir.log1p(T.tir.exp(zero - T.tir.abs(x)))


_unary("neg", np.negative, lambda T, x: T.tir.const(0, _dt(x)) - x)
def _nan_kept(T, x, y, name):
    """y where x is a number, x (NaN) where it is not: the fast polynomials map NaN to a number."""
    return T.te.compute(x.shape, lambda *i: T.tir.Select(x(*i) != x(*i), x(*i), y(*i)), name=name)


def _fast_sigmoid(T, x):
    """1 / (1 + exp(-x)) with the polynomial exp (exp(88+) is inf, giving 0; exp(-88-) is 0, giving 1)."""
    e = T.topi.fast_exp(T.te.compute(x.shape, lambda *i: T.tir.const(0, "float32") - x(*i), name="sigmoid_neg"))
    return T.te.compute(x.shape, lambda *i: T.tir.const(1, "float32") / (T.tir.const(1, "float32") + e(*i)),
                        name="fast_sigmoid")


_unary("exp", np.exp, lambda T, x: T.tir.exp(x), 8, fast=lambda T, x: T.topi.fast_exp(x))
_unary("log", np.log, lambda T, x: T.tir.log(x), 8)
_unary("sqrt", np.sqrt, lambda T, x: T.tir.sqrt(x), 4)
_unary("reciprocal", lambda x: 1.0 / x, lambda T, x: T.tir.const(1, _dt(x)) / x, 4)
_unary("tanh", np.tanh, lambda T, x: T.tir.tanh(x), 10, fast=lambda T, x: T.topi.fast_tanh(x))
_unary("erf", lambda x: _erf_np(x), lambda T, x: T.tir.erf(x), 10,
       fast=lambda T, x: _nan_kept(T, x, T.topi.fast_erf(x), "fast_erf_nan"))
_unary("sigmoid", lambda x: 1.0 / (1.0 + np.exp(-x)), lambda T, x: T.tir.sigmoid(x), 10, fast=_fast_sigmoid)
_unary("relu", lambda x: np.maximum(x, 0), lambda T, x: T.tir.max(x, T.tir.const(0, _dt(x))))
_unary("abs", np.abs, lambda T, x: T.tir.abs(x))
_unary("floor", np.floor, lambda T, x: T.tir.floor(x))
_unary("ceil", np.ceil, lambda T, x: T.tir.ceil(x))
_unary("round", np.round, lambda T, x: T.tir.nearbyint(x))
_unary("sin", np.sin, lambda T, x: T.tir.sin(x), 10)
_unary("cos", np.cos, lambda T, x: T.tir.cos(x), 10)
_unary("softplus", _softplus_np, _te_softplus, 20)
_unary("not", np.logical_not, lambda T, x: T.tir.Not(x), 1, dtype_in="bool")


def _erf_np(x):
    # float32 erf through float64 erf: exact to fp32 rounding. (scipy's, not math.erf element by
    # element: the same float32 values for 512 x 1536 normal inputs in 17 ms instead of 129, which a
    # GELU kernel over seq=1..512 spent three times in its check at each sample.)
    from scipy.special import erf
    return erf(x.astype(np.float64)).astype(x.dtype) if x.size else x


def _cast_infer(types, a):
    return TensorType(types[0].shape, a["to"])


def _cast_te(T, ins, a, out):
    x = ins[0]
    return T.te.compute(x.shape, lambda *i: x(*i).astype(a["to"]), name="cast")


register(PrimDef("cast", "elementwise", 1, _cast_infer, lambda v, a: v[0].astype(a["to"]), _cast_te,
                 _zero_flops, lambda: ([_f32((4, 3))], {"to": "int64"})))

# ---------------------------------------------------------------------------------------------
# elementwise: binary with broadcasting, and where
# ---------------------------------------------------------------------------------------------


def _binary(name, np_fn, te_fn, out_dtype=None, cost=1.0, dtype_in="float32"):
    def infer(types, a):
        if types[0].dtype != types[1].dtype:
            raise KernorchError(f"{name}: dtypes differ ({types[0].dtype} vs {types[1].dtype})")
        return TensorType(broadcast_shape(types[0].shape, types[1].shape), out_dtype or types[0].dtype)

    def te(T, ins, a, out):
        x, y = ins
        return T.te.compute(tuple(out.shape), lambda *i: te_fn(T, x(*_bcast_index(T, x, i)), y(*_bcast_index(T, y, i))),
                            name=name)

    def example():
        return [TensorType((2, 3, 4), dtype_in), TensorType((3, 1), dtype_in)], {}

    register(PrimDef(name, "elementwise", 2, infer, lambda v, a: np_fn(v[0], v[1]), te, _ew_flops(cost), example))


def _te_pow(T, x, y):
    return T.tir.power(x, y)


_binary("add", np.add, lambda T, x, y: x + y)
_binary("sub", np.subtract, lambda T, x, y: x - y)
_binary("mul", np.multiply, lambda T, x, y: x * y)
_binary("div", np.divide, lambda T, x, y: x / y)
_binary("pow", np.power, _te_pow, cost=10)
_binary("max", np.maximum, lambda T, x, y: T.tir.max(x, y))
_binary("min", np.minimum, lambda T, x, y: T.tir.min(x, y))
_binary("equal", np.equal, lambda T, x, y: x == y, out_dtype="bool")
_binary("less", np.less, lambda T, x, y: x < y, out_dtype="bool")
_binary("greater", np.greater, lambda T, x, y: x > y, out_dtype="bool")
_binary("and", np.logical_and, lambda T, x, y: T.tir.And(x, y), dtype_in="bool")
_binary("or", np.logical_or, lambda T, x, y: T.tir.Or(x, y), dtype_in="bool")


def _where_infer(types, a):
    c, x, y = types
    if c.dtype != "bool" or x.dtype != y.dtype:
        raise KernorchError(f"where: condition must be bool and branches of one dtype, got {c.dtype}, {x.dtype}, {y.dtype}")
    return TensorType(broadcast_shape(c.shape, x.shape, y.shape), x.dtype)


def _where_te(T, ins, a, out):
    c, x, y = ins
    return T.te.compute(tuple(out.shape), lambda *i: T.tir.Select(c(*_bcast_index(T, c, i)), x(*_bcast_index(T, x, i)),
                                                                 y(*_bcast_index(T, y, i))), name="where")


register(PrimDef("where", "elementwise", 3, _where_infer, lambda v, a: np.where(v[0], v[1], v[2]), _where_te,
                 _ew_flops(1), lambda: ([TensorType((3, 4), "bool"), _f32((3, 4)), _f32((1, 4))], {})))

# ---------------------------------------------------------------------------------------------
# reduce
# ---------------------------------------------------------------------------------------------


def _norm_axes(axes, rank):
    return tuple(sorted(a % rank for a in axes))


def _reduce_infer(types, a):
    x = types[0]
    axes = _norm_axes(a["axes"], x.rank)
    if a.get("keepdims", 1):
        shape = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    else:
        shape = tuple(d for i, d in enumerate(x.shape) if i not in axes)
    return TensorType(shape, x.dtype)


# a reduction over a symbolic last axis (kernorch.dynamic: softmax over seq keys) is computed in
# two parts: whole chunks of this many elements, which a schedule vectorizes without a guard, and
# the rest (1 to a chunk); one guarded loop over the whole length compiled to gathers (a max over
# 6 x 512 x 512 scores took 230-250 us on a Zen 4, 45 us in two parts)
REDUCE_CHUNK = 16


def _reduce(name, np_fn, te_reducer, combine):
    def ref(v, a):
        x = v[0]
        return np_fn(x, axis=_norm_axes(a["axes"], x.ndim), keepdims=bool(a.get("keepdims", 1)))

    def te(T, ins, a, out):
        x = ins[0]
        rank = len(x.shape)
        axes = _norm_axes(a["axes"], rank)
        keep = bool(a.get("keepdims", 1))
        count = 1
        for ax in axes:
            count *= _dim(x.shape[ax])

        def part(raxes, suffix):
            def body(*i):
                idx, it, rk = [], iter(i), iter(raxes)
                for d in range(rank):
                    if d in axes:
                        idx.append(next(rk))
                        if keep:
                            next(it)
                    else:
                        idx.append(next(it))
                return te_reducer(T, x(*idx), raxes, count)
            return T.te.compute(tuple(out.shape), body, name=name + suffix)

        n = _dim(x.shape[axes[-1]]) if axes else 1
        divisible = getattr(T, "divisible", None)  # (a padded symbolic extent: whole chunks only)
        if (len(axes) == 1 and axes[0] == rank - 1 and not isinstance(n, int)
                and not (divisible is not None and divisible(n, REDUCE_CHUNK))):
            # the rest: 1 to REDUCE_CHUNK elements, never none. Written n - rest, not (n - 1) // c * c:
            # both parts then provably end inside the axis (TVM could not place (n - 1) // 16 * 16
            # inside a producer padded to (n + 63) // 64 * 64, and reverse_compute_at refused every
            # register tile of the attention scores followed by their max); `divisible` proves the
            # chunks whole
            whole = n - ((n - 1) % REDUCE_CHUNK + 1)
            head = part([T.te.reduce_axis((0, whole), name=f"r{axes[0]}")], "_chunks")
            tail = part([T.te.reduce_axis((whole, n), name=f"r{axes[0]}t")], "_rest")
            res = T.te.compute(tuple(out.shape), lambda *i: combine(T, head(*i), tail(*i)), name=name)
        else:
            res = part([T.te.reduce_axis((0, _dim(x.shape[ax])), name=f"r{ax}") for ax in axes], "")
        if name == "reduce_mean":
            n = T.tir.const(count, x.dtype) if isinstance(count, int) else count.astype(x.dtype)
            res = T.te.compute(tuple(out.shape), lambda *i: res(*i) / n, name="mean")
        return res

    def example():
        return [_f32((2, 3, 5))], {"axes": (-1,), "keepdims": 1}

    register(PrimDef(name, "reduce", 1, _reduce_infer, ref, te, lambda ins, out, a: float(ins[0].size), example))


def _prod_reducer(T):
    return T.te.comm_reducer(lambda x, y: x * y, lambda t: T.tir.const(1, dtype=t), name="prod")


_reduce("reduce_sum", np.sum, lambda T, v, r, n: T.te.sum(v, axis=r), lambda T, a, b: a + b)
_reduce("reduce_mean", np.mean, lambda T, v, r, n: T.te.sum(v, axis=r), lambda T, a, b: a + b)  # / n in _reduce
_reduce("reduce_max", np.max, lambda T, v, r, n: T.te.max(v, axis=r), lambda T, a, b: T.te.max(a, b))
_reduce("reduce_min", np.min, lambda T, v, r, n: T.te.min(v, axis=r), lambda T, a, b: T.te.min(a, b))
_reduce("reduce_prod", np.prod, lambda T, v, r, n: _prod_reducer(T)(v, axis=r), lambda T, a, b: a * b)


# pooling: a windowed reduction (max or average) over the trailing spatial axes of NC...

def _pool_out(n, k, s, pb, pe, d, ceil_mode):
    eff = (k - 1) * d + 1
    num = n + pb + pe - eff
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + pb:
        out -= 1
    return out


def _pool_infer(types, a):
    x = types[0]
    k = a["kernel"]
    sp = len(k)
    shape = list(x.shape[:-sp])
    for i in range(sp):
        shape.append(_pool_out(x.shape[-sp + i], k[i], a["strides"][i], a["pads"][i], a["pads"][i + sp],
                               a["dilations"][i], a.get("ceil_mode", 0)))
    return TensorType(tuple(shape), x.dtype)


def _pool_ref(v, a):
    x = v[0]
    k, s, d, pads = a["kernel"], a["strides"], a["dilations"], a["pads"]
    sp = len(k)
    out_t = _pool_infer([TensorType(x.shape, str(x.dtype))], a)
    outs = out_t.shape[-sp:]
    mode = a["mode"]
    # pad generously on the end so ceil_mode windows stay in range
    pad_w = [(0, 0)] * (x.ndim - sp) + [(pads[i], pads[i + sp] + s[i] * 2 + k[i] * d[i]) for i in range(sp)]
    fill = -np.inf if mode == "max" else 0.0
    xp = np.pad(x, pad_w, constant_values=fill)
    valid = np.pad(np.ones(x.shape[-sp:], dtype=x.dtype), pad_w[-sp:], constant_values=0)
    acc = np.full(x.shape[:-sp] + tuple(outs), fill, dtype=x.dtype)
    cnt = np.zeros(tuple(outs), dtype=x.dtype)
    cnt_all = np.zeros(tuple(outs), dtype=x.dtype)
    import itertools
    for off in itertools.product(*[range(kk) for kk in k]):
        sl = tuple(slice(off[i] * d[i], off[i] * d[i] + s[i] * (outs[i] - 1) + 1, s[i]) for i in range(sp))
        win = xp[(Ellipsis,) + sl]
        vwin = valid[sl]
        # window positions inside the explicitly padded region count for count_include_pad
        inpad = np.ones_like(vwin)
        for i in range(sp):
            idx = off[i] * d[i] + s[i] * np.arange(outs[i])
            m = (idx < x.shape[-sp + i] + pads[i] + pads[i + sp]).astype(x.dtype)
            inpad = inpad * m.reshape([-1 if j == i else 1 for j in range(sp)])
        if mode == "max":
            acc = np.maximum(acc, win)
        else:
            acc = acc + win
            cnt = cnt + vwin
            cnt_all = cnt_all + inpad
    if mode == "max":
        return acc
    return acc / (cnt_all if a.get("count_include_pad", 0) else cnt)


def _pool_te(T, ins, a, out):
    x = ins[0]
    k, s, d, pads = a["kernel"], a["strides"], a["dilations"], a["pads"]
    sp = len(k)
    rank = len(x.shape)
    ins_sp = [int(x.shape[rank - sp + i]) for i in range(sp)]
    r = [T.te.reduce_axis((0, k[i]), name=f"k{i}") for i in range(sp)]
    mode = a["mode"]
    dtype = x.dtype

    def pos(i, o):
        return o * s[i] + r[i] * d[i] - pads[i]

    def inside(o):
        conds = [T.tir.all(pos(i, o[i]) >= 0, pos(i, o[i]) < ins_sp[i]) for i in range(sp)]
        return T.tir.all(*conds) if len(conds) > 1 else conds[0]

    def load(lead, o):
        idx = list(lead) + [T.tir.max(T.tir.min(pos(i, o[i]), ins_sp[i] - 1), 0) for i in range(sp)]
        return x(*idx)

    if mode == "max":
        def body(*i):
            lead, o = i[:rank - sp], i[rank - sp:]
            return T.te.max(T.tir.if_then_else(inside(o), load(lead, o), T.te.min_value(dtype)), axis=r)
        return T.te.compute(tuple(out.shape), body, name="maxpool")

    def sbody(*i):
        lead, o = i[:rank - sp], i[rank - sp:]
        return T.te.sum(T.tir.if_then_else(inside(o), load(lead, o), T.tir.const(0, dtype)), axis=r)

    summed = T.te.compute(tuple(out.shape), sbody, name="sumpool")

    def count(o):
        # number of window taps inside the input (or inside input+explicit pads when count_include_pad)
        total = None
        for i in range(sp):
            lo_lim = 0 if not a.get("count_include_pad", 0) else -pads[i]
            hi_lim = ins_sp[i] if not a.get("count_include_pad", 0) else ins_sp[i] + pads[i + sp]
            start = o[i] * s[i] - pads[i]
            # taps are start + t*d for t in [0, k); count those within [lo_lim, hi_lim)
            n = 0
            for t in range(k[i]):
                p = start + t * d[i]
                n = n + T.tir.Select(T.tir.all(p >= lo_lim, p < hi_lim), 1, 0)
            total = n if total is None else total * n
        return total.astype(dtype)

    return T.te.compute(tuple(out.shape), lambda *i: summed(*i) / count(i[rank - sp:]), name="avgpool")


register(PrimDef("pool", "reduce", 1, _pool_infer, _pool_ref, _pool_te,
                 lambda ins, out, a: float(out.size * int(np.prod(a["kernel"]))),
                 lambda: ([_f32((1, 2, 7, 6))], {"mode": "max", "kernel": (3, 3), "strides": (2, 2),
                                                 "pads": (1, 1, 1, 1), "dilations": (1, 1), "ceil_mode": 0})))

# ---------------------------------------------------------------------------------------------
# broadcast and layout
# ---------------------------------------------------------------------------------------------


def _expand_infer(types, a):
    return TensorType(broadcast_shape(types[0].shape, a["shape"]), types[0].dtype)


def _expand_te(T, ins, a, out):
    x = ins[0]
    return T.te.compute(tuple(out.shape), lambda *i: x(*_bcast_index(T, x, i)), name="expand")


register(PrimDef("expand", "broadcast", 1, _expand_infer,
                 lambda v, a: np.broadcast_to(v[0], broadcast_shape(v[0].shape, a["shape"])).copy(), _expand_te,
                 _zero_flops, lambda: ([_f32((3, 1))], {"shape": (2, 3, 4)})))


def _transpose_infer(types, a):
    x = types[0]
    return TensorType(tuple(x.shape[p] for p in a["perm"]), x.dtype)


def _transpose_te(T, ins, a, out):
    x = ins[0]
    perm = a["perm"]
    inv = [perm.index(i) for i in range(len(perm))]
    return T.te.compute(tuple(out.shape), lambda *i: x(*[i[inv[d]] for d in range(len(perm))]), name="transpose")


register(PrimDef("transpose", "layout", 1, _transpose_infer, lambda v, a: np.transpose(v[0], a["perm"]),
                 _transpose_te, _zero_flops, lambda: ([_f32((2, 3, 4))], {"perm": (2, 0, 1)})))


def _reshape_infer(types, a):
    x = types[0]
    shape = tuple(a["shape"])
    if int(np.prod(shape)) != x.size:
        raise KernorchError(f"reshape of {x} to {shape}: sizes differ")
    return TensorType(shape, x.dtype)


def _unravel(T, flat, shape):
    idx = []
    for d in reversed(shape):
        idx.append(T.tir.const(0, "int64") * flat if isinstance(d, int) and d == 1 else T.tir.floormod(flat, d))
        flat = T.tir.floordiv(flat, d)
    return list(reversed(idx))


def _ravel(T, idx, shape):
    flat = None
    for i, d in zip(idx, shape):
        flat = i if flat is None else flat * d + i
    return flat if flat is not None else 0


def _reshape_groups(in_shape, out_shape) -> list[tuple[list[int], list[int]]] | None:
    """The axes of a reshape in groups (input axes, output axes) of equal sizes, in order: a
    symbolic axis alone in its group, static axes merged or split within theirs, unit axes joining
    a neighbour ([1, seq, 384] -> [1, seq, 6, 64]: [0]->[0], [1]->[1], [2]->[2, 3]). None when the
    sizes do not group (a symbolic axis merged with another)."""
    def static(d):
        return isinstance(d, int)

    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        a, b = in_shape[i], out_shape[j]
        if not (static(a) and static(b)):
            if a == 1 or b == 1:  # a unit axis beside a symbolic one: a group of its own
                groups.append(([i], []) if a == 1 else ([], [j]))
                i, j = (i + 1, j) if a == 1 else (i, j + 1)
                continue
            if static(a) or static(b) or str(a) != str(b):
                return None
            groups.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        gi, gj, pa, pb = [i], [j], a, b
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                if i >= len(in_shape) or not static(in_shape[i]):
                    return None
                pa *= in_shape[i]
                gi.append(i)
                i += 1
            else:
                if j >= len(out_shape) or not static(out_shape[j]):
                    return None
                pb *= out_shape[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    if any(d != 1 for d in in_shape[i:]) or any(d != 1 for d in out_shape[j:]):
        return None
    groups += [([k], []) for k in range(i, len(in_shape))] + [([], [k]) for k in range(j, len(out_shape))]
    return groups


def _reshape_te(T, ins, a, out):
    """A reshape indexes its input group by group (`_reshape_groups`): over a symbolic axis no index
    is divided by the symbolic size (a flat index over [1, seq, 384] read a kernel's padded result
    as `(... + s) % seq`, which a schedule can neither vectorize nor tile)."""
    x = ins[0]
    in_shape = [_dim(d) for d in x.shape]
    out_shape = [_dim(d) for d in out.shape]
    groups = _reshape_groups(in_shape, out_shape)
    if groups is None:
        return T.te.compute(tuple(out.shape), lambda *i: x(*_unravel(T, _ravel(T, i, out_shape), in_shape)),
                            name="reshape")

    def body(*i):
        idx = [None] * len(in_shape)
        for gi, gj in groups:
            if not gi:
                continue
            if not gj:
                for k in gi:
                    idx[k] = T.tir.const(0, "int64") * i[0] if i else 0
                continue
            flat = _ravel(T, [i[k] for k in gj], [out_shape[k] for k in gj])
            for k in reversed(gi[1:]):  # the group's outermost input axis takes what is left: no modulo
                idx[k] = T.tir.floormod(flat, in_shape[k])
                flat = T.tir.floordiv(flat, in_shape[k])
            idx[gi[0]] = flat
        return x(*idx)
    return T.te.compute(tuple(out.shape), body, name="reshape")


register(PrimDef("reshape", "layout", 1, _reshape_infer, lambda v, a: np.reshape(v[0], a["shape"]), _reshape_te,
                 _zero_flops, lambda: ([_f32((2, 3, 4))], {"shape": (6, 4)})))


def _slice_infer(types, a):
    x = types[0]
    shape = list(x.shape)
    for ax, b, e, s in zip(a["axes"], a["begins"], a["ends"], a["steps"]):
        shape[ax] = len(range(b, e, s))
    return TensorType(tuple(shape), x.dtype)


def _slice_ref(v, a):
    x = v[0]
    sl = [slice(None)] * x.ndim
    for ax, b, e, s in zip(a["axes"], a["begins"], a["ends"], a["steps"]):
        sl[ax] = slice(b, e if e >= 0 else None, s)
    return x[tuple(sl)]


def _slice_te(T, ins, a, out):
    x = ins[0]
    spec = {ax: (b, s) for ax, b, e, s in zip(a["axes"], a["begins"], a["ends"], a["steps"])}

    def body(*i):
        return x(*[(spec[d][0] + i[d] * spec[d][1]) if d in spec else i[d] for d in range(len(i))])

    return T.te.compute(tuple(out.shape), body, name="slice")


register(PrimDef("slice", "layout", 1, _slice_infer, _slice_ref, _slice_te, _zero_flops,
                 lambda: ([_f32((4, 6, 5))], {"axes": (1, 2), "begins": (1, 4), "ends": (6, -1), "steps": (2, -2)})))


def _concat_infer(types, a):
    ax = a["axis"]
    base = list(types[0].shape)
    base[ax] = sum(t.shape[ax] for t in types)
    return TensorType(tuple(base), types[0].dtype)


def _concat_te(T, ins, a, out):
    ax = a["axis"]
    offsets = []
    off = 0
    for x in ins:
        offsets.append(off)
        off += _dim(x.shape[ax])

    def body(*i):
        val = None
        # forward order: a later input (larger offset) must win where i >= its offset
        for x, o in zip(ins, offsets):
            idx = list(i)
            idx[ax] = i[ax] - o
            v = x(*idx)
            # if_then_else, not Select: Select evaluates both sides, and the simplifier uses its
            # condition to drop index clamps, so a Select chain reads far outside the inputs
            val = v if val is None else T.tir.if_then_else(i[ax] >= o, v, val)
        return val

    return T.te.compute(tuple(out.shape), body, name="concat")


register(PrimDef("concat", "layout", -1, _concat_infer, lambda v, a: np.concatenate(v, axis=a["axis"]), _concat_te,
                 _zero_flops, lambda: ([_f32((2, 3, 4)), _f32((2, 1, 4)), _f32((2, 2, 4))], {"axis": 1})))


def _pad_infer(types, a):
    x = types[0]
    p = a["pads"]
    r = x.rank
    return TensorType(tuple(d + p[i] + p[i + r] for i, d in enumerate(x.shape)), x.dtype)


def _pad_ref(v, a):
    x = v[0]
    r = x.ndim
    p = a["pads"]
    width = [(p[i], p[i + r]) for i in range(r)]
    mode = a.get("mode", "constant")
    if mode == "constant":
        return np.pad(x, width, constant_values=a.get("value", 0.0))
    return np.pad(x, width, mode={"reflect": "reflect", "edge": "edge"}[mode])


def _pad_te(T, ins, a, out):
    x = ins[0]
    r = len(x.shape)
    p = a["pads"]
    n = [_dim(d) for d in x.shape]
    mode = a.get("mode", "constant")

    def body(*i):
        j = [i[d] - p[d] for d in range(r)]
        if mode == "constant":
            conds = [T.tir.all(j[d] >= 0, j[d] < n[d]) for d in range(r) if p[d] or p[d + r]]
            clamped = [T.tir.max(T.tir.min(j[d], n[d] - 1), 0) for d in range(r)]
            if not conds:
                return x(*j)
            return T.tir.if_then_else(T.tir.all(*conds) if len(conds) > 1 else conds[0], x(*clamped),
                                T.tir.const(a.get("value", 0.0), x.dtype))
        idx = []
        for d in range(r):
            if not (p[d] or p[d + r]):
                idx.append(j[d])
            elif mode == "edge":
                idx.append(T.tir.max(T.tir.min(j[d], n[d] - 1), 0))
            else:  # reflect
                v = T.tir.abs(j[d])
                v = T.tir.Select(v >= n[d], 2 * (n[d] - 1) - v, v)
                idx.append(v)
        return x(*idx)

    return T.te.compute(tuple(out.shape), body, name="pad")


register(PrimDef("pad", "layout", 1, _pad_infer, _pad_ref, _pad_te, _zero_flops,
                 lambda: ([_f32((1, 2, 5, 4))], {"pads": (0, 0, 2, 1, 0, 0, 1, 2), "mode": "reflect"})))


def _gather_infer(types, a):
    x, idx = types
    ax = a["axis"]
    return TensorType(tuple(x.shape[:ax]) + tuple(idx.shape) + tuple(x.shape[ax + 1:]), x.dtype)


def _gather_te(T, ins, a, out):
    x, idx = ins
    ax = a["axis"]
    k = len(idx.shape)

    def body(*i):
        pos = idx(*i[ax:ax + k])
        n = _dim(x.shape[ax])
        pos = T.tir.Select(pos < 0, pos + n, pos)  # ONNX/numpy negative indices count from the end
        return x(*(list(i[:ax]) + [pos] + list(i[ax + k:])))

    return T.te.compute(tuple(out.shape), body, name="gather")


register(PrimDef("gather", "layout", 2, _gather_infer, lambda v, a: np.take(v[0], v[1], axis=a["axis"]),
                 _gather_te, _zero_flops,
                 lambda: ([_f32((3, 5, 2)), TensorType((4,), "int64")], {"axis": 1})))

# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------


def _matmul_infer(types, a):
    x, y = types
    if x.rank < 2 or y.rank < 2:
        raise KernorchError("matmul primitive needs rank >= 2 operands")
    if x.shape[-1] != y.shape[-2]:
        raise KernorchError(f"matmul of {x} and {y}: inner dimensions differ")
    batch = broadcast_shape(x.shape[:-2], y.shape[:-2])
    return TensorType(batch + (x.shape[-2], y.shape[-1]), x.dtype)


def _matmul_te(T, ins, a, out):
    x, y = ins
    kk = _dim(x.shape[-1])
    r = T.te.reduce_axis((0, kk), name="k")
    nb = len(out.shape) - 2

    def body(*i):
        b, m, n = i[:nb], i[nb], i[nb + 1]
        xb = _bcast_index(T, _Shape(x.shape[:-2]), b)
        yb = _bcast_index(T, _Shape(y.shape[:-2]), b)
        return T.te.sum(x(*xb, m, r) * y(*yb, r, n), axis=r)

    return T.te.compute(tuple(out.shape), body, name="matmul")


class _Shape:
    def __init__(self, shape):
        self.shape = shape


def _matmul_flops(ins, out, a):
    return 2.0 * out.size * ins[0].shape[-1]


register(PrimDef("matmul", "linear", 2, _matmul_infer, lambda v, a: np.matmul(v[0], v[1]), _matmul_te,
                 _matmul_flops, lambda: ([_f32((2, 4, 8)), _f32((8, 5))], {})))


def _conv_infer(types, a):
    x, w = types
    sp = x.rank - 2
    if w.shape[1] * a["group"] != x.shape[1]:
        raise KernorchError(f"conv: input channels {x.shape[1]} != {w.shape[1]} x group {a['group']}")
    shape = [x.shape[0], w.shape[0]]
    for i in range(sp):
        shape.append(_pool_out(x.shape[2 + i], w.shape[2 + i], a["strides"][i], a["pads"][i], a["pads"][i + sp],
                               a["dilations"][i], 0))
    return TensorType(tuple(shape), x.dtype)


def conv_ref(x, w, strides, pads, dilations, group):
    """NC(spatial) grouped convolution through im2col + matmul (numpy)."""
    sp = x.ndim - 2
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    k = w.shape[2:]
    width = [(0, 0), (0, 0)] + [(pads[i], pads[i + sp]) for i in range(sp)]
    xp = np.pad(x, width)
    outs = [_pool_out(x.shape[2 + i], k[i], strides[i], pads[i], pads[i + sp], dilations[i], 0) for i in range(sp)]
    import itertools
    cols = []
    for off in itertools.product(*[range(kk) for kk in k]):
        sl = tuple(slice(off[i] * dilations[i], off[i] * dilations[i] + strides[i] * (outs[i] - 1) + 1, strides[i])
                   for i in range(sp))
        cols.append(xp[(slice(None), slice(None)) + sl])
    col = np.stack(cols, axis=2)  # n, c, K, *outs
    kprod = int(np.prod(k))
    col = col.reshape(n, group, cg * kprod, -1)  # channel-major then tap, matching w's layout
    wm = w.reshape(group, m // group, cg * kprod)
    y = np.einsum("gok,ngkp->ngop", wm, col, optimize=True)
    return y.reshape((n, m) + tuple(outs)).astype(x.dtype)


def _conv_te(T, ins, a, out):
    x, w = ins
    sp = len(x.shape) - 2
    g = a["group"]
    s, d, p = a["strides"], a["dilations"], a["pads"]
    n_sp = [int(x.shape[2 + i]) for i in range(sp)]
    cg = int(w.shape[1])
    og = int(w.shape[0]) // g
    rc = T.te.reduce_axis((0, cg), name="rc")
    rk = [T.te.reduce_axis((0, int(w.shape[2 + i])), name=f"rk{i}") for i in range(sp)]
    if any(p):
        padded_shape = [x.shape[0], x.shape[1]] + [n_sp[i] + p[i] + p[i + sp] for i in range(sp)]

        def pbody(*i):
            j = [i[2 + t] - p[t] for t in range(sp)]
            cond = T.tir.all(*[T.tir.all(j[t] >= 0, j[t] < n_sp[t]) for t in range(sp)]) if sp > 1 else \
                T.tir.all(j[0] >= 0, j[0] < n_sp[0])
            cl = [T.tir.max(T.tir.min(j[t], n_sp[t] - 1), 0) for t in range(sp)]
            return T.tir.if_then_else(cond, x(i[0], i[1], *cl), T.tir.const(0, x.dtype))

        xp = T.te.compute(tuple(padded_shape), pbody, name="conv_pad")
    else:
        xp = x

    def body(nn, oc, *o):
        # the input channel: plain rc without groups, the output channel itself for depthwise (so
        # a schedule that vectorizes output channels reads contiguous input, never a gather)
        ic = rc if g == 1 else oc + rc if cg == 1 and og == 1 else T.tir.floordiv(oc, og) * cg + rc
        return T.te.sum(xp(nn, ic, *[o[t] * s[t] + rk[t] * d[t] for t in range(sp)]) * w(oc, rc, *rk),
                        axis=[rc] + rk)

    return T.te.compute(tuple(out.shape), body, name="conv")


def _conv_flops(ins, out, a):
    w = ins[1]
    return 2.0 * out.size * int(np.prod(w.shape[1:]))


register(PrimDef("conv", "linear", 2, _conv_infer,
                 lambda v, a: conv_ref(v[0], v[1], a["strides"], a["pads"], a["dilations"], a["group"]), _conv_te,
                 _conv_flops,
                 lambda: ([_f32((1, 4, 7, 6)), _f32((6, 2, 3, 3))],
                          {"strides": (2, 1), "pads": (1, 0, 1, 2), "dilations": (1, 2), "group": 2})))

# ---------------------------------------------------------------------------------------------
# opaque: an ONNX operator kept whole, evaluated by onnx's reference implementation
# ---------------------------------------------------------------------------------------------


def _opaque_infer(types, a):
    return TensorType(tuple(a["out_shape"]), a["out_dtype"])


def _opaque_ref(v, a):
    """Optional attrs: `inputs_present` (omitted optional inputs, e.g. Resize's roi, come back as None),
    `n_outputs` (the node's output count) and `opset` (the model's, so newer attributes are accepted)."""
    from .frontend.onnx import run_onnx_node
    vals = list(v)
    if "inputs_present" in a:
        it = iter(vals)
        vals = [next(it) if present else None for present in a["inputs_present"]]
    outs = run_onnx_node(a["onnx_op"], dict(a["onnx_attrs"]), vals, a.get("domain", ""), opset=a.get("opset", 17),
                         n_outputs=a.get("n_outputs"))
    return outs[a.get("out_index", 0)]


register(PrimDef("opaque", "opaque", -1, _opaque_infer, _opaque_ref, None, lambda ins, out, a: float(out.size),
                 lambda: ([_f32((2, 6))], {"onnx_op": "Hardmax", "onnx_attrs": (("axis", -1),), "out_index": 0,
                                           "out_shape": (2, 6), "out_dtype": "float32"})))
