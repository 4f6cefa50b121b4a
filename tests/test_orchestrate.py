"""Orchestration: the BLP against an exact search, the cycle cut, time limits, baselines, plans.

Instances are synthetic (random DAGs, random candidates and costs), so these tests run without
ONNX or TVM and in a few seconds.
"""
from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernorch.ir import KernorchError
from kernorch.orchestrate import (KINDS, Choice, Problem, brute_force, greedy, live_prims, solve, unfused,
                                  validate)
from kernorch.plan import Plan, make_plan

IMPLS = ("tvm-default", "library-blas", "tvm-tuned")


def make_choice(cid, members, deps, consumers, outputs, cost, impl="tvm-default", key=None):
    """A candidate with inputs/outputs derived from the graph, as the pipeline would derive them."""
    members = frozenset(members)
    ins = frozenset(d for m in members for d in deps.get(m, ()) if d not in members)
    outs = frozenset(m for m in members if m in outputs or any(c not in members for c in consumers.get(m, ())))
    return Choice(cid, key or "k:" + ",".join(sorted(members)), impl, members, ins, outs, cost)


def consumers_of(prims, deps):
    cons = {p: [] for p in prims}
    for p in prims:
        for d in deps.get(p, ()):
            cons[d].append(p)
    return cons


def is_convex(s, deps, cons, index):
    """No path leaves s and re-enters it (checked by a forward walk bounded by s's last index)."""
    hi = max(index[m] for m in s)
    stack = [c for m in s for c in cons[m] if c not in s and index[c] < hi]
    seen = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for c in cons[v]:
            if c in s:
                return False
            if index[c] < hi:
                stack.append(c)
    return True


def random_problem(rng: random.Random, n: int, max_size: int = 3) -> Problem:
    prims = tuple(f"p{i}" for i in range(n))
    deps = {}
    for i in range(1, n):
        k = min(i, rng.choice([0, 1, 1, 2, 2, 3]))
        if k:
            deps[prims[i]] = tuple(prims[j] for j in sorted(rng.sample(range(i), k)))
    cons = consumers_of(prims, deps)
    sinks = [p for p in prims if not cons[p]]
    outs = [p for p in sinks if rng.random() < 0.8] or [sinks[-1]]  # some sinks stay dead code
    outs += [p for p in prims if p not in outs and rng.random() < 0.1]  # interior outputs
    index = {p: i for i, p in enumerate(prims)}
    nbrs = {p: set(cons[p]) | set(deps.get(p, ())) for p in prims}
    base = {p: rng.randint(5, 50) for p in prims}
    subsets = set()
    for size in range(1, max_size + 1):
        for s in itertools.combinations(prims, size):
            fs = frozenset(s)
            connected = size == 1 or all(nbrs[m] & fs for m in fs)  # enough for <= 3; bigger: checked below
            if size > 3:
                comp, stack = set(), [s[0]]
                while stack:
                    v = stack.pop()
                    if v not in comp:
                        comp.add(v)
                        stack.extend(nbrs[v] & fs)
                connected = comp == fs
            if (connected or rng.random() < 0.05) and is_convex(fs, deps, cons, index):  # a few horizontal ones
                subsets.add(fs)
    choices = []
    for fs in sorted(subsets, key=lambda f: sorted(index[m] for m in f)):
        for impl in rng.sample(IMPLS, rng.randint(1, len(IMPLS))):
            cost = max(1, int(sum(base[m] for m in fs) * rng.uniform(0.35, 1.1)))
            choices.append(make_choice(f"c{len(choices)}", fs, deps, cons, set(outs), cost, impl))
    kinds = {p: rng.choice(KINDS) for p in prims}
    return Problem(prims, deps, tuple(outs), tuple(choices), kinds)


