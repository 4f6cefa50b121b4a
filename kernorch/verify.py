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


def verify(compiled, model, options, seed: int | None = None, tol: float = TOLERANCE) -> dict:
    """Compare the compiled model with ONNX Runtime; on a mismatch raise, naming the first diverging kernel."""
    seed = options.seed if seed is None else seed
    feeds = executor.random_feeds(compiled.graph, seed)
    sess = executor.ort_session(model, options.threads)
    names = [o.name for o in sess.get_outputs()]
    ref = dict(zip(names, sess.run(names, feeds)))
    del sess  # its thread pool must not stay beside the executable's
    got = compiled.run(feeds)
    errors = {n: executor.max_error(np.asarray(ref[n]), got[n]) for n in compiled.output_names}
    worst = max((e["rel"] for e in errors.values()), default=0.0)
    result = {"ok": worst <= tol, "tolerance": tol, "max_rel_error": worst, "outputs": errors}
    if not result["ok"]:
        bad = [n for n, e in errors.items() if e["rel"] > tol]
        k = bisect(compiled, feeds, tol)
        raise KernorchError(f"the optimized model differs from ONNX Runtime on output(s) {bad} (max error "
                            f"{worst:.3g} of the output scale, tolerance {tol:g}); first diverging kernel: {k}")
    return result


def bisect(compiled, feeds, tol: float) -> str | None:
    """Run each plan kernel alone on reference intermediates; describe the first that disagrees."""
    from .backends import registry
    from .backends import tvm as tb
    from .backends.tvm.relax import kernel_module
    from .kernels import pack_args, unpack_outputs
    from .layouts import kernel_io
    graph, plan = compiled.graph, compiled.plan
    values = executor.run(graph, feeds, keep_all=True)
    target = tb.make_target(compiled.threads, compiled.machine)
    for k in plan.kernels:
        io = kernel_io(graph, k)
        args = [values[t] if t in values else graph.constants[t] for t in io.inputs]
        if not registry.native(k.impl):
            outs = registry.python_kernel(k.impl, io.graph, io.graph.prims, io.inputs, io.outputs)(*args)
        else:
            args = pack_args(io.graph, io.inputs, k.schedule, args)
            outs = tb.build(kernel_module(graph, k, target, plan.meta.get("tune_dir")), target)(*args)
            outs = unpack_outputs(io.graph, io.outputs, k.schedule, outs)
        for t, o in zip(k.outputs, outs):
            if executor.max_error(values[t], np.asarray(o))["rel"] > tol:
                what = "+".join(graph.by_name[m].op for m in k.members) or f"layout {k.schedule}"
                return f"{k.id} ({k.impl} {k.schedule}: {what}) output {t}"
    return None
