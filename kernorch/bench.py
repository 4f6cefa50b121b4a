"""End-to-end comparison of kernorch with the systems people would otherwise use, timed honestly.

    results = bench("model.onnx", systems=("kernorch", "ort", "openvino", "tvm"), threads=2, rounds=10)
    save_json(results, "bench.json")

Every system is prepared and timed alone in its own process, the processes taking turns in blocks
of runs (kernorch.peers), on the same random inputs (`executor.random_feeds` of the fissioned
graph) with the same explicit thread count. kernorch's system is its saved executable, loaded in
its process like a user would (optimized first, in this process, when `outdir` holds none).
Reported: medians with p10/p90 and run counts, the CPU pressure and load average before and after,
each system's max error against ONNX Runtime, its speedup over ONNX Runtime and over the best
peer (medians of the per-round ratios, kernorch.peers.round_ratios), and its fraction of the
model's roofline floor (FLOPs / the measured GEMM peak).
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from . import peers

log = logging.getLogger(__name__)

SYSTEMS = tuple(peers.PEERS)
DEFAULT_AGAINST = ("ort", "ort-basic", "openvino", "tvm", "torch")
REFERENCE = "ort"
ERROR_TOL = 1e-3          # max error relative to the output scale, reported as "matches"


def _cache_dir() -> Path:
    import platformdirs
    return Path(platformdirs.user_cache_dir("kernorch"))


def bench(model, systems: Sequence[str] = ("kernorch", *DEFAULT_AGAINST), threads: int = 2, rounds: int = 10,
          block: int = 3, budget_trials: int = 0, outdir=None, options=None, seed: int = 0,
          max_seconds_per_system: float = 120.0, tune_dir=None) -> dict:
    """Time `systems` on `model` (an ONNX path), each in its own process; a JSON-ready dict.

    `outdir`: kernorch's saved model directory; loaded if it holds a model, else the optimized model
    is saved there (a temporary directory when None). The results are also written there as
    bench.json (the HTML report shows them). `options`: kernorch `Options` (shapes, profile DB, ...);
    the thread count is overridden.
    """
    import onnx
    from . import __version__, executor
    from . import calibrate as cal
    from . import pipeline
    from .ir import KernorchError
    from .options import Machine, Options

    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise KernorchError(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    options = (options or Options()).with_(threads=threads)
    path = Path(str(model))
    proto = onnx.load(str(path))
    t_start = time.perf_counter()
    # the model's work as exported (no algebraic rewrites): every system is held against the same
    # floor, and a rewrite that removes FLOPs shows as a fraction above what the floor allows
    graph = pipeline.load(proto, options.with_(rewrites=False)).graph
    if options.ranges:  # a model over a range of lengths is timed at the range's middle length
        from .dynamic import bind, middle
        graph = bind(graph, middle(options.ranges, options.lengths))
    feeds = executor.random_feeds(graph, seed)
    results: dict[str, Any] = {
        "model": path.stem, "source": str(path), "threads": threads, "seed": seed, "budget_trials": budget_trials,
        "timing_method": {"isolation": "each system alone in its own process", "rounds": rounds,
                          "runs_per_turn": block, "untimed_runs_per_turn": 1, "order": "round-robin, rotated start"},
        "reference": REFERENCE, "error_tolerance": ERROR_TOL, "kernorch": __version__,
        "machine": Machine.host().to_json(), "inputs": {n: list(t.shape) for n, t in graph.inputs}, "systems": {},
    }
    try:
        calib = cal.calibrate(threads)
        results["calibration"] = {k: calib.get(k) for k in ("peak_gflops", "peak_kernel", "bandwidth_gbs", "loaded",
                                                             "created", "fingerprint") if k in calib}
        results["roofline"] = cal.roofline(graph, calib)
    except Exception as e:  # noqa: BLE001 - the benchmark stands without a roofline
        log.warning("no roofline: %s", e)
        results["roofline"] = {"error": f"{type(e).__name__}: {e}"}

    wanted = list(dict.fromkeys(systems))
    tmp = None
    kdir = Path(outdir) if outdir is not None else None
    if "kernorch" in wanted:
        if kdir is None:
            tmp = tempfile.TemporaryDirectory(prefix="kernorch-bench-")
            kdir = Path(tmp.name) / "model"
        if not (kdir / "manifest.json").exists():
            t0 = time.perf_counter()
            compiled, _ = pipeline.optimize(str(path), options, runs=0)
            compiled.save(kdir)
            results["optimize_seconds"] = time.perf_counter() - t0
            del compiled
    extra = {"tvm": {"budget_trials": budget_trials,
                     "tune_dir": str((Path(tune_dir) if tune_dir else _cache_dir() / "tvm-tune") /
                                     f"{hashlib.sha1(proto.SerializeToString()).hexdigest()[:12]}-t{threads}-n{budget_trials}")}}
    try:
        with peers.Timer(threads) as timer:
            for s in wanted + ([REFERENCE] if REFERENCE not in wanted else []):
                source = str(kdir) if s == "kernorch" else str(path)
                info = timer.add(s, source, feeds, **extra.get(s, {}))
                log.info("%s: %s", s, info.get("status"))
            _check_outputs(timer, results, wanted)
            results["load_before"] = peers.load_state()
            if peers.busy(results["load_before"]):
                log.warning("the machine is busy (%s): timings will be inflated and noisy", results["load_before"])
            times = timer.rounds(rounds, block, max_seconds=max_seconds_per_system)
            results["load_after"] = peers.load_state()
            for s in wanted:
                results["systems"][s] = dict(timer.info[s])
    finally:
        if tmp is not None:
            tmp.cleanup()
    _summarize(results, times, wanted, block)
    results["seconds"] = time.perf_counter() - t_start
    results["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if outdir is not None and Path(outdir).exists():
        save_json(results, Path(outdir) / "bench.json")
    return results


def _check_outputs(timer, results: dict, wanted: Sequence[str]) -> None:
    """Each system's outputs against ONNX Runtime's (a system that cannot run is dropped)."""
    from . import executor
    ref = None
    if REFERENCE in timer.systems:
        try:
            ref = timer.outputs(REFERENCE)
        except Exception as e:  # noqa: BLE001
            log.warning("reference failed: %s", e)
    for s in list(timer.systems):
        entry = timer.info[s]
        try:
            outs = timer.outputs(s)
            if ref is not None:
                if len(outs) != len(ref):
                    raise ValueError(f"{len(outs)} outputs, ONNX Runtime gives {len(ref)}")
                errs = [executor.max_error(np.asarray(r), np.asarray(o)) for r, o in zip(ref, outs)]
                entry["max_abs_error"] = max(e["abs"] for e in errs)
                entry["max_rel_error"] = max(e["rel"] for e in errs)
                entry["matches"] = entry["max_rel_error"] <= ERROR_TOL
        except Exception as e:  # noqa: BLE001 - reported, never stops the others
            entry.update(status="failed", error=f"run: {type(e).__name__}: {e}"[:2000])
    if REFERENCE not in wanted:
        timer.info[REFERENCE]["status"] = "reference only"


def _summarize(results: dict, times: dict[str, list[float]], wanted: Sequence[str], block: int) -> None:
    """Per system its timing stats; its speedups over ONNX Runtime and over the best peer (the
    peer of least median) as the median of their per-round ratios (`peers.paired_ratio`: two
    systems compared within one round, in the same phase of the machine); its roofline fraction."""
    med = {s: float(np.median(t)) * 1e3 for s, t in times.items() if t}
    floor = results.get("roofline", {}).get("floor_ms")
    ref_ms = med.get(REFERENCE)
    best_peer = min((s for s in wanted if s != "kernorch" and s in med), key=med.get, default=None)
    for s in wanted:
        entry = results["systems"][s]
        if s not in med:
            continue
        entry.update(peers.stats(times[s]))
        if ref_ms:
            entry["speedup_vs_ort"] = peers.paired_ratio(times, REFERENCE, s, block)
        if best_peer:
            entry["vs_best_peer"] = peers.paired_ratio(times, best_peer, s, block)
        if floor:
            entry["roofline_fraction"] = floor / entry["median_ms"]
    if best_peer:
        results["best_peer"] = best_peer


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
    """One row per system (for the CLI's table): status, median [p10–p90], runs, speedups, error, roofline."""
    rows = []
    for s, e in results["systems"].items():
        if "median_ms" in e:
            rows.append([s, e["status"], f"{e['median_ms']:.3f} [{e['p10_ms']:.3f}–{e['p90_ms']:.3f}]", str(e["runs"]),
                         f"{e['speedup_vs_ort']:.2f}x" if "speedup_vs_ort" in e else "-",
                         f"{e['vs_best_peer']:.2f}x" if "vs_best_peer" in e else "-",
                         f"{e['max_rel_error']:.1e}" if "max_rel_error" in e else "-",
                         f"{e['roofline_fraction']:.0%}" if "roofline_fraction" in e else "-"])
        else:
            rows.append([s, e["status"], e.get("error") or e.get("note", ""), "0", "-", "-", "-", "-"])
    return rows


SUMMARY_COLUMNS = ["system", "status", "median ms [p10–p90]", "runs", "vs ORT", "vs best peer", "max rel err",
                   "of roofline"]
