"""The learned cost model: how well it ranks fusions on models it was not trained on, and the model
the package ships.

    .venv/bin/python benchmarks/costmodel.py                  # evaluate (leave one model out), then train and save
    .venv/bin/python benchmarks/costmodel.py --no-save        # evaluate only
    .venv/bin/python benchmarks/costmodel.py --stored         # leave one model out on every machine's stored rows
    .venv/bin/python benchmarks/costmodel.py --stored --depth 1 --rounds 200   # the same with other trees
    .venv/bin/python benchmarks/costmodel.py --no-save --retest 800   # also: each fusion timed again, the noise ceiling

Data: the profile database (the user's cache unless --db) holds every kernel measured on this
machine; for each model, the candidates are enumerated again (no measuring) and joined with the
database by their keys. Each measured fused kernel is one row (kernorch.features), its label
log(measured / members alone).

Evaluation, leave one model out: the model is fitted on the others' rows and predicts the held-out
model's. Reported against the analytic bound of kernorch.estimate and against the plainest
predictor there is, the sum of the fusion's members timed alone (its base), per held-out model:

* Spearman rho of predicted vs measured times among the choices that cover the same primitive
  (every fused kernel containing it), averaged over primitives with at least 3 choices: the
  issue's "within prim covers" rank correlation;
* the same on the ratio fused / members alone (harder: size no longer helps);
* pairwise accuracy within covers, and top-3 recall of the measured fastest choice per cover;
* the spread (standard deviation) of log(measured / predicted): `sigma`, saved with the model.

Transfer (--transfer N, default 50): the shipped model, trained on other machines, scored on this
machine's rows per model as shipped and after `CostModel.corrected` with N of the model's own
measurements (at random, as a run's first measurements), beside a model fitted on this machine.

Retest (--retest N): up to N measured fusions per model built and timed again in a fresh database,
the second timing scored as a predictor of the first: the ceiling the measurement's own noise puts
on the rank correlation of any model.

This machine's measured rows are written to results/costmodel-rows/ (JSON, one file per machine and
thread count; no pickle); rows kept there from other machines join the training, so the shipped
model spans every CPU the project has been measured on.

Writes benchmarks/results/costmodel.json and .md, and kernorch/data/costmodel.json (trained on all
rows, every machine's) unless --no-save.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SHARED = HERE.parents[1] / "shared" / "models"
sys.path.insert(0, str(ROOT))

from kernorch import costmodel as cm  # noqa: E402
from kernorch import measure as meas  # noqa: E402
from kernorch import pipeline as pl  # noqa: E402
from kernorch.calibrate import calibrate  # noqa: E402
from kernorch.database import ProfileDB  # noqa: E402
from kernorch.estimate import fused_estimate_ns  # noqa: E402
from kernorch.options import Machine, Options  # noqa: E402


_EXAMPLES: tempfile.TemporaryDirectory | None = None  # the example models of this process, removed as it ends


def model_paths(names) -> list[Path]:
    """The ONNX files of `names`: the shared models, and kernorch's examples written once per process
    into a directory of its own (a directory per call, never removed, had left 49 in /tmp)."""
    global _EXAMPLES
    from kernorch.examples import save_examples
    out = [SHARED / f"{n}.onnx" for n in names if (SHARED / f"{n}.onnx").exists()]
    if _EXAMPLES is None:
        _EXAMPLES = tempfile.TemporaryDirectory(prefix="kernorch-examples-")
    out += [p for p in save_examples(Path(_EXAMPLES.name)) if p.stem in names]
    return out


@dataclass(frozen=True)
class Stored:
    """A model's fused jobs as the database holds them: one row per job (with its time where it was
    measured), the analytic estimate by ident, the jobs by ident, and the options its optimize
    measured with (its namespace)."""
    rows: list
    analytic: dict
    jobs: dict
    options: Options


def stored_rows(path: Path, db: ProfileDB, options: Options, machine: Machine, calibration: dict) -> Stored:
    """Every fused job of the model, joined with the database (see `Stored`)."""
    loaded = pl.load(str(path), options)
    options = pl.model_options(loaded.graph, options, machine)  # the namespace its optimize measured in
    en = pl.enumerate_candidates(loaded.graph, options)
    by_prim = pl.tile_jobs(loaded.graph, en.candidates, options, machine)
    stored = meas.stored([j for js in by_prim.values() for j in js], db, options, machine)
    jobs = pl.candidate_jobs(loaded.graph, en.candidates, options, machine, pl.fastest_schedules(stored, by_prim))
    stored.update(meas.stored(jobs, db, options, machine))
    alone, cheapest = cm.alone_times(stored)
    fused = [j for j in jobs if pl._deferrable(j)]
    prim_alone = cm.prims_alone((j.graph for j in fused), alone)
    rows = cm.rows_for(fused, prim_alone, cheapest, machine, calibration, options.threads, stored, source=path.stem)
    analytic = {j.ident: fused_estimate_ns(j.graph, calibration["peak_gflops"], calibration["bandwidth_gbs"],
                                           prim_alone, cheapest) for j in fused}
    return Stored(rows, analytic, {j.ident: j for j in fused}, options)


def _spearman(a, b) -> float | None:
    from scipy.stats import spearmanr
    if len(a) < 3 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    return float(spearmanr(a, b).statistic)


def metrics(rows, predicted_ns) -> dict:
    """Rank quality of `predicted_ns` (per row) against the measured times, within prim covers."""
    covers: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        for p in r.prims:
            covers.setdefault(p, []).append(i)
    rho_t, rho_r, pairs_ok, pairs, top3, tops = [], [], 0, 0, 0, 0
    for idx in covers.values():
        if len(idx) < 3:
            continue
        meas_t = [rows[i].measured_ns for i in idx]
        pred_t = [predicted_ns[i] for i in idx]
        s = _spearman(pred_t, meas_t)
        if s is not None:
            rho_t.append(s)
        s = _spearman([p / rows[i].base_ns for p, i in zip(pred_t, idx)], [m / rows[i].base_ns for m, i in zip(meas_t, idx)])
        if s is not None:
            rho_r.append(s)
        for a in range(len(idx)):
            for b in range(a + 1, len(idx)):
                if meas_t[a] != meas_t[b]:
                    pairs += 1
                    pairs_ok += (pred_t[a] < pred_t[b]) == (meas_t[a] < meas_t[b])
        best = min(range(len(idx)), key=lambda k: meas_t[k])
        tops += 1
        top3 += best in sorted(range(len(idx)), key=lambda k: pred_t[k])[:3]
    errors = [math.log(r.measured_ns / p) for r, p in zip(rows, predicted_ns)]
    return {"rows": len(rows), "covers": len(rho_t),
            "rho_time": statistics.mean(rho_t) if rho_t else None,
            "rho_ratio": statistics.mean(rho_r) if rho_r else None,
            "pairwise": pairs_ok / pairs if pairs else None,
            "top3_recall": top3 / tops if tops else None,
            "bias": statistics.mean(errors), "sigma": statistics.pstdev(errors)}


def _f(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# Learned cost model: leave one model out", "",
             f"Machine: {m['name']}, {m['simd_bits']}-bit vectors, {result['threads']} threads; "
             f"{result['rows']} measured fused kernels from {len(result['models'])} models. "
             "Each row: the model fitted on the other models' kernels predicts this model's; "
             "rho = Spearman within prim covers (time / ratio to members alone), sigma = spread of log(measured/predicted).", "",
             "| held out | rows | predictor | rho time | rho ratio | pairwise | top-3 recall | bias | sigma |",
             "|---|---|---|---|---|---|---|---|---|"]

    for name, by in result["held_out"].items():
        for pred in ("learned", "analytic", "members alone"):
            e = by[pred]
            lines.append(f"| {name} | {e['rows']} | {pred} | {_f(e['rho_time'])} | {_f(e['rho_ratio'])} | "
                         f"{_f(e['pairwise'])} | {_f(e['top3_recall'])} | {_f(e['bias'])} | {_f(e['sigma'])} |")
    return "\n".join(lines) + "\n"


def rows_file(directory: Path, machine: Machine, threads: int) -> Path:
    """Where this machine's measured rows are kept (one file per machine and thread count)."""
    slug = "".join(ch if ch.isalnum() else "-" for ch in machine.name).strip("-").lower()
    return directory / f"{slug}-{machine.simd_bits}b-{machine.fingerprint(threads)}.json.gz"


