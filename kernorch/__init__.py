"""kernorch: optimal kernel orchestration for ONNX models.

    compiled = kernorch.optimize("model.onnx", threads=2)
    outputs = compiled.run({"input": x})
    compiled.save("out/"); kernorch.load("out/")

Importing kernorch changes nothing in the environment: the thread count is set where a model is
built or loaded (kernorch.backends.tvm.set_threads).
"""
from .ir import KernorchError

__version__ = "0.2.0"


def optimize(model, target=None, *, runs: int = 20, **options):
    """Optimize an ONNX model (path or ModelProto) for this CPU; returns a verified CompiledModel.

    `options` are fields of `kernorch.options.Options` (threads, shapes as a dict, db_path, ranges as
    a dict such as {"seq": (1, 512)} for one executable over a symbolic dimension, buckets such as
    [8, 64] for a plan per bucket of that range with dispatch at run time, or "samples" for a plan
    per length the range is timed at, or "one" for one plan over the whole range, ...).
    `target` is a `Machine` (default: this host); only the host CPU can be measured today.
    """
    from .options import Machine, Options
    from . import pipeline
    if "shapes" in options and isinstance(options["shapes"], dict):
        options["shapes"] = tuple((k, tuple(v)) for k, v in options["shapes"].items())
    if "ranges" in options and isinstance(options["ranges"], dict):  # {"seq": (1, 512)}: one executable over the range
        options["ranges"] = tuple((k, int(lo), int(hi)) for k, (lo, hi) in options["ranges"].items())
    if "lengths" in options:
        options["lengths"] = tuple(int(v) for v in options["lengths"])
    if options.get("buckets") == "samples":  # a plan per length the range is timed at, dispatched at run time
        del options["buckets"]
        options["sample_plans"] = True
    elif options.get("buckets") == "one":  # one plan for the whole range
        del options["buckets"]
        options["sample_gain"] = 0.0
    elif "buckets" in options:  # [8, 64]: a plan per bucket of the range (1..8, 9..64, 65..hi), dispatched at run time
        options["bucket_edges"] = tuple(int(v) for v in options.pop("buckets"))
    opts = Options().with_(**options)
    if target is not None and target != Machine.host():
        raise KernorchError("kernorch measures kernels on the machine it runs on: optimize on the target itself")
    compiled, _ = pipeline.optimize(model, opts, runs=runs)
    return compiled


def load(outdir, threads=None):
    """Load a model saved by `CompiledModel.save` (no re-optimization)."""
    from .runtime import load as _load
    return _load(outdir, threads)


__all__ = ["KernorchError", "__version__", "optimize", "load"]
