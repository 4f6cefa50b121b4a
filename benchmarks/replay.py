"""Replay cold optimizes against an oracle database: how the refine loop's policy trades the
kernels it measures for the plan it finds, without building or timing anything.

First measure every candidate once (`kernorch optimize ... --measure-all --db ORACLE`). Each replay
is then a cold optimize on an empty database of its own whose measurements are looked up in
ORACLE instead of taken, so it follows the loop's real path (solves, estimates, learned-model
corrections, stops) in seconds. `--noise` and `--slow` disturb each fused kernel's time as this
VM does (a lognormal factor, and a slow phase of 1.2-1.6x with that probability), drawn once per
kernel and seed; the plan each replay ends with is then priced at the oracle's times ("true"), so
a policy that measures more only to pick kernels that were timed lucky shows as no better.

    python benchmarks/replay.py block.onnx --oracle oracle.sqlite --shape seq=1..512 \
        --seeds 16 --policy SETTLE_WITHIN=0.03 --policy SETTLE_WITHIN=0.05

Prints, per policy (assignments to kernorch.pipeline constants, comma-separated), the mean true
cost of the plans and the mean number of kernels measured, and writes them as JSON with --out.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernorch import measure as meas  # noqa: E402
from kernorch import pipeline  # noqa: E402
from kernorch.cli import options_from  # noqa: E402
from kernorch.database import Measurement, ProfileDB  # noqa: E402
from kernorch.options import Machine  # noqa: E402


def _disturbed(m: Measurement, rng, noise: float, slow: float) -> Measurement:
    f = math.exp(rng.normal(0.0, noise)) * (rng.uniform(1.2, 1.6) if rng.random() < slow else 1.0)
    return replace(m, median_ns=int(m.median_ns * f), samples_ns=tuple((n, int(ns * f)) for n, ns in m.samples_ns))


def replay(model: str, shapes: list[str], oracle: ProfileDB, policy: dict, seed: int, noise: float,
           slow: float, threads: int, max_kernel_size: int, cost_model: str | None = None) -> dict:
    """One cold optimize whose measurements come from `oracle` (fusions disturbed); returns the
    plan's cost at the oracle's times, its cost as the run saw it, and what it measured."""
    rng = np.random.default_rng(seed)
    seen: dict = {"measured": 0, "missing": 0}

    def measure(jobs, db, options, machine=None, label="measure", workers=None):
        target = meas.target_of(machine or Machine.host(), options)
        seen["target"] = target
        out = {}
        for j in {j.ident: j for j in jobs}.values():
            m = oracle.lookup(target, j.key, j.impl, j.schedule, meas.versions(j.impl))
            if m is None:
                seen["missing"] += 1
                m = Measurement(target, j.key, j.impl, j.schedule, meas.versions(j.impl), "refused", None, (),
                                "not in the oracle database")
            else:
                seen["measured"] += 1
                if m.ok and label == "refine" and (noise or slow):
                    m = _disturbed(m, rng, noise, slow)
            out[j.ident] = m
        return out, meas.MeasureStats(jobs=len(out), measured=len(out), seconds=0.25 * len(out))

    saved = {name: getattr(pipeline, name) for name in policy}
    real = (meas.measure, pipeline.settled, pipeline.suspects)
    meas.measure = measure
    pipeline.settled = lambda m, *a, **k: m     # (no second timings: the oracle's time is the time)
    pipeline.suspects = lambda *a, **k: {}
    try:
        for name, value in policy.items():
            setattr(pipeline, name, value)
        with tempfile.TemporaryDirectory() as d:
            args = SimpleNamespace(shape=shapes, threads=threads, db=str(Path(d) / "replay.sqlite"),
                                   max_kernel_size=max_kernel_size, max_candidates=None, max_partition=None,
                                   max_pointwise=None, lengths=None, samples=None, buckets=None, budget=None,
                                   cost_model=cost_model)
            planned = pipeline.plan_model(model, options_from(args))
    finally:
        meas.measure, pipeline.settled, pipeline.suspects = real
        for name, value in saved.items():
            setattr(pipeline, name, value)
    plan, true = priced(planned, lambda k: oracle.lookup(seen["target"], k.key, k.impl, k.schedule,
                                                         meas.versions(k.impl)))
    return {"true_ns": true, "seen_ns": plan.stats.objective_ns, "measured": seen["measured"],
            "missing": seen["missing"], "rounds": planned.measured.stats.rounds}


def priced(planned, lookup) -> tuple:
    """(the plan the refine loop settled on, its cost with each kernel at the oracle's time, `lookup(kernel)`,
    where the oracle has it). Over a range that is the one plan: the plan that dispatches among the
    samples' own plans prices each bucket's kernels at that bucket's weights and the oracle at the
    whole range's (priced so, replays of the transformer block over seq=1..512 came out below zero)."""
    plan = planned.one if planned.one is not None else planned.plan
    true = plan.stats.objective_ns
    for k in plan.kernels:
        o = lookup(k)
        true += (o.median_ns if o is not None and o.ok else k.cost_ns) - k.cost_ns
    return plan, true


def _policy(text: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, value = part.split("=", 1)
        if not hasattr(pipeline, name):
            raise SystemExit(f"kernorch.pipeline has no {name}")
        out[name] = type(getattr(pipeline, name))(float(value) if "." in value or "e" in value else int(value))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--oracle", required=True, help="a database holding every candidate (--measure-all)")
    ap.add_argument("--shape", action="append", required=True)
    ap.add_argument("--policy", action="append", default=[],
                    help="NAME=VALUE[,NAME=VALUE]: kernorch.pipeline constants for one policy (none: as shipped)")
    ap.add_argument("--cost-model", action="append", choices=("learned", "analytic"), default=None,
                    help="pruning's estimates (kernorch optimize --cost-model); repeat it to replay each policy "
                         "with each (default: as shipped)")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--noise", type=float, default=0.05, help="lognormal sigma of a fusion's timing")
    ap.add_argument("--slow", type=float, default=0.1, help="probability a fusion is timed in a slow phase")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-kernel-size", type=int, default=8)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    oracle = ProfileDB(args.oracle)
    results = {}
    for text, cost_model in ((t, c) for t in args.policy or [""] for c in args.cost_model or [None]):
        runs = [replay(args.model, args.shape, oracle, _policy(text), seed, args.noise, args.slow, args.threads,
                       args.max_kernel_size, cost_model) for seed in range(1, args.seeds + 1)]
        name = ", ".join(filter(None, (text, cost_model and f"cost model {cost_model}"))) or "shipped"
        results[name] = runs
        print(f"{name}: true cost {statistics.mean(r['true_ns'] for r in runs) / 1e3:.1f} us "
              f"(min {min(r['true_ns'] for r in runs) / 1e3:.1f}, max {max(r['true_ns'] for r in runs) / 1e3:.1f}), "
              f"{statistics.mean(r['measured'] for r in runs):.0f} kernels measured, "
              f"{statistics.mean(r['rounds'] for r in runs):.1f} rounds over {len(runs)} seeds"
              + (f"; {sum(r['missing'] for r in runs)} lookups missing" if any(r["missing"] for r in runs) else ""),
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
