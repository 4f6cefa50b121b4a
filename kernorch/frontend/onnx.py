"""ONNX → a clean, folded, typed list of ONNX nodes (the input of fission).

The frontend binds symbolic input dimensions the user gave (`shapes`), infers every tensor's type,
and folds the constant subgraphs exporters emit (Constant, Shape → Gather → Unsqueeze → Concat →
Reshape chains, ConstantOfShape, ...) by evaluating them with onnx's reference implementation.
Initializers stay weights. Every problem becomes a `KernorchError` that names the file, the node,
the operator and what is wrong.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from ..ir import KernorchError, TensorType

log = logging.getLogger(__name__)

MIN_OPSET, MAX_OPSET = 13, 21
# nodes never folded even when their inputs are constant (random or stateful)
NOT_FOLDABLE = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
# constant folding must not materialise huge tensors that were not in the file
MAX_FOLD_ELEMS = 1 << 24


@dataclass(frozen=True)
class OnnxNode:
    name: str
    op_type: str
    inputs: tuple[str, ...]  # "" for an omitted optional input
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    domain: str = ""

    def where(self, source: str = "") -> str:
        at = f"{source}: " if source else ""
        return f"{at}node {self.name!r} ({self.op_type})"


@dataclass
class OnnxGraph:
    source: str
    opset: int
    inputs: list[tuple[str, TensorType]]
    outputs: list[str]
    nodes: list[OnnxNode]
    constants: dict[str, np.ndarray]
    types: dict[str, TensorType] = field(default_factory=dict)
    symbols: dict[str, str] = field(default_factory=dict)  # unbound symbol -> input that has it
    n_nodes_in_file: int = 0

    def histogram(self) -> dict[str, int]:
        h: dict[str, int] = {}
        for n in self.nodes:
            h[n.op_type] = h.get(n.op_type, 0) + 1
        return dict(sorted(h.items(), key=lambda kv: (-kv[1], kv[0])))


def _onnx():
    import onnx  # imported lazily: `kernorch --help` stays fast
    return onnx


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """'x=1x3x224x224' → ('x', (1, 3, 224, 224)); a clear error otherwise."""
    if "=" not in text:
        raise KernorchError(f"--shape {text!r}: expected NAME=D1xD2x..., e.g. input=1x3x224x224")
    name, dims = text.split("=", 1)
    try:
        shape = tuple(int(d) for d in dims.lower().replace(",", "x").split("x") if d != "")
    except ValueError:
        raise KernorchError(f"--shape {text!r}: dimensions must be integers") from None
    if any(d <= 0 for d in shape):
        raise KernorchError(f"--shape {text!r}: dimensions must be positive")
    return name.strip(), shape


def _np_dtype(elem_type: int) -> str:
    onnx = _onnx()
    try:
        return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)))
    except Exception:
        raise KernorchError(f"unsupported ONNX element type {elem_type}") from None


def _attrs(node) -> dict[str, Any]:
    onnx = _onnx()
    out = {}
    for a in node.attribute:
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [x.decode() for x in v]
        elif hasattr(v, "dims") and hasattr(v, "data_type"):  # TensorProto
            v = onnx.numpy_helper.to_array(v)
        out[a.name] = v
    return out


def run_onnx_node(op_type: str, attrs: Mapping[str, Any], inputs: Sequence[np.ndarray | None], domain: str = "",
                  opset: int = 17, n_outputs: int | None = None) -> list[np.ndarray]:
    """Evaluate one ONNX operator with onnx's reference implementation (used for folding and opaque prims)."""
    onnx = _onnx()
    from onnx.reference import ReferenceEvaluator
    in_names = [f"i{k}" if v is not None else "" for k, v in enumerate(inputs)]
    if n_outputs is None:
        n_outputs = {"TopK": 2, "Split": None}.get(op_type, 1) or 1
    out_names = [f"o{k}" for k in range(n_outputs)]
    # tensor attributes (ConstantOfShape's value, ...) were read as numpy arrays: make them tensors again
    attrs = {k: onnx.numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}
    node = onnx.helper.make_node(op_type, in_names, out_names, domain=domain, **attrs)
    ev = ReferenceEvaluator(node, opsets={"": opset} if not domain else {"": opset, domain: 1})
    feeds = {n: v for n, v in zip(in_names, inputs) if n}
    return [np.asarray(r) for r in ev.run(None, feeds)]


def _load_external_data(proto, path: Path) -> None:
    """Weights stored beside the model (ONNX external data): a clear error naming the missing file."""
    onnx = _onnx()
    from onnx.external_data_helper import load_external_data_for_model, uses_external_data
    locations = set()
    for t in proto.graph.initializer:
        if uses_external_data(t):
            loc = next((e.value for e in t.external_data if e.key == "location"), "?")
            locations.add(loc)
    if not locations:
        return
    missing = sorted(loc for loc in locations if not (path.parent / loc).exists())
    if missing:
        raise KernorchError(f"{path}: the weights are stored as external data in {', '.join(missing)}, which is "
                            f"missing beside the model (in {path.parent})")
    try:
        load_external_data_for_model(proto, str(path.parent))
    except Exception as e:  # a truncated or unreadable data file
        raise KernorchError(f"{path}: cannot read its external data {', '.join(sorted(locations))} "
                            f"({type(e).__name__}: {str(e)[:200]})") from None
    del onnx


