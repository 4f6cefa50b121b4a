"""The orchestration plan: what runs, in which order, which buffers live when, and why.

A `Plan` is the hand-off from the solver to code generation and to the report. It is plain data
(JSON round-trips exactly) so a plan can be saved next to a model and re-used without re-solving.
"""
from __future__ import annotations

import json
import math
import logging
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

from kernorch.ir import KernorchError
from kernorch.orchestrate import Problem, Solution, greedy, solve, unfused

log = logging.getLogger(__name__)

PLAN_VERSION = 2


@dataclass(frozen=True)
class Alternative:
    """Another candidate that overlaps a chosen kernel; shown so users can see what was rejected."""

    id: str
    impl: str
    members: tuple[str, ...]
    cost_ns: int
    schedule: str = "default"


@dataclass(frozen=True)
class Kernel:
    id: str
    key: str
    impl: str
    members: tuple[str, ...]  # in execution (topological) order
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # measured alone, in this schedule; a kernel the executable's timed stages turned or re-tiled
    # (meta "columns_outside", "long_tiles": kernorch.executed) keeps the cost it was planned at
    cost_ns: int
    alternatives: tuple[Alternative, ...] = ()
    schedule: str = "default"      # "default" rules, a micro-kernel tile ("t14x32p"), a tuning record
    bucket: int = 0                # a plan that dispatches on a symbolic length: the bucket it runs in


@dataclass(frozen=True)
class Buffer:
    """A tensor written by a kernel: it must live from its first write to its last read."""

    tensor: str
    produced_at: int
    last_use: int


@dataclass(frozen=True)
class SolverStats:
    status: str
    objective_ns: int
    bound_ns: int
    gap: float | None  # None for heuristics (no bound), so the JSON stays standard
    solve_seconds: float
    n_cuts: int
    n_rows: int = 0
    n_cols: int = 0
    n_nonzeros: int = 0


