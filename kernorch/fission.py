"""Operator fission: every ONNX operator becomes a few primitives of the table (kernorch.primitives).

One function per ONNX operator (the dispatch table `OPS`), each emitting prims through a `Builder`
that names new tensors uniquely after the ONNX node, infers their types with `primitives.infer`,
records the ONNX node as `origin` and keeps the small constants it needs (0.5, eps, gather indices)
in the graph's constants. The last prim of a node takes the ONNX output's name, so graph outputs
and intermediate values keep the names users (and ONNX Runtime) know.

Unlike Korch's three fission rules, softmax keeps its max-subtraction (large logits stay finite)
and works on any axis; normalisations are fissioned from their definition, not from an exporter's
pattern, and ops that cannot be expressed with primitives (TopK, ArgMax, ...) stay whole as opaque
prims evaluated by onnx's reference implementation.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Sequence

import numpy as np

from . import primitives
from .frontend.onnx import OnnxGraph, OnnxNode
from .ir import Graph, KernorchError, Prim, TensorType, make_prim

log = logging.getLogger(__name__)

# ONNX ops kept whole (one opaque prim per used output); their output shapes come from ONNX's
# shape inference and must be static.
OPAQUE_OPS = {"ArgMax", "ArgMin", "TopK", "NonMaxSuppression", "Hardmax", "CumSum", "GatherElements",
              "GatherND", "ScatterND", "ScatterElements", "OneHot", "Mod", "Trilu", "Range", "NonZero"}


def fission(og: OnnxGraph) -> Graph:
    """Fission a loaded ONNX graph into a primitive graph (validated, topologically ordered)."""
    _check_bound(og)
    b = Builder(og)
    for n in og.nodes:
        fn = OPS.get(n.op_type)
        if fn is None:
            raise KernorchError(f"{n.where(og.source)}: operator {n.op_type} is not supported by fission "
                                f"(supported: {', '.join(sorted(OPS))})")
        b.begin(n)
        outs = fn(b, n)
        b.bind(n, outs)
    return b.finish()


def _check_bound(og: OnnxGraph) -> None:
    """Kernels are built for static shapes: every symbolic input dimension must be bound by the user."""
    for name, t in og.inputs:
        free = [d for d in t.shape if isinstance(d, str)]
        if free:
            example = "x".join(str(d) if isinstance(d, int) else "N" for d in t.shape)
            raise KernorchError(f"{og.source}: input {name!r} has unbound symbolic dimension(s) "
                                f"{', '.join(map(repr, free))} (shape {t}); bind them with --shape {name}={example} "
                                f"(replace N by the size you will run with)")


class Builder:
    """Accumulates prims and constants; names, types and origins are handled here, once."""

    def __init__(self, og: OnnxGraph):
        self.og = og
        self.prims: list[Prim] = []
        self.types: dict[str, TensorType] = {n: t for n, t in og.inputs}
        self.constants: dict[str, np.ndarray] = dict(og.constants)
        for k, v in self.constants.items():
            self.types[k] = TensorType(tuple(int(d) for d in v.shape), str(v.dtype))
        self.alias: dict[str, str] = {}  # ONNX tensor -> the tensor that holds its value
        self.taken: set[str] = set(self.types) | {t for n in og.nodes for t in (*n.inputs, *n.outputs) if t}
        self.taken |= set(og.outputs)
        self._small: dict[tuple, str] = {}  # deduplicated small constants
        self.node: OnnxNode | None = None
        self._start = 0

    # -- naming and bookkeeping ----------------------------------------------------------------
    def begin(self, n: OnnxNode) -> None:
        self.node, self._start = n, len(self.prims)

    def fresh(self, tag: str) -> str:
        base = f"{self.node.name if self.node else 'fission'}/{tag}"
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def where(self) -> str:
        return self.node.where(self.og.source) if self.node else self.og.source

    def fail(self, msg: str) -> KernorchError:
        return KernorchError(f"{self.where()}: {msg}")

    # -- tensors --------------------------------------------------------------------------------
    def x(self, n: OnnxNode, k: int) -> str | None:
        """The k-th input of n (resolved through aliases), or None when omitted."""
        if k >= len(n.inputs) or not n.inputs[k]:
            return None
        t = n.inputs[k]
        return self.alias.get(t, t)

    def t(self, name: str) -> TensorType:
        return self.types[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.types[name].shape)

    def is_const(self, name: str | None) -> bool:
        return name is not None and name in self.constants

    def value(self, name: str | None, what: str = "input") -> np.ndarray:
        if not self.is_const(name):
            raise self.fail(f"{what} {name!r} must be a constant (known at compile time); kernorch builds "
                            "static-shape kernels")
        return self.constants[name]

    def const(self, arr, dtype=None, tag: str = "const") -> str:
        arr = np.asarray(arr, dtype=dtype)
        key = None
        if arr.size <= 64:
            key = (str(arr.dtype), arr.shape, arr.tobytes())
            if key in self._small:
                return self._small[key]
        name = self.fresh(tag)
        self.constants[name] = arr
        self.types[name] = TensorType(tuple(int(d) for d in arr.shape), str(arr.dtype))
        if key is not None:
            self._small[key] = name
        return name

    def scalar(self, v: float, like: str) -> str:
        return self.const(np.asarray(v, dtype=self.t(like).dtype), tag="scalar")

    def emit(self, op: str, inputs: Sequence[str], tag: str | None = None, **attrs) -> str:
        try:
            ty = primitives.infer(op, [self.types[i] for i in inputs], attrs)
        except KernorchError as e:
            raise self.fail(f"{op} primitive: {e}") from None
        name = self.fresh(tag or op)
        self.prims.append(make_prim(name, op, inputs, ty, origin=self.node.name if self.node else "", **attrs))
        self.types[name] = ty
        return name

    # -- common shapes of prims -----------------------------------------------------------------
    def reshape(self, x: str, shape: Sequence[int]) -> str:
        shape = tuple(int(d) for d in shape)
        if shape == self.shape(x):
            return x
        if self.is_const(x):
            return self.const(self.constants[x].reshape(shape), tag="reshaped")
        return self.emit("reshape", [x], shape=shape)

    def transpose(self, x: str, perm: Sequence[int]) -> str:
        perm = tuple(int(p) for p in perm)
        if perm == tuple(range(len(perm))):
            return x
        if self.is_const(x):
            return self.const(np.ascontiguousarray(np.transpose(self.constants[x], perm)), tag="transposed")
        return self.emit("transpose", [x], perm=perm)

    def channel(self, v: str, rank: int, axis: int = 1) -> str:
        """A per-channel vector (C,) shaped to broadcast against a rank-`rank` tensor along `axis`."""
        return self.reshape(v, (self.t(v).size,) + (1,) * (rank - axis - 1))

    # -- binding ONNX outputs -------------------------------------------------------------------
    def bind(self, n: OnnxNode, outs) -> None:
        if isinstance(outs, str) or outs is None:
            outs = [outs]
        mine = {p.name for p in self.prims[self._start:]}
        rename: dict[str, str] = {}
        for onnx_name, res in zip(n.outputs, outs):
            if not onnx_name:
                continue
            if res is None:
                raise self.fail(f"output {onnx_name!r} is not supported by fission")
            if res in mine and res not in rename:
                rename[res] = onnx_name
            else:
                self.alias[onnx_name] = rename.get(res, res)
        if rename:
            tail = []
            for p in self.prims[self._start:]:
                ins = tuple(rename.get(i, i) for i in p.inputs)
                tail.append(Prim(rename.get(p.name, p.name), p.op, ins, p.attrs, p.type, p.origin))
            self.prims[self._start:] = tail
            for old, new in rename.items():
                self.types[new] = self.types.pop(old)
        for onnx_name in n.outputs:
            if onnx_name:
                self._check_type(onnx_name, self.types[self.alias.get(onnx_name, onnx_name)])

    def _check_type(self, onnx_name: str, got: TensorType) -> None:
        want = self.og.types.get(onnx_name)
        if want is None or not want.static:
            return
        if tuple(want.shape) != tuple(got.shape) or want.dtype != got.dtype:
            # a warning, not an error: onnx's shape inference lags ONNX Runtime on some rules (e.g. the
            # ceil_mode pooling window that starts in the end padding is dropped by ORT, not by onnx 1.23)
            log.warning("%s: fission gives %r the type %s, ONNX shape inference says %s", self.where(), onnx_name,
                        got, want)

    def finish(self) -> Graph:
        outputs = []
        for o in self.og.outputs:
            src = self.alias.get(o, o)
            if src != o or src in self.constants or src in dict(self.og.inputs) or src in outputs:
                # the output's value lives under another name (Identity, no-op Reshape, an input):
                # a copy gives it the name users and ONNX Runtime know
                name = o if o not in self.types else self.fresh("output_copy")
                self.prims.append(make_prim(name, "reshape", [src], self.types[src], origin="output",
                                            shape=self.shape(src)))
                self.types[name] = self.types[src]
                src = name
            outputs.append(src)
        used = {i for p in self.prims for i in p.inputs}
        consts = {k: v for k, v in self.constants.items() if k in used}
        g = Graph(tuple(self.og.inputs), tuple(outputs), tuple(self.prims), consts, name=_stem(self.og.source))
        g.validate()
        return g


def _stem(source: str) -> str:
    return source.rsplit("/", 1)[-1].removesuffix(".onnx") or "graph"


def _ax(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


OpFn = Callable[[Builder, OnnxNode], "str | list[str | None]"]
OPS: dict[str, OpFn] = {}


def op(*names: str):
    def deco(fn):
        for nm in names:
            OPS[nm] = fn
        return fn
    return deco


# ---------------------------------------------------------------------------------------------
# elementwise
# ---------------------------------------------------------------------------------------------

_UNARY = {"Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Reciprocal": "reciprocal", "Tanh": "tanh",
          "Erf": "erf", "Sigmoid": "sigmoid", "Relu": "relu", "Abs": "abs", "Floor": "floor", "Ceil": "ceil",
          "Round": "round", "Sin": "sin", "Cos": "cos", "Softplus": "softplus", "Not": "not"}
_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Equal": "equal", "Less": "less",
           "Greater": "greater", "And": "and", "Or": "or"}

for _o, _p in _UNARY.items():
    OPS[_o] = (lambda p: lambda b, n: b.emit(p, [b.x(n, 0)]))(_p)
for _o, _p in _BINARY.items():
    OPS[_o] = (lambda p: lambda b, n: b.emit(p, [b.x(n, 0), b.x(n, 1)]))(_p)


@op("Div")
def _div(b, n):
    """x / c by a float constant c (every element finite and nonzero, and so is its reciprocal) as
    x * (1 / c), the reciprocal rounded once: a vector division costs several multiplies, and the
    result differs by about an ulp (none where c is a power of two). The scaled scores of an
    attention (divided by sqrt(64), twice in the softmax's row kernel: for its max and its exp) and
    GELU's x / sqrt(2) are such divisions."""
    x, y = b.x(n, 0), b.x(n, 1)
    if b.is_const(y):
        c = b.value(y)
        if c.dtype.kind == "f" and c.size and np.all(np.isfinite(c)) and np.all(c != 0):
            with np.errstate(over="ignore"):
                inverse = (1.0 / c.astype(np.float64)).astype(c.dtype)
            if np.all(np.isfinite(inverse)) and np.all(inverse != 0):
                return b.emit("mul", [x, b.const(inverse, tag="reciprocal")])
    return b.emit("div", [x, y])


@op("LessOrEqual", "GreaterOrEqual")
def _cmp_or_equal(b, n):
    # x <= y is not (x > y) (and x >= y is not (x < y)); equal for all non-NaN inputs
    flip = "greater" if n.op_type == "LessOrEqual" else "less"
    return b.emit("not", [b.emit(flip, [b.x(n, 0), b.x(n, 1)])])


@op("Xor")
def _xor(b, n):
    x, y = b.x(n, 0), b.x(n, 1)
    return b.emit("and", [b.emit("or", [x, y]), b.emit("not", [b.emit("and", [x, y])])])


@op("Pow")
def _pow(b, n):
    x, y = b.x(n, 0), b.x(n, 1)
    if b.is_const(y) and b.constants[y].size == 1:
        e = float(b.constants[y].reshape(()))
        if e == 1.0:
            return x
        if e == 2.0:  # exporters write x**2 (variance, GELU-tanh's x**3): exact and cheap as products
            return b.emit("mul", [x, x])
        if e == 3.0:
            return b.emit("mul", [b.emit("mul", [x, x]), x])
        if e == 0.5:
            return b.emit("sqrt", [x])
        if e == -1.0:
            return b.emit("reciprocal", [x])
    if b.t(y).dtype != b.t(x).dtype:
        y = b.const(b.constants[y].astype(b.t(x).dtype)) if b.is_const(y) else b.emit("cast", [y], to=b.t(x).dtype)
    return b.emit("pow", [x, y])


@op("Max", "Min", "Sum", "Mean")
def _variadic(b, n):
    p = {"Max": "max", "Min": "min", "Sum": "add", "Mean": "add"}[n.op_type]
    ins = [b.x(n, k) for k in range(len(n.inputs)) if b.x(n, k)]
    acc = ins[0]
    for other in ins[1:]:
        acc = b.emit(p, [acc, other])
    if n.op_type == "Mean" and len(ins) > 1:
        acc = b.emit("div", [acc, b.scalar(len(ins), acc)])
    return acc


@op("Where")
def _where(b, n):
    return b.emit("where", [b.x(n, 0), b.x(n, 1), b.x(n, 2)])


@op("Cast", "CastLike")
def _cast(b, n):
    x = b.x(n, 0)
    if n.op_type == "Cast":
        import onnx
        to = str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(n.attrs["to"])))
    else:
        to = b.t(b.x(n, 1)).dtype
    if to == b.t(x).dtype:
        return x
    return b.emit("cast", [x], to=to)


