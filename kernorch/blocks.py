"""Solving the orchestration program block by block.

Candidate kernels never span the pipeline's partitions, so a model's program is a chain of blocks
that meet only in the tensors crossing between them. A crossing tensor is read across in one or
more layouts; which of them its block writes (its "pattern") is all that the blocks need to agree
on. Given the pattern of every crossing tensor, the program splits into one independent program
per block: its own prims and kernels, the patterns it writes as required outputs, the layouts it
reads as available inputs (kernels reading a layout outside the pattern dropped). So the optimum
is the cheapest consistent choice of one pattern assignment ("state") per block, each block
solved once per state, and that choice is a small program of its own (`_agree`). A block with
more than MAX_STATES states is merged with the neighbour it shares the most with (in the limit:
one block, the whole program). Small branch-and-bounds are cheaper than one big one, a block that
did not change is not solved again, and a slow block can be given its own time (segformer_b0: 20
blocks, 19 of them solved in under 2 s together, its decode head in 0.3-22 s per state; as one
program, 17 s within 1 % and 36 s exact).
"""
from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import time
from collections import OrderedDict
from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterable, Mapping, Protocol, Sequence

import highspy
import numpy as np

from kernorch.ir import KernorchError
from kernorch.orchestrate import (Choice, Problem, Solution, _baseline_start, _finish, _rank, _sccs, _solve_whole,
                                  base, live_prims, validate)

log = logging.getLogger(__name__)

# pattern assignments a block is solved for before it is merged with a neighbour. Measured on a Zen 4
# (one solve within 1 %, the whole program vs blocks at 27 / 9 / 3): yolox_tiny 1.1 s vs 4.6 / 2.9 /
# 1.7 s, candy 2.7 s vs 2.1 / 2.1 / 0.9 s; segformer_b0's blocks have at most 3 states anyway.
MAX_STATES = 3


