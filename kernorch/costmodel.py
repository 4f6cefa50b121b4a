"""The learned cost model: what a fused kernel not measured yet will take (XGBoost, no pickle).

It predicts y = log(measured / base) of a fused kernel, base being the sum of its primitives
measured alone (kernorch.features), from the fusion's structure, its schedule and the machine.
Pruning (`pipeline.measure_candidates`) uses it in place of the analytic bound of kernorch.estimate:
the solver is shown each unmeasured fusion at its prediction lowered by the model's own spread, so
it asks to measure the fusions that may win, and far fewer of the ones that will not.

Transfer: every row carries the machine's features (vector width, registers, caches, measured peak
and bandwidth, threads), and during a run the fusions measured so far correct the prediction by a
shrunk median residual (`Residual`), which is how a model trained elsewhere adapts to a new CPU
from its first few dozen measurements.

A model is saved as XGBoost's own JSON with the feature order and training summary as attributes;
loading it runs no code. The package ships one (kernorch/data/costmodel.json), trained by
`benchmarks/costmodel.py` on the project's own measurements.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from . import features as feat
from .ir import Graph, KernorchError, structural_key

SHIPPED = Path(__file__).parent / "data" / "costmodel.json"
PARAMS = {"max_depth": 6, "eta": 0.08, "subsample": 0.9, "colsample_bytree": 0.9, "min_child_weight": 2,
          "objective": "reg:squarederror", "nthread": 1, "seed": 0}
ROUNDS = 300
# the correction on a new machine: shallow, slow, few trees (50 rows must not be memorised)
# the correction samples neither rows nor columns: continued training draws from XGBoost's global
# generator, and the same rows must give the same model (a warm run's estimates repeat)
CORRECT_PARAMS = PARAMS | {"max_depth": 3, "eta": 0.1, "min_child_weight": 4, "subsample": 1.0, "colsample_bytree": 1.0}
CORRECT_ROUNDS = 20
SHRINK = 8.0  # the run's residual counts n / (n + SHRINK) of its median: a few fusions move it little
# the run's spread: over its last this many errors (0: all of them). The corrected model errs less than
# the run's early errors say (segformer_b0, Zen 4: 0.34-0.40 against 0.47 over all); replayed, the
# window measured 2431 fusions instead of 3514 (600: about 3000) for a plan 1.5 % above measuring all
SPREAD_WINDOW = 300
HELD_OUT_FOLDS = 5  # CostModel.held_out_errors: the folds a warm run's spread is estimated from


def alone_times(measurements: Mapping) -> tuple[dict[str, int], int]:
    """Per kernel key of a single primitive: its fastest successful measurement (untuned
    comparisons aside), and the cheapest of them all (the call every kernel pays)."""
    alone: dict[str, int] = {}
    for (key, _impl, sched), m in measurements.items():
        if m.ok and sched != "none" and len(m.description.split("+")) == 1:
            alone[key] = min(alone.get(key, m.median_ns), m.median_ns)
    return alone, min(alone.values(), default=0)


def prims_alone(graphs: Iterable[Graph], alone_by_key: Mapping[str, int]) -> dict[str, int]:
    """Per prim name of the kernel graphs: its time measured as a kernel of its own, where known."""
    out: dict[str, int] = {}
    for kg in graphs:
        for p in kg.prims:
            if p.name not in out:
                key = structural_key([p], kg, [p.name])
                if key in alone_by_key:
                    out[p.name] = alone_by_key[key]
    return out


@dataclass(frozen=True)
class Row:
    """One fused kernel: its features, its base (ns) and, when measured, its time (ns)."""
    ident: tuple[str, str, str]
    features: Mapping[str, float]
    base_ns: float
    prims: tuple[str, ...] = ()
    measured_ns: int | None = None
    source: str = ""

    @property
    def label(self) -> float:
        return math.log(self.measured_ns / self.base_ns)


def rows_for(jobs: Sequence, alone: Mapping[str, int], cheapest: int, machine, calibration: Mapping, threads: int,
             measurements: Mapping | None = None, source: str = "") -> list[Row]:
    """The rows of fused jobs (`measurements`: their results, where measured)."""
    out = []
    for j in jobs:
        m = (measurements or {}).get(j.ident)
        ns = m.median_ns if m is not None and m.ok else None
        out.append(Row(j.ident, feat.kernel_features(j.graph, j.schedule, alone, cheapest, machine, calibration, threads),
                       feat.base_ns(j.graph, alone, cheapest), tuple(p.name for p in j.graph.prims), ns, source))
    return out


ROWS_FORMAT = 1


def save_rows(rows: Sequence[Row], machine, threads: int, path: str | Path) -> None:
    """Measured rows as JSON (gzip when the name ends in .gz), with the machine that measured them:
    the training data of a model that spans machines, kept where it can be shared."""
    import gzip
    doc = {"format": ROWS_FORMAT, "machine": machine.to_json(), "threads": threads, "features": list(feat.FEATURES),
           "rows": [{"ident": list(r.ident), "features": [r.features[n] for n in feat.FEATURES], "base_ns": r.base_ns,
                     "prims": list(r.prims), "measured_ns": r.measured_ns, "source": r.source}
                    for r in rows if r.measured_ns]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(doc, separators=(",", ":")).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)


def load_rows(path: str | Path) -> tuple[dict, list[Row]]:
    """(machine as JSON, rows) of a file written by `save_rows`; rows with other features are refused."""
    import gzip
    path = Path(path)
    data = path.read_bytes()
    doc = json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)
    if doc.get("format") != ROWS_FORMAT or tuple(doc.get("features", ())) != feat.FEATURES:
        raise KernorchError(f"{path}: rows of another format or feature set; measure them again")
    rows = [Row(tuple(r["ident"]), dict(zip(feat.FEATURES, r["features"])), float(r["base_ns"]), tuple(r["prims"]),
                int(r["measured_ns"]), r["source"]) for r in doc["rows"]]
    return doc["machine"], rows


def _matrix(rows: Sequence[Row], labelled: bool = False):
    """The rows as XGBoost's DMatrix in the order of feat.FEATURES (with their labels when `labelled`)."""
    import numpy as np
    import xgboost as xgb
    x = np.array([feat.vector(r.features) for r in rows], dtype=np.float32)
    y = np.array([r.label for r in rows], dtype=np.float32) if labelled else None
    return xgb.DMatrix(x, label=y, feature_names=list(feat.FEATURES))


