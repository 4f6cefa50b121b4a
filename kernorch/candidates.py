"""Candidate kernels: the legal convex connected subgraphs of each partition.

A candidate is a set of prims that one kernel may compute. The solver later picks the cheapest set
of candidates that produces every output; legality here only says what *may* be fused, never what
should be (legality, cost and choice stay separate).

Legal means (see `legality`): at most one linear prim (matmul/conv) with any elementwise, broadcast,
layout or reduce prologue and epilogue around it, or two matmuls in the shape of attention (the
second contracts a softmax-like row-wise function of the first over its columns: `_attention`); an
opaque prim only alone; convex (no path leaves the set and re-enters it, so the kernel can run as
one launch); weakly connected through prim-to-prim edges (sharing a graph input or weight does not
connect); at most `max_outputs` outputs; at most `max_size` prims, not counting *closed pointwise*
members (elementwise prims that read only the set's own values and weights: a GELU or the scale and
shift of a LayerNorm after the set's contraction or reduction, computed on values the kernel holds
and costing no memory traffic), up to `max_size + max_pointwise` prims in all. Without that, a
LayerNorm (9 prims) was never one kernel at the default cap of 8, nor was a GEMM with its GELU.

Enumeration grows sets breadth-first by size, one adjacent prim at a time, and keeps only convex
sets in the frontier. That is complete: every convex connected set of two or more prims has a
member whose removal leaves a convex connected set (a source or sink of a leaf block of the set), so
it is reached from a smaller convex set. Sets are bitmasks over the partition's prims and are
deduplicated per size, so each set is examined once. Supersets of a set with two linear prims (not
in the shape of attention) or an opaque prim are never legal and are not grown, nor are sets with
more than `max_outputs` members that are graph outputs or read outside the partition (those stay
outputs in every superset); other sets with too many outputs are grown (absorbing a consumer can
remove outputs) but not emitted. Past `max_size` prims only sets within the cap are grown: removing
a sink never raises a set's count (a sink that was free leaves no member that read it), so a legal
set is reached through legal ones; the brute-force test checks that on random graphs, as no proof
covers a set whose only removable members are sources.
Rejection counts therefore count the sets examined, not every illegal superset.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from . import primitives
from .ir import Graph, KernorchError, Prim, graph_index, structural_key
from .partition import Partition, partition

log = logging.getLogger(__name__)

# Rejection reasons: short stable strings that reach the report.
EMPTY = "empty"
OVER_SIZE = "over size cap"
OPAQUE = "opaque primitive must be alone"
TWO_LINEAR = "two linear primitives"
NOT_CONNECTED = "not connected"
NOT_CONVEX = "not convex"
TOO_MANY_OUTPUTS = "too many outputs"


@dataclass(frozen=True)
class EnumOptions:
    max_size: int = 8  # prims per candidate, closed pointwise members not counted (`weight`)
    max_pointwise: int = 4  # ... and at most this many more prims in all (a GEMM with its GELU: 12)
    max_per_partition: int = 4000  # candidates kept per partition (singletons are always kept)
    max_outputs: int = 3  # tensors a candidate may write
    # Sets examined per partition (candidates plus rejected): a guard for pathologically wide graphs
    # (a prim with 60 consumers has ~10^8 connected sets of size 8), where the candidate cap alone
    # would not stop the growth of sets rejected for having too many outputs. 100k sets take ~1 s.
    max_visited: int = 100_000
    keep_rejected: int = 20  # Rejected entries kept per reason and partition; counts are always complete


@dataclass(frozen=True)
class Candidate:
    """One kernel the solver may choose.

    `inputs` are all tensors read from outside (graph inputs, weights, other kernels' outputs) in
    order of first use; the lowering makes them the kernel's parameters in this order, the same
    order `structural_key` numbers them. `deps` is the subset produced by prims: what the solver
    must make available before the kernel runs. `outputs` are members read outside the candidate
    or graph outputs, in topological order.
    """

    members: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    key: str
    partition: int
    deps: tuple[str, ...] = ()
    linear: str | None = None  # the member matmul/conv, if any (attention: the scores' matmul)

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True)
class Rejected:
    members: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class PartitionEnumeration:
    """Everything enumerate_partition found for one partition."""

    partition: Partition
    candidates: list[Candidate]
    rejected: list[Rejected]  # the first `keep_rejected` per reason
    rejected_counts: dict[str, int]  # complete counts per reason
    cap_hit: str | None  # name of the option that stopped the enumeration early, if any
    seconds: float


@dataclass(frozen=True)
class PartitionStats:
    index: int
    prims: int
    candidates: int
    distinct_keys: int
    rejected: dict[str, int]
    cap_hit: str | None
    seconds: float


@dataclass(frozen=True)
class Enumeration:
    partitions: list[Partition]
    candidates: list[Candidate]
    rejected: list[Rejected]
    stats: list[PartitionStats] = field(default_factory=list)

    def summary(self) -> str:
        keys = len({c.key for c in self.candidates})
        caps = sum(1 for s in self.stats if s.cap_hit)
        return (f"{len(self.partitions)} partitions, {len(self.candidates)} candidates ({keys} distinct keys), "
                f"{sum(sum(s.rejected.values()) for s in self.stats)} rejected, {caps} partitions capped, "
                f"{sum(s.seconds for s in self.stats):.2f}s")


# ---------------------------------------------------------------------------------------------
# legality: a pure predicate on (graph, members)
# ---------------------------------------------------------------------------------------------

def kernel_io(graph: Graph, members: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(inputs, outputs) of a kernel computing `members`, as defined on `Candidate`."""
    inside = set(members)
    prims = sorted((graph.by_name[m] for m in inside), key=lambda p: graph_index(graph, p.name))
    inputs = dict.fromkeys(t for p in prims for t in p.inputs if t not in inside)
    graph_outputs = set(graph.outputs)
    outputs = tuple(p.name for p in prims if p.name in graph_outputs
                    or any(c.name not in inside for c in graph.consumers.get(p.name, ())))
    return tuple(inputs), outputs


def _connected(graph: Graph, inside: set[str]) -> bool:
    start = next(iter(inside))
    seen, stack = {start}, [start]
    while stack:
        p = graph.by_name[stack.pop()]
        for q in [t for t in p.inputs if t in inside] + [c.name for c in graph.consumers.get(p.name, ())]:
            if q in inside and q not in seen:
                seen.add(q)
                stack.append(q)
    return len(seen) == len(inside)


def _convex(graph: Graph, inside: set[str]) -> bool:
    """No path leaves the set and re-enters it: walk forward from the set through outside prims only."""
    last = max(graph_index(graph, m) for m in inside)
    stack = [c.name for m in inside for c in graph.consumers.get(m, ()) if c.name not in inside]
    seen = set(stack)
    while stack:
        p = stack.pop()
        if graph_index(graph, p) > last:
            continue  # topological order: nothing after the last member can reach a member
        for c in graph.consumers.get(p, ()):
            if c.name in inside:
                return False
            if c.name not in seen:
                seen.add(c.name)
                stack.append(c.name)
    return True


def reduces_last_axis(graph: Graph, prim: Prim) -> bool:
    """A reduction over its input's last axis alone (a softmax's or a LayerNorm's, row by row)."""
    axes = prim.attr("axes")
    if primitives.kind(prim.op) != "reduce" or not axes:
        return False
    rank = len(graph.type_of(prim.inputs[0]).shape)
    return tuple(int(a) % rank for a in axes) == (rank - 1,)


def attention_parts(graph: Graph, inside: Iterable[str]) -> tuple[str, tuple[str, ...], str] | None:
    """(the scores' matmul, the members between in graph order, the values' matmul) when `inside`
    holds two matmuls where the second contracts, over the first's columns, a row-wise function of
    the first's result that holds a reduction over those columns (scores -> softmax -> x values;
    the members between include those read only after the values, a softmax's sum that divides them):
    one kernel computes it a row tile at a time, the scores of a row tile never leaving the cache.
    None otherwise."""
    inside = set(inside)
    lin = sorted((m for m in inside if primitives.kind(graph.by_name[m].op) == "linear"),
                 key=lambda m: graph_index(graph, m))
    if len(lin) != 2:
        return None
    s, o = (graph.by_name[m] for m in lin)
    if s.op != "matmul" or o.op != "matmul" or o.inputs[0] not in inside or o.inputs[1] in inside:
        return None
    if tuple(graph.type_of(o.inputs[0]).shape) != tuple(s.type.shape) or len(s.type.shape) < 2:
        return None
    # the members between: downstream of the scores and upstream of the probabilities
    down, todo = {s.name}, [s.name]
    while todo:
        for c in graph.consumers.get(todo.pop(), ()):
            if c.name in inside and c.name not in down and c.name != o.name:
                down.add(c.name)
                todo.append(c.name)
    up, todo = {o.inputs[0]}, [o.inputs[0]]
    while todo:
        for t in graph.by_name[todo.pop()].inputs:
            if t in inside and t not in up:
                up.add(t)
                todo.append(t)
    # ... and beside them, a member of the row-wise function read only after the values' matmul (a
    # softmax's sum when the normalization follows the values: kernorch.rewrite.after_attention)
    after, todo = {o.name}, [o.name]
    while todo:
        for c in graph.consumers.get(todo.pop(), ()):
            if c.name in inside and c.name not in after:
                after.add(c.name)
                todo.append(c.name)
    outputs, side, grew = set(graph.outputs), set(), True
    while grew:
        grew = False
        for m in sorted(down - up - after - side):
            if m not in outputs and all(c.name in inside and (c.name in up or c.name in after or c.name in side)
                                        for c in graph.consumers.get(m, ())):
                side.add(m)
                grew = True
    chain = ((down & up) | side) - {s.name}
    if down - after - chain - {s.name} or any(m in outputs or any(c.name not in inside for c in graph.consumers.get(m, ()))
                                              for m in chain):
        # (a member that reads the probabilities but neither feeds the values nor follows them, or
        # one read outside the kernel, such as the exp a softmax's sum outside it reads when the sum
        # divides the values: a row tile's probabilities never leave it)
        return None
    reduces = 0
    for m in chain:
        p = graph.by_name[m]
        k = primitives.kind(p.op)
        if k == "reduce":
            if not reduces_last_axis(graph, p):
                return None
            reduces += 1
        elif k != "elementwise":
            return None
    if not reduces:
        return None
    return s.name, tuple(sorted(chain, key=lambda m: graph_index(graph, m))), o.name


def closed_pointwise(graph: Graph, name: str, inside: set[str]) -> bool:
    """An elementwise member that reads only members of `inside` and weights."""
    p = graph.by_name[name]
    return primitives.kind(p.op) == "elementwise" and all(t in inside or t in graph.constants for t in p.inputs)


def weight(graph: Graph, inside: set[str]) -> int:
    """A set's size against the cap: its prims, not counting closed pointwise members."""
    return sum(1 for m in inside if not closed_pointwise(graph, m, inside))


def _attention(graph: Graph, inside: set[str]) -> bool:
    return attention_parts(graph, inside) is not None


def legality(graph: Graph, members: Iterable[str], opts: EnumOptions | None = None) -> str | None:
    """None if `members` may form one kernel, else the reason it may not (one of the constants above).

    The checks run in a fixed order, so a set that breaks several rules gets the same reason here
    and in the enumeration.
    """
    opts = opts or EnumOptions()
    inside = set(members)
    if not inside:
        return EMPTY
    unknown = inside - set(graph.by_name)
    if unknown:
        raise KernorchError(f"legality: {sorted(unknown)} are not prims of graph {graph.name!r}")
    if len(inside) > opts.max_size and (len(inside) > opts.max_size + opts.max_pointwise
                                        or weight(graph, inside) > opts.max_size):
        return OVER_SIZE
    kinds = [primitives.kind(graph.by_name[m].op) for m in inside]
    if "opaque" in kinds and len(inside) > 1:
        return OPAQUE
    if kinds.count("linear") > 1 and not _attention(graph, inside):
        return TWO_LINEAR
    if not _connected(graph, inside):
        return NOT_CONNECTED
    if not _convex(graph, inside):
        return NOT_CONVEX
    if len(kernel_io(graph, inside)[1]) > opts.max_outputs:
        return TOO_MANY_OUTPUTS
    return None


# ---------------------------------------------------------------------------------------------
# enumeration
# ---------------------------------------------------------------------------------------------

def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def make_candidate(graph: Graph, members: Iterable[str], part: int = 0) -> Candidate:
    """Build the Candidate record (io, key) for a set of prims; does not check legality."""
    prims: list[Prim] = sorted((graph.by_name[m] for m in set(members)), key=lambda p: graph_index(graph, p.name))
    names = tuple(p.name for p in prims)
    inputs, outputs = kernel_io(graph, names)
    linear = next((p.name for p in prims if primitives.kind(p.op) == "linear"), None)
    deps = tuple(t for t in inputs if t in graph.by_name)
    return Candidate(names, inputs, outputs, structural_key(prims, graph, outputs), part, deps, linear)


def enumerate_partition(graph: Graph, part: Partition, opts: EnumOptions | None = None) -> PartitionEnumeration:
    """All legal candidates of one partition, smallest first, with rejections and cap status.

    Exact when the partition is convex in the graph (no path leaves it and comes back), which holds
    for the contiguous ranges of a topological order that `partition` makes.
    """
    opts = opts or EnumOptions()
    t0 = time.perf_counter()
    names = part.prims
    n = len(names)
    local = {nm: i for i, nm in enumerate(names)}
    prims = [graph.by_name[nm] for nm in names]
    kinds = [primitives.kind(p.op) for p in prims]
    linear_mask = sum(1 << i for i, k in enumerate(kinds) if k == "linear")
    opaque_mask = sum(1 << i for i, k in enumerate(kinds) if k == "opaque")
    graph_outputs = set(graph.outputs)
    # elementwise prims reading only prims of the partition and weights: free against the size cap
    # once every prim they read is in the set
    pointwise_mask = sum(1 << i for i, (p, k) in enumerate(zip(prims, kinds))
                         if k == "elementwise" and all(t in local or t in graph.constants for t in p.inputs))

    # Local adjacency (undirected, for growth), consumers, producers; `external[i]`: prim i is read
    # outside the partition or is a graph output, so it is an output of every set containing it.
    adj, cons, prod = [0] * n, [0] * n, [0] * n
    for i, p in enumerate(prims):
        for t in p.inputs:
            j = local.get(t)
            if j is not None:
                adj[i] |= 1 << j
                adj[j] |= 1 << i
                cons[j] |= 1 << i
                prod[i] |= 1 << j
    external = [nm in graph_outputs or any(c.name not in local for c in graph.consumers.get(nm, ())) for nm in names]
    external_mask = sum(1 << i for i, e in enumerate(external) if e)
    # Strict descendants and ancestors inside the partition, as bitmasks (prims are topological).
    desc, anc = [0] * n, [0] * n
    for i in reversed(range(n)):
        for j in _bits(cons[i]):
            desc[i] |= (1 << j) | desc[j]
    for i in range(n):
        for j in _bits(prod[i]):
            anc[i] |= (1 << j) | anc[j]

    def weight_of(mask: int) -> int:
        return mask.bit_count() - sum(1 for i in _bits(mask & pointwise_mask) if not prod[i] & ~mask)

    def n_outputs(mask: int) -> int:
        return sum(1 for i in _bits(mask) if external[i] or cons[i] & ~mask)

    found: list[int] = []
    rejected: list[Rejected] = []
    counts: Counter[str] = Counter()

    def reject(mask: int, reason: str) -> None:
        counts[reason] += 1
        if counts[reason] <= opts.keep_rejected:
            rejected.append(Rejected(tuple(names[i] for i in _bits(mask)), reason))

    # Size 1: every prim, so that a plan always exists. Frontier entries: (set, neighbours, desc, anc).
    frontier = []
    for i in range(n):
        found.append(1 << i)
        if not opaque_mask >> i & 1:
            frontier.append((1 << i, adj[i], desc[i], anc[i]))
    cap_hit = "max_per_partition" if frontier and len(found) >= opts.max_per_partition else None
    visited, size = n, 1
    while frontier and size < opts.max_size + opts.max_pointwise and not cap_hit:
        seen: set[int] = set()
        grown = []
        for mask, nbrs, d, a in frontier:
            for v in _bits(nbrs):
                new = mask | 1 << v
                if new in seen:
                    continue
                seen.add(new)
                if size >= opts.max_size and weight_of(new) > opts.max_size:
                    continue  # over the cap (not counted: legality says OVER_SIZE, checked first)
                visited += 1
                if opaque_mask >> v & 1:
                    reject(new, OPAQUE)
                elif (linear_mask & new).bit_count() > 1 and not (
                        (linear_mask & new).bit_count() == 2 and _attention(graph, {names[i] for i in _bits(new)})):
                    reject(new, TWO_LINEAR)
                elif (d | desc[v]) & (a | anc[v]) & ~new:
                    reject(new, NOT_CONVEX)
                elif (external_mask & new).bit_count() > opts.max_outputs:
                    reject(new, TOO_MANY_OUTPUTS)  # these stay outputs in every superset: do not grow
                else:
                    grown.append((new, (nbrs | adj[v]) & ~new, d | desc[v], a | anc[v]))
                    if n_outputs(new) > opts.max_outputs:
                        reject(new, TOO_MANY_OUTPUTS)
                    else:
                        found.append(new)
                        if len(found) >= opts.max_per_partition:
                            cap_hit = "max_per_partition"
                if visited >= opts.max_visited and not cap_hit:
                    cap_hit = "max_visited"
                if cap_hit:
                    break
            if cap_hit:
                break
        frontier, size = grown, size + 1

    candidates = [make_candidate(graph, [names[i] for i in _bits(m)], part.index) for m in found]
    seconds = time.perf_counter() - t0
    if cap_hit:
        log.warning("partition %d: enumeration stopped by %s at size %d (%d candidates); smaller candidates kept",
                    part.index, cap_hit, size, len(candidates))
    log.debug("partition %d: %d prims, %d candidates, rejected %s, %.3fs", part.index, n, len(candidates),
              dict(counts), seconds)
    return PartitionEnumeration(part, candidates, rejected, dict(counts), cap_hit, seconds)


def enumerate_candidates(graph: Graph, part: Partition,
                         opts: EnumOptions | None = None) -> tuple[list[Candidate], list[Rejected]]:
    """Legal candidates of a partition and (the first `keep_rejected` per reason of) the rejected sets.

    Use `enumerate_partition` for complete rejection counts and whether a cap was hit.
    """
    r = enumerate_partition(graph, part, opts)
    return r.candidates, r.rejected


def enumerate_all(graph: Graph, opts: EnumOptions | None = None, max_prims: int = 64,
                  at: Mapping[str, int] | None = None) -> Enumeration:
    """Partition the graph (its cuts weighed with each symbol at `at`), then enumerate every
    partition's candidates, with per-partition stats."""
    parts = partition(graph, max_prims, at)
    candidates: list[Candidate] = []
    rejected: list[Rejected] = []
    stats = []
    for part in parts:
        r = enumerate_partition(graph, part, opts)
        candidates += r.candidates
        rejected += r.rejected
        stats.append(PartitionStats(part.index, len(part.prims), len(r.candidates),
                                    len({c.key for c in r.candidates}), r.rejected_counts, r.cap_hit, r.seconds))
    result = Enumeration(parts, candidates, rejected, stats)
    log.info("enumerated %s: %s", graph.name, result.summary())
    return result
