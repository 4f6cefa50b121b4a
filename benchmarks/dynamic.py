"""One executable over a range of sequence lengths against per-length plans, pad-to-bucket and ONNX
Runtime.

    .venv/bin/python benchmarks/dynamic.py                       # transformer block, dim 384, seq=1..512
    .venv/bin/python benchmarks/dynamic.py --dim 64 --max-kernel-size 4 --lengths 1,7,32,128

The model (`--model`) is kernorch's transformer block (pre-norm attention + GELU MLP;
`examples.transformer_block(seq="seq")`, the default), or its GPT-2- or BERT-architecture model
(`examples.gpt_like`, `examples.bert_like`: token ids in, `--layers` layers over a `--vocab`
embedding), each exported with a symbolic sequence axis. Built with the CLI, each on a cold
profile database of its own, wall time recorded:

* dynamic: `kernorch optimize --shape seq=LO..HI` (one executable, one plan);
* dispatched: the same with `--buckets 8,64` (one executable, a plan per bucket, dispatch inside;
  `--dispatch samples`: a plan per length the range is timed at, from one measurement);
* static: `kernorch optimize --shape x=1xSx{dim}` (the token models: every input `=1xS`) for every
  length S of the list;
* pad-to-bucket: the static executables of the buckets (32, 128, 512 by default), each length
  running in the smallest bucket that holds it (the padding copy itself is not counted).

`--batch 1..8` makes the batch axis symbolic too (block, gpt_like): the dynamic executable is
optimized over both (`--shape batch=1..8 --shape seq=LO..HI`: one plan, or plans of their own
dispatched along one symbol where they run faster), timed at the pairs of `--points` (batch x seq),
against a static plan per pair and pad-to-bucket padding the seq of each pair (its batch kept); no
separate dispatching system.

Timing: at each length, every kernorch executable, ONNX Runtime (the same dynamic model, all
optimizations) and OpenVINO (f32, LATENCY hint, the dynamic model compiled once) run in processes
of their own, in turns, with the same threads (kernorch.peers.Timer), and are compared by their
medians from that one alternation. `--reuse` keeps the executables already in `--work`. Writes
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
from kernorch.peers import REPLICA, Timer, load_state, median_replicas, round_ratios  # noqa: E402

BLOCK = 3  # timed runs per system per round, at least
BLOCK_S = 0.02  # and as many as last this long for the fastest system (Timer.block_lasting)


def build_model(args):
    """The ONNX model of `args.model` with a symbolic sequence axis (and batch axis, with --batch)."""
    hidden = 4 * args.dim
    batch = {"batch": "batch"} if args.batch else {}
    if args.model == "block":
        return examples.transformer_block(seq="seq", dim=args.dim, heads=args.heads, hidden=hidden, **batch)
    build = {"gpt_like": examples.gpt_like, "bert_like": examples.bert_like}[args.model]
    return build(seq="seq", vocab=args.vocab, dim=args.dim, heads=args.heads, hidden=hidden, layers=args.layers,
                 **batch)


def feeds(args, point, rng) -> dict[str, np.ndarray]:
    """The model's inputs at `point` ((batch, length)): a random activation, or random token ids
    (positions 0..length-1 and an attention mask of ones where the model takes them)."""
    batch, length = point
    if args.model == "block":
        return {"x": rng.standard_normal((batch, length, args.dim)).astype(np.float32)}
    out = {"input_ids": rng.integers(0, args.vocab, (batch, length), dtype=np.int64)}
    if args.model == "bert_like":
        out["position_ids"] = np.arange(length, dtype=np.int64)[None]
        out["attention_mask"] = np.ones((1, length), np.float32)
    return out


def static_shapes(args, point) -> list[str]:
    """`--shape` arguments binding every input at `point` ((batch, length))."""
    return [f"{name}={'x'.join(str(d) for d in a.shape)}" for name, a in feeds(args, point, np.random.default_rng(0)).items()]


def label(args, point) -> str:
    """A point's name: its length, or batch x length with --batch."""
    return f"{point[0]}x{point[1]}" if args.batch else str(point[1])


