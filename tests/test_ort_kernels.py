"""ONNX Runtime as a kernel library: every primitive's ONNX form, and linear kernels with epilogues."""
import numpy as np
import pytest

from kernorch import primitives as P
from kernorch.backends import ort_kernels, packed_kernel, packed_supports
from kernorch.ir import Graph, make_prim

from test_backend import conv_bias_relu_graph, layernorm_graph, matmul_gelu_graph, rand_input, reference

OPS = [op for op in P.TABLE if op != "opaque"]


@pytest.mark.parametrize("op", OPS)
def test_every_primitive_round_trips_through_onnx(op):
    d = P.TABLE[op]
    types, attrs = d.example()
    names = [f"x{i}" for i in range(len(types))]
    prim = make_prim("y", op, names, d.infer(types, attrs), **attrs)
    graph = Graph(tuple(zip(names, types)), ("y",), (prim,))
    rng = np.random.default_rng(7)
    xs = [rand_input(t, rng, op, i, attrs, types) for i, t in enumerate(types)]
    if op == "gather":
        xs[1] = np.abs(xs[1])  # ONNX Gather takes negatives too, but keep the reference simple
    (got,) = ort_kernels.OrtKernel(graph, [prim], names, ["y"], threads=1)(*xs)
    want = P.run(prim, xs)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("make", [matmul_gelu_graph, conv_bias_relu_graph])
def test_linear_kernels_with_epilogue(make):
    graph, inputs = make()
    members = list(graph.prims)
    outputs = [members[-1].name]
    assert packed_supports("ort", graph, members, inputs, outputs) is None
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(tuple(t.shape)).astype(np.float32) for n, t in graph.inputs}
    args = [graph.constants[t] if t in graph.constants else feeds[t] for t in inputs]
    k = packed_kernel("ort", graph, members, inputs, outputs)
    (got,) = k(*args)
    (want,) = reference(graph, feeds, outputs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    out = np.empty(want.shape, want.dtype)  # C order, as Relax passes it
    k.run_dps(*args, out)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


def test_memory_bound_kernels_are_not_offered():
    graph, inputs = layernorm_graph()
    assert "no linear primitive" in packed_supports("ort", graph, list(graph.prims), inputs, ["y"])