class Blocks:
    """The blocks of a problem, in an order where each reads only earlier ones.

    Prims are joined when a candidate computes them together (or they read one graph input in a
    blocked layout, which is converted once), then when blocks depend on each other in a cycle,
    then while a block has more than MAX_STATES states."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.index = {p: i for i, p in enumerate(problem.prims)}
        self.parent = list(range(len(problem.prims)))
        readers: dict[str, list[str]] = {}
        for c in problem.choices:
            if c.members:
                self._join(c.members)
                for q in c.inputs:
                    if base(q) in problem.sources:
                        readers.setdefault(base(q), []).extend(c.members)
        for ps in readers.values():
            self._join(ps)
        self.source_reader = {s: ps[0] for s, ps in readers.items()}
        live = live_prims(problem)
        self.consumers: dict[str, list[str]] = {}  # live consumers
        for p, ds in problem.deps.items():
            for d in ds:
                if p in live:
                    self.consumers.setdefault(d, []).append(p)
        self.written = {q for c in problem.choices for q in c.outputs}
        while True:
            self._number()
            if self._join_cycles():
                continue
            self._interfaces()
            states = [self.states(b) for b in range(len(self.prims))]
            worst = max(range(len(states)), key=states.__getitem__)
            if states[worst] <= MAX_STATES:
                break
            self._join([self.prims[worst][0], self.prims[self._closest(worst)][0]])
        self.homed: list[list[Choice]] = [[] for _ in self.prims]  # each block's choices
        for c in problem.choices:
            home = self._home(c)
            if home is not None:
                self.homed[home].append(c)

    def _find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def _join(self, prims: Iterable[str]) -> None:
        roots = [self._find(self.index[p]) for p in prims]
        for r in roots[1:]:
            self.parent[self._find(r)] = self._find(roots[0])

    def _number(self) -> None:
        first: dict[int, int] = {}
        for i in range(len(self.parent)):
            first.setdefault(self._find(i), len(first))
        self.block_of = {p: first[self._find(i)] for i, p in enumerate(self.problem.prims)}
        self._group()

    def _group(self) -> None:
        groups: list[list[str]] = [[] for _ in range(max(self.block_of.values(), default=-1) + 1)]
        for p in self.problem.prims:
            groups[self.block_of[p]].append(p)
        self.prims = [tuple(g) for g in groups]

    def _join_cycles(self) -> bool:
        """Join blocks that depend on each other in a cycle (True); else number them in dependency order."""
        succ: list[set[int]] = [set() for _ in self.prims]
        for p, ds in self.problem.deps.items():
            for d in ds:
                if self.block_of[d] != self.block_of[p]:
                    succ[self.block_of[d]].add(self.block_of[p])
        comps = _sccs([sorted(s) for s in succ])
        cyclic = [c for c in comps if len(c) > 1]
        for c in cyclic:
            self._join([self.prims[b][0] for b in c])
        if cyclic:
            return True
        new = {c[0]: n for n, c in enumerate(reversed(comps))}  # Tarjan emits a component after all it reaches
        self.block_of = {p: new[b] for p, b in self.block_of.items()}
        self._group()
        return False

    def _interfaces(self) -> None:
        """The crossing tensors: their patterns and the blocks that read them."""
        forms: dict[str, set[str]] = {}
        self.readers: dict[str, set[int]] = {}
        for c in self.problem.choices:
            if not c.members:
                continue
            b = self.block_of[next(iter(c.members))]
            for q in c.inputs:
                t = base(q)
                if t in self.block_of and self.block_of[t] != b:
                    forms.setdefault(t, set()).add(q)
                    self.readers.setdefault(t, set()).add(b)
        self.patterns: dict[str, tuple[frozenset[str], ...]] = {}
        for t, fs in forms.items():
            can = sorted(fs & self.written)
            needed = any(self.block_of[p] != self.block_of[t] for p in self.consumers.get(t, ()))
            subsets = (frozenset(s) for k in range(len(can) + 1) for s in itertools.combinations(can, k))
            self.patterns[t] = tuple(s for s in subsets if s or not (needed and can))

    def crossing(self, b: int) -> list[str]:
        """The crossing tensors block b writes or reads."""
        return [t for t in self.patterns if self.block_of[t] == b or b in self.readers[t]]

    def states(self, b: int) -> int:
        return math.prod(len(self.patterns[t]) for t in self.crossing(b))

    def _closest(self, b: int) -> int:
        """The block sharing the most pattern combinations with b."""
        shared: dict[int, int] = {}
        for t in self.crossing(b):
            for o in {self.block_of[t], *self.readers[t]} - {b}:
                shared[o] = shared.get(o, 1) * len(self.patterns[t])
        return max(sorted(shared), key=shared.__getitem__)

    def _home(self, c: Choice) -> int | None:
        """The block a choice belongs to (a conversion: its tensor's; of a graph input: its readers')."""
        t = next(iter(c.members)) if c.members else base(next(iter(c.outputs)))
        t = self.source_reader.get(t, t)
        return self.block_of.get(t)

    def subproblem(self, b: int, state: Mapping[str, frozenset[str]]) -> Problem:
        """Block b's program when each crossing tensor it touches has the pattern `state` gives it."""
        p = self.problem
        inside = set(self.prims[b])
        there = {q for t, pat in state.items() if t not in inside for q in pat}
        choices = []
        for c in self.homed[b]:
            outside = frozenset(q for q in c.inputs if base(q) in self.block_of and base(q) not in inside)
            if outside <= there:
                choices.append(replace(c, inputs=c.inputs - outside) if outside else c)
        here = sorted(q for t, pat in state.items() if t in inside for q in pat)
        outputs = tuple(dict.fromkeys([o for o in p.outputs if o in inside] + here))
        deps = {q: tuple(d for d in p.deps.get(q, ()) if d in inside) for q in self.prims[b]}
        kinds = {q: p.kinds[q] for q in self.prims[b] if q in p.kinds}
        return Problem(self.prims[b], deps, outputs, tuple(choices), kinds, p.sources)


# Solved block programs by content: between the solves of a refine loop most blocks do not change
# (the new measurements land in a few), so a block is solved again only when its kernels, costs or
# state did. A solution serves any later solve whose gap tolerance it meets.
_SOLVED: "OrderedDict[tuple, Solution | KernorchError]" = OrderedDict()
_SOLVED_MAX = 4096
# The last solution of each block state (its prims and patterns): the start of the state's next solve.
# The costs have moved since, so it is no longer proved optimal, but a capped solve (a refine round's)
# can only improve on it, instead of starting again from the greedy baseline.
_LAST: "OrderedDict[tuple, tuple[str, ...]]" = OrderedDict()


def _signature(problem: Problem) -> tuple:
    return (problem.prims, problem.outputs, tuple(sorted(problem.deps.items())),
            tuple(sorted((c.id, c.members, c.inputs, c.outputs, c.cost_ns, c.schedule) for c in problem.choices)))


