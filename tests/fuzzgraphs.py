"""Random ONNX graphs of the operators kernorch supports, for the fuzz suite (tests/test_fuzz.py).

`random_model(seed)` builds a small model from one seed: an image family (NCHW activations:
convolutions with random groups/strides/dilations/padding, pooling, resize, pad, channel concat
and split, normalisations, elementwise with broadcasting, reductions, transposes) or a sequence
family (3-D activations: matmul/Gemm with constant or activation operands, softmax, layer norm,
GELU, reshape/transpose of heads, slice, gather, concat, split, reductions). Shapes and
attributes are drawn within each operator's legal space; constants are random. The same seed
always gives the same model, so a failing example is reproduced from its seed alone.
"""
from __future__ import annotations

import random

import numpy as np
from onnx import TensorProto, helper, numpy_helper


class _Builder:
    def __init__(self, rng: random.Random):
        self.rng = rng
        self.nodes, self.inits, self.n = [], [], 0
        self.ops: list[str] = []

    def name(self, tag: str) -> str:
        self.n += 1
        return f"{tag}{self.n}"

    def const(self, arr, tag="c") -> str:
        n = self.name(tag)
        self.inits.append(numpy_helper.from_array(np.asarray(arr), n))
        return n

    def weight(self, shape, scale=None) -> str:
        rs = np.random.default_rng(self.rng.getrandbits(32))
        fan = int(np.prod(shape[1:])) if len(shape) > 1 else int(shape[0])
        return self.const((rs.standard_normal(shape) / np.sqrt(max(fan, 1)) * (scale or 1.0)).astype(np.float32), "w")

    def node(self, op, inputs, n_out=1, **attrs):
        outs = [self.name(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, name=self.name(f"n_{op}_"), **attrs))
        self.ops.append(op)
        return outs[0] if n_out == 1 else outs


def _conv_out(n, k, s, p0, p1, d):
    return (n + p0 + p1 - (k - 1) * d - 1) // s + 1


