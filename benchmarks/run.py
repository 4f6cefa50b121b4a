"""Benchmark kernorch against ONNX Runtime, OpenVINO, TVM (and PyTorch when it can) on the example and shared models.

    .venv/bin/python benchmarks/run.py                                  # examples + ../shared/models
    .venv/bin/python benchmarks/run.py --models candy_like,transformer_block --rounds 5
    .venv/bin/python benchmarks/run.py --models gpt2_mini --systems kernorch,ort,openvino,tvm --budget-trials 64

Writes benchmarks/results/results.json (merged by model name with what is there, so models can be
run one at a time; --fresh to start over), results.md and results.png. See benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"

log = logging.getLogger("benchmarks")


def available_models() -> dict[str, object]:
    """Name -> ONNX ModelProto (examples) or path (shared models, when the directory exists)."""
    from kernorch.examples import save_examples
    models: dict[str, object] = {p.stem: p for p in save_examples(HERE / "results" / "examples")}
    if SHARED.is_dir():
        for p in sorted(SHARED.glob("*.onnx")):
            models[p.stem] = p
    else:
        log.info("no shared models at %s: benchmarking the examples only", SHARED)
    return models


def resolve(spec: str | None) -> dict[str, object]:
    models = available_models()
    if not spec:
        return models
    out = {}
    for name in spec.split(","):
        name = name.strip()
        if name in models:
            out[name] = models[name]
        elif Path(name).exists():
            out[Path(name).stem] = Path(name)
        else:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(models)} (or give an .onnx path)")
    return out


def _cell(e: dict) -> str:
    if "median_ms" not in e:
        return e.get("status", "?")
    s = f"{e['median_ms']:.3g} [{e['p10_ms']:.3g}–{e['p90_ms']:.3g}]"
    return s


def markdown(all_results: list[dict]) -> str:
    """results.md: one row per model; latencies, speedups over ORT, roofline fractions, runs, load."""
    systems = list(dict.fromkeys(s for r in all_results for s in r["systems"]))
    lines = []
    if all_results:
        r0 = all_results[0]
        cal = r0.get("calibration", {})
        lines += ["# kernorch benchmark results", "",
                  f"Machine: {r0['machine'].get('name')}, {r0['machine'].get('cores')} cores, "
                  f"{r0['machine'].get('simd_bits')}-bit vectors; {r0['threads']} thread(s) for every system; "
                  f"GEMM peak {cal.get('peak_gflops', float('nan')):.0f} GFLOP/s (kernorch's packed micro-kernel, "
                  f"{cal.get('peak_kernel')}), {cal.get('bandwidth_gbs', float('nan')):.1f} GB/s"
                  f"{' (calibrated under load)' if cal.get('loaded') else ''}. Timings: median ms [p10–p90], each "
                  "system alone in its own process, the processes in turns (blocks of "
                  f"{r0.get('timing_method', {}).get('runs_per_turn', 3)} runs), same random inputs; "
                  "vs best peer = the median over the rounds of the best peer's time / kernorch's in that round "
                  "(kernorch.peers.round_ratios); roofline = floor / median.", ""]
    head = ["model", "floor ms"] + [f"{s} ms" for s in systems] + ["best peer", "kernorch vs best peer"] + \
           [f"{s} roofline" for s in systems] + ["runs", "CPU pressure / load", "date"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---" for _ in head) + "|")
    notes = []
    for r in all_results:
        sy = r["systems"]
        rf = r.get("roofline", {})
        lb = r.get("load_before", {})
        row = [r["model"], f"{rf['floor_ms']:.3g} ({rf['bound'][0]})" if "floor_ms" in rf else "–"]
        row += [_cell(sy.get(s, {"status": "–"})) for s in systems]
        k = sy.get("kernorch", {})
        row += [r.get("best_peer", "–"), f"{k['vs_best_peer']:.2f}x" if "vs_best_peer" in k else "–"]
        row += [f"{sy[s]['roofline_fraction']:.0%}" if "roofline_fraction" in sy.get(s, {}) else "–" for s in systems]
        row.append("/".join(str(sy[s].get("runs", 0)) for s in systems if s in sy))
        la = lb.get("loadavg") or [float("nan")]
        row.append(f"{lb.get('cpu_pressure', {}).get('avg10', '?')}% / {la[0]:.2f}")
        row.append(r.get("created", "")[:16])
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
        for s, e in sy.items():
            if e.get("status") != "ok" or (e.get("matches") is False):
                why = e.get("error") or e.get("note") or f"max rel. error {e.get('max_rel_error'):.2g} vs ORT"
                notes.append(f"- {r['model']} / {s}: {e.get('status')}: {why.splitlines()[0][:300]}")
    if notes:
        lines += ["", "Notes:", ""] + notes
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", help="comma-separated names (examples, shared models) or .onnx paths; default: all")
    ap.add_argument("--rounds", type=int, default=10, help="turns per system (--block timed runs each)")
    ap.add_argument("--block", type=int, default=3, help="timed runs per turn (after one untimed run)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-trials", type=int, default=0, help="MetaSchedule trials for TVM (0: untuned)")
    ap.add_argument("--systems", default="kernorch,ort,openvino,tvm,torch")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--model-dirs", help="keep kernorch's optimized models (and report.html) under this directory")
    ap.add_argument("--db", help="kernorch profile database (default: the user's cache)")
    ap.add_argument("--fresh", action="store_true", help="do not merge with an existing results.json")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)

    from kernorch.bench import bench
    from kernorch.options import Options
    from kernorch.report import plot_bench, write_report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rj = out / "results.json"
    previous = [] if args.fresh or not rj.exists() else json.loads(rj.read_text()).get("results", [])
    options = Options(threads=args.threads, db_path=args.db)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    done = []
    for name, model in resolve(args.models).items():
        log.info("benchmarking %s (%s)", name, ", ".join(systems))
        t0 = time.perf_counter()
        mdir = Path(args.model_dirs) / name if args.model_dirs else None
        try:
            r = bench(model, systems, threads=args.threads, rounds=args.rounds, block=args.block,
                      budget_trials=args.budget_trials, outdir=mdir, options=options)
        except Exception as e:  # one broken model must not lose the others' results
            log.error("%s: %s: %s", name, type(e).__name__, e)
            continue
        r["model"] = name
        if mdir is not None and (mdir / "manifest.json").exists():
            log.info("report: %s", write_report(mdir))
        done.append(r)
        log.info("%s done in %.0f s: %s", name, time.perf_counter() - t0,
                 ", ".join(f"{s} {e['median_ms']:.3g} ms" for s, e in r["systems"].items() if "median_ms" in e))
        merged = [p for p in previous if p.get("model") not in {d["model"] for d in done}] + done
        rj.write_text(json.dumps({"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": merged}, indent=1,
                                 default=str))
    merged = [p for p in previous if p.get("model") not in {d["model"] for d in done}] + done
    if not merged:
        log.error("no results")
        return 1
    (out / "results.md").write_text(markdown(merged))
    plot_bench(merged, out / "results.png")
    log.info("wrote %s, %s, %s", rj, out / "results.md", out / "results.png")
    print((out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
