"""Kernel orchestration: pick the cheapest set of candidate kernels that computes the graph.

This module is a pure data interface. The pipeline turns a primitive graph into a `Problem`
(prim names, their dependencies, the graph outputs and the measured candidate kernels); `solve`
returns the provably cheapest executable selection. Nothing here knows about ONNX or TVM, so the
solver can be tested on synthetic instances against an exact search (`brute_force`).

Layouts. A tensor a kernel reads or writes is named by its prim ("t"), or by its prim and a layout
("t@nChw16c") when the kernel reads or writes it in that layout. A kernel variant in a blocked
layout is one more choice with those names; a *conversion* is a choice with no members that reads
one tensor in one layout and writes it in another (or, for a graph input, writes it blocked from
nothing the solver tracks). So the program picks kernels and layouts together: every edge's
producer and consumer agree, or a conversion is paid. Graph outputs are always the plain names.

The model: a binary x_k per candidate, a continuous availability a_t per consumed tensor (a_t <=
sum of the x_k that write t, and x_k <= a_t for every t that k reads), and one coverage row per
live primitive (the chosen kernels together compute it at least once). The coverage rows keep the
LP relaxation tight on most programs (root gaps of a fraction of a percent) so that HiGHS proves
optimality at or near the root; where many overlapping fusions carry near-equal estimates (the
decode head of segformer_b0: 2300 candidates on 41 prims) the root gap is 9-15 % and the branch
and bound takes seconds to tens of seconds; dropping the kernels that two others do at most as
dearly (`_splits`) shrinks that tree without moving the optimum. Cycles among multi-output kernels
are cut lazily (first-writer cuts, below). A program that falls apart into blocks meeting in a few tensors (the pipeline's
partitions) is solved block by block, with the same optimum (kernorch.blocks).
"""
from __future__ import annotations

import heapq
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import highspy
import numpy as np

from kernorch.ir import KernorchError


class NoPlan(KernorchError):
    """No selection of the problem's kernels computes the graph's outputs: every prim has a kernel,
    but no set of them covers each once without one needing a tensor another holds inside (two
    fusions each taking the other's inner result)."""


log = logging.getLogger(__name__)

KINDS = ("elementwise", "reduce", "broadcast", "layout", "linear", "opaque")


