"""Features of a fused kernel for the learned cost model (kernorch.costmodel): pure Python, no TVM.

A fused kernel is described relative to what is always measured before it: each of its primitives
timed as a kernel of its own ("alone"). The model learns how a fusion's time relates to the sum of
its members alone, from the fusion's structure (primitive kinds, the bytes its intermediates no
longer move, its roofline floor), its schedule (micro-kernel tile, blocked layout) and the machine
(vector width and registers, caches, measured GEMM peak and bandwidth, threads). Times enter as
logarithms of ratios, so a model fitted on one machine speaks in units that carry to another.

`base_ns` is the unit of the label: the larger of the members' sum alone and the cheapest kernel
call measured on the model. The label is log(measured / base).
"""
from __future__ import annotations

import math
from typing import Mapping

from . import primitives
from .ir import Graph
from .kernels import Tile, Winograd
from .kernels.variants import split

KINDS = primitives.KINDS


def _log(x: float) -> float:
    return math.log(max(float(x), 1e-9))


def schedule_features(schedule: str) -> dict[str, float]:
    """The schedule string as numbers: blocked layout, micro-kernel tile rows x columns, packed
    weights, rows-outside variant. A Winograd variant ("w4t14x32") shows as its GEMMs' packed tile:
    its epilogue is fused the way a tile's is (written back once per output tile), and the shipped
    model was trained before Winograd variants existed (a feature of their own needs a retrained
    model)."""
    block, inner = split(schedule)
    wino = Winograd.parse(inner)
    tile = Tile.parse(inner)  # (a tile with row copies shows as its own row count)
    rows, cols, flags = (tile.mr, tile.nb, ("p" if tile.pack else "") + ("r" if tile.rows_outer else "")) if tile \
        else (0, 0, "")
    if wino is not None:
        rows, cols, flags = wino.mr, wino.nb, "p"
    return {"blocked": float(block or 0), "tile_rows": float(rows), "tile_cols": float(cols),
            "packed": float("p" in flags), "rows_outside": float("r" in flags), "default": float(inner == "default")}


def machine_features(machine, calibration: Mapping, threads: int) -> dict[str, float]:
    return {"simd_bits": float(machine.simd_bits), "vector_registers": float(machine.vector_registers),
            "log_l1d": _log(machine.l1d_kib * 1024), "log_l2": _log(machine.l2_kib * 1024),
            "log_l3": _log(machine.l3_kib * 1024), "threads": float(threads),
            "log_peak": _log(calibration["peak_gflops"]), "log_bandwidth": _log(calibration["bandwidth_gbs"])}


def base_ns(kg: Graph, alone: Mapping[str, int], cheapest_call_ns: int) -> float:
    return float(max(sum(alone.get(p.name, 0) for p in kg.prims), cheapest_call_ns, 1))