def optimize(model: Path, out: Path, shapes: list[str], args, extra=()) -> float:
    """`kernorch optimize` on a cold database of its own; returns the wall seconds."""
    db = out.with_suffix(".sqlite")
    db.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", "import sys; from kernorch.cli import main; sys.exit(main(sys.argv[1:]))",
           "optimize", str(model), "-o", str(out), "--force", "--threads", str(args.threads), "--db", str(db),
           *(a for shape in shapes for a in ("--shape", shape)), "--max-kernel-size", str(args.max_kernel_size), *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def where_it_went(outs: list[Path]) -> dict | None:
    """Where the optimizes that wrote `outs` spent their time, from their report.json files: seconds per
    stage and, of measuring, the kernels measured and their builds' and timings' seconds, summed
    (None where a report is missing: an executable reused from an older run)."""
    reports = [out / "report.json" for out in outs]
    if not all(r.exists() for r in reports):
        return None
    stages: dict[str, float] = {}
    total = {"measured": 0, "build_s": 0.0, "time_s": 0.0}
    for r in reports:
        report = json.loads(r.read_text())
        for stage, s in report.get("seconds", {}).items():
            stages[stage] = stages.get(stage, 0.0) + s
        m = report.get("measure", {})
        total["measured"] += m.get("measured", 0)
        total["build_s"] += m.get("build_seconds", 0.0)
        total["time_s"] += m.get("time_seconds", 0.0)
    return {"stages_s": stages, **total}


def went_text(name: str, w: dict) -> str:
    """`where_it_went` as a sentence: measuring first, then the other stages of a second or more."""
    st = w["stages_s"]
    rest = ", ".join(f"{k} {v:.1f} s" for k, v in st.items() if k != "measure" and v >= 1.0)
    return (f"{name}: measure {st.get('measure', 0.0):.1f} s ({w['measured']} kernels; builds {w['build_s']:.1f} s, "
            f"timing {w['time_s']:.1f} s)" + (f", {rest}" if rest else ""))


