"""The CLI's commands: each calls the Python API and prints a table (rich) or JSON."""
from __future__ import annotations

import json
from pathlib import Path

from . import masks, pipeline, primitives
from .database import ProfileDB
from .dynamic import plan_buckets
from .ir import KernorchError
from .options import Machine, Options
from .rewrite import summary as rewrite_summary

# max error relative to the output's scale (max |reference|) accepted as "matches ONNX Runtime"
VERIFY_TOL = 1e-4


def _console():
    from rich.console import Console
    return Console()


def _table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.table import Table
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c not in (columns[0],) else "left")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    _console().print(t)


def _emit_json(obj) -> None:
    print(json.dumps(obj, indent=2, default=str))


# ---------------------------------------------------------------------------------------------

def inspect_report(model, options: Options, verify: bool = False) -> dict:
    clock = pipeline.Clock()
    run = pipeline.load(model, options, clock)
    g = run.graph
    kinds: dict[str, int] = {}
    for p in g.prims:
        k = primitives.kind(p.op)
        kinds[k] = kinds.get(k, 0) + 1
    out = {
        "model": run.source,
        "opset": run.onnx.opset,
        "inputs": {n: str(t) for n, t in run.onnx.inputs},
        "outputs": list(run.onnx.outputs),
        "onnx_nodes_in_file": run.onnx.n_nodes_in_file,
        "onnx_nodes_after_folding": len(run.onnx.nodes),   # and after the algebraic rewrites
        **({"rewrites": run.rewrites.to_json()} if run.rewrites else {}),
        "onnx_ops": run.onnx.histogram(),
        "primitives": len(g.prims),
        "primitive_ops": g.histogram(),
        "primitive_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "weights": len(g.constants),
        "causal_masks": masks.marked(g),  # adds of a causal mask: their attention skips the masked keys
        "seconds": {k: round(v, 3) for k, v in clock.seconds.items()},
    }
    if verify:
        from .executor import compare_with_ort
        errs = compare_with_ort(model, g, options.shape_dict, seed=options.seed, threads=options.threads)
        out["verify"] = {"ok": all(e["rel"] <= VERIFY_TOL for e in errs.values()), "tolerance": VERIFY_TOL,
                         "outputs": errs}
    return out


def cmd_inspect(args, options: Options) -> int:
    rep = inspect_report(args.model, options, args.verify)
    if args.json:
        _emit_json(rep)
    else:
        c = _console()
        c.print(f"[bold]{rep['model']}[/] opset {rep['opset']}: {rep['onnx_nodes_in_file']} ONNX nodes "
                f"({rep['onnx_nodes_after_folding']} after constant folding) → {rep['primitives']} primitives")
        if "rewrites" in rep:
            c.print(f"rewrites: {rewrite_summary(rep['rewrites'])}")
        if rep["causal_masks"]:
            c.print(f"causal masks added at {', '.join(rep['causal_masks'])}: their attention skips the masked keys")
        _table("ONNX operators", ["op", "count"], [[k, v] for k, v in rep["onnx_ops"].items()])
        _table("Primitive kinds", ["kind", "count"], [[k, v] for k, v in rep["primitive_kinds"].items()])
        _table("Primitives", ["op", "count"], [[k, v] for k, v in rep["primitive_ops"].items()])
    if args.verify:
        v = rep["verify"]
        ok = v["ok"]
        if not args.json:
            rows = [[name, f"{e['abs']:.3g}", f"{e['rel']:.3g}"] for name, e in v["outputs"].items()]
            _table("Reference executor vs ONNX Runtime", ["output", "max abs error", "max error / scale"], rows)
            print("verify: " + ("OK" if ok else "MISMATCH"))
        return 0 if ok else 1
    return 0


def cmd_db(args, options: Options) -> int:
    with ProfileDB(options.resolved_db()) as db:
        if args.action == "stats":
            s = db.stats()
            if args.json:
                _emit_json(s)
            else:
                print(f"{s['path']}: {s['measurements']} measurements, {s['size_bytes'] / 1e6:.2f} MB; the last "
                      f"estimates of {s['runs_kept']} runs, {s['block_solutions']} proven block solutions, "
                      f"{s['executable_comparisons']} timings of executables in turns")
                _table("Measurements", ["target", "impl", "status", "rows", "distinct keys"],
                       [[g["target"], g["impl"], g["status"], g["rows"], g["distinct_keys"]] for g in s["groups"]])
        elif args.action == "export":
            _emit_json(db.export())
        else:
            n = db.clear(refused_only=args.refused)
            print(f"cleared {n} {'refusals' if args.refused else 'measurements'} from {db.path}")
    return 0


