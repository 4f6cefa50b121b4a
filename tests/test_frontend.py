"""The ONNX frontend: every bad input becomes a clear KernorchError; constant subgraphs fold away."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kernorch import executor
from kernorch.fission import fission
from kernorch.frontend.onnx import load, parse_shape
from kernorch.ir import KernorchError

F = TensorProto.FLOAT


def model(nodes, inputs, outputs, inits=(), opset=17, domains=()):
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    ops = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = 8
    return m


def relu_model(opset=17, shape=(2, 3)):
    return model([helper.make_node("Relu", ["x"], ["y"], name="r")],
                 [helper.make_tensor_value_info("x", F, list(shape))], [helper.make_tensor_value_info("y", F, None)],
                 opset=opset)


def test_missing_file(tmp_path):
    with pytest.raises(KernorchError, match="no such file"):
        load(tmp_path / "nope.onnx")


def test_directory(tmp_path):
    with pytest.raises(KernorchError, match="is a directory"):
        load(tmp_path)


def test_garbage_bytes(tmp_path):
    p = tmp_path / "garbage.onnx"
    p.write_bytes(b"\x00\xffthis is not a protobuf\x13\x37" * 10)
    with pytest.raises(KernorchError, match=r"garbage\.onnx"):
        load(p)


@pytest.mark.parametrize("opset", [9, 22])
def test_unsupported_opsets(opset):
    with pytest.raises(KernorchError, match=f"opset {opset} is not supported.*version_converter"):
        load(relu_model(opset))


def test_custom_domain_node():
    m = model([helper.make_node("FusedThing", ["x"], ["y"], name="custom", domain="com.example")],
              [helper.make_tensor_value_info("x", F, [2])], [helper.make_tensor_value_info("y", F, [2])],
              domains=["com.example"])
    with pytest.raises(KernorchError, match=r"'custom' \(FusedThing\).*com\.example"):
        load(m)


def test_unsupported_op_names_file_node_and_op(tmp_path):
    m = model([helper.make_node("Det", ["x"], ["y"], name="determinant")],
              [helper.make_tensor_value_info("x", F, [3, 3])], [helper.make_tensor_value_info("y", F, None)])
    p = tmp_path / "det.onnx"
    onnx.save(m, str(p))
    with pytest.raises(KernorchError, match=r"det\.onnx.*'determinant' \(Det\).*not supported"):
        fission(load(p))


def symbolic_model():
    return model([helper.make_node("Relu", ["x"], ["y"], name="r")],
                 [helper.make_tensor_value_info("x", F, ["batch", 8])], [helper.make_tensor_value_info("y", F, None)])


def test_symbolic_input_without_shape():
    og = load(symbolic_model())
    assert og.symbols == {"batch": "x"}
    with pytest.raises(KernorchError, match=r"input 'x'.*'batch'.*--shape x=Nx8"):
        fission(og)


def test_symbolic_input_bound_by_shape():
    m = symbolic_model()
    graph = fission(load(m, {"x": (3, 8)}))
    assert dict(graph.inputs)["x"].shape == (3, 8)
    assert executor.compare_with_ort(m, graph)["y"]["abs"] == 0.0


def test_wrong_shape_rank():
    with pytest.raises(KernorchError, match="input 'x' has rank 2.*rank 3"):
        load(symbolic_model(), {"x": (1, 2, 8)})


def test_shape_contradicting_static_dim():
    with pytest.raises(KernorchError, match="static shape 2x3"):
        load(relu_model(), {"x": (2, 4)})


def test_shape_for_missing_input():
    with pytest.raises(KernorchError, match=r"--shape names 'image'.*not model inputs.*'x'"):
        load(relu_model(), {"image": (1, 3)})


@pytest.mark.parametrize("text,want", [("x=1x3x224x224", ("x", (1, 3, 224, 224))), ("ids=1,128", ("ids", (1, 128)))])
def test_parse_shape(text, want):
    assert parse_shape(text) == want


@pytest.mark.parametrize("text", ["x", "x=1xa", "x=0x3"])
def test_parse_shape_errors(text):
    with pytest.raises(KernorchError, match="--shape"):
        parse_shape(text)


def folding_model(named=True):
    """reshape(x, concat(unsqueeze(gather(shape(x), 0)), [-1])) + constant_of_shape(...) * Constant."""
    def n(op, ins, outs, **kw):
        return helper.make_node(op, ins, outs, name=f"{op}_{outs[0]}" if named else "", **kw)

    nodes = [
        n("Shape", ["x"], ["s"]),
        n("Gather", ["s", "zero"], ["s0"], axis=0),
        n("Unsqueeze", ["s0", "axes0"], ["s0u"]),
        n("Concat", ["s0u", "minus1"], ["target"], axis=0),
        n("Reshape", ["x", "target"], ["flat"]),
        n("Constant", [], ["c"], value=numpy_helper.from_array(np.array(2.5, np.float32))),
        n("Constant", [], ["cshape"], value_ints=[1, 12]),
        n("ConstantOfShape", ["cshape"], ["ones"], value=numpy_helper.from_array(np.array([1.0], np.float32))),
        n("Mul", ["ones", "c"], ["scaled"]),
        n("Add", ["flat", "scaled"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "axes0"),
             numpy_helper.from_array(np.array([-1], np.int64), "minus1")]
    return model(nodes, [helper.make_tensor_value_info("x", F, ["batch", 3, 4])],
                 [helper.make_tensor_value_info("y", F, None)], inits)


@pytest.mark.parametrize("named", [True, False])
def test_constant_folding_of_shape_chain(named):
    m = folding_model(named)
    og = load(m, {"x": (2, 3, 4)})
    assert og.histogram() == {"Add": 1, "Reshape": 1}
    reshape = next(nd for nd in og.nodes if nd.op_type == "Reshape")
    np.testing.assert_array_equal(og.constants[reshape.inputs[1]], [2, -1])
    add = next(nd for nd in og.nodes if nd.op_type == "Add")
    np.testing.assert_array_equal(og.constants[add.inputs[1]], np.full((1, 12), 2.5, np.float32))
    graph = fission(og)
    assert graph.histogram() == {"add": 1, "reshape": 1}
    assert executor.compare_with_ort(m, graph)["y"]["abs"] == 0.0


def test_shared_model_loads(shared_models):
    p = shared_models / "gpt2_mini.onnx"
    if not p.exists():
        pytest.skip("gpt2_mini.onnx absent")
    og = load(p)
    assert og.opset == 17 and og.nodes and not og.symbols
    assert all(t.static for _, t in og.inputs)


@pytest.mark.parametrize("listed", [False, True])
def test_shape_inference_sees_large_constants_by_their_type_alone(listed):
    """Types come from onnx's shape inference on a copy of the model whose constants of more than
    INFER_VALUES_MAX elements are graph inputs of their type (it serializes what it is given): a
    large weight and a large folded constant (its transpose) are never handed over with their
    values, the small shape tensor a Reshape reads is, every type is the one shape inference gives
    on the whole model, and the model computes what ONNX Runtime does. `listed`: the weight is also
    a graph input (as older models list their initializers), declared without a shape."""
    from unittest import mock

    from kernorch.frontend import onnx as frontend
    w = np.random.default_rng(0).standard_normal((48, 64)).astype(np.float32)
    v = np.random.default_rng(1).standard_normal((48, 48)).astype(np.float32)
    nodes = [helper.make_node("Transpose", ["w"], ["wt"], name="t", perm=[1, 0]),
             helper.make_node("MatMul", ["x", "wt"], ["h"], name="mm"),
             helper.make_node("MatMul", ["h", "v"], ["h2"], name="mm2"),
             helper.make_node("Reshape", ["h2", "shape"], ["r"], name="rs"),
             helper.make_node("Relu", ["r"], ["y"], name="relu")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v"),
             numpy_helper.from_array(np.array([-1, 4, 12], np.int64), "shape")]
    declared = [helper.make_tensor_value_info("x", F, [6, 64])]
    if listed:  # (v's shape only shape inference gives: no constant is folded from it)
        declared.append(helper.make_tensor_value_info("v", F, None))
    m = model(nodes, declared, [helper.make_tensor_value_info("y", F, None)], inits)
    given = []
    real = onnx.shape_inference.infer_shapes

    def infer(proto, *a, **k):
        given.append(proto)
        return real(proto, *a, **k)
    with mock.patch.object(onnx.shape_inference, "infer_shapes", infer):
        g = load(m)
    assert len(given) >= 2   # (again after the transpose folded)
    for proto in given:
        assert all(np.prod(i.dims) <= frontend.INFER_VALUES_MAX for i in proto.graph.initializer)
        assert "shape" in {i.name for i in proto.graph.initializer} and {"w", "v"} <= {i.name for i in proto.graph.input}
    assert "wt" in g.constants and any("wt" in {i.name for i in proto.graph.input} for proto in given)
    assert g.types["wt"].shape == (64, 48) and g.types["h2"].shape == (6, 48) and g.types["y"].shape == (6, 4, 12)
    if not listed:  # (declared without a shape, the weight leaves onnx's own inference y's first dim unknown)
        whole = real(m, data_prop=True)
        want = {vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
                for vi in [*whole.graph.value_info, *whole.graph.output]}
        assert want["y"] == (6, 4, 12)
        assert all(g.types[n].shape == s for n, s in want.items() if n in g.types)
    assert executor.compare_with_ort(m, fission(g))["y"]["rel"] < 1e-5