def timed(point, systems: dict[str, tuple[Path, tuple]], model: Path, args) -> dict:
    """Every system at `point` ((batch, length)), each in `args.replicas` processes of its own, in
    turns with the same threads (kernorch.peers.Timer), each round counting its median replica
    (kernorch.peers.median_replicas): the kernorch executables of `systems` ({label: (directory,
    the point it runs at)}: a padded one runs at its bucket), ONNX Runtime and OpenVINO (the dynamic model,
    compiled once for every length; f32, LATENCY hint). Returns the medians (ms), the runs, every
    run (s, in order: `block` per round, BLOCK or as many as last BLOCK_S) and, per pair of
    systems, the median of their per-round ratios (kernorch.peers.round_ratios)."""
    rng = np.random.default_rng(point[0] * 100000 + point[1])
    at_feeds = {label: feeds(args, at, rng) for label, (_, at) in systems.items()}
    inputs = feeds(args, point, rng)
    with Timer(args.threads) as t:
        for k in range(args.replicas):  # (each system in `replicas` processes: peers.median_replicas)
            for label, (directory, _) in systems.items():
                name = f"{label}{REPLICA}{k}"
                if t.add(name, str(directory), at_feeds[label], peer="kernorch")["status"] != "ok":
                    raise SystemExit(f"{label}: {t.info[name]}")
            t.add(f"ort{REPLICA}{k}", str(model), inputs, peer="ort")
            if t.add(f"openvino{REPLICA}{k}", str(model), inputs, peer="openvino")["status"] != "ok":
                print(f"OpenVINO: {t.info[f'openvino{REPLICA}{k}']}", flush=True)
        before = load_state()
        block = t.block_lasting(BLOCK_S, BLOCK)
        times = median_replicas(t.rounds(args.rounds, block=block), block)
    paired = {f"{a}/{b}": statistics.median(r) for a in times for b in times
              if a != b and (r := round_ratios(times, a, b, block))}
    return {"ms": {n: statistics.median(v) * 1e3 for n, v in times.items() if v},
            "runs": {n: len(v) for n, v in times.items()}, "block": block, "paired": paired, "times_s": times,
            "load": before}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("block", "gpt_like", "bert_like"), default="block")
    ap.add_argument("--layers", type=int, default=4, help="gpt_like, bert_like: layers")
    ap.add_argument("--vocab", type=int, default=512, help="gpt_like, bert_like: vocabulary")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--range", default="1..512")
    ap.add_argument("--lengths", default="1,7,32,128,300,512")
    ap.add_argument("--batch", default=None, metavar="LO..HI",
                    help="a symbolic batch too (block, gpt_like): the dynamic executable over batch x seq")
    ap.add_argument("--points", default="1x1,2x7,4x32,8x128,3x300,8x512",
                    help="with --batch: the batch x seq pairs timed")
    ap.add_argument("--buckets", default="32,128,512", help="pad-to-bucket: the static lengths padded to")
    ap.add_argument("--dispatch", default="8,64",
                    help="bucket edges of the dispatching executable (kernorch optimize --buckets), or 'samples'; "
                         "'' to skip it")
    ap.add_argument("--samples", type=int, default=None,
                    help="the lengths the dynamic and dispatching executables time the range at (kernorch optimize "
                         "--samples; default its own, 4)")
    ap.add_argument("--also-samples", type=int, default=None, metavar="N",
                    help="also a one-plan executable timed at N lengths (system 'samplesN'), beside the others")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replicas", type=int, default=3,
                    help="processes per system at each length; each round counts the median one's runs")
    ap.add_argument("--max-kernel-size", type=int, default=8)
    ap.add_argument("--work", default="/tmp/kernorch-dynamic")
    ap.add_argument("--out", default=str(HERE / "results" / "dynamic"))
    ap.add_argument("--reuse", action="store_true",
                    help="keep the executables already optimized in --work (their optimize times from its builds.json)")
    args = ap.parse_args(argv)
    import onnx
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"{args.model}_dyn.onnx"
    onnx.save(build_model(args), str(model))
    if args.batch:
        if args.model == "bert_like":
            raise SystemExit("--batch: block or gpt_like")
        args.dispatch = ""
        points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    else:
        points = [(1, int(x)) for x in args.lengths.split(",")]
    buckets = [int(x) for x in args.buckets.split(",")]

    def padded(point):  # (batch, the smallest bucket that holds the length) or None
        bucket = next((b for b in sorted(buckets) if b >= point[1]), None)
        return (point[0], bucket) if bucket else None
    saved = work / "builds.json"  # optimize wall times, kept for --reuse
    builds = json.loads(saved.read_text()) if args.reuse and saved.exists() else {}
    over = ("--samples", str(args.samples)) if args.samples else ()
    ranges = ([f"batch={args.batch}"] if args.batch else []) + [f"seq={args.range}"]
    jobs = [("dynamic", ranges, over)]
    if args.dispatch:
        jobs.append(("dispatch", [f"seq={args.range}"], ("--buckets", args.dispatch, *over)))
    also = f"samples{args.also_samples}" if args.also_samples else None
    if also:
        jobs.append((also, [f"seq={args.range}"], ("--samples", str(args.also_samples))))
    statics = sorted(set(points) | {padded(p) for p in points if padded(p)}) if args.batch else \
        [(1, s) for s in sorted({p[1] for p in points} | set(buckets))]
    jobs += [(f"static{label(args, p)}", static_shapes(args, p), ()) for p in statics]
    for name, shapes, extra in jobs:
        if args.reuse and name in builds and (work / name / "model.so").exists():
            continue
        builds[name] = optimize(model, work / name, shapes, args, extra)
        saved.write_text(json.dumps(builds))
        print(f"{name}: optimized in {builds[name]:.0f} s", flush=True)
    rows = []
    for p in points:
        pad = padded(p)
        systems = {"dynamic": (work / "dynamic", p), "static": (work / f"static{label(args, p)}", p)}
        if args.dispatch:
            systems["dispatch"] = (work / "dispatch", p)
        if also:
            systems[also] = (work / also, p)
        if pad:
            systems["padded"] = (work / f"static{label(args, pad)}", pad)
        row = {"length": label(args, p) if args.batch else p[1], "bucket": pad[1] if pad else None, **timed(p, systems, model, args)}
        ms = row["ms"]
        row["best_peer"] = min((q for q in ("ort", "openvino") if q in ms), key=ms.get)
        rows.append(row)
        print(f"{'batch x seq' if args.batch else 'seq'} {row['length']}: "
              + ", ".join(f"{n} {v:.3f}" for n, v in ms.items()) + " ms", flush=True)

    def geomean(xs):
        return float(np.exp(np.mean(np.log(xs)))) if xs else None

    def ratio(r: dict, num: str, den: str) -> float:
        """`num` over `den` at one length: the median of their per-round ratios (same phase of the machine)."""
        return r["paired"][f"{num}/{den}"]

    def ratios(num: str, den: str) -> list[float]:
        return [ratio(r, num, den) for r in rows if num in r["ms"] and den in r["ms"]]
    static_sum = sum(builds[f"static{label(args, p)}"] for p in points)
    summary = {"optimize_dynamic_s": builds["dynamic"], "optimize_static_sum_s": static_sum,
               "optimize_ratio": builds["dynamic"] / static_sum}
    for name in ("dynamic", "dispatch", *([also] if also else [])):
        if not any(name in r["ms"] for r in rows):
            continue
        vs_static, vs_pad = ratios(name, "static"), ratios("padded", name)
        vs_peer = [ratio(r, name, r["best_peer"]) for r in rows if name in r["ms"]]
        summary[name] = {"vs_static_max": max(vs_static), "vs_static_geomean": geomean(vs_static),
                         "pad_over_geomean": geomean(vs_pad), "vs_best_peer_max": max(vs_peer),
                         "vs_best_peer_geomean": geomean(vs_peer)}
    went = {"dynamic": where_it_went([work / "dynamic"]),
            "static": where_it_went([work / f"static{label(args, p)}" for p in points])}
    summary["optimize_went"] = went
    meta = json.loads((work / "dynamic" / "plan.json").read_text()).get("meta", {})
    summary["dynamic_buckets"] = " ".join(filter(None, (meta.get("dispatch_on"), meta.get("buckets")))) or "one plan"
    static_peer = [ratio(r, "static", r["best_peer"]) for r in rows]
    summary["static"] = {"vs_best_peer_max": max(static_peer), "vs_best_peer_geomean": geomean(static_peer)}
    if args.dispatch:
        summary["optimize_dispatch_s"] = builds["dispatch"]
        summary["optimize_dispatch_ratio"] = builds["dispatch"] / static_sum
    if also:
        summary[f"optimize_{also}_s"] = builds[also]
    result = {"args": vars(args), "builds_s": {str(k): v for k, v in builds.items()}, "rows": rows, "summary": summary}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    names = ["dynamic", "dispatch", *([also] if also else []), "static", "padded", "ort", "openvino"]
    pairs = [("dynamic", "static"), ("dispatch", "static"), *([(also, "static")] if also else [])]
    what = "transformer block" if args.model == "block" else f"{args.model}, {args.layers} layers, vocabulary {args.vocab}"
    over_what = ", ".join(ranges)
    lines = [f"# One executable over {over_what} ({what}, dim {args.dim}, {args.threads} threads, "
             f"max kernel size {args.max_kernel_size})", "",
             f"Median ms; at each length every system runs in {args.replicas} processes of its own, all in turns, "
             "each round counting the process whose median is the replicas' median (kernorch.peers.median_replicas: "
             "a process keeps its own speed, 5-14 % apart at short lengths) "
             f"({args.rounds} rounds of "
             f"{BLOCK} runs or as many as take the fastest system {BLOCK_S * 1e3:.0f} ms: "
             f"{', '.join(str(r.get('block', BLOCK)) for r in rows)} at the lengths below). The ratios are medians of the per-round ratios (two systems compared within one round, "
             "seconds apart: kernorch.peers.round_ratios). dynamic: `kernorch optimize` over the range"
             + (f" (timed at {args.samples} lengths)" if args.samples else "")
             + f", one plan or own plans dispatched where they run faster (here: {summary['dynamic_buckets']})"
             + "; dispatch: a plan per bucket "
             f"({args.dispatch or 'none'}) chosen inside the executable; static: a plan made for that length; "
             "padded: the static plan of the smallest bucket that holds the length (the padding copy not "
             "counted); ONNX Runtime and OpenVINO run the same dynamic model."
             + (f" {also}: one plan over the range timed at {args.also_samples} lengths." if also else ""), "",
             f"| {'batch x seq' if args.batch else 'seq'} | " + " | ".join(names) + " | " + " | ".join(f"{a} / {b}" for a, b in pairs)
             + " | dynamic / best peer |",
             "|---|" + "---|" * (len(names) + len(pairs) + 1)]
    for r in rows:
        ms = r["ms"]
        cells = [f"{ms[n]:.3f}" if n in ms else "-" for n in names]
        cells[names.index("padded")] += f" ({r['bucket']})" if "padded" in ms else ""
        rel = [f"{ratio(r, a, b):.2f}x" if a in ms and b in ms else "-"
               for a, b in (*pairs, ("dynamic", r["best_peer"]))]
        lines.append(f"| {r['length']} | " + " | ".join(cells + rel) + " |")
    sm = summary
    for name in ("dynamic", "dispatch", *([also] if also else [])):
        if name in sm:
            d = sm[name]
            lines += ["", f"{name}: against the per-length static plans worst {d['vs_static_max']:.2f}x, geomean "
                      f"{d['vs_static_geomean']:.2f}x; pad-to-bucket takes {d['pad_over_geomean'] or float('nan'):.2f}x "
                      f"its time (geomean); against the best peer worst {d['vs_best_peer_max']:.2f}x, geomean "
                      f"{d['vs_best_peer_geomean']:.2f}x (> 1: slower)."]
    lines += ["", f"static plans against the best peer: worst {sm['static']['vs_best_peer_max']:.2f}x, geomean "
              f"{sm['static']['vs_best_peer_geomean']:.2f}x.", "",
              f"Optimize time: dynamic {sm['optimize_dynamic_s']:.0f} s"
              + (f", dispatch {sm['optimize_dispatch_s']:.0f} s" if "optimize_dispatch_s" in sm else "")
              + (f", {also} {sm[f'optimize_{also}_s']:.0f} s" if also else "")
              + f", the static lengths together {sm['optimize_static_sum_s']:.0f} s (dynamic / static "
              f"{sm['optimize_ratio']:.2f})."]
    if all(went.values()):
        lines += ["", "Where it went (the optimizes' reports): "
                  + "; ".join(went_text(n, w) for n, w in (("dynamic", went["dynamic"]),
                                                           ("the static lengths together", went["static"]))) + "."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
