"""Kernels and their boundary layouts, as the orchestration program and the emitter see them.

A kernel variant reads and writes each activation at its boundary in a layout its schedule names
(kernorch.kernels.variants): plain NCHW, or blocked nChw16c/nChw8c. The orchestration program
names a tensor in a non-plain layout "t@nChw16c", so a producer and a consumer that disagree need a
conversion kernel between them, which is a choice of its own. A conversion is a kernel of one copy
prim whose input and output layouts differ ("b16/block": plain to blocked, "b16/unblock": back).

    kernel_io(graph, k)       -> KernelIO: the kernel graph, its parameter order, and the names
                                 (layout included) of every activation it reads and writes
    conversion(graph, t, s)   -> KernelIO of the conversion of tensor t in direction s
"""
from __future__ import annotations

from dataclasses import dataclass

from .ir import Graph, kernel_graph, make_prim, structural_key
from .kernels import blocked, layout_of
from .kernels.variants import block_of


def qualified(tensor: str, layout: str) -> str:
    """The orchestration program's name of `tensor` in `layout`."""
    return tensor if layout == "plain" else f"{tensor}@{layout}"


@dataclass(frozen=True)
class KernelIO:
    """One kernel as the emitter calls it: its own graph, its parameters (inputs in lowering order),
    its outputs, and the program's names of both (activations only, layout included)."""

    graph: Graph
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    reads: tuple[str, ...]       # per input: its name in the program (constants keep theirs)
    writes: tuple[str, ...]      # per output


def _io(kg: Graph, inputs, outputs, schedule: str, names_in, names_out) -> KernelIO:
    reads = tuple(t if t in kg.constants else qualified(n, layout_of(kg, t, schedule, "in"))
                  for t, n in zip(inputs, names_in))
    writes = tuple(qualified(n, layout_of(kg, t, schedule, "out")) for t, n in zip(outputs, names_out))
    return KernelIO(kg, tuple(inputs), tuple(outputs), reads, writes)


def candidate_io(graph: Graph, members, inputs, outputs, schedule: str) -> KernelIO:
    """A candidate kernel (members of `graph`) in variant `schedule`. Kept with the graph: each
    refine round's program asks for every candidate again (segformer_b0: 0.35 s a round)."""
    cache = graph.__dict__.setdefault("_candidate_io", {})
    key = (tuple(members), tuple(inputs), tuple(outputs), schedule)
    io = cache.get(key)
    if io is None:
        kg = kernel_graph(graph, members, inputs, outputs)
        io = cache[key] = _io(kg, inputs, outputs, schedule, inputs, outputs)
    return io


def conversion_graph(graph: Graph, tensor: str) -> tuple[Graph, str]:
    """A one-prim kernel graph copying `tensor` (its layouts come from the schedule)."""
    ty = graph.type_of(tensor)
    out = f"{tensor}#layout"
    return Graph(((tensor, ty),), (out,), (make_prim(out, "reshape", [tensor], ty, shape=tuple(ty.shape)),),
                 name="conversion"), out


def conversion(graph: Graph, tensor: str, schedule: str) -> KernelIO:
    """The conversion kernel of `tensor` ("b16/block" or "b16/unblock")."""
    kg, out = conversion_graph(graph, tensor)
    return _io(kg, (tensor,), (out,), schedule, (tensor,), (tensor,))


def conversion_key(graph: Graph, tensor: str) -> str:
    kg, out = conversion_graph(graph, tensor)
    return structural_key(kg.prims, kg, [out])


def conversions(graph: Graph, tensor: str, lanes: int) -> list[str]:
    """The conversion schedules a tensor can have: none unless it has a blocked layout."""
    if block_of(graph.type_of(tensor), lanes) is None:
        return []
    return [blocked(lanes, "block"), blocked(lanes, "unblock")]


def kernel_io(graph: Graph, k) -> KernelIO:
    """A plan kernel: a candidate in its variant, or (no members) a layout conversion."""
    if not k.members:
        return conversion(graph, k.inputs[0] if k.inputs else k.outputs[0], k.schedule)
    return candidate_io(graph, k.members, k.inputs, k.outputs, k.schedule)
