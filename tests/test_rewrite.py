"""Algebraic rewrites (kernorch.rewrite): each rule fires where it should, nowhere else, and the
rewritten graph computes what ONNX Runtime computes on the original model."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from kernorch import executor
from kernorch.fission import fission
from kernorch.frontend.onnx import load
from kernorch.options import Options
from kernorch.pipeline import load as pipeline_load
from kernorch.rewrite import rewrite

SEGFORMER = Path(__file__).resolve().parents[2] / "shared" / "models" / "segformer_b0.onnx"


def _model(nodes, inputs, outputs, inits):
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m = onnx.shape_inference.infer_shapes(m)
    return m


def decode_head(sizes=((16, 16, 8), (8, 8, 16), (4, 4, 24)), width=32, out=12, seed=0, mode="linear",
                use_scales=False, conv_kernel=1, extra_reader=False, images=False):
    """Per stage: tokens [1, H*W, C] -> MatMul + bias -> Transpose -> Reshape [1, width, H, W] ->
    Resize to the first stage's size; Concat; Conv (bias); Relu. The SegFormer decode head, small.
    `images`: each stage comes channels-first [1, C, H*W] and is transposed to tokens first (as
    SegFormer's export does)."""
    rng = np.random.default_rng(seed)
    h0, w0 = sizes[0][:2]
    nodes, inputs, inits, parts = [], [], {}, []
    for i, (h, w, c) in enumerate(sizes):
        x = f"x{i}"
        if images:
            inputs.append(helper.make_tensor_value_info(f"img{i}", TensorProto.FLOAT, [1, c, h * w]))
            nodes.append(helper.make_node("Transpose", [f"img{i}"], [x], perm=[0, 2, 1]))
        else:
            inputs.append(helper.make_tensor_value_info(x, TensorProto.FLOAT, [1, h * w, c]))
        inits[f"m{i}"] = (rng.standard_normal((c, width)) / np.sqrt(c)).astype(np.float32)
        inits[f"c{i}"] = rng.standard_normal(width).astype(np.float32)
        inits[f"shape{i}"] = np.array([1, width, h, w], np.int64)
        nodes += [helper.make_node("MatMul", [x, f"m{i}"], [f"mm{i}"]),
                  helper.make_node("Add", [f"c{i}", f"mm{i}"], [f"p{i}"]),
                  helper.make_node("Transpose", [f"p{i}"], [f"t{i}"], perm=[0, 2, 1]),
                  helper.make_node("Reshape", [f"t{i}", f"shape{i}"], [f"r{i}"])]
        if use_scales:
            inits[f"scales{i}"] = np.array([1, 1, h0 / h, w0 / w], np.float32)
            nodes.append(helper.make_node("Resize", [f"r{i}", "", f"scales{i}"], [f"u{i}"], mode=mode))
        else:
            inits[f"sizes{i}"] = np.array([1, width, h0, w0], np.int64)
            nodes.append(helper.make_node("Resize", [f"r{i}", "", "", f"sizes{i}"], [f"u{i}"], mode=mode,
                                          coordinate_transformation_mode="half_pixel"))
        parts.append(f"u{i}")
    k = conv_kernel
    inits["wf"] = (rng.standard_normal((out, width * len(sizes), k, k)) / np.sqrt(width * len(sizes))).astype(np.float32)
    inits["bf"] = rng.standard_normal(out).astype(np.float32)
    nodes += [helper.make_node("Concat", parts[::-1], ["cat"], axis=1),
              helper.make_node("Conv", ["cat", "wf", "bf"], ["fused"], pads=[k // 2] * 4),
              helper.make_node("Relu", ["fused"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("u1", TensorProto.FLOAT, None))
    return _model(nodes, inputs, outputs, inits)


def _rules(applied):
    return [a.rule for a in applied]


def test_decode_head_contracts_before_upsampling_and_folds_projections():
    m = decode_head()
    og = load(m)
    r = rewrite(og)
    new, applied = r.graph, r.applied
    assert _rules(applied).count("split_concat") == 1
    assert _rules(applied).count("before_resize") == 3
    assert _rules(applied).count("fold_projection") == 3
    ops = [n.op_type for n in new.nodes]
    assert "Concat" not in ops and ops.count("Conv") == 0 and ops.count("MatMul") == 3
    assert len(og.nodes) == 18 and [n.op_type for n in og.nodes].count("Conv") == 1   # the input is untouched
    # the rewritten graph against ONNX Runtime on the original model
    err = executor.compare_with_ort(m, fission(new), seed=1)
    assert err["y"]["rel"] < 1e-5


@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([2, 3, 4, 6]), st.sampled_from([4, 8, 20])), min_size=1, max_size=4),
       st.sampled_from([8, 16]), st.sampled_from([1, 5, 16]), st.sampled_from(["linear", "nearest"]),
       st.booleans(), st.booleans(), st.integers(0, 1000))
def test_random_heads_match_ort(stages, width, out, mode, use_scales, images, seed):
    """Random stage sizes (the first the largest), channel counts, resize modes and inputs: the
    rewritten graph matches ONNX Runtime on the original, and never costs more FLOPs."""
    sizes = [(12, 12, stages[0][1])] + [(12 // f, 12 // f, c) for f, c in stages[1:]]
    m = decode_head(tuple(sizes), width, out, seed, mode, use_scales, images=images)
    r = rewrite(load(m))
    assert r.applied and r.flops_after < r.flops_before
    assert executor.compare_with_ort(m, fission(r.graph), seed=seed)["y"]["rel"] < 1e-5


def test_channels_first_projection_loses_its_transposes():
    m = decode_head(images=True)
    r = rewrite(load(m))
    assert [a.rule for a in r.applied].count("channels_first") == 3
    assert [n.op_type for n in r.graph.nodes].count("Transpose") == 0
    assert executor.compare_with_ort(m, fission(r.graph), seed=4)["y"]["rel"] < 1e-5


@pytest.mark.parametrize("bias", [True, False])
def test_channels_first_alone(bias):
    """Transpose -> MatMul (+ bias) -> Transpose, nothing else: MatMul(M^T, x) (+ a column)."""
    rng = np.random.default_rng(5)
    inits = {"m": rng.standard_normal((6, 10)).astype(np.float32), "c": rng.standard_normal(10).astype(np.float32)}
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["t", "m"], ["mm"])]
    nodes += [helper.make_node("Add", ["mm", "c"], ["p"])] if bias else []
    nodes += [helper.make_node("Transpose", ["p" if bias else "mm"], ["y"], perm=[0, 2, 1])]
    m = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 35])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 10, 35])], inits if bias else {"m": inits["m"]})
    r = rewrite(load(m))
    assert [a.rule for a in r.applied] == ["channels_first"]
    assert [n.op_type for n in r.graph.nodes] == ["MatMul"] + (["Add"] if bias else [])
    assert executor.compare_with_ort(m, fission(r.graph), seed=5)["y"]["rel"] < 1e-5


