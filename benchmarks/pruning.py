"""Pruned measurement, replayed: how many fused kernels each estimator makes the optimizer measure,
and how good the plan it ends with is, with the profile database answering every measurement.

    .venv/bin/python benchmarks/pruning.py --models gpt2_mini,candy
    .venv/bin/python benchmarks/pruning.py --models candy --confidence 1.0,2.0

For a model whose candidates the database already holds (a previous unpruned or pruned run on this
machine), `pipeline.plan_model` runs three times: measuring everything, pruning with the analytic
bound (`cost_model="analytic"`) and pruning with the learned model (`"learned"`; `learned-members`:
the same, its rounds filled up against the members alone as before `pipeline.FILL_AGAINST_PLAN`;
`--estimators` picks the runs). Nothing is timed:
`measure` answers from the database (what a cold run would have measured), and the database is
made to look empty of fused kernels, so pruning starts as on a cold database. The learned model is
fitted on the *other* models' rows (leave one model out), as for a model it has never seen.

Reported: fused kernels measured, solve-and-measure rounds, the plan's predicted latency (the sum
of its measured kernels) against the plan of the unpruned run, and the replay's own seconds (its
solves, which a cold run pays as well, on top of its measurements). Writes
benchmarks/results/pruning.json and .md.

One model file at given shapes (over a range as well), with the shipped model as a user gets it:

    .venv/bin/python benchmarks/pruning.py --model-file block_dyn.onnx --shape seq=1..512 --db all.sqlite \
        --estimators all,learned --confidence 1.0,0.5 --max-kernel-size 8

Here each run also reports the builders' seconds stored with the kernels it measured (what its
builds cost when the database was filled: a cold run's builds, without their timing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from unittest import mock

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import costmodel as cmbench  # noqa: E402  (benchmarks/costmodel.py: the rows of a model)
from kernorch import costmodel as cm  # noqa: E402
from kernorch import measure as meas  # noqa: E402
from kernorch import pipeline as pl  # noqa: E402
from kernorch.calibrate import calibrate  # noqa: E402
from kernorch.cli import options_from  # noqa: E402
from kernorch.database import Measurement, ProfileDB  # noqa: E402
from kernorch.options import Machine, Options  # noqa: E402

TRAIN = "transformer_block,candy_like,gpt2_mini,yolox_tiny,candy"


def replay(path: Path, options: Options, machine: Machine, db: ProfileDB, kernel_s: float = 1.0) -> tuple:
    """plan_model with the database as the oracle; returns (planned, fused kernels measured, all
    measured, the builders' seconds stored with them)."""
    real_stored = meas.stored
    counts = {"all": 0, "fused": 0, "build_s": 0.0}

    def stored(jobs, _db, opts, mach):
        jobs = list(jobs)
        got = real_stored(jobs, db, opts, mach)
        deferred = {j.ident for j in jobs if pl._deferrable(j)}
        return {i: m for i, m in got.items() if i not in deferred}

    def measure(jobs, _db, opts, mach=None, label="", workers=None):
        jobs = list(jobs)
        got = real_stored(jobs, db, opts, machine)
        out = {j.ident: got.get(j.ident) or Measurement("", j.key, j.impl, j.schedule, "", "refused", None, (),
                                                        "not in the database") for j in jobs}
        counts["all"] += len(jobs)
        counts["fused"] += sum(pl._deferrable(j) for j in jobs)
        counts["build_s"] += sum(m.build_s or 0.0 for m in out.values())
        return out, meas.MeasureStats(jobs=len(jobs), measured=len(jobs), seconds=kernel_s * len(jobs))

    with mock.patch.object(meas, "stored", stored), mock.patch.object(meas, "measure", measure):
        planned = pl.plan_model(str(path), options, db=db, machine=machine)
    return planned, counts["fused"], counts["all"], counts["build_s"]


def shape_options(shapes) -> dict:
    """Options' `ranges` and `shapes` from optimize-style --shape arguments, parsed and checked as
    optimize does (kernorch.cli.options_from)."""
    o = options_from(argparse.Namespace(shape=list(shapes), threads=None, db=None))
    return {"ranges": o.ranges, "shapes": o.shapes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="transformer_block,gpt2_mini,candy")
    ap.add_argument("--train", default=TRAIN, help="models whose rows the learned model may use (minus the one replayed)")
    ap.add_argument("--confidence", default=str(pl.CONFIDENCE), help="comma-separated values of pipeline.CONFIDENCE")
    ap.add_argument("--estimators", default="all,analytic,learned",
                    help="which runs: all (the reference, always first), analytic, learned (once per confidence), "
                         "learned-members (learned, its rounds filled against the members alone, not the last plan)")
    ap.add_argument("--kernel-seconds", type=float, default=0.3,
                    help="what a measurement is taken to cost (a round's fill-up is one solve's time of them)")
    ap.add_argument("--shipped", action="store_true",
                    help="use the shipped learned model as it is (instead of one fitted without the replayed model)")
    ap.add_argument("--depth", type=int, default=None,
                    help="the learned model's trees this deep (default: the shipped model's, cost model PARAMS)")
    ap.add_argument("--rounds", type=int, default=None, help="the learned model's trees: this many")
    ap.add_argument("--stored-rows", default=None,
                    help="the learned model also trains on the rows other machines stored in this directory "
                         "(benchmarks/costmodel.py's --rows-dir), never the replayed model's")
    ap.add_argument("--model-file", default=None,
                    help="replay this ONNX file instead of --models, with the shipped model (no training rows)")
    ap.add_argument("--shape", action="append", default=[],
                    help="with --model-file: as optimize's --shape (seq=1..512 over a range, x=1x7x384 static)")
    ap.add_argument("--max-kernel-size", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--db", default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "pruning"))
    args = ap.parse_args(argv)
    options = Options(threads=args.threads, db_path=args.db, **shape_options(args.shape))
    if args.max_kernel_size:
        options = options.with_(max_kernel_size=args.max_kernel_size)
    machine = Machine.host()
    calibration = calibrate(args.threads)
    results = []
    shipped = cm.shipped()
    sigma = shipped.sigma if shipped else 0.7
    stored = []
    if args.stored_rows:
        mine = cmbench.rows_file(Path(args.stored_rows), machine, args.threads)
        stored = [r for _, rs in cmbench.other_machines(Path(args.stored_rows), mine, machine).values() for r in rs]
    with ProfileDB(options.resolved_db()) as db:
        rows = {}
        for p in ([] if args.model_file else cmbench.model_paths(args.train.split(","))):
            rs = cmbench.stored_rows(p, db, options, machine, calibration).rows
            rows[p.stem] = [r for r in rs if r.measured_ns]
        for path in [Path(args.model_file)] if args.model_file else cmbench.model_paths(args.models.split(",")):
            train = [r for name, rs in rows.items() if name != path.stem for r in rs]
            train += [r for r in stored if r.source != path.stem]
            model = shipped if args.shipped or args.model_file else cm.CostModel.fit(
                train, {"sigma": sigma}, rounds=args.rounds or cm.ROUNDS, depth=args.depth)
            wanted = set(args.estimators.split(","))
            runs = [("all", options.with_(prune=False), None)]
            runs += [("analytic", options.with_(cost_model="analytic"), None)] if "analytic" in wanted else []
            runs += [(f"{e}@{c}", options.with_(cost_model="learned"), float(c)) for e in ("learned", "learned-members")
                     for c in args.confidence.split(",") if e in wanted]
            base = None
            for label, opts, confidence in runs:
                t0 = time.perf_counter()
                with mock.patch.object(cm, "shipped", lambda: model), \
                        mock.patch.object(pl, "CONFIDENCE", confidence if confidence is not None else pl.CONFIDENCE), \
                        mock.patch.object(pl, "FILL_AGAINST_PLAN", not label.startswith("learned-members")):
                    planned, fused, total, build_s = replay(path, opts, machine, db, args.kernel_seconds)
                ns = planned.plan.predicted_ns
                base = base or ns
                r = {"model": path.stem, "estimator": label, "fused_measured": fused, "measured": total, "build_s": build_s,
                     "rounds": planned.measured.stats.rounds, "solve_s": planned.seconds.get("orchestrate", 0.0),
                     "never_measured": planned.measured.stats.estimated,
                     "plan_ms": ns / 1e6, "plan_vs_all": ns / base, "replay_s": time.perf_counter() - t0}
                results.append(r)
                print(f"{path.stem} {label}: {fused} fused measured ({total} kernels, builds {build_s:.0f} s), "
                      f"{r['rounds']} rounds, plan {ns / 1e6:.4f} ms "
                      f"({r['plan_vs_all']:.4f} of measuring all), solves {r['solve_s']:.0f} s, "
                      f"replayed in {r['replay_s']:.0f} s", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"machine": machine.to_json(), "results": results}, indent=1))
    lines = ["# Pruned measurement replayed from the profile database", "",
             f"Machine: {machine.name}, {args.threads} threads. "
             + (f"{args.model_file} at {', '.join(args.shape) or 'its shapes'}, the shipped learned model."
                if args.model_file else "Learned model fitted without the replayed model"
                + (f", on this database's other models and {len(stored)} rows of other machines" if stored else "")
                + (f"; trees of depth {args.depth or cm.PARAMS['max_depth']}, {args.rounds or cm.ROUNDS} rounds"
                   if args.depth or args.rounds else "") + "."), "",
             "| model | estimator | fused measured | kernels measured | their builds s | rounds | never measured | "
             "plan ms | plan / measuring all | replay s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['estimator']} | {r['fused_measured']} | {r['measured']} | {r['build_s']:.0f} | "
              f"{r['rounds']} | {r['never_measured']} | {r['plan_ms']:.4f} | {r['plan_vs_all']:.4f} | "
              f"{r['replay_s']:.0f} |" for r in results]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
