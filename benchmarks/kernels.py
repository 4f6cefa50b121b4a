"""Kernel benchmark: every distinct contraction of each model, kernorch against ONNX Runtime.

    .venv/bin/python benchmarks/kernels.py                       # every model of ../shared/models
    .venv/bin/python benchmarks/kernels.py --models gpt2_mini --threads 1,2

For each distinct matmul/conv: kernorch's kernel (its fastest micro-kernel tile; convolutions in
their blocked layout) and ONNX Runtime's one-node operator (weights as initializers, so MLAS
prepacks them), timed in alternating blocks, each in a process of its own, at every thread count
(kernorch.kbench). Writes benchmarks/results/kernels.json and kernels.md: GFLOP/s of both, the
ratio (ORT time / kernorch time), kernorch's fraction of the measured GEMM peak, and per model the
geomean and lowest ratio. Same as `kernorch bench --kernels MODEL`, over all models.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1] / "shared" / "models"


def markdown(results: list[dict]) -> str:
    lines = ["# Contraction kernels: kernorch vs ONNX Runtime", ""]
    if results:
        m = results[0]["machine"]
        lines += [f"Machine: {m['name']}, {m['simd_bits']}-bit vectors, {m['vector_registers']} vector registers; "
                  f"each kernel alone, kernorch's and ORT's in alternating blocks in processes of their own; "
                  f"ratio = ORT time / kernorch time (> 1: kernorch faster). GFLOP/s and the fraction of the "
                  f"GEMM peak count a convolution's direct FLOPs: a Winograd variant (tile `w4t...`: F(4x4,3x3), "
                  f"`w2t...`: F(2x2,3x3)) does 4x or 2.25x fewer multiplications, so it can pass 100%.", ""]
    for r in results:
        for t in r["threads"]:
            s = r["summary"].get(str(t), {})
            lines += [f"## {Path(r['model']).stem}, {t} thread(s): geomean {s.get('geomean_ratio', float('nan')):.2f}x, "
                      f"lowest {s.get('min_ratio', float('nan')):.2f}x over {s.get('kernels', 0)} kernels"
                      + (f"; convolutions: geomean {s['conv_geomean_ratio']:.2f}x, lowest {s['conv_min_ratio']:.2f}x "
                         f"over {s['conv_kernels']}" if "conv_kernels" in s else ""), "",
                      "| kernel | n | kernorch µs | tile | kernorch GFLOP/s | ORT µs | ORT GFLOP/s | ratio | of peak |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for k in r["kernels"]:
                e = k["by_threads"][str(t)]
                if "ratio" not in e:
                    lines.append(f"| {k['kernel']} | {k['count']} | – | – | – | – | – | – | – |")
                    continue
                lines.append(f"| {k['kernel']} | {k['count']} | {e['kernorch_us']:.1f} | {e['schedule']} | "
                             f"{e['kernorch_gflops']:.0f} | {e['ort_us']:.1f} | {e['ort_gflops']:.0f} | "
                             f"{e['ratio']:.2f} | {e['of_peak']:.0%} |")
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", help="comma-separated names of ../shared/models or .onnx paths")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--db", help="kernorch profile database (default: the user's cache)")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args(argv)
    from kernorch.kbench import bench_kernels
    from kernorch.options import Options
    if args.models:
        paths = [Path(m) if m.endswith(".onnx") else SHARED / f"{m}.onnx" for m in args.models.split(",")]
    elif SHARED.is_dir():
        paths = sorted(SHARED.glob("*.onnx"))
    else:
        print(f"no models: {SHARED} does not exist; pass --models PATH.onnx")
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for p in paths:
        t0 = time.perf_counter()
        r = bench_kernels(str(p), Options(db_path=args.db), threads=tuple(int(t) for t in args.threads.split(",")))
        results.append(r)
        print(f"{p.stem}: {time.perf_counter() - t0:.0f} s, " + ", ".join(
            f"{t} thr {s['geomean_ratio']:.2f}x (lowest {s['min_ratio']:.2f}x"
            + (f"; convs {s['conv_geomean_ratio']:.2f}x, lowest {s['conv_min_ratio']:.2f}x" if "conv_kernels" in s else "")
            + ")" for t, s in r["summary"].items()))
        (out / "kernels.json").write_text(json.dumps(results, indent=1))
        (out / "kernels.md").write_text(markdown(results))
    print((out / "kernels.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
