"""Causal masks: an attention whose scores are masked above the diagonal skips the keys it masks.

A decoder (GPT-2's architecture) adds to its attention scores, before the softmax, a mask that is
a large negative number where the key comes after the query (`(1 - tril(ones)) * -10000`, or the
lowest float). Computed from the sequence's length, it folds to a constant (over a range of
lengths, the leading slice of its value at the range's end: kernorch.dynamic). Its softmax gives
those keys a probability that underflows to exactly zero, so a row tile of queries ending at row
`i` need compute its scores, softmax and values only over keys `0..i`: half the work of a long
sequence.

`annotate(graph)` marks each `add` prim whose operand is such a mask (attribute
`CAUSAL_OPERAND`: the operand's index), when the operand's value is known from the graph's
constants alone: a constant, a leading slice of one (begins 0, steps 1: the slice of a masked
square is a masked square), or an elementwise function of those. Its value must be, along its two
last axes (the result's rows and columns, not broadcast), at most `MASKED` strictly above the
diagonal and at least `OPEN` on it. The attention schedule then skips, for each row tile, the keys
past its last row (kernorch.backends.tvm.schedule). Skipping a key j of row i is exact when its
score s_ij is below s_ii + |MASKED| - |OPEN| - 88 (the exponential of anything below -88
underflows to zero in float32): |s_ij - s_ii| < 9800, far beyond the scores of any trained model
(a softmax over such a row is one-hot already).

The attribute is part of the prim, so it is part of every kernel's structural key: a kernel that
skips keys is never confused with one that does not. A kernel measured alone is given a mask
input with the same property (`impose`), as the model's is.
"""
from __future__ import annotations

import numpy as np

from . import primitives
from .ir import Graph, Prim

CAUSAL_OPERAND = "causal_operand"
MASKED = -1e4   # at most this strictly above the diagonal
OPEN = -100.0   # at least this on the diagonal (each query sees itself)
_MAX_ELEMENTS = 1 << 26  # values evaluated for the check: a 8192 x 8192 float mask


def _known_values(graph: Graph) -> dict[str, np.ndarray]:
    """The values computable from the graph's constants alone, through leading slices and
    elementwise prims (a leading slice of a constant stands for the whole constant: what holds of
    every square leading block of it, holds of the slice)."""
    values = {c: np.asarray(v) for c, v in graph.constants.items()}
    for p in graph.prims:
        if not p.inputs or any(t not in values for t in p.inputs):
            continue
        if p.op == "slice":
            a = p.a
            if all(b == 0 for b in a.get("begins", ())) and all(s == 1 for s in a.get("steps", ())):
                values[p.name] = values[p.inputs[0]]
            continue
        if primitives.kind(p.op) != "elementwise":
            continue
        if max(v.size for v in (values[t] for t in p.inputs)) > _MAX_ELEMENTS:
            continue
        try:
            with np.errstate(all="ignore"):
                values[p.name] = np.asarray(primitives.get(p.op).ref([values[t] for t in p.inputs], p.a))
        except Exception:  # noqa: BLE001 - shapes that only broadcast at a bound length: unknown
            continue
    return values


def is_causal(value: np.ndarray) -> bool:
    """Whether `value`'s two last axes form a square masked above its diagonal (see the module)."""
    if value.ndim < 2 or value.shape[-1] != value.shape[-2] or value.shape[-1] < 2 or value.dtype.kind != "f":
        return False
    n = value.shape[-1]
    upper = np.triu(np.ones((n, n), bool), 1)
    diagonal = np.eye(n, dtype=bool)
    v = value.reshape(-1, n, n)
    return bool(np.all(v[:, upper] <= MASKED) and np.all(v[:, diagonal] >= OPEN))


def annotate(graph: Graph) -> Graph:
    """`graph` with each `add` of a causal mask to a tensor of its rows and columns marked
    (attribute CAUSAL_OPERAND); the graph itself when there is none."""
    candidates = [p for p in graph.prims if p.op == "add" and p.attr(CAUSAL_OPERAND) is None]
    if not candidates:
        return graph
    values = None
    marked: dict[str, Prim] = {}
    for p in candidates:
        out = tuple(p.type.shape)
        for k, t in enumerate(p.inputs):
            shape = tuple(graph.type_of(t).shape)
            if len(shape) < 2 or len(out) < 2 or shape[-2:] != out[-2:] or shape[-1] != shape[-2]:
                continue
            other = graph.type_of(p.inputs[1 - k]).shape
            if tuple(other[-2:]) != out[-2:]:
                continue  # (the other operand must have the rows and columns itself)
            values = _known_values(graph) if values is None else values
            if t in values and is_causal(values[t]):
                marked[p.name] = Prim(p.name, p.op, p.inputs, tuple(sorted((*p.attrs, (CAUSAL_OPERAND, k)))),
                                      p.type, p.origin)
                break
    if not marked:
        return graph
    return Graph(graph.inputs, graph.outputs, tuple(marked.get(p.name, p) for p in graph.prims), graph.constants,
                 graph.name)


def marked(graph: Graph) -> list[str]:
    """The adds `annotate` marked, in graph order (their attention skips the masked keys)."""
    return [p.name for p in graph.prims if p.op == "add" and p.attr(CAUSAL_OPERAND) is not None]


def causal_inputs(graph: Graph) -> set[str]:
    """The inputs (not constants) of `graph` (a kernel's) that a marked add reads as its mask."""
    names = {n for n, _ in graph.inputs}
    adds = (graph.by_name[a] for a in marked(graph))
    return {p.inputs[p.attr(CAUSAL_OPERAND)] for p in adds} & names


def impose(x: np.ndarray) -> np.ndarray:
    """`x` (a random mask input of a kernel measured alone) made causal: MASKED strictly above the
    diagonal of its two last axes, its values elsewhere (random ones are at least OPEN)."""
    n = x.shape[-1]
    out = np.array(x, copy=True)
    out[..., np.triu(np.ones((n, n), bool), 1)] = MASKED
    return out