def test_projection_not_folded_through_a_bottleneck():
    """fold_projection only when one contraction costs less than two: Cin*Cout < Cin*Cmid + Cmid*Cout.
    With a 4-channel middle between 64 and 64 channels (512 vs 4096 per pixel) folding would cost more."""
    m = decode_head(sizes=((8, 8, 64), (4, 4, 64)), width=4, out=64)
    applied = rewrite(load(m)).applied
    assert "fold_projection" not in _rules(applied) and "before_resize" in _rules(applied)


@pytest.mark.parametrize("case", ["3x3 conv", "read twice"])
def test_left_alone(case):
    m = decode_head(conv_kernel=3) if case == "3x3 conv" else decode_head(extra_reader=True)
    r = rewrite(load(m))
    new, applied = r.graph, r.applied
    if case == "3x3 conv":
        assert applied == () and new.nodes == load(m).nodes and r.flops_after == r.flops_before
    else:   # the concat still splits; the resize whose output is read elsewhere stays before its conv
        assert _rules(applied).count("before_resize") == 2
        assert executor.compare_with_ort(m, fission(new), seed=2)["y"]["rel"] < 1e-5


def test_downsampling_resize_is_left_alone():
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((4, 6, 1, 1)).astype(np.float32),
             "sizes": np.array([1, 6, 4, 4], np.int64)}
    nodes = [helper.make_node("Resize", ["x", "", "", "sizes"], ["r"], mode="linear"),
             helper.make_node("Concat", ["r", "r"], ["c"], axis=1),
             helper.make_node("Conv", ["r", "w"], ["y"])]
    m = _model(nodes[:1] + nodes[2:], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 8, 8])],
               [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    assert rewrite(load(m)).applied == ()


def test_option_and_report():
    m = decode_head()
    on = pipeline_load(m, Options(threads=1))
    off = pipeline_load(m, Options(threads=1, rewrites=False))
    assert len(on.rewrites.applied) == 7 and off.rewrites is None
    ops = lambda g: [p.op for p in g.prims]   # noqa: E731
    assert "conv" in ops(off.graph) and "concat" in ops(off.graph)
    assert "conv" not in ops(on.graph) and "concat" not in ops(on.graph)
    js = on.rewrites.to_json()
    assert js["flops_after"] < js["flops_before"] / 4 and len(js["applied"]) == 7


@pytest.mark.skipif(not SEGFORMER.exists(), reason="needs ../shared/models")
def test_segformer_decode_head_loses_most_of_its_flops():
    r = rewrite(load(str(SEGFORMER)))
    assert r.flops_before - r.flops_after > 8.5e9   # the decode head: 9.1 -> 0.5 GFLOP
    assert executor.compare_with_ort(str(SEGFORMER), fission(r.graph), seed=0)["logits"]["rel"] < 1e-4


def attention_model(opset=17, axis=-1, seq=12, d=8, read_twice=False, probs_as_values=False):
    """q @ k^T scaled, Softmax(axis), @ v: one head of attention. `read_twice`: the probabilities
    are an output too; `probs_as_values`: they are the MatMul's right operand."""
    inits = {"scale": np.array(d ** -0.5, np.float32)}
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]), helper.make_node("Mul", ["s", "scale"], ["sc"]),
             helper.make_node("Softmax", ["sc"], ["p"], **({} if axis is None else {"axis": axis}))]
    nodes += [helper.make_node("MatMul", ["w", "p"] if probs_as_values else ["p", "v"], ["y"])]
    ins = [helper.make_tensor_value_info("q", TensorProto.FLOAT, [2, seq, d]),
           helper.make_tensor_value_info("kt", TensorProto.FLOAT, [2, d, seq]),
           helper.make_tensor_value_info("w" if probs_as_values else "v", TensorProto.FLOAT, [2, seq, seq] if probs_as_values else [2, seq, d])]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    outs += [helper.make_tensor_value_info("p", TensorProto.FLOAT, None)] if read_twice else []
    g = helper.make_graph(nodes, "g", ins, outs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return onnx.shape_inference.infer_shapes(m)


@pytest.mark.parametrize("opset", [13, 17, 18])
def test_an_attentions_normalization_moves_after_its_values(opset):
    """Softmax(x) @ V -> (exp(x - max) @ V) * 1 / sum: the division touches seq x d values instead
    of seq x seq probabilities; each opset's reductions in its own form (axes an attribute or an
    input); the result is ONNX Runtime's on the original model."""
    m = attention_model(opset)
    r = rewrite(load(m))
    assert _rules(r.applied) == ["after_attention"] and r.flops_after == r.flops_before
    ops = [n.op_type for n in r.graph.nodes]
    assert "Softmax" not in ops and ops[-3:] == ["Reciprocal", "MatMul", "Mul"], ops
    g = fission(r.graph)
    last = g.by_name["y"]
    assert last.op == "mul" and g.by_name[last.inputs[1]].op == "matmul"
    assert g.by_name[g.by_name[last.inputs[1]].inputs[0]].op == "exp"   # the values read the unnormalized exp
    assert executor.compare_with_ort(m, g, seed=opset)["y"]["rel"] < 1e-5


@pytest.mark.parametrize("case", [dict(read_twice=True), dict(probs_as_values=True), dict(axis=1)])
def test_an_attentions_normalization_stays_where_it_must(case):
    """Not when the probabilities are read elsewhere, are the MatMul's right operand (the contraction
    runs over their rows), or the softmax is over another axis."""
    m = attention_model(**case)
    r = rewrite(load(m))
    assert r.applied == ()
    assert executor.compare_with_ort(m, fission(r.graph), seed=3)["y"]["rel"] < 1e-5