@dataclass(frozen=True)
class Plan:
    kernels: tuple[Kernel, ...]
    buffers: tuple[Buffer, ...]
    outputs: tuple[str, ...]
    stats: SolverStats
    unfused_ns: int | None = None
    greedy_ns: int | None = None
    meta: Mapping[str, str] = field(default_factory=dict)
    # measurements (key, impl, schedule) of kernels chosen, or close to it, on an estimate only
    estimated: tuple = field(default=(), compare=False)
    # a plan per bucket of a symbolic length (meta["buckets"]): each bucket's share of the range
    weights: tuple[float, ...] = ()

    @property
    def predicted_ns(self) -> int:
        """The additive cost model's prediction: the sum of the kernels' measured latencies (with
        buckets: each bucket's sum, weighted by its share of the range)."""
        if not self.weights:
            return sum(k.cost_ns for k in self.kernels)
        return round(sum(w * sum(k.cost_ns for k in self.kernels if k.bucket == b) for b, w in enumerate(self.weights)))

    def bucket(self, b: int) -> "Plan":
        """The plan of bucket `b` alone (a plan without buckets is its own bucket 0)."""
        if not self.weights:
            return self
        return replace(self, kernels=tuple(k for k in self.kernels if k.bucket == b), weights=())

    def split_last(self, weights: Sequence[float], meta: Mapping[str, str]) -> "Plan":
        """A plan with buckets, its last bucket's kernels (and the buffers they write) serving one
        more bucket after it, the same kernels (ids "b{n}." of the new bucket n); `weights` every
        bucket's share, `meta` the plan's (its "buckets" naming the new one)."""
        last = len(self.weights) - 1
        first = next(i for i, k in enumerate(self.kernels) if k.bucket == last)
        n, prefix = len(self.kernels), f"b{last}."
        kernels = tuple(replace(k, id=f"b{last + 1}.{k.id.removeprefix(prefix)}", bucket=last + 1)
                        for k in self.kernels[first:])
        buffers = tuple(replace(x, produced_at=x.produced_at - first + n, last_use=x.last_use - first + n)
                        for x in self.buffers if x.produced_at >= first)
        return replace(self, kernels=self.kernels + kernels, buffers=self.buffers + buffers, weights=tuple(weights),
                       meta=dict(meta))

    @staticmethod
    def dispatch(plans: "list[Plan]", weights: list[float], meta: Mapping[str, str]) -> "Plan":
        """One plan of the per-bucket `plans` (in bucket order, each solved over its bucket): the
        kernels of bucket b tagged `bucket=b` (ids prefixed "b{b}."), solver figures weighted by
        the buckets' shares `weights` (the gap is the worst bucket's)."""
        kernels, buffers, offset = [], [], 0
        for b, p in enumerate(plans):
            kernels += [replace(k, id=f"b{b}.{k.id}", bucket=b) for k in p.kernels]
            buffers += [replace(x, produced_at=x.produced_at + offset, last_use=x.last_use + offset) for x in p.buffers]
            offset += len(p.kernels)

        def weighted(values):
            return None if any(v is None for v in values) else round(sum(w * v for w, v in zip(weights, values)))
        st = [p.stats for p in plans]
        gaps = [x.gap for x in st]
        stats = SolverStats(next((x.status for x in st if x.status != "optimal"), "optimal"),
                            weighted([x.objective_ns for x in st]), weighted([x.bound_ns for x in st]),
                            None if any(g is None for g in gaps) else max(gaps), sum(x.solve_seconds for x in st),
                            sum(x.n_cuts for x in st), sum(x.n_rows for x in st), sum(x.n_cols for x in st),
                            sum(x.n_nonzeros for x in st))
        return Plan(tuple(kernels), tuple(buffers), plans[0].outputs, stats, weighted([p.unfused_ns for p in plans]),
                    weighted([p.greedy_ns for p in plans]), dict(meta), weights=tuple(weights))

    # -- construction ------------------------------------------------------------------------
    @staticmethod
    def from_solution(problem: Problem, solution: Solution, baselines: Mapping[str, Solution | int | None] | None = None,
                      n_alternatives: int = 3, meta: Mapping[str, str] | None = None) -> "Plan":
        """Build the plan for `solution`; `baselines` maps "unfused"/"greedy" to a Solution or ns."""
        by_id = {c.id: c for c in problem.choices}
        rank = {p: i for i, p in enumerate(problem.prims)}
        covering: dict[str, list] = {}
        for c in problem.choices:
            for m in c.members:
                covering.setdefault(m, []).append(c)
        kernels = []
        for cid in solution.chosen:
            if cid not in by_id:
                raise KernorchError(f"solution names unknown choice {cid!r}")
            c = by_id[cid]
            members = c.order or tuple(sorted(c.members, key=rank.__getitem__))
            others = {o.id: o for m in c.members for o in covering.get(m, ()) if o.id != c.id}
            alts = sorted(others.values(), key=lambda o: (o.cost_ns, o.id))[:n_alternatives]
            kernels.append(Kernel(c.id, c.key, c.impl, tuple(members), tuple(sorted(c.inputs)), tuple(sorted(c.outputs)),
                                  c.cost_ns, tuple(Alternative(o.id, o.impl, tuple(sorted(o.members, key=rank.__getitem__)),
                                                               o.cost_ns, o.schedule) for o in alts),
                                  c.schedule))
        produced: dict[str, int] = {}
        last: dict[str, int] = {}
        for step, k in enumerate(kernels):
            for t in k.inputs:
                last[t] = step
            for t in k.outputs:
                produced.setdefault(t, step)
        end = len(kernels) - 1
        buffers = tuple(Buffer(t, s, end if t in problem.outputs else max(s, last.get(t, s)))
                        for t, s in sorted(produced.items(), key=lambda ts: (ts[1], ts[0])))
        s = solution
        gap = s.gap if math.isfinite(s.gap) else None
        stats = SolverStats(s.status, s.objective_ns, s.bound_ns, gap, s.solve_seconds, s.n_cuts,
                            s.n_rows, s.n_cols, s.n_nonzeros)
        base = {name: (v.objective_ns if isinstance(v, Solution) else v) for name, v in (baselines or {}).items()}
        return Plan(tuple(kernels), buffers, tuple(problem.outputs), stats, base.get("unfused"), base.get("greedy"),
                    dict(meta or {}))

    # -- serialisation -----------------------------------------------------------------------
    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("estimated")
        d["meta"] = dict(self.meta)
        d["version"] = PLAN_VERSION
        d["predicted_ns"] = self.predicted_ns
        return d

    @staticmethod
    def from_json(d: Mapping) -> "Plan":
        if d.get("version") != PLAN_VERSION:
            raise KernorchError(f"plan file has version {d.get('version')!r}; this kernorch reads version {PLAN_VERSION}")
        kernels = tuple(Kernel(k["id"], k["key"], k["impl"], tuple(k["members"]), tuple(k["inputs"]), tuple(k["outputs"]),
                               k["cost_ns"], tuple(Alternative(a["id"], a["impl"], tuple(a["members"]), a["cost_ns"],
                                                               a["schedule"]) for a in k["alternatives"]),
                               k["schedule"], k.get("bucket", 0))
                        for k in d["kernels"])
        buffers = tuple(Buffer(**b) for b in d["buffers"])
        return Plan(kernels, buffers, tuple(d["outputs"]), SolverStats(**d["stats"]), d.get("unfused_ns"),
                    d.get("greedy_ns"), dict(d.get("meta", {})), weights=tuple(d.get("weights", ())))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @staticmethod
    def load(path: str | Path) -> "Plan":
        try:
            return Plan.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KernorchError(f"cannot read plan {path}: {e}") from e

    # -- report ------------------------------------------------------------------------------
    def summary(self) -> str:
        """A plain-text table of the kernels and the totals against the baselines."""
        lines = [f"{'#':>3}  {'kernel':<24} {'impl':<10} {'schedule':<10} {'cost_ns':>10}  members"]
        for i, k in enumerate(self.kernels):
            if self.weights and (i == 0 or self.kernels[i - 1].bucket != k.bucket):
                lines.append(f"bucket {k.bucket} (weight {self.weights[k.bucket]:.2f})")
            lines.append(f"{i:>3}  {k.id[:24]:<24} {k.impl[:10]:<10} {k.schedule[:10]:<10} {k.cost_ns:>10}  "
                         f"{', '.join(k.members)}")
        st = self.stats
        lines.append(f"predicted {self.predicted_ns} ns with {len(self.kernels)} kernels; solver {st.status}, "
                     f"bound {st.bound_ns} ns, gap {'n/a' if st.gap is None else f'{st.gap:.2%}'}, {st.solve_seconds:.2f} s, {st.n_cuts} cuts")
        for name, v in (("unfused", self.unfused_ns), ("greedy", self.greedy_ns)):
            if v:
                lines.append(f"{name}: {v} ns (plan is {v / max(self.predicted_ns, 1):.2f}x faster)")
        return "\n".join(lines)