def cycle_problem() -> Problem:
    """The 6-prim counterexample: two convex 2-output kernels that feed each other."""
    prims = ("x", "w", "y", "z", "q", "r")
    deps = {"y": ("w",), "z": ("x", "y"), "q": ("x",), "r": ("q", "w")}
    cons = consumers_of(prims, deps)
    outs = {"z", "r"}
    choices = [make_choice("K1", {"x", "y", "z"}, deps, cons, outs, 10),
               make_choice("K2", {"w", "q", "r"}, deps, cons, outs, 10)]
    single = {"x": 10, "w": 10, "y": 5, "z": 5, "q": 5, "r": 5}
    choices += [make_choice(f"s_{p}", {p}, deps, cons, outs, c) for p, c in single.items()]
    return Problem(prims, deps, ("z", "r"), tuple(choices), {p: "elementwise" for p in prims})


def with_layouts(rng: random.Random, p: Problem) -> Problem:
    """The problem with a blocked variant of some choices (every tensor it reads and writes named
    "t@B"), and conversions both ways for every such tensor, as the pipeline builds them."""
    blocked = [replace(c, id=c.id + ".B", inputs=frozenset(t + "@B" for t in c.inputs),
                       outputs=frozenset(t + "@B" for t in c.outputs),
                       cost_ns=max(1, int(c.cost_ns * rng.uniform(0.3, 1.2))), schedule="b/x")
               for c in p.choices if rng.random() < 0.5]
    qualified = sorted({t for c in blocked for t in c.inputs | c.outputs})
    conv = []
    for q in qualified:
        t = q.split("@")[0]
        conv.append(Choice(f"block:{t}", "conv", "tvm", frozenset(), frozenset([t]), frozenset([q]),
                           rng.randint(1, 20), (), "b/block"))
        conv.append(Choice(f"unblock:{t}", "conv", "tvm", frozenset(), frozenset([q]), frozenset([t]),
                           rng.randint(1, 20), (), "b/unblock"))
    return replace(p, choices=p.choices + tuple(blocked) + tuple(conv))


# -- correctness against the exact search ------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(4, 8))
def test_solve_with_layouts_matches_brute_force(seed, n):
    """Kernels and layouts chosen together: the BLP with blocked variants and conversions finds the
    exact optimum, and its plan runs every kernel after the layouts it reads exist."""
    rng = random.Random(seed)
    p = with_layouts(rng, random_problem(rng, n, 3))
    exact = brute_force(p)
    sol = solve(p, time_limit=30)
    assert sol.status == "optimal" and sol.objective_ns == exact.objective_ns
    validate(p, sol.chosen)
    plain = brute_force(random_problem(random.Random(seed), n, 3))
    assert sol.objective_ns <= plain.objective_ns  # more choices never cost more


def test_conversions_are_checked():
    p = with_layouts(random.Random(3), random_problem(random.Random(3), 6, 3))
    bad = Choice("bad", "k", "tvm", frozenset(), frozenset(["p1"]), frozenset(["p2@B"]), 1)
    with pytest.raises(KernorchError, match="must rewrite one tensor"):
        solve(replace(p, choices=p.choices + (bad,)))


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(4, 9), st.sampled_from([3, 4]))
def test_solve_matches_brute_force(seed, n, max_size):
    p = random_problem(random.Random(seed), n, max_size)
    exact = brute_force(p)
    sol = solve(p, time_limit=30)
    assert sol.status == "optimal"
    assert sol.objective_ns == exact.objective_ns
    assert sol.bound_ns == sol.objective_ns and sol.gap == 0.0
    validate(p, sol.chosen)
    for base in (unfused(p), greedy(p)):
        validate(p, base.chosen)
        assert base.status == "heuristic"
        assert base.objective_ns >= sol.objective_ns
    plan = Plan.from_solution(p, sol, {"unfused": unfused(p), "greedy": greedy(p)})
    assert plan.predicted_ns == sol.objective_ns
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(4, 9), st.sampled_from([0.01, 0.2, 0.5]))
def test_solve_within_a_gap_stays_within_it_of_brute_force(seed, n, rel_gap):
    """rel_gap: the plan may stop short of the optimum, never by more than the gap, and says so."""
    p = random_problem(random.Random(seed), n, 3)
    exact = brute_force(p)
    sol = solve(p, time_limit=30, rel_gap=rel_gap)
    validate(p, sol.chosen)
    assert exact.objective_ns <= sol.objective_ns <= exact.objective_ns / (1 - rel_gap) + 1
    assert sol.status == ("optimal" if sol.objective_ns == sol.bound_ns else "within_gap")


