"""ONNX Runtime as a kernel library: a candidate kernel run by an ORT session of its own.

ONNX Runtime's MLAS convolutions and GEMMs (NCHWc layouts, prepacked weights) are near this CPU's
peak; generated code without tuning is not. So a candidate with a linear primitive is also offered
as an "ort" implementation: its primitives are written back as a small ONNX graph (weights as
initializers, so ORT prepacks them), run by a session with the same thread count and spinning
turned off (its pool must not steal the cores TVM's pool needs next). The solver picks it only
where its measured cost wins, exactly as Korch took the best of cuDNN, cuBLAS and TVM.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

import numpy as np

from ..ir import Graph, KernorchError, Prim

log = logging.getLogger(__name__)

OPSET = 18
_UNARY = {"neg": "Neg", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "reciprocal": "Reciprocal", "tanh": "Tanh",
          "erf": "Erf", "sigmoid": "Sigmoid", "relu": "Relu", "abs": "Abs", "floor": "Floor", "ceil": "Ceil",
          "round": "Round", "sin": "Sin", "cos": "Cos", "softplus": "Softplus", "not": "Not"}
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "pow": "Pow", "max": "Max", "min": "Min",
           "equal": "Equal", "less": "Less", "greater": "Greater", "and": "And", "or": "Or"}
_REDUCE = {"reduce_sum": "ReduceSum", "reduce_mean": "ReduceMean", "reduce_max": "ReduceMax",
           "reduce_min": "ReduceMin", "reduce_prod": "ReduceProd"}
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)


def supports(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]) -> str | None:
    """None if the kernel can run as an ORT sub-graph; offered only where a linear prim is inside."""
    if not any(p.op in ("matmul", "conv") for p in members):
        return "no linear primitive (ORT kernels are offered for convolutions and matmuls)"
    for p in members:
        if not (p.op in _UNARY or p.op in _BINARY or p.op in _REDUCE or p.op in _OTHER):
            return f"{p.op} has no ONNX form"
        if not p.type.static:
            return f"{p.name} has a symbolic shape"
    return None


def _node(helper, p: Prim, consts: dict[str, np.ndarray]):
    a = p.a
    name = p.name

    def const(tag, value):
        cname = f"{name}__{tag}"
        consts[cname] = np.asarray(value)
        return cname

    if p.op in _UNARY:
        return helper.make_node(_UNARY[p.op], list(p.inputs), [name])
    if p.op in _BINARY:
        return helper.make_node(_BINARY[p.op], list(p.inputs), [name])
    if p.op in _REDUCE:
        return helper.make_node(_REDUCE[p.op], [p.inputs[0], const("axes", np.asarray(a["axes"], np.int64))], [name],
                                keepdims=int(a.get("keepdims", 1)))
    return _OTHER[p.op](helper, p, const)


def _cast(helper, p, const):
    from onnx import helper as h
    return h.make_node("Cast", list(p.inputs), [p.name], to=h.np_dtype_to_tensor_dtype(np.dtype(p.a["to"])))


def _slice(helper, p, const):
    a = p.a
    ends = [e if e >= 0 else (INT64_MAX if s > 0 else INT64_MIN) for e, s in zip(a["ends"], a["steps"])]
    return helper.make_node("Slice", [p.inputs[0], const("starts", np.asarray(a["begins"], np.int64)),
                                      const("ends", np.asarray(ends, np.int64)),
                                      const("axes", np.asarray(a["axes"], np.int64)),
                                      const("steps", np.asarray(a["steps"], np.int64))], [p.name])


def _pad(helper, p, const):
    a = p.a
    ins = [p.inputs[0], const("pads", np.asarray(a["pads"], np.int64))]
    mode = a.get("mode", "constant")
    if mode == "constant":
        ins.append(const("value", np.asarray(a.get("value", 0.0), dtype=p.type.dtype)))
    return helper.make_node("Pad", ins, [p.name], mode=mode)


def _pool(helper, p, const):
    a = p.a
    kw = dict(kernel_shape=list(a["kernel"]), strides=list(a["strides"]), pads=list(a["pads"]),
              ceil_mode=int(a.get("ceil_mode", 0)))
    if a["mode"] == "max":
        return helper.make_node("MaxPool", list(p.inputs), [p.name], dilations=list(a["dilations"]), **kw)
    if any(d != 1 for d in a["dilations"]):
        raise KernorchError("average pooling with dilation has no ONNX opset-18 form")
    return helper.make_node("AveragePool", list(p.inputs), [p.name],
                            count_include_pad=int(a.get("count_include_pad", 0)), **kw)


_OTHER = {
    "cast": _cast,
    "where": lambda helper, p, const: helper.make_node("Where", list(p.inputs), [p.name]),
    "expand": lambda helper, p, const: helper.make_node(
        "Expand", [p.inputs[0], const("shape", np.asarray(p.a["shape"], np.int64))], [p.name]),
    "transpose": lambda helper, p, const: helper.make_node("Transpose", list(p.inputs), [p.name],
                                                           perm=list(p.a["perm"])),
    "reshape": lambda helper, p, const: helper.make_node(
        "Reshape", [p.inputs[0], const("shape", np.asarray(p.a["shape"], np.int64))], [p.name]),
    "slice": _slice,
    "concat": lambda helper, p, const: helper.make_node("Concat", list(p.inputs), [p.name], axis=int(p.a["axis"])),
    "pad": _pad,
    "gather": lambda helper, p, const: helper.make_node("Gather", list(p.inputs), [p.name], axis=int(p.a["axis"])),
    "matmul": lambda helper, p, const: helper.make_node("MatMul", list(p.inputs), [p.name]),
    "conv": lambda helper, p, const: helper.make_node(
        "Conv", list(p.inputs), [p.name], strides=list(p.a["strides"]), pads=list(p.a["pads"]),
        dilations=list(p.a["dilations"]), group=int(p.a["group"])),
    "pool": _pool,
}


def to_onnx(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]):
    """The kernel as an ONNX model: non-constant inputs are graph inputs, weights initializers."""
    import onnx
    from onnx import helper, numpy_helper
    consts: dict[str, np.ndarray] = {}
    nodes = [_node(helper, p, consts) for p in members]

    def vi(name):
        t = graph.type_of(name)
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(t.dtype)),
                                             [int(d) for d in t.shape])

    g_inputs = [vi(t) for t in inputs if t not in graph.constants]
    inits = [numpy_helper.from_array(np.asarray(graph.constants[t]), t) for t in inputs if t in graph.constants]
    inits += [numpy_helper.from_array(v, k) for k, v in consts.items()]
    g = helper.make_graph(nodes, "kernel", g_inputs, [vi(o) for o in outputs], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    return m


def session(model_bytes: bytes, threads: int):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


class OrtKernel:
    """`run_dps(*inputs, *outputs)` on numpy arrays through an IOBinding (no copies)."""

    def __init__(self, graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str],
                 threads: int | None = None):
        threads = threads or int(os.environ.get("TVM_NUM_THREADS", "0") or 0) or (os.cpu_count() or 1)
        self.model = to_onnx(graph, members, inputs, outputs)
        self.sess = session(self.model.SerializeToString(), threads)
        self.inputs = list(inputs)
        self.feed = [(i, t) for i, t in enumerate(inputs) if t not in graph.constants]
        self.outputs = list(outputs)
        self.out_types = [graph.type_of(o) for o in outputs]
        self.describe = "ort:" + "+".join(p.op for p in members)
        self._binding, self._bound_ptrs = None, None

    def run_dps(self, *args: np.ndarray) -> None:
        # The VM's planned buffers keep their addresses from call to call: bind them once.
        ptrs = tuple(a.ctypes.data for a in args)
        if ptrs == self._bound_ptrs:
            self.sess.run_with_iobinding(self._binding)
            return
        b = self.sess.io_binding()
        for i, name in self.feed:
            x = args[i]
            if not x.flags.c_contiguous:
                x = np.ascontiguousarray(x)
            b.bind_input(name, "cpu", 0, x.dtype, list(x.shape), x.ctypes.data)
        for j, name in enumerate(self.outputs):
            y = args[len(self.inputs) + j]
            if not y.flags.c_contiguous:
                raise KernorchError(f"{self.describe}: output buffer {name} is not C-contiguous")
            b.bind_output(name, "cpu", 0, y.dtype, list(y.shape), y.ctypes.data)
        self.sess.run_with_iobinding(b)
        self._binding, self._bound_ptrs = b, ptrs

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        outs = [np.empty(tuple(int(d) for d in t.shape), t.dtype) for t in self.out_types]
        self.run_dps(*[np.asarray(x, order="C") for x in inputs], *outs)
        return outs


def make(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]) -> OrtKernel:
    reason = supports(graph, members, inputs, outputs)
    if reason is not None:
        raise KernorchError(f"no ORT implementation: {reason}")
    return OrtKernel(graph, members, inputs, outputs)
