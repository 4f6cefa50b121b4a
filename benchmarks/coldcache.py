"""Where the executable's time beyond the sum of its kernels goes: every kernel of a saved plan
timed alone three ways: hot (a loop: weights and activations stay in cache), as the optimizer
times it (its weights flushed from the caches before each call, activations warm), and with every
argument but the first flushed (TVM's `cache_flush_cpu_non_first_arg`: weights, other inputs and
outputs come from memory), beside the saved model's end-to-end median from
benchmarks/results/results.json.

    .venv/bin/python benchmarks/coldcache.py --models gpt2_mini,yolox_tiny --model-dirs /tmp/bench

The model directories are those `benchmarks/run.py --model-dirs` saved (plan.json). Writes
benchmarks/results/coldcache.json and coldcache.md.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import resolve  # noqa: E402


def kernel_times(model, outdir: Path, threads: int, repeat: int = 20) -> list[dict]:
    from kernorch import fission, rewrite
    from kernorch.backends import tvm as tb
    from kernorch.backends.tvm.relax import kernel_module
    from kernorch.frontend import onnx as fe
    from kernorch.layouts import kernel_io
    from kernorch.measure import KernelJob, cold_args, kernel_args, make_inputs
    from kernorch.plan import Plan
    tb.set_threads(threads)
    target = tb.make_target(threads)
    graph = fission.fission(rewrite.rewrite(fe.load(str(model))).graph)
    plan = Plan.load(outdir / "plan.json")
    rows = []
    for k in plan.kernels:
        io = kernel_io(graph, k)   # a candidate in its variant, or a layout conversion
        job = KernelJob(k.key, k.impl, k.schedule, io.graph, tuple(io.inputs), tuple(io.outputs))
        kernel = tb.build(kernel_module(graph, k, target), target)  # as the emitter schedules it
        inputs = kernel_args(job, make_inputs(job))
        hot = kernel.time(*inputs, number=1, repeat=repeat, min_repeat_ms=5)
        weights = kernel.time(*inputs, repeat=repeat, cold=cold_args(job))
        args, outs = kernel._args(inputs)
        cold = kernel.rt_mod.time_evaluator("main", kernel.dev, number=1, repeat=repeat,
                                            f_preproc="cache_flush_cpu_non_first_arg")(*args, *outs).results
        rows.append({"kernel": k.id, "schedule": k.schedule, "plan_us": k.cost_ns / 1e3,
                     "hot_us": float(np.median(hot)) * 1e6, "weights_cold_us": float(np.median(weights)) * 1e6,
                     "cold_us": float(np.median(cold)) * 1e6, "prims": [graph.by_name[m].op for m in k.members]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", required=True)
    ap.add_argument("--model-dirs", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    e2e = {}
    if (out / "results.json").exists():
        for r in json.loads((out / "results.json").read_text()).get("results", []):
            e2e[r["model"]] = (r.get("systems", {}).get("kernorch") or {}).get("median_ms")
    results, md = {}, ["# Kernels alone, hot and with flushed caches, against the executable end to end", "",
                       f"{args.threads} threads; medians of 20 calls per kernel; end to end: results.json.", "",
                       "| model | kernels | sum as planned ms | sum hot ms | sum weights cold ms | sum all cold ms | end to end ms |",
                       "|---|---|---|---|---|---|---|"]
    for name, model in resolve(args.models).items():
        rows = kernel_times(model, Path(args.model_dirs) / name, args.threads)
        results[name] = {"kernels": rows, "end_to_end_ms": e2e.get(name)}
        s = {k: sum(r[k] for r in rows) / 1e3 for k in ("plan_us", "hot_us", "weights_cold_us", "cold_us")}
        md.append(f"| {name} | {len(rows)} | {s['plan_us']:.3f} | {s['hot_us']:.3f} | {s['weights_cold_us']:.3f} | "
                  f"{s['cold_us']:.3f} | "
                  f"{e2e.get(name) or float('nan'):.3f} |")
        print(md[-1], flush=True)
    (out / "coldcache.json").write_text(json.dumps(results, indent=1))
    (out / "coldcache.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
