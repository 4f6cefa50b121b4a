"""optimize(): the stages in order, each one function from one value to the next.

    load → fission → partition+enumerate → measure → orchestrate → emit (→ verify, time)

Each stage's result is kept on a `Run` so the CLI can stop after any stage (inspect,
candidates, plan) and the report can show all of them.
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import candidates as cands
from . import fission as fis
from . import measure as meas
from .database import Measurement, ProfileDB
from .frontend import onnx as frontend
from .ir import Graph, KernorchError
from .options import Machine, Options

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything one optimization produced, stage by stage."""

    options: Options
    machine: Machine
    source: str = ""
    onnx: Any = None
    graph: Graph | None = None
    enumeration: Any = None
    jobs: list = field(default_factory=list)
    measurements: dict = field(default_factory=dict)
    measure_stats: Any = None
    plan: Any = None
    seconds: dict[str, float] = field(default_factory=dict)
    tuning: dict | None = None      # kernorch.tune.tune_loop's history when options.budget is set
    mixes: list = field(default_factory=list)  # select(): each runtime mix, predicted and measured
    context: dict = field(default_factory=dict)  # impl -> (scale, call_ns): in model = scale x alone + call_ns
    refined: dict | None = None     # refine(): the fitted context and whether re-solving with it paid

    def timed(self, stage: str, fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - t0


def load(model, options: Options, run: Run | None = None) -> Run:
    """Frontend + fission."""
    run = run or Run(options, Machine.host())
    run.onnx = run.timed("load", frontend.load, model, options.shape_dict)
    run.source = run.onnx.source
    run.graph = run.timed("fission", fis.fission, run.onnx)
    return run


def enum_options(options: Options) -> cands.EnumOptions:
    return cands.EnumOptions(max_size=options.max_kernel_size, max_per_partition=options.max_candidates,
                             max_outputs=options.max_outputs)


def enumerate_candidates(run: Run) -> Run:
    run.enumeration = run.timed("enumerate", cands.enumerate_all, run.graph, enum_options(run.options),
                                run.options.max_partition)
    return run


def jobs_for(graph: Graph, candidates, options: Options) -> list[meas.KernelJob]:
    """Every distinct (key, implementation) worth measuring; untuned TVM for a few, for comparison."""
    from .backends import packed_supports
    jobs: dict[tuple, meas.KernelJob] = {}
    untuned = 0
    for c in candidates:
        kg = meas.kernel_graph(graph, c.members, c.inputs, c.outputs)
        if any(p.op == "opaque" for p in kg.prims):
            continue  # opaque kernels run through the library path only
        jobs.setdefault((c.key, "tvm", "default"), meas.KernelJob(c.key, "tvm", "default", kg, c.inputs, c.outputs))
        for impl in (("library", "ort") if options.library else ()):
            if packed_supports(impl, graph, kg.prims, c.inputs, c.outputs) is None:
                jobs.setdefault((c.key, impl, "-"), meas.KernelJob(c.key, impl, "-", kg, c.inputs, c.outputs))
        if untuned < options.compare_untuned and (c.key, "tvm", "none") not in jobs and len(c.members) > 1:
            jobs[(c.key, "tvm", "none")] = meas.KernelJob(c.key, "tvm", "none", kg, c.inputs, c.outputs)
            untuned += 1
    return list(jobs.values())


def measure_candidates(run: Run, db: ProfileDB) -> Run:
    run.jobs = run.timed("jobs", jobs_for, run.graph, run.enumeration.candidates, run.options)
    run.measurements, run.measure_stats = run.timed("measure", meas.measure, run.jobs, db, run.options, run.machine)
    return run


def best_costs(measurements: dict[tuple[str, str, str], Measurement]) -> dict[tuple[str, str], Measurement]:
    """Per (key, impl): the measurement the solver may use (untuned TVM is only for comparison)."""
    out = {}
    for (key, impl, schedule), m in measurements.items():
        if m.ok and schedule != "none":
            out[(key, impl)] = m
    return out


def problem_for(graph: Graph, candidates, costs: dict[tuple[str, str], Measurement],
                context: dict[str, tuple[float, float]] | None = None):
    """The orchestration problem: one choice per (candidate, implementation) with a measured cost,
    weighed by the implementation's context (how it runs inside an executable, see `refine`).

    Returns the problem and a map from choice id to its candidate (for the plan's kernel params).
    """
    from . import orchestrate as orch
    from . import primitives
    from .plan import weighed
    context = context or {}
    choices, by_id = [], {}
    for i, c in enumerate(candidates):
        for impl in meas.IMPLS:
            m = costs.get((c.key, impl))
            if m is None:
                continue
            cid = f"c{i}.{impl}"
            scale, call_ns = context.get(impl, (1.0, 0.0))
            choices.append(orch.Choice(cid, c.key, impl, frozenset(c.members), frozenset(c.deps),
                                       frozenset(c.outputs), weighed(int(m.median_ns), scale, call_ns),
                                       tuple(c.members), scale, call_ns, int(m.median_ns)))
            by_id[cid] = c
    deps = {p.name: tuple(t for t in dict.fromkeys(p.inputs) if t in graph.by_name) for p in graph.prims}
    problem = orch.Problem(tuple(p.name for p in graph.prims), deps, tuple(graph.outputs), tuple(choices),
                           {p.name: primitives.kind(p.op) for p in graph.prims})
    return problem, by_id


def orchestrate(run: Run, packed: tuple[str, ...] | None = None) -> Run:
    """Solve the binary linear program over every measured candidate and make the plan.

    `packed`: the library implementations the plan may call (None: every one measured).
    """
    from dataclasses import replace
    from .backends import PACKED
    from .plan import make_plan
    costs = best_costs(run.measurements)
    if packed is not None:
        costs = {k: m for k, m in costs.items() if k[1] not in PACKED or k[1] in packed}
    problem, by_id = problem_for(run.graph, run.enumeration.candidates, costs, run.context)
    plan = run.timed("orchestrate", make_plan, problem, run.options.solver_time_limit)
    # the plan's kernels take every tensor they read, in the order the lowering numbers them
    kernels = tuple(replace(k, inputs=by_id[k.id].inputs, outputs=by_id[k.id].outputs) for k in plan.kernels)
    meta = {"model": run.source, "machine": run.machine.name, "threads": str(run.options.threads)}
    if run.options.budget:  # where the emitter finds the schedules of "tvm-tuned" kernels
        from .tune import tune_dir
        meta["tune_dir"] = str(tune_dir(run.options, run.machine))
    run.plan = replace(plan, kernels=kernels, meta=meta)
    return run


def plan_model(model, options: Options, db: ProfileDB | None = None) -> Run:
    """Everything up to the plan."""
    own = db is None
    db = db or ProfileDB(options.resolved_db())
    try:
        run = load(model, options)
        if options.context:
            run.context = db.context(run.machine.fingerprint(options.threads))
        enumerate_candidates(run)
        measure_candidates(run, db)
        orchestrate(run)
        if options.budget:
            from . import tune
            run.timed("tune", tune.tune_loop, run, db)
        return run
    finally:
        if own:
            db.close()


def emit(run: Run, max_fallbacks: int = 3, packed: tuple[str, ...] | None = None):
    """Compile the plan; a kernel that fails to build is dropped and the program re-solved
    (within the runtime mix `packed`, see `orchestrate`)."""
    from . import emit as em
    for attempt in range(max_fallbacks + 1):
        try:
            ex, wnames = run.timed("emit", em.build_module, run.graph, run.plan, run.options.threads)
            return em.CompiledModel(run.graph, run.plan, ex, wnames, run.options.threads, run.machine)
        except Exception as e:
            if attempt == max_fallbacks:
                raise
            bad = run.timed("emit", _failing_kernel, run)
            if bad is None:
                raise
            log.warning("kernel %s (%s, %s) fails to build in the emitted module (%s); falling back to the next "
                        "best implementation", bad.id, bad.impl, "+".join(bad.members), str(e)[:200])
            run.measurements = {k: v for k, v in run.measurements.items() if not (k[0] == bad.key and k[1] == bad.impl)}
            orchestrate(run, packed)


#: The runtime mixes `select` tries: the library implementations a plan may call besides TVM
#: kernels. Each library runs its own thread pool (TVM's, ONNX Runtime's per session, OpenBLAS's),
#: and handing the cores from one pool to another costs wake-ups that isolated kernel timings do
#: not see (on gpt2_mini, ORT kernels ran 1.3-1.6x slower between TVM kernels than alone). Which
#: mix wins depends on the model, so each is emitted and timed end to end.
MIXES: dict[str, tuple[str, ...]] = {"all": ("library", "ort"), "tvm+ort": ("ort",), "tvm+blas": ("library",),
                                     "tvm": ()}
MIX_SLACK = 2.0  # a mix predicted this many times slower than the best one is not emitted


def select(run: Run):
    """Emit the plan of every runtime mix, time them interleaved, keep the fastest.

    Mixes whose plan equals an earlier one are not emitted again. With `options.select` off, the
    plan over every implementation is emitted as is. Returns the chosen CompiledModel; `run.plan`
    becomes its plan and `run.mixes` records every mix (predicted and measured).
    """
    mixes = MIXES if run.options.select else {"all": MIXES["all"]}
    built: dict[str, tuple] = {}
    seen: dict[tuple, str] = {}
    best_predicted = None
    for name, packed in mixes.items():
        orchestrate(run, packed)
        sig = _signature(run.plan)
        if sig in seen:
            run.mixes.append({"mix": name, "same_as": seen[sig]})
            continue
        predicted = run.plan.predicted_ns
        best_predicted = predicted if best_predicted is None else min(best_predicted, predicted)
        if predicted > MIX_SLACK * best_predicted:  # cannot win: pool hand-offs never cost that much
            run.mixes.append({"mix": name, "predicted_ms": predicted / 1e6, "skipped": "predicted too slow"})
            continue
        seen[sig] = name
        try:
            compiled = emit(run, packed=packed)
            built[name] = (run.plan, compiled)
        except Exception as e:  # noqa: BLE001 - another mix may still build
            if len(mixes) == 1:
                raise
            log.warning("runtime mix %s does not build (%s); skipped", name, str(e)[:200])
            run.mixes.append({"mix": name, "error": str(e)[:300]})
    if not built:
        raise KernorchError("no runtime mix of the plan could be built")
    times = (run.timed("select", _time_interleaved, run, {n: c for n, (_, c) in built.items()}) if len(built) > 1
             else {n: [] for n in built})
    best = min(built, key=lambda n: float(np.median(times[n])) if times[n] else 0.0)
    for n, (plan, _) in built.items():
        run.mixes.append({"mix": n, "predicted_ms": plan.predicted_ns / 1e6, "kernels": len(plan.kernels),
                          "impls": dict(sorted(_impl_counts(plan).items())),
                          "measured_ms": float(np.median(times[n])) * 1e3 if times[n] else None,
                          "runs": len(times[n]), "chosen": n == best})
    run.plan, compiled = built[best]
    return compiled


def _time_interleaved(run: Run, models: dict) -> dict[str, list[float]]:
    """`select_runs` end-to-end runs of each compiled model, round-robin (seconds per run)."""
    from . import executor
    feeds = executor.random_feeds(run.graph, run.options.seed)
    for c in models.values():
        c.time(feeds, runs=0, warmup=2)
    times: dict[str, list[float]] = {n: [] for n in models}
    for _ in range(run.options.select_runs):
        for n, c in models.items():
            times[n].extend(c.time(feeds, runs=1, warmup=0))
    return times


#: Fitting an implementation's context needs this many of its kernels in the executable; with
#: fewer, only the scale (total in model / total alone) is fitted.
FIT_MIN_KERNELS = 4
SCALE_RANGE = (0.5, 4.0)
CALL_NS_MAX = 500_000.0


def fit_context(plan, kernel_ms) -> dict[str, tuple[float, float, int]]:
    """Per implementation: (scale, call_ns, kernels) with in-model = scale x alone + call_ns,
    least squares over the plan's kernels of that implementation (kernel_ms: each one's time
    inside the executable). Kernels the profile did not see (0 ms) are left out."""
    by: dict[str, list[tuple[float, float]]] = {}
    for k, ms in zip(plan.kernels, kernel_ms):
        if ms > 0 and k.cost_ns > 0:
            by.setdefault(k.impl, []).append((float(k.cost_ns), ms * 1e6))
    out = {}
    for impl, pts in by.items():
        alone = np.array([a for a, _ in pts])
        inside = np.array([b for _, b in pts])
        scale, call = float(inside.sum() / alone.sum()), 0.0
        if len(pts) >= FIT_MIN_KERNELS and np.ptp(alone) > 0:
            (s, c), *_ = np.linalg.lstsq(np.vstack([alone, np.ones_like(alone)]).T, inside, rcond=None)
            if SCALE_RANGE[0] <= s <= SCALE_RANGE[1] and 0.0 <= c <= CALL_NS_MAX:
                scale, call = float(s), float(c)
        out[impl] = (float(np.clip(scale, *SCALE_RANGE)), call, len(pts))
    return out


def refine(run: Run, compiled):
    """Learn how each implementation runs inside the measured executable and re-solve with it.

    The executable is profiled (each kernel's time inside it) and, per implementation, in-model =
    scale x alone + call_ns is fitted: thread-pool hand-offs, cold caches and calls through the VM
    are what the isolated timings do not see (on gpt2_mini, ORT kernels ran ~1.4x slower inside the
    model, generated kernels paid ~10 us per call). The fits are stored (the next optimization on
    this machine starts from them), the plan is re-solved within the chosen runtime mix, and a
    different plan is emitted and kept only if it measures faster, interleaved with the current one.
    Returns the kept CompiledModel and its in-context profile (see `in_context`).
    """
    context = run.timed("refine", in_context, compiled, run.options.seed)
    fits = fit_context(compiled.plan, context["kernel_ms"])
    with ProfileDB(run.options.resolved_db()) as db:
        target = run.machine.fingerprint(run.options.threads)
        for impl, (scale, call_ns, n) in fits.items():
            db.add_context(target, impl, scale, call_ns, n, run.source)
    before = run.context
    run.context = {impl: (scale, call_ns) for impl, (scale, call_ns, _) in fits.items()}
    run.refined = {"fits": {i: {"scale": s, "call_us": c / 1e3, "kernels": n} for i, (s, c, n) in fits.items()},
                   "context_before": {i: {"scale": s, "call_us": c / 1e3} for i, (s, c) in before.items()}}
    chosen = next((m["mix"] for m in run.mixes if m.get("chosen")), "all")
    packed = MIXES.get(chosen, MIXES["all"])
    old = run.plan
    orchestrate(run, packed)
    if _signature(run.plan) == _signature(old):
        run.refined.update(changed=False, predicted_ms=run.plan.predicted_ns / 1e6)
        run.plan = old
        return compiled, context
    new_plan = run.plan
    try:
        candidate = emit(run, packed=packed)
    except Exception as e:  # noqa: BLE001 - the plan that already runs stays
        log.warning("the re-solved plan does not build (%s); keeping the selected one", str(e)[:200])
        run.refined.update(changed=True, error=str(e)[:300])
        run.plan = old
        return compiled, context
    times = run.timed("refine", _time_interleaved, run, {"selected": compiled, "refined": candidate})
    ms = {n: float(np.median(t)) * 1e3 for n, t in times.items()}
    keep = ms["refined"] < ms["selected"]
    run.refined.update(changed=True, kept=keep, measured_ms=ms, runs=run.options.select_runs,
                       predicted_ms=new_plan.predicted_ns / 1e6, kernels=len(new_plan.kernels),
                       impls=dict(sorted(_impl_counts(new_plan).items())))
    if not keep:
        run.plan = old
        return compiled, context
    run.plan = new_plan
    return candidate, run.timed("refine", in_context, candidate, run.options.seed)


def _signature(plan) -> tuple:
    return tuple((k.key, k.impl) for k in plan.kernels)


def _impl_counts(plan) -> dict[str, int]:
    return dict(Counter(k.impl for k in plan.kernels))


def _failing_kernel(run: Run):
    """The first plan kernel that does not build on its own (None if all do)."""
    from .backends import PACKED
    from .backends import tvm as tb
    from .emit import kernel_module
    target = tb.make_target(run.options.threads)
    for k in run.plan.kernels:
        if k.impl in PACKED:
            continue
        try:
            tb.build(kernel_module(run.graph, run.plan, k, target), target)
        except Exception:
            return k
    return None


def verify(run: Run, compiled, model, seed: int = 0, tol: float = 1e-3) -> dict:
    """Compare the compiled model with ONNX Runtime; on a mismatch name the first diverging kernel."""
    from . import executor
    feeds = executor.random_feeds(run.graph, seed)
    sess = executor.ort_session(model, run.options.threads)
    names = [o.name for o in sess.get_outputs()]
    ref = dict(zip(names, sess.run(names, feeds)))
    got = compiled.run(feeds)
    errors = {n: executor.max_error(np.asarray(ref[n]), got[n]) for n in compiled.output_names}
    worst = max((e["rel"] for e in errors.values()), default=0.0)
    result = {"ok": worst <= tol, "tolerance": tol, "max_rel_error": worst, "outputs": errors}
    if not result["ok"]:
        result["first_bad_kernel"] = bisect(run, feeds, tol)
        k = result["first_bad_kernel"]
        raise KernorchError(f"the optimized model differs from ONNX Runtime (max error {worst:.3g} of the output "
                            f"scale); first diverging kernel: {k}")
    return result


def bisect(run: Run, feeds, tol: float) -> str | None:
    """Run each plan kernel alone on reference intermediates; return the first that disagrees."""
    from . import executor
    from .backends import PACKED, packed_kernel
    from .backends import tvm as tb
    from .emit import kernel_module
    values = executor.run(run.graph, feeds, keep_all=True)
    target = tb.make_target(run.options.threads)
    for k in run.plan.kernels:
        kg = meas.kernel_graph(run.graph, k.members, k.inputs, k.outputs)
        args = [values[t] for t in k.inputs]
        if k.impl in PACKED:
            outs = packed_kernel(k.impl, kg, kg.prims, k.inputs, k.outputs)(*args)
        else:
            outs = tb.build(kernel_module(run.graph, run.plan, k, target), target)(*args)
        for t, o in zip(k.outputs, outs):
            if executor.max_error(values[t], np.asarray(o))["rel"] > tol:
                return f"{k.id} ({k.impl}: {'+'.join(run.graph.by_name[m].op for m in k.members)}) output {t}"
    return None


def time_against_ort(compiled, model, threads: int, runs: int = 20, seed: int = 0) -> dict:
    """End-to-end latency of kernorch and ONNX Runtime, interleaved in this process, medians."""
    from . import executor
    feeds = executor.random_feeds(compiled.graph, seed)
    sess = executor.ort_session(model, threads)
    kern, ort = [], []
    compiled.time(feeds, runs=0, warmup=3)
    for _ in range(3):
        sess.run(None, feeds)
    for _ in range(runs):
        kern.extend(compiled.time(feeds, runs=1, warmup=0))
        t0 = time.perf_counter()
        sess.run(None, feeds)
        ort.append(time.perf_counter() - t0)
    k_ms, o_ms = float(np.median(kern)) * 1e3, float(np.median(ort)) * 1e3
    return {"runs": runs, "threads": threads, "kernorch_ms": k_ms, "ort_ms": o_ms, "speedup": o_ms / k_ms,
            "kernorch_runs_ms": [x * 1e3 for x in kern], "ort_runs_ms": [x * 1e3 for x in ort],
            "load": _load_average()}


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def optimize(model, options: Options, runs: int = 20):
    """The whole pipeline: a verified CompiledModel with its report."""
    from .backends import tvm as tb
    tb.set_threads(options.threads)
    run = plan_model(model, options)
    compiled = select(run)
    context = None
    if options.select and options.context:
        compiled, context = refine(run, compiled)
    check = run.timed("verify", verify, run, compiled, model, options.seed)
    timing = run.timed("time", time_against_ort, compiled, model, options.threads, runs, options.seed) if runs else {}
    if context is None and runs:
        context = run.timed("time", in_context, compiled, options.seed)
    compiled.report = report_dict(run, check, timing, context)
    return compiled, run


def in_context(compiled, seed: int = 0, runs: int = 3) -> dict:
    """Each plan kernel's time inside the executable (median over `runs`), beside its isolated cost:
    where the end-to-end time goes that the additive cost model does not see."""
    from . import executor
    prof = compiled.profile(executor.random_feeds(compiled.graph, seed), runs=runs)
    kernel_ms = [0.0] * len(compiled.plan.kernels)
    for p in prof:
        if p["kernel"] is not None:
            kernel_ms[p["kernel"]] += p["ms"]
    return {"runs": runs, "kernel_ms": kernel_ms, "other_ms": sum(p["ms"] for p in prof if p["kernel"] is None),
            "by_impl": _sum_by_impl(compiled.plan, kernel_ms)}


def _sum_by_impl(plan, kernel_ms) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for k, ms in zip(plan.kernels, kernel_ms):
        d = out.setdefault(k.impl, {"kernels": 0, "alone_ms": 0.0, "in_model_ms": 0.0})
        d["kernels"] += 1
        d["alone_ms"] += k.cost_ns / 1e6
        d["in_model_ms"] += ms
    return out


def report_dict(run: Run, check: dict, timing: dict, context: dict | None = None) -> dict:
    ms = run.measure_stats
    return {
        "model": run.source, "machine": run.machine.to_json(), "threads": run.options.threads,
        "primitives": len(run.graph.prims), "partitions": len(run.enumeration.partitions),
        "candidates": len(run.enumeration.candidates),
        "distinct_keys": len({c.key for c in run.enumeration.candidates}),
        "measure": ms.__dict__ if ms else {}, "plan": run.plan.to_json(),
        "predicted_ms": run.plan.predicted_ns / 1e6, "verify": check, "timing": timing,
        "seconds": dict(run.seconds),
        **({"tuning": run.tuning} if run.tuning else {}),
        **({"mixes": run.mixes} if run.mixes else {}),
        **({"context": context} if context else {}),
        **({"refined": run.refined} if run.refined else {}),
    }
