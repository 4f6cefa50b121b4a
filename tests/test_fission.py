"""Fission + the reference executor against ONNX Runtime: one-node models per decomposition (table
driven), the example models, the shared benchmark models, and every primitive's own example."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from kernorch import executor, primitives
from kernorch.examples import EXAMPLES, save_examples
from kernorch.fission import OPS, fission
from kernorch.frontend.onnx import load
from kernorch.ir import KernorchError, make_prim

F, I64, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def X(*shape, kind="f"):
    """A runtime input: kind f (normal), pos (in [0.5, 2]), i (int64 in [0, 4)), b (bool), big (logits ±1000)."""
    return ("in", tuple(shape), kind)


def W(*shape, seed=1):
    """A constant weight (initializer) with seeded random values."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def i64(*v):
    return np.array(v, np.int64)


def f32(*v):
    return np.array(v, np.float32)


def one_node(op, inputs, attrs=None, outs=(F,), opset=17):
    """A model with one node: tuples from X() are graph inputs, arrays initializers, None omitted."""
    names, g_in, inits = [], [], []
    for k, spec in enumerate(inputs):
        if spec is None:
            names.append("")
        elif isinstance(spec, tuple):
            elem = {"f": F, "pos": F, "big": F, "i": I64, "b": B}[spec[2]]
            names.append(f"x{k}")
            g_in.append(helper.make_tensor_value_info(f"x{k}", elem, list(spec[1])))
        else:
            names.append(f"c{k}")
            inits.append(numpy_helper.from_array(np.asarray(spec), f"c{k}"))
    out_names = [f"y{k}" for k in range(len(outs))]
    node = helper.make_node(op, names, out_names, name=f"the_{op}", **(attrs or {}))
    g = helper.make_graph([node], f"one_{op}", g_in,
                          [helper.make_tensor_value_info(n, e, None) for n, e in zip(out_names, outs)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8 if opset <= 17 else 9
    return m


def feeds_for(inputs, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for k, spec in enumerate(inputs):
        if not isinstance(spec, tuple):
            continue
        _, shape, kind = spec
        if kind == "f":
            v = rng.standard_normal(shape).astype(np.float32)
        elif kind == "pos":
            v = rng.uniform(0.5, 2.0, shape).astype(np.float32)
        elif kind == "big":
            v = (rng.standard_normal(shape) * 1000).astype(np.float32)
        elif kind == "i":
            v = rng.integers(0, 4, shape).astype(np.int64)
        else:
            v = rng.random(shape) < 0.5
        feeds[f"x{k}"] = v
    return feeds


def assert_matches_ort(model, feeds):
    sess = executor.ort_session(model, threads=1)
    names = [o.name for o in sess.get_outputs()]
    ref = dict(zip(names, sess.run(names, feeds)))
    graph = fission(load(model))
    for p in graph.prims:
        assert p.origin, p
    got = executor.run(graph, feeds)
    for name in names:
        r, g = np.asarray(ref[name]), got[name]
        assert g.shape == r.shape and g.dtype == r.dtype, (name, g.shape, g.dtype, r.shape, r.dtype)
        scale = float(np.abs(r).max()) if r.size and r.dtype.kind == "f" else 1.0
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * max(1.0, scale), err_msg=name)
    return graph


# (id, op, inputs, attrs, output types, opset)
CASES = []


def case(id, op, inputs, attrs=None, outs=(F,), opset=17):
    CASES.append(pytest.param(op, inputs, attrs or {}, outs, opset, id=id))


for _op in ("Neg", "Exp", "Tanh", "Erf", "Sigmoid", "Relu", "Abs", "Floor", "Ceil", "Round", "Sin", "Cos",
            "Softplus", "Identity", "Softsign", "HardSwish"):
    case(_op, _op, [X(2, 3, 5)])
for _op in ("Log", "Sqrt", "Reciprocal"):
    case(_op, _op, [X(2, 3, 5, kind="pos")])
case("Mish", "Mish", [X(2, 3, 5)], opset=18)
case("Not", "Not", [X(3, 4, kind="b")], outs=(B,))
for _op in ("Add", "Sub", "Mul", "Div"):
    case(_op, _op, [X(2, 3, 4), X(3, 1)])
case("Div-const-scalar", "Div", [X(2, 3), f32(8.0).reshape(())])
case("Div-const-tensor", "Div", [X(2, 3), f32(1.4142135, -3.0, 1e-3)])
for _e in (2.0, 3.0, 0.5, 1.0, -1.0, 1.7):
    case(f"Pow-{_e}", "Pow", [X(2, 3, kind="pos"), np.array(_e, np.float32)])
case("Pow-tensor", "Pow", [X(2, 3, kind="pos"), X(3)])
case("Pow-int-exponent", "Pow", [X(2, 3), i64(2).reshape(())])
for _op in ("Max", "Min", "Sum", "Mean"):
    case(f"{_op}-3", _op, [X(2, 3), X(3), X(1, 3)])
case("Max-1", "Max", [X(2, 3)])
for _op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"):
    case(_op, _op, [X(2, 3, kind="i"), X(3, kind="i")], outs=(B,))
for _op in ("And", "Or", "Xor"):
    case(_op, _op, [X(2, 3, kind="b"), X(3, kind="b")], outs=(B,))
case("Where", "Where", [X(3, 4, kind="b"), X(3, 4), X(1, 4)])
case("LeakyRelu", "LeakyRelu", [X(2, 5)], {"alpha": 0.1})
case("LeakyRelu-big-alpha", "LeakyRelu", [X(2, 5)], {"alpha": 1.5})
case("PRelu", "PRelu", [X(1, 3, 4, 4), f32(0.1, -0.2, 2.0).reshape(3, 1, 1)])
case("Elu", "Elu", [X(2, 5)], {"alpha": 0.7})
case("Selu", "Selu", [X(2, 5)])
case("Celu", "Celu", [X(2, 5)], {"alpha": 2.0})
case("ThresholdedRelu", "ThresholdedRelu", [X(2, 5)], {"alpha": 0.3})
case("Clip", "Clip", [X(2, 5), f32(-0.5).reshape(()), f32(0.7).reshape(())])
case("Clip-max-only", "Clip", [X(2, 5), None, f32(0.2).reshape(())])
case("Clip-none", "Clip", [X(2, 5)])
case("HardSigmoid", "HardSigmoid", [X(2, 5)], {"alpha": 0.3, "beta": 0.4})
case("Gelu", "Gelu", [X(2, 5)], opset=20)
case("Gelu-tanh", "Gelu", [X(2, 5)], {"approximate": "tanh"}, opset=20)
for _ax in (-1, 0, 1):
    case(f"Softmax-axis{_ax}", "Softmax", [X(3, 4, 5)], {"axis": _ax})
case("Softmax-large-logits", "Softmax", [X(2, 8, kind="big")])
case("LogSoftmax", "LogSoftmax", [X(3, 4, 5)], {"axis": 1})
case("LogSoftmax-large-logits", "LogSoftmax", [X(2, 8, kind="big")])
case("LayerNormalization", "LayerNormalization", [X(2, 3, 8), X(8), X(8)], {"epsilon": 1e-3})
case("LayerNormalization-axis1-nobias", "LayerNormalization", [X(2, 3, 4), X(3, 4)], {"axis": 1})
case("LayerNormalization-mean-invstd", "LayerNormalization", [X(2, 3, 8), X(8), X(8)], outs=(F, F, F))
case("InstanceNormalization", "InstanceNormalization", [X(2, 3, 5, 4), X(3), X(3)], {"epsilon": 1e-3})
case("BatchNormalization", "BatchNormalization",
     [X(2, 3, 4, 4), f32(1, 2, 3), f32(0.1, 0.2, 0.3), f32(0, 1, -1), f32(1, 0.5, 2)])
case("BatchNormalization-runtime-stats", "BatchNormalization", [X(2, 3, 4), X(3), X(3), X(3), X(3, kind="pos")])
case("GroupNormalization", "GroupNormalization", [X(2, 6, 4, 4), X(6), X(6)], {"num_groups": 3}, opset=21)
case("GroupNormalization-18-per-group", "GroupNormalization", [X(2, 6, 5), W(3), W(3, seed=2)], {"num_groups": 3},
     opset=18)
for _op in ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2", "ReduceSumSquare",
            "ReduceLogSumExp"):
    case(_op, _op, [X(2, 3, 4)], {"axes": [1, -1], "keepdims": 0})
case("ReduceLogSum", "ReduceLogSum", [X(2, 3, 4, kind="pos")], {"axes": [1]})
case("ReduceSum-input-axes", "ReduceSum", [X(2, 3, 4), i64(-1)])
case("ReduceSum-all", "ReduceSum", [X(2, 3, 4)], {"keepdims": 0})
case("ReduceSum-noop", "ReduceSum", [X(2, 3, 4)], {"noop_with_empty_axes": 1})
case("ReduceMean-opset18", "ReduceMean", [X(2, 3, 4), i64(0, 2)], opset=18)
case("MatMul-2d", "MatMul", [X(4, 8), X(8, 5)])
case("MatMul-batch", "MatMul", [X(2, 1, 4, 8), X(3, 8, 5)])
case("MatMul-1d-left", "MatMul", [X(8), X(2, 8, 5)])
case("MatMul-1d-right", "MatMul", [X(2, 4, 8), X(8)])
case("MatMul-1d-both", "MatMul", [X(8), X(8)])
case("Gemm", "Gemm", [X(4, 8), X(8, 5), X(5)])
case("Gemm-trans-alpha-beta", "Gemm", [X(8, 4), np.ones((5, 8), np.float32) * 0.3, X(4, 1)],
     {"transA": 1, "transB": 1, "alpha": 0.5, "beta": 2.0})
case("Gemm-runtime-B-alpha", "Gemm", [X(4, 8), X(8, 5)], {"alpha": 0.5})
case("Conv", "Conv", [X(1, 4, 9, 8), X(6, 2, 3, 3), X(6)],
     {"strides": [2, 1], "pads": [1, 0, 1, 2], "dilations": [1, 2], "group": 2})
for _ap in ("SAME_UPPER", "SAME_LOWER", "VALID"):
    case(f"Conv-{_ap}", "Conv", [X(1, 2, 7, 6), X(3, 2, 4, 3)], {"auto_pad": _ap, "strides": [2, 2]})
case("Conv-1d", "Conv", [X(1, 3, 10), X(4, 3, 3), X(4)], {"pads": [1, 1]})
case("ConvTranspose", "ConvTranspose", [X(1, 4, 5, 5), W(4, 3, 3, 3), X(3)],
     {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]})
