"""Automatic graph partitioning: cut the primitive graph at narrow frontiers.

Korch splits big graphs by hand (toml files naming boundary tensors) because enumerating candidate
kernels over a whole model is too slow. We cut automatically instead: walk the graph's topological
order and, whenever more than `max_prims` prims remain, cut at the position in the second half of
the next `max_prims` window where the fewest live tensors cross (ties go to the position where the
fewest bytes cross, then to the later one, so partitions stay close to the size cap). In DNNs the
narrowest cuts are usually width 1 or 2: the residual stream between transformer layers, the
activation between conv stages.

What a cut gives up. No candidate kernel spans a cut, so
  * fusions across it are lost: the prims on either side of a cut never share a kernel, and the
    tensors crossing it (the cut width) are always written to and read back from memory;
  * recomputation across it is lost: a kernel in a later partition can never recompute a prim of an
    earlier one, it must read the tensor the earlier partition wrote.
The orchestration optimum is exact within each partition, and because the partitions only meet at
the crossing tensors, the sum of the per-partition optima is the optimum among all plans that
respect the cuts (it may be worse than the unrestricted optimum, by at most what the lost fusions
and recomputations would have saved). A graph of at most `max_prims` prims is one partition, so no
optimality is given up there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from .ir import Graph, KernorchError, SymDim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Partition:
    """A contiguous range of the graph's topological order.

    `inputs`: tensors read inside but produced outside it (earlier partitions or graph inputs),
    constants excluded, in order of first use. `outputs`: prims of this partition read by a later
    partition or that are graph outputs, in topological order.
    """

    index: int
    prims: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def cut_widths(graph: Graph) -> list[int]:
    """width[c] = number of prim-produced tensors crossing a cut before prim c of the topological order.

    A tensor produced at position i and last read at position j crosses every cut c with i < c <= j.
    Graph inputs and constants never count: they are available to every partition.
    """
    return _crossing(graph, lambda name: 1)


def cut_bytes(graph: Graph, at: Mapping[str, int] | None = None) -> list[int]:
    """bytes[c] = the bytes of the prim-produced tensors crossing a cut before prim c (as
    `cut_widths`), a symbolic dimension's at `at` (each symbol's value; 1 where it has none)."""
    def nbytes(name: str) -> int:
        ty = graph.by_name[name].type
        n = np.dtype(ty.dtype).itemsize
        for d in ty.shape:
            if isinstance(d, SymDim):
                d = d.subs({**dict.fromkeys(d.names, 1), **(at or {})})
            n *= max(0, int(d))
        return n
    return _crossing(graph, nbytes)


def _crossing(graph: Graph, weight: Callable[[str], int]) -> list[int]:
    """The sum of `weight` over the prim-produced tensors crossing each cut (see `cut_widths`)."""
    n = len(graph.prims)
    index = {p.name: i for i, p in enumerate(graph.prims)}
    last_use = list(range(n))
    for j, p in enumerate(graph.prims):
        for t in p.inputs:
            i = index.get(t)
            if i is not None:
                last_use[i] = max(last_use[i], j)
    delta = [0] * (n + 1)
    for i, j in enumerate(last_use):
        if j > i:
            w = weight(graph.prims[i].name)
            delta[i + 1] += w
            delta[j + 1] -= w
    widths, run = [], 0
    for c in range(n):
        run += delta[c]
        widths.append(run)
    return widths


def partition(graph: Graph, max_prims: int = 64, at: Mapping[str, int] | None = None) -> list[Partition]:
    """Split `graph` into partitions of at most `max_prims` prims, cut at narrow frontiers.

    Every prim lands in exactly one partition; partitions come in topological order, so a
    partition's inputs are graph inputs or outputs of earlier partitions. See the module docstring
    for what a cut gives up. `at`: the value of each symbol the crossing bytes are weighed at.
    Among cuts of one width, the fewest bytes: a tensor that depends only on a symbol (a mask over
    seq) crosses every cut of a layer, so the last layer's attention, after its last read, had as
    few tensors crossing between the softmax's exp and sum as between the layers (gpt_like over
    seq=1..512, dim 384: the cut fell there, 7.5 MiB crossing at 512 against 2.5 MiB between the
    layers, and the last layer ran its attention in five kernels).
    """
    if max_prims < 1:
        raise KernorchError(f"max_prims must be at least 1, got {max_prims}")
    n = len(graph.prims)
    widths = cut_widths(graph)
    sizes = cut_bytes(graph, at)
    bounds = [0]
    while n - bounds[-1] > max_prims:
        start = bounds[-1]
        lo, hi = start + max(1, max_prims // 2), start + max_prims
        cut = min(range(lo, hi + 1), key=lambda c: (widths[c], sizes[c], -c))
        log.debug("cut before prim %d (%s), width %d, %d bytes", cut, graph.prims[cut].name, widths[cut],
                  sizes[cut])
        bounds.append(cut)
    bounds.append(n)

    graph_outputs = set(graph.outputs)
    parts = []
    for k, (start, end) in enumerate(zip(bounds, bounds[1:])):
        prims = graph.prims[start:end]
        names = tuple(p.name for p in prims)
        inside = set(names)
        inputs = dict.fromkeys(t for p in prims for t in p.inputs if t not in inside and t not in graph.constants)
        outputs = tuple(nm for nm in names if nm in graph_outputs
                        or any(c.name not in inside for c in graph.consumers.get(nm, ())))
        parts.append(Partition(k, names, tuple(inputs), outputs))
    if len(parts) > 1:
        log.info("partitioned %s (%d prims) into %d parts of sizes %s, cut widths %s", graph.name, n, len(parts),
                 [len(p.prims) for p in parts], [widths[b] for b in bounds[1:-1]])
    return parts