@dataclass(frozen=True)
class Choice:
    """One candidate kernel in one implementation and schedule, with its measured latency.

    `inputs` holds only tensors produced by prims (graph inputs and weights are always available,
    so they never constrain the schedule). `outputs` holds the members whose value is used outside
    the kernel or is a graph output; a prim's output tensor is named like the prim. `schedule` is
    opaque to the solver (the micro-kernel tile, "default", a tuning record): it travels to the plan.
    """

    id: str
    key: str
    impl: str
    members: frozenset[str]
    inputs: frozenset[str]
    outputs: frozenset[str]
    cost_ns: int
    order: tuple[str, ...] = ()
    schedule: str = "default"


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything the orchestrator needs: the prim DAG, the graph outputs and the candidates.

    `kinds` (prim -> one of KINDS) is only used by the rule-based `greedy` baseline.
    """

    prims: tuple[str, ...]
    deps: Mapping[str, tuple[str, ...]]
    outputs: tuple[str, ...]
    choices: tuple[Choice, ...]
    kinds: Mapping[str, str] = field(default_factory=dict)
    sources: frozenset[str] = frozenset()   # graph inputs a conversion may block


def base(tensor: str) -> str:
    """The prim (or graph input) a tensor name refers to: "t@nChw16c" -> "t"."""
    return tensor.split("@", 1)[0]


def is_conversion(c: Choice) -> bool:
    return not c.members


def _rank_of(c: Choice, rank: Mapping[str, int]) -> int:
    """Where a choice sits in topological order: its earliest member, or its tensor for a conversion."""
    if c.members:
        return min(rank[m] for m in c.members)
    return rank.get(base(next(iter(c.outputs))), -1)


@dataclass(frozen=True)
class Solution:
    """A selection of choices in an execution order, with the solver's evidence of its quality.

    `bound_ns` is a proven lower bound on the optimum (0 for heuristics), so
    `gap = (objective_ns - bound_ns) / objective_ns` says how far from optimal the plan can be.
    """

    chosen: tuple[str, ...]
    status: str
    objective_ns: int
    bound_ns: int = 0
    gap: float = math.inf
    solve_seconds: float = 0.0
    n_cuts: int = 0
    n_rows: int = 0
    n_cols: int = 0
    n_nonzeros: int = 0


# -- helpers over the problem ----------------------------------------------------------------------

def _check(problem: Problem) -> dict[str, Choice]:
    """Reject malformed problems early, with a message naming the offending choice or prim."""
    prims = set(problem.prims)
    if len(prims) != len(problem.prims):
        raise KernorchError("orchestration problem lists a prim twice")
    for p, ds in problem.deps.items():
        if p not in prims or any(d not in prims for d in ds):
            raise KernorchError(f"dependencies of {p!r} name an unknown prim: {ds}")
    for o in problem.outputs:  # plain prim names; a block's subproblem (below) also asks for layouts
        if base(o) not in prims:
            raise KernorchError(f"graph output {o!r} is not a prim of the orchestration problem")
    by_id: dict[str, Choice] = {}
    for c in problem.choices:
        if c.id in by_id:
            raise KernorchError(f"choice id {c.id!r} is used twice")
        outs, ins = {base(t) for t in c.outputs}, {base(t) for t in c.inputs}
        if is_conversion(c):
            if len(c.outputs) != 1 or len(c.inputs) > 1 or (c.inputs and ins != outs) or c.inputs == c.outputs \
                    or not outs <= prims | problem.sources:
                raise KernorchError(f"conversion {c.id!r} must rewrite one tensor into another layout: "
                                    f"{sorted(c.inputs)} -> {sorted(c.outputs)}")
        else:
            if not c.members <= prims:
                raise KernorchError(f"choice {c.id!r} has unknown members: {sorted(c.members - prims)}")
            if not outs <= c.members:
                raise KernorchError(f"choice {c.id!r} writes tensors that are not its members: {sorted(outs - c.members)}")
            plain_sources = {t for t in c.inputs if t in problem.sources}  # sources are tracked only blocked
            if not ins <= prims | problem.sources or ins & c.members or plain_sources:
                raise KernorchError(f"choice {c.id!r} has invalid inputs {sorted(c.inputs)}")
        if c.cost_ns < 0:
            raise KernorchError(f"choice {c.id!r} has a negative cost")
        by_id[c.id] = c
    return by_id


def live_prims(problem: Problem) -> set[str]:
    """Prims that some graph output depends on; the rest is dead code and needs no kernel."""
    live: set[str] = set()
    stack = [base(o) for o in problem.outputs]
    while stack:
        p = stack.pop()
        if p not in live:
            live.add(p)
            stack.extend(problem.deps.get(p, ()))
    return live


def _fire(choices: Sequence[Choice], rank: Mapping[str, int]) -> tuple[list[Choice], list[Choice]]:
    """Simulate execution: a kernel fires once all its inputs exist. Returns (fired, stuck).

    Kernels become ready in a heap ordered by their earliest member in topological order, so
    the resulting schedule roughly follows the graph (helps buffer lifetimes and readability).
    """
    waiting: dict[str, list[int]] = {}
    missing = []
    heap: list[tuple[int, int]] = []
    for i, c in enumerate(choices):
        missing.append(len(c.inputs))
        for t in c.inputs:
            waiting.setdefault(t, []).append(i)
        if not c.inputs:
            heap.append((_rank_of(c, rank), i))
    heapq.heapify(heap)
    available: set[str] = set()
    fired: list[Choice] = []
    done = [False] * len(choices)
    while heap:
        _, i = heapq.heappop(heap)
        done[i] = True
        fired.append(choices[i])
        for t in choices[i].outputs:
            if t in available:
                continue
            available.add(t)
            for j in waiting.get(t, ()):
                missing[j] -= 1
                if missing[j] == 0:
                    heapq.heappush(heap, (_rank_of(choices[j], rank), j))
    return fired, [c for i, c in enumerate(choices) if not done[i]]


def _prune(fired: list[Choice], outputs: Iterable[str]) -> list[Choice]:
    """Drop kernels whose results nobody reads (only zero-cost ties can produce them)."""
    needed = set(outputs)
    keep = []
    for c in reversed(fired):
        if c.outputs & needed:
            keep.append(c)
            needed -= c.outputs
            needed |= c.inputs
    return keep[::-1]


def _sccs(succ: Sequence[Sequence[int]]) -> list[list[int]]:
    """Strongly connected components of the graph i -> succ[i] (Tarjan's algorithm, iterative),
    each component after every component it reaches."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    comp: dict[int, int] = {}
    stack: list[int] = []
    comps: list[list[int]] = []
    for root in range(len(succ)):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, pos = work.pop()
            if pos == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
            if pos < len(succ[v]):
                work.append((v, pos + 1))
                w = succ[v][pos]
                if w not in index:
                    work.append((w, 0))
                elif w not in comp:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                members = []
                while True:
                    w = stack.pop()
                    comp[w] = len(comps)
                    members.append(w)
                    if w == v:
                        break
                comps.append(members)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return comps


def _trapped_tensor_sets(stuck: list[Choice], available: set[str]) -> list[set[str]]:
    """Tensor sets T behind the deadlock, one per terminal strongly connected component.

    Edge k -> j when stuck kernel k misses a tensor that stuck kernel j writes. Every selected
    writer of a missing tensor is stuck (else the tensor would exist), so each stuck kernel has an
    edge and some component is terminal. For each cyclic component D we return T = the missing
    inputs of D that D writes; every kernel of D reads some of T. For a terminal D all selected
    writers of T are in D, so its cut is violated; the caller keeps every violated one.
    """
    writers: dict[str, list[int]] = {}
    for i, c in enumerate(stuck):
        for t in c.outputs:
            writers.setdefault(t, []).append(i)
    missing = [sorted(t for t in c.inputs if t not in available) for c in stuck]
    succ = [sorted({j for t in m for j in writers.get(t, ())}) for m in missing]
    for i, nxt in enumerate(succ):
        if not nxt:  # only possible if the solver's point violated a_t <= sum of writers
            raise KernorchError(f"solver selected kernel {stuck[i].id!r} whose inputs {missing[i]} have no selected writer")
    comps = _sccs(succ)
    out = []
    for members in comps:
        if len(members) > 1:  # a deadlock cycle; its cut is checked for violation by the caller
            inside = {t for v in members for t in stuck[v].outputs}
            out.append({t for v in members for t in missing[v] if t in inside})
    return out


def _finish(problem: Problem, chosen: Iterable[Choice], rank: Mapping[str, int]) -> list[Choice] | None:
    """Order a chosen set for execution, or None if it is not schedulable."""
    fired, stuck = _fire(list(chosen), rank)
    if stuck:
        return None
    made = set().union(*(c.outputs for c in fired)) if fired else set()
    if any(o not in made for o in problem.outputs):
        return None
    return _prune(fired, problem.outputs)


def _rank(problem: Problem) -> dict[str, int]:
    return {p: i for i, p in enumerate(problem.prims)}


def validate(problem: Problem, chosen_ids_in_order: Sequence[str]) -> None:
    """Raise KernorchError unless the kernels, run in this order, compute every graph output.

    Every input of a kernel must be written by an earlier kernel in the list (sources never
    appear among inputs), and every graph output must be written by some kernel.
    """
    by_id = _check(problem)
    available: set[str] = set()
    seen: set[str] = set()
    for step, cid in enumerate(chosen_ids_in_order):
        if cid not in by_id:
            raise KernorchError(f"plan step {step} names unknown choice {cid!r}")
        if cid in seen:
            raise KernorchError(f"plan runs choice {cid!r} twice")
        seen.add(cid)
        c = by_id[cid]
        missing = sorted(c.inputs - available)
        if missing:
            raise KernorchError(f"plan step {step} ({cid!r}) reads {missing} before any earlier kernel writes them")
        available |= c.outputs
    lost = [o for o in problem.outputs if o not in available]
    if lost:
        raise KernorchError(f"plan never computes graph output(s) {lost}")


def _heuristic(problem: Problem, chosen: list[Choice], what: str, t0: float) -> Solution:
    order = _finish(problem, chosen, _rank(problem))
    if order is None:
        raise KernorchError(f"{what} baseline produced an unschedulable plan")
    ids = tuple(c.id for c in order)
    validate(problem, ids)
    return Solution(ids, "heuristic", sum(c.cost_ns for c in order), solve_seconds=time.perf_counter() - t0)


def _cheapest(choices: Iterable[Choice]) -> dict[frozenset[str], Choice]:
    """Cheapest plain-layout implementation for each member set (ties broken by id, for
    determinism): what the rule-based baselines choose from."""
    best: dict[frozenset[str], Choice] = {}
    for c in choices:
        if is_conversion(c) or any("@" in t for t in c.inputs | c.outputs):
            continue
        b = best.get(c.members)
        if b is None or (c.cost_ns, c.id) < (b.cost_ns, b.id):
            best[c.members] = c
    return best


# -- baselines ------------------------------------------------------------------------------------

def unfused(problem: Problem) -> Solution:
    """One kernel per live primitive: the cheapest singleton choice for each (the eager baseline)."""
    t0 = time.perf_counter()
    _check(problem)
    best = _cheapest(problem.choices)
    live = live_prims(problem)
    chosen = []
    for p in problem.prims:
        if p in live:
            c = best.get(frozenset([p]))
            if c is None:
                raise KernorchError(f"primitive {p!r} has no single-primitive kernel, so there is no unfused baseline")
            chosen.append(c)
    return _heuristic(problem, chosen, "unfused", t0)


_EPILOGUE = {"elementwise", "broadcast"}
_INJECTIVE = {"elementwise", "broadcast", "layout"}


def greedy(problem: Problem) -> Solution:
    """Rule-based fusion in the style of TVM FuseOps / ONNX Runtime, on the same measured costs.

    Rule: walk live prims in topological order; the first unassigned prim seeds a group.
    - A seed of kind linear or reduce may absorb elementwise/broadcast consumers (an epilogue).
    - A seed of kind elementwise/broadcast/layout may absorb injective (elementwise, broadcast,
      layout) consumers: elementwise chains fuse.
    - opaque prims (and unknown kinds) always stay alone.
    A consumer q of a group member is absorbed only if it is unassigned, every prim q reads is in
    the group or in an earlier group (so groups run in creation order and never form cycles), and
    a choice with exactly the grown member set exists. Consumers are tried in topological order
    until the group stops growing. Each group takes its cheapest implementation. Unlike FuseOps
    there is no post-dominator analysis: the candidate set decides which groups are legal.
    """
    t0 = time.perf_counter()
    _check(problem)
    best = _cheapest(problem.choices)
    live = live_prims(problem)
    rank = _rank(problem)
    consumers: dict[str, list[str]] = {}
    for p in problem.prims:
        for d in problem.deps.get(p, ()):
            consumers.setdefault(d, []).append(p)
    assigned: set[str] = set()
    chosen: list[Choice] = []
    for p in problem.prims:
        if p not in live or p in assigned:
            continue
        kind = problem.kinds.get(p, "opaque")
        allowed = _EPILOGUE if kind in ("linear", "reduce") else _INJECTIVE if kind in _INJECTIVE else set()
        group = {p}
        grown = True
        while grown and allowed:
            grown = False
            cands = sorted({q for m in group for q in consumers.get(m, ()) if q in live and q not in assigned and q not in group},
                           key=rank.__getitem__)
            for q in cands:
                if problem.kinds.get(q, "opaque") not in allowed:
                    continue
                if any(d not in group and d not in assigned for d in problem.deps.get(q, ())):
                    continue
                if frozenset(group | {q}) in best:
                    group.add(q)
                    grown = True
                    break
        c = best.get(frozenset(group))
        if c is None:
            raise KernorchError(f"primitive {p!r} has no single-primitive kernel, so the greedy baseline cannot place it")
        chosen.append(c)
        assigned |= group
    return _heuristic(problem, chosen, "greedy", t0)


# -- the binary linear program ---------------------------------------------------------------------

class _Model:
    """Model (B) as one CSR matrix: columns are x_k for every choice, then a_t for every tensor."""

    def __init__(self, problem: Problem):
        self.problem = problem
        # Implementations of the same member set read and write the same tensors, so only the
        # cheapest can be in an optimal plan: dropping the rest shrinks the model and the symmetry.
        best: dict[tuple, Choice] = {}
        for c in problem.choices:
            key = (c.members, c.inputs, c.outputs)
            if key not in best or (c.cost_ns, c.id) < (best[key].cost_ns, best[key].id):
                best[key] = c
        self.split = _splits(tuple(best.values()))
        kept = {key: c for key, c in best.items() if key not in self.split}
        self.choices = tuple(kept.values())
        self.column = {key: k for k, key in enumerate(kept)}
        nk = len(self.choices)
        producers: dict[str, list[int]] = {}
        for k, c in enumerate(self.choices):
            for t in c.outputs:
                producers.setdefault(t, []).append(k)
        for o in problem.outputs:
            if o not in producers:
                raise KernorchError(f"graph output {o!r} is not written by any candidate kernel")
        tensors = sorted({t for c in self.choices for t in c.inputs} | set(problem.outputs))
        tcol = {t: nk + i for i, t in enumerate(tensors)}
        self.n_x = nk
        self.n_cols = nk + len(tensors)
        rows: list[int] = []
        cols: list[int] = []
        vals: list[float] = []
        lower: list[float] = []
        upper: list[float] = []
        inf = highspy.kHighsInf

        def row(entries: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
            r = len(lower)
            for j, v in entries:
                rows.append(r)
                cols.append(j)
                vals.append(v)
            lower.append(lo)
            upper.append(hi)

        for k, c in enumerate(self.choices):  # x_k <= a_t: a kernel needs its inputs
            for t in sorted(c.inputs):
                row(((k, 1.0), (tcol[t], -1.0)), -inf, 0.0)
        for t in tensors:  # a_t <= sum of producers: a tensor exists only if someone writes it
            row([(tcol[t], 1.0)] + [(j, -1.0) for j in producers.get(t, ())], -inf, 0.0)
        covering: dict[str, list[int]] = {}
        for k, c in enumerate(self.choices):
            for m in c.members:
                covering.setdefault(m, []).append(k)
        live = live_prims(problem)
        for p in problem.prims:  # coverage: valid, and the reason the LP is tight
            if p in live:
                if p not in covering:
                    raise KernorchError(f"primitive {p!r} is needed by a graph output but no candidate kernel computes it")
                row(((k, 1.0) for k in covering[p]), 1.0, inf)
        self.producers = producers
        r = np.asarray(rows, dtype=np.int64)
        order = np.argsort(r, kind="stable")
        n_rows = len(lower)
        start = np.zeros(n_rows + 1, dtype=np.int32)
        np.cumsum(np.bincount(r, minlength=n_rows), out=start[1:])

        lp = highspy.HighsLp()
        lp.num_col_ = self.n_cols
        lp.num_row_ = n_rows
        lp.col_cost_ = np.concatenate([np.array([c.cost_ns for c in self.choices], dtype=np.float64), np.zeros(len(tensors))])
        col_lower = np.zeros(self.n_cols)
        for o in problem.outputs:
            col_lower[tcol[o]] = 1.0  # a_t = 1 for graph outputs, as a bound
        lp.col_lower_ = col_lower
        lp.col_upper_ = np.ones(self.n_cols)
        lp.row_lower_ = np.asarray(lower)
        lp.row_upper_ = np.asarray(upper)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_ = self.n_cols
        lp.a_matrix_.num_row_ = n_rows
        lp.a_matrix_.start_ = start
        lp.a_matrix_.index_ = np.asarray(cols, dtype=np.int32)[order]
        lp.a_matrix_.value_ = np.asarray(vals, dtype=np.float64)[order]
        lp.integrality_ = [highspy.HighsVarType.kInteger] * nk + [highspy.HighsVarType.kContinuous] * len(tensors)
        self.lp = lp
        self.tcol = tcol
        self.n_nonzeros = len(vals)

    def start_vector(self, chosen: Iterable[Choice]) -> np.ndarray:
        """A full column vector for a chosen set: x = 1 on it, a_t = 1 where it writes t."""
        v = np.zeros(self.n_cols)
        keys = [(c.members, c.inputs, c.outputs) for c in chosen]
        while keys:  # a dropped implementation maps to its cheaper twin, a dominated kernel to its split
            key = keys.pop()
            if key in self.split:
                keys.extend(self.split[key])
                continue
            v[self.column[key]] = 1.0
            for t in key[2]:
                if t in self.tcol:
                    v[self.tcol[t]] = 1.0
        return v


def _splits(choices: Sequence[Choice]) -> dict[tuple, tuple[tuple, tuple]]:
    """The choices that two others do at most as dearly, each with the (members, inputs, outputs)
    of those two: the first reads only what the choice reads, the second only that and what the
    first writes, together they compute exactly its members and write all it writes. Put in its
    place in any plan, the pair runs where it ran and costs no more, so the optimum stays without
    it. On segformer_b0's decode head 60 % of the choices go, and its exact solve took 11-18 s
    instead of 29-37 s (Zen 4): many fusions there save nothing over two smaller kernels, and the
    relaxation spreads across them."""
    by_members: dict[frozenset[str], list[Choice]] = {}
    for c in choices:
        by_members.setdefault(c.members, []).append(c)
    containing: dict[str, list[frozenset[str]]] = {}  # prim -> the member sets holding it
    for m in by_members:
        for p in m:
            containing.setdefault(p, []).append(m)
    out: dict[tuple, tuple[tuple, tuple]] = {}
    for k in choices:
        if len(k.members) < 2:
            continue
        # the member sets that split k in two (each split has one side holding any one prim of k: the
        # rarest), in the order of k's subsets by size, then by their sorted prims (an 8-prim fusion
        # has 254 subsets, and the solver's model is made at every solve)
        pivot = min(k.members, key=lambda p: (len(containing[p]), p))
        halves = {h for s in containing[pivot] if s < k.members and (rest := k.members - s) in by_members
                  for h in (s, rest)}
        parts = sorted(halves, key=lambda h: (len(h), sorted(h)))
        found = next(((a, b) for part in parts
                      for a in by_members[part] if a.inputs <= k.inputs and a.cost_ns <= k.cost_ns
                      for b in by_members[k.members - part] if a.cost_ns + b.cost_ns <= k.cost_ns
                      and b.inputs <= k.inputs | a.outputs and k.outputs <= a.outputs | b.outputs), None)
        if found:
            out[(k.members, k.inputs, k.outputs)] = tuple((c.members, c.inputs, c.outputs) for c in found)
    return out


_STATUS = {
    highspy.HighsModelStatus.kOptimal: "optimal",
    highspy.HighsModelStatus.kTimeLimit: "time_limit",
    highspy.HighsModelStatus.kInfeasible: "infeasible",
    highspy.HighsModelStatus.kInterrupt: "interrupted",
}


def solve(problem: Problem, time_limit: float = 60.0, initial: list[str] | None = None,
          rel_gap: float = 0.0, block_time_limit: float | None = None, store=None) -> Solution:
    """Return the cheapest executable selection of choices (or the best found by `time_limit`;
    with `rel_gap` > 0, the first found within that fraction of the bound: status "within_gap";
    with `block_time_limit`, the best found in that many seconds per block: a refine round's plan
    only has to say which estimated kernels to measure next, the exact solve comes last).

    `initial` is an optional list of choice ids used as the MIP start; by default the greedy
    baseline (or, failing that, the unfused one) is used, so a time-out still returns a plan at
    least as good as the heuristic. A problem that falls apart into blocks (kernorch.blocks) is solved
    block by block, exactly (the blocks' proven solutions kept in `store`, a
    blocks.SolutionStore, when given); otherwise, or if that finds nothing, as a whole
    (`_solve_whole`).
    """
    t0 = time.perf_counter()
    by_id = _check(problem)
    rank = _rank(problem)
    fallback: list[Choice] | None = None  # best known schedulable selection
    if initial is not None:
        unknown = [i for i in initial if i not in by_id]
        if unknown:
            raise KernorchError(f"initial solution names unknown choices {unknown}")
        fallback = _finish(problem, [by_id[i] for i in initial], rank)
        if fallback is None:
            log.warning("initial solution is not executable; ignoring it")
    if fallback is None:
        fallback = _baseline_start(problem, by_id)
    deadline = t0 + time_limit
    from .blocks import Blocks, solve_blocks  # it builds on this module
    blocks = Blocks(problem)
    if len(blocks.prims) > 1:
        sol = solve_blocks(problem, blocks, deadline, fallback, rel_gap, block_time_limit, store)
        if sol is not None:
            return replace(sol, solve_seconds=time.perf_counter() - t0)
    if block_time_limit is not None:
        deadline = min(deadline, time.perf_counter() + block_time_limit)
    return replace(_solve_whole(problem, deadline, fallback, rel_gap), solve_seconds=time.perf_counter() - t0)


def _baseline_start(problem: Problem, by_id: Mapping[str, Choice], level: int = logging.INFO) -> list[Choice] | None:
    """The greedy baseline's selection, else the unfused one's, else None."""
    for baseline in (greedy, unfused):
        try:
            return [by_id[i] for i in baseline(problem).chosen]
        except KernorchError as e:
            log.log(level, "no %s start: %s", baseline.__name__, e)
    return None


def _solve_whole(problem: Problem, deadline: float, fallback: list[Choice] | None, rel_gap: float) -> Solution:
    """The binary linear program of the whole problem, `fallback` its MIP start.

    The loop solves, checks that the selection can be scheduled (multi-output kernels can feed
    each other in a cycle that the BLP cannot see), adds cuts if not, and re-solves. The cut is a
    "first-writer" cut on the deadlocked tensors rather than a cut forbidding the cycle's set of
    kernels: that one is not violated when a cycle tensor has a second deadlocked writer (the loop
    would spin) and only forbids one implementation of the cycle. Before the MIP the LP relaxation
    is solved; if it is integral it is already optimal.
    """
    rank = _rank(problem)
    model = _Model(problem)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("mip_rel_gap", float(rel_gap))
    h.setOptionValue("mip_abs_gap", 0.5)  # costs are integers: a gap below 1 ns proves optimality
    h.passModel(model.lp)
    cuts = 0
    status = "unknown"
    bound = 0.0

    def remaining() -> float:
        return deadline - time.perf_counter()

    # LP first: when the relaxation is integral it is optimal and the MIP root can be skipped.
    lp_ok = False
    if remaining() > 0:
        h.setOptionValue("time_limit", max(remaining(), 1e-3))
        h.setOptionValue("solve_relaxation", True)
        h.run()
        h.setOptionValue("solve_relaxation", False)
        if h.getModelStatus() == highspy.HighsModelStatus.kOptimal:
            x = np.asarray(h.getSolution().col_value[: model.n_x])
            lp_ok = bool(np.all(np.minimum(np.abs(x), np.abs(1 - x)) < 1e-9))
            bound = h.getInfo().objective_function_value
        elif h.getModelStatus() == highspy.HighsModelStatus.kInfeasible:
            raise NoPlan("no executable plan exists: the candidate kernels cannot compute every graph output")

    best: list[Choice] | None = None
    while True:
        if lp_ok:
            status = "optimal"
            x = np.asarray(h.getSolution().col_value[: model.n_x])
            lp_ok = False  # after a cut, go through the MIP
        else:
            if remaining() <= 0:
                status = "time_limit"
                break
            h.setOptionValue("time_limit", max(remaining(), 1e-3))
            if fallback is not None:  # MIP start: a time-out returns at least this
                h.setSolution(model.n_cols, np.arange(model.n_cols, dtype=np.int32), model.start_vector(fallback))
            h.run()
            ms = h.getModelStatus()
            status = _STATUS.get(ms, h.modelStatusToString(ms).lower().replace(" ", "_"))
            info = h.getInfo()
            if ms == highspy.HighsModelStatus.kInfeasible:
                raise NoPlan("no executable plan exists: the candidate kernels cannot compute every graph output")
            bound = info.mip_dual_bound if ms != highspy.HighsModelStatus.kOptimal else info.objective_function_value
            if info.primal_solution_status != 2:  # no feasible point from HiGHS
                break
            x = np.asarray(h.getSolution().col_value[: model.n_x])
        chosen = [model.choices[k] for k in np.flatnonzero(x > 0.5)]
        fired, stuck = _fire(chosen, rank)
        if not stuck:
            best = _prune(fired, problem.outputs)
            break
        # First-writer cut: in any schedule the first kernel to write a tensor of T reads none of
        # T, so a_t <= sum of x over such "clean" writers of T, for each t in T. It is violated
        # here (T's selected writers are all trapped) and, unlike a cut on the cycle's kernels,
        # it also excludes every other implementation or grouping that recreates the deadlock.
        avail = set().union(*(c.outputs for c in fired)) if fired else set()
        new = []
        for ts in _trapped_tensor_sets(stuck, avail):
            clean = [j for j in sorted({j for t in ts for j in model.producers.get(t, ())}) if not model.choices[j].inputs & ts]
            if any(x[j] > 0.5 for j in clean):
                continue  # not violated by this point
            new.append(ts)
            for t in sorted(ts):
                idx = np.asarray([model.tcol[t]] + clean, dtype=np.int32)
                val = np.asarray([1.0] + [-1.0] * len(clean))
                h.addRow(-highspy.kHighsInf, 0.0, len(idx), idx, val)
        if not new:  # cannot happen: a terminal deadlock component always yields a violated cut
            raise KernorchError("internal error: deadlocked plan but no violated cut (please report)")
        log.info("deadlock among %d selected kernels: %d cuts through %s", len(stuck), len(new), [sorted(t) for t in new])
        cuts += len(new)

    cost = lambda sel: sum(c.cost_ns for c in sel)  # noqa: E731
    if best is None or (fallback is not None and cost(fallback) < cost(best)):
        if fallback is None:
            raise KernorchError("no executable plan found within the solver's time limit "
                                "and no heuristic plan to fall back on")
        log.warning("solver stopped (%s) without a better executable plan; using the heuristic start", status)
        best = fallback
    ids = tuple(c.id for c in best)
    validate(problem, ids)
    obj = cost(best)
    bound_ns = min(obj, max(0, math.ceil(bound - 1e-6))) if math.isfinite(bound) else 0
    gap = 0.0 if obj == bound_ns else (obj - bound_ns) / obj
    if status == "optimal" and obj > bound_ns:  # never call a plan optimal without the bound to prove it
        status = "within_gap" if rel_gap > 0 and gap <= rel_gap + 1e-9 else "time_limit"
    return Solution(ids, status, obj, bound_ns, gap, 0.0, cuts, h.getNumRow(), model.n_cols, h.getNumNz())


# -- exact search for tests ------------------------------------------------------------------------

def brute_force(problem: Problem, max_prims: int = 16) -> Solution:
    """Exact optimum by shortest path over execution states, for checking `solve` on small graphs.

    A state is the set of tensors written so far; firing a choice whose inputs are all written
    adds its outputs at its cost. Every executable selection is a path (fire in schedule order),
    and every path is an executable selection, so Dijkstra to a state holding all graph outputs
    enumerates all schedulable subsets implicitly. It shares no code with the BLP, which is the
    point: it does not rely on coverage rows or cycle cuts.
    """
    _check(problem)
    if len(problem.prims) > max_prims:
        raise KernorchError(f"brute_force is for small graphs (<= {max_prims} prims), got {len(problem.prims)}")
    tensors = sorted(set(problem.prims) | {t for c in problem.choices for t in c.inputs | c.outputs})
    bit = {t: 1 << i for i, t in enumerate(tensors)}

    def mask(ts: Iterable[str]) -> int:
        m = 0
        for t in ts:
            m |= bit[t]
        return m

    best: dict[tuple, Choice] = {}  # same signature: only the cheapest can be on a shortest path
    for c in problem.choices:
        key = (c.members, c.inputs, c.outputs)
        if key not in best or (c.cost_ns, c.id) < (best[key].cost_ns, best[key].id):
            best[key] = c
    moves = [(mask(c.inputs), mask(c.outputs), c) for c in best.values()]
    goal = mask(problem.outputs)
    dist = {0: 0}
    prev: dict[int, tuple[int, Choice]] = {}
    heap = [(0, 0)]
    while heap:
        d, s = heapq.heappop(heap)
        if d > dist[s]:
            continue
        if s & goal == goal:
            path = []
            while s in prev:
                s, c = prev[s]
                path.append(c.id)
            ids = tuple(reversed(path))
            validate(problem, ids)
            return Solution(ids, "optimal", d, d, 0.0)
        for need, out, c in moves:
            if need & s == need and out & ~s:
                n = s | out
                nd = d + c.cost_ns
                if nd < dist.get(n, math.inf):
                    dist[n] = nd
                    prev[n] = (s, c)
                    heapq.heappush(heap, (nd, n))
    raise NoPlan("no executable plan exists: the candidate kernels cannot compute every graph output")
