"""Lowering: a candidate kernel (a convex set of prims) to one TIR PrimFunc "main".

The primitives' TE computes (kernorch.primitives) are composed in topological order; packed
constant operands (kernorch.kernels.pack) enter as placeholders of their packed shape with an
"unpack" view that the schedule inlines.
"""
from __future__ import annotations

import types
from typing import Sequence

import tvm
import tvm.sym
from tvm import te, tirx, topi

from ... import primitives
from ...ir import Graph, KernorchError, Prim, SymDim, TensorType
from ...kernels import Winograd, split, variant_out_packs, variant_packs
from ...kernels.winograd import te_conv as winograd_conv

#: The TVM namespace handed to the primitive table's TE computes (they never import tvm).
T = types.SimpleNamespace(te=te, tir=tirx, topi=topi)

NUM_INPUTS_ATTR = "kernorch.num_inputs"
UNPACK = "unpack"  # TE stages that read a packed operand as its logical tensor (always inlined)
BLOCK = "block"    # TE stages that write a kernel output in a blocked layout


def lower(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str],
          schedule: str = "default") -> tvm.IRModule:
    """Compose the members' TE computes into one PrimFunc `main(*inputs, *outputs)`.

    `members` must be in topological order; every input of a member is another member or a name in
    `inputs` (graph inputs, constants/weights and other kernels' results are all plain params here).
    `schedule` names the kernel variant (kernorch.kernels.variants): inputs it takes in another
    layout (a packed weight, a blocked activation) are parameters of the packed shape read through
    an "unpack" view, and outputs it writes blocked are computed through a "block" view, so the
    members' computes stay in logical coordinates.
    """
    env: dict[str, te.Tensor] = {}
    params: list[te.Tensor] = []
    packs = variant_packs(graph, inputs, schedule)
    out_packs = variant_out_packs(graph, outputs, schedule)
    sym = Symbols()
    wino = Winograd.parse(split(schedule)[1])  # a Winograd variant: its conv is computed by kernels.winograd
    for i, name in enumerate(inputs):
        t = sym.type(graph.type_of(name))
        if any(isinstance(d, str) for d in t.shape):
            raise KernorchError(f"kernel input {name!r} has an unbound symbolic shape {t}; bind the shape first")
        if i in packs and not graph.type_of(name).static:
            raise KernorchError(f"kernel input {name!r}: packed layouts need static shapes")
        if i in packs:
            ph = te.placeholder(packs[i].packed_shape, t.dtype, name=f"in{i}_packed_{_ident(name)}")
            env[name] = packs[i].te_view(T, ph, f"{UNPACK}{i}")
        else:
            ph = te.placeholder(tuple(t.shape), t.dtype, name=f"in{i}_{_ident(name)}")
            env[name] = ph
        params.append(ph)
    member_names = {p.name for p in members}
    for p in members:
        d = primitives.get(p.op)
        if d.te is None:
            raise KernorchError(f"prim {p.name} ({p.op}, from {p.origin or '?'}) has no TE compute; "
                                "it must run as an opaque kernel, not inside a TIR kernel")
        missing = [t for t in p.inputs if t not in env]
        if missing:
            kind = "a later member" if any(m in member_names for m in missing) else "neither a member nor an input"
            raise KernorchError(f"prim {p.name} ({p.op}) reads {missing} which is {kind} of the kernel")
        want = sym.type(p.type)
        if wino is not None and p.op == "conv":
            out = winograd_conv(T, env[p.inputs[0]], env[p.inputs[1]], p.a, want.shape, wino)
        else:
            out = d.te(T, [env[t] for t in p.inputs], sym.value(p.a), want)
        if not sym.same_shape(out.shape, want.shape) or out.dtype != p.type.dtype:
            raise KernorchError(f"TE compute of {p.op} ({p.name}) gave {out.dtype}{list(out.shape)}, "
                                f"expected {p.type}")
        env[p.name] = out
    for o in outputs:
        if o not in member_names:
            raise KernorchError(f"kernel output {o!r} is not computed by a member")
    results = [out_packs[j].te_block(T, env[o], f"{BLOCK}{j}") if j in out_packs else env[o]
               for j, o in enumerate(outputs)]
    if sym.vars and out_packs:
        raise KernorchError("blocked output layouts need static shapes")
    func = te.create_prim_func(params + results, index_dtype_override="int64" if sym.vars else None)
    func = func.with_attr(NUM_INPUTS_ATTR, len(inputs))
    return tvm.IRModule({"main": func})


class Symbols:
    """The TIR variables of one kernel's symbolic dimensions (kernorch.dynamic.SymDim): one int64
    variable per symbol, shared by every shape and attribute that uses it."""

    def __init__(self):
        self.vars: dict[str, tirx.Var] = {}

    def expr(self, d):
        if not isinstance(d, SymDim):
            return d
        v = self.vars.setdefault(d.name, tirx.Var(d.name, "int64"))
        c0, c1, c2 = (tirx.IntImm("int64", c) for c in d.coeffs)
        e = c1 * v if d.coeffs[1] != 1 else v
        if d.coeffs[2]:
            e = e + c2 * v * v if d.coeffs[1] else c2 * v * v
        return e + c0 if d.coeffs[0] else e

    def value(self, v):
        if isinstance(v, dict):
            return {k: self.value(x) for k, x in v.items()}
        if isinstance(v, tuple):
            return tuple(self.value(x) for x in v)
        return self.expr(v)

    def type(self, t: TensorType) -> TensorType:
        return t if t.static else TensorType(tuple(self.expr(d) for d in t.shape), t.dtype)

    def same_shape(self, got, want) -> bool:
        if len(got) != len(want):
            return False
        if not self.vars:
            return tuple(int(s) for s in got) == tuple(want)
        ana = tvm.sym.Analyzer()
        return all(ana.can_prove_equal(g, w) for g, w in zip(got, want))


def _ident(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)[:40]