case("ConvTranspose-group-dilation", "ConvTranspose", [X(1, 4, 4, 5), W(4, 1, 2, 3)],
     {"group": 2, "dilations": [2, 1], "strides": [1, 3], "pads": [0, 2, 1, 0]})
case("ConvTranspose-output-shape", "ConvTranspose", [X(1, 2, 4, 4), W(2, 2, 3, 3)],
     {"strides": [2, 2], "output_shape": [9, 8]})
case("ConvTranspose-1d", "ConvTranspose", [X(1, 2, 6), W(2, 3, 4)], {"strides": [3]})
case("MaxPool", "MaxPool", [X(1, 2, 9, 8)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})
case("MaxPool-ceil-dilated", "MaxPool", [X(1, 2, 9, 8)],
     {"kernel_shape": [2, 3], "strides": [2, 2], "dilations": [2, 1], "ceil_mode": 1})
case("MaxPool-same", "MaxPool", [X(1, 2, 7, 7)], {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"})
case("MaxPool-indices", "MaxPool", [X(1, 2, 6, 6)], {"kernel_shape": [2, 2], "strides": [2, 2]}, outs=(F, I64))
case("AveragePool", "AveragePool", [X(1, 2, 9, 8)], {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]})
case("AveragePool-include-pad-ceil", "AveragePool", [X(1, 2, 9, 8)],
     {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1], "count_include_pad": 1, "ceil_mode": 1})