def _with_db(options: Options):
    return ProfileDB(options.resolved_db())


def candidates_report(planned) -> dict:
    en, ms = planned.enumeration, planned.measured.measurements
    key_part = {}
    for c in en.candidates:
        key_part.setdefault(c.key, c.partition)
    parts = []
    for st in en.stats:
        keys = {c.key for c in en.candidates if c.partition == st.index}
        mine = [m for (k, impl, sch), m in ms.items() if key_part.get(k) == st.index]
        refused: dict[str, int] = {}
        for m in mine:
            if not m.ok:
                reason = m.reason.split(":")[0]
                refused[reason] = refused.get(reason, 0) + 1
        parts.append({"partition": st.index, "primitives": st.prims, "candidates": st.candidates,
                      "distinct_keys": len(keys), "rejected": st.rejected, "cap_hit": st.cap_hit,
                      "measured": sum(1 for m in mine if m.ok), "refused": refused,
                      "enumerate_s": round(st.seconds, 3)})
    s = planned.measured.stats
    return {"model": planned.loaded.source, "primitives": len(planned.loaded.graph.prims), "partitions": parts,
            "candidates": len(en.candidates), "distinct_keys": len({c.key for c in en.candidates}),
            "jobs": s.jobs, "from_database": s.cached, "measured": s.measured, "refused": s.refused,
            "estimated": len(planned.measured.pending),
            "remeasured": s.remeasured, "measure_seconds": round(s.seconds, 2),
            "seconds": {k: round(v, 2) for k, v in planned.seconds.items()},
            "tiles": tile_report(planned), "untuned_vs_default": untuned_speedups(ms)}


def tile_report(planned) -> list[dict]:
    """Per contraction with micro-kernel tiles: each tile's time and the one kept."""
    g, ms = planned.loaded.graph, planned.measured.measurements
    out = []
    for prim, best in planned.measured.tiles.items():
        p = g.by_name[prim]
        times = {sch: m.median_ns / 1e3 for (k, impl, sch), m in ms.items()
                 if m.ok and impl == "tvm" and sch.startswith("t") and k == _singleton_key(planned, prim)}
        # over a range (kernorch.dynamic) the time is a weighted one: no single FLOP count goes with it
        flops = 2.0 * p.type.size * g.type_of(p.inputs[0]).shape[-1] if g.type_of(p.inputs[0]).static and p.type.static else None
        out.append({"prim": prim, "shape": f"{'x'.join(map(str, g.type_of(p.inputs[0]).shape))} @ "
                                          f"{'x'.join(map(str, g.type_of(p.inputs[1]).shape))}",
                    "tiles_us": times, "kept": best,
                    "gflops": flops / (times[best] * 1e3) if flops and best in times else None})
    return out


def _singleton_key(planned, prim: str) -> str | None:
    return next((c.key for c in planned.enumeration.candidates if c.members == (prim,)), None)


def untuned_speedups(measurements) -> list[dict]:
    """Kernels measured both untuned and scheduled by kernorch: the schedule's speedup."""
    out = []
    best = pipeline.best_costs(measurements)
    for (key, impl, sch), m in measurements.items():
        if sch != "none" or not m.ok:
            continue
        d = best.get((key, "tvm"))
        if d is not None:
            out.append({"kernel": m.description, "untuned_us": m.median_ns / 1e3, "scheduled_us": d.median_ns / 1e3,
                        "schedule": d.schedule, "speedup": m.median_ns / d.median_ns})
    return out