def other_machines(directory: Path, mine: Path, machine: Machine) -> dict[str, tuple[dict, list]]:
    """Rows measured on other machines and kept in `directory`, by file name."""
    out = {}
    for path in sorted(directory.glob("*.json.gz")):
        if path != mine:
            try:
                stored, rows = cm.load_rows(path)
            except Exception as e:  # noqa: BLE001 - a stale file is skipped, said once
                print(f"skipping {path.name}: {e}", flush=True)
                continue
            if Machine.from_json(stored).same_cpu(machine):
                print(f"skipping {path.name}: this machine's rows under an older name", flush=True)
                continue
            out[path.name] = (stored, rows)
    return out


def transfer(rows_by_model: dict, n: int, seed: int = 0) -> dict:
    """The shipped model (trained on other machines) on this machine's rows, per model: as shipped,
    then corrected with `n` of the model's own measured fusions (at random: the first a run measures),
    both scored on the model's remaining rows, beside a model fitted here without that model."""
    import random
    shipped = cm.shipped()
    if shipped is None:
        return {}
    out = {"trained_on": shipped.summary.get("machines", []), "n": n, "models": {}}
    for name, (rows, _) in rows_by_model.items():
        if len(rows) <= n + 10:
            continue
        picked = set(random.Random(seed).sample(range(len(rows)), n))
        seen = [r for i, r in enumerate(rows) if i in picked]
        rest = [r for i, r in enumerate(rows) if i not in picked]
        local = [r for other, (rs, _) in rows_by_model.items() if other != name for r in rs]
        out["models"][name] = {
            "shipped": metrics(rest, shipped.predict_ns(rest)),
            "corrected": metrics(rest, shipped.corrected(seen).predict_ns(rest)),
            "local": metrics(rest, cm.CostModel.fit(local).predict_ns(rest)) if local else None}
        e = out["models"][name]
        print(f"{name}: rho shipped {e['shipped']['rho_time']:.2f}, corrected with {n} "
              f"{e['corrected']['rho_time']:.2f}" + (f", fitted here {e['local']['rho_time']:.2f}" if local else ""),
              flush=True)
    return out