case("GlobalAveragePool", "GlobalAveragePool", [X(1, 3, 5, 4)])
case("GlobalMaxPool", "GlobalMaxPool", [X(1, 3, 5, 4)])
case("Resize-nearest-asym-floor", "Resize", [X(1, 2, 4, 5), None, f32(1, 1, 2, 2)],
     {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"})
case("Resize-nearest-halfpixel-sizes", "Resize", [X(1, 2, 4, 5), None, None, i64(1, 2, 7, 3)], {"mode": "nearest"})
case("Resize-nearest-align-ceil", "Resize", [X(1, 2, 4, 5), None, None, i64(1, 2, 9, 11)],
     {"mode": "nearest", "coordinate_transformation_mode": "align_corners", "nearest_mode": "round_prefer_ceil"})
case("Resize-nearest-down-ceil", "Resize", [X(1, 2, 8, 6), None, f32(1, 1, 0.5, 0.5)],
     {"mode": "nearest", "nearest_mode": "ceil"})
case("Resize-nearest-pytorch-floor", "Resize", [X(1, 2, 4, 5), None, f32(1, 1, 1.5, 2.5)],
     {"mode": "nearest", "coordinate_transformation_mode": "pytorch_half_pixel", "nearest_mode": "floor"})
for _ctm in ("half_pixel", "align_corners", "asymmetric", "pytorch_half_pixel"):
    case(f"Resize-linear-{_ctm}-up", "Resize", [X(1, 2, 4, 5), None, f32(1, 1, 2, 1.5)],
         {"mode": "linear", "coordinate_transformation_mode": _ctm})
    case(f"Resize-linear-{_ctm}-sizes", "Resize", [X(1, 2, 6, 5), None, None, i64(1, 2, 3, 1)],
         {"mode": "linear", "coordinate_transformation_mode": _ctm})
case("Resize-cubic-opaque", "Resize", [X(1, 1, 4, 4), None, f32(1, 1, 2, 2)], {"mode": "cubic"})
case("Reshape", "Reshape", [X(2, 3, 4), i64(0, -1, 2)])
case("Reshape-allowzero", "Reshape", [X(2, 3, 4), i64(4, -1, 3)], {"allowzero": 1})
case("Reshape-noop", "Reshape", [X(2, 3, 4), i64(2, 3, 4)])
case("Flatten", "Flatten", [X(2, 3, 4, 5)], {"axis": 2})
case("Flatten-0", "Flatten", [X(2, 3, 4)], {"axis": 0})
case("Squeeze", "Squeeze", [X(1, 3, 1, 4), i64(-2)])
case("Squeeze-all", "Squeeze", [X(1, 3, 1, 4)])
case("Unsqueeze", "Unsqueeze", [X(3, 4), i64(0, -1)])
case("Transpose", "Transpose", [X(2, 3, 4)], {"perm": [1, 2, 0]})
case("Transpose-default", "Transpose", [X(2, 3, 4)])
case("Slice", "Slice", [X(5, 6, 7), i64(1, -1), i64(100, -7), i64(0, 2), i64(2, -2)])
case("Slice-default-axes", "Slice", [X(5, 6), i64(-3, 0), i64(9223372036854775807, 4)])
case("Slice-reverse", "Slice", [X(5, 6), i64(-1), i64(-9223372036854775807), i64(1), i64(-1)])
case("Split-input", "Split", [X(2, 7, 3), i64(2, 4, 1)], {"axis": 1}, outs=(F, F, F))
case("Split-equal", "Split", [X(6, 3)], outs=(F, F, F))
case("Split-num-outputs", "Split", [X(2, 7)], {"axis": -1, "num_outputs": 3}, outs=(F, F, F), opset=18)
case("Concat", "Concat", [X(2, 3), X(2, 1), X(2, 4)], {"axis": -1})
case("Pad-constant", "Pad", [X(1, 2, 3, 4), i64(0, 0, 1, 2, 0, 0, 2, 1), f32(1.5).reshape(())])
case("Pad-reflect", "Pad", [X(1, 2, 4, 5), i64(0, 0, 2, 3, 0, 0, 1, 2)], {"mode": "reflect"})
case("Pad-edge-negative", "Pad", [X(1, 2, 4, 5), i64(0, 0, -1, 3, 0, 0, 2, -2)], {"mode": "edge"})
case("Pad-axes", "Pad", [X(2, 3, 4), i64(1, 2, 3, 0), None, i64(0, -1)], opset=18)
case("Expand", "Expand", [X(3, 1), i64(2, 1, 4)])
case("Expand-noop", "Expand", [X(3, 4), i64(1, 4)])
case("Tile", "Tile", [X(2, 3), i64(2, 3)])
case("Gather", "Gather", [X(5, 4), i64(0, -1, 3, 3)], {"axis": 0})
case("Gather-scalar", "Gather", [X(3, 5, 2), i64(-2).reshape(())], {"axis": 1})
case("Gather-2d", "Gather", [X(3, 5), i64(1, 0, 4, 2).reshape(2, 2)], {"axis": -1})
case("Gather-runtime", "Gather", [X(6, 4), X(2, 3, kind="i")], {"axis": 0})
case("Cast", "Cast", [X(2, 3)], {"to": TensorProto.INT64}, outs=(I64,))
case("Cast-same", "Cast", [X(2, 3)], {"to": TensorProto.FLOAT})
case("CastLike", "CastLike", [X(2, 3, kind="i"), np.zeros(1, np.float32)])
case("Dropout", "Dropout", [X(2, 3)])
case("Einsum-matmul", "Einsum", [X(2, 3, 4), X(2, 4, 5)], {"equation": "bij,bjk->bik"})
case("Einsum-bt", "Einsum", [X(2, 2, 3, 4), X(2, 2, 5, 4)], {"equation": "bhid,bhjd->bhij"})
case("ArgMax", "ArgMax", [X(3, 5)], {"axis": 1}, outs=(I64,))
case("ArgMin", "ArgMin", [X(3, 5)], {"axis": 0, "keepdims": 0}, outs=(I64,))
case("TopK", "TopK", [X(3, 6), i64(2)], outs=(F, I64))


@pytest.mark.parametrize("op,inputs,attrs,outs,opset", CASES)
def test_one_node_matches_ort(op, inputs, attrs, outs, opset):
    model = one_node(op, inputs, attrs, outs, opset)
    graph = assert_matches_ort(model, feeds_for(inputs))
    graph.validate()


def test_every_fission_function_is_tested():
    tested = {p.values[0] for p in CASES}
    # Upsample is deprecated since opset 10 (ORT refuses it at the opsets we load); it shares Resize's code
    untested = set(OPS) - tested - {"Upsample", "NonMaxSuppression", "NonZero", "Range", "Hardmax", "CumSum",
                                    "GatherElements", "GatherND", "ScatterND", "ScatterElements", "OneHot", "Mod",
                                    "Trilu"}
    assert not untested, sorted(untested)


def test_upsample_shares_resize():
    """Upsample (deprecated at opset 10, so ORT will not run it here) = Resize nearest, asymmetric, floor."""
    m = one_node("Resize", [X(1, 2, 3, 4), None, f32(1, 1, 2, 3)],
                 {"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"})
    og = load(m)
    resized = executor.run(fission(og), feeds_for([X(1, 2, 3, 4)]))["y0"]
    node = og.nodes[0]
    og.nodes = [type(node)("up", "Upsample", (node.inputs[0], node.inputs[2]), node.outputs, {"mode": "nearest"})]
    np.testing.assert_array_equal(executor.run(fission(og), feeds_for([X(1, 2, 3, 4)]))["y0"], resized)


@pytest.mark.parametrize("divisor, kept", [(f32(8.0).reshape(()), False), (f32(1.4142135, -3.0, 1e-3), False),
                                            (f32(2.0, 0.0, 1.0), True), (f32(1e-39, 1.0, 1.0), True), (None, True)])
def test_a_division_by_a_constant_multiplies_by_its_reciprocal(divisor, kept):
    """x / c by a constant c is x times 1 / c (a vector division costs several multiplies); a divisor
    that is not a constant, holds a zero, or whose reciprocal overflows (a subnormal) stays a
    division. Within an ulp or two of ONNX Runtime's division, exact for a power of two."""
    inputs = [X(2, 3), X(3) if divisor is None else divisor]
    model = one_node("Div", inputs)
    graph = fission(load(model))
    assert [p.op for p in graph.prims] == (["div"] if kept else ["mul"])
    feeds = feeds_for(inputs)
    got = executor.run(graph, feeds)["y0"]
    want = executor.ort_session(model, threads=1).run(None, feeds)[0]
    if divisor is not None and divisor.ndim == 0:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)


def test_softmax_large_logits_stay_finite():
    x = np.array([[1000.0, 999.0, -1000.0, 0.0], [3e4, 3e4, 3e4, -3e4]], np.float32)
    graph = fission(load(one_node("Softmax", [X(2, 4)], {"axis": -1})))
    y = executor.run(graph, {"x0": x})["y0"]
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y.sum(-1), 1.0, rtol=1e-6)
    assert "reduce_max" in graph.histogram()