def cmd_candidates(args, options: Options) -> int:
    with _with_db(options) as db:
        machine = Machine.host()
        clock = pipeline.Clock()
        loaded = pipeline.load(args.model, options, clock)
        options = pipeline.model_options(loaded.graph, options, machine, loaded.source)
        with clock("enumerate"):
            en = pipeline.enumerate_candidates(loaded.graph, options)
        with clock("measure"):
            measured = pipeline.measure_candidates(loaded.graph, en, db, options, machine)
    rep = candidates_report(pipeline.Planned(loaded, en, measured, None, None, clock.seconds, machine))
    if args.json:
        _emit_json(rep)
        return 0
    _table(f"Candidates of {rep['model']} ({rep['primitives']} primitives)",
           ["partition", "prims", "candidates", "keys", "measured", "refused", "rejected (legality)", "enum s"],
           [[p["partition"], p["primitives"], p["candidates"], p["distinct_keys"], p["measured"],
             ", ".join(f"{k}: {v}" for k, v in p["refused"].items()) or "-",
             ", ".join(f"{k}: {v}" for k, v in p["rejected"].items()) or "-", p["enumerate_s"]]
            for p in rep["partitions"]])
    if rep["tiles"]:
        _table("Micro-kernel tiles (each contraction alone; the fastest is used by its fused kernels)",
               ["contraction", "tiles µs", "kept", "GFLOP/s"],
               [[t["shape"], ", ".join(f"{k} {v:.1f}" for k, v in sorted(t["tiles_us"].items(), key=lambda kv: kv[1])),
                 t["kept"], f"{t['gflops']:.0f}" if t["gflops"] else "-"] for t in rep["tiles"]])
    print(f"{rep['candidates']} candidates, {rep['distinct_keys']} distinct keys; {rep['jobs']} measurements needed: "
          f"{rep['from_database']} from the database, {rep['measured']} measured, {rep['estimated']} fused kernels "
          "left to the solver's estimates (measured when it wants them)"
          + (f" ({rep['remeasured']} of them again)" if rep.get("remeasured") else "")
          + f", {rep['refused']} refused, in {rep['measure_seconds']} s")
    sp = rep["untuned_vs_default"]
    if sp:
        import numpy as np
        print(f"kernorch's schedules vs untuned TVM on {len(sp)} kernels: geomean speedup "
              f"{float(np.exp(np.mean(np.log([x['speedup'] for x in sp])))):.1f}x")
    return 0


def describe_kernel(graph, k) -> str:
    """The kernel's primitives, or for a layout conversion what it converts."""
    if not k.members:
        what = "plain -> blocked" if k.schedule.endswith("/block") else "blocked -> plain"
        return f"layout of {k.outputs[0]}: {what}"
    return "+".join(graph.by_name[m].op for m in k.members)


def _print_plan(planned) -> None:
    plan, g = planned.plan, planned.loaded.graph
    rows = []
    buckets = plan_buckets(plan.meta)
    for i, k in enumerate(plan.kernels):
        rows.append([i, *([f"{buckets[k.bucket][0]}..{buckets[k.bucket][1]}"] if buckets else []),
                     describe_kernel(g, k)[:60], k.impl, k.schedule, f"{k.cost_ns / 1e3:.1f}", len(k.outputs)])
    _table(f"Plan for {planned.loaded.source}", ["#", *(["bucket"] if buckets else []), "primitives", "impl", "schedule",
                                                 "cost µs", "outputs"], rows)
    for b, ((lo, hi), w) in enumerate(zip(buckets, plan.weights)):
        part = plan.bucket(b)
        print(f"bucket {lo}..{hi} (weight {w:.2f}): {len(part.kernels)} kernels, predicted {part.predicted_ns / 1e6:.3f} ms")
    if planned.loaded.rewrites is not None:
        print(f"rewrites: {rewrite_summary(planned.loaded.rewrites.to_json())}")
    n_conv = sum(1 for k in plan.kernels if not k.members)
    n_blocked = sum(1 for k in plan.kernels if k.members and k.schedule.startswith("b"))
    if n_conv or n_blocked:
        print(f"layouts: {n_blocked} kernels in a blocked layout, {n_conv} layout conversions")
    st = plan.stats
    print(f"solver: {st.status}, objective {st.objective_ns / 1e6:.3f} ms, bound {st.bound_ns / 1e6:.3f} ms, "
          f"gap {0 if st.gap is None else st.gap:.2%}, {st.solve_seconds:.2f} s, {st.n_cuts} cycle cuts")
    print(f"predicted: optimal {plan.predicted_ns / 1e6:.3f} ms ({len(plan.kernels)} kernels)"
          + (f", greedy fusion {plan.greedy_ns / 1e6:.3f} ms" if plan.greedy_ns else "")
          + (f", unfused {plan.unfused_ns / 1e6:.3f} ms" if plan.unfused_ns else ""))