@op("Identity")
def _identity(b, n):
    return b.x(n, 0)


@op("Dropout")
def _dropout(b, n):
    """Inference: the identity; the optional mask output is all true."""
    x = b.x(n, 0)
    outs = [x]
    if len(n.outputs) > 1 and n.outputs[1]:
        outs.append(b.const(np.ones(b.shape(x), dtype=bool), tag="mask"))
    return outs


@op("LeakyRelu")
def _leaky_relu(b, n):
    x = b.x(n, 0)
    alpha = float(n.attrs.get("alpha", 0.01))
    scaled = b.emit("mul", [x, b.scalar(alpha, x)])
    if 0.0 <= alpha <= 1.0:  # max(x, a*x) is exact for 0 <= a <= 1
        return b.emit("max", [x, scaled])
    return b.emit("where", [b.emit("less", [x, b.scalar(0, x)]), scaled, x])


@op("PRelu")
def _prelu(b, n):
    x, slope = b.x(n, 0), b.x(n, 1)
    neg = b.emit("less", [x, b.scalar(0, x)])
    return b.emit("where", [neg, b.emit("mul", [x, slope]), x])


@op("Elu", "Selu", "Celu")
def _elu(b, n):
    """Exponential linear units: x > 0 ? x : alpha*(exp(x/c) - 1) (Selu scales both sides by gamma)."""
    x = b.x(n, 0)
    alpha = float(n.attrs.get("alpha", {"Elu": 1.0, "Selu": 1.67326319217681884765625, "Celu": 1.0}[n.op_type]))
    xin = x if n.op_type != "Celu" or alpha == 1.0 else b.emit("div", [x, b.scalar(alpha, x)])
    em1 = b.emit("sub", [b.emit("exp", [xin]), b.scalar(1.0, x)])
    neg = b.emit("mul", [em1, b.scalar(alpha, x)])
    y = b.emit("where", [b.emit("greater", [x, b.scalar(0, x)]), x, neg])
    if n.op_type == "Selu":
        y = b.emit("mul", [y, b.scalar(float(n.attrs.get("gamma", 1.05070102214813232421875)), x)])
    return y