def test_softmax_axis_one_is_not_last_axis():
    graph = fission(load(one_node("Softmax", [X(2, 3, 4)], {"axis": 1})))
    rmax = next(p for p in graph.prims if p.op == "reduce_max")
    assert rmax.attr("axes") == (1,)


def test_outputs_keep_onnx_names_and_origins():
    graph = fission(load(one_node("LayerNormalization", [X(2, 8), X(8), X(8)])))
    assert graph.outputs == ("y0",)
    assert {p.origin for p in graph.prims} == {"the_LayerNormalization"}
    assert len({p.name for p in graph.prims}) == len(graph.prims)


def test_identity_output_gets_a_copy():
    graph = fission(load(one_node("Identity", [X(2, 3)])))
    assert graph.outputs == ("y0",) and graph.prims[-1].name == "y0"


def test_unsupported_op_names_node_and_op():
    m = one_node("Det", [X(3, 3)])
    with pytest.raises(KernorchError, match=r"the_Det.*Det.*not supported"):
        fission(load(m))


def test_data_dependent_opaque_shape_is_refused_clearly():
    m = one_node("NonMaxSuppression", [X(1, 4, 4), X(1, 1, 4), i64(2)], outs=(I64,))
    with pytest.raises(KernorchError, match="the_NonMaxSuppression.*data-dependent"):
        fission(load(m))


