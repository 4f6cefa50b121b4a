"""MetaSchedule for one kernel: tune, query the best schedule, warm-start from similar kernels.

Part of the TVM backend, so TVM stays behind the backend boundary. Facts this relies on
(TVM 0.27, measured here):

* The stock LocalBuilder imports `tvm.s_tir.tensor_intrin` in every fresh worker (18-50 s here),
  so every build times out; `fast_build` below calls `tvm.compile` directly. It is a module-level
  function of an installed package because builder workers import it by name.
* The tuning database's key is the structural hash of the PrimFunc, NOT the target: callers pass
  one `work_dir` per target fingerprint (`kernorch.tune.tune_dir`).
* Builds that fail are committed too (no run_secs), so "has a workload" is not "has a schedule".
* `python -m tvm.exec.popen_worker` processes can outlive a tuning run; `tune` ends the ones it
  started (its own descendants, never another run's).
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import tvm
import tvm_ffi
from tvm import s_tir
from tvm.s_tir import meta_schedule as ms

from ...ir import KernorchError
from .build import build, compile_kernel
from .target import thread_env

log = logging.getLogger(__name__)


def fast_build(mod, target, _params):
    """MetaSchedule f_build: tvm.compile without the per-worker tensor_intrin import."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return compile_kernel(mod, target).mod


_OPEN: dict[str, tuple[tuple, ms.database.JSONDatabase]] = {}


def open_db(work_dir: str | Path) -> ms.database.JSONDatabase:
    """The JSON tuning database in `work_dir` (created; JSONDatabase does not mkdir).

    Opening parses every record (0.8 s for 20 minutes of tuning records), and emitting the runtime
    mixes asks for it once per tuned kernel per mix (37 times, 31 s, on gpt2_mini). So an open
    database is kept, and opened again only when its files changed on disk (another writer).
    """
    d = Path(work_dir)
    d.mkdir(parents=True, exist_ok=True)
    files = (d / "database_workload.json", d / "database_tuning_record.json")
    sig = tuple((f.stat().st_mtime_ns, f.stat().st_size) if f.exists() else None for f in files)
    key = str(d.resolve())
    hit = _OPEN.get(key)
    if hit is not None and hit[0] == sig:
        return hit[1]
    db = ms.database.JSONDatabase(work_dir=str(d))
    _OPEN[key] = (sig, db)
    return db


def _key(mod: tvm.IRModule) -> int:
    return int(tvm_ffi.structural_hash(mod))


def workload_hash(mod: tvm.IRModule) -> str:
    """MetaSchedule's workload key of `mod` (structural hash), as text for JSON."""
    return str(_key(mod))


def _records(db, mod: tvm.IRModule) -> list:
    """Every record of this workload (failed builds included: each one was a trial)."""
    h = _key(mod)
    return [r for r in db.get_all_tuning_records() if _key(r.workload.mod) == h]


def trials_done(db, mod: tvm.IRModule) -> int:
    return len(_records(db, mod)) if db.has_workload(mod) else 0


def best_seconds(db, mod: tvm.IRModule, target) -> float | None:
    """MetaSchedule's own latency of the best record (None: nothing valid yet)."""
    if not db.has_workload(mod):
        return None
    rec = db.query_tuning_record(mod, target, workload_name="main")
    if rec is None or not rec.run_secs:
        return None
    return float(np.median([float(x) for x in rec.run_secs]))


def best_module(db, mod: tvm.IRModule, target) -> tvm.IRModule | None:
    """The kernel scheduled by its best record, ready for `build` / the emitter (None if none)."""
    if not db.has_workload(mod):
        return None
    sch = db.query_schedule(mod, target, workload_name="main")
    if sch is None:
        return None
    func = sch.mod["main"]
    for k, v in (mod["main"].attrs or {}).items():  # keep kernorch.num_inputs etc.
        if func.attrs is None or k not in func.attrs:
            func = func.with_attr(k, v)
    func = func.with_attr("tirx.is_scheduled", True).with_attr("kernorch.rule", "metaschedule")
    return tvm.IRModule({"main": func})


# ------------------------------------------------------------------------------------------------
# warm start: replay the best traces of similar kernels (same ops, other shapes)
# ------------------------------------------------------------------------------------------------

def top_traces(db, workloads: Sequence[str], k: int = 2) -> list:
    """The `k` fastest valid traces of each workload (by `workload_hash`) in the database."""
    want = set(workloads)
    by: dict[str, list] = {}
    for r in db.get_all_tuning_records():
        if r.run_secs and max(float(x) for x in r.run_secs) < 1e9:  # failed runs carry 1e10
            h = workload_hash(r.workload.mod)
            if h in want:
                by.setdefault(h, []).append((float(np.mean([float(x) for x in r.run_secs])), r.trace))
    out = []
    for recs in by.values():
        out.extend(t for _, t in sorted(recs, key=lambda x: x[0])[:k])
    return out


