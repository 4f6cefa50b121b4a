"""Library implementations of linear kernels: numpy / OpenBLAS.

A library kernel is exactly one `matmul` or `conv` prim optionally followed by a chain of
elementwise prims (bias add, relu, sigmoid, ...). The GEMM goes to OpenBLAS through `np.matmul(...,
out=)`; the epilogue runs in numpy in place on the output array, so conv+bias+relu is one kernel.
Convolutions: 1x1/stride 1/no pad as a plain GEMM, depthwise (one input channel per group) as a sum
of shifted multiply-adds, everything else as im2col + (grouped) GEMM. Scratch buffers (padded input,
im2col matrix) are allocated once per kernel and reused, so a kernel is not thread-safe.

No TVM import here: `register(kernel, name)` delegates to kernorch.backends.tvm.register_packed,
after which Relax can call the kernel with `relax.call_dps_packed(name, args, out_ty=...)`.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..ir import Graph, KernorchError, Prim

log = logging.getLogger(__name__)

# elementwise epilogue ops: name -> in-place numpy evaluation f(acc, other_or_None, acc_is_first, out)
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "max": np.maximum,
           "min": np.minimum, "pow": np.power}
_UNARY = {"relu", "sigmoid", "tanh", "exp", "neg", "abs", "sqrt", "reciprocal", "erf", "softplus"}


# epilogue ops that are one numpy ufunc, applied in place
_UFUNCS = {"tanh": np.tanh, "exp": np.exp, "neg": np.negative, "abs": np.abs, "sqrt": np.sqrt,
           "reciprocal": np.reciprocal}


def _unary_inplace(op: str, y: np.ndarray) -> None:
    if op == "relu":
        np.maximum(y, 0, out=y)
    elif op == "sigmoid":  # 1 / (1 + exp(-y)), in place
        np.negative(y, out=y)
        np.exp(y, out=y)
        y += 1
        np.reciprocal(y, out=y)
    elif op in _UFUNCS:
        _UFUNCS[op](y, out=y)
    elif op == "erf":
        from .. import primitives

        y[...] = primitives.TABLE["erf"].ref([y], {})
    elif op == "softplus":
        from .. import primitives

        y[...] = primitives.TABLE["softplus"].ref([y], {})
    else:  # pragma: no cover - guarded by supports()
        raise KernorchError(f"no in-place epilogue for {op}")


def supports(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]) -> str | None:
    """None if `make` can implement this kernel, else the reason it cannot."""
    if not members:
        return "empty kernel"
    if len(members) == 1 and members[0].op == "opaque":
        return None  # kept-whole operators run through their reference implementation
    head = members[0]
    if head.op not in ("matmul", "conv"):
        return f"first member is {head.op}, not matmul/conv"
    if head.type.dtype != "float32" or not head.type.static:
        return f"linear prim type {head.type} is not static float32"
    for t in head.inputs:
        if t not in inputs:
            return f"linear prim input {t!r} is not a kernel input"
    if head.op == "conv":
        x = graph.type_of(head.inputs[0])
        if x.rank != 4:
            return f"only 2-D convolutions (rank-4 input), got rank {x.rank}"
    prev = head
    for p in members[1:]:
        if p.op not in _BINARY and p.op not in _UNARY:
            return f"epilogue op {p.op} is not supported in place"
        if tuple(p.type.shape) != tuple(head.type.shape) or p.type.dtype != "float32":
            return f"epilogue {p.name} ({p.op}) changes the type to {p.type}"
        chain = [t for t in p.inputs if t == prev.name]
        others = [t for t in p.inputs if t != prev.name]
        if not chain:
            return f"epilogue {p.name} does not consume the previous member {prev.name}"
        if len(chain) > 1 and p.op in _BINARY:
            pass  # e.g. mul(y, y): both operands are the chain value
        elif any(t not in inputs for t in others):
            return f"epilogue {p.name} reads {others}, not all kernel inputs (no side branches)"
        prev = p
    if list(outputs) != [members[-1].name]:
        return f"outputs {list(outputs)} must be exactly the last member {members[-1].name}"
    return None


class LibraryKernel:
    """Callable kernel on numpy arrays; `run_dps(*inputs, *outputs)` writes into given outputs."""

    def __init__(self, linear: Callable[[list[np.ndarray], np.ndarray], None],
                 epilogue: list[tuple[str, int | None, bool]], num_inputs: int,
                 out_shape: tuple[int, ...], describe: str):
        self._linear = linear
        self._epilogue = epilogue  # (op, index of the other input or None, chain value is operand 0)
        self.num_inputs = num_inputs
        self.out_shape = out_shape
        self.describe = describe

    def run_dps(self, *args: np.ndarray) -> None:
        if len(args) != self.num_inputs + 1:
            raise KernorchError(f"{self.describe}: expected {self.num_inputs} inputs + 1 output, got {len(args)}")
        ins, out = list(args[: self.num_inputs]), args[self.num_inputs]
        self._linear(ins, out)
        for op, other, first in self._epilogue:
            if op in _BINARY:
                z = out if other is None else ins[other]
                if first:
                    _BINARY[op](out, z, out=out)
                else:
                    _BINARY[op](z, out, out=out)
            else:
                _unary_inplace(op, out)

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        out = np.empty(self.out_shape, np.float32)
        self.run_dps(*[np.asarray(x, np.float32, order="C") for x in inputs], out)
        return [out]

    def __repr__(self) -> str:
        return f"LibraryKernel({self.describe})"


class OpaqueKernel:
    """An operator kept whole (TopK, ArgMax, ...): its reference implementation, as one kernel."""

    def __init__(self, prim: Prim, inputs: Sequence[str]):
        self.prim, self.num_inputs = prim, len(inputs)
        self.order = [list(inputs).index(t) for t in prim.inputs]
        self.describe = f"opaque {prim.attr('onnx_op')}"

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        from .. import primitives
        return [primitives.run(self.prim, [inputs[i] for i in self.order])]

    def run_dps(self, *args: np.ndarray) -> None:
        args[self.num_inputs][...] = self(*args[: self.num_inputs])[0]


def make(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]):
    reason = supports(graph, members, inputs, outputs)
    if reason is not None:
        raise KernorchError(f"no library implementation: {reason}")
    if members[0].op == "opaque":
        return OpaqueKernel(members[0], inputs)
    pos = {n: i for i, n in enumerate(inputs)}
    head = members[0]
    ia, ib = pos[head.inputs[0]], pos[head.inputs[1]]
    out_shape = tuple(int(d) for d in head.type.shape)
    if head.op == "matmul":
        def linear(ins, out):
            np.matmul(ins[ia], ins[ib], out=out)
        describe = "matmul"
    else:
        linear, describe = _conv(graph.type_of(head.inputs[0]).shape, graph.type_of(head.inputs[1]).shape,
                                 out_shape, head.a, ia, ib)
    epilogue = []
    prev = head.name
    for p in members[1:]:
        if p.op in _BINARY:
            a, b = p.inputs
            if a == prev and b == prev:
                epilogue.append((p.op, None, True))
            elif a == prev:
                epilogue.append((p.op, pos[b], True))
            else:
                epilogue.append((p.op, pos[a], False))
        else:
            epilogue.append((p.op, None, True))
        prev = p.name
    describe += "".join(f"+{p.op}" for p in members[1:])
    return LibraryKernel(linear, epilogue, len(inputs), out_shape, describe)


def _conv(xs, ws, ys, a, ix: int, iw: int):
    """The conv part of a kernel: returns (linear(ins, out), description)."""
    n, c, h, w_ = (int(d) for d in xs)
    m, cg, kh, kw = (int(d) for d in ws)
    oh, ow = int(ys[2]), int(ys[3])
    g = int(a["group"])
    sh, sw = a["strides"]
    dh, dw = a["dilations"]
    pt, pl, pb, pr = a["pads"]
    og = m // g
    if kh == kw == 1 and sh == sw == 1 and not any(a["pads"]) and g == 1:
        def linear(ins, out):  # plain GEMM: W[m, c] @ X[n, c, h*w]
            np.matmul(ins[iw].reshape(m, c), ins[ix].reshape(n, c, h * w_), out=out.reshape(n, m, oh * ow))
        return linear, "conv1x1(gemm)"
    padded = np.zeros((n, c, h + pt + pb, w_ + pl + pr), np.float32) if (pt or pb or pl or pr) else None

    def windows(x):
        """View (n, c, kh, kw, oh, ow) of the (padded) input: no copy."""
        if padded is not None:
            padded[:, :, pt:pt + h, pl:pl + w_] = x
            x = padded
        s0, s1, s2, s3 = x.strides
        return as_strided(x, (n, c, kh, kw, oh, ow), (s0, s1, s2 * dh, s3 * dw, s2 * sh, s3 * sw), writeable=False)

    if cg == 1:
        # depthwise (with channel multiplier og): accumulate kh*kw shifted products, no GEMM
        tmp = np.empty((n, g, og, oh, ow), np.float32)

        def linear(ins, out):
            win = windows(ins[ix])  # (n, g, kh, kw, oh, ow)
            wt = ins[iw].reshape(g, og, kh, kw)
            o = out.reshape(n, g, og, oh, ow)
            o[...] = 0
            for i in range(kh):
                for j in range(kw):
                    np.multiply(win[:, :, None, i, j], wt[None, :, :, i, j, None, None], out=tmp)
                    o += tmp
        return linear, "conv-depthwise"
    col = np.empty((n, c, kh, kw, oh, ow), np.float32)

    def linear(ins, out):  # im2col + GEMM, grouped through a batched matmul
        np.copyto(col, windows(ins[ix]))
        np.matmul(ins[iw].reshape(g, og, cg * kh * kw), col.reshape(n, g, cg * kh * kw, oh * ow),
                  out=out.reshape(n, g, og, oh * ow))
    return linear, "conv-im2col" if g == 1 else f"conv-im2col-g{g}"


def register(kernel: LibraryKernel, name: str) -> str:
    """Register `kernel.run_dps` as the global packed function `name` (for Relax call_dps_packed)."""
    from . import tvm as backend

    backend.register_packed(kernel.run_dps, name)
    return name
