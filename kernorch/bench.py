"""End-to-end comparison of kernorch with the systems people would otherwise use, timed honestly.

    results = bench("model.onnx", systems=("kernorch", "ort", "ort-basic", "tvm"), threads=2, runs=20)
    save_json(results, "bench.json")

Why it is built this way (machine-notes.md, "Timing on a shared 2-core machine"):

* every system runs in ONE process, on the SAME random inputs (`executor.random_feeds` of the
  fissioned graph) and the same thread count, and the runs are *interleaved* round-robin (one run
  of each system per round, starting system rotated), so a burst of load from another process hits
  every system alike instead of whichever happened to be timed then;
* we report medians with the p10/p90 spread and the number of runs, never a mean or a best;
* /proc/pressure/cpu and the load average are recorded before and after timing, so a reader can
  discount numbers taken on a busy box;
* TVM's thread pool defaults to ONE thread here: TVM_NUM_THREADS is set before its first parallel
  call (and inherited by MetaSchedule's workers).

Systems: "kernorch" (a saved model dir, or `pipeline.optimize`), "ort" (ONNX Runtime, all graph
optimizations: the reference for speedups and errors), "ort-basic" (ORT_ENABLE_BASIC), "tvm" (Relax
from `from_onnx` with the default CPU fusion pipeline plus dlight's CPU rules, and MetaSchedule with
`budget_trials` trials when > 0), "torch" (only via onnx2torch, when installed). A system that fails
to build or run is reported with its error; it never stops the others.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

log = logging.getLogger(__name__)

SYSTEMS = ("kernorch", "ort", "ort-basic", "tvm", "torch")
REFERENCE = "ort"
ERROR_TOL = 1e-3          # max error relative to the output scale, reported as "matches"
WARMUP = 3
MAX_SECONDS_PER_SYSTEM = 120.0  # stop timing a (very slow) system after this much, once it has 3 runs
# Pause before each timed run. Needed because the systems share the process: ONNX Runtime's and TVM's
# thread pools spin-wait after a call, and on 2 cores a partner still spinning from the *previous*
# system makes the next one's parallel loops wait (measured: TVM 1.5 ms alone, 10 ms [7-38] right
# after ORT on transformer_block). The pause lets the spinners go to sleep; it is not timed.
COOLDOWN_S = 0.01
# ONNX Runtime's workers spin during a Run (its default, kept) but stop spinning when the Run ends
# ("session.force_spinning_stop"), so they do not steal the 2 cores from the next system. Measured on
# candy_like with default spinning: ORT medians flipped between 2.5 and 8 ms from one bench to the next,
# and TVM's p90 reached 8-20x its median. True = ORT's default, False = no spinning at all.
ORT_SPINNING: bool | str = "stop"


class Skip(Exception):
    """The system cannot run here for a reason that is not a bug (e.g. a package is not installed)."""


@dataclass
class System:
    name: str
    run_once: Callable[[], float]            # one inference on the prepared inputs; returns its wall seconds
    outputs: Callable[[], list[np.ndarray]]  # one inference; outputs in the ONNX graph's output order
    info: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# MetaSchedule fast builder: lives here so builder worker processes can import it by name
# (tvm-0.27-guide §3.0: the stock builder times out importing tensor intrinsics in every worker)
# ------------------------------------------------------------------------------------------------

def fast_build(mod, target, _params):
    import tvm
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.compile(mod, target=target).mod


def make_builder(max_workers: int = 2, timeout_sec: float = 60.0):
    from tvm.s_tir import meta_schedule as ms
    return ms.builder.LocalBuilder(max_workers=max_workers, timeout_sec=timeout_sec, f_build=fast_build)


# ------------------------------------------------------------------------------------------------
# machine state
# ------------------------------------------------------------------------------------------------

def load_state() -> dict:
    """CPU pressure (/proc/pressure/cpu "some" averages, %) and the load average, now."""
    out: dict[str, Any] = {"time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    try:
        for line in Path("/proc/pressure/cpu").read_text().splitlines():
            if line.startswith("some"):
                kv = dict(f.split("=") for f in line.split()[1:])
                out["cpu_pressure"] = {k: float(kv[k]) for k in ("avg10", "avg60", "avg300") if k in kv}
    except (OSError, ValueError):
        pass
    try:
        out["loadavg"] = list(os.getloadavg())
    except OSError:
        pass
    return out


def _busy(state: dict, threads: int) -> bool:
    p = state.get("cpu_pressure", {}).get("avg10")
    if p is not None:
        return p > 10.0
    la = state.get("loadavg")
    return bool(la) and la[0] > 0.5


# ------------------------------------------------------------------------------------------------
# the systems
# ------------------------------------------------------------------------------------------------

def _timer(fn: Callable[[], Any]) -> Callable[[], float]:
    def run_once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return run_once


def _onnx_inputs(proto) -> list[str]:
    inits = {i.name for i in proto.graph.initializer}
    return [i.name for i in proto.graph.input if i.name not in inits]


def _ort_system(name: str, proto_bytes: bytes, feeds: dict, threads: int, level: str) -> System:
    import onnxruntime as ort
    from .executor import ort_session
    sess = ort_session(proto_bytes, threads, level, ORT_SPINNING)
    names = [o.name for o in sess.get_outputs()]
    feeds = {i.name: feeds[i.name] for i in sess.get_inputs()}
    return System(name, _timer(lambda: sess.run(names, feeds)), lambda: [np.asarray(o) for o in sess.run(names, feeds)],
                  {"graph_optimization_level": level, "onnxruntime": ort.__version__,
                   "spinning": ORT_SPINNING})


def _tvm_tune(mod, target, budget_trials: int, work_dir: Path) -> dict:
    """MetaSchedule over the fused module's tasks; reuses a finished database in `work_dir`."""
    from tvm.s_tir import meta_schedule as ms
    done = work_dir / "done.json"
    if done.exists():
        info = json.loads(done.read_text())
        info["from_cache"] = True
        return info
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ms.relax_integration.tune_relax(
        mod, params={}, target=target, work_dir=str(work_dir), max_trials_global=budget_trials,
        num_trials_per_iter=min(16, budget_trials), builder=make_builder(),
        runner=ms.runner.LocalRunner(timeout_sec=30, evaluator_config=ms.runner.EvaluatorConfig(
            number=3, repeat=1, min_repeat_ms=20)), seed=0)
    _reap_workers()
    info = {"budget_trials": budget_trials, "tuning_seconds": time.perf_counter() - t0}
    done.write_text(json.dumps(info))
    info["from_cache"] = False
    return info