def retest(stored_by_model: dict, n: int, machine: Machine, seed: int = 0, keep: str | None = None) -> dict:
    """How far any predictor can rank this machine's fusions: up to `n` measured fused kernels per
    model (all of them when they are fewer; else a random sample) built and timed once more, in a
    fresh database and fresh workers, and that second timing scored as if it were a predictor of
    the first (the label every cost model is scored against), beside the members alone on the same
    rows. Its rho is the ceiling the measurement's own noise puts on any model's. `keep`: the second
    timings' database is kept there (else a temporary one)."""
    import random
    out = {"n": n, "models": {}}
    for name, st in stored_by_model.items():
        rows = [r for r in st.rows if r.measured_ns]
        if len(rows) > n:
            rows = random.Random(seed).sample(rows, n)
        with tempfile.TemporaryDirectory(prefix="kernorch-retest-") as tmp, ProfileDB(keep or Path(tmp) / "db.sqlite") as db:
            t0 = time.perf_counter()
            again, _ = meas.measure([st.jobs[r.ident] for r in rows], db, st.options, machine, label=f"retest {name}")
            seconds = time.perf_counter() - t0
        rows = [r for r in rows if again.get(r.ident) is not None and again[r.ident].ok]
        second = [float(again[r.ident].median_ns) for r in rows]
        drift = [math.log(t / r.measured_ns) for r, t in zip(rows, second)]
        out["models"][name] = {"retimed": metrics(rows, second), "members alone": metrics(rows, [r.base_ns for r in rows]),
                               "seconds": seconds,
                               "ratio_quantiles": [math.exp(q) for q in statistics.quantiles(drift, n=10)]
                               if len(drift) > 1 else []}
        e = out["models"][name]
        print(f"{name}: {len(rows)} fusions timed again in {seconds:.0f} s: rho of one timing against the other "
              f"{_f(e['retimed']['rho_time'])}, members alone {_f(e['members alone']['rho_time'])}", flush=True)
    return out