def segmented_problem(rng: random.Random, sizes, max_size: int = 3) -> Problem:
    """Random problems in a chain, as the pipeline's partitions: the first prim of each segment reads
    a prim of the one before, and no candidate spans two segments."""
    parts = [random_problem(rng, n, max_size) for n in sizes]
    name = lambda j, p: f"s{j}{p}"  # noqa: E731
    prims = tuple(name(j, p) for j, q in enumerate(parts) for p in q.prims)
    deps = {name(j, p): tuple(name(j, d) for d in ds) for j, q in enumerate(parts) for p, ds in q.deps.items()}
    for j in range(1, len(parts)):
        deps[name(j, "p0")] = (name(j - 1, rng.choice(parts[j - 1].prims)),)
    cons = consumers_of(prims, deps)
    outs = {name(j, o) for j, q in enumerate(parts) for o in q.outputs}
    outs |= {p for p in prims if not cons[p]}
    choices = [make_choice(f"s{j}{c.id}", {name(j, m) for m in c.members}, deps, cons, outs, c.cost_ns, c.impl)
               for j, q in enumerate(parts) for c in q.choices]
    kinds = {name(j, p): k for j, q in enumerate(parts) for p, k in q.kinds.items()}
    return Problem(prims, deps, tuple(p for p in prims if p in outs), tuple(choices), kinds)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(3, 5), min_size=2, max_size=3), st.booleans(),
       st.sampled_from([27, 3, 1]))
def test_solving_block_by_block_matches_brute_force(seed, sizes, layouts, max_states):
    """A problem that falls apart into blocks meeting in a few tensors (in one or two layouts) is
    solved block by block, exactly; also when every block with a choice of layouts is merged."""
    from kernorch import blocks as blk
    rng = random.Random(seed)
    p = segmented_problem(rng, sizes)
    if layouts:
        p = with_layouts(rng, p)
    old = blk.MAX_STATES
    blk.MAX_STATES = max_states
    try:
        blocks = blk.Blocks(p)
        sol = solve(p, time_limit=30)
    finally:
        blk.MAX_STATES = old
    assert len(blocks.prims) >= (len(sizes) if max_states > 1 and not layouts else 1)
    assert all(blocks.states(b) <= max_states for b in range(len(blocks.prims)))
    validate(p, sol.chosen)
    assert sol.status == "optimal" and sol.objective_ns == brute_force(p).objective_ns


def test_a_block_is_solved_again_only_when_it_changed(monkeypatch):
    """Between the solves of a refine loop, blocks whose program did not change are not re-solved."""
    from kernorch import blocks as blk
    p = segmented_problem(random.Random(5), [5, 5, 5])
    calls = []
    whole = blk._solve_whole
    monkeypatch.setattr(blk, "_solve_whole", lambda sub, *a: calls.append(sub.prims) or whole(sub, *a))
    blk._SOLVED.clear()
    first = solve(p)
    assert len(calls) >= 3  # a block per segment at least
    calls.clear()
    assert solve(p).objective_ns == first.objective_ns and not calls
    cheaper = tuple(replace(c, cost_ns=1) if c.members == {"s2p4"} else c for c in p.choices)
    again = solve(replace(p, choices=cheaper))
    assert calls and all(prims[0].startswith("s2") for prims in calls)
    assert again.objective_ns == brute_force(replace(p, choices=cheaper)).objective_ns