def _reap_workers() -> None:
    """MetaSchedule's popen workers sometimes outlive tuning (guide §3.2); end ours, by pid."""
    try:
        import psutil
        for c in psutil.Process().children(recursive=True):
            if "popen_worker" in " ".join(c.cmdline()):
                log.info("ending leftover tuning worker %d", c.pid)
                c.terminate()
    except Exception as e:  # best effort only
        log.debug("could not reap tuning workers: %s", e)


def _tvm_system(proto, feeds: dict, shapes: dict, threads: int, budget_trials: int, tune_dir: Path | None) -> System:
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from tvm.relax.frontend.onnx import from_onnx
    from tvm.s_tir import dlight as dl
    from .backends import tvm as tb

    target = tb.make_target(threads)
    t0 = time.perf_counter()
    mod = from_onnx(proto, shape_dict={k: list(v) for k, v in shapes.items()}, keep_params_in_input=False)
    info: dict[str, Any] = {"pipeline": "relax cpu_generic default (legalize, FuseOps, FuseTIR) + dlight cpu GEMV/Reduction",
                            "target": str(target.export().get("mcpu", "")), "tuned": False}
    # the default pipeline, split where schedules go: after fusion, before lowering to the VM
    with target:
        mod = tvm.transform.Sequential(cpu.library_dispatch_passes(target) + cpu.legalize_passes(target))(mod)
    if budget_trials > 0:
        key = hashlib.sha1(proto.SerializeToString()).hexdigest()[:12]
        wd = (tune_dir or _cache_dir() / "tvm-tune") / f"{key}-t{threads}-n{budget_trials}"
        info["tuning"] = _tvm_tune(mod, target, budget_trials, wd)
        info["tuning"]["work_dir"] = str(wd)
        from tvm.s_tir import meta_schedule as ms
        db = ms.database.JSONDatabase(work_dir=str(wd))
        with target, db, tvm.transform.PassContext(opt_level=3):
            mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
        info["tuned"] = True
    with target:
        mod = dl.ApplyDefaultSchedule(dl.cpu.GEMV(), dl.cpu.Reduction())(mod)
        mod = tvm.transform.Sequential(cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))(mod)
    ex = tvm.compile(mod, target=target, relax_pipeline=None)
    info["build_seconds"] = time.perf_counter() - t0
    dev = tvm.cpu()
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(np.ascontiguousarray(feeds[n]), dev) for n in _onnx_inputs(proto)]
    f = vm["main"]

    def outputs() -> list[np.ndarray]:
        res = f(*args)
        if hasattr(res, "numpy"):
            return [res.numpy()]
        return [r.numpy() for r in res]

    return System("tvm", _timer(lambda: f(*args)), outputs, info)