def retest_markdown(result: dict) -> str:
    t = result.get("retest") or {}
    if not t.get("models"):
        return ""
    lines = ["", "## The measurement against itself", "",
             f"Up to {t['n']} measured fusions per model built and timed again in a fresh database and fresh workers; "
             "the second timing ranks the first within prim covers as a predictor would (the ceiling that the "
             "measurement's own noise puts on any cost model), beside the members alone on the same rows. "
             "second / first: the 10th, 50th and 90th percentiles of the ratio of the two timings.", "",
             "| model | rows | rho second timing | pairwise | top-3 recall | rho members alone | second / first p10, p50, p90 "
             "| seconds |", "|---|---|---|---|---|---|---|---|"]
    for name, e in t["models"].items():
        a, b, q = e["retimed"], e["members alone"], e["ratio_quantiles"]
        qs = ", ".join(f"{q[i]:.2f}" for i in (0, 4, 8)) if len(q) == 9 else "-"
        lines.append(f"| {name} | {a['rows']} | {_f(a['rho_time'])} | {_f(a['pairwise'])} | {_f(a['top3_recall'])} | "
                     f"{_f(b['rho_time'])} | {qs} | {e['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def transfer_markdown(result: dict) -> str:
    t = result.get("transfer") or {}
    if not t.get("models"):
        return ""

    lines = ["", "## Transfer to this machine", "",
             f"The shipped model (trained on {', '.join(t['trained_on']) or 'unknown'}) predicts this machine's "
             f"fusions as shipped, and corrected with {t['n']} of the model's own measurements (a few shallow trees "
             "fitted to its errors, kernorch.costmodel.CostModel.corrected); both scored on the model's other rows, "
             "beside a model fitted on this machine's other models.", "",
             "| model | rows scored | predictor | rho time | pairwise | top-3 recall | bias | sigma |",
             "|---|---|---|---|---|---|---|---|"]
    for name, by in t["models"].items():
        for pred in ("shipped", "corrected", "local"):
            e = by.get(pred)
            if e:
                lines.append(f"| {name} | {e['rows']} | {pred} | {_f(e['rho_time'])} | {_f(e['pairwise'])} | "
                             f"{_f(e['top3_recall'])} | {_f(e['bias'])} | {_f(e['sigma'])} |")
    return "\n".join(lines) + "\n"


def stored_evaluation(directory: Path, fit=None) -> dict:
    """Leave one model out on every machine's stored rows, without a database or a measurement: per
    machine and held-out model, the model fitted on every other model's rows (this machine's and
    the others') against the sum of the fusion's members alone, within prim covers. `fit`: how a
    model is fitted from rows (default `CostModel.fit`; --depth and --rounds set its trees)."""
    fit = fit or cm.CostModel.fit
    files = {}
    for path in sorted(directory.glob("*.json.gz")):
        try:
            files[path.name] = cm.load_rows(path)
        except Exception as e:  # noqa: BLE001 - a stale file is skipped, said once
            print(f"skipping {path.name}: {e}", flush=True)
    every = [r for _, rs in files.values() for r in rs]
    fitted: dict[str, cm.CostModel] = {}   # per held-out model: the same rows on every machine, fitted once
    out = {}
    for name, (machine, rows) in files.items():
        by_model: dict[str, list] = {}
        for r in rows:
            by_model.setdefault(r.source, []).append(r)
        out[name] = {"machine": machine, "models": {}}
        for model, held in by_model.items():
            if model not in fitted:
                fitted[model] = fit([r for r in every if r.source != model])
            learned = metrics(held, fitted[model].predict_ns(held))
            alone = metrics(held, [r.base_ns for r in held])
            out[name]["models"][model] = {"learned": learned, "members alone": alone}
            print(f"{name} {model}: learned rho {learned['rho_time']}, members alone {alone['rho_time']}", flush=True)
    return out


def stored_markdown(result: dict, trees: str = "") -> str:
    """`trees`: the learned model's trees where not the shipped model's (e.g. "depth 1, 200 rounds")."""
    lines = ["# Learned cost model: leave one model out on the stored rows" + (f" ({trees})" if trees else ""), "",
             "Every machine's measured fusions kept in results/costmodel-rows/ (no database, nothing measured "
             "again). For each machine and held-out model the model is fitted on every other model's rows, of "
             "every machine, and ranks the held-out model's fusions within prim covers (Spearman of predicted "
             "and measured times); beside it the plainest predictor, the sum of the fusion's members timed alone.",
             "", "| machine | vectors | held out | rows | rho learned | rho members alone | pairwise learned | "
             "pairwise members alone |", "|---|---|---|---|---|---|---|---|"]
    for name, by in result.items():
        m = by["machine"]
        for model, e in by["models"].items():
            a, b = e["learned"], e["members alone"]
            lines.append(f"| {m['name']} ({name.rsplit('-', 1)[-1].split('.')[0]}) | {m['simd_bits']}-bit | {model} | "
                         f"{a['rows']} | {_f(a['rho_time'])} | {_f(b['rho_time'])} | {_f(a['pairwise'])} | "
                         f"{_f(b['pairwise'])} |")
    means = [(e["learned"]["rho_time"], e["members alone"]["rho_time"]) for by in result.values()
             for e in by["models"].values()
             if e["learned"]["rho_time"] is not None and e["members alone"]["rho_time"] is not None]
    if means:
        lines += ["", f"Mean over {len(means)} held-out models: learned {statistics.mean(a for a, _ in means):.2f}, "
                  f"members alone {statistics.mean(b for _, b in means):.2f}."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="transformer_block,candy_like,gpt2_mini,yolox_tiny,candy,segformer_b0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--db", default=None)
    ap.add_argument("--no-save", action="store_true", help="do not replace the shipped model")
    ap.add_argument("--transfer", type=int, default=50,
                    help="score the shipped model here as shipped and corrected with this many measurements (0: skip)")
    ap.add_argument("--retest", type=int, default=0,
                    help="time up to this many measured fusions per model again and score the second timing as a "
                         "predictor of the first: the noise ceiling of the ranking (0: skip)")
    ap.add_argument("--retest-db", default=None, help="keep the second timings in this database")
    ap.add_argument("--rows-dir", default=str(HERE / "results" / "costmodel-rows"),
                    help="measured rows per machine: this machine's are written here, the others' join the training")
    ap.add_argument("--out", default=str(HERE / "results" / "costmodel"))
    ap.add_argument("--depth", type=int, default=None,
                    help="with --stored: fit trees of this depth (the shipped model's: cost model PARAMS)")
    ap.add_argument("--rounds", type=int, default=None, help="with --stored: fit this many trees")
    ap.add_argument("--stored", action="store_true",
                    help="only evaluate on the stored rows of every machine (leave one model out; no database, "
                         "no measuring) and write <out>-stored.md/.json")
    args = ap.parse_args(argv)
    if args.stored:
        depth, rounds = args.depth or cm.PARAMS["max_depth"], args.rounds or cm.ROUNDS
        result = stored_evaluation(Path(args.rows_dir), lambda rows: cm.CostModel.fit(rows, rounds=rounds, depth=depth))
        default = args.depth is None and args.rounds is None
        out = Path(args.out + "-stored" + ("" if default else f"-d{depth}r{rounds}"))
        text = stored_markdown(result, "" if default else f"trees of depth {depth}, {rounds} rounds")
        out.with_suffix(".json").write_text(json.dumps(result, indent=1))
        out.with_suffix(".md").write_text(text)
        print(text)
        return 0
    options = Options(threads=args.threads, db_path=args.db)
    machine = Machine.host()
    calibration = calibrate(args.threads)
    rows_by_model, stored_by_model = {}, {}
    with ProfileDB(options.resolved_db()) as db:
        for path in model_paths(args.models.split(",")):
            t0 = time.perf_counter()
            st = stored_rows(path, db, options, machine, calibration)
            measured = [r for r in st.rows if r.measured_ns]
            print(f"{path.stem}: {len(st.rows)} fused kernels, {len(measured)} measured "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
            if measured:
                rows_by_model[path.stem] = (measured, st.analytic)
                stored_by_model[path.stem] = st
    mine = rows_file(Path(args.rows_dir), machine, args.threads)
    if rows_by_model:
        cm.save_rows([r for rs, _ in rows_by_model.values() for r in rs], machine, args.threads, mine)
        print(f"wrote {mine}", flush=True)
    others = other_machines(Path(args.rows_dir), mine, machine)
    result = {"machine": machine.to_json(), "threads": args.threads, "models": list(rows_by_model),
              "rows": sum(len(r) for r, _ in rows_by_model.values()), "held_out": {},
              "other_machines": {k: {"machine": m["name"], "simd_bits": m["simd_bits"], "rows": len(rs)}
                                 for k, (m, rs) in others.items()}}
    if args.transfer:
        result["transfer"] = transfer(rows_by_model, args.transfer)
    if args.retest:
        result["retest"] = retest(stored_by_model, args.retest, machine, keep=args.retest_db)
    sigmas = []
    for name, (rows, analytic) in rows_by_model.items():
        train = [r for other, (rs, _) in rows_by_model.items() if other != name for r in rs]
        train += [r for _, rs in others.values() for r in rs if r.source != name]
        if not train:
            continue
        model = cm.CostModel.fit(train)
        learned = metrics(rows, model.predict_ns(rows))
        result["held_out"][name] = {"learned": learned, "analytic": metrics(rows, [analytic[r.ident] for r in rows]),
                                    "members alone": metrics(rows, [r.base_ns for r in rows])}
        sigmas.append(learned["sigma"])
        print(f"{name}: learned rho {learned['rho_time']:.2f}/{learned['rho_ratio']:.2f} sigma {learned['sigma']:.2f}; "
              f"analytic rho {result['held_out'][name]['analytic']['rho_time']:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result) + transfer_markdown(result) + retest_markdown(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    if not args.no_save and rows_by_model:
        all_rows = [r for rs, _ in rows_by_model.values() for r in rs] + [r for _, rs in others.values() for r in rs]
        summary = {"sigma": statistics.median(sigmas) if sigmas else 0.5,
                   "machines": sorted({f"{machine.name} ({machine.simd_bits}-bit)"}
                                     | {f"{m['name']} ({m['simd_bits']}-bit)" for m, _ in others.values()}),
                   "trained": time.strftime("%Y-%m-%d")}
        cm.CostModel.fit(all_rows, summary).save(cm.SHIPPED)
        print(f"wrote {cm.SHIPPED} ({len(all_rows)} rows from {1 + len(others)} machines, sigma {summary['sigma']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