def _replay(mod: tvm.IRModule, trace) -> s_tir.Schedule | None:
    """Apply `trace` to `mod`: with its decisions first (same tiling), else re-sampled (same sketch)."""
    for keep in (True, False):
        try:
            t = trace if keep else s_tir.Trace(trace.insts, {})
            sch = s_tir.Schedule(mod, seed=1)
            t.apply_to_schedule(sch, remove_postproc=False)
            return sch
        except Exception as e:  # noqa: BLE001 - a trace of another shape often does not fit
            log.debug("trace replay (decisions=%s) failed: %s", keep, str(e).splitlines()[0] if str(e) else e)
    return None


def warm_start(db, mod: tvm.IRModule, target, traces: Sequence, inputs: Sequence[np.ndarray],
               check=None) -> int:
    """Replay `traces` on `mod`, time the ones that build (and pass `check(outputs)`), and commit
    them as tuning records: the evolutionary search then starts from them as measured seeds.
    Returns the number of records committed (each counts as a trial)."""
    wl = db.commit_workload(mod)
    args_info = ms.arg_info.ArgInfo.from_prim_func(mod["main"])
    n = 0
    seen = set()
    for trace in traces:
        sch = _replay(mod, trace)
        if sch is None:
            continue
        h = _key(sch.mod)
        if h in seen:
            continue
        seen.add(h)
        try:
            k = build(sch.mod, target)
            outs = k(*inputs)
            if check is not None:
                check(outs)
            secs = float(np.median(k.time(*inputs, number=1, repeat=3, min_repeat_ms=5)))
        except Exception as e:  # noqa: BLE001
            log.debug("replayed schedule rejected: %s", str(e).splitlines()[0] if str(e) else e)
            continue
        db.commit_tuning_record(ms.database.TuningRecord(sch.trace, wl, [secs], target, args_info))
        n += 1
    return n


# ------------------------------------------------------------------------------------------------
# tuning
# ------------------------------------------------------------------------------------------------

def reap_workers() -> int:
    """End the `tvm.exec.popen_worker` processes this process started (they can outlive a tuning
    run). Only our own descendants: another run's workers are never touched."""
    import psutil
    killed = 0
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for c in children:
        try:
            if any("tvm.exec.popen_worker" in part for part in c.cmdline()):
                c.kill()
                killed += 1
        except psutil.Error:
            pass
    return killed


def tune(mod: tvm.IRModule, target, work_dir: str | Path, trials: int, threads: int, seed: int = 0,
         build_timeout: float = 60.0, run_timeout: float = 30.0) -> dict:
    """Run MetaSchedule on `mod` for about `trials` more trials, appending to the database in
    `work_dir` (existing records of the workload seed the evolutionary search).

    Returns {"trials": records added, "best_s": best MetaSchedule latency or None, "seconds"}.
    Raises KernorchError when nothing valid exists afterwards (every build or run failed).
    """
    os.environ.update(thread_env(threads))  # the runner's workers inherit it
    # MetaSchedule sizes its stdout handler from this logger's level at every call (and resets the
    # level to DEBUG afterwards): set it each time. Its tables stay in work_dir/logs.
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.INFO if log.isEnabledFor(logging.DEBUG)
                                                          else logging.ERROR)
    db = open_db(work_dir)
    before_n = trials_done(db, mod)
    t0 = time.perf_counter()
    try:
        ms.tune_tir(
            mod, target, work_dir=str(work_dir), max_trials_global=int(trials), num_trials_per_iter=int(trials),
            database=db,
            builder=ms.builder.LocalBuilder(max_workers=max(1, threads), timeout_sec=build_timeout, f_build=fast_build),
            runner=ms.runner.LocalRunner(timeout_sec=run_timeout, evaluator_config=ms.runner.EvaluatorConfig(
                number=3, repeat=1, min_repeat_ms=5)),
            num_tuning_cores=max(1, threads), seed=seed)
    finally:
        n = reap_workers()
        if n:
            log.debug("killed %d leftover popen_worker processes", n)
    seconds = time.perf_counter() - t0
    added = trials_done(db, mod) - before_n
    best = best_seconds(db, mod, target)
    if best is None:
        raise KernorchError(f"MetaSchedule found no valid schedule in {added} trials (see {work_dir}/logs)")
    return {"trials": added, "best_s": best, "seconds": seconds}
