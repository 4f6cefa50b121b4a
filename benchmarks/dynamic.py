"""One executable over a range of sequence lengths against per-length plans, pad-to-bucket and ONNX
Runtime.

    .venv/bin/python benchmarks/dynamic.py                       # transformer block, dim 384, seq=1..512
    .venv/bin/python benchmarks/dynamic.py --dim 64 --max-kernel-size 4 --lengths 1,7,32,128

The model is kernorch's transformer block (pre-norm attention + GELU MLP) exported with a symbolic
sequence axis (`examples.transformer_block(seq="seq")`). Built with the CLI, each on a cold profile
database of its own, wall time recorded:

* dynamic: `kernorch optimize --shape seq=LO..HI` (one executable, one plan);
* dispatched: the same with `--buckets 8,64` (one executable, a plan per bucket, dispatch inside);
* static: `kernorch optimize --shape x=1xSx{dim}` for every length S of the list;
* pad-to-bucket: the static executables of the buckets (32, 128, 512 by default), each length
  running in the smallest bucket that holds it (the padding copy itself is not counted).

Timing: for each length, each kernorch executable and ONNX Runtime (the same dynamic model, all
optimizations; beside the one-plan executable also OpenVINO, f32, LATENCY hint, the dynamic model
compiled once) run in processes of their own, in turns, with the same threads (kernorch.peers.Timer);
the executables are compared through their ratio to ONNX Runtime measured beside them. Writes
benchmarks/results/dynamic.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kernorch import examples  # noqa: E402
from kernorch.peers import Timer, load_state  # noqa: E402


def optimize(model: Path, out: Path, shape: str, args, extra=()) -> float:
    """`kernorch optimize` on a cold database of its own; returns the wall seconds."""
    db = out.with_suffix(".sqlite")
    db.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", "import sys; from kernorch.cli import main; sys.exit(main(sys.argv[1:]))",
           "optimize", str(model), "-o", str(out), "--force", "--threads", str(args.threads), "--db", str(db),
           "--shape", shape, "--max-kernel-size", str(args.max_kernel_size), *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def timed(executable: Path, exe_len: int, model: Path, length: int, dim: int, args, openvino: bool = False) -> dict:
    """kernorch `executable` at `exe_len` and ONNX Runtime at `length` (and OpenVINO, the dynamic model
    compiled once for every length, f32, LATENCY hint), in turns: medians (ms)."""
    rng = np.random.default_rng(length)
    with Timer(args.threads) as t:
        t.add("kernorch", str(executable), {"x": rng.standard_normal((1, exe_len, dim)).astype(np.float32)})
        feeds = {"x": rng.standard_normal((1, length, dim)).astype(np.float32)}
        t.add("ort", str(model), feeds)
        if openvino and t.add("openvino", str(model), feeds)["status"] != "ok":
            print(f"OpenVINO: {t.info['openvino']}", flush=True)
        before = load_state()
        times = t.rounds(args.rounds, block=3)
    k, o = (statistics.median(times[n]) * 1e3 for n in ("kernorch", "ort"))
    out = {"kernorch_ms": k, "ort_ms": o, "ratio_to_ort": k / o, "runs": len(times["kernorch"]), "load": before}
    if times.get("openvino"):
        out["openvino_ms"] = statistics.median(times["openvino"]) * 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--range", default="1..512")
    ap.add_argument("--lengths", default="1,7,32,128,300,512")
    ap.add_argument("--buckets", default="32,128,512", help="pad-to-bucket: the static lengths padded to")
    ap.add_argument("--dispatch", default="8,64",
                    help="bucket edges of the dispatching executable (kernorch optimize --buckets); '' to skip it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--max-kernel-size", type=int, default=8)
    ap.add_argument("--work", default="/tmp/kernorch-dynamic")
    ap.add_argument("--out", default=str(HERE / "results" / "dynamic"))
    args = ap.parse_args(argv)
    import onnx
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "block_dyn.onnx"
    onnx.save(examples.transformer_block(seq="seq", dim=args.dim, heads=args.heads, hidden=4 * args.dim), str(model))
    lengths = [int(x) for x in args.lengths.split(",")]
    buckets = [int(x) for x in args.buckets.split(",")]
    builds = {"dynamic": optimize(model, work / "dynamic", f"seq={args.range}", args)}
    print(f"dynamic: optimized in {builds['dynamic']:.0f} s", flush=True)
    if args.dispatch:
        builds["dispatch"] = optimize(model, work / "dispatch", f"seq={args.range}", args, ["--buckets", args.dispatch])
        print(f"dispatch ({args.dispatch}): optimized in {builds['dispatch']:.0f} s", flush=True)
    for s in sorted(set(lengths) | set(buckets)):
        builds[s] = optimize(model, work / f"static{s}", f"x=1x{s}x{args.dim}", args)
        print(f"static {s}: optimized in {builds[s]:.0f} s", flush=True)
    rows = []
    for s in lengths:
        bucket = next((b for b in sorted(buckets) if b >= s), None)
        row = {"length": s, "bucket": bucket,
               "dynamic": timed(work / "dynamic", s, model, s, args.dim, args, openvino=True),
               "dispatch": timed(work / "dispatch", s, model, s, args.dim, args) if args.dispatch else None,
               "static": timed(work / f"static{s}", s, model, s, args.dim, args),
               "padded": timed(work / f"static{bucket}", bucket, model, s, args.dim, args) if bucket else None}
        ov = row["dynamic"].get("openvino_ms")
        row["best_peer"] = "openvino" if ov and ov < row["dynamic"]["ort_ms"] else "ort"
        row["best_peer_to_ort"] = min(ov or float("inf"), row["dynamic"]["ort_ms"]) / row["dynamic"]["ort_ms"]
        rows.append(row)
        print(f"seq {s}: dynamic {row['dynamic']['ratio_to_ort']:.2f}x ORT, static {row['static']['ratio_to_ort']:.2f}x, "
              f"padded to {bucket} {row['padded']['ratio_to_ort'] if bucket else float('nan'):.2f}x", flush=True)
    static_sum = sum(builds[s] for s in lengths)
    vs_static = [r["dynamic"]["ratio_to_ort"] / r["static"]["ratio_to_ort"] for r in rows]
    vs_pad = [r["padded"]["ratio_to_ort"] / r["dynamic"]["ratio_to_ort"] for r in rows if r["padded"]]
    disp_static = [r["dispatch"]["ratio_to_ort"] / r["static"]["ratio_to_ort"] for r in rows if r["dispatch"]]
    disp_pad = [r["padded"]["ratio_to_ort"] / r["dispatch"]["ratio_to_ort"] for r in rows if r["dispatch"] and r["padded"]]

    def geomean(xs):
        return float(np.exp(np.mean(np.log(xs)))) if xs else None
    peer = {name: [r[name]["ratio_to_ort"] / r["best_peer_to_ort"] for r in rows if r[name]]
            for name in ("dynamic", "dispatch", "static")}
    summary = {"dynamic_vs_static_max": max(vs_static), "dynamic_vs_static_geomean": float(np.exp(np.mean(np.log(vs_static)))),
               "pad_over_dynamic_geomean": float(np.exp(np.mean(np.log(vs_pad)))) if vs_pad else None,
               "optimize_dynamic_s": builds["dynamic"], "optimize_static_sum_s": static_sum,
               "optimize_ratio": builds["dynamic"] / static_sum,
               **({"dispatch_vs_static_max": max(disp_static), "dispatch_vs_static_geomean": geomean(disp_static),
                   "pad_over_dispatch_geomean": geomean(disp_pad), "optimize_dispatch_s": builds["dispatch"],
                   "optimize_dispatch_ratio": builds["dispatch"] / static_sum} if disp_static else {}),
               **{f"{name}_vs_best_peer_max": max(v) for name, v in peer.items() if v},
               **{f"{name}_vs_best_peer_geomean": geomean(v) for name, v in peer.items() if v}}
    result = {"args": vars(args), "builds_s": {str(k): v for k, v in builds.items()}, "rows": rows, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    lines = [f"# One executable over seq={args.range} (transformer block, dim {args.dim}, {args.threads} threads, "
             f"max kernel size {args.max_kernel_size})", "",
             "Time relative to ONNX Runtime on the same dynamic model, measured beside it in turns (each system in "
             f"its own process, {args.rounds} rounds of 3 runs, medians); < 1: faster than ORT.", "",
             f"One plan over the range (dynamic) and a plan per bucket ({args.dispatch}) dispatched inside the "
             "executable (dispatched).", "",
             "| seq | dynamic / ORT | dispatched / ORT | static plan / ORT | padded to bucket / ORT | OpenVINO / ORT | "
             "ORT ms | dynamic vs static | dispatched vs static |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r, v in zip(rows, vs_static):
        ov = r["dynamic"].get("openvino_ms")
        ov = f"{ov / r['dynamic']['ort_ms']:.2f}" if ov else "-"
        pad = f"{r['padded']['ratio_to_ort']:.2f} ({r['bucket']})" if r["padded"] else "-"
        disp = (f"{r['dispatch']['ratio_to_ort']:.2f}", f"{r['dispatch']['ratio_to_ort'] / r['static']['ratio_to_ort']:.2f}x") \
            if r["dispatch"] else ("-", "-")
        lines.append(f"| {r['length']} | {r['dynamic']['ratio_to_ort']:.2f} | {disp[0]} | {r['static']['ratio_to_ort']:.2f} | "
                     f"{pad} | {ov} | {r['dynamic']['ort_ms']:.3f} | {v:.2f}x | {disp[1]} |")
    s = summary
    lines += ["", f"Dynamic vs per-length static plans: worst {s['dynamic_vs_static_max']:.2f}x, geomean "
              f"{s['dynamic_vs_static_geomean']:.2f}x; pad-to-bucket over dynamic: geomean "
              f"{s['pad_over_dynamic_geomean'] or float('nan'):.2f}x. Optimize time: dynamic {s['optimize_dynamic_s']:.0f} s, "
              f"the static lengths together {s['optimize_static_sum_s']:.0f} s (ratio {s['optimize_ratio']:.2f})."]
    lines += ["", "Against the best peer (ONNX Runtime or OpenVINO, whichever is faster at that length; > 1: slower): "
              + "; ".join(f"{name} worst {s[f'{name}_vs_best_peer_max']:.2f}x, geomean {s[f'{name}_vs_best_peer_geomean']:.2f}x"
                          for name in ("dynamic", "dispatch", "static") if f"{name}_vs_best_peer_max" in s) + "."]
    if "dispatch_vs_static_max" in s:
        lines += ["", f"Dispatched vs per-length static plans: worst {s['dispatch_vs_static_max']:.2f}x, geomean "
                  f"{s['dispatch_vs_static_geomean']:.2f}x; pad-to-bucket over dispatched: geomean "
                  f"{s['pad_over_dispatch_geomean'] or float('nan'):.2f}x. Optimize time: {s['optimize_dispatch_s']:.0f} s "
                  f"(ratio to the static lengths {s['optimize_dispatch_ratio']:.2f})."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