@op("ThresholdedRelu")
def _thresholded_relu(b, n):
    x = b.x(n, 0)
    alpha = float(n.attrs.get("alpha", 1.0))
    return b.emit("where", [b.emit("greater", [x, b.scalar(alpha, x)]), x, b.scalar(0, x)])


@op("Clip")
def _clip(b, n):
    """min/max come from inputs (opset >= 11) or attributes (older exports); either may be absent."""
    x = b.x(n, 0)
    lo, hi = b.x(n, 1), b.x(n, 2)
    if lo is None and "min" in n.attrs:
        lo = b.scalar(n.attrs["min"], x)
    if hi is None and "max" in n.attrs:
        hi = b.scalar(n.attrs["max"], x)
    y = x
    if lo is not None:
        y = b.emit("max", [y, lo])
    if hi is not None:
        y = b.emit("min", [y, hi])
    return y


def _hard_sigmoid(b, x, alpha, beta):
    y = b.emit("add", [b.emit("mul", [x, b.scalar(alpha, x)]), b.scalar(beta, x)])
    return b.emit("min", [b.emit("max", [y, b.scalar(0.0, x)]), b.scalar(1.0, x)])


@op("HardSigmoid")
def _hardsigmoid(b, n):
    return _hard_sigmoid(b, b.x(n, 0), float(n.attrs.get("alpha", 0.2)), float(n.attrs.get("beta", 0.5)))


@op("HardSwish")
def _hardswish(b, n):
    x = b.x(n, 0)
    return b.emit("mul", [x, _hard_sigmoid(b, x, 1.0 / 6.0, 0.5)])


@op("Mish")
def _mish(b, n):
    x = b.x(n, 0)
    return b.emit("mul", [x, b.emit("tanh", [b.emit("softplus", [x])])])


@op("Softsign")
def _softsign(b, n):
    x = b.x(n, 0)
    return b.emit("div", [x, b.emit("add", [b.emit("abs", [x]), b.scalar(1.0, x)])])


@op("Gelu")
def _gelu(b, n):
    """Opset-20 Gelu: 0.5·x·(1 + erf(x/√2)), or the tanh approximation."""
    x = b.x(n, 0)
    if n.attrs.get("approximate", "none") == "tanh":
        cube = b.emit("mul", [b.emit("mul", [x, x]), x])
        inner = b.emit("add", [x, b.emit("mul", [cube, b.scalar(0.044715, x)])])
        t = b.emit("tanh", [b.emit("mul", [inner, b.scalar(math.sqrt(2.0 / math.pi), x)])])
    else:
        t = b.emit("erf", [b.emit("mul", [x, b.scalar(1.0 / math.sqrt(2.0), x)])])
    half = b.emit("mul", [x, b.scalar(0.5, x)])
    return b.emit("mul", [half, b.emit("add", [t, b.scalar(1.0, x)])])