def kernel_features(kg: Graph, schedule: str, alone: Mapping[str, int], cheapest_call_ns: int,
                    machine, calibration: Mapping, threads: int) -> dict[str, float]:
    """Every feature of one fused kernel (see the module docstring). `alone` maps a prim name to its
    time measured as a kernel of its own (absent: not measured)."""
    base = base_ns(kg, alone, cheapest_call_ns)
    kinds = {k: 0.0 for k in KINDS}
    flops = 0.0
    members = {p.name for p in kg.prims}
    internal = 0  # bytes of intermediates that the fusion keeps out of memory
    share = {k: 0.0 for k in KINDS}
    linear_alone = 0.0
    prologue = prologue_alone = 0.0  # members read by a contraction member: inlined, recomputed per use
    for p in kg.prims:
        kind = primitives.kind(p.op)
        kinds[kind] += 1
        share[kind] += alone.get(p.name, 0) / base
        if kind == "linear":
            for t in p.inputs:
                if t in members:
                    prologue += 1
                    prologue_alone += alone.get(t, 0) / base
        flops += float(primitives.get(p.op).flops([kg.type_of(t) for t in p.inputs], p.type, p.a))
        if p.name not in kg.outputs:
            internal += p.type.nbytes
        if kind == "linear":
            linear_alone += alone.get(p.name, 0)
    recompute, reuse_max = _recompute(kg, alone, base)
    external = sum(t.nbytes for _, t in kg.inputs) + sum(int(getattr(c, "nbytes", 0)) for c in kg.constants.values())
    external += sum(kg.type_of(o).nbytes for o in kg.outputs)
    largest = max([t.nbytes for _, t in kg.inputs] + [p.type.nbytes for p in kg.prims] + [1])
    times = [alone[p.name] for p in kg.prims if p.name in alone]
    peak = calibration["peak_gflops"]
    bandwidth = calibration["bandwidth_gbs"]
    out = {f"n_{k}": v for k, v in kinds.items()}
    out.update({f"share_{k}": v for k, v in share.items()})
    out.update({
        "n_prims": float(len(kg.prims)), "n_inputs": float(len(kg.inputs)), "n_outputs": float(len(kg.outputs)),
        "n_constants": float(len(kg.constants)),
        "missing_alone": float(sum(p.name not in alone for p in kg.prims)),
        "log_base": _log(base),
        "max_alone_share": (max(times) / base) if times else 0.0,
        "linear_alone_share": linear_alone / base,
        "call_share": cheapest_call_ns / base,
        "log_flops": _log(1 + flops), "log_external": _log(1 + external), "log_internal": _log(1 + internal),
        "internal_share": internal / max(1, internal + external),
        "log_compute_floor": _log(flops / peak) - _log(base),           # ns at the measured peak, relative
        "log_memory_floor": _log(external / bandwidth) - _log(base),    # ns at the measured bandwidth, relative
        "largest_vs_l2": largest / (machine.l2_kib * 1024),
        "largest_vs_l1": largest / (machine.l1d_kib * 1024),
        "consumers_outside": float(sum(1 for p in kg.prims if p.name in kg.outputs)),
        "inputs_from_members": float(sum(1 for p in kg.prims for t in p.inputs if t in members)),
        "log_recompute": math.log1p(recompute), "log_reuse_max": math.log1p(reuse_max),
        "linear_prologue": prologue, "linear_prologue_share": prologue_alone,
    })
    out.update(schedule_features(schedule))
    out.update(machine_features(machine, calibration, threads))
    return out


def _names() -> tuple[str, ...]:
    """The order of the feature vector (the cost model stores it and refuses another)."""
    names = [f"n_{k}" for k in KINDS] + [f"share_{k}" for k in KINDS]
    names += ["n_prims", "n_inputs", "n_outputs", "n_constants", "missing_alone", "log_base", "max_alone_share",
              "linear_alone_share", "call_share", "log_flops", "log_external", "log_internal", "internal_share",
              "log_compute_floor", "log_memory_floor", "largest_vs_l2", "largest_vs_l1", "consumers_outside",
              "inputs_from_members", "log_recompute", "log_reuse_max", "linear_prologue", "linear_prologue_share"]
    names += ["blocked", "tile_rows", "tile_cols", "packed", "rows_outside", "default"]
    names += ["simd_bits", "vector_registers", "log_l1d", "log_l2", "log_l3", "threads", "log_peak", "log_bandwidth"]
    return tuple(names)


def _recompute(kg: Graph, alone: Mapping[str, int], base: float) -> tuple[float, float]:
    """What inlining costs: an injective member (elementwise, broadcast, layout) is computed again
    for every element its consumers in the kernel read of it (a 5x5 pooling window reads each
    element 25 times, a matmul reads each row of A once per output column). Returns (the members'
    time alone times their extra reads, relative to `base`; the largest reuse factor)."""
    members = kg.by_name
    total = worst = 0.0
    for p in kg.prims:
        if primitives.kind(p.op) not in ("elementwise", "broadcast", "layout"):
            continue
        for q in kg.consumers.get(p.name, []):
            if q.name not in members:
                continue
            out = max(1, q.type.size)
            reads = 1.0  # per output element: 1 for pointwise consumers
            if primitives.kind(q.op) in ("reduce", "linear"):
                flops = float(primitives.get(q.op).flops([kg.type_of(t) for t in q.inputs], q.type, q.a))
                reads = max(1.0, flops / out / (2.0 if primitives.kind(q.op) == "linear" else 1.0))
            reuse = out * reads / max(1, p.type.size)
            worst = max(worst, reuse)
            total += alone.get(p.name, 0) / base * max(0.0, reuse - 1.0)
    return total, worst


FEATURES: tuple[str, ...] = _names()


def vector(features: Mapping[str, float]) -> list[float]:
    """The features in the fixed order of FEATURES (a missing one is an error: the model would be
    fed a shifted row)."""
    return [float(features[n]) for n in FEATURES]