def load(model: Any, shapes: Mapping[str, Sequence[int]] | None = None) -> OnnxGraph:
    """Load a path or ModelProto, bind input shapes, infer types and fold constants."""
    onnx = _onnx()
    shapes = dict(shapes or {})
    if isinstance(model, (str, os.PathLike)):
        source = str(model)
        p = Path(model)
        if not p.exists():
            raise KernorchError(f"{source}: no such file")
        if p.is_dir():
            raise KernorchError(f"{source}: is a directory, expected an .onnx file")
        try:
            proto = onnx.load(source, load_external_data=False)
        except Exception as e:  # protobuf DecodeError and friends
            raise KernorchError(f"{source}: not a valid ONNX model ({type(e).__name__}: {str(e)[:200]})") from None
        _load_external_data(proto, p)
    elif isinstance(model, onnx.ModelProto):
        proto = model
        source = proto.graph.name or "<model>"
    else:
        raise KernorchError(f"expected a path or an onnx.ModelProto, got {type(model).__name__}")
    if len(proto.graph.node) == 0 and len(proto.graph.output) == 0:
        raise KernorchError(f"{source}: the model has an empty graph (not an ONNX model?)")

    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None:
        raise KernorchError(f"{source}: the model imports no ai.onnx opset")
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise KernorchError(f"{source}: opset {opset} is not supported (kernorch reads opset {MIN_OPSET} to "
                            f"{MAX_OPSET}); convert it with onnx.version_converter")
    for n in proto.graph.node:
        if n.domain not in ("", "ai.onnx"):
            raise KernorchError(f"{source}: node {n.name!r} ({n.op_type}) is in domain {n.domain!r}; "
                                "only the default ai.onnx domain is supported")

    # --- constants and inputs ---------------------------------------------------------------
    constants: dict[str, np.ndarray] = {}
    for init in proto.graph.initializer:
        constants[init.name] = onnx.numpy_helper.to_array(init)
    inputs: list[tuple[str, TensorType]] = []
    symbols: dict[str, str] = {}
    for vi in proto.graph.input:
        if vi.name in constants:
            continue
        tt = vi.type.tensor_type
        dtype = _np_dtype(tt.elem_type)
        dims: list[int | str] = []
        for k, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or f"{vi.name}_dim{k}")
        if vi.name in shapes:
            want = tuple(int(x) for x in shapes.pop(vi.name))
            if len(want) != len(dims):
                raise KernorchError(f"{source}: input {vi.name!r} has rank {len(dims)} ({_fmt(dims)}), "
                                    f"--shape gave rank {len(want)} ({_fmt(want)})")
            for have, w in zip(dims, want):
                if isinstance(have, int) and have != w:
                    raise KernorchError(f"{source}: input {vi.name!r} has static shape {_fmt(dims)}; "
                                        f"--shape {_fmt(want)} does not match it")
            dims = list(want)
        for d in dims:
            if isinstance(d, str):
                symbols.setdefault(d, vi.name)
        inputs.append((vi.name, TensorType(tuple(dims), dtype)))
    if shapes:
        names = ", ".join(repr(n) for n, _ in inputs)
        raise KernorchError(f"{source}: --shape names {', '.join(map(repr, shapes))}, which "
                            f"{'is' if len(shapes) == 1 else 'are'} not model inputs (inputs: {names})")

    nodes = [OnnxNode(n.name or f"{n.op_type}_{i}", n.op_type, tuple(n.input), tuple(n.output), _attrs(n), n.domain)
             for i, n in enumerate(proto.graph.node)]
    outputs = [o.name for o in proto.graph.output]
    g = OnnxGraph(source, opset, inputs, outputs, nodes, constants, symbols=symbols,
                  n_nodes_in_file=len(proto.graph.node))
    _infer_types(g, proto)
    _fold(g, proto)
    return g


def _fmt(dims) -> str:
    return "x".join(str(d) for d in dims)


# a constant of more elements than this is shown to shape inference as a graph input of its type, not
# as an initializer: only its shape matters there (data propagation reads small shape tensors), and
# shape inference serializes the model it is given. gpt_like over seq=1..512 (Zen 3) loaded at six
# lengths in 1.8 s, 1.2 of them in 12 shape inferences copying its 30 MB of weights
INFER_VALUES_MAX = 1024