# ---------------------------------------------------------------------------------------------
# softmax and normalisations
# ---------------------------------------------------------------------------------------------

def _stable_exp(b, x, axis):
    """exp(x - max(x)) and its sum along `axis`: the max-subtraction Korch dropped keeps it finite."""
    m = b.emit("reduce_max", [x], axes=(axis,), keepdims=1)
    d = b.emit("sub", [x, m])
    e = b.emit("exp", [d])
    return d, e, b.emit("reduce_sum", [e], axes=(axis,), keepdims=1)


@op("Softmax")
def _softmax(b, n):
    x = b.x(n, 0)
    _, e, s = _stable_exp(b, x, _ax(int(n.attrs.get("axis", -1)), b.t(x).rank))
    return b.emit("div", [e, s])


@op("LogSoftmax")
def _log_softmax(b, n):
    x = b.x(n, 0)
    d, _, s = _stable_exp(b, x, _ax(int(n.attrs.get("axis", -1)), b.t(x).rank))
    return b.emit("sub", [d, b.emit("log", [s])])


def _normalize(b, x, axes, eps):
    """(x - mean) / sqrt(var + eps) over `axes`; returns (y, mean, std)."""
    mean = b.emit("reduce_mean", [x], axes=tuple(axes), keepdims=1)
    d = b.emit("sub", [x, mean])
    var = b.emit("reduce_mean", [b.emit("mul", [d, d])], axes=tuple(axes), keepdims=1)
    std = b.emit("sqrt", [b.emit("add", [var, b.scalar(eps, x)])])
    return b.emit("div", [d, std]), mean, std


@op("LayerNormalization")
def _layer_norm(b, n):
    x, scale, bias = b.x(n, 0), b.x(n, 1), b.x(n, 2)
    r = b.t(x).rank
    axis = _ax(int(n.attrs.get("axis", -1)), r)
    y, mean, std = _normalize(b, x, range(axis, r), float(n.attrs.get("epsilon", 1e-5)))
    y = b.emit("mul", [y, scale])
    if bias is not None:
        y = b.emit("add", [y, bias])
    outs = [y]
    if len(n.outputs) > 1 and n.outputs[1]:
        outs.append(mean)
    if len(n.outputs) > 2 and n.outputs[2]:
        outs += [None] * (2 - len(outs)) + [b.emit("reciprocal", [std])]
    return outs


@op("InstanceNormalization")
def _instance_norm(b, n):
    x, scale, bias = b.x(n, 0), b.x(n, 1), b.x(n, 2)
    r = b.t(x).rank
    y, _, _ = _normalize(b, x, range(2, r), float(n.attrs.get("epsilon", 1e-5)))
    y = b.emit("mul", [y, b.channel(scale, r)])
    return b.emit("add", [y, b.channel(bias, r)])


