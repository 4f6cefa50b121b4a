"""Budgeted MetaSchedule tuning inside the orchestration loop: tune only what can change the plan.

Korch tuned every candidate (3-12 h per model). Here the plan made from default-schedule and
library costs decides what is worth tuning:

1. the candidate set is the plan's kernels (their TVM version, also when the plan picked a library
   kernel) plus close alternatives (the plan's recorded alternatives whose cost is within
   `CLOSE` times the chosen kernel's), each distinct key weighted by how often it occurs;
2. a global budget (trials "200t" or time "20m") is spent in rounds, each round on the kernels with
   the highest expected end-to-end gain per unit of budget (DynaTune-style: an optimistic, UCB-like
   estimate from each kernel's tuning curve, a prior proportional to its cost when untried); a
   kernel whose curve has flattened is not tuned again;
3. after each round the tuned kernels are re-measured through kernorch's own path (build, check
   against the numpy reference, time), stored in the profile DB as impl "tvm-tuned", and the
   program is re-solved; the next round works on the new plan;
4. a kernel never tuned before starts from the best traces of similar kernels (same op sequence,
   other shapes) before MetaSchedule's random/evolutionary search.

Budget semantics: the budget is a *level*, not an increment. Tuning already recorded for the
model's kernels (in the tuning directory's `kernels.json`) counts as spent, so a second run with
the same budget reuses everything and tunes nothing, like the profile DB measures nothing twice.

Everything learned is kept per target fingerprint (MetaSchedule's key ignores the target) under
`Options.tune_dir` or the user's cache directory: MetaSchedule's JSON database plus `kernels.json`
with each kernel key's curve, trials and seconds.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence


from . import measure as meas
from .backends import registry
from .database import Measurement, ProfileDB
from .ir import KernorchError, kernel_graph

log = logging.getLogger(__name__)

IMPL = "tvm-tuned"
CLOSE = 2.0          # alternatives within this factor of the chosen kernel's cost are worth tuning
PRIOR = 0.5          # expected relative gain of an untried kernel (default schedule → tuned)
FLAT = 0.02          # a chunk improving the best by less than this (relative) is "flat"
PATIENCE = 2         # flat chunks in a row before a kernel is no longer tuned
EXPLORE = 0.1        # weight of the UCB exploration bonus
SEC_PER_TRIAL = 3.0  # time-budget estimate before any kernel was tuned here
OVERHEAD_S = 5.0     # fixed seconds of one tune_tir call (pools, search initialisation)


# ------------------------------------------------------------------------------------------------
# budget
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Budget:
    """`amount` trials (unit "t") or seconds (unit "s")."""

    amount: float
    unit: str

    def __str__(self) -> str:
        return f"{self.amount:g}t" if self.unit == "t" else f"{self.amount / 60:g}m"


def parse_budget(text: str | int | float) -> Budget:
    """"200t" / "200" → trials; "20m", "90s", "1.5h" → seconds."""
    if isinstance(text, (int, float)):
        return Budget(float(text), "t")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([tmsh]?)\s*", str(text).lower())
    if not m:
        raise KernorchError(f"budget {text!r}: expected trials like '200t' or time like '20m', '90s', '1h'")
    x, u = float(m.group(1)), m.group(2) or "t"
    if u == "t":
        return Budget(float(int(x)), "t")
    return Budget(x * {"s": 1, "m": 60, "h": 3600}[u], "s")


# ------------------------------------------------------------------------------------------------
# the allocator (pure)
# ------------------------------------------------------------------------------------------------

@dataclass
class Arm:
    """One kernel key as the allocator sees it.

    `curve` holds (cumulative trials, best ns) points, starting with (0, default ns). `weight` is
    how often the key occurs where it matters (times a relevance factor for alternatives).
    `cost_per_trial` is in budget units (1 for trial budgets, seconds for time budgets).
    """

    key: str
    weight: float
    curve: list[tuple[int, float]]
    cost_per_trial: float = 1.0
    overhead: float = 0.0
    done: bool = False  # failed, or known not to improve

    @property
    def best(self) -> float:
        return min(ns for _, ns in self.curve)

    @property
    def chunks(self) -> int:
        return len(self.curve) - 1


def flattened(curve: Sequence[tuple[int, float]], tol: float = FLAT, patience: int = PATIENCE) -> bool:
    """True when the last `patience` chunks each improved the best by less than `tol` (relative)."""
    if len(curve) - 1 < patience:
        return False
    best = [min(ns for _, ns in curve[: i + 1]) for i in range(len(curve))]
    return all((best[i - 1] - best[i]) < tol * best[i - 1] for i in range(len(best) - patience, len(best)))


def expected_gain(arm: Arm, total_chunks: int) -> float:
    """Expected end-to-end ns saved by one more chunk of this kernel (optimistic).

    Untried: PRIOR of its cost. Tried: the relative improvement of its last chunk plus a UCB
    bonus that shrinks with the chunks it already had, times its current best, times its weight.
    """
    if arm.done or flattened(arm.curve):
        return 0.0
    if arm.chunks == 0:
        rel = PRIOR
    else:
        prev = min(ns for _, ns in arm.curve[:-1])
        last = max(0.0, (prev - arm.best) / prev)
        rel = min(0.9, last + EXPLORE * math.sqrt(2 * math.log(max(total_chunks, 2)) / arm.chunks))
    return arm.weight * arm.best * rel


def allocate(arms: Sequence[Arm], remaining: float, chunk: int, max_arms: int = 4) -> list[tuple[str, int]]:
    """One round: (key, trials) for the arms with the highest expected gain per budget unit.

    Never allocates more than `remaining` budget units; arms with no expected gain get nothing;
    a leftover smaller than half a chunk is not spent.
    """
    total = sum(a.chunks for a in arms)
    scored = []
    for a in arms:
        g = expected_gain(a, total)
        if g > 0:
            scored.append((g / (chunk * a.cost_per_trial + a.overhead), a))
    scored.sort(key=lambda s: -s[0])
    out = []
    for _, a in scored[:max_arms]:
        trials = min(chunk, int((remaining - a.overhead) // max(a.cost_per_trial, 1e-9)))
        if trials < max(1, chunk // 2):  # a trial or two of search is not worth a tune_tir call
            continue
        out.append((a.key, trials))
        remaining -= trials * a.cost_per_trial + a.overhead
    return out


# ------------------------------------------------------------------------------------------------
# persistent per-key state
# ------------------------------------------------------------------------------------------------

def tune_dir(options, machine) -> Path:
    """One directory per target fingerprint (MetaSchedule's DB key ignores the target)."""
    if getattr(options, "tune_dir", None):
        base = Path(options.tune_dir)
    else:
        import platformdirs
        base = Path(platformdirs.user_cache_dir("kernorch")) / "tuning"
    return base / machine.fingerprint(options.threads)


def family(prims) -> str:
    """Kernels with the same op sequence but other shapes: warm-start donors for each other."""
    return meas.describe(prims)


class State:
    """`kernels.json`: per kernel key its family, trials, seconds, curve and failure."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / "kernels.json"
        self.data: dict[str, dict] = self._read()
        self.dirty: set[str] = set()

    def _read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def get(self, key: str) -> dict | None:
        return self.data.get(key)

    def put(self, key: str, entry: dict) -> None:
        self.data[key] = entry
        self.dirty.add(key)

    def save(self) -> None:
        """Merge our keys into the file (another run may have written others) and replace it."""
        merged = self._read()
        merged.update({k: self.data[k] for k in self.dirty})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged))
        tmp.replace(self.path)


# ------------------------------------------------------------------------------------------------
# one kernel: lower, tune, re-measure
# ------------------------------------------------------------------------------------------------

@dataclass
class Kernel:
    key: str
    job: meas.KernelJob   # impl "tvm": the kernel graph and its parameter order
    weight: float = 1.0

    @property
    def family(self) -> str:
        return family(self.job.graph.prims)


def _lowered(job: meas.KernelJob):
    from .backends import tvm as tb
    return tb.lower(job.graph, job.graph.prims, job.inputs, job.outputs)


def measure_tuned(kernel: Kernel, directory: Path, options, machine, db: ProfileDB, trials: int) -> Measurement:
    """Build the best tuned schedule, check it against the numpy reference and time it, in
    `measure`'s worker processes (a kernel that faults cannot end the run; a crash is a transient
    failure, not a verdict). Served from the profile database when it was measured before."""
    job = replace(kernel.job, impl=IMPL, schedule=f"ms:{trials}")
    results, _ = meas.measure([job], db, options.with_(tune_dir=str(directory)), machine, label="tuned")
    return results[job.ident]


def _warm_start_task(job: meas.KernelJob, directory: str, donors: list[str], threads: int) -> int:
    """In a worker: replay the donors' best traces on the kernel, keep those that build and compute
    the reference, and commit them as tuning records."""
    from .backends import tvm as tb
    from .backends.tvm import metaschedule as tt
    target = tb.make_target(threads)
    db = tt.open_db(directory)
    inputs = meas.make_inputs(job)
    want = meas.reference(job, inputs)
    return tt.warm_start(db, _lowered(job), target, tt.top_traces(db, donors), inputs,
                         check=lambda outs: meas.check(job, outs, want))


def _warm_start(kernel: Kernel, state: State, directory: Path, options) -> int:
    """Replay the best traces of tuned kernels of the same family (same ops, other shapes; from any
    model tuned on this target) into the DB, so the search starts from them. In a worker process:
    a replayed schedule that faults ends only the worker (the warm start is then skipped)."""
    from .workers import WorkerPool
    donors = {e["workload"] for k, e in state.data.items()
              if k != kernel.key and e.get("family") == kernel.family and e.get("workload") and not e.get("error")}
    if not donors:
        return 0
    with WorkerPool(1, meas.worker_env(options.threads)) as pool:
        r = pool.call(_warm_start_task, (kernel.job, str(directory), sorted(donors)[:4], options.threads),
                      options.build_timeout * 4)
    if not r.ok:
        log.warning("warm start of %s (%s) failed: %s", kernel.job.description, kernel.key, r.error)
        return 0
    log.info("warm start of %s (%s): %d schedules replayed from %d similar kernels", kernel.job.description,
             kernel.key, r.value, len(donors))
    return r.value


# ------------------------------------------------------------------------------------------------
# the loop
# ------------------------------------------------------------------------------------------------

def tunable_set(plan, candidates) -> dict[str, float]:
    """Keys worth tuning and their weights: the plan's kernels weighted by occurrences, plus close
    alternatives weighted by occurrences times how close they are (chosen cost / alternative cost)."""
    ids = {f"c{i}": c for i, c in enumerate(candidates)}
    weights: dict[str, float] = {}
    for k in plan.kernels:
        weights[k.key] = weights.get(k.key, 0.0) + 1.0
    for k in plan.kernels:
        for a in k.alternatives:
            c = ids.get(a.id.split(".")[0])
            if c is None or c.key in weights and weights[c.key] >= 1.0:
                continue
            cover = sum(p.cost_ns for p in plan.kernels if set(p.members) & set(a.members))
            if a.cost_ns <= CLOSE * max(cover, 1):
                weights[c.key] = weights.get(c.key, 0.0) + min(1.0, cover / max(a.cost_ns, 1))
    return weights


def _kernels(graph, candidates, keys) -> dict[str, Kernel]:
    """A "tvm" KernelJob per key (from the first candidate with that key); opaque kernels skipped."""
    out = {}
    for c in candidates:
        if c.key in keys and c.key not in out:
            kg = kernel_graph(graph, c.members, c.inputs, c.outputs)
            if any(p.op == "opaque" for p in kg.prims):
                continue
            out[c.key] = Kernel(c.key, meas.KernelJob(c.key, "tvm", "default", kg, c.inputs, c.outputs))
    return out


def _current_ns(measurements, key: str) -> float | None:
    """The best generated cost of a key (any schedule, tuned or not) the solver currently sees."""
    vals = [m.median_ns for (k, impl, sched), m in measurements.items()
            if k == key and registry.native(impl) and m.ok and sched != "none"]
    return float(min(vals)) if vals else None


def _spent(entries: Sequence[dict], budget: Budget) -> float:
    return sum(e.get("trials", 0) if budget.unit == "t" else e.get("seconds", 0.0) for e in entries)


def _reuse(graph, candidates, measured, db: ProfileDB, state: State, directory: Path, options, machine):
    """Bring in tuned costs of this model's kernels already tuned (this or another model/run):
    the profile DB row when it matches the recorded trials, else a re-measurement (no tuning).
    Returns (measured, how many)."""
    from .backends.tvm import metaschedule as tt  # noqa: F401 - fail early if MetaSchedule is missing
    keys = {c.key for c in candidates}
    tuned = {k: e for k, e in state.data.items() if k in keys and e.get("trials") and not e.get("error")}
    if not tuned:
        return measured, 0
    kernels = _kernels(graph, candidates, tuned)
    n = 0
    for key, k in kernels.items():
        measured = measured.with_measurement(measure_tuned(k, directory, options, machine, db, tuned[key]["trials"]))
        n += 1
    return measured, n


def tune_loop(graph, enumeration, measured, plan, db: ProfileDB, options, machine, solve,
              chunk: int | None = None, max_rounds: int = 1000):
    """Spend `options.budget` tuning the kernels that can change `plan`; after each round,
    `solve(measured)` gives the next plan and the measurements it needed, as (plan, measured).
    Returns (plan, measured, history):

        history = {"budget", "unit", "spent", "curve": [(seconds, predicted ms)], "kernels": [tuned keys],
                   "kernel_curves": {key: [(trials, best ns)]}, "rounds", "new_trials", "seconds"}
    """
    from .backends.tvm import metaschedule as tt
    from .backends import tvm as tb

    candidates = enumeration.candidates
    budget = parse_budget(options.budget)
    chunk = chunk or (4 if budget.unit == "t" and budget.amount <= 32 else 8)
    directory = tune_dir(options, machine)
    directory.mkdir(parents=True, exist_ok=True)
    namespace = meas.target_of(machine, options)  # where measure() keeps the run's measurements
    tb.set_threads(options.threads)
    target = tb.make_target(options.threads)
    state = State(directory)
    t0 = time.perf_counter()

    def add(m: Measurement) -> None:
        nonlocal measured
        measured = measured.with_measurement(m)
        db.add(m)

    history: dict = {"budget": str(budget), "unit": budget.unit, "dir": str(directory), "rounds": 0,
                     "new_trials": 0, "curve": [], "kernels": [], "kernel_curves": {}}
    measured, reused = _reuse(graph, candidates, measured, db, state, directory, options, machine)
    if reused:
        plan, measured = solve(measured)
    history["reused"] = reused
    history["curve"].append((0.0, plan.predicted_ns / 1e6))
    log.info("tuning: budget %s, %d kernels already tuned, plan %.4f ms", budget, reused, plan.predicted_ns / 1e6)

    all_keys = {c.key for c in candidates}
    failed_now: set[str] = set()
    for _ in range(max_rounds):
        weights = tunable_set(plan, candidates)
        kernels = _kernels(graph, candidates, weights)
        spent = _spent([e for k, e in state.data.items() if k in all_keys], budget)
        remaining = budget.amount - spent
        if remaining < 1:
            break
        rate = _seconds_per_trial(state)
        arms = []
        for key, k in kernels.items():
            e = state.get(key) or {}
            base = _current_ns(measured.measurements, key)
            if base is None or e.get("error") or key in failed_now:
                continue
            curve = [tuple(p) for p in e.get("curve", [])] or [(0, base)]
            arms.append(Arm(key, weights[key], curve, 1.0 if budget.unit == "t" else rate,
                            0.0 if budget.unit == "t" else OVERHEAD_S))
        picks = allocate(arms, remaining, chunk)
        if not picks:
            break
        for key, trials in picks:
            k = kernels[key]
            e = dict(state.get(key) or {"family": k.family, "desc": k.job.description, "trials": 0, "seconds": 0.0,
                                        "curve": [(0, _current_ns(measured.measurements, key))]})
            ts = time.perf_counter()
            try:
                mod = _lowered(k.job)
                e["workload"] = tt.workload_hash(mod)
                if e["trials"] == 0:
                    e["trials"] += _warm_start(k, state, directory, options)
                r = tt.tune(mod, target, directory, trials, options.threads, options.seed)
                e["trials"] += r["trials"]
            except Exception as ex:  # noqa: BLE001 - recorded as refused, never tuned again
                e["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                e["seconds"] = e.get("seconds", 0.0) + time.perf_counter() - ts
                e["trials"] = max(e["trials"], trials)  # the budget was spent
                state.put(key, e)
                add(Measurement(namespace, key, IMPL, f"ms:{e['trials']}", meas.versions(IMPL), "refused",
                                None, (), f"tuning failed: {e['error']}", 0.0, k.job.description))
                failed_now.add(key)
                log.warning("tuning %s (%s) failed: %s", k.job.description, key, e["error"])
                continue
            m = measure_tuned(k, directory, options, machine, db, e["trials"])
            measured = measured.with_measurement(m)
            e["seconds"] = e.get("seconds", 0.0) + time.perf_counter() - ts
            if m.ok:
                e["curve"] = list(e["curve"]) + [(e["trials"], min(m.median_ns, min(ns for _, ns in e["curve"])))]
            else:
                e["error"] = m.reason
                failed_now.add(key)
            state.put(key, e)
            state.save()
            history["new_trials"] += r["trials"]
            log.info("tuned %s (%s): %d trials, %s ns (default %s ns), %.1f s", k.job.description, key, e["trials"],
                     m.median_ns, e["curve"][0][1], time.perf_counter() - ts)
        history["rounds"] += 1
        plan, measured = solve(measured)
        history["curve"].append((time.perf_counter() - t0, plan.predicted_ns / 1e6))
        log.info("tuning round %d: plan %.4f ms, %.0f of %s spent", history["rounds"], plan.predicted_ns / 1e6,
                 _spent([e for k, e in state.data.items() if k in all_keys], budget), budget)
    state.save()
    tuned = {k: e for k, e in state.data.items() if k in all_keys and e.get("trials")}
    history["kernels"] = sorted(k.key for k in plan.kernels if k.impl == IMPL)
    history["kernel_curves"] = {k: [list(p) for p in e.get("curve", [])] for k, e in tuned.items()}
    history["spent"] = _spent(list(tuned.values()), budget)
    history["seconds"] = time.perf_counter() - t0
    return plan, measured, history


def _seconds_per_trial(state: State) -> float:
    """Observed tuning seconds per trial on this target (the estimate for time budgets)."""
    t = sum(e.get("trials", 0) for e in state.data.values())
    s = sum(e.get("seconds", 0.0) for e in state.data.values())
    return s / t if t >= 8 else SEC_PER_TRIAL