def cmd_plan(args, options: Options) -> int:
    planned = pipeline.plan_model(args.model, options)
    if args.output:
        planned.plan.save(args.output)
    if args.json:
        _emit_json(planned.plan.to_json())
    else:
        _print_plan(planned)
        if args.output:
            print(f"plan written to {args.output}")
    return 0


def _print_optimize(rep: dict, outdir) -> None:
    t = rep.get("timing", {})
    rows = []
    if t:
        rows.append(["kernorch", f"{t['kernorch_ms']:.3f}", f"{t['speedup']:.2f}x"])
        rows.append(["ONNX Runtime (all optimizations), own process", f"{t['ort_ms']:.3f}", "1.00x"])
    _table(f"{rep['model']}: medians of {t.get('runs', 0)} runs, {rep['threads']} threads, in turns",
           ["system", "latency ms", "speedup vs ORT"], rows)
    plan = rep["plan"]
    ctx = rep.get("context") or {}
    ranges = plan.get("meta", {}).get("ranges")
    buckets = plan.get("meta", {}).get("buckets")
    samples = plan.get("meta", {}).get("samples")
    basis = (f"the kernels' times measured alone, weighted over {ranges}"
             + (f" at {samples} (each length relative to the model's floor there)" if samples else "")
             + (f" in buckets {buckets}, one plan each, dispatched at run time" if buckets else "")
             + "; timing below at the middle length" if ranges else "sum of the kernels measured alone")
    boundary = int(plan.get("meta", {}).get("boundary_ns", 0))
    basis += f", each plus a kernel boundary of {boundary / 1e3:.2f} us" if boundary else ""
    print(f"predicted {rep['predicted_ms']:.3f} ms ({basis}); inside the executable "
          f"the kernels take {ctx.get('in_model_ms', float('nan')):.3f} ms, end to end "
          f"{t.get('kernorch_ms', float('nan')):.3f} ms; "
          f"{len(plan['kernels'])} kernels chosen"
          + (f" ({len(buckets.split(','))} buckets)" if buckets else "")
          + f" from {rep['candidates']} candidates ({rep['distinct_keys']} distinct)")
    by_sched: dict[str, int] = {}
    for k in plan["kernels"]:
        layout, _, inner = k["schedule"].rpartition("/")
        kind = ("micro-kernel tile" if inner.startswith("t") else "layout conversion" if not k["members"]
                else "tuned" if k["impl"] == "tvm-tuned" else "rules")
        name = f"{kind}{' (blocked)' if layout and k['members'] else ''}"
        by_sched[name] = by_sched.get(name, 0) + 1
    print("kernels: " + ", ".join(f"{v} {k}" for k, v in sorted(by_sched.items())))
    m = rep.get("measure") or {}
    if m:
        print(f"measurements: {m.get('measured', 0)} taken, {m.get('cached', 0)} from the database, "
              f"{m.get('refused', 0)} refused; {m.get('estimated', 0)} fused candidates never measured (the solver "
              f"did not want them on an optimistic estimate; {m.get('rounds', 0)} solve-and-measure rounds)"
              + (f"; builds {m['build_seconds']:.1f} s, timing {m['time_seconds']:.1f} s of the measuring"
                 if m.get("build_seconds") is not None else ""))
    checked = _checked_in_executable(rep)
    if checked:
        print(checked)
    print(f"max error vs ONNX Runtime: {rep['verify']['max_rel_error']:.2e} of the output scale")
    print("time per stage: " + ", ".join(f"{k} {v:.1f}s" for k, v in rep["seconds"].items()))
    print(f"saved to {outdir}")


def _checked_in_executable(rep: dict) -> str | None:
    """Over a range, what the run decided by timing executables in turns (each time over the other's):
    the sample lengths' own plans against the one plan (`executed.measured_dispatch`, or its screen),
    the plan's packed rows-outside kernels turned against the plan (`executed.measured_loop_order`),
    and the last bucket's packed GEMMs re-tiled against the plan (`executed.measured_long_tiles`)."""
    parts = []
    if rep.get("dispatch"):
        parts.append("own plans / the one plan " + ", ".join(f"at {n} {r:.3f}" for n, r in rep["dispatch"].items()))
    if rep.get("loop_order"):
        turned = rep["plan"].get("meta", {}).get("columns_outside")
        ratios = ", ".join(f"{k} {r:.3f}" for k, r in rep["loop_order"].items())
        kept = f" (kept: {turned})" if turned else " (none kept)"
        parts.append(f"rows-outside kernels turned / the plan {ratios}{kept}")
    if rep.get("long_tiles"):
        retiled = rep["plan"].get("meta", {}).get("long_tiles")
        ratios = ", ".join(f"{k} {r:.3f}" for k, r in rep["long_tiles"].items())
        kept = f"kept: {retiled}" if retiled else "not kept"
        parts.append(f"the last bucket's GEMMs re-tiled / the plan {ratios} ({kept})")
    return "timed in the executable: " + "; ".join(parts) if parts else None