def _infer_types(g: OnnxGraph, proto) -> None:
    """Types of every tensor onnx's shape inference can give, with the bound input shapes."""
    onnx = _onnx()
    m = _shapes_only(proto)
    # bind input shapes in the copy
    by_name = dict(g.inputs)
    for vi in m.graph.input:
        if vi.name in by_name:
            t = by_name[vi.name]
            dims = vi.type.tensor_type.shape.dim
            for d, v in zip(dims, t.shape):
                if isinstance(v, int):
                    d.dim_value = v
                else:
                    d.dim_param = v
    # folded constants become initializers so data propagation sees them (the large ones inputs)
    have = {i.name for i in m.graph.initializer} | {i.name for i in m.graph.input}
    for name, arr in g.constants.items():
        if name not in have:
            arr = np.asarray(arr)
            if arr.size > INFER_VALUES_MAX:
                m.graph.input.append(onnx.helper.make_tensor_value_info(
                    name, onnx.helper.np_dtype_to_tensor_dtype(arr.dtype), arr.shape))
            else:
                m.graph.initializer.append(onnx.numpy_helper.from_array(arr, name))
    live = {n.name for n in g.nodes}
    keep = [n for n in m.graph.node if (n.name in live or not n.name)]
    if len(keep) != len(m.graph.node):
        del m.graph.node[:]
        m.graph.node.extend(keep)
    try:
        inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False, data_prop=True)
    except Exception as e:
        log.debug("shape inference failed: %s", e)
        return
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output) + list(inferred.graph.input):
        tt = vi.type.tensor_type
        if not tt.HasField("shape") or tt.elem_type == 0:
            continue
        dims = []
        for d in tt.shape.dim:
            dims.append(int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?"))
        try:
            g.types[vi.name] = TensorType(tuple(dims), _np_dtype(tt.elem_type))
        except KernorchError:
            pass
    for n, t in g.inputs:
        g.types[n] = t
    for n, c in g.constants.items():
        g.types[n] = TensorType(tuple(int(d) for d in c.shape), str(c.dtype))


def _shapes_only(proto):
    """A copy of `proto` for shape inference: its nodes, inputs and outputs, its small initializers,
    and each initializer of more than INFER_VALUES_MAX elements as a graph input of its type (no
    value_info: shape inference gives them again)."""
    onnx = _onnx()
    m = onnx.ModelProto()
    for attr in ("ir_version", "producer_name", "domain", "model_version"):
        setattr(m, attr, getattr(proto, attr))
    m.opset_import.extend(proto.opset_import)
    m.functions.extend(proto.functions)
    src, dst = proto.graph, m.graph
    dst.name = src.name
    dst.node.extend(src.node)
    dst.input.extend(src.input)
    dst.output.extend(src.output)
    listed = {i.name: i for i in dst.input}   # (an older model lists its initializers as inputs too)
    for init in src.initializer:
        if math.prod(init.dims) <= INFER_VALUES_MAX:
            dst.initializer.append(init)
            continue
        typed = onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims))
        if init.name in listed:
            listed[init.name].CopyFrom(typed)
        else:
            dst.input.append(typed)
    return m


def _fold(g: OnnxGraph, proto) -> None:
    """Fold constant subgraphs to a fixed point (shapes become known as Reshapes fold)."""
    for _round in range(8):
        changed = False
        kept: list[OnnxNode] = []
        for n in g.nodes:
            value = _try_fold(g, n)
            if value is None:
                kept.append(n)
                continue
            for name, v in zip(n.outputs, value):
                if name:
                    g.constants[name] = v
                    g.types[name] = TensorType(tuple(int(d) for d in v.shape), str(v.dtype))
            changed = True
        g.nodes = kept
        if not changed:
            break
        _infer_types(g, proto)
    # drop constants nobody reads any more (folded intermediates), keep graph outputs
    used = {t for n in g.nodes for t in n.inputs} | set(g.outputs)
    g.constants = {k: v for k, v in g.constants.items() if k in used}


def _try_fold(g: OnnxGraph, n: OnnxNode) -> list[np.ndarray] | None:
    if n.op_type == "Constant":
        a = n.attrs
        if "value" in a:
            return [np.asarray(a["value"])]
        for key, dt in (("value_float", np.float32), ("value_int", np.int64)):
            if key in a:
                return [np.asarray(a[key], dtype=dt)]
        for key, dt in (("value_floats", np.float32), ("value_ints", np.int64)):
            if key in a:
                return [np.asarray(a[key], dtype=dt)]
        raise KernorchError(f"{n.where(g.source)}: unsupported Constant attribute {sorted(a)}")
    if n.op_type in ("Shape", "Size"):
        t = g.types.get(n.inputs[0])
        if t is None or not t.static:
            return None
        if n.op_type == "Size":
            return [np.asarray(t.size, dtype=np.int64)]
        dims = list(t.shape)
        start, end = n.attrs.get("start", 0), n.attrs.get("end", None)
        return [np.asarray(dims[start:end], dtype=np.int64)]
    if n.op_type in NOT_FOLDABLE:
        return None
    real = [i for i in n.inputs if i]
    if not real or not all(i in g.constants for i in real):
        return None
    # folding an op on weights only that grows them (Expand, Tile) is fine up to a limit
    try:
        vals = run_onnx_node(n.op_type, n.attrs, [g.constants[i] if i else None for i in n.inputs], n.domain,
                             g.opset, n_outputs=len(n.outputs))
    except Exception as e:
        log.debug("could not fold %s: %s", n.where(), e)
        return None
    if sum(v.size for v in vals) > MAX_FOLD_ELEMS:
        return None
    return vals
