"""Every emitted model is checked against ONNX Runtime before it is returned.

Numerical policy: on the same random inputs, every output must be within `TOLERANCE` of ONNX
Runtime's, measured relative to that output's scale (max |reference| over its finite elements);
NaN and infinities must sit at the same positions with the same sign. Kernels are checked one by
one against the numpy reference of their primitives before their time counts (kernorch.measure);
this is the end-to-end check. On a mismatch, `bisect` runs each plan kernel alone on the
reference executor's intermediates and names the first one that disagrees.
"""
from __future__ import annotations

import numpy as np

from . import executor
from .ir import KernorchError

#: max error relative to each output's scale (reduction orders differ from ONNX Runtime's)
TOLERANCE = 1e-3


def loadable(model, threads: int) -> None:
    """Raise now (a KernorchError naming ONNX Runtime's reason) where ONNX Runtime cannot load
    `model`: `verify` compares with it at the end of every optimize, after the measuring."""
    executor.ort_session(model, threads)


def verify(compiled, model, options, seed: int | None = None, tol: float = TOLERANCE) -> dict:
    """Compare the compiled model with ONNX Runtime; on a mismatch raise, naming the first diverging kernel."""
    seed = options.seed if seed is None else seed
    graphs = compiled.sample_graphs()  # a model over a range: at its ends and middle
    all_feeds = [executor.random_feeds(g, seed) for g in graphs]
    sess = executor.ort_session(model, options.threads)
    names = [o.name for o in sess.get_outputs()]
    refs = [dict(zip(names, sess.run(names, feeds))) for feeds in all_feeds]
    del sess  # its thread pool must not stay beside the executable's
    result: dict = {}
    for graph, feeds, ref in zip(graphs, all_feeds, refs):
        got = compiled.run(feeds)
        errors = {n: executor.max_error(np.asarray(ref[n]), got[n]) for n in compiled.output_names}
        worst = max((e["rel"] for e in errors.values()), default=0.0)
        if not result or worst > result["max_rel_error"]:
            result = {"ok": worst <= tol, "tolerance": tol, "max_rel_error": worst, "outputs": errors}
        if worst > tol:
            bad = [n for n, e in errors.items() if e["rel"] > tol]
            k = bisect(compiled, feeds, tol, graph)
            shape = ", ".join(f"{n} {tuple(x.shape)}" for n, x in feeds.items())
            raise KernorchError(f"the optimized model differs from ONNX Runtime on output(s) {bad} at {shape} "
                                f"(max error {worst:.3g} of the output scale, tolerance {tol:g}); first diverging "
                                f"kernel: {k}")
    result["shapes"] = [{n: list(x.shape) for n, x in feeds.items()} for feeds in all_feeds]
    return result


def bisect(compiled, feeds, tol: float, graph=None) -> str | None:
    """Run each plan kernel alone on reference intermediates; describe the first that disagrees.
    `graph`: the model's graph at the feeds' shapes (a model over a range: bound at that length).
    Over a range each kernel is built as the executable has it, over the symbols up to its bounds,
    and run at the feeds' values: a kernel wrong only at some lengths (a symbolic batch tiled as
    rows, wrong at batch=3) is right when built for that length alone."""
    from .backends import registry
    from .backends import tvm as tb
    from .backends.tvm.relax import bucket_bounds, kernel_module
    from .kernels import pack_args, unpack_outputs
    from .layouts import kernel_io
    from .measure import written_shapes
    graph, plan = graph or compiled.graph, compiled.plan_for(feeds)
    values = executor.run(graph, feeds, keep_all=True)
    target = tb.make_target(compiled.threads, compiled.machine)
    for k in plan.kernels:
        io = kernel_io(graph, k)
        args = [values[t] if t in values else graph.constants[t] for t in io.inputs]
        if not registry.native(k.impl):
            outs = registry.python_kernel(k.impl, io.graph, io.graph.prims, io.inputs, io.outputs)(*args)
        else:
            args = pack_args(io.graph, io.inputs, k.schedule, args)
            if compiled.ranges:
                mod = kernel_module(compiled.graph, k, target, plan.meta.get("tune_dir"), bucket_bounds(plan, k.bucket))
                outs = tb.build(mod, target)(*args, out_shapes=written_shapes(io.graph, io.outputs, k.schedule))
            else:
                outs = tb.build(kernel_module(graph, k, target, plan.meta.get("tune_dir")), target)(*args)
            outs = unpack_outputs(io.graph, io.outputs, k.schedule, outs)
        for t, o in zip(k.outputs, outs):
            if executor.max_error(values[t], np.asarray(o))["rel"] > tol:
                what = "+".join(graph.by_name[m].op for m in k.members) or f"layout {k.schedule}"
                return f"{k.id} ({k.impl} {k.schedule}: {what}) output {t}"
    return None