class CostModel:
    def __init__(self, booster, summary: Mapping | None = None):
        self.booster = booster
        self.summary = dict(summary or {})

    @property
    def sigma(self) -> float:
        """The model's out-of-sample spread in log space (from its training summary)."""
        return float(self.summary.get("sigma", 0.5))

    @staticmethod
    def fit(rows: Sequence[Row], summary: Mapping | None = None, rounds: int = ROUNDS,
            depth: int | None = None) -> "CostModel":
        """Fitted on the measured `rows`: `rounds` trees of PARAMS, of `depth` levels where given
        (benchmarks/costmodel.py --depth compares: trees of one level, an additive model, ranked
        held-out models' fusions better and pruned worse; HISTORY, sixty-seventh session)."""
        import xgboost as xgb
        rows = [r for r in rows if r.measured_ns]
        if not rows:
            raise KernorchError("the cost model has nothing to learn from: no measured fused kernels")
        params = PARAMS if depth is None else PARAMS | {"max_depth": depth}
        booster = xgb.train(params, _matrix(rows, labelled=True), rounds)
        s = {"rows": len(rows), "sources": sorted({r.source for r in rows if r.source})} | dict(summary or {})
        return CostModel(booster, s)

    def corrected(self, rows: Sequence[Row], rounds: int = CORRECT_ROUNDS) -> "CostModel":
        """This model continued by a few shallow trees fitted to its errors on `rows` (measured on
        the machine it is to predict): how a model trained on other CPUs learns the new one's
        differences from its first few dozen measurements, rather than only its mean error (a
        shift of every prediction leaves their order, which is what pruning needs, unchanged)."""
        import xgboost as xgb
        rows = [r for r in rows if r.measured_ns]
        if not rows:
            return self
        booster = xgb.train(CORRECT_PARAMS, _matrix(rows, labelled=True), rounds, xgb_model=self.booster.copy())
        return CostModel(booster, self.summary | {"corrected_with": len(rows)})

    def held_out_errors(self, rows: Sequence[Row], folds: int = HELD_OUT_FOLDS) -> tuple[float, ...]:
        """The errors, log(measured / predicted), that this model corrected by `rows` makes on
        fusions it has not seen: each row predicted by the model corrected with the other folds
        (row i in fold i % folds), in the order of `rows`. A run that starts from fusions an
        earlier run measured has no out-of-sample errors of its own; these stand in for them."""
        rows = [r for r in rows if r.measured_ns]
        if len(rows) < 2 * folds:
            return ()
        out: list[float] = [0.0] * len(rows)
        for f in range(folds):
            train = [r for i, r in enumerate(rows) if i % folds != f]
            test = [i for i in range(f, len(rows), folds)]
            for i, p in zip(test, self.corrected(train).predict_ns([rows[i] for i in test])):
                out[i] = math.log(rows[i].measured_ns / p)
        return tuple(out)

    def predict(self, rows: Sequence[Row]) -> list[float]:
        """Predicted log(time / base) per row."""
        if not rows:
            return []
        return [float(v) for v in self.booster.predict(_matrix(rows))]

    def predict_ns(self, rows: Sequence[Row]) -> list[float]:
        return [r.base_ns * math.exp(y) for r, y in zip(rows, self.predict(rows))]

    def save(self, path: str | Path) -> None:
        self.booster.set_attr(kernorch_features=json.dumps(list(feat.FEATURES)),
                              kernorch_summary=json.dumps(self.summary, sort_keys=True))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.booster.save_model(str(path))

    @staticmethod
    def load(path: str | Path) -> "CostModel":
        import xgboost as xgb
        path = Path(path)
        if path.suffix != ".json":
            raise KernorchError(f"{path}: a cost model is XGBoost JSON (.json)")
        try:
            booster = xgb.Booster(model_file=str(path))
        except Exception as e:  # xgboost raises its own error type for an unreadable file
            raise KernorchError(f"{path}: not a readable cost model ({str(e).splitlines()[0]})") from None
        names = json.loads(booster.attr("kernorch_features") or "[]")
        if tuple(names) != feat.FEATURES:
            raise KernorchError(f"{path}: cost model built for other features ({len(names)} vs {len(feat.FEATURES)})")
        return CostModel(booster, json.loads(booster.attr("kernorch_summary") or "{}"))


