"""The CLI's commands: each calls the Python API and prints a table (rich) or JSON."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from . import pipeline, primitives
from .database import ProfileDB
from .ir import KernorchError
from .options import Options

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
    run = pipeline.load(model, options)
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
        "onnx_nodes_after_folding": len(run.onnx.nodes),
        "onnx_ops": run.onnx.histogram(),
        "primitives": len(g.prims),
        "primitive_ops": g.histogram(),
        "primitive_kinds": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "weights": len(g.constants),
        "seconds": {k: round(v, 3) for k, v in run.seconds.items()},
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
                print(f"{s['path']}: {s['measurements']} measurements, {s['size_bytes'] / 1e6:.2f} MB")
                _table("Measurements", ["target", "impl", "status", "rows", "distinct keys"],
                       [[g["target"], g["impl"], g["status"], g["rows"], g["distinct_keys"]] for g in s["groups"]])
        elif args.action == "export":
            _emit_json(db.export())
        else:
            n = db.clear()
            print(f"cleared {n} measurements from {db.path}")
    return 0