def test_blocks_solved_by_an_earlier_process_are_found_in_the_database(tmp_path, monkeypatch):
    """Proven block solutions are kept in the profile database: a solve in a new process (the
    in-memory cache empty) finds every block there and solves none; another version of the
    solver's code finds none of them."""
    from kernorch import blocks as blk
    from kernorch.database import ProfileDB
    p = segmented_problem(random.Random(7), [5, 5, 5])
    calls = []
    whole = blk._solve_whole
    monkeypatch.setattr(blk, "_solve_whole", lambda sub, *a: calls.append(sub.prims) or whole(sub, *a))
    with ProfileDB(tmp_path / "db.sqlite") as db:
        blk._SOLVED.clear()
        first = solve(p, store=db)
        assert len(calls) >= 3
        assert db.conn.execute("SELECT COUNT(*) FROM solutions").fetchone()[0] >= 3
    calls.clear()
    blk._SOLVED.clear()
    with ProfileDB(tmp_path / "db.sqlite") as db:
        again = solve(p, store=db)
        assert not calls and again.chosen == first.chosen and again.objective_ns == first.objective_ns
        assert again.objective_ns == brute_force(p).objective_ns
        blk._SOLVED.clear()
        monkeypatch.setattr(blk, "_solver_source", lambda: "another solver")
        solve(p, store=db)
        assert calls
        db.clear()
        assert db.conn.execute("SELECT COUNT(*) FROM solutions").fetchone()[0] == 0


def test_a_changed_block_starts_from_its_last_solution(monkeypatch):
    """A block solved again (its costs moved) starts from its own last solution of the same state,
    not from the greedy baseline: a capped solve can then only improve on it."""
    from kernorch import blocks as blk
    from kernorch.orchestrate import greedy
    p = segmented_problem(random.Random(5), [5, 5, 5])
    starts = []
    whole = blk._solve_whole
    monkeypatch.setattr(blk, "_solve_whole",
                        lambda sub, deadline, start, gap: starts.append((sub.prims, start)) or whole(sub, deadline, start, gap))
    blk._SOLVED.clear()
    blk._LAST.clear()
    solve(p, initial=list(greedy(p).chosen))
    last = {k[0]: set(ids) for k, ids in blk._LAST.items()}
    starts.clear()
    dearer = tuple(replace(c, cost_ns=c.cost_ns + 1) if c.members & {"s2p0"} else c for c in p.choices)
    solve(replace(p, choices=dearer), initial=list(greedy(p).chosen))
    assert starts and all(prims[0].startswith("s2") for prims, _ in starts)
    for prims, start in starts:
        assert {c.id for c in start} == last[prims]


def test_a_fusion_two_smaller_kernels_beat_leaves_the_model():
    """A chain a -> b -> c: the fusion {a, b} that costs no less than a and b apart leaves the
    binary program (and a start that holds it maps to the pair); {b, c}, which saves, stays; a
    fusion whose parts would read what it does not (b alone reads a) is not split into them."""
    from kernorch.orchestrate import _Model
    prims = ("a", "b", "c")
    deps = {"a": (), "b": ("a",), "c": ("b",)}
    cons = consumers_of(prims, deps)
    outs = {"c"}
    mk = lambda cid, m, cost: make_choice(cid, m, deps, cons, outs, cost)  # noqa: E731
    choices = (mk("A", {"a"}, 10), mk("B", {"b"}, 10), mk("C", {"c"}, 10), mk("AB", {"a", "b"}, 20),
               mk("BC", {"b", "c"}, 15), mk("AC", {"a", "b", "c"}, 24))
    problem = Problem(prims, deps, ("c",), choices)
    model = _Model(problem)
    assert {c.id for c in model.choices} == {"A", "B", "C", "BC", "AC"}
    start = model.start_vector([c for c in choices if c.id in ("AB", "C")])
    assert {model.choices[k].id for k in np.flatnonzero(start[: model.n_x])} == {"A", "B", "C"}
    assert solve(problem).objective_ns == brute_force(problem).objective_ns == 24
    dearer = tuple(replace(c, cost_ns=26) if c.id == "AC" else c for c in choices)
    model = _Model(replace(problem, choices=dearer))  # A + BC = 25 does it cheaper
    assert "AC" not in {c.id for c in model.choices}
    assert solve(replace(problem, choices=dearer)).objective_ns == 25


def _splits_by_every_subset(choices):
    """The oracle of orchestrate._splits: every subset of each choice's members tried in turn, by
    size, then in combinations order."""
    by_members = {}
    for c in choices:
        by_members.setdefault(c.members, []).append(c)
    out = {}
    for k in choices:
        members = sorted(k.members)
        for part in (frozenset(p) for size in range(1, len(members)) for p in itertools.combinations(members, size)):
            found = next(((a, b) for a in by_members.get(part, ()) if a.inputs <= k.inputs and a.cost_ns <= k.cost_ns
                          for b in by_members.get(k.members - part, ()) if a.cost_ns + b.cost_ns <= k.cost_ns
                          and b.inputs <= k.inputs | a.outputs and k.outputs <= a.outputs | b.outputs), None)
            if found:
                out[(k.members, k.inputs, k.outputs)] = tuple((c.members, c.inputs, c.outputs) for c in found)
                break
    return out