def shipped() -> CostModel | None:
    """The model that ships with the package, or None when there is none (or it does not match)."""
    if not SHIPPED.exists():
        return None
    try:
        return CostModel.load(SHIPPED)
    except KernorchError:
        return None


@dataclass(frozen=True)
class Residual:
    """This run's errors of the model in log space, log(measured / predicted), each taken before the
    fusion was measured (out of sample). `errors` are those of the model now in use: their median,
    shrunk toward 0 while they are few, is the `shift` of its predictions. `earlier` are those of
    models the run corrected since: with `errors` they give the run's `spread`."""
    errors: tuple[float, ...] = field(default_factory=tuple)
    earlier: tuple[float, ...] = field(default_factory=tuple)

    def add(self, pairs: Iterable[tuple[float, float]]) -> "Residual":
        """`pairs` of (predicted ns, measured ns)."""
        return replace(self, errors=self.errors + tuple(math.log(m / p) for p, m in pairs if p > 0 and m > 0))

    def corrected(self) -> "Residual":
        """After the model was corrected by the measured fusions: no shift, the errors kept for the spread."""
        return Residual((), self.earlier + self.errors)

    @property
    def shift(self) -> float:
        n = len(self.errors)
        return statistics.median(self.errors) * n / (n + SHRINK) if n else 0.0

    def spread(self, prior: float) -> float:
        """The standard deviation of this run's errors about their mean, pulled toward `prior` (the
        model's spread where it was trained) as SHRINK errors would pull it: what the model misses
        on this machine and model, once the run has measured enough to say."""
        every = self.earlier + self.errors
        if SPREAD_WINDOW:
            every = every[-SPREAD_WINDOW:]
        n = len(every)
        if n < 2:
            return prior
        mean = sum(every) / n
        var = sum((e - mean) ** 2 for e in every) / (n - 1)
        return math.sqrt((n * var + SHRINK * prior * prior) / (n + SHRINK))