def _torch_system(proto, feeds: dict, threads: int) -> System:
    try:
        import torch
    except ImportError:
        raise Skip("PyTorch is not installed") from None
    try:
        import onnx2torch
    except ImportError:
        raise Skip("no ONNX→PyTorch converter installed (onnx2torch)") from None
    torch.set_num_threads(threads)
    net = onnx2torch.convert(proto).eval()
    args = [torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in _onnx_inputs(proto)]

    def call():
        with torch.inference_mode():
            return net(*args)

    def outputs() -> list[np.ndarray]:
        res = call()
        res = res if isinstance(res, (tuple, list)) else [res]
        return [r.detach().numpy() for r in res]

    return System("torch", _timer(call), outputs, {"torch": torch.__version__, "converter": "onnx2torch"})


def _kernorch_system(model, feeds: dict, threads: int, outdir: Path | None, options) -> tuple[System, Any]:
    from . import emit
    from . import pipeline
    t0 = time.perf_counter()
    if outdir is not None and (outdir / "manifest.json").exists():
        compiled = emit.load(outdir, threads)
        info: dict[str, Any] = {"source": f"saved model {outdir}"}
    else:
        compiled, _run = pipeline.optimize(model, options.with_(threads=threads), runs=0)
        info = {"source": "pipeline.optimize", "stage_seconds": dict(_run.seconds)}
        if outdir is not None:
            compiled.save(outdir)
            info["saved"] = str(outdir)
    info["setup_seconds"] = time.perf_counter() - t0
    info["kernels"] = len(compiled.plan.kernels)
    info["predicted_ms"] = compiled.plan.predicted_ns / 1e6
    names = compiled.output_names
    return System("kernorch", lambda: compiled.time(feeds, runs=1, warmup=0)[0],
                  lambda: [compiled.run(feeds)[n] for n in names], info), compiled


def _cache_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernorch"))


# ------------------------------------------------------------------------------------------------
# the benchmark
# ------------------------------------------------------------------------------------------------

def _stats(times_s: Sequence[float]) -> dict:
    ms = np.asarray(times_s) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90)), "min_ms": float(ms.min()), "runs": int(ms.size)}