def test_splits_match_every_subset_tried():
    """`_splits` finds, for every choice, the same pair of cheaper kernels as trying each subset of
    its members in order (by size, then combinations order), on random problems with fusions of
    up to six prims, many of them splittable (costs well below their members' sum)."""
    from kernorch.orchestrate import _splits
    rng = random.Random(11)
    found = 0
    for _ in range(40):
        p = random_problem(rng, rng.randint(5, 9), rng.randint(3, 6))
        got = _splits(p.choices)
        assert got == _splits_by_every_subset(p.choices)
        found += len(got)
    assert found > 100


def test_random_instances_exercise_cycle_cuts():
    """Seeded sweep: multi-output candidates sometimes form cycles, and the cuts fix them."""
    rng = random.Random(7)
    cut_instances = 0
    for _ in range(150):
        p = random_problem(rng, rng.randint(6, 9), 4)
        sol = solve(p)
        assert sol.objective_ns == brute_force(p).objective_ns
        cut_instances += sol.n_cuts > 0
    assert cut_instances >= 1


def test_cycle_counterexample_needs_a_cut():
    p = cycle_problem()
    sol = solve(p)
    assert sol.objective_ns == 30 and sol.status == "optimal"
    assert sol.n_cuts >= 1
    validate(p, sol.chosen)
    assert brute_force(p).objective_ns == 30
    with pytest.raises(KernorchError, match="before any earlier kernel"):
        validate(p, ["K1", "K2"])


def test_kernels_that_cover_every_prim_but_only_feeding_each_other_make_no_plan():
    """The counterexample's two fused kernels alone: every prim is covered, but each needs a tensor
    the other computes inside; the solve says there is no plan (`NoPlan`, which the refine loop
    takes as "measure more" while fusions are pending)."""
    from kernorch.orchestrate import NoPlan
    p = cycle_problem()
    fused = replace(p, choices=tuple(c for c in p.choices if c.id in ("K1", "K2")))
    assert {m for c in fused.choices for m in c.members} == set(p.prims)
    with pytest.raises(NoPlan, match="no executable plan exists"):
        solve(fused)


def test_dead_prims_need_no_kernel():
    prims = ("a", "b", "dead")
    deps = {"b": ("a",), "dead": ("a",)}
    cons = consumers_of(prims, deps)
    ch = [make_choice("A", {"a"}, deps, cons, {"b"}, 3), make_choice("B", {"b"}, deps, cons, {"b"}, 4),
          make_choice("D", {"dead"}, deps, cons, {"b"}, 1)]
    p = Problem(prims, deps, ("b",), tuple(ch))
    assert live_prims(p) == {"a", "b"}
    assert solve(p).chosen == ("A", "B")
    assert unfused(p).chosen == ("A", "B")


# -- errors and limits --------------------------------------------------------------------------------

def test_output_without_producer_is_named():
    p = cycle_problem()
    p = Problem(p.prims, p.deps, p.outputs, tuple(c for c in p.choices if "r" not in c.outputs))
    with pytest.raises(KernorchError, match="'r'"):
        solve(p)


def test_uncovered_prim_is_named():
    p = cycle_problem()
    p = Problem(p.prims, p.deps, p.outputs, tuple(c for c in p.choices if "q" not in c.members))
    with pytest.raises(KernorchError, match="'q'"):
        solve(p)
    with pytest.raises(KernorchError, match="'q'"):
        unfused(p)


def test_validate_rejects_missing_output_and_unknown_ids():
    p = cycle_problem()
    with pytest.raises(KernorchError, match="never computes"):
        validate(p, ["s_x", "s_w", "s_y", "s_z"])
    with pytest.raises(KernorchError, match="unknown choice"):
        validate(p, ["nope"])


