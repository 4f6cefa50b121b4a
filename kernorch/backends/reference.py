"""The "reference" implementation: an operator kept whole (TopK, NonZero, ...) run by onnx's
reference evaluator through a Python callback.

It exists so that models with such operators can still be optimized, but it is not compiled code:
a plan uses it only when the user allows Python kernels (`Options.python_kernels`,
`--allow-python-kernels`), and the report counts it. No TVM import here; the emitter registers
`run_dps` as a packed function for Relax `call_dps_packed`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..ir import Graph, KernorchError, Prim


def supports(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]) -> str | None:
    """None for a kernel that is exactly one opaque prim, else the reason."""
    if len(members) != 1 or members[0].op != "opaque":
        return "only single opaque operators run through the reference evaluator"
    return None


class OpaqueKernel:
    """An operator kept whole: `k(*inputs) -> [output]`, `k.run_dps(*inputs, output)`."""

    def __init__(self, prim: Prim, inputs: Sequence[str]):
        self.prim, self.num_inputs = prim, len(inputs)
        self.order = [list(inputs).index(t) for t in prim.inputs]
        self.describe = f"opaque {prim.attr('onnx_op')}"

    def __call__(self, *inputs: np.ndarray) -> list[np.ndarray]:
        from .. import primitives
        return [primitives.run(self.prim, [inputs[i] for i in self.order])]

    def run_dps(self, *args: np.ndarray) -> None:
        args[self.num_inputs][...] = self(*args[: self.num_inputs])[0]


def make(graph: Graph, members: Sequence[Prim], inputs: Sequence[str], outputs: Sequence[str]) -> OpaqueKernel:
    reason = supports(graph, members, inputs, outputs)
    if reason is not None:
        raise KernorchError(f"no reference implementation: {reason}")
    return OpaqueKernel(members[0], inputs)