def bench(model, systems: Sequence[str] = SYSTEMS, threads: int = 2, runs: int = 20, budget_trials: int = 0,
          outdir=None, options=None, seed: int = 0, max_seconds_per_system: float = MAX_SECONDS_PER_SYSTEM,
          tune_dir=None, cooldown_s: float = COOLDOWN_S, rewarm: int = 1) -> dict:
    """Time `systems` on `model` (ONNX path or ModelProto), interleaved in this process; a JSON-ready dict.

    `outdir`: kernorch's saved model directory; loaded if it holds a model, else the optimized model
    is saved there. The results are also written there as bench.json (the HTML report shows them).
    `options`: kernorch `Options` (shapes for symbolic inputs, profile DB, ...); threads are overridden.
    `cooldown_s`, `rewarm`: before each timed call, sleep this long and make `rewarm` untimed calls, so
    the previous system's spinning thread pool has gone quiet and this one's is awake (see COOLDOWN_S).
    """
    os.environ["TVM_NUM_THREADS"] = str(threads)  # before TVM's first parallel call, and for tuning workers
    import onnx
    from . import __version__, executor
    from . import calibrate as cal
    from . import pipeline
    from .options import Machine, Options

    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        from .ir import KernorchError
        raise KernorchError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    options = options or Options()
    options = options.with_(threads=threads)
    outdir = Path(outdir) if outdir is not None else None
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
    proto_bytes = proto.SerializeToString()
    name = Path(str(model)).stem if not isinstance(model, onnx.ModelProto) else (proto.graph.name or "model")

    t_start = time.perf_counter()
    run = pipeline.load(proto, options)
    graph = run.graph
    feeds = executor.random_feeds(graph, seed)
    pristine = {n: v.copy() for n, v in feeds.items()}
    shapes = {n: tuple(int(d) for d in t.shape) for n, t in graph.inputs}
    from .backends import tvm as tb
    tb.set_threads(threads)  # TVM pool and BLAS threads, before anything runs

    results: dict[str, Any] = {
        "model": name, "source": str(model) if not isinstance(model, onnx.ModelProto) else name,
        "threads": threads, "runs_requested": runs, "seed": seed, "budget_trials": budget_trials,
        "timing_method": {"interleaved": "round-robin, rotated start", "warmup": WARMUP, "cooldown_s": cooldown_s,
                          "untimed_calls_before_each_timed_call": rewarm, "ort_spinning": ORT_SPINNING},
        "reference": REFERENCE, "error_tolerance": ERROR_TOL, "kernorch": __version__,
        "machine": Machine.host().to_json(), "inputs": {n: list(s) for n, s in shapes.items()},
        "env": {v: os.environ[v] for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_THREAD_TIMEOUT",
                                            "TVM_NUM_THREADS", "TVM_THREAD_POOL_SPIN_COUNT", "OMP_NUM_THREADS") if v in os.environ},
        "systems": {},
    }
    try:
        calib = cal.calibrate(threads)
        results["calibration"] = {k: calib.get(k) for k in ("peak_gflops", "bandwidth_gbs", "blas", "loaded",
                                                             "created", "fingerprint", "note") if k in calib}
        results["roofline"] = cal.roofline(graph, calib)
    except Exception as e:
        log.warning("no roofline: %s", e)
        results["roofline"] = {"error": f"{type(e).__name__}: {e}"}

    # -- build every system; failures are results, not crashes -----------------------------------
    built: dict[str, System] = {}
    wanted = list(dict.fromkeys(systems))
    ref_needed = REFERENCE not in wanted
    for s in wanted + ([REFERENCE] if ref_needed else []):
        entry: dict[str, Any] = {}
        t0 = time.perf_counter()
        try:
            if s == "ort":
                sys_ = _ort_system(s, proto_bytes, feeds, threads, "ORT_ENABLE_ALL")
            elif s == "ort-basic":
                sys_ = _ort_system(s, proto_bytes, feeds, threads, "ORT_ENABLE_BASIC")
            elif s == "tvm":
                sys_ = _tvm_system(proto, feeds, shapes, threads, budget_trials, Path(tune_dir) if tune_dir else None)
            elif s == "torch":
                sys_ = _torch_system(proto, feeds, threads)
            else:
                own = onnx.ModelProto()
                own.CopyFrom(proto)  # the optimizer gets its own copy: the others must see the file as it is
                sys_, _compiled = _kernorch_system(own, feeds, threads, outdir, options)
            built[s] = sys_
            entry.update(status="ok", **sys_.info)
        except Skip as e:
            entry.update(status="skipped", note=str(e))
            log.info("%s skipped: %s", s, e)
        except Exception as e:
            entry.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000])
            log.warning("%s failed to build: %s: %s", s, type(e).__name__, e)
        entry["setup_seconds"] = entry.get("setup_seconds", time.perf_counter() - t0)
        changed = [n for n in feeds if not np.array_equal(feeds[n], pristine[n], equal_nan=True)]
        if changed:  # a system wrote into its inputs: every later comparison would be meaningless
            log.warning("building %s modified the inputs %s; restoring them", s, changed)
            entry["modified_inputs"] = changed
            for n in changed:
                np.copyto(feeds[n], pristine[n])
        if s in wanted:
            results["systems"][s] = entry

    # -- correctness against ONNX Runtime (all optimizations) --------------------------------------
    ref = None
    if REFERENCE in built:
        try:
            ref = built[REFERENCE].outputs()
        except Exception as e:
            log.warning("reference failed: %s", e)
    if ref_needed:
        built.pop(REFERENCE, None)
    for s, sys_ in list(built.items()):
        entry = results["systems"][s]
        try:
            outs = sys_.outputs()
            if ref is not None:
                if len(outs) != len(ref):
                    raise ValueError(f"{len(outs)} outputs, ONNX Runtime gives {len(ref)}")
                errs = [executor.max_error(np.asarray(r), np.asarray(o)) for r, o in zip(ref, outs)]
                entry["max_abs_error"] = max(e["abs"] for e in errs)
                entry["max_rel_error"] = max(e["rel"] for e in errs)
                entry["matches"] = entry["max_rel_error"] <= ERROR_TOL
        except Exception as e:
            entry.update(status="failed", error=f"run: {type(e).__name__}: {e}"[:2000])
            log.warning("%s failed to run: %s", s, e)
            built.pop(s)

    # -- interleaved timing ---------------------------------------------------------------------
    for sys_ in built.values():
        for _ in range(WARMUP):
            sys_.run_once()
    results["load_before"] = load_state()
    if _busy(results["load_before"], threads):
        log.warning("the machine is busy (%s): timings will be inflated and noisy", results["load_before"])
    wall: dict[str, list[float]] = {s: [] for s in built}
    cpu: dict[str, list[float]] = {s: [] for s in built}
    active = list(built)
    for r in range(runs):
        if not active:
            break
        k = r % len(active)
        for s in active[k:] + active[:k]:
            if cooldown_s:
                time.sleep(cooldown_s)
            try:
                for _ in range(rewarm):
                    built[s].run_once()
            except Exception:
                pass  # reported by the timed call below
            c0 = time.process_time()
            try:
                wall[s].append(built[s].run_once())
            except Exception as e:
                results["systems"][s].update(status="failed", error=f"timing: {type(e).__name__}: {e}"[:2000])
                active.remove(s)
                continue
            cpu[s].append(time.process_time() - c0)
        for s in list(active):
            if sum(wall[s]) > max_seconds_per_system and len(wall[s]) >= 3:
                log.warning("%s: stopping after %d runs (%.0f s spent)", s, len(wall[s]), sum(wall[s]))
                results["systems"][s]["stopped_early"] = True
                active.remove(s)
    results["load_after"] = load_state()

    ref_ms = None
    if wall.get(REFERENCE):
        ref_ms = float(np.median(wall[REFERENCE])) * 1e3
    floor = results.get("roofline", {}).get("floor_ms")
    for s, times in wall.items():
        if not times:
            continue
        entry = results["systems"][s]
        entry.update(_stats(times))
        entry["cpu_median_ms"] = float(np.median(cpu[s])) * 1e3
        if ref_ms:
            entry["speedup_vs_ort"] = ref_ms / entry["median_ms"]
        if floor:
            entry["roofline_fraction"] = floor / entry["median_ms"]
    results["seconds"] = time.perf_counter() - t_start
    results["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if outdir is not None and outdir.exists():
        save_json(results, outdir / "bench.json")
    return results


def save_json(results: dict, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(results, indent=1, default=_jsonable))
    return p


def _jsonable(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def summary_rows(results: dict) -> list[list[str]]:
    """One row per system (for the CLI's table): status, median [p10–p90], runs, speedup, error, roofline."""
    rows = []
    for s, e in results["systems"].items():
        if "median_ms" in e:
            rows.append([s, e["status"], f"{e['median_ms']:.3f} [{e['p10_ms']:.3f}–{e['p90_ms']:.3f}]", str(e["runs"]),
                         f"{e['speedup_vs_ort']:.2f}x" if "speedup_vs_ort" in e else "-",
                         f"{e['max_rel_error']:.1e}" if "max_rel_error" in e else "-",
                         f"{e['roofline_fraction']:.0%}" if "roofline_fraction" in e else "-"])
        else:
            rows.append([s, e["status"], e.get("error") or e.get("note", ""), "0", "-", "-", "-"])
    return rows


SUMMARY_COLUMNS = ["system", "status", "median ms [p10–p90]", "runs", "speedup vs ORT", "max rel err", "of roofline"]