def test_tiny_time_limit_still_returns_an_executable_plan():
    p = layered_problem(random.Random(3), 300)
    start = greedy(p)
    for limit in (1e-9, 0.01):
        sol = solve(p, time_limit=limit)
        validate(p, sol.chosen)
        assert sol.objective_ns <= start.objective_ns
        assert sol.bound_ns <= sol.objective_ns
        assert sol.status in ("optimal", "time_limit")


def test_a_block_time_limit_still_returns_an_executable_plan():
    """A refine round's solve, capped per block, returns a plan at least as good as its start."""
    from kernorch import blocks as blk
    p = with_layouts(random.Random(4), segmented_problem(random.Random(4), [5, 5, 5]))
    blk._SOLVED.clear()
    exact = brute_force(p).objective_ns
    for cap in (1e-9, 5.0):
        sol = solve(p, rel_gap=0.01, block_time_limit=cap)
        validate(p, sol.chosen)
        assert sol.bound_ns <= exact <= sol.objective_ns <= greedy(p).objective_ns
    assert sol.objective_ns <= exact / 0.99 + 1  # with time to spare, within the gap


def test_time_limit_without_any_start_raises_clearly():
    p = cycle_problem()
    p = Problem(p.prims, p.deps, p.outputs, tuple(c for c in p.choices if c.id != "s_y"))  # no unfused/greedy
    with pytest.raises(KernorchError, match="time limit"):
        solve(p, time_limit=0.0)
    assert solve(p).objective_ns == brute_force(p).objective_ns


def test_initial_solution_is_checked():
    p = cycle_problem()
    with pytest.raises(KernorchError, match="unknown"):
        solve(p, initial=["nope"])
    assert solve(p, initial=["K1", "K2"]).objective_ns == 30  # an unexecutable start is ignored


# -- baselines ----------------------------------------------------------------------------------------

def test_greedy_fuses_epilogues_and_elementwise_chains():
    prims = ("mm", "add", "relu", "sum", "mul")
    deps = {"add": ("mm",), "relu": ("add",), "sum": ("relu",), "mul": ("sum",)}
    kinds = {"mm": "linear", "add": "broadcast", "relu": "elementwise", "sum": "reduce", "mul": "elementwise"}
    cons = consumers_of(prims, deps)
    outs = {"mul"}
    sets = [{p} for p in prims] + [{"mm", "add"}, {"mm", "add", "relu"}, {"relu", "sum"}, {"sum", "mul"}]
    ch = [make_choice(f"c{i}", s, deps, cons, outs, 10 * len(s) - 5) for i, s in enumerate(sets)]
    p = Problem(prims, deps, ("mul",), tuple(ch), kinds)
    g = greedy(p)
    groups = [set(next(c for c in ch if c.id == i).members) for i in g.chosen]
    assert groups == [{"mm", "add", "relu"}, {"sum", "mul"}]  # relu is not pulled into the reduce
    assert g.objective_ns >= solve(p).objective_ns


# -- plans --------------------------------------------------------------------------------------------

def test_a_refine_rounds_plan_skips_the_baselines_and_starts_from_the_last_plan(monkeypatch):
    """A refine round's plan (baselines=False) computes neither baseline and hands the solver the
    previous plan as its start; the plan a user sees has both."""
    import kernorch.plan as plan_mod
    p = cycle_problem()
    full = make_plan(p)
    starts = []
    real = plan_mod.solve
    monkeypatch.setattr(plan_mod, "solve", lambda problem, t, initial=None, **kw: starts.append(initial) or real(problem, t, initial=initial, **kw))
    monkeypatch.setattr(plan_mod, "greedy", lambda problem: pytest.fail("greedy baseline computed"))
    monkeypatch.setattr(plan_mod, "unfused", lambda problem: pytest.fail("unfused baseline computed"))
    fast = make_plan(p, previous=full, baselines=False)
    assert starts == [[k.id for k in full.kernels]]
    assert fast.predicted_ns == full.predicted_ns and fast.unfused_ns is None and fast.greedy_ns is None
    assert full.unfused_ns == 40 and full.greedy_ns is not None