def make_plan(problem: Problem, time_limit: float = 60.0, previous: "Plan | None" = None,
              rel_gap: float = 0.0, block_time_limit: float | None = None, baselines: bool = True,
              store=None) -> Plan:
    """Solve and compute both baselines; a baseline that does not exist is recorded as None.
    `previous`: a plan of an earlier solve of this problem (other costs), the solver's start when it
    is cheaper than the greedy baseline under today's costs. `rel_gap`, `block_time_limit`: see
    orchestrate.solve (and `store`). Without `baselines` (a refine round's plan, which only says what to measure
    next: 0.33 s of segformer_b0's rounds), `previous` is the start whenever it still runs."""
    found: dict[str, Solution | None] = {}
    for name, fn in (("unfused", unfused), ("greedy", greedy)) if baselines else ():
        try:
            found[name] = fn(problem)
        except KernorchError as e:
            log.info("no %s baseline: %s", name, e)
            found[name] = None
    start = found.get("greedy") or found.get("unfused")
    initial = list(start.chosen) if start else None
    if previous is not None:
        costs = {c.id: c.cost_ns for c in problem.choices}
        ids = [k.id for k in previous.kernels]
        if all(i in costs for i in ids) and (start is None or sum(costs[i] for i in ids) < start.objective_ns):
            initial = ids
    sol = solve(problem, time_limit, initial=initial, rel_gap=rel_gap, block_time_limit=block_time_limit,
                store=store)
    return Plan.from_solution(problem, sol, found)
