"""Optimistic costs of kernels not measured yet: what lets the solver ask for measurements.

A fused candidate is measured only when the orchestration program, given an optimistic estimate of
its cost, would choose it (`pipeline.plan_model`'s loop: solve, measure the chosen kernels that
were estimated and their close alternatives, solve again, until the plan holds only measured
kernels). The estimate is the largest of three things a fused kernel cannot beat by much:

* its roofline floor on this machine: FLOPs at a GEMM rate above the measured peak, bytes (inputs,
  weights, outputs) at several times the measured memory bandwidth (kernels timed alone run from
  cache); a 3x3 stride-1 convolution counts the multiplications of its cheapest algorithm
  (Winograd F(4x4,3x3): a quarter of direct convolution's, kernels.winograd), since its kernel may
  run in that variant;
* the cheapest kernel call measured on this model (every call pays the launch and the pool);
* that call plus what its most expensive primitive measured alone takes beyond it, times a share:
  half for a memory-bound primitive (fusing saves its own memory traffic, at most about half of
  it), nine tenths for a contraction (it keeps its FLOPs; a fused epilogue may even cost it its
  micro-kernel tile). The launch is paid once either way.

An estimate below the truth costs one more measurement; one above it could hide a better plan,
so every term errs low.
"""
from __future__ import annotations

from . import primitives
from .ir import Graph
from .kernels import winograd

PEAK_MARGIN = 1.25     # FLOPs at 1.25x the measured GEMM peak
CACHE_FACTOR = 6.0     # bytes at 6x the measured copy bandwidth (data in L1/L2 when timed alone)
CALL_FACTOR = 0.9      # of the cheapest call measured on the model
MEMBER_FACTOR = 0.5    # of a memory-bound member's time alone beyond the call
LINEAR_FACTOR = 0.9    # of a contraction's time alone beyond the call


def fused_estimate_ns(kg: Graph, peak_gflops: float, bandwidth_gbs: float, alone_ns, cheapest_call_ns: int) -> int:
    """The optimistic cost of a fused kernel: `alone_ns` maps a prim name to its cost measured as a
    kernel of its own (absent: unknown), `cheapest_call_ns` is the shortest kernel measured."""
    call = CALL_FACTOR * cheapest_call_ns
    beyond = max((max(0.0, alone_ns[p.name] - call) * (LINEAR_FACTOR if primitives.kind(p.op) == "linear" else MEMBER_FACTOR)
                  for p in kg.prims if p.name in alone_ns), default=0.0)
    return int(max(kernel_floor_ns(kg, peak_gflops, bandwidth_gbs), call + beyond))


def kernel_floor_ns(kg: Graph, peak_gflops: float, bandwidth_gbs: float) -> int:
    """The roofline floor of a kernel graph (its prims, its inputs, weights and outputs)."""
    flops = 0.0
    for p in kg.prims:
        f = float(primitives.get(p.op).flops([kg.type_of(t) for t in p.inputs], p.type, p.a))
        flops += f / winograd.FEWEST_MULTIPLICATIONS if winograd.applies(kg, p) else f
    nbytes = sum(t.nbytes for _, t in kg.inputs) + sum(int(getattr(c, "nbytes", 0)) for c in kg.constants.values())
    nbytes += sum(kg.type_of(o).nbytes for o in kg.outputs)
    compute_ns = flops / (peak_gflops * PEAK_MARGIN)
    memory_ns = nbytes / (bandwidth_gbs * CACHE_FACTOR)
    return int(max(compute_ns, memory_ns))