def _image_step(b: _Builder, x: str, shape: list[int], pool: list) -> tuple[str, list[int]]:
    rng = b.rng
    n, c, h, w = shape
    op = rng.choice(["Conv", "Conv", "Conv", "Relu", "Sigmoid", "Add", "Mul", "MaxPool", "AveragePool",
                     "GlobalAveragePool", "Resize", "Pad", "Concat", "Split", "InstanceNormalization",
                     "BatchNormalization", "ReduceMean", "Transpose", "Softmax", "LeakyRelu", "Clip", "HardSwish"])
    if op == "Conv":
        k = rng.choice([1, 1, 3, 3, 5])
        s = rng.choice([1, 1, 2])
        dil = rng.choice([1, 1, 2]) if k > 1 else 1
        p = [rng.randint(0, k // 2 * dil) for _ in range(4)]
        groups = [g for g in (1, 2, 4, c) if c % g == 0]
        g = rng.choice(groups)
        oc = g * rng.choice([1, 2]) if g == c else rng.choice([4, 8, 16, 24, 32, 48])
        if oc % g:
            oc = g
        oh, ow = _conv_out(h, k, s, p[0], p[2], dil), _conv_out(w, k, s, p[1], p[3], dil)
        if oh < 1 or ow < 1:
            return x, shape
        ins = [x, b.weight((oc, c // g, k, k))]
        if rng.random() < 0.7:
            ins.append(b.const(np.asarray(np.random.default_rng(b.n).standard_normal(oc), np.float32), "bias"))
        return b.node("Conv", ins, kernel_shape=[k, k], strides=[s, s], pads=p, dilations=[dil, dil], group=g), \
            [n, oc, oh, ow]
    if op in ("Relu", "Sigmoid"):
        return b.node(op, [x]), shape
    if op == "HardSwish":
        return b.node(op, [x]), shape
    if op == "LeakyRelu":
        return b.node(op, [x], alpha=rng.choice([0.01, 0.1, 0.2])), shape
    if op == "Clip":
        lo, hi = sorted(rng.uniform(-2, 2) for _ in range(2))
        return b.node(op, [x, b.const(np.float32(lo)), b.const(np.float32(hi))]), shape
    if op in ("Add", "Mul"):
        same = [t for t, s in pool if s == shape and t != x]
        kind = rng.choice(["channel", "scalar", "same"] if same else ["channel", "scalar"])
        if kind == "same":
            other = rng.choice(same)
        elif kind == "channel":
            other = b.const(np.random.default_rng(b.n).standard_normal((c, 1, 1)).astype(np.float32))
        else:
            other = b.const(np.float32(rng.uniform(0.5, 1.5)))
        return b.node(op, [x, other] if rng.random() < 0.5 else [other, x]), shape
    if op in ("MaxPool", "AveragePool"):
        k, s = rng.choice([(2, 2), (3, 1), (3, 2)])
        p = rng.randint(0, k // 2)
        oh, ow = _conv_out(h, k, s, p, p, 1), _conv_out(w, k, s, p, p, 1)
        if oh < 1 or ow < 1:
            return x, shape
        attrs = dict(kernel_shape=[k, k], strides=[s, s], pads=[p] * 4)
        if op == "AveragePool":
            attrs["count_include_pad"] = rng.choice([0, 1])
        return b.node(op, [x], **attrs), [n, c, oh, ow]
    if op == "GlobalAveragePool":
        return b.node(op, [x]), [n, c, 1, 1]
    if op == "Resize" and h * w <= 400:
        scales = b.const(np.asarray([1, 1, 2, 2], np.float32))
        return b.node("Resize", [x, "", scales], mode="nearest"), [n, c, 2 * h, 2 * w]
    if op == "Pad":
        p = [0, 0, rng.randint(0, 2), rng.randint(0, 2), 0, 0, rng.randint(0, 2), rng.randint(0, 2)]
        mode = rng.choice(["constant", "reflect", "edge"]) if min(h, w) > 2 else "constant"
        return b.node("Pad", [x, b.const(np.asarray(p, np.int64))], mode=mode), [n, c, h + p[2] + p[6], w + p[3] + p[7]]
    if op == "Concat":
        others = [(t, s) for t, s in pool if s[0] == n and s[2:] == shape[2:]]
        t, s = rng.choice(others)
        return b.node("Concat", [x, t], axis=1), [n, c + s[1], h, w]
    if op == "Split" and c % 2 == 0:
        a, _ = b.node("Split", [x, b.const(np.asarray([c // 2, c // 2], np.int64))], n_out=2, axis=1)
        return a, [n, c // 2, h, w]
    if op == "InstanceNormalization":
        rs = np.random.default_rng(b.n)
        return b.node(op, [x, b.const(rs.uniform(0.5, 1.5, c).astype(np.float32)),
                           b.const(rs.standard_normal(c).astype(np.float32))], epsilon=1e-5), shape
    if op == "BatchNormalization":
        rs = np.random.default_rng(b.n)
        return b.node(op, [x] + [b.const(v.astype(np.float32)) for v in (rs.uniform(0.5, 1.5, c), rs.standard_normal(c),
                                                                          rs.standard_normal(c), rs.uniform(0.5, 2, c))],
                      epsilon=1e-5), shape
    if op == "ReduceMean":
        return b.node(op, [x], axes=[2, 3], keepdims=1), [n, c, 1, 1]  # opset 17: axes is an attribute
    if op == "Transpose":
        return b.node(op, [x], perm=[0, 1, 3, 2]), [n, c, w, h]
    if op == "Softmax":
        return b.node(op, [x], axis=1), shape
    return b.node("Relu", [x]), shape


def _sequence_step(b: _Builder, x: str, shape: list[int], pool: list) -> tuple[str, list[int]]:
    rng = b.rng
    n, s, d = shape
    op = rng.choice(["MatMul", "MatMul", "Gemm", "Add", "Softmax", "LayerNormalization", "Gelu", "Tanh", "Heads",
                     "Slice", "Gather", "Concat", "Split", "ReduceSum", "Mul", "Div", "Erf"])
    if op == "MatMul":
        nd = rng.choice([16, 32, 48, 64, 96])
        return b.node("MatMul", [x, b.weight((d, nd))]), [n, s, nd]
    if op == "Gemm":
        nd = rng.choice([16, 32, 64])
        flat = b.node("Reshape", [x, b.const(np.asarray([n * s, d], np.int64))])
        y = b.node("Gemm", [flat, b.weight((nd, d)), b.const(np.zeros(nd, np.float32) + 0.1)], transB=1,
                   alpha=rng.choice([1.0, 0.5]))
        return b.node("Reshape", [y, b.const(np.asarray([n, s, nd], np.int64))]), [n, s, nd]
    if op == "Heads" and d % 4 == 0:
        hd = d // 4
        q = b.node("Transpose", [b.node("Reshape", [x, b.const(np.asarray([n, s, 4, hd], np.int64))])],
                   perm=[0, 2, 1, 3])
        kt = b.node("Transpose", [q], perm=[0, 1, 3, 2])
        sc = b.node("Softmax", [b.node("MatMul", [q, kt])], axis=-1)
        o = b.node("MatMul", [sc, q])
        o = b.node("Reshape", [b.node("Transpose", [o], perm=[0, 2, 1, 3]), b.const(np.asarray([n, s, d], np.int64))])
        return o, shape
    if op in ("Add", "Mul", "Div"):
        same = [t for t, sh in pool if sh == shape and t != x]
        other = rng.choice(same) if same and rng.random() < 0.5 else \
            b.const((np.random.default_rng(b.n).uniform(0.5, 1.5, d)).astype(np.float32))
        if op == "Div":
            other = b.const((np.random.default_rng(b.n).uniform(0.5, 1.5, d)).astype(np.float32))
        return b.node(op, [x, other]), shape
    if op == "Softmax":
        return b.node(op, [x], axis=rng.choice([-1, 1])), shape
    if op == "LayerNormalization":
        rs = np.random.default_rng(b.n)
        return b.node(op, [x, b.const(rs.uniform(0.5, 1.5, d).astype(np.float32)),
                           b.const(rs.standard_normal(d).astype(np.float32))], axis=-1, epsilon=1e-5), shape
    if op == "Gelu":  # the exported erf pattern: 0.5 x (1 + erf(x / sqrt 2))
        e = b.node("Erf", [b.node("Div", [x, b.const(np.float32(np.sqrt(2.0)))])])
        return b.node("Mul", [b.node("Mul", [x, b.node("Add", [e, b.const(np.float32(1.0))])]),
                              b.const(np.float32(0.5))]), shape
    if op in ("Tanh", "Erf"):
        return b.node(op, [x]), shape
    if op == "Slice" and s > 2:
        a, e = sorted(rng.sample(range(s + 1), 2))
        return b.node("Slice", [x, b.const(np.asarray([a], np.int64)), b.const(np.asarray([e], np.int64)),
                                b.const(np.asarray([1], np.int64))]), [n, e - a, d]
    if op == "Gather":
        idx = np.asarray([rng.randrange(-s, s) for _ in range(rng.randint(1, s))], np.int64)
        return b.node("Gather", [x, b.const(idx)], axis=1), [n, len(idx), d]
    if op == "Concat":
        others = [(t, sh) for t, sh in pool if sh[0] == n and sh[2] == d]
        t, sh = rng.choice(others)
        return b.node("Concat", [x, t], axis=1), [n, s + sh[1], d]
    if op == "Split" and d % 2 == 0:
        a, _ = b.node("Split", [x, b.const(np.asarray([d // 2, d // 2], np.int64))], n_out=2, axis=2)
        return a, [n, s, d // 2]
    if op == "ReduceSum":
        return b.node(op, [x, b.const(np.asarray([-1], np.int64))], keepdims=1), [n, s, 1]
    return b.node("Relu", [x]), shape


def random_model(seed: int, max_ops: int = 5):
    """A random model (ModelProto) and the ONNX operators it uses."""
    rng = random.Random(seed)
    b = _Builder(rng)
    image = rng.random() < 0.5
    if image:
        shape = [1, rng.choice([3, 4, 8, 16, 32]), rng.randint(5, 14), rng.randint(5, 14)]
        step = _image_step
    else:
        shape = [1, rng.randint(2, 12), rng.choice([16, 24, 32, 64])]
        step = _sequence_step
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))]
    x, pool = "x", [("x", list(shape))]
    for _ in range(rng.randint(2, max_ops)):
        x, shape = step(b, x, shape, pool)
        pool.append((x, list(shape)))
    outputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, list(shape))]
    extra = [(t, s) for t, s in pool[1:-1] if t != x]
    if extra and rng.random() < 0.3:  # an interior tensor as a second output
        t, s = rng.choice(extra)
        outputs.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, list(s)))
    g = helper.make_graph(b.nodes, f"fuzz{seed}", inputs, outputs, b.inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m, sorted(set(b.ops))


def fuzz_options(db_path: str):
    """A tiny measurement budget: every kernel is still built, checked and timed once."""
    from kernorch.options import Options
    return Options(db_path=db_path, threads=1, max_kernel_size=3, repeats=1, min_repeat_ms=0.2, compare_untuned=0,
                   workers=2)


class Discard(Exception):
    """The graph is not a test of kernorch (ONNX Runtime rejects it, or its reference is not finite)."""


def check(seed: int, options) -> dict:
    """Optimize `random_model(seed)` end to end with `options` and compare every output with ONNX
    Runtime on inputs from the seed. Returns the log entry (seed, ops, outcome, kernels); raises
    Discard for a graph that tests nothing, and AssertionError (or kernorch's error) on a mismatch."""
    from kernorch import executor, pipeline

    model, ops = random_model(seed)
    feeds = executor.random_feeds(pipeline.load(model, options).graph, seed)
    try:
        sess = executor.ort_session(model, 1)
        ref = sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - ONNX Runtime rejects the graph: not a kernorch case
        raise Discard(f"rejected by ONNX Runtime: {str(e)[:200]}") from None
    if not all(np.isfinite(r).all() for r in ref):
        raise Discard("non-finite reference")
    compiled, planned = pipeline.optimize(model, options, runs=0)
    got = compiled.run(feeds)
    for o, r in zip(sess.get_outputs(), ref):
        err = executor.max_error(np.asarray(r), got[o.name])
        assert err["rel"] <= 1e-3, (seed, o.name, err)
    return {"seed": seed, "ops": ops, "outcome": "ok", "kernels": len(planned.plan.kernels),
            "blocked": sum(1 for k in planned.plan.kernels if k.schedule.startswith("b"))}
