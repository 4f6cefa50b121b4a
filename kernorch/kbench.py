"""Kernel benchmark: every distinct contraction of a model, kernorch's kernel against ONNX Runtime's.

    r = bench_kernels("model.onnx", options, threads=(1, 2))
    print_kernels(r)

For each distinct matmul/conv primitive of the model (shapes, attributes, which operand is a
constant), kernorch's kernel is the primitive alone in every micro-kernel tile the machine allows
(the fastest kept, as the optimizer does; measured through `kernorch.measure`, so cached in the
profile database), and ONNX Runtime's is the same operator as a one-node model with the constant
operand as an initializer (so MLAS prepacks it). The two are then timed in alternating blocks,
each in a process of its own with the same thread count (calls of two runtimes interleaved one by
one would make their thread pools disturb each other), and the medians of the blocks compared. Reported per kernel: both
latencies and GFLOP/s, their ratio (ORT time / kernorch time: > 1 means kernorch is faster), and
kernorch's fraction of the machine's measured GEMM peak at that thread count.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .ir import Graph, Prim
from .timing import time_repeats

log = logging.getLogger(__name__)

OPSET = 17


@dataclass(frozen=True)
class Contraction:
    """One distinct linear primitive of a model and how often it occurs."""

    prim: Prim
    graph: Graph          # the primitive alone (its constant operand as a constant)
    count: int
    flops: float

    @property
    def label(self) -> str:
        g, p = self.graph, self.prim
        a, b = (g.type_of(t) for t in p.inputs)
        const = "W" if p.inputs[1] in g.constants else "X"
        extra = ""
        if p.op == "conv":
            extra = f" s{p.attr('strides')[0]} g{p.attr('group')}"
        return f"{p.op} {'x'.join(map(str, a.shape))} · {const}{'x'.join(map(str, b.shape))}{extra}"


def contractions(graph: Graph) -> list[Contraction]:
    """The distinct matmul/conv prims of `graph` (structural key of the prim alone), most frequent first."""
    from . import primitives
    from .ir import structural_key
    from .ir import kernel_graph
    seen: dict[str, list] = {}
    for p in graph.prims:
        if p.op not in ("matmul", "conv"):
            continue
        key = structural_key([p], graph, [p.name])
        if key in seen:
            seen[key][2] += 1
            continue
        inputs = tuple(dict.fromkeys(p.inputs))
        kg = kernel_graph(graph, [p.name], inputs, [p.name])
        flops = float(primitives.get(p.op).flops([graph.type_of(t) for t in p.inputs], p.type, p.a))
        seen[key] = [p, kg, 1, flops, key]
    return sorted((Contraction(p, kg, n, f) for p, kg, n, f, _ in seen.values()), key=lambda c: -c.count * c.flops)


def kernel_jobs(c: Contraction, machine) -> list:
    """kernorch's kernel for the contraction: the prim alone in every micro-kernel tile (the default
    schedule when it has none), as `pipeline.measure_candidates` times it; convolutions in their
    blocked layout (nChw{lanes}c in and out: the layout the orchestration program would keep them in),
    or, with output channels no multiple of the lanes (no blocked tile), in their plain-layout tiles
    against the default schedule, as `pipeline.tile_jobs` races them."""
    from .ir import structural_key
    from .kernels import blocked, prim_tiles
    from .measure import KernelJob
    g, p = c.graph, c.prim
    key = structural_key([p], g, [p.name])
    inputs = tuple(dict.fromkeys(p.inputs))
    if p.op == "conv":
        schedules = [blocked(machine.lanes, t.name) for t in prim_tiles(machine, g, p, blocked_layout=True)]
        schedules = schedules or [t.name for t in prim_tiles(machine, g, p)] + ["default"]
    else:
        schedules = [t.name for t in prim_tiles(machine, g, p)] or ["default"]
    return [KernelJob(key, "tvm", s, g, inputs, (p.name,)) for s in schedules]


def onnx_node_model(c: Contraction):
    """The contraction as a one-node ONNX model: activations as inputs, constants as initializers."""
    import onnx
    from onnx import helper, numpy_helper
    g, p = c.graph, c.prim
    inputs, inits = [], []
    names = []
    for i, t in enumerate(p.inputs):
        name = f"in{i}"
        names.append(name)
        ty = g.type_of(t)
        if t in g.constants:
            inits.append(numpy_helper.from_array(np.asarray(g.constants[t], np.float32), name))
        else:
            inputs.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, list(ty.shape)))
    if p.op == "matmul":
        node = helper.make_node("MatMul", names, ["y"])
    else:
        a = p.a
        sp = len(a["strides"])
        node = helper.make_node("Conv", names, ["y"], strides=list(a["strides"]), pads=list(a["pads"]),
                                dilations=list(a["dilations"]), group=int(a["group"]),
                                kernel_shape=list(g.type_of(p.inputs[1]).shape[2:2 + sp]))
    graph = helper.make_graph([node], "k", inputs, [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT,
                                                                                   list(p.type.shape))], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    return m.SerializeToString()


# -- inside the timing processes: prepared kernels kept between calls -------------------------------

_READY: list = []


def _prepare_ort(models: list[bytes], threads: int) -> int:
    """ONNX Runtime sessions of the one-node models, with random inputs (in ORT's own process)."""
    from .executor import ort_session
    rng = np.random.default_rng(0)
    for blob in models:
        sess = ort_session(blob, threads)  # workers stop spinning when a run ends, as in the model benchmark
        feeds = {i.name: rng.uniform(0.1, 1.0, size=i.shape).astype(np.float32) for i in sess.get_inputs()}
        sess.run(None, feeds)
        _READY.append(lambda sess=sess, feeds=feeds: sess.run(None, feeds))
    return len(_READY)


def _prepare_kernorch(jobs: list, threads: int) -> int:
    """kernorch's kernels, built as measured (in kernorch's own process)."""
    from .backends import tvm as tb
    from .kernels import pack_args
    from .measure import make_inputs
    target = tb.make_target(threads)
    for job in jobs:
        mod = tb.lower(job.graph, job.graph.prims, job.inputs, job.outputs, job.schedule)
        k = tb.build(tb.schedule(mod, target, job.schedule), target)
        args, outs = k._args(pack_args(job.graph, job.inputs, job.schedule, make_inputs(job)))
        k._fn(*args, *outs)
        _READY.append(lambda k=k, a=args + outs: k._fn(*a))
    return len(_READY)


QUIET_S = 0.2  # before a block: the other process's pool stops spinning (TVM's spins on after a call)


def _time_block(i: int, repeats: int, min_repeat_s: float) -> float:
    """Median seconds per call of prepared kernel `i` over `repeats` repeats of >= min_repeat_s each,
    started QUIET_S after the other process's block ended. Measured on Zen 1 at 2 threads with ORT's
    workers left spinning between blocks: candy's stride-2 convolution 14.2-15.8 ms in kernorch's
    process (6.7-7.5 alone)."""
    time.sleep(QUIET_S)
    return float(np.median(time_repeats(_READY[i], repeats, min_repeat_s)))


def bench_kernels(model, options, threads: Sequence[int] = (1, 2), repeats: int = 5, rounds: int = 3) -> dict:
    """Every distinct contraction of `model`: kernorch vs ONNX Runtime at each thread count.

    kernorch's tile is chosen by `measure` (cached in the profile database); then both kernels of
    each contraction are timed in alternating blocks, `rounds` times, kernorch's and ORT's each in a
    process of its own with the same thread count; the medians of the blocks are compared."""
    from . import calibrate as cal
    from . import measure as meas
    from . import pipeline
    from .database import ProfileDB
    from .options import Machine
    from .workers import WorkerPool
    loaded = pipeline.load(model, options)
    cs = contractions(loaded.graph)
    machine = Machine.host()
    out = {"model": loaded.source, "machine": machine.to_json(), "threads": list(threads), "kernels": [],
           "repeats": repeats, "rounds": rounds,
           "method": "the fastest tile chosen by measure; then kernorch's kernel and ONNX Runtime's one-node model "
                     "timed in alternating blocks, each in a process of its own, medians of the blocks"}
    results: dict[int, dict] = {}
    for t in threads:
        opts = options.with_(threads=t, repeats=repeats)
        peak = cal.calibrate(t)
        jobs = {id(c): kernel_jobs(c, machine) for c in cs}
        with ProfileDB(opts.resolved_db()) as db:
            measured, _ = meas.measure([j for js in jobs.values() for j in js], db, opts, machine, label=f"{t} thread(s)")
        best = {}
        for c in cs:
            ok = [j for j in jobs[id(c)] if measured[j.ident].ok]
            if ok:
                best[id(c)] = min(ok, key=lambda j: measured[j.ident].median_ns)
        env = meas.worker_env(t)
        with WorkerPool(1, env) as kp, WorkerPool(1, env) as op:
            timed = [c for c in cs if id(c) in best]
            for pool, fn, arg in ((kp, _prepare_kernorch, [best[id(c)] for c in timed]),
                                  (op, _prepare_ort, [onnx_node_model(c) for c in timed])):
                r = pool.call(fn, (arg, t), 3600)
                if not r.ok:
                    raise RuntimeError(f"preparing the kernels failed: {r.error}")
            blocks: dict[int, tuple[list, list]] = {id(c): ([], []) for c in timed}
            for _ in range(rounds):
                for i, c in enumerate(timed):
                    for pool, side in ((kp, 0), (op, 1)):
                        r = pool.call(_time_block, (i, repeats, 0.02), 600)
                        if not r.ok:
                            raise RuntimeError(f"timing {c.label} failed: {r.error}")
                        blocks[id(c)][side].append(r.value)
        for c in cs:
            row = results.setdefault(id(c), {"kernel": c.label, "count": c.count, "gflop": c.flops / 1e9, "by_threads": {}})
            entry: dict = {"peak_gflops": peak["peak_gflops"]}
            if id(c) in best:
                k_s, o_s = (float(np.median(b)) for b in blocks[id(c)])
                j = best[id(c)]
                entry.update(kernorch_us=k_s * 1e6, kernorch_gflops=c.flops / k_s / 1e9, schedule=j.schedule,
                             ort_us=o_s * 1e6, ort_gflops=c.flops / o_s / 1e9, ratio=o_s / k_s,
                             of_peak=c.flops / k_s / 1e9 / peak["peak_gflops"],
                             tiles_us={x.schedule: measured[x.ident].median_ns / 1e3 for x in jobs[id(c)]
                                       if measured[x.ident].ok})
            row["by_threads"][str(t)] = entry
    out["kernels"] = [results[id(c)] for c in cs]
    out["summary"] = {}
    for t in threads:
        s = summary(out["kernels"], t)
        if s:  # no kernel timed at t: no entry
            out["summary"][str(t)] = s
    out["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    return out


def summary(kernels: list[dict], threads: int) -> dict:
    """Geomean and lowest ratio at `threads`, over all kernels and over the convolutions alone (the
    blocked-layout target is stated per model over its convolutions)."""
    out: dict = {}
    for prefix, pick in (("", lambda k: True), ("conv_", lambda k: k["kernel"].startswith("conv"))):
        ratios = [k["by_threads"][str(threads)]["ratio"] for k in kernels
                  if pick(k) and "ratio" in k["by_threads"][str(threads)]]
        if ratios:
            out.update({f"{prefix}geomean_ratio": float(math.exp(np.mean(np.log(ratios)))),
                        f"{prefix}min_ratio": float(min(ratios)), f"{prefix}kernels": len(ratios)})
    return out


def print_kernels(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    for t in r["threads"]:
        tab = Table(title=f"{r['model']}: contractions, {t} thread(s) (ratio > 1: kernorch faster)")
        for c in ("kernel", "n", "kernorch µs", "tile", "GFLOP/s", "ORT µs", "ORT GFLOP/s", "ratio", "of peak"):
            tab.add_column(c, justify="left" if c in ("kernel", "tile") else "right")
        for k in r["kernels"]:
            e = k["by_threads"][str(t)]
            nan = float("nan")
            tab.add_row(k["kernel"], str(k["count"]), f"{e.get('kernorch_us', nan):.1f}", e.get("schedule", "-"),
                        f"{e.get('kernorch_gflops', nan):.0f}", f"{e.get('ort_us', nan):.1f}",
                        f"{e.get('ort_gflops', nan):.0f}", f"{e.get('ratio', nan):.2f}", f"{e.get('of_peak', nan):.0%}")
        Console().print(tab)
        s = r["summary"].get(str(t))
        if s:
            print(f"{t} thread(s): geomean kernorch/ORT {s['geomean_ratio']:.2f}x over {s['kernels']} kernels, "
                  f"lowest {s['min_ratio']:.2f}x")
        if s and "conv_kernels" in s:
            print(f"  convolutions: geomean {s['conv_geomean_ratio']:.2f}x over {s['conv_kernels']}, "
                  f"lowest {s['conv_min_ratio']:.2f}x")