def test_plan_round_trip_and_buffers(tmp_path):
    p = cycle_problem()
    plan = make_plan(p)
    assert plan.predicted_ns == 30 and plan.unfused_ns == 40 and plan.greedy_ns is not None
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    last = len(plan.kernels) - 1
    bufs = {b.tensor: b for b in plan.buffers}
    for o in p.outputs:
        assert bufs[o].last_use == last
    for b in plan.buffers:
        assert 0 <= b.produced_at <= b.last_use <= last
    assert all(k.alternatives for k in plan.kernels)
    assert "predicted 30 ns" in plan.summary()
    path.write_text("{}")
    with pytest.raises(KernorchError, match="version"):
        Plan.load(path)


# -- scale --------------------------------------------------------------------------------------------

def layered_problem(rng: random.Random, n: int, window: int = 8, beam: int = 10, max_size: int = 4) -> Problem:
    """A DNN-like graph: mostly a chain (prim i reads i-1 or i-2), plus skip/residual edges from
    up to `window` back; candidates grow from every seed (convex, connected, beam-capped)."""
    prims = tuple(f"n{i}" for i in range(n))
    deps = {}
    for i in range(1, n):
        if rng.random() < 0.02:
            continue
        ds = {i - 1 if rng.random() < 0.8 or i < 2 else i - 2}
        if i > 2 and rng.random() < 0.3:
            ds.add(rng.randrange(max(0, i - window), i - 1))
        deps[prims[i]] = tuple(prims[j] for j in sorted(ds))
    cons = consumers_of(prims, deps)
    outs = {p for p in prims if not cons[p]}
    index = {p: i for i, p in enumerate(prims)}
    nbrs = {p: set(cons[p]) | set(deps.get(p, ())) for p in prims}
    base = {p: rng.randint(200, 5000) for p in prims}
    subsets = set()
    for p in prims:
        frontier = [frozenset([p])]
        subsets.add(frontier[0])
        for _ in range(max_size - 1):
            grown = {s | {q} for s in frontier for q in set().union(*(nbrs[m] for m in s)) - s}
            grown = [s for s in grown if is_convex(s, deps, cons, index)]
            frontier = rng.sample(grown, min(beam // (max_size - 1) + 1, len(grown)))
            subsets.update(frontier)
    choices = []
    for fs in sorted(subsets, key=lambda f: sorted(index[m] for m in f)):
        for impl in rng.sample(IMPLS[:2], rng.randint(1, 2)):
            cost = max(1, int(sum(base[m] for m in fs) * (0.55 + 0.45 / len(fs)) * rng.uniform(0.85, 1.15)))
            choices.append(make_choice(f"c{len(choices)}", fs, deps, cons, outs, cost, impl))
    kinds = {p: rng.choice(KINDS) for p in prims}
    return Problem(prims, deps, tuple(sorted(outs, key=index.__getitem__)), tuple(choices), kinds)


def test_scale_smoke():
    p = layered_problem(random.Random(11), 1500)
    assert 10_000 <= len(p.choices) <= 20_000
    sol = solve(p, time_limit=60)
    assert sol.status == "optimal", sol
    assert sol.solve_seconds < 30, sol.solve_seconds
    validate(p, sol.chosen)
    assert greedy(p).objective_ns >= sol.objective_ns
    assert unfused(p).objective_ns >= sol.objective_ns


def test_plan_carries_each_kernels_schedule():
    """The solver treats schedules as opaque; the plan's kernels and alternatives keep theirs, the
    prediction is the sum of the chosen costs, and JSON round-trips."""
    p = random_problem(random.Random(7), 7, 3)
    choices = tuple(replace(c, schedule=f"t{i % 5 + 4}x32p") for i, c in enumerate(p.choices))
    p2 = replace(p, choices=choices)
    sol = solve(p2, time_limit=30)
    plan = Plan.from_solution(p2, sol)
    sched = {c.id: c.schedule for c in choices}
    assert all(k.schedule == sched[k.id] for k in plan.kernels)
    assert all(a.schedule == sched[a.id] for k in plan.kernels for a in k.alternatives)
    assert plan.predicted_ns == sol.objective_ns
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