@op("GroupNormalization")
def _group_norm(b, n):
    """Normalise over (C/G, spatial) per group; scale/bias are per channel (opset 21) or per group (18)."""
    x, scale, bias = b.x(n, 0), b.x(n, 1), b.x(n, 2)
    shape = b.shape(x)
    g = int(n.attrs["num_groups"])
    c = shape[1]
    grouped = b.reshape(x, (shape[0], g, int(np.prod(shape[1:])) // g))
    y, _, _ = _normalize(b, grouped, (2,), float(n.attrs.get("epsilon", 1e-5)))
    y = b.reshape(y, shape)

    def per_channel(v):
        if b.t(v).size == g and g != c:
            v = b.const(np.repeat(b.value(v, "GroupNormalization scale/bias"), c // g))
        return b.channel(v, len(shape))

    y = b.emit("mul", [y, per_channel(scale)])
    return b.emit("add", [y, per_channel(bias)])


@op("BatchNormalization")
def _batch_norm(b, n):
    """Inference batch norm folds into one per-channel scale and shift."""
    if n.attrs.get("training_mode", 0):
        raise b.fail("BatchNormalization with training_mode=1 is not supported (inference only)")
    x = b.x(n, 0)
    r = b.t(x).rank
    eps = float(n.attrs.get("epsilon", 1e-5))
    scale, bias, mean, var = (b.x(n, k) for k in range(1, 5))
    if all(b.is_const(v) for v in (scale, bias, mean, var)):
        s = b.constants[scale] / np.sqrt(b.constants[var] + eps)
        shift = b.constants[bias] - b.constants[mean] * s
        dt = b.t(x).dtype
        s, shift = b.const(s.astype(dt), tag="bn_scale"), b.const(shift.astype(dt), tag="bn_shift")
        return b.emit("add", [b.emit("mul", [x, b.channel(s, r)]), b.channel(shift, r)])
    std = b.emit("sqrt", [b.emit("add", [b.channel(var, r), b.scalar(eps, x)])])
    y = b.emit("div", [b.emit("sub", [x, b.channel(mean, r)]), std])
    return b.emit("add", [b.emit("mul", [y, b.channel(scale, r)]), b.channel(bias, r)])


# ---------------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------------

def _reduce_axes(b, n, rank):
    """Axes from the attribute (older opsets) or the second input (ReduceSum >= 13, others >= 18)."""
    axes = n.attrs.get("axes")
    if len(n.inputs) > 1 and n.inputs[1]:
        axes = b.value(b.x(n, 1), "axes").reshape(-1).tolist()
    if not axes:
        return None if n.attrs.get("noop_with_empty_axes", 0) else tuple(range(rank))
    return tuple(sorted(_ax(int(a), rank) for a in axes))


@op("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare",
    "ReduceLogSum", "ReduceLogSumExp")
def _reduce(b, n):
    x = b.x(n, 0)
    axes = _reduce_axes(b, n, b.t(x).rank)
    if axes is None:
        return x
    kd = int(n.attrs.get("keepdims", 1))
    kind = n.op_type
    simple = {"ReduceMean": "reduce_mean", "ReduceSum": "reduce_sum", "ReduceMax": "reduce_max",
              "ReduceMin": "reduce_min", "ReduceProd": "reduce_prod"}
    if kind in simple:
        return b.emit(simple[kind], [x], axes=axes, keepdims=kd)
    if kind == "ReduceL1":
        return b.emit("reduce_sum", [b.emit("abs", [x])], axes=axes, keepdims=kd)
    if kind in ("ReduceL2", "ReduceSumSquare"):
        s = b.emit("reduce_sum", [b.emit("mul", [x, x])], axes=axes, keepdims=kd)
        return b.emit("sqrt", [s]) if kind == "ReduceL2" else s
    if kind == "ReduceLogSum":
        return b.emit("log", [b.emit("reduce_sum", [x], axes=axes, keepdims=kd)])
    # ReduceLogSumExp, stable: m + log(sum(exp(x - m)))
    m = b.emit("reduce_max", [x], axes=axes, keepdims=1)
    s = b.emit("reduce_sum", [b.emit("exp", [b.emit("sub", [x, m])])], axes=axes, keepdims=kd)
    return b.emit("add", [b.emit("log", [s]), b.reshape(m, b.shape(s))])


# ---------------------------------------------------------------------------------------------
# linear: MatMul, Gemm, Conv, ConvTranspose, Einsum
# ---------------------------------------------------------------------------------------------

@op("MatMul")
def _matmul(b, n):
    """1-D operands follow numpy: promoted to a matrix by reshape, the added dimension removed after."""
    a, w = b.x(n, 0), b.x(n, 1)
    sa, sw = b.shape(a), b.shape(w)
    if len(sa) == 1:
        a = b.reshape(a, (1, sa[0]))
    if len(sw) == 1:
        w = b.reshape(w, (sw[0], 1))
    y = b.emit("matmul", [a, w])
    out = list(b.shape(y))
    if len(sw) == 1:
        out.pop(-1)
    if len(sa) == 1:
        out.pop(-2 if len(sw) != 1 else -1)
    return b.reshape(y, out)


@op("Gemm")
def _gemm(b, n):
    """alpha·op(A)·op(B) + beta·C; transposes and scalings of constant operands fold into the weights."""
    a, w, c = b.x(n, 0), b.x(n, 1), b.x(n, 2)
    alpha, beta = float(n.attrs.get("alpha", 1.0)), float(n.attrs.get("beta", 1.0))
    if n.attrs.get("transA", 0):
        a = b.transpose(a, (1, 0))
    if n.attrs.get("transB", 0):
        w = b.transpose(w, (1, 0))
    if alpha != 1.0 and b.is_const(w):
        w, alpha = b.const((b.constants[w] * alpha).astype(b.constants[w].dtype), tag="alpha_B"), 1.0
    y = b.emit("matmul", [a, w])
    if alpha != 1.0:
        y = b.emit("mul", [y, b.scalar(alpha, y)])
    if c is not None and beta != 0.0:
        if beta != 1.0:
            c = (b.const((b.constants[c] * beta).astype(b.constants[c].dtype), tag="beta_C") if b.is_const(c)
                 else b.emit("mul", [c, b.scalar(beta, c)]))
        y = b.emit("add", [y, c])
    return y


def _auto_pads(b, n, in_sp, kernel, strides, dilations):
    sp = len(kernel)
    mode = n.attrs.get("auto_pad", "NOTSET")
    if mode in ("NOTSET", ""):
        return tuple(int(p) for p in n.attrs.get("pads", [0] * (2 * sp)))
    if mode == "VALID":
        return (0,) * (2 * sp)
    begin, end = [], []
    for i in range(sp):
        out = -(-in_sp[i] // strides[i])
        total = max(0, (out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - in_sp[i])
        lo = total // 2 if mode == "SAME_UPPER" else total - total // 2
        begin.append(lo)
        end.append(total - lo)
    return tuple(begin + end)


def _window(b, n, x, kernel):
    sp = len(kernel)
    strides = tuple(int(s) for s in n.attrs.get("strides", [1] * sp))
    dilations = tuple(int(d) for d in n.attrs.get("dilations", [1] * sp))
    pads = _auto_pads(b, n, b.shape(x)[2:], kernel, strides, dilations)
    return strides, pads, dilations


@op("Conv")
def _conv(b, n):
    x, w, bias = b.x(n, 0), b.x(n, 1), b.x(n, 2)
    kernel = tuple(int(k) for k in n.attrs.get("kernel_shape", b.shape(w)[2:]))
    strides, pads, dilations = _window(b, n, x, kernel)
    y = b.emit("conv", [x, w], strides=strides, pads=pads, dilations=dilations, group=int(n.attrs.get("group", 1)))
    if bias is not None:
        y = b.emit("add", [y, b.channel(bias, b.t(y).rank)])
    return y


@op("ConvTranspose")
def _conv_transpose(b, n):
    """The adjoint of a strided conv: insert stride-1 zeros between inputs (pad + reshape), pad by
    dilation·(k-1) - pad, and convolve with the flipped, channel-swapped weights (stride 1)."""
    x, w, bias = b.x(n, 0), b.x(n, 1), b.x(n, 2)
    wv = b.value(w, "ConvTranspose weight")
    xs = b.shape(x)
    sp = len(xs) - 2
    g = int(n.attrs.get("group", 1))
    k = tuple(int(v) for v in n.attrs.get("kernel_shape", wv.shape[2:]))
    s = tuple(int(v) for v in n.attrs.get("strides", [1] * sp))
    d = tuple(int(v) for v in n.attrs.get("dilations", [1] * sp))
    op_ = tuple(int(v) for v in n.attrs.get("output_padding", [0] * sp))
    pads = list(int(v) for v in n.attrs.get("pads", [0] * (2 * sp)))
    auto = n.attrs.get("auto_pad", "NOTSET")
    if "output_shape" in n.attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        target = (list(n.attrs["output_shape"])[-sp:] if "output_shape" in n.attrs
                  else [xs[2 + i] * s[i] for i in range(sp)])
        for i in range(sp):
            total = s[i] * (xs[2 + i] - 1) + op_[i] + (k[i] - 1) * d[i] + 1 - int(target[i])
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads[i], pads[i + sp] = lo, total - lo
    elif auto == "VALID":
        pads = [0] * (2 * sp)
    # 1. zero insertion
    if any(v > 1 for v in s):
        inter = [xs[0], xs[1]]
        for i in range(sp):
            inter += [xs[2 + i], 1]
        z = b.reshape(x, inter)
        zp = [0] * len(inter) + [0, 0] + [v for i in range(sp) for v in (0, s[i] - 1)]
        z = b.emit("pad", [z], pads=tuple(zp), mode="constant", value=0.0)
        z = b.reshape(z, [xs[0], xs[1]] + [xs[2 + i] * s[i] for i in range(sp)])
        x = b.emit("slice", [z], axes=tuple(range(2, 2 + sp)), begins=(0,) * sp,
                   ends=tuple((xs[2 + i] - 1) * s[i] + 1 for i in range(sp)), steps=(1,) * sp)
    # 2. padding (negative amounts crop)
    cp = [d[i % sp] * (k[i % sp] - 1) - pads[i] for i in range(2 * sp)]
    for i in range(sp):
        cp[sp + i] += op_[i]
    if any(v < 0 for v in cp):
        cur = b.shape(x)
        x = b.emit("slice", [x], axes=tuple(range(2, 2 + sp)), begins=tuple(max(0, -cp[i]) for i in range(sp)),
                   ends=tuple(cur[2 + i] - max(0, -cp[sp + i]) for i in range(sp)), steps=(1,) * sp)
        cp = [max(0, v) for v in cp]
    # 3. weights (C, M/g, *k) -> (M, C/g, *k), spatially flipped
    c, mg = wv.shape[:2]
    wt = wv.reshape((g, c // g, mg) + wv.shape[2:]).swapaxes(1, 2).reshape((g * mg, c // g) + wv.shape[2:])
    wt = np.ascontiguousarray(np.flip(wt, axis=tuple(range(2, 2 + sp))))
    y = b.emit("conv", [x, b.const(wt, tag="weight_t")], strides=(1,) * sp, pads=tuple(cp), dilations=d, group=g)
    if bias is not None:
        y = b.emit("add", [y, b.channel(bias, b.t(y).rank)])
    return y


@op("Einsum")
def _einsum(b, n):
    """Only the batched-matmul forms ('...ij,...jk->...ik', optionally with B transposed)."""
    eq = n.attrs.get("equation", "").replace(" ", "")
    try:
        lhs, out = eq.split("->")
        ea, eb = lhs.split(",")
    except ValueError:
        raise b.fail(f"Einsum {eq!r} is not supported (only batched matrix products are)") from None
    if "." not in eq and len(ea) >= 2 and len(eb) == len(ea) and len(out) == len(ea):
        p, (i, j) = ea[:-2], ea[-2:]
        if eb[:-2] == p and out[:-2] == p and len(set(ea + eb)) == len(p) + 3:
            kk = eb[-1] if eb[-2] == j else eb[-2]
            if eb[-2:] in (j + kk, kk + j) and out[-2:] == i + kk:
                a, w = b.x(n, 0), b.x(n, 1)
                if eb[-2:] == kk + j:
                    r = b.t(w).rank
                    w = b.transpose(w, tuple(range(r - 2)) + (r - 1, r - 2))
                return b.emit("matmul", [a, w])
    raise b.fail(f"Einsum {eq!r} is not supported (only batched matrix products are)")


# ---------------------------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------------------------

@op("MaxPool", "AveragePool")
def _pool(b, n):
    x = b.x(n, 0)
    kernel = tuple(int(k) for k in n.attrs["kernel_shape"])
    strides, pads, dilations = _window(b, n, x, kernel)
    mode = "max" if n.op_type == "MaxPool" else "avg"
    y = b.emit("pool", [x], mode=mode, kernel=kernel, strides=strides, pads=pads, dilations=dilations,
               ceil_mode=int(n.attrs.get("ceil_mode", 0)), count_include_pad=int(n.attrs.get("count_include_pad", 0)))
    outs: list = [y]
    if len(n.outputs) > 1 and n.outputs[1]:
        outs.append(_opaque(b, n, 1))
    return outs


@op("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(b, n):
    x = b.x(n, 0)
    p = "reduce_mean" if n.op_type == "GlobalAveragePool" else "reduce_max"
    return b.emit(p, [x], axes=tuple(range(2, b.t(x).rank)), keepdims=1)


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------

@op("Reshape")
def _reshape(b, n):
    x = b.x(n, 0)
    want = [int(v) for v in b.value(b.x(n, 1), "Reshape shape").reshape(-1)]
    shape = list(b.shape(x))
    allowzero = int(n.attrs.get("allowzero", 0))
    out = [shape[i] if (v == 0 and not allowzero) else v for i, v in enumerate(want)]
    if -1 in out:
        known = int(np.prod([v for v in out if v != -1]))
        out[out.index(-1)] = b.t(x).size // known if known else 0
    return b.reshape(x, out)


@op("Flatten")
def _flatten(b, n):
    x = b.x(n, 0)
    s = b.shape(x)
    axis = _ax(int(n.attrs.get("axis", 1)), len(s))
    return b.reshape(x, (int(np.prod(s[:axis])), int(np.prod(s[axis:]))))


def _axes_arg(b, n, k=1):
    if len(n.inputs) > k and n.inputs[k]:
        return [int(v) for v in b.value(b.x(n, k), "axes").reshape(-1)]
    return n.attrs.get("axes")


@op("Squeeze")
def _squeeze(b, n):
    x = b.x(n, 0)
    s = b.shape(x)
    axes = _axes_arg(b, n)
    drop = {_ax(int(a), len(s)) for a in axes} if axes else {i for i, d in enumerate(s) if d == 1}
    return b.reshape(x, [d for i, d in enumerate(s) if i not in drop])


@op("Unsqueeze")
def _unsqueeze(b, n):
    x = b.x(n, 0)
    s = list(b.shape(x))
    r = len(s) + len(_axes_arg(b, n))
    for a in sorted(_ax(int(a), r) for a in _axes_arg(b, n)):
        s.insert(a, 1)
    return b.reshape(x, s)


@op("Transpose")
def _transpose(b, n):
    x = b.x(n, 0)
    r = b.t(x).rank
    perm = n.attrs.get("perm") or list(range(r))[::-1]
    y = b.transpose(x, perm)
    return y


def _slice(b, x, axes, starts, ends, steps):
    """Normalise ONNX slice bounds (negative, clamped, INT_MAX) to the static ints the prim wants."""
    s = b.shape(x)
    spec = {}
    for a, st, en, sp in zip(axes, starts, ends, steps):
        a = _ax(int(a), len(s))
        dim, st, en, sp = s[a], int(st), int(en), int(sp)
        if sp == 0:
            raise b.fail("Slice step 0 is invalid")
        # the ONNX rule, not Python's: with a negative step a start below -dim clamps to 0 (Python: empty);
        # like ONNX Runtime, an INT_MAX end means "to the end" in either direction (numpy's None)
        if en in (2**63 - 1, 2**31 - 1):
            en = dim if sp > 0 else -1 - dim
        st, en = st + dim if st < 0 else st, en + dim if en < 0 else en
        if sp > 0:
            st, en = min(max(st, 0), dim), min(max(en, 0), dim)
        else:
            st, en = min(max(st, 0), dim - 1), min(max(en, -1), dim - 1)
        spec[a] = (st, en, sp) if len(range(st, en, sp)) else (0, 0, 1)
    if all(v == (0, s[a], 1) for a, v in spec.items()):
        return x
    ax = tuple(sorted(spec))
    return b.emit("slice", [x], axes=ax, begins=tuple(spec[a][0] for a in ax), ends=tuple(spec[a][1] for a in ax),
                  steps=tuple(spec[a][2] for a in ax))


@op("Slice")
def _slice_op(b, n):
    x = b.x(n, 0)
    starts = b.value(b.x(n, 1), "Slice starts").reshape(-1).tolist()
    ends = b.value(b.x(n, 2), "Slice ends").reshape(-1).tolist()
    axes = b.value(b.x(n, 3)).reshape(-1).tolist() if b.x(n, 3) else list(range(len(starts)))
    steps = b.value(b.x(n, 4)).reshape(-1).tolist() if b.x(n, 4) else [1] * len(starts)
    y = _slice(b, x, axes, starts, ends, steps)
    return y


@op("Split")
def _split(b, n):
    """Split → one slice per output (a prim computes exactly one tensor)."""
    x = b.x(n, 0)
    s = b.shape(x)
    axis = _ax(int(n.attrs.get("axis", 0)), len(s))
    if b.x(n, 1):
        sizes = [int(v) for v in b.value(b.x(n, 1), "Split sizes").reshape(-1)]
    elif "split" in n.attrs:
        sizes = [int(v) for v in n.attrs["split"]]
    else:
        k = int(n.attrs.get("num_outputs", len(n.outputs)))
        chunk = -(-s[axis] // k)
        sizes = [min(chunk, s[axis] - i * chunk) for i in range(k)]
    outs, off = [], 0
    for size in sizes:
        outs.append(_slice(b, x, [axis], [off], [off + size], [1]))
        off += size
    return outs


@op("Concat")
def _concat(b, n):
    ins = [b.x(n, k) for k in range(len(n.inputs)) if b.x(n, k)]
    ins = [t for t in ins if b.t(t).size > 0] or ins[:1]  # ONNX allows empty operands
    axis = _ax(int(n.attrs["axis"]), b.t(ins[0]).rank)
    if len(ins) == 1:
        return ins[0]
    return b.emit("concat", ins, axis=axis)


@op("Pad")
def _pad(b, n):
    x = b.x(n, 0)
    r = b.t(x).rank
    mode = n.attrs.get("mode", "constant")
    if mode not in ("constant", "reflect", "edge"):
        raise b.fail(f"Pad mode {mode!r} is not supported (constant, reflect, edge are)")
    raw = b.value(b.x(n, 1), "Pad pads").reshape(-1).tolist() if b.x(n, 1) else list(n.attrs.get("pads", []))
    axes = _axes_arg(b, n, 3) or list(range(r))
    axes = [_ax(int(a), r) for a in axes]
    pads = [0] * (2 * r)
    for i, a in enumerate(axes):
        pads[a], pads[a + r] = int(raw[i]), int(raw[i + len(axes)])
    value = 0.0
    if b.x(n, 2):
        value = float(b.value(b.x(n, 2), "Pad constant_value").reshape(()))
    elif "value" in n.attrs:
        value = float(n.attrs["value"])
    if any(p < 0 for p in pads):  # negative pads crop
        x = _slice(b, x, range(r), [max(0, -pads[i]) for i in range(r)],
                   [b.shape(x)[i] - max(0, -pads[i + r]) for i in range(r)], [1] * r)
        pads = [max(0, p) for p in pads]
    if not any(pads):
        return x
    return b.emit("pad", [x], pads=tuple(pads), mode=mode, value=value)


@op("Expand")
def _expand(b, n):
    x = b.x(n, 0)
    shape = tuple(int(v) for v in b.value(b.x(n, 1), "Expand shape").reshape(-1))
    out = primitives.broadcast_shape(b.shape(x), shape)
    if out == b.shape(x):
        return x
    return b.emit("expand", [x], shape=shape)


@op("Tile")
def _tile(b, n):
    """Tile = reshape to interleave unit axes, expand them to the repeats, reshape back."""
    x = b.x(n, 0)
    s = b.shape(x)
    reps = [int(v) for v in b.value(b.x(n, 1), "Tile repeats").reshape(-1)]
    if all(r == 1 for r in reps):
        return x
    inter = [v for d in s for v in (1, d)]
    big = [v for r, d in zip(reps, s) for v in (r, d)]
    y = b.emit("expand", [b.reshape(x, inter)], shape=tuple(big))
    return b.reshape(y, [r * d for r, d in zip(reps, s)])


@op("Gather")
def _gather(b, n):
    x, idx = b.x(n, 0), b.x(n, 1)
    s = b.shape(x)
    axis = _ax(int(n.attrs.get("axis", 0)), len(s))
    if b.is_const(idx):
        v = b.constants[idx].astype(np.int64)
        if v.size and (v.min() < -s[axis] or v.max() >= s[axis]):
            raise b.fail(f"Gather indices out of range for axis {axis} of size {s[axis]}")
        return b.emit("gather", [x, b.const(np.where(v < 0, v + s[axis], v), tag="indices")], axis=axis)
    # runtime indices (e.g. token ids into an embedding table): normalise negatives with prims
    if b.t(idx).dtype != "int64":
        idx = b.emit("cast", [idx], to="int64")
    zero, dim = b.const(np.int64(0)), b.const(np.int64(s[axis]))
    idx = b.emit("where", [b.emit("less", [idx, zero]), b.emit("add", [idx, dim]), idx])
    return b.emit("gather", [x, idx], axis=axis)


# ---------------------------------------------------------------------------------------------
# Resize / Upsample: gathers along each resized axis (+ weighted sums for linear)
# ---------------------------------------------------------------------------------------------

def _source_coords(mode, out_len, in_len, scale):
    """ONNX coordinate_transformation_mode, in float32 like ONNX Runtime."""
    o = np.arange(out_len, dtype=np.float32)
    sc = np.float32(scale)
    if mode == "half_pixel":
        return (o + np.float32(0.5)) / sc - np.float32(0.5)
    if mode == "pytorch_half_pixel":
        return (o + np.float32(0.5)) / sc - np.float32(0.5) if out_len > 1 else np.zeros_like(o)
    if mode == "align_corners":
        return (o * np.float32(in_len - 1) / np.float32(out_len - 1)) if out_len > 1 else np.zeros_like(o)
    if mode == "asymmetric":
        return o / sc
    if mode == "half_pixel_symmetric":
        adj = np.float32(out_len) / (sc * np.float32(in_len))
        off = np.float32(in_len) / np.float32(2) * (np.float32(1) - adj)
        return off + (o + np.float32(0.5)) / sc - np.float32(0.5)
    raise ValueError(mode)


def _round_away(v):
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _nearest(coords, mode):
    if mode == "round_prefer_floor":
        return np.where(coords == np.trunc(coords) + 0.5, np.floor(coords), _round_away(coords))
    if mode == "round_prefer_ceil":
        return _round_away(coords)
    if mode == "floor":
        return np.floor(coords)
    if mode == "ceil":
        return np.ceil(coords)
    raise ValueError(mode)


@op("Resize", "Upsample")
def _resize(b, n):
    x = b.x(n, 0)
    s = b.shape(x)
    r = len(s)
    a = n.attrs
    if n.op_type == "Upsample":
        scales_in, sizes_in, ctm = b.x(n, 1), None, "asymmetric"
        scales_in = scales_in if scales_in else None
        if scales_in is None and "scales" in a:
            scales_in = b.const(np.asarray(a["scales"], np.float32))
    else:
        scales_in, sizes_in = b.x(n, 2), b.x(n, 3)
        ctm = a.get("coordinate_transformation_mode", "half_pixel")
    mode = a.get("mode", "nearest")
    # Upsample (opset 7-9) is Resize with asymmetric coordinates and floor rounding
    nearest_mode = a.get("nearest_mode", "floor" if n.op_type == "Upsample" else "round_prefer_floor")
    axes = [_ax(int(v), r) for v in a.get("axes", range(r))]
    scales = [1.0] * r
    out = list(s)
    if sizes_in is not None and b.value(sizes_in).size:
        if a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
            return _opaque(b, n, 0)
        for ax, v in zip(axes, b.value(sizes_in, "Resize sizes").reshape(-1)):
            out[ax] = int(v)
            scales[ax] = float(np.float32(v) / np.float32(s[ax]))
    elif scales_in is not None:
        for ax, v in zip(axes, b.value(scales_in, "Resize scales").reshape(-1)):
            scales[ax] = float(v)
            out[ax] = int(np.floor(np.float32(s[ax]) * np.float32(v)))
    else:
        raise b.fail("Resize needs scales or sizes")
    downsampling = any(out[i] < s[i] for i in range(r))
    if (mode not in ("nearest", "linear") or ctm == "tf_crop_and_resize"
            or (a.get("antialias", 0) and downsampling and mode == "linear")):
        log.info("%s: Resize mode %s / %s kept whole as an opaque primitive", b.where(), mode, ctm)
        return _opaque(b, n, 0)
    y = x
    for ax in range(r):
        if out[ax] == s[ax] and scales[ax] == 1.0:
            continue
        coords = _source_coords(ctm, out[ax], s[ax], scales[ax])
        if mode == "nearest":
            idx = np.clip(_nearest(coords, nearest_mode), 0, s[ax] - 1).astype(np.int64)
            if out[ax] == s[ax] and np.array_equal(idx, np.arange(s[ax])):
                continue
            y = b.emit("gather", [y, b.const(idx, tag=f"nearest{ax}")], axis=ax)
            continue
        c = np.clip(coords, 0, s[ax] - 1)
        i0 = np.floor(c).astype(np.int64)
        i1 = np.minimum(i0 + 1, s[ax] - 1)
        frac = (c - i0).astype(b.t(x).dtype)
        if out[ax] == s[ax] and np.array_equal(i0, np.arange(s[ax])) and not frac.any():
            continue
        wshape = [1] * r
        wshape[ax] = out[ax]
        g0 = b.emit("gather", [y, b.const(i0, tag=f"lo{ax}")], axis=ax)
        g1 = b.emit("gather", [y, b.const(i1, tag=f"hi{ax}")], axis=ax)
        w0 = b.const((1 - frac).reshape(wshape), tag=f"w_lo{ax}")
        w1 = b.const(frac.reshape(wshape), tag=f"w_hi{ax}")
        y = b.emit("add", [b.emit("mul", [g0, w0]), b.emit("mul", [g1, w1])])
    return y


# ---------------------------------------------------------------------------------------------
# opaque operators
# ---------------------------------------------------------------------------------------------

def _opaque(b: Builder, n: OnnxNode, k: int) -> str:
    """Keep node `n` whole; this prim computes its k-th output (types from ONNX shape inference)."""
    t = b.og.types.get(n.outputs[k])
    if t is None or not t.static:
        raise b.fail(f"output {n.outputs[k]!r} has a data-dependent or unknown shape ({t}); kernorch needs "
                     "static shapes")
    present = tuple(bool(i) for i in n.inputs)
    ins = [b.x(n, j) for j in range(len(n.inputs)) if n.inputs[j]]
    return b.emit("opaque", ins, tag=f"opaque{k}", onnx_op=n.op_type, onnx_attrs=dict(n.attrs), out_index=k,
                  out_shape=tuple(t.shape), out_dtype=t.dtype, n_outputs=len(n.outputs), inputs_present=present,
                  opset=b.og.opset)


def _opaque_node(b, n):
    return [_opaque(b, n, k) if name else None for k, name in enumerate(n.outputs)]


for _o in OPAQUE_OPS:
    OPS[_o] = _opaque_node
