"""Algebraic rewrites that remove arithmetic: a loaded ONNX graph -> an equivalent one with fewer FLOPs.

Fission keeps every operator's arithmetic; some models compute far more than their function needs.
The rules here move or merge *channel contractions* (1x1 convolutions and projections with constant
weights) where linear algebra says the result is the same and the FLOP count says it is cheaper, or
move an elementwise step to the side of a contraction where it touches fewer elements:

  split_concat     Conv1x1(Concat_c(x1, .., xn)) = sum_i Conv1x1_i(x_i)           (weight split by channel)
                   -- applied when some x_i is an upsampling Resize, so the next rule can move its part
  before_resize    Conv1x1(Resize(x)) = Resize(Conv1x1(x))                       (Resize linear/nearest,
                   spatial axes only, not downsampling: its weights sum to one per output, so even the
                   bias commutes) -- the contraction runs on the smaller image
  fold_projection  Conv1x1_W(Reshape(Transpose(x @ M + c))) = Reshape(Transpose(x @ (M W^T) + (W c + b)))
                   -- two contractions with nothing between them become one, when that costs fewer
                   multiply-adds per pixel (Cin*Cout < Cin*Cmid + Cmid*Cout)
  channels_first   Transpose(Transpose(x) @ M + c) = M^T @ x + c[:, None]      (perms (0, 2, 1))
                   -- the same FLOPs without the two transposes (each a strided pass over memory)
  after_attention  Softmax(x) @ V = (e @ V) / sum(e), e = exp(x - max(x))     (softmax over the last axis)
                   -- the normalization divides rows x N outputs instead of rows x K probabilities

The rules run in phases (PHASES), each to a fixed point. An FPN/SegFormer-style decode head (project each stage, upsample all to the finest, concatenate,
fuse with a 1x1 conv) is the pattern these were written for: SegFormer-B0's head goes from 9.1 to
0.5 GFLOP. Results differ from the original graph by float rounding only (sums reassociated);
`verify` checks the optimized executable against ONNX Runtime running the original model.

`rewrite(og)` returns a `Rewritten`: the new graph, the rewrites applied and the graph's contraction
FLOPs before and after (for the report); the input is not changed. Each rule sees one node and
either returns its replacement (with the FLOPs of what it replaces and of the replacement) or None.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from .frontend.onnx import OnnxGraph, OnnxNode
from .ir import TensorType


@dataclass(frozen=True)
class Applied:
    rule: str
    node: str                # the contraction rewritten
    flops_before: int        # of the nodes replaced
    flops_after: int         # of their replacement

    def to_json(self) -> dict:
        return {"rule": self.rule, "node": self.node, "flops_before": self.flops_before,
                "flops_after": self.flops_after}


@dataclass(frozen=True)
class Rewritten:
    graph: OnnxGraph
    applied: tuple[Applied, ...]
    flops_before: int        # MatMul and Conv FLOPs of the whole graph
    flops_after: int

    def to_json(self) -> dict:
        return {"applied": [a.to_json() for a in self.applied], "flops_before": self.flops_before,
                "flops_after": self.flops_after}


def summary(rewritten: dict) -> str:
    """One line for the plan printout and the report, from `Rewritten.to_json()`."""
    counts: dict[str, int] = {}
    for a in rewritten.get("applied", []):
        counts[a["rule"]] = counts.get(a["rule"], 0) + 1
    if not counts:
        return "none applied"
    rules = ", ".join(f"{k} x{v}" for k, v in counts.items())
    return (f"{rules}: contractions {rewritten['flops_before'] / 1e9:.2f} -> "
            f"{rewritten['flops_after'] / 1e9:.2f} GFLOP")


class _View:
    """The graph under rewrite: producers, consumers, constants and types; new names are unique."""

    def __init__(self, og: OnnxGraph):
        self.og = og
        self.nodes = list(og.nodes)
        self.constants = dict(og.constants)
        self.types = dict(og.types)
        self.taken = set(self.constants) | set(self.types) | {t for n in self.nodes for t in (*n.inputs, *n.outputs)}
        self.reindex()

    def reindex(self) -> None:
        self.producer = {t: n for n in self.nodes for t in n.outputs if t}
        self.readers: dict[str, int] = {}
        for n in self.nodes:
            for t in n.inputs:
                if t:
                    self.readers[t] = self.readers.get(t, 0) + 1
        for t in self.og.outputs:
            self.readers[t] = self.readers.get(t, 0) + 1

    def only_reader(self, t: str) -> bool:
        return self.readers.get(t, 0) == 1

    def made_by(self, t: str, op: str) -> OnnxNode | None:
        n = self.producer.get(t)
        return n if n is not None and n.op_type == op else None

    def shape(self, t: str) -> tuple[int, ...] | None:
        if t in self.constants:
            return tuple(int(d) for d in self.constants[t].shape)
        ty = self.types.get(t)
        return ty.shape if ty is not None and ty.static else None

    def name(self, base: str) -> str:
        k, out = 0, base
        while out in self.taken:
            k += 1
            out = f"{base}_{k}"
        self.taken.add(out)
        return out

    def const(self, base: str, value: np.ndarray) -> str:
        t = self.name(base)
        self.constants[t] = value
        self.types[t] = TensorType(tuple(int(d) for d in value.shape), str(value.dtype))
        return t

    def tensor(self, base: str, shape: tuple[int, ...], dtype: str = "float32") -> str:
        t = self.name(base)
        self.types[t] = TensorType(tuple(shape), dtype)
        return t


# ---------------------------------------------------------------------------------------------
# what the rules recognise
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Conv1x1:
    node: OnnxNode
    weight: np.ndarray       # [Cout, Cin]
    bias: np.ndarray | None  # [Cout]


def _conv1x1(v: _View, n: OnnxNode) -> _Conv1x1 | None:
    """A 2-D convolution that is a per-pixel channel contraction with constant weights."""
    if n.op_type != "Conv" or len(n.inputs) < 2 or n.inputs[1] not in v.constants:
        return None
    w = v.constants[n.inputs[1]]
    if w.ndim != 4 or w.shape[2:] != (1, 1) or w.dtype != np.float32:
        return None
    a = n.attrs
    if int(a.get("group", 1)) != 1 or any(int(s) != 1 for s in a.get("strides", [1, 1])):
        return None
    if any(int(p) != 0 for p in a.get("pads", [0] * 4)) or a.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    bias = None
    if len(n.inputs) > 2 and n.inputs[2]:
        if n.inputs[2] not in v.constants:
            return None
        bias = v.constants[n.inputs[2]].astype(np.float32)
    if v.shape(n.inputs[0]) is None or v.shape(n.outputs[0]) is None:
        return None
    return _Conv1x1(n, w[:, :, 0, 0], bias)


@dataclass(frozen=True)
class _Projection:
    """t = x @ M (+ c): a MatMul by a constant 2-D float32 weight, and a constant bias of its
    columns or none, every intermediate read only here."""
    matmul: OnnxNode
    add: OnnxNode | None
    weight: np.ndarray       # [K, C]
    shift: np.ndarray | None  # [C]


def _projection(v: _View, t: str) -> _Projection | None:
    if not v.only_reader(t):
        return None
    add, shift, mm_out = v.made_by(t, "Add"), None, t
    if add is not None:
        consts = [i for i in add.inputs if i in v.constants]
        others = [i for i in add.inputs if i not in v.constants]
        if len(consts) != 1 or len(others) != 1 or not v.only_reader(others[0]):
            return None
        shift, mm_out = v.constants[consts[0]], others[0]
    mm = v.made_by(mm_out, "MatMul")
    if mm is None or mm.inputs[1] not in v.constants:
        return None
    m = v.constants[mm.inputs[1]]
    if m.ndim != 2 or m.dtype != np.float32:
        return None
    if shift is not None and (shift.ndim != 1 or shift.size != m.shape[1] or shift.dtype != np.float32):
        return None
    return _Projection(mm, add, m, shift)


def _pixels(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[2:])) * shape[0]


def _upsampling_resize(v: _View, n: OnnxNode | None) -> bool:
    """A Resize (linear or nearest) of the spatial axes of a rank-4 tensor that downsamples none."""
    if n is None or n.op_type != "Resize":
        return False
    a = n.attrs
    if a.get("mode", "nearest") not in ("linear", "nearest") or "axes" in a:
        return False
    if a.get("coordinate_transformation_mode", "half_pixel") == "tf_crop_and_resize":
        return False
    if a.get("keep_aspect_ratio_policy", "stretch") != "stretch":
        return False
    xs, ys = v.shape(n.inputs[0]), v.shape(n.outputs[0])
    if xs is None or ys is None or len(xs) != 4:
        return False
    return xs[:2] == ys[:2] and all(o >= i for i, o in zip(xs[2:], ys[2:]))


# ---------------------------------------------------------------------------------------------
# the rules: (view, node) -> (replacement nodes, flops before, flops after) or None
# ---------------------------------------------------------------------------------------------

Rewrite = tuple[list[OnnxNode], int, int]


def split_concat(v: _View, n: OnnxNode) -> Rewrite | None:
    c = _conv1x1(v, n)
    if c is None:
        return None
    cat = v.made_by(n.inputs[0], "Concat")
    if cat is None or not v.only_reader(n.inputs[0]) or int(cat.attrs.get("axis", 0)) not in (1, -3):
        return None
    parts = [t for t in cat.inputs if t]
    shapes = [v.shape(t) for t in parts]
    if any(s is None or len(s) != 4 for s in shapes) or sum(s[1] for s in shapes) != c.weight.shape[1]:
        return None
    if not any(_upsampling_resize(v, v.producer.get(t)) and v.only_reader(t) for t in parts):
        return None
    out_shape = v.shape(n.outputs[0])
    cout = c.weight.shape[0]
    new, partial, off = [], [], 0
    for t, s in zip(parts, shapes):
        w = c.weight[:, off:off + s[1]].reshape(cout, s[1], 1, 1).copy()
        off += s[1]
        y = v.tensor(f"{n.outputs[0]}/part", out_shape)
        new.append(OnnxNode(v.name(f"{n.name}/part"), "Conv", (t, v.const(f"{n.inputs[1]}/part", w)), (y,),
                            {"kernel_shape": [1, 1]}))
        partial.append(y)
    total = n.outputs[0]
    if c.bias is not None:
        total = v.tensor(f"{n.outputs[0]}/sum", out_shape)
    new.append(OnnxNode(v.name(f"{n.name}/sum"), "Sum", tuple(partial), (total,), {}))
    if c.bias is not None:
        b = v.const(f"{n.inputs[2]}/channel", c.bias.reshape(cout, 1, 1))
        new.append(OnnxNode(v.name(f"{n.name}/bias"), "Add", (total, b), (n.outputs[0],), {}))
    flops = 2 * _pixels(out_shape) * c.weight.size
    return new, flops, flops + (len(parts) - 1) * int(np.prod(out_shape))


def before_resize(v: _View, n: OnnxNode) -> Rewrite | None:
    c = _conv1x1(v, n)
    if c is None:
        return None
    r = v.producer.get(n.inputs[0])
    if not _upsampling_resize(v, r) or not v.only_reader(n.inputs[0]):
        return None
    x = r.inputs[0]
    xs, ys = v.shape(x), v.shape(n.outputs[0])
    mid = v.tensor(f"{n.outputs[0]}/small", (xs[0], ys[1], *xs[2:]))
    conv = replace(n, name=v.name(f"{n.name}/small"), inputs=(x, *n.inputs[1:]), outputs=(mid,))
    inputs = [mid, *r.inputs[1:]] + [""] * (4 - len(r.inputs))
    if inputs[3]:   # sizes: the channel count is now the conv's
        if inputs[3] not in v.constants:
            return None
        sizes = v.constants[inputs[3]].astype(np.int64).copy()
        sizes[1] = ys[1]
        inputs[3] = v.const(f"{inputs[3]}/conv", sizes)
    elif not inputs[2] or inputs[2] not in v.constants:
        return None
    resize = replace(r, name=v.name(f"{r.name}/after_conv"), inputs=tuple(inputs), outputs=(n.outputs[0],))
    before = 2 * _pixels(ys) * c.weight.size
    after = 2 * _pixels((xs[0], ys[1], *xs[2:])) * c.weight.size
    return [conv, resize], before, after


def fold_projection(v: _View, n: OnnxNode) -> Rewrite | None:
    c = _conv1x1(v, n)
    if c is None:
        return None
    reshape = v.made_by(n.inputs[0], "Reshape")
    if reshape is None or not v.only_reader(n.inputs[0]):
        return None
    tr = v.made_by(reshape.inputs[0], "Transpose")
    if tr is None or not v.only_reader(reshape.inputs[0]) or list(tr.attrs.get("perm", [])) != [0, 2, 1]:
        return None
    proj_out = tr.inputs[0]
    pr = _projection(v, proj_out)
    if pr is None:
        return None
    mm, m, shift = pr.matmul, pr.weight, pr.shift
    mm_out = mm.outputs[0]
    ps, ys = v.shape(proj_out), v.shape(n.inputs[0])
    if ps is None or ys is None or len(ps) != 3:
        return None
    c_in, c_mid = m.shape
    c_out = c.weight.shape[0]
    # the Reshape only splits the token axis into the image: [N, Cmid, T] -> [N, Cmid, H, W]
    if ys[:2] != (ps[0], c_mid) or int(np.prod(ys[2:])) != ps[1] or len(ys) != 4:
        return None
    if c_in * c_out >= c_in * c_mid + c_mid * c_out:
        return None
    w = c.weight.astype(np.float64)
    folded = (m.astype(np.float64) @ w.T).astype(np.float32)
    offset = None if shift is None else w @ shift.astype(np.float64)
    if c.bias is not None:
        offset = c.bias if offset is None else offset + c.bias
    tokens = ps[1] * ps[0]
    add2 = v.tensor(f"{proj_out}/folded", (*ps[:2], c_out))
    mm2 = add2 if offset is None else v.tensor(f"{mm_out}/folded", (*ps[:2], c_out))
    tr2 = v.tensor(f"{tr.outputs[0]}/folded", (ps[0], c_out, ps[1]))
    out_shape = (ps[0], c_out, *ys[2:])
    nodes = [OnnxNode(v.name(f"{mm.name}/folded"), "MatMul", (mm.inputs[0], v.const(f"{mm.inputs[1]}/folded", folded)),
                      (mm2,), {})]
    if offset is not None:   # the projection's bias through the conv, and the conv's own
        nodes.append(OnnxNode(v.name(f"{n.name}/folded_bias"), "Add",
                              (mm2, v.const(f"{n.name}/folded_bias", np.asarray(offset, np.float32))), (add2,), {}))
    nodes += [replace(tr, name=v.name(f"{tr.name}/folded"), inputs=(add2,), outputs=(tr2,)),
              replace(reshape, name=v.name(f"{reshape.name}/folded"),
                      inputs=(tr2, v.const(f"{reshape.inputs[1]}/folded", np.asarray(out_shape, np.int64))),
                      outputs=(n.outputs[0],))]
    return nodes, 2 * tokens * (c_in * c_mid + c_mid * c_out), 2 * tokens * c_in * c_out


def channels_first(v: _View, n: OnnxNode) -> Rewrite | None:
    """Transpose(MatMul(Transpose(x), M) + c) with both transposes (0, 2, 1): a channel contraction
    of a channels-first tensor x [N, K, P] taken through the token layout and back. As
    MatMul(M^T, x) + c[:, None] it reads and writes channels-first directly (rows: the C output
    channels, broadcast from the constant; columns: the P pixels, contiguous vectors): no transposes."""
    if n.op_type != "Transpose" or list(n.attrs.get("perm", [])) != [0, 2, 1]:
        return None
    pr = _projection(v, n.inputs[0])
    if pr is None or not v.only_reader(pr.matmul.inputs[0]):
        return None
    mm, m, shift, add = pr.matmul, pr.weight, pr.shift, pr.add
    mm_out = mm.outputs[0]
    tr = v.made_by(mm.inputs[0], "Transpose")
    if tr is None or list(tr.attrs.get("perm", [])) != [0, 2, 1]:
        return None
    xs, ys = v.shape(tr.inputs[0]), v.shape(n.outputs[0])
    if xs is None or ys is None or len(xs) != 3:
        return None
    k, c = m.shape
    mid = v.tensor(f"{mm_out}/channels_first", ys) if shift is not None else n.outputs[0]
    nodes = [OnnxNode(v.name(f"{mm.name}/channels_first"), "MatMul",
                      (v.const(f"{mm.inputs[1]}/T", np.ascontiguousarray(m.T)), tr.inputs[0]), (mid,), {})]
    if shift is not None:
        nodes.append(OnnxNode(v.name(f"{add.name}/channels_first"), "Add",
                              (mid, v.const(f"{add.name}/column", shift.reshape(c, 1))), (n.outputs[0],), {}))
    flops = 2 * int(np.prod(ys)) * k
    return nodes, flops, flops


def after_attention(v: _View, n: OnnxNode) -> Rewrite | None:
    """MatMul(Softmax(x), V) with the softmax over the axis the MatMul contracts (x's last) and read
    by the MatMul only: as MatMul(e, V) / sum(e), e = exp(x - max(x)), the normalization divides the
    product's rows (rows x N: an attention's head width) instead of the probabilities (rows x K: the
    keys), and the contraction reads e as it comes. Each output row has one divisor, so only the
    rounding differs. Where the softmax and the values are kernels of their own, that is a pass
    over seq x seq floats less (the transformer block's attention over seq=1..512 at 512, 6 heads
    of 64, Zen 2, 2 threads, in the executable: 4.36 -> 4.02 ms); end to end the executables ran
    0.98-1.04x their time before, side by side (plans re-measured: within their noise). A fused
    attention normalizes in its row tiles as before (kernorch.backends.tvm.lower)."""
    if n.op_type != "MatMul":
        return None
    sm = v.made_by(n.inputs[0], "Softmax")
    if sm is None or not v.only_reader(n.inputs[0]):
        return None
    x = sm.inputs[0]
    xs, ys = v.shape(x), v.shape(n.outputs[0])
    ty = v.types.get(x)
    if xs is None or ys is None or len(xs) < 2 or ty is None or ty.dtype != "float32":
        return None
    if int(sm.attrs.get("axis", -1)) % len(xs) != len(xs) - 1:   # (the frontend reads opset 13 and later)
        return None
    row = (*xs[:-1], 1)
    top, shifted, e, total = (v.tensor(f"{sm.name}/{t}", shape) for t, shape in
                              (("max", row), ("shifted", xs), ("exp", xs), ("sum", row)))
    inverse, product = v.tensor(f"{sm.name}/inverse", row), v.tensor(f"{n.name}/unnormalized", ys)
    nodes = [_reduce_last(v, "ReduceMax", x, top, len(xs)),
             OnnxNode(v.name(f"{sm.name}/sub"), "Sub", (x, top), (shifted,), {}),
             OnnxNode(v.name(f"{sm.name}/exp"), "Exp", (shifted,), (e,), {}),
             _reduce_last(v, "ReduceSum", e, total, len(xs)),
             OnnxNode(v.name(f"{sm.name}/reciprocal"), "Reciprocal", (total,), (inverse,), {}),
             OnnxNode(v.name(f"{n.name}/unnormalized"), "MatMul", (e, n.inputs[1]), (product,), {}),
             OnnxNode(v.name(f"{n.name}/normalized"), "Mul", (inverse, product), (n.outputs[0],), {})]
    flops = 2 * int(np.prod(ys)) * int(xs[-1])
    return nodes, flops, flops


def _reduce_last(v: _View, op: str, x: str, out: str, rank: int) -> OnnxNode:
    """`op` over the last axis of `x`, keeping it, in the form the graph's opset defines (the axes
    an input of ReduceSum, and of the others from opset 18; an attribute of those before)."""
    name = v.name(f"{out}/op")
    if op == "ReduceSum" or v.og.opset >= 18:
        return OnnxNode(name, op, (x, v.const(f"{out}/axes", np.array([rank - 1], np.int64))), (out,), {"keepdims": 1})
    return OnnxNode(name, op, (x,), (out,), {"axes": [rank - 1], "keepdims": 1})


# Phases, each run to a fixed point in turn: the contraction-moving rules first (fold_projection
# needs the token-layout projection that channels_first would remove).
PHASES: tuple[tuple[Callable[[_View, OnnxNode], Rewrite | None], ...], ...] = (
    (split_concat, before_resize, fold_projection), (channels_first,), (after_attention,))


def rewrite(og: OnnxGraph) -> Rewritten:
    """Apply the rules until none applies; the nodes and constants only the replaced nodes used go."""
    v = _View(og)
    flops = _contraction_flops(v)
    applied: list[Applied] = []
    for rules in PHASES:
        changed = True
        while changed:
            changed = False
            for i, n in enumerate(v.nodes):
                got = next(((rule, r) for rule in rules if (r := rule(v, n)) is not None), None)
                if got is None:
                    continue
                rule, (new, before, after) = got
                v.nodes[i:i + 1] = new
                _drop_dead(v)
                applied.append(Applied(rule.__name__, n.name, before, after))
                changed = True
                break
    if not applied:
        return Rewritten(og, (), flops, flops)
    used = {t for n in v.nodes for t in n.inputs} | set(og.outputs)
    constants = {k: a for k, a in v.constants.items() if k in used}
    new = replace(og, nodes=v.nodes, constants=constants, types=v.types)
    return Rewritten(new, tuple(applied), flops, _contraction_flops(v))


def _contraction_flops(v: _View) -> int:
    """2 x multiply-adds of the MatMul and Conv nodes of `v` whose shapes are known."""
    total = 0
    for n in v.nodes:
        if n.op_type not in ("MatMul", "Conv"):
            continue
        x, w, y = v.shape(n.inputs[0]), v.shape(n.inputs[1]), v.shape(n.outputs[0])
        if x is None or w is None or y is None:
            continue
        per_output = x[-1] if n.op_type == "MatMul" else int(np.prod(w[1:]))
        total += 2 * int(np.prod(y)) * int(per_output)
    return total


def _drop_dead(v: _View) -> None:
    """Remove the nodes whose outputs nobody reads any more (what a rewrite replaced), to a fixed
    point. The replacement sits where the node it replaces was and reads only what was computed
    before it, so the order stays topological."""
    while True:
        v.reindex()
        dead = {id(n) for n in v.nodes if not any(v.readers.get(t, 0) for t in n.outputs if t)}
        if not dead:
            return
        v.nodes = [n for n in v.nodes if id(n) not in dead]