def test_runtime_slice_bounds_are_refused_clearly():
    m = one_node("Slice", [X(4, 5), X(1, kind="i"), i64(3)])
    with pytest.raises(KernorchError, match="Slice starts.*constant"):
        fission(load(m))


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_models(name, tmp_path):
    model = EXAMPLES[name]()
    onnx.checker.check_model(model, full_check=True)
    graph = fission(load(model))
    err = executor.compare_with_ort(model, graph, seed=3)
    for out, e in err.items():
        assert e["rel"] < 1e-4, (out, e)
    paths = save_examples(tmp_path)
    assert {p.stem for p in paths} == set(EXAMPLES)


@pytest.mark.shared
@pytest.mark.parametrize("shared_model", ["candy", "gpt2_mini", "segformer_b0", "yolox_tiny"], indirect=True)
def test_shared_models_match_ort(shared_model):
    og = load(shared_model)
    graph = fission(og)
    assert len(graph.prims) >= len(og.nodes)
    err = executor.compare_with_ort(shared_model, graph, seed=0)
    for out, e in err.items():
        assert e["rel"] < 1e-4, (shared_model.name, out, e)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_slice_normalisation_matches_ort(data):
    """ONNX Slice bounds (negative, out of range, INT64 extremes, negative steps) against ONNX Runtime
    (not numpy: the two disagree when a negative-step slice starts below -dim)."""
    n = data.draw(st.integers(1, 7))
    bound = st.one_of(st.integers(-10, 10), st.sampled_from([2**63 - 1, -2**63, 2**31 - 1, -2**31]))
    start, end = data.draw(bound), data.draw(bound)
    step = data.draw(st.integers(-3, 3).filter(bool))
    m = one_node("Slice", [X(n, 2), i64(start), i64(end), i64(0), i64(step)])
    x = np.arange(2 * n, dtype=np.float32).reshape(n, 2)
    want = executor.ort_session(m, threads=1).run(None, {"x0": x})[0]
    got = executor.run(fission(load(m)), {"x0": x})["y0"]
    np.testing.assert_array_equal(got, want)


