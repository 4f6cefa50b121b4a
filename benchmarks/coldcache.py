"""Where the executable's time beyond the sum of its kernels goes: every kernel of a saved plan
timed alone as the optimizer times it (a hot loop: its weights and inputs stay in cache) and with
the CPU caches flushed of every argument but the first before each call (TVM's
`cache_flush_cpu_non_first_arg`: weights and other inputs come from memory), beside the saved
model's end-to-end median from benchmarks/results/results.json.

    .venv/bin/python benchmarks/coldcache.py --models gpt2_mini,yolox_tiny --model-dirs /tmp/bench

The model directories are those `benchmarks/run.py --model-dirs` saved (plan.json). Writes
benchmarks/results/coldcache.json and coldcache.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import resolve  # noqa: E402


def kernel_times(model, outdir: Path, threads: int, repeat: int = 20) -> list[dict]:
    from kernorch import fission, rewrite
    from kernorch.backends import tvm as tb
    from kernorch.frontend import onnx as fe
    from kernorch.layouts import kernel_io
    from kernorch.measure import KernelJob, _build_task, kernel_args, make_inputs
    tb.set_threads(threads)
    graph = fission.fission(rewrite.rewrite(fe.load(str(model))).graph)
    from kernorch.plan import Plan
    plan = Plan.load(outdir / "plan.json")
    rows, tmp = [], tempfile.mkdtemp(prefix="kernorch-cold-")
    for k in plan.kernels:
        io = kernel_io(graph, k)   # a candidate in its variant, or a layout conversion
        job = KernelJob(k.key, k.impl, k.schedule, io.graph, tuple(io.inputs), tuple(io.outputs))
        kernel = tb.load(_build_task(job, threads, tmp, False)["path"])
        args, outs = kernel._args(kernel_args(job, make_inputs(job)), None)
        timer = kernel.rt_mod.time_evaluator
        hot = timer("main", kernel.dev, number=1, repeat=repeat, min_repeat_ms=5)(*args, *outs).results
        cold = timer("main", kernel.dev, number=1, repeat=repeat,
                     f_preproc="cache_flush_cpu_non_first_arg")(*args, *outs).results
        rows.append({"kernel": k.id, "schedule": k.schedule, "plan_us": k.cost_ns / 1e3,
                     "hot_us": float(np.median(hot)) * 1e6, "cold_us": float(np.median(cold)) * 1e6,
                     "prims": [graph.by_name[m].op for m in k.members]})
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
                       "| model | kernels | sum as planned ms | sum hot ms | sum cold ms | end to end ms |",
                       "|---|---|---|---|---|---|"]
    for name, model in resolve(args.models).items():
        rows = kernel_times(model, Path(args.model_dirs) / name, args.threads)
        results[name] = {"kernels": rows, "end_to_end_ms": e2e.get(name)}
        s = {k: sum(r[k] for r in rows) / 1e3 for k in ("plan_us", "hot_us", "cold_us")}
        md.append(f"| {name} | {len(rows)} | {s['plan_us']:.3f} | {s['hot_us']:.3f} | {s['cold_us']:.3f} | "
                  f"{e2e.get(name) or float('nan'):.3f} |")
        print(md[-1], flush=True)
    (out / "coldcache.json").write_text(json.dumps(results, indent=1))
    (out / "coldcache.md").write_text("\n".join(md) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