def cmd_optimize(args, options: Options) -> int:
    from .runtime import check_writable
    out = Path(args.output)
    check_writable(out, args.force)  # before minutes of work, not after
    compiled, _ = pipeline.optimize(args.model, options, runs=args.runs)
    compiled.save(out, force=args.force)
    from .report import write_report
    write_report(out)
    if args.json:
        _emit_json(compiled.report)
    else:
        _print_optimize(compiled.report, out)
    return 0


def cmd_run(args, options: Options) -> int:
    import numpy as np
    from .runtime import load
    m = load(args.outdir, options.threads if args.threads else None)
    feeds = {}
    for spec in args.input:
        name, _, path = spec.rpartition("=")
        if not name:
            if len(m.input_names) != 1 or feeds:
                raise KernorchError(f"the model has inputs {m.input_names}: give --input NAME=FILE.npy")
            name = m.input_names[0]
        try:
            feeds[name] = np.load(path)
        except OSError as e:
            raise KernorchError(f"cannot read input {path}: {e}") from None
    outs = m.run(feeds)
    if args.output:
        np.savez(args.output, **outs)
    for n, v in outs.items():
        print(f"{n}: {v.dtype}{list(v.shape)} mean {float(v.mean()):.6g} max|x| {float(np.abs(v).max()):.6g}")
    return 0


def cmd_demo(args, options: Options) -> int:
    import tempfile
    import onnx
    from . import examples
    from .bench import SUMMARY_COLUMNS, bench, summary_rows
    if args.example not in examples.EXAMPLES:
        raise KernorchError(f"unknown example {args.example!r}; choose from {sorted(examples.EXAMPLES)}")
    work = Path(tempfile.mkdtemp(prefix="kernorch-demo-"))
    model = work / f"{args.example}.onnx"
    onnx.save(examples.EXAMPLES[args.example](), str(model))
    print(f"optimizing the bundled example {args.example} ({model})")
    compiled, _ = pipeline.optimize(str(model), options, runs=0)
    compiled.save(work / "out", force=True)
    del compiled
    print("timing kernorch, ONNX Runtime and OpenVINO, each alone in its own process, in turns")
    r = bench(str(model), ("kernorch", "ort", "openvino"), threads=options.threads, rounds=args.rounds,
              outdir=work / "out", options=options)
    from .report import write_report
    print(f"report: {write_report(work / 'out')}")
    _table(f"{r['model']}, {r['threads']} threads", SUMMARY_COLUMNS, summary_rows(r))
    k = r["systems"].get("kernorch", {})
    if r.get("best_peer") and "vs_best_peer" in k:
        verdict = "faster than" if k["vs_best_peer"] > 1 else "slower than"
        print(f"kernorch is {k['vs_best_peer']:.2f}x the best peer ({r['best_peer']}): {verdict} it, "
              f"medians of {k['runs']} runs each")
    return 0


def cmd_bench(args, options: Options) -> int:
    if args.kernels:
        from .kbench import bench_kernels, print_kernels
        r = bench_kernels(args.model, options, threads=tuple(int(t) for t in args.kernel_threads.split(",")))
        if args.json:
            _emit_json(r)
        else:
            print_kernels(r)
        return 0
    from .bench import SUMMARY_COLUMNS, bench, summary_rows
    r = bench(args.model, ("kernorch", *[s for s in args.against.split(",") if s]), threads=options.threads,
              rounds=args.rounds, budget_trials=args.budget_trials, outdir=args.output, options=options)
    if args.json:
        _emit_json(r)
    else:
        _table(f"{r['model']}, {r['threads']} threads", SUMMARY_COLUMNS, summary_rows(r))
    return 0


def cmd_report(args, options: Options) -> int:
    from .report import write_report
    print(write_report(args.outdir))
    return 0