class SolutionStore(Protocol):
    """Where proven block solutions outlive the process (kernorch.database.ProfileDB): a second run
    whose block programs are the same, costs and all, finds them solved."""

    def solution(self, key: str) -> str | None: ...

    def add_solution(self, key: str, doc: str) -> None: ...


@functools.cache
def _solver_source() -> str:
    """The solver's own code (this module and kernorch.orchestrate): a change to either makes every
    stored solution a stranger."""
    import kernorch.orchestrate as orch
    return hashlib.sha256(Path(orch.__file__).read_bytes() + Path(__file__).read_bytes()).hexdigest()


def _digest(signature: tuple) -> str:
    """A stored solution's key: its program's content (sets sorted: not the process's string
    hashing) and the solver's code."""
    prims, outputs, deps, choices = signature
    canon = (_solver_source(), prims, outputs, deps,
             tuple((i, *(tuple(sorted(x)) for x in (m, r, w)), cost, sched) for i, m, r, w, cost, sched in choices))
    return hashlib.sha256(repr(canon).encode()).hexdigest()


def _stored(store: SolutionStore, signature: tuple) -> Solution | KernorchError | None:
    doc = store.solution(_digest(signature))
    if doc is None:
        return None
    d = json.loads(doc)
    if "infeasible" in d:
        return KernorchError(d["infeasible"])
    return Solution(**(d | {"chosen": tuple(d["chosen"])}))


def _store(store: SolutionStore, signature: tuple, known: Solution | KernorchError) -> None:
    doc = {"infeasible": str(known)} if isinstance(known, KernorchError) else asdict(known)
    store.add_solution(_digest(signature), json.dumps(doc))


def solve_blocks(problem: Problem, blocks: Blocks, deadline: float, fallback: list[Choice] | None,
                  rel_gap: float, block_time_limit: float | None = None,
                  store: SolutionStore | None = None) -> Solution | None:
    """Each block solved in each of its states, the states chosen to agree (`_agree`); None when no
    agreeing choice was solved in time (the caller then solves the whole). A block state solved
    before, in this process or (`store`) in an earlier one, is not solved again."""
    start = {c.id for c in fallback or ()}
    solved: list[dict[tuple, Solution]] = []  # per block: state -> its solution
    fresh = 0
    for b in range(len(blocks.prims)):
        crossing = blocks.crossing(b)
        solved.append({})
        writes = [blocks.block_of[t] == b for t in crossing]
        # most permissive first: the most layouts to read from other blocks, the fewest to write
        states = sorted(itertools.product(*(blocks.patterns[t] for t in crossing)),
                        key=lambda s: sum(len(p) if w else -len(p) for p, w in zip(s, writes)))
        for pats in states:
            if time.perf_counter() >= deadline:
                return None
            sub = blocks.subproblem(b, dict(zip(crossing, pats)))
            looser = next((sol for s, sol in solved[b].items() if _looser(s, pats, writes) and _runs(sub, sol)), None)
            if looser is not None:  # a looser state's optimum is feasible here, so optimal here too
                solved[b][pats] = looser
                continue
            key = _signature(sub)
            known = _SOLVED.get(key)
            if known is None and store is not None:  # the digest only when this process has not solved it
                known = _stored(store, key)
                if known is not None:
                    _remember(_SOLVED, key, known)
            if known is not None and (isinstance(known, KernorchError) or known.gap <= rel_gap):
                _SOLVED.move_to_end(key)
            else:
                fresh += 1
                try:
                    begin = _start(sub, start, _LAST.get((blocks.prims[b], pats), ()))
                    until = deadline if block_time_limit is None else min(deadline, time.perf_counter() + block_time_limit)
                    known = _solve_whole(sub, until, begin or _baseline_start(
                        sub, {c.id: c for c in sub.choices}, logging.DEBUG), rel_gap)
                except KernorchError as e:  # this state cannot be computed
                    log.debug("block %d, state %s: %s", b, pats, e)
                    known = e
                final = known.status in ("optimal", "within_gap") if isinstance(known, Solution) \
                    else time.perf_counter() < until  # proven infeasible, not out of time
                if final:
                    _remember(_SOLVED, key, known)
                    if store is not None:
                        _store(store, key, known)
                if isinstance(known, Solution):
                    _remember(_LAST, (blocks.prims[b], pats), known.chosen)
            if not isinstance(known, KernorchError):
                solved[b][pats] = known
    picked = _agree(blocks, solved, lambda s: s.objective_ns)
    if picked is None:
        return None
    lower = _agree(blocks, solved, lambda s: s.bound_ns)
    sols = [solved[b][s] for b, s in enumerate(picked)]
    ids = tuple(i for s in sols for i in s.chosen)
    validate(problem, ids)
    obj = sum(s.objective_ns for s in sols)
    if fallback is not None and sum(c.cost_ns for c in fallback) < obj:
        log.warning("solver stopped without a better executable plan; using the heuristic start")
        ids, obj = tuple(c.id for c in fallback), sum(c.cost_ns for c in fallback)
    bound = min(obj, sum(solved[b][s].bound_ns for b, s in enumerate(lower)))
    gap = 0.0 if obj == bound else (obj - bound) / obj
    proven = all(s.status in ("optimal", "within_gap") for s in sols)
    status = "optimal" if proven and obj == bound else "within_gap" if proven and gap <= rel_gap + 1e-9 \
        else "time_limit"
    log.info("%s: %d blocks in %d states, %d solved now (the rest unchanged or implied)", status, len(sols),
             sum(map(len, solved)), fresh)
    return Solution(ids, status, obj, bound, gap, 0.0, sum(s.n_cuts for s in sols), sum(s.n_rows for s in sols),
                    sum(s.n_cols for s in sols), sum(s.n_nonzeros for s in sols))


