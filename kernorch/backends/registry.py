"""Every implementation a kernel can have, declared once.

The rest of kernorch asks this registry instead of spelling implementation names: which ones the
solver may choose (`allowed`), whether one runs as compiled code inside the executable
(`native`), whether the tuning loop rather than `measure` produces its costs (`tuned`), and
whether it can implement a given kernel (`supports`).

    tvm        the primitives' TE computes composed into one TIR PrimFunc, scheduled by kernorch
               (micro-kernel tiles from the machine for contractions, rules for the rest)
    tvm-tuned  the same PrimFunc with MetaSchedule's best schedule (`--budget`)
    reference  an operator kept whole (TopK, NonZero, ...) run by onnx's reference evaluator
               through a Python callback; only with `python_kernels` (not compiled code)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..ir import Graph, KernorchError, Prim


def _generated(graph: Graph, members: Sequence[Prim], inputs, outputs) -> str | None:
    if any(p.op == "opaque" for p in members):
        return "opaque operators have no TE compute"
    return None


def _reference(graph: Graph, members: Sequence[Prim], inputs, outputs) -> str | None:
    from . import reference
    return reference.supports(graph, members, inputs, outputs)


@dataclass(frozen=True)
class Implementation:
    name: str
    native: bool        # compiled code inside the executable; False: a Python callback
    tuned: bool         # costs come from the tuning loop (kernorch.tune), not from `measure`
    supports: Callable[[Graph, Sequence[Prim], Sequence[str], Sequence[str]], str | None]
    summary: str


IMPLEMENTATIONS: dict[str, Implementation] = {i.name: i for i in (
    Implementation("tvm", True, False, _generated, "generated TIR, kernorch's schedule or micro-kernel tile"),
    Implementation("tvm-tuned", True, True, _generated, "generated TIR, MetaSchedule's best schedule"),
    Implementation("reference", False, False, _reference, "onnx reference evaluator (Python callback)"),
)}


def get(name: str) -> Implementation:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise KernorchError(f"unknown implementation {name!r}; known: {', '.join(IMPLEMENTATIONS)}") from None


def allowed(options) -> tuple[Implementation, ...]:
    """The implementations the solver may choose under `options`."""
    return tuple(i for i in IMPLEMENTATIONS.values() if i.native or options.python_kernels)


def measured(options) -> tuple[Implementation, ...]:
    """The allowed implementations whose costs `measure` produces (the others are tuned)."""
    return tuple(i for i in allowed(options) if not i.tuned)


def native(name: str) -> bool:
    return get(name).native


def python_kernel(impl: str, graph: Graph, members: Sequence[Prim], inputs, outputs):
    """The callable of a non-native kernel (`k(*arrays) -> outputs`, `k.run_dps(*inputs, *outputs)`)."""
    from . import reference
    if get(impl).native:
        raise KernorchError(f"{impl} kernels are compiled, not Python callbacks")
    return reference.make(graph, members, inputs, outputs)