def test_executor_checks_feeds():
    graph = fission(load(one_node("Relu", [X(2, 3)])))
    with pytest.raises(KernorchError, match="missing input.*'x0'"):
        executor.run(graph, {})
    with pytest.raises(KernorchError, match="unknown input.*'nope'"):
        executor.run(graph, {"x0": np.zeros((2, 3), np.float32), "nope": np.zeros(1)})
    with pytest.raises(KernorchError, match="shape"):
        executor.run(graph, {"x0": np.zeros((3, 2), np.float32)})
    with pytest.raises(KernorchError, match="dtype float64"):
        executor.run(graph, {"x0": np.zeros((2, 3))})


def test_executor_keeps_all_intermediates():
    graph = fission(load(one_node("Softmax", [X(2, 3)])))
    values = executor.run(graph, {"x0": np.ones((2, 3), np.float32)}, keep_all=True)
    assert all(p.name in values for p in graph.prims)


@pytest.mark.parametrize("op", sorted(primitives.TABLE))
def test_primitive_reference_matches_inferred_type(op):
    d = primitives.TABLE[op]
    in_types, attrs = d.example()
    rng = np.random.default_rng(0)
    values = []
    for t in in_types:
        if t.dtype == "bool":
            values.append(rng.random(t.shape) < 0.5)
        elif t.dtype == "int64":  # gather indices: valid, non-negative
            values.append(rng.integers(0, 3, t.shape).astype(np.int64))
        elif op in ("log", "sqrt", "pow"):  # keep the reference in its real domain
            values.append(rng.uniform(0.5, 2.0, t.shape).astype(t.dtype))
        else:
            values.append(rng.standard_normal(t.shape).astype(t.dtype))
    out_t = primitives.infer(op, in_types, attrs)
    prim = make_prim("y", op, [f"x{k}" for k in range(len(in_types))], out_t, **attrs)
    y = primitives.run(prim, values)
    assert y.shape == tuple(out_t.shape) and str(y.dtype) == out_t.dtype
    assert d.kind in primitives.KINDS
