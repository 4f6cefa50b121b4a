"""kernorch: optimal kernel orchestration for ONNX models.

    compiled = kernorch.optimize("model.onnx", threads=2)
    outputs = compiled.run({"input": x})
    compiled.save("out/"); kernorch.load("out/")
"""
import os as _os

# Two thread pools share the cores in an emitted model: TVM's (generated kernels) and OpenBLAS's
# (library kernels). Both spin after a parallel region by default, and on a 2-core machine the
# spinning pool steals the cores the other one needs (kernels measured 20-50x slower in context
# than alone). Let idle workers sleep quickly; the user's own settings win. OpenBLAS reads its
# variable when numpy is first imported, so this only helps when kernorch is imported first.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
_os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

from .ir import KernorchError  # noqa: E402

__version__ = "0.1.0"


def optimize(model, target=None, *, runs: int = 20, **options):
    """Optimize an ONNX model (path or ModelProto) for this CPU; returns a verified CompiledModel.

    `options` are fields of `kernorch.options.Options` (threads, shapes as a dict, db_path, ...).
    `target` is a `Machine` (default: this host); only the host CPU can be measured today.
    """
    from .options import Machine, Options
    from . import pipeline
    if "shapes" in options and isinstance(options["shapes"], dict):
        options["shapes"] = tuple((k, tuple(v)) for k, v in options["shapes"].items())
    opts = Options().with_(**options)
    if target is not None and target != Machine.host():
        raise KernorchError("kernorch measures kernels on the machine it runs on: optimize on the target itself")
    compiled, _run = pipeline.optimize(model, opts, runs=runs)
    return compiled


def load(outdir, threads=None):
    """Load a model saved by `CompiledModel.save` (no re-optimization)."""
    from .emit import load as _load
    return _load(outdir, threads)


__all__ = ["KernorchError", "__version__", "optimize", "load"]