def _remember(cache: OrderedDict, key: tuple, value) -> None:
    """Keep `value` as the newest entry of `cache`, the oldest dropped beyond _SOLVED_MAX."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > _SOLVED_MAX:
        cache.popitem(last=False)


def _start(sub: Problem, *starts: Iterable[str]) -> list[Choice] | None:
    """The cheapest executable completion of the starts' choices in `sub` (ids it lacks dropped)."""
    rank = _rank(sub)
    done = (_finish(sub, [c for c in sub.choices if c.id in ids], rank) for ids in map(set, starts) if ids)
    return min((d for d in done if d is not None), key=lambda d: sum(c.cost_ns for c in d), default=None)


def _looser(s: tuple, t: tuple, writes: Sequence[bool]) -> bool:
    """State s allows everything state t does: it reads at least t's layouts, writes at most t's."""
    return all(a <= b if w else a >= b for a, b, w in zip(s, t, writes))


def _runs(problem: Problem, sol: Solution) -> bool:
    try:
        validate(problem, sol.chosen)
        return True
    except KernorchError:
        return False


def _agree(blocks: Blocks, solved: Sequence[Mapping[tuple, Solution]], cost) -> list[tuple] | None:
    """One solved state per block, the blocks agreeing on every crossing tensor's pattern, with the
    least total `cost`; None if there is none. A small binary program: a column per solved state,
    a row per block (pick one of its states), and per crossing tensor, reading block and pattern a
    row saying that the reader picks that pattern exactly when the tensor's own block does."""
    if any(not states for states in solved):
        return None
    if all(len(states) == 1 for states in solved):
        return [next(iter(states)) for states in solved]
    cols = [(b, s) for b, states in enumerate(solved) for s in states]
    where = {bs: j for j, bs in enumerate(cols)}
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    everything = np.arange(len(cols), dtype=np.int32)
    h.addVars(len(cols), np.zeros(len(cols)), np.ones(len(cols)))
    h.changeColsCost(len(cols), everything, np.array([float(cost(solved[b][s])) for b, s in cols]))
    h.changeColsIntegrality(len(cols), everything, np.array([highspy.HighsVarType.kInteger] * len(cols)))

    def row(plus: list[int], minus: list[int], rhs: float) -> None:
        h.addRow(rhs, rhs, len(plus) + len(minus), np.asarray(plus + minus, dtype=np.int32),
                 np.asarray([1.0] * len(plus) + [-1.0] * len(minus)))

    for b, states in enumerate(solved):
        row([where[(b, s)] for s in states], [], 1.0)
    for t, pats in blocks.patterns.items():
        home = blocks.block_of[t]
        at = {b: blocks.crossing(b).index(t) for b in {home, *blocks.readers[t]}}
        for r in blocks.readers[t]:
            for pat in pats:
                row([where[(home, s)] for s in solved[home] if s[at[home]] == pat],
                    [where[(r, s)] for s in solved[r] if s[at[r]] == pat], 0.0)
    h.run()
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    x = h.getSolution().col_value
    picked = {b: s for j, (b, s) in enumerate(cols) if x[j] > 0.5}
    return [picked[b] for b in range(len(solved))]
